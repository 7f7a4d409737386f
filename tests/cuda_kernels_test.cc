// The CUDA kernels against the CPU kernels (which kernels_test.cc checks
// against first principles), and the memory-kind dispatch in front of both.
//
// Three groups:
//  - ElementMath: the host build of kernels/cuda/elementwise.h, the one
//    source of the GPU's per-element arithmetic and conversions, against the
//    CPU kernels, bit for bit. Runs everywhere, GPU or not.
//  - CudaAvailability: the device probe and the dispatch without a device
//    (or without CUDA in the build) answer with an error, never a crash.
//  - CudaKernelTest / CudaDispatchTest: every kernel on the GPU against the
//    CPU kernel on the same inputs, bit for bit (NaN payloads aside: GPU
//    arithmetic returns the canonical NaN), at sizes from 0 to past 16 MiB,
//    with every array misaligned alike and differently, checking that nothing
//    outside [0, n) is written. They skip with "no CUDA device: ..." without
//    a usable GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/internal.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/dispatch.h"

namespace psld::kernels {
namespace {

namespace el = cuda::element;

#define ASSERT_KERNEL_OK(expr)                                      \
  do {                                                              \
    const ::psld::Status kernel_status_ = (expr);                   \
    ASSERT_TRUE(kernel_status_.ok()) << kernel_status_.to_string(); \
  } while (false)

// ---------------------------------------------------------------------------
// Helpers

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// xorshift64*: fast enough to fill 16 MiB arrays many times over.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint32_t next() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return static_cast<uint32_t>((s_ * 0x2545f4914f6cdd1dull) >> 32);
  }
  // Uniform in [lo, hi), 24 random bits.
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * (static_cast<float>(next() >> 8) * 0x1p-24f);
  }

 private:
  uint64_t s_;
};

std::vector<float> uniform(Rng& rng, size_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (float& x : v)
    x = rng.uniform(lo, hi);
  return v;
}
std::vector<float> integers(Rng& rng, size_t n, int32_t range) {
  std::vector<float> v(n);
  for (float& x : v)
    x = static_cast<float>(static_cast<int32_t>(rng.next() % (2u * range + 1)) - range);
  return v;
}
std::vector<float> any_bits(Rng& rng, size_t n) {
  std::vector<float> v(n);
  for (float& x : v)
    x = float_of(rng.next());
  return v;
}
std::vector<uint16_t> random_u16(Rng& rng, size_t n) {
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v)
    x = static_cast<uint16_t>(rng.next() >> 16);
  return v;
}

// "0x3f800000". (AssertionResult streams each piece on its own, so a
// std::hex would not stick.)
std::string hex(uint32_t bits) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", bits);
  return text;
}

// Bitwise, except that any NaN matches any NaN.
::testing::AssertionResult same_floats(const std::vector<float>& expected,
                                       const std::vector<float>& actual) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << "size " << actual.size() << ", expected " << expected.size();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    const float e = expected[i], a = actual[i];
    if (bits_of(e) == bits_of(a) || (std::isnan(e) && std::isnan(a))) continue;
    return ::testing::AssertionFailure()
           << "i=" << i << ": expected " << e << " (" << hex(bits_of(e)) << ") got " << a << " ("
           << hex(bits_of(a)) << ")";
  }
  return ::testing::AssertionSuccess();
}

// Exactly the same bits, NaN payloads included.
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& expected, const std::vector<T>& actual) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << "size " << actual.size() << ", expected " << expected.size();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::memcmp(&expected[i], &actual[i], sizeof(T)) == 0) continue;
    uint32_t e = 0, a = 0;
    std::memcpy(&e, &expected[i], sizeof(T));
    std::memcpy(&a, &actual[i], sizeof(T));
    return ::testing::AssertionFailure()
           << "i=" << i << ": expected " << hex(e) << " got " << hex(a);
  }
  return ::testing::AssertionSuccess();
}

// fp32 inputs for the narrowing conversions: every fp16 and bf16 value, the
// midpoints between neighbours (the ties), their fp32 neighbours, specials,
// and random bit patterns.
const std::vector<float>& narrowing_inputs() {
  static const std::vector<float> inputs = [] {
    std::vector<float> v;
    auto around = [&v](float x) {
      for (float s : {x, -x}) {
        v.push_back(s);
        v.push_back(std::nextafter(s, -INFINITY));
        v.push_back(std::nextafter(s, INFINITY));
      }
    };
    for (uint32_t h = 0; h < 0x7c00; ++h) {
      const float a = f16_to_f32_scalar(static_cast<uint16_t>(h));
      const float b = f16_to_f32_scalar(static_cast<uint16_t>(h + 1));
      around(a);
      around(static_cast<float>((double{a} + double{b}) / 2));
    }
    for (uint32_t h = 0; h < 0x7f80; ++h) {
      around(float_of(h << 16));
      around(float_of((h << 16) | 0x8000u));  // the tie above it
    }
    for (uint32_t b : {0x7f800000u, 0x7f800001u, 0x7fbfffffu, 0x7fc00000u, 0x7fffffffu, 0x7f802000u,
                       0x7f801fffu, 0x7fffe000u, 0x7f80ffffu, 0x477fefffu, 0x477ff000u, 0x7f7fffffu,
                       0x00000001u, 0x007fffffu, 0x00800000u}) {
      v.push_back(float_of(b));
      v.push_back(float_of(b | 0x80000000u));
    }
    Rng rng(11);
    for (int i = 0; i < 200000; ++i)
      v.push_back(float_of(rng.next()));
    return v;
  }();
  return inputs;
}

// Floats that exercise the corners of fp32 arithmetic: zeros, subnormals,
// the normal range's ends, inf and NaN.
std::vector<float> special_floats() {
  return {0.0f,
          -0.0f,
          float_of(1),
          -float_of(1),
          float_of(0x007fffffu),
          0x1p-126f,
          -0x1p-126f,
          1.0f,
          -1.0f,
          0.1f,
          3e38f,
          -3e38f,
          0x1.fffffep127f,
          INFINITY,
          -INFINITY,
          NAN,
          -NAN,
          float_of(0x7fa00000u),
          1e-30f,
          65504.0f};
}

// Every combination of two special values, as two arrays.
void special_pairs(std::vector<float>* a, std::vector<float>* b) {
  const std::vector<float> s = special_floats();
  for (float x : s) {
    for (float y : s) {
      a->push_back(x);
      b->push_back(y);
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

std::vector<AdamParams> adam_cases() {
  AdamParams first{1e-3f};
  AdamParams coupled{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, false, 10};
  AdamParams adamw{3e-4f, 0.8f, 0.99f, 1e-6f, 0.1f, true, 1000};
  AdamParams late{1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, false, 1u << 20};
  return {first, coupled, adamw, late};
}

std::string describe(const MomentumParams& p) {
  std::ostringstream s;
  s << "momentum=" << p.momentum << " dampening=" << p.dampening << " wd=" << p.weight_decay
    << " nesterov=" << p.nesterov << " first_step=" << p.first_step;
  return s.str();
}
std::string describe(const AdamParams& p) {
  std::ostringstream s;
  s << "wd=" << p.weight_decay << " decoupled=" << p.decoupled << " step=" << p.step;
  return s.str();
}

// ---------------------------------------------------------------------------
// ElementMath: the GPU's per-element code, compiled for the host.

TEST(ElementMath, ConversionsMatchCpuKernels) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto u = static_cast<uint16_t>(h);
    ASSERT_EQ(bits_of(el::f16_to_f32(u)), bits_of(f16_to_f32_scalar(u))) << std::hex << h;
    ASSERT_EQ(bits_of(el::bf16_to_f32(u)), bits_of(bf16_to_f32_scalar(u))) << std::hex << h;
  }
  for (float x : narrowing_inputs()) {
    ASSERT_EQ(el::f32_to_f16(x), f32_to_f16_scalar(x)) << std::hex << bits_of(x);
    ASSERT_EQ(el::f32_to_bf16(x), f32_to_bf16_scalar(x)) << std::hex << bits_of(x);
  }
}

TEST(ElementMath, OptimizersMatchCpuKernels) {
  const KernelTable& cpu = *kernels_for(Isa::kScalar);
  Rng rng(3);
  const size_t n = 4099;
  for (int round = 0; round < 2; ++round) {
    // Round 1 mixes special values into every array.
    auto make = [&](float lo, float hi) {
      std::vector<float> v = uniform(rng, n, lo, hi);
      if (round == 1) {
        const std::vector<float> s = special_floats();
        for (size_t i = 0; i < n; i += 7)
          v[i] = s[(i / 7) % s.size()];
      }
      return v;
    };
    const std::vector<float> w0 = make(-1, 1), g0 = make(-1, 1), m0 = make(-0.1f, 0.1f),
                             v0 = make(0, 0.01f);

    for (const SgdParams& p : {SgdParams{0.1f}, SgdParams{0.05f, 0.01f}}) {
      std::vector<float> expected = w0, actual = w0;
      cpu.sgd_f32(expected.data(), g0.data(), n, p);
      const internal::SgdConsts c = internal::sgd_consts(p);
      for (size_t i = 0; i < n; ++i)
        actual[i] = el::sgd(actual[i], g0[i], c);
      ASSERT_TRUE(same_floats(expected, actual)) << "sgd wd=" << p.weight_decay;
    }
    for (const MomentumParams& p : momentum_cases()) {
      if (p.momentum == 0) continue;  // plain SGD on the GPU too (momentum_f32 checks)
      SCOPED_TRACE(describe(p));
      const std::vector<float> b0 = p.first_step ? std::vector<float>(n) : m0;
      std::vector<float> we = w0, be = b0, wa = w0, ba = b0;
      cpu.momentum_f32(we.data(), be.data(), g0.data(), n, p);
      const internal::MomentumConsts c = internal::momentum_consts(p);
      for (size_t i = 0; i < n; ++i)
        el::momentum(wa[i], ba[i], g0[i], c, p.nesterov);
      ASSERT_TRUE(same_floats(we, wa));
      ASSERT_TRUE(same_floats(be, ba));
    }
    for (const AdamParams& p : adam_cases()) {
      SCOPED_TRACE(describe(p));
      std::vector<float> we = w0, me = m0, ve = v0, wa = w0, ma = m0, va = v0;
      cpu.adam_f32(we.data(), me.data(), ve.data(), g0.data(), n, p);
      const internal::AdamConsts c = internal::adam_consts(p);
      for (size_t i = 0; i < n; ++i)
        el::adam(wa[i], ma[i], va[i], g0[i], c);
      ASSERT_TRUE(same_floats(we, wa));
      ASSERT_TRUE(same_floats(me, ma));
      ASSERT_TRUE(same_floats(ve, va));
    }
  }
}

TEST(ElementMath, VectorPlanAlignsEveryArrayOrNone) {
  alignas(64) static float f[64];
  alignas(64) static uint16_t h[64];
  {
    const el::ArrayShape a[] = {{f, 4}, {f + 16, 4}};
    const el::VectorPlan p = el::plan_vectors(100, 4, a, 2);
    EXPECT_EQ(p.head, 0u);
    EXPECT_EQ(p.vectors, 25u);
  }
  {
    // Misaligned alike by one element: three single elements first.
    const el::ArrayShape a[] = {{f + 1, 4}, {f + 5, 4}};
    const el::VectorPlan p = el::plan_vectors(100, 4, a, 2);
    EXPECT_EQ(p.head, 3u);
    EXPECT_EQ(p.vectors, 24u);  // 97 elements: 24 vectors and one more single
  }
  {
    // Misaligned differently: no common head.
    const el::ArrayShape a[] = {{f + 1, 4}, {f + 2, 4}};
    const el::VectorPlan p = el::plan_vectors(100, 4, a, 2);
    EXPECT_EQ(p.head, 100u);
    EXPECT_EQ(p.vectors, 0u);
  }
  {
    // fp32 with fp16, 8 lanes: both aligned after 2 elements.
    const el::ArrayShape a[] = {{f + 2, 4}, {h + 6, 2}};
    const el::VectorPlan p = el::plan_vectors(50, 8, a, 2);
    EXPECT_EQ(p.head, 2u);
    EXPECT_EQ(p.vectors, 6u);
  }
  {
    // Shorter than the head it would need: all single elements.
    const el::ArrayShape a[] = {{f + 1, 4}};
    EXPECT_EQ(el::plan_vectors(2, 4, a, 1).vectors, 0u);
    EXPECT_EQ(el::plan_vectors(0, 4, a, 1).vectors, 0u);
  }
}

// ---------------------------------------------------------------------------
// CudaAvailability: answers everywhere, without aborting.

TEST(CudaAvailability, ProbeAnswersWithoutAborting) {
  const Status first = cuda_device_status();
  const Status second = cuda_device_status();
  EXPECT_EQ(first.code(), second.code());
  EXPECT_EQ(first.message(), second.message());
  EXPECT_EQ(cuda_device_present(), first.ok());
  EXPECT_EQ(cuda_built(), cuda::built());
  if (!cuda_built()) {
    EXPECT_EQ(first.code(), StatusCode::kUnavailable);
    EXPECT_NE(first.message().find("built without CUDA"), std::string::npos) << first.message();
  } else if (!first.ok()) {
    EXPECT_EQ(first.code(), StatusCode::kUnavailable);
    EXPECT_FALSE(first.message().empty());
  }
  std::printf("CUDA built: %s; device: %s\n", cuda_built() ? "yes" : "no",
              first.to_string().c_str());
  RecordProperty("cuda_device", first.to_string());
}

TEST(CudaAvailability, CudaCallsWithoutDeviceFailCleanly) {
  const Status status = cuda_device_status();
  if (status.ok()) GTEST_SKIP() << "a CUDA device is present: CudaDispatchTest covers this path";

  const std::vector<float> a0 = {1, 2, 3, 4, 5}, b0 = {0.5f, 0.25f, -1, 2, 8};
  std::vector<float> a = a0, b = b0, c = a0, d = b0;
  std::vector<uint16_t> h(a0.size(), 0x3c00);
  const std::vector<uint16_t> h0 = h;
  const size_t n = a.size();
  const std::string expected_text = !cuda_built() ? "built without CUDA" : "no CUDA device";
  auto expect_refused = [&](const Status& s, const char* name) {
    EXPECT_EQ(s.code(), status.code()) << name << ": " << s.to_string();
    EXPECT_NE(s.message().find(name), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(expected_text), std::string::npos) << s.message();
  };
  const MemoryKind gpu = MemoryKind::kCuda;
  expect_refused(reduce_f32(gpu, a.data(), b.data(), n), "reduce_f32");
  expect_refused(reduce_f16(gpu, a.data(), h.data(), n), "reduce_f16");
  expect_refused(reduce_bf16(gpu, a.data(), h.data(), n), "reduce_bf16");
  expect_refused(scale_f32(gpu, a.data(), 2.0f, n), "scale_f32");
  expect_refused(sgd_f32(gpu, a.data(), b.data(), n, {0.1f}), "sgd_f32");
  expect_refused(momentum_f32(gpu, a.data(), c.data(), b.data(), n, {0.1f, 0.9f}), "momentum_f32");
  expect_refused(adam_f32(gpu, a.data(), c.data(), d.data(), b.data(), n, {1e-3f}), "adam_f32");
  expect_refused(f32_to_f16(gpu, h.data(), a.data(), n), "f32_to_f16");
  expect_refused(f16_to_f32(gpu, a.data(), h.data(), n), "f16_to_f32");
  expect_refused(f32_to_bf16(gpu, h.data(), a.data(), n), "f32_to_bf16");
  expect_refused(bf16_to_f32(gpu, a.data(), h.data(), n), "bf16_to_f32");
  // Nothing ran: the arrays are as they were.
  EXPECT_EQ(a, a0);
  EXPECT_EQ(b, b0);
  EXPECT_EQ(c, a0);
  EXPECT_EQ(d, b0);
  EXPECT_EQ(h, h0);

  // The CUDA entry points themselves refuse too (n == 0 is a no-op), and the
  // memory helpers hand back no memory.
  EXPECT_FALSE(cuda::reduce_f32(a.data(), b.data(), n, nullptr).ok());
  EXPECT_FALSE(cuda::adam_f32(a.data(), c.data(), d.data(), b.data(), n, {1e-3f}, nullptr).ok());
  EXPECT_TRUE(cuda::reduce_f32(nullptr, nullptr, 0, nullptr).ok());
  EXPECT_EQ(a, a0);
  void* p = &p;
  EXPECT_FALSE(cuda::device_alloc(1024, &p).ok());
  EXPECT_EQ(p, nullptr);
  void* stream = &stream;
  EXPECT_FALSE(cuda::stream_create(&stream).ok());
  EXPECT_EQ(stream, nullptr);
  EXPECT_FALSE(cuda::stream_synchronize(nullptr).ok());

  // Nothing is device memory, and the host side works as ever.
  EXPECT_EQ(memory_kind_of(a.data()), MemoryKind::kHost);
  EXPECT_EQ(memory_kind_of(nullptr), MemoryKind::kHost);
  EXPECT_FALSE(cuda::is_device_pointer(a.data()));
  ASSERT_KERNEL_OK(reduce_f32(memory_kind_of(a.data()), a.data(), b.data(), n));
  for (size_t i = 0; i < n; ++i)
    EXPECT_EQ(a[i], a0[i] + b0[i]);
}

TEST(CudaAvailability, UnknownMemoryKindIsAnError) {
  std::vector<float> a = {1, 2};
  const Status s = scale_f32(static_cast<MemoryKind>(7), a.data(), 2.0f, a.size());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(a, (std::vector<float>{1, 2}));
  EXPECT_EQ(memory_kind_name(MemoryKind::kHost), "host");
  EXPECT_EQ(memory_kind_name(MemoryKind::kCuda), "cuda");
}

// ---------------------------------------------------------------------------
// The GPU tests.

// n elements on the device, `offset` elements past a 256-byte boundary (the
// alignment of cudaMalloc), between runs of sentinels, so that a kernel that
// writes past either end, or that only works on aligned data, is caught.
template <class T>
class DeviceArray {
 public:
  static constexpr size_t kGuard = 64;  // elements on each side

  DeviceArray(size_t n, size_t offset) : n_(n), offset_(offset), total_(n + offset + 2 * kGuard) {
    void* p = nullptr;
    const Status s = cuda::device_alloc(total_ * sizeof(T), &p);
    if (!s.ok()) {
      ADD_FAILURE() << s.to_string();
      return;
    }
    base_ = static_cast<T*>(p);
    upload_all(std::vector<T>(total_, sentinel()));
  }
  DeviceArray(const std::vector<T>& values, size_t offset) : DeviceArray(values.size(), offset) {
    if (base_ == nullptr) return;
    std::vector<T> all(total_, sentinel());
    std::copy(values.begin(), values.end(), all.begin() + kGuard + offset_);
    upload_all(all);
  }
  ~DeviceArray() {
    if (base_ != nullptr) {
      EXPECT_TRUE(cuda::device_free(base_).ok());
    }
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  bool ok() const { return base_ != nullptr && ok_; }
  T* data() { return base_ + kGuard + offset_; }
  std::vector<T> values() const {
    const std::vector<T> all = download_all();
    return std::vector<T>(all.begin() + kGuard + offset_, all.begin() + kGuard + offset_ + n_);
  }
  ::testing::AssertionResult guards_intact() const {
    const std::vector<T> all = download_all();
    const T s = sentinel();
    for (size_t i = 0; i < total_; ++i) {
      if (i >= kGuard + offset_ && i < kGuard + offset_ + n_) continue;
      if (std::memcmp(&all[i], &s, sizeof(T)) != 0) {
        return ::testing::AssertionFailure()
               << "guard element " << static_cast<long>(i) - static_cast<long>(kGuard + offset_)
               << " (relative to the array) was written";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  // A signalling NaN for float, so a stray read that gets used shows too.
  static T sentinel() {
    if constexpr (sizeof(T) == 4) {
      return float_of(0x7fa5a5a5u);
    } else {
      return static_cast<T>(0xa5a5u);
    }
  }
  void upload_all(const std::vector<T>& all) {
    const Status s = cuda::copy(base_, all.data(), total_ * sizeof(T));
    if (!s.ok()) {
      ADD_FAILURE() << s.to_string();
      ok_ = false;
    }
  }
  std::vector<T> download_all() const {
    std::vector<T> all(total_);
    const Status s = cuda::copy(all.data(), base_, total_ * sizeof(T));
    EXPECT_TRUE(s.ok()) << s.to_string();
    return all;
  }

  size_t n_, offset_, total_;
  T* base_ = nullptr;
  bool ok_ = true;
};

// One call's shape: its length and each array's offset in elements from a
// 256-byte boundary.
struct Shape {
  size_t n;
  size_t off[4];
};

std::string describe(const Shape& s) {
  std::ostringstream out;
  out << "n=" << s.n << " offsets=" << s.off[0] << "," << s.off[1] << "," << s.off[2] << ","
      << s.off[3];
  return out.str();
}

// Small sizes around the vector widths (4 and 8 elements) and the block
// size, every array aligned alike (vector body, after a scalar head where
// misaligned) and differently (element by element); then 1 MiB of fp32
// exactly and past it, and 16 MiB and 3 elements, where the grid-stride
// loops go round many times.
std::vector<Shape> shapes() {
  std::vector<Shape> out;
  const size_t small[] = {0,  1,  2,  3,  4,   5,   7,   8,   9,    15,   16,   17,   31,   32,
                          33, 63, 64, 65, 127, 255, 256, 257, 1000, 1023, 1025, 4097, 65537};
  // {1, 5, 5, 1} puts each fp32 array (offset 1) and 16-bit array (offset 5)
  // of a call at 16-byte boundaries after the same head of 3 elements, so
  // the mixed kernels (reduce_f16/bf16, the conversions) also take the
  // vector path after a head.
  const Shape offsets[] = {{0, {0, 0, 0, 0}}, {0, {1, 1, 1, 1}}, {0, {3, 3, 3, 3}},
                           {0, {1, 2, 3, 0}}, {0, {2, 0, 1, 3}}, {0, {1, 5, 5, 1}}};
  for (size_t n : small) {
    for (Shape s : offsets) {
      s.n = n;
      out.push_back(s);
    }
  }
  for (size_t n : {size_t{1} << 18, (size_t{1} << 18) + 1, (size_t{1} << 22) + 3}) {
    for (Shape s : {offsets[0], offsets[1], offsets[3], offsets[5]}) {
      s.n = n;
      out.push_back(s);
    }
  }
  return out;
}

class CudaKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status s = cuda_device_status();
    if (!s.ok()) GTEST_SKIP() << "no CUDA device: " << s.message();
    ASSERT_KERNEL_OK(cuda::stream_create(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_TRUE(cuda::stream_destroy(stream_).ok());
    }
  }
  // Waits for the kernels queued on stream_ (cuda::copy runs on the legacy
  // default stream, which does not wait for a non-blocking one).
  ::testing::AssertionResult finish() {
    const Status s = cuda::stream_synchronize(stream_);
    if (s.ok()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << s.to_string();
  }

  void* stream_ = nullptr;
  Rng rng_{42};
};

TEST_F(CudaKernelTest, ReduceF32IsExactAndMatchesCpu) {
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(describe(s));
    // Integers: the exact sum is known without fp32 arithmetic at all.
    const std::vector<float> a0 = integers(rng_, s.n, 1000000);
    const std::vector<float> x0 = integers(rng_, s.n, 1000000);
    DeviceArray<float> acc(a0, s.off[0]), x(x0, s.off[1]);
    ASSERT_TRUE(acc.ok() && x.ok());
    ASSERT_KERNEL_OK(cuda::reduce_f32(acc.data(), x.data(), s.n, stream_));
    ASSERT_TRUE(finish());
    const std::vector<float> got = acc.values();
    for (size_t i = 0; i < s.n; ++i)
      ASSERT_EQ(double{got[i]}, double{a0[i]} + double{x0[i]}) << "i=" << i;
    ASSERT_TRUE(acc.guards_intact());
    ASSERT_TRUE(x.guards_intact());
    ASSERT_TRUE(same_bits(x0, x.values()));

    // Arbitrary values: one rounding each, the CPU's.
    const std::vector<float> a1 = uniform(rng_, s.n, -1e3f, 1e3f);
    const std::vector<float> x1 = uniform(rng_, s.n, -1, 1);
    DeviceArray<float> acc1(a1, s.off[2]), x2(x1, s.off[3]);
    ASSERT_TRUE(acc1.ok() && x2.ok());
    ASSERT_KERNEL_OK(cuda::reduce_f32(acc1.data(), x2.data(), s.n, stream_));
    ASSERT_TRUE(finish());
    std::vector<float> expected = a1;
    reduce_f32(expected.data(), x1.data(), s.n);
    ASSERT_TRUE(same_floats(expected, acc1.values()));
    ASSERT_TRUE(acc1.guards_intact());
  }
}

TEST_F(CudaKernelTest, ReduceF32SpecialValuesAndAliasing) {
  std::vector<float> a0, x0;
  special_pairs(&a0, &x0);
  DeviceArray<float> acc(a0, 1), x(x0, 1);
  ASSERT_TRUE(acc.ok() && x.ok());
  ASSERT_KERNEL_OK(cuda::reduce_f32(acc.data(), x.data(), a0.size(), stream_));
  ASSERT_TRUE(finish());
  std::vector<float> expected = a0;
  reduce_f32(expected.data(), x0.data(), a0.size());
  ASSERT_TRUE(same_floats(expected, acc.values()));

  // acc and x may be the same array.
  for (size_t n : {1, 17, 100, 4099}) {
    for (size_t offset : {0, 3}) {
      const std::vector<float> v = uniform(rng_, n, -1, 1);
      DeviceArray<float> a(v, offset);
      ASSERT_TRUE(a.ok());
      ASSERT_KERNEL_OK(cuda::reduce_f32(a.data(), a.data(), n, stream_));
      ASSERT_TRUE(finish());
      std::vector<float> twice = v;
      reduce_f32(twice.data(), twice.data(), n);
      ASSERT_TRUE(same_floats(twice, a.values()));
      ASSERT_TRUE(a.guards_intact());
    }
  }
}

TEST_F(CudaKernelTest, ReduceHalfMatchesCpu) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f16");
    for (const Shape& s : shapes()) {
      SCOPED_TRACE(describe(s));
      const std::vector<float> a0 = uniform(rng_, s.n, -1e3f, 1e3f);
      const std::vector<uint16_t> x0 = random_u16(rng_, s.n);  // inf and NaN included
      DeviceArray<float> acc(a0, s.off[0]);
      DeviceArray<uint16_t> x(x0, s.off[1]);
      ASSERT_TRUE(acc.ok() && x.ok());
      std::vector<float> expected = a0;
      if (bf16) {
        ASSERT_KERNEL_OK(cuda::reduce_bf16(acc.data(), x.data(), s.n, stream_));
        reduce_bf16(expected.data(), x0.data(), s.n);
      } else {
        ASSERT_KERNEL_OK(cuda::reduce_f16(acc.data(), x.data(), s.n, stream_));
        reduce_f16(expected.data(), x0.data(), s.n);
      }
      ASSERT_TRUE(finish());
      ASSERT_TRUE(same_floats(expected, acc.values()));
      ASSERT_TRUE(acc.guards_intact());
      ASSERT_TRUE(x.guards_intact());
      ASSERT_TRUE(same_bits(x0, x.values()));
    }
  }
}

TEST_F(CudaKernelTest, ScaleMatchesCpu) {
  const float factors[] = {0.5f, -3.0f, 1.0f / 3.0f, 0x1p-140f, INFINITY};
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(describe(s));
    const float a = factors[s.n % 5];
    const std::vector<float> x0 = uniform(rng_, s.n, -1e3f, 1e3f);
    DeviceArray<float> x(x0, s.off[0]);
    ASSERT_TRUE(x.ok());
    ASSERT_KERNEL_OK(cuda::scale_f32(x.data(), a, s.n, stream_));
    ASSERT_TRUE(finish());
    std::vector<float> expected = x0;
    scale_f32(expected.data(), a, s.n);
    ASSERT_TRUE(same_floats(expected, x.values())) << "a=" << a;
    ASSERT_TRUE(x.guards_intact());
  }
}

TEST_F(CudaKernelTest, ArithmeticOnSpecialValuesMatchesCpu) {
  // Subnormals in, subnormals out (no flush to zero), inf and NaN through
  // every kernel.
  std::vector<float> a0, b0;
  special_pairs(&a0, &b0);
  const size_t n = a0.size();
  for (float f : special_floats()) {
    DeviceArray<float> x(a0, 2);
    ASSERT_TRUE(x.ok());
    ASSERT_KERNEL_OK(cuda::scale_f32(x.data(), f, n, stream_));
    ASSERT_TRUE(finish());
    std::vector<float> expected = a0;
    scale_f32(expected.data(), f, n);
    ASSERT_TRUE(same_floats(expected, x.values())) << "a=" << f;
  }
  const std::vector<float> c0(b0.rbegin(), b0.rend());
  const std::vector<float> d0 = uniform(rng_, n, 0, 1e-30f);  // tiny v: subnormal sqrt
  for (const AdamParams& p : adam_cases()) {
    SCOPED_TRACE(describe(p));
    DeviceArray<float> w(a0, 0), m(c0, 1), v(d0, 2), g(b0, 3);
    ASSERT_TRUE(w.ok() && m.ok() && v.ok() && g.ok());
    ASSERT_KERNEL_OK(cuda::adam_f32(w.data(), m.data(), v.data(), g.data(), n, p, stream_));
    ASSERT_TRUE(finish());
    std::vector<float> we = a0, me = c0, ve = d0;
    adam_f32(we.data(), me.data(), ve.data(), b0.data(), n, p);
    ASSERT_TRUE(same_floats(we, w.values()));
    ASSERT_TRUE(same_floats(me, m.values()));
    ASSERT_TRUE(same_floats(ve, v.values()));
  }
  for (const MomentumParams& p : momentum_cases()) {
    SCOPED_TRACE(describe(p));
    DeviceArray<float> w(a0, 1), buf(c0, 1), g(b0, 1);
    ASSERT_TRUE(w.ok() && buf.ok() && g.ok());
    ASSERT_KERNEL_OK(cuda::momentum_f32(w.data(), buf.data(), g.data(), n, p, stream_));
    ASSERT_TRUE(finish());
    std::vector<float> we = a0, be = c0;
    momentum_f32(we.data(), be.data(), b0.data(), n, p);
    ASSERT_TRUE(same_floats(we, w.values()));
    ASSERT_TRUE(same_floats(be, buf.values()));
  }
}

TEST_F(CudaKernelTest, SgdMatchesCpu) {
  for (const SgdParams& p : {SgdParams{0.1f}, SgdParams{0.05f, 0.01f}}) {
    SCOPED_TRACE(::testing::Message() << "wd=" << p.weight_decay);
    for (const Shape& s : shapes()) {
      SCOPED_TRACE(describe(s));
      const std::vector<float> w0 = uniform(rng_, s.n, -1, 1);
      const std::vector<float> g0 = uniform(rng_, s.n, -1, 1);
      DeviceArray<float> w(w0, s.off[0]), g(g0, s.off[1]);
      ASSERT_TRUE(w.ok() && g.ok());
      ASSERT_KERNEL_OK(cuda::sgd_f32(w.data(), g.data(), s.n, p, stream_));
      ASSERT_TRUE(finish());
      std::vector<float> expected = w0;
      sgd_f32(expected.data(), g0.data(), s.n, p);
      ASSERT_TRUE(same_floats(expected, w.values()));
      ASSERT_TRUE(w.guards_intact());
      ASSERT_TRUE(g.guards_intact());
      ASSERT_TRUE(same_bits(g0, g.values()));
    }
  }
}

TEST_F(CudaKernelTest, MomentumMatchesCpu) {
  for (const MomentumParams& p : momentum_cases()) {
    SCOPED_TRACE(describe(p));
    for (const Shape& s : shapes()) {
      SCOPED_TRACE(describe(s));
      const std::vector<float> w0 = uniform(rng_, s.n, -1, 1);
      // The first step's buffer is zero-filled by contract.
      const std::vector<float> b0 =
          p.first_step ? std::vector<float>(s.n) : uniform(rng_, s.n, -1, 1);
      const std::vector<float> g0 = uniform(rng_, s.n, -1, 1);
      DeviceArray<float> w(w0, s.off[0]), buf(b0, s.off[1]), g(g0, s.off[2]);
      ASSERT_TRUE(w.ok() && buf.ok() && g.ok());
      ASSERT_KERNEL_OK(cuda::momentum_f32(w.data(), buf.data(), g.data(), s.n, p, stream_));
      ASSERT_TRUE(finish());
      std::vector<float> we = w0, be = b0;
      momentum_f32(we.data(), be.data(), g0.data(), s.n, p);
      ASSERT_TRUE(same_floats(we, w.values()));
      // momentum == 0 leaves buf alone: be is b0 then.
      ASSERT_TRUE(same_floats(be, buf.values()));
      ASSERT_TRUE(w.guards_intact());
      ASSERT_TRUE(buf.guards_intact());
      ASSERT_TRUE(g.guards_intact());
    }
  }
}

TEST_F(CudaKernelTest, MomentumZeroNeverTouchesBuf) {
  const std::vector<float> w0 = uniform(rng_, 1000, -1, 1), g0 = uniform(rng_, 1000, -1, 1);
  DeviceArray<float> w(w0, 0), g(g0, 0);
  ASSERT_TRUE(w.ok() && g.ok());
  // A null buf is never dereferenced with momentum == 0, on the CPU either.
  ASSERT_KERNEL_OK(
      cuda::momentum_f32(w.data(), nullptr, g.data(), 1000, {0.5f, 0.0f, 0.5f}, stream_));
  ASSERT_TRUE(finish());
  std::vector<float> expected = w0;
  sgd_f32(expected.data(), g0.data(), 1000, {0.5f});
  ASSERT_TRUE(same_floats(expected, w.values()));
}

TEST_F(CudaKernelTest, AdamMatchesCpu) {
  for (const AdamParams& p : adam_cases()) {
    SCOPED_TRACE(describe(p));
    for (const Shape& s : shapes()) {
      SCOPED_TRACE(describe(s));
      const std::vector<float> w0 = uniform(rng_, s.n, -1, 1);
      const std::vector<float> m0 = uniform(rng_, s.n, -0.1f, 0.1f);
      const std::vector<float> v0 = uniform(rng_, s.n, 0, 0.01f);
      const std::vector<float> g0 = uniform(rng_, s.n, -1, 1);
      DeviceArray<float> w(w0, s.off[0]), m(m0, s.off[1]), v(v0, s.off[2]), g(g0, s.off[3]);
      ASSERT_TRUE(w.ok() && m.ok() && v.ok() && g.ok());
      ASSERT_KERNEL_OK(cuda::adam_f32(w.data(), m.data(), v.data(), g.data(), s.n, p, stream_));
      ASSERT_TRUE(finish());
      std::vector<float> we = w0, me = m0, ve = v0;
      adam_f32(we.data(), me.data(), ve.data(), g0.data(), s.n, p);
      ASSERT_TRUE(same_floats(we, w.values()));
      ASSERT_TRUE(same_floats(me, m.values()));
      ASSERT_TRUE(same_floats(ve, v.values()));
      ASSERT_TRUE(w.guards_intact());
      ASSERT_TRUE(m.guards_intact());
      ASSERT_TRUE(v.guards_intact());
      ASSERT_TRUE(g.guards_intact());
      ASSERT_TRUE(same_bits(g0, g.values()));
    }
  }
}

TEST_F(CudaKernelTest, AdamStepZeroIsStepOne) {
  const std::vector<float> g0 = uniform(rng_, 37, -1, 1), w0(37, 0.5f), zero(37, 0.0f);
  DeviceArray<float> w1(w0, 0), m1(zero, 0), v1(zero, 0), w2(w0, 1), m2(zero, 1), v2(zero, 1),
      g(g0, 0);
  ASSERT_TRUE(w1.ok() && m1.ok() && v1.ok() && w2.ok() && m2.ok() && v2.ok() && g.ok());
  AdamParams p{1e-3f};
  ASSERT_KERNEL_OK(cuda::adam_f32(w1.data(), m1.data(), v1.data(), g.data(), 37, p, stream_));
  p.step = 0;
  ASSERT_KERNEL_OK(cuda::adam_f32(w2.data(), m2.data(), v2.data(), g.data(), 37, p, stream_));
  ASSERT_TRUE(finish());
  ASSERT_TRUE(same_bits(w1.values(), w2.values()));
}

TEST_F(CudaKernelTest, WideningConversionsExhaustive) {
  std::vector<uint16_t> all(65536);
  for (uint32_t h = 0; h <= 0xffff; ++h)
    all[h] = static_cast<uint16_t>(h);
  for (size_t offset : {0, 1, 3}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (bf16 ? "bf16" : "f16") << " offset=" << offset);
      DeviceArray<uint16_t> in(all, offset);
      DeviceArray<float> out(all.size(), offset + 2);
      ASSERT_TRUE(in.ok() && out.ok());
      std::vector<float> expected(all.size());
      if (bf16) {
        ASSERT_KERNEL_OK(cuda::bf16_to_f32(out.data(), in.data(), all.size(), stream_));
        bf16_to_f32(expected.data(), all.data(), all.size());
      } else {
        ASSERT_KERNEL_OK(cuda::f16_to_f32(out.data(), in.data(), all.size(), stream_));
        f16_to_f32(expected.data(), all.data(), all.size());
      }
      ASSERT_TRUE(finish());
      ASSERT_TRUE(same_bits(expected, out.values()));  // NaN payloads too
      ASSERT_TRUE(out.guards_intact());
      ASSERT_TRUE(in.guards_intact());
    }
  }
}

TEST_F(CudaKernelTest, NarrowingConversionsMatchCpu) {
  const std::vector<float>& x = narrowing_inputs();
  for (size_t offset : {0, 1}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (bf16 ? "bf16" : "f16") << " offset=" << offset);
      DeviceArray<float> in(x, offset);
      DeviceArray<uint16_t> out(x.size(), offset == 0 ? 0 : 3);
      ASSERT_TRUE(in.ok() && out.ok());
      std::vector<uint16_t> expected(x.size());
      if (bf16) {
        ASSERT_KERNEL_OK(cuda::f32_to_bf16(out.data(), in.data(), x.size(), stream_));
        f32_to_bf16(expected.data(), x.data(), x.size());
      } else {
        ASSERT_KERNEL_OK(cuda::f32_to_f16(out.data(), in.data(), x.size(), stream_));
        f32_to_f16(expected.data(), x.data(), x.size());
      }
      ASSERT_TRUE(finish());
      ASSERT_TRUE(same_bits(expected, out.values()));
      ASSERT_TRUE(out.guards_intact());
      ASSERT_TRUE(in.guards_intact());
    }
  }
}

TEST_F(CudaKernelTest, ConversionsAnyLengthAndAlignment) {
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(describe(s));
    const std::vector<float> f = any_bits(rng_, s.n);
    const std::vector<uint16_t> h = random_u16(rng_, s.n);
    DeviceArray<float> fin(f, s.off[0]), fout(s.n, s.off[3]);
    DeviceArray<uint16_t> hin(h, s.off[1]), hout(s.n, s.off[2]);
    ASSERT_TRUE(fin.ok() && fout.ok() && hin.ok() && hout.ok());
    std::vector<uint16_t> he(s.n);
    std::vector<float> fe(s.n);

    ASSERT_KERNEL_OK(cuda::f32_to_f16(hout.data(), fin.data(), s.n, stream_));
    ASSERT_TRUE(finish());
    f32_to_f16(he.data(), f.data(), s.n);
    ASSERT_TRUE(same_bits(he, hout.values()));
    ASSERT_KERNEL_OK(cuda::f32_to_bf16(hout.data(), fin.data(), s.n, stream_));
    ASSERT_TRUE(finish());
    f32_to_bf16(he.data(), f.data(), s.n);
    ASSERT_TRUE(same_bits(he, hout.values()));
    ASSERT_KERNEL_OK(cuda::f16_to_f32(fout.data(), hin.data(), s.n, stream_));
    ASSERT_TRUE(finish());
    f16_to_f32(fe.data(), h.data(), s.n);
    ASSERT_TRUE(same_bits(fe, fout.values()));
    ASSERT_KERNEL_OK(cuda::bf16_to_f32(fout.data(), hin.data(), s.n, stream_));
    ASSERT_TRUE(finish());
    bf16_to_f32(fe.data(), h.data(), s.n);
    ASSERT_TRUE(same_bits(fe, fout.values()));

    ASSERT_TRUE(fin.guards_intact());
    ASSERT_TRUE(hin.guards_intact());
    ASSERT_TRUE(hout.guards_intact());
    ASSERT_TRUE(fout.guards_intact());
  }
}

TEST_F(CudaKernelTest, DefaultStreamWorks) {
  const std::vector<float> a0 = uniform(rng_, 5000, -1, 1), x0 = uniform(rng_, 5000, -1, 1);
  DeviceArray<float> acc(a0, 1), x(x0, 1);
  ASSERT_TRUE(acc.ok() && x.ok());
  ASSERT_KERNEL_OK(cuda::reduce_f32(acc.data(), x.data(), a0.size(), nullptr));
  ASSERT_KERNEL_OK(cuda::stream_synchronize(nullptr));
  std::vector<float> expected = a0;
  reduce_f32(expected.data(), x0.data(), a0.size());
  ASSERT_TRUE(same_floats(expected, acc.values()));
}

TEST_F(CudaKernelTest, BadPointersAreRefusedBeforeLaunch) {
  DeviceArray<float> a(std::vector<float>(64, 1.0f), 0);
  ASSERT_TRUE(a.ok());
  float* const misaligned =
      reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(a.data()) + 2);  // 2-byte aligned
  Status s = cuda::scale_f32(misaligned, 2.0f, 8, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  s = cuda::reduce_f32(a.data(), nullptr, 8, stream_);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(cuda::reduce_f32(nullptr, nullptr, 0, stream_).ok());
  ASSERT_TRUE(finish());
  EXPECT_TRUE(a.guards_intact());
  const std::vector<float> after = a.values();
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](float v) { return v == 1.0f; }));
}

// ---------------------------------------------------------------------------
// Dispatch with a device: host pointers run the CPU kernels, device pointers
// the CUDA ones, with the same results.

using CudaDispatchTest = CudaKernelTest;

TEST_F(CudaDispatchTest, MemoryKindOfTellsHostFromDevice) {
  std::vector<float> host(16);
  DeviceArray<float> device(16, 1);
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(memory_kind_of(host.data()), MemoryKind::kHost);
  EXPECT_EQ(memory_kind_of(nullptr), MemoryKind::kHost);
  EXPECT_EQ(memory_kind_of(device.data()), MemoryKind::kCuda);
  EXPECT_EQ(memory_kind_of(device.data() + 5), MemoryKind::kCuda);  // inside an allocation
  EXPECT_TRUE(cuda::is_device_pointer(device.data()));
  EXPECT_FALSE(cuda::is_device_pointer(host.data()));
}

TEST_F(CudaDispatchTest, EveryOperationRunsWhereItsMemoryIs) {
  const size_t n = 1003;
  const std::vector<float> w0 = uniform(rng_, n, -1, 1), m0 = uniform(rng_, n, -0.1f, 0.1f),
                           v0 = uniform(rng_, n, 0, 0.01f), g0 = uniform(rng_, n, -1, 1);
  const std::vector<uint16_t> h0 = random_u16(rng_, n);

  // Host side: every operation through the dispatch, on host vectors.
  std::vector<float> w = w0, m = m0, v = v0, f(n);
  std::vector<uint16_t> h = h0, hn(n), hb(n);
  const MemoryKind host = memory_kind_of(w.data());
  ASSERT_EQ(host, MemoryKind::kHost);
  ASSERT_KERNEL_OK(reduce_f32(host, w.data(), g0.data(), n));
  ASSERT_KERNEL_OK(reduce_f16(host, w.data(), h.data(), n));
  ASSERT_KERNEL_OK(reduce_bf16(host, w.data(), h.data(), n));
  ASSERT_KERNEL_OK(scale_f32(host, w.data(), 0.75f, n));
  ASSERT_KERNEL_OK(sgd_f32(host, w.data(), g0.data(), n, {0.1f, 0.01f}));
  ASSERT_KERNEL_OK(momentum_f32(host, w.data(), m.data(), g0.data(), n, {0.05f, 0.9f}));
  ASSERT_KERNEL_OK(adam_f32(host, w.data(), m.data(), v.data(), g0.data(), n, {1e-3f}));
  ASSERT_KERNEL_OK(f32_to_f16(host, hn.data(), w.data(), n));
  ASSERT_KERNEL_OK(f32_to_bf16(host, hb.data(), w.data(), n));
  ASSERT_KERNEL_OK(f16_to_f32(host, f.data(), hn.data(), n));
  ASSERT_KERNEL_OK(bf16_to_f32(host, f.data(), hb.data(), n));

  // The same sequence on device arrays, queued on one stream.
  DeviceArray<float> dw(w0, 1), dm(m0, 1), dv(v0, 1), dg(g0, 1), df(n, 1);
  DeviceArray<uint16_t> dh(h0, 2), dhn(n, 2), dhb(n, 2);
  ASSERT_TRUE(dw.ok() && dm.ok() && dv.ok() && dg.ok() && df.ok() && dh.ok() && dhn.ok() &&
              dhb.ok());
  const MemoryKind gpu = memory_kind_of(dw.data());
  ASSERT_EQ(gpu, MemoryKind::kCuda);
  ASSERT_KERNEL_OK(reduce_f32(gpu, dw.data(), dg.data(), n, stream_));
  ASSERT_KERNEL_OK(reduce_f16(gpu, dw.data(), dh.data(), n, stream_));
  ASSERT_KERNEL_OK(reduce_bf16(gpu, dw.data(), dh.data(), n, stream_));
  ASSERT_KERNEL_OK(scale_f32(gpu, dw.data(), 0.75f, n, stream_));
  ASSERT_KERNEL_OK(sgd_f32(gpu, dw.data(), dg.data(), n, {0.1f, 0.01f}, stream_));
  ASSERT_KERNEL_OK(momentum_f32(gpu, dw.data(), dm.data(), dg.data(), n, {0.05f, 0.9f}, stream_));
  ASSERT_KERNEL_OK(adam_f32(gpu, dw.data(), dm.data(), dv.data(), dg.data(), n, {1e-3f}, stream_));
  ASSERT_KERNEL_OK(f32_to_f16(gpu, dhn.data(), dw.data(), n, stream_));
  ASSERT_KERNEL_OK(f32_to_bf16(gpu, dhb.data(), dw.data(), n, stream_));
  ASSERT_KERNEL_OK(f16_to_f32(gpu, df.data(), dhn.data(), n, stream_));
  ASSERT_KERNEL_OK(bf16_to_f32(gpu, df.data(), dhb.data(), n, stream_));
  ASSERT_TRUE(finish());

  ASSERT_TRUE(same_floats(w, dw.values()));
  ASSERT_TRUE(same_floats(m, dm.values()));
  ASSERT_TRUE(same_floats(v, dv.values()));
  ASSERT_TRUE(same_bits(hn, dhn.values()));
  ASSERT_TRUE(same_bits(hb, dhb.values()));
  ASSERT_TRUE(same_bits(f, df.values()));
  // The host vectors were computed on the host: they are not device memory.
  EXPECT_EQ(memory_kind_of(f.data()), MemoryKind::kHost);
}

}  // namespace
}  // namespace psld::kernels
