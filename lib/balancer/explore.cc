// lib/balancer/explore.cc — explore: remember a step, judge it, roll it back; probe a server.
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "lib/balancer/internal.h"

namespace psld {

using namespace balancer_detail;

namespace {

// A cooldown doubles with each rollback in a row, up to 2^4 = 16 times.
constexpr uint32_t kMaxCooldownDoublings = 4;
// Rebalance steps in a row without a measured gain that end a rebalance.
constexpr uint32_t kFlatSteps = 2;

}  // namespace

// ---- Explore: remember a step, judge it, undo it ----------------------------------

double Balancer::Decision::range_load(uint64_t lo, uint64_t hi) const {
  double load = 0;
  for (size_t i = placement_.arc_index_of_hash(lo);; ++i) {
    const Arc a = placement_.arc(i);
    load += arc_load_[i] *
            fraction_of(hashes_in(std::max(a.lo, lo), std::min(a.hi, hi)), hashes_in(a.lo, a.hi));
    if (a.hi >= hi) break;
  }
  return load;
}

bool Balancer::Decision::in_effect(const Move& m) const {
  for (size_t i = placement_.arc_index_of_hash(m.lo);; ++i) {
    const Arc a = placement_.arc(i);
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
    for (auto it = t.history.rbegin(); it != t.history.rend() && n < options_.evaluation_windows;
         ++it) {
      if (exact ? it->epoch == placement_.epoch() : it->epoch <= placement_.epoch()) {
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
  for (auto it = t.history.rbegin(); it != t.history.rend() && n < options_.evaluation_windows;
       ++it) {
    if (it->epoch >= epoch) {
      least = n == 0 ? it->service_s : std::min(least, it->service_s);
      ++n;
    }
  }
  if (n < options_.evaluation_windows) return std::nullopt;
  return least;
}

void Balancer::Decision::remember(const PlanStep& step, const std::vector<Node>& nodes,
                                  std::vector<ServerId> added) {
  Pending p;
  p.decision = balancer_.decision_;
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
    if (auto it = balancer_.servers_.find(n.id); it != balancer_.servers_.end()) {
      inv.rate = it->second.rate;
      inv.rate_var = it->second.rate_var;
      inv.rate_samples = it->second.rate_samples;
    }
    if (const Member* m = member(n.id)) {
      if (auto before = least_service_before(*m->tracked)) {
        p.measured_before_s = std::max(p.measured_before_s, *before);
      }
    }
    p.involved.push_back(inv);
  }
  std::sort(p.involved.begin(), p.involved.end(),
            [](const Involved& a, const Involved& b) { return a.id < b.id; });
  balancer_.pending_ = std::move(p);
}

Result<Balancer::Decision::Verdict> Balancer::Decision::evaluate() {
  Verdict v;
  if (!balancer_.pending_) return v;
  const Pending& pd = *balancer_.pending_;
  const uint64_t age = balancer_.decision_ - pd.decision;
  auto give_up = [&](std::string why) {
    v.note = fmt::format("dropped decision {}: {}", pd.decision, why);
    balancer_.pending_.reset();
    return v;
  };
  if (placement_.epoch() < pd.to_epoch) {
    if (age > options_.pending_timeout_decisions) {
      return give_up(fmt::format("epoch {} was not published within {} decisions", pd.to_epoch,
                                 options_.pending_timeout_decisions));
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
    if (auto s = least_service_after(*m->tracked, pd.to_epoch)) {
      after = std::max(after, *s);
      if (inv.received && *s > (1 + options_.rollback_tolerance) * inv.predicted_s) {
        blamed.push_back(inv.id);
      }
    } else {
      missing.push_back(inv.id);
    }
  }
  if (!missing.empty()) {
    if (age > options_.pending_timeout_decisions) {
      return give_up(fmt::format("{} sent no {} windows of epoch {} within {} decisions",
                                 ids_text(missing), options_.evaluation_windows, pd.to_epoch,
                                 options_.pending_timeout_decisions));
    }
    v.wait = true;
    v.note = fmt::format("waiting for {} windows of epoch {} from {} to judge decision {}",
                         options_.evaluation_windows, pd.to_epoch, ids_text(missing), pd.decision);
    return v;
  }
  const bool judged = pd.kind == StepKind::kRebalance || pd.kind == StepKind::kScaleOut ||
                      pd.kind == StepKind::kProbe;
  if (!judged || !(pd.measured_before_s > 0)) {
    v.note = fmt::format("decision {} took effect", pd.decision);
    balancer_.pending_.reset();
    return v;
  }
  const std::string measured =
      fmt::format("measured round {} (predicted {}, before {}: {})", seconds_text(after),
                  seconds_text(pd.predicted_after_s), seconds_text(pd.measured_before_s),
                  change_text(pd.measured_before_s, after));
  // Slower, with every receiver within its prediction: a server that gave
  // load away got slower on its own (a straggler appearing as the step was
  // planned, in psld sim's S2). Undoing the move would put the load back on
  // it; the step stays and detection goes on. A probe is different: it is
  // planned on a stale rate to find out whether the server recovered, so a
  // slower round undoes it whatever its prediction said.
  const bool worse = after > (1 + options_.rollback_tolerance) * pd.measured_before_s;
  const bool source_slowed = worse && blamed.empty() && pd.kind != StepKind::kProbe;
  if (!worse || source_slowed) {
    for (ServerId id : receivers)
      if (auto it = balancer_.servers_.find(id); it != balancer_.servers_.end())
        it->second.rollbacks = 0;
    v.note = fmt::format("kept decision {}: {}{}", pd.decision, measured,
                         source_slowed ? "; slower, but no receiver beyond its prediction" : "");
    // Predictions at the scale of the noise keep finding a few percent to
    // gain. Two steps in a row that did not gain settle_gain when measured
    // (one can be bad luck) end the rebalance until stragglers show again.
    if (pd.kind == StepKind::kRebalance && balancer_.rebalancing_) {
      const bool flat = after > (1 - options_.settle_gain) * pd.measured_before_s;
      balancer_.flat_steps_ = flat ? balancer_.flat_steps_ + 1 : 0;
      if (balancer_.flat_steps_ >= kFlatSteps) {
        balancer_.rebalancing_ = false;
        v.note += fmt::format("; {} steps without a measurable gain, the rebalance ends",
                              balancer_.flat_steps_);
      }
    }
    balancer_.pending_.reset();
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
  const Pending undone = *balancer_.pending_;
  balancer_.pending_.reset();
  balancer_.rebalancing_ = false;  // a new rebalance waits for stragglers to show again
  if (back.empty() && membership.empty()) {
    v.note = fmt::format("decision {} made the round slower ({}), but none of it can be undone",
                         decision, measured);
    return v;
  }
  PSLD_ASSIGN_OR_RETURN(PlanStep step,
                        finish(StepKind::kRollback, std::move(back), std::move(membership), nodes));
  uint64_t until = balancer_.decision_;
  for (const Involved& inv : undone.involved) {
    if (!std::binary_search(blamed.begin(), blamed.end(), inv.id)) continue;
    auto it = balancer_.servers_.find(inv.id);
    if (it == balancer_.servers_.end()) continue;
    Tracked& t = it->second;
    const uint64_t cooldown = uint64_t{options_.rollback_cooldown_decisions}
                              << std::min(t.rollbacks, kMaxCooldownDoublings);
    t.cooldown_until = balancer_.decision_ + cooldown;
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
      decision, step.change.next.epoch(), measured, 100 * options_.rollback_tolerance,
      moves_text(step), ids_text(blamed), until);
  remember(step, nodes);
  v.rollback = std::move(step);
  return v;
}

// ---- The steps ------------------------------------------------------------------

// Every server due for a probe (up to an eighth of the active ones) is
// probed in the same step, each fed by one of the slowest servers: at 1,024
// servers the ring leaves dozens without a chunk, and probing them one step
// at a time took 48 epoch switches (docs/scale.md).
Result<std::optional<PlanStep>> Balancer::Decision::probe_step() {
  if (active_count_ < 2) return std::optional<PlanStep>();
  const size_t most = std::max<size_t>(1, active_count_ / 8);
  std::vector<size_t> targets;
  for (size_t i = 0; i < members_.size() && targets.size() < most; ++i) {
    const Member& m = members_[i];
    const Tracked& t = *m.tracked;
    if (!m.active() || cooling(t) || t.windows_since_rate < options_.probe_after_windows) continue;
    if (t.last_probe != 0 && balancer_.decision_ - t.last_probe < options_.probe_interval_decisions)
      continue;
    // On its way to a drain (the scale-in's candidate, such as a slow
    // server the balancer emptied): a probe would only give it load to take
    // away again.
    if (balancer_.scale_in_windows_ > 0 && balancer_.scale_in_candidate_ == m.id) continue;
    targets.push_back(i);
  }
  if (targets.empty()) return std::optional<PlanStep>();
  std::vector<char> target(members_.size(), 0);
  for (size_t i : targets)
    target[i] = 1;
  std::vector<size_t> sources;  // the slowest first
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    if (m.active() && m.load > 0 && !target[i]) sources.push_back(i);
  }
  if (sources.empty()) return std::optional<PlanStep>();
  std::sort(sources.begin(), sources.end(), [&](size_t a, size_t b) {
    const double ta = members_[a].time();
    const double tb = members_[b].time();
    return ta != tb ? ta > tb : members_[a].id < members_[b].id;
  });
  std::vector<Node> nodes = base_nodes();
  for (size_t k = 0; k < targets.size(); ++k) {
    const size_t source = sources[k % sources.size()];
    const double amount = std::min(
        probe_load_, options_.max_step_fraction * members_[source].load - nodes[source].out);
    if (!(amount > 0)) continue;
    nodes[source].out += amount;
    nodes[targets[k]].receives = true;
    nodes[targets[k]].in = amount;
  }
  PSLD_ASSIGN_OR_RETURN(PlanStep step, realise(StepKind::kProbe, nodes, {}));
  if (step.moves.empty()) return std::optional<PlanStep>();
  std::vector<ServerId> took;  // the targets the moves reached
  for (const Move& m : step.moves)
    took.push_back(m.to);
  std::sort(took.begin(), took.end());
  std::vector<ServerId> probed;
  uint32_t windows = UINT32_MAX;
  for (size_t i : targets) {
    if (!std::binary_search(took.begin(), took.end(), members_[i].id)) continue;
    Tracked& t = *members_[i].tracked;
    t.last_probe = balancer_.decision_;
    probed.push_back(members_[i].id);
    windows = std::min(windows, t.windows_since_rate);
  }
  // Only targets have room in a probe, so the moves reached at least one.
  const Member& first = *member(probed.empty() ? members_[targets.front()].id : probed.front());
  constexpr size_t kNamed = 8;
  std::string who = ids_text(std::vector<ServerId>(
      probed.begin(),
      probed.begin() + static_cast<std::ptrdiff_t>(std::min(kNamed, probed.size()))));
  if (probed.size() > kNamed) who += fmt::format(" and {} more", probed.size() - kNamed);
  step.reason = fmt::format(
      "probe -> epoch {}: {} {} had no rate sample for {} windows or more (last estimate of "
      "server {}: {}/s); {}/round in all to measure {}; predicted round at the estimates {} -> {} "
      "({}); {}",
      step.change.next.epoch(), who, probed.size() == 1 ? "has" : "have", windows, first.id,
      bytes_text(first.rate), bytes_text(step.moved_bytes_per_round),
      probed.size() == 1 ? "it" : "them", seconds_text(step.predicted_round_s_before),
      seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step));
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

}  // namespace psld
