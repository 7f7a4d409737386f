// Wire-up of the verbs backend: queue pairs (INIT, RTR, RTS) and the side channel handshake.
#include "transports/verbs/core.h"

#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/log.h"

namespace psld::transport {
namespace verbs {

namespace {

uint32_t side_channel_events(bool want_out) {
  return uint32_t{EPOLLIN} | uint32_t{EPOLLRDHUP} | (want_out ? uint32_t{EPOLLOUT} : 0u);
}

}  // namespace

// ---------------------------------------------------------------------------
// Queue pairs

Status Core::create_qp_locked(VerbsConnection& c) {
  ibv_qp_init_attr a{};
  a.send_cq = send_cq_;
  a.recv_cq = recv_cq_;
  a.srq = srq_;
  a.qp_type = IBV_QPT_RC;
  a.sq_sig_all = 0;  // every WR sets IBV_SEND_SIGNALED itself
  a.cap.max_send_wr = sq_depth_;
  a.cap.max_send_sge = 1;
  a.cap.max_inline_data = kWantedInline;
  ibv_qp* qp = ibv_create_qp(pd_, &a);
  if (qp == nullptr) {
    // Some devices refuse any inline data; it is an optimisation only.
    a.cap.max_inline_data = 0;
    qp = ibv_create_qp(pd_, &a);
  }
  if (qp == nullptr) return device_error("ibv_create_qp", errno);
  c.qp_ = qp;
  c.qp_num_ = qp->qp_num;
  c.max_inline_ = a.cap.max_inline_data;  // what the device actually granted
  by_qp_[c.qp_num_] = c.shared_from_this();

  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = port_;
  attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;  // peers' WRITE_WITH_IMM
  const int rc = ibv_modify_qp(
      qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc != 0) return Unavailable("ibv_modify_qp(INIT): " + errno_text(rc));
  return Status::Ok();
}

Hello Core::make_hello_locked(const VerbsConnection& c, uint32_t psn, uint64_t nonce) const {
  Hello h;
  h.link_layer = link_;
  h.mtu = static_cast<uint8_t>(port_attr_.active_mtu);
  h.lid = port_attr_.lid;
  h.qp_num = c.qp_num_;
  h.psn = psn;
  h.gid = gid_;
  h.transport_id = transport_id_;
  h.nonce = nonce;
  return h;
}

Status Core::to_rtr_locked(VerbsConnection& c, const Hello& peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(port_attr_.active_mtu, peer.mtu));
  a.dest_qp_num = peer.qp_num;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = max_dest_rd_atomic_;  // psld issues no READs or atomics
  a.min_rnr_timer = kMinRnrTimer;
  a.ah_attr.port_num = port_;
  a.ah_attr.sl = 0;
  a.ah_attr.src_path_bits = 0;
  a.ah_attr.dlid = link_ == LinkLayer::kInfiniBand ? peer.lid : 0;
  if (use_grh_) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid.raw.data(), 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    a.ah_attr.grh.hop_limit = kHopLimit;
    a.ah_attr.grh.traffic_class = 0;
    a.ah_attr.grh.flow_label = 0;
  }
  const int rc =
      ibv_modify_qp(c.qp_, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) return Unavailable("ibv_modify_qp(RTR): " + errno_text(rc));
  c.reached_rtr_ = true;
  return Status::Ok();
}

Status Core::to_rts_locked(VerbsConnection& c) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = kAckTimeout;
  a.retry_cnt = kRetryCount;
  a.rnr_retry = kRnrRetry;
  a.sq_psn = c.local_hello_.psn;
  a.max_rd_atomic = max_rd_atomic_;
  const int rc = ibv_modify_qp(c.qp_, &a,
                               IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) return Unavailable("ibv_modify_qp(RTS): " + errno_text(rc));
  return Status::Ok();
}

void Core::destroy_qp_locked(VerbsConnection& c) {
  if (c.qp_ != nullptr) {
    by_qp_.erase(c.qp_num_);
    if (const int rc = ibv_destroy_qp(c.qp_); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_destroy_qp({:#x}): {}", c.qp_num_, errno_text(rc));
    }
    c.qp_ = nullptr;
  }
  // Work requests whose completions will never be polled (forced teardown).
  for (auto& [wr_id, rec] : c.inflight_) {
    if (rec.bounce >= 0) send_pool_.free.push_back(rec.bounce);
  }
  c.inflight_.clear();
  c.sq_.abandon_posted();
}

// ---------------------------------------------------------------------------
// Connection setup

Core::ConnPtr Core::make_connection_locked(SideChannel chan, bool outbound, std::string peer) {
  return std::make_shared<VerbsConnection>(weak_from_this(), std::move(chan), outbound,
                                           std::move(peer), sq_depth_, &cq_budget_);
}

Status Core::register_connection_locked(const ConnPtr& c) {
  conns_[c->id_] = c;
  c->want_out_ = c->chan_.has_pending_output();
  return epoll_add(c->chan_.fd(), c->id_, side_channel_events(c->want_out_));
}

Status Core::side_send_locked(VerbsConnection& c, std::span<const uint8_t> bytes) {
  PSLD_RETURN_IF_ERROR(c.chan_.send(bytes));
  const bool want = c.chan_.has_pending_output();
  if (want != c.want_out_ && c.chan_.is_open()) {
    epoll_event ev{};
    ev.events = side_channel_events(want);
    ev.data.u64 = c.id_;
    epoll_ctl(epfd_, EPOLL_CTL_MOD, c.chan_.fd(), &ev);
    c.want_out_ = want;
  }
  return Status::Ok();
}

Result<ConnectionPtr> Core::connect(std::span<const uint8_t> peer_address) {
  const std::string text(peer_address.begin(), peer_address.end());
  PSLD_ASSIGN_OR_RETURN(HostPort to, parse_host_port(text, /*port_required=*/true));
  if (shut_.load()) return Unavailable("verbs transport is shut down");
  // The only blocking step: TCP connect, bounded by op_timeout. The kernel
  // completes it from the peer's listen backlog, so it needs nothing from
  // the peer's progress() and works with both ends on one thread.
  PSLD_ASSIGN_OR_RETURN(int fd, tcp_connect(to, opts_.common.op_timeout));
  SideChannel chan(fd);
  auto peer_addr = socket_address(fd, /*peer=*/true);
  const std::string peer =
      fmt::format("verbs {}", peer_addr.ok() ? format_host_port(*peer_addr) : text);

  MutexLock lock(mu_);
  if (shut_.load() || torn_down_) return Unavailable("verbs transport is shut down");
  if (device_failed_) return Unavailable(fmt::format("RDMA device {} failed", device_name_));
  ConnPtr c = make_connection_locked(std::move(chan), /*outbound=*/true, peer);
  c->reported_ = true;  // the caller holds it from here on
  Status s = create_qp_locked(*c);
  const uint32_t psn = static_cast<uint32_t>(random_nonzero_u64()) & kMax24Bit;
  if (s.ok()) {
    c->local_hello_ = make_hello_locked(*c, psn, random_nonzero_u64());
    s = side_send_locked(*c, encode_hello(c->local_hello_));
  }
  if (s.ok()) {
    c->state_ = ConnState::kAwaitReply;
    c->handshake_deadline_ = Clock::now() + opts_.common.op_timeout;
    s = register_connection_locked(c);
  }
  if (!s.ok()) {
    c->state_ = ConnState::kClosed;
    c->open_ = false;
    epoll_del(c->chan_.fd());
    c->chan_.close();
    conns_.erase(c->id_);
    destroy_qp_locked(*c);  // never reached RTR: nothing of the SRQ to drain
    return s.with_context(fmt::format("connecting to {}", text));
  }
  // Writes and sends on it queue until the reply arrives in progress();
  // the handshake fails them with Unavailable if it does not finish within
  // op_timeout.
  return ConnectionPtr(c);
}

// Server: a client's hello arrived. Bring our QP to RTS before answering, so
// the client may send as soon as it has the answer.
Status Core::accept_hello_locked(const ConnPtr& c, const Hello& peer) {
  Hello ours;
  ours.link_layer = link_;
  PSLD_RETURN_IF_ERROR(check_peer_hello(ours, peer));
  PSLD_RETURN_IF_ERROR(create_qp_locked(*c));
  const uint32_t psn = static_cast<uint32_t>(random_nonzero_u64()) & kMax24Bit;
  c->local_hello_ = make_hello_locked(*c, psn, peer.nonce);
  PSLD_RETURN_IF_ERROR(to_rtr_locked(*c, peer));
  PSLD_RETURN_IF_ERROR(to_rts_locked(*c));
  c->peer_transport_id_ = peer.transport_id;
  PSLD_RETURN_IF_ERROR(side_send_locked(*c, encode_hello(c->local_hello_)));
  c->state_ = ConnState::kAwaitReady;
  return Status::Ok();
}

// Client: the server's reply arrived; its QP is in RTS already.
Status Core::complete_client_locked(const ConnPtr& c, const Hello& reply, Events& events) {
  PSLD_RETURN_IF_ERROR(check_hello_reply(c->local_hello_, reply));
  PSLD_RETURN_IF_ERROR(to_rtr_locked(*c, reply));
  PSLD_RETURN_IF_ERROR(to_rts_locked(*c));
  const uint8_t ready = kReadyByte;
  PSLD_RETURN_IF_ERROR(side_send_locked(*c, {&ready, 1}));
  c->peer_transport_id_ = reply.transport_id;
  c->state_ = ConnState::kReady;
  // Keys imported before the peer was known could not be checked then.
  auto wrong = c->sq_.extract_if([&](const SendItem& item) {
    return item.is_write && item.remote_transport_id != reply.transport_id;
  });
  for (SendItem& item : wrong) {
    push_ready(events,
               pending_.take(item.op_id, InvalidArgument("write target's remote key belongs to "
                                                         "another transport than this connection's "
                                                         "peer")));
  }
  drain_locked(c, events);
  return Status::Ok();
}

// Server: the client is in RTS (its ready byte, or a first receive from it,
// which can overtake the byte). Only now does the application hear of it.
void Core::promote_locked(const ConnPtr& c, Events& events) {
  c->state_ = ConnState::kReady;
  c->reported_ = true;
  push_event(events, Event::Kind::kAccept, c);
  drain_locked(c, events);
}

size_t Core::pending_accepts_locked() const {
  size_t n = 0;
  for (const auto& [id, c] : conns_) {
    n += c->state_ == ConnState::kAwaitHello || c->state_ == ConnState::kAwaitReady;
  }
  return n;
}

void Core::accept_all_locked(Events& events) {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        PSLD_LOG_WARN("verbs: accept on {}: {}", address_, errno_text(errno));
      }
      return;
    }
    if (device_failed_ || pending_accepts_locked() >= kMaxPendingHandshakes) {
      PSLD_LOG_WARN("verbs: refusing a connection on {}: {}", address_,
                    device_failed_ ? "the device failed" : "too many handshakes in progress");
      ::close(fd);
      continue;
    }
    tune_side_channel_socket(fd);
    auto peer_addr = socket_address(fd, /*peer=*/true);
    const std::string peer =
        fmt::format("verbs {}", peer_addr.ok() ? format_host_port(*peer_addr) : "?");
    ConnPtr c = make_connection_locked(SideChannel(fd), /*outbound=*/false, peer);
    c->state_ = ConnState::kAwaitHello;
    c->handshake_deadline_ = Clock::now() + opts_.common.op_timeout;
    if (Status s = register_connection_locked(c); !s.ok()) {
      PSLD_LOG_WARN("verbs: {}: {}", peer, s.to_string());
      conns_.erase(c->id_);
      continue;
    }
    handle_side_channel_locked(c, EPOLLIN, events);  // the hello may be here already
  }
}

void Core::handle_side_channel_locked(const ConnPtr& c, uint32_t revents, Events& events) {
  if (c->state_ == ConnState::kClosed) return;
  if ((revents & EPOLLOUT) != 0) {
    if (Status s = side_send_locked(*c, {}); !s.ok()) {
      break_locked(c, Unavailable(fmt::format("{}: {}", c->peer_, s.message())), false, events);
      return;
    }
  }
  if ((revents & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) == 0) return;
  Status s = c->chan_.read_available();
  if (s.ok()) process_side_input_locked(c, events);
  if (c->state_ == ConnState::kClosed) return;
  if (s.ok() && !c->chan_.eof()) return;
  const bool handshaking = c->state_ != ConnState::kReady;
  if (!s.ok()) {
    s = Unavailable(fmt::format("{}: {}", c->peer_, s.message()));
  } else if (handshaking) {
    s =
        Unavailable(fmt::format("{} closed the side channel during the handshake (its log says "
                                "why)",
                                c->peer_));
  } else {
    s = Unavailable(
        fmt::format("{} went away (its side channel closed without a goodbye)", c->peer_));
  }
  break_locked(c, s, false, events);
}

void Core::process_side_input_locked(const ConnPtr& c, Events& events) {
  for (;;) {
    const std::span<const uint8_t> in = c->chan_.input();
    switch (c->state_) {
      case ConnState::kClosed:
        return;
      case ConnState::kAwaitHello: {
        if (in.size() < kHelloBytes) return;
        auto hello = decode_hello(in.first(kHelloBytes));
        c->chan_.consume(kHelloBytes);
        Status s = hello.ok() ? accept_hello_locked(c, *hello) : hello.status();
        if (!s.ok()) {
          // Nobody above knows this connection yet: log and drop it. The
          // client sees its side channel close during the handshake.
          PSLD_LOG_WARN("verbs: refusing {}: {}", c->peer_, s.to_string());
          break_locked(c, s, false, events);
          return;
        }
        break;
      }
      case ConnState::kAwaitReply: {
        if (in.size() < kHelloBytes) return;
        auto reply = decode_hello(in.first(kHelloBytes));
        c->chan_.consume(kHelloBytes);
        Status s = reply.ok() ? complete_client_locked(c, *reply, events) : reply.status();
        if (!s.ok()) {
          break_locked(
              c, Unavailable(fmt::format("handshake with {} failed: {}", c->peer_, s.to_string())),
              false, events);
          return;
        }
        break;
      }
      case ConnState::kAwaitReady: {
        if (in.empty()) return;
        const uint8_t b = in[0];
        c->chan_.consume(1);
        if (b != kReadyByte) {
          PSLD_LOG_WARN("verbs: refusing {}: unexpected byte {:#04x} in the handshake", c->peer_,
                        b);
          break_locked(c, DataLoss("protocol error in the handshake"), false, events);
          return;
        }
        c->ready_byte_seen_ = true;
        promote_locked(c, events);
        break;
      }
      case ConnState::kReady: {
        if (in.empty()) return;
        const uint8_t b = in[0];
        c->chan_.consume(1);
        if (b == kReadyByte && !c->outbound_ && !c->ready_byte_seen_) {
          c->ready_byte_seen_ = true;  // promoted early by a receive
          break;
        }
        if (b == kByeByte) {
          break_locked(c, Unavailable(fmt::format("{} closed the connection", c->peer_)), false,
                       events);
        } else {
          break_locked(c,
                       Unavailable(fmt::format("protocol error on the side channel of {}: "
                                               "unexpected byte {:#04x}",
                                               c->peer_, b)),
                       false, events);
        }
        return;
      }
    }
  }
}

}  // namespace verbs
}  // namespace psld::transport
