// The data path of the verbs backend: WRITE_WITH_IMM and SENDs through the send queue, close.
#include "transports/verbs/core.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <sys/socket.h>

#include <cstring>

#include "base/log.h"

namespace psld::transport {
namespace verbs {

// ---------------------------------------------------------------------------
// Data path

Status Core::check_backend_locked(const VerbsConnection& c, const WriteRequest& req) const {
  if (c.state_ == ConnState::kClosed) {
    return Unavailable(fmt::format("connection to {} is closed", c.peer_));
  }
  if (shut_.load()) return Unavailable("verbs transport is shut down");
  // Connection::write proved both are this backend's (by their tags).
  if (static_cast<const VerbsRegion*>(req.local)->transport_id() != transport_id_) {
    return Connection::foreign_source();
  }
  const auto* remote = static_cast<const VerbsRemoteRegion*>(req.remote);
  if (remote->connection_id() != c.id_) return Connection::foreign_target();
  if (req.length > max_write_bytes_) {
    return OutOfRange(
        fmt::format("write of {} bytes exceeds the port's largest message ({} bytes); "
                    "split it",
                    req.length, max_write_bytes_));
  }
  if (c.peer_transport_id_ != 0 && remote->key().transport_id != c.peer_transport_id_) {
    return InvalidArgument("write target's remote key belongs to another transport");
  }
  return Status::Ok();
}

void Core::drain_locked(const ConnPtr& c, Events& events) {
  if (c->state_ != ConnState::kReady || c->sq_.backlog() == 0) return;
  Status failure;
  c->sq_.drain([&](SendItem& item) -> PostResult {
    mu_.assert_held();  // drain() calls back before it returns, here under mu_
    // An operation that timed out while it waited here is not sent at all:
    // its caller was told Timeout and may already reuse the source.
    if (!pending_.contains(item.op_id)) return PostResult::kDropped;
    ibv_sge sge{};
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    Inflight rec;
    rec.op_id = item.op_id;
    rec.is_write = item.is_write;
    if (item.is_write) {
      sge.addr = item.local_addr;
      sge.length = item.length;
      sge.lkey = item.lkey;
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(item.imm);
      wr.wr.rdma.remote_addr = item.remote_addr;
      wr.wr.rdma.rkey = item.rkey;
      wr.num_sge = item.length > 0 ? 1 : 0;
      rec.src = item.src;
    } else {
      const auto size = static_cast<uint32_t>(item.bytes.size());
      wr.opcode = IBV_WR_SEND;
      wr.num_sge = size > 0 ? 1 : 0;
      if (size > 0 && size <= c->max_inline_) {
        // The provider copies inline data during ibv_post_send.
        sge.addr = reinterpret_cast<uintptr_t>(item.bytes.data());
        sge.length = size;
        wr.send_flags |= IBV_SEND_INLINE;
      } else if (size > 0) {
        if (send_pool_.free.empty()) return PostResult::kNotNow;
        rec.bounce = send_pool_.free.back();
        send_pool_.free.pop_back();
        uint8_t* buf = send_pool_.at(static_cast<uint32_t>(rec.bounce));
        std::memcpy(buf, item.bytes.data(), size);
        sge.addr = reinterpret_cast<uintptr_t>(buf);
        sge.length = size;
        sge.lkey = send_pool_.mr->lkey;
      }
    }
    const uint64_t wr_id = next_wr_id_++;
    wr.wr_id = wr_id;
    wr.sg_list = wr.num_sge > 0 ? &sge : nullptr;
    wr.send_flags |= IBV_SEND_SIGNALED;
    if (const int rc = ibv_post_send(c->qp_, &wr, &bad); rc != 0) {
      if (rec.bounce >= 0) send_pool_.free.push_back(rec.bounce);
      failure = Unavailable(fmt::format("ibv_post_send to {}: {}", c->peer_, errno_text(rc)));
      push_ready(events, pending_.take(item.op_id, failure));
      return PostResult::kFailed;
    }
    c->inflight_.emplace(wr_id, std::move(rec));
    return PostResult::kPosted;
  });
  if (!failure.ok()) break_locked(c, failure, false, events);
}

void Core::drain_all_locked(Events& events) {
  // Round-robin from where the last pass stopped: when the shared CQ budget
  // is what limits (more than kSendCqDepth / max_inflight busy connections),
  // every connection still gets its turn. Breaking a connection never erases
  // it from conns_ here, so the iterator stays valid.
  auto it = conns_.upper_bound(drain_cursor_);
  for (size_t n = 0; n < conns_.size(); ++n, ++it) {
    if (cq_budget_.used() >= cq_budget_.capacity()) return;
    if (it == conns_.end()) it = conns_.begin();
    const ConnPtr c = it->second;
    if (c->sq_.backlog() > 0) {
      drain_locked(c, events);
      drain_cursor_ = c->id_;
    }
  }
}

Status Core::check_backend(const VerbsConnection& c, const WriteRequest& req) {
  MutexLock lock(mu_);
  return check_backend_locked(c, req);
}

Status Core::write(VerbsConnection& c, const WriteRequest& req, Completion done) {
  Events events;
  MutexLock lock(mu_);
  PSLD_RETURN_IF_ERROR(check_backend_locked(c, req));
  if (c.sq_.backlog() >= c.sq_.max_backlog()) {
    return ResourceExhausted(
        fmt::format("{} operations already wait for send slots on {}; let progress() complete some",
                    c.sq_.backlog(), c.peer_));
  }
  const auto* local = static_cast<const VerbsRegion*>(req.local);
  const auto* remote = static_cast<const VerbsRemoteRegion*>(req.remote);
  SendItem item;
  item.src = local->weak_from_this().lock();
  if (!item.src) return InvalidArgument("write source region is being destroyed");
  item.is_write = true;
  item.local_addr = reinterpret_cast<uintptr_t>(local->data()) + req.local_offset;
  item.lkey = local->lkey();
  item.remote_addr = remote->key().addr + req.remote_offset;
  item.rkey = remote->key().rkey;
  item.remote_transport_id = remote->key().transport_id;
  item.length = static_cast<uint32_t>(req.length);
  item.imm = req.notify;
  item.op_id = pending_.add(c.id_, Clock::now() + opts_.common.op_timeout, std::move(done));
  (void)c.sq_.push(std::move(item));  // room was checked above
  drain_locked(c.shared_from_this(), events);
  if (!events.empty()) {
    for (Event& e : events) {
      deferred_.push_back(std::move(e));
    }
    wake();
  }
  return Status::Ok();
}

Status Core::send(VerbsConnection& c, std::span<const uint8_t> message, Completion done) {
  if (message.size() > kMaxMessageBytes) {
    return InvalidArgument(fmt::format("message of {} bytes exceeds the {}-byte limit",
                                       message.size(), kMaxMessageBytes));
  }
  Events events;
  MutexLock lock(mu_);
  if (c.state_ == ConnState::kClosed || shut_.load()) {
    return Unavailable(fmt::format("connection to {} is closed", c.peer_));
  }
  if (c.sq_.backlog() >= c.sq_.max_backlog()) {
    return ResourceExhausted(
        fmt::format("{} operations already wait for send slots on {}; let progress() complete some",
                    c.sq_.backlog(), c.peer_));
  }
  SendItem item;
  item.bytes.assign(message.begin(), message.end());
  item.op_id = pending_.add(c.id_, Clock::now() + opts_.common.op_timeout, std::move(done));
  (void)c.sq_.push(std::move(item));
  drain_locked(c.shared_from_this(), events);
  if (!events.empty()) {
    for (Event& e : events) {
      deferred_.push_back(std::move(e));
    }
    wake();
  }
  return Status::Ok();
}

Result<std::shared_ptr<RemoteRegion>> Core::import_region(VerbsConnection& c,
                                                          std::span<const uint8_t> key) {
  PSLD_ASSIGN_OR_RETURN(RemoteKey k, decode_remote_key(key));
  MutexLock lock(mu_);
  if (c.peer_transport_id_ != 0 && k.transport_id != c.peer_transport_id_) {
    return InvalidArgument(
        fmt::format("remote key belongs to transport {:#x}, not to this connection's peer {:#x}",
                    k.transport_id, c.peer_transport_id_));
  }
  return std::shared_ptr<RemoteRegion>(std::make_shared<VerbsRemoteRegion>(k, c.id_));
}

void Core::close(VerbsConnection& c) {
  Events events;
  MutexLock lock(mu_);
  if (c.state_ == ConnState::kClosed) return;
  break_locked(c.shared_from_this(), Aborted("connection closed locally"), true, events);
  for (Event& e : events) {
    deferred_.push_back(std::move(e));
  }
  wake();
}

// Closes one connection: its side channel (with a goodbye when we close on
// purpose), its QP to ERR (flushing what is posted), its waiting and pending
// operations failed with `why`. The QP itself is destroyed later by
// reap_closed_locked(), once its flushed completions are in.
void Core::break_locked(const ConnPtr& c, const Status& why, bool local, Events& events) {
  if (c->state_ == ConnState::kClosed) return;
  c->state_ = ConnState::kClosed;
  c->open_ = false;
  if (c->chan_.is_open()) {
    if (local) {
      const uint8_t bye = kByeByte;
      (void)c->chan_.send({&bye, 1});  // best effort: the close says the same
      ::shutdown(c->chan_.fd(), SHUT_WR);
    }
    epoll_del(c->chan_.fd());
    c->chan_.close();
  }
  if (c->qp_ != nullptr) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    if (const int rc = ibv_modify_qp(c->qp_, &a, IBV_QP_STATE); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_modify_qp({:#x}, ERR): {}", c->qp_num_, errno_text(rc));
    }
    c->drain_deadline_ = Clock::now() + kQpDrainTimeout;
  }
  (void)c->sq_.take_backlog();  // their operations fail just below
  for (auto& r : pending_.fail_connection(c->id_, why)) {
    push_ready(events, std::move(r));
  }
  if (c->reported_) {
    Event e;
    e.kind = Event::Kind::kDisconnect;
    e.conn = c;
    e.why = why;
    events.push_back(std::move(e));
  }
  if (!why.ok() && !local) {
    PSLD_LOG_INFO("verbs: connection {} closed: {}", c->peer_, why.message());
  }
}

void Core::fail_device_locked(const Status& why, Events& events) {
  device_failed_ = true;
  std::vector<ConnPtr> all;
  for (auto& [id, c] : conns_) {
    all.push_back(c);
  }
  for (auto& c : all) {
    break_locked(c, why, false, events);
  }
}

// Destroys the QPs of closed connections once safe: every posted send has
// completed (flushed), and the device said the QP will take no more SRQ
// receives (or kQpDrainTimeout passed). The receive CQ is polled first so
// that no completion of this QP is left behind to be attributed to a later
// QP that gets the same number.
void Core::reap_closed_locked(Events& events, std::vector<uint32_t>& reposts,
                              Clock::time_point now) {
  std::vector<ConnPtr> done;
  for (auto& [id, c] : conns_) {
    if (c->state_ != ConnState::kClosed) continue;
    if (c->qp_ != nullptr) {
      if (!c->inflight_.empty() && now < c->drain_deadline_) continue;
      if (c->reached_rtr_ && !c->last_wqe_ && now < c->drain_deadline_) continue;
    }
    done.push_back(c);
  }
  if (done.empty()) return;
  while (poll_recv_cq_locked(events, reposts) >= kMaxCompletionsPerProgress) {
  }
  for (auto& c : done) {
    if (!c->inflight_.empty()) {
      PSLD_LOG_WARN("verbs: destroying QP {:#x} with {} unflushed work requests", c->qp_num_,
                    c->inflight_.size());
    }
    destroy_qp_locked(*c);
    conns_.erase(c->id_);
  }
}

}  // namespace verbs
}  // namespace psld::transport
