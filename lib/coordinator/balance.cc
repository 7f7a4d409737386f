// Balancing, the coordinator's side: the load history the members reported,
// turned into the balancer's input each interval, and its plan proposed as
// an epoch switch (lib/balancer/balancer.h is the pure decision).
#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "base/log.h"
#include "lib/coordinator/service.h"
#include "lib/placement/epoch_log.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

// mu_ held. The balancer sees one window per server per decision: what the
// server reported since the previous decision, over the rounds the job made
// in that time.
void CoordinatorService::balance() {
  const auto now = Clock::now();
  const bool first = last_decision_ == Clock::time_point{};
  const uint64_t rounds = max_round_ - decision_round_;
  const double elapsed_s = std::chrono::duration<double>(now - last_decision_).count();
  // A window belongs to the epoch that was in force when it began: one that
  // straddles a switch (and the migration) is not evidence about the new one.
  const uint64_t window_epoch = decision_epoch_;
  last_decision_ = now;
  decision_round_ = max_round_;
  // The window beginning now counts for the newest epoch only once that
  // epoch serves every round: its switch round passed and its state
  // transfer final. Until then it holds rounds of the previous epoch and the
  // migration itself (a scale-out of 3 MiB per round was rolled back in
  // psld bench stragglers S5 on such a window).
  const bool serving = placement_->epoch() == 0 || (!transfer_ && max_round_ > last_switch_round_);
  decision_epoch_ = serving ? placement_->epoch() : placement_->epoch() - 1;
  if (first || rounds == 0) return;  // nothing measured yet
  const uint64_t seq = balancer_->decisions() + 1;
  BalancerInput input;
  std::map<uint32_t, uint64_t> newest = decision_window_;
  for (const auto& [rank, id] : servers_) {
    const auto* ring = load_.server(rank);
    if (ring == nullptr) continue;
    ServerWindow w;
    w.seq = seq;
    w.epoch = window_epoch;
    w.rounds = rounds;
    w.round_s = elapsed_s / static_cast<double>(rounds);
    bool any = false;
    for (const auto& win : *ring) {
      auto seen = decision_window_.find(rank);
      if (seen != decision_window_.end() && win.window <= seen->second) continue;
      w.bytes += static_cast<double>(win.bytes_in + win.bytes_out);
      w.busy_s += static_cast<double>(win.busy_ns) / 1e9;
      newest[rank] = std::max(newest[rank], win.window);
      any = true;
    }
    if (any) input.servers.push_back(ServerHistory{rank, {w}});
  }
  for (const auto& [lo, ring] : load_.arcs()) {
    const Arc arc = placement_->arc(placement_->arc_index_of_hash(lo));
    if (arc.lo != lo) continue;  // an arc of an older epoch, since cut
    double bytes = 0;
    for (const auto& win : ring) {
      auto seen = decision_window_.find(win.server);
      if (win.epoch != placement_->epoch()) continue;
      if (seen != decision_window_.end() && win.window <= seen->second) continue;
      bytes += static_cast<double>(win.bytes_in + win.bytes_out);
    }
    if (bytes > 0) input.ranges.push_back({arc.lo, arc.hi, bytes / static_cast<double>(rounds)});
  }
  decision_window_ = std::move(newest);
  for (const auto& [rank, id] : servers_) {
    if (placement_->find_server(rank) == nullptr) input.standby.push_back({rank, 1.0});
  }
  auto plan = balancer_->decide(*placement_, input);
  if (!plan.ok()) {
    PSLD_LOG_WARN("balancer: {}", plan.status().to_string());
    return;
  }
  PSLD_LOG_DEBUG("balancer: {}", plan->log);
  if (plan->steps.empty()) {
    observe_decision(*plan, nullptr);
    return;
  }
  const PlanStep& step = plan->steps.front();
  PSLD_LOG_INFO("balancer: {}", step.reason);
  Status st = start_switch_locked(step.change.delta);
  if (!st.ok()) PSLD_LOG_WARN("balancer: the plan was not published: {}", st.to_string());
  observe_decision(*plan, st.ok() ? &step : nullptr);
}

}  // namespace psld
