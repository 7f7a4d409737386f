// The CPU kernels, every ISA this machine runs, against references written
// here: the fp16/bf16 formats decoded and rounded from first principles in
// double precision, and the documented fp32 formulas of the optimizers. An
// ISA the CPU lacks is skipped, not passed.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace psld::kernels {
namespace {

// ---------------------------------------------------------------------------
// Helpers

uint32_t bits_of(float f) {
  return std::bit_cast<uint32_t>(f);
}
float float_of(uint32_t b) {
  return std::bit_cast<float>(b);
}

// Distance in representable floats; +0 and -0 are the same point. NaN is
// at distance 0 from NaN and infinitely far from everything else.
int64_t ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::isnan(a) && std::isnan(b) ? 0 : std::numeric_limits<int64_t>::max();
  }
  auto key = [](float f) {
    const uint32_t u = bits_of(f);
    const int64_t mag = u & 0x7fffffffu;
    return (u >> 31) ? -mag : mag;
  };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

TEST(UlpDistance, CountsRepresentableSteps) {
  EXPECT_EQ(ulp_distance(1.0f, 1.0f), 0);
  EXPECT_EQ(ulp_distance(1.0f, std::nextafter(1.0f, 2.0f)), 1);
  EXPECT_EQ(ulp_distance(0.0f, -0.0f), 0);
  EXPECT_EQ(ulp_distance(float_of(1), -float_of(1)), 2);  // across zero
  EXPECT_EQ(ulp_distance(1.0f, 2.0f), 1 << 23);
  EXPECT_EQ(ulp_distance(NAN, NAN), 0);
  EXPECT_EQ(ulp_distance(NAN, 1.0f), std::numeric_limits<int64_t>::max());
}

// An array placed `offset` elements past a 64-byte boundary, between runs of
// sentinels, so a kernel that reads or writes past either end, or that only
// works on aligned data, is caught.
template <class T>
class Guarded {
 public:
  static constexpr size_t kGuard = 64;  // elements on each side

  Guarded(size_t n, size_t offset) : n_(n), storage_(n + offset + 2 * kGuard + 64) {
    std::fill(storage_.begin(), storage_.end(), sentinel());
    const auto addr = reinterpret_cast<uintptr_t>(storage_.data() + kGuard);
    const size_t skip = ((64 - addr % 64) % 64) / sizeof(T);
    data_ = storage_.data() + kGuard + skip + offset;
  }
  Guarded(const std::vector<T>& values, size_t offset) : Guarded(values.size(), offset) {
    std::copy(values.begin(), values.end(), data_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  std::vector<T> values() const { return std::vector<T>(data_, data_ + n_); }

  bool guards_intact() const {
    auto same = [](const T& a) { return std::memcmp(&a, &kSentinel, sizeof(T)) == 0; };
    const T* begin = data_;
    const T* end = data_ + n_;
    return std::all_of(storage_.data(), begin, same) &&
           std::all_of(end, storage_.data() + storage_.size(), same);
  }

 private:
  // A signalling NaN for float, so a stray read that gets used shows too.
  static T sentinel() {
    if constexpr (sizeof(T) == 4) {
      return std::bit_cast<T>(0x7fa5a5a5u);
    } else {
      return std::bit_cast<T>(static_cast<uint16_t>(0xa5a5u));
    }
  }
  static inline const T kSentinel = sentinel();

  size_t n_;
  std::vector<T> storage_;
  T* data_;
};

// Every length up to 130 (all the tail and unroll cases of 8- and 16-lane
// code), then a stride up to 1025 with the powers of two and their
// neighbours.
std::vector<size_t> test_lengths() {
  std::set<size_t> s;
  for (size_t n = 0; n <= 130; ++n)
    s.insert(n);
  for (size_t n = 131; n <= 1025; n += 29)
    s.insert(n);
  for (size_t n : {255, 256, 257, 511, 512, 513, 1023, 1024, 1025})
    s.insert(n);
  return {s.begin(), s.end()};
}

// Element offsets from a 64-byte boundary for the (up to four) arrays of one
// call: each array misaligned, and misaligned differently from the others.
struct Offsets {
  size_t a, b, c, d;
};
std::vector<Offsets> test_offsets() {
  return {{0, 0, 0, 0}, {1, 2, 3, 0}, {3, 1, 0, 2}, {2, 3, 1, 1}};
}

std::vector<float> uniform(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v)
    x = dist(rng);
  return v;
}

std::vector<float> integers(std::mt19937& rng, size_t n, int lo, int hi) {
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v)
    x = static_cast<float>(dist(rng));
  return v;
}

std::vector<uint16_t> random_u16(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<uint32_t> dist(0, 0xffff);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v)
    x = static_cast<uint16_t>(dist(rng));
  return v;
}

// ---------------------------------------------------------------------------
// fp16 / bf16 from first principles: a format with E exponent and M mantissa
// bits, decoded in double (exact for both), and fp32 -> format by searching
// the sorted table of all its values for the two neighbours of x.

struct MiniFloat {
  int exp_bits;
  int mant_bits;

  uint32_t inf_bits() const { return ((1u << exp_bits) - 1u) << mant_bits; }
  uint32_t sign_bit() const { return 1u << (exp_bits + mant_bits); }

  // Value of a non-negative pattern up to inf_bits(); inf_bits() itself gives
  // 2^(emax+1), the "next value" past the largest finite one, which is what
  // round to nearest even compares against when deciding to overflow.
  double magnitude(uint32_t p) const {
    const int bias = (1 << (exp_bits - 1)) - 1;
    const uint32_t exp = p >> mant_bits;
    const uint32_t mant = p & ((1u << mant_bits) - 1u);
    if (exp == 0) return std::ldexp(static_cast<double>(mant), 1 - bias - mant_bits);
    return std::ldexp(static_cast<double>(mant + (1u << mant_bits)),
                      static_cast<int>(exp) - bias - mant_bits);
  }

  std::vector<double> table() const {
    std::vector<double> t(inf_bits() + 1);
    for (uint32_t p = 0; p <= inf_bits(); ++p)
      t[p] = magnitude(p);
    return t;
  }

  // Round |x| (finite or inf, not NaN) to nearest, ties to the even pattern.
  uint32_t round(float x, const std::vector<double>& table) const {
    const uint32_t sign = std::signbit(x) ? sign_bit() : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= table.back()) return sign | inf_bits();
    const auto p =
        static_cast<uint32_t>(std::upper_bound(table.begin(), table.end(), a) - table.begin() - 1);
    // Both differences are exact in double: near a tie x sits within a
    // factor of two of both neighbours.
    const double below = a - table[p];
    const double above = table[p + 1] - a;
    uint32_t r = p;
    if (above < below || (above == below && (p & 1u))) r = p + 1;
    return sign | r;
  }
};

constexpr MiniFloat kF16{5, 10};
constexpr MiniFloat kBf16{8, 7};

const std::vector<double>& f16_table() {
  static const std::vector<double> t = kF16.table();
  return t;
}
const std::vector<double>& bf16_table() {
  static const std::vector<double> t = kBf16.table();
  return t;
}

// The documented NaN rules: quiet bit set, sign and top payload bits kept.
uint16_t ref_f32_to_f16(float x) {
  const uint32_t b = bits_of(x);
  if (std::isnan(x))
    return static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7e00u | ((b & 0x7fffffu) >> 13));
  return static_cast<uint16_t>(kF16.round(x, f16_table()));
}

uint16_t ref_f32_to_bf16(float x) {
  const uint32_t b = bits_of(x);
  if (std::isnan(x)) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>(kBf16.round(x, bf16_table()));
}

// NaN comes back quiet, as vcvtph2ps returns it.
uint32_t ref_f16_to_f32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  if (mag > kF16.inf_bits()) return sign | 0x7fc00000u | ((mag & 0x3ffu) << 13);
  if (mag == kF16.inf_bits()) return sign | 0x7f800000u;
  return sign | bits_of(static_cast<float>(kF16.magnitude(mag)));
}

// NaN payloads pass through untouched (a pure widening).
uint32_t ref_bf16_to_f32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  if (mag > kBf16.inf_bits()) return sign | 0x7f800000u | ((mag & 0x7fu) << 16);
  if (mag == kBf16.inf_bits()) return sign | 0x7f800000u;
  return sign | bits_of(static_cast<float>(kBf16.magnitude(mag)));
}

TEST(Reference, SpotValues) {
  // Pin the reference itself to known encodings, so the comparisons below
  // do not rest on a reference that is wrong the same way as the kernels.
  EXPECT_EQ(ref_f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(ref_f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(ref_f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(ref_f32_to_f16(65519.996f), 0x7bff);
  EXPECT_EQ(ref_f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(ref_f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(ref_f32_to_f16(0x1p-25f), 0x0000);         // tie to even (0)
  EXPECT_EQ(ref_f32_to_f16(0x1.8p-24f), 0x0002);       // tie to even (2)
  EXPECT_EQ(ref_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);  // tie to even (down)
  EXPECT_EQ(ref_f32_to_f16(1.0f + 0x3p-11f), 0x3c02);  // tie to even (up)
  EXPECT_EQ(ref_f32_to_f16(float_of(0xff800001u)), 0xfe00);
  EXPECT_EQ(ref_f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x7f7fffffu)), 0x7f80);  // max float rounds to inf
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x7fffffffu)), 0x7fff);  // NaN stays NaN
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x00000001u)), 0x0000);
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x00008000u)), 0x0000);  // tie to even (down)
  EXPECT_EQ(ref_f32_to_bf16(float_of(0x00018000u)), 0x0002);  // subnormal tie up
  EXPECT_EQ(ref_f16_to_f32_bits(0x0001), bits_of(0x1p-24f));
  EXPECT_EQ(ref_f16_to_f32_bits(0x7bff), bits_of(65504.0f));
  EXPECT_EQ(ref_f16_to_f32_bits(0x7d00), 0x7fe00000u);  // signalling NaN made quiet
  EXPECT_EQ(ref_bf16_to_f32_bits(0x7f81), 0x7f810000u);
}

// fp32 inputs for the narrowing conversions: every special value, every
// fp16 and bf16 value with its rounding midpoints and their neighbours
// (subnormals, ties, the overflow threshold), and random bit patterns.
const std::vector<float>& narrowing_inputs() {
  static const std::vector<float> inputs = [] {
    std::vector<float> v;
    auto add_around = [&v](float x) {
      for (float s : {x, -x}) {
        v.push_back(s);
        v.push_back(std::nextafter(s, -INFINITY));
        v.push_back(std::nextafter(s, INFINITY));
      }
    };
    for (const auto& [fmt, table] :
         {std::pair{kF16, &f16_table()}, std::pair{kBf16, &bf16_table()}}) {
      for (uint32_t p = 0; p < fmt.inf_bits(); ++p) {
        add_around(static_cast<float>((*table)[p]));
        add_around(static_cast<float>(((*table)[p] + (*table)[p + 1]) / 2));  // exact in float
      }
    }
    for (uint32_t b :
         {0x00000000u, 0x00000001u, 0x007fffffu, 0x00800000u, 0x7f7fffffu, 0x7f800000u, 0x7f800001u,
          0x7fbfffffu, 0x7fc00000u, 0x7fc00001u, 0x7fffffffu, 0x7f802000u, 0x7f801fffu, 0x7fffe000u,
          0x7f80ffffu, 0x7f810000u, 0x7fff8000u, 0x477fefffu, 0x477ff000u, 0x477ff001u}) {
      v.push_back(float_of(b));
      v.push_back(float_of(b | 0x80000000u));
    }
    std::mt19937 rng(7);
    std::uniform_int_distribution<uint32_t> dist;
    for (int i = 0; i < 200000; ++i)
      v.push_back(float_of(dist(rng)));
    return v;
  }();
  return inputs;
}

TEST(ScalarHelpers, MatchReference) {
  for (float x : narrowing_inputs()) {
    ASSERT_EQ(f32_to_f16_scalar(x), ref_f32_to_f16(x)) << std::hex << bits_of(x);
    ASSERT_EQ(f32_to_bf16_scalar(x), ref_f32_to_bf16(x)) << std::hex << bits_of(x);
  }
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    ASSERT_EQ(bits_of(f16_to_f32_scalar(static_cast<uint16_t>(h))),
              ref_f16_to_f32_bits(static_cast<uint16_t>(h)))
        << std::hex << h;
    ASSERT_EQ(bits_of(bf16_to_f32_scalar(static_cast<uint16_t>(h))),
              ref_bf16_to_f32_bits(static_cast<uint16_t>(h)))
        << std::hex << h;
  }
}

// ---------------------------------------------------------------------------
// The optimizers as documented in cpu_kernels.h, in fp32, one rounding per
// operation. This file is built for baseline x86-64, which has no FMA, so
// the compiler cannot fuse these either.

void ref_sgd(float& w, float g, const SgdParams& p) {
  if (p.weight_decay != 0) g = g + p.weight_decay * w;
  w = w + (-p.lr) * g;
}

void ref_momentum(float& w, float& buf, float g, const MomentumParams& p) {
  if (p.momentum == 0) return ref_sgd(w, g, {p.lr, p.weight_decay});
  if (p.weight_decay != 0) g = g + p.weight_decay * w;
  const float damp = static_cast<float>(1.0 - static_cast<double>(p.dampening));
  buf = p.first_step ? 0.0f * buf + 1.0f * g : p.momentum * buf + damp * g;
  const float d = p.nesterov ? g + p.momentum * buf : buf;
  w = w + (-p.lr) * d;
}

struct AdamScalars {
  float one_minus_b1, one_minus_b2, neg_step, bc2_sqrt, w_scale;
};
AdamScalars adam_scalars(const AdamParams& p) {
  const double t = static_cast<double>(std::max<uint64_t>(p.step, 1));
  return {
      static_cast<float>(1.0 - p.beta1),
      static_cast<float>(1.0 - p.beta2),
      static_cast<float>(-static_cast<double>(p.lr) / (1.0 - std::pow(double{p.beta1}, t))),
      static_cast<float>(std::sqrt(1.0 - std::pow(double{p.beta2}, t))),
      static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay),
  };
}

void ref_adam(float& w, float& m, float& v, float g, const AdamParams& p) {
  const AdamScalars s = adam_scalars(p);
  if (p.weight_decay != 0 && !p.decoupled) g = g + p.weight_decay * w;
  if (p.weight_decay != 0 && p.decoupled) w = w * s.w_scale;
  m = p.beta1 * m + s.one_minus_b1 * g;
  v = p.beta2 * v + (s.one_minus_b2 * g) * g;
  w = w + (s.neg_step * m) / (std::sqrt(v) / s.bc2_sqrt + p.eps);
}

// The same formulas in double, from the same fp32 inputs, for the accuracy
// bound against exact arithmetic.
void exact_adam(double& w, double& m, double& v, double g, const AdamParams& p) {
  const double t = static_cast<double>(std::max<uint64_t>(p.step, 1));
  const double b1 = p.beta1, b2 = p.beta2, lr = p.lr, wd = p.weight_decay;
  if (wd != 0 && !p.decoupled) g = g + wd * w;
  if (wd != 0 && p.decoupled) w = w * (1 - lr * wd);
  m = b1 * m + (1 - b1) * g;
  v = b2 * v + (1 - b2) * g * g;
  w = w -
      (lr / (1 - std::pow(b1, t))) * m / (std::sqrt(v) / std::sqrt(1 - std::pow(b2, t)) + p.eps);
}

void exact_momentum(double& w, double& buf, double g, const MomentumParams& p) {
  if (p.weight_decay != 0) g = g + double{p.weight_decay} * w;
  buf = p.first_step ? g : p.momentum * buf + (1 - double{p.dampening}) * g;
  const double d = p.nesterov ? g + p.momentum * buf : buf;
  w = w - double{p.lr} * d;
}

// ---------------------------------------------------------------------------
// Kernel tests, instantiated for every ISA.

class KernelTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "CPU lacks " << isa_name(GetParam());
    k_ = kernels_for(GetParam());
    ASSERT_NE(k_, nullptr);
    ASSERT_EQ(k_->isa, GetParam());
  }

  const KernelTable* k_ = nullptr;
  std::mt19937 rng_{42};
};

std::string shape(size_t n, const Offsets& o) {
  std::ostringstream s;
  s << "n=" << n << " offsets=" << o.a << "," << o.b << "," << o.c << "," << o.d;
  return s.str();
}

// Bitwise, except that any NaN matches any NaN (IEEE leaves the payload of
// an operation on two NaNs open, and compilers swap operands of an add).
::testing::AssertionResult same_float(float expected, float actual) {
  if (bits_of(expected) == bits_of(actual) || (std::isnan(expected) && std::isnan(actual))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "expected " << expected << " (0x" << std::hex << bits_of(expected) << ") got " << actual
         << " (0x" << bits_of(actual) << ")";
}

TEST_P(KernelTest, ReduceF32IsExact) {
  for (size_t n : test_lengths()) {
    for (const Offsets& o : test_offsets()) {
      SCOPED_TRACE(shape(n, o));
      // Integers: the exact sum is known without fp32 arithmetic at all.
      const std::vector<float> a0 = integers(rng_, n, -1000000, 1000000);
      const std::vector<float> x0 = integers(rng_, n, -1000000, 1000000);
      Guarded<float> acc(a0, o.a);
      Guarded<float> x(x0, o.b);
      k_->reduce_f32(acc.data(), x.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(static_cast<double>(acc[i]), double{a0[i]} + double{x0[i]}) << "i=" << i;
      }
      ASSERT_TRUE(acc.guards_intact());
      ASSERT_TRUE(x.guards_intact());
      ASSERT_EQ(x.values(), x0);

      // Arbitrary values: one IEEE add each, so bit-exact.
      const std::vector<float> a1 = uniform(rng_, n, -1e3f, 1e3f);
      const std::vector<float> x1 = uniform(rng_, n, -1.0f, 1.0f);
      Guarded<float> acc1(a1, o.c);
      Guarded<float> xx(x1, o.d);
      k_->reduce_f32(acc1.data(), xx.data(), n);
      for (size_t i = 0; i < n; ++i)
        ASSERT_TRUE(same_float(a1[i] + x1[i], acc1[i])) << "i=" << i;
      ASSERT_TRUE(acc1.guards_intact());
    }
  }
}

TEST_P(KernelTest, ReduceF32SpecialValuesAndAliasing) {
  const std::vector<float> a0 = {INFINITY, -INFINITY, INFINITY, NAN,      1.0f,
                                 -0.0f,    -0.0f,     3e38f,    0x1p-149f};
  const std::vector<float> x0 = {1.0f, 2.0f, -INFINITY, 1.0f, NAN, -0.0f, 0.0f, 3e38f, 0x1p-149f};
  Guarded<float> acc(a0, 1);
  k_->reduce_f32(acc.data(), x0.data(), a0.size());
  for (size_t i = 0; i < a0.size(); ++i)
    EXPECT_TRUE(same_float(a0[i] + x0[i], acc[i])) << i;

  // acc and x may be the same array.
  for (size_t n : {0, 1, 17, 100}) {
    const std::vector<float> v = uniform(rng_, n, -1, 1);
    Guarded<float> a(v, 3);
    k_->reduce_f32(a.data(), a.data(), n);
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(a[i], v[i] + v[i]);
    ASSERT_TRUE(a.guards_intact());
  }
}

TEST_P(KernelTest, ReduceHalfIsExact) {
  struct Format {
    const char* name;
    void (*KernelTable::*fn)(float*, const uint16_t*, size_t);
    uint32_t (*widen)(uint16_t);
  };
  for (const Format& f : {Format{"f16", &KernelTable::reduce_f16, ref_f16_to_f32_bits},
                          Format{"bf16", &KernelTable::reduce_bf16, ref_bf16_to_f32_bits}}) {
    SCOPED_TRACE(f.name);
    for (size_t n : test_lengths()) {
      for (const Offsets& o : test_offsets()) {
        SCOPED_TRACE(shape(n, o));
        const std::vector<float> a0 = uniform(rng_, n, -1e3f, 1e3f);
        const std::vector<uint16_t> x0 = random_u16(rng_, n);  // inf and NaN included
        Guarded<float> acc(a0, o.a);
        Guarded<uint16_t> x(x0, o.b);
        (k_->*f.fn)(acc.data(), x.data(), n);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_float(a0[i] + float_of(f.widen(x0[i])), acc[i])) << "i=" << i;
        }
        ASSERT_TRUE(acc.guards_intact());
        ASSERT_TRUE(x.guards_intact());
        ASSERT_EQ(x.values(), x0);
      }
    }
  }
}

TEST_P(KernelTest, ScaleIsExact) {
  for (float a : {0.5f, -3.0f, 1.0f / 3.0f}) {
    for (size_t n : test_lengths()) {
      for (const Offsets& o : test_offsets()) {
        SCOPED_TRACE(shape(n, o));
        const std::vector<float> x0 = uniform(rng_, n, -1e3f, 1e3f);
        Guarded<float> x(x0, o.a);
        k_->scale_f32(x.data(), a, n);
        for (size_t i = 0; i < n; ++i)
          ASSERT_TRUE(same_float(x0[i] * a, x[i])) << "i=" << i;
        ASSERT_TRUE(x.guards_intact());
      }
    }
  }
}

TEST_P(KernelTest, WideningConversionsExhaustive) {
  std::vector<uint16_t> all(65536);
  for (uint32_t h = 0; h <= 0xffff; ++h)
    all[h] = static_cast<uint16_t>(h);
  for (size_t offset : {0, 1}) {
    Guarded<uint16_t> in(all, offset);
    Guarded<float> out(all.size(), offset + 2);
    k_->f16_to_f32(out.data(), in.data(), all.size());
    for (uint32_t h = 0; h <= 0xffff; ++h) {
      ASSERT_EQ(bits_of(out[h]), ref_f16_to_f32_bits(static_cast<uint16_t>(h))) << std::hex << h;
    }
    ASSERT_TRUE(out.guards_intact());
    k_->bf16_to_f32(out.data(), in.data(), all.size());
    for (uint32_t h = 0; h <= 0xffff; ++h) {
      ASSERT_EQ(bits_of(out[h]), ref_bf16_to_f32_bits(static_cast<uint16_t>(h))) << std::hex << h;
    }
    ASSERT_TRUE(out.guards_intact());
    ASSERT_TRUE(in.guards_intact());
  }
}

TEST_P(KernelTest, NarrowingConversionsMatchReference) {
  const std::vector<float>& x = narrowing_inputs();
  static const std::vector<uint16_t> f16 = [&] {
    std::vector<uint16_t> r(x.size());
    std::transform(x.begin(), x.end(), r.begin(), ref_f32_to_f16);
    return r;
  }();
  static const std::vector<uint16_t> bf16 = [&] {
    std::vector<uint16_t> r(x.size());
    std::transform(x.begin(), x.end(), r.begin(), ref_f32_to_bf16);
    return r;
  }();
  Guarded<float> in(x, 1);
  Guarded<uint16_t> out(x.size(), 3);
  k_->f32_to_f16(out.data(), in.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(out[i], f16[i]) << "f16 of 0x" << std::hex << bits_of(x[i]);
  }
  ASSERT_TRUE(out.guards_intact());
  k_->f32_to_bf16(out.data(), in.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(out[i], bf16[i]) << "bf16 of 0x" << std::hex << bits_of(x[i]);
  }
  ASSERT_TRUE(out.guards_intact());
  ASSERT_TRUE(in.guards_intact());
}

TEST_P(KernelTest, ConversionsAnyLengthAndAlignment) {
  std::uniform_int_distribution<uint32_t> any_bits;
  for (size_t n : test_lengths()) {
    for (const Offsets& o : test_offsets()) {
      SCOPED_TRACE(shape(n, o));
      std::vector<float> f(n);
      for (float& v : f)
        v = float_of(any_bits(rng_));
      const std::vector<uint16_t> h = random_u16(rng_, n);
      Guarded<float> fin(f, o.a);
      Guarded<uint16_t> hin(h, o.b);
      Guarded<uint16_t> hout(n, o.c);
      Guarded<float> fout(n, o.d);

      k_->f32_to_f16(hout.data(), fin.data(), n);
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(hout[i], ref_f32_to_f16(f[i])) << "i=" << i;
      k_->f32_to_bf16(hout.data(), fin.data(), n);
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(hout[i], ref_f32_to_bf16(f[i])) << "i=" << i;
      k_->f16_to_f32(fout.data(), hin.data(), n);
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(bits_of(fout[i]), ref_f16_to_f32_bits(h[i]));
      k_->bf16_to_f32(fout.data(), hin.data(), n);
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(bits_of(fout[i]), ref_bf16_to_f32_bits(h[i]));

      ASSERT_TRUE(fin.guards_intact());
      ASSERT_TRUE(hin.guards_intact());
      ASSERT_TRUE(hout.guards_intact());
      ASSERT_TRUE(fout.guards_intact());
      ASSERT_EQ(hin.values(), h);
    }
  }
}

// The optimizers: bit-identical to the documented fp32 formula (hence to
// every other ISA) on data with cancellation, any length and alignment.

TEST_P(KernelTest, SgdMatchesFormulaExactly) {
  for (const SgdParams& p : {SgdParams{0.1f}, SgdParams{0.05f, 0.01f}}) {
    for (size_t n : test_lengths()) {
      for (const Offsets& o : test_offsets()) {
        SCOPED_TRACE(shape(n, o));
        const std::vector<float> w0 = uniform(rng_, n, -1, 1);
        const std::vector<float> g0 = uniform(rng_, n, -1, 1);
        Guarded<float> w(w0, o.a);
        Guarded<float> g(g0, o.b);
        k_->sgd_f32(w.data(), g.data(), n, p);
        for (size_t i = 0; i < n; ++i) {
          float we = w0[i];
          ref_sgd(we, g0[i], p);
          ASSERT_TRUE(same_float(we, w[i])) << "i=" << i;
        }
        ASSERT_TRUE(w.guards_intact());
        ASSERT_TRUE(g.guards_intact());
        ASSERT_EQ(g.values(), g0);
      }
    }
  }
}

std::vector<MomentumParams> momentum_cases() {
  MomentumParams plain{0.1f, 0.9f};
  MomentumParams full{0.05f, 0.9f, 0.1f, 0.01f, true};
  MomentumParams damped{0.05f, 0.5f, 0.3f};
  MomentumParams first{0.1f, 0.9f, 0.1f, 0.01f, false, true};
  MomentumParams first_nesterov{0.1f, 0.9f, 0.0f, 0.0f, true, true};
  MomentumParams none{0.1f, 0.0f, 0.5f, 0.01f};
  return {plain, full, damped, first, first_nesterov, none};
}

TEST_P(KernelTest, MomentumMatchesFormulaExactly) {
  for (const MomentumParams& p : momentum_cases()) {
    SCOPED_TRACE(::testing::Message() << "momentum=" << p.momentum << " dampening=" << p.dampening
                                      << " wd=" << p.weight_decay << " nesterov=" << p.nesterov
                                      << " first_step=" << p.first_step);
    for (size_t n : test_lengths()) {
      for (const Offsets& o : test_offsets()) {
        SCOPED_TRACE(shape(n, o));
        const std::vector<float> w0 = uniform(rng_, n, -1, 1);
        // The first step's buffer is zero-filled by contract.
        const std::vector<float> b0 =
            p.first_step ? std::vector<float>(n) : uniform(rng_, n, -1, 1);
        const std::vector<float> g0 = uniform(rng_, n, -1, 1);
        Guarded<float> w(w0, o.a);
        Guarded<float> buf(b0, o.b);
        Guarded<float> g(g0, o.c);
        k_->momentum_f32(w.data(), buf.data(), g.data(), n, p);
        for (size_t i = 0; i < n; ++i) {
          float we = w0[i], be = b0[i];
          ref_momentum(we, be, g0[i], p);
          ASSERT_TRUE(same_float(we, w[i])) << "w i=" << i;
          ASSERT_TRUE(same_float(be, buf[i])) << "buf i=" << i;
        }
        ASSERT_TRUE(w.guards_intact());
        ASSERT_TRUE(buf.guards_intact());
        ASSERT_TRUE(g.guards_intact());
        ASSERT_EQ(g.values(), g0);
      }
    }
  }
}

TEST_P(KernelTest, MomentumSemantics) {
  // First step with a zero buffer: buf becomes g' = g + wd*w, undamped.
  const std::vector<float> w0 = {1.0f, -2.0f, 0.5f};
  const std::vector<float> g0 = {0.25f, 0.5f, -1.0f};
  MomentumParams p{0.5f, 0.9f, 0.5f, 0.25f, false, true};
  std::vector<float> w = w0, buf(3, 0.0f);
  k_->momentum_f32(w.data(), buf.data(), g0.data(), 3, p);
  for (size_t i = 0; i < 3; ++i) {
    const float gp = g0[i] + 0.25f * w0[i];  // exact for these values
    EXPECT_EQ(buf[i], gp);
    EXPECT_EQ(w[i], w0[i] - 0.5f * gp);
  }
  // momentum == 0 is plain SGD: buf is not touched (not even read).
  Guarded<float> untouched(0, 0);
  std::vector<float> w2 = w0;
  k_->momentum_f32(w2.data(), untouched.data(), g0.data(), 3, MomentumParams{0.5f, 0.0f, 0.5f});
  EXPECT_TRUE(untouched.guards_intact());
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(w2[i], w0[i] - 0.5f * g0[i]);
}

std::vector<AdamParams> adam_cases() {
  AdamParams first{1e-3f};
  AdamParams coupled{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, false, 10};
  AdamParams adamw{3e-4f, 0.8f, 0.99f, 1e-6f, 0.1f, true, 1000};
  AdamParams late{1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, false, 1u << 20};
  return {first, coupled, adamw, late};
}

TEST_P(KernelTest, AdamMatchesFormulaExactly) {
  for (const AdamParams& p : adam_cases()) {
    SCOPED_TRACE(::testing::Message()
                 << "wd=" << p.weight_decay << " decoupled=" << p.decoupled << " step=" << p.step);
    for (size_t n : test_lengths()) {
      for (const Offsets& o : test_offsets()) {
        SCOPED_TRACE(shape(n, o));
        const std::vector<float> w0 = uniform(rng_, n, -1, 1);
        const std::vector<float> m0 = uniform(rng_, n, -0.1f, 0.1f);
        const std::vector<float> v0 = uniform(rng_, n, 0, 0.01f);
        const std::vector<float> g0 = uniform(rng_, n, -1, 1);
        Guarded<float> w(w0, o.a), m(m0, o.b), v(v0, o.c), g(g0, o.d);
        k_->adam_f32(w.data(), m.data(), v.data(), g.data(), n, p);
        for (size_t i = 0; i < n; ++i) {
          float we = w0[i], me = m0[i], ve = v0[i];
          ref_adam(we, me, ve, g0[i], p);
          ASSERT_TRUE(same_float(we, w[i])) << "w i=" << i;
          ASSERT_TRUE(same_float(me, m[i])) << "m i=" << i;
          ASSERT_TRUE(same_float(ve, v[i])) << "v i=" << i;
        }
        ASSERT_TRUE(w.guards_intact());
        ASSERT_TRUE(m.guards_intact());
        ASSERT_TRUE(v.guards_intact());
        ASSERT_TRUE(g.guards_intact());
        ASSERT_EQ(g.values(), g0);
      }
    }
  }
}

TEST_P(KernelTest, AdamStepZeroIsStepOne) {
  const std::vector<float> g = uniform(rng_, 37, -1, 1);
  std::vector<float> w1(37, 0.5f), m1(37), v1(37), w0 = w1, m0 = m1, v0 = v1;
  AdamParams p{1e-3f};
  k_->adam_f32(w1.data(), m1.data(), v1.data(), g.data(), g.size(), p);
  p.step = 0;
  k_->adam_f32(w0.data(), m0.data(), v0.data(), g.data(), g.size(), p);
  EXPECT_EQ(w0, w1);
  for (float x : w0)
    EXPECT_TRUE(std::isfinite(x));
}

// Accuracy against exact arithmetic (double) on well-conditioned data, with
// the bounds cpu_kernels.h states (reached: 400 random parameter sets of 64k
// elements each gave exactly these worst cases).
constexpr int64_t kSgdUlp = 1;
constexpr int64_t kMomentumUlp = 2;
constexpr int64_t kAdamStateUlp = 3;
constexpr int64_t kAdamWeightUlp = 2;

TEST_P(KernelTest, OptimizersWithinUlpOfExact) {
  const size_t n = 4099;
  std::uniform_real_distribution<float> mag(0.5f, 2.0f), small(1e-3f, 1.0f);
  std::bernoulli_distribution negative;
  std::vector<float> w0(n), g0(n), m0(n), v0(n);
  for (size_t i = 0; i < n; ++i) {
    const float s = negative(rng_) ? -1.0f : 1.0f;
    // One sign per element for w, g and m, so neither g' = g + wd*w nor the
    // running averages cancel; the update is at most a few % of |w|.
    w0[i] = s * mag(rng_);
    g0[i] = s * small(rng_);
    m0[i] = s * 0.1f * small(rng_);
    v0[i] = 0.01f * small(rng_);
  }
  int64_t worst_sgd = 0, worst_mom = 0, worst_state = 0, worst_w = 0;

  for (const SgdParams& p : {SgdParams{1e-2f}, SgdParams{1e-2f, 1e-3f}}) {
    std::vector<float> w = w0;
    k_->sgd_f32(w.data(), g0.data(), n, p);
    for (size_t i = 0; i < n; ++i) {
      const double gp = double{g0[i]} + double{p.weight_decay} * w0[i];
      const double exact = double{w0[i]} - double{p.lr} * gp;
      worst_sgd = std::max(worst_sgd, ulp_distance(w[i], static_cast<float>(exact)));
    }
  }
  for (MomentumParams p : momentum_cases()) {
    if (p.momentum == 0 || p.first_step) continue;
    p.lr = 1e-2f;
    p.weight_decay = p.weight_decay != 0 ? 1e-3f : 0.0f;  // keep g' the sign of g
    std::vector<float> w = w0, buf = m0;
    k_->momentum_f32(w.data(), buf.data(), g0.data(), n, p);
    for (size_t i = 0; i < n; ++i) {
      double we = w0[i], be = m0[i];
      exact_momentum(we, be, g0[i], p);
      worst_mom = std::max(worst_mom, ulp_distance(buf[i], static_cast<float>(be)));
      worst_mom = std::max(worst_mom, ulp_distance(w[i], static_cast<float>(we)));
    }
  }
  for (AdamParams p : adam_cases()) {
    p.weight_decay = p.weight_decay != 0 ? 1e-3f : 0.0f;
    std::vector<float> w = w0, m = m0, v = v0;
    k_->adam_f32(w.data(), m.data(), v.data(), g0.data(), n, p);
    for (size_t i = 0; i < n; ++i) {
      double we = w0[i], me = m0[i], ve = v0[i];
      exact_adam(we, me, ve, g0[i], p);
      worst_state = std::max(worst_state, ulp_distance(m[i], static_cast<float>(me)));
      worst_state = std::max(worst_state, ulp_distance(v[i], static_cast<float>(ve)));
      worst_w = std::max(worst_w, ulp_distance(w[i], static_cast<float>(we)));
    }
  }
  EXPECT_LE(worst_sgd, kSgdUlp);
  EXPECT_LE(worst_mom, kMomentumUlp);
  EXPECT_LE(worst_state, kAdamStateUlp);
  EXPECT_LE(worst_w, kAdamWeightUlp);
  RecordProperty("worst_ulp", std::to_string(worst_sgd) + "," + std::to_string(worst_mom) + "," +
                                  std::to_string(worst_state) + "," + std::to_string(worst_w));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KernelTest,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(isa_name(info.param));
                         });

// ---------------------------------------------------------------------------
// Dispatch

TEST(Dispatch, NamesRoundTrip) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    Isa parsed = isa == Isa::kScalar ? Isa::kAvx512 : Isa::kScalar;
    ASSERT_TRUE(parse_isa(isa_name(isa), &parsed)) << isa_name(isa);
    EXPECT_EQ(parsed, isa);
  }
  Isa untouched = Isa::kAvx2;
  EXPECT_FALSE(parse_isa("", &untouched));
  EXPECT_FALSE(parse_isa("AVX2", &untouched));
  EXPECT_FALSE(parse_isa("avx512f", &untouched));
  EXPECT_EQ(untouched, Isa::kAvx2);
}

TEST(Dispatch, TablesExistExactlyForSupportedIsas) {
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_TRUE(isa_supported(best_isa()));
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    const KernelTable* t = kernels_for(isa);
    EXPECT_EQ(t != nullptr, isa_supported(isa)) << isa_name(isa);
    if (t != nullptr) {
      EXPECT_EQ(t->isa, isa);
    }
    if (isa_supported(isa)) {
      EXPECT_GE(best_isa(), isa);
    }
  }
}

// Cross-checks the CPUID probe against the kernel's view of the CPU, so a
// probe that never finds AVX-512 (and silently runs the scalar path) fails.
TEST(Dispatch, DetectionAgreesWithProcCpuinfo) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;)
      flags.insert(w);
    break;
  }
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  auto has = [&](std::initializer_list<const char*> names) {
    return std::all_of(names.begin(), names.end(),
                       [&](const char* f) { return flags.count(f) > 0; });
  };
  EXPECT_EQ(isa_supported(Isa::kAvx2), has({"avx2", "f16c"}));
  EXPECT_EQ(isa_supported(Isa::kAvx512),
            has({"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c"}));
}

TEST(Dispatch, SelectNeverGoesAboveTheCpu) {
  EXPECT_EQ(select_isa("scalar"), Isa::kScalar);
  EXPECT_EQ(select_isa("avx2"), isa_supported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar);
  EXPECT_EQ(select_isa("avx512"), best_isa());
  EXPECT_EQ(select_isa(""), best_isa());
  EXPECT_EQ(select_isa("sse9"), best_isa());
}

// kernels() reads PSLD_KERNEL_ISA once; run this binary with it set (e.g.
// PSLD_KERNEL_ISA=scalar) to exercise the override end to end.
TEST(Dispatch, KernelsHonoursEnvironment) {
  const char* env = std::getenv("PSLD_KERNEL_ISA");
  EXPECT_EQ(kernels().isa, select_isa(env != nullptr ? env : ""));
  EXPECT_EQ(&kernels(), kernels_for(kernels().isa));

  // The free functions go through the same table.
  std::vector<float> acc = {1, 2, 3}, x = {4, 5, 6};
  reduce_f32(acc.data(), x.data(), 3);
  EXPECT_EQ(acc, (std::vector<float>{5, 7, 9}));
  uint16_t h = 0;
  f32_to_bf16(&h, acc.data(), 1);
  EXPECT_EQ(h, 0x40a0);
}

}  // namespace
}  // namespace psld::kernels
