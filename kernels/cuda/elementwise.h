// Private to kernels/cuda: the per-element arithmetic of the CUDA kernels and
// the split of an array into a 16-byte-vector body and scalar ends.
//
// The element functions are written once, for the device and (compiled as
// plain C++) for the host. On the device every operation is an explicit
// round-to-nearest intrinsic, which nvcc never fuses into an FMA whatever the
// flags; on the host they are the same IEEE operations the CPU kernels do.
// tests/cuda_kernels_test.cc runs the host build of them against the CPU
// kernels, so a slip in porting a formula fails on a machine without a GPU.
#ifndef PSLD_KERNELS_CUDA_ELEMENTWISE_H_
#define PSLD_KERNELS_CUDA_ELEMENTWISE_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/internal.h"

namespace psld::kernels::cuda::element {

using convert::bits_of;
using convert::float_of;
using convert::leading_zeros;

PSLD_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

PSLD_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

PSLD_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

PSLD_HOST_DEVICE float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// ---------------------------------------------------------------------------
// Conversions: kernels/cpu/convert.h, the same functions the CPU kernels use.

using convert::bf16_to_f32;
using convert::f16_to_f32;
using convert::f32_to_bf16;
using convert::f32_to_f16;

// ---------------------------------------------------------------------------
// The optimizers, as documented in cpu_kernels.h and written in scalar.cc:
// the same operations in the same order.

PSLD_HOST_DEVICE float sgd(float w, float g, const internal::SgdConsts& c) {
  if (c.has_wd) g = add(g, mul(c.wd, w));
  return add(w, mul(c.neg_lr, g));
}

// Only for momentum != 0; momentum == 0 is sgd() with buf untouched.
PSLD_HOST_DEVICE void momentum(float& w, float& buf, float g, const internal::MomentumConsts& c,
                               bool nesterov) {
  if (c.has_wd) g = add(g, mul(c.wd, w));
  const float b = add(mul(c.decay, buf), mul(c.g_scale, g));
  buf = b;
  const float d = nesterov ? add(g, mul(c.momentum, b)) : b;
  w = add(w, mul(c.neg_lr, d));
}

PSLD_HOST_DEVICE void adam(float& w, float& m, float& v, float g, const internal::AdamConsts& c) {
  float wi = w;
  if (c.coupled_wd) g = add(g, mul(c.wd, wi));
  if (c.decoupled_wd) wi = mul(wi, c.w_scale);
  const float mi = add(mul(c.b1, m), mul(c.one_minus_b1, g));
  const float vi = add(mul(c.b2, v), mul(mul(c.one_minus_b2, g), g));
  m = mi;
  v = vi;
  const float denom = add(div(sqrt(vi), c.bc2_sqrt), c.eps);
  w = add(wi, div(mul(c.neg_step, mi), denom));
}

// ---------------------------------------------------------------------------
// Vector plan (host side): elements [0, head) and [head + vectors * lanes, n)
// are done one at a time, the body in vectors of `lanes` elements, each array
// 16-byte aligned at every vector. `lanes` elements of every array must span
// a multiple of 16 bytes (4 or 8 for fp32, 8 for 16-bit types).

struct ArrayShape {
  const void* data;
  size_t element_size;
};

struct VectorPlan {
  size_t head;
  size_t vectors;
};

// The smallest head that aligns every array at once; when the arrays are
// misaligned differently from each other there is none, and everything is
// done element by element ({n, 0}).
inline VectorPlan plan_vectors(size_t n, size_t lanes, const ArrayShape* arrays, size_t count) {
  for (size_t head = 0; head < lanes && head < n; ++head) {
    bool aligned = true;
    for (size_t a = 0; a < count; ++a) {
      const auto address = reinterpret_cast<uintptr_t>(arrays[a].data);
      if ((address + head * arrays[a].element_size) % 16 != 0) aligned = false;
    }
    if (aligned) return {head, (n - head) / lanes};
  }
  return {n, 0};
}

}  // namespace psld::kernels::cuda::element

#endif  // PSLD_KERNELS_CUDA_ELEMENTWISE_H_
