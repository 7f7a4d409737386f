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
  // In place, in order: a vector a round per key cost an allocation and a
  // copy of every pull still waiting. serve_pull does not touch k.waiting.
  size_t kept = 0;
  for (size_t i = 0; i < k.waiting.size(); ++i) {
    if (pull_ready(k, k.waiting[i])) {
      serve_pull(shard, k, k.waiting[i]);
    } else {
      if (kept != i) k.waiting[kept] = k.waiting[i];
      ++kept;
    }
  }
  k.waiting.resize(kept);
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
  k.busy_ns += ns_since(start);  // recorded with the round (apply_round)
  if (trace_ && trace_->wants(w.meta.round)) {
    trace_->complete("reduce", "server", start, transport::Clock::now(),
                     fmt::format(R"("key":"{:#x}","worker":{},"round":{},"bytes":{})", k.key,
                                 w.worker, w.meta.round, w.meta.bytes));
  }
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
  if (held_for_epoch(meta.epoch, meta.key, w)) return;  // keeps its slot meanwhile
  const uint64_t round = (meta.flags & protocol::kPushInit) ? 0 : meta.round;
  const Ownership owns = shard_ownership(shard, meta.key, round);
  if (owns.owner != rank()) {
    free_slot(shard, w.conn, meta.slot);
    send_moved(w.conn, meta.tag, meta.key);
    return;
  }
  KeyState& k = key_state(shard, meta.key, meta.dtype, meta.bytes, round, false, &owns.gained);
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
  ++shard.counted.pushes;
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
    if (async_replicated()) {
      // Accepted once the version it makes is at the backup: recorded when
      // it is applied, below.
    } else if (replicated()) {
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
    if (async_replicated() && !then_pull) {
      // Accepted once the backup holds the value (BSP: recorded above).
      k.unaccepted.push_back({w.conn, meta.tag, k.agg.version()});
      accept_durable(shard, k);
    }
    if (then_pull) {
      follow.req.round = 0;
      if (pull_ready(k, follow)) {
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
  // pull write is reading the parameter (replicated: and once a key a
  // failover gave this server holds its copy).
  if (k.inflight > 0 ||
      (async_replicated() && k.agg.version() == 0 && !k.taken_over && awaiting_copy(k.key))) {
    k.deferred.push_back(w);
    return;
  }
  if (async_replicated() && k.agg.applied(w.worker, meta.round)) {
    // Sent again after a failover: the copy holds it already. Answered as
    // done, with the state as it is now, once that is at the backup.
    free_slot(shard, w.conn, meta.slot);
    answer_applied_push(shard, k, w, follow);
    return;
  }
  if (!reduce_push(shard, k, w)) return;
  // The pull, or the acceptance of a plain push, waits for the version this
  // push makes to reach the backup (replicated; at once otherwise).
  follow.min_version = k.agg.version() + 1;
  if (then_pull) k.waiting.push_back(follow);
  if (async_replicated() && !then_pull) {
    k.unaccepted.push_back({w.conn, meta.tag, k.agg.version() + 1});
  }
  apply_round(shard, k);
}

void ServerService::answer_applied_push(Shard& shard, KeyState& k, const PushWork& w,
                                        PullWork follow) {
  follow.min_version = k.agg.version();
  if ((w.meta.flags & protocol::kPushThenPull) != 0) {
    k.waiting.push_back(follow);
    serve_ready_pulls(shard, k);
  } else {
    k.unaccepted.push_back({w.conn, w.meta.tag, k.agg.version()});
    accept_durable(shard, k);
  }
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
  // The round's reduces and its update: one sample.
  load_->record_round(k.arc, k.busy_ns + ns_since(start));
  k.busy_ns = 0;
  if (trace_ && trace_->wants(k.agg.version())) {
    trace_->complete("update", "server", start, transport::Clock::now(),
                     fmt::format(R"("key":"{:#x}","round":{},"bytes":{})", k.key, k.agg.version(),
                                 k.agg.bytes()));
  }
  ++shard.counted.rounds_applied;
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

bool ServerService::pull_ready(const KeyState& k, const PullWork& w) const {
  if (async_replicated()) return k.acked > w.min_version && k.agg.pull_ready(w.req.round);
  return k.durable && k.agg.pull_ready(w.req.round);
}

void ServerService::process_pull(Shard& shard, PullWork& w) {
  if (held_for_epoch(w.req.epoch, w.req.key, w)) return;
  const Ownership owns = shard_ownership(shard, w.req.key, w.req.round);
  if (owns.owner != rank()) {
    send_moved(w.conn, w.req.tag, w.req.key);
    return;
  }
  KeyState& k =
      key_state(shard, w.req.key, w.req.dtype, w.req.bytes, w.req.round, false, &owns.gained);
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
  // Replicated async: what it reads must be at the backup first, unless
  // nobody wrote it: its zeros are what a new owner would hold too (but
  // not when a failover gave it here and its copy is still on its way).
  bool zeros = false;
  if (async_replicated()) {
    w.min_version = k.agg.version();
    zeros = !k.written && !k.taken_over && k.agg.version() == 0 && !awaiting_copy(k.key);
  }
  if (!k.awaiting_state && !k.awaiting_final && (zeros || pull_ready(k, w))) {
    serve_pull(shard, k, w);
  } else {
    k.waiting.push_back(w);
  }
}

void ServerService::serve_pull(Shard& shard, KeyState& k, const PullWork& w) {
  const uint64_t bytes = k.agg.bytes();
  const uint64_t in_tensor =
      static_cast<uint64_t>(key_chunk(w.req.key)) * session_.welcome().chunk_bytes;
  std::shared_ptr<transport::RemoteRegion> remote;
  uint64_t offset = 0;  // of the chunk in `remote`
  ConnectionPtr conn;
  uint64_t answer_slot_bytes = 0;  // 0: the worker takes no batched answer for it
  uint8_t* view = nullptr;         // set: the pull is copied to here (see below)
  bool known = false;              // the worker sent the tensor's TensorKey
  {
    MutexLock lock(conns_mu_);
    auto it = conns_.find(w.conn);
    if (it == conns_.end()) return;  // the worker is gone
    auto t = it->second->tensors.find(key_tensor(w.req.key));
    if (t != it->second->tensors.end() && t->second.remote) {
      known = true;
      offset = t->second.offset + in_tensor;
      const uint64_t length = t->second.remote->length();
      // A pull into memory this process maps (a worker on this host,
      // shared memory), whatever its size, is copied straight into the
      // tensor (below); it needs no connection. The region's reference is
      // held all the same: the mapping lives as long as the region, and a
      // worker that disconnects during the copy drops its own.
      remote = t->second.remote;
      if (t->second.view != nullptr && !device_ && options_.batch_chunk_bytes > 0 &&
          offset <= length && bytes <= length - offset) {
        view = const_cast<uint8_t*>(t->second.view);
      } else {
        conn = it->second->conn;
      }
      // Not into memory this server maps (a worker on this host over
      // shared memory): there a pull's own write is one memcpy, cheaper
      // than the batch's three.
      if (t->second.batched && t->second.view == nullptr && it->second->answer_slots)
        answer_slot_bytes = it->second->answer_slot_bytes;
    }
  }
  if (!known) {
    send_error(w.conn, w.req.tag,
               FailedPrecondition(fmt::format("no TensorKey for tensor {} from this worker",
                                              key_tensor(w.req.key))));
    return;
  }
  if (!k.out_region) {
    send_error(w.conn, w.req.tag, Internal("the key's memory could not be registered"));
    return;
  }
  if (answer_slot_bytes > 0 &&
      batch_answer(shard, k, w.conn, w.req.tag, remote, offset, answer_slot_bytes)) {
    return;
  }
  if (view != nullptr) {
    // Copied straight into the tensor, and its tag goes in the Credit that
    // ends this pass of the shard loop, one message for many answers instead
    // of a write and a notification each (measured 1.3-1.4x the goodput of
    // 64 KiB to 1 MiB push_pulls). The copy is visible to the worker once it
    // has the Credit (transport.h, local_view). With batches off
    // (data.batch_chunk_bytes = 0), each is written.
    std::memcpy(view + offset, k.out_region->data(), bytes);
    shard.accepted[w.conn].push_back(w.req.tag);
    load_->record(k.arc, LoadMetric::kBytesOut, static_cast<double>(bytes));
    ++shard.counted.pulls;
    ++shard.counted.answers_in_place;
    shard.counted.bytes_out += bytes;
    return;
  }
  ++k.inflight;
  const Key key = w.req.key;
  const uint64_t run = k.owned_from;
  load_->begin_service();  // until the write completed
  // This answer leaves now, not at the end of the pass: the pass's counts so
  // far, its own included, are folded first, so that whoever has the answer
  // sees them (shard_loop).
  ++shard.counted.pulls;
  shard.counted.bytes_out += bytes;
  fold_counts(shard);
  Status s = conn->write({k.out_region.get(), 0, remote.get(), offset, bytes, w.req.tag},
                         [this, key, run](const Status&) {
                           load_->end_service();
                           dispatch(key, PullDone{key, run});
                         });
  if (!s.ok()) {
    --k.inflight;
    load_->end_service();
    {
      MutexLock lock(stats_mu_);  // not answered after all
      --stats_.pulls;
      stats_.bytes_out -= bytes;
    }
    send_error(w.conn, w.req.tag, s.with_context("pull write"));
    return;
  }
  load_->record(k.arc, LoadMetric::kBytesOut, static_cast<double>(bytes));
}

bool ServerService::batch_answer(Shard& shard, KeyState& k, uint64_t conn, uint32_t tag,
                                 const std::shared_ptr<transport::RemoteRegion>& remote,
                                 uint64_t offset, uint64_t answer_slot_bytes) {
  const uint64_t bytes = k.agg.bytes();
  if (!answer_pool_ || device_ || bytes > options_.batch_chunk_bytes) return false;
  auto aligned = [](uint64_t at) { return (at + 63) & ~uint64_t{63}; };
  const uint64_t limit = std::min(answer_buffer_bytes_, answer_slot_bytes);
  if (protocol::kAnswerDataOffset + bytes > limit) return false;
  AnswerBatch& b = shard.answers[conn];
  if (b.buffer >= 0 &&
      (b.entries.size() == protocol::kMaxAnswerEntries || aligned(b.end) + bytes > b.limit)) {
    fold_counts(shard);  // a full batch leaves before the pass ends: its counts first
    flush_answer(conn, b);
  }
  if (b.buffer < 0) {
    MutexLock lock(answer_mu_);
    if (free_answer_buffers_.empty()) return false;
    b.buffer = free_answer_buffers_.back();
    free_answer_buffers_.pop_back();
    b.end = protocol::kAnswerDataOffset;
    b.limit = limit;
  }
  const uint64_t at = aligned(b.end);
  uint8_t* buffer = answer_pool_->data() + static_cast<uint64_t>(b.buffer) * answer_buffer_bytes_;
  // The answer is a copy: the key may change as soon as this returns.
  std::memcpy(buffer + at, k.out_region->data(), bytes);
  b.entries.push_back(
      {protocol::AnswerEntry{tag, static_cast<uint32_t>(at), static_cast<uint32_t>(bytes)}, remote,
       offset});
  b.end = at + bytes;
  load_->begin_service();  // until the batch's write completed
  load_->record(k.arc, LoadMetric::kBytesOut, static_cast<double>(bytes));
  ++shard.counted.pulls;
  shard.counted.bytes_out += bytes;
  return true;
}

void ServerService::flush_answers(Shard& shard) {
  for (auto& [conn, batch] : shard.answers)
    flush_answer(conn, batch);
  shard.answers.clear();
}

void ServerService::flush_answer(uint64_t conn_id, AnswerBatch& b) {
  if (b.buffer < 0 || b.entries.empty()) return;
  const uint32_t buffer = static_cast<uint32_t>(b.buffer);
  const uint64_t local = uint64_t{buffer} * answer_buffer_bytes_;
  const size_t n = b.entries.size();
  std::vector<AnswerBatch::Entry> entries;
  entries.swap(b.entries);
  const uint64_t end = b.end;
  b.buffer = -1;
  ConnectionPtr conn;
  std::shared_ptr<transport::RemoteRegion> slots;
  uint64_t slot_bytes = 0;
  std::optional<uint32_t> slot;
  {
    MutexLock lock(conns_mu_);
    auto it = conns_.find(conn_id);
    if (it != conns_.end()) {
      WorkerConn& w = *it->second;
      conn = w.conn;
      slots = w.answer_slots;
      slot_bytes = w.answer_slot_bytes;
      if (!w.free_answer_slots.empty() && end <= slot_bytes) {
        slot = w.free_answer_slots.front();
        w.free_answer_slots.pop_front();
      }
    }
  }
  // Once every write from the buffer completed: the buffer goes back and
  // each answer stops counting as in service.
  auto remaining = std::make_shared<std::atomic<size_t>>(slot ? 1 : n);
  auto release = [this, buffer, n, remaining]() {
    if (remaining->fetch_sub(1) != 1) return;
    for (size_t i = 0; i < n; ++i)
      load_->end_service();
    MutexLock lock(answer_mu_);
    free_answer_buffers_.push_back(buffer);
  };
  if (!conn) {  // the worker is gone
    *remaining = 1;
    release();
    return;
  }
  if (slot) {
    uint8_t* out = answer_pool_->data() + local;
    const protocol::AnswerHeader header{protocol::kAnswerMagic, static_cast<uint32_t>(n)};
    std::memcpy(out, &header, sizeof(header));
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(out + sizeof(header) + i * sizeof(protocol::AnswerEntry), &entries[i].entry,
                  sizeof(protocol::AnswerEntry));
    }
    Status st = conn->write({answer_pool_.get(), local, slots.get(), uint64_t{*slot} * slot_bytes,
                             end, protocol::kAnswerBatch | *slot},
                            [release, slots](const Status&) { release(); });
    if (!st.ok()) {
      release();
      for (const auto& e : entries)
        send_error(conn_id, e.entry.tag, st.with_context("pull write"));
      return;
    }
    MutexLock lock(stats_mu_);
    ++stats_.answer_batches;
    stats_.batched_answers += n;
    return;
  }
  // No answer slot free: each answer is written on its own, from the buffer.
  {
    MutexLock lock(stats_mu_);
    stats_.answers_alone += n;
  }
  for (const auto& e : entries) {
    Status st = conn->write({answer_pool_.get(), local + e.entry.offset, e.remote.get(),
                             e.remote_offset, e.entry.bytes, e.entry.tag},
                            [release, remote = e.remote](const Status&) { release(); });
    if (!st.ok()) {
      release();
      send_error(conn_id, e.entry.tag, st.with_context("pull write"));
    }
  }
}

}  // namespace psld
