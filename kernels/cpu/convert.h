// The fp32 <-> fp16/bf16 conversions of one element, on the bit patterns
// with integer arithmetic: exact, independent of the floating-point
// environment and of hardware fp16/bf16 support. They define the results of
// every kernel that converts: the CPU kernels (kernels/cpu/scalar.cc; the
// SIMD files match them bit for bit) and the CUDA kernels, which compile the
// same functions for the device (kernels/cuda/elementwise.h).
#ifndef PSLD_KERNELS_CPU_CONVERT_H_
#define PSLD_KERNELS_CPU_CONVERT_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PSLD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PSLD_HOST_DEVICE inline
#endif

namespace psld::kernels::convert {

PSLD_HOST_DEVICE uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

PSLD_HOST_DEVICE float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// x != 0.
PSLD_HOST_DEVICE int leading_zeros(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(x));
#else
  return __builtin_clz(x);
#endif
}

PSLD_HOST_DEVICE uint16_t f32_to_f16(float x) {
  const uint32_t bits = bits_of(x);
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

PSLD_HOST_DEVICE float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {
    // inf, or NaN made quiet as vcvtph2ps does.
    const uint32_t quiet = mant != 0 ? 0x400000u : 0u;
    return float_of(sign | 0x7f800000u | quiet | (mant << 13));
  }
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return float_of(sign);
  // Subnormal: normalise so the leading 1 becomes the implicit bit.
  const int lz = leading_zeros(mant) - 21;  // moves the leading 1 up to bit 10
  const uint32_t norm = (mant << lz) & 0x3ffu;
  const uint32_t e = 113u - static_cast<uint32_t>(lz);  // 2^-14 is exponent 113
  return float_of(sign | (e << 23) | (norm << 13));
}

PSLD_HOST_DEVICE uint16_t f32_to_bf16(float x) {
  const uint32_t bits = bits_of(x);
  // NaN first: adding the rounding bias to a NaN with a large payload would
  // carry into the exponent and sign, or drop the payload and leave inf.
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  // Round to nearest even on the integer: add just under half an ulp, plus
  // one if the kept part is odd. This is what the SIMD paths compute too;
  // vcvtneps2bf16 is not used because it flushes subnormals.
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

PSLD_HOST_DEVICE float bf16_to_f32(uint16_t h) {
  return float_of(static_cast<uint32_t>(h) << 16);
}

}  // namespace psld::kernels::convert

#endif  // PSLD_KERNELS_CPU_CONVERT_H_
