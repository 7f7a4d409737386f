// lib/balancer/balancer.h — the balancer: (placement, load history, options) -> plan.
//
// docs/design.md §6; docs/balancer.md explains the model and every option. The
// module is pure: no I/O, no clock, no threads. It remembers what it needs
// between decisions (rate estimates, hysteresis counters, the last plan, so
// that it can roll it back), and the same sequence of inputs always yields the
// same sequence of plans, bit for bit, so it runs unchanged in the coordinator
// and in a simulator.
//
// One decision:
//   predict  each server's service rate (EWMA of bytes / busy time, and its
//            spread) and each arc's load (bytes per round);
//   detect   stragglers: predicted time per round above the others' by a
//            threshold for several windows in a row;
//   exploit  move load (whole arcs, or a cut of one) so that the predicted
//            round time, max over servers of load / rate, goes down by more
//            than the migration costs over a horizon of rounds;
//   explore  move at most a fraction of a server's load per decision, check
//            the measured round time after a move and roll back a move that
//            made it worse, probe a server whose rate is unknown or stale
//            with a little load;
//   scale    add standby servers when even a balanced placement keeps the
//            servers busy; drain one that is idle or persistently slow when
//            the others can absorb its load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lib/placement/placement.h"
#include "psld/status.h"

namespace psld {

// ---- Inputs: plain structs the coordinator fills from the servers' summaries.

// One window of a server's load summary (docs/design.md §5; the coordinator's
// LoadHistory holds them: bytes = bytes_in + bytes_out, busy_s = busy_ns, and
// round_s from what the workers reported of the server). Windows of one server
// carry increasing `seq`; the balancer reads each window once, so a caller can
// pass its whole ring of recent windows to every decision.
struct ServerWindow {
  uint64_t seq = 0;
  // The placement epoch the server served under (the newer one if it switched
  // during the window). Evaluating a move waits for windows of its epoch.
  uint64_t epoch = 0;
  uint64_t rounds = 0;  // rounds the server completed in the window
  double bytes = 0;     // bytes it received and sent for them (pushes + pulls)
  double busy_s = 0;    // time it spent serving them: receive, reduce, update, send
  // The mean round time its workers saw (one push_pull of every key, from
  // issue to the last pull done): the pace of the job. 0: not measured.
  double round_s = 0;
};

struct ServerHistory {
  ServerId id = 0;
  std::vector<ServerWindow> windows;  // oldest first (increasing seq)
};

// The load of hashes [lo, hi], in bytes per round (pushes and pulls of all
// workers), measured on the arcs of a recent epoch. Ranges need not match the
// current arcs: a range's load is spread over the arcs it overlaps in
// proportion to the hashes they share. Hashes no range covers carry no load.
struct RangeLoad {
  uint64_t lo = 0;
  uint64_t hi = 0;
  double bytes_per_round = 0;
};

// A chunk of the model: where its key falls on the ring (hash_key) and its
// bytes. A chunk does not split: given the chunks, a step cuts an arc only
// between them, and a part's load is its chunks' share of the arc's
// measured load, not its share of the arc's hashes (an arc of one 32 KiB
// chunk cut in half moves all of it or nothing, never half).
struct ChunkPoint {
  uint64_t hash = 0;
  double bytes = 0;
};

struct BalancerInput {
  // Members' reports; a report of a server that is neither a member nor a
  // standby is ignored (it may have just left).
  std::vector<ServerHistory> servers;
  std::vector<RangeLoad> ranges;  // sorted by lo, not overlapping
  // The model's chunks, sorted by hash (each hash once), or empty: then a
  // range's load is taken as spread evenly over its hashes. A view: what it
  // points to must outlive decide().
  std::span<const ChunkPoint> chunks;
  // Servers outside the placement that scale-out may add, in order of
  // preference. Never a member.
  std::vector<ServerSpec> standby;
};

// ---- Options. Defaults are documented, with the reasons, in docs/balancer.md.

struct BalancerOptions {
  // Predict.
  double rate_ewma_alpha = 0.3;  // weight of the newest window's rate, (0, 1]
  // Planning uses rate - rate_confidence x the estimate's standard error
  // (never below half the rate): a server whose rate is uncertain gets a
  // little less load.
  double rate_confidence = 1.0;
  uint32_t history_windows = 32;  // windows kept per server, [2, 4096]

  // Detect.
  // A straggler: its time per round above the others' by straggler_threshold,
  // for straggler_windows windows in a row, once a sequential test (a
  // one-sided CUSUM of log(its window's time / the others'), against half
  // the threshold, in units of that ratio's measured noise) has told the
  // level change from noise. false_alarm_windows is the test's mean run
  // length without a change, per server: the larger, the calmer on a noisy
  // machine and the slower to see a small straggler (a large one is seen in
  // a window or two).
  double straggler_threshold = 0.15;
  uint32_t straggler_windows = 1;
  double false_alarm_windows = 1e5;
  // A rebalance, once started, continues until a step would gain less than
  // this fraction of the predicted round time.
  double settle_gain = 0.02;

  // Exploit.
  double horizon_rounds = 100;  // rounds over which a migration is amortised
  // Bytes a migration ships per byte per round of load it moves: parameters
  // plus optimizer state, over (workers x push + pull). 1 is pessimistic.
  double migration_bytes_per_load_byte = 1.0;
  // No move smaller than this fraction of the mean server load (no dust arcs).
  double min_move_fraction = 0.005;

  // Explore.
  double max_step_fraction = 0.25;  // trust region: of a server's load, per decision
  // Clear evidence lifts the trust region: a rebalance between servers
  // whose rates have at least confident_samples samples and a standard
  // error of at most confident_error of the rate goes to the
  // rate-proportional placement in one step (0 samples: never).
  uint32_t confident_samples = 3;
  double confident_error = 0.1;
  uint32_t evaluation_windows = 2;  // windows at the new epoch before judging a move
  // Roll back when the measured round time grew by more than this fraction.
  // Keep it above the noise of a mean of evaluation_windows windows.
  double rollback_tolerance = 0.1;
  // A server that received a rolled-back move takes no new load for this many
  // decisions, doubled for each further rollback in a row (at most 16x).
  uint32_t rollback_cooldown_decisions = 10;
  uint32_t pending_timeout_decisions = 20;  // give up waiting for an unapplied plan
  // A server with no rate sample for this many windows (it holds no load) is
  // probed with probe_fraction of the mean server load, at most once every
  // probe_interval_decisions.
  uint32_t probe_after_windows = 10;
  uint32_t probe_interval_decisions = 20;
  double probe_fraction = 0.02;

  // Scale.
  bool scale_out = true;
  bool scale_in = true;
  // Scale out when even a balanced placement keeps the servers busy for at
  // least this fraction of a round, for scale_out_windows windows.
  double scale_out_utilisation = 0.8;
  uint32_t scale_out_windows = 5;
  // Scale in (drain one server) when, without it, the servers would be busy
  // at most this fraction of a round (idle) ...
  double scale_in_utilisation = 0.5;
  // ... or when its rate is below this fraction of the median (slow) ...
  double slow_rate_fraction = 0.2;
  // ... and draining it makes the predicted round at most this much longer,
  // for scale_in_windows windows.
  double scale_in_max_slowdown = 0.05;
  uint32_t scale_in_windows = 20;
  uint32_t scale_cooldown_decisions = 20;  // between two scale steps
  uint32_t min_active_servers = 1;

  // InvalidArgument naming the first option out of range.
  Status validate() const;
};

// ---- Outputs.

enum class StepKind : uint8_t {
  kRebalance,  // moves load from slower to faster servers
  kDrain,      // moves every arc off servers that are already draining
  kScaleOut,   // adds standby servers and gives them load
  kScaleIn,    // marks a server draining and moves all its arcs off
  kProbe,      // gives a little load to a server whose rate is unknown or stale
  kRollback,   // undoes the previous step, which made the round slower
};
std::string_view step_kind_name(StepKind kind);

// Hashes [lo, hi] change owner from `from` to `to`.
struct Move {
  uint64_t lo = 0;
  uint64_t hi = 0;
  ServerId from = 0;
  ServerId to = 0;
  double bytes_per_round = 0;  // predicted load of the range
  bool operator==(const Move&) const = default;
};

struct PlanStep {
  StepKind kind = StepKind::kRebalance;
  // The next epoch and the delta that makes it from the input placement.
  PlacementChange change;
  std::vector<Move> moves;  // sorted by lo
  double predicted_round_s_before = 0;
  double predicted_round_s_after = 0;
  double moved_bytes_per_round = 0;
  double migration_bytes = 0;   // parameter + optimizer state to ship
  double migration_cost_s = 0;  // the busiest server's time to ship it
  std::string reason;           // one line: what, why, and the prediction
};

// What the balancer believes about a member when it decides.
struct ServerPrediction {
  ServerId id = 0;
  ServerState state = ServerState::kActive;
  double load_bytes_per_round = 0;
  double rate_bytes_per_s = 0;      // EWMA; the prior for a server never measured
  double rate_stddev = 0;           // spread of the rate samples around it
  double planning_rate = 0;         // what the plan assumes
  double predicted_round_s = 0;     // load / planning_rate
  uint64_t rate_samples = 0;        // 0: the rate is a prior (median of the others)
  uint32_t straggler_windows = 0;   // windows in a row it has been a straggler
  uint32_t windows_since_rate = 0;  // windows since its last rate sample
};

struct Plan {
  uint64_t decision = 0;  // 1 for the first decide() call
  // At most one step per decision: each step's effect is measured before the
  // next one is planned. steps[i + 1] would start from steps[i].change.next.
  std::vector<PlanStep> steps;
  std::vector<ServerPrediction> servers;  // members, sorted by id
  double predicted_round_s = 0;           // max over members of load / planning rate
  double balanced_round_s = 0;            // total load / total active planning rate
  double measured_round_s = 0;            // max over members of their last window's busy / rounds
  std::string log;                        // the decision's log line, change or not
};

// ---- The balancer.

class Balancer {
 public:
  static Result<Balancer> make(BalancerOptions options = {});

  // One decision. InvalidArgument for a malformed input (windows out of
  // order, negative or non-finite values, overlapping ranges, a standby that
  // is a member), which changes nothing; FailedPrecondition when the epoch
  // counter is exhausted. The plan is not applied here: the caller publishes
  // steps[i].change.delta.
  Result<Plan> decide(const Placement& placement, const BalancerInput& input);

  const BalancerOptions& options() const { return options_; }
  uint64_t decisions() const { return decision_; }
  // Memory is bounded: at most history_windows windows per tracked server,
  // and only members and standby servers of the last decision are tracked.
  size_t retained_windows() const;
  size_t tracked_servers() const { return servers_.size(); }

 private:
  struct WindowRecord {
    uint64_t seq = 0;
    uint64_t epoch = 0;
    double service_s = 0;  // busy_s / rounds
    double round_s = 0;
  };
  struct Tracked {
    bool seen = false;
    uint64_t last_seq = 0;
    double rate = 0;  // EWMA of bytes / busy_s
    double rate_var = 0;
    uint64_t rate_samples = 0;
    double last_rate = 0;   // the newest sample
    int shift_windows = 0;  // samples in a row far above (> 0) or below (< 0) the estimate
    uint32_t windows_since_rate = 0;
    std::deque<WindowRecord> history;  // at most history_windows
    uint32_t new_windows = 0;          // ingested by this decision
    uint32_t straggler_windows = 0;
    // Detection: the CUSUM of x = log(window time / the others'), and x's
    // EWMA mean, variance and lag-1 covariance (its noise, which on a
    // shared machine is correlated from window to window).
    double cusum = 0;
    uint64_t x_epoch = 0;  // the placement the test runs at
    bool has_x = false;
    double last_x = 0;
    double x_mean = 0;
    double x_var = 0;
    double x_cov = 0;
    uint32_t x_samples = 0;       // windows the noise was learnt from
    uint64_t cooldown_until = 0;  // takes no new load before this decision
    uint32_t rollbacks = 0;       // rollbacks in a row that it received load in
    uint64_t last_probe = 0;      // decision of its last probe
  };
  // A server a step gives or takes load, as the step expects it to be.
  struct Involved {
    ServerId id = 0;
    bool received = false;
    double predicted_s = 0;  // its time per round after the step
    // Its rate estimate before the step, restored when the step is undone
    // because of it: samples taken at a load it will not carry again would
    // make it look slower than it is at the load it goes back to.
    double rate = 0;
    double rate_var = 0;
    uint64_t rate_samples = 0;
  };
  // The last step, until its effect has been measured.
  struct Pending {
    uint64_t decision = 0;
    StepKind kind = StepKind::kRebalance;
    uint64_t to_epoch = 0;
    std::vector<Move> moves;
    std::vector<Involved> involved;  // sorted by id
    std::vector<ServerId> added;     // the servers a scale-out added
    double measured_before_s = 0;
    double predicted_after_s = 0;
  };
  class Decision;

  explicit Balancer(BalancerOptions options) : options_(options) {}

  BalancerOptions options_;
  std::map<ServerId, Tracked> servers_;
  std::optional<Pending> pending_;
  bool rebalancing_ = false;
  uint32_t flat_steps_ = 0;  // rebalance steps in a row measured without a gain
  uint64_t decision_ = 0;
  uint64_t last_scale_ = 0;  // decision of the last scale step; 0: none
  uint32_t server_bound_windows_ = 0;
  uint32_t scale_in_windows_ = 0;
  ServerId scale_in_candidate_ = 0;
};

}  // namespace psld
