// The AVX-512 kernels (16 fp32 lanes; F for the arithmetic, BW/VL for masked
// 16-bit loads and stores, F16C for fp16). Built with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mf16c and only ever called after dispatch.cc has
// checked the CPU. Tails use masked moves, which do not fault on the disabled
// lanes.

// GCC 12.2 reports its own _mm512_undefined_*() placeholders (`__m512 __Y =
// __Y;`) as maybe-uninitialized once they are inlined at -O3 (GCC bug
// 105593, fixed in 12.3/13); the diagnostic is silenced for the header only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"

namespace psld::kernels {
namespace {

constexpr Isa kIsa = Isa::kAvx512;
using V = __m512;
constexpr size_t kLanes = 16;

inline V vadd(V a, V b) {
  return _mm512_add_ps(a, b);
}
inline V vmul(V a, V b) {
  return _mm512_mul_ps(a, b);
}
inline V vdiv(V a, V b) {
  return _mm512_div_ps(a, b);
}
inline V vsqrt(V a) {
  return _mm512_sqrt_ps(a);
}
inline V vset1(float a) {
  return _mm512_set1_ps(a);
}

// vcvtps2ph with an immediate rounding mode ignores MXCSR.RC; round to
// nearest even is what scalar.cc implements.
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// fp32 -> bf16 bits (in the low half of each 32-bit lane), round to nearest
// even with integer arithmetic as f32_to_bf16_scalar does; vcvtneps2bf16
// (AVX512_BF16) would be one instruction but flushes subnormals to zero.
// Seven integer operations per vector make it ALU-bound in cache (4 KiB:
// 35 ns against 13 ns for fp16 through vcvtps2ph, Zen 4).
inline __m512i to_bf16(V v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(x, 16);
  const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, bias), 16);
  const __mmask16 is_nan = _mm512_fpclass_ps_mask(v, 0x81);  // QNaN | SNaN
  return _mm512_mask_or_epi32(rounded, is_nan, hi, _mm512_set1_epi32(0x40));
}

inline V from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i load_u16x16(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void store_u16x16(uint16_t* p, __m256i h) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

struct Full {
  V ld(const float* p) const { return _mm512_loadu_ps(p); }
  void st(float* p, V v) const { _mm512_storeu_ps(p, v); }
  V ld_f16(const uint16_t* p) const { return _mm512_cvtph_ps(load_u16x16(p)); }
  void st_f16(uint16_t* p, V v) const { store_u16x16(p, _mm512_cvtps_ph(v, kRoundNearest)); }
  V ld_bf16(const uint16_t* p) const { return from_bf16(load_u16x16(p)); }
  void st_bf16(uint16_t* p, V v) const { store_u16x16(p, _mm512_cvtepi32_epi16(to_bf16(v))); }
};

struct Part {
  __mmask16 k;

  V ld(const float* p) const { return _mm512_maskz_loadu_ps(k, p); }
  void st(float* p, V v) const { _mm512_mask_storeu_ps(p, k, v); }
  V ld_f16(const uint16_t* p) const { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
  void st_f16(uint16_t* p, V v) const {
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtps_ph(v, kRoundNearest));
  }
  V ld_bf16(const uint16_t* p) const { return from_bf16(_mm256_maskz_loadu_epi16(k, p)); }
  void st_bf16(uint16_t* p, V v) const { _mm512_mask_cvtepi32_storeu_epi16(p, k, to_bf16(v)); }
};

inline Part make_part(size_t r) {
  return {static_cast<__mmask16>((1u << r) - 1u)};
}

#include "kernels/cpu/simd_body.inc"

}  // namespace

const KernelTable internal::kAvx512Table = kTable;

}  // namespace psld::kernels
