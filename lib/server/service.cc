// The server service: start-up, shutdown, stats, the control messages it
// receives, and where each key belongs in its epochs (docs/runtime.md).
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "base/thread.h"
#include "lib/server/key_state.h"

namespace psld {

using transport::ConnectionPtr;

uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

Status check_landing_memory(const RuntimeOptions& options, uint64_t memory_bytes) {
  // Every worker gets its landing slots when it connects: a job too large
  // for them would fail worker after worker, long after it started.
  const unsigned __int128 landing = static_cast<unsigned __int128>(options.num_workers) *
                                    options.slots_per_worker * options.chunk_bytes;
  if (memory_bytes == 0 || landing <= memory_bytes) return Status::Ok();
  const auto gib = [](unsigned __int128 b) { return static_cast<double>(b) / (1u << 30); };
  return InvalidArgument(fmt::format(
      "a server's landing slots for {} workers would take {:.1f} GiB (job.num_workers x "
      "data.slots_per_worker {} x data.chunk_bytes {}), more than this machine's {:.1f} GiB of "
      "memory: lower data.chunk_bytes or data.slots_per_worker (docs/scale.md)",
      options.num_workers, gib(landing), options.slots_per_worker, options.chunk_bytes,
      gib(memory_bytes)));
}

Result<std::unique_ptr<ServerService>> ServerService::start(const RuntimeOptions& options) {
  if (options.net.options.common.listen_address.empty()) {
    return InvalidArgument("a server needs a listen address");
  }
  if (options.server_threads == 0 || options.server_threads > 256) {
    return InvalidArgument("server_threads must be in [1, 256]");
  }
  PSLD_RETURN_IF_ERROR(check_landing_memory(options, physical_memory_bytes()));
  std::unique_ptr<ServerService> s(new ServerService(options));
  if (options.server_device == ServerDeviceKind::kCuda) {
    auto device = options.server_device_factory
                      ? options.server_device_factory(options.server_threads)
                      : create_cuda_server_device(options.server_threads);
    if (!device.ok()) {
      return FailedPrecondition(
          fmt::format("server.device = cuda, but the GPU cannot be used: {} (server.device = "
                      "cpu keeps the keys in host memory)",
                      device.status().message()));
    }
    if ((*device)->lanes() < options.server_threads) {
      return Internal(fmt::format("the server device has {} lanes for {} server threads",
                                  (*device)->lanes(), options.server_threads));
    }
    s->device_ = std::move(device).value();
  }
  PSLD_ASSIGN_OR_RETURN(s->load_, LoadRecorder::make(Role::kServer));
  PSLD_RETURN_IF_ERROR(s->ProcessRuntime::start(options.net, options.secret));
  if (options.batch_chunk_bytes > 0 && !s->device_) {
    // Two batches in flight per landing slot a worker holds: enough for a
    // pass of the shard loop to find one free.
    const uint32_t buffers = 2 * options.slots_per_worker;
    auto pool = s->transport().allocate_memory(buffers * options.batch_bytes, MemoryKind::kHost);
    if (!pool.ok()) return pool.status().with_context("allocating the buffers of answer batches");
    s->answer_pool_ = *pool;
    s->answer_buffer_bytes_ = options.batch_bytes;
    MutexLock lock(s->answer_mu_);
    for (uint32_t i = buffers; i > 0; --i)
      s->free_answer_buffers_.push_back(i - 1);
  }
  for (uint32_t i = 0; i < options.server_threads; ++i) {
    s->shards_.push_back(std::make_unique<Shard>());
    s->shards_.back()->index = i;
    s->shards_.back()->lane = ComputeLane(s->device_.get(), i);
  }
  for (auto& shard : s->shards_) {
    Shard* raw = shard.get();
    PSLD_RETURN_IF_ERROR(start_thread(shard->thread, "server shard",
                                      [srv = s.get(), raw] { srv->shard_loop(*raw); }));
  }
  s->session_.on_epoch(
      [srv = s.get()](const protocol::EpochChange& e) { srv->on_epoch_change(e); });
  s->session_.on_final([srv = s.get()](const protocol::EpochFinal& f) { srv->on_final(f); });
  s->session_.on_watermark(
      [srv = s.get()](const protocol::LowWatermark& w) { srv->dispatch_all(Trim{w}); });
  s->session_.on_tick([srv = s.get()] { srv->on_tick(); });
  s->session_.on_seal([srv = s.get()](const protocol::CheckpointSeal& seal) {
    if (CheckpointWriter* writer = srv->checkpoint_writer()) {
      writer->seal(seal.round);
      return;
    }
    protocol::CheckpointSealed answer;
    answer.round = seal.round;
    answer.error = fmt::format(
        "server {} writes no checkpoints (checkpoint.every_rounds is 0 "
        "here, or its writer could not start)",
        srv->rank());
    (void)srv->session_.send_to_coordinator(answer);
  });
  PSLD_RETURN_IF_ERROR(s->session_.join(s->transport().address()));
  s->trace_ = TraceRecorder::make(options.trace, "server", s->rank());
  {
    MutexLock lock(s->epoch_mu_);
    s->epochs_.emplace(s->session_.placement());
    s->committed_epoch_.store(s->epochs_->latest().epoch(), std::memory_order_release);
    s->owned_ever_ = !s->epochs_->latest().arcs_of(s->rank()).empty();
  }
  Status reports =
      s->session_.start_reports(options.stats_interval, [srv = s.get()](uint64_t window_ns) {
        std::vector<protocol::Message> out;
        for (auto& r : srv->load_->close_window(srv->rank(), srv->newest_epoch(), window_ns))
          out.emplace_back(std::move(r));
        return out;
      });
  PSLD_RETURN_IF_ERROR(reports);
  PSLD_LOG_INFO("server {} listening at {}; keys {}", s->rank(), s->address(),
                s->device_ ? "on " + s->device_->describe() : std::string("in host memory"));
  return s;
}

ServerService::ServerService(const RuntimeOptions& options)
    : options_(options),
      session_(*this, Role::kServer, options),
      compute_rate_(options.compute_bytes_per_second) {}

void ServerService::set_compute_rate(double bytes_per_second) {
  compute_rate_.store(bytes_per_second);
}

void ServerService::pace_compute(uint64_t bytes) {
  // A sleep wakes ~50-100 us late (timer slack, scheduling), which is more
  // than a small chunk's whole cost at 100 MB/s (4 KiB: 41 us). Sleeping
  // once per reduce made the emulated processor's speed depend on how many
  // chunks it reduced, not on their bytes (a server of many small tensors
  // looked slow, to the balancer and in fact). So the processor runs ahead
  // of the clock and a reduce sleeps only once it is kSleepAfter ahead:
  // the lateness is paid once per kSleepAfter of work, whatever the chunks.
  constexpr auto kSleepAfter = std::chrono::milliseconds(1);
  transport::Clock::time_point until;
  transport::Clock::time_point now;
  {
    const double rate = compute_rate_.load(std::memory_order_relaxed);
    if (rate <= 0) return;
    MutexLock lock(compute_mu_);
    now = transport::Clock::now();
    const auto cost = std::chrono::duration_cast<transport::Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / rate));
    compute_free_ = std::max(compute_free_, now) + cost;
    until = compute_free_;
  }
  if (until - now >= kSleepAfter) std::this_thread::sleep_until(until);
}

ServerService::~ServerService() {
  shutdown();
}

void ServerService::shutdown() {
  if (stopping_.exchange(true)) return;
  session_.on_tick(nullptr);  // the tick reads what is torn down below
  session_.stop_reports();
  // The shard threads first: they dial peers, register memory and write,
  // none of which the transport may see after its shutdown (a server can be
  // stopped in the middle of a transfer). Work the progress thread queues
  // meanwhile stays queued.
  for (auto& shard : shards_) {
    {
      std::lock_guard<std::mutex> lock(shard->mu);
      shard->stop = true;
    }
    shard->cv.notify_all();
  }
  for (auto& shard : shards_) {
    if (shard->thread.joinable()) shard->thread.join();
  }
  stop();  // no more handler calls after this
  {
    // Files of rounds not sealed are removed: never a torn one in place.
    MutexLock lock(ckpt_mu_);
    writer_.reset();
  }
  MutexLock lock(conns_mu_);
  conns_.clear();
}

static_assert(sizeof(ServerStats) == 20 * sizeof(uint64_t),
              "ServerStats::operator+= adds every field: add the new one there");

ServerStats& ServerStats::operator+=(const ServerStats& o) {
  pushes += o.pushes;
  pushes_in_place += o.pushes_in_place;
  batches += o.batches;
  batched_pushes += o.batched_pushes;
  answer_batches += o.answer_batches;
  batched_answers += o.batched_answers;
  answers_alone += o.answers_alone;
  answers_in_place += o.answers_in_place;
  pulls += o.pulls;
  bytes_in += o.bytes_in;
  bytes_out += o.bytes_out;
  rounds_applied += o.rounds_applied;
  rejected += o.rejected;
  states_requested += o.states_requested;
  states_in += o.states_in;
  states_out += o.states_out;
  runs += o.runs;
  runs_freed += o.runs_freed;
  copies += o.copies;
  copies_direct += o.copies_direct;
  return *this;
}

ServerStats ServerService::stats() const {
  MutexLock lock(stats_mu_);
  return stats_;
}

// ---- Progress-thread side: connections come and go; control messages go to
// the session or to intake.cc, which pairs notifications with metadata.

void ServerService::on_accept(const ConnectionPtr& conn) {
  auto w = std::make_shared<WorkerConn>();
  w->conn = conn;
  w->accepted = transport::Clock::now();
  {
    MutexLock lock(conns_mu_);
    size_t waiting = 0;
    for (const auto& [id, c] : conns_)
      waiting += !c->hello;
    if (waiting < Door::kMaxWaiting) {
      conns_[conn->id()] = w;
      return;
    }
  }
  // Not kept: what it sends is ignored, and sweep_door() closes it.
  door_.refuse(fmt::format("server {}", rank()), conn,
               fmt::format("more than {} connections wait for their handshake", Door::kMaxWaiting));
}

void ServerService::sweep_door() {
  const auto now = transport::Clock::now();
  std::vector<std::shared_ptr<WorkerConn>> late;
  {
    MutexLock lock(conns_mu_);
    for (const auto& [id, c] : conns_) {
      if (!c->hello && !c->refused && now - c->accepted > options_.heartbeat_timeout) {
        c->refused = true;
        late.push_back(c);
      }
    }
  }
  for (const auto& c : late) {
    door_.refuse(
        fmt::format("server {}", rank()), c->conn,
        fmt::format("no handshake within {} ms of connecting", options_.heartbeat_timeout.count()));
  }
  for (const auto& conn : door_.take_to_close())
    conn->close();
}

void ServerService::on_disconnect(const ConnectionPtr& conn, const Status& why) {
  if (session_.on_disconnect(conn, why)) return;
  {
    MutexLock lock(dialing_mu_);
    if (auto it = dialing_.find(conn->id()); it != dialing_.end()) {
      PSLD_LOG_WARN("server {}: the connection to server {} closed during its handshake: {}",
                    rank(), it->second.peer, why.message());
      dialing_.erase(it);
    }
  }
  MutexLock lock(conns_mu_);
  conns_.erase(conn->id());
}

void ServerService::on_control(const ConnectionPtr& conn, protocol::Message&& message) {
  if (session_.handle(conn, message)) return;
  if (handle_dialing(conn, message)) return;
  if (replicated() && handle_replica_answer(conn, message)) return;
  handle_worker_message(conn, message);
}

// ---- Who owns what, and answers to workers: called from every thread.

uint64_t ServerService::arc_of(Key key) const {
  MutexLock lock(epoch_mu_);
  const Placement& p = epochs_->latest();
  return p.arc(p.arc_index_of_hash(hash_key(key))).lo;
}

uint64_t ServerService::shard_arc_of(Shard& shard, Key key) const {
  // Read before arc_of: an arc found under a newer placement than this
  // count is dropped at the next call, never kept past its placement.
  const uint64_t placements = latest_placements_.load(std::memory_order_acquire);
  if (shard.arcs_of != placements) {
    shard.arcs.clear();
    shard.arcs_of = placements;
  }
  auto [it, added] = shard.arcs.try_emplace(key, 0);
  if (added) it->second = arc_of(key);
  return it->second;
}

ServerId ServerService::owner_for(Key key, uint64_t round) const {
  MutexLock lock(epoch_mu_);
  return owner_for_locked(key, round);
}

ServerService::Ownership ServerService::shard_ownership(Shard& shard, Key key, uint64_t round) {
  // Read before the lock below: an answer found under a newer count than
  // this one is dropped at the next call, never kept past its epochs.
  const uint64_t gen = ownership_gen_.load(std::memory_order_acquire);
  if (shard.owners_of != gen) {
    shard.owners.clear();
    shard.owners_of = gen;
  }
  auto it = shard.owners.find(key);
  if (it != shard.owners.end() && round >= it->second.from && round < it->second.until) {
    return it->second.ownership;
  }
  CachedOwnership c;
  {
    MutexLock lock(epoch_mu_);
    c.ownership.owner = owner_for_locked(key, round);
    if (c.ownership.owner == rank()) c.ownership.gained = gained_locked(key, round);
    serving_rounds_locked(round, &c.from, &c.until);
  }
  shard.owners.insert_or_assign(key, c);
  return c.ownership;
}

void ServerService::serving_rounds_locked(uint64_t round, uint64_t* from, uint64_t* until) const {
  // The same walk as EpochLog::at, with the prepared epoch after the log.
  const size_t committed = epochs_->size();
  const size_t total = committed + (prepared_ ? 1 : 0);
  auto switch_round = [&](size_t i) REQUIRES(epoch_mu_) {
    return i < committed ? epochs_->entry(i).switch_round : prepared_->switch_round;
  };
  size_t i = total;  // one past the epoch that serves `round`
  while (i > 1 && switch_round(i - 1) > round)
    --i;
  *from = i == 1 ? 0 : switch_round(i - 1);
  *until = i < total ? switch_round(i) : UINT64_MAX;
}

ServerId ServerService::owner_for_locked(Key key, uint64_t round) const {
  if (prepared_ && round >= prepared_->switch_round) {
    return prepared_->placement->owner_of_key(key);
  }
  return epochs_->owner(key, round);
}

uint64_t ServerService::newest_epoch() const {
  MutexLock lock(epoch_mu_);
  return prepared_ ? prepared_->epoch : epochs_->latest().epoch();
}

ServerService::Gained ServerService::gained(Key key, uint64_t round) const {
  MutexLock lock(epoch_mu_);
  return gained_locked(key, round);
}

bool ServerService::failed_over(ServerId id) const {
  MutexLock lock(epoch_mu_);
  return failed_over_.count(id) != 0;
}

ServerService::Gained ServerService::gained_locked(Key key, uint64_t round) const {
  // Walk back from the epoch that serves `round` while this server owns the
  // key: where that run of epochs starts, the key arrived from the owner
  // before it. An epoch followed by one with the same switch round (an
  // aborted transfer) served no round and is skipped, so an old owner that
  // got its keys back continues its run.
  // Runs on every request: no allocation, and nothing to walk before the
  // first switch.
  const size_t committed = epochs_->size();
  const size_t total = committed + (prepared_ ? 1 : 0);
  if (total == 1) return std::nullopt;
  auto switch_round = [&](size_t i) REQUIRES(epoch_mu_) {
    return i < committed ? epochs_->entry(i).switch_round : prepared_->switch_round;
  };
  auto owner = [&](size_t i) REQUIRES(epoch_mu_) {
    const Placement& p = i < committed ? *epochs_->entry(i).placement : *prepared_->placement;
    return p.owner_of_key(key);
  };
  size_t i = total;
  while (i > 0 && switch_round(i - 1) > round)
    --i;
  if (i == 0) return std::nullopt;
  --i;  // the epoch that serves `round`
  const ServerId me = rank();
  size_t start = i;  // the earliest epoch of this server's run found so far
  for (size_t j = i; j > 0; --j) {
    const size_t prev = j - 1;
    if (switch_round(prev) == switch_round(j)) continue;  // served no round
    if (owner(prev) != me) {
      if (switch_round(start) == 0) return std::nullopt;
      return std::make_pair(switch_round(start), owner(prev));
    }
    start = prev;
  }
  return std::nullopt;  // held since the oldest epoch kept
}

ConnectionPtr ServerService::worker_connection(uint64_t conn_id) const {
  MutexLock lock(conns_mu_);
  auto it = conns_.find(conn_id);
  return it == conns_.end() ? nullptr : it->second->conn;
}

void ServerService::send_moved(uint64_t conn_id, uint32_t tag, Key key) {
  {
    MutexLock lock(stats_mu_);
    ++stats_.rejected;
  }
  if (ConnectionPtr conn = worker_connection(conn_id)) {
    (void)send(conn, protocol::Moved{tag, key, newest_epoch()});
  }
}

void ServerService::send_error(uint64_t conn_id, uint32_t tag, const Status& status) {
  ConnectionPtr conn = worker_connection(conn_id);
  if (!conn) return;
  {
    MutexLock lock(stats_mu_);
    ++stats_.rejected;
  }
  PSLD_LOG_WARN("server {}: rejected a request from {}: {}", rank(), conn->peer(),
                status.to_string());
  (void)send(conn, protocol::Error{tag, 0, static_cast<uint8_t>(status.code()), status.message()});
}

}  // namespace psld
