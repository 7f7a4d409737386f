// lib/balancer/balancer.cc — see balancer.h, and docs/balancer.md for the model.
//
// The entry points (make, decide and the decision's run), the checks of the
// options and the input, and the decision's log. The phases have files of
// their own: predict.cc (predict, detect), plan.cc (exploit), explore.cc
// (judge and roll back a step, probe) and scale.cc; internal.h declares what
// they share.
#include "lib/balancer/balancer.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include <fmt/format.h>

#include "lib/balancer/internal.h"

namespace psld {

using namespace balancer_detail;

namespace {

// The log names at most this many moves; Plan::steps holds all of them.
constexpr size_t kLoggedMoves = 6;
// Stragglers a decision's reason names, the slowest first (at 1,024 servers
// a skewed placement has hundreds; the reason stays one line).
constexpr size_t kLoggedStragglers = 4;

bool finite_nonneg(double x) {
  return std::isfinite(x) && x >= 0;
}

}  // namespace

namespace balancer_detail {

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

}  // namespace balancer_detail

namespace {

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
  for (size_t i = 0; i < in.chunks.size(); ++i) {
    const ChunkPoint& c = in.chunks[i];
    if (i > 0 && c.hash <= in.chunks[i - 1].hash) {
      return InvalidArgument(
          fmt::format("chunk {} has hash {:#x}, after {:#x}; chunks must be sorted by hash, each "
                      "hash once",
                      i, c.hash, in.chunks[i - 1].hash));
    }
    if (!finite_nonneg(c.bytes)) {
      return InvalidArgument(
          fmt::format("chunk {} has bytes {}; it must be finite and >= 0", i, c.bytes));
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
      {"false_alarm_windows", false_alarm_windows, 10, 1e12, false},
      {"settle_gain", settle_gain, 0, 0.99, false},
      {"horizon_rounds", horizon_rounds, 1, 1e9, false},
      {"migration_bytes_per_load_byte", migration_bytes_per_load_byte, 0, 1e6, false},
      {"min_move_fraction", min_move_fraction, 0, 0.5, false},
      {"max_step_fraction", max_step_fraction, 0, 1, true},
      {"confident_samples", static_cast<double>(confident_samples), 0, 1e6, false},
      {"confident_error", confident_error, 0, 1, false},
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

const Balancer::Decision::Member* Balancer::Decision::member(ServerId id) const {
  auto it = std::lower_bound(members_.begin(), members_.end(), id,
                             [](const Member& m, ServerId v) { return m.id < v; });
  return it != members_.end() && it->id == id ? &*it : nullptr;
}

// ---- Log text -------------------------------------------------------------------

std::string Balancer::Decision::moves_text(const PlanStep& step) const {
  std::string out = fmt::format("moves {}/round in {} ranges",
                                bytes_text(step.moved_bytes_per_round), step.moves.size());
  std::vector<const Move*> biggest;
  for (const Move& m : step.moves)
    biggest.push_back(&m);
  // The biggest first, ties in the plan's order: only the few logged are
  // put in order (a scale-out on 1,024 servers plans 42,453 moves).
  const size_t logged = std::min(biggest.size(), kLoggedMoves);
  std::partial_sort(biggest.begin(), biggest.begin() + static_cast<ptrdiff_t>(logged),
                    biggest.end(), [](const Move* a, const Move* b) {
                      return a->bytes_per_round != b->bytes_per_round
                                 ? a->bytes_per_round > b->bytes_per_round
                                 : a < b;
                    });
  for (size_t i = 0; i < logged; ++i) {
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
                     seconds_text(step.migration_cost_s / options_.horizon_rounds),
                     options_.horizon_rounds);
}

std::string Balancer::Decision::straggler_text() const {
  std::vector<const Member*> stragglers;
  for (const Member& m : members_) {
    if (m.active() && m.tracked->straggler_windows >= options_.straggler_windows)
      stragglers.push_back(&m);
  }
  if (stragglers.empty()) return "none";
  std::stable_sort(stragglers.begin(), stragglers.end(),
                   [](const Member* a, const Member* b) { return a->time() > b->time(); });
  std::string out;
  const size_t logged = std::min(stragglers.size(), kLoggedStragglers);
  for (size_t i = 0; i < logged; ++i) {
    const Member& m = *stragglers[i];
    const double others = (active_load_ - m.load) / (active_rate_ - m.rate);
    out +=
        fmt::format("{}server {} at {} vs {} for the others ({} windows)", i == 0 ? "" : ", ", m.id,
                    seconds_text(m.time()), seconds_text(others), m.tracked->straggler_windows);
  }
  if (stragglers.size() > logged) {
    out += fmt::format(" and {} more ({} in all)", stragglers.size() - logged, stragglers.size());
  }
  return out;
}

Result<Plan> Balancer::Decision::finish_plan(const std::string& prefix,
                                             std::optional<PlanStep> step,
                                             const std::string& hold) {
  std::string line = fmt::format("decision {} epoch {}: ", balancer_.decision_, placement_.epoch());
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
  plan_.decision = balancer_.decision_;
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
    const Tracked& t = *m.tracked;
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
    note = worst > 0 ? fmt::format(
                           "no straggler (the slowest, server {}, is {:+.1f}% over the "
                           "others; the threshold is {:.0f}% for {} windows)",
                           worst_id, 100 * worst, 100 * options_.straggler_threshold,
                           options_.straggler_windows)
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
