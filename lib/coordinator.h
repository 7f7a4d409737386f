// The coordinator: control plane only, never on the data path (DESIGN.md
// §2). Admits members (challenge-response with the job secret), assigns
// ranks, hands out the server list and the epoch-0 placement, agrees tensor
// ids, runs barriers, and watches heartbeats: a member that disconnects or
// falls silent fails the job with a message naming it, on every member.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lib/balancer.h"
#include "lib/endpoint.h"
#include "lib/load_history.h"
#include "lib/placement.h"
#include "lib/runtime_options.h"

namespace psld {

class CoordinatorService final : public Endpoint {
 public:
  static Result<std::unique_ptr<CoordinatorService>> start(const RuntimeOptions& options);
  ~CoordinatorService() override;

  // Blocks until every worker said goodbye (Ok), the job failed (Aborted,
  // with the reason), or the timeout passed (Timeout).
  Status wait(std::chrono::milliseconds timeout);
  // Tells every member the job is over and stops.
  void shutdown();

  // For tests and `psld top`.
  size_t num_members() const;
  // A copy of the recent load the members reported.
  LoadHistory load_history() const;

  // Starts a placement epoch switch (DESIGN.md §7): the servers prepare it at
  // a switch round ahead of every worker, vote, and once all agree everyone
  // commits it. FailedPrecondition while another switch is in flight or when
  // delta does not start from the current epoch; InvalidArgument when it does
  // not apply or is too large for one message.
  Status propose(const PlacementDelta& delta);
  // A copy of the committed placement.
  Placement current_placement() const;
  // The last committed epoch, and whether a switch is in flight.
  uint64_t epoch() const;
  bool switching() const;
  // Epoch switches committed so far, and prepares sent (retries included).
  uint64_t switches() const;
  const Placement* placement() const { return placement_ ? &*placement_ : nullptr; }

 private:
  explicit CoordinatorService(const RuntimeOptions& options);

  struct Member {
    transport::ConnectionPtr conn;
    uint64_t nonce = 0;
    bool welcomed = false;
    protocol::Role role = protocol::Role::kWorker;
    uint32_t rank = 0;
    std::string host;
    uint32_t pid = 0;
    std::vector<uint8_t> address;
    transport::Clock::time_point last_seen;
    bool said_goodbye = false;
  };
  struct TensorRecord {
    TensorId id = 0;
    protocol::DType dtype = protocol::DType::kF32;
    uint64_t bytes = 0;
    uint32_t first_worker = 0;
  };

  void on_accept(const transport::ConnectionPtr& conn) override;
  void on_write(const transport::ConnectionPtr&, uint32_t, uint64_t) override {}
  void on_disconnect(const transport::ConnectionPtr& conn, const Status& why) override;
  void on_control(const transport::ConnectionPtr& conn, protocol::Message&& message) override;

  void handle_control(const transport::ConnectionPtr& conn, protocol::Message&& message);
  // Messages are queued under mu_ and sent by flush() after it is released:
  // sending under our lock while the transport's thread waits for it in a
  // handler would deadlock.
  void post(const transport::ConnectionPtr& conn, protocol::Message message);
  void flush();

  // All of these run with mu_ held.
  void handle_hello(Member& m, const protocol::Hello& hello);
  void handle_register(Member& m, const protocol::RegisterTensor& reg);
  void handle_load_report(const Member& m, const protocol::LoadReport& report);
  void handle_vote(const Member& m, const protocol::EpochVote& vote);
  void send_prepare();
  // One balancer decision over the load reported since the last (mu_ held).
  void balance();
  Status start_switch(const PlacementDelta& delta);
  Status start_switch_locked(const PlacementDelta& delta);
  void maybe_start_job();
  void send_job_state(const Member& m);
  void fail_job(const std::string& reason);
  void finish_job();
  std::string describe(const Member& m) const;

  void monitor();

  const RuntimeOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Member> members_;              // by connection id
  std::map<uint32_t, uint64_t> workers_, servers_;  // rank -> connection id
  std::set<uint32_t> finished_workers_;             // said goodbye, possibly gone already
  std::map<std::string, TensorRecord> tensors_;
  TensorId next_tensor_ = 1;
  std::map<uint64_t, std::set<uint32_t>> barriers_;
  std::optional<Placement> placement_;
  LoadHistory load_;
  // The epoch switch in flight (DESIGN.md §7).
  struct Switch {
    PlacementDelta delta;
    std::vector<uint8_t> delta_bytes;
    Placement next;
    uint64_t switch_round = 0;
    uint64_t margin = 0;  // rounds ahead of the furthest round seen; doubles on a no
    std::set<uint32_t> yes;
  };
  std::optional<Switch> switch_;
  uint64_t max_round_ = 0;  // the highest round any member reported
  // The balancer, when enabled, and what its last decision had seen.
  std::optional<Balancer> balancer_;
  transport::Clock::time_point last_decision_{};
  uint64_t decision_round_ = 0;                   // max_round_ then
  uint64_t decision_epoch_ = 0;                   // the committed epoch then
  std::map<uint32_t, uint64_t> decision_window_;  // server -> last window seen
  uint64_t last_switch_round_ = 0;
  uint64_t switches_ = 0;
  uint64_t bad_reports_ = 0;
  bool job_started_ = false;
  bool job_over_ = false;
  Status job_status_;
  bool stopping_ = false;
  std::vector<std::pair<transport::ConnectionPtr, protocol::Message>> outbox_;
  std::mutex flush_mu_;  // held while flushing: sends leave in posting order
  std::thread monitor_;
};

}  // namespace psld
