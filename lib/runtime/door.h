// lib/runtime/door.h — what a listening process does with connections that
// have not proven they belong to the job (docs/reliability.md, "The door").
//
// The coordinator and every server keep one: at most kMaxWaiting connections
// may be waiting to finish their handshake at once, each for at most one
// heartbeat timeout; anything past that, or a wrong proof, is refused.
// Refusals are counted, logged once per peer host (a flood must not flood
// the log too) and closed by the owner's periodic thread, outside its locks.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "transports/transport.h"

namespace psld {

class Door {
 public:
  // At most this many connections may wait for admission at once; more are
  // refused at once. A job's members are admitted within milliseconds.
  static constexpr size_t kMaxWaiting = 64;

  // `who` names the owner in the log ("coordinator", "server 2").
  void refuse(std::string_view who, const transport::ConnectionPtr& conn, const std::string& why)
      EXCLUDES(mu_);
  // The refused connections to close now, for the caller to close: those
  // refused at least kCloseGrace ago, so that what they were told (why)
  // reaches them before the close does.
  std::vector<transport::ConnectionPtr> take_to_close() EXCLUDES(mu_);
  static constexpr std::chrono::milliseconds kCloseGrace{200};
  uint64_t num_refused() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  uint64_t refused_ GUARDED_BY(mu_) = 0;
  std::vector<std::pair<transport::ConnectionPtr, transport::Clock::time_point>> to_close_
      GUARDED_BY(mu_);
  std::set<std::string> hosts_ GUARDED_BY(mu_);  // already told about in the log
};

}  // namespace psld
