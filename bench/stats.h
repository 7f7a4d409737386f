// bench/stats.h — the statistics behind `psld bench compare`: medians, the
// coefficient of variation, and the two-sided Mann-Whitney U test.
//
// Pure functions of their samples, unit tested against reference values
// computed with scipy.stats.mannwhitneyu (tests/bench_stats_test.cc).
#pragma once

#include <span>

namespace psld::bench {

// The median; 0 for no samples.
double median(std::span<const double> samples);

// Standard deviation (n - 1) over the mean's magnitude; 0 for fewer than two
// samples or a zero mean.
double coefficient_of_variation(std::span<const double> samples);

struct MannWhitney {
  double u = 0;        // U of the first sample (scipy's `statistic`)
  double p = 1;        // two-sided p-value
  bool exact = false;  // from the exact distribution of U, not the normal approximation
};

// The two-sided Mann-Whitney U test of "a and b come from one distribution",
// as scipy.stats.mannwhitneyu(a, b, alternative="two-sided") computes it with
// method="auto": the exact distribution of U when one sample has at most 8
// values and no value repeats across them, otherwise the normal
// approximation with the tie correction and a continuity correction of 0.5.
// Samples where every value is the same give p = 1. Either sample empty: p = 1.
MannWhitney mann_whitney(std::span<const double> a, std::span<const double> b);

// The smallest two-sided p-value the test can give for samples of these
// sizes (all of a below all of b): with 2 and 2 it is 1/3, so no alpha below
// that can ever be met, and a comparison must say so rather than pass.
double smallest_p(size_t n_a, size_t n_b);

}  // namespace psld::bench
