// The exact-sum trainer of the launch tests: joins the job from its
// environment (`psld launch` sets it), registers a set of tensors of odd
// sizes, and for every BSP round push_pulls all of them and checks every
// element of every tensor against the exact sum of all workers' pushes.
//
//   exact_worker [--rounds N] [--profile small|full] [--seed S] [--tamper-round R]
//
// Profiles (every worker must be given the same profile and seed):
//   small  218 tensors: one element of fp16, bf16 and fp32 (2, 2 and 4 bytes),
//          200 of odd element counts up to 4 KiB (fp32, fp16, bf16), 12 fp32
//          of 64..384 KiB, and chunk_bytes - 4, chunk_bytes, chunk_bytes + 4
//          (fp32).
//   full   the small ones plus 2^k - 1 and 2^k + 1 elements for k = 17..22
//          (fp16 or fp32, up to 16 MiB), and 16777215 fp32 elements, the
//          largest fp32 tensor below 64 MiB (64 MiB - 3 bytes rounded down to
//          whole elements): 231 tensors, 142 MB a worker.
// A tensor cannot be 1 byte: register_tensor takes a whole number of
// elements and the smallest dtype, fp16/bf16, has 2 bytes.
//
// Values are integers, different for every worker, round, tensor and
// element, with |value| <= limit / num_workers where limit is the largest
// integer range the dtype holds exactly (2^24 fp32, 2^11 fp16, 2^8 bf16), so
// every partial sum is exact and a wrong, stale, missing or doubled
// contribution shows up as a wrong element.
//
// --tamper-round R: worker 0 pushes one element off by one in round R, so a
// test can see that a wrong sum is caught.
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "psld/worker.h"

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Spec {
  psld::DType dtype = psld::DType::kFloat32;
  size_t elements = 0;
};

size_t dtype_bytes(psld::DType d) {
  return d == psld::DType::kFloat32 ? 4 : 2;
}
const char* dtype_name(psld::DType d) {
  switch (d) {
    case psld::DType::kFloat32:
      return "fp32";
    case psld::DType::kFloat16:
      return "fp16";
    case psld::DType::kBFloat16:
      return "bf16";
  }
  return "?";
}

// The largest power of two L with n * L <= the dtype's exact integer range:
// values are drawn from [-L, L), so any sum of n of them is exact.
int64_t value_limit(psld::DType d, uint32_t n) {
  const int64_t exact = d == psld::DType::kFloat32   ? int64_t{1} << 24
                        : d == psld::DType::kFloat16 ? int64_t{1} << 11
                                                     : int64_t{1} << 8;
  int64_t l = 1;
  while (2 * l * n <= exact)
    l *= 2;
  return l;
}

std::vector<Spec> make_specs(const std::string& profile, uint64_t seed, uint64_t chunk_bytes) {
  using psld::DType;
  std::vector<Spec> specs = {{DType::kFloat16, 1}, {DType::kBFloat16, 1}, {DType::kFloat32, 1}};
  std::mt19937_64 rng(seed);
  // Log-uniform odd element counts: many small tensors, as a model has.
  auto odd_between = [&](double lo, double hi) {
    std::uniform_real_distribution<double> e(std::log2(lo), std::log2(hi));
    return static_cast<size_t>(std::exp2(e(rng))) | 1;
  };
  for (int i = 0; i < 200; ++i) {
    const DType d = i % 10 == 3   ? DType::kFloat16
                    : i % 10 == 7 ? DType::kBFloat16
                                  : DType::kFloat32;
    specs.push_back({d, odd_between(1, 4096.0 / static_cast<double>(dtype_bytes(d)))});
  }
  for (int i = 0; i < 12; ++i) {
    specs.push_back({DType::kFloat32, odd_between(16 * 1024, 96 * 1024)});
  }
  // Around the chunk size: one chunk less an element, exactly one, one and an element.
  const size_t per_chunk = static_cast<size_t>(chunk_bytes / 4);
  for (size_t e : {per_chunk - 1, per_chunk, per_chunk + 1}) {
    if (e > 0) specs.push_back({DType::kFloat32, e});
  }
  if (profile == "full") {
    for (int k = 17; k <= 22; ++k) {
      const size_t p = size_t{1} << k;
      specs.push_back({k % 2 ? DType::kFloat16 : DType::kFloat32, p - 1});
      specs.push_back({DType::kFloat32, p + 1});
    }
    specs.push_back({DType::kFloat32, (size_t{64} << 20) / 4 - 1});  // 64 MiB - 4 bytes
  }
  return specs;
}

// What worker `w` pushes in round `round` for element `i` of tensor `t`.
inline int64_t pushed_value(uint64_t tensor_round_base, size_t i, uint32_t w, uint32_t n,
                            int64_t limit) {
  const uint64_t h = mix(tensor_round_base + static_cast<uint64_t>(i) * n + w);
  return static_cast<int64_t>(h & static_cast<uint64_t>(2 * limit - 1)) - limit;
}

struct Tensor {
  Spec spec;
  std::string name;
  std::vector<uint8_t> data;
  psld::TensorHandle handle;
};

float load(const Tensor& t, size_t i) {
  if (t.spec.dtype == psld::DType::kFloat32) {
    float f;
    std::memcpy(&f, t.data.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, t.data.data() + 2 * i, 2);
  return t.spec.dtype == psld::DType::kFloat16 ? psld::kernels::f16_to_f32_scalar(h)
                                               : psld::kernels::bf16_to_f32_scalar(h);
}

void store(Tensor& t, size_t i, float f) {
  if (t.spec.dtype == psld::DType::kFloat32) {
    std::memcpy(t.data.data() + 4 * i, &f, 4);
    return;
  }
  const uint16_t h = t.spec.dtype == psld::DType::kFloat16 ? psld::kernels::f32_to_f16_scalar(f)
                                                           : psld::kernels::f32_to_bf16_scalar(f);
  std::memcpy(t.data.data() + 2 * i, &h, 2);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 20, tamper_round = -1;
  uint64_t seed = 1;
  std::string profile = "small";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    if (a == "--rounds") {
      rounds = std::atoi(v);
    } else if (a == "--profile") {
      profile = v;
    } else if (a == "--seed") {
      seed = std::strtoull(v, nullptr, 10);
    } else if (a == "--tamper-round") {
      tamper_round = std::atoi(v);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (profile != "small" && profile != "full") {
    std::fprintf(stderr, "--profile must be small or full, not %s\n", profile.c_str());
    return 2;
  }
  auto config = psld::load_config({});
  if (!config.ok()) {
    std::fprintf(stderr, "config: %s\n", config.status().to_string().c_str());
    return 1;
  }
  auto joined = psld::Worker::join(*config);
  if (!joined.ok()) {
    std::fprintf(stderr, "join: %s\n", joined.status().to_string().c_str());
    return 1;
  }
  psld::Worker& w = **joined;
  const uint32_t rank = w.rank();
  const uint32_t n = w.num_workers();

  std::vector<Tensor> tensors;
  uint64_t total_bytes = 0;
  for (const Spec& s : make_specs(profile, seed, config->data.chunk_bytes)) {
    Tensor t;
    t.spec = s;
    t.name = "t" + std::to_string(tensors.size()) + "_" + dtype_name(s.dtype) + "_" +
             std::to_string(s.elements);
    t.data.assign(s.elements * dtype_bytes(s.dtype), 0);
    total_bytes += t.data.size();
    tensors.push_back(std::move(t));
  }
  // Registered after every vector is in place: the library keeps the pointers.
  for (Tensor& t : tensors) {
    auto h = w.register_tensor(t.name, t.spec.dtype, t.data.size(), t.data.data());
    if (!h.ok()) {
      std::fprintf(stderr, "register %s: %s\n", t.name.c_str(), h.status().to_string().c_str());
      return 1;
    }
    t.handle = *h;
  }

  const auto start = std::chrono::steady_clock::now();
  for (int r = 1; r <= rounds; ++r) {
    std::vector<psld::Request> reqs;
    for (size_t ti = 0; ti < tensors.size(); ++ti) {
      Tensor& t = tensors[ti];
      const int64_t limit = value_limit(t.spec.dtype, n);
      const uint64_t base = mix(seed ^ (uint64_t{ti} << 40) ^ (static_cast<uint64_t>(r) << 8));
      for (size_t i = 0; i < t.spec.elements; ++i)
        store(t, i, static_cast<float>(pushed_value(base, i, rank, n, limit)));
      if (r == tamper_round && rank == 0 && ti + 1 == tensors.size()) {
        const size_t last = t.spec.elements - 1;
        store(t, last, load(t, last) + 1.0f);
      }
      auto req = w.push_pull(t.handle);
      if (!req.ok()) {
        std::fprintf(stderr, "round %d: push_pull %s: %s\n", r, t.name.c_str(),
                     req.status().to_string().c_str());
        return 1;
      }
      reqs.push_back(*req);
    }
    for (size_t ti = 0; ti < reqs.size(); ++ti) {
      psld::Status s = reqs[ti].wait(std::chrono::seconds(120));
      if (!s.ok()) {
        std::fprintf(stderr, "round %d: %s: %s\n", r, tensors[ti].name.c_str(),
                     s.to_string().c_str());
        return 1;
      }
    }
    uint64_t wrong = 0;
    for (size_t ti = 0; ti < tensors.size(); ++ti) {
      const Tensor& t = tensors[ti];
      const int64_t limit = value_limit(t.spec.dtype, n);
      const uint64_t base = mix(seed ^ (uint64_t{ti} << 40) ^ (static_cast<uint64_t>(r) << 8));
      for (size_t i = 0; i < t.spec.elements; ++i) {
        int64_t want = 0;
        for (uint32_t k = 0; k < n; ++k)
          want += pushed_value(base, i, k, n, limit);
        const float got = load(t, i);
        if (got != static_cast<float>(want)) {
          if (wrong < 5) {
            std::fprintf(stderr, "round %d tensor %s element %zu: %.1f != %" PRId64 "\n", r,
                         t.name.c_str(), i, static_cast<double>(got), want);
          }
          ++wrong;
        }
      }
    }
    if (wrong > 0) {
      std::fprintf(stderr, "round %d: %" PRIu64 " wrong elements\n", r, wrong);
      return 1;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("worker %u: %d rounds x %zu tensors (%" PRIu64 " bytes) exact in %.1f s\n", rank,
              rounds, tensors.size(), total_bytes, seconds);
  std::fflush(stdout);
  return w.shutdown().ok() ? 0 : 1;
}
