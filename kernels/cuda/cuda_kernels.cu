// The CUDA kernels: one grid-stride elementwise kernel template, and per
// operation a functor that does one element (scalar) or one 16-byte-aligned
// vector of elements (vector), with the arithmetic of elementwise.h.
//
// Built with -fmad=false -prec-div=true -prec-sqrt=true -ftz=false (see
// kernels/meson.build), although the explicit _rn intrinsics alone already
// pin every rounding.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"
#include "kernels/cuda/cuda_error.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/elementwise.h"

namespace psld::kernels::cuda {
namespace {

namespace el = element;

// 256 threads, 8 blocks per SM: 2048 resident threads, the most an SM of
// sm_80/sm_90 holds. With one 16-byte load per array in flight per thread
// that is 64 KiB (reduce) to 128 KiB (Adam) of reads in flight per SM, well
// above what bandwidth times latency asks for on an H200 (4.8 TB/s x ~0.7 us
// / 132 SMs, about 26 KiB per SM), so one vector per thread and iteration is
// enough. An estimate, not a measurement: tools/gpu-check measures it.
constexpr int kBlockThreads = 256;
constexpr int kBlocksPerSm = 8;

// Body: vector j covers elements [head + j*lanes, head + (j+1)*lanes). Ends:
// the head and the tail past the last whole vector, one element per thread.
template <class Op>
__global__ void __launch_bounds__(kBlockThreads)
    elementwise_kernel(Op op, size_t n, size_t head, size_t vectors) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (size_t j = first; j < vectors; j += stride)
    op.vector(head + j * Op::kLanes);
  const size_t body_end = head + vectors * Op::kLanes;
  const size_t singles = head + (n - body_end);
  for (size_t k = first; k < singles; k += stride)
    op.scalar(k < head ? k : body_end + (k - head));
}

template <class T>
__device__ __forceinline__ float4 load4(const T* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void store4(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}

// Eight 16-bit values in one 16-byte load; value k is in word k/2, the low
// half first (little-endian, as on the host).
struct Halves {
  uint32_t w[4];
  __device__ __forceinline__ uint16_t get(int k) const {
    return static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));
  }
  __device__ __forceinline__ void set(int k, uint16_t h) {
    const int shift = 16 * (k % 2);
    w[k / 2] = (w[k / 2] & ~(0xffffu << shift)) | (static_cast<uint32_t>(h) << shift);
  }
};
__device__ __forceinline__ Halves load_halves(const uint16_t* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  return {{u.x, u.y, u.z, u.w}};
}
__device__ __forceinline__ void store_halves(uint16_t* p, const Halves& h) {
  *reinterpret_cast<uint4*>(p) = make_uint4(h.w[0], h.w[1], h.w[2], h.w[3]);
}

// ---------------------------------------------------------------------------
// Operations. Plain loads throughout, no __ldg: an input may be the same
// array as an output, which the read-only path does not allow.

struct ReduceF32 {
  static constexpr size_t kLanes = 4;
  float* acc;
  const float* x;
  __device__ void scalar(size_t i) const { acc[i] = el::add(acc[i], x[i]); }
  __device__ void vector(size_t i) const {
    float4 a = load4(acc + i);
    const float4 b = load4(x + i);
    a.x = el::add(a.x, b.x);
    a.y = el::add(a.y, b.y);
    a.z = el::add(a.z, b.z);
    a.w = el::add(a.w, b.w);
    store4(acc + i, a);
  }
};

template <bool kBf16>
struct ReduceHalf {
  static constexpr size_t kLanes = 8;
  float* acc;
  const uint16_t* x;
  static __device__ __forceinline__ float widen(uint16_t h) {
    return kBf16 ? el::bf16_to_f32(h) : el::f16_to_f32(h);
  }
  __device__ void scalar(size_t i) const { acc[i] = el::add(acc[i], widen(x[i])); }
  __device__ void vector(size_t i) const {
    const Halves h = load_halves(x + i);
    float4 lo = load4(acc + i);
    float4 hi = load4(acc + i + 4);
    lo.x = el::add(lo.x, widen(h.get(0)));
    lo.y = el::add(lo.y, widen(h.get(1)));
    lo.z = el::add(lo.z, widen(h.get(2)));
    lo.w = el::add(lo.w, widen(h.get(3)));
    hi.x = el::add(hi.x, widen(h.get(4)));
    hi.y = el::add(hi.y, widen(h.get(5)));
    hi.z = el::add(hi.z, widen(h.get(6)));
    hi.w = el::add(hi.w, widen(h.get(7)));
    store4(acc + i, lo);
    store4(acc + i + 4, hi);
  }
};

struct ScaleF32 {
  static constexpr size_t kLanes = 4;
  float* x;
  float a;
  __device__ void scalar(size_t i) const { x[i] = el::mul(x[i], a); }
  __device__ void vector(size_t i) const {
    float4 v = load4(x + i);
    v.x = el::mul(v.x, a);
    v.y = el::mul(v.y, a);
    v.z = el::mul(v.z, a);
    v.w = el::mul(v.w, a);
    store4(x + i, v);
  }
};

struct Sgd {
  static constexpr size_t kLanes = 4;
  float* w;
  const float* g;
  internal::SgdConsts c;
  __device__ void scalar(size_t i) const { w[i] = el::sgd(w[i], g[i], c); }
  __device__ void vector(size_t i) const {
    float4 wv = load4(w + i);
    const float4 gv = load4(g + i);
    wv.x = el::sgd(wv.x, gv.x, c);
    wv.y = el::sgd(wv.y, gv.y, c);
    wv.z = el::sgd(wv.z, gv.z, c);
    wv.w = el::sgd(wv.w, gv.w, c);
    store4(w + i, wv);
  }
};

struct Momentum {
  static constexpr size_t kLanes = 4;
  float* w;
  float* buf;
  const float* g;
  internal::MomentumConsts c;
  bool nesterov;
  __device__ void scalar(size_t i) const {
    float wi = w[i], bi = buf[i];
    el::momentum(wi, bi, g[i], c, nesterov);
    w[i] = wi;
    buf[i] = bi;
  }
  __device__ void vector(size_t i) const {
    float4 wv = load4(w + i);
    float4 bv = load4(buf + i);
    const float4 gv = load4(g + i);
    el::momentum(wv.x, bv.x, gv.x, c, nesterov);
    el::momentum(wv.y, bv.y, gv.y, c, nesterov);
    el::momentum(wv.z, bv.z, gv.z, c, nesterov);
    el::momentum(wv.w, bv.w, gv.w, c, nesterov);
    store4(w + i, wv);
    store4(buf + i, bv);
  }
};

struct Adam {
  static constexpr size_t kLanes = 4;
  float* w;
  float* m;
  float* v;
  const float* g;
  internal::AdamConsts c;
  __device__ void scalar(size_t i) const {
    float wi = w[i], mi = m[i], vi = v[i];
    el::adam(wi, mi, vi, g[i], c);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
  }
  __device__ void vector(size_t i) const {
    float4 wv = load4(w + i);
    float4 mv = load4(m + i);
    float4 vv = load4(v + i);
    const float4 gv = load4(g + i);
    el::adam(wv.x, mv.x, vv.x, gv.x, c);
    el::adam(wv.y, mv.y, vv.y, gv.y, c);
    el::adam(wv.z, mv.z, vv.z, gv.z, c);
    el::adam(wv.w, mv.w, vv.w, gv.w, c);
    store4(w + i, wv);
    store4(m + i, mv);
    store4(v + i, vv);
  }
};

template <bool kBf16>
struct Narrow {
  static constexpr size_t kLanes = 8;
  uint16_t* out;
  const float* in;
  static __device__ __forceinline__ uint16_t narrow(float x) {
    return kBf16 ? el::f32_to_bf16(x) : el::f32_to_f16(x);
  }
  __device__ void scalar(size_t i) const { out[i] = narrow(in[i]); }
  __device__ void vector(size_t i) const {
    const float4 lo = load4(in + i);
    const float4 hi = load4(in + i + 4);
    Halves h{};
    h.set(0, narrow(lo.x));
    h.set(1, narrow(lo.y));
    h.set(2, narrow(lo.z));
    h.set(3, narrow(lo.w));
    h.set(4, narrow(hi.x));
    h.set(5, narrow(hi.y));
    h.set(6, narrow(hi.z));
    h.set(7, narrow(hi.w));
    store_halves(out + i, h);
  }
};

template <bool kBf16>
struct Widen {
  static constexpr size_t kLanes = 8;
  float* out;
  const uint16_t* in;
  static __device__ __forceinline__ float widen(uint16_t h) {
    return kBf16 ? el::bf16_to_f32(h) : el::f16_to_f32(h);
  }
  __device__ void scalar(size_t i) const { out[i] = widen(in[i]); }
  __device__ void vector(size_t i) const {
    const Halves h = load_halves(in + i);
    store4(out + i,
           make_float4(widen(h.get(0)), widen(h.get(1)), widen(h.get(2)), widen(h.get(3))));
    store4(out + i + 4,
           make_float4(widen(h.get(4)), widen(h.get(5)), widen(h.get(6)), widen(h.get(7))));
  }
};

// ---------------------------------------------------------------------------
// Launching

// Enough blocks to fill the current device, from its SM count, cached per
// device (the query is a driver call; kernels are launched millions of times).
Status max_blocks(const char* name, unsigned* blocks) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_failure(std::string(name) + ": cudaGetDevice", e);
  constexpr int kCachedDevices = 64;
  static std::atomic<int> sm_counts[kCachedDevices] = {};
  int sms = device < kCachedDevices ? sm_counts[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return cuda_failure(std::string(name) + ": cudaDeviceGetAttribute", e);
    if (device < kCachedDevices) sm_counts[device].store(sms, std::memory_order_relaxed);
  }
  *blocks = static_cast<unsigned>(std::max(sms, 1)) * kBlocksPerSm;
  return {};
}

Status check_arrays(const char* name, const el::ArrayShape* arrays, size_t count) {
  for (size_t a = 0; a < count; ++a) {
    if (arrays[a].data == nullptr) {
      return InvalidArgument(std::string(name) + ": array " + std::to_string(a) +
                             " is null with n > 0");
    }
    if (reinterpret_cast<uintptr_t>(arrays[a].data) % arrays[a].element_size != 0) {
      return InvalidArgument(std::string(name) + ": array " + std::to_string(a) +
                             " is not aligned to its " + std::to_string(arrays[a].element_size) +
                             "-byte element size");
    }
  }
  return {};
}

template <class Op, size_t kArrays>
Status launch(const char* name, const Op& op, size_t n, const el::ArrayShape (&arrays)[kArrays],
              void* stream) {
  if (n == 0) return {};
  if (Status s = check_arrays(name, arrays, kArrays); !s.ok()) return s;
  if (Status s = device_status(); !s.ok()) {
    return Status(s.code(), std::string(name) + ": no CUDA device: " + s.message());
  }
  unsigned limit = 0;
  if (Status s = max_blocks(name, &limit); !s.ok()) return s;
  const el::VectorPlan plan = el::plan_vectors(n, Op::kLanes, arrays, kArrays);
  const size_t singles = n - plan.vectors * Op::kLanes;
  const size_t items = std::max(plan.vectors, singles);
  const size_t wanted = (items + kBlockThreads - 1) / kBlockThreads;
  const auto blocks = static_cast<unsigned>(std::min<size_t>(wanted, limit));
  elementwise_kernel<Op><<<blocks, kBlockThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      op, n, plan.head, plan.vectors);
  // Reports (and clears) a failed launch: bad configuration, no kernel image
  // for this GPU, or an earlier sticky fault on the context.
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_failure(name, e);
  return {};
}

}  // namespace

Status reduce_f32(float* acc, const float* x, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{acc, 4}, {x, 4}};
  return launch("cuda reduce_f32", ReduceF32{acc, x}, n, arrays, stream);
}

Status reduce_f16(float* acc, const uint16_t* x, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{acc, 4}, {x, 2}};
  return launch("cuda reduce_f16", ReduceHalf<false>{acc, x}, n, arrays, stream);
}

Status reduce_bf16(float* acc, const uint16_t* x, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{acc, 4}, {x, 2}};
  return launch("cuda reduce_bf16", ReduceHalf<true>{acc, x}, n, arrays, stream);
}

Status scale_f32(float* x, float a, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{x, 4}};
  return launch("cuda scale_f32", ScaleF32{x, a}, n, arrays, stream);
}

Status sgd_f32(float* w, const float* g, size_t n, const SgdParams& p, void* stream) {
  const el::ArrayShape arrays[] = {{w, 4}, {g, 4}};
  return launch("cuda sgd_f32", Sgd{w, g, internal::sgd_consts(p)}, n, arrays, stream);
}

Status momentum_f32(float* w, float* buf, const float* g, size_t n, const MomentumParams& p,
                    void* stream) {
  // As on the CPU: momentum 0 is plain SGD and buf is neither read nor written.
  if (p.momentum == 0.0f) return sgd_f32(w, g, n, SgdParams{p.lr, p.weight_decay}, stream);
  const el::ArrayShape arrays[] = {{w, 4}, {buf, 4}, {g, 4}};
  return launch("cuda momentum_f32", Momentum{w, buf, g, internal::momentum_consts(p), p.nesterov},
                n, arrays, stream);
}

Status adam_f32(float* w, float* m, float* v, const float* g, size_t n, const AdamParams& p,
                void* stream) {
  const el::ArrayShape arrays[] = {{w, 4}, {m, 4}, {v, 4}, {g, 4}};
  return launch("cuda adam_f32", Adam{w, m, v, g, internal::adam_consts(p)}, n, arrays, stream);
}

Status f32_to_f16(uint16_t* out, const float* in, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{out, 2}, {in, 4}};
  return launch("cuda f32_to_f16", Narrow<false>{out, in}, n, arrays, stream);
}

Status f16_to_f32(float* out, const uint16_t* in, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{out, 4}, {in, 2}};
  return launch("cuda f16_to_f32", Widen<false>{out, in}, n, arrays, stream);
}

Status f32_to_bf16(uint16_t* out, const float* in, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{out, 2}, {in, 4}};
  return launch("cuda f32_to_bf16", Narrow<true>{out, in}, n, arrays, stream);
}

Status bf16_to_f32(float* out, const uint16_t* in, size_t n, void* stream) {
  const el::ArrayShape arrays[] = {{out, 4}, {in, 2}};
  return launch("cuda bf16_to_f32", Widen<true>{out, in}, n, arrays, stream);
}

}  // namespace psld::kernels::cuda
