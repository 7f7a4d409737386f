// EpochLog: which placement epoch serves which rounds (DESIGN.md §7).
//
// An epoch switch takes effect at a round: rounds >= switch_round of every key
// are served under the new epoch, earlier rounds under the epochs before. A
// worker routes a chunk of round r to owner(key, r); a server refuses a round
// it does not own in the same way, so both sides agree without a barrier.
// The log keeps the last kMaxEpochs epochs: a round older than the oldest
// switch kept is routed by the oldest epoch kept.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>

#include "lib/placement.h"

namespace psld {

class EpochLog {
 public:
  static constexpr size_t kMaxEpochs = 64;

  struct Entry {
    std::shared_ptr<const Placement> placement;
    uint64_t switch_round = 0;  // 0 for the first epoch
  };

  explicit EpochLog(std::shared_ptr<const Placement> first) { entries_.push_back({first, 0}); }

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

  // Appends the next epoch. The caller checks that placement is the next
  // epoch and switch_round is not below the latest one.
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

}  // namespace psld
