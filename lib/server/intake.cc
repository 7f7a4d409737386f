// Intake, on the transport's progress thread: worker hellos and landing-slot
// grants, TensorKeys, PushMeta paired with its write, and the credits given
// back; work is queued to the key's shard.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "base/secret.h"
#include "lib/server/key_state.h"

namespace psld {

using transport::ConnectionPtr;

namespace {

// How far into its slot a batch's bytes reach: what its write carries.
uint64_t batch_extent(const protocol::PushBatch& batch) {
  uint64_t end = 0;
  for (const auto& e : batch.entries)
    end = std::max(end, uint64_t{e.offset} + e.bytes);
  return end;
}

}  // namespace

// The data handshake (protocol.h): PeerHello -> Challenge -> PeerProof ->
// Grant. Anything else before a good PeerProof is refused: the connection
// is told why and closed (Door).
void ServerService::admit(const ConnectionPtr& conn, const std::shared_ptr<WorkerConn>& w,
                          protocol::Message& message) {
  const std::string who = fmt::format("server {}", rank());
  auto refuse = [&](const std::string& why) {
    {
      MutexLock lock(conns_mu_);
      if (w->refused) return;
      w->refused = true;
    }
    (void)send(conn, protocol::Error{0, 0, static_cast<uint8_t>(StatusCode::kFailedPrecondition),
                                     who + " refused this connection: " + why});
    door_.refuse(who, conn, why);
  };
  const protocol::Welcome& job = session_.welcome();
  if (auto* hello = std::get_if<protocol::PeerHello>(&message)) {
    const uint32_t limit =
        hello->role == Role::kWorker ? job.num_workers : job.num_servers + job.num_standby;
    if (hello->rank >= limit) {
      return refuse(fmt::format("a hello from {} {}, which this job does not have",
                                role_name(hello->role), hello->rank));
    }
    protocol::Challenge challenge{protocol::make_nonce()};
    {
      MutexLock lock(conns_mu_);
      if (w->peer_hello || w->refused) return refuse("a second PeerHello");
      w->peer_hello = *hello;
      w->challenge = challenge.nonce;
    }
    (void)send(conn, challenge);
    return;
  }
  auto* proof = std::get_if<protocol::PeerProof>(&message);
  if (proof == nullptr) {
    return refuse(fmt::format("{} before the handshake (PeerHello, PeerProof) finished",
                              protocol::message_name(message)));
  }
  protocol::PeerHello hello;
  protocol::Nonce challenge{};
  {
    MutexLock lock(conns_mu_);
    if (!w->peer_hello || w->refused) return refuse("a PeerProof before its PeerHello");
    hello = *w->peer_hello;
    challenge = w->challenge;
  }
  if (!protocol::proofs_equal(proof->proof,
                              protocol::peer_proof(options_.secret, challenge, hello))) {
    return refuse(fmt::format("it does not know the job secret ({})", kSameSecretEverywhere));
  }
  protocol::Grant grant;
  if (hello.role == Role::kWorker) {
    const uint64_t slot_bytes = job.chunk_bytes;
    auto slots =
        transport().allocate_memory(options_.slots_per_worker * slot_bytes, MemoryKind::kHost);
    if (!slots.ok()) {
      send_error(conn->id(), 0, slots.status().with_context("allocating landing slots"));
      return;
    }
    PinnedRange pinned;
    if (device_) {
      uint8_t* base = (*slots)->data();
      Status st = device_->pin(base, options_.slots_per_worker * slot_bytes);
      if (st.ok()) {
        pinned = PinnedRange(base, Unpin{device_.get()});
      } else if (!pin_warned_.exchange(true)) {
        PSLD_LOG_WARN(
            "server {}: landing slots stay pageable, so pushes reach the GPU through the CUDA "
            "runtime's bounce buffer: {}",
            rank(), st.to_string());
      }
    }
    MutexLock lock(conns_mu_);
    w->pinned = std::move(pinned);
    w->slots = *slots;
    w->num_slots = options_.slots_per_worker;
    w->slot_bytes = slot_bytes;
    w->slot_busy.assign(w->num_slots, 0);
    grant = protocol::Grant{
        w->num_slots, slot_bytes,
        std::vector<uint8_t>(w->slots->remote_key().begin(), w->slots->remote_key().end())};
  }
  grant.proof = protocol::grant_proof(options_.secret, challenge, hello, grant);
  {
    MutexLock lock(conns_mu_);
    w->hello = true;
    w->role = hello.role;
    w->rank = hello.rank;
  }
  (void)send(conn, grant);
}

void ServerService::handle_worker_message(const ConnectionPtr& conn, protocol::Message& message) {
  std::shared_ptr<WorkerConn> w;
  {
    MutexLock lock(conns_mu_);
    auto it = conns_.find(conn->id());
    if (it == conns_.end()) return;
    w = it->second;
  }
  bool authenticated = false;
  Role peer_role = Role::kWorker;
  {
    MutexLock lock(conns_mu_);
    authenticated = w->hello;
    peer_role = w->role;
  }
  if (!authenticated) return admit(conn, w, message);
  if (std::holds_alternative<protocol::StateRequest>(message) ||
      std::holds_alternative<protocol::StateOffer>(message) ||
      std::holds_alternative<protocol::ReplicaOpen>(message)) {
    if (peer_role != Role::kServer) {
      send_error(conn->id(), 0,
                 FailedPrecondition(fmt::format("worker {} sent {}, which only servers send",
                                                w->rank, protocol::message_name(message))));
      return;
    }
  } else if (peer_role != Role::kWorker) {
    PSLD_LOG_WARN("server {}: server {} sent {}, which only workers send; ignored", rank(), w->rank,
                  protocol::message_name(message));
    return;
  }
  if (auto* req = std::get_if<protocol::StateRequest>(&message)) {
    // Another server took over this key and wants its state (migration).
    auto region = conn->import_region(req->region);
    if (!region.ok()) {
      PSLD_LOG_ERROR("server {}: a state request for key {:#x} with a bad region: {}", rank(),
                     req->key, region.status().to_string());
      return;
    }
    dispatch(req->key, StateWork{conn->id(), *req, *region});
    return;
  }
  if (auto* open = std::get_if<protocol::ReplicaOpen>(&message)) {
    // This server is the key's backup (replication).
    open_copy(conn, w->rank, *open);
    return;
  }
  if (auto* offer = std::get_if<protocol::StateOffer>(&message)) {
    // An old owner says a key it loses to this server reached the switch.
    if (offer->bytes == 0 || offer->bytes > session_.welcome().chunk_bytes ||
        offer->bytes % protocol::dtype_bytes(offer->dtype) != 0) {
      PSLD_LOG_WARN("server {}: a state offer for key {:#x} of an invalid size ignored", rank(),
                    offer->key);
      return;
    }
    dispatch(offer->key, Offered{*offer});
    return;
  }
  if (auto* batch = std::get_if<protocol::PushBatch>(&message)) {
    take_batch(conn, *w, *batch);
    return;
  }
  if (auto* answers = std::get_if<protocol::AnswerSlots>(&message)) {
    // Where this worker takes batches of answers to its small pulls.
    auto region = conn->import_region(answers->key);
    if (!region.ok() || (*region)->length() / answers->slot_bytes < uint64_t{answers->num_slots}) {
      send_error(conn->id(), 0,
                 region.ok() ? InvalidArgument("answer slots larger than their region")
                             : region.status().with_context("answer slots"));
      return;
    }
    MutexLock lock(conns_mu_);
    if (w->answer_slots) {
      PSLD_LOG_WARN("server {}: worker {} sent AnswerSlots twice; the second ignored", rank(),
                    w->rank);
      return;
    }
    w->answer_slots = *region;
    w->answer_slot_bytes = answers->slot_bytes;
    w->answer_num_slots = answers->num_slots;
    for (uint32_t i = 0; i < answers->num_slots; ++i)
      w->free_answer_slots.push_back(i);
    return;
  }
  if (auto* credit = std::get_if<protocol::Credit>(&message)) {
    // From a worker: answer slots it copied out.
    MutexLock lock(conns_mu_);
    const uint32_t slots = w->answer_num_slots;
    for (uint32_t slot : credit->slots) {
      if (slot < slots && w->free_answer_slots.size() < slots) w->free_answer_slots.push_back(slot);
    }
    return;
  }
  UniqueLock lock(conns_mu_);
  if (auto* key = std::get_if<protocol::TensorKey>(&message)) {
    auto remote = conn->import_region(key->key);
    if (!remote.ok()) {
      lock.unlock();
      send_error(conn->id(), 0, remote.status().with_context("tensor key"));
      return;
    }
    const uint8_t* view = transport().local_view(**remote);
    if (view != nullptr && key->offset > (*remote)->length()) view = nullptr;
    w->tensors[key->tensor] = {*remote, key->offset, view,
                               (key->flags & protocol::kTensorAnswersBatched) != 0};
    lock.unlock();
    (void)send(conn,
               protocol::Ack{key->request, view != nullptr ? protocol::kAckMapped : uint8_t{0}});
  } else if (auto* mapped = std::get_if<protocol::PushMeta>(&message);
             mapped != nullptr && (mapped->flags & protocol::kPushMapped)) {
    // Read in place from the worker's tensor: no slot, no write to wait for.
    note_round(mapped->round);
    std::optional<PushWork> work = mapped_work(conn->id(), *w, *mapped, transport::Clock::now());
    if (!work) {
      lock.unlock();
      send_error(conn->id(), mapped->tag,
                 InvalidArgument(fmt::format(
                     "an in-place push of {} bytes of key {:#x}: this server does not map that "
                     "much of the tensor's memory",
                     mapped->bytes, mapped->key)));
      return;
    }
    lock.unlock();
    {
      MutexLock stats(stats_mu_);
      ++stats_.pushes_in_place;
      stats_.bytes_in += work->meta.bytes;
    }
    load_->begin_service();
    dispatch(mapped->key, std::move(*work));
  } else if (auto* meta = std::get_if<protocol::PushMeta>(&message)) {
    // Before the push is looked at: an epoch prepared after this line sees it.
    note_round(meta->round);
    const uint32_t db = protocol::dtype_bytes(meta->dtype);
    if (meta->slot >= w->num_slots || meta->bytes == 0 || meta->bytes > w->slot_bytes ||
        meta->bytes % db != 0 || w->slot_busy[meta->slot]) {
      lock.unlock();
      send_error(
          conn->id(), meta->tag,
          InvalidArgument(fmt::format("push of {} bytes into slot {} is not valid (slots: "
                                      "{} of {} bytes)",
                                      meta->bytes, meta->slot, w->num_slots, w->slot_bytes)));
      return;
    }
    w->slot_busy[meta->slot] = 1;
    auto early = w->early.find(meta->tag);
    if (early == w->early.end()) {
      w->metas[meta->tag] = *meta;
      load_->begin_service();  // the push is arriving; its data follows
      return;
    }
    const uint64_t length = early->second;
    w->early.erase(early);
    PushWork work{conn->id(), *meta,   w->slots->data() + meta->slot * w->slot_bytes,
                  nullptr,    w->rank, transport::Clock::now()};
    work.slots = w->slots;
    lock.unlock();
    if (length != meta->bytes) {
      load_->end_service();
      send_error(conn->id(), meta->tag, DataLoss("push write length differs from its metadata"));
      return;
    }
    dispatch(meta->key, std::move(work));
  } else if (auto* pull = std::get_if<protocol::PullRequest>(&message)) {
    lock.unlock();
    if (pull->bytes == 0 || pull->bytes > session_.welcome().chunk_bytes ||
        pull->bytes % protocol::dtype_bytes(pull->dtype) != 0) {
      send_error(conn->id(), pull->tag, InvalidArgument("pull of an invalid size"));
      return;
    }
    dispatch(pull->key, PullWork{conn->id(), *pull, transport::Clock::now()});
  } else {
    lock.unlock();
    PSLD_LOG_WARN("server {}: unexpected {} from a worker", rank(),
                  protocol::message_name(message));
  }
}

std::optional<ServerService::PushWork> ServerService::mapped_work(
    uint64_t conn, const WorkerConn& w, const protocol::PushMeta& meta,
    transport::Clock::time_point arrived) {
  const uint64_t chunk = session_.welcome().chunk_bytes;
  auto t = w.tensors.find(key_tensor(meta.key));
  if (t == w.tensors.end() || t->second.view == nullptr || meta.bytes == 0 || meta.bytes > chunk ||
      meta.bytes % protocol::dtype_bytes(meta.dtype) != 0) {
    return std::nullopt;
  }
  const uint64_t at = t->second.offset + static_cast<uint64_t>(key_chunk(meta.key)) * chunk;
  const uint64_t length = t->second.remote->length();
  if (at > length || meta.bytes > length - at) return std::nullopt;
  return PushWork{conn, meta, t->second.view + at, t->second.remote, w.rank, arrived};
}

void ServerService::note_round(uint64_t round) {
  uint64_t seen = max_round_seen_.load();
  while (round > seen && !max_round_seen_.compare_exchange_weak(seen, round)) {
  }
}

void ServerService::take_batch(const ConnectionPtr& conn, WorkerConn& w,
                               protocol::PushBatch& batch) {
  // Before the pushes are looked at: an epoch prepared after this sees them.
  uint64_t highest = 0;
  for (const auto& e : batch.entries)
    highest = std::max(highest, e.round);
  note_round(highest);
  const size_t n = batch.entries.size();
  {
    MutexLock stats(stats_mu_);
    ++stats_.batches;
    stats_.batched_pushes += n;
  }
  if (batch.slot == protocol::kNoSlot) {
    // In place: each entry is read from the worker's tensor, as a mapped PushMeta.
    std::vector<PushWork> works;
    works.reserve(n);
    {
      MutexLock lock(conns_mu_);
      const auto arrived = transport::Clock::now();
      for (size_t i = 0; i < n; ++i) {
        std::optional<PushWork> work =
            mapped_work(conn->id(), w, protocol::entry_meta(batch, i), arrived);
        if (!work) {
          works.clear();
          break;
        }
        works.push_back(std::move(*work));
      }
    }
    if (works.size() != n) {
      refuse_batch(conn->id(), batch,
                   InvalidArgument("a batch of in-place pushes names memory this server does not "
                                   "map, or a chunk of an invalid size"),
                   /*counted=*/false);
      return;
    }
    {
      MutexLock stats(stats_mu_);
      stats_.pushes_in_place += n;
      for (const auto& work : works)
        stats_.bytes_in += work.meta.bytes;
    }
    load_->begin_service(works.size());
    dispatch_pushes(works);
    return;
  }
  std::optional<uint64_t> early;
  const uint8_t* base = nullptr;
  std::shared_ptr<transport::MemoryRegion> slot_region;
  {
    MutexLock lock(conns_mu_);
    bool valid = batch.slot < w.num_slots && w.slot_busy[batch.slot] == 0;
    for (size_t i = 0; valid && i < n; ++i) {
      const protocol::BatchEntry& e = batch.entries[i];
      const uint32_t db = protocol::dtype_bytes(e.dtype);
      valid = e.bytes != 0 && e.bytes % db == 0 && e.offset % db == 0 &&
              uint64_t{e.offset} + e.bytes <= w.slot_bytes;
    }
    if (valid) {
      w.slot_busy[batch.slot] = static_cast<uint32_t>(n);
      base = w.slots->data() + batch.slot * w.slot_bytes;
      slot_region = w.slots;
      auto it = w.early.find(batch.tag);
      if (it == w.early.end()) {
        load_->begin_service(n);  // the pushes are arriving; their data follows
        w.batches[batch.tag] = std::move(batch);
        return;
      }
      early = it->second;
      w.early.erase(it);
    }
  }
  if (!early) {
    uint32_t slots = 0;
    uint64_t slot_bytes = 0;
    {
      MutexLock lock(conns_mu_);
      slots = w.num_slots;
      slot_bytes = w.slot_bytes;
    }
    refuse_batch(conn->id(), batch,
                 InvalidArgument(fmt::format(
                     "a batch of {} pushes into slot {} is not valid (slots: {} of {} bytes)", n,
                     batch.slot, slots, slot_bytes)),
                 /*counted=*/false);
    return;
  }
  // The write came first (and counted one arrival).
  if (n > 1) load_->begin_service(n - 1);
  if (*early != batch_extent(batch)) {
    refuse_batch(conn->id(), batch, DataLoss("a batch's write length differs from its entries"),
                 /*counted=*/true);
    return;
  }
  {
    MutexLock s(stats_mu_);
    stats_.bytes_in += *early;
  }
  dispatch_batch(conn->id(), w.rank, slot_region, base, batch);
}

void ServerService::dispatch_batch(uint64_t conn, uint32_t worker,
                                   const std::shared_ptr<transport::MemoryRegion>& slots,
                                   const uint8_t* base, const protocol::PushBatch& batch) {
  const auto now = transport::Clock::now();
  std::vector<PushWork> works;
  works.reserve(batch.entries.size());
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    works.push_back(PushWork{conn, protocol::entry_meta(batch, i), base + batch.entries[i].offset,
                             nullptr, worker, now});
    works.back().slots = slots;
  }
  dispatch_pushes(works);
}

void ServerService::refuse_batch(uint64_t conn, const protocol::PushBatch& batch, const Status& why,
                                 bool counted) {
  if (counted) {
    for (size_t i = 0; i < batch.entries.size(); ++i)
      load_->end_service();
    if (batch.slot != protocol::kNoSlot) {
      MutexLock lock(conns_mu_);
      auto it = conns_.find(conn);
      if (it != conns_.end() && batch.slot < it->second->slot_busy.size())
        it->second->slot_busy[batch.slot] = 0;
    }
  }
  for (const auto& e : batch.entries)
    send_error(conn, e.tag, why);
}

void ServerService::on_write(const ConnectionPtr& conn, uint32_t tag, uint64_t length) {
  if (replicated() && copy_landed(conn, tag, length)) return;
  {
    UniqueLock lock(peers_mu_);
    auto it = incoming_.find({conn->id(), tag});
    if (it != incoming_.end()) {
      const auto [key, run] = it->second;
      incoming_.erase(it);
      lock.unlock();
      dispatch(key, StateArrived{key, run});
      return;
    }
  }
  UniqueLock lock(conns_mu_);
  auto it = conns_.find(conn->id());
  if (it == conns_.end()) return;
  WorkerConn& w = *it->second;
  if (auto batch = w.batches.find(tag); batch != w.batches.end()) {
    protocol::PushBatch b = std::move(batch->second);
    w.batches.erase(batch);
    const uint8_t* base = w.slots->data() + b.slot * w.slot_bytes;
    const uint32_t worker = w.rank;
    std::shared_ptr<transport::MemoryRegion> slot_region = w.slots;
    lock.unlock();
    if (length != batch_extent(b)) {
      refuse_batch(conn->id(), b, DataLoss("a batch's write length differs from its entries"),
                   /*counted=*/true);
      return;
    }
    {
      MutexLock s(stats_mu_);
      stats_.bytes_in += length;
    }
    dispatch_batch(conn->id(), worker, slot_region, base, b);
    return;
  }
  auto meta = w.metas.find(tag);
  if (meta == w.metas.end()) {
    // The write beat its metadata; it occupies a slot the worker holds
    // credit for, so there can be at most num_slots of these.
    if (w.early.size() >= w.num_slots) {
      lock.unlock();
      send_error(conn->id(), tag, ResourceExhausted("more unannounced writes than slots"));
      conn->close();
      return;
    }
    w.early[tag] = length;
    load_->begin_service();  // the push arrived; its metadata follows
    return;
  }
  PushWork work{conn->id(), meta->second, w.slots->data() + meta->second.slot * w.slot_bytes,
                nullptr,    w.rank,       transport::Clock::now()};
  work.slots = w.slots;
  w.metas.erase(meta);
  lock.unlock();
  if (length != work.meta.bytes) {
    load_->end_service();
    send_error(conn->id(), tag, DataLoss("push write length differs from its metadata"));
    return;
  }
  {
    MutexLock s(stats_mu_);
    stats_.bytes_in += length;
  }
  // The key first: the order in which arguments are evaluated is unspecified.
  const Key key = work.meta.key;
  dispatch(key, std::move(work));
}

size_t ServerService::shard_of(Key key) const {
  return mix64(key) % shards_.size();
}

void ServerService::dispatch(Key key, Work work) {
  Shard& shard = *shards_[shard_of(key)];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    shard.queue.push_back(std::move(work));
  }
  shard.cv.notify_one();
}

void ServerService::dispatch_pushes(std::vector<PushWork>& works) {
  for (size_t s = 0; s < shards_.size(); ++s) {
    Shard& shard = *shards_[s];
    bool any = false;
    {
      std::lock_guard<std::mutex> lock(shard.mu);
      for (PushWork& w : works) {
        if (shard_of(w.meta.key) != s) continue;
        shard.queue.push_back(std::move(w));
        any = true;
      }
    }
    if (any) shard.cv.notify_one();
  }
}

void ServerService::dispatch_all(const Work& work) {
  for (auto& shard : shards_) {
    {
      std::lock_guard<std::mutex> lock(shard->mu);
      shard->queue.push_back(work);
    }
    shard->cv.notify_one();
  }
}

// ---- Credits, from the shard threads: the slots they freed and the plain
// pushes they took, sent back once per batch.

void ServerService::free_slot(Shard& shard, uint64_t conn, uint32_t slot) {
  if (slot == protocol::kNoSlot) return;  // read in place: it took no slot
  {
    MutexLock lock(conns_mu_);
    auto it = conns_.find(conn);
    if (it != conns_.end() && slot < it->second->slot_busy.size()) {
      uint32_t& holders = it->second->slot_busy[slot];
      if (holders > 1) {
        --holders;  // other entries of its batch still read it
        return;
      }
      holders = 0;
    }
  }
  shard.credits[conn].push_back(slot);
}

void ServerService::flush_credits(Shard& shard) {
  // The lists stay in the maps between passes, emptied, with their capacity
  // (no allocation a pass once grown); a connection's go when it is gone.
  for (auto& [conn_id, tags] : shard.accepted) {
    if (!tags.empty()) shard.credits[conn_id];  // a credit message also for accepted pushes alone
  }
  for (auto it = shard.credits.begin(); it != shard.credits.end();) {
    const uint64_t conn_id = it->first;
    std::vector<uint32_t>& slots = it->second;
    auto acc = shard.accepted.find(conn_id);
    std::vector<uint32_t>* tags = acc != shard.accepted.end() ? &acc->second : nullptr;
    const size_t num_tags = tags != nullptr ? tags->size() : 0;
    if (slots.empty() && num_tags == 0) {
      ++it;
      continue;
    }
    ConnectionPtr conn = worker_connection(conn_id);
    if (!conn) {
      if (tags != nullptr) shard.accepted.erase(acc);
      it = shard.credits.erase(it);
      continue;
    }
    // At most 1024 entries a message: well inside a control message.
    constexpr size_t kPerMessage = 1024;
    size_t si = 0, ti = 0;
    while (si < slots.size() || ti < num_tags) {
      protocol::Credit credit;
      const size_t ns = std::min(slots.size() - si, kPerMessage);
      credit.slots.assign(slots.begin() + si, slots.begin() + si + ns);
      si += ns;
      const size_t nt = std::min(num_tags - ti, kPerMessage - ns);
      if (nt > 0) credit.accepted.assign(tags->begin() + ti, tags->begin() + ti + nt);
      ti += nt;
      (void)send(conn, std::move(credit));
    }
    slots.clear();
    if (tags != nullptr) tags->clear();
    ++it;
  }
}

}  // namespace psld
