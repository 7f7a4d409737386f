// lib/stats/prometheus.h — the Prometheus text exposition format (version
// 0.0.4), written: what the coordinator serves on metrics.listen
// (docs/operations.md, "Metrics").
//
// A family is announced once (# HELP, # TYPE) and its samples follow it;
// label values are escaped (backslash, double quote, newline) and numbers
// are written so that integers stay exact and NaN/Inf are spelled as the
// format wants. A histogram is given as its cumulative buckets' counts and
// becomes NAME_bucket{le=...} lines, +Inf included, then NAME_sum and
// NAME_count. Names are the caller's constants; a character a name may not
// hold is written as '_', so the output always parses.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace psld::prometheus {

enum class Type : uint8_t { kCounter, kGauge, kHistogram };

using Labels = std::vector<std::pair<std::string_view, std::string>>;

// Text for a label value or HELP line: '\' '"' and newline escaped as the
// format requires ('"' is left alone in HELP).
std::string escape_label_value(std::string_view v);
std::string escape_help(std::string_view v);
// A sample value: integers up to 2^53 exactly, others as the shortest text
// that reads back as the same double, NaN, +Inf, -Inf.
std::string format_value(double v);
// [a-zA-Z_:][a-zA-Z0-9_:]* (metric) or [a-zA-Z_][a-zA-Z0-9_]* (label).
bool valid_metric_name(std::string_view name);
bool valid_label_name(std::string_view name);

class Writer {
 public:
  // Starts family `name`; its samples follow. A family is started once.
  void family(std::string_view name, Type type, std::string_view help);
  // One sample of the current counter or gauge family.
  void sample(const Labels& labels, double value);
  // One histogram of the current histogram family: `bounds` are the upper
  // bounds of the buckets (increasing, +Inf not included) and
  // `cumulative[i]` the observations <= bounds[i]; `count` all of them
  // (the +Inf bucket) and `sum` their sum.
  void histogram(const Labels& labels, std::span<const double> bounds,
                 std::span<const uint64_t> cumulative, uint64_t count, double sum);

  const std::string& text() const { return out_; }

 private:
  void line(std::string_view suffix, const Labels& labels, std::string_view extra_name,
            std::string_view extra_value, double value);

  std::string out_;
  std::string current_;
  Type type_ = Type::kGauge;
  std::vector<std::string> started_;
};

}  // namespace psld::prometheus
