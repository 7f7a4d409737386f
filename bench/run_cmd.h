// bench/run_cmd.h — `psld bench run` (tools/psld.cc calls it): the benchmark
// suites, repeated, into one Google Benchmark-shaped report (bench/report.h)
// that `psld bench compare` reads.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "bench/report.h"

namespace psld::bench {

// argv holds what follows "psld bench run". Returns the exit status: 0 when
// every suite ran, 1 when one failed, 2 on bad options.
int cmd_run(int argc, char** argv);

// What to run: suites by name, quick or full, from each of bench_dirs (one
// report per directory; a build's bench/ holds the programs).
struct RunPlan {
  std::vector<std::string> suites;
  bool quick = true;
  int repetitions = 9;
  std::vector<std::string> bench_dirs;
  // Per directory: variables set for its programs (e.g. PSLD_KERNEL_ISA).
  std::vector<std::map<std::string, std::string>> env;
  bool verbose = false;  // the programs' output to stderr, not to logs
  std::string command;   // recorded in the reports' context
};

// Runs every suite of the plan once per repetition from each directory in
// turn (repetition 1: A's suites, then B's; repetition 2: ...), so that two
// builds are measured A/B, interleaved, under the same conditions. One
// report per directory, its context filled. Aborted on SIGINT or SIGTERM
// (the running program is stopped first); a failed program fails the run
// with the end of its output.
Result<std::vector<Report>> run_suites(const RunPlan& plan);

// The names of the suites there are.
std::vector<std::string> suite_names();

// One repetition's rows of a Google Benchmark suite, as `psld bench run`
// keeps them: names prefixed "<suite>/", every row's yardstick named and its
// ratio computed against the yardstick row of the same repetition (the same
// process run), with `speed` the metric compared ("bytes_per_second",
// "items_per_second", or "real_time", where the ratio is yardstick time over
// row time). Rows whose yardstick is missing from the run keep no ratio.
// Exposed for tests.
enum class Speed : uint8_t { kBytesPerSecond, kItemsPerSecond, kInverseTime };
void add_ratios(std::vector<Row>& rows, const std::string& suite,
                std::string (*yardstick_of)(const std::string& name), Speed speed);

}  // namespace psld::bench
