// `psld bench compare BASE NEW [options]`: the command around bench/compare.h.
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "bench/compare.h"
#include "bench/compare_cmd.h"

namespace psld::bench {
namespace {

constexpr const char* kCompareUsage =
    "usage: psld bench compare BASE NEW [--metric ratio|bytes_per_second|real_time|NAME]\n"
    "                          [--threshold 5%] [--alpha 0.05] [--markdown FILE]\n"
    "                          [--higher-is-better | --lower-is-better]\n"
    "  BASE and NEW are Google Benchmark-shaped JSON reports (psld bench run --json,\n"
    "  or any benchmark's --benchmark_out). Exit status: 1 when a row regressed\n"
    "  (p < alpha and a change beyond the threshold in the bad direction), 0 when\n"
    "  none did, 2 when the input or the options are wrong.\n";

int usage_error(const std::string& why) {
  std::fprintf(stderr, "psld bench compare: %s\n%s", why.c_str(), kCompareUsage);
  return 2;
}

// "5%", "5" (percent) or "0.05" (a fraction below 1).
bool parse_threshold(const std::string& text, double& out) {
  if (text.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) return false;
  const std::string rest(end);
  if (rest == "%") {
    out = v / 100;
  } else if (rest.empty()) {
    out = v >= 1 ? v / 100 : v;
  } else {
    return false;
  }
  return out >= 0;
}

}  // namespace

int cmd_compare(int argc, char** argv) {
  std::vector<std::string> files;
  CompareOptions o;
  std::string markdown_file;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= argc) return false;
      out = argv[++i];
      return true;
    };
    std::string v;
    if (arg == "-h" || arg == "--help") {
      std::fputs(kCompareUsage, stdout);
      return 0;
    } else if (arg == "--metric") {
      if (!value(o.metric) || o.metric.empty()) return usage_error("--metric needs a name");
    } else if (arg == "--threshold") {
      if (!value(v) || !parse_threshold(v, o.threshold)) {
        return usage_error(fmt::format("--threshold '{}' is not a percentage like 5% or 0.05", v));
      }
    } else if (arg == "--alpha") {
      char* end = nullptr;
      if (!value(v) || (o.alpha = std::strtod(v.c_str(), &end), *end != '\0') || o.alpha <= 0 ||
          o.alpha >= 1) {
        return usage_error(fmt::format("--alpha '{}' is not a number in (0, 1)", v));
      }
    } else if (arg == "--markdown") {
      if (!value(markdown_file)) return usage_error("--markdown needs a file");
    } else if (arg == "--higher-is-better") {
      o.higher_is_better = true;
    } else if (arg == "--lower-is-better") {
      o.higher_is_better = false;
    } else if (arg.rfind("--", 0) == 0) {
      return usage_error(fmt::format("unknown option '{}'", arg));
    } else {
      files.push_back(arg);
    }
  }
  if (files.size() != 2) return usage_error("needs two reports, BASE and NEW");
  auto base = read_report(files[0]);
  if (!base.ok()) return usage_error(base.status().message());
  auto fresh = read_report(files[1]);
  if (!fresh.ok()) return usage_error(fresh.status().message());
  auto c = compare(*base, *fresh, o);
  if (!c.ok()) return usage_error(c.status().message());
  const std::string table = markdown(*c, o);
  std::fputs(table.c_str(), stdout);
  if (!markdown_file.empty()) {
    std::ofstream out(markdown_file, std::ios::trunc);
    out << fmt::format("### psld bench compare: {} against {}\n\n", files[1], files[0]) << table;
    if (!out) return usage_error(fmt::format("cannot write {}", markdown_file));
  }
  for (const RowComparison& r : c->rows) {
    if (r.verdict == Verdict::kRegression) {
      std::fprintf(stderr, "psld bench compare: %s regressed: %s %+.1f%% (p = %.3g)\n",
                   r.name.c_str(), c->metric.c_str(), 100 * r.change, r.p);
    }
  }
  return c->count(Verdict::kRegression) > 0 ? 1 : 0;
}

}  // namespace psld::bench
