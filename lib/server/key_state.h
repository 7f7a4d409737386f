// A server's key state (one run of ownership of a key), its shards and its
// worker connections, shared by the server's files (service, intake, shards,
// aggregation, migration). Internal to lib/server/.
#pragma once

#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>

#include "lib/server/aggregator.h"
#include "lib/server/copy_parts.h"
#include "lib/server/service.h"

namespace psld {

inline double ns_since(transport::Clock::time_point t) {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(transport::Clock::now() - t).count());
}

// Host memory the device page-locked (ServerDevice::pin).
struct Unpin {
  ServerDevice* device = nullptr;
  void operator()(uint8_t* p) const { device->unpin(p); }
};
using PinnedRange = std::unique_ptr<uint8_t, Unpin>;

struct ServerService::KeyState {
  Key key = 0;
  uint64_t arc = 0;  // first hash of the key's arc: the subject of its load samples
  // The key's parameter, accumulator and optimizer state, in host memory or
  // on the server's device. Its output (the source of pull writes) is
  // registered with the transport as out_region.
  Aggregator agg;
  std::shared_ptr<transport::MemoryRegion> out_region;
  // BSP sum mode, fp32: the accumulator is registered too, and a round is
  // applied by swapping parameter and accumulator (and their regions).
  std::shared_ptr<transport::MemoryRegion> acc_region;
  std::map<uint64_t, std::vector<PushWork>> parked;  // BSP: pushes for later rounds
  std::deque<PushWork> deferred;                     // async: waiting for pull writes
  std::vector<PullWork> waiting;
  uint32_t inflight = 0;  // pull writes reading param right now
  // Reduce time of the pushes of the round being gathered, recorded with the
  // round's update as one load sample (LoadRecorder::record_round).
  double busy_ns = 0;
  bool apply_pending = false;
  // Migration. A key this server gained waits for its state: pushes park,
  // pulls wait, until the previous owner's write lands in `incoming`.
  bool awaiting_state = false;
  uint64_t state_round = 0;  // the switch round it was gained at
  // The switch round this server's run of ownership began (0: from the first
  // epoch). A key that leaves and comes back gets a new KeyState for the new
  // run; the old one still finishes its rounds and ships them.
  uint64_t owned_from = 0;
  std::shared_ptr<transport::MemoryRegion> incoming;
  std::vector<StateWork> successors;  // state requests waiting for their round
  // Gained at a switch while this server owned nothing before: rounds >= the
  // switch are held (not applied, no pull answered, no plain push accepted)
  // until the transfer is final, so an abort can still give the key back.
  bool awaiting_final = false;
  // As an old owner, the switch round this run last offered its state at,
  // started shipping it at, and shipped it at (the write completed): the
  // run ended there. An abort that gives the key back clears shipped_round
  // (the run goes on), so that the run is not freed.
  uint64_t offered_round = 0;
  uint64_t shipping_round = 0;
  uint64_t shipped_round = 0;
  // A device operation on the key failed (a CUDA error): every request for
  // it is answered with this.
  Status failed;
  // Replication (docs/replication.md), as the key's primary: its slots at
  // the backup, the copy in flight, and whether the backup holds the
  // current state (a pull is answered and a plain push accepted only then).
  struct Replica {
    bool granted = false;
    ServerId backup = 0;
    uint64_t conn = 0;  // the connection to the backup the slots belong to
    uint32_t tag = 0;
    std::shared_ptr<transport::RemoteRegion> slots;
    std::shared_ptr<transport::MemoryRegion> staging;  // the copy being written
    uint32_t slot = 0;                                 // where the next copy goes
    bool opening = false;
    bool writing = false;  // a copy on its way, or waiting for its ack
    bool dirty = false;    // the state changed since that copy was taken
    uint64_t version = 0;  // of the copy in flight
  };
  Replica replica;
  bool durable = true;
  // Async and staleness: 1 + the newest version the backup acknowledged (0:
  // none yet); a pull is answered once its min_version is below it.
  uint64_t acked = 0;
  // Plain pushes taken, accepted once their round is durable.
  struct Unaccepted {
    uint64_t conn = 0;
    uint32_t tag = 0;
    uint64_t round = 0;
  };
  std::vector<Unaccepted> unaccepted;
  // Taken over from a lost primary's copy: a push of the round the copy
  // holds reached the primary before it died, so it is answered as done.
  bool taken_over = false;
  // Its state changed here (an initial value, an applied push: replicate()
  // ran for it). Until then it holds zeros, as any owner after a failover
  // would: in a replicated async job a pull of it waits for no copy.
  bool written = false;
};

// Answers to small pulls gathered for one worker connection during one
// pass of the shard loop, written as one batch at its end
// (flush_answers; docs/runtime.md, "Batches").
struct ServerService::AnswerBatch {
  int64_t buffer = -1;  // in the server's answer pool
  uint64_t end = protocol::kAnswerDataOffset;
  uint64_t limit = 0;
  struct Entry {
    protocol::AnswerEntry entry;
    // Where the pull goes when no answer slot is free: its own write.
    std::shared_ptr<transport::RemoteRegion> remote;
    uint64_t remote_offset = 0;
  };
  std::vector<Entry> entries;
};

struct ServerService::Shard {
  size_t index = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Work> queue;  // swapped with the loop's own: both keep their capacity
  bool stop = false;
  // What this pass of the loop counted, added to the server's stats under
  // stats_mu_ once at its end (fold_counts) instead of a lock per chunk.
  ServerStats counted;
  // Pushes of this pass whose service ends with it (LoadRecorder::end_service).
  uint64_t services_ended = 0;
  // Per key, its runs of ownership here, oldest first.
  std::unordered_map<Key, std::vector<std::unique_ptr<KeyState>>> keys;
  // arc_of() of the keys this shard saw under the latest placement it knows
  // (shard_arc_of): the arc every arrival is recorded against, without the
  // epochs' lock. Emptied when a placement is pushed.
  std::unordered_map<Key, uint64_t> arcs;
  uint64_t arcs_of = UINT64_MAX;  // the latest_placements_ count they are of
  // Who owns the keys this shard saw, each for the rounds its epoch serves
  // (shard_ownership), of one ownership_gen_ count.
  std::unordered_map<Key, CachedOwnership> owners;
  uint64_t owners_of = UINT64_MAX;
  std::map<uint64_t, std::vector<uint32_t>> credits;   // connection -> freed slots
  std::map<uint64_t, std::vector<uint32_t>> accepted;  // connection -> plain push tags taken
  std::map<uint64_t, AnswerBatch> answers;             // connection -> its batch
  // Where its keys live and its kernels run (host, or lane `index` of the
  // server's device), with the staging buffer for pushes.
  ComputeLane lane;
  // The keys (runs) this shard still has to ship for the transfer at
  // out_round (0: none scanned yet).
  uint64_t out_round = 0;
  std::set<std::pair<Key, uint64_t>> outgoing;
  // The last LowWatermark: no request of a tensor's rounds below the
  // round it gives that tensor will come.
  protocol::LowWatermark low;
  // Keys whose copy at their new backup is not acknowledged yet, after the
  // failover of resync_epoch (0: none).
  uint64_t resync_epoch = 0;
  std::set<Key> resync;
  std::thread thread;
};

// A connection to this server's data port: a worker's, or another server's
// (migration), once its handshake is done (hello).
struct ServerService::WorkerConn {
  transport::ConnectionPtr conn;
  transport::Clock::time_point accepted;
  // The handshake: the peer's hello and the nonce we challenged it with.
  std::optional<protocol::PeerHello> peer_hello;
  protocol::Nonce challenge{};
  bool refused = false;
  bool hello = false;  // it proved it knows the job secret
  Role role = Role::kWorker;
  uint32_t rank = 0;
  std::shared_ptr<transport::MemoryRegion> slots;
  // With a device: the slots page-locked for its copies; unpinned before
  // the slots go (declared after them).
  PinnedRange pinned;
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  // Per slot, the pushes that hold it (a batch's entries each hold it):
  // a credit goes back when the last one lets go.
  std::vector<uint32_t> slot_busy;
  std::map<uint32_t, protocol::PushMeta> metas;     // tag -> metadata waiting for its write
  std::map<uint32_t, protocol::PushBatch> batches;  // tag -> batch waiting for its write
  // Where answers to its pulls may come in batches (protocol::AnswerSlots).
  std::shared_ptr<transport::RemoteRegion> answer_slots;
  uint64_t answer_slot_bytes = 0;
  uint32_t answer_num_slots = 0;
  std::deque<uint32_t> free_answer_slots;
  std::map<uint32_t, uint64_t> early;  // tag -> length of a write waiting for its metadata
  // Where each tensor's pulls land (the worker's memory and the tensor's
  // offset in it), and where this process maps that memory, if it does
  // (then push_pulls are read in place: protocol::kPushMapped).
  struct TensorTarget {
    std::shared_ptr<transport::RemoteRegion> remote;
    uint64_t offset = 0;
    const uint8_t* view = nullptr;
    bool batched = false;  // protocol::kTensorAnswersBatched
  };
  std::unordered_map<TensorId, TensorTarget> tensors;
};
}  // namespace psld
