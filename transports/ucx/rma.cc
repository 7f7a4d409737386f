// UCX writes: the write path, puts and flushes, and the writer's side of the ring.
#include "transports/ucx/core.h"

#include <fmt/format.h>

#include <cstring>

#include "base/log.h"

namespace psld::transport {

// ---------------------------------------------------------------------------
// Writes

Status UcxCore::check_backend(const UcxConnection& conn, const WriteRequest& req) const {
  if (!conn.is_open()) return Unavailable("connection to " + conn.peer() + " is closed");
  if (shut_) return Unavailable("UCX transport is shut down");
  // Connection::write proved both are this backend's (by their tags).
  if (static_cast<const UcxRegion*>(req.local)->owner() != instance_) {
    return Connection::foreign_source();
  }
  auto* remote = static_cast<const UcxRemoteRegion*>(req.remote);
  if (remote->connection_id() != conn.id()) return Connection::foreign_target();
  const uint64_t peer = conn.peer_instance_.load();
  if (peer != 0 && remote->owner() != peer) return foreign_key(conn);
  return Status::Ok();
}

Status UcxCore::write(UcxConnection& conn, const WriteRequest& req, Completion done) {
  PSLD_RETURN_IF_ERROR(check_backend(conn, req));
  // Connection::write and check_backend proved both are ours.
  auto* src_region = const_cast<UcxRegion*>(static_cast<const UcxRegion*>(req.local));
  auto* remote_region =
      const_cast<UcxRemoteRegion*>(static_cast<const UcxRemoteRegion*>(req.remote));
  if (copies_into_mapping(conn, *src_region, *remote_region)) {
    // Done before this call returns, so the caller's references are all the
    // regions need: no shared_ptr of them is taken (four atomic operations
    // on the latency path).
    UcxRegion* src = src_region;
    UcxRemoteRegion* remote = remote_region;
    // Shared memory: the put is this memcpy. It runs outside mu_ so that a
    // large copy does not stall the thread progressing the worker; the
    // notification goes out after it, so the peer cannot see it early.
    {
      ReaderLock map(mapping_mu_);
      if (remote->mapped_base_ == nullptr) return Unavailable("UCX transport is shut down");
      if (req.length > 0) {
        std::memcpy(remote->mapped_base_ + req.remote_offset, src->data() + req.local_offset,
                    req.length);
      }
    }
    const WriteHeader h{
        remote->peer_region_id(), remote->secret(), req.remote_offset, req.length, req.notify, 0};
    // The notification ring needs no worker lock: only a completion to queue
    // or a sleeping peer to wake takes mu_.
    RingResult ring = RingResult::kUnavailable;
    if (conn.tx_ring_mapped_.load(std::memory_order_acquire)) ring = ring_notify(conn, h);
    if (ring == RingResult::kPublished && !done) {
      ++writes_put_;
      return Status::Ok();
    }
    {
      MutexLock lock(mu_);
      if (ring == RingResult::kPublished || ring == RingResult::kPublishedPeerAsleep) {
        // Shut down meanwhile: its completions were run; this one cannot be.
        if (worker_ == nullptr) return Unavailable("UCX transport is shut down");
        ++writes_put_;
        if (ring == RingResult::kPublishedPeerAsleep) wake_ring_owner_locked(conn);
        if (done) push_completion(PendingOps::Ready{std::move(done), Status::Ok()});
      } else {
        if (worker_ == nullptr || conn.state_ != UcxConnection::State::kReady) {
          return Unavailable("connection to " + conn.peer() + " is closed");
        }
        ++writes_put_;
        notify_one(conn, UserOp{0, std::move(done)}, h);
      }
      run_deferred();
    }
    maybe_wake();
    return Status::Ok();
  }
  // Held by the operation until it completes.
  auto src = src_region->weak_from_this().lock();
  auto remote = remote_region->weak_from_this().lock();
  if (!src || !remote) return InvalidArgument("write region is being destroyed");
  {
    MutexLock lock(mu_);
    if (worker_ == nullptr || conn.state_ == UcxConnection::State::kClosed) {
      return Unavailable("connection to " + conn.peer() + " is closed");
    }
    if (conn.state_ == UcxConnection::State::kHandshake) {
      UcxConnection::Queued q;
      q.op_id = pending_.add(conn.id(), deadline(), std::move(done));
      q.is_write = true;
      q.src = std::move(src);
      q.remote = std::move(remote);
      q.local_offset = req.local_offset;
      q.remote_offset = req.remote_offset;
      q.length = req.length;
      q.notify = req.notify;
      conn.queued_.push_back(std::move(q));
    } else {
      start_write(conn, UserOp{0, std::move(done)}, src, remote, req.local_offset,
                  req.remote_offset, req.length, req.notify);
      run_deferred();
    }
  }
  maybe_wake();
  return Status::Ok();
}

// A small write with no completion to a peer on this host whose ring is
// mapped here: the backend's checks, memcpy into the peer's mapped region, publish the
// record, all under the connection's tx_mu_ and nothing else. This is the
// latency path (a shared-memory ping-pong), so it takes no reference to the
// core (weak_ptr::lock is two atomic read-modify-writes), no mapping_mu_ and
// no mu_:
// - The core is alive, and the peer's region and ring are mapped, for as
//   long as conn.tx_ring_ is set under tx_mu_: shutdown() runs
//   release_rings for every connection (close_locked), which clears tx_ring_
//   under tx_mu_, before it unmaps anything, and the core is destroyed only
//   after shutdown(). A write that finds tx_ring_ null takes write().
// - Copies are serialised per connection while tx_mu_ is held, hence the
//   size limit: larger copies run under mapping_mu_ (shared) instead, in
//   parallel.
// Writes with a completion take write(): their completion is queued under mu_.
bool UcxCore::write_through_ring(UcxConnection& conn, const WriteRequest& req, Status* status) {
  UniqueLock tx(conn.tx_mu_);
  TxRing* r = conn.tx_ring_.get();
  if (r == nullptr) return false;
  UcxCore& core = *conn.core_raw_;
  if (Status s = core.check_backend(conn, req); !s.ok()) {
    *status = std::move(s);
    return true;
  }
  const auto& src = static_cast<const UcxRegion&>(*req.local);
  const auto& remote = static_cast<const UcxRemoteRegion&>(*req.remote);
  // A full ring falls back to an active message; write() counts it.
  if (!core.copies_into_mapping(conn, src, remote) || ring_full(*r)) return false;
  if (req.length > 0) {
    std::memcpy(remote.mapped_base_ + req.remote_offset, src.data() + req.local_offset, req.length);
  }
  const WriteHeader h{
      remote.peer_region_id(), remote.secret(), req.remote_offset, req.length, req.notify, 0};
  const RingResult ring = core.ring_publish(conn, *r, h);
  count_one(conn.ring_writes_);
  *status = Status::Ok();
  if (ring != RingResult::kPublishedPeerAsleep) return true;
  tx.unlock();
  // Rare (once per sleep of the peer): now a reference to the core is needed.
  if (auto c = conn.core_.lock()) c->wake_ring_owner(conn);
  return true;
}

void UcxCore::wake_ring_owner(UcxConnection& conn) {
  {
    MutexLock lock(mu_);
    wake_ring_owner_locked(conn);
    run_deferred();
  }
  maybe_wake();
}

void UcxCore::wake_ring_owner_locked(UcxConnection& conn) {
  if (worker_ == nullptr || conn.state_ != UcxConnection::State::kReady) return;
  ++ring_wakeups_;
  send_control(conn, kAmWake, {}, OpCtx::kControl);
}

void UcxCore::start_write(UcxConnection& conn, UserOp u, const std::shared_ptr<UcxRegion>& src,
                          const std::shared_ptr<UcxRemoteRegion>& remote, uint64_t local_offset,
                          uint64_t remote_offset, uint64_t length, uint32_t notify) {
  WriteHeader h{remote->peer_region_id(), remote->secret(), remote_offset, length, notify, 0};
  if (copies_into_mapping(conn, *src, *remote)) {
    // Under mu_, so shutdown cannot unmap meanwhile.
    ++writes_put_;
    if (length > 0) {
      std::memcpy(remote->mapped_base_ + remote_offset, src->data() + local_offset, length);
    }
    const RingResult ring = conn.tx_ring_mapped_.load(std::memory_order_acquire)
                                ? ring_notify(conn, h)
                                : RingResult::kUnavailable;
    if (ring == RingResult::kPublished || ring == RingResult::kPublishedPeerAsleep) {
      if (ring == RingResult::kPublishedPeerAsleep) wake_ring_owner_locked(conn);
      complete_user(u, Status::Ok());
      return;
    }
    notify_one(conn, std::move(u), h);
    return;
  }
  // Over shared memory UCX can put only into memory it maps; a region the
  // peer registered from its own heap is reached by active message unless
  // put was forced (UCX then emulates it).
  const bool put = conn.path_.load() == WritePath::kPut &&
                   (forced_ == WritePath::kPut || conn.rma_ == RmaKind::kRdma);
  if (!put && conn.path_.load() == WritePath::kPut && !conn.am_fallback_logged_) {
    conn.am_fallback_logged_ = true;
    PSLD_LOG_INFO(
        "ucx: region {} of {} is not shared memory this process can map (the peer registered it "
        "with register_memory, not allocate_memory); writes to it, and to any other such region "
        "of this connection, use am",
        remote->peer_region_id(), conn.peer());
  }
  if (put) {
    ++writes_put_;
    // Completes at the flush, which is always later: track it now.
    if (u.op_id == 0) u.op_id = pending_.add(conn.id(), deadline(), std::move(u.done));
    if (length > 0 && remote->rkey_ == nullptr) {
      if (Status s = unpack_late(conn, *remote); !s.ok()) {
        complete(u.op_id, std::move(s));
        return;
      }
    }
    if (length > 0) {
      OpCtx* op = new_op(OpCtx::kPut);
      op->op_id = u.op_id;
      op->deadline = deadline();
      op->region = src;
      op->remote = remote;
      ucp_request_param_t p = send_param(op);
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = src->memh();
      finish_request(op, ucp_put_nbx(conn.ep_, src->data() + local_offset, length,
                                     remote->base() + remote_offset, remote->rkey_, &p));
      if (!pending_.contains(u.op_id)) return;  // failed at once
    }
    conn.unflushed_.push_back({u.op_id, h});
    if (!conn.flush_in_flight_) start_flush(conn);
    return;
  }
  ++writes_am_;
  ucx_idle_.store(false, std::memory_order_relaxed);  // a rendezvous needs the worker progressed
  OpCtx* op = new_op(OpCtx::kAmWrite);
  op->deadline = deadline();
  op->region = src;
  MutexLock tx(conn.tx_mu_);
  h.seq = conn.tx_seq_++;
  store_le(op->header, conn.peer_token_, kTokenBytes);
  encode_header(h, op->header + kTokenBytes);
  ucp_request_param_t p = am_send_param(op);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
  // Into device memory always by rendezvous: the receiver then has UCX fetch
  // the bytes straight into the region (ucp_am_recv_data_nbx, which knows the
  // memory type from the region's memh); an eager payload would need a CPU
  // copy into GPU memory, which this transport cannot do.
  if (remote->kind() == MemoryKind::kCuda) {
    p.flags |= UCP_AM_SEND_FLAG_RNDV;
  } else if (length <= am_eager_max_) {
    p.flags |= UCP_AM_SEND_FLAG_EAGER;
  }
  p.memh = src->memh();
  ucs_status_ptr_t r =
      ucp_am_send_nbx(conn.ep_, kAmWrite, op->header, kTokenBytes + kWriteHeaderBytes,
                      src->data() + local_offset, length, &p);
  if (UCS_PTR_IS_ERR(r)) --conn.tx_seq_;  // never sent: the number is free again
  finish_user(u, op, r, conn.id(), "write failed");
}

void UcxCore::notify_one(UcxConnection& conn, UserOp u, WriteHeader h) {
  ucx_idle_.store(false, std::memory_order_relaxed);
  OpCtx* op = new_op(OpCtx::kSend);
  op->deadline = deadline();
  op->bytes.resize(4 + kWriteHeaderBytes);
  store_le(op->bytes.data(), 1, 4);
  MutexLock tx(conn.tx_mu_);
  h.seq = conn.tx_seq_++;
  encode_header(h, op->bytes.data() + 4);
  store_le(op->header, conn.peer_token_, kTokenBytes);
  ucp_request_param_t p = am_send_param(op);
  ucs_status_ptr_t r = ucp_am_send_nbx(conn.ep_, kAmNotify, op->header, kTokenBytes,
                                       op->bytes.data(), op->bytes.size(), &p);
  if (UCS_PTR_IS_ERR(r)) --conn.tx_seq_;
  finish_user(u, op, r, conn.id(), "notification failed");
}

// Ordering for ucp_put_nbx (RDMA, or put forced where UCX emulates it): a
// notification leaves only after a flush that covers its put completed, i.e.
// after the bytes are visible at the target. One flush is in flight per
// connection; puts issued meanwhile wait for the next one, so a window of
// writes shares one flush. (Shared memory skips all this: ucp_ep_flush_nbx
// flushes every lane, and UCX 1.13's tcp flush on the rendezvous lanes is a
// round trip, 24 us per ping-pong; the memcpy in write() needs no flush.)
void UcxCore::start_flush(UcxConnection& conn) {
  if (conn.unflushed_.empty() || conn.ep_ == nullptr) return;
  OpCtx* op = new_op(OpCtx::kFlush);
  op->conn = conn.shared_from_this();
  op->batch.swap(conn.unflushed_);
  conn.flush_in_flight_ = true;
  ++flushes_;
  ucp_request_param_t p = send_param(op);
  finish_request(op, ucp_ep_flush_nbx(conn.ep_, &p));
}

void UcxCore::on_flushed(const ConnPtr& conn, std::vector<UcxConnection::Unflushed> batch,
                         ucs_status_t status) {
  conn->flush_in_flight_ = false;
  if (status == UCS_OK && conn->state_ == UcxConnection::State::kReady) {
    announce(*conn, batch.data(), batch.size());
  } else {
    for (const auto& u : batch)
      complete(u.op_id, ucs_to_status(status, "flush failed"));
  }
  if (conn->state_ == UcxConnection::State::kReady && !conn->unflushed_.empty()) {
    start_flush(*conn);
  }
}

void UcxCore::announce(UcxConnection& conn, const UcxConnection::Unflushed* writes, size_t n) {
  // Only writes still pending are announced: one that timed out was reported
  // as failed, so the receiver must not hear of it.
  std::vector<uint64_t> ops;
  std::vector<uint8_t> payload;
  size_t k = 0;
  // Numbers are taken as the batch is encoded; held until it is sent.
  MutexLock tx(conn.tx_mu_);
  auto send_batch = [&]() REQUIRES(mu_, conn.tx_mu_) {
    if (k == 0) return;
    store_le(payload.data(), k, 4);
    const bool sent = send_control(conn, kAmNotify, std::move(payload), OpCtx::kControl);
    if (!sent) conn.tx_seq_ -= k;
    for (uint64_t id : ops) {
      complete(id, sent ? Status::Ok()
                        : Unavailable("the notification to " + conn.peer() + " could not be sent"));
    }
    ops.clear();
    payload.clear();
    k = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    if (!pending_.contains(writes[i].op_id)) continue;
    if (k == 0) payload.assign(4, 0);
    payload.resize(4 + (k + 1) * kWriteHeaderBytes);
    WriteHeader h = writes[i].header;
    h.seq = conn.tx_seq_++;
    encode_header(h, payload.data() + 4 + k * kWriteHeaderBytes);
    ops.push_back(writes[i].op_id);
    if (++k == kNotifyBatch) send_batch();
  }
  send_batch();
}

// ---------------------------------------------------------------------------
// The writer's side of the notification ring (see kRingMagic)

UcxCore::RingResult UcxCore::ring_notify(UcxConnection& conn, WriteHeader h) {
  MutexLock tx(conn.tx_mu_);
  TxRing* r = conn.tx_ring_.get();
  if (r == nullptr) return RingResult::kUnavailable;
  if (ring_full(*r)) {
    ++notify_ring_full_;
    return RingResult::kFull;
  }
  return ring_publish(conn, *r, h);
}

bool UcxCore::ring_full(TxRing& r) {
  if (r.written - r.consumed < r.slots) return false;
  r.consumed = ring_word(r.base, kRingConsumedAt).load(std::memory_order_acquire);
  // A peer's bogus `consumed` (ahead of `written`) reads as full: safe.
  return r.written - r.consumed >= r.slots;
}

UcxCore::RingResult UcxCore::ring_publish(UcxConnection& conn, TxRing& r, WriteHeader h) {
  h.seq = conn.tx_seq_++;
  uint8_t* slot = r.base + kRingHeaderBytes + (r.written & (r.slots - 1)) * kRingRecordBytes;
  encode_header(h, slot);
  // The sleep handshake with wait(), Dekker-style: this stamp's store and the
  // flag's load here, the flag's store and the stamp's load there, all
  // seq_cst (operations, not fences, which ThreadSanitizer cannot see), so
  // the owner either sees this record after it said it sleeps, or we see
  // that it sleeps.
  ring_word(slot, kRingStampAt).store(r.written + 1, std::memory_order_seq_cst);
  ++r.written;
  count_one(conn.ring_records_);
  const uint64_t epoch = ring_word(r.base, kRingSleepingAt).load(std::memory_order_seq_cst);
  if ((epoch & 1) == 0 || epoch == r.woken_epoch) return RingResult::kPublished;
  r.woken_epoch = epoch;
  return RingResult::kPublishedPeerAsleep;
}

}  // namespace psld::transport
