// tools/sim/sim.h — `psld sim`: a discrete-event model of a BSP job that runs
// the real control plane (docs/sim.md).
//
// W workers push and pull every key of a model once a round; S servers serve
// the keys their placement gives them, each behind a link of a bandwidth
// (each way) or with a reduce of a rate, following a trace. A server's time
// in a round is its bytes over that capacity; the round is the slowest
// server's time, plus the CPU of every chunk on the cores the job shares,
// plus the workers' own time. Every stats interval (simulated) each server
// reports its window, and each worker what it saw of the servers (cut to
// stats.worker_peers by the workers' own sampling code), as a
// protocol::LoadReport into the coordinator's real LoadHistory; the highest
// round the workers report is the job's round, as at the coordinator; every
// balancer interval the real BalanceFeed cuts the balancer's input from it
// and the real Balancer decides; a step switches the placement `margin`
// rounds later, as the coordinator's epoch switch does, and its migration
// costs its bytes on both servers' links in the switch round.
//
// Nothing here reads the environment, and the clock only to measure the
// coordinator's own CPU (SimResult::coordinator_s): one seed, one result.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/stragglers.h"
#include "bench/stragglers_report.h"
#include "lib/balancer/balancer.h"
#include "lib/coordinator/balance_feed.h"
#include "lib/placement/placement.h"
#include "psld/status.h"

namespace psld::sim {

// How servers' capacities move over the run, as bench::CapacityEvents (from
// a round on, a server runs at a factor of the nominal capacity). Specs:
//   step:SERVER:ROUND:FACTOR       from ROUND on (0: the start)
//   moving:FACTOR:PERIOD           a straggler at FACTOR on server 0, moving to
//                                  the next server every PERIOD rounds
//   oscillate:SERVER:FACTOR:PERIOD FACTOR and 1 in turn, PERIOD rounds each
//   walk:SIGMA:LO                  every server: a random walk of its log
//                                  factor, SIGMA a round, within [LO, 1]
//   file:PATH                      lines "ROUND SERVER FACTOR" ('#' comments)
// Events of several specs combine; at one round and server the last wins.
Result<std::vector<bench::CapacityEvent>> parse_trace(std::string_view spec, uint32_t servers,
                                                      uint64_t rounds, uint64_t seed);

struct SimOptions {
  uint32_t workers = 4;
  uint32_t servers = 4;  // members of epoch 0: ids 0 .. servers - 1
  uint32_t standby = 0;  // ids servers .. servers + standby - 1
  uint64_t rounds = 300;
  std::vector<bench::ModelKey> keys;
  bench::Resource resource = bench::Resource::kLink;
  double capacity = 100e6;  // bytes/s: the link each way (kLink) or the reduce (kCompute)
  std::vector<bench::CapacityEvent> events;  // sorted by round
  // CPU per chunk and worker (its push, reduce, update and pull, on worker
  // and server together), and the cores every member of the job shares (0:
  // each server has its own). With shared cores the round pays the whole
  // job's CPU, divided by the cores; a server's busy time counts its own
  // chunks' CPU. The defaults fit `psld bench stragglers` on 2 cores
  // (docs/sim.md).
  double chunk_s = 10.5e-6;
  uint32_t cores = 2;
  double other_s = 4.7e-3;  // the rest of a round: workers' own work, latency
  // Noise of a shared machine: each server's time a round is multiplied by
  // 1 + noise x X, X >= 0 a correlated series of mean about 0.25 with spikes
  // of 1-3 (docs/sim.md); 0: none.
  double noise = 0;
  uint64_t seed = 1;
  // The control plane, as the coordinator runs it.
  bool balance = false;
  BalancerOptions balancer;
  double stats_interval_s = 0.05;
  // Workers report too (their rounds, and their view of the servers): the
  // balancer's round count comes from them, as at the coordinator. Off: the
  // simulated round itself.
  bool worker_reports = true;
  uint32_t worker_peers = 0;  // stats.worker_peers: 0 auto, 65536 every server
  double balancer_interval_s = 0.25;
  // Rounds from a decision to its switch: the coordinator's.
  uint32_t switch_margin = kSwitchMarginRounds;
  // Bytes a migration ships per parameter byte moved (1: sum mode's
  // parameters alone; 2 with a momentum buffer).
  double migration_bytes_per_byte = 1;
  // Epoch 0 when not the consistent-hash ring (a static policy's).
  std::shared_ptr<const Placement> initial;
  // Called after each round with the placement in force; for tests.
  std::function<void(uint64_t round, const Placement&)> on_round;
};

struct SimStep {
  uint64_t round = 0;  // when it was decided
  std::string kind;
  std::string reason;
};

struct SimResult {
  bench::RunResult run;  // round times in simulated ms; seconds simulated
  std::vector<SimStep> steps;
  uint64_t decisions = 0;
  double migrated_bytes = 0;  // shipped by all switches
  uint64_t reports = 0;       // LoadReports the coordinator took
  uint64_t worker_reports = 0;
  uint64_t peer_entries = 0;  // in the workers' reports
  uint64_t arc_entries = 0;   // in the servers'
  // Measured, not simulated: CPU the coordinator's code took (ingesting the
  // reports, BalanceFeed and the Balancer's decisions), in seconds.
  double coordinator_s = 0;
  double ingest_s = 0;  // of which ingesting
  std::optional<Placement> final_placement;
};

Result<SimResult> simulate(const SimOptions& options);

// `psld sim [flags]`; argv[0] is "sim". Tables on stdout, progress on
// stderr; returns the exit code.
int run_sim(int argc, char** argv);

}  // namespace psld::sim
