// The parameter server (docs/design.md §4): grants each worker connection a ring
// of landing slots, reduces pushed chunks into per-key accumulators with the
// CPU kernels (or, with server.device = cuda, in GPU memory with the CUDA
// kernels: lib/server/server_device.h), applies the round (sum or optimizer) and
// writes results straight into the workers' registered tensors.
//
// Threads: the transport's progress thread only pairs notifications with
// their metadata and queues work; `server_threads` shard threads own the keys
// (key -> shard by hash), so a key's state is touched by one thread and needs
// no lock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "base/mutex.h"
#include "lib/checkpoint/checkpoint.h"
#include "lib/placement/epoch_log.h"
#include "lib/runtime/door.h"
#include "lib/runtime/member.h"
#include "lib/server/checkpointing.h"
#include "lib/server/copy_parts.h"
#include "lib/server/server_device.h"
#include "lib/stats/load_stats.h"
#include "lib/stats/trace.h"

namespace psld {

struct ServerStats {
  uint64_t pushes = 0;
  uint64_t pushes_in_place = 0;  // of them, read from the worker's mapped tensor (kPushMapped)
  uint64_t batches = 0;          // PushBatch messages taken
  uint64_t batched_pushes = 0;   // pushes that came in them
  uint64_t answer_batches = 0;   // batches of pull answers written
  uint64_t batched_answers = 0;  // pulls answered in them
  // Answers gathered for a batch but written one by one (no answer slot
  // of the worker was free).
  uint64_t answers_alone = 0;
  // Small pulls copied straight into a worker's mapped tensor, their tags
  // sent in a Credit (shared memory on one host).
  uint64_t answers_in_place = 0;
  uint64_t pulls = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t rounds_applied = 0;
  uint64_t rejected = 0;  // malformed or not-owned requests answered with an error or Moved
  // Migration: key states this server asked for, states that landed here,
  // and states shipped from here (their write completed).
  uint64_t states_requested = 0;
  uint64_t states_in = 0;
  uint64_t states_out = 0;
  // Runs of ownership (a key's state, one per stretch of rounds the key
  // spent here) held now, and those freed once no round could need them
  // (docs/migration.md, "Freeing old runs").
  uint64_t runs = 0;
  uint64_t runs_freed = 0;
  // Replication: copies of a key's state written to its backup, and of
  // them those written straight from the parameter, without a staging copy.
  uint64_t copies = 0;
  uint64_t copies_direct = 0;

  // Every field added.
  ServerStats& operator+=(const ServerStats& o);
};

// This machine's memory, in bytes (0: unknown).
uint64_t physical_memory_bytes();
// InvalidArgument, saying which settings to lower, when the landing slots of
// every worker (num_workers x slots_per_worker x chunk_bytes, granted as
// workers connect) would not fit in `memory_bytes` (0: no check). A server
// checks before it joins (docs/scale.md).
Status check_landing_memory(const RuntimeOptions& options, uint64_t memory_bytes);

class ServerService final : public ProcessRuntime {
 public:
  // Starts listening, joins the job and waits for its start (connect_timeout).
  static Result<std::unique_ptr<ServerService>> start(const RuntimeOptions& options);
  ~ServerService() override;

  uint32_t rank() const { return session_.welcome().rank; }
  // Blocks until the coordinator ends the job (Ok) or it fails.
  Status wait(std::chrono::milliseconds timeout) { return session_.wait_for_shutdown(timeout); }
  void shutdown();
  ServerStats stats() const;
  // Connections the data port refused: a wrong proof, anything before the
  // handshake, over the cap, past the handshake deadline (Door).
  uint64_t num_refused() const { return door_.num_refused(); }
  // The emulated compute capacity (RuntimeOptions::compute_bytes_per_second),
  // changed while the job runs; 0: unlimited.
  void set_compute_rate(double bytes_per_second);

 private:
  explicit ServerService(const RuntimeOptions& options);

  struct PushWork {
    uint64_t conn = 0;
    protocol::PushMeta meta;
    const uint8_t* data = nullptr;  // the landing slot, or the worker's mapped tensor
    // A push read in place (protocol::kPushMapped): holds the mapping of the
    // worker's memory that `data` points into.
    std::shared_ptr<const transport::RemoteRegion> source;
    uint32_t worker = 0;
    transport::Clock::time_point arrived{};
    bool taken = false;     // the worker was told the push was accepted
    bool requeued = false;  // queued again after waiting for an epoch: load already counted
    // A push in a landing slot: the slots, which `data` points into, kept
    // alive while the push waits (its worker's connection, which owns them,
    // may close meanwhile).
    std::shared_ptr<transport::MemoryRegion> slots = nullptr;
  };
  struct PullWork {
    uint64_t conn = 0;
    protocol::PullRequest req;
    transport::Clock::time_point arrived{};
    bool requeued = false;
    // Replicated async and staleness: the version of the key the backup must
    // hold before the pull is answered (its push's, or the key's on arrival).
    uint64_t min_version = 0;
  };
  struct PullDone {
    Key key = 0;
    uint64_t run = 0;  // KeyState::owned_from
  };
  // A successor asks for a key's state as of switch_round - 1 (migration).
  struct StateWork {
    uint64_t conn = 0;
    protocol::StateRequest req;
    std::shared_ptr<transport::RemoteRegion> region;
  };
  // The state this server asked for landed in the key's incoming region.
  struct StateArrived {
    Key key = 0;
    uint64_t run = 0;
  };
  // Migration bookkeeping (docs/migration.md): find the keys this shard
  // ships at a switch; a shipping write completed; an old owner offers a key;
  // the transfer at a switch became final.
  struct TransferScan {
    uint64_t switch_round = 0;
  };
  struct ShipDone {
    Key key = 0;
    uint64_t run = 0;
    uint64_t switch_round = 0;
    bool ok = false;
  };
  struct Offered {
    protocol::StateOffer offer;
  };
  struct Release {
    uint64_t switch_round = 0;
  };
  // The coordinator's LowWatermark: free the runs nothing can need.
  struct Trim {
    protocol::LowWatermark mark;
  };
  // Connect to the servers a prepared switch brings keys from.
  struct Dial {
    std::vector<ServerId> servers;
  };
  // Replication (docs/replication.md; lib/server/replication.cc). A copy
  // this server keeps of another server's key, in two slots written in turn.
  struct ReplicaCopy {
    Key key = 0;
    ServerId primary = 0;
    DType dtype = DType::kFloat32;
    uint64_t bytes = 0;
    uint64_t slot_bytes = 0;
    std::shared_ptr<transport::MemoryRegion> region;  // both slots
    int committed = -1;                               // the slot of the newest complete copy
    uint64_t version = 0;
    CopyParts landed;  // of the copies written in two parts (body, header)
  };
  // As a key's primary: the backup granted its slots; acknowledged the copy
  // of `version`; the write of a copy failed.
  struct ReplicaGranted {
    Key key = 0;
    uint64_t run = 0;
    ServerId backup = 0;
    uint64_t conn = 0;
    uint32_t tag = 0;
    std::shared_ptr<transport::RemoteRegion> slots;
  };
  struct ReplicaAcked {
    Key key = 0;
    uint64_t run = 0;
    uint32_t tag = 0;
    uint64_t version = 0;
  };
  struct ReplicaFailed {
    Key key = 0;
    uint64_t run = 0;
    uint32_t tag = 0;
  };
  // A failover gave this server a lost primary's key: its state is the copy's
  // slot `slot`, as of `version`.
  struct TakeOver {
    std::shared_ptr<const ReplicaCopy> copy;
    int slot = 0;
    uint64_t version = 0;
  };
  // A failover changed the backups: every key gets a copy at its backup of
  // `epoch`, and the server reports ReplicaSynced once all have one.
  struct Resync {
    uint64_t epoch = 0;
  };
  using Work = std::variant<PushWork, PullWork, PullDone, StateWork, StateArrived, TransferScan,
                            ShipDone, Offered, Release, Dial, Trim, ReplicaGranted, ReplicaAcked,
                            ReplicaFailed, TakeOver, Resync>;

  struct KeyState;
  struct Shard;
  struct AnswerBatch;
  struct WorkerConn;

  void on_accept(const transport::ConnectionPtr& conn) override;
  void on_write(const transport::ConnectionPtr& conn, uint32_t notify, uint64_t length) override;
  void on_disconnect(const transport::ConnectionPtr& conn, const Status& why) override;
  void on_control(const transport::ConnectionPtr& conn, protocol::Message&& message) override;

  void handle_worker_message(const transport::ConnectionPtr& conn, protocol::Message& message);
  // A PushBatch: its entries queued now (in place, or their write came
  // first), or once its write lands (on_write).
  void take_batch(const transport::ConnectionPtr& conn, WorkerConn& w, protocol::PushBatch& batch);
  // The entries of a batch whose bytes are in its slot at `base`, each
  // queued as the push it stands for.
  void dispatch_batch(uint64_t conn, uint32_t worker,
                      const std::shared_ptr<transport::MemoryRegion>& slots, const uint8_t* base,
                      const protocol::PushBatch& batch);
  // Every entry of a batch fails with `why`; `counted`: their arrival was
  // counted and the slot marked, and both are undone.
  void refuse_batch(uint64_t conn, const protocol::PushBatch& batch, const Status& why,
                    bool counted);
  // An in-place push (kPushMapped) of worker connection w as the work that
  // reads it from the worker's mapped tensor; nullopt when this server maps
  // no such memory or the size is invalid. `arrived`: when its message
  // came (one clock reading for a whole batch). conns_mu_ held.
  std::optional<PushWork> mapped_work(uint64_t conn, const WorkerConn& w,
                                      const protocol::PushMeta& meta,
                                      transport::Clock::time_point arrived);
  // The highest round a push named so far (max_round_seen_).
  void note_round(uint64_t round);
  void admit(const transport::ConnectionPtr& conn, const std::shared_ptr<WorkerConn>& w,
             protocol::Message& message);
  // A message on a connection this server dialled and is authenticating
  // (peer()): true if it was one.
  bool handle_dialing(const transport::ConnectionPtr& conn, protocol::Message& message);
  // Sends on a connection peer() returned: held until its handshake's grant.
  Status send_peer(const transport::ConnectionPtr& conn, const protocol::Message& message);
  // A dial whose handshake failed: logged, forgotten (the next peer() dials
  // again) and closed; what waited for it is dropped.
  void drop_dial(const transport::ConnectionPtr& conn, ServerId peer, const Status& why);
  // The heartbeat thread: closes what the door refused and connections
  // whose handshake missed its deadline.
  void sweep_door();
  // Adds what a pass of the shard loop counted (Shard::counted) to stats_.
  void fold_counts(Shard& shard);
  // The shard every piece of work on `key` goes to, so that a key's work
  // stays in order on one thread.
  size_t shard_of(Key key) const;
  void dispatch(Key key, Work work);
  // Many pushes at once (a batch's): each shard takes its share, in order,
  // in one hand-off (one lock, one wake-up) instead of one per push.
  void dispatch_pushes(std::vector<PushWork>& works);
  void dispatch_all(const Work& work);  // to every shard
  void shard_loop(Shard& shard);
  // Runs one piece of work: std::visit over the handlers below, one per
  // alternative of Work, so an alternative without its handler does not
  // compile.
  void process(Shard& shard, Work& work);
  void handle(Shard& shard, PushWork& w);
  void handle(Shard& shard, PullWork& w);
  void handle(Shard& shard, const PullDone& w);
  void handle(Shard& shard, const StateWork& w);
  void handle(Shard& shard, const StateArrived& w);
  void handle(Shard& shard, const TransferScan& w);
  void handle(Shard& shard, const ShipDone& w);
  void handle(Shard& shard, const Offered& w);
  void handle(Shard& shard, const Release& w);
  void handle(Shard& shard, const Dial& w);
  void handle(Shard& shard, const Trim& w);
  void handle(Shard& shard, const ReplicaGranted& w);
  void handle(Shard& shard, const ReplicaAcked& w);
  void handle(Shard& shard, const ReplicaFailed& w);
  void handle(Shard& shard, const TakeOver& w);
  void handle(Shard& shard, const Resync& w);
  // Replication, as a key's primary: its state changed (an initial value, a
  // round): it is not durable until its backup acknowledged a copy, and
  // until then no pull of it is answered and no plain push of it accepted.
  bool replicated() const { return options_.replication_factor > 1; }
  // Replicated in async or staleness mode: a pull waits for the version of
  // its push at the backup, and a push sent again is taken once.
  bool async_replicated() const { return replicated() && options_.sync != SyncMode::kBsp; }
  // A key a failover gives this server whose copy (here) is not installed
  // yet: async pushes wait for it.
  bool awaiting_copy(Key key) EXCLUDES(replicas_mu_);
  void replicate(Shard& shard, KeyState& k);
  // Sends the key's state to its backup: opens its slots first, or marks
  // the copy to follow the one in flight.
  void push_replica(Shard& shard, KeyState& k);
  // The backup has the key's current state: serves what waited for it.
  void now_durable(Shard& shard, KeyState& k);
  // Plain pushes of durable rounds are accepted (all, without replication).
  void accept_durable(Shard& shard, KeyState& k);
  void note_resynced(Shard& shard, Key key);
  // The backup of this server in the newest epoch.
  std::optional<ServerId> backup_now() const;
  // As a backup: a primary opens a key's slots; a copy landed in a slot
  // (true if the write was one); a failover gives this server the lost
  // primary's keys.
  void open_copy(const transport::ConnectionPtr& conn, ServerId primary,
                 const protocol::ReplicaOpen& open);
  bool copy_landed(const transport::ConnectionPtr& conn, uint32_t notify, uint64_t length);
  // A ReplicaGrant, ReplicaAck or Error on a connection this server dialled
  // to a backup: true if it was one.
  bool handle_replica_answer(const transport::ConnectionPtr& conn, protocol::Message& message);
  // A failover epoch, just installed (epoch_mu_ held): the copies of the
  // lost server's keys that it gives this server, taken out of copies_
  // (async: marked awaiting_copy_).
  std::vector<TakeOver> take_copies_of(ServerId lost, const Placement& now) REQUIRES(epoch_mu_)
      EXCLUDES(replicas_mu_);
  // After it: installs those copies, then resyncs.
  void on_failover(const protocol::EpochChange& change, std::vector<TakeOver> take);
  // A committed switch gave this server another backup (a server joined or
  // left the ring): every key it owns is copied there, then ReplicaSynced.
  void on_backup_changed(uint64_t epoch);
  // Every key not copied to its backup of `epoch` yet is copied there;
  // ReplicaSynced once all are (after a failover or a new backup).
  void resync(uint64_t epoch) EXCLUDES(replicas_mu_);
  void process_push(Shard& shard, PushWork& w);
  void process_pull(Shard& shard, PullWork& w);
  // The key's state, created on first use; `round` is the round of the
  // request that creates it (a key gained by migration waits for its state).
  // A key taken over from a replica (`from_replica`) is not read from a
  // resumed job's checkpoint: the copy is newer.
  // Where a key's run of epochs here began: {switch round, the owner before}
  // (gained()).
  using Gained = std::optional<std::pair<uint64_t, ServerId>>;
  // `known`: gained(key, round), where the caller has it (shard_ownership()).
  KeyState& key_state(Shard& shard, Key key, DType dtype, uint64_t bytes, uint64_t round,
                      bool from_replica = false, const Gained* known = nullptr);
  // Reduces a push into the key's accumulator (Aggregator::reduce), waits
  // for it, records the busy time and frees the landing slot. On an error
  // it fails the key and answers the push: false.
  bool reduce_push(Shard& shard, KeyState& k, const PushWork& w);
  // A device operation on the key failed: answers what waits for it, and
  // every later request, with `why` (docs/gpu.md, "GPU servers").
  void fail_key(Shard& shard, KeyState& k, const Status& why);
  // Charges `bytes` to the emulated processor (compute_bytes_per_second) and
  // holds the calling shard thread until the processor is done, once it is
  // at least 1 ms ahead of the clock (service.cc says why).
  void pace_compute(uint64_t bytes);
  void try_apply(Shard& shard, KeyState& k);
  void apply_round(Shard& shard, KeyState& k);
  // Replicated async: a push sent again whose round the key holds already is
  // answered as done (its pull, or its acceptance, once at the backup).
  void answer_applied_push(Shard& shard, KeyState& k, const PushWork& w, PullWork follow);
  bool pull_ready(const KeyState& k, const PullWork& w) const;
  void serve_pull(Shard& shard, KeyState& k, const PullWork& w);
  void free_slot(Shard& shard, uint64_t conn, uint32_t slot);
  // A small pull's answer copied into the shard's batch for its worker;
  // false when it cannot be (no answer slots, a device key, no buffer), and
  // the pull is written on its own.
  bool batch_answer(Shard& shard, KeyState& k, uint64_t conn, uint32_t tag,
                    const std::shared_ptr<transport::RemoteRegion>& remote, uint64_t offset,
                    uint64_t answer_slot_bytes);
  // Writes every batch of answers the shard gathered (end of a pass).
  void flush_answers(Shard& shard);
  void flush_answer(uint64_t conn, AnswerBatch& batch);
  transport::ConnectionPtr worker_connection(uint64_t conn) const;
  void send_error(uint64_t conn, uint32_t tag, const Status& status);
  // Answers a request for a key this server does not own in its epoch.
  void send_moved(uint64_t conn, uint32_t tag, Key key);
  void flush_credits(Shard& shard);
  // Migration (docs/design.md §7).
  void on_epoch_change(const protocol::EpochChange& change);
  void cancel_prepared(const protocol::EpochChange& change);
  void on_final(const protocol::EpochFinal& final);
  // The heartbeat thread's clock: the transfer's fallback report.
  void on_tick();
  // arc_of(key) through the shard's cache (Shard::arcs).
  uint64_t shard_arc_of(Shard& shard, Key key) const;
  // Who serves round `round` of `key`: the committed epochs, and a prepared
  // epoch from its switch round on.
  ServerId owner_for(Key key, uint64_t round) const;
  ServerId owner_for_locked(Key key, uint64_t round) const REQUIRES(epoch_mu_);
  uint64_t newest_epoch() const;
  // When this server gained `key` at a switch round (the state must come
  // from `from`): {switch_round, from}; nullopt when it held it from epoch 0.
  Gained gained(Key key, uint64_t round) const;
  bool failed_over(ServerId id) const EXCLUDES(epoch_mu_);
  Gained gained_locked(Key key, uint64_t round) const REQUIRES(epoch_mu_);
  // owner_for and, where that is this server, gained, for every push and
  // pull: from the shard's cache (Shard::owners), filled under one lock of
  // the epochs for the rounds the same epoch serves; emptied when an epoch
  // is prepared, committed or aborted (ownership_gen_).
  struct Ownership {
    ServerId owner = 0;
    Gained gained;
  };
  Ownership shard_ownership(Shard& shard, Key key, uint64_t round);
  // The rounds [from, until) that the epoch serving `round` serves (the
  // prepared one counted).
  void serving_rounds_locked(uint64_t round, uint64_t* from, uint64_t* until) const
      REQUIRES(epoch_mu_);
  struct CachedOwnership {
    Ownership ownership;
    uint64_t from = 0;
    uint64_t until = 0;
  };
  void request_state(KeyState& k, uint64_t switch_round, ServerId from);
  KeyState* find_run(Shard& shard, Key key, uint64_t run);
  void install_state(Shard& shard, KeyState& k);
  // Serves what waited for the key's state (or for EpochFinal).
  void resume(Shard& shard, KeyState& k);
  bool ready_to_ship(const KeyState& k, uint64_t switch_round) const;
  void ship_state(Shard& shard, KeyState& k, const StateWork& w);
  void maybe_ship(Shard& shard, KeyState& k);
  // The transfer this server is an old owner in (docs/migration.md).
  void scan_outgoing(Shard& shard, uint64_t switch_round);
  void maybe_offer(Shard& shard, KeyState& k);
  // Publishes the shard's count of keys still to ship; reports TransferDone
  // once every shard is done.
  void note_outgoing(const Shard& shard);
  void release_final(Shard& shard, uint64_t switch_round);
  // Old runs of ownership (docs/migration.md, "Freeing old runs"): whether
  // nothing can need the run any more; frees the shard's runs (trim: all,
  // with a new watermark; free_runs: those of one key) that nothing needs.
  bool done_with(const Shard& shard, const KeyState& k) const;
  void trim(Shard& shard, const protocol::LowWatermark& mark);
  void free_runs(Shard& shard, Key key);
  void note_freed(uint64_t freed);
  // True when a run that began at `run` must wait for EpochFinal.
  bool hold_until_final(uint64_t run) const;
  // Keeps a request that names a newer epoch than this server has committed
  // (an abort reaches workers and servers in any order) until that epoch
  // arrives; false when the request is to be answered now. A prepared epoch
  // does not count: workers name committed epochs only, and the epoch of a
  // prepared one's number may be the failover that replaced it (cancel).
  bool wait_for_epoch(uint64_t epoch, Key key, Work work);
  // wait_for_epoch() for a push or pull on a shard, behind a look without
  // epoch_mu_ (committed_epoch_): a request of a committed epoch, nearly
  // every one, neither takes the lock nor is copied into a Work. Owner or
  // not here: this server's view may rest on a prepare that is about to be
  // cancelled, whose epoch number the worker's epoch took.
  template <typename W>
  bool held_for_epoch(uint64_t epoch, Key key, const W& w) {
    return epoch > committed_epoch_.load(std::memory_order_acquire) &&
           wait_for_epoch(epoch, key, w);
  }
  void forget_peer(ServerId id);
  void release_parked(Shard& shard, KeyState& k);
  void serve_ready_pulls(Shard& shard, KeyState& k);
  transport::ConnectionPtr peer(ServerId id);
  // The first hash of the arc that holds `key`: the subject of its load samples.
  uint64_t arc_of(Key key) const;
  // Checkpoints (lib/server/checkpointing.h, docs/checkpoint.md): the key's
  // state after a checkpoint round it just applied goes to the writer; a
  // key this server holds from the start of a resumed job takes its state
  // from the checkpoint.
  void save_checkpoint(Shard& shard, KeyState& k);
  Status restore_checkpoint(Shard& shard, KeyState& k);
  // Made on first use (the rank and the resume round come with the Welcome):
  // nullptr when checkpoints are off or the writer could not start.
  CheckpointWriter* checkpoint_writer() EXCLUDES(ckpt_mu_);
  Result<const checkpoint::Reader*> resume_reader() EXCLUDES(ckpt_mu_);

  const RuntimeOptions options_;
  MemberSession session_;
  // Epochs: the committed log and a prepared one.
  mutable Mutex epoch_mu_;
  std::optional<EpochLog> epochs_ GUARDED_BY(epoch_mu_);
  // Counts the placements pushed onto epochs_ (after each push): a shard's
  // cache of arcs is of one count.
  std::atomic<uint64_t> latest_placements_{0};
  // epochs_->latest().epoch(), for a look without epoch_mu_: a request that
  // names a newer epoch waits for it (held_for_epoch).
  std::atomic<uint64_t> committed_epoch_{0};
  // Counts the changes of who serves which rounds (a prepare, and each push
  // onto epochs_), each made under epoch_mu_: a shard's cached ownership is
  // of one count.
  std::atomic<uint64_t> ownership_gen_{0};
  struct Prepared {
    uint64_t epoch = 0;
    uint64_t switch_round = 0;
    std::shared_ptr<const Placement> placement;
  };
  std::optional<Prepared> prepared_ GUARDED_BY(epoch_mu_);
  // The transfer of the newest switch this server loses keys in: it reports
  // TransferDone once every shard shipped what it must.
  struct Transfer {
    uint64_t epoch = 0;
    uint64_t switch_round = 0;  // 0: none
    bool losing = false;
    bool reported = false;
    std::vector<int64_t> pending;            // per shard: keys to ship; -1: not scanned yet
    transport::Clock::time_point reached{};  // when round switch_round - 1 was first seen
  };
  Transfer transfer_ GUARDED_BY(epoch_mu_);
  // This server gained keys at gate_round_ and had never owned any before:
  // their runs wait for EpochFinal, so that the coordinator can still give
  // them back if this server dies.
  // Servers a failover epoch removed: a key gained from one of them comes
  // from its copy here (TakeOver), never by a state request.
  std::set<ServerId> failed_over_ GUARDED_BY(epoch_mu_);
  uint64_t gate_round_ GUARDED_BY(epoch_mu_) = 0;
  bool gate_final_ GUARDED_BY(epoch_mu_) = true;
  // This server owned keys in a placement that is final: it is never such a
  // server again.
  bool owned_ever_ GUARDED_BY(epoch_mu_) = false;
  // Requests that name an epoch newer than this server's, with that epoch.
  static constexpr size_t kMaxWaitingForEpoch = 4096;
  std::vector<std::tuple<uint64_t, Key, Work>> waiting_for_epoch_ GUARDED_BY(epoch_mu_);
  std::atomic<uint64_t> max_round_seen_{0};
  // The door of the data port: unauthenticated connections are capped and
  // have a deadline.
  Door door_;
  // Connections to other servers whose handshake runs, by connection id,
  // with what waits to be sent on them. Taken after peers_mu_.
  struct Dialing {
    protocol::PeerDial dial;
    ServerId peer = 0;
    std::vector<protocol::Message> queued;
  };
  Mutex dialing_mu_;
  std::map<uint64_t, Dialing> dialing_ GUARDED_BY(dialing_mu_);
  // Connections this server dialled to other servers (migration), by id.
  Mutex peers_mu_;
  std::map<ServerId, transport::ConnectionPtr> peers_ GUARDED_BY(peers_mu_);
  // State requests in flight: (connection, tag) -> (key, run).
  std::map<std::pair<uint64_t, uint32_t>, std::pair<Key, uint64_t>> incoming_ GUARDED_BY(peers_mu_);
  uint32_t next_state_tag_ GUARDED_BY(peers_mu_) = 1;

  // server.device = cuda: where keys live and kernels run (lane i: shard
  // i); null: host memory and the CPU kernels. Declared before conns_ and
  // shards_ so that the pinned slots and the keys' device memory are given
  // back before the device goes.
  std::unique_ptr<ServerDevice> device_;
  std::atomic<bool> pin_warned_{false};  // said once that slots could not be pinned
  mutable Mutex conns_mu_;
  std::map<uint64_t, std::shared_ptr<WorkerConn>> conns_ GUARDED_BY(conns_mu_);

  std::vector<std::unique_ptr<Shard>> shards_;
  std::atomic<bool> stopping_{false};

  // Buffers answers to small pulls are gathered in (batch_answer), each
  // of answer_buffer_bytes_; a buffer is free again once its write
  // completed. Null: no batches.
  std::shared_ptr<transport::MemoryRegion> answer_pool_;
  uint64_t answer_buffer_bytes_ = 0;
  Mutex answer_mu_;
  std::vector<uint32_t> free_answer_buffers_ GUARDED_BY(answer_mu_);
  mutable Mutex stats_mu_;
  ServerStats stats_ GUARDED_BY(stats_mu_);
  // Emulated compute: reduces are serialised through one virtual processor
  // that frees up at compute_free_ (shared by every shard).
  // The rate is atomic so that a server without emulation (rate 0, every
  // real job) checks it on each reduce without taking the mutex.
  std::atomic<double> compute_rate_{0};
  Mutex compute_mu_;
  transport::Clock::time_point compute_free_ GUARDED_BY(compute_mu_){};
  std::unique_ptr<LoadRecorder> load_;
  // trace.dir: reduce and update spans per key, shipping, epoch switches.
  std::shared_ptr<TraceRecorder> trace_;
  // Replication: the copies this server keeps as a backup, by (the
  // primary's connection, tag); and, as a primary, its opened slots by
  // (connection to the backup, tag) -> (key, run).
  Mutex replicas_mu_;
  std::map<std::pair<uint64_t, uint32_t>, std::shared_ptr<ReplicaCopy>> copies_
      GUARDED_BY(replicas_mu_);
  // Async and staleness: the keys of a lost primary this server takes over
  // from their copies and has not installed yet (awaiting_copy).
  std::set<Key> awaiting_copy_ GUARDED_BY(replicas_mu_);
  std::map<std::pair<uint64_t, uint32_t>, std::pair<Key, uint64_t>> replica_opens_
      GUARDED_BY(replicas_mu_);
  uint32_t next_replica_tag_ GUARDED_BY(replicas_mu_) = 4;  // kCopyPart + 1 apart
  std::atomic<int64_t> unreachable_backup_{-1};             // a backup whose dial failed
  // The failover epoch being resynced and the shards still copying keys.
  uint64_t resync_epoch_ GUARDED_BY(replicas_mu_) = 0;
  size_t resync_shards_left_ GUARDED_BY(replicas_mu_) = 0;
  Mutex ckpt_mu_;
  bool writer_tried_ GUARDED_BY(ckpt_mu_) = false;
  std::unique_ptr<CheckpointWriter> writer_ GUARDED_BY(ckpt_mu_);
  std::optional<Result<std::unique_ptr<checkpoint::Reader>>> resume_ GUARDED_BY(ckpt_mu_);
};

}  // namespace psld
