#include "lib/coordinator/balance_feed.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace psld {

std::optional<BalancerInput> BalanceFeed::next(LoadHistory& load, const Placement& placement,
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
  input.chunks = chunks_;
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
  // Every arc's load since the previous decision, in the current epoch. The
  // history gives them in the order of lo, the placement's order: one pass.
  input.ranges.reserve(placement.num_arcs());
  size_t i = 0;
  load.take_arcs(placement.epoch(), [&](const ArcLoadRecord& a) {
    while (i < placement.num_arcs() && placement.arc(i).hi < a.lo)
      ++i;
    if (i == placement.num_arcs()) return;
    const Arc arc = placement.arc(i);
    if (arc.lo != a.lo) return;  // not an arc of this epoch (a bad report)
    const double bytes = static_cast<double>(a.bytes_in + a.bytes_out);
    if (bytes > 0) input.ranges.push_back({arc.lo, arc.hi, bytes / static_cast<double>(rounds)});
  });
  seen_ = std::move(newest);
  for (uint32_t rank : server_ranks) {
    if (placement.find_server(rank) == nullptr) input.standby.push_back({rank, 1.0});
  }
  return input;
}

void BalanceFeed::set_chunks(std::vector<ChunkPoint> chunks) {
  std::sort(chunks.begin(), chunks.end(),
            [](const ChunkPoint& a, const ChunkPoint& b) { return a.hash < b.hash; });
  chunks_ = std::move(chunks);
}

}  // namespace psld
