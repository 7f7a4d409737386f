#include "psld/c_api.h"

#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "psld/worker.h"

struct psld_worker {
  std::unique_ptr<psld::Worker> w;
  std::string gpu_path;  // what psld_worker_gpu_path hands out
};
struct psld_request {
  psld::Request r;
};

namespace {

thread_local std::string g_last_error;

int fail(const psld::Status& s) {
  g_last_error = s.to_string();
  return static_cast<int>(s.code());
}

int fail_args(const char* what) {
  return fail(psld::InvalidArgument(std::string(what) + " must not be NULL"));
}

std::chrono::milliseconds to_timeout(int64_t ms) {
  return ms < 0 ? std::chrono::hours(24 * 365) : std::chrono::milliseconds(ms);
}

// Nothing may unwind into a C caller: an exception that reaches the boundary
// (an allocation that failed, a thread that could not start) becomes a code
// and psld_last_error's message.
template <typename Fn>
int guarded(Fn fn) noexcept {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return fail(psld::ResourceExhausted("out of memory"));
  } catch (const std::exception& e) {
    return fail(psld::Internal(std::string("unexpected exception: ") + e.what()));
  } catch (...) {
    return fail(psld::Internal("unexpected exception"));
  }
}

template <typename Fn>
int submit(psld_worker* w, uint32_t tensor, psld_request** out, Fn fn) {
  if (w == nullptr || out == nullptr) return fail_args("worker and out");
  return guarded([&] {
    psld::Result<psld::Request> r = fn(*w->w, psld::TensorHandle{tensor});
    if (!r.ok()) return fail(r.status());
    *out = new psld_request{*r};
    return 0;
  });
}

template <typename Fn>
int submit_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out, Fn fn) {
  if (w == nullptr || (n > 0 && (tensors == nullptr || out == nullptr))) {
    return fail_args("worker, tensors and out");
  }
  return guarded([&] {
    std::vector<psld::TensorHandle> handles(n);
    for (size_t i = 0; i < n; ++i)
      handles[i] = psld::TensorHandle{tensors[i]};
    psld::Result<std::vector<psld::Request>> r =
        fn(*w->w, std::span<const psld::TensorHandle>(handles));
    if (!r.ok()) return fail(r.status());
    std::vector<std::unique_ptr<psld_request>> made;
    made.reserve(r->size());
    for (const auto& req : *r)
      made.push_back(std::make_unique<psld_request>(psld_request{req}));
    for (size_t i = 0; i < made.size(); ++i)
      out[i] = made[i].release();
    return 0;
  });
}

// The C codes mirror psld::StatusCode and psld::DType.
#define PSLD_SAME_CODE(c, cpp) \
  static_assert(static_cast<int>(c) == static_cast<int>(psld::StatusCode::cpp), #c)
PSLD_SAME_CODE(PSLD_OK, kOk);
PSLD_SAME_CODE(PSLD_INVALID_ARGUMENT, kInvalidArgument);
PSLD_SAME_CODE(PSLD_NOT_FOUND, kNotFound);
PSLD_SAME_CODE(PSLD_ALREADY_EXISTS, kAlreadyExists);
PSLD_SAME_CODE(PSLD_OUT_OF_RANGE, kOutOfRange);
PSLD_SAME_CODE(PSLD_FAILED_PRECONDITION, kFailedPrecondition);
PSLD_SAME_CODE(PSLD_RESOURCE_EXHAUSTED, kResourceExhausted);
PSLD_SAME_CODE(PSLD_UNAVAILABLE, kUnavailable);
PSLD_SAME_CODE(PSLD_TIMEOUT, kTimeout);
PSLD_SAME_CODE(PSLD_ABORTED, kAborted);
PSLD_SAME_CODE(PSLD_DATA_LOSS, kDataLoss);
PSLD_SAME_CODE(PSLD_MOVED, kMoved);
PSLD_SAME_CODE(PSLD_UNIMPLEMENTED, kUnimplemented);
PSLD_SAME_CODE(PSLD_INTERNAL, kInternal);
#undef PSLD_SAME_CODE
static_assert(PSLD_FLOAT32 == static_cast<int>(psld::DType::kFloat32));
static_assert(PSLD_FLOAT16 == static_cast<int>(psld::DType::kFloat16));
static_assert(PSLD_BFLOAT16 == static_cast<int>(psld::DType::kBFloat16));

}  // namespace

extern "C" {

const char* psld_version(void) {
  return PSLD_VERSION_STRING;
}

const char* psld_last_error(void) {
  return g_last_error.c_str();
}

int psld_worker_join(int argc, const char* const* argv, psld_worker** out) {
  if (out == nullptr) return fail_args("out");
  return guarded([&] {
    psld::ConfigSources sources;
    for (int i = 0; i < argc && argv != nullptr; ++i)
      sources.args.emplace_back(argv[i]);
    auto config = psld::load_config(sources);
    if (!config.ok()) return fail(config.status());
    auto w = psld::Worker::join(*config);
    if (!w.ok()) return fail(w.status());
    auto handle = std::make_unique<psld_worker>(psld_worker{std::move(w).value(), {}});
    handle->gpu_path = handle->w->gpu_path();
    *out = handle.release();
    return 0;
  });
}

int psld_worker_rank(const psld_worker* w, uint32_t* rank, uint32_t* num_workers) {
  if (w == nullptr) return fail_args("worker");
  if (rank) *rank = w->w->rank();
  if (num_workers) *num_workers = w->w->num_workers();
  return 0;
}

int psld_allocate(psld_worker* w, size_t bytes, void** out) {
  if (w == nullptr || out == nullptr) return fail_args("worker and out");
  return guarded([&] {
    auto p = w->w->allocate(bytes);
    if (!p.ok()) return fail(p.status());
    *out = *p;
    return 0;
  });
}

const char* psld_worker_gpu_path(const psld_worker* w) {
  if (w == nullptr) {
    fail_args("worker");
    return nullptr;
  }
  return w->gpu_path.c_str();
}

int psld_register_tensor(psld_worker* w, const char* name, int dtype, size_t bytes, void* data,
                         const void* init, uint32_t* tensor) {
  if (w == nullptr || name == nullptr || tensor == nullptr)
    return fail_args("worker, name and tensor");
  if (dtype != PSLD_FLOAT32 && dtype != PSLD_FLOAT16 && dtype != PSLD_BFLOAT16) {
    return fail(psld::InvalidArgument(
        "dtype " + std::to_string(dtype) +
        " is not one of PSLD_FLOAT32 (1), PSLD_FLOAT16 (2), PSLD_BFLOAT16 (3)"));
  }
  return guarded([&] {
    auto h = w->w->register_tensor(name, static_cast<psld::DType>(dtype), bytes, data, init);
    if (!h.ok()) return fail(h.status());
    *tensor = h->index;
    return 0;
  });
}

int psld_push(psld_worker* w, uint32_t tensor, psld_request** out) {
  return submit(w, tensor, out, [](psld::Worker& k, psld::TensorHandle t) { return k.push(t); });
}
int psld_pull(psld_worker* w, uint32_t tensor, psld_request** out) {
  return submit(w, tensor, out, [](psld::Worker& k, psld::TensorHandle t) { return k.pull(t); });
}
int psld_push_pull(psld_worker* w, uint32_t tensor, psld_request** out) {
  return submit(w, tensor, out,
                [](psld::Worker& k, psld::TensorHandle t) { return k.push_pull(t); });
}

int psld_push_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out) {
  return submit_many(
      w, tensors, n, out,
      [](psld::Worker& k, std::span<const psld::TensorHandle> t) { return k.push(t); });
}
int psld_pull_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out) {
  return submit_many(
      w, tensors, n, out,
      [](psld::Worker& k, std::span<const psld::TensorHandle> t) { return k.pull(t); });
}
int psld_push_pull_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out) {
  return submit_many(
      w, tensors, n, out,
      [](psld::Worker& k, std::span<const psld::TensorHandle> t) { return k.push_pull(t); });
}

int psld_request_wait(psld_request* r, int64_t timeout_ms) {
  if (r == nullptr) return fail_args("request");
  return guarded([&] {
    psld::Status s = r->r.wait(to_timeout(timeout_ms));
    return s.ok() ? 0 : fail(s);
  });
}

int psld_request_test(const psld_request* r) {
  return r == nullptr || r->r.test() ? 1 : 0;
}

void psld_request_free(psld_request* r) {
  delete r;
}

int psld_barrier(psld_worker* w, int64_t timeout_ms) {
  if (w == nullptr) return fail_args("worker");
  return guarded([&] {
    psld::Status s = w->w->barrier(to_timeout(timeout_ms));
    return s.ok() ? 0 : fail(s);
  });
}

int psld_set_learning_rate(psld_worker* w, double lr) {
  if (w == nullptr) return fail_args("worker");
  psld::Status s = w->w->set_learning_rate(lr);
  return s.ok() ? 0 : fail(s);
}

int psld_tensor_round(const psld_worker* w, uint32_t tensor, uint64_t* round) {
  if (w == nullptr || round == nullptr) return fail_args("worker and round");
  auto r = w->w->round(psld::TensorHandle{tensor});
  if (!r.ok()) return fail(r.status());
  *round = *r;
  return 0;
}

int psld_worker_shutdown(psld_worker* w) {
  if (w == nullptr) return 0;
  return guarded([&] {
    std::unique_ptr<psld_worker> owned(w);
    psld::Status s = owned->w->shutdown();
    return s.ok() ? 0 : fail(s);
  });
}

}  // extern "C"
