#include "lib/coordinator/balance_feed.h"

#include <algorithm>

namespace psld {

std::optional<BalancerInput> BalanceFeed::next(const LoadHistory& load, const Placement& placement,
                                               std::span<const uint32_t> server_ranks, uint64_t seq,
                                               const DecisionPoint& at) {
  const bool first = !started_;
  const uint64_t rounds = at.max_round - std::min(at.max_round, round_);
  const double elapsed_s = at.now_s - last_s_;
  // A window belongs to the epoch that was in force when it began: one that
  // straddles a switch (and the migration) is not evidence about the new one.
  const uint64_t window_epoch = epoch_;
  started_ = true;
  last_s_ = at.now_s;
  round_ = at.max_round;
  // The window beginning now counts for the newest epoch only once that
  // epoch serves every round. Until then it holds rounds of the previous
  // epoch and the migration itself (a scale-out of 3 MiB per round was
  // rolled back in psld bench stragglers S5 on such a window).
  epoch_ = at.serving || placement.epoch() == 0 ? placement.epoch() : placement.epoch() - 1;
  if (first || rounds == 0) return std::nullopt;

  BalancerInput input;
  std::map<uint32_t, uint64_t> newest = seen_;
  for (uint32_t rank : server_ranks) {
    const auto* ring = load.server(rank);
    if (ring == nullptr) continue;
    ServerWindow w;
    w.seq = seq;
    w.epoch = window_epoch;
    w.rounds = rounds;
    w.round_s = elapsed_s / static_cast<double>(rounds);
    bool any = false;
    const auto seen = seen_.find(rank);
    for (const auto& win : *ring) {
      if (seen != seen_.end() && win.window <= seen->second) continue;
      w.bytes += static_cast<double>(win.bytes_in + win.bytes_out);
      w.busy_s += static_cast<double>(win.busy_ns) / 1e9;
      newest[rank] = std::max(newest[rank], win.window);
      any = true;
    }
    if (any) input.servers.push_back(ServerHistory{rank, {w}});
  }
  for (const auto& [lo, ring] : load.arcs()) {
    const Arc arc = placement.arc(placement.arc_index_of_hash(lo));
    if (arc.lo != lo) continue;  // an arc of an older epoch, since cut
    double bytes = 0;
    for (const auto& win : ring) {
      if (win.epoch != placement.epoch()) continue;
      const auto seen = seen_.find(win.server);
      if (seen != seen_.end() && win.window <= seen->second) continue;
      bytes += static_cast<double>(win.bytes_in + win.bytes_out);
    }
    if (bytes > 0) input.ranges.push_back({arc.lo, arc.hi, bytes / static_cast<double>(rounds)});
  }
  seen_ = std::move(newest);
  for (uint32_t rank : server_ranks) {
    if (placement.find_server(rank) == nullptr) input.standby.push_back({rank, 1.0});
  }
  return input;
}

}  // namespace psld
