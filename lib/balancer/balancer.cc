// lib/balancer/balancer.cc — see balancer.h, and docs/balancer.md for the model.
#include "lib/balancer/balancer.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <queue>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace psld {
namespace {

// Hash counts need 65 bits: one range can cover all 2^64 hashes.
__extension__ typedef unsigned __int128 u128;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Water levels are found by bisection. 100 halvings shrink any bracket below
// the spacing of doubles, and a fixed count keeps the result deterministic.
constexpr int kBisectionSteps = 100;
// Relative slack when two loads computed along different paths are compared.
constexpr double kSlack = 1e-9;
// A cooldown doubles with each rollback in a row, up to 2^4 = 16 times.
constexpr uint32_t kMaxCooldownDoublings = 4;
// Streak counters saturate here (about 19 years of 10 ms windows).
constexpr uint32_t kMaxStreak = 1u << 30;
// A rate sample further than this many spreads and this fraction from the
// estimate, kShiftWindows times in a row on the same side, is a new level.
// 0.2 is twice the +-10% that window-to-window noise reaches on a shared host.
constexpr double kShiftSpreads = 3;
constexpr double kShiftFraction = 0.2;
constexpr int kShiftWindows = 2;
// Rebalance steps in a row without a measured gain that end a rebalance.
constexpr uint32_t kFlatSteps = 2;
// The log names at most this many moves; Plan::steps holds all of them.
constexpr size_t kLoggedMoves = 6;

// A hash range on its way to a new owner.
struct Piece {
  uint64_t lo = 0;
  uint64_t hi = 0;
  double load = 0;
  size_t from = 0;    // the source's node
  bool must = false;  // its source is being emptied: it cannot stay
};

u128 hashes_in(uint64_t lo, uint64_t hi) {
  return u128{hi} - lo + 1;
}

double fraction_of(u128 part, u128 whole) {
  return static_cast<double>(static_cast<long double>(part) / static_cast<long double>(whole));
}

uint32_t add_windows(uint32_t streak, uint32_t windows) {
  return std::min(kMaxStreak, streak + std::min(windows, kMaxStreak));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

bool finite_nonneg(double x) {
  return std::isfinite(x) && x >= 0;
}

std::string bytes_text(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  size_t unit = 0;
  while (std::fabs(bytes) >= 1024 && unit + 1 < std::size(kUnits)) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, kUnits[unit]);
}

std::string seconds_text(double s) {
  if (!std::isfinite(s)) return "inf";
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string change_text(double before, double after) {
  if (!(before > 0) || !std::isfinite(after)) return "n/a";
  return fmt::format("{:+.1f}%", (after / before - 1) * 100);
}

// "server 3", or "servers 1, 2, 5".
std::string ids_text(const std::vector<ServerId>& ids) {
  std::string out = ids.size() == 1 ? "server " : "servers ";
  for (size_t i = 0; i < ids.size(); ++i)
    out += (i == 0 ? "" : ", ") + std::to_string(ids[i]);
  return out;
}

Status option_error(std::string_view name, double value, std::string_view accepted) {
  return InvalidArgument(
      fmt::format("balancer option {} = {} is out of range; accepted: {}", name, value, accepted));
}

Status validate_input(const Placement& placement, const BalancerInput& in) {
  std::vector<ServerId> ids;
  for (const ServerSpec& s : in.standby) {
    if (placement.find_server(s.id) != nullptr) {
      return InvalidArgument(fmt::format(
          "standby server {} is already a member of epoch {}; list only servers outside it", s.id,
          placement.epoch()));
    }
    if (!(std::isfinite(s.weight) && s.weight > 0 && s.weight <= Placement::kMaxWeight)) {
      return InvalidArgument(fmt::format("standby server {} has weight {}; accepted: (0, {}]", s.id,
                                         s.weight, Placement::kMaxWeight));
    }
    ids.push_back(s.id);
  }
  std::sort(ids.begin(), ids.end());
  if (auto it = std::adjacent_find(ids.begin(), ids.end()); it != ids.end()) {
    return InvalidArgument(fmt::format("standby server {} is listed twice", *it));
  }

  ids.clear();
  for (const ServerHistory& h : in.servers) {
    ids.push_back(h.id);
    for (size_t i = 0; i < h.windows.size(); ++i) {
      const ServerWindow& w = h.windows[i];
      if (i > 0 && w.seq <= h.windows[i - 1].seq) {
        return InvalidArgument(fmt::format(
            "server {}: window {} has seq {} after seq {}; windows must be oldest first", h.id, i,
            w.seq, h.windows[i - 1].seq));
      }
      if (!finite_nonneg(w.bytes) || !finite_nonneg(w.busy_s) || !finite_nonneg(w.round_s)) {
        return InvalidArgument(fmt::format(
            "server {}: window seq {} has bytes {}, busy_s {}, round_s {}; each must be finite and "
            ">= 0",
            h.id, w.seq, w.bytes, w.busy_s, w.round_s));
      }
    }
  }
  std::sort(ids.begin(), ids.end());
  if (auto it = std::adjacent_find(ids.begin(), ids.end()); it != ids.end()) {
    return InvalidArgument(fmt::format("server {} has two histories in one input", *it));
  }

  for (size_t i = 0; i < in.ranges.size(); ++i) {
    const RangeLoad& r = in.ranges[i];
    if (r.lo > r.hi) {
      return InvalidArgument(
          fmt::format("range {} is [{:#x}, {:#x}]: lo must not exceed hi", i, r.lo, r.hi));
    }
    if (i > 0 && r.lo <= in.ranges[i - 1].hi) {
      return InvalidArgument(fmt::format(
          "range {} starts at {:#x}, inside or before range {} (ends at {:#x}); ranges must be "
          "sorted by lo and not overlap",
          i, r.lo, i - 1, in.ranges[i - 1].hi));
    }
    if (!finite_nonneg(r.bytes_per_round)) {
      return InvalidArgument(fmt::format(
          "range {} has bytes_per_round {}; it must be finite and >= 0", i, r.bytes_per_round));
    }
  }
  return Status::Ok();
}

}  // namespace

std::string_view step_kind_name(StepKind kind) {
  switch (kind) {
    case StepKind::kRebalance:
      return "rebalance";
    case StepKind::kDrain:
      return "drain";
    case StepKind::kScaleOut:
      return "scale-out";
    case StepKind::kScaleIn:
      return "scale-in";
    case StepKind::kProbe:
      return "probe";
    case StepKind::kRollback:
      return "rollback";
  }
  return "unknown";
}

Status BalancerOptions::validate() const {
  struct Range {
    std::string_view name;
    double value;
    double lo;
    double hi;
    bool lo_open;
  };
  const Range ranges[] = {
      {"rate_ewma_alpha", rate_ewma_alpha, 0, 1, true},
      {"rate_confidence", rate_confidence, 0, 10, false},
      {"history_windows", static_cast<double>(history_windows), 2, 4096, false},
      {"straggler_threshold", straggler_threshold, 0, 10, true},
      {"straggler_windows", static_cast<double>(straggler_windows), 1, 1e6, false},
      {"settle_gain", settle_gain, 0, 0.99, false},
      {"horizon_rounds", horizon_rounds, 1, 1e9, false},
      {"migration_bytes_per_load_byte", migration_bytes_per_load_byte, 0, 1e6, false},
      {"min_move_fraction", min_move_fraction, 0, 0.5, false},
      {"max_step_fraction", max_step_fraction, 0, 1, true},
      {"evaluation_windows", static_cast<double>(evaluation_windows), 1, 1000, false},
      {"rollback_tolerance", rollback_tolerance, 0, 10, false},
      {"rollback_cooldown_decisions", static_cast<double>(rollback_cooldown_decisions), 0, 1e6,
       false},
      {"pending_timeout_decisions", static_cast<double>(pending_timeout_decisions), 1, 1e6, false},
      {"probe_after_windows", static_cast<double>(probe_after_windows), 1, 1e6, false},
      {"probe_interval_decisions", static_cast<double>(probe_interval_decisions), 1, 1e6, false},
      {"probe_fraction", probe_fraction, 0, 1, false},
      {"scale_out_utilisation", scale_out_utilisation, 0, 1, true},
      {"scale_out_windows", static_cast<double>(scale_out_windows), 1, 1e6, false},
      {"scale_in_utilisation", scale_in_utilisation, 0, 1, false},
      {"slow_rate_fraction", slow_rate_fraction, 0, 1, false},
      {"scale_in_max_slowdown", scale_in_max_slowdown, 0, 10, false},
      {"scale_in_windows", static_cast<double>(scale_in_windows), 1, 1e6, false},
      {"scale_cooldown_decisions", static_cast<double>(scale_cooldown_decisions), 0, 1e6, false},
      {"min_active_servers", static_cast<double>(min_active_servers), 1,
       static_cast<double>(Placement::kMaxServers), false},
  };
  for (const Range& r : ranges) {
    const bool above_lo = r.lo_open ? r.value > r.lo : r.value >= r.lo;
    if (!(std::isfinite(r.value) && above_lo && r.value <= r.hi)) {
      return option_error(r.name, r.value,
                          fmt::format("{}{}, {}]", r.lo_open ? "(" : "[", r.lo, r.hi));
    }
  }
  if (history_windows < evaluation_windows) {
    return InvalidArgument(
        fmt::format("balancer option history_windows = {} must be at least evaluation_windows = {}",
                    history_windows, evaluation_windows));
  }
  if (scale_in_utilisation >= scale_out_utilisation) {
    return InvalidArgument(fmt::format(
        "balancer option scale_in_utilisation = {} must be below scale_out_utilisation = {}, or "
        "the balancer would scale out and back in forever",
        scale_in_utilisation, scale_out_utilisation));
  }
  return Status::Ok();
}

Result<Balancer> Balancer::make(BalancerOptions options) {
  PSLD_RETURN_IF_ERROR(options.validate());
  return Balancer(options);
}

size_t Balancer::retained_windows() const {
  size_t n = 0;
  for (const auto& [id, t] : servers_)
    n += t.history.size();
  return n;
}

// ---- One decision --------------------------------------------------------------

class Balancer::Decision {
 public:
  Decision(Balancer& balancer, const Placement& placement, const BalancerInput& input)
      : b_(balancer), o_(balancer.options_), p_(placement), in_(input) {}

  Result<Plan> run();

 private:
  // A member as this decision sees it.
  struct Member {
    ServerId id = 0;
    ServerState state = ServerState::kActive;
    double weight = 1;
    Tracked* t = nullptr;
    double load = 0;  // bytes per round under the input placement
    size_t arcs = 0;
    double rate = 0;  // planning rate, bytes/s
    bool estimated = false;
    bool active() const { return state == ServerState::kActive; }
    double time() const { return rate > 0 ? load / rate : (load > 0 ? kInf : 0); }
  };
  // A server in one step's plan: every member, then the standby servers a
  // scale-out adds. Node i is member i for i < members_.size().
  struct Node {
    ServerId id = 0;
    double load = 0;
    double rate = 0;
    bool receives = false;    // may take load
    bool must_empty = false;  // every arc leaves, zero-load ones too
    double max_out = 0;       // trust region, giving
    double max_in = kInf;     // trust region, taking
    double out = 0;           // planned
    double in = 0;            // planned
    double gave = 0;          // realised by the chosen ranges
    double got = 0;
    double time() const { return rate > 0 ? load / rate : (load > 0 ? kInf : 0); }
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
  // The standard error of the EWMA: the spread of the samples times
  // sqrt(alpha / (2 - alpha)), the EWMA's variance reduction for
  // independent samples (0.42 for alpha = 0.3).
  double rate_error(const Tracked& t) const {
    return std::sqrt(t.rate_var * o_.rate_ewma_alpha / (2 - o_.rate_ewma_alpha));
  }

  std::vector<Node> base_nodes() const;
  bool cooling(const Tracked& t) const { return t.cooldown_until > b_.decision_; }
  // The trust region: a fraction of the load, but at least one minimal move,
  // or a server holding little load could never give it away.
  double step_limit(double load) const {
    return std::max(o_.max_step_fraction * load, std::min(load, min_move_));
  }
  // What a server may take: a fraction of its load or of the mean load,
  // whichever is larger, so that an empty server ramps up in a few steps
  // and a rate measured at a small load is tried at a larger one gradually.
  double take_limit(double load) const {
    return o_.max_step_fraction * std::max(load, active_load_ / std::max<size_t>(active_count_, 1));
  }
  void water_fill(std::vector<Node>& nodes) const;
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
  Result<Plan> finish_plan(std::string prefix, std::optional<PlanStep> step, std::string hold);

  Balancer& b_;
  const BalancerOptions& o_;
  const Placement& p_;
  const BalancerInput& in_;

  Plan plan_;
  std::vector<ServerId> standby_ids_;  // sorted
  std::vector<Member> members_;        // as p_.servers(), sorted by id
  std::vector<double> arc_load_;       // per arc of p_
  std::vector<uint32_t> arc_member_;   // per arc of p_: the owner's index in members_
  double prior_per_weight_ = 0;        // rate of a server never measured, per unit of weight
  double total_load_ = 0;              // all members
  double active_load_ = 0;
  double active_rate_ = 0;
  size_t active_count_ = 0;
  double min_move_ = 0;  // bytes per round
  double period_s_ = 0;  // the job's round time as workers see it; 0: unknown
  double other_s_ = 0;   // the part of a round that is not server time
  uint32_t new_windows_ = 0;
  std::string scale_in_why_;
};

const Balancer::Decision::Member* Balancer::Decision::member(ServerId id) const {
  auto it = std::lower_bound(members_.begin(), members_.end(), id,
                             [](const Member& m, ServerId v) { return m.id < v; });
  return it != members_.end() && it->id == id ? &*it : nullptr;
}

// ---- Predict --------------------------------------------------------------------

void Balancer::Decision::add_rate_sample(Tracked& t, double rate) const {
  // A stale estimate says nothing about today: the first sample after a long
  // gap (a probe of an empty server) starts afresh instead of being averaged
  // with it.
  if (t.rate_samples == 0 || t.windows_since_rate >= o_.probe_after_windows) {
    t.rate = rate;
    t.rate_var = 0;
    t.rate_samples = 1;
    t.shift_windows = 0;
    t.last_rate = rate;
    t.windows_since_rate = 0;
    return;
  }
  // A straggler appears or recovers from one window to the next; an EWMA
  // alone would take ~10 windows to follow. Two samples in a row far from the
  // estimate, on the same side, restart it from them.
  const double d = rate - t.rate;
  const bool far =
      std::fabs(d) > std::max(kShiftSpreads * std::sqrt(t.rate_var), kShiftFraction * t.rate);
  const int side = d > 0 ? 1 : -1;
  t.shift_windows = far ? (t.shift_windows * side > 0 ? t.shift_windows + side : side) : 0;
  if (std::abs(t.shift_windows) >= kShiftWindows) {
    const double half_gap = 0.5 * (rate - t.last_rate);
    t.rate = 0.5 * (rate + t.last_rate);
    t.rate_var = half_gap * half_gap;
    t.rate_samples = 2;
    t.shift_windows = 0;
  } else {
    // Exponentially weighted mean and variance (the incremental form of
    // Finch 2009, "Incremental calculation of weighted mean and variance").
    t.rate += o_.rate_ewma_alpha * d;
    t.rate_var = (1 - o_.rate_ewma_alpha) * (t.rate_var + o_.rate_ewma_alpha * d * d);
    ++t.rate_samples;
  }
  t.last_rate = rate;
  t.windows_since_rate = 0;
}

void Balancer::Decision::ingest() {
  for (const ServerSpec& s : in_.standby)
    standby_ids_.push_back(s.id);
  std::sort(standby_ids_.begin(), standby_ids_.end());
  auto known = [&](ServerId id) {
    return p_.find_server(id) != nullptr ||
           std::binary_search(standby_ids_.begin(), standby_ids_.end(), id);
  };
  // Forget servers that left: what the balancer holds is bounded by the
  // members and standby servers of the last decision.
  for (auto it = b_.servers_.begin(); it != b_.servers_.end();) {
    if (known(it->first)) {
      it->second.new_windows = 0;
      ++it;
    } else {
      it = b_.servers_.erase(it);
    }
  }
  for (const ServerHistory& h : in_.servers) {
    if (!known(h.id)) continue;
    Tracked& t = b_.servers_[h.id];
    for (const ServerWindow& w : h.windows) {
      if (t.seen && w.seq <= t.last_seq) continue;  // read by an earlier decision
      t.seen = true;
      t.last_seq = w.seq;
      t.new_windows = add_windows(t.new_windows, 1);
      if (w.bytes > 0 && w.busy_s > 0) {
        add_rate_sample(t, w.bytes / w.busy_s);
      } else {
        t.windows_since_rate = add_windows(t.windows_since_rate, 1);
      }
      if (w.rounds > 0) {
        t.history.push_back(
            WindowRecord{w.seq, w.epoch, w.busy_s / static_cast<double>(w.rounds), w.round_s});
        while (t.history.size() > o_.history_windows)
          t.history.pop_front();
      }
    }
  }
}

void Balancer::Decision::measure_load() {
  const size_t n_arcs = p_.num_arcs();
  arc_load_.assign(n_arcs, 0.0);
  // A measured range spreads its load over the current arcs it overlaps, in
  // proportion to the hashes they share: keys are hashed, so hashes are the
  // best guess of where the bytes are.
  size_t i = 0;
  for (const RangeLoad& r : in_.ranges) {
    if (r.bytes_per_round <= 0) continue;
    i = std::max(i, p_.arc_index_of_hash(r.lo));
    const u128 width = hashes_in(r.lo, r.hi);
    for (;; ++i) {
      const Arc a = p_.arc(i);
      const uint64_t lo = std::max(a.lo, r.lo);
      const uint64_t hi = std::min(a.hi, r.hi);
      arc_load_[i] += r.bytes_per_round * fraction_of(hashes_in(lo, hi), width);
      if (a.hi >= r.hi) break;  // the next range may start in this arc
    }
  }

  const std::vector<ServerInfo>& infos = p_.servers();
  members_.resize(infos.size());
  for (size_t m = 0; m < infos.size(); ++m) {
    members_[m].id = infos[m].id;
    members_[m].state = infos[m].state;
    members_[m].weight = infos[m].weight;
    members_[m].t = &b_.servers_[infos[m].id];
  }
  arc_member_.resize(n_arcs);
  for (size_t k = 0; k < n_arcs; ++k) {
    const ServerId owner = p_.arc(k).owner;
    const auto it = std::lower_bound(infos.begin(), infos.end(), owner,
                                     [](const ServerInfo& s, ServerId v) { return s.id < v; });
    const auto m = static_cast<uint32_t>(it - infos.begin());
    arc_member_[k] = m;
    members_[m].load += arc_load_[k];
    ++members_[m].arcs;
  }
}

bool Balancer::Decision::estimate_rates() {
  // Plan with a pessimistic rate: a server whose samples scatter gets less
  // load than its mean promises, and never less than half of it.
  std::vector<double> per_weight;
  std::vector<double> any_per_weight;
  for (Member& m : members_) {
    const Tracked& t = *m.t;
    if (t.rate_samples == 0 || !(t.rate > 0)) continue;
    m.estimated = true;
    m.rate = std::max(t.rate - o_.rate_confidence * rate_error(t), 0.5 * t.rate);
    (m.active() ? per_weight : any_per_weight).push_back(m.rate / m.weight);
  }
  if (per_weight.empty()) per_weight = any_per_weight;
  if (per_weight.empty()) return false;
  // A server never measured is assumed to be a typical one.
  prior_per_weight_ = median(per_weight);
  for (Member& m : members_) {
    if (!m.estimated) m.rate = prior_per_weight_ * m.weight;
    total_load_ += m.load;
    if (m.active()) {
      active_load_ += m.load;
      active_rate_ += m.rate;
      ++active_count_;
    }
  }
  min_move_ = active_count_ > 0 ? o_.min_move_fraction * total_load_ / active_count_ : 0;
  return true;
}

// ---- Detect ---------------------------------------------------------------------

void Balancer::Decision::update_streaks() {
  for (Member& m : members_) {
    Tracked& t = *m.t;
    new_windows_ = std::max(new_windows_, t.new_windows);
    if (t.new_windows == 0) continue;
    if (!m.active() || active_count_ < 2) {
      t.straggler_windows = 0;
      continue;
    }
    // "The others": the time per round the rest would have if balanced among
    // themselves. A server above it by the threshold slows the round.
    const double others = (active_load_ - m.load) / (active_rate_ - m.rate);
    const bool straggling = m.time() > (1 + o_.straggler_threshold) * others;
    t.straggler_windows = straggling ? add_windows(t.straggler_windows, t.new_windows) : 0;
  }

  // The job's pace: the round time workers report (the median over servers,
  // which see the same rounds), and how much of it is not server time.
  std::vector<double> rounds;
  double busiest = 0;
  for (const Member& m : members_) {
    if (m.t->history.empty()) continue;
    const WindowRecord& last = m.t->history.back();
    busiest = std::max(busiest, last.service_s);
    if (m.active() && last.round_s > 0) rounds.push_back(last.round_s);
  }
  plan_.measured_round_s = busiest;
  if (!rounds.empty()) {
    period_s_ = median(rounds);
    other_s_ = std::max(0.0, period_s_ - busiest);
  }
  if (new_windows_ == 0) return;

  // Server-bound: even balanced, the servers would be busy most of a round.
  const double balanced = plan_.balanced_round_s;
  const bool bound = period_s_ > 0 && balanced >= o_.scale_out_utilisation * (other_s_ + balanced);
  b_.server_bound_windows_ = bound ? add_windows(b_.server_bound_windows_, new_windows_) : 0;

  // Scale-in: the slowest active server (the least loaded, then the highest
  // id, among equals), if the others could absorb its load.
  const Member* candidate = nullptr;
  auto key = [](const Member& m) { return std::make_tuple(m.rate, m.load, ~m.id); };
  if (o_.scale_in && active_count_ >= 2 && active_count_ > o_.min_active_servers) {
    for (const Member& m : members_) {
      if (m.active() && (candidate == nullptr || key(m) < key(*candidate))) candidate = &m;
    }
  }
  bool drainable = false;
  if (candidate != nullptr) {
    std::vector<double> rates;
    for (const Member& m : members_)
      if (m.active()) rates.push_back(m.rate);
    const double without = total_load_ / (active_rate_ - candidate->rate);
    const bool fits = other_s_ + without <= (1 + o_.scale_in_max_slowdown) * (other_s_ + balanced);
    const bool idle = period_s_ > 0 && without <= o_.scale_in_utilisation * (other_s_ + without);
    const bool slow = candidate->rate < o_.slow_rate_fraction * median(rates);
    drainable = fits && (idle || slow);
    if (drainable) {
      scale_in_why_ =
          idle
              ? fmt::format("idle: without it the servers would be busy {:.0f}% of a {} round",
                            100 * without / (other_s_ + without), seconds_text(other_s_ + without))
              : fmt::format("slow: {}/s is {:.0f}% of the median {}/s", bytes_text(candidate->rate),
                            100 * candidate->rate / median(rates), bytes_text(median(rates)));
      scale_in_why_ +=
          fmt::format("; the others absorb its load, predicted round {} -> {}",
                      seconds_text(other_s_ + balanced), seconds_text(other_s_ + without));
    }
  }
  // The streak belongs to the cluster, not to one server: among equal idle
  // servers, noise picks a different slowest one every window.
  if (drainable) {
    b_.scale_in_candidate_ = candidate->id;
    b_.scale_in_windows_ = add_windows(b_.scale_in_windows_, new_windows_);
  } else {
    b_.scale_in_windows_ = 0;
  }
}

// ---- Plan moves -----------------------------------------------------------------

std::vector<Balancer::Decision::Node> Balancer::Decision::base_nodes() const {
  std::vector<Node> nodes(members_.size());
  for (size_t i = 0; i < members_.size(); ++i) {
    nodes[i].id = members_[i].id;
    nodes[i].load = members_[i].load;
    nodes[i].rate = members_[i].rate;
  }
  return nodes;
}

// Sources give down to a common level lambda (each at most max_out, draining
// ones everything) and receivers fill up to it: the level at which what the
// sources can give equals what the receivers can take. Unbounded, that is the
// rate-proportional split, lambda = total load / total rate.
void Balancer::Decision::water_fill(std::vector<Node>& nodes) const {
  double receiving_rate = 0;
  double total = 0;
  double top = 0;
  for (const Node& n : nodes) {
    total += n.load;
    if (n.must_empty) continue;
    if (n.receives) receiving_rate += n.rate;
    if (n.rate > 0) top = std::max(top, n.time());
  }
  if (!(receiving_rate > 0)) return;
  auto out_at = [](const Node& n, double level) {
    return n.must_empty ? n.load : std::min(n.max_out, std::max(0.0, n.load - level * n.rate));
  };
  auto in_at = [](const Node& n, double level) {
    return n.receives && !n.must_empty ? std::min(n.max_in, std::max(0.0, level * n.rate - n.load))
                                       : 0.0;
  };
  double lo = 0;
  double hi = std::max(top, total / receiving_rate);
  for (int step = 0; step < kBisectionSteps; ++step) {
    const double mid = 0.5 * (lo + hi);
    double out = 0;
    double in = 0;
    for (const Node& n : nodes) {
      out += out_at(n, mid);
      in += in_at(n, mid);
    }
    (out > in ? lo : hi) = mid;
  }
  // Where the trust region holds a source above the level, the round cannot
  // get below that source's time this step: the others give only down to
  // it, and moves that would not shorten this round wait for the next step.
  double level = hi;
  for (const Node& n : nodes) {
    if (!n.must_empty && n.rate > 0) level = std::max(level, (n.load - out_at(n, hi)) / n.rate);
  }
  double total_out = 0;
  for (Node& n : nodes) {
    n.out = out_at(n, level);
    if (!n.must_empty && n.out > 0) {
      if (n.load - n.out < min_move_) {
        n.out = n.load;  // leave no dust behind
      } else if (n.out < min_move_ * (1 - kSlack)) {
        n.out = 0;  // not worth a migration
      }
    }
    total_out += n.out;
  }
  fill_receivers(nodes, total_out);
}

// Which receivers take `total_out`, and how much each. Filling every server
// below the level would cut a piece for each of them (511 pieces for one
// straggler among 512 servers); instead the emptiest k receivers fill to a
// common level mu_k (each up to its max_in): as many as can each take at
// least a minimal move, but never so few that they would rise above the
// highest time a server keeps.
void Balancer::Decision::fill_receivers(std::vector<Node>& nodes, double total_out) const {
  if (!(total_out > 0)) return;
  auto candidate = [](const Node& n) {
    return n.receives && !n.must_empty && n.out == 0 && n.rate > 0 && n.max_in > 0;
  };
  // The highest time any server keeps after giving: receivers need not
  // rise above it.
  double top = 0;
  for (const Node& n : nodes) {
    if (n.must_empty || !(n.rate > 0)) continue;
    top = std::max(top, (n.load - n.out) / n.rate);
  }
  std::vector<size_t> cand;
  for (size_t i = 0; i < nodes.size(); ++i)
    if (candidate(nodes[i])) cand.push_back(i);
  if (cand.empty()) return;
  auto in_at = [&](size_t i, double level) {
    const Node& n = nodes[cand[i]];
    return std::min(n.max_in, std::max(0.0, level * n.rate - n.load));
  };
  // The level at which the first k candidates take total_out (the highest
  // useful one when their room is not enough).
  auto level = [&](size_t k) {
    double lo = 0;
    double hi = 0;
    for (size_t i = 0; i < k; ++i) {
      const Node& n = nodes[cand[i]];
      hi = std::max(hi, std::isfinite(n.max_in) ? (n.load + n.max_in) / n.rate
                                                : (n.load + total_out) / n.rate);
    }
    for (int step = 0; step < kBisectionSteps; ++step) {
      const double mid = 0.5 * (lo + hi);
      double in = 0;
      for (size_t i = 0; i < k; ++i)
        in += in_at(i, mid);
      (in < total_out ? lo : hi) = mid;
    }
    return hi;
  };
  // A server that cannot take a minimal move below the level all candidates
  // would share (a very slow one) takes nothing: a crumb would not be worth
  // its migration. Better a crumb than nothing, though.
  const double shared = std::max(top, level(cand.size()));
  std::vector<size_t> useful;
  for (size_t i = 0; i < cand.size(); ++i)
    if (in_at(i, shared) >= min_move_) useful.push_back(cand[i]);
  if (!useful.empty()) cand = std::move(useful);
  std::sort(cand.begin(), cand.end(), [&](size_t a, size_t b) {
    const double ta = nodes[a].time();
    const double tb = nodes[b].time();
    return ta != tb ? ta < tb : nodes[a].id < nodes[b].id;
  });
  auto least_in = [&](size_t k) {
    const double mu = level(k);
    double least = kInf;
    for (size_t i = 0; i < k; ++i)
      least = std::min(least, in_at(i, mu));
    return least;
  };
  // Binary searches: the level does not rise and least_in does not grow
  // with k (more receivers share the same bytes).
  const size_t n = cand.size();
  size_t lo = 1;
  size_t hi = n;
  auto enough = [&](size_t k) {  // k receivers take it all and stay at or below `top`
    const double mu = level(k);
    double in = 0;
    for (size_t i = 0; i < k; ++i)
      in += in_at(i, mu);
    return mu <= top && in >= total_out * (1 - kSlack);
  };
  while (lo < hi) {  // the fewest receivers that are enough
    const size_t mid = lo + (hi - lo) / 2;
    if (enough(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const size_t k_level = lo;
  size_t k_min = 0;  // the most receivers that each take a minimal move
  if (least_in(1) >= min_move_) {
    lo = 1;
    hi = n;
    while (lo < hi) {
      const size_t mid = lo + (hi - lo + 1) / 2;
      if (least_in(mid) >= min_move_) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    k_min = lo;
  }
  const size_t k = std::max(k_level, k_min);
  const double mu = level(k);
  for (size_t i = 0; i < k; ++i)
    nodes[cand[i]].in = in_at(i, mu);
}

namespace {

// The first part of `p` holding about `want` of its load (uniform over its
// hashes) and the rest; nothing when p is one hash or `want` covers it.
std::optional<std::pair<Piece, Piece>> split_piece(const Piece& p, double want) {
  const u128 width = hashes_in(p.lo, p.hi);
  if (width < 2 || !(p.load > 0) || !(want < p.load)) return std::nullopt;
  const long double x = static_cast<long double>(want) / p.load;
  u128 head = static_cast<u128>(x * static_cast<long double>(width));
  head = std::max<u128>(head, 1);
  if (head >= width) return std::nullopt;
  Piece a = p;
  Piece b = p;
  a.hi = p.lo + static_cast<uint64_t>(head - 1);
  a.load = p.load * fraction_of(head, width);
  b.lo = a.hi + 1;
  b.load = p.load - a.load;
  return std::make_pair(a, b);
}

}  // namespace

// Turns the planned out / in amounts into hash ranges: whole arcs where they
// fit, and one cut arc per source and per receiver at most.
Result<PlanStep> Balancer::Decision::realise(StepKind kind, std::vector<Node>& nodes,
                                             std::vector<MembershipChange> membership) const {
  std::vector<char> source(nodes.size(), 0);
  for (size_t i = 0; i < members_.size(); ++i)
    source[i] = nodes[i].must_empty ? members_[i].arcs > 0 : nodes[i].out > 0;
  std::vector<std::vector<uint32_t>> arcs(nodes.size());
  for (size_t k = 0; k < arc_member_.size(); ++k) {
    if (source[arc_member_[k]]) arcs[arc_member_[k]].push_back(static_cast<uint32_t>(k));
  }

  auto heavier = [](const Piece& a, const Piece& b) {
    return a.load != b.load ? a.load < b.load : a.lo > b.lo;
  };
  std::priority_queue<Piece, std::vector<Piece>, decltype(heavier)> pieces(heavier);
  auto arc_piece = [&](uint32_t k, size_t from, bool must) {
    const Arc a = p_.arc(k);
    return Piece{a.lo, a.hi, arc_load_[k], from, must};
  };
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!source[i]) continue;
    std::vector<uint32_t>& list = arcs[i];
    if (nodes[i].must_empty) {
      for (uint32_t k : list)
        pieces.push(arc_piece(k, i, true));
      continue;
    }
    // Biggest arcs first while they fit; then a cut of the smallest arc that
    // did not fit, for what is left (unless that is dust).
    std::sort(list.begin(), list.end(), [&](uint32_t a, uint32_t b) {
      return arc_load_[a] != arc_load_[b] ? arc_load_[a] > arc_load_[b] : a < b;
    });
    double want = nodes[i].out;
    const bool all = want >= nodes[i].load * (1 - kSlack);  // every arc that carries load
    std::optional<uint32_t> cut;
    for (uint32_t k : list) {
      if (!(arc_load_[k] > 0)) break;
      if (all || arc_load_[k] <= want * (1 + kSlack)) {
        pieces.push(arc_piece(k, i, all));
        want -= arc_load_[k];
      } else {
        cut = k;
      }
    }
    if (cut && want > std::max(0.5 * min_move_, kSlack * nodes[i].out)) {
      if (auto parts = split_piece(arc_piece(*cut, i, false), want)) pieces.push(parts->first);
    }
  }

  struct Slot {
    double left = 0;
    ServerId id = 0;
    size_t node = 0;
  };
  auto roomier = [](const Slot& a, const Slot& b) {
    return a.left != b.left ? a.left < b.left : a.id > b.id;
  };
  std::priority_queue<Slot, std::vector<Slot>, decltype(roomier)> slots(roomier);
  std::optional<size_t> fallback;  // for pieces that must leave when no room is left
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    if (n.in > 0) slots.push(Slot{n.in, n.id, i});
    if (n.receives && !n.must_empty && n.out <= 0 && n.rate > 0 &&
        (!fallback || n.time() < nodes[*fallback].time())) {
      fallback = i;
    }
  }

  std::vector<Move> moves;
  auto give = [&](const Piece& piece, size_t to) {
    moves.push_back(Move{piece.lo, piece.hi, nodes[piece.from].id, nodes[to].id, piece.load});
  };
  const double dust = kSlack * std::max(min_move_, 1.0);
  while (!pieces.empty()) {
    const Piece piece = pieces.top();
    pieces.pop();
    while (!slots.empty() && slots.top().left <= dust)
      slots.pop();
    if (slots.empty()) {
      if (piece.must) {
        if (!fallback) {
          return FailedPrecondition(
              fmt::format("server {} must be emptied but no active server can take its arcs",
                          nodes[piece.from].id));
        }
        give(piece, *fallback);
      }
      continue;  // a piece that may stay, stays
    }
    Slot slot = slots.top();
    slots.pop();
    if (piece.load <= slot.left * (1 + kSlack)) {
      give(piece, slot.node);
      slot.left -= piece.load;
      slots.push(slot);
      continue;
    }
    if (slot.left < 0.5 * min_move_) {  // room too small to cut a piece for
      if (piece.must) {
        give(piece, slot.node);  // this is the roomiest receiver left
        slot.left -= piece.load;
        slots.push(slot);
      }
      continue;
    }
    auto parts = split_piece(piece, slot.left);
    if (!parts) {  // one hash, heavier than the room
      if (piece.must) {
        give(piece, slot.node);
        slot.left -= piece.load;
        slots.push(slot);
      } else {
        slots.push(slot);  // the piece stays where it is; the room is for others
      }
      continue;
    }
    give(parts->first, slot.node);
    pieces.push(parts->second);
  }
  return finish(kind, std::move(moves), std::move(membership), nodes);
}

Result<PlanStep> Balancer::Decision::finish(StepKind kind, std::vector<Move> moves,
                                            std::vector<MembershipChange> membership,
                                            std::vector<Node>& nodes) const {
  std::sort(moves.begin(), moves.end(), [](const Move& a, const Move& b) { return a.lo < b.lo; });
  std::vector<Move> merged;
  for (const Move& m : moves) {
    if (!merged.empty() && merged.back().hi + 1 == m.lo && merged.back().from == m.from &&
        merged.back().to == m.to) {
      merged.back().hi = m.hi;
      merged.back().bytes_per_round += m.bytes_per_round;
    } else {
      merged.push_back(m);
    }
  }

  PlacementDelta delta;
  delta.from_epoch = p_.epoch();
  delta.to_epoch = p_.epoch() + 1;  // run() checked that the counter is not exhausted
  delta.membership = std::move(membership);
  for (const Move& m : merged) {
    if (!delta.assignments.empty() && delta.assignments.back().hi + 1 == m.lo &&
        delta.assignments.back().owner == m.to) {
      delta.assignments.back().hi = m.hi;
    } else {
      delta.assignments.push_back(RangeAssignment{m.lo, m.hi, m.to});
    }
  }
  PSLD_ASSIGN_OR_RETURN(Placement next, p_.apply(delta));
  for (const RangeAssignment& a : delta.assignments) {
    const ServerInfo* s = next.find_server(a.owner);
    if (s == nullptr || s->state != ServerState::kActive) {
      return Internal(
          fmt::format("the balancer planned a move to server {}, which is not active", a.owner));
    }
  }

  auto node_of = [&](ServerId id) {
    for (size_t i = members_.size(); i < nodes.size(); ++i)
      if (nodes[i].id == id) return i;
    return static_cast<size_t>(member(id) - members_.data());
  };
  for (Node& n : nodes)
    n.gave = n.got = 0;
  double moved = 0;
  for (const Move& m : merged) {
    nodes[node_of(m.from)].gave += m.bytes_per_round;
    nodes[node_of(m.to)].got += m.bytes_per_round;
    moved += m.bytes_per_round;
  }
  double before = 0;
  double after = 0;
  double cost = 0;
  for (const Node& n : nodes) {
    const double load = std::max(0.0, n.load - n.gave + n.got);
    before = std::max(before, n.time());
    if (load > 0) after = std::max(after, n.rate > 0 ? load / n.rate : kInf);
    if (n.rate > 0) {
      cost = std::max(cost, (n.gave + n.got) * o_.migration_bytes_per_load_byte / n.rate);
    }
  }
  return PlanStep{kind,
                  PlacementChange{std::move(next), std::move(delta)},
                  std::move(merged),
                  before,
                  after,
                  moved,
                  moved * o_.migration_bytes_per_load_byte,
                  cost,
                  {}};
}

// ---- Explore: remember a step, judge it, undo it ----------------------------------

double Balancer::Decision::range_load(uint64_t lo, uint64_t hi) const {
  double load = 0;
  for (size_t i = p_.arc_index_of_hash(lo);; ++i) {
    const Arc a = p_.arc(i);
    load += arc_load_[i] *
            fraction_of(hashes_in(std::max(a.lo, lo), std::min(a.hi, hi)), hashes_in(a.lo, a.hi));
    if (a.hi >= hi) break;
  }
  return load;
}

bool Balancer::Decision::in_effect(const Move& m) const {
  for (size_t i = p_.arc_index_of_hash(m.lo);; ++i) {
    const Arc a = p_.arc(i);
    if (a.owner != m.to) return false;
    if (a.hi >= m.hi) return true;
  }
}

// A server's time per round over the last evaluation_windows windows: the
// least of them, not their mean. On a shared machine noise only adds time (a
// round that waited for a core, a spike of 2-3x), so one spiky window must not
// make a good move look bad; a move that really slowed a server shows in
// every window.
std::optional<double> Balancer::Decision::least_service_before(const Tracked& t) const {
  // Windows of the current epoch; failing that, the newest ones before it.
  for (const bool exact : {true, false}) {
    double least = 0;
    uint32_t n = 0;
    for (auto it = t.history.rbegin(); it != t.history.rend() && n < o_.evaluation_windows; ++it) {
      if (exact ? it->epoch == p_.epoch() : it->epoch <= p_.epoch()) {
        least = n == 0 ? it->service_s : std::min(least, it->service_s);
        ++n;
      }
    }
    if (n > 0) return least;
  }
  return std::nullopt;
}

std::optional<double> Balancer::Decision::least_service_after(const Tracked& t,
                                                              uint64_t epoch) const {
  double least = 0;
  uint32_t n = 0;
  for (auto it = t.history.rbegin(); it != t.history.rend() && n < o_.evaluation_windows; ++it) {
    if (it->epoch >= epoch) {
      least = n == 0 ? it->service_s : std::min(least, it->service_s);
      ++n;
    }
  }
  if (n < o_.evaluation_windows) return std::nullopt;
  return least;
}

void Balancer::Decision::remember(const PlanStep& step, const std::vector<Node>& nodes,
                                  std::vector<ServerId> added) {
  Pending p;
  p.decision = b_.decision_;
  p.kind = step.kind;
  p.to_epoch = step.change.next.epoch();
  p.moves = step.moves;
  p.added = std::move(added);
  p.predicted_after_s = step.predicted_round_s_after;
  for (const Node& n : nodes) {
    if (n.gave <= 0 && n.got <= 0) continue;
    Involved inv;
    inv.id = n.id;
    inv.received = n.got > 0;
    inv.predicted_s = n.rate > 0 ? std::max(0.0, n.load - n.gave + n.got) / n.rate : kInf;
    if (auto it = b_.servers_.find(n.id); it != b_.servers_.end()) {
      inv.rate = it->second.rate;
      inv.rate_var = it->second.rate_var;
      inv.rate_samples = it->second.rate_samples;
    }
    if (const Member* m = member(n.id)) {
      if (auto before = least_service_before(*m->t)) {
        p.measured_before_s = std::max(p.measured_before_s, *before);
      }
    }
    p.involved.push_back(inv);
  }
  std::sort(p.involved.begin(), p.involved.end(),
            [](const Involved& a, const Involved& b) { return a.id < b.id; });
  b_.pending_ = std::move(p);
}

Result<Balancer::Decision::Verdict> Balancer::Decision::evaluate() {
  Verdict v;
  if (!b_.pending_) return v;
  const Pending& pd = *b_.pending_;
  const uint64_t age = b_.decision_ - pd.decision;
  auto give_up = [&](std::string why) {
    v.note = fmt::format("dropped decision {}: {}", pd.decision, why);
    b_.pending_.reset();
    return v;
  };
  if (p_.epoch() < pd.to_epoch) {
    if (age > o_.pending_timeout_decisions) {
      return give_up(fmt::format("epoch {} was not published within {} decisions", pd.to_epoch,
                                 o_.pending_timeout_decisions));
    }
    v.wait = v.unpublished = true;
    v.note = fmt::format("waiting for epoch {} of decision {}", pd.to_epoch, pd.decision);
    return v;
  }
  std::vector<Move> live;
  for (const Move& m : pd.moves)
    if (in_effect(m)) live.push_back(m);
  if (!pd.moves.empty() && live.empty()) {
    return give_up("a later placement changed every range it moved");
  }

  // The measurement: every involved active server's windows at the new epoch.
  // A receiver measured slower than predicted by the tolerance is to blame.
  double after = 0;
  std::vector<ServerId> missing;
  std::vector<ServerId> blamed;
  std::vector<ServerId> receivers;
  for (const Involved& inv : pd.involved) {
    const Member* m = member(inv.id);
    if (m == nullptr || !m->active()) continue;  // left or draining: nothing to wait for
    if (inv.received) receivers.push_back(inv.id);
    if (auto s = least_service_after(*m->t, pd.to_epoch)) {
      after = std::max(after, *s);
      if (inv.received && *s > (1 + o_.rollback_tolerance) * inv.predicted_s) {
        blamed.push_back(inv.id);
      }
    } else {
      missing.push_back(inv.id);
    }
  }
  if (!missing.empty()) {
    if (age > o_.pending_timeout_decisions) {
      return give_up(fmt::format("{} sent no {} windows of epoch {} within {} decisions",
                                 ids_text(missing), o_.evaluation_windows, pd.to_epoch,
                                 o_.pending_timeout_decisions));
    }
    v.wait = true;
    v.note = fmt::format("waiting for {} windows of epoch {} from {} to judge decision {}",
                         o_.evaluation_windows, pd.to_epoch, ids_text(missing), pd.decision);
    return v;
  }
  const bool judged = pd.kind == StepKind::kRebalance || pd.kind == StepKind::kScaleOut ||
                      pd.kind == StepKind::kProbe;
  if (!judged || !(pd.measured_before_s > 0)) {
    v.note = fmt::format("decision {} took effect", pd.decision);
    b_.pending_.reset();
    return v;
  }
  const std::string measured =
      fmt::format("measured round {} (predicted {}, before {}: {})", seconds_text(after),
                  seconds_text(pd.predicted_after_s), seconds_text(pd.measured_before_s),
                  change_text(pd.measured_before_s, after));
  if (after <= (1 + o_.rollback_tolerance) * pd.measured_before_s) {
    for (ServerId id : receivers)
      if (auto it = b_.servers_.find(id); it != b_.servers_.end()) it->second.rollbacks = 0;
    v.note = fmt::format("kept decision {}: {}", pd.decision, measured);
    // Predictions at the scale of the noise keep finding a few percent to
    // gain. Two steps in a row that did not gain settle_gain when measured
    // (one can be bad luck) end the rebalance until stragglers show again.
    if (pd.kind == StepKind::kRebalance && b_.rebalancing_) {
      const bool flat = after > (1 - o_.settle_gain) * pd.measured_before_s;
      b_.flat_steps_ = flat ? b_.flat_steps_ + 1 : 0;
      if (b_.flat_steps_ >= kFlatSteps) {
        b_.rebalancing_ = false;
        v.note +=
            fmt::format("; {} steps without a measurable gain, the rebalance ends", b_.flat_steps_);
      }
    }
    b_.pending_.reset();
    return v;
  }

  // Worse beyond the tolerance: undo what is still in place. A range whose
  // old owner is draining or gone stays where it is.
  std::vector<Node> nodes = base_nodes();
  std::vector<Move> back;
  for (const Move& m : live) {
    const Member* from = member(m.from);
    if (from == nullptr || !from->active()) continue;
    back.push_back(Move{m.lo, m.hi, m.to, m.from, range_load(m.lo, m.hi)});
  }
  std::vector<MembershipChange> membership;
  size_t active = active_count_;
  for (ServerId id : pd.added) {
    const Member* added = member(id);
    if (added != nullptr && added->active() && active > 1) {
      membership.push_back(MembershipChange::set_state(id, ServerState::kDraining));
      --active;
    }
  }
  // Undone because of the blamed receivers (all receivers when none was
  // mispredicted alone): they cool down, and forget what they showed at a
  // load they will not carry.
  if (blamed.empty()) blamed = receivers;
  const uint64_t decision = pd.decision;
  const Pending undone = *b_.pending_;
  b_.pending_.reset();
  b_.rebalancing_ = false;  // a new rebalance waits for stragglers to show again
  if (back.empty() && membership.empty()) {
    v.note = fmt::format("decision {} made the round slower ({}), but none of it can be undone",
                         decision, measured);
    return v;
  }
  PSLD_ASSIGN_OR_RETURN(PlanStep step,
                        finish(StepKind::kRollback, std::move(back), std::move(membership), nodes));
  uint64_t until = b_.decision_;
  for (const Involved& inv : undone.involved) {
    if (!std::binary_search(blamed.begin(), blamed.end(), inv.id)) continue;
    auto it = b_.servers_.find(inv.id);
    if (it == b_.servers_.end()) continue;
    Tracked& t = it->second;
    const uint64_t cooldown = uint64_t{o_.rollback_cooldown_decisions}
                              << std::min(t.rollbacks, kMaxCooldownDoublings);
    t.cooldown_until = b_.decision_ + cooldown;
    until = std::max(until, t.cooldown_until);
    t.rollbacks = std::min(t.rollbacks + 1, kMaxStreak);
    if (inv.rate_samples > 0) {
      t.rate = inv.rate;
      t.rate_var = inv.rate_var;
      t.rate_samples = inv.rate_samples;
    }
  }
  step.reason = fmt::format(
      "rollback of decision {} -> epoch {}: {} exceeds the tolerance {:.0f}%; {}; no new load for "
      "{} until decision {}",
      decision, step.change.next.epoch(), measured, 100 * o_.rollback_tolerance, moves_text(step),
      ids_text(blamed), until);
  remember(step, nodes);
  v.rollback = std::move(step);
  return v;
}

// ---- The steps ------------------------------------------------------------------

Result<std::optional<PlanStep>> Balancer::Decision::drain_step() {
  std::vector<ServerId> draining;
  for (const Member& m : members_)
    if (!m.active() && m.arcs > 0) draining.push_back(m.id);
  if (draining.empty()) return std::optional<PlanStep>();

  std::vector<Node> nodes = base_nodes();
  bool any_receiver = false;
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    if (!m.active()) {
      nodes[i].must_empty = m.arcs > 0;
      nodes[i].max_out = m.load;
    } else if (!cooling(*m.t)) {
      nodes[i].receives = any_receiver = true;
    }
  }
  if (!any_receiver) {  // everyone is cooling down: the arcs must go somewhere anyway
    for (size_t i = 0; i < members_.size(); ++i)
      nodes[i].receives = members_[i].active();
  }
  water_fill(nodes);
  PSLD_ASSIGN_OR_RETURN(PlanStep step, realise(StepKind::kDrain, nodes, {}));
  step.reason = fmt::format(
      "drain -> epoch {}: {} draining and still owning arcs; predicted round {} -> {} "
      "({}); {}; {}",
      step.change.next.epoch(), ids_text(draining), seconds_text(step.predicted_round_s_before),
      seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step),
      cost_text(step));
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

Result<std::optional<PlanStep>> Balancer::Decision::scale_in_step() {
  if (!o_.scale_in || b_.scale_in_windows_ < o_.scale_in_windows) return std::optional<PlanStep>();
  if (b_.last_scale_ != 0 && b_.decision_ - b_.last_scale_ < o_.scale_cooldown_decisions) {
    return std::optional<PlanStep>();
  }
  const Member* c = member(b_.scale_in_candidate_);
  if (c == nullptr || !c->active()) return std::optional<PlanStep>();
  std::vector<Node> nodes = base_nodes();
  bool any_receiver = false;
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    if (m.id == c->id) {
      nodes[i].must_empty = true;
      nodes[i].max_out = m.load;
    } else if (m.active() && !cooling(*m.t)) {
      nodes[i].receives = any_receiver = true;
    }
  }
  if (!any_receiver) {
    for (size_t i = 0; i < members_.size(); ++i)
      nodes[i].receives = members_[i].active() && members_[i].id != c->id;
  }
  water_fill(nodes);
  PSLD_ASSIGN_OR_RETURN(PlanStep step,
                        realise(StepKind::kScaleIn, nodes,
                                {MembershipChange::set_state(c->id, ServerState::kDraining)}));
  step.reason = fmt::format(
      "scale-in -> epoch {}: drains server {} ({}, for {} windows); predicted round {} -> {} "
      "({}); {}; {}",
      step.change.next.epoch(), c->id, scale_in_why_, b_.scale_in_windows_,
      seconds_text(step.predicted_round_s_before), seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step),
      cost_text(step));
  b_.last_scale_ = b_.decision_;
  b_.scale_in_windows_ = 0;
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

Result<std::optional<PlanStep>> Balancer::Decision::scale_out_step(std::string* note) {
  if (!o_.scale_out || in_.standby.empty() || b_.server_bound_windows_ < o_.scale_out_windows) {
    return std::optional<PlanStep>();
  }
  if (b_.last_scale_ != 0 && b_.decision_ - b_.last_scale_ < o_.scale_cooldown_decisions) {
    return std::optional<PlanStep>();
  }
  // As many standby servers as bring the balanced servers below the
  // threshold, at most max_step_fraction of the active ones (at least one):
  // one server more among 500 saturated ones would gain 0.2%.
  const size_t most =
      std::max<size_t>(1, static_cast<size_t>(std::ceil(o_.max_step_fraction * active_count_)));
  std::vector<const ServerSpec*> specs;
  double rate = active_rate_;
  for (const ServerSpec& s : in_.standby) {
    if (specs.size() >= most) break;
    auto it = b_.servers_.find(s.id);
    if (it != b_.servers_.end() && cooling(it->second)) continue;
    specs.push_back(&s);
    rate += prior_per_weight_ * s.weight;  // a typical server of its weight
    const double balanced = total_load_ / rate;
    if (balanced < o_.scale_out_utilisation * (other_s_ + balanced)) break;
  }
  if (specs.empty()) return std::optional<PlanStep>();

  std::vector<Node> nodes = base_nodes();
  for (size_t i = 0; i < members_.size(); ++i) {
    if (!members_[i].active()) continue;
    nodes[i].max_out = step_limit(members_[i].load);
    nodes[i].max_in = take_limit(members_[i].load);
    nodes[i].receives = !cooling(*members_[i].t);
  }
  std::vector<MembershipChange> membership;
  std::vector<ServerId> added;
  for (const ServerSpec* spec : specs) {
    Node n;
    n.id = spec->id;
    n.rate = prior_per_weight_ * spec->weight;
    n.receives = true;
    n.max_in = take_limit(0);
    nodes.push_back(n);
    membership.push_back(MembershipChange::add(*spec, ServerState::kActive));
    added.push_back(spec->id);
  }
  water_fill(nodes);
  PSLD_ASSIGN_OR_RETURN(PlanStep step, realise(StepKind::kScaleOut, nodes, std::move(membership)));
  const double gain = step.predicted_round_s_before - step.predicted_round_s_after;
  if (!(gain > step.migration_cost_s / o_.horizon_rounds) ||
      gain < o_.settle_gain * step.predicted_round_s_before) {
    *note = fmt::format("the servers are saturated, but adding standby {} would gain only {} ({})",
                        ids_text(added), seconds_text(gain),
                        change_text(step.predicted_round_s_before, step.predicted_round_s_after));
    return std::optional<PlanStep>();
  }
  const double balanced = plan_.balanced_round_s;
  step.reason = fmt::format(
      "scale-out -> epoch {}: adds standby {}; the servers are saturated (balanced, they "
      "would be busy {:.0f}% of a {} round, for {} windows); predicted round {} -> {} ({}); {}; {}",
      step.change.next.epoch(), ids_text(added), 100 * balanced / (other_s_ + balanced),
      seconds_text(other_s_ + balanced), b_.server_bound_windows_,
      seconds_text(step.predicted_round_s_before), seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step),
      cost_text(step));
  b_.last_scale_ = b_.decision_;
  b_.server_bound_windows_ = 0;
  b_.rebalancing_ = true;  // the new servers fill up over the next steps
  remember(step, nodes, std::move(added));
  return std::optional<PlanStep>(std::move(step));
}

Result<std::optional<PlanStep>> Balancer::Decision::rebalance_step(std::string* note) {
  std::vector<ServerId> stragglers;
  for (const Member& m : members_)
    if (m.active() && m.t->straggler_windows >= o_.straggler_windows) stragglers.push_back(m.id);
  if (!b_.rebalancing_ && stragglers.empty()) return std::optional<PlanStep>();

  std::vector<Node> nodes = base_nodes();
  for (size_t i = 0; i < members_.size(); ++i) {
    if (!members_[i].active()) continue;
    nodes[i].max_out = step_limit(members_[i].load);
    nodes[i].max_in = take_limit(members_[i].load);
    nodes[i].receives = !cooling(*members_[i].t);
  }
  water_fill(nodes);
  bool any = false;
  for (const Node& n : nodes)
    any = any || n.out > 0;
  if (!any) {
    b_.rebalancing_ = false;
    *note = "balanced: every move would be below the minimum";
    return std::optional<PlanStep>();
  }
  PSLD_ASSIGN_OR_RETURN(PlanStep step, realise(StepKind::kRebalance, nodes, {}));
  const double before = step.predicted_round_s_before;
  const double gain = before - step.predicted_round_s_after;
  const double cost = step.migration_cost_s / o_.horizon_rounds;
  if (!(gain > cost) || gain < o_.settle_gain * before) {
    b_.rebalancing_ = false;
    const std::string best = fmt::format(
        "the best step would gain {} per round ({}) against {} of migration per round",
        seconds_text(gain), change_text(before, step.predicted_round_s_after), seconds_text(cost));
    *note = stragglers.empty() ? "balanced: " + best
                               : fmt::format("stragglers: {}, but {}", straggler_text(), best);
    return std::optional<PlanStep>();
  }
  const bool started = !b_.rebalancing_;
  if (started) b_.flat_steps_ = 0;
  b_.rebalancing_ = true;
  step.reason = fmt::format(
      "rebalance -> epoch {}: {}; predicted round {} -> {} ({}, balanced {}); {}; {}",
      step.change.next.epoch(),
      started ? fmt::format("stragglers: {}", straggler_text())
              : fmt::format("continues (stragglers: {})",
                            stragglers.empty() ? std::string("none now") : straggler_text()),
      seconds_text(before), seconds_text(step.predicted_round_s_after),
      change_text(before, step.predicted_round_s_after), seconds_text(plan_.balanced_round_s),
      moves_text(step), cost_text(step));
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

Result<std::optional<PlanStep>> Balancer::Decision::probe_step() {
  const Member* target = nullptr;
  for (const Member& m : members_) {
    const Tracked& t = *m.t;
    if (!m.active() || cooling(t) || t.windows_since_rate < o_.probe_after_windows) continue;
    if (t.last_probe != 0 && b_.decision_ - t.last_probe < o_.probe_interval_decisions) continue;
    target = &m;
    break;
  }
  if (target == nullptr || active_count_ < 2) return std::optional<PlanStep>();
  size_t source = members_.size();
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    if (!m.active() || m.id == target->id || !(m.load > 0)) continue;
    if (source == members_.size() || m.time() > members_[source].time()) source = i;
  }
  if (source == members_.size()) return std::optional<PlanStep>();
  const double amount = std::min(o_.probe_fraction * active_load_ / active_count_,
                                 o_.max_step_fraction * members_[source].load);
  if (!(amount > 0)) return std::optional<PlanStep>();

  std::vector<Node> nodes = base_nodes();
  nodes[source].out = amount;
  const size_t t = static_cast<size_t>(target - members_.data());
  nodes[t].receives = true;
  nodes[t].in = amount;
  PSLD_ASSIGN_OR_RETURN(PlanStep step, realise(StepKind::kProbe, nodes, {}));
  if (step.moves.empty()) return std::optional<PlanStep>();
  target->t->last_probe = b_.decision_;
  step.reason = fmt::format(
      "probe -> epoch {}: server {} has had no rate sample for {} windows (last estimate {}/s); "
      "it gets {}/round to measure it; predicted round at that estimate {} -> {} ({}); {}",
      step.change.next.epoch(), target->id, target->t->windows_since_rate, bytes_text(target->rate),
      bytes_text(step.moved_bytes_per_round), seconds_text(step.predicted_round_s_before),
      seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step));
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

// ---- Log text -------------------------------------------------------------------

std::string Balancer::Decision::moves_text(const PlanStep& step) const {
  std::string out = fmt::format("moves {}/round in {} ranges",
                                bytes_text(step.moved_bytes_per_round), step.moves.size());
  std::vector<const Move*> biggest;
  for (const Move& m : step.moves)
    biggest.push_back(&m);
  std::stable_sort(biggest.begin(), biggest.end(), [](const Move* a, const Move* b) {
    return a->bytes_per_round > b->bytes_per_round;
  });
  for (size_t i = 0; i < biggest.size() && i < kLoggedMoves; ++i) {
    const Move& m = *biggest[i];
    out += fmt::format("{}[{:#x}, {:#x}] {}->{} {}", i == 0 ? ": " : ", ", m.lo, m.hi, m.from, m.to,
                       bytes_text(m.bytes_per_round));
  }
  if (biggest.size() > kLoggedMoves) {
    out += fmt::format(" and {} more", biggest.size() - kLoggedMoves);
  }
  return out;
}

std::string Balancer::Decision::cost_text(const PlanStep& step) const {
  return fmt::format("migration {} takes {}, {} per round over {:g} rounds",
                     bytes_text(step.migration_bytes), seconds_text(step.migration_cost_s),
                     seconds_text(step.migration_cost_s / o_.horizon_rounds), o_.horizon_rounds);
}

std::string Balancer::Decision::straggler_text() const {
  std::string out;
  for (const Member& m : members_) {
    if (!m.active() || m.t->straggler_windows < o_.straggler_windows) continue;
    const double others = (active_load_ - m.load) / (active_rate_ - m.rate);
    out +=
        fmt::format("{}server {} at {} vs {} for the others ({} windows)", out.empty() ? "" : ", ",
                    m.id, seconds_text(m.time()), seconds_text(others), m.t->straggler_windows);
  }
  return out.empty() ? "none" : out;
}

Result<Plan> Balancer::Decision::finish_plan(std::string prefix, std::optional<PlanStep> step,
                                             std::string hold) {
  std::string line = fmt::format("decision {} epoch {}: ", b_.decision_, p_.epoch());
  if (!prefix.empty()) line += prefix + "; ";
  if (step) {
    line += step->reason;
    plan_.steps.push_back(std::move(*step));
  } else {
    line += fmt::format("hold: predicted round {}, balanced {}, measured {}",
                        seconds_text(plan_.predicted_round_s), seconds_text(plan_.balanced_round_s),
                        seconds_text(plan_.measured_round_s));
    if (!hold.empty()) line += "; " + hold;
  }
  plan_.log = std::move(line);
  return std::move(plan_);
}

Result<Plan> Balancer::Decision::run() {
  plan_.decision = b_.decision_;
  ingest();
  measure_load();
  const bool estimated = estimate_rates();
  if (estimated) {
    plan_.balanced_round_s = active_rate_ > 0 ? total_load_ / active_rate_ : 0;
    for (const Member& m : members_) {
      plan_.predicted_round_s = std::max(plan_.predicted_round_s, m.time());
    }
  }
  if (estimated) update_streaks();
  for (const Member& m : members_) {
    const Tracked& t = *m.t;
    plan_.servers.push_back(ServerPrediction{m.id, m.state, m.load, m.estimated ? t.rate : m.rate,
                                             m.estimated ? std::sqrt(t.rate_var) : 0, m.rate,
                                             m.time(), m.estimated ? t.rate_samples : 0,
                                             t.straggler_windows, t.windows_since_rate});
  }
  if (!estimated) {
    return finish_plan("", std::nullopt,
                       "no rate estimate yet: no server has reported a window "
                       "with bytes and busy time");
  }

  // A step in flight is judged first; one that is not published yet holds
  // everything. Then the arcs of draining servers leave, before anything else.
  PSLD_ASSIGN_OR_RETURN(Verdict verdict, evaluate());
  if (verdict.rollback || verdict.unpublished) {
    return finish_plan("", std::move(verdict.rollback), verdict.note);
  }
  PSLD_ASSIGN_OR_RETURN(std::optional<PlanStep> drain, drain_step());
  if (drain) return finish_plan(verdict.wait ? "" : verdict.note, std::move(drain), "");
  if (verdict.wait) return finish_plan("", std::nullopt, verdict.note);
  if (!(total_load_ > 0)) return finish_plan(verdict.note, std::nullopt, "no load measured");

  std::string note;
  PSLD_ASSIGN_OR_RETURN(std::optional<PlanStep> step, scale_in_step());
  if (!step) {
    PSLD_ASSIGN_OR_RETURN(step, scale_out_step(&note));
  }
  if (!step) {
    PSLD_ASSIGN_OR_RETURN(step, rebalance_step(&note));
  }
  if (!step) {
    PSLD_ASSIGN_OR_RETURN(step, probe_step());
  }
  if (!step && note.empty()) {
    double worst = 0;
    ServerId worst_id = 0;
    for (const Member& m : members_) {
      if (!m.active() || active_count_ < 2) continue;
      const double others = (active_load_ - m.load) / (active_rate_ - m.rate);
      if (others > 0 && m.time() / others - 1 > worst) {
        worst = m.time() / others - 1;
        worst_id = m.id;
      }
    }
    note = worst > 0
               ? fmt::format(
                     "no straggler (the slowest, server {}, is {:+.1f}% over the "
                     "others; the threshold is {:.0f}% for {} windows)",
                     worst_id, 100 * worst, 100 * o_.straggler_threshold, o_.straggler_windows)
               : "no straggler";
  }
  return finish_plan(verdict.note, std::move(step), note);
}

Result<Plan> Balancer::decide(const Placement& placement, const BalancerInput& input) {
  PSLD_RETURN_IF_ERROR(validate_input(placement, input));
  if (placement.epoch() == UINT64_MAX) {
    return FailedPrecondition("the placement epoch counter is exhausted; no change can follow it");
  }
  ++decision_;
  Decision decision(*this, placement, input);
  return decision.run();
}

}  // namespace psld
