// bench/stragglers_report.h — one straggler run's measures and the report of
// a scenario: the table, the plot and the benchmark rows (docs/stragglers.md).
// Shared by `psld bench stragglers`, which measures real jobs, and `psld sim`
// (tools/sim), which simulates them, so that both print the same table.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench/report.h"
#include "bench/stragglers.h"
#include "psld/status.h"

namespace psld::bench {

// The chunk a policy's keys use. BytePS's partitions (4,096,000 bytes,
// scaled like the model) are the chunk for every policy but MXNet's, which
// splits a big array into one part per server: its chunks are a quarter of
// that, so that even the smallest big array (1e6 elements) has a part for
// each of 4 servers.
uint64_t chunk_bytes_for(Policy policy, double scale);

// One policy's run of a scenario.
struct RunResult {
  Policy policy = Policy::kPsld;
  std::vector<double> round_ms;      // [r - 1]: round r, as worker 0 saw it
  std::vector<uint8_t> migrating;    // [r - 1]: an epoch switch ran during round r
  uint64_t switches = 0;             // epoch switches committed
  double seconds = 0;                // wall time of the rounds
  std::vector<double> final_shares;  // of the bytes pushed, per server id, at the end
};

// The scenario's table: one row per policy (rounds/s, mean round, rounds to
// settle per phase, round time while migrating, switches, where the model
// ends), with speedups against the static baselines that ran.
std::string table(const Scenario& sc, const std::vector<RunResult>& results);

// The first round of each phase (1, then each event's round).
std::vector<uint64_t> phase_starts(const Scenario& sc);

// DIR/<id>.tsv (round, then each policy's round time) and, with gnuplot,
// DIR/<id>.png; without gnuplot *note says so.
Status write_plot(const std::string& out_dir, const Scenario& sc,
                  const std::vector<RunResult>& results, std::string* note);

// The scenario's rounds as report rows: every policy's round times, and
// psld's against MXNet's and the oracle's median round time, round by round.
void add_rows(const Scenario& sc, const std::vector<RunResult>& results, bench::Report& report);

Status write_file(const std::string& path, const std::string& text);

// --scenario and --policies, as both commands take them: comma lists of
// names or "all". Scenarios run for `rounds` (events at the same fractions)
// and at `scale` when given.
Result<std::vector<Scenario>> parse_scenarios(const std::string& list,
                                              std::optional<uint64_t> rounds,
                                              std::optional<double> scale);
Result<std::vector<Policy>> parse_policies(const std::string& list);

// The outputs of one run of several scenarios: each scenario's section on
// stdout and, with an output folder, in DIR/results.md with its plot; its
// rounds as benchmark rows for a JSON report. `program` prefixes errors.
class ScenarioReport {
 public:
  ScenarioReport(std::string program, std::string out_dir, std::string json)
      : program_(std::move(program)), out_dir_(std::move(out_dir)), json_(std::move(json)) {}

  // Creates the output folder, if one was named and it does not exist.
  Status open() const;
  // `description` is the line under the title; `extra` follows the table.
  Status add(const Scenario& sc, const std::string& description,
             const std::vector<RunResult>& results, const std::string& extra = "");
  // Writes results.md and the JSON report, with `context` added to its
  // context. A missing gnuplot is said on stderr.
  Status finish(const std::map<std::string, std::string>& context);

 private:
  std::string program_;
  std::string out_dir_;
  std::string json_;
  std::string markdown_;
  std::string notes_;
  Report report_;
};

}  // namespace psld::bench
