// bench/kernels_bench.cc — the CPU kernels next to their yardstick.
//
// BM_<kernel>/<bytes>: one kernel over a parameter (or accumulator) array of
// <bytes> bytes of fp32; fp16/bf16 inputs have as many elements, so half the
// bytes. bytes/s counts every byte the kernel must read or write once (an
// in-place update of w counts w twice), so rows compare directly with
// BM_memcpy/<bytes>, which reads <bytes> and writes <bytes>. At 64 MiB the
// arrays are far larger than the caches and every row is a DRAM bandwidth
// figure; the targets are fp32 reduce >= 0.8x and Adam >= 0.5x of memcpy.
// The label names the ISA that kernels() chose (PSLD_KERNEL_ISA lowers it).
//
// This file holds main() for the whole binary (placement_bench.cc too).

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "kernels/cpu/cpu_kernels.h"

namespace psld::kernels {
namespace {

constexpr int64_t kSizes[] = {4096, 1 << 20, 64 << 20};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Page-aligned, like registered transfer buffers, and touched once so that
// no page fault lands in a timed loop.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes) {
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    mem_.reset(std::aligned_alloc(4096, rounded));
    if (!mem_) std::abort();
    std::memset(mem_.get(), 0, rounded);
  }
  float* f32() { return static_cast<float*>(mem_.get()); }
  uint16_t* u16() { return static_cast<uint16_t*>(mem_.get()); }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  std::unique_ptr<void, FreeDeleter> mem_;
};

// The arrays of one size, shared by all rows: allocating and faulting in
// 256 MiB again for each of the library's calibration runs would dominate
// the wall time of the binary.
struct Arrays {
  explicit Arrays(size_t bytes)
      : a(bytes), b(bytes), c(bytes), d(bytes), h(bytes / 2), n(bytes / sizeof(float)) {}
  Buffer a, b, c, d, h;
  size_t n;
};

Arrays& arrays(int64_t bytes) {
  static std::map<int64_t, std::unique_ptr<Arrays>> cache;
  auto& slot = cache[bytes];
  if (!slot) slot = std::make_unique<Arrays>(static_cast<size_t>(bytes));
  return *slot;
}

// Realistic magnitudes (no denormals, nothing that drifts to inf over
// millions of repetitions): base + spread * a pattern in [-1, 1).
//
// The optimizer rows use PyTorch's default weight decay (0, and 0.01 for
// AdamW): with coupled decay and the same gradient on every repetition, w
// converges to where g + wd*w = 0, the momentum buffer or v decays into
// denormals, and the row measures denormal arithmetic (Adam at 4 KiB ran
// 1.6x slower that way) instead of the kernel.
void fill(float* x, size_t n, float base, float spread) {
  uint32_t s = 12345;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = base + spread * (static_cast<float>(s >> 8) * 0x1p-23f - 1.0f);
  }
}

void fill_half(uint16_t* h, size_t n, bool bf16) {
  for (size_t i = 0; i < n; ++i) {
    const float x = 1e-3f * static_cast<float>(static_cast<int>(i % 2001) - 1000);
    h[i] = bf16 ? f32_to_bf16_scalar(x) : f32_to_f16_scalar(x);
  }
}

void finish(benchmark::State& state, int64_t bytes_per_iteration) {
  state.SetBytesProcessed(state.iterations() * bytes_per_iteration);
  state.SetLabel(std::string(isa_name(kernels().isa)));
}

void BM_memcpy(benchmark::State& state) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  for (auto _ : state) {
    std::memcpy(arr.b.f32(), arr.a.f32(), arr.a.bytes());
    benchmark::DoNotOptimize(arr.b.f32());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * state.range(0));
  state.SetLabel("libc");
}

void BM_reduce_fp32(benchmark::State& state) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  fill(arr.b.f32(), arr.n, 0.0f, 1e-3f);
  for (auto _ : state) {
    reduce_f32(arr.a.f32(), arr.b.f32(), arr.n);
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, 3 * state.range(0));  // read acc, read x, write acc
}

void reduce_half(benchmark::State& state, bool bf16) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  fill_half(arr.h.u16(), arr.n, bf16);
  for (auto _ : state) {
    if (bf16) {
      reduce_bf16(arr.a.f32(), arr.h.u16(), arr.n);
    } else {
      reduce_f16(arr.a.f32(), arr.h.u16(), arr.n);
    }
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, 2 * state.range(0) + state.range(0) / 2);
}
void BM_reduce_fp16(benchmark::State& state) {
  reduce_half(state, false);
}
void BM_reduce_bf16(benchmark::State& state) {
  reduce_half(state, true);
}

void BM_scale_fp32(benchmark::State& state) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  bool up = false;
  for (auto _ : state) {
    // Alternate exact factors so the values neither vanish nor overflow.
    scale_f32(arr.a.f32(), up ? 2.0f : 0.5f, arr.n);
    up = !up;
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, 2 * state.range(0));
}

void BM_sgd_fp32(benchmark::State& state) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  fill(arr.b.f32(), arr.n, 0.0f, 1e-2f);
  const SgdParams p{1e-3f};
  for (auto _ : state) {
    sgd_f32(arr.a.f32(), arr.b.f32(), arr.n, p);
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, 3 * state.range(0));  // w read+write, g read
}

void BM_momentum_fp32(benchmark::State& state) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  fill(arr.b.f32(), arr.n, 0.0f, 1e-2f);
  fill(arr.c.f32(), arr.n, 0.0f, 1e-2f);
  const MomentumParams p{1e-3f, 0.9f, 0.0f, 0.0f, true};
  for (auto _ : state) {
    momentum_f32(arr.a.f32(), arr.b.f32(), arr.c.f32(), arr.n, p);
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, 5 * state.range(0));  // w, buf read+write, g read
}

void adam(benchmark::State& state, bool decoupled) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  fill(arr.b.f32(), arr.n, 0.0f, 1e-3f);
  fill(arr.c.f32(), arr.n, 1e-5f, 1e-6f);
  fill(arr.d.f32(), arr.n, 0.0f, 1e-2f);
  AdamParams p{1e-3f};
  p.decoupled = decoupled;
  p.weight_decay = decoupled ? 1e-2f : 0.0f;
  for (auto _ : state) {
    adam_f32(arr.a.f32(), arr.b.f32(), arr.c.f32(), arr.d.f32(), arr.n, p);
    ++p.step;  // new bias corrections every call, as in training
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, 7 * state.range(0));  // w, m, v read+write, g read
}
void BM_adam_fp32(benchmark::State& state) {
  adam(state, false);
}
void BM_adamw_fp32(benchmark::State& state) {
  adam(state, true);
}

void narrow(benchmark::State& state, bool bf16) {
  Arrays& arr = arrays(state.range(0));
  fill(arr.a.f32(), arr.n, 0.0f, 1.0f);
  for (auto _ : state) {
    if (bf16) {
      f32_to_bf16(arr.h.u16(), arr.a.f32(), arr.n);
    } else {
      f32_to_f16(arr.h.u16(), arr.a.f32(), arr.n);
    }
    benchmark::DoNotOptimize(arr.h.u16());
    benchmark::ClobberMemory();
  }
  finish(state, state.range(0) + state.range(0) / 2);
}
void BM_cvt_fp32_to_fp16(benchmark::State& state) {
  narrow(state, false);
}
void BM_cvt_fp32_to_bf16(benchmark::State& state) {
  narrow(state, true);
}

void widen(benchmark::State& state, bool bf16) {
  Arrays& arr = arrays(state.range(0));
  fill_half(arr.h.u16(), arr.n, bf16);
  for (auto _ : state) {
    if (bf16) {
      bf16_to_f32(arr.a.f32(), arr.h.u16(), arr.n);
    } else {
      f16_to_f32(arr.a.f32(), arr.h.u16(), arr.n);
    }
    benchmark::DoNotOptimize(arr.a.f32());
    benchmark::ClobberMemory();
  }
  finish(state, state.range(0) + state.range(0) / 2);
}
void BM_cvt_fp16_to_fp32(benchmark::State& state) {
  widen(state, false);
}
void BM_cvt_bf16_to_fp32(benchmark::State& state) {
  widen(state, true);
}

// Arg() rather than MinTime()/Iterations(), which would append
// "/min_time:..." to the row names; the library's default time per row keeps
// the whole binary well under a minute.
#define PSLD_KERNEL_BENCHMARK(fn) BENCHMARK(fn)->Arg(kSizes[0])->Arg(kSizes[1])->Arg(kSizes[2])

PSLD_KERNEL_BENCHMARK(BM_memcpy);
PSLD_KERNEL_BENCHMARK(BM_reduce_fp32);
PSLD_KERNEL_BENCHMARK(BM_reduce_fp16);
PSLD_KERNEL_BENCHMARK(BM_reduce_bf16);
PSLD_KERNEL_BENCHMARK(BM_scale_fp32);
PSLD_KERNEL_BENCHMARK(BM_sgd_fp32);
PSLD_KERNEL_BENCHMARK(BM_momentum_fp32);
PSLD_KERNEL_BENCHMARK(BM_adam_fp32);
PSLD_KERNEL_BENCHMARK(BM_adamw_fp32);
PSLD_KERNEL_BENCHMARK(BM_cvt_fp32_to_fp16);
PSLD_KERNEL_BENCHMARK(BM_cvt_fp16_to_fp32);
PSLD_KERNEL_BENCHMARK(BM_cvt_fp32_to_bf16);
PSLD_KERNEL_BENCHMARK(BM_cvt_bf16_to_fp32);

}  // namespace
}  // namespace psld::kernels

BENCHMARK_MAIN();
