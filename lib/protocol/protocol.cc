#include "lib/protocol/protocol.h"

#include <fmt/format.h>
#include <cmath>

#include <algorithm>

#include "base/wire.h"

namespace psld::protocol {
namespace {

// ---- Field helpers: each read reports failure instead of reading past the end.

bool read_bytes(WireReader& r, std::vector<uint8_t>* out, size_t max) {
  std::span<const uint8_t> b;
  if (!r.blob(&b, max)) return false;
  out->assign(b.begin(), b.end());
  return true;
}

// The wire carries the public enums' values: changing one is a protocol
// change (kVersion). Role::kAuto (0) is never sent, and is refused.
static_assert(static_cast<uint8_t>(Role::kAuto) == 0);
static_assert(static_cast<uint8_t>(Role::kWorker) == 1);
static_assert(static_cast<uint8_t>(Role::kServer) == 2);
static_assert(static_cast<uint8_t>(Role::kCoordinator) == 3);
static_assert(static_cast<uint8_t>(DType::kFloat32) == 1);
static_assert(static_cast<uint8_t>(DType::kFloat16) == 2);
static_assert(static_cast<uint8_t>(DType::kBFloat16) == 3);

bool read_role(WireReader& r, Role* role) {
  uint8_t v = 0;
  if (!r.u8(&v) || v < 1 || v > 3) return false;
  *role = static_cast<Role>(v);
  return true;
}

// A DType's wire value: kFloat32, kFloat16 or kBFloat16.
bool valid_dtype(uint8_t v) {
  return v >= 1 && v <= 3;
}

bool read_dtype(WireReader& r, DType* d) {
  uint8_t v = 0;
  if (!r.u8(&v) || !valid_dtype(v)) return false;
  *d = static_cast<DType>(v);
  return true;
}

bool read_bool(WireReader& r, bool* b) {
  uint8_t v = 0;
  if (!r.u8(&v) || v > 1) return false;
  *b = v == 1;
  return true;
}

bool read_i32(WireReader& r, int32_t* v) {
  uint32_t u = 0;
  if (!r.u32(&u)) return false;
  *v = static_cast<int32_t>(u);
  return true;
}

// ---- One encode/decode pair per message.

template <size_t N>
bool read_array(WireReader& r, std::array<uint8_t, N>* out) {
  for (uint8_t& b : *out) {
    if (!r.u8(&b)) return false;
  }
  return true;
}

void put(WireWriter& w, const Challenge& m) {
  w.bytes(m.nonce);
}
bool get(WireReader& r, Challenge* m) {
  return read_array(r, &m->nonce);
}

void put(WireWriter& w, const Hello& m) {
  w.u8(static_cast<uint8_t>(m.role));
  w.u32(static_cast<uint32_t>(m.rank_hint));
  w.bytes(m.nonce);
  w.bytes(m.proof);
  w.blob(m.address);
  w.u32(m.pid);
  w.str(m.host);
}
bool get(WireReader& r, Hello* m) {
  return read_role(r, &m->role) && read_i32(r, &m->rank_hint) && m->rank_hint >= -1 &&
         read_array(r, &m->nonce) && read_array(r, &m->proof) &&
         read_bytes(r, &m->address, kMaxBlobBytes) && r.u32(&m->pid) &&
         r.str(&m->host, kMaxNameBytes);
}

void put(WireWriter& w, const Welcome& m) {
  w.u8(static_cast<uint8_t>(m.role));
  w.u32(m.rank);
  w.u32(m.num_workers);
  w.u32(m.num_servers);
  w.u32(m.num_standby);
  w.u64(m.chunk_bytes);
  w.u64(m.resume_round);
  w.bytes(m.proof);
}
bool get(WireReader& r, Welcome* m) {
  return read_role(r, &m->role) && r.u32(&m->rank) && r.u32(&m->num_workers) &&
         r.u32(&m->num_servers) && r.u32(&m->num_standby) && r.u64(&m->chunk_bytes) &&
         m->chunk_bytes > 0 && r.u64(&m->resume_round) && read_array(r, &m->proof);
}

void put(WireWriter& w, const Reject& m) {
  w.str(m.reason);
}
bool get(WireReader& r, Reject* m) {
  return r.str(&m->reason, kMaxReasonBytes);
}

void put(WireWriter& w, const ServerList& m) {
  w.u32(static_cast<uint32_t>(m.servers.size()));
  for (const auto& s : m.servers) {
    w.u32(s.rank);
    w.blob(s.address);
  }
}
bool get(WireReader& r, ServerList* m) {
  uint32_t n = 0;
  if (!r.u32(&n) || n > kMaxListEntries) return false;
  m->servers.resize(n);
  for (auto& s : m->servers) {
    if (!r.u32(&s.rank) || !read_bytes(r, &s.address, kMaxBlobBytes)) return false;
  }
  return true;
}

void put(WireWriter& w, const PlacementChunk& m) {
  w.u64(m.epoch);
  w.u32(m.index);
  w.u32(m.count);
  w.blob(m.bytes);
}
bool get(WireReader& r, PlacementChunk* m) {
  return r.u64(&m->epoch) && r.u32(&m->index) && r.u32(&m->count) && m->index < m->count &&
         read_bytes(r, &m->bytes, 8192);
}

void put(WireWriter& w, const RegisterTensor& m) {
  w.u64(m.request);
  w.str(m.name);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.bytes);
  w.u8(m.has_init ? 1 : 0);
}
bool get(WireReader& r, RegisterTensor* m) {
  return r.u64(&m->request) && r.str(&m->name, kMaxNameBytes) && !m->name.empty() &&
         read_dtype(r, &m->dtype) && r.u64(&m->bytes) && read_bool(r, &m->has_init);
}

void put(WireWriter& w, const TensorInfo& m) {
  w.u64(m.request);
  w.str(m.name);
  w.u32(m.id);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.bytes);
  w.u64(m.chunk_bytes);
  w.u64(m.round);
}
bool get(WireReader& r, TensorInfo* m) {
  return r.u64(&m->request) && r.str(&m->name, kMaxNameBytes) && r.u32(&m->id) &&
         read_dtype(r, &m->dtype) && r.u64(&m->bytes) && r.u64(&m->chunk_bytes) &&
         m->chunk_bytes > 0 && r.u64(&m->round);
}

void put(WireWriter& w, const BarrierEnter& m) {
  w.u64(m.barrier);
}
bool get(WireReader& r, BarrierEnter* m) {
  return r.u64(&m->barrier);
}
void put(WireWriter& w, const BarrierRelease& m) {
  w.u64(m.barrier);
}
bool get(WireReader& r, BarrierRelease* m) {
  return r.u64(&m->barrier);
}
void put(WireWriter& w, const Heartbeat& m) {
  w.u64(m.sequence);
}
bool get(WireReader& r, Heartbeat* m) {
  return r.u64(&m->sequence);
}
void put(WireWriter& w, const JobFailed& m) {
  w.str(m.reason);
}
bool get(WireReader& r, JobFailed* m) {
  return r.str(&m->reason, kMaxReasonBytes);
}
void put(WireWriter&, const Shutdown&) {}
bool get(WireReader&, Shutdown*) {
  return true;
}

void put(WireWriter& w, const LoadReport& m) {
  w.u8(static_cast<uint8_t>(m.role));
  w.u32(m.rank);
  w.u64(m.epoch);
  w.u64(m.window);
  w.u64(m.window_ns);
  w.u32(m.part);
  w.u32(m.parts);
  for (uint64_t v : {m.bytes_in, m.bytes_out, m.busy_ns, m.queue_p50_ns, m.queue_p99_ns, m.rounds,
                     m.lost_samples}) {
    w.u64(v);
  }
  w.u32(static_cast<uint32_t>(m.arcs.size()));
  for (const auto& a : m.arcs) {
    w.u64(a.lo);
    w.u64(a.bytes_in);
    w.u64(a.bytes_out);
    w.u64(a.busy_ns);
    w.u32(a.requests);
  }
  w.u32(static_cast<uint32_t>(m.peers.size()));
  for (const auto& p : m.peers) {
    w.u32(p.server);
    w.u64(p.bytes);
    w.u32(p.answers);
    w.u64(p.mean_ns);
    w.u64(p.p99_ns);
  }
}
bool get(WireReader& r, LoadReport* m) {
  if (!read_role(r, &m->role)) return false;
  if (!r.u32(&m->rank) || !r.u64(&m->epoch) || !r.u64(&m->window) || !r.u64(&m->window_ns) ||
      !r.u32(&m->part) || !r.u32(&m->parts) || m->parts == 0 || m->part >= m->parts) {
    return false;
  }
  for (uint64_t* v : {&m->bytes_in, &m->bytes_out, &m->busy_ns, &m->queue_p50_ns, &m->queue_p99_ns,
                      &m->rounds, &m->lost_samples}) {
    if (!r.u64(v)) return false;
  }
  uint32_t n = 0;
  if (!r.u32(&n) || n > kMaxLoadEntries) return false;
  m->arcs.resize(n);
  for (auto& a : m->arcs) {
    if (!r.u64(&a.lo) || !r.u64(&a.bytes_in) || !r.u64(&a.bytes_out) || !r.u64(&a.busy_ns) ||
        !r.u32(&a.requests)) {
      return false;
    }
  }
  if (!r.u32(&n) || n + m->arcs.size() > kMaxLoadEntries) return false;
  m->peers.resize(n);
  for (auto& p : m->peers) {
    if (!r.u32(&p.server) || !r.u64(&p.bytes) || !r.u32(&p.answers) || !r.u64(&p.mean_ns) ||
        !r.u64(&p.p99_ns)) {
      return false;
    }
  }
  return true;
}

void put(WireWriter& w, const PeerHello& m) {
  w.u8(static_cast<uint8_t>(m.role));
  w.u32(m.rank);
  w.bytes(m.nonce);
}
bool get(WireReader& r, PeerHello* m) {
  return read_role(r, &m->role) && m->role != Role::kCoordinator && r.u32(&m->rank) &&
         read_array(r, &m->nonce);
}

void put(WireWriter& w, const PeerProof& m) {
  w.bytes(m.proof);
}
bool get(WireReader& r, PeerProof* m) {
  return read_array(r, &m->proof);
}

// A worker's grant has slots; a server's has none (0, 0, no key).
void put(WireWriter& w, const Grant& m) {
  w.u32(m.num_slots);
  w.u64(m.slot_bytes);
  w.blob(m.slots_key);
  w.bytes(m.proof);
}
bool get(WireReader& r, Grant* m) {
  return r.u32(&m->num_slots) && m->num_slots <= kMaxListEntries && r.u64(&m->slot_bytes) &&
         (m->num_slots == 0) == (m->slot_bytes == 0) &&
         read_bytes(r, &m->slots_key, kMaxBlobBytes) && read_array(r, &m->proof);
}

void put(WireWriter& w, const TensorKey& m) {
  w.u64(m.request);
  w.u32(m.tensor);
  w.blob(m.key);
  w.u64(m.offset);
  w.u8(m.flags);
}
bool get(WireReader& r, TensorKey* m) {
  return r.u64(&m->request) && r.u32(&m->tensor) && read_bytes(r, &m->key, kMaxBlobBytes) &&
         r.u64(&m->offset) && r.u8(&m->flags) && (m->flags & ~kTensorAnswersBatched) == 0;
}

void put(WireWriter& w, const AnswerSlots& m) {
  w.u32(m.num_slots);
  w.u64(m.slot_bytes);
  w.blob(m.key);
}
bool get(WireReader& r, AnswerSlots* m) {
  return r.u32(&m->num_slots) && m->num_slots > 0 && m->num_slots <= kMaxListEntries &&
         r.u64(&m->slot_bytes) && m->slot_bytes > kAnswerDataOffset &&
         m->slot_bytes <= (uint64_t{1} << 30) && read_bytes(r, &m->key, kMaxBlobBytes);
}

void put(WireWriter& w, const Ack& m) {
  w.u64(m.request);
  w.u8(m.flags);
}
bool get(WireReader& r, Ack* m) {
  return r.u64(&m->request) && r.u8(&m->flags) && (m->flags & ~kAckMapped) == 0;
}

void put(WireWriter& w, const PushMeta& m) {
  w.u32(m.tag);
  w.u32(m.slot);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.key);
  w.u64(m.round);
  w.u64(m.bytes);
  w.u64(m.epoch);
  w.u8(m.flags);
  w.u32(m.pull_tag);
  w.f64(m.lr);
}
bool get(WireReader& r, PushMeta* m) {
  return r.u32(&m->tag) && r.u32(&m->slot) && read_dtype(r, &m->dtype) && r.u64(&m->key) &&
         r.u64(&m->round) && r.u64(&m->bytes) && r.u64(&m->epoch) && r.u8(&m->flags) &&
         (m->flags & ~(kPushInit | kPushThenPull | kPushMapped)) == 0 &&
         ((m->flags & kPushMapped) == 0 || (m->flags & kPushThenPull) != 0) &&
         r.u32(&m->pull_tag) && r.f64(&m->lr) && std::isfinite(m->lr) && m->lr >= 0;
}

// An entry is a fixed record (42 bytes), written and read as one run.
constexpr size_t kBatchEntryBytes = 4 + 4 + 1 + 1 + 8 + 8 + 4 + 4 + 8;
// A full batch and its header fit a control message (transport::kMaxMessageBytes, 8 KiB).
static_assert(kMaxBatchEntries * kBatchEntryBytes + 64 <= 8192);

void put(WireWriter& w, const PushBatch& m) {
  w.u32(m.tag);
  w.u32(m.slot);
  w.u64(m.epoch);
  w.u32(static_cast<uint32_t>(m.entries.size()));
  WireWriter::Fixed f = w.fixed(m.entries.size() * kBatchEntryBytes);
  for (const BatchEntry& e : m.entries) {
    f.u32(e.tag);
    f.u32(e.pull_tag);
    f.u8(static_cast<uint8_t>(e.dtype));
    f.u8(e.flags);
    f.u64(e.key);
    f.u64(e.round);
    f.u32(e.bytes);
    f.u32(e.offset);
    f.f64(e.lr);
  }
}
bool get(WireReader& r, PushBatch* m) {
  uint32_t n = 0;
  if (!r.u32(&m->tag) || !r.u32(&m->slot) || !r.u64(&m->epoch) || !r.u32(&n) || n == 0 ||
      n > kMaxBatchEntries) {
    return false;
  }
  // In place: no write, no slot, every entry a mapped push_pull.
  const bool mapped = m->slot == kNoSlot;
  if (mapped != (m->tag == 0)) return false;
  WireReader::Fixed f;
  if (!r.fixed(size_t{n} * kBatchEntryBytes, &f)) return false;
  m->entries.resize(n);
  for (BatchEntry& e : m->entries) {
    e.tag = f.u32();
    e.pull_tag = f.u32();
    const uint8_t dtype = f.u8();
    e.flags = f.u8();
    e.key = f.u64();
    e.round = f.u64();
    e.bytes = f.u32();
    e.offset = f.u32();
    e.lr = f.f64();
    if (!valid_dtype(dtype) || !std::isfinite(e.lr) || e.lr < 0) return false;
    e.dtype = static_cast<DType>(dtype);
    if ((e.flags & ~(kPushInit | kPushThenPull | kPushMapped)) != 0) return false;
    if (mapped != ((e.flags & kPushMapped) != 0)) return false;
    if (mapped && ((e.flags & kPushThenPull) == 0 || e.offset != 0)) return false;
  }
  return true;
}

void put(WireWriter& w, const PullRequest& m) {
  w.u32(m.tag);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.bytes);
  w.u64(m.key);
  w.u64(m.round);
  w.u64(m.epoch);
}
bool get(WireReader& r, PullRequest* m) {
  return r.u32(&m->tag) && read_dtype(r, &m->dtype) && r.u64(&m->bytes) && r.u64(&m->key) &&
         r.u64(&m->round) && r.u64(&m->epoch);
}

void put(WireWriter& w, const Credit& m) {
  for (const auto* list : {&m.slots, &m.accepted}) {
    w.u32(static_cast<uint32_t>(list->size()));
    WireWriter::Fixed f = w.fixed(4 * list->size());
    for (uint32_t v : *list)
      f.u32(v);
  }
}
bool get(WireReader& r, Credit* m) {
  for (auto* list : {&m->slots, &m->accepted}) {
    uint32_t n = 0;
    WireReader::Fixed f;
    if (!r.u32(&n) || n > kMaxListEntries || !r.fixed(size_t{4} * n, &f)) return false;
    list->resize(n);
    for (auto& v : *list)
      v = f.u32();
  }
  return true;
}

void put(WireWriter& w, const Moved& m) {
  w.u32(m.tag);
  w.u64(m.key);
  w.u64(m.epoch);
}
bool get(WireReader& r, Moved* m) {
  return r.u32(&m->tag) && r.u64(&m->key) && r.u64(&m->epoch);
}

void put(WireWriter& w, const Error& m) {
  w.u32(m.tag);
  w.u64(m.request);
  w.u8(m.code);
  w.str(m.message);
}
bool get(WireReader& r, Error* m) {
  return r.u32(&m->tag) && r.u64(&m->request) && r.u8(&m->code) &&
         m->code <= static_cast<uint8_t>(StatusCode::kInternal) &&
         r.str(&m->message, kMaxReasonBytes);
}

void put(WireWriter& w, const EpochChange& m) {
  w.u8(static_cast<uint8_t>(m.step));
  w.u64(m.epoch);
  w.u64(m.switch_round);
  w.blob(m.delta);
  w.u32(m.lost_server);
}
bool get(WireReader& r, EpochChange* m) {
  uint8_t step = 0;
  if (!r.u8(&step) || step > static_cast<uint8_t>(EpochStep::kCancel)) return false;
  m->step = static_cast<EpochStep>(step);
  return r.u64(&m->epoch) && r.u64(&m->switch_round) && read_bytes(r, &m->delta, kMaxDeltaBytes) &&
         r.u32(&m->lost_server);
}

void put(WireWriter& w, const EpochVote& m) {
  w.u64(m.epoch);
  w.u64(m.switch_round);
  w.u8(m.yes ? 1 : 0);
  w.u64(m.max_round);
}
bool get(WireReader& r, EpochVote* m) {
  return r.u64(&m->epoch) && r.u64(&m->switch_round) && read_bool(r, &m->yes) &&
         r.u64(&m->max_round);
}

void put(WireWriter& w, const StateRequest& m) {
  w.u32(m.tag);
  w.u64(m.key);
  w.u64(m.switch_round);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.bytes);
  w.blob(m.region);
}
bool get(WireReader& r, StateRequest* m) {
  return r.u32(&m->tag) && r.u64(&m->key) && r.u64(&m->switch_round) && m->switch_round > 0 &&
         read_dtype(r, &m->dtype) && r.u64(&m->bytes) && read_bytes(r, &m->region, kMaxBlobBytes);
}

void put(WireWriter& w, const StateOffer& m) {
  w.u64(m.key);
  w.u64(m.switch_round);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.bytes);
}
bool get(WireReader& r, StateOffer* m) {
  return r.u64(&m->key) && r.u64(&m->switch_round) && m->switch_round > 0 &&
         read_dtype(r, &m->dtype) && r.u64(&m->bytes);
}

void put(WireWriter& w, const TransferDone& m) {
  w.u64(m.epoch);
  w.u64(m.switch_round);
  w.u64(m.late_keys);
}
bool get(WireReader& r, TransferDone* m) {
  return r.u64(&m->epoch) && r.u64(&m->switch_round) && r.u64(&m->late_keys);
}

void put(WireWriter& w, const EpochFinal& m) {
  w.u64(m.epoch);
  w.u64(m.switch_round);
}
bool get(WireReader& r, EpochFinal* m) {
  return r.u64(&m->epoch) && r.u64(&m->switch_round);
}

void put_rounds(WireWriter& w, uint32_t tensors, const std::vector<TensorRounds>& low) {
  w.u32(tensors);
  w.u32(static_cast<uint32_t>(low.size()));
  for (const auto& r : low) {
    w.u32(r.first_tensor);
    w.u64(r.round);
  }
}
// Ranges start at tensor 1, rise strictly and stay within `tensors`.
bool get_rounds(WireReader& r, uint32_t* tensors, std::vector<TensorRounds>* low) {
  uint32_t n = 0;
  if (!r.u32(tensors) || !r.u32(&n) || n > kMaxRoundRanges || (n > 0) != (*tensors > 0)) {
    return false;
  }
  low->resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto& e = (*low)[i];
    if (!r.u32(&e.first_tensor) || !r.u64(&e.round)) return false;
    const uint64_t min = i == 0 ? 1 : uint64_t{(*low)[i - 1].first_tensor} + 1;
    if (e.first_tensor < min || e.first_tensor > *tensors || (i == 0 && e.first_tensor != 1)) {
      return false;
    }
  }
  return true;
}

void put(WireWriter& w, const WorkerProgress& m) {
  put_rounds(w, m.tensors, m.low);
}
bool get(WireReader& r, WorkerProgress* m) {
  return get_rounds(r, &m->tensors, &m->low);
}

void put(WireWriter& w, const LowWatermark& m) {
  put_rounds(w, m.tensors, m.low);
}
bool get(WireReader& r, LowWatermark* m) {
  return get_rounds(r, &m->tensors, &m->low);
}

void put(WireWriter& w, const CheckpointSeal& m) {
  w.u64(m.round);
}
bool get(WireReader& r, CheckpointSeal* m) {
  return r.u64(&m->round) && m->round > 0;
}

void put(WireWriter& w, const CheckpointSealed& m) {
  w.u64(m.round);
  w.u64(m.bytes);
  w.u64(m.records);
  w.str(m.blake2b);
  w.str(m.error);
}
bool get(WireReader& r, CheckpointSealed* m) {
  return r.u64(&m->round) && m->round > 0 && r.u64(&m->bytes) && r.u64(&m->records) &&
         r.str(&m->blake2b, 64) &&
         std::all_of(m->blake2b.begin(), m->blake2b.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }) &&
         r.str(&m->error, kMaxReasonBytes);
}

void put_ranks(WireWriter& w, const std::vector<uint32_t>& ranks) {
  w.u32(static_cast<uint32_t>(ranks.size()));
  for (uint32_t r : ranks)
    w.u32(r);
}
// At most kMaxMissingListed ranks, ascending.
bool get_ranks(WireReader& r, std::vector<uint32_t>* ranks) {
  uint32_t n = 0;
  if (!r.u32(&n) || n > kMaxMissingListed) return false;
  ranks->resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.u32(&(*ranks)[i]) || (i > 0 && (*ranks)[i] <= (*ranks)[i - 1])) return false;
  }
  return true;
}

void put(WireWriter& w, const JoinWaiting& m) {
  w.u32(m.workers_joined);
  w.u32(m.servers_joined);
  put_ranks(w, m.missing_workers);
  put_ranks(w, m.missing_servers);
}
bool get(WireReader& r, JoinWaiting* m) {
  return r.u32(&m->workers_joined) && r.u32(&m->servers_joined) &&
         get_ranks(r, &m->missing_workers) && get_ranks(r, &m->missing_servers);
}

void put(WireWriter& w, const ReplicaOpen& m) {
  w.u32(m.tag);
  w.u64(m.key);
  w.u8(static_cast<uint8_t>(m.dtype));
  w.u64(m.bytes);
  w.u8(m.arrays);
}
bool get(WireReader& r, ReplicaOpen* m) {
  return r.u32(&m->tag) && m->tag % 2 == 0 && r.u64(&m->key) && read_dtype(r, &m->dtype) &&
         r.u64(&m->bytes) && r.u8(&m->arrays) && m->arrays >= 1 && m->arrays <= 3;
}

void put(WireWriter& w, const ReplicaGrant& m) {
  w.u32(m.tag);
  w.u64(m.key);
  w.blob(m.region);
}
bool get(WireReader& r, ReplicaGrant* m) {
  return r.u32(&m->tag) && r.u64(&m->key) && read_bytes(r, &m->region, kMaxBlobBytes);
}

void put(WireWriter& w, const ReplicaAck& m) {
  w.u32(m.tag);
  w.u64(m.version);
}
bool get(WireReader& r, ReplicaAck* m) {
  return r.u32(&m->tag) && r.u64(&m->version);
}

void put(WireWriter& w, const ReplicaSynced& m) {
  w.u64(m.epoch);
}
bool get(WireReader& r, ReplicaSynced* m) {
  return r.u64(&m->epoch);
}

// The wire type of each alternative of Message, in variant order.
constexpr Type kTypes[] = {
    Type::kChallenge,
    Type::kHello,
    Type::kWelcome,
    Type::kReject,
    Type::kServerList,
    Type::kPlacementChunk,
    Type::kRegisterTensor,
    Type::kTensorInfo,
    Type::kBarrierEnter,
    Type::kBarrierRelease,
    Type::kHeartbeat,
    Type::kJobFailed,
    Type::kShutdown,
    Type::kLoadReport,
    Type::kPeerHello,
    Type::kGrant,
    Type::kTensorKey,
    Type::kPushMeta,
    Type::kPullRequest,
    Type::kCredit,
    Type::kMoved,
    Type::kError,
    Type::kAck,
    Type::kEpochChange,
    Type::kEpochVote,
    Type::kStateRequest,
    Type::kStateOffer,
    Type::kTransferDone,
    Type::kEpochFinal,
    Type::kWorkerProgress,
    Type::kLowWatermark,
    Type::kPeerProof,
    Type::kCheckpointSeal,
    Type::kCheckpointSealed,
    Type::kJoinWaiting,
    Type::kReplicaOpen,
    Type::kReplicaGrant,
    Type::kReplicaAck,
    Type::kReplicaSynced,
    Type::kPushBatch,
    Type::kAnswerSlots,
};
static_assert(std::size(kTypes) == std::variant_size_v<Message>);

constexpr const char* kNames[] = {
    "Challenge",
    "Hello",
    "Welcome",
    "Reject",
    "ServerList",
    "Placement",
    "RegisterTensor",
    "TensorInfo",
    "BarrierEnter",
    "BarrierRelease",
    "Heartbeat",
    "JobFailed",
    "Shutdown",
    "LoadReport",
    "PeerHello",
    "Grant",
    "TensorKey",
    "PushMeta",
    "PullRequest",
    "Credit",
    "Moved",
    "Error",
    "Ack",
    "EpochChange",
    "EpochVote",
    "StateRequest",
    "StateOffer",
    "TransferDone",
    "EpochFinal",
    "WorkerProgress",
    "LowWatermark",
    "PeerProof",
    "CheckpointSeal",
    "CheckpointSealed",
    "JoinWaiting",
    "ReplicaOpen",
    "ReplicaGrant",
    "ReplicaAck",
    "ReplicaSynced",
    "PushBatch",
    "AnswerSlots",
};
static_assert(std::size(kNames) == std::variant_size_v<Message>);

template <size_t I = 0>
Result<Message> decode_as(uint16_t type, WireReader& r) {
  if constexpr (I == std::variant_size_v<Message>) {
    return DataLoss(fmt::format("unknown message type {}", type));
  } else {
    if (static_cast<uint16_t>(kTypes[I]) != type) return decode_as<I + 1>(type, r);
    std::variant_alternative_t<I, Message> m;
    if (!get(r, &m)) return DataLoss(fmt::format("malformed {} message", kNames[I]));
    if (!r.done()) {
      return DataLoss(fmt::format("{} message has {} trailing bytes", kNames[I], r.remaining()));
    }
    return Message(std::move(m));
  }
}

}  // namespace

PushMeta entry_meta(const PushBatch& batch, size_t i) {
  const BatchEntry& e = batch.entries[i];
  return PushMeta{e.tag,   batch.slot,  e.dtype, e.key,      e.round,
                  e.bytes, batch.epoch, e.flags, e.pull_tag, e.lr};
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "unknown";
}

std::string_view epoch_step_name(EpochStep step) {
  switch (step) {
    case EpochStep::kPrepare:
      return "prepare";
    case EpochStep::kCommit:
      return "commit";
    case EpochStep::kAbort:
      return "abort";
    case EpochStep::kFailover:
      return "failover";
    case EpochStep::kCancel:
      return "cancel";
  }
  return "unknown";
}

uint32_t dtype_bytes(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

std::vector<TensorRounds> pack_rounds(std::span<const uint64_t> by_tensor) {
  // Ranges of `group` tensors each, neighbours of the same round merged; the
  // group grows until they fit (1 whenever every tensor fits on its own).
  const size_t n = by_tensor.size();
  for (size_t group = 1;; group *= 2) {
    std::vector<TensorRounds> out;
    for (size_t i = 0; i < n && out.size() <= kMaxRoundRanges; i += group) {
      const size_t end = std::min(n, i + group);
      const uint64_t round = *std::min_element(by_tensor.begin() + i, by_tensor.begin() + end);
      if (out.empty() || out.back().round != round) {
        out.push_back({static_cast<uint32_t>(i + 1), round});
      }
    }
    if (out.size() <= kMaxRoundRanges) return out;
  }
}

uint64_t round_of(std::span<const TensorRounds> ranges, uint32_t tensors, TensorId t) {
  if (t == 0 || t > tensors) return 0;
  auto it = std::upper_bound(ranges.begin(), ranges.end(), t,
                             [](TensorId v, const TensorRounds& r) { return v < r.first_tensor; });
  return it == ranges.begin() ? 0 : std::prev(it)->round;
}

namespace {
void put_message(WireWriter& w, const Message& message) {
  w.u16(static_cast<uint16_t>(kTypes[message.index()]));
  w.u16(kVersion);
  std::visit([&](const auto& m) { put(w, m); }, message);
}
}  // namespace

std::vector<uint8_t> encode(const Message& message) {
  // Room for the messages of every chunk (a PushMeta, a Credit, a batch of a
  // few entries) without growing.
  WireWriter w(256);
  put_message(w, message);
  return w.take();
}

void encode_to(const Message& message, std::vector<uint8_t>& out) {
  WireWriter w(std::move(out));
  put_message(w, message);
  out = w.take();
}

Result<Message> decode(std::span<const uint8_t> bytes) {
  WireReader r(bytes);
  uint16_t type = 0, version = 0;
  if (!r.u16(&type) || !r.u16(&version)) {
    return DataLoss(fmt::format("message of {} bytes is shorter than its header", bytes.size()));
  }
  if (version != kVersion) {
    return DataLoss(fmt::format(
        "protocol version {} is not supported (this build speaks {}): run the same psld "
        "version everywhere",
        version, kVersion));
  }
  return decode_as(type, r);
}

std::string_view message_name(const Message& message) {
  return kNames[message.index()];
}

namespace {

// "worker 2", "workers 2 and 3", "servers 0, 1, ..., 15 and 9 more"; ""
// for none. `missing` is the count, `listed` its lowest ranks.
std::string ranks_text(const char* role, const std::vector<uint32_t>& listed, uint32_t missing) {
  if (missing == 0 || listed.empty()) return "";
  std::string out = fmt::format("{}{} ", role, missing == 1 ? "" : "s");
  const bool more = missing > listed.size();
  for (size_t i = 0; i < listed.size(); ++i) {
    if (i > 0) out += (i + 1 == listed.size() && !more) ? " and " : ", ";
    out += std::to_string(listed[i]);
  }
  if (more) out += fmt::format(" and {} more", missing - listed.size());
  return out;
}

}  // namespace

std::string waiting_for(const JoinWaiting& w, uint32_t num_workers, uint32_t num_servers) {
  const uint32_t workers = num_workers > w.workers_joined ? num_workers - w.workers_joined : 0;
  const uint32_t servers = num_servers > w.servers_joined ? num_servers - w.servers_joined : 0;
  const std::string a = ranks_text("worker", w.missing_workers, workers);
  const std::string b = ranks_text("server", w.missing_servers, servers);
  if (a.empty() && b.empty()) return "";
  return fmt::format("{}{}{} ({} of {} workers and {} of {} servers joined)", a,
                     a.empty() || b.empty() ? "" : " and ", b, w.workers_joined, num_workers,
                     w.servers_joined, num_servers);
}

namespace {

// A message's encoding with its proof zeroed: what its proof binds.
template <typename M>
std::vector<uint8_t> claims(M m) {
  m.proof = Proof{};
  return encode(m);
}

}  // namespace

Proof hello_proof(const std::string& secret, const Nonce& challenge, const Hello& hello) {
  const auto c = claims(hello);
  return prove(secret, {"member", Side::kDialer, &challenge, &hello.nonce, c});
}

Proof welcome_proof(const std::string& secret, const Nonce& challenge, const Hello& hello,
                    const Welcome& welcome) {
  // The hello too: a Welcome answers that hello and no other.
  auto c = claims(hello);
  const auto w = claims(welcome);
  c.insert(c.end(), w.begin(), w.end());
  return prove(secret, {"member", Side::kAcceptor, &challenge, &hello.nonce, c});
}

Proof peer_proof(const std::string& secret, const Nonce& challenge, const PeerHello& hello) {
  const auto c = encode(hello);
  return prove(secret, {"data", Side::kDialer, &challenge, &hello.nonce, c});
}

Proof grant_proof(const std::string& secret, const Nonce& challenge, const PeerHello& hello,
                  const Grant& grant) {
  auto c = encode(hello);
  const auto g = claims(grant);
  c.insert(c.end(), g.begin(), g.end());
  return prove(secret, {"data", Side::kAcceptor, &challenge, &hello.nonce, c});
}

PeerDial::PeerDial(Role role, uint32_t rank) : hello{role, rank, make_nonce()} {}

std::optional<PeerProof> PeerDial::answer(const std::string& secret, const Challenge& c) {
  if (challenge) return std::nullopt;
  challenge = c.nonce;
  return PeerProof{peer_proof(secret, c.nonce, hello)};
}

bool PeerDial::proves(const std::string& secret, const Grant& g) const {
  return challenge && proofs_equal(g.proof, grant_proof(secret, *challenge, hello, g));
}

}  // namespace psld::protocol
