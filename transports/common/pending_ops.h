// PendingOps: the operations a backend has started and not yet completed,
// with their deadlines, so that every one of them completes exactly once:
// on success, on timeout, when its connection dies, or at shutdown.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

class PendingOps {
 public:
  // A completion taken out of the table, to be called without holding locks.
  struct Ready {
    Completion done;
    Status status;
    void run() {
      if (done) done(std::move(status));
    }
  };

  uint64_t add(uint64_t connection, Clock::time_point deadline, Completion done) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    ops_.emplace(id, Op{connection, deadline, std::move(done)});
    by_deadline_.emplace(deadline, id);
    return id;
  }

  // Removes op `id` and returns its completion with `status`; an op that
  // already completed (timed out, failed with its connection) yields an empty
  // Ready, so late completions from the fabric are ignored.
  Ready take(uint64_t id, Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(id);
    if (it == ops_.end()) return Ready{};
    Ready r{std::move(it->second.done), std::move(status)};
    by_deadline_.erase({it->second.deadline, id});
    ops_.erase(it);
    return r;
  }

  bool contains(uint64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_.count(id) != 0;
  }

  // Ops whose deadline passed, failed with Timeout.
  std::vector<Ready> expire(Clock::time_point now) {
    std::vector<Ready> out;
    std::lock_guard<std::mutex> lock(mu_);
    while (!by_deadline_.empty() && by_deadline_.begin()->first <= now) {
      const uint64_t id = by_deadline_.begin()->second;
      by_deadline_.erase(by_deadline_.begin());
      auto it = ops_.find(id);
      out.push_back(Ready{std::move(it->second.done),
                          Timeout("operation did not complete within its timeout")});
      ops_.erase(it);
    }
    return out;
  }

  // Every op of `connection` (or of all connections), failed with `status`.
  std::vector<Ready> fail_connection(uint64_t connection, const Status& status) {
    return fail_if([&](const Op& op) { return op.connection == connection; }, status);
  }
  std::vector<Ready> fail_all(const Status& status) {
    return fail_if([](const Op&) { return true; }, status);
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_.size();
  }
  // The earliest deadline, or Clock::time_point::max() with nothing pending.
  Clock::time_point next_deadline() const {
    std::lock_guard<std::mutex> lock(mu_);
    return by_deadline_.empty() ? Clock::time_point::max() : by_deadline_.begin()->first;
  }

 private:
  struct Op {
    uint64_t connection;
    Clock::time_point deadline;
    Completion done;
  };

  template <typename Pred>
  std::vector<Ready> fail_if(Pred pred, const Status& status) {
    std::vector<Ready> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = ops_.begin(); it != ops_.end();) {
      if (pred(it->second)) {
        by_deadline_.erase({it->second.deadline, it->first});
        out.push_back(Ready{std::move(it->second.done), status});
        it = ops_.erase(it);
      } else {
        ++it;
      }
    }
    return out;
  }

  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Op> ops_;
  std::set<std::pair<Clock::time_point, uint64_t>> by_deadline_;
};

}  // namespace psld::transport
