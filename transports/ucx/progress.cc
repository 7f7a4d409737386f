// UCX progress: requests and their completions, progress, wait, deadlines, closing.
#include "transports/ucx/core.h"

#include <fmt/format.h>
#include <poll.h>

#include <algorithm>
#include <ctime>
#include <limits>

#include "base/log.h"

namespace psld::transport {

// ---------------------------------------------------------------------------
// Requests

OpCtx* UcxCore::new_op(OpCtx::Kind kind) {
  OpCtx* op;
  if (!free_ops_.empty()) {
    op = free_ops_.back();
    free_ops_.pop_back();
  } else {
    op = new OpCtx;
    op->core = this;
  }
  op->kind = kind;
  op->prev = nullptr;
  op->next = live_ops_;
  if (live_ops_ != nullptr) live_ops_->prev = op;
  live_ops_ = op;
  ++live_count_;
  return op;
}

void UcxCore::unlink_op(OpCtx* op) {
  if (op->prev != nullptr) op->prev->next = op->next;
  if (op->next != nullptr) op->next->prev = op->prev;
  if (live_ops_ == op) live_ops_ = op->next;
  --live_count_;
  op->request = nullptr;
  op->op_id = 0;
  op->deadline = Clock::time_point::max();
  op->conn.reset();
  op->region.reset();
  op->remote.reset();
  op->bytes.clear();  // keeps its capacity for the next message
  op->batch.clear();
  // A bounded pool: enough for a window of writes on a few connections.
  if (free_ops_.size() < 1024 && op->bytes.capacity() <= 2 * kMaxMessageBytes) {
    free_ops_.push_back(op);
  } else {
    delete op;
  }
}

void UcxCore::finish_user(UserOp& u, OpCtx* op, ucs_status_ptr_t r, uint64_t conn_id,
                          std::string_view what) {
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
    if (u.op_id == 0) u.op_id = pending_.add(conn_id, op->deadline, std::move(u.done));
    op->op_id = u.op_id;
    op->request = r;
    return;
  }
  complete_user(u, ucs_to_status(r == nullptr ? UCS_OK : UCS_PTR_STATUS(r), what));
  unlink_op(op);
}

void UcxCore::finish_request(OpCtx* op, ucs_status_ptr_t r) {
  if (r == nullptr) {
    on_request_done(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    on_request_done(op, UCS_PTR_STATUS(r));
  } else {
    op->request = r;
  }
}

void UcxCore::on_request_done(OpCtx* op, ucs_status_t status) {
  mu_.assert_held();
  switch (op->kind) {
    case OpCtx::kPut:
      // Local completion only; the flush that covers it completes the write.
      if (status != UCS_OK) complete(op->op_id, ucs_to_status(status, "put failed"));
      break;
    case OpCtx::kFlush:
      flushed_.push_back(Flushed{std::move(op->conn), std::move(op->batch), status});
      break;
    case OpCtx::kAmWrite:
      complete(op->op_id, ucs_to_status(status, "write failed"));
      break;
    case OpCtx::kSend:
      complete(op->op_id, ucs_to_status(status, "send failed"));
      break;
    case OpCtx::kControl:
      if (status != UCS_OK && status != UCS_ERR_CANCELED) {
        PSLD_LOG_DEBUG("ucx: control message on connection {} failed: {}",
                       op->conn ? op->conn->id() : 0, ucs_status_string(status));
      }
      break;
    case OpCtx::kBye:
      if (op->conn && op->conn->bye_in_flight_) {
        op->conn->bye_in_flight_ = false;
        to_close_.push_back(op->conn);
      }
      break;
    case OpCtx::kRecvWrite:
      if (status == UCS_OK && op->conn && op->conn->state_ == UcxConnection::State::kReady) {
        queue_write(op->conn, op->notify, op->length);
      } else if (status != UCS_OK) {
        PSLD_LOG_DEBUG("ucx: incoming write on connection {} failed: {}",
                       op->conn ? op->conn->id() : 0, ucs_status_string(status));
      }
      break;
    case OpCtx::kRecvControl:
      if (status == UCS_OK && op->conn) handle_control(op->conn, op->am_id, op->seq, op->bytes);
      break;
    case OpCtx::kClose:
      break;
  }
  unlink_op(op);
}

// ---------------------------------------------------------------------------
// Closing

void UcxCore::on_ep_error(ucp_ep_h ep, ucs_status_t status) {
  mu_.assert_held();
  auto it = ep_peers_.find(ep);
  if (it == ep_peers_.end()) return;
  // Every connection to that peer shares the endpoint: all of them fail,
  // and the endpoint is closed once they let go of it (run_deferred).
  for (auto& [id, conn] : conns_) {
    if (conn->ep_ != ep) continue;
    failed_.emplace_back(conn, Unavailable(fmt::format("connection to {} failed: {} (peer died or "
                                                       "closed)",
                                                       conn->peer(), ucs_status_string(status))));
  }
  peer_eps_.erase(it->second);
  ep_peers_.erase(it);
  dead_eps_.push_back(ep);
}

void UcxCore::close_connection(UcxConnection& conn) {
  {
    MutexLock lock(mu_);
    if (conn.state_ == UcxConnection::State::kClosed) return;
    close_locked(conn, Aborted("connection closed locally"), true);
    run_deferred();
  }
  maybe_wake();
}

void UcxCore::close_locked(UcxConnection& conn, const Status& why, bool send_bye) {
  if (conn.state_ == UcxConnection::State::kClosed) return;
  if (conn.state_ == UcxConnection::State::kHandshake) --handshaking_;
  const bool was_visible = conn.state_ == UcxConnection::State::kReady || conn.client_;
  conn.state_ = UcxConnection::State::kClosed;
  conn.open_ = false;
  if (conn.boot_fd_ >= 0) end_boot(conn.boot_fd_);
  if (conn.watch_fd_ >= 0) end_watch(conn.watch_fd_, send_bye);
  release_rings(conn);
  for (auto& r : pending_.fail_connection(conn.id(), why))
    push_completion(std::move(r));
  conn.queued_.clear();
  conn.unflushed_.clear();
  ConnPtr self = conn.shared_from_this();
  if (was_visible) {
    Event e;
    e.kind = Event::kDisconnect;
    e.conn = self;
    e.why = why;
    queue_event(std::move(e));
  }
  // The bye tells the peer at once, whatever the lanes; UCX's own disconnect
  // (through the connection manager, or a closed socket) comes later or, over
  // shared memory, only with keep-alive.
  if (send_bye && conn.ep_ != nullptr) {
    conn.bye_in_flight_ = true;
    conn.bye_deadline_ = Clock::now() + std::min<Clock::duration>(options_.common.op_timeout,
                                                                  std::chrono::seconds(1));
    send_control(conn, kAmBye, {}, OpCtx::kBye);  // its completion queues the close
    return;
  }
  to_close_.push_back(self);
}

void UcxCore::detach(UcxConnection& conn) {
  // The endpoint stays: other connections to the peer use it, and closing
  // it would fail the peer's side of them. A request of this connection
  // still in flight on it completes later and is ignored (its operation
  // already failed).
  conn.ep_ = nullptr;
  conn.bye_in_flight_ = false;
  by_token_.erase(conn.token_);
  conns_.erase(conn.id());
}

void UcxCore::run_deferred() {
  for (;;) {
    if (!acks_.empty()) {
      std::vector<ConnPtr> a;
      a.swap(acks_);
      for (auto& conn : a) {
        if (conn->state_ == UcxConnection::State::kReady) {
          send_control(*conn, kAmHelloAck, hello_payload(*conn), OpCtx::kControl);
        }
      }
      continue;
    }
    if (!ready_.empty()) {
      std::vector<ConnPtr> r;
      r.swap(ready_);
      for (auto& conn : r)
        dispatch_queued(*conn);
      continue;
    }
    if (!failed_.empty()) {
      std::vector<std::pair<ConnPtr, Status>> f;
      f.swap(failed_);
      for (auto& [conn, why] : f) {
        close_locked(*conn, why, false);
        to_close_.push_back(conn);  // also when a bye was in flight
      }
      continue;
    }
    if (!flushed_.empty()) {
      std::vector<Flushed> f;
      f.swap(flushed_);
      for (auto& x : f)
        on_flushed(x.conn, std::move(x.batch), x.status);
      continue;
    }
    if (!to_close_.empty()) {
      std::vector<ConnPtr> c;
      c.swap(to_close_);
      for (auto& conn : c)
        detach(*conn);
      continue;
    }
    if (!dead_eps_.empty()) {
      std::vector<ucp_ep_h> d;
      d.swap(dead_eps_);
      for (ucp_ep_h ep : d) {
        for (auto& [id, conn] : conns_) {
          if (conn->ep_ == ep) conn->ep_ = nullptr;  // closed, its bye still in flight
        }
        close_peer_ep(ep);
      }
      continue;
    }
    dead_rings_.clear();
    break;
  }
}

void UcxCore::check_deadlines(Clock::time_point now) {
  if (pending_.next_deadline() <= now) {
    // UCX 1.13 can cancel receives only; a send keeps running after its
    // operation timed out, and its late completion is ignored by PendingOps.
    for (OpCtx* op = live_ops_; op != nullptr; op = op->next) {
      if (op->op_id != 0 && op->request != nullptr && op->deadline <= now) {
        ucp_request_cancel(worker_, op->request);
      }
    }
    for (auto& r : pending_.expire(now))
      push_completion(std::move(r));
  }
  if (!boots_.empty()) expire_boots(now);
  if (handshaking_ == 0 && to_close_.empty()) {
    bool any_bye = false;
    for (auto& [id, conn] : conns_)
      any_bye |= conn->bye_in_flight_;
    if (!any_bye) return;
  }
  std::vector<ConnPtr> expired_handshakes, stuck_byes;
  for (auto& [id, conn] : conns_) {
    if (conn->state_ == UcxConnection::State::kHandshake && conn->handshake_deadline_ <= now) {
      expired_handshakes.push_back(conn);
    }
    if (conn->bye_in_flight_ && conn->bye_deadline_ <= now) stuck_byes.push_back(conn);
  }
  for (auto& conn : expired_handshakes) {
    close_locked(*conn,
                 Unavailable(fmt::format("{} did not answer the handshake within {} ms (nobody "
                                         "listening there, or its transport is not progressed)",
                                         conn->peer(), options_.common.op_timeout.count())),
                 false);
  }
  for (auto& conn : stuck_byes)
    to_close_.push_back(conn);
  run_deferred();
}

// ---------------------------------------------------------------------------
// Progress

size_t UcxCore::progress() {
  MutexLock progress_lock(progress_mu_);
  // The fast path, while UCX is idle and peers write into our rings: no
  // worker lock, no worker progress, just the rings (see kUcxPollPeriod and
  // kRingPollsPerCall).
  if (ucx_idle_.load(std::memory_order_relaxed) &&
      polled_version_ == rx_version_.load(std::memory_order_acquire) &&
      poll_clock() - last_ucx_progress_ < ucx_poll_period_) {
    size_t n = 0;
    for (int i = 0; i < kRingPollsPerCall && n == 0; ++i)
      n = poll_rings_unlocked();
    return n;
  }
  size_t work = 0;
  {
    MutexLock lock(mu_);
    if (worker_ == nullptr) return 0;
    drain_graveyard();
    work = ucp_worker_progress(worker_);
    ucx_poll_period_ =
        work == 0 ? std::min(2 * ucx_poll_period_, kUcxPollPeriodMax) : kUcxPollPeriod;
    last_ucx_progress_ = poll_clock();
    timespec coarse{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &coarse);
    const int64_t tick = static_cast<int64_t>(coarse.tv_sec) * 1000000000 + coarse.tv_nsec;
    // The bootstrap's sockets: at once while boots run or after wait() saw
    // them ready, else once per tick of the coarse clock (an epoll_wait per
    // call would cost a busy-polling loop ~300 ns; a new connection waits at
    // most a tick, a few milliseconds).
    if (!boots_.empty() || boot_wake_.exchange(false, std::memory_order_relaxed) ||
        tick != last_deadline_tick_) {
      poll_boots();
    }
    run_deferred();
    // Deadlines are milliseconds away: look at them once per tick of the
    // coarse clock (a variable in the vDSO, no TSC read), not on every call of
    // a busy-polling loop, where the check (a clock read and PendingOps' lock)
    // was ~10% of an idle spin.
    if (tick != last_deadline_tick_) {
      last_deadline_tick_ = tick;
      check_deadlines(Clock::now());
    }
    if (!rx_conns_.empty()) {
      bool attached = false;
      for (const ConnPtr& conn : rx_conns_) {
        attached |= conn->rx_ring_->attached();
        drain_ring(conn, std::numeric_limits<uint64_t>::max(), true);
      }
      rings_attached_ = attached;
    }
    const uint64_t version = rx_version_.load(std::memory_order_acquire);
    if (polled_version_ != version) {
      polled_.clear();
      for (const ConnPtr& conn : rx_conns_)
        polled_.push_back(Polled{conn, conn.get(), conn->rx_ring_, ValidTarget{}});
      polled_version_ = version;
    }
    // Last, after whatever this call queued (queue_event cleared it): those
    // events are delivered below, so they need no other progress().
    ucx_idle_.store(work == 0 && rings_attached_, std::memory_order_relaxed);
    events_.swap(delivering_);
  }
  for (Event& e : delivering_)
    deliver(e);
  work += delivering_.size();
  delivering_.clear();
  return work;
}

void UcxCore::deliver(Event& e) {
  if (e.kind == Event::kCompletion) {
    e.ready.run();
    return;
  }
  if (shut_) return;  // after shutdown no handler runs
  switch (e.kind) {
    case Event::kAccept:
      handler_->on_accept(e.conn);
      break;
    case Event::kWrite:
      handler_->on_write(e.conn, e.notify, e.length);
      break;
    case Event::kMessage:
      handler_->on_message(e.conn, e.bytes);
      break;
    case Event::kDisconnect:
      handler_->on_disconnect(e.conn, e.why);
      break;
    case Event::kCompletion:
      break;
  }
}

void UcxCore::wait(std::chrono::milliseconds timeout) {
  auto until = Clock::now() + timeout;
  bool advertised = false;
  auto stop_advertising = [&]() REQUIRES(mu_) {
    if (advertised && --ring_sleepers_ == 0) set_rings_sleeping(false);
    advertised = false;
  };
  {
    MutexLock lock(mu_);
    if (worker_ == nullptr) return;
    if (!events_.empty()) return;
    ucx_idle_.store(false,
                    std::memory_order_relaxed);  // whatever wakes us, the next progress() asks UCX
    until = std::min(until, pending_.next_deadline());
    if (handshaking_ > 0 || !boots_.empty()) {
      until = std::min(until, Clock::now() + std::chrono::milliseconds(10));
    }
    if (!rx_conns_.empty()) {
      // Writers that publish a ring record from now on send kAmWake; one
      // published before is seen here (seq_cst flag store and stamp loads,
      // against ring_notify's stamp store and flag load).
      advertised = true;
      if (ring_sleepers_++ == 0) set_rings_sleeping(true);
      for (const ConnPtr& conn : rx_conns_) {
        if (ring_has_next(*conn)) {
          stop_advertising();
          return;
        }
      }
    }
    // Arming fails with BUSY when events are already pending: no sleep.
    if (ucp_worker_arm(worker_) != UCS_OK) {
      stop_advertising();
      return;
    }
    sleepers_.fetch_add(1);
  }
  pollfd fds[3] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}, {boot_epfd_, POLLIN, 0}};
  const auto left = until - Clock::now();
  if (left > Clock::duration::zero()) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    ppoll(fds, 3, &ts, nullptr);
  }
  if (fds[2].revents & POLLIN) boot_wake_.store(true, std::memory_order_relaxed);
  if (fds[1].revents & POLLIN) {
    uint64_t v = 0;
    [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof(v));
  }
  if (advertised) {
    MutexLock lock(mu_);
    stop_advertising();
  }
  sleepers_.fetch_sub(1);
}

}  // namespace psld::transport
