// The AVX2 + F16C kernels (8 fp32 lanes). Built with -mavx2 -mf16c and only
// ever called after dispatch.cc has checked the CPU.

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"

namespace psld::kernels {
namespace {

constexpr Isa kIsa = Isa::kAvx2;
using V = __m256;
constexpr size_t kLanes = 8;

inline V vadd(V a, V b) {
  return _mm256_add_ps(a, b);
}
inline V vmul(V a, V b) {
  return _mm256_mul_ps(a, b);
}
inline V vdiv(V a, V b) {
  return _mm256_div_ps(a, b);
}
inline V vsqrt(V a) {
  return _mm256_sqrt_ps(a);
}
inline V vset1(float a) {
  return _mm256_set1_ps(a);
}

// vcvtps2ph with an immediate rounding mode ignores MXCSR.RC; round to
// nearest even is what scalar.cc implements.
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// fp32 -> bf16 bits, round to nearest even, as f32_to_bf16_scalar does it:
// integer arithmetic, NaNs patched afterwards.
inline __m128i to_bf16(V v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(x, 16);
  const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, bias), 16);
  const __m256i abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  // Signed compare is safe: abs is at most 0x7fffffff.
  const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
  // Every lane is in [0, 0xffff], so the saturating pack is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline V from_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m128i load_u16x8(const uint16_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline void store_u16x8(uint16_t* p, __m128i h) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

struct Full {
  V ld(const float* p) const { return _mm256_loadu_ps(p); }
  void st(float* p, V v) const { _mm256_storeu_ps(p, v); }
  V ld_f16(const uint16_t* p) const { return _mm256_cvtph_ps(load_u16x8(p)); }
  void st_f16(uint16_t* p, V v) const { store_u16x8(p, _mm256_cvtps_ph(v, kRoundNearest)); }
  V ld_bf16(const uint16_t* p) const { return from_bf16(load_u16x8(p)); }
  void st_bf16(uint16_t* p, V v) const { store_u16x8(p, to_bf16(v)); }
};

// Lane j is enabled iff kMaskTable[8 - r + j] is -1, i.e. j < r.
alignas(64) constexpr int32_t kMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                0,  0,  0,  0,  0,  0,  0,  0};

// The last r < 8 elements. fp32 uses vmaskmov, which does not fault on the
// disabled lanes; AVX2 has no 16-bit masked move, so 16-bit data goes through
// a stack buffer (a tail is at most 14 bytes).
struct Part {
  size_t r;
  __m256i mask;

  V ld(const float* p) const { return _mm256_maskload_ps(p, mask); }
  void st(float* p, V v) const { _mm256_maskstore_ps(p, mask, v); }
  V ld_f16(const uint16_t* p) const { return _mm256_cvtph_ps(load(p)); }
  void st_f16(uint16_t* p, V v) const { store(p, _mm256_cvtps_ph(v, kRoundNearest)); }
  V ld_bf16(const uint16_t* p) const { return from_bf16(load(p)); }
  void st_bf16(uint16_t* p, V v) const { store(p, to_bf16(v)); }

  __m128i load(const uint16_t* p) const {
    uint16_t b[8] = {};
    std::memcpy(b, p, r * sizeof(uint16_t));
    return load_u16x8(b);
  }
  void store(uint16_t* p, __m128i h) const {
    uint16_t b[8];
    store_u16x8(b, h);
    std::memcpy(p, b, r * sizeof(uint16_t));
  }
};

inline Part make_part(size_t r) {
  return {r, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTable + 8 - r))};
}

#include "kernels/cpu/simd_body.inc"

}  // namespace

const KernelTable internal::kAvx2Table = kTable;

}  // namespace psld::kernels
