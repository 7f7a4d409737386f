// Progress of the verbs backend: completions, device events, progress(), wait() and its spin.
#include "transports/verbs/core.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "base/log.h"

namespace psld::transport {
namespace verbs {

// ---------------------------------------------------------------------------
// Completions

size_t Core::poll_send_cq_locked(Events& events) {
  size_t total = 0;
  for (const ibv_wc& wc : send_stash_) {
    on_send_completion_locked(wc, events);
  }
  total += send_stash_.size();
  send_stash_.clear();
  ibv_wc wcs[kPollBatch];
  while (total < kMaxCompletionsPerProgress) {
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n < 0) {
      fail_device_locked(Unavailable("ibv_poll_cq on the send CQ failed"), events);
      break;
    }
    for (int i = 0; i < n; ++i) {
      on_send_completion_locked(wcs[i], events);
    }
    total += static_cast<size_t>(n);
    if (n < kPollBatch) break;
  }
  return total;
}

size_t Core::poll_recv_cq_locked(Events& events, std::vector<uint32_t>& reposts) {
  size_t total = 0;
  for (const ibv_wc& wc : recv_stash_) {
    on_recv_completion_locked(wc, events, reposts);
  }
  total += recv_stash_.size();
  recv_stash_.clear();
  ibv_wc wcs[kPollBatch];
  while (total < kMaxCompletionsPerProgress) {
    const int n = ibv_poll_cq(recv_cq_, kPollBatch, wcs);
    if (n < 0) {
      fail_device_locked(Unavailable("ibv_poll_cq on the receive CQ failed"), events);
      break;
    }
    for (int i = 0; i < n; ++i) {
      on_recv_completion_locked(wcs[i], events, reposts);
    }
    total += static_cast<size_t>(n);
    if (n < kPollBatch) break;
  }
  return total;
}

void Core::on_send_completion_locked(const ibv_wc& wc, Events& events) {
  ConnPtr c = find_qp_locked(wc.qp_num);
  if (!c) return;  // its QP was destroyed by force; slots were returned then
  auto it = c->inflight_.find(wc.wr_id);
  if (it == c->inflight_.end()) {
    PSLD_LOG_WARN("verbs: completion for unknown work request {} on QP {:#x}", wc.wr_id, wc.qp_num);
    return;
  }
  Inflight rec = std::move(it->second);
  c->inflight_.erase(it);
  c->sq_.complete();
  if (rec.bounce >= 0) send_pool_.free.push_back(rec.bounce);
  if (wc.status == IBV_WC_SUCCESS) {
    push_ready(events, pending_.take(rec.op_id, Status::Ok()));
    return;
  }
  // Only wr_id, status, qp_num and vendor_err are valid in an error
  // completion. A flush error means the QP failed or was closed before:
  // the first error (or the close) already said why.
  Status why = Unavailable(fmt::format("{} to {} failed: {} (vendor error {:#x})",
                                       rec.is_write ? "RDMA write" : "send", c->peer_,
                                       ibv_wc_status_str(wc.status), wc.vendor_err));
  push_ready(events, pending_.take(rec.op_id, why));
  break_locked(c, why, false, events);
}

void Core::on_recv_completion_locked(const ibv_wc& wc, Events& events,
                                     std::vector<uint32_t>& reposts) {
  if (wc.wr_id >= recv_pool_.count) {
    PSLD_LOG_ERROR("verbs: receive completion with unknown buffer {}", wc.wr_id);
    return;
  }
  const auto buffer = static_cast<uint32_t>(wc.wr_id);
  reposts.push_back(buffer);  // after this progress() ran the handlers
  ConnPtr c = find_qp_locked(wc.qp_num);
  if (wc.status != IBV_WC_SUCCESS) {
    if (c) {
      break_locked(c,
                   Unavailable(fmt::format("receive from {} failed: {} (vendor error {:#x})",
                                           c->peer_, ibv_wc_status_str(wc.status), wc.vendor_err)),
                   false, events);
    }
    return;
  }
  if (!c || c->state_ == ConnState::kClosed) return;  // arrived after the close
  if (c->state_ == ConnState::kAwaitReady) promote_locked(c, events);
  Event e;
  e.conn = c;
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    e.kind = Event::Kind::kWrite;
    e.notify = ntohl(wc.imm_data);
    e.length = wc.byte_len;
  } else if (wc.opcode == IBV_WC_RECV && wc.byte_len <= kMaxMessageBytes) {
    e.kind = Event::Kind::kMessage;
    e.buffer = buffer;
    e.length = wc.byte_len;
  } else {
    break_locked(c,
                 Unavailable(fmt::format("unexpected receive from {} (opcode {}, {} bytes)",
                                         c->peer_, static_cast<int>(wc.opcode), wc.byte_len)),
                 false, events);
    return;
  }
  events.push_back(std::move(e));
}

// Polls both CQs into the stashes without handling anything; true if any
// completion is waiting.
bool Core::peek_cqs_locked() {
  if (send_stash_.size() < kMaxCompletionsPerProgress) {
    ibv_wc wcs[kPollBatch];
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n > 0) send_stash_.insert(send_stash_.end(), wcs, wcs + n);
    if (n < 0) slow_path_due_ = true;
  }
  if (recv_stash_.size() < kMaxCompletionsPerProgress) {
    ibv_wc wcs[kPollBatch];
    const int n = ibv_poll_cq(recv_cq_, kPollBatch, wcs);
    if (n > 0) recv_stash_.insert(recv_stash_.end(), wcs, wcs + n);
    if (n < 0) slow_path_due_ = true;
  }
  return !send_stash_.empty() || !recv_stash_.empty();
}

void Core::arm_cqs_locked() {
  if (!send_armed_) {
    if (const int rc = ibv_req_notify_cq(send_cq_, 0); rc == 0) {
      send_armed_ = true;
    } else {
      PSLD_LOG_WARN("verbs: ibv_req_notify_cq(send): {}", errno_text(rc));
    }
  }
  if (!recv_armed_) {
    if (const int rc = ibv_req_notify_cq(recv_cq_, 0); rc == 0) {
      recv_armed_ = true;
    } else {
      PSLD_LOG_WARN("verbs: ibv_req_notify_cq(recv): {}", errno_text(rc));
    }
  }
}

void Core::post_receives_locked(const std::vector<uint32_t>& buffers) {
  constexpr size_t kBatch = 64;
  ibv_recv_wr wrs[kBatch];
  ibv_sge sges[kBatch];
  for (size_t i = 0; i < buffers.size(); i += kBatch) {
    const size_t n = std::min(kBatch, buffers.size() - i);
    for (size_t j = 0; j < n; ++j) {
      const uint32_t b = buffers[i + j];
      sges[j].addr = reinterpret_cast<uintptr_t>(recv_pool_.at(b));
      sges[j].length = recv_pool_.bytes;
      sges[j].lkey = recv_pool_.mr->lkey;
      wrs[j] = ibv_recv_wr{};
      wrs[j].wr_id = b;
      wrs[j].sg_list = &sges[j];
      wrs[j].num_sge = 1;
      wrs[j].next = j + 1 < n ? &wrs[j + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (const int rc = ibv_post_srq_recv(srq_, wrs, &bad); rc != 0) {
      // Losing receive buffers shrinks the SRQ; senders then see more RNR
      // retries, not errors. Nothing else can be done about it here.
      PSLD_LOG_ERROR("verbs: ibv_post_srq_recv: {}", errno_text(rc));
    }
  }
}

void Core::drain_cq_events_locked() {
  ibv_cq* cq = nullptr;
  void* cq_context = nullptr;
  while (channel_ != nullptr && ibv_get_cq_event(channel_, &cq, &cq_context) == 0) {
    ibv_ack_cq_events(cq, 1);
    if (cq == send_cq_) send_armed_ = false;
    if (cq == recv_cq_) recv_armed_ = false;
  }
}

void Core::drain_async_events_locked(Events& events) {
  ibv_async_event ev{};
  while (ibv_get_async_event(ctx_, &ev) == 0) {
    const char* what = ibv_event_type_str(ev.event_type);
    switch (ev.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PATH_MIG_ERR:
        if (ConnPtr c = find_qp_locked(ev.element.qp->qp_num)) {
          break_locked(c, Unavailable(fmt::format("queue pair to {} failed: {}", c->peer_, what)),
                       false, events);
        }
        break;
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        if (ConnPtr c = find_qp_locked(ev.element.qp->qp_num)) c->last_wqe_ = true;
        break;
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_SRQ_ERR:
      case IBV_EVENT_DEVICE_FATAL:
        PSLD_LOG_ERROR("verbs: {} on {}: every connection fails", what, device_name_);
        fail_device_locked(Unavailable(fmt::format("RDMA device {}: {}", device_name_, what)),
                           events);
        break;
      case IBV_EVENT_PORT_ERR:
        PSLD_LOG_WARN("verbs: {} port {} went down", device_name_, ev.element.port_num);
        break;
      default:
        PSLD_LOG_DEBUG("verbs: async event {}", what);
        break;
    }
    ibv_ack_async_event(&ev);
  }
}

// ---------------------------------------------------------------------------
// progress / wait

void Core::slow_path_locked(Events& events, std::vector<uint32_t>& reposts, Clock::time_point now) {
  slow_path_due_ = false;
  last_slow_path_ = now;
  epoll_event evs[64];
  const int n = epoll_wait(epfd_, evs, 64, 0);
  for (int i = 0; i < n; ++i) {
    const uint64_t tag = evs[i].data.u64;
    if (tag == kTagWake) {
      uint64_t v = 0;
      while (::read(wake_fd_, &v, sizeof(v)) > 0) {
      }
    } else if (tag == kTagChannel) {
      drain_cq_events_locked();
    } else if (tag == kTagAsync) {
      drain_async_events_locked(events);
    } else if (tag == kTagListen) {
      if (listen_fd_ >= 0) accept_all_locked(events);
    } else {
      auto it = conns_.find(tag);
      if (it != conns_.end())
        handle_side_channel_locked(ConnPtr(it->second), evs[i].events, events);
    }
  }
  std::vector<ConnPtr> late;
  for (auto& [id, c] : conns_) {
    const bool handshaking = c->state_ == ConnState::kAwaitHello ||
                             c->state_ == ConnState::kAwaitReply ||
                             c->state_ == ConnState::kAwaitReady;
    if (handshaking && now >= c->handshake_deadline_) late.push_back(c);
  }
  for (auto& c : late) {
    if (!c->reported_) PSLD_LOG_WARN("verbs: handshake with {} timed out", c->peer_);
    break_locked(c,
                 Unavailable(fmt::format("handshake with {} did not finish within op_timeout "
                                         "({} ms); is the peer calling progress()?",
                                         c->peer_, opts_.common.op_timeout.count())),
                 false, events);
  }
  reap_closed_locked(events, reposts, now);
}

size_t Core::run_event(Event& e) {
  if (e.kind == Event::Kind::kCompletion) {
    e.ready.run();
    return 1;
  }
  if (shut_.load()) return 0;  // after shutdown() no handler runs
  switch (e.kind) {
    case Event::Kind::kAccept:
      handler_->on_accept(e.conn);
      break;
    case Event::Kind::kWrite:
      if (!e.conn->is_open()) return 0;  // closed by an earlier handler
      handler_->on_write(e.conn, e.notify, e.length);
      break;
    case Event::Kind::kMessage:
      if (!e.conn->is_open()) return 0;
      handler_->on_message(e.conn, {recv_pool_.at(e.buffer), static_cast<size_t>(e.length)});
      break;
    case Event::Kind::kDisconnect:
      handler_->on_disconnect(e.conn, e.why);
      break;
    case Event::Kind::kCompletion:
      break;
  }
  return 1;
}

size_t Core::progress() {
  MutexLock progress_lock(progress_mu_);
  progress_owner_.store(std::this_thread::get_id());
  Events events;
  std::vector<uint32_t> reposts;
  {
    MutexLock lock(mu_);
    if (!torn_down_) {
      events.swap(deferred_);
      const size_t work = poll_send_cq_locked(events) + poll_recv_cq_locked(events, reposts);
      const auto now = Clock::now();
      if (work == 0 || slow_path_due_ || now - last_slow_path_ >= kSlowPathInterval) {
        slow_path_locked(events, reposts, now);
      }
      drain_all_locked(events);
    }
  }
  for (auto& r : pending_.expire(Clock::now())) {
    push_ready(events, std::move(r));
  }
  size_t n = 0;
  for (Event& e : events) {
    n += run_event(e);
  }
  events.clear();  // drops connection references before teardown may run
  {
    MutexLock lock(mu_);
    if (!torn_down_ && !reposts.empty()) post_receives_locked(reposts);
  }
  progress_owner_.store(std::thread::id());
  if (teardown_deferred_.exchange(false)) teardown();  // a handler called shutdown()
  return n;
}

void Core::wait(std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  const auto until = start + timeout;
  Clock::time_point timer = Clock::time_point::max();
  AdaptiveSpin::Micros spin_budget{0};
  {
    MutexLock lock(mu_);
    if (!torn_down_) {
      if (!deferred_.empty() || !send_stash_.empty() || !recv_stash_.empty() || slow_path_due_) {
        return;
      }
      spin_budget = spin_.budget();
    }
  }
  // Spin first while the adaptive budget says completions come quickly; the
  // lock is taken per poll so that writers on other threads get through.
  const auto spin_until = std::min(until, start + spin_budget);
  bool spun = false;
  while (Clock::now() < spin_until) {
    spun = true;
    MutexLock lock(mu_);
    if (torn_down_) break;
    if (peek_cqs_locked() || !deferred_.empty()) {
      spin_.found_work();
      return;
    }
  }
  {
    MutexLock lock(mu_);
    if (!torn_down_) {
      if (spun) spin_.found_nothing();
      // Arm, then look once more: a completion that arrived between the last
      // poll and the arming raises no event.
      arm_cqs_locked();
      if (peek_cqs_locked()) return;
      for (const auto& [id, c] : conns_) {
        if (c->state_ == ConnState::kClosed) {
          timer = std::min(timer, Clock::now() + 10ms);  // a QP waits to be reaped
        } else if (c->state_ != ConnState::kReady) {
          timer = std::min(timer, c->handshake_deadline_);
        }
      }
    }
  }
  timer = std::min({timer, until, pending_.next_deadline()});
  const auto left = timer - Clock::now();
  const int ms = left <= Clock::duration::zero()
                     ? 0
                     : static_cast<int>(std::min<int64_t>(
                           std::chrono::ceil<std::chrono::milliseconds>(left).count(), INT32_MAX));
  epoll_event evs[16];
  const auto slept_from = Clock::now();
  const int n = epoll_wait(epfd_, evs, 16, ms);
  bool completion = false, other = false;
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == kTagWake) {
      uint64_t v = 0;
      while (::read(wake_fd_, &v, sizeof(v)) > 0) {
      }
    } else {
      (evs[i].data.u64 == kTagChannel ? completion : other) = true;
    }
  }
  MutexLock lock(mu_);
  if (completion || other) slow_path_due_ = true;
  // Woken by a completion soon after going to sleep: a spin would have
  // caught it for less.
  if (completion && Clock::now() - slept_from <= kMaxSpin) spin_.found_work();
}

void Core::wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  // EAGAIN means the counter is saturated: a wake is pending anyway.
  (void)!::write(wake_fd_, &one, sizeof(one));
}

}  // namespace verbs
}  // namespace psld::transport
