// UCX active messages: sends, control messages, and every incoming active message.
#include "transports/ucx/core.h"

#include <fmt/format.h>

#include <cstring>
#include <limits>

#include "base/log.h"

namespace psld::transport {

// ---------------------------------------------------------------------------
// Sends

Status UcxCore::send(UcxConnection& conn, std::span<const uint8_t> message, Completion done) {
  if (message.size() > kMaxMessageBytes) {
    return InvalidArgument(
        fmt::format("message of {} bytes exceeds the {}-byte limit; larger "
                    "payloads belong in a write",
                    message.size(), kMaxMessageBytes));
  }
  if (!conn.is_open()) return Unavailable("connection to " + conn.peer() + " is closed");
  {
    MutexLock lock(mu_);
    if (worker_ == nullptr || conn.state_ == UcxConnection::State::kClosed) {
      return Unavailable("connection to " + conn.peer() + " is closed");
    }
    if (conn.state_ == UcxConnection::State::kHandshake) {
      UcxConnection::Queued q;
      q.op_id = pending_.add(conn.id(), deadline(), std::move(done));
      q.message.assign(message.begin(), message.end());
      conn.queued_.push_back(std::move(q));
    } else {
      start_send(conn, UserOp{0, std::move(done)}, message);
      run_deferred();
    }
  }
  maybe_wake();
  return Status::Ok();
}

void UcxCore::start_send(UcxConnection& conn, UserOp u, std::span<const uint8_t> message) {
  ucx_idle_.store(false, std::memory_order_relaxed);
  OpCtx* op = new_op(OpCtx::kSend);
  op->deadline = deadline();
  op->bytes.assign(message.begin(), message.end());  // send() copies before it returns
  ucp_request_param_t p = am_send_param(op);
  // Numbered like notifications, so a message never overtakes a write
  // notified through the ring before it.
  MutexLock tx(conn.tx_mu_);
  store_le(op->header, conn.peer_token_, kTokenBytes);
  store_le(op->header + kTokenBytes, conn.tx_seq_++, kSeqHeaderBytes);
  ucs_status_ptr_t r =
      ucp_am_send_nbx(conn.ep_, kAmMessage, op->header, kTokenBytes + kSeqHeaderBytes,
                      op->bytes.data(), op->bytes.size(), &p);
  if (UCS_PTR_IS_ERR(r)) --conn.tx_seq_;
  finish_user(u, op, r, conn.id(), "send failed");
}

// False when UCX refused the message at once.
bool UcxCore::send_control(UcxConnection& conn, unsigned id, std::vector<uint8_t> payload,
                           OpCtx::Kind kind) {
  if (conn.ep_ == nullptr) return false;
  OpCtx* op = new_op(kind);
  op->conn = conn.shared_from_this();
  op->bytes = std::move(payload);
  store_le(op->header, conn.peer_token_, kTokenBytes);
  ucp_request_param_t p = am_send_param(op);
  ucs_status_ptr_t r = ucp_am_send_nbx(conn.ep_, id, op->header, kTokenBytes, op->bytes.data(),
                                       op->bytes.size(), &p);
  const bool ok = !UCS_PTR_IS_ERR(r);
  finish_request(op, r);
  return ok;
}

// ---------------------------------------------------------------------------
// Incoming active messages

bool UcxCore::validate_target(const WriteHeader& h, std::shared_ptr<UcxRegion>* region) {
  std::shared_ptr<UcxRegion> r;
  {
    MutexLock lock(export_mu_);
    auto it = exported_.find(h.region);
    if (it != exported_.end()) r = it->second.lock();
  }
  // The secret makes a region id useless to a peer that never got the key;
  // the bounds keep a valid key inside its region.
  if (!r || r->secret() != h.secret || !in_region(h, r->length())) {
    return false;
  }
  *region = std::move(r);
  return true;
}

void UcxCore::reject_write(const UcxConnection* conn, const std::string& why) {
  const uint64_t n = ++rejected_writes_;
  // The first few say why; a flood from a broken peer stays one line in 1000.
  if (n <= 10 || n % 1000 == 0) {
    PSLD_LOG_WARN("ucx: rejected an incoming write from {} ({}; {} rejected so far)",
                  conn != nullptr ? conn->peer() : std::string("an unknown endpoint"), why, n);
  }
}

ucs_status_t UcxCore::on_am(unsigned id, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param) {
  mu_.assert_held();
  // The connection is the one the header's token names.
  ConnPtr conn;
  if (header_length >= kTokenBytes) {
    auto it = by_token_.find(load_le(static_cast<const uint8_t*>(header), kTokenBytes));
    if (it != by_token_.end()) conn = it->second;
    header = static_cast<const uint8_t*>(header) + kTokenBytes;
    header_length -= kTokenBytes;
  }
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (!conn || conn->state_ == UcxConnection::State::kClosed) {
    // A late message for a connection we closed; a rendezvous descriptor is
    // released by UCX when we return UCS_OK without receiving it.
    return UCS_OK;
  }
  if (id == kAmWrite) return on_am_write(conn, header, header_length, data, length, param);
  // A message's header is its sequence number; control messages have none.
  const size_t want_header = id == kAmMessage ? kSeqHeaderBytes : 0;
  if (header_length != want_header || length > kMaxMessageBytes + 64) {
    ++rejected_messages_;
    PSLD_LOG_WARN("ucx: dropped a malformed message (id {}, {} bytes) from {}", id, length,
                  conn->peer());
    return UCS_OK;
  }
  const uint64_t seq =
      want_header != 0 ? load_le(static_cast<const uint8_t*>(header), kSeqHeaderBytes) : 0;
  if (rndv) {
    // UCX chose rendezvous for a small message (a low UCX_RNDV_THRESH): fetch
    // it into a buffer and handle it when it lands.
    OpCtx* op = new_op(OpCtx::kRecvControl);
    op->conn = conn;
    op->am_id = id;
    op->seq = seq;
    op->bytes.resize(length);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = recv_am_cb;
    p.user_data = op;
    // Its place in the sequence is taken now, so that a failed receive
    // cannot hold up the ring; it is delivered when it lands.
    if (id == kAmMessage && conn->state_ == UcxConnection::State::kReady) {
      arrived_in_order(conn, seq);
    }
    finish_request(op, ucp_am_recv_data_nbx(worker_, data, op->bytes.data(), length, &p));
    return UCS_OK;
  }
  handle_control(conn, id, seq, {static_cast<const uint8_t*>(data), length});
  return UCS_OK;
}

void UcxCore::handle_control(const ConnPtr& conn, unsigned id, uint64_t seq,
                             std::span<const uint8_t> payload) {
  if (conn->state_ == UcxConnection::State::kClosed) return;
  switch (id) {
    case kAmMessage: {
      if (hold_early(*conn, id, seq, payload)) return;
      if (conn->state_ != UcxConnection::State::kReady) break;
      arrived_in_order(conn, seq);
      Event e;
      e.kind = Event::kMessage;
      e.conn = conn;
      e.bytes.assign(payload.begin(), payload.end());
      queue_event(std::move(e));
      return;
    }
    case kAmNotify:
      if (hold_early(*conn, id, 0, payload)) return;
      if (conn->state_ != UcxConnection::State::kReady) break;
      handle_notify(conn, payload);
      return;
    // The handshake changes state here, at once, so that a message that
    // follows it in the same ucp_worker_progress() finds the connection
    // ready; what it has to send waits for run_deferred().
    case kAmHello:
      handle_hello(conn, payload);
      return;
    case kAmHelloAck:
      handle_hello_ack(conn, payload);
      return;
    case kAmBye:
      // Every notification the peer published before its bye is delivered
      // before the disconnect.
      drain_ring(conn, std::numeric_limits<uint64_t>::max(), false);
      close_locked(*conn, Unavailable("peer closed the connection"), false);
      return;
    case kAmWake:
      return;  // its arrival woke the worker; progress() polls the rings next
    default:
      break;
  }
  ++rejected_messages_;
  PSLD_LOG_WARN("ucx: dropped an unexpected message (id {}) from {}", id, conn->peer());
}

size_t ucx_detail::notify_batch_records(std::span<const uint8_t> payload) {
  if (payload.size() < 4) return 0;
  const uint64_t n = load_le(payload.data(), 4);
  if (n == 0 || n > kNotifyBatch || payload.size() != 4 + n * kWriteHeaderBytes) return 0;
  return static_cast<size_t>(n);
}

void UcxCore::handle_notify(const ConnPtr& conn, std::span<const uint8_t> payload) {
  if (payload.size() < 4) {
    reject_write(conn.get(), "truncated notification");
    return;
  }
  const size_t n = notify_batch_records(payload);
  if (n == 0) {
    reject_write(conn.get(), "malformed notification batch");
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const WriteHeader h = decode_header(payload.data() + 4 + i * kWriteHeaderBytes);
    arrived_in_order(conn, h.seq);
    deliver_notification(conn, h);
  }
}

ucs_status_t UcxCore::on_am_write(const ConnPtr& conn, const void* header, size_t header_length,
                                  void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (conn->state_ != UcxConnection::State::kReady || header_length != kWriteHeaderBytes) {
    reject_write(conn.get(), "malformed write header");
    return UCS_OK;
  }
  const WriteHeader h = decode_header(static_cast<const uint8_t*>(header));
  // A rendezvous write is notified when its bytes land, possibly after
  // notifications numbered later; its number is taken now so that a failed
  // receive cannot hold up the ring.
  arrived_in_order(conn, h.seq);
  std::shared_ptr<UcxRegion> region;
  if (h.length != length || !validate_target(h, &region)) {
    reject_write(conn.get(),
                 "write names no region we export, a wrong secret, or bytes outside "
                 "the region");
    return UCS_OK;  // a rendezvous is released unreceived
  }
  uint8_t* dst = region->data() + h.offset;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Rendezvous: UCX fetches the payload straight into the target region,
    // and on_write waits for that to complete.
    OpCtx* op = new_op(OpCtx::kRecvWrite);
    op->conn = conn;
    op->region = region;
    op->notify = h.notify;
    op->length = h.length;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.recv_am = recv_am_cb;
    p.user_data = op;
    p.memh = region->memh();
    finish_request(op, ucp_am_recv_data_nbx(worker_, data, dst, length, &p));
    return UCS_OK;
  }
  // Eager: UCX already holds the bytes; one copy puts them in place. Our
  // writers send to device memory by rendezvous only.
  if (region->kind() != MemoryKind::kHost) {
    reject_write(conn.get(), "eager write into device memory (the writer must use rendezvous)");
    return UCS_OK;
  }
  if (length > 0) std::memcpy(dst, data, length);
  queue_write(conn, h.notify, h.length);
  return UCS_OK;
}

}  // namespace psld::transport
