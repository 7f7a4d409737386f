// `psld bench compare BASE NEW [options]`: the command around bench/compare.h.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "bench/compare.h"
#include "bench/compare_cmd.h"
#include "bench/run_cmd.h"

namespace psld::bench {
namespace {

constexpr const char* kCompareUsage =
    "usage: psld bench compare BASE NEW [--metric ratio|bytes_per_second|real_time|NAME]\n"
    "                          [--threshold 5%] [--alpha 0.05] [--markdown FILE]\n"
    "                          [--higher-is-better | --lower-is-better]\n"
    "                          [--rerun] [--rerun-repetitions N]\n"
    "  BASE and NEW are Google Benchmark-shaped JSON reports (psld bench run --json,\n"
    "  or any benchmark's --benchmark_out). Exit status: 1 when a row regressed\n"
    "  (p < alpha and a change beyond the threshold in the bad direction), 0 when\n"
    "  none did, 2 when the input or the options are wrong. --rerun: the rows\n"
    "  flagged are measured again, base and new programs interleaved A/B (from\n"
    "  the bench directories the reports name), and only those confirmed count;\n"
    "  9 repetitions each, or as many as the reports have, or N.\n";

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

std::string context_string(const Report& r, const char* key) {
  return string_in(r.context, {"psld", key});
}

// Only the rows named (and their yardsticks, for the noise warnings).
Report only(const Report& r, const std::set<std::string>& names) {
  Report out;
  out.context = r.context;
  std::set<std::string> keep = names;
  for (const Row& row : r.rows) {
    if (names.count(row.name) != 0 && !row.yardstick.empty()) keep.insert(row.yardstick);
  }
  for (const Row& row : r.rows) {
    if (keep.count(row.name) != 0) out.rows.push_back(row);
  }
  return out;
}

// --rerun: the flagged rows' suites again, BASE's and NEW's programs A/B.
// Returns the comparison of the flagged rows on the new samples.
Result<Comparison> rerun_flagged(const Report& base, const Report& fresh, const Comparison& first,
                                 const CompareOptions& o, int repetitions) {
  std::set<std::string> flagged, suites;
  size_t most = 0;
  const std::vector<std::string> known = suite_names();
  for (const RowComparison& r : first.rows) {
    if (r.verdict != Verdict::kRegression) continue;
    const std::string suite = r.name.substr(0, r.name.find('/'));
    if (std::find(known.begin(), known.end(), suite) == known.end()) {
      return FailedPrecondition(
          fmt::format("--rerun: row {} is not from a psld bench run suite", r.name));
    }
    flagged.insert(r.name);
    suites.insert(suite);
    most = std::max({most, r.n_base, r.n_new});
  }
  const std::string new_dir = context_string(fresh, "bench_dir");
  const std::string base_dir = context_string(base, "bench_dir");
  namespace fs = std::filesystem;
  if (new_dir.empty() || !fs::is_directory(new_dir)) {
    return FailedPrecondition(fmt::format(
        "--rerun: NEW's programs are not on this machine (its report names bench_dir '{}')",
        new_dir));
  }
  RunPlan plan;
  plan.suites.assign(suites.begin(), suites.end());
  plan.quick = context_string(fresh, "size") != "full";
  plan.repetitions = repetitions > 0 ? repetitions : static_cast<int>(std::max<size_t>(9, most));
  // BASE's programs are where its report says only when that directory still
  // holds a build of BASE's revision: a committed baseline names a path that
  // may hold NEW's build here, or another checkout's of any revision.
  const std::string base_sha = context_string(base, "git_sha");
  const bool ab = !base_dir.empty() && fs::is_directory(base_dir) && !base_sha.empty() &&
                  base_sha != "unknown" && revision_at(base_dir) == base_sha;
  if (!base_dir.empty() && fs::is_directory(base_dir) && !ab) {
    std::fprintf(stderr,
                 "psld bench compare: --rerun: %s holds a build of revision '%s', not BASE's "
                 "'%s'\n",
                 base_dir.c_str(), revision_at(base_dir).c_str(), base_sha.c_str());
  }
  plan.bench_dirs =
      ab ? std::vector<std::string>{base_dir, new_dir} : std::vector<std::string>{new_dir};
  // Each side's kernels on the ISA its report ran (PSLD_KERNEL_ISA then).
  for (const Report* r :
       ab ? std::vector<const Report*>{&base, &fresh} : std::vector<const Report*>{&fresh}) {
    std::map<std::string, std::string> env;
    if (const std::string isa = context_string(*r, "isa"); !isa.empty()) {
      env["PSLD_KERNEL_ISA"] = isa;
    }
    plan.env.push_back(std::move(env));
  }
  plan.command = "psld bench compare --rerun";
  std::fprintf(
      stderr, "psld bench compare: --rerun: %zu flagged rows, suites %s, %d repetitions%s\n",
      flagged.size(), fmt::format("{}", fmt::join(plan.suites, ",")).c_str(), plan.repetitions,
      ab ? ", BASE and NEW programs interleaved"
         : "; BASE's programs are not here, so NEW is measured again against BASE's "
           "samples");
  PSLD_ASSIGN_OR_RETURN(std::vector<Report> again, run_suites(plan));
  const Report& base2 = ab ? again[0] : base;
  const Report& new2 = again.back();
  return compare(only(base2, flagged), only(new2, flagged), o);
}

}  // namespace

// The revision the programs in a build's bench directory were built from:
// what vcs_tag wrote into its build_info.cc (bench/meson.build) at the last
// build, or "" where there is none (not a build directory of psld).
std::string revision_at(const std::filesystem::path& bench_dir) {
  std::ifstream in(bench_dir / "build_info.cc");
  const std::string marker = "kGitDescribe = \"";
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(marker);
    if (at == std::string::npos) continue;
    const size_t from = at + marker.size();
    const size_t to = line.find('"', from);
    return to == std::string::npos ? std::string() : line.substr(from, to - from);
  }
  return {};
}

int cmd_compare(int argc, char** argv) {
  std::vector<std::string> files;
  CompareOptions o;
  std::string markdown_file;
  bool rerun = false;
  int rerun_repetitions = 0;  // 0: 9, or the most either report has
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
    } else if (arg == "--rerun") {
      rerun = true;
    } else if (arg == "--rerun-repetitions") {
      char* end = nullptr;
      long n = 0;
      if (!value(v) || (n = std::strtol(v.c_str(), &end, 10), *end != '\0') || n < 1 || n > 100) {
        return usage_error(fmt::format("--rerun-repetitions '{}' is not a number in [1, 100]", v));
      }
      rerun = true;
      rerun_repetitions = static_cast<int>(n);
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
  std::string table = markdown(*c, o);
  std::fputs(table.c_str(), stdout);
  const Comparison* verdicts = &*c;
  std::optional<Comparison> again;
  if (rerun && c->count(Verdict::kRegression) > 0) {
    auto r = rerun_flagged(*base, *fresh, *c, o, rerun_repetitions);
    if (!r.ok()) {
      std::fprintf(stderr, "psld bench compare: %s\n", r.status().to_string().c_str());
      return r.status().code() == StatusCode::kAborted ? 130 : 2;
    }
    again = std::move(*r);
    const std::string second = markdown(*again, o);
    std::printf("\nRerun of the flagged rows (only these verdicts count):\n\n%s", second.c_str());
    table += "\nRerun of the flagged rows (only these verdicts count):\n\n" + second;
    verdicts = &*again;
  }
  if (!markdown_file.empty()) {
    std::ofstream out(markdown_file, std::ios::trunc);
    out << fmt::format("### psld bench compare: {} against {}\n\n", files[1], files[0]) << table;
    if (!out) return usage_error(fmt::format("cannot write {}", markdown_file));
  }
  for (const RowComparison& r : verdicts->rows) {
    if (r.verdict == Verdict::kRegression) {
      std::fprintf(stderr, "psld bench compare: %s regressed: %s %+.1f%% (p = %.3g)\n",
                   r.name.c_str(), verdicts->metric.c_str(), 100 * r.change, r.p);
    }
  }
  return verdicts->count(Verdict::kRegression) > 0 ? 1 : 0;
}

int cmd_merge(int argc, char** argv) {
  constexpr const char* kMergeUsage =
      "usage: psld bench merge OUT IN IN...\n"
      "  One report of the repetitions of every IN (runs of the same suites, e.g.\n"
      "  a baseline measured several times so that its medians are the\n"
      "  machine's usual level, not one run's). The context is the last IN's,\n"
      "  with psld.merged_from the number of runs.\n";
  if (argc >= 1 && (std::string(argv[0]) == "-h" || std::string(argv[0]) == "--help")) {
    std::fputs(kMergeUsage, stdout);
    return 0;
  }
  if (argc < 3) {
    std::fprintf(stderr, "psld bench merge: needs OUT and at least two INs\n%s", kMergeUsage);
    return 2;
  }
  Report merged;
  int offset = 0;
  for (int i = 1; i < argc; ++i) {
    auto r = read_report(argv[i]);
    if (!r.ok()) {
      std::fprintf(stderr, "psld bench merge: %s\n", r.status().message().c_str());
      return 2;
    }
    int most = 0;
    for (Row& row : r->rows) {
      most = std::max(most, row.repetition + 1);
      row.repetition += offset;
      merged.rows.push_back(std::move(row));
    }
    offset += most;
    merged.context = r->context;
  }
  for (Row& row : merged.rows)
    row.repetitions = offset;
  merged.context["psld"]["merged_from"] = argc - 1;
  merged.context["psld"]["repetitions"] = offset;
  const Status w = write_report(argv[0], merged);
  if (!w.ok()) {
    std::fprintf(stderr, "psld bench merge: %s\n", w.to_string().c_str());
    return 1;
  }
  std::fprintf(stderr, "psld bench merge: %s: %zu rows from %d reports\n", argv[0],
               merged.rows.size(), argc - 1);
  return 0;
}

}  // namespace psld::bench
