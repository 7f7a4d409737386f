// The statistics of `psld bench compare` (bench/stats.h) against reference
// values from scipy 1.10 (scipy.stats.mannwhitneyu(a, b,
// alternative="two-sided"), method "auto"), and their power on synthetic
// samples: what the gate flags and what it must not.
#include "bench/stats.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace psld::bench {
namespace {

struct Reference {
  const char* what;
  std::vector<double> a, b;
  double u, p;
  bool exact;
};

TEST(MannWhitney, MatchesScipy) {
  const Reference cases[] = {
      {"no ties, 5 and 5, all apart",
       {1, 2, 3, 4, 5},
       {6, 7, 8, 9, 10},
       0.0,
       0.007936507936507936,
       true},
      {"no ties, 6 and 7, interleaved",
       {1.1, 2.5, 3.2, 4.8, 5.0, 6.3},
       {2.0, 3.0, 4.0, 7.0, 8.5, 9.1, 10.2},
       12.0,
       0.23426573426573427,
       true},
      {"ties, 5 and 5", {1, 2, 2, 3, 4}, {2, 3, 3, 5, 6}, 6.0, 0.19882894401644247, false},
      {"9 and 9, a 10% shift",
       {100, 101, 99, 102, 98, 100.5, 99.5, 101.5, 98.5},
       {110, 111, 109, 112, 108, 110.5, 109.5, 111.5, 108.5},
       0.0,
       0.00041229480206169127,
       false},
      {"9 and 10, one distribution, a tie",
       {1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.01, 0.99},
       {1.03, 0.97, 1.04, 0.96, 1.0, 1.06, 0.94, 1.07, 0.93, 1.08},
       41.5,
       0.8064127004978174,
       false},
      {"1 and 1", {1}, {2}, 0.0, 1.0, true},
      {"2 and 2", {1, 2}, {3, 4}, 0.0, 0.3333333333333333, true},
      {"12 and 12, many ties",
       {5, 5, 6, 7, 7, 7, 8, 9, 9, 10, 11, 12},
       {7, 8, 8, 9, 10, 10, 11, 12, 12, 13, 14, 15},
       30.0,
       0.01592095627721573,
       false},
  };
  for (const Reference& c : cases) {
    SCOPED_TRACE(c.what);
    const MannWhitney r = mann_whitney(c.a, c.b);
    EXPECT_DOUBLE_EQ(r.u, c.u);
    EXPECT_NEAR(r.p, c.p, 1e-12 + 1e-9 * c.p);
    EXPECT_EQ(r.exact, c.exact);
    // Two-sided: the same p with the samples swapped.
    EXPECT_NEAR(mann_whitney(c.b, c.a).p, r.p, 1e-12);
  }
}

TEST(MannWhitney, DegenerateSamples) {
  EXPECT_EQ(mann_whitney({}, std::vector<double>{1, 2}).p, 1.0);
  EXPECT_EQ(mann_whitney(std::vector<double>{1, 2}, {}).p, 1.0);
  // Every value equal: nothing tells the samples apart.
  const std::vector<double> same(12, 3.0);
  EXPECT_EQ(mann_whitney(same, same).p, 1.0);
}

TEST(MannWhitney, SmallestPSaysWhenNoTestCanPass) {
  EXPECT_NEAR(smallest_p(2, 2), 1.0 / 3, 1e-12);
  EXPECT_NEAR(smallest_p(1, 9), 0.2, 1e-12);
  EXPECT_LT(smallest_p(4, 4), 0.05);  // 2 / 70
  EXPECT_GT(smallest_p(3, 3), 0.05);  // 2 / 20
  EXPECT_EQ(smallest_p(0, 5), 1.0);
}

TEST(Stats, MedianAndVariation) {
  EXPECT_EQ(median(std::vector<double>{3, 1, 2}), 2);
  EXPECT_EQ(median(std::vector<double>{4, 1, 3, 2}), 2.5);
  EXPECT_EQ(median({}), 0);
  EXPECT_EQ(coefficient_of_variation(std::vector<double>{5}), 0);
  EXPECT_NEAR(coefficient_of_variation(std::vector<double>{9, 10, 11}), 0.1, 1e-12);
}

// How often the test says p < 0.05 for 9 against 9 samples of N(1, 3%)
// against N(1 + shift, 3%), over 400 seeded trials.
double rejection_rate(double shift, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 0.03);
  int rejected = 0;
  constexpr int kTrials = 400;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<double> a, b;
    for (int i = 0; i < 9; ++i) {
      a.push_back(1.0 + noise(rng));
      b.push_back(1.0 + shift + noise(rng));
    }
    rejected += mann_whitney(a, b).p < 0.05;
  }
  return static_cast<double>(rejected) / kTrials;
}

TEST(MannWhitney, FlagsATenPercentShiftUnderThreePercentNoise) {
  // A 10% shift is 3.3 standard deviations: with 9 repetitions a side the
  // test finds it nearly always.
  EXPECT_GE(rejection_rate(0.10, 1), 0.97);
  EXPECT_GE(rejection_rate(-0.10, 2), 0.97);
}

TEST(MannWhitney, RarelyFlagsIdenticalDistributions) {
  // The false-positive rate is alpha, at most: ~5% of trials (the gate also
  // asks for a change beyond its threshold, which removes most of those).
  EXPECT_LE(rejection_rate(0.0, 3), 0.08);
}

}  // namespace
}  // namespace psld::bench
