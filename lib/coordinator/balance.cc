// Balancing, the coordinator's side: the load history the members reported,
// turned into the balancer's input each interval, and its plan proposed as
// an epoch switch (lib/balancer/balancer.h is the pure decision).
#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "base/log.h"
#include "lib/coordinator/service.h"
#include "lib/placement/epoch_log.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

// mu_ held. The balancer sees one window per server per decision: what the
// server reported since the previous decision, over the rounds the job made
// in that time (lib/coordinator/balance_feed.h, shared with psld sim).
void CoordinatorService::balance() {
  const auto now = Clock::now();
  last_decision_ = now;
  // The newest epoch serves every round once its switch round passed and
  // its state transfer is final.
  const bool serving = !transfer_ && max_round_ > last_switch_round_;
  std::vector<uint32_t> ranks;
  ranks.reserve(servers_.size());
  for (const auto& [rank, id] : servers_)
    ranks.push_back(rank);
  if (feed_tensors_ != tensors_.size()) {
    // Where the model's chunks fall, so that steps cut arcs between them.
    std::vector<ChunkPoint> chunks;
    for_each_chunk([&](Key k, uint64_t bytes) {
      chunks.push_back(ChunkPoint{hash_key(k), static_cast<double>(bytes)});
    });
    feed_.set_chunks(std::move(chunks));
    feed_tensors_ = tensors_.size();
  }
  const double now_s = std::chrono::duration<double>(now.time_since_epoch()).count();
  auto input = feed_.next(load_, *placement_, ranks, balancer_->decisions() + 1,
                          DecisionPoint{now_s, max_round_, serving});
  if (!input) return;  // nothing measured yet
  auto plan = balancer_->decide(*placement_, *input);
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
