#include "bench/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "bench/stats.h"

namespace psld::bench {

using nlohmann::json;

namespace {

// Below this many repetitions a 10% shift under 3% noise is not reliably
// flagged at alpha 0.05 (tests/bench_stats_test.cc measures it).
constexpr size_t kFewRepetitions = 9;
// A yardstick that varies more than this within one run means the machine
// was busy during it: the ratios are still paired, but noisier.
constexpr double kNoisyYardstick = 0.10;

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The 1-minute load average at the start or end of a run, if recorded: a
// number (psld bench run) or getloadavg's three, 1-minute first.
std::optional<double> load_at(const json& context, const char* key) {
  const json* v = find_path(context, {"psld", key});
  if (v != nullptr && v->is_array() && !v->empty()) v = &(*v)[0];
  if (v == nullptr || !v->is_number()) return std::nullopt;
  return v->get<double>();
}

std::optional<double> cores_of(const json& context) {
  for (const json* v : {find_path(context, {"psld", "cores"}), find_path(context, {"num_cpus"})}) {
    if (v != nullptr && v->is_number() && v->get<double>() > 0) return v->get<double>();
  }
  return std::nullopt;
}

void warn_about_context(const Report& base, const Report& fresh, Comparison& c) {
  const std::pair<const char*, const Report*> sides[] = {{"BASE", &base}, {"NEW", &fresh}};
  for (auto [side, report] : sides) {
    const auto cores = cores_of(report->context);
    if (!cores) continue;
    for (const char* key : {"load_avg_start", "load_avg_end"}) {
      const auto load = load_at(report->context, key);
      if (load && *load > *cores) {
        c.warnings.push_back(fmt::format(
            "{} ran on a loaded machine: load average {:.2f} at its {} on {} cores", side, *load,
            std::string_view(key) == "load_avg_start" ? "start" : "end", *cores));
      }
    }
  }
  struct Field {
    std::initializer_list<const char*> path;
    const char* what;
  };
  const Field fields[] = {{{"host_name"}, "hosts"},
                          {{"psld", "build_type"}, "build types"},
                          {{"psld", "compiler"}, "compilers"},
                          {{"psld", "isa"}, "kernel ISAs"}};
  for (const Field& f : fields) {
    const std::string a = string_in(base.context, f.path), b = string_in(fresh.context, f.path);
    if (!a.empty() && !b.empty() && a != b) {
      c.warnings.push_back(
          fmt::format("BASE and NEW come from different {}: {} and {}", f.what, a, b));
    }
  }
}

// Rows whose yardstick varied a lot within a run.
void warn_about_yardsticks(const Report& report, const char* side, Comparison& c) {
  std::set<std::string> yardsticks;
  for (const Row& r : report.rows) {
    if (!r.yardstick.empty()) yardsticks.insert(r.yardstick);
  }
  for (const std::string& y : yardsticks) {
    const std::vector<double> t = samples_of(report, y, "real_time");
    const double cv = coefficient_of_variation(t);
    if (cv > kNoisyYardstick) {
      c.warnings.push_back(fmt::format(
          "{}: the yardstick {} varied by {:.0f}% (coefficient of variation over {} repetitions): "
          "the machine was busy, so its rows are noisier",
          side, y, 100 * cv, t.size()));
    }
  }
}

}  // namespace

std::optional<bool> higher_is_better(const std::string& metric) {
  if (metric == "ratio" || ends_with(metric, "_per_second")) return true;
  if (metric == "real_time" || metric == "cpu_time" || ends_with(metric, "_time")) return false;
  return std::nullopt;
}

size_t Comparison::count(Verdict v) const {
  return static_cast<size_t>(std::count_if(rows.begin(), rows.end(),
                                           [v](const RowComparison& r) { return r.verdict == v; }));
}

Result<Comparison> compare(const Report& base, const Report& fresh, const CompareOptions& o) {
  if (!(o.threshold >= 0 && o.threshold < 10)) {
    return InvalidArgument(fmt::format("threshold {} is not a fraction in [0, 10)", o.threshold));
  }
  if (!(o.alpha > 0 && o.alpha < 1)) {
    return InvalidArgument(fmt::format("alpha {} is not in (0, 1)", o.alpha));
  }
  Comparison c;
  c.metric = o.metric;
  const std::optional<bool> direction =
      o.higher_is_better ? o.higher_is_better : higher_is_better(o.metric);
  if (!direction) {
    return InvalidArgument(fmt::format(
        "psld bench compare does not know whether more '{}' is better; say --higher-is-better "
        "or --lower-is-better",
        o.metric));
  }
  c.higher_is_better = *direction;

  std::vector<std::string> order;
  std::set<std::string> in_base, in_new;
  for (const Row& r : base.rows) {
    if (in_base.insert(r.name).second) order.push_back(r.name);
  }
  for (const Row& r : fresh.rows) {
    if (in_new.insert(r.name).second && in_base.count(r.name) == 0) c.only_in_new.push_back(r.name);
  }
  // Yardsticks carry no ratio of their own: not worth a line when comparing ratios.
  std::set<std::string> yardsticks;
  for (const Report* report : {&base, &fresh}) {
    for (const Row& r : report->rows) {
      if (!r.yardstick.empty()) yardsticks.insert(r.yardstick);
    }
  }
  size_t fewest = SIZE_MAX;
  for (const std::string& name : order) {
    if (in_new.count(name) == 0) {
      c.only_in_base.push_back(name);
      continue;
    }
    const std::vector<double> a = samples_of(base, name, o.metric);
    const std::vector<double> b = samples_of(fresh, name, o.metric);
    if (a.empty() || b.empty()) {
      if (!(a.empty() && b.empty() && o.metric == "ratio" && yardsticks.count(name) != 0)) {
        c.without_metric.push_back(name);
      }
      continue;
    }
    RowComparison r;
    r.name = name;
    r.n_base = a.size();
    r.n_new = b.size();
    fewest = std::min({fewest, a.size(), b.size()});
    r.median_base = median(a);
    r.median_new = median(b);
    r.change = r.median_base != 0 ? (r.median_new - r.median_base) / std::fabs(r.median_base) : 0;
    r.p = mann_whitney(a, b).p;
    r.tested = smallest_p(a.size(), b.size()) < o.alpha;
    const double worse = c.higher_is_better ? -r.change : r.change;
    const bool significant = !r.tested || r.p < o.alpha;
    if (significant && worse > o.threshold) r.verdict = Verdict::kRegression;
    if (significant && -worse > o.threshold) r.verdict = Verdict::kImprovement;
    c.rows.push_back(r);
  }
  if (c.rows.empty()) {
    return InvalidArgument(fmt::format(
        "BASE and NEW have no row in common with a '{}' value ({} rows only in BASE, {} only in "
        "NEW, {} without the metric)",
        o.metric, c.only_in_base.size(), c.only_in_new.size(), c.without_metric.size()));
  }
  if (fewest < kFewRepetitions) {
    c.warnings.push_back(fmt::format(
        "some rows have only {} repetition{} on a side: fewer than {} may miss a 10% change under "
        "3% noise{}; run with --repetitions {} or more",
        fewest, fewest == 1 ? "" : "s", kFewRepetitions,
        smallest_p(fewest, fewest) >= o.alpha
            ? fmt::format(", and no p-value can reach alpha {} (those rows are judged by their "
                          "change alone, marked 'untested')",
                          o.alpha)
            : "",
        kFewRepetitions));
  }
  warn_about_context(base, fresh, c);
  warn_about_yardsticks(base, "BASE", c);
  warn_about_yardsticks(fresh, "NEW", c);
  return c;
}

namespace {

std::string number(double v) {
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-3)) return fmt::format("{:.3e}", v);
  return fmt::format("{:.4g}", v);
}

std::string verdict_cell(const RowComparison& r) {
  std::string v;
  switch (r.verdict) {
    case Verdict::kRegression:
      v = "**REGRESSION**";
      break;
    case Verdict::kImprovement:
      v = "improved";
      break;
    case Verdict::kSame:
      v = "same";
      break;
  }
  if (!r.tested) v += " (untested)";
  return v;
}

}  // namespace

std::string markdown(const Comparison& c, const CompareOptions& o) {
  std::string out = fmt::format(
      "| row | {} base | {} new | change | p | n base/new | verdict |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: | --- |\n",
      c.metric, c.metric);
  for (const RowComparison& r : c.rows) {
    out += fmt::format("| {} | {} | {} | {:+.1f}% | {:.3g} | {}/{} | {} |\n", r.name,
                       number(r.median_base), number(r.median_new), 100 * r.change, r.p, r.n_base,
                       r.n_new, verdict_cell(r));
  }
  auto counted = [](size_t n, const char* what) {
    return fmt::format("{} {}{}", n, what, n == 1 ? "" : "s");
  };
  out += fmt::format(
      "\n{} compared on {} ({} is better): {}, {}; a regression is p < {} and a change beyond "
      "{:.1f}% in the bad direction.\n",
      counted(c.rows.size(), "row"), c.metric, c.higher_is_better ? "higher" : "lower",
      counted(c.count(Verdict::kRegression), "regression"),
      counted(c.count(Verdict::kImprovement), "improvement"), o.alpha, 100 * o.threshold);
  auto list = [&out](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    out += fmt::format("{} ({}):", what, names.size());
    for (size_t i = 0; i < names.size() && i < 10; ++i)
      out += " " + names[i];
    if (names.size() > 10) out += fmt::format(" and {} more", names.size() - 10);
    out += "\n";
  };
  list("Only in BASE", c.only_in_base);
  list("Only in NEW", c.only_in_new);
  list(fmt::format("Without {} on a side", c.metric).c_str(), c.without_metric);
  for (const std::string& w : c.warnings)
    out += "warning: " + w + "\n";
  return out;
}

}  // namespace psld::bench
