// psld._psld — the nanobind module under the Python package psld.
//
// A thin layer over the public C++ API (include/psld/): every call keeps
// psld's semantics and messages. What Python adds is decided in
// python/psld/__init__.py; what must be native is here:
//
//   - tensors are registered by their own memory (DLPack or the buffer
//     protocol through nb::ndarray, never converted), so a pull writes into
//     the numpy array or torch tensor the caller holds;
//   - the GIL is released wherever psld may block (join, register, submit,
//     wait, barrier, shutdown), and waits run in slices so that Ctrl-C
//     interrupts them;
//   - a failed Status becomes the Python exception of its code (the classes
//     live in psld/__init__.py and are handed over by _set_error_classes).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "psld/c_api.h"
#include "psld/config.h"
#include "psld/coordinator.h"
#include "psld/server.h"
#include "psld/status.h"
#include "psld/worker.h"

namespace nb = nanobind;

namespace {

// A failed Status on its way to Python.
struct StatusError {
  psld::StatusCode code;
  std::string message;
};

// The exception class of each status code, by name; set once at import.
nb::dict& error_classes() {
  static nb::dict* classes = new nb::dict();  // never freed: lives as long as the interpreter
  return *classes;
}

[[noreturn]] void throw_status(const psld::Status& status) {
  throw StatusError{status.code(), status.message()};
}

void check(const psld::Status& status) {
  if (!status.ok()) throw_status(status);
}

template <typename T>
T take(psld::Result<T> result) {
  if (!result.ok()) throw_status(result.status());
  return std::move(result).value();
}

using Clock = std::chrono::steady_clock;

// A timeout from Python, in seconds, as a duration (capped at 1e9 s); None
// stays none. A negative or NaN one is InvalidArgument.
std::optional<Clock::duration> timeout_of(std::optional<double> timeout_s) {
  if (!timeout_s) return std::nullopt;
  if (!(*timeout_s >= 0)) {
    throw_status(psld::InvalidArgument("timeout must be a number of seconds >= 0, or None"));
  }
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(*timeout_s, 1e9)));
}

// How long one slice of a blocking wait lasts before Python's signal
// handlers get to run (Ctrl-C raises KeyboardInterrupt within this).
constexpr std::chrono::milliseconds kWaitSlice{100};

// Runs `wait(slice)` with the GIL released until it returns anything but
// Timeout or `timeout_s` (None: no limit) has passed; then Timeout saying
// "`what` after N s" (the slice's own message would name 100 ms).
template <typename WaitFn>
psld::Status wait_in_slices(std::optional<double> timeout_s, const char* what, WaitFn wait) {
  const std::optional<Clock::duration> timeout = timeout_of(timeout_s);
  const bool bounded = timeout.has_value();
  const auto deadline = bounded ? Clock::now() + *timeout : Clock::time_point::max();
  for (;;) {
    auto slice = kWaitSlice;
    if (bounded) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(std::max(deadline - Clock::now(), {}));
      slice = std::min(slice, left);
    }
    psld::Status status;
    {
      nb::gil_scoped_release release;
      status = wait(slice);
    }
    if (status.code() != psld::StatusCode::kTimeout) return status;
    if (bounded && Clock::now() >= deadline) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", *timeout_s);
      return psld::Timeout(std::string(what) + " after " + seconds + " s");
    }
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  }
}

// --- configuration --------------------------------------------------------

psld::Config load_config(const std::vector<std::string>& args) {
  psld::ConfigSources sources;
  sources.args = args;
  sources.args_on_command_line = false;  // keyword arguments, not a command line
  return take(psld::load_config(sources));
}

// --- tensors --------------------------------------------------------------

const char* dlpack_type_name(nb::dlpack::dtype t) {
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int:
      return t.bits == 8 ? "int8" : t.bits == 16 ? "int16" : t.bits == 32 ? "int32" : "int64";
    case nb::dlpack::dtype_code::UInt:
      return t.bits == 8 ? "uint8" : t.bits == 16 ? "uint16" : t.bits == 32 ? "uint32" : "uint64";
    case nb::dlpack::dtype_code::Float:
      return t.bits == 16 ? "float16" : t.bits == 32 ? "float32" : "float64";
    case nb::dlpack::dtype_code::Bfloat:
      return "bfloat16";
    case nb::dlpack::dtype_code::Complex:
      return "complex";
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      return "an unknown type";
  }
}

// Only the three types servers aggregate.
std::optional<psld::DType> psld_dtype(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 32) {
    return psld::DType::kFloat32;
  }
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) {
    return psld::DType::kFloat16;
  }
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) {
    return psld::DType::kBFloat16;
  }
  return std::nullopt;
}

// C order with no gaps: the memory psld reads and writes is exactly the
// tensor's elements. Dimensions of size 1 may have any stride.
bool c_contiguous(const nb::ndarray<>& a) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

bool device_memory_psld_takes(int32_t device_type) {
  switch (device_type) {
    case nb::device::cpu::value:
    case nb::device::cuda::value:
    case nb::device::cuda_host::value:
    case nb::device::cuda_managed::value:
      return true;
    default:
      return false;
  }
}

// --- the classes ----------------------------------------------------------

class PyRequest {
 public:
  explicit PyRequest(psld::Request request) : request_(std::move(request)) {}

  void wait(std::optional<double> timeout_s) {
    check(wait_in_slices(timeout_s, "the request is still in flight",
                         [&](std::chrono::milliseconds slice) { return request_.wait(slice); }));
  }
  bool done() const { return request_.test(); }

 private:
  psld::Request request_;
};

class PyWorker {
 public:
  explicit PyWorker(const psld::Config& config) {
    nb::gil_scoped_release release;
    worker_ = take(psld::Worker::join(config));
  }

  uint32_t rank() const { return get().rank(); }
  uint32_t num_workers() const { return get().num_workers(); }
  std::string gpu_path() const { return get().gpu_path(); }

  // `bytes` of zero-filled transport memory, as a uint8 numpy array whose
  // owner is this Worker's Python object (so the memory outlives the array).
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> allocate(nb::handle self, size_t bytes) {
    void* data = nullptr;
    {
      nb::gil_scoped_release release;
      data = take(get().allocate(bytes));
    }
    const size_t shape[1] = {bytes};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(data, 1, shape, self);
  }

  uint32_t register_tensor(const std::string& name, const nb::ndarray<>& array, bool init) {
    const auto dtype = psld_dtype(array.dtype());
    if (!dtype) {
      throw_status(
          psld::InvalidArgument("tensor '" + name + "': dtype " + dlpack_type_name(array.dtype()) +
                                " is not supported; psld carries float32, float16 and bfloat16"));
    }
    if (!device_memory_psld_takes(array.device_type())) {
      throw_status(psld::InvalidArgument("tensor '" + name +
                                         "': its memory is on a device psld does not know "
                                         "(DLPack device type " +
                                         std::to_string(array.device_type()) +
                                         "); psld takes host and CUDA memory"));
    }
    if (!c_contiguous(array)) {
      throw_status(psld::InvalidArgument(
          "tensor '" + name +
          "' is not contiguous: psld reads and writes the tensor's own memory, so it needs "
          "a C-contiguous tensor (register a contiguous one, e.g. .contiguous(), and use it)"));
    }
    void* data = array.data();
    const size_t bytes = array.nbytes();
    psld::TensorHandle handle;
    {
      nb::gil_scoped_release release;
      handle = take(get().register_tensor(name, *dtype, bytes, data, init ? data : nullptr));
    }
    return handle.index;
  }

  PyRequest push(uint32_t tensor) { return submit(&psld::Worker::push, tensor); }
  PyRequest pull(uint32_t tensor) { return submit(&psld::Worker::pull, tensor); }
  PyRequest push_pull(uint32_t tensor) { return submit(&psld::Worker::push_pull, tensor); }
  // Many tensors at once (Worker::push_pull of a span): their small chunks
  // travel in batches.
  std::vector<PyRequest> push_many(const std::vector<uint32_t>& tensors) {
    return submit_many(&psld::Worker::push, tensors);
  }
  std::vector<PyRequest> pull_many(const std::vector<uint32_t>& tensors) {
    return submit_many(&psld::Worker::pull, tensors);
  }
  std::vector<PyRequest> push_pull_many(const std::vector<uint32_t>& tensors) {
    return submit_many(&psld::Worker::push_pull, tensors);
  }

  void barrier(std::optional<double> timeout_s) {
    // One barrier call, however long; psld's own limit is the timeout.
    const std::optional<Clock::duration> timeout = timeout_of(timeout_s);
    const auto limit = timeout ? std::chrono::duration_cast<std::chrono::milliseconds>(*timeout)
                               : std::chrono::hours(24 * 365);
    psld::Status status;
    {
      nb::gil_scoped_release release;
      status = get().barrier(limit);
    }
    check(status);
  }

  void health() const { check(get().health()); }
  void set_learning_rate(double lr) { check(get().set_learning_rate(lr)); }
  uint64_t round(uint32_t tensor) const { return take(get().round(psld::TensorHandle{tensor})); }

  nb::list server_loads() const {
    nb::list out;
    for (const psld::ServerLoad& l : get().server_loads()) {
      nb::dict d;
      d["server"] = l.server;
      d["bytes_pushed"] = l.bytes_pushed;
      d["answers"] = l.answers;
      d["mean_answer_us"] = l.mean_answer_us;
      out.append(d);
    }
    return out;
  }

  void shutdown() {
    if (!worker_) return;
    psld::Status status;
    {
      nb::gil_scoped_release release;
      status = worker_->shutdown();
    }
    shut_down_ = true;
    check(status);
  }

  bool is_shut_down() const { return shut_down_; }

 private:
  using SubmitFn = psld::Result<psld::Request> (psld::Worker::*)(psld::TensorHandle);

  PyRequest submit(SubmitFn fn, uint32_t tensor) {
    psld::Result<psld::Request> r = psld::Request();
    {
      nb::gil_scoped_release release;
      r = (get().*fn)(psld::TensorHandle{tensor});
    }
    return PyRequest(take(std::move(r)));
  }

  using SubmitManyFn = psld::Result<std::vector<psld::Request>> (psld::Worker::*)(
      std::span<const psld::TensorHandle>);
  std::vector<PyRequest> submit_many(SubmitManyFn fn, const std::vector<uint32_t>& tensors) {
    std::vector<psld::TensorHandle> handles;
    handles.reserve(tensors.size());
    for (uint32_t t : tensors)
      handles.push_back(psld::TensorHandle{t});
    psld::Result<std::vector<psld::Request>> r = std::vector<psld::Request>();
    {
      nb::gil_scoped_release release;
      r = (get().*fn)(handles);
    }
    std::vector<PyRequest> out;
    for (psld::Request& req : take(std::move(r)))
      out.emplace_back(std::move(req));
    return out;
  }

  psld::Worker& get() const {
    if (shut_down_) throw_status(psld::FailedPrecondition("the worker was shut down"));
    return *worker_;
  }

  std::unique_ptr<psld::Worker> worker_;
  bool shut_down_ = false;
};

// A Server or Coordinator run by this process: both start from a Config,
// wait for the job to end and shut down the same way.
template <typename Member>
class PyMember {
 public:
  explicit PyMember(const psld::Config& config) {
    nb::gil_scoped_release release;
    member_ = take(Member::start(config));
  }
  const Member& get() const { return *member_; }
  std::string address() const { return member_->address(); }
  void wait(std::optional<double> timeout_s) {
    check(wait_in_slices(timeout_s, "the job still runs",
                         [&](std::chrono::milliseconds s) { return member_->wait(s); }));
  }
  void shutdown() {
    nb::gil_scoped_release release;
    member_->shutdown();
  }

 private:
  std::unique_ptr<Member> member_;
};
using PyServer = PyMember<psld::Server>;
using PyCoordinator = PyMember<psld::Coordinator>;

}  // namespace

NB_MODULE(_psld, m) {
  m.doc() = "psld's native module; use the package psld, not this.";
  // A process that exits on an uncaught exception (a failed job) still holds
  // its Worker; nanobind would report that as leaked instances, which it is
  // not: the process is ending.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const std::string name(psld::status_code_name(e.code));
      nb::dict& classes = error_classes();
      nb::str key(name.c_str());
      if (classes.contains(key)) {
        PyErr_SetString(classes[key].ptr(), e.message.c_str());
      } else {
        PyErr_SetString(PyExc_RuntimeError, (name + ": " + e.message).c_str());
      }
    }
  });

  m.def("_set_error_classes", [](nb::dict classes) { error_classes() = std::move(classes); });
  m.def("version", [] { return std::string(psld_version()); });
  m.def("status_code_names", [] {
    std::vector<std::string> names;
    for (int c = 1; c <= static_cast<int>(psld::StatusCode::kInternal); ++c) {
      names.emplace_back(psld::status_code_name(static_cast<psld::StatusCode>(c)));
    }
    return names;
  });

  nb::class_<psld::Config>(m, "Config")
      .def(
          "to_string",
          [](const psld::Config& c, bool with_sources) { return psld::to_string(c, with_sources); },
          nb::arg("with_sources") = true)
      .def_prop_ro("launcher", [](const psld::Config& c) { return c.launcher; });
  m.def("load_config", &load_config, nb::arg("args"));

  nb::class_<PyRequest>(m, "Request")
      .def("wait", &PyRequest::wait, nb::arg("timeout").none() = nb::none())
      .def("done", &PyRequest::done);

  nb::class_<PyWorker>(m, "Worker")
      .def(nb::init<const psld::Config&>(), nb::arg("config"))
      .def_prop_ro("rank", &PyWorker::rank)
      .def_prop_ro("num_workers", &PyWorker::num_workers)
      .def_prop_ro("gpu_path", &PyWorker::gpu_path)
      .def(
          "allocate",
          [](nb::handle self, size_t bytes) {
            return nb::cast<PyWorker&>(self).allocate(self, bytes);
          },
          nb::arg("bytes"))
      .def("register_tensor", &PyWorker::register_tensor, nb::arg("name"), nb::arg("array"),
           nb::arg("init"))
      .def("push", &PyWorker::push)
      .def("pull", &PyWorker::pull)
      .def("push_pull", &PyWorker::push_pull)
      .def("push_many", &PyWorker::push_many)
      .def("pull_many", &PyWorker::pull_many)
      .def("push_pull_many", &PyWorker::push_pull_many)
      .def("barrier", &PyWorker::barrier, nb::arg("timeout").none() = nb::none())
      .def("health", &PyWorker::health)
      .def("set_learning_rate", &PyWorker::set_learning_rate, nb::arg("lr"))
      .def("round", &PyWorker::round, nb::arg("tensor"))
      .def("server_loads", &PyWorker::server_loads)
      .def("shutdown", &PyWorker::shutdown)
      .def_prop_ro("is_shut_down", &PyWorker::is_shut_down);

  nb::class_<PyServer>(m, "Server")
      .def(nb::init<const psld::Config&>(), nb::arg("config"))
      .def_prop_ro("rank", [](const PyServer& s) { return s.get().rank(); })
      .def_prop_ro("address", &PyServer::address)
      .def("wait", &PyServer::wait, nb::arg("timeout").none() = nb::none())
      .def("shutdown", &PyServer::shutdown);

  nb::class_<PyCoordinator>(m, "Coordinator")
      .def(nb::init<const psld::Config&>(), nb::arg("config"))
      .def_prop_ro("address", &PyCoordinator::address)
      .def("wait", &PyCoordinator::wait, nb::arg("timeout").none() = nb::none())
      .def("shutdown", &PyCoordinator::shutdown);
}
