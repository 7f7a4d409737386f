// lib/coordinator/balance_feed.h — what the balancer sees at each decision:
// the coordinator's load history, cut into one window per server since the
// previous decision.
//
// Pure (no clock, no lock, no I/O): the coordinator calls it under its lock
// with its steady clock, and `psld sim` (tools/sim) with simulated time, so
// that the simulator drives the same decisions the coordinator would.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "lib/balancer/balancer.h"
#include "lib/placement/placement.h"
#include "lib/stats/load_history.h"

namespace psld {

// How many rounds past the furthest round seen the coordinator prepares an
// epoch switch for (doubled after a server votes no): the round a decision
// takes effect at, in the coordinator and in psld sim alike.
inline constexpr uint32_t kSwitchMarginRounds = 2;

// The job when a decision is due.
struct DecisionPoint {
  double now_s = 0;        // seconds on any clock that only moves forward
  uint64_t max_round = 0;  // the highest round any member reported
  // The placement's epoch serves every round: its switch round has passed
  // and its state transfer is final (always true at epoch 0).
  bool serving = true;
};

class BalanceFeed {
 public:
  // The input of decision `seq` (the balancer's decisions() + 1): per server
  // of `server_ranks` that reported, one window of everything it reported
  // since the previous call, over the rounds the job made meanwhile; the
  // load of every arc of the current epoch in those windows; and as standby
  // every rank outside the placement. nullopt on the first call (nothing to
  // compare against yet) and when no round passed; the call still starts
  // the next window. Takes the arcs' load from `load` (LoadHistory::take_arcs)
  // when it returns an input.
  std::optional<BalancerInput> next(LoadHistory& load, const Placement& placement,
                                    std::span<const uint32_t> server_ranks, uint64_t seq,
                                    const DecisionPoint& at);

  // The model's chunks, given to every input from now on
  // (BalancerInput::chunks); any order, each key once. Call again when
  // tensors are added.
  void set_chunks(std::vector<ChunkPoint> chunks);

  // The start of the current window (the previous call), or nullopt before
  // the first call.
  std::optional<double> last_s() const {
    return started_ ? std::optional<double>(last_s_) : std::nullopt;
  }

 private:
  bool started_ = false;
  double last_s_ = 0;
  uint64_t round_ = 0;                 // max_round at the previous call
  uint64_t epoch_ = 0;                 // the epoch the current window counts for
  std::map<uint32_t, uint64_t> seen_;  // server -> its newest window taken
  std::vector<ChunkPoint> chunks_;     // sorted by hash
};

}  // namespace psld
