// bench/report.h — one benchmark run as `psld bench run` writes it and
// `psld bench compare` reads it: Google Benchmark-shaped JSON, so that
// compare.py (Debian's libbenchmark-tools), github-action-benchmark and
// bencher read it unmodified.
//
//   {"context": {Google Benchmark's context ..., "psld": {git_sha, build_type,
//                compiler, isa, transport, medium, cores, load_avg_start,
//                load_avg_end, suites, repetitions, command}},
//    "benchmarks": [{"name": "kernels/BM_reduce_fp32/4096",
//                    "run_name": ..., "run_type": "iteration",
//                    "repetitions": 9, "repetition_index": 0, "threads": 1,
//                    "iterations": N, "real_time": ..., "cpu_time": ...,
//                    "time_unit": "ns", "bytes_per_second": ...,
//                    "ratio": 0.93, "yardstick": "kernels/BM_memcpy/4096"},
//                   ..., {"name": "..._median", "run_type": "aggregate",
//                         "aggregate_name": "median", ...}]}
//
// `ratio` is the row's speed over its yardstick's, measured back to back in
// the same repetition (higher is better); a yardstick row has none.
#pragma once

#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "psld/status.h"

namespace psld::bench {

struct Row {
  std::string name;       // "<suite>/<benchmark>", unique per repetition
  int repetition = 0;     // repetition_index
  int repetitions = 1;    // of the run
  std::string label;      // Google Benchmark's label (e.g. the kernel's ISA)
  std::string yardstick;  // the name of the row `ratio` is against; empty for none
  // Every number of the row: real_time and cpu_time in ns, iterations,
  // bytes_per_second, items_per_second, ratio, counters.
  std::map<std::string, double> values;
};

struct Report {
  nlohmann::json context = nlohmann::json::object();
  std::vector<Row> rows;  // iteration rows only, in run order
};

// Parses a Google Benchmark JSON document. Aggregate rows (mean, median, ...)
// are skipped: the samples are the iteration rows. Times are converted to
// ns. A row without a name or a real_time, or a document without a
// "benchmarks" array, is an InvalidArgument naming it.
Result<Report> parse_report(const std::string& text, const std::string& what);
Result<Report> read_report(const std::string& path);

// The document: the iteration rows, then one median aggregate per name.
std::string format_report(const Report& report);
Status write_report(const std::string& path, const Report& report);

// The value at `path` in a context (find_path({"psld", "isa"})), or nullptr.
const nlohmann::json* find_path(const nlohmann::json& context,
                                std::initializer_list<const char*> path);
// That value as text (a number as JSON writes it), or "" when absent.
std::string string_in(const nlohmann::json& context, std::initializer_list<const char*> path);

// The values of `metric` of the rows named `name`, in repetition order.
std::vector<double> samples_of(const Report& report, const std::string& name,
                               const std::string& metric);

}  // namespace psld::bench
