// The coordinator: control plane only, never on the data path (docs/design.md
// §2). Admits members (challenge-response with the job secret), assigns
// ranks, hands out the server list and the epoch-0 placement, agrees tensor
// ids, runs barriers, and watches heartbeats: a member that disconnects or
// falls silent fails the job with a message naming it, on every member,
// except a server that held nothing but keys of a transfer that is not final:
// that transfer is aborted and the job goes on without it
// (docs/migration.md, "Abort").
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

#include "lib/balancer/balancer.h"
#include "lib/config/runtime_options.h"
#include "lib/placement/placement.h"
#include "lib/runtime/runtime.h"
#include "lib/stats/load_history.h"

namespace psld {

class CoordinatorService final : public ProcessRuntime {
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

  // Starts a placement epoch switch (docs/design.md §7): the servers prepare it at
  // a switch round ahead of every worker, vote, and once all agree everyone
  // commits it; its transfer is final once every old owner shipped what it
  // loses. FailedPrecondition while another switch or its transfer is in
  // flight or when delta does not start from the current epoch;
  // InvalidArgument when it does not apply or is too large for one message.
  Status propose(const PlacementDelta& delta);
  // A copy of the committed placement.
  Placement current_placement() const;
  // The last committed epoch, and whether a switch (or the transfer of the
  // last one) is in flight: propose() waits for that to end.
  uint64_t epoch() const;
  bool switching() const;
  bool transferring() const;
  // Epoch switches committed so far (aborts not counted).
  uint64_t switches() const;
  // The round the last committed switch takes effect at (0: none yet).
  uint64_t last_switch_round() const;
  // Transfers aborted because a server gaining keys died.
  uint64_t aborts() const;
  const Placement* placement() const { return placement_ ? &*placement_ : nullptr; }

 private:
  explicit CoordinatorService(const RuntimeOptions& options);

  struct Member {
    transport::ConnectionPtr conn;
    uint64_t nonce = 0;
    bool welcomed = false;
    Role role = Role::kWorker;
    uint32_t rank = 0;
    std::string host;
    uint32_t pid = 0;
    std::vector<uint8_t> address;
    transport::Clock::time_point last_seen;
    bool said_goodbye = false;
  };
  struct TensorRecord {
    TensorId id = 0;
    DType dtype = DType::kFloat32;
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
  // Posts `message` to each member of `ranks` (workers_ or servers_).
  void post_all(const std::map<uint32_t, uint64_t>& ranks, const protocol::Message& message);
  // The member of connection `id`, or nullptr. workers_ and servers_ name
  // admitted members only, so a miss there is a broken invariant: logged,
  // never an exception.
  const Member* find_member(uint64_t id) const;
  void flush();

  // All of these run with mu_ held.
  void handle_hello(Member& m, const protocol::Hello& hello);
  void handle_register(Member& m, const protocol::RegisterTensor& reg);
  void handle_load_report(const Member& m, const protocol::LoadReport& report);
  void handle_vote(const Member& m, const protocol::EpochVote& vote);
  void handle_transfer_done(const Member& m, const protocol::TransferDone& done);
  // Sends the servers a LowWatermark when it moved (docs/migration.md,
  // "Freeing old runs").
  void publish_watermark();
  void send_prepare();
  // Commits the switch once every live server voted yes.
  void maybe_commit();
  void commit_switch();
  // Tracks the committed switch's transfer (from `before`) when it can be
  // aborted; final at once when nothing moves.
  void begin_transfer(Placement before);
  void finish_transfer_if_done();
  // A server is gone (`what` says how). Fails the job when it held state;
  // else removes it and aborts its part of the transfer.
  void server_lost(const Member& m, const std::string& what);
  // Publishes the epoch that takes the lost server out (EpochStep::kAbort).
  void publish_abort(uint32_t rank);
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
  // The epoch switch in flight (docs/design.md §7).
  struct Switch {
    PlacementDelta delta;
    std::vector<uint8_t> delta_bytes;
    Placement next;
    uint64_t switch_round = 0;
    uint64_t margin = 0;  // rounds ahead of the furthest round seen; doubles on a no
    std::set<uint32_t> yes;
  };
  std::optional<Switch> switch_;
  // The transfer of the last committed switch when a server that never
  // owned anything gains keys in it, until every old owner said TransferDone
  // and EpochFinal went out. No switch starts meanwhile, so an abort always
  // concerns the newest epoch. Other switches are not tracked.
  struct Transfer {
    uint64_t switch_round = 0;
    Placement before;            // the committed placement it started from
    std::set<uint32_t> waiting;  // old owners that have not reported yet
    std::set<uint32_t> reported;
  };
  std::optional<Transfer> transfer_;
  std::set<uint32_t> lost_servers_;    // removed after they died; their ranks stay taken
  std::set<uint32_t> pending_losses_;  // lost while a switch was being voted on
  // Servers that owned arcs in a placement that is final (every committed
  // one but that of an open transfer): they may hold parameters nobody else
  // has, so their death fails the job.
  std::set<uint32_t> ever_owned_;
  uint64_t aborts_ = 0;
  uint64_t max_round_ = 0;  // the highest round any member reported
  // Each worker's last WorkerProgress, and the last LowWatermark sent.
  std::map<uint32_t, protocol::WorkerProgress> progress_;
  std::optional<protocol::LowWatermark> watermark_;
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
