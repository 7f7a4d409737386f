// UCX bootstrap: psld's own TCP listener in front of UCX (see kBootMagic in
// core.h). A connection starts here: the acceptor challenges, the dialer
// proves it knows the job secret and sends its UCX worker address and
// connection token, the acceptor answers with its own (and its proof), and
// only then does either side make a UCX endpoint. The hello over UCX
// (wireup.cc) follows.
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sodium.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "base/log.h"
#include "base/secret.h"
#include "transports/ucx/core.h"

namespace psld::transport {

namespace {

void ensure_sodium() {
  // Idempotent and thread-safe; 1 when already done.
  static const bool ready = sodium_init() >= 0;
  if (!ready) {
    PSLD_LOG_ERROR("ucx: libsodium could not start; the bootstrap cannot draw nonces");
    std::abort();
  }
}

BootNonce make_boot_nonce() {
  ensure_sodium();
  BootNonce n;
  randombytes_buf(n.data(), n.size());
  return n;
}

// Where a refusal is logged: the peer's host, without the port.
std::string host_of(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  return colon == std::string::npos ? host_port : host_port.substr(0, colon);
}

}  // namespace

// ---------------------------------------------------------------------------
// Frames and proofs (core.h)

uint64_t ucx_detail::random_token() {
  ensure_sodium();
  uint64_t t = 0;
  while (t == 0)
    randombytes_buf(&t, sizeof(t));
  return t;
}

std::vector<uint8_t> ucx_detail::encode_boot_frame(const BootFrame& f) {
  WireWriter w;
  w.u32(0);  // the length, below
  w.u32(kBootMagic);
  w.u8(kWireVersion);
  w.u8(static_cast<uint8_t>(f.type));
  switch (f.type) {
    case BootType::kChallenge:
      w.bytes(f.nonce);
      w.u64(f.instance);
      break;
    case BootType::kRequest:
      w.bytes(f.nonce);
      w.u64(f.instance);
      w.u64(f.token);
      w.blob(f.address);
      w.bytes(f.proof);
      break;
    case BootType::kAccept:
      w.u64(f.token);
      w.blob(f.address);
      w.bytes(f.proof);
      break;
    case BootType::kRefuse:
      w.str(f.reason);
      break;
    case BootType::kBye:
      break;
  }
  std::vector<uint8_t> out = w.take();
  store_le(out.data(), out.size() - 4, 4);
  return out;
}

ptrdiff_t ucx_detail::decode_boot_frame(std::span<const uint8_t> input, BootFrame* f) {
  if (input.size() < 4) return 0;
  const uint64_t length = load_le(input.data(), 4);
  if (length < 6 || length > kMaxBootFrame) return -1;
  if (input.size() < 4 + length) {
    // The magic is checked as soon as it is there: garbage is refused at its
    // first bytes, not once it filled a frame.
    if (input.size() >= 8 && load_le(input.data() + 4, 4) != kBootMagic) return -1;
    return 0;
  }
  WireReader r(input.subspan(4, length));
  uint32_t magic = 0;
  uint8_t version = 0, type = 0;
  if (!r.u32(&magic) || magic != kBootMagic || !r.u8(&version) || version != kWireVersion ||
      !r.u8(&type)) {
    return -1;
  }
  auto fixed = [&r](std::span<uint8_t> out) {
    for (uint8_t& b : out) {
      if (!r.u8(&b)) return false;
    }
    return true;
  };
  std::span<const uint8_t> address;
  bool ok = false;
  switch (static_cast<BootType>(type)) {
    case BootType::kChallenge:
      ok = fixed(f->nonce) && r.u64(&f->instance) && f->instance != 0;
      break;
    case BootType::kRequest:
      ok = fixed(f->nonce) && r.u64(&f->instance) && f->instance != 0 && r.u64(&f->token) &&
           f->token != 0 && r.blob(&address, kMaxWorkerAddress) && !address.empty() &&
           fixed(f->proof);
      break;
    case BootType::kAccept:
      ok = r.u64(&f->token) && f->token != 0 && r.blob(&address, kMaxWorkerAddress) &&
           !address.empty() && fixed(f->proof);
      break;
    case BootType::kRefuse:
      ok = r.str(&f->reason, kMaxBootReason);
      break;
    case BootType::kBye:
      ok = true;
      break;
    default:
      return -1;
  }
  if (!ok || !r.done()) return -1;
  f->type = static_cast<BootType>(type);
  f->address.assign(address.begin(), address.end());
  return static_cast<ptrdiff_t>(4 + length);
}

BootProof ucx_detail::boot_proof(std::string_view secret, const BootFrame& challenge,
                                 const BootFrame& request, const BootFrame* accept) {
  ensure_sodium();
  WireWriter w;
  w.str("psld ucx bootstrap v3");
  w.u8(accept == nullptr ? 1 : 2);  // the side: a proof reflected to its sender fails
  w.bytes(challenge.nonce);
  w.u64(challenge.instance);
  w.bytes(request.nonce);
  w.u64(request.instance);
  w.u64(request.token);
  w.blob(request.address);
  if (accept != nullptr) {
    w.u64(accept->token);
    w.blob(accept->address);
  }
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char*>(secret.data()),
                              secret.size());
  crypto_auth_hmacsha256_update(&st, w.data().data(), w.data().size());
  BootProof proof;
  crypto_auth_hmacsha256_final(&st, proof.data());
  return proof;
}

// ---------------------------------------------------------------------------
// The listening socket and the endpoints

Status UcxCore::start_listening(const sockaddr_storage& listen, socklen_t listen_len) {
  const int fd = ::socket(listen.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(fmt::format("socket: {}", std::strerror(errno)));
  listen_fd_ = fd;
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&listen), listen_len) != 0 ||
      ::listen(fd, 128) != 0) {
    return Unavailable(
        fmt::format("UCX transport cannot listen on '{}': {} (is the address local "
                    "and the port free?)",
                    options_.common.listen_address, std::strerror(errno)));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) {
    return Unavailable(fmt::format("getsockname: {}", std::strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (::epoll_ctl(boot_epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return Unavailable(fmt::format("epoll_ctl: {}", std::strerror(errno)));
  }
  // Text, "127.0.0.1:41234": what a launcher builds from MASTER_ADDR and a
  // port, and what logs and configuration files can carry.
  listen_text_ = socket_address_string(bound);
  address_.assign(listen_text_.begin(), listen_text_.end());
  return Status::Ok();
}

Result<ucp_ep_h> UcxCore::peer_ep(uint64_t instance, std::span<const uint8_t> address) {
  if (auto it = peer_eps_.find(instance); it != peer_eps_.end()) return it->second;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = ep_error_cb;
  ep.err_handler.arg = this;
  ucp_ep_h h = nullptr;
  const ucs_status_t st = ucp_ep_create(worker_, &ep, &h);
  if (st != UCS_OK) {
    return Unavailable(fmt::format("UCX cannot make an endpoint to the peer's worker address: {}",
                                   ucs_status_string(st)));
  }
  peer_eps_[instance] = h;
  ep_peers_[h] = instance;
  return h;
}

void UcxCore::close_peer_ep(ucp_ep_h ep) {
  if (auto it = ep_peers_.find(ep); it != ep_peers_.end()) {
    peer_eps_.erase(it->second);
    ep_peers_.erase(it);
  }
  // FORCE: the peer may be dead, and a flushing close would wait for it.
  // Outstanding requests complete with UCS_ERR_CANCELED (their operations
  // already failed, so PendingOps ignores them).
  OpCtx* op = new_op(OpCtx::kClose);
  ucp_request_param_t p = send_param(op, UCP_EP_CLOSE_FLAG_FORCE);
  finish_request(op, ucp_ep_close_nbx(ep, &p));
}

// ---------------------------------------------------------------------------
// Bootstraps in progress

Status UcxCore::start_dial(const sockaddr_storage& sa, socklen_t sa_len, const std::string& where,
                           const ConnPtr& conn) {
  const int fd = ::socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(fmt::format("socket: {}", std::strerror(errno)));
  tune_side_channel_socket(fd);
  const bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sa_len) == 0;
  if (!connected && errno != EINPROGRESS) {
    const int err = errno;
    ::close(fd);
    return Unavailable(fmt::format("cannot connect to {}: {}", where, std::strerror(err)));
  }
  auto b = std::make_unique<Boot>();
  b->chan = SideChannel(fd, kMaxBootFrame + 64);
  b->dialer = true;
  b->stage = connected ? Boot::Stage::kAwaitChallenge : Boot::Stage::kConnecting;
  b->peer = where;
  b->deadline = deadline();
  b->conn = conn;
  epoll_event ev{};
  ev.events = connected ? EPOLLIN : EPOLLOUT;
  ev.data.fd = fd;
  if (::epoll_ctl(boot_epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return Unavailable(fmt::format("epoll_ctl: {}", std::strerror(errno)));
  }
  b->events = ev.events;
  conn->boot_fd_ = fd;
  boots_[fd] = std::move(b);
  return Status::Ok();
}

void UcxCore::poll_boots() {
  epoll_event ev[32];
  const int n = ::epoll_wait(boot_epfd_, ev, 32, 0);
  for (int i = 0; i < n; ++i) {
    const int fd = ev[i].data.fd;
    if (fd == listen_fd_) {
      accept_boots();
    } else if (auto w = watches_.find(fd); w != watches_.end()) {
      step_watch(*w->second);
    } else {
      step_boot(fd, ev[i].events);
    }
  }
}

void UcxCore::accept_boots() {
  for (int i = 0; i < 64; ++i) {
    sockaddr_storage from{};
    socklen_t from_len = sizeof(from);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &from_len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or an error the next poll sees again
    if (accepting_boots_ >= kMaxAcceptingBoots) {
      // A flood: each waits at most op_timeout, and beyond the cap they are
      // turned away at once.
      ++refused_boots_;
      ::close(fd);
      continue;
    }
    tune_side_channel_socket(fd);
    auto b = std::make_unique<Boot>();
    b->chan = SideChannel(fd, kMaxBootFrame + 64);
    b->dialer = false;
    b->stage = Boot::Stage::kAwaitRequest;
    b->peer = socket_address_string(from);
    b->deadline = deadline();
    b->challenge.type = BootType::kChallenge;
    b->challenge.nonce = make_boot_nonce();
    b->challenge.instance = instance_;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(boot_epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      ::close(fd);
      continue;
    }
    b->events = ev.events;
    ++accepting_boots_;
    Boot& boot = *b;
    boots_[fd] = std::move(b);
    const Status s = boot.chan.send(encode_boot_frame(boot.challenge));
    if (!s.ok()) end_boot(fd);
  }
}

std::unique_ptr<Boot> UcxCore::detach_boot(int fd) {
  auto it = boots_.find(fd);
  if (it == boots_.end()) return nullptr;
  std::unique_ptr<Boot> b = std::move(it->second);
  boots_.erase(it);
  if (!b->dialer) --accepting_boots_;
  if (b->conn && b->conn->boot_fd_ == fd) b->conn->boot_fd_ = -1;
  return b;
}

void UcxCore::end_boot(int fd) {
  std::unique_ptr<Boot> b = detach_boot(fd);
  if (!b) return;
  ::epoll_ctl(boot_epfd_, EPOLL_CTL_DEL, fd, nullptr);
  b->chan.close();
}

void UcxCore::watch_socket(const SideChannel& chan, uint32_t* have) {
  const uint32_t want = EPOLLIN | (chan.has_pending_output() ? EPOLLOUT : 0u);
  if (want == *have) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.fd = chan.fd();
  ::epoll_ctl(boot_epfd_, EPOLL_CTL_MOD, chan.fd(), &ev);
  *have = want;
}

void UcxCore::fail_boot(Boot& b, const Status& why) {
  const int fd = b.chan.fd();
  ConnPtr conn = b.conn;
  end_boot(fd);
  if (conn && conn->state_ == UcxConnection::State::kHandshake) close_locked(*conn, why, false);
}

void UcxCore::step_boot(int fd, uint32_t events) {
  auto it = boots_.find(fd);
  if (it == boots_.end()) return;
  Boot& b = *it->second;
  if (b.stage == Boot::Stage::kConnecting) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) {
      return fail_boot(
          b, Unavailable(fmt::format("cannot connect to {}: {}", b.peer, std::strerror(err))));
    }
    if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) == 0) return;
    b.stage = Boot::Stage::kAwaitChallenge;
  }
  Status s = b.chan.flush();
  if (s.ok()) s = b.chan.read_available();
  if (!s.ok()) {
    if (b.stage == Boot::Stage::kClosing) return end_boot(fd);
    return fail_boot(
        b, Unavailable(fmt::format("the bootstrap with {} failed: {}", b.peer, s.message())));
  }
  for (;;) {
    BootFrame f;
    const ptrdiff_t n = decode_boot_frame(b.chan.input(), &f);
    if (n == 0) break;
    if (n < 0) {
      ++rejected_messages_;
      if (!b.dialer) {
        // Garbage at the door: closed without a word (and without a log
        // line per connection: a port scan or a flood is not news).
        return end_boot(fd);
      }
      return fail_boot(b, DataLoss(fmt::format(
                              "{} answered with bytes that are not psld's UCX bootstrap (another "
                              "program at that port, or a psld of another version)",
                              b.peer)));
    }
    b.chan.consume(static_cast<size_t>(n));
    if (!on_boot_frame(b, f)) return;  // the boot ended
  }
  if (b.stage == Boot::Stage::kClosing) {
    if (b.chan.eof()) return end_boot(fd);
    if (!b.chan.has_pending_output() && !b.write_shut) {
      // Everything said: the peer reads it, then closes; its end of stream
      // ends this boot (or the deadline does).
      ::shutdown(fd, SHUT_WR);
      b.write_shut = true;
    }
  } else if (b.chan.eof()) {
    if (!b.dialer) return end_boot(fd);
    return fail_boot(
        b, Unavailable(fmt::format("{} closed the connection during the bootstrap", b.peer)));
  }
  watch_socket(b.chan, &b.events);
}

bool UcxCore::on_boot_frame(Boot& b, const BootFrame& f) {
  const int fd = b.chan.fd();
  const std::string& secret = options_.common.secret;
  switch (b.stage) {
    case Boot::Stage::kAwaitChallenge: {
      if (f.type != BootType::kChallenge) break;
      b.challenge = f;
      b.request.type = BootType::kRequest;
      b.request.nonce = make_boot_nonce();
      b.request.instance = instance_;
      b.request.token = b.conn->token_;
      b.request.address = worker_address_;
      b.request.proof = boot_proof(secret, b.challenge, b.request, nullptr);
      const Status s = b.chan.send(encode_boot_frame(b.request));
      if (!s.ok()) {
        fail_boot(
            b, Unavailable(fmt::format("the bootstrap with {} failed: {}", b.peer, s.message())));
        return false;
      }
      b.stage = Boot::Stage::kAwaitAccept;
      return true;
    }
    case Boot::Stage::kAwaitRequest: {
      if (f.type != BootType::kRequest) break;
      const BootProof want = boot_proof(secret, b.challenge, f, nullptr);
      if (crypto_verify_32(want.data(), f.proof.data()) != 0) {
        refuse_boot(b, fmt::format("wrong job secret ({})", kSameSecretEverywhere),
                    "it does not know the job secret");
        return true;
      }
      return accept_boot(b, f);
    }
    case Boot::Stage::kAwaitAccept: {
      if (f.type == BootType::kRefuse) {
        // Not retried: the member's dial loop gives up on FailedPrecondition.
        fail_boot(
            b, FailedPrecondition(fmt::format("{} refused the connection: {}", b.peer, f.reason)));
        return false;
      }
      if (f.type != BootType::kAccept) break;
      const BootProof want = boot_proof(secret, b.challenge, b.request, &f);
      if (crypto_verify_32(want.data(), f.proof.data()) != 0) {
        fail_boot(b, FailedPrecondition(fmt::format(
                         "{} did not prove it knows the job secret: another job's, or the secret "
                         "differs ({})",
                         b.peer, kSameSecretEverywhere)));
        return false;
      }
      // start_watch destroys `b`: what is needed of it is taken first.
      ConnPtr conn = b.conn;
      const uint64_t instance = b.challenge.instance;
      if (conn->state_ != UcxConnection::State::kHandshake) {  // closed meanwhile
        end_boot(fd);
        return false;
      }
      // The socket stays, as the connection's watch: closing the connection
      // (close_locked) closes it.
      start_watch(fd, conn);
      Result<ucp_ep_h> ep = peer_ep(instance, f.address);
      if (!ep.ok()) {
        close_locked(*conn, ep.status(), false);
        return false;
      }
      conn->ep_ = *ep;
      conn->peer_token_ = f.token;
      conn->boot_instance_ = instance;
      // Writes and sends wait for the hello's answer, which tells us the
      // lanes.
      send_control(*conn, kAmHello, hello_payload(*conn), OpCtx::kControl);
      return false;
    }
    case Boot::Stage::kConnecting:
    case Boot::Stage::kClosing:
      break;
  }
  // A frame out of turn.
  ++rejected_messages_;
  if (b.dialer) {
    fail_boot(b, DataLoss(fmt::format("{} broke the bootstrap (a frame out of turn)", b.peer)));
  } else {
    end_boot(fd);
  }
  return false;
}

void UcxCore::refuse_boot(Boot& b, const std::string& tell, const char* log) {
  const uint64_t n = ++refused_boots_;
  const std::string host = host_of(b.peer);
  if (refused_hosts_.size() < 1024 && refused_hosts_.insert(host).second) {
    PSLD_LOG_WARN(
        "ucx: refused a connection from {}: {} (further ones from there are refused without a "
        "word; {} refused so far)",
        b.peer, log, n);
  }
  BootFrame refuse;
  refuse.type = BootType::kRefuse;
  refuse.reason = tell;
  (void)b.chan.send(encode_boot_frame(refuse));
  b.stage = Boot::Stage::kClosing;
}

bool UcxCore::accept_boot(Boot& b, const BootFrame& request) {
  if (shut_) {
    end_boot(b.chan.fd());
    return false;
  }
  Result<ucp_ep_h> ep = peer_ep(request.instance, request.address);
  if (!ep.ok()) {
    PSLD_LOG_WARN("ucx: cannot accept a connection from {}: {}", b.peer, ep.status().message());
    refuse_boot(b, "the acceptor cannot reach this process's UCX worker",
                "its worker is unreachable");
    return true;
  }
  auto conn =
      std::make_shared<UcxConnection>(this, weak_from_this(), false, fmt::format("ucx {}", b.peer));
  conn->ep_ = *ep;
  conn->peer_token_ = request.token;
  conn->boot_instance_ = request.instance;
  // Invisible to the application until the dialer's hello arrives.
  track_handshake(conn);

  BootFrame accept;
  accept.type = BootType::kAccept;
  accept.token = conn->token_;
  accept.address = worker_address_;
  accept.proof = boot_proof(options_.common.secret, b.challenge, request, &accept);
  const int fd = b.chan.fd();
  const Status s = b.chan.send(encode_boot_frame(accept));
  if (!s.ok()) {
    end_boot(fd);
    close_locked(*conn, s, false);
    return false;
  }
  // The socket stays, as the connection's watch (the accept may still be
  // in its output: the watch sends it).
  start_watch(fd, conn);
  return false;
}

// ---------------------------------------------------------------------------
// Watches

void UcxCore::start_watch(int fd, const ConnPtr& conn) {
  std::unique_ptr<Boot> b = detach_boot(fd);
  auto w = std::make_unique<Watch>();
  w->chan = std::move(b->chan);
  w->conn = conn;
  w->peer = std::move(b->peer);
  w->events = b->events;  // what epoll watches already
  conn->watch_fd_ = fd;
  Watch& watch = *w;
  watches_[fd] = std::move(w);
  watch_socket(watch.chan, &watch.events);
}

void UcxCore::step_watch(Watch& w) {
  const int fd = w.chan.fd();
  Status s = w.chan.flush();
  if (s.ok()) s = w.chan.read_available();
  bool garbage = false;
  for (;;) {
    BootFrame f;
    const ptrdiff_t n = decode_boot_frame(w.chan.input(), &f);
    if (n == 0) break;
    if (n < 0 || f.type != BootType::kBye) {
      garbage = true;
      break;
    }
    w.chan.consume(static_cast<size_t>(n));
    w.bye_seen = true;
  }
  if (garbage) {
    ++rejected_messages_;
    ConnPtr conn = w.conn;
    close_locked(*conn,
                 DataLoss(fmt::format("{} sent bytes on the connection's bootstrap socket that "
                                      "are not psld's (the socket is closed with the connection)",
                                      w.peer)),
                 false);
    return;
  }
  if (!s.ok() || w.chan.eof()) {
    if (w.bye_seen) return end_watch(fd, false);  // its UCX bye closes the connection
    // Gone without a word: its process ended (the kernel closed the socket)
    // or it dropped the connection. What it published before is delivered
    // first, as with a bye.
    ConnPtr conn = w.conn;
    const std::string peer = w.peer;
    drain_ring(conn, std::numeric_limits<uint64_t>::max(), false);
    close_locked(*conn,
                 Unavailable(fmt::format("connection to {} lost: the peer's process ended, or it "
                                         "dropped the connection (its bootstrap socket closed "
                                         "without a goodbye)",
                                         peer)),
                 false);
    return;
  }
  watch_socket(w.chan, &w.events);
}

void UcxCore::end_watch(int fd, bool say_bye) {
  auto it = watches_.find(fd);
  if (it == watches_.end()) return;
  std::unique_ptr<Watch> w = std::move(it->second);
  watches_.erase(it);
  if (say_bye) {
    BootFrame bye;
    bye.type = BootType::kBye;
    (void)w->chan.send(encode_boot_frame(bye));  // 10 bytes into an idle socket: best effort
  }
  ::epoll_ctl(boot_epfd_, EPOLL_CTL_DEL, fd, nullptr);
  if (w->conn && w->conn->watch_fd_ == fd) w->conn->watch_fd_ = -1;
  w->chan.close();
}

void UcxCore::expire_boots(Clock::time_point now) {
  std::vector<int> expired;
  for (auto& [fd, b] : boots_) {
    if (b->deadline <= now) expired.push_back(fd);
  }
  for (int fd : expired) {
    auto it = boots_.find(fd);
    if (it == boots_.end()) continue;
    Boot& b = *it->second;
    if (b.dialer) {
      fail_boot(b, Unavailable(fmt::format(
                       "{} did not answer the bootstrap within {} ms (nobody listening there, or "
                       "its transport is not progressed)",
                       b.peer, options_.common.op_timeout.count())));
    } else {
      if (b.stage != Boot::Stage::kClosing) ++refused_boots_;
      end_boot(fd);
    }
  }
}

}  // namespace psld::transport
