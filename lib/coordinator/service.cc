#include "lib/coordinator/service.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "base/log.h"
#include "lib/placement/epoch_log.h"

namespace psld {

using MemberRole = protocol::Role;
using transport::Clock;
using transport::ConnectionPtr;

namespace {

// The servers that own at least one arc of `p`.
std::set<uint32_t> owners_of(const Placement& p) {
  std::set<uint32_t> out;
  for (size_t i = 0; i < p.num_arcs(); ++i)
    out.insert(p.arc(i).owner);
  return out;
}

uint64_t random_nonce() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

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
  if (options.endpoint.options.common.listen_address.empty()) {
    return InvalidArgument("the coordinator needs a listen address");
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
  PSLD_RETURN_IF_ERROR(c->Endpoint::start(options.endpoint));
  if (options.balancer_enabled) {
    PSLD_ASSIGN_OR_RETURN(auto b, Balancer::make(options.balancer));
    c->balancer_.emplace(std::move(b));
  }
  c->monitor_ = std::thread([raw = c.get()] { raw->monitor(); });
  PSLD_LOG_INFO("coordinator listening at {} for {} workers, {} servers (+{} standby)",
                c->address(), options.num_workers, options.num_servers, options.num_standby);
  return c;
}

CoordinatorService::CoordinatorService(const RuntimeOptions& options) : options_(options) {}

CoordinatorService::~CoordinatorService() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  stop();
}

size_t CoordinatorService::num_members() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [id, m] : members_)
    n += m.welcomed;
  return n;
}

std::string CoordinatorService::describe(const Member& m) const {
  if (!m.welcomed) return "an unadmitted peer at " + m.conn->peer();
  return fmt::format("{} {} ({}, pid {})", protocol::role_name(m.role), m.rank,
                     m.host.empty() ? m.conn->peer() : m.host, m.pid);
}

void CoordinatorService::on_accept(const ConnectionPtr& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Member m;
    m.conn = conn;
    m.nonce = random_nonce();
    m.last_seen = Clock::now();
    members_[conn->id()] = m;
    post(conn, protocol::Challenge{m.nonce});
  }
  flush();
}

void CoordinatorService::post(const ConnectionPtr& conn, protocol::Message message) {
  outbox_.emplace_back(conn, std::move(message));
}

void CoordinatorService::flush() {
  // One flusher at a time, so messages leave in the order they were posted
  // (a commit must not be overtaken by the next epoch's prepare).
  std::lock_guard<std::mutex> order(flush_mu_);
  std::vector<std::pair<ConnectionPtr, protocol::Message>> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(outbox_);
  }
  for (auto& [conn, message] : out)
    (void)send(conn, message);
}

void CoordinatorService::on_disconnect(const ConnectionPtr& conn, const Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = members_.find(conn->id());
    if (it == members_.end()) return;
    Member m = it->second;
    members_.erase(it);
    if (!m.welcomed) return;
    (m.role == MemberRole::kWorker ? workers_ : servers_).erase(m.rank);
    if (!m.said_goodbye && !job_over_ && !stopping_) {
      const std::string what = fmt::format("{} disconnected: {}", describe(m), why.message());
      if (m.role == MemberRole::kServer) {
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
  std::lock_guard<std::mutex> lock(mu_);
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
    if (m.role != MemberRole::kWorker) return;
    auto& entered = barriers_[b->barrier];
    entered.insert(m.rank);
    if (entered.size() == options_.num_workers) {
      barriers_.erase(b->barrier);
      for (const auto& [rank, id] : workers_) {
        post(members_.at(id).conn, protocol::BarrierRelease{b->barrier});
      }
    }
  } else if (auto* hb = std::get_if<protocol::Heartbeat>(&message)) {
    post(conn, protocol::Heartbeat{hb->sequence});  // members watch us too
  } else if (auto* report = std::get_if<protocol::LoadReport>(&message)) {
    handle_load_report(m, *report);
  } else if (auto* vote = std::get_if<protocol::EpochVote>(&message)) {
    handle_vote(m, *vote);
  } else if (auto* done = std::get_if<protocol::TransferDone>(&message)) {
    handle_transfer_done(m, *done);
  } else if (auto* p = std::get_if<protocol::WorkerProgress>(&message)) {
    if (m.role != MemberRole::kWorker) return;
    // The next switch round is chosen above max_round_: keeping it at or
    // above every round promised keeps it above every watermark sent, so no
    // switch can end a run at a round a watermark already passed.
    for (const auto& r : p->low)
      max_round_ = std::max(max_round_, r.round);
    progress_[m.rank] = std::move(*p);
  } else if (std::holds_alternative<protocol::Shutdown>(message)) {
    m.said_goodbye = true;
    // The acknowledgement lets the member close knowing its goodbye arrived:
    // a close that overtakes it would read as a death.
    post(conn, protocol::Shutdown{});
    if (m.role == MemberRole::kWorker) {
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
  auto reject = [&](const std::string& reason) {
    PSLD_LOG_WARN("coordinator rejected {} at {}: {}", protocol::role_name(hello.role),
                  m.conn->peer(), reason);
    post(m.conn, protocol::Reject{reason});
  };
  if (m.welcomed) return reject("already admitted");
  if (hello.proof != protocol::secret_proof(options_.secret, m.nonce)) {
    return reject("wrong job secret (check PSLD_SECRET on every process of the job)");
  }
  if (job_over_) return reject("the job is over");
  uint32_t capacity = 0;
  std::map<uint32_t, uint64_t>* ranks = nullptr;
  if (hello.role == MemberRole::kWorker) {
    capacity = options_.num_workers;
    ranks = &workers_;
  } else if (hello.role == MemberRole::kServer) {
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
                                protocol::role_name(hello.role), rank, capacity,
                                protocol::role_name(hello.role)));
    }
    if (ranks->count(rank)) {
      return reject(
          fmt::format("{} rank {} is already taken", protocol::role_name(hello.role), rank));
    }
    if (hello.role == MemberRole::kServer && lost_servers_.count(rank)) {
      // Workers dropped their connections to it for good.
      return reject(fmt::format("server rank {} was lost and removed from this job", rank));
    }
  } else {
    while (rank < capacity &&
           (ranks->count(rank) || (hello.role == MemberRole::kServer && lost_servers_.count(rank))))
      ++rank;
    if (rank == capacity) {
      return reject(fmt::format("the job already has all its {} {}s", capacity,
                                protocol::role_name(hello.role)));
    }
  }
  if (hello.role == MemberRole::kServer && hello.address.empty()) {
    return reject("a server must say where it listens");
  }
  m.welcomed = true;
  m.role = hello.role;
  m.rank = rank;
  m.host = hello.host;
  m.pid = hello.pid;
  m.address = hello.address;
  (*ranks)[rank] = m.conn->id();
  post(m.conn, protocol::Welcome{m.role, rank, options_.num_workers, options_.num_servers,
                                 options_.num_standby, options_.chunk_bytes});
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
  ever_owned_ = owners_of(*placement_);
  PSLD_LOG_INFO("coordinator: all {} workers and {} servers joined; job starts",
                options_.num_workers, options_.num_servers);
  for (const auto& [id, m] : members_) {
    if (m.welcomed) send_job_state(m);
  }
}

void CoordinatorService::send_job_state(const Member& m) {
  protocol::ServerList list;
  for (const auto& [rank, id] : servers_)
    list.servers.push_back({rank, members_.at(id).address});
  post(m.conn, list);
  for (const auto& piece : placement_chunks(*placement_))
    post(m.conn, piece);
}

void CoordinatorService::handle_register(Member& m, const protocol::RegisterTensor& reg) {
  if (m.role != MemberRole::kWorker) return;
  auto it = tensors_.find(reg.name);
  if (it == tensors_.end()) {
    if (reg.bytes % protocol::dtype_bytes(reg.dtype) != 0) {
      post(m.conn,
           protocol::Error{0, reg.request, static_cast<uint8_t>(StatusCode::kInvalidArgument),
                           fmt::format("tensor '{}': {} bytes is not a whole number "
                                       "of {} elements",
                                       reg.name, reg.bytes, dtype_name(reg.dtype))});
      return;
    }
    it = tensors_.emplace(reg.name, TensorRecord{next_tensor_++, reg.dtype, reg.bytes, m.rank})
             .first;
  } else if (it->second.dtype != reg.dtype || it->second.bytes != reg.bytes) {
    post(m.conn,
         protocol::Error{
             0, reg.request, static_cast<uint8_t>(StatusCode::kAlreadyExists),
             fmt::format("tensor '{}' was registered by worker {} as {} bytes of "
                         "{}, but worker {} registers it as {} bytes of {}",
                         reg.name, it->second.first_worker, it->second.bytes,
                         dtype_name(it->second.dtype), m.rank, reg.bytes, dtype_name(reg.dtype))});
    return;
  }
  post(m.conn, protocol::TensorInfo{reg.request, reg.name, it->second.id, reg.dtype, reg.bytes,
                                    options_.chunk_bytes});
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
  if (r.role == protocol::Role::kWorker) max_round_ = std::max(max_round_, r.rounds);
  load_.ingest(r);
}

Status CoordinatorService::propose(const PlacementDelta& delta) {
  Status st = start_switch(delta);
  flush();
  return st;
}

Placement CoordinatorService::current_placement() const {
  std::lock_guard<std::mutex> lock(mu_);
  return *placement_;
}

Status CoordinatorService::start_switch(const PlacementDelta& delta) {
  std::lock_guard<std::mutex> lock(mu_);
  return start_switch_locked(delta);
}

// mu_ held. The one way an epoch switch starts (propose() and the balancer).
Status CoordinatorService::start_switch_locked(const PlacementDelta& delta) {
  if (!job_started_ || job_over_) return FailedPrecondition("the job is not running");
  if (switch_) return FailedPrecondition("an epoch switch is in flight");
  if (transfer_) {
    return FailedPrecondition(
        fmt::format("the transfer of epoch {} is not final yet", placement_->epoch()));
  }
  if (delta.from_epoch != placement_->epoch()) {
    return FailedPrecondition(fmt::format("the delta starts from epoch {}, the job is at {}",
                                          delta.from_epoch, placement_->epoch()));
  }
  auto next = placement_->apply(delta);
  if (!next.ok()) return next.status().with_context("the proposed epoch");
  Switch sw{delta, delta.serialize(), std::move(next).value(), 0, 4, {}};
  if (sw.delta_bytes.size() > protocol::kMaxDeltaBytes) {
    return InvalidArgument(fmt::format("a delta of {} bytes does not fit one message ({})",
                                       sw.delta_bytes.size(), protocol::kMaxDeltaBytes));
  }
  switch_ = std::move(sw);
  send_prepare();
  return Status::Ok();
}

// mu_ held.
void CoordinatorService::send_prepare() {
  Switch& sw = *switch_;
  // Ahead of every round seen, and after the previous switch (an epoch must
  // serve at least one round for the next one to take its keys from it).
  sw.switch_round = std::max(max_round_ + sw.margin, last_switch_round_ + 1);
  sw.yes.clear();
  for (const auto& [rank, id] : servers_) {
    post(members_.at(id).conn, protocol::EpochChange{protocol::EpochStep::kPrepare, sw.next.epoch(),
                                                     sw.switch_round, sw.delta_bytes, 0});
  }
}

void CoordinatorService::handle_vote(const Member& m, const protocol::EpochVote& vote) {
  if (m.role != protocol::Role::kServer || !switch_) return;
  Switch& sw = *switch_;
  if (vote.epoch != sw.next.epoch() || vote.switch_round != sw.switch_round) return;  // stale
  max_round_ = std::max(max_round_, vote.max_round);
  if (!vote.yes) {
    // A server already saw a round past the switch: switch later.
    sw.margin = std::min<uint64_t>(sw.margin * 2, 1 << 20);
    PSLD_LOG_DEBUG("coordinator: server {} saw round {} >= {}; epoch {} retried later", m.rank,
                   vote.max_round, sw.switch_round, sw.next.epoch());
    send_prepare();
    return;
  }
  sw.yes.insert(m.rank);
  maybe_commit();
}

// mu_ held.
void CoordinatorService::maybe_commit() {
  if (!switch_) return;
  for (const auto& [rank, id] : servers_) {
    if (!switch_->yes.count(rank)) return;
  }
  commit_switch();
}

// mu_ held. Everyone agreed: commit, servers first.
void CoordinatorService::commit_switch() {
  Switch& sw = *switch_;
  const protocol::EpochChange commit{protocol::EpochStep::kCommit, sw.next.epoch(), sw.switch_round,
                                     sw.delta_bytes, 0};
  for (const auto& [rank, id] : servers_)
    post(members_.at(id).conn, commit);
  for (const auto& [rank, id] : workers_)
    post(members_.at(id).conn, commit);
  PSLD_LOG_INFO("coordinator: epoch {} from round {} ({} ranges move)", sw.next.epoch(),
                sw.switch_round, sw.delta.assignments.size());
  Placement before = std::move(*placement_);
  placement_ = std::move(sw.next);
  last_switch_round_ = sw.switch_round;
  switch_.reset();
  ++switches_;
  begin_transfer(std::move(before));
  // Servers lost while this switch was voted on held nothing then: what it
  // gave them goes back now.
  for (uint32_t rank : std::exchange(pending_losses_, {}))
    publish_abort(rank);
  cv_.notify_all();
}

// mu_ held. A transfer is tracked (and blocks the next switch until final)
// only when a server that never owned anything gains keys in it: only such a
// server can die without losing state, and only its transfer can be
// aborted. Other switches end as they always did, in the background.
void CoordinatorService::begin_transfer(Placement before) {
  bool abortable = false;
  for (uint32_t s : owners_of(*placement_))
    abortable = abortable || !ever_owned_.count(s);
  if (!abortable) {
    ever_owned_.merge(owners_of(*placement_));
    return;
  }
  Transfer t{last_switch_round_, std::move(before), {}, {}};
  for_each_overlap(t.before, *placement_, [&](uint64_t, uint64_t, ServerId was, ServerId now) {
    if (was != now) t.waiting.insert(was);
  });
  transfer_.emplace(std::move(t));
  finish_transfer_if_done();
}

// mu_ held.
void CoordinatorService::finish_transfer_if_done() {
  if (!transfer_ || !transfer_->waiting.empty()) return;
  // From now on the new owners hold state like any other owner.
  ever_owned_.merge(owners_of(*placement_));
  const protocol::EpochFinal final{placement_->epoch(), transfer_->switch_round};
  for (const auto& [rank, id] : servers_)
    post(members_.at(id).conn, final);
  PSLD_LOG_DEBUG("coordinator: the transfer of epoch {} at round {} is final", final.epoch,
                 final.switch_round);
  transfer_.reset();
  cv_.notify_all();
}

void CoordinatorService::handle_transfer_done(const Member& m, const protocol::TransferDone& done) {
  if (m.role != protocol::Role::kServer || !transfer_) return;
  // By switch round, not epoch: an abort changes the epoch of the same
  // transfer, and what a server shipped for the first still counts.
  if (done.switch_round != transfer_->switch_round) return;
  if (done.late_keys > 0) {
    PSLD_LOG_WARN(
        "coordinator: server {} reports the transfer at round {} done with {} keys that have not "
        "reached the switch; they move when they do",
        m.rank, done.switch_round, done.late_keys);
  }
  transfer_->reported.insert(m.rank);
  transfer_->waiting.erase(m.rank);
  finish_transfer_if_done();
}

// mu_ held. Per tensor, the lowest round any worker may still send a request
// for: a run of ownership of its keys that ended at or below it and shipped
// is needed by nobody. Capped below a switch being voted on and a transfer
// that can still be aborted: either may yet give a key back to the run it
// ends (docs/migration.md, "Freeing old runs").
void CoordinatorService::publish_watermark() {
  // Tensor ids are 1..tensors_.size(), assigned in registration order.
  const auto tensors = static_cast<uint32_t>(tensors_.size());
  if (!job_started_ || job_over_ || tensors == 0) return;
  std::vector<uint64_t> low(tensors, UINT64_MAX);
  for (uint32_t w = 0; w < options_.num_workers; ++w) {
    if (finished_workers_.count(w)) continue;  // it sends nothing any more
    auto it = progress_.find(w);
    if (it == progress_.end()) return;  // it promised nothing yet
    for (TensorId t = 1; t <= tensors; ++t)
      low[t - 1] = std::min(low[t - 1], protocol::round_of(it->second.low, it->second.tensors, t));
  }
  uint64_t cap = UINT64_MAX;
  if (switch_) cap = std::min(cap, switch_->switch_round - 1);
  if (transfer_) cap = std::min(cap, transfer_->switch_round - 1);
  for (uint64_t& r : low) {
    r = std::min(r, cap);
    if (r == UINT64_MAX) return;  // every worker is done
  }
  protocol::LowWatermark mark{tensors, protocol::pack_rounds(low)};
  if (watermark_ && watermark_->tensors == mark.tensors &&
      watermark_->low.size() == mark.low.size() &&
      std::equal(mark.low.begin(), mark.low.end(), watermark_->low.begin(),
                 [](const auto& a, const auto& b) {
                   return a.first_tensor == b.first_tensor && a.round == b.round;
                 })) {
    return;
  }
  watermark_ = std::move(mark);
  for (const auto& [rank, id] : servers_)
    post(members_.at(id).conn, *watermark_);
}

// mu_ held. A server that never owned an arc outside an open transfer holds
// no state: nothing it gained was applied, answered or accepted before
// EpochFinal (protocol.h), so it can go without losing anything. Any other
// server may hold parameters nobody else has (also one that owns nothing
// now: it may still be shipping what it owned).
void CoordinatorService::server_lost(const Member& m, const std::string& what) {
  if (!job_started_) return fail_job(what);
  if (ever_owned_.count(m.rank)) {
    const size_t arcs = placement_->arcs_of(m.rank).size();
    return fail_job(fmt::format(
        "{}; it held parameters ({}) that exist nowhere else, so the job cannot go on", what,
        arcs > 0 ? fmt::format("{} ranges of epoch {}", arcs, placement_->epoch())
                 : std::string("ranges it owned before, maybe not all shipped")));
  }
  lost_servers_.insert(m.rank);
  PSLD_LOG_WARN(
      "coordinator: {}; it held nothing but keys in transfer, so the job goes on without it", what);
  if (switch_) {
    // No vote is awaited from it; once the others agreed, the switch
    // commits and what it gave this server goes back.
    switch_->yes.erase(m.rank);
    pending_losses_.insert(m.rank);
    maybe_commit();
    return;
  }
  publish_abort(m.rank);
  cv_.notify_all();
}

// mu_ held.
void CoordinatorService::publish_abort(uint32_t rank) {
  const Placement& now = *placement_;
  if (now.find_server(rank) == nullptr) return;  // an idle standby: nothing to take back
  const Placement& before = transfer_ ? transfer_->before : now;
  PlacementDelta delta;
  delta.from_epoch = now.epoch();
  delta.to_epoch = now.epoch() + 1;
  delta.membership.push_back(MembershipChange::remove(rank));
  for_each_overlap(before, now, [&](uint64_t lo, uint64_t hi, ServerId was, ServerId owner) {
    if (owner != rank) return;
    auto& as = delta.assignments;
    if (!as.empty() && as.back().owner == was && as.back().hi + 1 == lo) {
      as.back().hi = hi;  // one range where neighbours go back to the same server
    } else {
      as.push_back({lo, hi, was});
    }
  });
  auto next = now.apply(delta);
  std::vector<uint8_t> bytes = delta.serialize();
  if (!next.ok() || bytes.size() > protocol::kMaxDeltaBytes) {
    return fail_job(fmt::format(
        "server {} was lost during a transfer, and giving its ranges back failed: {}", rank,
        next.ok() ? fmt::format("the delta has {} bytes, more than one message holds", bytes.size())
                  : next.status().to_string()));
  }
  const uint64_t round = transfer_ ? transfer_->switch_round : last_switch_round_;
  const protocol::EpochChange abort{protocol::EpochStep::kAbort, next->epoch(), round, bytes, rank};
  for (const auto& [r, id] : servers_)
    post(members_.at(id).conn, abort);
  for (const auto& [r, id] : workers_)
    post(members_.at(id).conn, abort);
  PSLD_LOG_INFO(
      "coordinator: epoch {} from round {}: server {} removed, {} ranges back to their "
      "owners",
      next->epoch(), round, rank, delta.assignments.size());
  placement_ = std::move(next).value();
  ++aborts_;
  if (transfer_) {
    // The rest of the transfer goes on; old owners that lost only to the
    // lost server have nothing left to ship.
    transfer_->waiting.clear();
    for_each_overlap(transfer_->before, *placement_,
                     [&](uint64_t, uint64_t, ServerId was, ServerId owner) {
                       if (was != owner && !transfer_->reported.count(was))
                         transfer_->waiting.insert(was);
                     });
    finish_transfer_if_done();
  }
}

// mu_ held. The balancer sees one window per server per decision: what the
// server reported since the previous decision, over the rounds the job made
// in that time.
void CoordinatorService::balance() {
  const auto now = Clock::now();
  const bool first = last_decision_ == Clock::time_point{};
  const uint64_t rounds = max_round_ - decision_round_;
  const double elapsed_s = std::chrono::duration<double>(now - last_decision_).count();
  // A window belongs to the epoch that was in force when it began: one that
  // straddles a switch (and the migration) is not evidence about the new one.
  const uint64_t window_epoch = decision_epoch_;
  last_decision_ = now;
  decision_round_ = max_round_;
  // The window beginning now counts for the newest epoch only once that
  // epoch serves every round: its switch round passed and its state
  // transfer final. Until then it holds rounds of the previous epoch and the
  // migration itself (a scale-out of 3 MiB per round was rolled back in
  // psld bench stragglers S5 on such a window).
  const bool serving = placement_->epoch() == 0 || (!transfer_ && max_round_ > last_switch_round_);
  decision_epoch_ = serving ? placement_->epoch() : placement_->epoch() - 1;
  if (first || rounds == 0) return;  // nothing measured yet
  const uint64_t seq = balancer_->decisions() + 1;
  BalancerInput input;
  std::map<uint32_t, uint64_t> newest = decision_window_;
  for (const auto& [rank, id] : servers_) {
    const auto* ring = load_.server(rank);
    if (ring == nullptr) continue;
    ServerWindow w;
    w.seq = seq;
    w.epoch = window_epoch;
    w.rounds = rounds;
    w.round_s = elapsed_s / static_cast<double>(rounds);
    bool any = false;
    for (const auto& win : *ring) {
      auto seen = decision_window_.find(rank);
      if (seen != decision_window_.end() && win.window <= seen->second) continue;
      w.bytes += static_cast<double>(win.bytes_in + win.bytes_out);
      w.busy_s += static_cast<double>(win.busy_ns) / 1e9;
      newest[rank] = std::max(newest[rank], win.window);
      any = true;
    }
    if (any) input.servers.push_back(ServerHistory{rank, {w}});
  }
  for (const auto& [lo, ring] : load_.arcs()) {
    const Arc arc = placement_->arc(placement_->arc_index_of_hash(lo));
    if (arc.lo != lo) continue;  // an arc of an older epoch, since cut
    double bytes = 0;
    for (const auto& win : ring) {
      auto seen = decision_window_.find(win.server);
      if (win.epoch != placement_->epoch()) continue;
      if (seen != decision_window_.end() && win.window <= seen->second) continue;
      bytes += static_cast<double>(win.bytes_in + win.bytes_out);
    }
    if (bytes > 0) input.ranges.push_back({arc.lo, arc.hi, bytes / static_cast<double>(rounds)});
  }
  decision_window_ = std::move(newest);
  for (const auto& [rank, id] : servers_) {
    if (placement_->find_server(rank) == nullptr) input.standby.push_back({rank, 1.0});
  }
  auto plan = balancer_->decide(*placement_, input);
  if (!plan.ok()) {
    PSLD_LOG_WARN("balancer: {}", plan.status().to_string());
    return;
  }
  PSLD_LOG_DEBUG("balancer: {}", plan->log);
  if (plan->steps.empty()) return;
  const PlanStep& step = plan->steps.front();
  PSLD_LOG_INFO("balancer: {}", step.reason);
  Status st = start_switch_locked(step.change.delta);
  if (!st.ok()) PSLD_LOG_WARN("balancer: the plan was not published: {}", st.to_string());
}

uint64_t CoordinatorService::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_ ? placement_->epoch() : 0;
}

bool CoordinatorService::switching() const {
  std::lock_guard<std::mutex> lock(mu_);
  return switch_.has_value() || transfer_.has_value();
}

bool CoordinatorService::transferring() const {
  std::lock_guard<std::mutex> lock(mu_);
  return transfer_.has_value();
}

uint64_t CoordinatorService::aborts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return aborts_;
}

uint64_t CoordinatorService::switches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return switches_;
}

uint64_t CoordinatorService::last_switch_round() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_switch_round_;
}

LoadHistory CoordinatorService::load_history() const {
  std::lock_guard<std::mutex> lock(mu_);
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
    if (m.welcomed && m.role == MemberRole::kServer) post(m.conn, protocol::Shutdown{});
  }
  PSLD_LOG_INFO("coordinator: every worker finished; servers told to stop");
  cv_.notify_all();
}

void CoordinatorService::monitor() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, options_.heartbeat_interval / 2);
    if (stopping_ || job_over_) continue;
    const auto now = Clock::now();
    std::vector<ConnectionPtr> silent_servers;
    for (auto it = members_.begin(); it != members_.end();) {
      const Member m = it->second;
      if (!m.welcomed || m.said_goodbye || now - m.last_seen <= options_.heartbeat_timeout) {
        ++it;
        continue;
      }
      const std::string what = fmt::format("{} sent no heartbeat for {} ms", describe(m),
                                           options_.heartbeat_timeout.count());
      if (m.role != MemberRole::kServer) {
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
    if (balancer_ && job_started_ && !job_over_ && !switch_ && !transfer_ &&
        now - last_decision_ >= options_.balancer_interval) {
      balance();
    }
    // Every half heartbeat interval at most, and only when it moved.
    publish_watermark();
    lock.unlock();
    flush();
    for (auto& conn : silent_servers)
      conn->close();
    lock.lock();
  }
}

Status CoordinatorService::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return job_over_; })) {
    return Timeout(fmt::format("the job did not end within {} ms", timeout.count()));
  }
  return job_status_;
}

void CoordinatorService::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  stop();  // closing flushes what was sent
}

}  // namespace psld
