// Routing, the worker's side of placement and migration (docs/design.md §3, §7;
// docs/migration.md): each chunk sent to the server its epoch names, a
// Moved answer re-routed, epoch changes applied, the per-server pump and
// the issue of a chunk, and the progress report the low watermark is made of.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "gpu/cuda_copy_engine.h"
#include "kernels/dispatch.h"
#include "lib/worker/service.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

void WorkerService::route(ChunkOp op, std::optional<Clock::time_point> deadline) {
  const Tensor& t = tensors_[op.tensor];
  const Key key = make_key(t.id, op.chunk);
  // The initial value is round 0 of the key.
  const uint64_t round = op.kind == RequestKind::kInit ? 0 : op.round;
  const ServerId owner = epochs_->owner(key, round);
  auto it = servers_.find(owner);
  if (it == servers_.end()) {
    op.request->complete_part(Unavailable(fmt::format("no connection to server {}", owner)));
    return;
  }
  if (it->second.lost) {
    orphans_.push_back({std::move(op), owner, deadline ? *deadline : Clock::now() + orphan_grace(),
                        it->second.lost_why});
    return;
  }
  it->second.backlog.push_back(std::move(op));
}

void WorkerService::on_moved(ServerConn& s, const protocol::Moved& m) {
  std::optional<Pending> taken = take_operation(m.tag);  // a push_pull's pull: never answered
  if (!taken) return;
  Pending p = std::move(*taken);
  const uint64_t known = epochs_->latest().epoch();
  PSLD_LOG_DEBUG("worker {}: server {} says key {:#x} round {} moved (its epoch {}, ours {})",
                 rank(), s.rank, m.key, p.op.round, m.epoch, known);
  if (m.epoch > known) {
    // The server already knows the epoch that moved the key; it reaches
    // this worker with its commit.
    moved_.push_back({std::move(p.op), m.epoch});
    return;
  }
  const Tensor& t = tensors_[p.op.tensor];
  const uint64_t round = p.op.kind == RequestKind::kInit ? 0 : p.op.round;
  if (epochs_->owner(make_key(t.id, p.op.chunk), round) == s.rank) {
    p.op.request->complete_part(Moved(fmt::format(
        "key {:#x} is not on server {} in epoch {}, though this worker's epoch {} puts it there",
        m.key, s.rank, m.epoch, known)));
    return;
  }
  route(std::move(p.op));
  for (auto& [r, srv] : servers_)
    pump(srv);
}

void WorkerService::on_epoch_change(const protocol::EpochChange& change) {
  // A prepare and its cancel are the servers' business: a worker follows
  // committed epochs only.
  if (change.step == protocol::EpochStep::kPrepare || change.step == protocol::EpochStep::kCancel)
    return;
  {
    MutexLock lock(mu_);
    if (!epochs_) {
      early_epochs_.push_back(change);
      return;
    }
    auto next = epochs_->follow(change.epoch, change.delta);
    if (!next.ok()) {
      PSLD_LOG_ERROR("worker {}: {}", rank(), next.status().to_string());
      return;
    }
    epochs_->push(*next, change.switch_round);
    PSLD_LOG_DEBUG("worker {}: epoch {} from round {}", rank(), change.epoch, change.switch_round);
    if (change.step == protocol::EpochStep::kAbort ||
        change.step == protocol::EpochStep::kFailover) {
      // Also when its connection still looks fine (it hung): the epoch
      // routes nothing to it any more. A join in progress stops waiting for
      // it (connect_servers).
      removed_servers_.insert(change.lost_server);
      cv_.notify_all();
      auto lost = servers_.find(change.lost_server);
      if (lost != servers_.end()) {
        server_lost(lost->second,
                    Unavailable(fmt::format("server {} was removed from the job by the coordinator",
                                            change.lost_server)));
      }
    }
    // What waited for a lost server goes where this epoch says.
    std::vector<Orphan> orphans;
    orphans.swap(orphans_);
    for (auto& o : orphans)
      route(std::move(o.op), o.deadline);
    // What a server sent back for this epoch goes out again.
    std::vector<MovedOp> still;
    for (auto& m : moved_) {
      if (m.epoch <= change.epoch) {
        route(std::move(m.op));
      } else {
        still.push_back(std::move(m));
      }
    }
    moved_.swap(still);
    for (auto& [r, srv] : servers_)
      pump(srv);
  }
  flush();
}

void WorkerService::pump(ServerConn& s) {
  if (s.lost) return;
  while (!s.backlog.empty()) {
    ChunkOp& op = s.backlog.front();
    const bool needs_slot = op.kind != RequestKind::kPull && !in_place(s, op);
    if (needs_slot && s.free_slots.empty()) return;  // waits for Credit
    if (s.backlog.size() > 1 && batchable(op) && issue_batch(s)) continue;
    uint32_t slot = 0;
    if (needs_slot) {
      slot = s.free_slots.front();
      s.free_slots.pop_front();
    }
    ChunkOp next = std::move(op);
    s.backlog.pop_front();
    issue(s, next, slot);
  }
}

bool WorkerService::in_place(const ServerConn& s, const ChunkOp& op) const {
  // Only a push whose request completes with a pull: until then the tensor
  // is the library's, so the server may read it whenever the round lets it.
  if (op.kind != RequestKind::kPushPull && op.kind != RequestKind::kInit) return false;
  return s.mapped.count(tensors_[op.tensor].id) != 0;
}

std::optional<WorkerService::Pending> WorkerService::take_operation(uint32_t tag) {
  std::optional<Pending> taken = pending_.take(tag);
  if (taken && taken->other_tag != 0) pending_.erase(taken->other_tag);
  return taken;
}

uint32_t WorkerService::new_tag() {
  // 0 is no tag, and notify values from kAnswerBatch up are batches of answers.
  if (next_tag_ == 0 || next_tag_ >= protocol::kAnswerBatch) next_tag_ = 1;
  return next_tag_++;
}

bool WorkerService::batchable(const ChunkOp& op) const {
  if (!batch_pool_ || op.kind == RequestKind::kPull) return false;
  const Tensor& t = tensors_[op.tensor];
  return t.region->kind() == MemoryKind::kHost &&
         t.layout->chunk(op.chunk).bytes <= options_.batch_chunk_bytes;
}

protocol::PushMeta WorkerService::start_push(ServerConn& s, const ChunkOp& op, uint32_t slot,
                                             Clock::time_point now) {
  Tensor& t = tensors_[op.tensor];
  const ChunkSpan span = t.layout->chunk(op.chunk);
  const uint32_t push_tag = new_tag();
  uint32_t pull_tag = 0;
  uint8_t flags = 0;
  if (op.kind == RequestKind::kPushPull || op.kind == RequestKind::kInit) {
    pull_tag = new_tag();
    flags |= protocol::kPushThenPull;
    if (op.kind == RequestKind::kInit) flags |= protocol::kPushInit;
    pending_.put(push_tag, Pending{pull_tag, s.rank, now, op});
    pending_.put(pull_tag, Pending{push_tag, s.rank, now, op, /*lands=*/true});
  } else {
    // A plain push completes when the server says it took it (Credit).
    pending_.put(push_tag, Pending{0, s.rank, now, op});
  }
  if (in_place(s, op)) {
    flags |= protocol::kPushMapped;
    slot = protocol::kNoSlot;
  }
  return protocol::PushMeta{
      push_tag, slot,     t.dtype, span.key, op.round, span.bytes, epochs_->latest().epoch(),
      flags,    pull_tag, op.lr};
}

void WorkerService::count_pushed(ServerConn& s, uint64_t bytes) {
  loads_[s.rank].bytes_pushed += bytes;
  load_->record(s.rank, LoadMetric::kPushedBytes, static_cast<double>(bytes));
}

bool WorkerService::issue_batch(ServerConn& s) {
  const bool mapped = in_place(s, s.backlog.front());
  if (!mapped && (s.free_slots.empty() || free_batch_buffers_.empty())) return false;
  const uint64_t limit = std::min(batch_buffer_bytes_, s.slot_bytes);
  // Each entry's bytes start on a cache line of the buffer (and of the slot).
  auto aligned = [](uint64_t at) { return (at + 63) & ~uint64_t{63}; };
  // The batch takes the pushes that fit from the first kScan of the
  // backlog, in order, and leaves the others where they are: a model's
  // small tensors sit between its large ones. A key's pushes are all
  // batchable or none (one size, one tensor), so every key's rounds still
  // leave in order.
  constexpr size_t kScan = 4 * protocol::kMaxBatchEntries;
  // Scratch of every batch (under mu_), with their capacity.
  std::vector<size_t>& picked = batch_picked_;
  std::vector<ChunkOp>& ops = batch_ops_;
  std::vector<ChunkOp>& rest = batch_rest_;
  picked.clear();
  ops.clear();
  rest.clear();
  uint64_t end = 0;
  const size_t scan = std::min(s.backlog.size(), kScan);
  for (size_t i = 0; i < scan && picked.size() < protocol::kMaxBatchEntries; ++i) {
    const ChunkOp& op = s.backlog[i];
    if (!batchable(op) || in_place(s, op) != mapped) continue;
    if (!mapped) {
      const uint64_t bytes = tensors_[op.tensor].layout->chunk(op.chunk).bytes;
      if (aligned(end) + bytes > limit) continue;
      end = aligned(end) + bytes;
    }
    picked.push_back(i);
  }
  if (picked.size() < 2) return false;
  {
    // Only the scanned front is rearranged: what was not picked there goes
    // back in front of the rest, in its order.
    size_t next = 0;
    const size_t prefix = picked.back() + 1;
    for (size_t i = 0; i < prefix; ++i) {
      if (next < picked.size() && picked[next] == i) {
        ops.push_back(std::move(s.backlog.front()));
        ++next;
      } else {
        rest.push_back(std::move(s.backlog.front()));
      }
      s.backlog.pop_front();
    }
    for (auto it = rest.rbegin(); it != rest.rend(); ++it)
      s.backlog.push_front(std::move(*it));
    rest.clear();
  }
  const size_t n = ops.size();
  protocol::PushBatch batch;
  batch.epoch = epochs_->latest().epoch();
  uint32_t buffer = 0;
  if (!mapped) {
    batch.tag = new_tag();
    batch.slot = s.free_slots.front();
    s.free_slots.pop_front();
    buffer = free_batch_buffers_.back();
    free_batch_buffers_.pop_back();
  }
  // Where each entry's bytes are now, and where they go in the buffer.
  struct Gather {
    const uint8_t* from;
    uint64_t to;
    uint64_t bytes;
  };
  std::vector<Gather> gather;
  gather.reserve(mapped ? 0 : n);
  batch.entries.reserve(n);
  uint64_t at = 0;
  uint64_t pushed = 0;
  const auto now = Clock::now();
  for (const ChunkOp& op : ops) {
    const protocol::PushMeta meta = start_push(s, op, batch.slot, now);
    protocol::BatchEntry e{meta.tag,
                           meta.pull_tag,
                           meta.dtype,
                           meta.flags,
                           meta.key,
                           meta.round,
                           static_cast<uint32_t>(meta.bytes),
                           0,
                           meta.lr};
    if (!mapped) {
      const Tensor& t = tensors_[op.tensor];
      at = aligned(at);
      e.offset = static_cast<uint32_t>(at);
      gather.push_back(
          {t.region->data() + t.region_offset + t.layout->chunk(op.chunk).offset, at, meta.bytes});
      at += meta.bytes;
    }
    batch.entries.push_back(e);
    pushed += meta.bytes;
  }
  ops.clear();  // the pending operations hold the requests now
  count_pushed(s, pushed);
  transport::WriteRequest wr{batch_pool_.get(),
                             buffer * batch_buffer_bytes_,
                             s.slots.get(),
                             uint64_t{batch.slot} * s.slot_bytes,
                             at,
                             batch.tag};
  outbox_.push_back([this, conn = s.conn, batch = std::move(batch), gather = std::move(gather), wr,
                     slots = s.slots, mapped, buffer, rank = s.rank] {
    auto done = [this, conn, rank, batch, mapped, buffer](const Status& ws) {
      {
        MutexLock lock(mu_);
        if (!mapped) free_batch_buffers_.push_back(buffer);
        if (ws.ok()) return;
        for (const auto& e : batch.entries)
          op_failed(rank, conn, e.tag, ws);
      }
      flush();
    };
    if (!mapped) {
      uint8_t* base = batch_pool_->data() + wr.local_offset;
      for (const Gather& g : gather)
        std::memcpy(base + g.to, g.from, g.bytes);
    }
    Status st = send(conn, batch);
    if (st.ok() && !mapped) {
      st = conn->write(wr, done);
    } else if (st.ok()) {
      return;  // in place: the message is all
    }
    if (!st.ok()) done(st);
  });
  return true;
}

void WorkerService::issue(ServerConn& s, const ChunkOp& op, uint32_t slot) {
  Tensor& t = tensors_[op.tensor];
  const ChunkSpan span = t.layout->chunk(op.chunk);
  ConnectionPtr conn = s.conn;
  if (op.kind == RequestKind::kPull) {
    const uint32_t pull_tag = new_tag();
    pending_.put(pull_tag, Pending{0, s.rank, Clock::now(), op, /*lands=*/true});
    protocol::PullRequest pr{pull_tag, t.dtype,  span.bytes,
                             span.key, op.round, epochs_->latest().epoch()};
    outbox_.push_back([this, conn, pr, rank = s.rank] {
      Status st = send(conn, pr);
      if (!st.ok()) {
        {
          MutexLock lock(mu_);
          op_failed(rank, conn, pr.tag, st);
        }
        flush();
      }
    });
    return;
  }
  const protocol::PushMeta meta = start_push(s, op, slot, Clock::now());
  count_pushed(s, meta.bytes);
  slot = meta.slot;
  transport::WriteRequest wr{t.region.get(), t.region_offset + span.offset,
                             s.slots.get(),  slot * s.slot_bytes,
                             span.bytes,     meta.tag};
  auto region = t.region;  // kept alive by the lambda
  auto slots = s.slots;
  outbox_.push_back([this, conn, meta, wr, region, slots, rank = s.rank] {
    Status st = send(conn, meta);
    auto done = [this, conn, rank, tag = meta.tag](const Status& ws) {
      if (!ws.ok()) {
        {
          MutexLock lock(mu_);
          op_failed(rank, conn, tag, ws);
        }
        flush();
      }
    };
    // In place: the metadata is all; the server reads the chunk itself.
    if (st.ok() && !(meta.flags & protocol::kPushMapped)) st = conn->write(wr, done);
    if (!st.ok()) done(st);
  });
}

protocol::WorkerProgress WorkerService::progress() {
  MutexLock lock(mu_);
  // Per tensor id: a pull names the tensor's current round and a push the
  // next one, so no new request goes below the current round; what is in
  // flight (waiting for credit, an answer, an epoch or a lost server's
  // fate) may still be sent, again or for the first time, with its own.
  // An id this worker has not registered (it may yet) gets 0.
  TensorId last = 0;
  for (const auto& t : tensors_)
    last = std::max(last, t.id);
  std::vector<uint64_t> low(last, 0);
  for (const auto& t : tensors_)
    low[t.id - 1] = t.push_round;
  auto at = [&](const ChunkOp& op) REQUIRES(mu_) {
    uint64_t& r = low[tensors_[op.tensor].id - 1];
    r = std::min(r, op.round);
  };
  for (uint32_t tag : pending_.tags()) {
    if (const Pending* p = pending_.find(tag)) at(p->op);
  }
  for (const auto& [r, s] : servers_) {
    for (const auto& op : s.backlog)
      at(op);
  }
  for (const auto& m : moved_)
    at(m.op);
  for (const auto& o : orphans_)
    at(o.op);
  for (const auto& [tensor_round, n] : staging_) {
    uint64_t& r = low[tensors_[tensor_round.first].id - 1];
    r = std::min(r, tensor_round.second);
  }
  return {last, protocol::pack_rounds(low)};
}

}  // namespace psld
