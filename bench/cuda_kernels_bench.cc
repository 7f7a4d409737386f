// bench/cuda_kernels_bench.cc — the CUDA kernels next to their yardstick, a
// device-to-device copy, in the same run.
//
// BM_cuda_<kernel>/<bytes>: one kernel over fp32 arrays of <bytes> bytes in
// GPU memory; fp16/bf16 arrays have as many elements, so half the bytes.
// bytes/s counts every byte the kernel must read or write once (an in-place
// update of w counts w twice), as kernels_bench.cc does, so rows compare
// directly with BM_cuda_copy/<bytes>, a cudaMemcpyAsync device to device
// that reads <bytes> and writes <bytes>. The x_copy column is a row's bytes/s
// over the copy's of the same size; the targets at 256 MiB, far past the
// 50 MiB L2 of an H100/H200, are reduce >= 0.85x and Adam >= 0.6x, printed
// again under the table.
//
// Times are GPU time between two CUDA events on the benchmark's stream
// (manual time). A timed iteration queues enough calls to cover 64 MiB of
// arrays (64 at 1 MiB, 1 at 256 MiB), so the Time column is per 64 calls at
// 1 MiB, and the 1 MiB bytes/s includes the gaps between back-to-back
// launches, as a server calling the kernel per key would see them.
//
// Without a usable device the binary says so and exits 0.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/dispatch.h"

namespace psld::kernels {
namespace {

constexpr int64_t kSizes[] = {int64_t{1} << 20, int64_t{256} << 20};
constexpr int64_t kBytesPerTimedIteration = int64_t{64} << 20;

// The stream every row runs on, and two events to time it.
struct Timing {
  void* stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  bool ok = false;
};

Timing& timing() {
  static Timing t = [] {
    Timing t;
    t.ok = cuda::stream_create(&t.stream).ok() && cudaEventCreate(&t.start) == cudaSuccess &&
           cudaEventCreate(&t.stop) == cudaSuccess;
    return t;
  }();
  return t;
}

// Realistic magnitudes, as in kernels_bench.cc: base + spread * a pattern in
// [-1, 1), so nothing drifts to inf or into subnormals over many repetitions.
std::vector<float> pattern(size_t n, float base, float spread) {
  std::vector<float> x(n);
  uint32_t s = 12345;
  for (float& v : x) {
    s = s * 1664525u + 1013904223u;
    v = base + spread * (static_cast<float>(s >> 8) * 0x1p-23f - 1.0f);
  }
  return x;
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    void* p = nullptr;
    status_ = cuda::device_alloc(bytes, &p);
    mem_ = p;
  }
  ~DeviceBuffer() { (void)cuda::device_free(mem_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  float* f32() { return static_cast<float*>(mem_); }
  uint16_t* u16() { return static_cast<uint16_t*>(mem_); }
  const Status& status() const { return status_; }

  Status fill(float base, float spread, size_t n) {
    const std::vector<float> host = pattern(n, base, spread);
    return cuda::copy(mem_, host.data(), n * sizeof(float));
  }
  Status fill_half(size_t n, bool bf16) {
    std::vector<uint16_t> host(n);
    for (size_t i = 0; i < n; ++i) {
      const float x = 1e-3f * static_cast<float>(static_cast<int>(i % 2001) - 1000);
      host[i] = bf16 ? f32_to_bf16_scalar(x) : f32_to_f16_scalar(x);
    }
    return cuda::copy(mem_, host.data(), n * sizeof(uint16_t));
  }

 private:
  void* mem_ = nullptr;
  Status status_;
};

// The arrays of one size, shared by all rows and filled once: a (parameters
// or accumulator), b, c, d (gradients, optimizer state), h (16-bit input);
// the copy and the conversions write into out and out16 only, so that no
// row changes another's inputs.
struct Arrays {
  explicit Arrays(size_t bytes)
      : n(bytes / sizeof(float)),
        a(bytes),
        b(bytes),
        c(bytes),
        d(bytes),
        h(bytes / 2),
        out(bytes),
        out16(bytes / 2) {
    for (const DeviceBuffer* buf : {&a, &b, &c, &d, &h, &out, &out16}) {
      if (!buf->status().ok()) {
        status = buf->status();
        return;
      }
    }
    for (Status s : {a.fill(0.0f, 1.0f, n), b.fill(0.0f, 1e-3f, n), c.fill(1e-5f, 1e-6f, n),
                     d.fill(0.0f, 1e-2f, n), h.fill_half(n, false)}) {
      if (!s.ok()) {
        status = s;
        return;
      }
    }
  }
  size_t n;
  DeviceBuffer a, b, c, d, h, out, out16;
  Status status;
};

std::map<int64_t, std::unique_ptr<Arrays>>& array_cache() {
  static std::map<int64_t, std::unique_ptr<Arrays>> cache;
  return cache;
}
Arrays& arrays(int64_t bytes) {
  auto& slot = array_cache()[bytes];
  if (!slot) slot = std::make_unique<Arrays>(static_cast<size_t>(bytes));
  return *slot;
}
// Frees the device arrays while the CUDA runtime is still up (not in a
// static destructor at exit, which may run after it is torn down).
void release_arrays() {
  array_cache().clear();
}

// bytes/s of the last run of each row, by "<name>/<bytes>", for x_copy and
// the targets under the table.
std::map<std::string, double>& rates() {
  static std::map<std::string, double> r;
  return r;
}
std::string key(const std::string& name, int64_t bytes) {
  return name + "/" + std::to_string(bytes);
}

// Times launch() (which queues one kernel or copy on the stream and returns
// its status) and reports bytes/s with `bytes_per_call` bytes per call.
template <class Launch>
void run(benchmark::State& state, const std::string& name, int64_t bytes_per_call, Launch launch) {
  Timing& t = timing();
  if (!t.ok) {
    state.SkipWithError("could not create the CUDA stream and events");
    return;
  }
  const auto stream = static_cast<cudaStream_t>(t.stream);
  const int64_t calls = std::max<int64_t>(1, kBytesPerTimedIteration / state.range(0));

  // One untimed call: the first launch of a kernel loads its module.
  Status s = launch();
  if (s.ok()) s = cuda::stream_synchronize(t.stream);
  if (!s.ok()) {
    state.SkipWithError(s.to_string().c_str());
    return;
  }
  double seconds = 0;
  for (auto _ : state) {
    cudaEventRecord(t.start, stream);
    for (int64_t i = 0; i < calls && s.ok(); ++i)
      s = launch();
    cudaEventRecord(t.stop, stream);
    const cudaError_t e = cudaEventSynchronize(t.stop);
    if (s.ok() && e != cudaSuccess) s = Internal(cudaGetErrorString(e));
    if (!s.ok()) {
      state.SkipWithError(s.to_string().c_str());
      break;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, t.start, t.stop);
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
  }
  if (!s.ok() || seconds <= 0) return;
  const int64_t bytes = state.iterations() * calls * bytes_per_call;
  state.SetBytesProcessed(bytes);
  const double rate = static_cast<double>(bytes) / seconds;
  rates()[key(name, state.range(0))] = rate;
  const auto copy = rates().find(key("copy", state.range(0)));
  if (copy != rates().end()) state.counters["x_copy"] = rate / copy->second;
}

// This row's arrays, or nullptr with the row skipped.
Arrays* ready(benchmark::State& state) {
  const Status device = cuda_device_status();
  if (!device.ok()) {
    state.SkipWithError(("no CUDA device: " + device.message()).c_str());
    return nullptr;
  }
  Arrays& arr = arrays(state.range(0));
  if (!arr.status.ok()) {
    state.SkipWithError(arr.status.to_string().c_str());
    return nullptr;
  }
  return &arr;
}

void BM_cuda_copy(benchmark::State& state) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  const auto bytes = static_cast<size_t>(state.range(0));
  run(state, "copy", 2 * state.range(0), [&]() -> Status {
    const cudaError_t e =
        cudaMemcpyAsync(arr->out.f32(), arr->a.f32(), bytes, cudaMemcpyDeviceToDevice,
                        static_cast<cudaStream_t>(timing().stream));
    if (e != cudaSuccess) return Internal(cudaGetErrorString(e));
    return {};
  });
}

void BM_cuda_reduce_fp32(benchmark::State& state) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  run(state, "reduce_fp32", 3 * state.range(0), [&] {  // read acc, read x, write acc
    return cuda::reduce_f32(arr->a.f32(), arr->b.f32(), arr->n, timing().stream);
  });
}

void reduce_half(benchmark::State& state, bool bf16) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  run(state, bf16 ? "reduce_bf16" : "reduce_fp16", 2 * state.range(0) + state.range(0) / 2, [&] {
    return bf16 ? cuda::reduce_bf16(arr->a.f32(), arr->h.u16(), arr->n, timing().stream)
                : cuda::reduce_f16(arr->a.f32(), arr->h.u16(), arr->n, timing().stream);
  });
}
void BM_cuda_reduce_fp16(benchmark::State& state) {
  reduce_half(state, false);
}
void BM_cuda_reduce_bf16(benchmark::State& state) {
  reduce_half(state, true);
}

void BM_cuda_scale_fp32(benchmark::State& state) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  bool up = false;
  run(state, "scale_fp32", 2 * state.range(0), [&] {
    // Alternate exact factors so the values neither vanish nor overflow.
    up = !up;
    return cuda::scale_f32(arr->a.f32(), up ? 2.0f : 0.5f, arr->n, timing().stream);
  });
}

void BM_cuda_sgd_fp32(benchmark::State& state) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  const SgdParams p{1e-3f};
  run(state, "sgd_fp32", 3 * state.range(0), [&] {  // w read+write, g read
    return cuda::sgd_f32(arr->a.f32(), arr->b.f32(), arr->n, p, timing().stream);
  });
}

void BM_cuda_momentum_fp32(benchmark::State& state) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  const MomentumParams p{1e-3f, 0.9f, 0.0f, 0.0f, true};
  run(state, "momentum_fp32", 5 * state.range(0), [&] {  // w, buf read+write, g read
    return cuda::momentum_f32(arr->a.f32(), arr->b.f32(), arr->d.f32(), arr->n, p, timing().stream);
  });
}

void adam(benchmark::State& state, bool decoupled) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  AdamParams p{1e-3f};
  p.decoupled = decoupled;
  p.weight_decay = decoupled ? 1e-2f : 0.0f;
  run(state, decoupled ? "adamw_fp32" : "adam_fp32", 7 * state.range(0), [&] {
    ++p.step;  // new bias corrections every call, as in training
    return cuda::adam_f32(arr->a.f32(), arr->b.f32(), arr->c.f32(), arr->d.f32(), arr->n, p,
                          timing().stream);
  });  // w, m, v read+write, g read
}
void BM_cuda_adam_fp32(benchmark::State& state) {
  adam(state, false);
}
void BM_cuda_adamw_fp32(benchmark::State& state) {
  adam(state, true);
}

void narrow(benchmark::State& state, bool bf16) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  run(state, bf16 ? "cvt_fp32_to_bf16" : "cvt_fp32_to_fp16", state.range(0) + state.range(0) / 2,
      [&] {
        return bf16 ? cuda::f32_to_bf16(arr->out16.u16(), arr->a.f32(), arr->n, timing().stream)
                    : cuda::f32_to_f16(arr->out16.u16(), arr->a.f32(), arr->n, timing().stream);
      });
}
void BM_cuda_cvt_fp32_to_fp16(benchmark::State& state) {
  narrow(state, false);
}
void BM_cuda_cvt_fp32_to_bf16(benchmark::State& state) {
  narrow(state, true);
}

void widen(benchmark::State& state, bool bf16) {
  Arrays* arr = ready(state);
  if (arr == nullptr) return;
  run(state, bf16 ? "cvt_bf16_to_fp32" : "cvt_fp16_to_fp32", state.range(0) + state.range(0) / 2,
      [&] {
        return bf16 ? cuda::bf16_to_f32(arr->out.f32(), arr->h.u16(), arr->n, timing().stream)
                    : cuda::f16_to_f32(arr->out.f32(), arr->h.u16(), arr->n, timing().stream);
      });
}
void BM_cuda_cvt_fp16_to_fp32(benchmark::State& state) {
  widen(state, false);
}
void BM_cuda_cvt_bf16_to_fp32(benchmark::State& state) {
  widen(state, true);
}

// The copy rows first: x_copy needs them. Arg() rather than MinTime(), which
// would append "/min_time:..." to the row names.
#define PSLD_CUDA_BENCHMARK(fn) BENCHMARK(fn)->Arg(kSizes[0])->Arg(kSizes[1])->UseManualTime()

PSLD_CUDA_BENCHMARK(BM_cuda_copy);
PSLD_CUDA_BENCHMARK(BM_cuda_reduce_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_reduce_fp16);
PSLD_CUDA_BENCHMARK(BM_cuda_reduce_bf16);
PSLD_CUDA_BENCHMARK(BM_cuda_scale_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_sgd_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_momentum_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_adam_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_adamw_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_cvt_fp32_to_fp16);
PSLD_CUDA_BENCHMARK(BM_cuda_cvt_fp16_to_fp32);
PSLD_CUDA_BENCHMARK(BM_cuda_cvt_fp32_to_bf16);
PSLD_CUDA_BENCHMARK(BM_cuda_cvt_bf16_to_fp32);

void print_targets() {
  struct Target {
    const char* row;
    double at_least;
  };
  const Target targets[] = {
      {"reduce_fp32", 0.85}, {"reduce_fp16", 0.85}, {"reduce_bf16", 0.85},
      {"adam_fp32", 0.60},   {"adamw_fp32", 0.60},
  };
  const int64_t bytes = kSizes[1];
  std::printf("\nAt %lld MiB, against the device-to-device copy of this run:\n",
              static_cast<long long>(bytes >> 20));
  const auto copy = rates().find(key("copy", bytes));
  for (const Target& t : targets) {
    const auto row = rates().find(key(t.row, bytes));
    if (row == rates().end() || copy == rates().end()) {
      std::printf("  %-12s not run (filtered out, or skipped)\n", t.row);
      continue;
    }
    const double ratio = row->second / copy->second;
    // GiB/s, as the table's "G/s".
    std::printf("  %-12s %7.1f GiB/s = %.2fx copy (%.1f GiB/s); target >= %.2fx: %s\n", t.row,
                row->second / (1 << 30), ratio, copy->second / (1 << 30), t.at_least,
                ratio >= t.at_least ? "met" : "MISSED");
  }
}

}  // namespace
}  // namespace psld::kernels

int main(int argc, char** argv) {
  using namespace psld::kernels;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const psld::Status device = cuda_device_status();
  if (!device.ok()) {
    std::printf("cuda_kernels_bench: no CUDA device: %s\nNothing to measure on this machine.\n",
                device.message().c_str());
    return 0;
  }
  int index = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&index) == cudaSuccess &&
      cudaGetDeviceProperties(&prop, index) == cudaSuccess) {
    benchmark::AddCustomContext("cuda_device",
                                std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
                                    std::to_string(prop.minor) + ", " +
                                    std::to_string(prop.totalGlobalMem >> 30) + " GiB, " +
                                    std::to_string(prop.multiProcessorCount) + " SMs)");
  }
  benchmark::RunSpecifiedBenchmarks();
  print_targets();
  release_arrays();
  benchmark::Shutdown();
  return 0;
}
