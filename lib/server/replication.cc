// Replication, the server side (docs/replication.md): as a key's primary,
// a copy of its state at the backup after every change, acknowledged before
// any pull of it is answered; as a backup, the copies in two slots per key,
// and the keys of a lost primary taken over at a failover.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <vector>

#include "base/log.h"
#include "lib/server/key_state.h"

namespace psld {

using transport::ConnectionPtr;

namespace {

// A copy's header, the first kStateHeader bytes of a slot: {u64 version,
// u64 arrays}.
uint64_t copy_bytes(size_t elements, size_t arrays) {
  return kStateHeader + arrays * elements * sizeof(float);
}

}  // namespace

std::optional<ServerId> ServerService::backup_now() const {
  MutexLock lock(epoch_mu_);
  return backup_of(epochs_->latest(), rank());
}

void ServerService::replicate(Shard& shard, KeyState& k) {
  k.written = true;
  if (!replicated()) return;
  k.durable = false;
  push_replica(shard, k);
}

void ServerService::push_replica(Shard& shard, KeyState& k) {
  KeyState::Replica& r = k.replica;
  if (r.opening) return;  // the copy follows the grant
  if (r.writing) {
    r.dirty = true;  // the copy follows the ack of the one in flight
    return;
  }
  const std::optional<ServerId> backup = backup_now();
  if (!backup) {
    // The only server left: there is nowhere to copy to, and the job goes
    // on with one copy (docs/replication.md).
    now_durable(shard, k);
    return;
  }
  // A backup that could not be reached is not dialled again for every key:
  // the failover that removes it resyncs them all.
  if (unreachable_backup_.load() == static_cast<int64_t>(*backup)) return;
  ConnectionPtr conn = peer(*backup);
  if (!conn) {
    unreachable_backup_ = *backup;  // peer() said why
    return;
  }
  if (!r.granted || r.backup != *backup || r.conn != conn->id()) {
    r.granted = false;
    r.slots.reset();
    r.opening = true;
    protocol::ReplicaOpen open{0, k.key, k.agg.dtype(), k.agg.bytes(),
                               static_cast<uint8_t>(k.agg.state_arrays())};
    {
      MutexLock lock(replicas_mu_);
      open.tag = next_replica_tag_;
      next_replica_tag_ += kCopyPart + 1;
      if (next_replica_tag_ == 0) next_replica_tag_ = kCopyPart + 1;  // wrapped
      replica_opens_[{conn->id(), open.tag}] = {k.key, k.owned_from};
    }
    r.backup = *backup;
    r.conn = conn->id();
    r.tag = open.tag;
    Status st = send_peer(conn, open);
    if (!st.ok()) {
      r.opening = false;
      PSLD_LOG_ERROR("server {}: cannot open the copy of key {:#x} at server {}: {}", rank(), k.key,
                     *backup, st.to_string());
    }
    return;
  }
  const size_t arrays = k.agg.state_arrays();
  const uint64_t length = copy_bytes(k.agg.size(), arrays) + k.agg.seen_bytes();
  // A BSP sum key whose parameter is registered (the swap on apply) is
  // written to its slot straight from the parameter, with the header
  // written beside it: no staging copy. Nothing writes the parameter until
  // the write completed and the backup acknowledged it: the next round's
  // apply waits for both (inflight, durable), and pull writes only read
  // it. A round-0 copy (the initial value) is staged, as is every copy of
  // other keys.
  const bool direct = k.agg.swaps() && k.out_region && k.agg.version() > 0 && arrays == 1 &&
                      k.agg.seen_bytes() == 0 && k.out_region->length() == k.agg.bytes();
  const uint64_t staged = direct ? kStateHeader : length;
  if (!r.staging || r.staging->length() < staged) {
    auto staging = transport().allocate_memory(staged, MemoryKind::kHost);
    if (!staging.ok()) {
      fail_key(shard, k, staging.status().with_context("allocating the copy for the backup"));
      return;
    }
    r.staging = *staging;
  }
  uint8_t* out = r.staging->data();
  const uint64_t version = k.agg.version();
  const uint64_t header[2] = {version, arrays};
  std::memcpy(out, header, sizeof(header));
  if (!direct) {
    Status copied = k.agg.save(shard.lane, reinterpret_cast<float*>(out + kStateHeader), arrays);
    if (!copied.ok()) {
      fail_key(shard, k, copied.with_context("copying the state for the backup"));
      return;
    }
    // Async and staleness: which pushes of each worker the state holds.
    k.agg.save_seen(out + copy_bytes(k.agg.size(), arrays));
  }
  const uint32_t slot = r.slot;
  r.writing = true;
  r.dirty = false;
  r.version = version;
  r.slot ^= 1;
  const Key key = k.key;
  const uint64_t run = k.owned_from;
  const uint32_t tag = r.tag;
  auto staging = r.staging;
  auto slots = r.slots;
  const uint64_t at = slot * length;
  Status st;
  if (direct) {
    // The body first, then the header; the backup takes the copy once both
    // landed (copy_landed). The parameter is read until the body's write
    // completes, counted as a pull write is (inflight, PullDone).
    auto param = k.out_region;
    ++k.inflight;
    st = conn->write({param.get(), 0, slots.get(), at + kStateHeader, length - kStateHeader,
                      tag | kCopyBody | slot},
                     [this, param, slots, key, run, tag](const Status& s) {
                       if (!s.ok()) dispatch(key, ReplicaFailed{key, run, tag});
                       dispatch(key, PullDone{key, run});
                     });
    if (!st.ok()) --k.inflight;
  }
  if (st.ok()) {
    st =
        conn->write({staging.get(), 0, slots.get(), at, direct ? kStateHeader : length, tag + slot},
                    [this, staging, slots, key, run, tag](const Status& s) {
                      if (!s.ok()) dispatch(key, ReplicaFailed{key, run, tag});
                    });
  }
  if (!st.ok()) {
    r.writing = false;
    r.granted = false;
    PSLD_LOG_WARN("server {}: the copy of key {:#x} to server {} failed: {}", rank(), k.key,
                  r.backup, st.to_string());
    return;
  }
  ++shard.counted.copies;
  if (direct) ++shard.counted.copies_direct;
}

void ServerService::now_durable(Shard& shard, KeyState& k) {
  k.durable = true;
  k.acked = std::max(k.acked, k.agg.version() + 1);
  accept_durable(shard, k);
  serve_ready_pulls(shard, k);
  if (k.apply_pending && k.inflight == 0) {
    k.apply_pending = false;
    apply_round(shard, k);
  }
}

void ServerService::accept_durable(Shard& shard, KeyState& k) {
  // BSP: the rounds up to the key's, once it is durable. Async: the
  // versions the backup acknowledged (an entry's round is the version its
  // push made).
  const bool async = async_replicated();
  if (k.unaccepted.empty() || (!async && !k.durable)) return;
  const uint64_t through = async ? k.acked : k.agg.version() + 1;
  std::vector<KeyState::Unaccepted> still;
  for (const auto& u : k.unaccepted) {
    if (u.round < through) {
      shard.accepted[u.conn].push_back(u.tag);
    } else {
      still.push_back(u);
    }
  }
  k.unaccepted.swap(still);
}

void ServerService::handle(Shard& shard, const ReplicaGranted& w) {
  KeyState* k = find_run(shard, w.key, w.run);
  if (k == nullptr) return;
  KeyState::Replica& r = k->replica;
  if (!r.opening || r.tag != w.tag || r.conn != w.conn) return;  // superseded
  r.opening = false;
  r.granted = true;
  r.slots = w.slots;
  r.slot = 0;
  push_replica(shard, *k);
}

void ServerService::handle(Shard& shard, const ReplicaAcked& w) {
  KeyState* k = find_run(shard, w.key, w.run);
  if (k == nullptr) return;
  KeyState::Replica& r = k->replica;
  if (!r.writing || (w.tag & ~kCopyPart) != r.tag || w.version != r.version) return;  // stale
  r.writing = false;
  if (async_replicated()) {
    // The backup holds this version: what waited for it goes, also while
    // the next copy is taken (async pushes keep coming).
    k->acked = std::max(k->acked, w.version + 1);
    accept_durable(shard, *k);
    serve_ready_pulls(shard, *k);
  }
  if (r.dirty) {
    push_replica(shard, *k);
    return;
  }
  note_resynced(shard, k->key);
  if (!k->durable && r.version == k->agg.version()) now_durable(shard, *k);
}

void ServerService::handle(Shard& shard, const ReplicaFailed& w) {
  KeyState* k = find_run(shard, w.key, w.run);
  if (k == nullptr || k->replica.tag != w.tag) return;
  // The backup is gone (or its connection): the failover that the
  // coordinator publishes gives a new one, and Resync copies again.
  k->replica.writing = false;
  k->replica.granted = false;
  k->replica.slots.reset();
  PSLD_LOG_WARN(
      "server {}: the copy of key {:#x} did not reach server {}; it waits for a new backup", rank(),
      k->key, k->replica.backup);
}

void ServerService::note_resynced(Shard& shard, Key key) {
  if (shard.resync_epoch == 0 || !shard.resync.erase(key) || !shard.resync.empty()) return;
  std::optional<protocol::ReplicaSynced> report;
  {
    MutexLock lock(replicas_mu_);
    if (resync_epoch_ == shard.resync_epoch && resync_shards_left_ > 0 &&
        --resync_shards_left_ == 0) {
      report = protocol::ReplicaSynced{resync_epoch_};
    }
  }
  shard.resync_epoch = 0;
  if (report) {
    PSLD_LOG_INFO("server {}: every key it holds has a copy at its backup of epoch {}", rank(),
                  report->epoch);
    (void)session_.send_to_coordinator(*report);
  }
}

void ServerService::handle(Shard& shard, const Resync& w) {
  {
    MutexLock lock(replicas_mu_);
    if (resync_epoch_ != w.epoch) return;  // a newer failover came
  }
  const std::optional<ServerId> backup = backup_now();
  shard.resync_epoch = w.epoch;
  shard.resync.clear();
  for (auto& [key, runs] : shard.keys) {
    if (runs.empty()) continue;
    KeyState& k = *runs.back();
    // A key gained in a switch and not installed yet is copied once it is
    // (its first applied round, after this epoch).
    if (k.awaiting_state || owner_for(key, k.agg.version() + 1) != rank() || !k.failed.ok()) {
      continue;
    }
    if (backup && k.replica.granted && k.replica.backup == *backup && !k.replica.writing &&
        k.durable && !k.taken_over) {
      continue;  // its backup did not change
    }
    shard.resync.insert(key);
  }
  // Every key not yet copied to its backup of this epoch is copied now;
  // those in flight are copied again once their ack comes (dirty).
  const std::vector<Key> keys(shard.resync.begin(), shard.resync.end());
  for (Key key : keys) {
    KeyState& k = *shard.keys[key].back();
    if (k.replica.writing || k.replica.opening) {
      k.replica.dirty = true;
      if (!backup || k.replica.backup != *backup) {
        // In flight to the lost backup: its ack never comes.
        k.replica.writing = k.replica.opening = false;
        k.replica.granted = false;
      }
    }
    push_replica(shard, k);
  }
  if (!backup) shard.resync.clear();
  if (shard.resync.empty()) {
    shard.resync.insert(0);  // note_resynced's countdown, for a shard with nothing to copy
    note_resynced(shard, 0);
  }
}

bool ServerService::awaiting_copy(Key key) {
  MutexLock lock(replicas_mu_);
  return awaiting_copy_.count(key) != 0;
}

void ServerService::handle(Shard& shard, const TakeOver& w) {
  const ReplicaCopy& c = *w.copy;
  {
    MutexLock lock(replicas_mu_);
    awaiting_copy_.erase(c.key);
  }
  KeyState& k = key_state(shard, c.key, c.dtype, c.bytes, w.version + 1, /*from_replica=*/true);
  if (k.taken_over || k.agg.version() > 0) {
    if (async_replicated()) resume(shard, k);  // the pushes that waited for it
    return;
  }
  const uint8_t* slot = c.region->data() + static_cast<uint64_t>(w.slot) * c.slot_bytes;
  Status st = k.failed;
  if (st.ok()) {
    st = k.agg.restore(shard.lane, reinterpret_cast<const float*>(slot + kStateHeader), w.version,
                       w.version);
  }
  if (st.ok() && async_replicated()) {
    // Which pushes of each worker it holds: those sent again are taken once.
    const uint64_t seen_at = copy_bytes(k.agg.size(), k.agg.state_arrays());
    if (seen_at + k.agg.seen_bytes() > c.slot_bytes) {
      st = Internal(
          fmt::format("a copy of {} bytes holds no record of the pushes in it", c.slot_bytes));
    } else {
      k.agg.restore_seen(slot + seen_at);
    }
  }
  if (!st.ok()) {
    fail_key(shard, k,
             st.with_context(fmt::format("taking over the copy of server {}", c.primary)));
    return;
  }
  k.taken_over = true;
  {
    MutexLock lock(stats_mu_);
    ++stats_.states_in;
  }
  PSLD_LOG_DEBUG("server {}: key {:#x} of lost server {} taken over as of round {}", rank(), c.key,
                 c.primary, w.version);
  replicate(shard, k);
  // Pushes that came between this server's learning the epoch and the copy's
  // arrival here found a fresh state at round 0 and were parked as later
  // rounds. Now that the round is known, those of the round the copy holds
  // (sent again after the failover) are answered and the next round's are
  // reduced, as any parked push once its key gets there; left parked, the
  // worker whose push it was waited forever, and the round after it with it.
  std::vector<PushWork> again;
  while (!k.parked.empty() && k.parked.begin()->first <= k.agg.version()) {
    auto& pushes = k.parked.begin()->second;
    std::move(pushes.begin(), pushes.end(), std::back_inserter(again));
    k.parked.erase(k.parked.begin());
  }
  for (auto& p : again)
    process_push(shard, p);
  release_parked(shard, k);
  if (async_replicated()) resume(shard, k);  // the pushes that waited for the copy
}

std::vector<ServerService::TakeOver> ServerService::take_copies_of(ServerId lost,
                                                                   const Placement& now) {
  std::vector<TakeOver> take;
  MutexLock lock(replicas_mu_);
  for (auto it = copies_.begin(); it != copies_.end();) {
    const ReplicaCopy& c = *it->second;
    if (c.primary == lost) {
      if (c.committed >= 0 && now.owner_of_key(c.key) == rank()) {
        take.push_back({it->second, c.committed, c.version});
        // Async: no push of it may be applied to a fresh state before the
        // copy is installed (the caller holds epoch_mu_, so this is marked
        // in the same step as the epoch that gives the key here).
        if (async_replicated()) awaiting_copy_.insert(c.key);
      }
      it = copies_.erase(it);  // held by its TakeOver until installed
      continue;
    }
    // A copy of a live primary stays, even one this server no longer
    // backs up in this epoch: the primary may have read a later epoch
    // already that makes this server its backup again, and then it goes
    // on writing into the slots it was granted without opening them anew
    // (its backup "did not change"). Erasing them here left its writes
    // unrecognised and its rounds never durable. A copy goes when its
    // primary opens the key again (open_copy) or is lost.
    ++it;
  }
  return take;
}

void ServerService::on_failover(const protocol::EpochChange& change, std::vector<TakeOver> take) {
  for (auto& t : take) {
    const Key key = t.copy->key;
    dispatch(key, std::move(t));
  }
  resync(change.epoch);
}

void ServerService::on_backup_changed(uint64_t epoch) {
  PSLD_LOG_INFO("server {}: epoch {} gives it server {} as its backup; copying its keys there",
                rank(), epoch, backup_now().value_or(rank()));
  resync(epoch);
}

void ServerService::resync(uint64_t epoch) {
  {
    MutexLock lock(replicas_mu_);
    resync_epoch_ = epoch;
    resync_shards_left_ = shards_.size();
  }
  unreachable_backup_ = -1;
  dispatch_all(Resync{epoch});
}

void ServerService::open_copy(const ConnectionPtr& conn, ServerId primary,
                              const protocol::ReplicaOpen& open) {
  const uint32_t dbytes = protocol::dtype_bytes(open.dtype);
  const uint64_t chunk = session_.welcome().chunk_bytes;
  if (open.bytes == 0 || open.bytes > chunk || open.bytes % dbytes != 0) {
    send_error(conn->id(), 0,
               InvalidArgument(fmt::format("a copy of {} bytes of {} (chunks hold at most {})",
                                           open.bytes, protocol::dtype_name(open.dtype), chunk)));
    return;
  }
  auto c = std::make_shared<ReplicaCopy>();
  c->key = open.key;
  c->primary = primary;
  c->dtype = open.dtype;
  c->bytes = open.bytes;
  // Async and staleness copies end with which pushes of each worker they
  // hold.
  c->slot_bytes = copy_bytes(open.bytes / dbytes, open.arrays) +
                  Aggregator::seen_bytes(options_.sync, session_.welcome().num_workers);
  auto region = transport().allocate_memory(2 * c->slot_bytes, MemoryKind::kHost);
  if (!region.ok()) {
    send_error(conn->id(), 0, region.status().with_context("allocating a copy's slots"));
    return;
  }
  c->region = *region;
  {
    MutexLock lock(replicas_mu_);
    // A primary opens a key again after its connection changed: the old
    // slots go.
    for (auto it = copies_.begin(); it != copies_.end();) {
      it = it->second->key == open.key ? copies_.erase(it) : std::next(it);
    }
    copies_[{conn->id(), open.tag}] = c;
  }
  (void)send(conn, protocol::ReplicaGrant{open.tag, open.key,
                                          std::vector<uint8_t>(c->region->remote_key().begin(),
                                                               c->region->remote_key().end())});
}

bool ServerService::copy_landed(const ConnectionPtr& conn, uint32_t notify, uint64_t length) {
  uint64_t version = 0;
  {
    MutexLock lock(replicas_mu_);
    auto it = copies_.find({conn->id(), notify & ~kCopyPart});
    if (it == copies_.end()) return false;
    ReplicaCopy& c = *it->second;
    const int slot = static_cast<int>(notify & 1u);
    const CopyParts::Landed landed = c.landed.land(notify, length, c.slot_bytes);
    if (landed == CopyParts::Landed::kBad) {
      PSLD_LOG_ERROR("server {}: a copy of key {:#x} of {} bytes{}, its slot holds {}", rank(),
                     c.key, length, (notify & kCopyBody) != 0 ? " (its body)" : "", c.slot_bytes);
      return true;
    }
    if (landed == CopyParts::Landed::kPart) return true;  // the other part follows
    std::memcpy(&version, c.region->data() + static_cast<uint64_t>(slot) * c.slot_bytes,
                sizeof(version));
    c.committed = slot;
    c.version = version;
  }
  (void)send(conn, protocol::ReplicaAck{notify & ~kCopyBody, version});
  return true;
}

bool ServerService::handle_replica_answer(const ConnectionPtr& conn, protocol::Message& message) {
  uint32_t tag = 0;
  if (auto* g = std::get_if<protocol::ReplicaGrant>(&message)) {
    tag = g->tag;
  } else if (auto* a = std::get_if<protocol::ReplicaAck>(&message)) {
    tag = a->tag & ~kCopyPart;
  } else if (auto* e = std::get_if<protocol::Error>(&message)) {
    tag = e->tag;
  } else {
    return false;
  }
  std::pair<Key, uint64_t> target;
  {
    MutexLock lock(replicas_mu_);
    auto it = replica_opens_.find({conn->id(), tag});
    if (it == replica_opens_.end()) return false;
    target = it->second;
  }
  const auto [key, run] = target;
  if (auto* g = std::get_if<protocol::ReplicaGrant>(&message)) {
    auto slots = conn->import_region(g->region);
    if (!slots.ok()) {
      PSLD_LOG_ERROR("server {}: the backup's slots for key {:#x}: {}", rank(), key,
                     slots.status().to_string());
      return true;
    }
    ServerId backup = 0;
    {
      MutexLock lock(peers_mu_);
      for (const auto& [id, c] : peers_) {
        if (c->id() == conn->id()) backup = id;
      }
    }
    dispatch(key, ReplicaGranted{key, run, backup, conn->id(), tag, *slots});
  } else if (auto* a = std::get_if<protocol::ReplicaAck>(&message)) {
    dispatch(key, ReplicaAcked{key, run, a->tag, a->version});
  } else {
    PSLD_LOG_ERROR("server {}: the backup refused the copy of key {:#x}: {}", rank(), key,
                   std::get<protocol::Error>(message).message);
  }
  return true;
}

}  // namespace psld
