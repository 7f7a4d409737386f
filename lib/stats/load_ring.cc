#include "lib/stats/load_ring.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace psld {

Result<WindowStats> WindowStats::make(double ewma_alpha, size_t max_values) {
  if (!(ewma_alpha > 0.0 && ewma_alpha <= 1.0)) {
    return InvalidArgument("WindowStats ewma_alpha must be in (0, 1], got " +
                           std::to_string(ewma_alpha));
  }
  if (max_values < 1 || max_values > (size_t{1} << 24)) {
    return InvalidArgument("WindowStats max_values must be in [1, 16777216], got " +
                           std::to_string(max_values));
  }
  return WindowStats(ewma_alpha, max_values);
}

WindowStats::WindowStats(double alpha, size_t max_values) : alpha_(alpha), max_values_(max_values) {
  values_.reserve(max_values_);
}

namespace {
// Nearest-rank percentile: the smallest value with at least q of the values at
// or below it. Reorders `v`.
double percentile(std::vector<double>& v, double q) {
  size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  rank = std::clamp<size_t>(rank, 1, v.size());
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(rank - 1), v.end());
  return v[rank - 1];
}
}  // namespace

WindowSummary WindowStats::close() {
  WindowSummary s;
  s.count = count_;
  s.sum = sum_;
  if (count_ > 0) {
    s.mean = sum_ / static_cast<double>(count_);
    s.min = min_;
    s.max = max_;
    s.sampled = count_ > values_.size();
    s.p50 = percentile(values_, 0.50);
    s.p99 = percentile(values_, 0.99);
    ewma_ = has_ewma_ ? alpha_ * s.mean + (1.0 - alpha_) * ewma_ : s.mean;
    has_ewma_ = true;
  }
  s.ewma = ewma_;
  ++windows_;
  values_.clear();
  count_ = 0;
  sum_ = 0;
  min_ = max_ = 0;
  return s;
}

}  // namespace psld
