// bench/compare.h — `psld bench compare`: is NEW slower than BASE, beyond the
// noise of a shared machine?
//
// Rows are paired by name. Per row: the medians of the chosen metric over
// the repetitions, the change in percent, and the two-sided Mann-Whitney U
// p-value of the two sets of samples. A row is a regression only when the
// test says the samples differ (p < alpha) *and* the change is beyond the
// threshold in the bad direction; an improvement is the same in the good
// direction. When the samples are too few for any p-value to reach alpha
// (2 and 2 repetitions: the smallest p is 1/3), the row is judged by its
// change alone and says so. Everything here is pure and unit tested.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "bench/report.h"

namespace psld::bench {

struct CompareOptions {
  std::string metric = "ratio";
  double threshold = 0.05;  // a fraction: 0.05 = 5%
  double alpha = 0.05;
  // For a metric whose direction compare does not know (a custom counter).
  std::optional<bool> higher_is_better;
};

// Whether more of `metric` is better: ratio and *_per_second yes; real_time,
// cpu_time and *_time no; nullopt for a name it does not know.
std::optional<bool> higher_is_better(const std::string& metric);

enum class Verdict : uint8_t {
  kSame,         // no change beyond the threshold that the test confirms
  kRegression,   // worse, confirmed
  kImprovement,  // better, confirmed
};

struct RowComparison {
  std::string name;
  size_t n_base = 0, n_new = 0;
  double median_base = 0, median_new = 0;
  double change = 0;   // (new - base) / base, of the medians
  double p = 1;        // Mann-Whitney, two-sided
  bool tested = true;  // false: the samples were too few for p to reach alpha
  Verdict verdict = Verdict::kSame;
};

struct Comparison {
  std::string metric;
  bool higher_is_better = true;
  std::vector<RowComparison> rows;        // in BASE's order
  std::vector<std::string> only_in_base;  // rows NEW lacks
  std::vector<std::string> only_in_new;
  std::vector<std::string> without_metric;  // in both, but one lacks the metric
  std::vector<std::string> warnings;

  size_t count(Verdict v) const;
};

// InvalidArgument when no row is in both with the metric, or a threshold or
// alpha is out of range, or the metric's direction is unknown and not given.
Result<Comparison> compare(const Report& base, const Report& fresh, const CompareOptions& o);

// The table for CI logs and PR comments, with the warnings under it.
std::string markdown(const Comparison& c, const CompareOptions& o);

}  // namespace psld::bench
