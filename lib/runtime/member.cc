#include "lib/runtime/member.h"

#include <fmt/format.h>
#include <unistd.h>

#include "base/log.h"
#include "base/secret.h"
#include "base/thread.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

namespace {
std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}
}  // namespace

MemberSession::MemberSession(ProcessRuntime& runtime, Role role, const RuntimeOptions& options)
    : runtime_(runtime), role_(role), options_(options) {}

MemberSession::~MemberSession() {
  stop_reports();
  {
    MutexLock lock(mu_);
    goodbye_ = true;
  }
  cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

Status MemberSession::join(std::vector<uint8_t> listen_address) {
  if (options_.coordinator_address.empty()) {
    return InvalidArgument(
        "no coordinator address: set PSLD_COORDINATOR (host:port) or run under psld launch");
  }
  {
    MutexLock lock(mu_);
    listen_address_ = std::move(listen_address);
    last_heard_ = Clock::now();
    joining_ = true;
  }
  const auto deadline = Clock::now() + options_.connect_timeout;
  // The coordinator may still be starting: retry until the deadline. A
  // connection can also be refused after connect() returned (UCX connects in
  // the background): until the coordinator has said anything, losing the
  // connection is a failed dial, retried like a refused one.
  Status last;
  while (true) {
    auto conn = connect_text(runtime_.transport(), options_.coordinator_address);
    if (conn.ok()) {
      std::vector<protocol::Message> early;
      {
        MutexLock lock(mu_);
        coordinator_ = *conn;
        early.swap(early_);
      }
      for (auto& m : early)
        handle(*conn, m);
      // The coordinator challenges every connection at once. A dial that
      // neither fails nor hears anything within a second is given up and
      // redialled (UCX does not always report a refused connection).
      UniqueLock lock(mu_);
      const auto attempt_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(1));
      cv_.wait_until(lock.native(), attempt_deadline,
                     [&]() REQUIRES(mu_) { return heard_ || !dial_failure_.ok(); });
      if (heard_) break;
      last = dial_failure_.ok() ? Unavailable("no answer") : dial_failure_;
      dial_failure_ = Status::Ok();
      coordinator_.reset();
      lock.unlock();
      (*conn)->close();
      // A refusal (the transport's bootstrap heard a wrong job secret) is
      // final: redialling until the deadline would only hide it.
      if (last.code() == StatusCode::kFailedPrecondition) {
        return FailedPrecondition(fmt::format("cannot join the coordinator at {}: {}",
                                              options_.coordinator_address, last.message()));
      }
    } else {
      last = conn.status();
    }
    if (Clock::now() + std::chrono::milliseconds(100) > deadline) {
      return Unavailable(fmt::format("cannot reach the coordinator at {} within {} ms: {}",
                                     options_.coordinator_address, options_.connect_timeout.count(),
                                     last.message()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  UniqueLock lock(mu_);
  // Admission first: from then on both sides watch each other's heartbeats,
  // also while waiting for the rest of the job (which may take longer than
  // the heartbeat timeout).
  const bool admitted = cv_.wait_until(lock.native(), deadline, [&]() REQUIRES(mu_) {
    return !rejected_.empty() || !health_.ok() || welcomed_;
  });
  if (!rejected_.empty()) {
    return FailedPrecondition("the coordinator refused this " + std::string(role_name(role_)) +
                              ": " + rejected_);
  }
  if (!health_.ok()) return health_;
  if (!admitted) {
    return Timeout(fmt::format("the coordinator at {} did not admit this {} within {} ms",
                               options_.coordinator_address, role_name(role_),
                               options_.connect_timeout.count()));
  }
  last_heard_ = Clock::now();
  PSLD_RETURN_IF_ERROR(start_thread(heartbeat_, "heartbeat", [this] { heartbeat_loop(); }));
  const bool started = cv_.wait_until(lock.native(), deadline, [&]() REQUIRES(mu_) {
    return !health_.ok() || (have_servers_ && placement_);
  });
  if (!health_.ok()) return health_;
  if (!started) {
    const std::string missing =
        waiting_ ? protocol::waiting_for(*waiting_, welcome_.num_workers,
                                         welcome_.num_servers + welcome_.num_standby)
                 : "";
    return Timeout(fmt::format(
        "the job did not start within {} ms: the coordinator at {} admitted this {} but {}",
        options_.connect_timeout.count(), options_.coordinator_address, role_name(role_),
        missing.empty() ? "not every worker and server joined" : "still waits for " + missing));
  }
  return Status::Ok();
}

bool MemberSession::handle(const ConnectionPtr& conn, protocol::Message& message) {
  {
    MutexLock lock(mu_);
    if (!coordinator_) {
      // The coordinator's first message can beat connect()'s return. Until
      // join() has stored the connection, the only peer that can talk to
      // us is the coordinator: keep its messages for join() to replay.
      if (joining_) {
        early_.push_back(std::move(message));
        return true;
      }
      return false;
    }
    if (conn->id() != coordinator_->id()) return false;
    last_heard_ = Clock::now();
    heard_ = true;
    // Until the coordinator proved it knows the secret, only the handshake.
    if (!welcomed_ && !std::holds_alternative<protocol::Challenge>(message) &&
        !std::holds_alternative<protocol::Welcome>(message) &&
        !std::holds_alternative<protocol::Reject>(message)) {
      PSLD_LOG_WARN("{} from the coordinator before its Welcome; ignored",
                    protocol::message_name(message));
      return true;
    }
  }
  if (auto* c = std::get_if<protocol::Challenge>(&message)) {
    protocol::Hello hello;
    {
      MutexLock lock(mu_);
      if (challenge_) {
        PSLD_LOG_WARN("a second challenge from the coordinator; ignored");
        return true;
      }
      hello.address = listen_address_;
    }
    hello.role = role_;
    hello.rank_hint = options_.rank;
    hello.nonce = protocol::make_nonce();
    hello.pid = static_cast<uint32_t>(getpid());
    hello.host = hostname();
    hello.proof = protocol::hello_proof(options_.secret, c->nonce, hello);
    {
      MutexLock lock(mu_);
      challenge_ = c->nonce;
      hello_ = hello;
    }
    (void)runtime_.send(conn, hello);
    return true;
  }
  if (auto* e = std::get_if<protocol::EpochChange>(&message)) {
    EpochFn fn;
    {
      MutexLock lock(mu_);
      fn = on_epoch_;
    }
    if (fn) {
      fn(*e);
    } else {
      PSLD_LOG_WARN("an epoch change from the coordinator, and nobody to take it");
    }
    return true;
  }
  if (auto* f = std::get_if<protocol::EpochFinal>(&message)) {
    FinalFn fn;
    {
      MutexLock lock(mu_);
      fn = on_final_;
    }
    if (fn) fn(*f);
    return true;
  }
  if (auto* w = std::get_if<protocol::LowWatermark>(&message)) {
    WatermarkFn fn;
    {
      MutexLock lock(mu_);
      fn = on_watermark_;
    }
    if (fn) fn(*w);
    return true;
  }
  if (auto* seal = std::get_if<protocol::CheckpointSeal>(&message)) {
    SealFn fn;
    {
      MutexLock lock(mu_);
      fn = on_seal_;
    }
    if (fn) {
      fn(*seal);
    } else {
      PSLD_LOG_WARN("a checkpoint seal from the coordinator, and nobody to take it");
    }
    return true;
  }
  MutexLock lock(mu_);
  if (auto* w = std::get_if<protocol::Welcome>(&message)) {
    if (welcomed_) {
      PSLD_LOG_WARN("a second Welcome from the coordinator; ignored");
    } else if (!challenge_ ||
               !protocol::proofs_equal(
                   w->proof, protocol::welcome_proof(options_.secret, *challenge_, hello_, *w))) {
      rejected_ = fmt::format(
          "the coordinator at {} did not prove it knows the job secret: another job's, or the "
          "secret differs ({})",
          options_.coordinator_address, kSameSecretEverywhere);
    } else {
      welcome_ = *w;
      welcomed_ = true;
    }
  } else if (auto* r = std::get_if<protocol::Reject>(&message)) {
    rejected_ = r->reason;
  } else if (auto* j = std::get_if<protocol::JoinWaiting>(&message)) {
    waiting_ = std::move(*j);
  } else if (auto* s = std::get_if<protocol::ServerList>(&message)) {
    servers_ = s->servers;
    have_servers_ = true;
  } else if (auto* p = std::get_if<protocol::PlacementChunk>(&message)) {
    if (placement_count_ != p->count) placement_pieces_.clear();
    placement_count_ = p->count;
    placement_pieces_[p->index] = std::move(p->bytes);
    if (placement_pieces_.size() == placement_count_) {
      std::vector<uint8_t> all;
      for (auto& [i, piece] : placement_pieces_)
        all.insert(all.end(), piece.begin(), piece.end());
      placement_pieces_.clear();
      auto placement = Placement::deserialize(all);
      if (placement.ok()) {
        placement_ = std::make_shared<const Placement>(std::move(placement).value());
      } else {
        PSLD_LOG_ERROR("the coordinator sent a placement that does not decode: {}",
                       placement.status().to_string());
      }
    }
  } else if (auto* t = std::get_if<protocol::TensorInfo>(&message)) {
    registrations_.insert_or_assign(t->request, *t);
  } else if (auto* e = std::get_if<protocol::Error>(&message)) {
    if (e->request != 0) {
      registrations_.insert_or_assign(e->request,
                                      Status(static_cast<StatusCode>(e->code), e->message));
    } else {
      PSLD_LOG_WARN("coordinator error: {}", e->message);
    }
  } else if (auto* b = std::get_if<protocol::BarrierRelease>(&message)) {
    released_barriers_.insert(b->barrier);
  } else if (std::holds_alternative<protocol::Heartbeat>(message)) {
    // last_heard_ was updated above.
  } else if (auto* f = std::get_if<protocol::JobFailed>(&message)) {
    if (health_.ok()) health_ = Aborted("the job failed: " + f->reason);
  } else if (std::holds_alternative<protocol::Shutdown>(message)) {
    shutdown_ = true;
  } else {
    PSLD_LOG_WARN("unexpected {} from the coordinator", protocol::message_name(message));
  }
  cv_.notify_all();
  return true;
}

bool MemberSession::on_disconnect(const ConnectionPtr& conn, const Status& why) {
  MutexLock lock(mu_);
  if (!coordinator_ || conn->id() != coordinator_->id()) return false;
  if (joining_ && !heard_) {
    dial_failure_ = why.ok() ? Unavailable("connection closed") : why;
  } else if (!shutdown_ && !goodbye_ && health_.ok()) {
    health_ = Unavailable("lost the coordinator at " + options_.coordinator_address + ": " +
                          why.message());
  }
  cv_.notify_all();
  return true;
}

void MemberSession::fail(const std::string& reason) {
  if (health_.ok()) health_ = Unavailable(reason);
  cv_.notify_all();
}

Status MemberSession::health() const {
  MutexLock lock(mu_);
  return health_;
}

bool MemberSession::shutdown_requested() const {
  MutexLock lock(mu_);
  return shutdown_;
}

Status MemberSession::wait_for_shutdown(std::chrono::milliseconds timeout) {
  UniqueLock lock(mu_);
  if (!cv_.wait_for(lock.native(), timeout,
                    [&]() REQUIRES(mu_) { return shutdown_ || !health_.ok(); })) {
    return Timeout("the job did not end in time");
  }
  return shutdown_ ? Status::Ok() : health_;
}

std::vector<protocol::ServerEntry> MemberSession::servers() const {
  MutexLock lock(mu_);
  return servers_;
}

std::shared_ptr<const Placement> MemberSession::placement() const {
  MutexLock lock(mu_);
  return placement_;
}

Result<protocol::TensorInfo> MemberSession::register_tensor(const protocol::RegisterTensor& request,
                                                            std::chrono::milliseconds timeout) {
  protocol::RegisterTensor r = request;
  ConnectionPtr conn;
  {
    MutexLock lock(mu_);
    PSLD_RETURN_IF_ERROR(health_);
    r.request = next_request_++;
    conn = coordinator_;
  }
  PSLD_RETURN_IF_ERROR(runtime_.send(conn, r));
  UniqueLock lock(mu_);
  if (!cv_.wait_for(lock.native(), timeout, [&]() REQUIRES(mu_) {
        return registrations_.count(r.request) || !health_.ok();
      })) {
    return Timeout(fmt::format("registering tensor '{}': no answer from the coordinator in {} ms",
                               r.name, timeout.count()));
  }
  PSLD_RETURN_IF_ERROR(health_);
  auto it = registrations_.find(r.request);
  Result<protocol::TensorInfo> out = std::move(it->second);
  registrations_.erase(it);
  return out;
}

Status MemberSession::barrier(std::chrono::milliseconds timeout) {
  uint64_t id = 0;
  ConnectionPtr conn;
  {
    MutexLock lock(mu_);
    PSLD_RETURN_IF_ERROR(health_);
    id = next_barrier_++;
    conn = coordinator_;
  }
  PSLD_RETURN_IF_ERROR(runtime_.send(conn, protocol::BarrierEnter{id}));
  UniqueLock lock(mu_);
  if (!cv_.wait_for(lock.native(), timeout, [&]() REQUIRES(mu_) {
        return released_barriers_.count(id) || !health_.ok();
      })) {
    return Timeout(
        fmt::format("barrier {}: not every worker arrived within {} ms", id, timeout.count()));
  }
  PSLD_RETURN_IF_ERROR(health_);
  released_barriers_.erase(id);
  return Status::Ok();
}

void MemberSession::goodbye() {
  ConnectionPtr conn;
  {
    MutexLock lock(mu_);
    if (goodbye_) return;
    goodbye_ = true;
    if (welcomed_) conn = coordinator_;
  }
  cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (conn && conn->is_open() && runtime_.send(conn, protocol::Shutdown{}).ok()) {
    // Wait for the coordinator's acknowledgement before the caller closes the
    // transport: a close that overtook the goodbye would look like a crash.
    UniqueLock lock(mu_);
    cv_.wait_for(lock.native(), options_.heartbeat_timeout,
                 [&]() REQUIRES(mu_) { return shutdown_ || !health_.ok() || !conn->is_open(); });
  }
}

Status MemberSession::send_to_coordinator(const protocol::Message& message) {
  ConnectionPtr conn;
  {
    MutexLock lock(mu_);
    conn = coordinator_;
  }
  if (!conn) return Unavailable("not connected to the coordinator");
  return runtime_.send(conn, message);
}

Status MemberSession::start_reports(std::chrono::milliseconds interval, ReportFn make) {
  MutexLock lock(mu_);
  if (reporter_.joinable() || interval.count() <= 0) return Status::Ok();
  reports_stop_ = false;
  return start_thread(reporter_, "load report",
                      [this, interval, make = std::move(make)] { report_loop(interval, make); });
}

void MemberSession::stop_reports() {
  {
    MutexLock lock(mu_);
    reports_stop_ = true;
  }
  cv_.notify_all();
  if (reporter_.joinable() && reporter_.get_id() != std::this_thread::get_id()) reporter_.join();
}

void MemberSession::report_loop(std::chrono::milliseconds interval, const ReportFn& make) {
  auto window_start = Clock::now();
  UniqueLock lock(mu_);
  while (true) {
    cv_.wait_for(lock.native(), interval, [&]() REQUIRES(mu_) { return reports_stop_; });
    const bool last = reports_stop_;
    ConnectionPtr conn = welcomed_ && health_.ok() ? coordinator_ : nullptr;
    lock.unlock();
    const auto now = Clock::now();
    const auto window_ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - window_start).count());
    window_start = now;
    std::vector<protocol::Message> messages = make(window_ns);
    if (conn && conn->is_open()) {
      for (const auto& m : messages)
        (void)runtime_.send(conn, m);
    }
    lock.lock();
    if (last) return;
  }
}

void MemberSession::report_failure(const std::string& reason) {
  ConnectionPtr conn;
  {
    MutexLock lock(mu_);
    conn = coordinator_;
  }
  if (conn) (void)runtime_.send(conn, protocol::JobFailed{reason});
}

void MemberSession::on_tick(TickFn fn) {
  MutexLock lock(tick_mu_);
  tick_ = std::move(fn);
}

void MemberSession::heartbeat_loop() {
  uint64_t seq = 0;
  bool failure_ticked = false;
  UniqueLock lock(mu_);
  auto due = Clock::now() + options_.heartbeat_interval;
  while (!goodbye_) {
    // Every message from the coordinator notifies cv_, the echo of our own
    // heartbeat included: only the due time, a goodbye or a failure (which
    // the tick passes on at once) end the wait. Waking on each notification
    // sent a heartbeat per echo, a ping-pong with the coordinator as fast as
    // the two could go.
    cv_.wait_until(lock.native(), due,
                   [&]() REQUIRES(mu_) { return goodbye_ || (!health_.ok() && !failure_ticked); });
    if (goodbye_) break;
    // This process itself did not run for a while (stopped, or starved):
    // the coordinator's silence then says nothing about the coordinator, so
    // it gets a fresh timeout from now.
    const auto now = Clock::now();
    if (now - due > options_.heartbeat_timeout / 2) last_heard_ = now;
    due = now + options_.heartbeat_interval;
    if (health_.ok() && !shutdown_ && now - last_heard_ > options_.heartbeat_timeout) {
      fail(fmt::format("the coordinator at {} sent nothing for {} ms", options_.coordinator_address,
                       options_.heartbeat_timeout.count()));
    }
    failure_ticked = !health_.ok();
    ConnectionPtr conn = coordinator_;
    lock.unlock();
    if (conn && conn->is_open()) (void)runtime_.send(conn, protocol::Heartbeat{++seq});
    {
      MutexLock tick(tick_mu_);
      if (tick_) tick_();
    }
    lock.lock();
  }
}

}  // namespace psld
