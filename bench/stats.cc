#include "bench/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace psld::bench {

double median(std::span<const double> samples) {
  if (samples.empty()) return 0;
  std::vector<double> s(samples.begin(), samples.end());
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return n % 2 == 1 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

double coefficient_of_variation(std::span<const double> samples) {
  const size_t n = samples.size();
  if (n < 2) return 0;
  const double mean = std::accumulate(samples.begin(), samples.end(), 0.0) / static_cast<double>(n);
  if (mean == 0) return 0;
  double ss = 0;
  for (double x : samples)
    ss += (x - mean) * (x - mean);
  return std::sqrt(ss / static_cast<double>(n - 1)) / std::fabs(mean);
}

namespace {

// counts[u] = the number of orderings of m values of one sample and n of the
// other (no ties) whose U is u, for u in [0, m*n]; built one value at a time
// from the recurrence f(m, n, u) = f(m-1, n, u-n) + f(m, n-1, u).
std::vector<double> u_counts(size_t m, size_t n) {
  // row[j][u] holds f(i, j, u) for the current i.
  std::vector<std::vector<double>> row(n + 1);
  for (size_t j = 0; j <= n; ++j)
    row[j] = {1.0};  // f(0, j, 0) = 1
  for (size_t i = 1; i <= m; ++i) {
    std::vector<std::vector<double>> next(n + 1);
    next[0] = {1.0};  // f(i, 0, 0) = 1
    for (size_t j = 1; j <= n; ++j) {
      std::vector<double> f(i * j + 1, 0.0);
      for (size_t u = 0; u < row[j].size(); ++u)
        f[u + j] += row[j][u];  // the largest value is from the first sample: U grows by j
      for (size_t u = 0; u < next[j - 1].size(); ++u)
        f[u] += next[j - 1][u];  // ... or from the second
      next[j] = std::move(f);
    }
    row = std::move(next);
  }
  return row[n];
}

// P(U >= u) for samples of m and n values without ties.
double exact_sf(double u, size_t m, size_t n) {
  const std::vector<double> counts = u_counts(m, n);
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  double tail = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    if (static_cast<double>(k) >= u) tail += counts[k];
  }
  return tail / total;
}

}  // namespace

MannWhitney mann_whitney(std::span<const double> a, std::span<const double> b) {
  MannWhitney r;
  const size_t n1 = a.size(), n2 = b.size();
  if (n1 == 0 || n2 == 0) return r;
  // Midranks over the pooled samples.
  struct Value {
    double x;
    bool first;
  };
  std::vector<Value> pooled;
  pooled.reserve(n1 + n2);
  for (double x : a)
    pooled.push_back({x, true});
  for (double x : b)
    pooled.push_back({x, false});
  std::sort(pooled.begin(), pooled.end(), [](const Value& l, const Value& r) { return l.x < r.x; });
  const auto n = static_cast<double>(n1 + n2);
  double rank_sum_a = 0;
  double tie_term = 0;  // sum of t^3 - t over groups of t equal values
  bool ties = false;
  for (size_t i = 0; i < pooled.size();) {
    size_t j = i;
    while (j < pooled.size() && pooled[j].x == pooled[i].x)
      ++j;
    const auto t = static_cast<double>(j - i);
    const double midrank = (static_cast<double>(i + 1) + static_cast<double>(j)) / 2;
    for (size_t k = i; k < j; ++k) {
      if (pooled[k].first) rank_sum_a += midrank;
    }
    if (j - i > 1) {
      ties = true;
      tie_term += t * t * t - t;
    }
    i = j;
  }
  const auto m1 = static_cast<double>(n1), m2 = static_cast<double>(n2);
  r.u = rank_sum_a - m1 * (m1 + 1) / 2;
  const double u_max = std::max(r.u, m1 * m2 - r.u);
  if ((n1 <= 8 || n2 <= 8) && !ties) {
    r.exact = true;
    r.p = std::min(1.0, 2 * exact_sf(u_max, n1, n2));
    return r;
  }
  const double mu = m1 * m2 / 2;
  const double var = m1 * m2 / 12 * ((n + 1) - tie_term / (n * (n - 1)));
  if (var <= 0) return r;  // every value the same: nothing tells them apart
  const double z = (u_max - mu - 0.5) / std::sqrt(var);
  r.p = std::clamp(std::erfc(z / std::sqrt(2.0)), 0.0, 1.0);  // 2 x the normal's upper tail
  return r;
}

double smallest_p(size_t n_a, size_t n_b) {
  if (n_a == 0 || n_b == 0) return 1;
  std::vector<double> a(n_a), b(n_b);
  std::iota(a.begin(), a.end(), 0.0);
  std::iota(b.begin(), b.end(), static_cast<double>(n_a));
  return mann_whitney(a, b).p;
}

}  // namespace psld::bench
