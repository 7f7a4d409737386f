// The coordinator: control plane only, never on the data path (docs/design.md
// §2). Admits members (challenge-response with the job secret), assigns
// ranks, hands out the server list and the epoch-0 placement, agrees tensor
// ids, runs barriers, and watches heartbeats: a member that disconnects or
// falls silent fails the job with a message naming it, on every member,
// except a server that held nothing but keys of a transfer that is not final:
// that transfer is aborted and the job goes on without it
// (docs/migration.md, "Abort"), and, with replication.factor 2, a server
// whose backup holds its ranges: they fail over to it (docs/replication.md).
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "lib/balancer/balancer.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/config/runtime_options.h"
#include "lib/coordinator/balance_feed.h"
#include "lib/coordinator/job_view.h"
#include "lib/coordinator/metrics_endpoint.h"
#include "lib/placement/placement.h"
#include "lib/runtime/door.h"
#include "lib/runtime/runtime.h"
#include "lib/stats/load_history.h"
#include "lib/stats/trace.h"

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
  // Connections not (yet) admitted, and those refused so far: over the cap
  // on unadmitted connections, or closed at the hello deadline.
  size_t num_unadmitted() const EXCLUDES(mu_);
  uint64_t num_refused() const;

  static constexpr size_t kMaxUnadmitted = Door::kMaxWaiting;
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
  // last one; replicated, the copies of what it moved) is in flight:
  // propose() waits for that to end.
  uint64_t epoch() const;
  bool switching() const;
  bool transferring() const;
  // Epoch switches committed so far (aborts not counted).
  uint64_t switches() const;
  // The round the last committed switch takes effect at (0: none yet).
  uint64_t last_switch_round() const;
  // Transfers aborted because a server gaining keys died.
  uint64_t aborts() const;
  // Failovers: replicated servers lost whose ranges went to their backups.
  uint64_t failovers() const EXCLUDES(mu_);
  // Checkpoints (docs/checkpoint.md): complete ones written by this job,
  // the round of the newest, and those skipped (a server could not write
  // its file, or the files missed keys).
  uint64_t checkpoints() const EXCLUDES(mu_);
  uint64_t last_checkpoint_round() const EXCLUDES(mu_);
  uint64_t checkpoints_skipped() const EXCLUDES(mu_);
  // What an operator sees (lib/coordinator/observe.cc): the members, the
  // servers' traffic and share, the balancer's beliefs and decisions, the
  // workers' pace; served on metrics.listen.
  JobView view() const EXCLUDES(mu_);
  // "host:port" of the metrics endpoint; "" when metrics.listen is empty.
  std::string metrics_address() const { return metrics_ ? metrics_->address() : ""; }

  // A copy of the committed placement, nullopt before there is one. (A
  // pointer into placement_ would race with the commit that replaces it.)
  std::optional<Placement> placement() const EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return placement_;
  }

 private:
  explicit CoordinatorService(const RuntimeOptions& options);

  struct Member {
    transport::ConnectionPtr conn;
    protocol::Nonce nonce{};
    bool welcomed = false;
    Role role = Role::kWorker;
    uint32_t rank = 0;
    std::string host;
    uint32_t pid = 0;
    std::vector<uint8_t> address;
    transport::Clock::time_point last_seen;
    // When it connected: an unadmitted peer has until then + the hello
    // deadline to be admitted, whatever else it sends.
    transport::Clock::time_point accepted;
    bool said_goodbye = false;
  };
  struct TensorRecord {
    TensorId id = 0;
    DType dtype = DType::kFloat32;
    uint64_t bytes = 0;
    uint64_t chunk_bytes = 0;
    uint32_t first_worker = 0;  // kFromCheckpoint: the resumed checkpoint has it
  };
  static constexpr uint32_t kFromCheckpoint = UINT32_MAX;

  void on_accept(const transport::ConnectionPtr& conn) override;
  void on_write(const transport::ConnectionPtr&, uint32_t, uint64_t) override {}
  void on_disconnect(const transport::ConnectionPtr& conn, const Status& why) override;
  void on_control(const transport::ConnectionPtr& conn, protocol::Message&& message) override;

  void handle_control(const transport::ConnectionPtr& conn, protocol::Message&& message);
  // Messages are queued under mu_ and sent by flush() after it is released:
  // sending under our lock while the transport's thread waits for it in a
  // handler would deadlock.
  void post(const transport::ConnectionPtr& conn, protocol::Message message) REQUIRES(mu_);
  // Posts `message` to each member of `ranks` (workers_ or servers_).
  void post_all(const std::map<uint32_t, uint64_t>& ranks, const protocol::Message& message)
      REQUIRES(mu_);
  // The member of connection `id`, or nullptr. workers_ and servers_ name
  // admitted members only, so a miss there is a broken invariant: logged,
  // never an exception.
  const Member* find_member(uint64_t id) const REQUIRES(mu_);
  void flush() EXCLUDES(mu_);
  // Counts, logs (once per peer host) and queues for closing a connection
  // that is not admitted.
  // members_ not welcomed (at most kMaxUnadmitted of them).
  size_t unadmitted_locked() const REQUIRES(mu_);

  // All of these run with mu_ held.
  void handle_hello(Member& m, const protocol::Hello& hello) REQUIRES(mu_);
  void handle_register(Member& m, const protocol::RegisterTensor& reg) REQUIRES(mu_);
  void handle_load_report(const Member& m, const protocol::LoadReport& report) REQUIRES(mu_);
  void handle_vote(const Member& m, const protocol::EpochVote& vote) REQUIRES(mu_);
  void handle_transfer_done(const Member& m, const protocol::TransferDone& done) REQUIRES(mu_);
  // Per tensor (id - 1), the lowest round a live worker may still send a
  // request for (WorkerProgress); nullopt while one has promised nothing.
  std::optional<std::vector<uint64_t>> lowest_rounds() const REQUIRES(mu_);
  // Sends the servers a LowWatermark when it moved (docs/migration.md,
  // "Freeing old runs").
  void publish_watermark() REQUIRES(mu_);
  // Before the job starts: tells every admitted member whom the job waits
  // for (protocol::JoinWaiting) when that changed, at most every half
  // heartbeat interval, and logs it at most every kJoinLogInterval (a job
  // that starts within that says nothing).
  void publish_join_waiting(transport::Clock::time_point now) REQUIRES(mu_);
  void send_prepare() REQUIRES(mu_);
  // Commits the switch once every live server voted yes.
  void maybe_commit() REQUIRES(mu_);
  void commit_switch() REQUIRES(mu_);
  // Tracks the committed switch's transfer (from `before`) when it can be
  // aborted; final at once when nothing moves.
  void begin_transfer(Placement before) REQUIRES(mu_);
  void finish_transfer_if_done() REQUIRES(mu_);
  // A server is gone (`what` says how). Fails the job when it held state;
  // else removes it and aborts its part of the transfer.
  void server_lost(const Member& m, const std::string& what) REQUIRES(mu_);
  // Publishes the epoch that takes the lost server out (EpochStep::kAbort).
  void publish_abort(uint32_t rank) REQUIRES(mu_);
  // Replication: publishes the epoch that gives the lost server's ranges to
  // its backup (EpochStep::kFailover), or fails the job when the backup
  // cannot hold them all (lib/coordinator/failover.cc).
  void fail_over(const Member& m, const std::string& what) REQUIRES(mu_);
  void handle_synced(const Member& m, const protocol::ReplicaSynced& synced) REQUIRES(mu_);
  // Replication: why no switch may start now (a switch's moved ranges or a
  // failover's copies not made yet), or Ok.
  Status replication_allows_switch() const REQUIRES(mu_);
  // Replication: ends the newest switch's open window once every worker
  // has finished its switch round.
  void close_replicated_switch() REQUIRES(mu_);
  // One balancer decision over the load reported since the last (mu_ held).
  void balance() REQUIRES(mu_);
  Status start_switch(const PlacementDelta& delta) EXCLUDES(mu_);
  Status start_switch_locked(const PlacementDelta& delta) REQUIRES(mu_);
  void maybe_start_job() REQUIRES(mu_);
  void send_job_state(const Member& m) REQUIRES(mu_);
  void fail_job(const std::string& reason) REQUIRES(mu_);
  void finish_job() REQUIRES(mu_);
  std::string describe(const Member& m) const REQUIRES(mu_);

  void monitor();

  // Observation (lib/coordinator/observe.cc), all with mu_ held: a load
  // report's totals and pace, a balancer decision and the step it
  // published, and the bytes of the registered model each server owns in
  // `placement` (cached for the committed one).
  void observe_report(const protocol::LoadReport& report) REQUIRES(mu_);
  void observe_decision(const Plan& plan, const PlanStep* published) REQUIRES(mu_);
  void for_each_chunk(const std::function<void(Key, uint64_t)>& fn) const REQUIRES(mu_);
  uint64_t moved_bytes(const Placement& before, const Placement& after) const REQUIRES(mu_);
  // A page of the metrics endpoint: /metrics, /status.json or /.
  MetricsEndpoint::Page metrics_page(const std::string& path) const EXCLUDES(mu_);
  const std::map<uint32_t, uint64_t>& owned_bytes() const REQUIRES(mu_);

  // Checkpoints (lib/coordinator/checkpoint.cc). Resuming: the newest
  // complete checkpoint gives the tensors their ids, sizes and rounds.
  Status load_resume() EXCLUDES(mu_);
  // Seals the newest checkpoint round that every worker went past (none in
  // flight); a server's answer; a server lost meanwhile.
  void maybe_seal() REQUIRES(mu_);
  void handle_sealed(const Member& m, const protocol::CheckpointSealed& sealed) REQUIRES(mu_);
  void seal_lost_server(uint32_t rank) REQUIRES(mu_);
  void finish_seal_if_done() REQUIRES(mu_);
  // The manifest of a sealed checkpoint (to_write_), written without mu_
  // (it fsyncs), then checkpoints beyond checkpoint.keep removed; by the
  // monitor, and by shutdown() for one sealed as the job ended.
  void write_sealed_checkpoint() EXCLUDES(mu_);
  void skip_checkpoint(uint64_t round, const std::string& why) REQUIRES(mu_);
  uint64_t expected_keys() const REQUIRES(mu_);

  const RuntimeOptions options_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Member> members_ GUARDED_BY(mu_);  // by connection id
  // Refused connections (over the cap, a wrong proof, past the hello
  // deadline), closed by the monitor outside mu_.
  Door door_;
  std::map<uint32_t, uint64_t> workers_ GUARDED_BY(mu_), servers_
      GUARDED_BY(mu_);                                   // rank -> connection id
  std::set<uint32_t> finished_workers_ GUARDED_BY(mu_);  // said goodbye, possibly gone already
  std::map<std::string, TensorRecord> tensors_ GUARDED_BY(mu_);
  TensorId next_tensor_ GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::set<uint32_t>> barriers_ GUARDED_BY(mu_);
  std::optional<Placement> placement_ GUARDED_BY(mu_);
  LoadHistory load_ GUARDED_BY(mu_);
  // The epoch switch in flight (docs/design.md §7).
  struct Switch {
    PlacementDelta delta;
    std::vector<uint8_t> delta_bytes;
    Placement next;
    uint64_t switch_round = 0;
    uint64_t margin = 0;  // rounds ahead of the furthest round seen; doubles on a no
    std::set<uint32_t> yes;
  };
  std::optional<Switch> switch_ GUARDED_BY(mu_);
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
  std::optional<Transfer> transfer_ GUARDED_BY(mu_);
  std::set<uint32_t> lost_servers_
      GUARDED_BY(mu_);  // removed after they died; their ranks stay taken
  std::set<uint32_t> pending_losses_ GUARDED_BY(mu_);  // lost while a switch was being voted on
  // Servers that owned arcs in a placement that is final (every committed
  // one but that of an open transfer): they may hold parameters nobody else
  // has, so their death fails the job.
  std::set<uint32_t> ever_owned_ GUARDED_BY(mu_);
  uint64_t aborts_ GUARDED_BY(mu_) = 0;
  // Replication: servers some of whose keys have no copy at their backup
  // yet, since a failover or a switch changed it, each with what changed it
  // ("server 2 was lost"); failovers so far.
  std::map<uint32_t, std::string> unsynced_ GUARDED_BY(mu_);
  uint64_t failovers_ GUARDED_BY(mu_) = 0;
  // Replication: the switch round of the newest switch until every worker
  // has finished it (0: none open). Until then a moved key's newest state
  // may exist at its new owner only, so a server lost then fails the job.
  uint64_t replicated_switch_round_ GUARDED_BY(mu_) = 0;
  uint64_t max_round_ GUARDED_BY(mu_) = 0;  // the highest round any member reported
  // Each worker's last WorkerProgress, and the last LowWatermark sent.
  std::map<uint32_t, protocol::WorkerProgress> progress_ GUARDED_BY(mu_);
  std::optional<protocol::LowWatermark> watermark_ GUARDED_BY(mu_);
  // The last JoinWaiting sent and logged, and when.
  static constexpr std::chrono::seconds kJoinLogInterval{5};
  std::optional<protocol::JoinWaiting> join_sent_ GUARDED_BY(mu_);
  std::optional<protocol::JoinWaiting> join_logged_ GUARDED_BY(mu_);
  transport::Clock::time_point join_sent_at_ GUARDED_BY(mu_){};
  transport::Clock::time_point join_logged_at_ GUARDED_BY(mu_) = transport::Clock::now();
  // The balancer, when enabled, and what its last decision had seen.
  std::optional<Balancer> balancer_ GUARDED_BY(mu_);
  transport::Clock::time_point last_decision_ GUARDED_BY(mu_){};
  BalanceFeed feed_ GUARDED_BY(mu_);
  size_t feed_tensors_ GUARDED_BY(mu_) = 0;  // tensors_.size() when the feed got the chunks
  uint64_t last_switch_round_ GUARDED_BY(mu_) = 0;
  uint64_t switches_ GUARDED_BY(mu_) = 0;
  uint64_t bad_reports_ GUARDED_BY(mu_) = 0;
  bool job_started_ GUARDED_BY(mu_) = false;
  bool job_over_ GUARDED_BY(mu_) = false;
  Status job_status_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::pair<transport::ConnectionPtr, protocol::Message>> outbox_ GUARDED_BY(mu_);
  // Checkpoints: the round resumed from, the seal in flight, and the
  // manifest of a sealed one waiting for the monitor to write it.
  uint64_t resume_round_ GUARDED_BY(mu_) = 0;
  struct Sealing {
    uint64_t round = 0;
    uint64_t epoch = 0;
    std::set<uint32_t> waiting;  // servers that have not answered
    std::vector<checkpoint::FileEntry> files;
    uint64_t records = 0;
    std::string error;  // the first server's reason it could not write its file
  };
  std::optional<Sealing> sealing_ GUARDED_BY(mu_);
  uint64_t sealed_through_ GUARDED_BY(mu_) = 0;  // the newest round sealed or skipped
  std::optional<checkpoint::Manifest> to_write_ GUARDED_BY(mu_);
  uint64_t checkpoints_ GUARDED_BY(mu_) = 0;
  uint64_t last_checkpoint_round_ GUARDED_BY(mu_) = 0;
  uint64_t checkpoints_skipped_ GUARDED_BY(mu_) = 0;
  Mutex flush_mu_;  // held while flushing: sends leave in posting order
  std::thread monitor_;

  // What view() shows beyond the above. Every member admitted so far, by
  // (role, rank), with its host and pid.
  const transport::Clock::time_point started_ = transport::Clock::now();
  std::map<std::pair<Role, uint32_t>, std::pair<std::string, uint32_t>> admitted_ GUARDED_BY(mu_);
  struct ServerTotals {
    uint64_t bytes_in = 0;
    uint64_t bytes_out = 0;
    uint64_t reports = 0;
  };
  std::map<uint32_t, ServerTotals> server_totals_ GUARDED_BY(mu_);
  struct WorkerPace {
    bool seen = false;
    uint64_t round = 0;  // the highest round its last report named
    double round_s = 0;
    std::array<uint64_t, JobView::kRoundBuckets.size()> buckets{};
    uint64_t rounds = 0;
    double rounds_sum_s = 0;
    std::vector<JobView::Answers> answers;
  };
  std::map<uint32_t, WorkerPace> pace_ GUARDED_BY(mu_);
  std::vector<ServerPrediction> predictions_ GUARDED_BY(mu_);
  std::deque<JobView::Decision> decisions_ GUARDED_BY(mu_);
  std::map<std::string, uint64_t> steps_ GUARDED_BY(mu_);
  uint64_t migrated_bytes_ GUARDED_BY(mu_) = 0;
  // owned_bytes()'s cache: for this epoch and number of tensors.
  mutable std::optional<std::pair<uint64_t, size_t>> owned_for_ GUARDED_BY(mu_);
  mutable std::map<uint32_t, uint64_t> owned_ GUARDED_BY(mu_);
  // trace.dir: epoch switches and balancer steps as instants.
  std::unique_ptr<TraceRecorder> trace_;
  // Started last and stopped first: its thread calls view().
  std::unique_ptr<MetricsEndpoint> metrics_;
};

}  // namespace psld
