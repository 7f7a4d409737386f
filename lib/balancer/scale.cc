// lib/balancer/scale.cc — scale: add standby servers, drain one, empty draining servers.
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "lib/balancer/internal.h"

namespace psld {

using namespace balancer_detail;

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
    } else if (!cooling(*m.tracked)) {
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
  if (!options_.scale_in || balancer_.scale_in_windows_ < options_.scale_in_windows)
    return std::optional<PlanStep>();
  if (balancer_.last_scale_ != 0 &&
      balancer_.decision_ - balancer_.last_scale_ < options_.scale_cooldown_decisions) {
    return std::optional<PlanStep>();
  }
  const Member* c = member(balancer_.scale_in_candidate_);
  if (c == nullptr || !c->active()) return std::optional<PlanStep>();
  std::vector<Node> nodes = base_nodes();
  bool any_receiver = false;
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    if (m.id == c->id) {
      nodes[i].must_empty = true;
      nodes[i].max_out = m.load;
    } else if (m.active() && !cooling(*m.tracked)) {
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
      step.change.next.epoch(), c->id, scale_in_why_, balancer_.scale_in_windows_,
      seconds_text(step.predicted_round_s_before), seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step),
      cost_text(step));
  balancer_.last_scale_ = balancer_.decision_;
  balancer_.scale_in_windows_ = 0;
  remember(step, nodes);
  return std::optional<PlanStep>(std::move(step));
}

Result<std::optional<PlanStep>> Balancer::Decision::scale_out_step(std::string* note) {
  if (!options_.scale_out || input_.standby.empty() ||
      balancer_.server_bound_windows_ < options_.scale_out_windows) {
    return std::optional<PlanStep>();
  }
  if (balancer_.last_scale_ != 0 &&
      balancer_.decision_ - balancer_.last_scale_ < options_.scale_cooldown_decisions) {
    return std::optional<PlanStep>();
  }
  // As many standby servers as bring the balanced servers below the
  // threshold, at most max_step_fraction of the active ones (at least one):
  // one server more among 500 saturated ones would gain 0.2%.
  const size_t most = std::max<size_t>(
      1, static_cast<size_t>(std::ceil(options_.max_step_fraction * active_count_)));
  std::vector<const ServerSpec*> specs;
  double rate = active_rate_;
  for (const ServerSpec& s : input_.standby) {
    if (specs.size() >= most) break;
    auto it = balancer_.servers_.find(s.id);
    if (it != balancer_.servers_.end() && cooling(it->second)) continue;
    specs.push_back(&s);
    rate += prior_per_weight_ * s.weight;  // a typical server of its weight
    const double balanced = total_load_ / rate;
    if (balanced < options_.scale_out_utilisation * (other_s_ + balanced)) break;
  }
  if (specs.empty()) return std::optional<PlanStep>();

  std::vector<Node> nodes = base_nodes();
  for (size_t i = 0; i < members_.size(); ++i) {
    if (!members_[i].active()) continue;
    nodes[i].max_out = step_limit(members_[i].load);
    nodes[i].max_in = take_limit(members_[i].load);
    nodes[i].receives = !cooling(*members_[i].tracked);
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
  if (!(gain > step.migration_cost_s / options_.horizon_rounds) ||
      gain < options_.settle_gain * step.predicted_round_s_before) {
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
      seconds_text(other_s_ + balanced), balancer_.server_bound_windows_,
      seconds_text(step.predicted_round_s_before), seconds_text(step.predicted_round_s_after),
      change_text(step.predicted_round_s_before, step.predicted_round_s_after), moves_text(step),
      cost_text(step));
  balancer_.last_scale_ = balancer_.decision_;
  balancer_.server_bound_windows_ = 0;
  balancer_.rebalancing_ = true;  // the new servers fill up over the next steps
  remember(step, nodes, std::move(added));
  return std::optional<PlanStep>(std::move(step));
}

}  // namespace psld
