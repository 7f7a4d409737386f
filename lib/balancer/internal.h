// What the balancer's files share: the class of one decision,
// Balancer::Decision, whose members are defined by phase in balancer.cc (the
// entry points and the log), predict.cc (predict, detect), plan.cc (exploit),
// explore.cc (judge, roll back, probe) and scale.cc, and the helpers more than
// one of them uses. Internal to lib/balancer/.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "lib/balancer/balancer.h"

namespace psld {
namespace balancer_detail {

// Hash counts need 65 bits: one range can cover all 2^64 hashes.
__extension__ typedef unsigned __int128 u128;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Streak counters saturate here (about 19 years of 10 ms windows).
constexpr uint32_t kMaxStreak = 1u << 30;

inline u128 hashes_in(uint64_t lo, uint64_t hi) {
  return u128{hi} - lo + 1;
}

// Exact: the counts fit a long double's 64-bit mantissa (2^64 too). Below
// 2^64 the hardware converts a uint64_t; a u128 goes through a libgcc call,
// which on a million arcs was a tenth of a decision.
inline long double hashes_as_long_double(u128 n) {
  return n >> 64 == 0 ? static_cast<long double>(static_cast<uint64_t>(n))
                      : static_cast<long double>(n);
}

// part / whole, for whole >= 1 (a count of hashes). A whole range is exactly
// 1, and the usual case: a measured range that is one arc of today's ring.
inline double fraction_of(u128 part, u128 whole) {
  if (part == whole) return 1;
  return static_cast<double>(hashes_as_long_double(part) / hashes_as_long_double(whole));
}

std::string bytes_text(double bytes);
std::string seconds_text(double s);
std::string change_text(double before, double after);
std::string ids_text(const std::vector<ServerId>& ids);

}  // namespace balancer_detail

// ---- One decision --------------------------------------------------------------

class Balancer::Decision {
 public:
  Decision(Balancer& balancer, const Placement& placement, const BalancerInput& input)
      : balancer_(balancer), options_(balancer.options_), placement_(placement), input_(input) {}

  Result<Plan> run();

 private:
  // A member as this decision sees it.
  struct Member {
    ServerId id = 0;
    ServerState state = ServerState::kActive;
    double weight = 1;
    Tracked* tracked = nullptr;
    double load = 0;  // bytes per round under the input placement
    size_t arcs = 0;
    double rate = 0;  // planning rate, bytes/s
    bool estimated = false;
    bool active() const { return state == ServerState::kActive; }
    double time() const { return rate > 0 ? load / rate : (load > 0 ? balancer_detail::kInf : 0); }
  };
  // A server in one step's plan: every member, then the standby servers a
  // scale-out adds. Node i is member i for i < members_.size().
  struct Node {
    ServerId id = 0;
    double load = 0;
    double rate = 0;
    bool receives = false;                  // may take load
    bool must_empty = false;                // every arc leaves, zero-load ones too
    double max_out = 0;                     // trust region, giving
    double max_in = balancer_detail::kInf;  // trust region, taking
    double out = 0;                         // planned
    double in = 0;                          // planned
    double gave = 0;                        // realised by the chosen ranges
    double got = 0;
    double time() const { return rate > 0 ? load / rate : (load > 0 ? balancer_detail::kInf : 0); }
  };
  // What the previous step's measurement says.
  struct Verdict {
    bool wait = false;         // for the next epoch, or for its windows
    bool unpublished = false;  // for the next epoch
    std::optional<PlanStep> rollback;
    std::string note;
  };

  void ingest();
  void add_rate_sample(Tracked& t, double rate) const;
  void measure_load();
  bool estimate_rates();
  void update_streaks();
  // One window of the sequential test for `t` at `load` against the others'
  // time per round: true while it is in alarm.
  bool detect(Tracked& t, double load, double others) const;
  // The standard error of the EWMA: the spread of the samples times
  // sqrt(alpha / (2 - alpha)), the EWMA's variance reduction for
  // independent samples (0.42 for alpha = 0.3).
  double rate_error(const Tracked& t) const {
    return std::sqrt(t.rate_var * options_.rate_ewma_alpha / (2 - options_.rate_ewma_alpha));
  }

  std::vector<Node> base_nodes() const;
  bool cooling(const Tracked& t) const { return t.cooldown_until > balancer_.decision_; }
  // The trust region: a fraction of the load, but at least one minimal move,
  // or a server holding little load could never give it away.
  double step_limit(double load) const {
    return std::max(options_.max_step_fraction * load, std::min(load, min_move_));
  }
  // What a server may take: a fraction of its load or of the mean load,
  // whichever is larger, so that an empty server ramps up in a few steps
  // and a rate measured at a small load is tried at a larger one gradually.
  double take_limit(double load) const {
    return options_.max_step_fraction *
           std::max(load, active_load_ / std::max<size_t>(active_count_, 1));
  }
  // The rate's standard error over the rate. The EWMA's variance starts at 0
  // and reaches its level only after many samples, so it is divided by
  // 1 - (1 - alpha)^(n - 1) here (the same start-up correction as Adam's)
  // before it is trusted. Infinite with fewer than 2 samples.
  double relative_error(const Tracked& t) const {
    if (t.rate_samples < 2 || !(t.rate > 0)) return balancer_detail::kInf;
    const double warmed =
        1 - std::pow(1 - options_.rate_ewma_alpha, static_cast<double>(t.rate_samples - 1));
    return rate_error(t) / std::sqrt(warmed) / t.rate;
  }
  // Enough samples, tightly spread: the rate may be planned on without a
  // trust region.
  bool confident(const Tracked& t) const {
    return options_.confident_samples > 0 && t.rate_samples >= options_.confident_samples &&
           relative_error(t) <= options_.confident_error;
  }
  void water_fill(std::vector<Node>& nodes) const;
  double round_after(const std::vector<Node>& nodes) const;
  double worst_round_after(const std::vector<Node>& nodes) const;
  void fill_receivers(std::vector<Node>& nodes, double total_out) const;
  Result<PlanStep> realise(StepKind kind, std::vector<Node>& nodes,
                           std::vector<MembershipChange> membership) const;
  Result<PlanStep> finish(StepKind kind, std::vector<Move> moves,
                          std::vector<MembershipChange> membership, std::vector<Node>& nodes) const;
  double range_load(uint64_t lo, uint64_t hi) const;
  bool in_effect(const Move& m) const;
  std::optional<double> least_service_before(const Tracked& t) const;
  std::optional<double> least_service_after(const Tracked& t, uint64_t epoch) const;
  void remember(const PlanStep& step, const std::vector<Node>& nodes,
                std::vector<ServerId> added = {});
  const Member* member(ServerId id) const;

  Result<Verdict> evaluate();
  Result<std::optional<PlanStep>> drain_step();
  Result<std::optional<PlanStep>> scale_in_step();
  Result<std::optional<PlanStep>> scale_out_step(std::string* note);
  Result<std::optional<PlanStep>> rebalance_step(std::string* note);
  Result<std::optional<PlanStep>> probe_step();

  std::string moves_text(const PlanStep& step) const;
  std::string cost_text(const PlanStep& step) const;
  std::string straggler_text() const;
  Result<Plan> finish_plan(const std::string& prefix, std::optional<PlanStep> step,
                           const std::string& hold);

  Balancer& balancer_;
  const BalancerOptions& options_;
  const Placement& placement_;
  const BalancerInput& input_;

  Plan plan_;
  std::vector<ServerId> standby_ids_;  // sorted
  std::vector<Member> members_;        // as placement_.servers(), sorted by id
  std::vector<double> arc_load_;       // per arc of placement_
  std::vector<uint32_t> arc_member_;   // per arc of placement_: the owner's index in members_
  double prior_per_weight_ = 0;        // rate of a server never measured, per unit of weight
  double total_load_ = 0;              // all members
  double active_load_ = 0;
  double active_rate_ = 0;
  size_t active_count_ = 0;
  double min_move_ = 0;    // bytes per round
  double probe_load_ = 0;  // a probe's load: probe_fraction of the mean active load
  double period_s_ = 0;    // the job's round time as workers see it; 0: unknown
  double other_s_ = 0;     // the part of a round that is not server time
  uint32_t new_windows_ = 0;
  std::string scale_in_why_;
};

}  // namespace psld
