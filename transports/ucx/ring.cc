// UCX notification ring, the receiver's side: the ring, its offer, reading, sleeping.
#include "transports/ucx/core.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "base/log.h"

namespace psld::transport {

// ---------------------------------------------------------------------------
// Notification ring

std::shared_ptr<RxRing> UcxCore::allocate_ring() {
  const uint32_t slots = options_.ucx.notify_ring_slots;
  // Only a peer that can map our memory could use it.
  if (slots == 0 || !tls_may_use_shared_memory(options_.ucx.tls)) return nullptr;
  const size_t bytes = kRingHeaderBytes + size_t{slots} * kRingRecordBytes;
  auto mapped = map_allocated(context_->handle, bytes, false);
  if (!mapped.ok()) {
    PSLD_LOG_WARN("ucx: no notification ring ({}); notifications use active messages",
                  mapped.status().message());
    return nullptr;
  }
  const ucp_mem_h memh = mapped->memh;
  void* packed = nullptr;
  size_t packed_size = 0;
  if (ucp_rkey_pack(context_->handle, memh, &packed, &packed_size) != UCS_OK) {
    ucp_mem_unmap(context_->handle, memh);
    PSLD_LOG_WARN("ucx: no notification ring (UCX could not pack a key for its memory)");
    return nullptr;
  }
  std::vector<uint8_t> key(static_cast<uint8_t*>(packed),
                           static_cast<uint8_t*>(packed) + packed_size);
  ucp_rkey_buffer_release(packed);
  uint8_t* base = mapped->base;
  std::memset(base, 0, bytes);
  ring_word(base, 0).store(kRingMagic, std::memory_order_relaxed);
  ring_word(base, 8).store(slots, std::memory_order_relaxed);
  return std::make_shared<RxRing>(context_, memh, base, slots, std::move(key));
}

void UcxCore::map_peer_ring(UcxConnection& conn, uint32_t slots, uint64_t base,
                            std::span<const uint8_t> packed) {
  const std::string ours = conn.rx_ring_
                               ? fmt::format("{} slots offered", conn.rx_ring_->slots())
                               : std::string(options_.ucx.notify_ring_slots == 0
                                                 ? "none offered (ucx.notify_ring_slots = 0)"
                                                 : "none offered (ucx.tls has no shared memory)");
  auto note = [&](std::string_view theirs) {
    conn.ring_note_ = fmt::format("{}; peer's {}", ours, theirs);
  };
  if (slots == 0) return note("none");
  if (options_.ucx.notify_ring_slots == 0) return note("unused (ucx.notify_ring_slots = 0)");
  if (forced_ == WritePath::kAm) return note("unused (ucx.write_path = am)");
  if (slots < kMinRingSlots || slots > kMaxRingSlots || (slots & (slots - 1)) != 0 ||
      packed.empty()) {
    ++rejected_messages_;
    return note("malformed, unused");
  }
  std::vector<uint8_t> padded(packed.size() + kRkeyPad, 0);
  std::memcpy(padded.data(), packed.data(), packed.size());
  ucp_rkey_h rkey = nullptr;
  if (Status st = unpack_rkey(conn.ep_, conn.peer_instance_.load(), padded.data(), &rkey);
      !st.ok()) {
    return note(fmt::format("not mapped ({})", st.message()));
  }
  void* mapped = nullptr;
  if (ucp_rkey_ptr(rkey, base, &mapped) != UCS_OK || mapped == nullptr) {
    ucp_rkey_destroy(rkey);
    return note("not mapped (the peer is not on this host, or not over shared memory)");
  }
  auto* p = static_cast<uint8_t*>(mapped);
  if (ring_word(p, 0).load(std::memory_order_relaxed) != kRingMagic ||
      ring_word(p, 8).load(std::memory_order_relaxed) != slots) {
    ucp_rkey_destroy(rkey);
    ++rejected_messages_;
    return note("not a ring where the peer said, unused");
  }
  // Tells the owner a writer is there, so its progress() may poll UCX less.
  ring_word(p, kRingAttachedAt).store(1, std::memory_order_release);
  {
    MutexLock tx(conn.tx_mu_);
    conn.tx_ring_ = std::make_unique<TxRing>();
    conn.tx_ring_->rkey = rkey;
    conn.tx_ring_->base = p;
    conn.tx_ring_->slots = slots;
  }
  conn.tx_ring_mapped_.store(true, std::memory_order_release);
  note(fmt::format("mapped, {} slots: shared-memory writes notify through it", slots));
}

template <typename Deliver>
size_t UcxCore::read_ring(UcxConnection& conn, RxRing& r, uint64_t below, bool stop_at_gap,
                          Deliver&& deliver) {
  uint64_t read = r.read.load(std::memory_order_relaxed);
  const uint64_t start = read;
  size_t n = 0;
  while (r.ready(read)) {
    const WriteHeader h = decode_header(r.slot(read));
    const uint64_t next = conn.rx_next_seq_.load(std::memory_order_relaxed);
    if (h.seq >= below) break;
    if (h.seq < next) {
      // Only a broken peer numbers twice; consumed so the ring keeps moving.
      r.read.store(++read, std::memory_order_relaxed);
      reject_write(&conn, "notification ring record out of sequence");
      continue;
    }
    if (stop_at_gap && h.seq != next) break;
    r.read.store(++read, std::memory_order_relaxed);
    conn.rx_next_seq_.store(h.seq + 1, std::memory_order_relaxed);
    ++n;
    if (!deliver(h)) break;
  }
  if (read != start) ring_word(r.base(), kRingConsumedAt).store(read, std::memory_order_release);
  return n;
}

void UcxCore::drain_ring(const ConnPtr& conn, uint64_t below, bool stop_at_gap) {
  RxRing* r = conn->rx_ring_.get();
  if (r == nullptr || conn->state_ != UcxConnection::State::kReady) return;
  read_ring(*conn, *r, below, stop_at_gap, [&](const WriteHeader& h) {
    mu_.assert_held();  // read_ring calls back before it returns, here under mu_
    deliver_notification(conn, h);
    return true;
  });
}

bool UcxCore::validate_target_cached(const WriteHeader& h, ValidTarget* last) {
  if (h.region != last->region || h.secret != last->secret ||
      last->unexported != unexported_.load(std::memory_order_acquire)) {
    MutexLock lock(export_mu_);
    auto it = exported_.find(h.region);
    std::shared_ptr<UcxRegion> r = it != exported_.end() ? it->second.lock() : nullptr;
    if (!r || r->secret() != h.secret) return false;
    *last =
        ValidTarget{unexported_.load(std::memory_order_relaxed), h.region, h.secret, r->length()};
  }
  return in_region(h, last->length);
}

// Without mu_: a record is validated and its handler called right here. The
// order of events is kept: whatever a peer sent before it (an active
// message, an earlier record) was delivered by an earlier progress() call,
// since this thread is the only one that runs UCX's callbacks and reads
// rings, and each progress() delivers what it queued before returning.
size_t UcxCore::poll_rings_unlocked() {
  size_t n = 0;
  for (Polled& p : polled_) {
    if (!p.ucx->open_.load(std::memory_order_relaxed)) continue;
    n += read_ring(*p.ucx, *p.ring, std::numeric_limits<uint64_t>::max(), true,
                   [&](const WriteHeader& h) {
                     if (!validate_target_cached(h, &p.last)) {
                       reject_write(p.ucx,
                                    "notification names no region we export, a wrong secret, "
                                    "or bytes outside the region");
                       return true;
                     }
                     if (shut_) return false;  // after shutdown no handler runs
                     handler_->on_write(p.conn, h.notify, h.length);
                     // The handler may have closed the connection.
                     return p.ucx->open_.load(std::memory_order_relaxed);
                   });
  }
  return n;
}

bool UcxCore::ring_has_next(const UcxConnection& conn) const {
  const RxRing* r = conn.rx_ring_.get();
  if (r == nullptr || conn.state_ != UcxConnection::State::kReady) return false;
  const uint64_t read = r->read.load(std::memory_order_relaxed);
  return r->ready(read) &&
         decode_header(r->slot(read)).seq == conn.rx_next_seq_.load(std::memory_order_relaxed);
}

void UcxCore::set_rings_sleeping(bool sleeping) {
  for (const ConnPtr& conn : rx_conns_) {
    auto epoch = ring_word(conn->rx_ring_->base(), kRingSleepingAt);
    const uint64_t now = epoch.load(std::memory_order_relaxed);
    if ((now & 1) != (sleeping ? 1u : 0u)) epoch.store(now + 1, std::memory_order_seq_cst);
  }
}

void UcxCore::release_rings(UcxConnection& conn) {
  if (conn.rx_ring_) {
    auto it = std::find_if(rx_conns_.begin(), rx_conns_.end(),
                           [&](const ConnPtr& c) { return c.get() == &conn; });
    if (it != rx_conns_.end()) rx_conns_.erase(it);
    rx_version_.fetch_add(1, std::memory_order_release);
    dead_rings_.push_back(std::move(conn.rx_ring_));
  }
  std::unique_ptr<TxRing> tx;
  {
    MutexLock lock(conn.tx_mu_);
    tx = std::move(conn.tx_ring_);
    conn.tx_ring_mapped_.store(false, std::memory_order_relaxed);
    // Without the ring nothing counts these any more; counters() reads
    // either the connection's or the retired figure (both under mu_).
    retired_ring_records_ += conn.ring_records_.exchange(0, std::memory_order_relaxed);
    retired_ring_writes_ += conn.ring_writes_.exchange(0, std::memory_order_relaxed);
  }
  if (tx) {
    // The owner's progress() goes back to polling UCX on every call.
    ring_word(tx->base, kRingAttachedAt).store(0, std::memory_order_relaxed);
    MutexLock lock(rkey_mu_);
    graveyard_.push_back(tx->rkey);  // destroyed outside any UCX callback
    graveyard_nonempty_ = true;
  }
}

void UcxCore::deliver_notification(const ConnPtr& conn, const WriteHeader& h) {
  std::shared_ptr<UcxRegion> region;
  if (!validate_target(h, &region)) {
    reject_write(conn.get(),
                 "notification names no region we export, a wrong secret, or "
                 "bytes outside the region");
    return;
  }
  queue_write(conn, h.notify, h.length);
}

void UcxCore::queue_write(ConnectionPtr conn, uint32_t notify, uint64_t length) {
  Event e;
  e.kind = Event::kWrite;
  e.conn = std::move(conn);
  e.notify = notify;
  e.length = length;
  queue_event(std::move(e));
}

}  // namespace psld::transport
