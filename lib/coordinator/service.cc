#include "lib/coordinator/service.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/log.h"
#include "base/secret.h"
#include "base/thread.h"
#include "lib/placement/epoch_log.h"

namespace psld {

using transport::Clock;
using transport::ConnectionPtr;

namespace {

// A serialized placement, cut into pieces that fit one control message.
std::vector<protocol::PlacementChunk> placement_chunks(const Placement& p) {
  constexpr size_t kPiece = 7168;
  const std::vector<uint8_t> bytes = p.serialize();
  const uint32_t count = static_cast<uint32_t>((bytes.size() + kPiece - 1) / kPiece);
  std::vector<protocol::PlacementChunk> out;
  for (uint32_t i = 0; i < count; ++i) {
    const size_t lo = i * kPiece, hi = std::min(bytes.size(), lo + kPiece);
    out.push_back(
        {p.epoch(), i, count, std::vector<uint8_t>(bytes.begin() + lo, bytes.begin() + hi)});
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<CoordinatorService>> CoordinatorService::start(
    const RuntimeOptions& options) {
  if (options.num_workers == 0 || options.num_servers == 0) {
    return InvalidArgument("a job needs at least one worker and one server");
  }
  if (options.net.options.common.listen_address.empty()) {
    return InvalidArgument("the coordinator needs a listen address");
  }
  if (options.replication_factor > options.num_servers) {
    return InvalidArgument(
        fmt::format("replication.factor {} needs at least {} servers; the job has {}",
                    options.replication_factor, options.replication_factor, options.num_servers));
  }
  if (const auto& p = options.initial_placement) {
    bool members_ok = p->epoch() == 0 && p->servers().size() == options.num_servers;
    for (uint32_t r = 0; members_ok && r < options.num_servers; ++r)
      members_ok = p->find_server(r) != nullptr;
    if (!members_ok) {
      return InvalidArgument(
          fmt::format("the initial placement must be epoch 0 with exactly servers 0..{} as members",
                      options.num_servers - 1));
    }
  }
  std::unique_ptr<CoordinatorService> c(new CoordinatorService(options));
  c->trace_ = TraceRecorder::make(options.trace, "coordinator", -1);
  if (options.checkpoint.resume) PSLD_RETURN_IF_ERROR(c->load_resume());
  PSLD_RETURN_IF_ERROR(c->ProcessRuntime::start(options.net, options.secret));
  if (options.balancer_enabled) {
    PSLD_ASSIGN_OR_RETURN(auto b, Balancer::make(options.balancer));
    MutexLock lock(c->mu_);
    c->balancer_.emplace(std::move(b));
  }
  PSLD_RETURN_IF_ERROR(
      start_thread(c->monitor_, "coordinator monitor", [raw = c.get()] { raw->monitor(); }));
  PSLD_LOG_INFO("coordinator listening at {} for {} workers, {} servers (+{} standby)",
                c->address(), options.num_workers, options.num_servers, options.num_standby);
  if (!options.metrics_listen.empty()) {
    PSLD_ASSIGN_OR_RETURN(
        c->metrics_,
        MetricsEndpoint::start(
            options.metrics_listen, {"/", "/metrics", "/status.json"},
            [raw = c.get()](const std::string& path) { return raw->metrics_page(path); }));
    PSLD_LOG_INFO("coordinator: metrics at http://{}/metrics", c->metrics_->address());
  }
  const std::string where = c->address();
  // "127.0.0.1:29600", "[::1]:29600", or the loopback transport's "loopback:N".
  const bool loopback = where.rfind("127.", 0) == 0 || where.rfind("localhost:", 0) == 0 ||
                        where.rfind("[::1]:", 0) == 0 || where.rfind("loopback:", 0) == 0;
  if (options.secret.empty() && !loopback) {
    PSLD_LOG_WARN(
        "coordinator: the job has no secret, so any process that reaches {} can join it: set "
        "PSLD_SECRET_FILE (or PSLD_JOB_SECRET) on every process (docs/reliability.md)",
        where);
  }
  return c;
}

CoordinatorService::CoordinatorService(const RuntimeOptions& options) : options_(options) {}

CoordinatorService::~CoordinatorService() {
  metrics_.reset();  // its thread reads view()
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  stop();
}

size_t CoordinatorService::num_unadmitted() const {
  MutexLock lock(mu_);
  return unadmitted_locked();
}

size_t CoordinatorService::unadmitted_locked() const {
  size_t n = 0;
  for (const auto& [id, m] : members_)
    n += !m.welcomed;
  return n;
}

uint64_t CoordinatorService::num_refused() const {
  return door_.num_refused();
}

size_t CoordinatorService::num_members() const {
  MutexLock lock(mu_);
  size_t n = 0;
  for (const auto& [id, m] : members_)
    n += m.welcomed;
  return n;
}

std::string CoordinatorService::describe(const Member& m) const {
  if (!m.welcomed) return "an unadmitted peer at " + m.conn->peer();
  return fmt::format("{} {} ({}, pid {})", role_name(m.role), m.rank,
                     m.host.empty() ? m.conn->peer() : m.host, m.pid);
}

void CoordinatorService::on_accept(const ConnectionPtr& conn) {
  {
    MutexLock lock(mu_);
    if (unadmitted_locked() >= kMaxUnadmitted) {
      // Not a member: what it sends is ignored, and the monitor closes it.
      door_.refuse("coordinator", conn,
                   fmt::format("more than {} connections wait for admission", kMaxUnadmitted));
      return;
    }
    Member m;
    m.conn = conn;
    m.nonce = protocol::make_nonce();
    m.last_seen = m.accepted = Clock::now();
    members_[conn->id()] = m;
    post(conn, protocol::Challenge{m.nonce});
  }
  flush();
}

void CoordinatorService::post(const ConnectionPtr& conn, protocol::Message message) {
  outbox_.emplace_back(conn, std::move(message));
}

void CoordinatorService::post_all(const std::map<uint32_t, uint64_t>& ranks,
                                  const protocol::Message& message) {
  for (const auto& [rank, id] : ranks) {
    if (const Member* m = find_member(id)) post(m->conn, message);
  }
}

const CoordinatorService::Member* CoordinatorService::find_member(uint64_t id) const {
  auto it = members_.find(id);
  if (it != members_.end()) return &it->second;
  PSLD_LOG_ERROR("coordinator: connection {} is listed as a member but is none (please report)",
                 id);
  return nullptr;
}

void CoordinatorService::flush() {
  // One flusher at a time, so messages leave in the order they were posted
  // (a commit must not be overtaken by the next epoch's prepare).
  MutexLock order(flush_mu_);
  std::vector<std::pair<ConnectionPtr, protocol::Message>> out;
  {
    MutexLock lock(mu_);
    out.swap(outbox_);
  }
  for (auto& [conn, message] : out)
    (void)send(conn, message);
}

void CoordinatorService::on_disconnect(const ConnectionPtr& conn, const Status& why) {
  {
    MutexLock lock(mu_);
    auto it = members_.find(conn->id());
    if (it == members_.end()) return;
    Member m = it->second;
    members_.erase(it);
    if (!m.welcomed) return;
    (m.role == Role::kWorker ? workers_ : servers_).erase(m.rank);
    if (!m.said_goodbye && !job_over_ && !stopping_) {
      const std::string what = fmt::format("{} disconnected: {}", describe(m), why.message());
      if (m.role == Role::kServer) {
        server_lost(m, what);
      } else {
        fail_job(what);
      }
    }
  }
  flush();
}

void CoordinatorService::on_control(const ConnectionPtr& conn, protocol::Message&& message) {
  handle_control(conn, std::move(message));
  flush();
}

void CoordinatorService::handle_control(const ConnectionPtr& conn, protocol::Message&& message) {
  MutexLock lock(mu_);
  auto it = members_.find(conn->id());
  if (it == members_.end()) return;
  Member& m = it->second;
  m.last_seen = Clock::now();
  if (auto* hello = std::get_if<protocol::Hello>(&message)) {
    handle_hello(m, *hello);
    return;
  }
  if (!m.welcomed) {
    PSLD_LOG_WARN("coordinator: {} sent {} before Hello; ignored", describe(m),
                  protocol::message_name(message));
    return;
  }
  if (auto* reg = std::get_if<protocol::RegisterTensor>(&message)) {
    handle_register(m, *reg);
  } else if (auto* b = std::get_if<protocol::BarrierEnter>(&message)) {
    if (m.role != Role::kWorker) return;
    auto& entered = barriers_[b->barrier];
    entered.insert(m.rank);
    if (entered.size() == options_.num_workers) {
      barriers_.erase(b->barrier);
      post_all(workers_, protocol::BarrierRelease{b->barrier});
    }
  } else if (auto* hb = std::get_if<protocol::Heartbeat>(&message)) {
    post(conn, protocol::Heartbeat{hb->sequence});  // members watch us too
  } else if (auto* report = std::get_if<protocol::LoadReport>(&message)) {
    handle_load_report(m, *report);
  } else if (auto* vote = std::get_if<protocol::EpochVote>(&message)) {
    handle_vote(m, *vote);
  } else if (auto* done = std::get_if<protocol::TransferDone>(&message)) {
    handle_transfer_done(m, *done);
  } else if (auto* sealed = std::get_if<protocol::CheckpointSealed>(&message)) {
    handle_sealed(m, *sealed);
  } else if (auto* synced = std::get_if<protocol::ReplicaSynced>(&message)) {
    handle_synced(m, *synced);
  } else if (auto* p = std::get_if<protocol::WorkerProgress>(&message)) {
    if (m.role != Role::kWorker) return;
    // The next switch round is chosen above max_round_: keeping it at or
    // above every round promised keeps it above every watermark sent, so no
    // switch can end a run at a round a watermark already passed.
    for (const auto& r : p->low)
      max_round_ = std::max(max_round_, r.round);
    progress_[m.rank] = std::move(*p);
    close_replicated_switch();
    maybe_seal();
  } else if (std::holds_alternative<protocol::Shutdown>(message)) {
    m.said_goodbye = true;
    // The acknowledgement lets the member close knowing its goodbye arrived:
    // a close that overtakes it would read as a death.
    post(conn, protocol::Shutdown{});
    if (m.role == Role::kWorker) {
      finished_workers_.insert(m.rank);
      if (finished_workers_.size() == options_.num_workers) finish_job();
    }
  } else if (auto* f = std::get_if<protocol::JobFailed>(&message)) {
    fail_job(fmt::format("{} reported: {}", describe(m), f->reason));
  } else {
    PSLD_LOG_WARN("coordinator: unexpected {} from {}", protocol::message_name(message),
                  describe(m));
  }
}

void CoordinatorService::handle_hello(Member& m, const protocol::Hello& hello) {
  auto reject = [&](const std::string& reason) REQUIRES(mu_) {
    PSLD_LOG_WARN("coordinator rejected {} at {}: {}", role_name(hello.role), m.conn->peer(),
                  reason);
    post(m.conn, protocol::Reject{reason});
  };
  if (m.welcomed) return reject("already admitted");
  if (!protocol::proofs_equal(hello.proof,
                              protocol::hello_proof(options_.secret, m.nonce, hello))) {
    // Told why, then closed: it has no business here, and a flood of them
    // is logged once per host (refuse).
    post(m.conn, protocol::Reject{fmt::format("wrong job secret ({})", kSameSecretEverywhere)});
    door_.refuse("coordinator", m.conn, "it does not know the job secret");
    return;
  }
  if (job_over_) return reject("the job is over");
  uint32_t capacity = 0;
  std::map<uint32_t, uint64_t>* ranks = nullptr;
  if (hello.role == Role::kWorker) {
    capacity = options_.num_workers;
    ranks = &workers_;
  } else if (hello.role == Role::kServer) {
    capacity = options_.num_servers + options_.num_standby;
    ranks = &servers_;
  } else {
    return reject("a coordinator cannot join another coordinator");
  }
  uint32_t rank = 0;
  if (hello.rank_hint >= 0) {
    rank = static_cast<uint32_t>(hello.rank_hint);
    if (rank >= capacity) {
      return reject(fmt::format("{} rank {} is out of range: the job has {} {}s",
                                role_name(hello.role), rank, capacity, role_name(hello.role)));
    }
    if (ranks->count(rank)) {
      return reject(fmt::format("{} rank {} is already taken", role_name(hello.role), rank));
    }
    if (hello.role == Role::kServer && lost_servers_.count(rank)) {
      // Workers dropped their connections to it for good.
      return reject(fmt::format("server rank {} was lost and removed from this job", rank));
    }
  } else {
    while (rank < capacity &&
           (ranks->count(rank) || (hello.role == Role::kServer && lost_servers_.count(rank))))
      ++rank;
    if (rank == capacity) {
      return reject(
          fmt::format("the job already has all its {} {}s", capacity, role_name(hello.role)));
    }
  }
  if (hello.role == Role::kServer && hello.address.empty()) {
    return reject("a server must say where it listens");
  }
  m.welcomed = true;
  m.role = hello.role;
  m.rank = rank;
  m.host = hello.host;
  m.pid = hello.pid;
  admitted_[{m.role, m.rank}] = {m.host, m.pid};
  m.address = hello.address;
  (*ranks)[rank] = m.conn->id();
  protocol::Welcome welcome{m.role,
                            rank,
                            options_.num_workers,
                            options_.num_servers,
                            options_.num_standby,
                            options_.chunk_bytes,
                            resume_round_};
  welcome.proof = protocol::welcome_proof(options_.secret, m.nonce, hello, welcome);
  post(m.conn, welcome);
  PSLD_LOG_INFO("coordinator admitted {}", describe(m));
  if (job_started_) {
    send_job_state(m);  // a late standby server, or a worker rejoining
  } else {
    maybe_start_job();
  }
}

void CoordinatorService::maybe_start_job() {
  if (workers_.size() < options_.num_workers) return;
  // Standby servers too: every worker connects to every server at start, so
  // that a scale-out needs no new connections.
  for (uint32_t r = 0; r < options_.num_servers + options_.num_standby; ++r) {
    if (!servers_.count(r)) return;
  }
  if (options_.initial_placement) {
    placement_ = *options_.initial_placement;
  } else {
    std::vector<ServerSpec> specs;
    for (uint32_t r = 0; r < options_.num_servers; ++r)
      specs.push_back({r, 1.0});
    auto p = Placement::initial(std::move(specs));
    if (!p.ok()) return fail_job("cannot build the initial placement: " + p.status().to_string());
    placement_ = std::move(p).value();
  }
  job_started_ = true;
  ever_owned_ = placement_->owners();
  PSLD_LOG_INFO("coordinator: all {} workers and {} servers joined; job starts",
                options_.num_workers, options_.num_servers);
  for (const auto& [id, m] : members_) {
    if (m.welcomed) send_job_state(m);
  }
}

void CoordinatorService::send_job_state(const Member& m) {
  protocol::ServerList list;
  for (const auto& [rank, id] : servers_) {
    if (const Member* server = find_member(id)) list.servers.push_back({rank, server->address});
  }
  post(m.conn, list);
  for (const auto& piece : placement_chunks(*placement_))
    post(m.conn, piece);
}

void CoordinatorService::handle_register(Member& m, const protocol::RegisterTensor& reg) {
  if (m.role != Role::kWorker) return;
  auto it = tensors_.find(reg.name);
  if (it == tensors_.end() && resume_round_ > 0) {
    std::string names;
    for (const auto& [name, t] : tensors_)
      names += fmt::format("{}'{}'", names.empty() ? "" : ", ", name);
    post(m.conn,
         protocol::Error{0, reg.request, static_cast<uint8_t>(StatusCode::kFailedPrecondition),
                         fmt::format("tensor '{}' is not in the checkpoint of round {} "
                                     "this job resumes from (it has {})",
                                     reg.name, resume_round_, names)});
    return;
  }
  if (it == tensors_.end()) {
    if (reg.bytes % protocol::dtype_bytes(reg.dtype) != 0) {
      post(m.conn,
           protocol::Error{0, reg.request, static_cast<uint8_t>(StatusCode::kInvalidArgument),
                           fmt::format("tensor '{}': {} bytes is not a whole number "
                                       "of {} elements",
                                       reg.name, reg.bytes, protocol::dtype_name(reg.dtype))});
      return;
    }
    it = tensors_
             .emplace(reg.name, TensorRecord{next_tensor_++, reg.dtype, reg.bytes,
                                             options_.chunk_bytes, m.rank})
             .first;
  } else if (it->second.dtype != reg.dtype || it->second.bytes != reg.bytes) {
    const std::string first =
        it->second.first_worker == kFromCheckpoint
            ? fmt::format("the checkpoint of round {} has it", resume_round_)
            : fmt::format("it was registered by worker {}", it->second.first_worker);
    post(m.conn, protocol::Error{0, reg.request, static_cast<uint8_t>(StatusCode::kAlreadyExists),
                                 fmt::format("tensor '{}': {} as {} bytes of {}, but worker {} "
                                             "registers it as {} bytes of {}",
                                             reg.name, first, it->second.bytes,
                                             protocol::dtype_name(it->second.dtype), m.rank,
                                             reg.bytes, protocol::dtype_name(reg.dtype))});
    return;
  }
  post(m.conn, protocol::TensorInfo{reg.request, reg.name, it->second.id, reg.dtype, reg.bytes,
                                    it->second.chunk_bytes, resume_round_});
}

void CoordinatorService::handle_load_report(const Member& m, const protocol::LoadReport& r) {
  // A member reports for itself, about servers of this job: anything else
  // is dropped (and counted) rather than allowed to grow the history.
  const uint32_t servers = options_.num_servers + options_.num_standby;
  bool ok = r.role == m.role && r.rank == m.rank;
  for (const auto& p : r.peers)
    ok = ok && p.server < servers;
  if (!ok) {
    if (bad_reports_++ == 0) {
      PSLD_LOG_WARN(
          "coordinator: dropped a load report from {} that is not about itself or "
          "names an unknown server",
          describe(m));
    }
    return;
  }
  if (r.role == Role::kWorker) max_round_ = std::max(max_round_, r.rounds);
  load_.ingest(r);
  observe_report(r);
}

uint64_t CoordinatorService::epoch() const {
  MutexLock lock(mu_);
  return placement_ ? placement_->epoch() : 0;
}

bool CoordinatorService::switching() const {
  MutexLock lock(mu_);
  return switch_.has_value() || transfer_.has_value() || !replication_allows_switch().ok();
}

bool CoordinatorService::transferring() const {
  MutexLock lock(mu_);
  return transfer_.has_value();
}

uint64_t CoordinatorService::failovers() const {
  MutexLock lock(mu_);
  return failovers_;
}

uint64_t CoordinatorService::aborts() const {
  MutexLock lock(mu_);
  return aborts_;
}

uint64_t CoordinatorService::switches() const {
  MutexLock lock(mu_);
  return switches_;
}

uint64_t CoordinatorService::last_switch_round() const {
  MutexLock lock(mu_);
  return last_switch_round_;
}

LoadHistory CoordinatorService::load_history() const {
  MutexLock lock(mu_);
  return load_;
}

void CoordinatorService::fail_job(const std::string& reason) {
  if (job_over_) return;
  job_over_ = true;
  job_status_ = Aborted(reason);
  PSLD_LOG_ERROR("job failed: {}", reason);
  for (const auto& [id, m] : members_) {
    if (m.welcomed) post(m.conn, protocol::JobFailed{reason});
  }
  cv_.notify_all();
}

void CoordinatorService::finish_job() {
  if (job_over_) return;
  job_over_ = true;
  job_status_ = Status::Ok();
  for (const auto& [id, m] : members_) {
    if (m.welcomed && m.role == Role::kServer) post(m.conn, protocol::Shutdown{});
  }
  PSLD_LOG_INFO("coordinator: every worker finished; servers told to stop");
  cv_.notify_all();
}

void CoordinatorService::monitor() {
  UniqueLock lock(mu_);
  auto woke = Clock::now();
  while (!stopping_) {
    cv_.wait_for(lock.native(), options_.heartbeat_interval / 2);
    if (stopping_ || job_over_) continue;
    const auto now = Clock::now();
    // The coordinator itself did not run for a while (its host stopped or
    // starved it): members' silence in that time is ours, not theirs, so
    // every member gets a fresh timeout from now.
    if (now - woke > options_.heartbeat_timeout / 2) {
      PSLD_LOG_WARN(
          "coordinator: did not run for {} ms; members' silence in that time is not "
          "held against them",
          std::chrono::duration_cast<std::chrono::milliseconds>(now - woke).count());
      for (auto& [id, m] : members_)
        m.last_seen = m.accepted = now;
    }
    woke = now;
    std::vector<ConnectionPtr> silent_servers;
    // Admission has a deadline: a peer not admitted a heartbeat timeout
    // after it connected (silent, or sending anything but a good Hello) is
    // closed.
    for (auto it = members_.begin(); it != members_.end();) {
      if (it->second.welcomed || now - it->second.accepted <= options_.heartbeat_timeout) {
        ++it;
        continue;
      }
      door_.refuse("coordinator", it->second.conn,
                   fmt::format("not admitted within {} ms of connecting",
                               options_.heartbeat_timeout.count()));
      it = members_.erase(it);
    }
    for (auto& conn : door_.take_to_close())
      silent_servers.push_back(std::move(conn));
    for (auto it = members_.begin(); it != members_.end();) {
      const Member m = it->second;
      if (!m.welcomed || m.said_goodbye || now - m.last_seen <= options_.heartbeat_timeout) {
        ++it;
        continue;
      }
      const std::string what = fmt::format("{} sent no heartbeat for {} ms", describe(m),
                                           options_.heartbeat_timeout.count());
      if (m.role != Role::kServer) {
        fail_job(what);
        break;
      }
      // Out of the job for good: its connection is closed (below, without
      // our lock) so that a server that only hung learns it.
      it = members_.erase(it);
      servers_.erase(m.rank);
      silent_servers.push_back(m.conn);
      server_lost(m, what);
      if (job_over_) break;
    }
    if (!job_started_) publish_join_waiting(now);
    close_replicated_switch();  // a worker that finished counts no more
    if (balancer_ && job_started_ && !job_over_ && !switch_ && !transfer_ &&
        replication_allows_switch().ok() && now - last_decision_ >= options_.balancer_interval) {
      balance();
    }
    // Every half heartbeat interval at most, and only when it moved.
    publish_watermark();
    maybe_seal();
    lock.unlock();
    flush();
    for (auto& conn : silent_servers)
      conn->close();
    write_sealed_checkpoint();
    lock.lock();
  }
}

void CoordinatorService::publish_join_waiting(transport::Clock::time_point now) {
  protocol::JoinWaiting w;
  w.workers_joined = static_cast<uint32_t>(workers_.size());
  w.servers_joined = static_cast<uint32_t>(servers_.size());
  const uint32_t all_servers = options_.num_servers + options_.num_standby;
  // The lowest ranks below `count` that `joined` lacks.
  auto missing = [](const std::map<uint32_t, uint64_t>& joined, uint32_t count,
                    std::vector<uint32_t>& out) {
    for (uint32_t r = 0; r < count && out.size() < protocol::kMaxMissingListed; ++r) {
      if (!joined.count(r)) out.push_back(r);
    }
  };
  missing(workers_, options_.num_workers, w.missing_workers);
  missing(servers_, all_servers, w.missing_servers);
  if (w != join_sent_ && now - join_sent_at_ >= options_.heartbeat_interval / 2) {
    for (const auto& [id, m] : members_) {
      if (m.welcomed) post(m.conn, w);
    }
    join_sent_ = w;
    join_sent_at_ = now;
  }
  if (w != join_logged_ && now - join_logged_at_ >= kJoinLogInterval) {
    PSLD_LOG_INFO("coordinator: the job waits for {}",
                  protocol::waiting_for(w, options_.num_workers, all_servers));
    join_logged_ = w;
    join_logged_at_ = now;
  }
}

Status CoordinatorService::wait(std::chrono::milliseconds timeout) {
  UniqueLock lock(mu_);
  if (!cv_.wait_for(lock.native(), timeout, [&]() REQUIRES(mu_) { return job_over_; })) {
    return Timeout(fmt::format("the job did not end within {} ms", timeout.count()));
  }
  return job_status_;
}

void CoordinatorService::shutdown() {
  {
    MutexLock lock(mu_);
    if (!job_over_) {
      job_over_ = true;
      job_status_ = Aborted("the coordinator was shut down");
      for (const auto& [id, m] : members_) {
        if (m.welcomed) post(m.conn, protocol::JobFailed{"the coordinator was shut down"});
      }
    }
    stopping_ = true;
  }
  flush();
  cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  // A checkpoint sealed as the job ended: its files are in place already.
  write_sealed_checkpoint();
  stop();  // closing flushes what was sent
}

}  // namespace psld
