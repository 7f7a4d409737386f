// Aggregation (docs/design.md §4): pushes reduced into a key's accumulator, rounds
// applied (sum or optimizer) under the sync mode, and pulls served from the
// result.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "lib/server/key_state.h"

namespace psld {

using transport::ConnectionPtr;

void ServerService::serve_ready_pulls(Shard& shard, KeyState& k) {
  std::vector<PullWork> still;
  for (auto& p : k.waiting) {
    if (pull_ready(k, p.req)) {
      serve_pull(shard, k, p);
    } else {
      still.push_back(p);
    }
  }
  k.waiting.swap(still);
}

void ServerService::release_parked(Shard& shard, KeyState& k) {
  if (options_.sync != SyncMode::kBsp) return;
  auto next = k.parked.find(k.agg.version() + 1);
  if (next == k.parked.end()) return;
  std::vector<PushWork> ready = std::move(next->second);
  k.parked.erase(next);
  for (auto& p : ready)
    process_push(shard, p);
}

bool ServerService::reduce_push(Shard& shard, KeyState& k, const PushWork& w) {
  const auto start = transport::Clock::now();
  Status st = k.failed;
  if (st.ok()) st = k.agg.reduce(shard.lane, w.worker, w.meta.round, w.data, w.meta.lr);
  if (st.ok()) pace_compute(k.agg.bytes());
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  free_slot(shard, w.conn, w.meta.slot);
  if (!st.ok()) {
    fail_key(shard, k, st);
    send_error(w.conn, w.meta.tag, k.failed);
    return false;
  }
  return true;
}

void ServerService::fail_key(Shard& shard, KeyState& k, const Status& why) {
  if (k.failed.ok()) {
    k.failed = why.with_context(fmt::format("server {}, key {:#x} ({})", rank(), k.key,
                                            device_ ? device_->describe() : "host memory"));
    PSLD_LOG_ERROR("{}; every request for this key fails from now on", k.failed.to_string());
  }
  for (const PullWork& p : k.waiting)
    send_error(p.conn, p.req.tag, k.failed);
  k.waiting.clear();
  auto refuse = [&](const PushWork& w) {
    free_slot(shard, w.conn, w.meta.slot);
    send_error(w.conn, w.meta.tag, k.failed);
  };
  for (const auto& [round, pushes] : k.parked) {
    for (const PushWork& w : pushes)
      refuse(w);
  }
  k.parked.clear();
  for (const PushWork& w : k.deferred)
    refuse(w);
  k.deferred.clear();
  k.apply_pending = false;
}

void ServerService::process_push(Shard& shard, PushWork& w) {
  const protocol::PushMeta& meta = w.meta;
  const uint64_t round = (meta.flags & protocol::kPushInit) ? 0 : meta.round;
  if (owner_for(meta.key, round) != rank()) {
    if (wait_for_epoch(meta.epoch, meta.key, w)) return;  // keeps its slot meanwhile
    free_slot(shard, w.conn, meta.slot);
    send_moved(w.conn, meta.tag, meta.key);
    return;
  }
  KeyState& k = key_state(shard, meta.key, meta.dtype, meta.bytes, round);
  if (k.agg.dtype() != meta.dtype || k.agg.bytes() != meta.bytes) {
    free_slot(shard, w.conn, meta.slot);
    send_error(
        w.conn, meta.tag,
        InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the push has {} of {}",
                                    meta.key, k.agg.bytes(), protocol::dtype_name(k.agg.dtype()),
                                    meta.bytes, protocol::dtype_name(meta.dtype))));
    return;
  }
  if (!k.failed.ok()) {
    free_slot(shard, w.conn, meta.slot);
    send_error(w.conn, meta.tag, k.failed);
    return;
  }
  {
    MutexLock lock(stats_mu_);
    ++stats_.pushes;
  }
  const bool then_pull = (meta.flags & protocol::kPushThenPull) != 0;
  if (k.awaiting_final) {
    // Held, not taken: if this server dies before the transfer is final,
    // the worker still has the push to send to the old owner again.
    if (options_.sync == SyncMode::kBsp) {
      k.parked[meta.round].push_back(w);
    } else {
      k.deferred.push_back(w);
    }
    return;
  }
  // A plain push completes at the worker once taken here (reduced or kept);
  // replicated, once its round is durable at the backup.
  if (!then_pull && !w.taken) {
    if (replicated()) {
      k.unaccepted.push_back({w.conn, meta.tag, round});
    } else {
      shard.accepted[w.conn].push_back(meta.tag);
    }
    w.taken = true;
  }
  if (k.awaiting_state) {
    // Gained by migration: everything waits for the state (and a push_pull's
    // pull is queued when its push is processed again).
    if (options_.sync == SyncMode::kBsp) {
      k.parked[meta.round].push_back(w);
    } else {
      k.deferred.push_back(w);
    }
    return;
  }
  PullWork follow{w.conn, protocol::PullRequest{meta.pull_tag, meta.dtype, meta.bytes, meta.key,
                                                meta.round, meta.epoch}};

  if (meta.flags & protocol::kPushInit) {
    // The initial value, round 0: written into the parameter as is.
    Status st = k.agg.set_initial(shard.lane, w.data);
    if (st.ok()) pace_compute(k.agg.bytes());
    free_slot(shard, w.conn, meta.slot);
    if (!st.ok()) {
      fail_key(shard, k, st.with_context("the initial value"));
      send_error(w.conn, meta.tag, k.failed);
      return;
    }
    replicate(shard, k);
    if (then_pull) {
      follow.req.round = 0;
      if (pull_ready(k, follow.req)) {
        serve_pull(shard, k, follow);
      } else {
        k.waiting.push_back(follow);  // until the backup has the value
      }
    }
    return;
  }

  if (options_.sync == SyncMode::kBsp) {
    const Aggregator::Admission admission = k.agg.admit(w.worker, meta.round);
    if (admission == Aggregator::Admission::kApplied && k.taken_over &&
        meta.round == k.agg.version()) {
      // Sent again after a failover: the lost primary applied this round
      // and its copy holds it, so the push is done; its pull is answered.
      free_slot(shard, w.conn, meta.slot);
      accept_durable(shard, k);
      if (then_pull) k.waiting.push_back(follow);
      serve_ready_pulls(shard, k);
      return;
    }
    if (admission == Aggregator::Admission::kApplied) {
      free_slot(shard, w.conn, meta.slot);
      send_error(w.conn, meta.tag,
                 FailedPrecondition(fmt::format("round {} of key {:#x} was already applied",
                                                meta.round, meta.key)));
      return;
    }
    if (admission == Aggregator::Admission::kLater || k.apply_pending) {
      // A later round (or this one while its predecessor waits to apply):
      // keep the slot until the key gets there.
      k.parked[meta.round].push_back(w);
      return;
    }
    if (admission == Aggregator::Admission::kTwice) {
      free_slot(shard, w.conn, meta.slot);
      send_error(w.conn, meta.tag,
                 FailedPrecondition(fmt::format("worker {} pushed round {} of key {:#x} twice",
                                                w.worker, meta.round, meta.key)));
      return;
    }
    if (!reduce_push(shard, k, w)) return;
    if (then_pull) k.waiting.push_back(follow);
    if (k.agg.round_complete()) try_apply(shard, k);
    return;
  }

  // Async and bounded staleness: every push is applied on arrival, once no
  // pull write is reading the parameter.
  if (k.inflight > 0) {
    k.deferred.push_back(w);
    return;
  }
  if (!reduce_push(shard, k, w)) return;
  if (then_pull) k.waiting.push_back(follow);
  apply_round(shard, k);
}

void ServerService::try_apply(Shard& shard, KeyState& k) {
  if (k.inflight > 0 || !k.durable) {
    // Pull writes of the last round still read param, or its copy has not
    // reached the backup yet.
    k.apply_pending = true;
    return;
  }
  apply_round(shard, k);
}

// Turns the accumulator into the new parameter value, then serves what waited.
void ServerService::apply_round(Shard& shard, KeyState& k) {
  const auto start = transport::Clock::now();
  // Nothing to apply on a failed key: fail_key answered what waited.
  Status st = k.failed;
  if (st.ok()) st = k.agg.apply(shard.lane);
  if (!st.ok()) {
    fail_key(shard, k, st.with_context(fmt::format("applying round {}", k.agg.version() + 1)));
    return;
  }
  if (k.agg.swaps()) std::swap(k.out_region, k.acc_region);
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  load_->record(k.arc, LoadMetric::kRound, 1);
  {
    MutexLock lock(stats_mu_);
    ++stats_.rounds_applied;
  }
  // Before any pull of the round is answered: the coordinator seals a
  // checkpoint round once every worker pulled it (checkpointing.h).
  if (const uint32_t every = options_.checkpoint.every_rounds;
      every > 0 && options_.sync == SyncMode::kBsp && k.agg.version() % every == 0) {
    save_checkpoint(shard, k);
  }
  // Serve the pulls this round satisfies (replicated: once the backup has it).
  replicate(shard, k);
  accept_durable(shard, k);
  serve_ready_pulls(shard, k);
  maybe_ship(shard, k);
  // BSP: pushes parked for the next round can be reduced now.
  if (options_.sync == SyncMode::kBsp) release_parked(shard, k);
}

bool ServerService::pull_ready(const KeyState& k, const protocol::PullRequest& req) const {
  return k.durable && k.agg.pull_ready(req.round);
}

void ServerService::process_pull(Shard& shard, PullWork& w) {
  if (owner_for(w.req.key, w.req.round) != rank()) {
    if (wait_for_epoch(w.req.epoch, w.req.key, w)) return;
    send_moved(w.conn, w.req.tag, w.req.key);
    return;
  }
  KeyState& k = key_state(shard, w.req.key, w.req.dtype, w.req.bytes, w.req.round);
  if (k.agg.dtype() != w.req.dtype || k.agg.bytes() != w.req.bytes) {
    send_error(
        w.conn, w.req.tag,
        InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the pull asks {} of {}",
                                    w.req.key, k.agg.bytes(), protocol::dtype_name(k.agg.dtype()),
                                    w.req.bytes, protocol::dtype_name(w.req.dtype))));
    return;
  }
  if (!k.failed.ok()) {
    send_error(w.conn, w.req.tag, k.failed);
    return;
  }
  if (!k.awaiting_state && !k.awaiting_final && pull_ready(k, w.req)) {
    serve_pull(shard, k, w);
  } else {
    k.waiting.push_back(w);
  }
}

void ServerService::serve_pull(Shard& shard, KeyState& k, const PullWork& w) {
  (void)shard;
  std::shared_ptr<transport::RemoteRegion> remote;
  uint64_t base = 0;  // of the tensor in `remote`
  ConnectionPtr conn;
  {
    MutexLock lock(conns_mu_);
    auto it = conns_.find(w.conn);
    if (it == conns_.end()) return;  // the worker is gone
    conn = it->second->conn;
    auto t = it->second->tensors.find(key_tensor(w.req.key));
    if (t != it->second->tensors.end()) {
      remote = t->second.remote;
      base = t->second.offset;
    }
  }
  if (!remote) {
    send_error(w.conn, w.req.tag,
               FailedPrecondition(fmt::format("no TensorKey for tensor {} from this worker",
                                              key_tensor(w.req.key))));
    return;
  }
  if (!k.out_region) {
    send_error(w.conn, w.req.tag, Internal("the key's memory could not be registered"));
    return;
  }
  const uint64_t offset =
      base + static_cast<uint64_t>(key_chunk(w.req.key)) * session_.welcome().chunk_bytes;
  ++k.inflight;
  const Key key = w.req.key;
  const uint64_t run = k.owned_from;
  load_->begin_service();  // until the write completed
  Status s = conn->write({k.out_region.get(), 0, remote.get(), offset, k.agg.bytes(), w.req.tag},
                         [this, key, run](const Status&) {
                           load_->end_service();
                           dispatch(key, PullDone{key, run});
                         });
  if (!s.ok()) {
    --k.inflight;
    load_->end_service();
    send_error(w.conn, w.req.tag, s.with_context("pull write"));
    return;
  }
  load_->record(k.arc, LoadMetric::kBytesOut, static_cast<double>(k.agg.bytes()));
  MutexLock lock(stats_mu_);
  ++stats_.pulls;
  stats_.bytes_out += k.agg.bytes();
}

}  // namespace psld
