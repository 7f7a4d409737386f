// The portable kernels: plain C++, no intrinsics, for any CPU. They define
// the results; the SIMD files must match them bit for bit. The conversions
// work on the bit patterns with integer arithmetic, so they are exact and do
// not depend on the floating-point environment or on hardware support for
// fp16/bf16.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"

namespace psld::kernels {

uint16_t f32_to_f16_scalar(float x) {
  return convert::f32_to_f16(x);
}

float f16_to_f32_scalar(uint16_t h) {
  return convert::f16_to_f32(h);
}

uint16_t f32_to_bf16_scalar(float x) {
  return convert::f32_to_bf16(x);
}

float bf16_to_f32_scalar(uint16_t h) {
  return convert::bf16_to_f32(h);
}

namespace internal {

SgdConsts sgd_consts(const SgdParams& p) {
  return {-p.lr, p.weight_decay, p.weight_decay != 0.0f};
}

MomentumConsts momentum_consts(const MomentumParams& p) {
  MomentumConsts c{};
  c.neg_lr = -p.lr;
  c.wd = p.weight_decay;
  c.has_wd = p.weight_decay != 0.0f;
  c.momentum = p.momentum;
  c.decay = p.first_step ? 0.0f : p.momentum;
  c.g_scale = p.first_step ? 1.0f : static_cast<float>(1.0 - static_cast<double>(p.dampening));
  return c;
}

AdamConsts adam_consts(const AdamParams& p) {
  const double t = static_cast<double>(p.step == 0 ? 1 : p.step);
  const double b1 = p.beta1;
  const double b2 = p.beta2;
  const double bc1 = 1.0 - std::pow(b1, t);
  const double bc2 = 1.0 - std::pow(b2, t);
  AdamConsts c{};
  c.coupled_wd = !p.decoupled && p.weight_decay != 0.0f;
  c.decoupled_wd = p.decoupled && p.weight_decay != 0.0f;
  c.wd = p.weight_decay;
  c.w_scale = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  c.b1 = p.beta1;
  c.one_minus_b1 = static_cast<float>(1.0 - b1);
  c.b2 = p.beta2;
  c.one_minus_b2 = static_cast<float>(1.0 - b2);
  c.neg_step = static_cast<float>(-static_cast<double>(p.lr) / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = p.eps;
  return c;
}

}  // namespace internal

namespace {

void reduce_f32(float* acc, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    acc[i] = acc[i] + x[i];
}

void reduce_f16(float* acc, const uint16_t* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    acc[i] = acc[i] + f16_to_f32_scalar(x[i]);
}

void reduce_bf16(float* acc, const uint16_t* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    acc[i] = acc[i] + bf16_to_f32_scalar(x[i]);
}

void scale_f32(float* x, float a, size_t n) {
  for (size_t i = 0; i < n; ++i)
    x[i] = x[i] * a;
}

// Named apart from sgd_f32: a call to that with a SgdParams argument would
// also find psld::kernels::sgd_f32 by argument-dependent lookup.
void sgd_loop(float* w, const float* g, size_t n, const internal::SgdConsts& c) {
  for (size_t i = 0; i < n; ++i) {
    float gi = g[i];
    if (c.has_wd) gi = gi + c.wd * w[i];
    w[i] = w[i] + c.neg_lr * gi;
  }
}

void sgd_f32(float* w, const float* g, size_t n, const SgdParams& p) {
  sgd_loop(w, g, n, internal::sgd_consts(p));
}

void momentum_f32(float* w, float* buf, const float* g, size_t n, const MomentumParams& p) {
  if (p.momentum == 0.0f) return sgd_loop(w, g, n, internal::sgd_consts({p.lr, p.weight_decay}));
  const internal::MomentumConsts c = internal::momentum_consts(p);
  for (size_t i = 0; i < n; ++i) {
    float gi = g[i];
    if (c.has_wd) gi = gi + c.wd * w[i];
    const float b = c.decay * buf[i] + c.g_scale * gi;
    buf[i] = b;
    const float d = p.nesterov ? gi + c.momentum * b : b;
    w[i] = w[i] + c.neg_lr * d;
  }
}

void adam_f32(float* w, float* m, float* v, const float* g, size_t n, const AdamParams& p) {
  const internal::AdamConsts c = internal::adam_consts(p);
  for (size_t i = 0; i < n; ++i) {
    float wi = w[i];
    float gi = g[i];
    if (c.coupled_wd) gi = gi + c.wd * wi;
    if (c.decoupled_wd) wi = wi * c.w_scale;
    const float mi = c.b1 * m[i] + c.one_minus_b1 * gi;
    const float vi = c.b2 * v[i] + (c.one_minus_b2 * gi) * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    w[i] = wi + (c.neg_step * mi) / denom;
  }
}

void f32_to_f16(uint16_t* out, const float* in, size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = f32_to_f16_scalar(in[i]);
}

void f16_to_f32(float* out, const uint16_t* in, size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = f16_to_f32_scalar(in[i]);
}

void f32_to_bf16(uint16_t* out, const float* in, size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = f32_to_bf16_scalar(in[i]);
}

void bf16_to_f32(float* out, const uint16_t* in, size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = bf16_to_f32_scalar(in[i]);
}

// Initialised here, where the names above hide the inline dispatching ones
// in psld::kernels.
constexpr KernelTable kTable = {
    Isa::kScalar, reduce_f32, reduce_f16, reduce_bf16, scale_f32,   sgd_f32,
    momentum_f32, adam_f32,   f32_to_f16, f16_to_f32,  f32_to_bf16, bf16_to_f32,
};

}  // namespace

const KernelTable internal::kScalarTable = kTable;

}  // namespace psld::kernels
