// The worker side of the data path: tensors registered once (zero-copy: the
// library reads pushes from and writes pulls into the caller's memory), cut
// into chunks, each chunk routed by the placement to its server, pushed with
// one write into a landing slot the server granted (credits bound the
// server's memory), pulled by the server writing straight into the tensor.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "base/mutex.h"
#include "base/tag_map.h"
#include "lib/placement/epoch_log.h"
#include "lib/runtime/member.h"
#include "lib/stats/load_stats.h"
#include "lib/stats/trace.h"
#include "lib/worker/device_staging.h"

namespace psld {

// Completion state shared by a request handle and the worker: the request is
// done when all its chunk operations are, and fails with the first error.
class RequestState {
 public:
  explicit RequestState(uint64_t parts) : remaining_(parts), done_(parts == 0) {}
  void complete_part(const Status& status);
  Status wait(std::chrono::milliseconds timeout);
  bool test() const;
  // The request's result once done.
  Status status() const;

 private:
  Status final_status() const;

  mutable Mutex mu_;
  std::condition_variable cv_;
  uint64_t remaining_ GUARDED_BY(mu_);
  // Set (release) under mu_ once status_ is final: status_ is never written
  // again, so a waiter that sees it set (acquire) reads status_ without mu_.
  std::atomic<bool> done_;
  Status status_ GUARDED_BY(mu_);
};

enum class RequestKind : uint8_t { kPush, kPull, kPushPull, kInit };

// What this worker sent to one server and how long the server took to answer.
struct ServerLoadStats {
  uint32_t server = 0;
  uint64_t bytes_pushed = 0;
  uint64_t answers = 0;            // pulls and push_pulls answered
  uint64_t answer_latency_ns = 0;  // summed over those answers
};

class WorkerService final : public ProcessRuntime {
 public:
  // Joins the job (connect_timeout), connects to every server and gets its grant.
  static Result<std::unique_ptr<WorkerService>> start(const RuntimeOptions& options);
  ~WorkerService() override;

  uint32_t rank() const { return session_.welcome().rank; }
  uint32_t num_workers() const { return session_.welcome().num_workers; }

  // Zero-filled memory from the transport for tensors (psld/worker.h,
  // Worker::allocate); valid until this object is destroyed.
  Result<void*> allocate(size_t bytes);
  // Returns a handle (an index) for the tensor. See psld/worker.h.
  Result<uint32_t> register_tensor(const std::string& name, DType dtype, uint64_t bytes, void* data,
                                   const void* init);
  Result<std::shared_ptr<RequestState>> submit(uint32_t tensor, RequestKind kind);
  // The same request for each tensor, in order, queued together: the small
  // chunks among them that go to one server travel as batches
  // (data.batch_chunk_bytes). Nothing is submitted for an unknown handle.
  Result<std::vector<std::shared_ptr<RequestState>>> submit_many(std::span<const uint32_t> tensors,
                                                                 RequestKind kind);
  // Rounds of the tensor pushed so far (a resumed job's tensors start at
  // the checkpoint's round).
  Result<uint64_t> tensor_round(uint32_t tensor) const;
  Status barrier(std::chrono::milliseconds timeout) { return session_.barrier(timeout); }
  // The learning rate that pushes submitted from now on carry (psld/worker.h).
  void set_learning_rate(double lr) {
    MutexLock lock(mu_);
    lr_ = lr;
  }
  Status health() const { return session_.health(); }
  // Cumulative, one entry per server.
  std::vector<ServerLoadStats> server_loads();
  // Says goodbye to the coordinator and stops; idempotent.
  Status shutdown();
  // What is in flight, for diagnostics: per server, chunks waiting for a
  // credit and operations waiting for an answer, and ops waiting for an epoch.
  std::string describe_in_flight();
  // Chunk operations not completed yet, wherever they wait.
  size_t operations_in_flight();
  // How tensors in CUDA memory travel here (lib/worker/device_staging.h).
  const std::string& gpu_path() const { return gpu_path_text_; }
  // The staged path's copies so far, each way (0 before a staged tensor).
  uint64_t staged_bytes_to_host();
  uint64_t staged_bytes_to_device();

 private:
  explicit WorkerService(const RuntimeOptions& options);

  struct Tensor {
    TensorId id = 0;
    std::string name;
    DType dtype = DType::kFloat32;
    uint64_t bytes = 0;
    uint8_t* data = nullptr;  // the caller's memory, host or CUDA
    MemoryKind kind = MemoryKind::kHost;
    std::optional<ChunkLayout> layout;
    // Staged CUDA tensors: the pinned host copy the transport reads pushes
    // from and servers write pulls into. Declared before `region`, which
    // registers it, so that the registration goes first.
    std::shared_ptr<uint8_t> shadow;
    std::shared_ptr<transport::MemoryRegion> region;  // of data, or of shadow when staged
    uint64_t region_offset = 0;  // of the tensor in region (inside an allocate()d block)
    uint64_t push_round = 0;
  };
  struct ChunkOp {
    RequestKind kind = RequestKind::kPush;
    uint32_t tensor = 0;
    uint32_t chunk = 0;
    uint64_t round = 0;
    std::shared_ptr<RequestState> request;
    double lr = 0;  // the learning rate its pushes carry (set_learning_rate); 0: the server's
    transport::Clock::time_point submitted{};  // for its trace span (trace.dir)
  };
  struct ServerConn {
    uint32_t rank = 0;
    transport::ConnectionPtr conn;
    // The data handshake (protocol.h); granted once the server proved it
    // knows the job secret, refused with why it did not.
    std::optional<protocol::PeerDial> dial;
    bool granted = false;
    Status refused;
    std::shared_ptr<transport::RemoteRegion> slots;
    uint64_t slot_bytes = 0;
    std::deque<uint32_t> free_slots;
    std::deque<ChunkOp> backlog;  // waiting for credit
    // Where the server writes batches of answers to small pulls
    // (protocol::AnswerSlots): answer_slots slots of answer_slot_bytes.
    std::shared_ptr<transport::MemoryRegion> answers;
    uint64_t answer_slot_bytes = 0;
    uint32_t answer_slots = 0;
    // Tensors the server maps (Ack kAckMapped): it reads their push_pulls in
    // place, so those need no slot and no write.
    std::unordered_set<TensorId> mapped;  // looked up for every chunk to it
    // The connection broke, or the coordinator removed the server: never
    // used again (docs/migration.md, "Abort").
    bool lost = false;
    Status lost_why;
  };
  // An operation waiting for its notification or error, by tag.
  struct Pending {
    uint32_t other_tag = 0;  // push_pull: the push's tag for the pull's and vice versa
    uint32_t server = 0;
    transport::Clock::time_point issued;
    ChunkOp op;          // its request, and to send it again where the server answers Moved
    bool lands = false;  // its notification: the chunk landed in the tensor (a pull)
  };
  // An operation a server answered Moved, waiting for an epoch it does not
  // know yet.
  struct MovedOp {
    ChunkOp op;
    uint64_t epoch = 0;
  };
  // An operation whose server was lost, or that failed to reach it, waiting
  // (until `deadline`) for the coordinator's decision: an epoch that routes
  // it to a live server, or JobFailed. `why` is what failed.
  struct Orphan {
    ChunkOp op;
    uint32_t server = 0;
    transport::Clock::time_point deadline;
    Status why;
  };

  // CUDA tensors: the copier, started with the first one (device_mu_).
  Result<DeviceCopier*> copier();
  // The pinned shadow of a staged tensor and its registration.
  Status stage_tensor(Tensor& t);
  // A staged push's chunk is in the shadow (or its copy failed): it goes out.
  void on_staged(ChunkOp op, const Status& copied);

  void on_write(const transport::ConnectionPtr& conn, uint32_t tag, uint64_t length) override;
  void on_disconnect(const transport::ConnectionPtr& conn, const Status& why) override;
  void on_control(const transport::ConnectionPtr& conn, protocol::Message&& message) override;
  void handshake(ServerConn& s, protocol::Message& message) REQUIRES(mu_);

  Status connect_servers();
  // Gives every server answer slots (protocol::AnswerSlots).
  Status grant_answer_slots();
  // A batch of answers landed in slot `slot` of s's answer slots: each pull
  // copied into its tensor and completed, and the slot given back.
  void take_answers(ServerConn& s, uint32_t slot, uint64_t length) REQUIRES(mu_);
  ServerConn* server_of(const transport::ConnectionPtr& conn) REQUIRES(mu_);
  // Issues as much of the server's backlog as its credits allow. mu_ held;
  // sends happen after it is released (see issue_later_).
  void pump(ServerConn& s) REQUIRES(mu_);
  void issue(ServerConn& s, const ChunkOp& op, uint32_t slot) REQUIRES(mu_);
  // A push's bookkeeping (its tags pending) and the PushMeta that announces
  // it; `slot` is kNoSlot's for one read in place. Its bytes are counted by
  // the caller (count_pushed), once for a whole batch; `now` is when it is
  // issued (one clock reading for a whole batch).
  protocol::PushMeta start_push(ServerConn& s, const ChunkOp& op, uint32_t slot,
                                transport::Clock::time_point now) REQUIRES(mu_);
  // Bytes pushed to s: its load stats and one load sample.
  void count_pushed(ServerConn& s, uint64_t bytes) REQUIRES(mu_);
  uint32_t new_tag() REQUIRES(mu_);
  // Removes the operation of `tag` from pending_, and a push_pull's other
  // half with it; nullopt if the tag is not pending.
  std::optional<Pending> take_operation(uint32_t tag) REQUIRES(mu_);
  // Whether op may travel in a batch (data.batch_chunk_bytes).
  bool batchable(const ChunkOp& op) const REQUIRES(mu_);
  // Issues the pushes at the front of s's backlog that fit one batch
  // (protocol::PushBatch); false, issuing nothing, when fewer than two do
  // or no batch buffer is free.
  bool issue_batch(ServerConn& s) REQUIRES(mu_);
  void finish_tag(uint32_t tag, const Status& status) REQUIRES(mu_);
  void flush();
  void fail_everything(const Status& why) REQUIRES(mu_);
  void on_epoch_change(const protocol::EpochChange& change);
  void on_moved(ServerConn& s, const protocol::Moved& moved) REQUIRES(mu_);
  // Queues the op on the server that serves its round, or with the orphans
  // when that server is lost (keeping `deadline` when it already waited).
  // mu_ held.
  void route(ChunkOp op, std::optional<transport::Clock::time_point> deadline = std::nullopt)
      REQUIRES(mu_);
  // The server's connection is gone or the coordinator removed it: what it
  // did not answer waits for the coordinator's decision. mu_ held.
  void server_lost(ServerConn& s, const Status& why) REQUIRES(mu_);
  // A send or write to server `rank` on `conn` failed: a sign that the
  // server is going away (its connection closes, or its memory was already
  // deregistered), so the operation waits with the lost server's. mu_ held.
  void op_failed(uint32_t rank, const transport::ConnectionPtr& conn, uint32_t tag,
                 const Status& why) REQUIRES(mu_);
  // The heartbeat thread's clock: orphans past their deadline fail.
  void on_tick();
  // The lowest round this worker may still send a request for, over every
  // tensor it registered (protocol::WorkerProgress): what lets servers free
  // old runs of ownership (docs/migration.md, "Freeing old runs").
  protocol::WorkerProgress progress();
  // How long a lost server's operations wait for the coordinator: it decides
  // within a heartbeat timeout of the loss; as much again is the margin.
  std::chrono::milliseconds orphan_grace() const { return 2 * options_.heartbeat_timeout; }

  const RuntimeOptions options_;
  MemberSession session_;
  std::string gpu_path_text_;  // fixed at start
  // allocate()d blocks by address. Declared before the tensors carved from them.
  std::map<const uint8_t*, std::shared_ptr<transport::MemoryRegion>> allocations_ GUARDED_BY(mu_);
  double lr_ GUARDED_BY(mu_) = 0;  // set_learning_rate; 0: the servers' optimizer.lr
  Mutex device_mu_;
  // Declared before tensors_: the shadows it allocated go first.
  // Set once under device_mu_, before the first staged tensor exists; read
  // without it by whoever reached a staged tensor through mu_.
  std::unique_ptr<DeviceCopier> copier_;
  std::optional<EpochLog> epochs_ GUARDED_BY(mu_);
  std::vector<protocol::EpochChange> early_epochs_ GUARDED_BY(mu_);  // arrived before join finished
  std::vector<MovedOp> moved_ GUARDED_BY(mu_);
  std::vector<Orphan> orphans_ GUARDED_BY(mu_);
  // Staged pushes whose chunks the copier is still copying out of the GPU:
  // (tensor, round) -> chunks.
  std::map<std::pair<uint32_t, uint64_t>, uint64_t> staging_ GUARDED_BY(mu_);
  std::atomic<uint64_t> max_round_{0};  // highest round pushed, for reports

  mutable Mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, ServerConn> servers_ GUARDED_BY(mu_);  // by server rank
  // Servers an epoch removed from the job (a failover, an aborted transfer),
  // also those removed before this worker connected to them: its join does
  // not wait for them.
  std::set<uint32_t> removed_servers_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, ServerLoadStats> loads_ GUARDED_BY(mu_);  // by server rank
  // issue_batch's scratch, kept with its capacity.
  std::vector<size_t> batch_picked_ GUARDED_BY(mu_);
  std::vector<ChunkOp> batch_ops_ GUARDED_BY(mu_);
  std::vector<ChunkOp> batch_rest_ GUARDED_BY(mu_);
  std::unique_ptr<LoadRecorder> load_;  // the windows sent to the coordinator
  // trace.dir: chunk spans (push, wait, pull), written past trace.rounds.
  // Shared with the GPU copier's callbacks, which record chunks they end.
  std::shared_ptr<TraceRecorder> trace_;
  // Records a chunk's spans once it completed.
  static void trace_chunk(TraceRecorder& trace, const Pending& p, const std::string& tensor,
                          uint64_t bytes, transport::Clock::time_point answered,
                          transport::Clock::time_point done, const Status& status);
  std::vector<Tensor> tensors_ GUARDED_BY(mu_);
  std::map<std::string, uint32_t> tensor_by_name_ GUARDED_BY(mu_);
  // By tag; two come and go per push_pull chunk (base/tag_map.h: no
  // allocation, one probe).
  TagMap<Pending> pending_ GUARDED_BY(mu_);
  std::map<uint64_t, std::set<uint32_t>> acks_wanted_
      GUARDED_BY(mu_);                                       // TensorKey request -> servers to ack
  std::map<uint64_t, TensorId> ack_tensor_ GUARDED_BY(mu_);  // TensorKey request -> its tensor
  // Whether server `s` reads op's push in place (protocol::kPushMapped). mu_ held.
  bool in_place(const ServerConn& s, const ChunkOp& op) const REQUIRES(mu_);
  // Batches of small pushes (issue_batch) are gathered into one of these
  // buffers of batch_bytes, registered once, and written from it; a buffer
  // is free again when its write completed. Null: no batches.
  std::shared_ptr<transport::MemoryRegion> batch_pool_;
  uint64_t batch_buffer_bytes_ = 0;
  std::vector<uint32_t> free_batch_buffers_ GUARDED_BY(mu_);
  uint64_t next_request_ GUARDED_BY(mu_) = 1;
  uint32_t next_tag_ GUARDED_BY(mu_) = 1;
  // Control messages and writes are issued outside mu_: the transport may be
  // calling one of our handlers, which takes mu_, on its progress thread.
  std::vector<std::function<void()>> outbox_ GUARDED_BY(mu_);
  bool stopped_ GUARDED_BY(mu_) = false;
};

}  // namespace psld
