// The portable kernels: plain C++, no intrinsics, for any CPU. They define
// the results; the SIMD files must match them bit for bit. The conversions
// work on the bit patterns with integer arithmetic, so they are exact and do
// not depend on the floating-point environment or on hardware support for
// fp16/bf16.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"

namespace psld::kernels {

uint16_t f32_to_f16_scalar(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) {
    // NaN: keep the top payload bits and set the quiet bit, which also keeps
    // a NaN whose payload sits only in the dropped low bits from becoming inf.
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs & 0x7fffffu) >> 13));
  }
  // 65520 = 65504 (max finite) + half an ulp; the tie goes to the even
  // neighbour, 65536, which is inf.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs >= 0x38800000u) {
    // Normal in fp16 (>= 2^-14): rebias the exponent (127 - 15 = 112) and
    // round the 13 dropped mantissa bits to nearest even; a carry out of the
    // mantissa correctly bumps the exponent.
    const uint32_t odd = (abs >> 13) & 1u;
    const uint32_t rounded = abs - (112u << 23) + 0xfffu + odd;
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  // fp16 subnormal or zero: the result is round(|x| / 2^-24). 2^-25 and below
  // (float subnormals included) round to zero; the tie at 2^-25 goes to even.
  if (abs <= 0x33000000u) return static_cast<uint16_t>(sign);
  const uint32_t exp = abs >> 23;                       // 102..112
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;  // |x| = mant * 2^(exp-150)
  const uint32_t shift = 126u - exp;                    // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 1024 is 2^-14, encoded right
  return static_cast<uint16_t>(sign | q);
}

float f16_to_f32_scalar(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {
    // inf, or NaN made quiet as vcvtph2ps does.
    const uint32_t quiet = mant != 0 ? 0x400000u : 0u;
    return std::bit_cast<float>(sign | 0x7f800000u | quiet | (mant << 13));
  }
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalise so the leading 1 becomes the implicit bit.
  const int lz = std::countl_zero(mant) - 21;  // moves the leading 1 up to bit 10
  const uint32_t norm = (mant << lz) & 0x3ffu;
  const uint32_t e = 113u - static_cast<uint32_t>(lz);  // 2^-14 is exponent 113
  return std::bit_cast<float>(sign | (e << 23) | (norm << 13));
}

uint16_t f32_to_bf16_scalar(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  // NaN first: adding the rounding bias to a NaN with a large payload would
  // carry into the exponent and sign, or drop the payload and leave inf.
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  // Round to nearest even on the integer: add just under half an ulp, plus
  // one if the kept part is odd. This is what the SIMD paths compute too;
  // vcvtneps2bf16 is not used because it flushes subnormals.
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float bf16_to_f32_scalar(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
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
