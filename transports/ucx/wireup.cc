// UCX wire-up: connect, accept, the handshake (hello, its answer) and remote keys.
#include "transports/ucx/core.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "base/log.h"

namespace psld::transport {

// ---------------------------------------------------------------------------
// The hello's and the remote key's bytes (core.h)

std::vector<uint8_t> ucx_detail::encode_hello(const HelloFields& h) {
  WireWriter w;
  w.u32(kHelloMagic);
  w.u8(kWireVersion);
  w.u64(h.instance);
  w.u64(h.conn);
  w.u64(h.process_namespace);
  w.u32(h.pid);
  w.str(h.listen);
  w.u32(h.ring_slots);
  w.u64(h.ring_base);
  w.blob(h.ring_key);
  return w.take();
}

bool ucx_detail::decode_hello(std::span<const uint8_t> payload, HelloFields* h) {
  WireReader r(payload);
  uint32_t magic = 0;
  uint8_t version = 0;
  return r.u32(&magic) && magic == kHelloMagic && r.u8(&version) && version == kWireVersion &&
         r.u64(&h->instance) && r.u64(&h->conn) && r.u64(&h->process_namespace) && r.u32(&h->pid) &&
         r.str(&h->listen, kMaxAddressString) && r.u32(&h->ring_slots) && r.u64(&h->ring_base) &&
         r.blob(&h->ring_key, kMaxPackedRkey) && r.done();
}

std::vector<uint8_t> ucx_detail::encode_remote_key(const RemoteKeyFields& k) {
  WireWriter w;
  w.u32(kKeyMagic);
  w.u8(kWireVersion);
  w.u8(static_cast<uint8_t>(k.kind));
  w.u64(k.owner);
  w.u64(k.region);
  w.u64(k.base);
  w.u64(k.length);
  w.u64(k.secret);
  w.blob(k.packed);
  w.u64(fnv1a64(w.data()));
  return w.take();
}

Result<RemoteKeyFields> ucx_detail::decode_remote_key(std::span<const uint8_t> key) {
  WireReader r(key);
  uint32_t magic = 0;
  uint8_t version = 0, kind = 0;
  uint64_t sum = 0;
  RemoteKeyFields k;
  if (!r.u32(&magic) || magic != kKeyMagic) {
    return DataLoss(
        "not a UCX remote key (a key of another transport kind, or corrupted); "
        "import keys made by this connection's peer's ucx transport");
  }
  if (!r.u8(&version) || version != kWireVersion || !r.u8(&kind) || !r.u64(&k.owner) ||
      !r.u64(&k.region) || !r.u64(&k.base) || !r.u64(&k.length) || !r.u64(&k.secret) ||
      !r.blob(&k.packed, kMaxPackedRkey) || key.size() < 8 || !r.u64(&sum) || !r.done()) {
    return DataLoss("malformed UCX remote key (truncated or padded)");
  }
  if (sum != fnv1a64(key.first(key.size() - 8))) {
    return DataLoss("UCX remote key failed its checksum (corrupted in transit?)");
  }
  if (k.length == 0 || k.base + k.length < k.base || k.packed.empty()) {
    return DataLoss("UCX remote key describes an impossible region");
  }
  if (kind != static_cast<uint8_t>(MemoryKind::kHost) &&
      kind != static_cast<uint8_t>(MemoryKind::kCuda)) {
    return DataLoss("UCX remote key names an unknown memory kind");
  }
  k.kind = static_cast<MemoryKind>(kind);
  return k;
}

UcxRemoteRegion::~UcxRemoteRegion() {
  if (auto core = core_.lock()) core->release_rkey(this);
}

// ---------------------------------------------------------------------------
// Connections

Result<ConnectionPtr> UcxCore::connect(std::span<const uint8_t> peer_address) {
  const std::string where(peer_address.begin(), peer_address.end());
  if (where.empty() || where.size() > kMaxAddressString ||
      !std::all_of(where.begin(), where.end(), [](char c) { return c > ' ' && c < 127; })) {
    return InvalidArgument(
        "not a UCX transport address: pass the peer's Transport::address(), "
        "host:port text such as 127.0.0.1:41234");
  }
  sockaddr_storage sa{};
  socklen_t sa_len = 0;
  PSLD_RETURN_IF_ERROR(parse_socket_address(where, false, &sa, &sa_len));

  ConnPtr conn;
  {
    MutexLock lock(mu_);
    if (worker_ == nullptr || shut_) return Unavailable("UCX transport is shut down");
    conn =
        std::make_shared<UcxConnection>(this, weak_from_this(), true, fmt::format("ucx {}", where));
    // The bootstrap first (bootstrap.cc); the hello goes once it made the
    // endpoint, and writes and sends issued meanwhile are queued.
    PSLD_RETURN_IF_ERROR(start_dial(sa, sa_len, where, conn));
    track_handshake(conn);
  }
  maybe_wake();
  return ConnectionPtr(conn);
}

void UcxCore::track_handshake(const ConnPtr& conn) {
  conn->handshake_deadline_ = deadline();
  ++handshaking_;
  conns_[conn->id()] = conn;
  by_token_[conn->token_] = conn;
  conn->rx_ring_ = allocate_ring();
}

std::vector<uint8_t> UcxCore::hello_payload(const UcxConnection& conn) const {
  HelloFields h;
  h.instance = instance_;
  h.conn = conn.id();
  h.process_namespace = namespace_key_;
  h.pid = static_cast<uint32_t>(getpid());
  h.listen = listen_text_;
  if (const RxRing* ring = conn.rx_ring_.get()) {
    h.ring_slots = ring->slots();
    h.ring_base = reinterpret_cast<uintptr_t>(ring->base());
    h.ring_key = ring->packed();
  }
  return encode_hello(h);
}

bool UcxCore::accept_peer_hello(const ConnPtr& conn, std::span<const uint8_t> payload,
                                bool from_server) {
  HelloFields h;
  if (conn->client_ != from_server || conn->state_ != UcxConnection::State::kHandshake ||
      !decode_hello(payload, &h) || h.instance != conn->boot_instance_) {
    ++rejected_messages_;
    close_locked(*conn,
                 DataLoss(fmt::format("malformed {} from {}",
                                      from_server ? "hello answer" : "hello", conn->peer())),
                 false);
    return false;
  }
  conn->peer_instance_ = h.instance;
  if (namespace_key_ != 0 && h.process_namespace == namespace_key_ && h.pid != 0) {
    MutexLock plock(procs_mu_);
    peer_pids_[h.instance] = h.pid;
  }
  map_peer_ring(*conn, h.ring_slots, h.ring_base, h.ring_key);
  connection_ready(*conn);
  return true;
}

void UcxCore::handle_hello(const ConnPtr& conn, std::span<const uint8_t> payload) {
  if (!accept_peer_hello(conn, payload, false)) return;
  push_event(Event::kAccept, conn);
  acks_.push_back(conn);  // sending is deferred: this runs inside a UCX callback
}

void UcxCore::handle_hello_ack(const ConnPtr& conn, std::span<const uint8_t> payload) {
  if (!accept_peer_hello(conn, payload, true)) return;
  ready_.push_back(conn);  // sending is deferred: this runs inside a UCX callback
  // What the server sent right after accepting (from its on_accept handler)
  // can overtake its deferred answer; it was held until now.
  std::vector<UcxConnection::Early> early;
  early.swap(conn->early_);
  for (auto& e : early)
    handle_control(conn, e.id, e.seq, e.bytes);
}

bool UcxCore::hold_early(UcxConnection& conn, unsigned id, uint64_t seq,
                         std::span<const uint8_t> payload) {
  if (!conn.client_ || conn.state_ != UcxConnection::State::kHandshake) return false;
  // Bounded: a peer cannot make us buffer without limit before it answers.
  if (conn.early_.size() >= kMaxEarlyMessages) return false;
  conn.early_.push_back({id, seq, std::vector<uint8_t>(payload.begin(), payload.end())});
  return true;
}

Status UcxCore::foreign_key(const UcxConnection& conn) {
  return InvalidArgument(
      "remote key was exported by another transport than this connection's peer (" + conn.peer() +
      "); import it on a connection to the transport that registered the region");
}

void UcxCore::dispatch_queued(UcxConnection& conn) {
  // Operations issued during the handshake go out in the order they came.
  std::deque<UcxConnection::Queued> queued;
  queued.swap(conn.queued_);
  for (auto& q : queued) {
    if (conn.state_ != UcxConnection::State::kReady) break;  // closed meanwhile: already failed
    if (!pending_.contains(q.op_id)) continue;               // timed out meanwhile
    if (q.is_write && q.remote->owner() != conn.peer_instance_.load()) {
      // Imported before the handshake named the peer: checked now.
      complete(q.op_id, foreign_key(conn));
    } else if (q.is_write) {
      start_write(conn, UserOp{q.op_id, nullptr}, q.src, q.remote, q.local_offset, q.remote_offset,
                  q.length, q.notify);
    } else {
      start_send(conn, UserOp{q.op_id, nullptr}, q.message);
    }
  }
}

void UcxCore::connection_ready(UcxConnection& conn) {
  conn.state_ = UcxConnection::State::kReady;
  --handshaking_;
  const std::string info = endpoint_info(conn.ep_);
  const LaneSummary lanes = summarize_lanes(info);
  conn.rma_ = lanes.rma;
  WritePath path = forced_;
  std::string why = "forced by ucx.write_path";
  if (path == WritePath::kAuto) {
    if (lanes.rma == RmaKind::kEmulated) {
      path = WritePath::kAm;
      why =
          "UCX only emulates put on these lanes; active-message rendezvous lands the data "
          "straight in the target";
    } else {
      path = WritePath::kPut;
      why = lanes.rma == RmaKind::kRdma ? "native RDMA put"
                                        : "shared-memory put into regions the peer allocated "
                                          "with allocate_memory (others use am)";
    }
  }
  conn.path_ = path;
  if (conn.rx_ring_) {
    rx_conns_.push_back(conn.shared_from_this());
    rx_version_.fetch_add(1, std::memory_order_release);
    // A thread already asleep advertises this ring too, so its writer wakes
    // it. (Records published before now are read by the progress() that
    // runs this: rings are polled after the worker.)
    if (ring_sleepers_ > 0) {
      ring_word(conn.rx_ring_->base(), kRingSleepingAt).store(1, std::memory_order_seq_cst);
    }
  }
  std::string summary = fmt::format("lanes {}; writes use {} ({}); notify ring: {}", lanes.text,
                                    path == WritePath::kPut ? "put" : "am", why, conn.ring_note_);
  if (lanes_said_.size() < kMaxLanesSaid && lanes_said_.insert(summary).second) {
    PSLD_LOG_INFO("ucx: connection {} ({}): {} (later connections with these lanes: at debug)",
                  conn.id(), conn.peer(), summary);
  } else {
    PSLD_LOG_DEBUG("ucx: connection {} ({}): {}", conn.id(), conn.peer(), summary);
  }
  PSLD_LOG_DEBUG("ucx: connection {} endpoint:\n{}", conn.id(), info);
}

Result<std::shared_ptr<RemoteRegion>> UcxCore::import_region(UcxConnection& conn,
                                                             std::span<const uint8_t> key) {
  PSLD_ASSIGN_OR_RETURN(const RemoteKeyFields k, decode_remote_key(key));
  std::vector<uint8_t> padded(k.packed.size() + kRkeyPad, 0);
  std::memcpy(padded.data(), k.packed.data(), k.packed.size());

  MutexLock lock(mu_);
  if (worker_ == nullptr || conn.state_ == UcxConnection::State::kClosed) {
    return Unavailable("connection to " + conn.peer() + " is closed");
  }
  // Before the handshake answered the peer is not known yet; then the writes
  // check the key (check_backend, dispatch_queued).
  if (conn.peer_instance_.load() != 0 && k.owner != conn.peer_instance_.load()) {
    return foreign_key(conn);
  }
  // Before the bootstrap made the endpoint, the key is unpacked on the
  // endpoint to its owner if there is one, else when a put first needs it
  // (unpack_later; such a region is not mapped, so writes to it use am).
  ucp_ep_h ep = conn.ep_;
  if (ep == nullptr) {
    if (auto it = peer_eps_.find(k.owner); it != peer_eps_.end()) ep = it->second;
  }
  ucp_rkey_h rkey = nullptr;
  if (ep != nullptr) PSLD_RETURN_IF_ERROR(unpack_rkey(ep, k.owner, padded.data(), &rkey));
  // Shared memory the peer allocated (UCP_MEM_MAP_ALLOCATE) is attached by
  // the unpack; ucp_rkey_ptr says where.
  // Device memory is never mapped for the CPU.
  void* mapped_at = nullptr;
  const bool mapped = rkey != nullptr && k.kind == MemoryKind::kHost &&
                      ucp_rkey_ptr(rkey, k.base, &mapped_at) == UCS_OK && mapped_at != nullptr;
  auto remote = std::make_shared<UcxRemoteRegion>(
      k.length, k.region, k.kind, conn.id(), k.owner, k.base, k.secret,
      mapped ? static_cast<uint8_t*>(mapped_at) : nullptr, rkey, weak_from_this());
  if (rkey == nullptr) remote->unpack_later_ = std::move(padded);
  {
    MutexLock rlock(rkey_mu_);
    live_remotes_.insert(remote.get());
  }
  return std::shared_ptr<RemoteRegion>(remote);
}

Status UcxCore::unpack_late(UcxConnection& conn, UcxRemoteRegion& remote) {
  MutexLock rlock(rkey_mu_);
  if (remote.rkey_ != nullptr) return Status::Ok();
  if (remote.unpack_later_.empty() || conn.ep_ == nullptr) {
    return Unavailable("connection to " + conn.peer() + " is closed");
  }
  Status st = unpack_rkey(conn.ep_, remote.owner(), remote.unpack_later_.data(), &remote.rkey_);
  if (!st.ok()) {
    remote.rkey_ = nullptr;
    return st;
  }
  remote.unpack_later_.clear();
  return Status::Ok();
}

Status UcxCore::unpack_rkey(ucp_ep_h ep, uint64_t owner, const uint8_t* packed, ucp_rkey_h* rkey) {
  std::optional<uint32_t> pid;
  {
    MutexLock lock(procs_mu_);
    if (auto it = peer_pids_.find(owner); it != peer_pids_.end()) pid = it->second;
  }
  if (pid && process_ended(*pid)) {
    return Unavailable(fmt::format(
        "the peer's process (pid {}) ended: the memory behind its key went with it", *pid));
  }
  const ucs_status_t st = ucp_ep_rkey_unpack(ep, packed, rkey);
  if (st != UCS_OK) {
    *rkey = nullptr;
    return DataLoss(fmt::format("UCX could not unpack the remote key: {}", ucs_status_string(st)));
  }
  return Status::Ok();
}

void UcxCore::release_rkey(UcxRemoteRegion* remote) {
  MutexLock lock(rkey_mu_);
  live_remotes_.erase(remote);
  if (remote->rkey_ != nullptr) {
    graveyard_.push_back(remote->rkey_);
    remote->rkey_ = nullptr;
    graveyard_nonempty_ = true;
  }
}

void UcxCore::drain_graveyard() {
  if (!graveyard_nonempty_.load()) return;
  std::vector<ucp_rkey_h> dead;
  {
    MutexLock lock(rkey_mu_);
    dead.swap(graveyard_);
    graveyard_nonempty_ = false;
  }
  for (ucp_rkey_h k : dead)
    ucp_rkey_destroy(k);
}

}  // namespace psld::transport
