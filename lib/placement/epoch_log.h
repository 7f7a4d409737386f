// EpochLog: which placement epoch serves which rounds (docs/design.md §7).
//
// An epoch switch takes effect at a round: rounds >= switch_round of every key
// are served under the new epoch, earlier rounds under the epochs before. A
// worker routes a chunk of round r to owner(key, r); a server refuses a round
// it does not own in the same way, so both sides agree without a barrier.
// The log keeps the last kMaxEpochs epochs: a round older than the oldest
// switch kept is routed by the oldest epoch kept.
//
// Two neighbouring epochs may share a switch round: an abort epoch takes the
// newest one's place for every round it would have served (docs/migration.md,
// "Abort"), so the earlier of the two serves no round at all. The log stays
// append-only and epoch numbers monotonic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "lib/placement/placement.h"

namespace psld {

class EpochLog {
 public:
  static constexpr size_t kMaxEpochs = 64;

  struct Entry {
    std::shared_ptr<const Placement> placement;
    uint64_t switch_round = 0;  // 0 for the first epoch
  };

  explicit EpochLog(std::shared_ptr<const Placement> first) {
    entries_.push_back({std::move(first), 0});
  }

  const Placement& latest() const { return *entries_.back().placement; }
  std::shared_ptr<const Placement> latest_ptr() const { return entries_.back().placement; }
  uint64_t latest_switch_round() const { return entries_.back().switch_round; }

  // The epoch that serves `round`.
  const Placement& at(uint64_t round) const {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->switch_round <= round) return *it->placement;
    }
    return *entries_.front().placement;
  }
  ServerId owner(Key key, uint64_t round) const { return at(round).owner_of_key(key); }

  // The epoch `epoch` that a serialized delta makes of the latest one; an
  // error saying why when the bytes are not a delta, the delta does not
  // start from the latest epoch or end at `epoch`, or it does not apply.
  Result<std::shared_ptr<const Placement>> follow(uint64_t epoch,
                                                  std::span<const uint8_t> delta_bytes) const {
    PSLD_ASSIGN_OR_RETURN(PlacementDelta delta, PlacementDelta::deserialize(delta_bytes));
    const uint64_t latest_epoch = latest().epoch();
    if (delta.from_epoch != latest_epoch || delta.to_epoch != epoch) {
      return FailedPrecondition("epoch " + std::to_string(epoch) + " (a delta from " +
                                std::to_string(delta.from_epoch) + " to " +
                                std::to_string(delta.to_epoch) + ") does not follow epoch " +
                                std::to_string(latest_epoch));
    }
    PSLD_ASSIGN_OR_RETURN(Placement next, latest().apply(delta));
    return std::make_shared<const Placement>(std::move(next));
  }

  // Appends the next epoch. The caller checks that placement is the next
  // epoch and switch_round is not below the latest one (equal: an abort).
  void push(std::shared_ptr<const Placement> placement, uint64_t switch_round) {
    entries_.push_back({std::move(placement), switch_round});
    while (entries_.size() > kMaxEpochs)
      entries_.pop_front();
  }

  size_t size() const { return entries_.size(); }
  const Entry& entry(size_t i) const { return entries_[i]; }

 private:
  std::deque<Entry> entries_;
};

// Calls fn(lo, hi, owner in a, owner in b) for every piece [lo, hi] of the
// hash space that lies inside one arc of each placement, in hash order: what
// going from `a` to `b` moves, range by range. O(arcs of a + arcs of b).
template <typename Fn>
void for_each_overlap(const Placement& a, const Placement& b, Fn&& fn) {
  size_t i = 0, j = 0;
  while (i < a.num_arcs() && j < b.num_arcs()) {
    const Arc x = a.arc(i), y = b.arc(j);
    const uint64_t hi = std::min(x.hi, y.hi);
    fn(std::max(x.lo, y.lo), hi, x.owner, y.owner);
    // Both rings end at UINT64_MAX, so both indexes run out together.
    if (x.hi == hi) ++i;
    if (y.hi == hi) ++j;
  }
}

}  // namespace psld
