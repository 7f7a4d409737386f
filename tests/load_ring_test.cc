#include "lib/stats/load_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace psld {
namespace {

LoadSample sample(uint64_t t, double v, uint32_t source = 0) {
  LoadSample s;
  s.time_ns = t;
  s.source = source;
  s.metric = 1;
  s.value = v;
  return s;
}

std::vector<LoadSample> drain_all(LoadRing<LoadSample>& ring) {
  std::vector<LoadSample> out;
  ring.drain([&](const LoadSample& s) { out.push_back(s); });
  return out;
}

TEST(LoadRing, RejectsBadCapacities) {
  for (size_t c : {size_t{0}, size_t{1}, size_t{3}, size_t{100}, size_t{1} << 25}) {
    auto r = LoadRing<LoadSample>::make(c);
    ASSERT_FALSE(r.ok()) << c;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(LoadRing<LoadSample>::make(2).ok());
  EXPECT_TRUE(LoadRing<LoadSample>::make(1024).ok());
}

TEST(LoadRing, DeliversSamplesInPushOrder) {
  auto ring = *LoadRing<LoadSample>::make(16);
  for (int i = 0; i < 10; ++i)
    ASSERT_TRUE(ring->push(sample(i, i * 1.5, i)));
  auto got = drain_all(*ring);
  ASSERT_EQ(got.size(), 10u);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(got[i].time_ns, static_cast<uint64_t>(i));
    EXPECT_EQ(got[i].source, static_cast<uint32_t>(i));
    EXPECT_EQ(got[i].metric, 1u);
    EXPECT_DOUBLE_EQ(got[i].value, i * 1.5);
  }
  EXPECT_TRUE(drain_all(*ring).empty());
  EXPECT_EQ(ring->pushed(), 10u);
  EXPECT_EQ(ring->consumed(), 10u);
  EXPECT_EQ(ring->lost(), 0u);
}

TEST(LoadRing, FullRingOverwritesOldestAndCountsThem) {
  auto ring = *LoadRing<LoadSample>::make(8);
  for (int i = 0; i < 20; ++i)
    ASSERT_TRUE(ring->push(sample(i, i)));
  auto got = drain_all(*ring);
  // The newest 8 survive; the 12 oldest are counted as lost.
  ASSERT_EQ(got.size(), 8u);
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(got[i].time_ns, static_cast<uint64_t>(12 + i));
  EXPECT_EQ(ring->lost(), 12u);
  EXPECT_EQ(ring->consumed() + ring->lost(), ring->pushed());

  // Exactly full is not overflow.
  for (int i = 0; i < 8; ++i)
    ASSERT_TRUE(ring->push(sample(100 + i, i)));
  got = drain_all(*ring);
  ASSERT_EQ(got.size(), 8u);
  EXPECT_EQ(got.front().time_ns, 100u);
  EXPECT_EQ(ring->lost(), 12u);
}

TEST(LoadRing, DrainRespectsMaxAndResumes) {
  auto ring = *LoadRing<LoadSample>::make(32);
  for (int i = 0; i < 10; ++i)
    ASSERT_TRUE(ring->push(sample(i, i)));
  std::vector<uint64_t> seen;
  EXPECT_EQ(ring->drain([&](const LoadSample& s) { seen.push_back(s.time_ns); }, 4), 4u);
  EXPECT_EQ(ring->drain([&](const LoadSample& s) { seen.push_back(s.time_ns); }, 100), 6u);
  std::vector<uint64_t> want(10);
  for (int i = 0; i < 10; ++i)
    want[i] = i;
  EXPECT_EQ(seen, want);
}

TEST(LoadRing, WorksWithOtherSampleTypes) {
  struct Wide {
    uint64_t a, b, c, d, e;
  };
  auto ring = *LoadRing<Wide>::make(4);
  ASSERT_TRUE(ring->push(Wide{1, 2, 3, 4, 5}));
  std::vector<Wide> out;
  ring->drain([&](const Wide& w) { out.push_back(w); });
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].e, 5u);
}

TEST(WindowStats, RejectsBadOptions) {
  EXPECT_FALSE(WindowStats::make(0.0).ok());
  EXPECT_FALSE(WindowStats::make(1.5).ok());
  EXPECT_FALSE(WindowStats::make(NAN).ok());
  EXPECT_FALSE(WindowStats::make(0.5, 0).ok());
  EXPECT_TRUE(WindowStats::make(1.0, 1).ok());
}

TEST(WindowStats, SummarisesAWindowExactly) {
  auto w = *WindowStats::make(0.5, 1000);
  for (int i = 1; i <= 100; ++i)
    w.add(i);
  WindowSummary s = w.close();
  EXPECT_EQ(s.count, 100u);
  EXPECT_DOUBLE_EQ(s.sum, 5050);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 100);
  EXPECT_DOUBLE_EQ(s.p50, 50);  // nearest rank: ceil(0.5*100) = 50th value
  EXPECT_DOUBLE_EQ(s.p99, 99);
  EXPECT_DOUBLE_EQ(s.ewma, 50.5);  // first window seeds the EWMA
  EXPECT_FALSE(s.sampled);
}

TEST(WindowStats, EwmaFoldsWindowMeansAndSkipsEmptyWindows) {
  auto w = *WindowStats::make(0.25, 16);
  w.add(8);
  EXPECT_DOUBLE_EQ(w.close().ewma, 8);
  w.add(16);
  EXPECT_DOUBLE_EQ(w.close().ewma, 0.25 * 16 + 0.75 * 8);
  WindowSummary empty = w.close();
  EXPECT_EQ(empty.count, 0u);
  EXPECT_DOUBLE_EQ(empty.mean, 0);
  EXPECT_DOUBLE_EQ(empty.ewma, 10);
  EXPECT_EQ(w.windows(), 3u);
}

TEST(WindowStats, WindowsAreIndependent) {
  auto w = *WindowStats::make(1.0, 16);
  w.add(1000);
  (void)w.close();
  w.add(1);
  w.add(3);
  WindowSummary s = w.close();
  EXPECT_EQ(s.count, 2u);
  EXPECT_DOUBLE_EQ(s.max, 3);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.ewma, 2);
}

TEST(WindowStats, MemoryStaysBoundedAndPercentilesStayClose) {
  // 1,000,000 values through a 4096-value reservoir: exact count/sum/min/max,
  // percentiles within 2% of the true ones.
  auto w = *WindowStats::make(0.2, 4096);
  const int n = 1000000;
  for (int i = 0; i < n; ++i)
    w.add(static_cast<double>((i * 7919L) % n));
  WindowSummary s = w.close();
  EXPECT_EQ(s.count, static_cast<uint64_t>(n));
  EXPECT_TRUE(s.sampled);
  EXPECT_DOUBLE_EQ(s.min, 0);
  EXPECT_DOUBLE_EQ(s.max, n - 1);
  EXPECT_DOUBLE_EQ(s.sum, static_cast<double>(n) * (n - 1) / 2);
  EXPECT_NEAR(s.p50, 0.50 * n, 0.02 * n);
  EXPECT_NEAR(s.p99, 0.99 * n, 0.02 * n);
}

TEST(WindowStats, SummarisesDrainedRing) {
  auto ring = *LoadRing<LoadSample>::make(64);
  auto w = *WindowStats::make(0.5, 64);
  for (int i = 0; i < 50; ++i)
    ASSERT_TRUE(ring->push(sample(i, i % 10)));
  ring->drain([&](const LoadSample& s) { w.add(s.value); });
  WindowSummary s = w.close();
  EXPECT_EQ(s.count, 50u);
  EXPECT_DOUBLE_EQ(s.mean, 4.5);
  EXPECT_DOUBLE_EQ(s.p99, 9);
}

}  // namespace
}  // namespace psld
