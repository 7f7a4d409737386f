#include "lib/server.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "transports/log.h"

namespace psld {

using protocol::DType;
using transport::ConnectionPtr;

namespace kn = psld::kernels;

namespace {
double ns_since(transport::Clock::time_point t) {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(transport::Clock::now() - t).count());
}
}  // namespace

struct ServerService::KeyState {
  Key key = 0;
  uint64_t arc = 0;  // first hash of the key's arc: the subject of its load samples
  DType dtype = DType::kF32;
  uint64_t bytes = 0;  // of the chunk in the workers' dtype
  size_t n = 0;        // elements
  // Allocated once: param (or out16) is registered with the transport as the
  // source of pull writes, so it must never move.
  std::unique_ptr<float[]> param;
  std::unique_ptr<float[]> acc;
  std::unique_ptr<float[]> m, v;  // optimizer state, allocated on first use
  std::unique_ptr<uint16_t[]> out16;
  std::shared_ptr<transport::MemoryRegion> out_region;
  uint64_t version = 0;  // rounds (BSP) or pushes (async) applied
  uint32_t pushes = 0;   // BSP: pushes reduced into acc for round version + 1
  std::vector<bool> pushed;
  std::map<uint64_t, std::vector<PushWork>> parked;  // BSP: pushes for later rounds
  std::deque<PushWork> deferred;                     // async: waiting for pull writes
  std::vector<PullWork> waiting;
  uint32_t inflight = 0;  // pull writes reading param right now
  bool apply_pending = false;
  std::vector<uint64_t> last_round;  // per worker, for bounded staleness
};

struct ServerService::Shard {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Work> queue;
  bool stop = false;
  std::unordered_map<Key, std::unique_ptr<KeyState>> keys;
  std::map<uint64_t, std::vector<uint32_t>> credits;  // connection -> freed slots
  std::thread thread;
};

struct ServerService::WorkerConn {
  ConnectionPtr conn;
  bool hello = false;
  uint32_t rank = 0;
  std::shared_ptr<transport::MemoryRegion> slots;
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  std::vector<uint8_t> slot_busy;
  std::map<uint32_t, protocol::PushMeta> metas;  // tag -> metadata waiting for its write
  std::map<uint32_t, uint64_t> early;  // tag -> length of a write waiting for its metadata
  std::map<TensorId, std::shared_ptr<transport::RemoteRegion>> tensors;
};

Result<std::unique_ptr<ServerService>> ServerService::start(const RuntimeOptions& options) {
  if (options.endpoint.options.common.listen_address.empty()) {
    return InvalidArgument("a server needs a listen address");
  }
  if (options.server_threads == 0 || options.server_threads > 256) {
    return InvalidArgument("server_threads must be in [1, 256]");
  }
  std::unique_ptr<ServerService> s(new ServerService(options));
  PSLD_ASSIGN_OR_RETURN(s->load_, LoadRecorder::make(protocol::Role::kServer));
  PSLD_RETURN_IF_ERROR(s->Endpoint::start(options.endpoint));
  for (uint32_t i = 0; i < options.server_threads; ++i) {
    s->shards_.push_back(std::make_unique<Shard>());
  }
  for (auto& shard : s->shards_) {
    Shard* raw = shard.get();
    shard->thread = std::thread([srv = s.get(), raw] { srv->shard_loop(*raw); });
  }
  PSLD_RETURN_IF_ERROR(s->session_.join(s->transport().address()));
  s->placement_ = s->session_.placement();
  s->session_.start_reports(options.stats_interval, [srv = s.get()](uint64_t window_ns) {
    std::vector<protocol::Message> out;
    for (auto& r : srv->load_->close_window(srv->rank(), srv->placement_->epoch(), window_ns))
      out.emplace_back(std::move(r));
    return out;
  });
  PSLD_LOG_INFO("server {} listening at {}", s->rank(), s->address());
  return s;
}

ServerService::ServerService(const RuntimeOptions& options)
    : options_(options), session_(*this, protocol::Role::kServer, options) {}

ServerService::~ServerService() {
  shutdown();
}

void ServerService::shutdown() {
  if (stopping_.exchange(true)) return;
  session_.stop_reports();
  stop();  // no more handler calls after this
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
  std::lock_guard<std::mutex> lock(conns_mu_);
  conns_.clear();
}

ServerStats ServerService::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

// ---- Progress-thread side: pair notifications with metadata, queue work.

void ServerService::on_accept(const ConnectionPtr& conn) {
  auto w = std::make_shared<WorkerConn>();
  w->conn = conn;
  std::lock_guard<std::mutex> lock(conns_mu_);
  conns_[conn->id()] = w;
}

void ServerService::on_disconnect(const ConnectionPtr& conn, const Status& why) {
  if (session_.on_disconnect(conn, why)) return;
  std::lock_guard<std::mutex> lock(conns_mu_);
  conns_.erase(conn->id());
}

void ServerService::on_control(const ConnectionPtr& conn, protocol::Message&& message) {
  if (session_.handle(conn, message)) return;
  handle_worker_message(conn, message);
}

uint64_t ServerService::arc_of(Key key) const {
  const Placement& p = *placement_;
  return p.arc(p.arc_index_of_hash(hash_key(key))).lo;
}

ConnectionPtr ServerService::worker_connection(uint64_t conn_id) const {
  std::lock_guard<std::mutex> lock(conns_mu_);
  auto it = conns_.find(conn_id);
  return it == conns_.end() ? nullptr : it->second->conn;
}

void ServerService::send_moved(uint64_t conn_id, uint32_t tag, Key key) {
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.rejected;
  }
  if (ConnectionPtr conn = worker_connection(conn_id)) {
    (void)send(conn, protocol::Moved{tag, key, placement_->epoch()});
  }
}

void ServerService::send_error(uint64_t conn_id, uint32_t tag, const Status& status) {
  ConnectionPtr conn = worker_connection(conn_id);
  if (!conn) return;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.rejected;
  }
  PSLD_LOG_WARN("server {}: rejected a request from {}: {}", rank(), conn->peer(),
                status.to_string());
  (void)send(conn, protocol::Error{tag, 0, static_cast<uint8_t>(status.code()), status.message()});
}

void ServerService::handle_worker_message(const ConnectionPtr& conn, protocol::Message& message) {
  std::shared_ptr<WorkerConn> w;
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = conns_.find(conn->id());
    if (it == conns_.end()) return;
    w = it->second;
  }
  if (auto* hello = std::get_if<protocol::WorkerHello>(&message)) {
    if (hello->proof != protocol::secret_proof(options_.secret, hello->worker_rank) ||
        hello->worker_rank >= session_.welcome().num_workers) {
      send_error(conn->id(), 0, FailedPrecondition("worker hello refused: bad rank or secret"));
      return;
    }
    const uint64_t slot_bytes = session_.welcome().chunk_bytes;
    auto slots = transport().allocate_memory(options_.slots_per_worker * slot_bytes,
                                             transport::MemoryKind::kHost);
    if (!slots.ok()) {
      send_error(conn->id(), 0, slots.status().with_context("allocating landing slots"));
      return;
    }
    std::lock_guard<std::mutex> lock(conns_mu_);
    w->hello = true;
    w->rank = hello->worker_rank;
    w->slots = *slots;
    w->num_slots = options_.slots_per_worker;
    w->slot_bytes = slot_bytes;
    w->slot_busy.assign(w->num_slots, 0);
    protocol::Grant grant{
        w->num_slots, slot_bytes,
        std::vector<uint8_t>(w->slots->remote_key().begin(), w->slots->remote_key().end())};
    (void)send(conn, grant);
    return;
  }
  std::unique_lock<std::mutex> lock(conns_mu_);
  if (!w->hello) {
    lock.unlock();
    send_error(conn->id(), 0, FailedPrecondition("WorkerHello must come first"));
    return;
  }
  if (auto* key = std::get_if<protocol::TensorKey>(&message)) {
    auto remote = conn->import_region(key->key);
    if (!remote.ok()) {
      lock.unlock();
      send_error(conn->id(), 0, remote.status().with_context("tensor key"));
      return;
    }
    w->tensors[key->tensor] = *remote;
    lock.unlock();
    (void)send(conn, protocol::Ack{key->request});
  } else if (auto* meta = std::get_if<protocol::PushMeta>(&message)) {
    const uint32_t db = protocol::dtype_bytes(meta->dtype);
    if (meta->slot >= w->num_slots || meta->bytes == 0 || meta->bytes > w->slot_bytes ||
        meta->bytes % db != 0 || w->slot_busy[meta->slot]) {
      lock.unlock();
      send_error(
          conn->id(), meta->tag,
          InvalidArgument(fmt::format("push of {} bytes into slot {} is not valid (slots: "
                                      "{} of {} bytes)",
                                      meta->bytes, meta->slot, w->num_slots, w->slot_bytes)));
      return;
    }
    w->slot_busy[meta->slot] = 1;
    auto early = w->early.find(meta->tag);
    if (early == w->early.end()) {
      w->metas[meta->tag] = *meta;
      load_->begin_service();  // the push is arriving; its data follows
      return;
    }
    const uint64_t length = early->second;
    w->early.erase(early);
    PushWork work{conn->id(), *meta, w->slots->data() + meta->slot * w->slot_bytes, w->rank,
                  transport::Clock::now()};
    lock.unlock();
    if (length != meta->bytes) {
      load_->end_service();
      send_error(conn->id(), meta->tag, DataLoss("push write length differs from its metadata"));
      return;
    }
    dispatch(meta->key, std::move(work));
  } else if (auto* pull = std::get_if<protocol::PullRequest>(&message)) {
    lock.unlock();
    if (pull->bytes == 0 || pull->bytes > session_.welcome().chunk_bytes ||
        pull->bytes % protocol::dtype_bytes(pull->dtype) != 0) {
      send_error(conn->id(), pull->tag, InvalidArgument("pull of an invalid size"));
      return;
    }
    dispatch(pull->key, PullWork{conn->id(), *pull, transport::Clock::now()});
  } else {
    lock.unlock();
    PSLD_LOG_WARN("server {}: unexpected {} from a worker", rank(),
                  protocol::message_name(message));
  }
}

void ServerService::on_write(const ConnectionPtr& conn, uint32_t tag, uint64_t length) {
  std::unique_lock<std::mutex> lock(conns_mu_);
  auto it = conns_.find(conn->id());
  if (it == conns_.end()) return;
  WorkerConn& w = *it->second;
  auto meta = w.metas.find(tag);
  if (meta == w.metas.end()) {
    // The write beat its metadata; it occupies a slot the worker holds
    // credit for, so there can be at most num_slots of these.
    if (w.early.size() >= w.num_slots) {
      lock.unlock();
      send_error(conn->id(), tag, ResourceExhausted("more unannounced writes than slots"));
      conn->close();
      return;
    }
    w.early[tag] = length;
    load_->begin_service();  // the push arrived; its metadata follows
    return;
  }
  PushWork work{conn->id(), meta->second, w.slots->data() + meta->second.slot * w.slot_bytes,
                w.rank, transport::Clock::now()};
  w.metas.erase(meta);
  lock.unlock();
  if (length != work.meta.bytes) {
    load_->end_service();
    send_error(conn->id(), tag, DataLoss("push write length differs from its metadata"));
    return;
  }
  {
    std::lock_guard<std::mutex> s(stats_mu_);
    stats_.bytes_in += length;
  }
  dispatch(work.meta.key, std::move(work));
}

void ServerService::dispatch(Key key, Work work) {
  Shard& shard = *shards_[mix64(key) % shards_.size()];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    shard.queue.push_back(std::move(work));
  }
  shard.cv.notify_one();
}

// ---- Shard threads: all key state lives here.

void ServerService::shard_loop(Shard& shard) {
  std::deque<Work> batch;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(shard.mu);
      shard.cv.wait(lock, [&] { return shard.stop || !shard.queue.empty(); });
      if (shard.stop) return;
      batch.swap(shard.queue);
    }
    for (auto& work : batch)
      process(shard, work);
    batch.clear();
    flush_credits(shard);
  }
}

void ServerService::process(Shard& shard, Work& work) {
  if (auto* push = std::get_if<PushWork>(&work)) {
    const uint64_t arc = arc_of(push->meta.key);
    load_->record(arc, LoadMetric::kBytesIn, static_cast<double>(push->meta.bytes));
    load_->record(arc, LoadMetric::kQueueNs, ns_since(push->arrived));
    process_push(shard, *push);
    load_->end_service();  // reduced, parked for a later round, or refused
  } else if (auto* pull = std::get_if<PullWork>(&work)) {
    load_->record(arc_of(pull->req.key), LoadMetric::kQueueNs, ns_since(pull->arrived));
    process_pull(shard, *pull);
  } else {
    const Key key = std::get<PullDone>(work).key;
    auto it = shard.keys.find(key);
    if (it == shard.keys.end()) return;
    KeyState& k = *it->second;
    if (k.inflight > 0) --k.inflight;
    if (k.inflight == 0) {
      if (k.apply_pending) {
        k.apply_pending = false;
        apply_round(shard, k);
      }
      while (k.inflight == 0 && !k.deferred.empty()) {
        PushWork next = std::move(k.deferred.front());
        k.deferred.pop_front();
        process_push(shard, next);
      }
    }
  }
}

ServerService::KeyState& ServerService::key_state(Shard& shard, Key key, DType dtype,
                                                  uint64_t bytes) {
  auto& slot = shard.keys[key];
  if (slot) return *slot;
  slot = std::make_unique<KeyState>();
  KeyState& k = *slot;
  k.key = key;
  k.arc = arc_of(key);
  k.dtype = dtype;
  k.bytes = bytes;
  k.n = bytes / protocol::dtype_bytes(dtype);
  k.param = std::make_unique<float[]>(k.n);  // zero-initialised
  k.acc = std::make_unique<float[]>(k.n);
  k.pushed.assign(session_.welcome().num_workers, false);
  k.last_round.assign(session_.welcome().num_workers, 0);
  if (dtype != DType::kF32) k.out16 = std::make_unique<uint16_t[]>(k.n);
  void* out =
      dtype == DType::kF32 ? static_cast<void*>(k.param.get()) : static_cast<void*>(k.out16.get());
  auto region = transport().register_memory(out, bytes, transport::MemoryKind::kHost);
  if (region.ok()) {
    k.out_region = *region;
  } else {
    PSLD_LOG_ERROR("server {}: cannot register key {:#x}: {}", rank(), key,
                   region.status().to_string());
  }
  return k;
}

void ServerService::free_slot(Shard& shard, uint64_t conn, uint32_t slot) {
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = conns_.find(conn);
    if (it != conns_.end() && slot < it->second->slot_busy.size()) it->second->slot_busy[slot] = 0;
  }
  shard.credits[conn].push_back(slot);
}

void ServerService::flush_credits(Shard& shard) {
  for (auto& [conn_id, slots] : shard.credits) {
    if (slots.empty()) continue;
    if (ConnectionPtr conn = worker_connection(conn_id)) {
      (void)send(conn, protocol::Credit{std::move(slots)});
    }
  }
  shard.credits.clear();
}

// Copies (first push of a round) or adds a pushed chunk into the accumulator.
void ServerService::reduce_push(KeyState& k, const PushWork& w) {
  const bool first = k.pushes == 0;
  switch (k.dtype) {
    case DType::kF32:
      if (first) {
        std::memcpy(k.acc.get(), w.data, k.bytes);
      } else {
        kn::reduce_f32(k.acc.get(), reinterpret_cast<const float*>(w.data), k.n);
      }
      break;
    case DType::kF16:
      if (first) {
        kn::f16_to_f32(k.acc.get(), reinterpret_cast<const uint16_t*>(w.data), k.n);
      } else {
        kn::reduce_f16(k.acc.get(), reinterpret_cast<const uint16_t*>(w.data), k.n);
      }
      break;
    case DType::kBF16:
      if (first) {
        kn::bf16_to_f32(k.acc.get(), reinterpret_cast<const uint16_t*>(w.data), k.n);
      } else {
        kn::reduce_bf16(k.acc.get(), reinterpret_cast<const uint16_t*>(w.data), k.n);
      }
      break;
  }
  ++k.pushes;
}

void ServerService::process_push(Shard& shard, PushWork& w) {
  const protocol::PushMeta& meta = w.meta;
  if (placement_->owner_of_key(meta.key) != rank()) {
    free_slot(shard, w.conn, meta.slot);
    send_moved(w.conn, meta.tag, meta.key);
    return;
  }
  KeyState& k = key_state(shard, meta.key, meta.dtype, meta.bytes);
  if (k.dtype != meta.dtype || k.bytes != meta.bytes) {
    free_slot(shard, w.conn, meta.slot);
    send_error(w.conn, meta.tag,
               InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the push has {} of {}",
                                           meta.key, k.bytes, protocol::dtype_name(k.dtype),
                                           meta.bytes, protocol::dtype_name(meta.dtype))));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.pushes;
  }
  const bool then_pull = (meta.flags & protocol::kPushThenPull) != 0;
  PullWork follow{w.conn, protocol::PullRequest{meta.pull_tag, meta.dtype, meta.bytes, meta.key,
                                                meta.round, meta.epoch}};

  if (meta.flags & protocol::kPushInit) {
    // The initial value, round 0: written into the parameter as is.
    k.pushes = 0;
    reduce_push(k, w);
    std::memcpy(k.param.get(), k.acc.get(), k.n * sizeof(float));
    k.pushes = 0;
    if (k.out16) {
      if (k.dtype == DType::kF16) kn::f32_to_f16(k.out16.get(), k.param.get(), k.n);
      if (k.dtype == DType::kBF16) kn::f32_to_bf16(k.out16.get(), k.param.get(), k.n);
    }
    free_slot(shard, w.conn, meta.slot);
    if (then_pull) {
      follow.req.round = 0;
      serve_pull(shard, k, follow);
    }
    return;
  }

  if (options_.sync == SyncMode::kBsp) {
    if (meta.round <= k.version) {
      free_slot(shard, w.conn, meta.slot);
      send_error(w.conn, meta.tag,
                 FailedPrecondition(fmt::format("round {} of key {:#x} was already applied",
                                                meta.round, meta.key)));
      return;
    }
    if (meta.round > k.version + 1 || k.apply_pending) {
      // A later round (or this one while its predecessor waits to apply):
      // keep the slot until the key gets there.
      k.parked[meta.round].push_back(w);
      return;
    }
    if (k.pushed[w.worker]) {
      free_slot(shard, w.conn, meta.slot);
      send_error(w.conn, meta.tag,
                 FailedPrecondition(fmt::format("worker {} pushed round {} of key {:#x} twice",
                                                w.worker, meta.round, meta.key)));
      return;
    }
    const auto start = transport::Clock::now();
    reduce_push(k, w);
    load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
    k.pushed[w.worker] = true;
    free_slot(shard, w.conn, meta.slot);
    if (then_pull) k.waiting.push_back(follow);
    if (k.pushes == k.pushed.size()) try_apply(shard, k);
    return;
  }

  // Async and bounded staleness: every push is applied on arrival, once no
  // pull write is reading the parameter.
  if (k.inflight > 0) {
    k.deferred.push_back(w);
    return;
  }
  k.pushes = 0;
  const auto start = transport::Clock::now();
  reduce_push(k, w);
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  free_slot(shard, w.conn, meta.slot);
  k.last_round[w.worker] = std::max(k.last_round[w.worker], meta.round);
  if (then_pull) k.waiting.push_back(follow);
  apply_round(shard, k);
}

void ServerService::try_apply(Shard& shard, KeyState& k) {
  if (k.inflight > 0) {
    k.apply_pending = true;  // pull writes of the last round still read param
    return;
  }
  apply_round(shard, k);
}

// Turns the accumulator into the new parameter value, then serves what waited.
void ServerService::apply_round(Shard& shard, KeyState& k) {
  const auto start = transport::Clock::now();
  const bool sum_mode = options_.mode == ServerMode::kSum;
  const bool bsp = options_.sync == SyncMode::kBsp;
  if (sum_mode) {
    if (bsp) {
      std::memcpy(k.param.get(), k.acc.get(), k.n * sizeof(float));  // the round's sum
    } else {
      kn::reduce_f32(k.param.get(), k.acc.get(), k.n);  // the running total
    }
  } else {
    const OptimizerOptions& o = options_.optimizer;
    switch (o.kind) {
      case OptimizerKind::kSgd:
        kn::sgd_f32(k.param.get(), k.acc.get(), k.n, {o.lr, o.weight_decay});
        break;
      case OptimizerKind::kMomentum: {
        if (!k.m) k.m = std::make_unique<float[]>(k.n);
        kn::MomentumParams p{o.lr,           o.momentum, o.dampening,
                             o.weight_decay, o.nesterov, k.version == 0};
        kn::momentum_f32(k.param.get(), k.m.get(), k.acc.get(), k.n, p);
        break;
      }
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        if (!k.m) k.m = std::make_unique<float[]>(k.n);
        if (!k.v) k.v = std::make_unique<float[]>(k.n);
        kn::AdamParams p{o.lr,         o.beta1,        o.beta2,
                         o.eps,        o.weight_decay, o.kind == OptimizerKind::kAdamW,
                         k.version + 1};
        kn::adam_f32(k.param.get(), k.m.get(), k.v.get(), k.acc.get(), k.n, p);
        break;
      }
    }
  }
  if (k.dtype == DType::kF16) kn::f32_to_f16(k.out16.get(), k.param.get(), k.n);
  if (k.dtype == DType::kBF16) kn::f32_to_bf16(k.out16.get(), k.param.get(), k.n);
  ++k.version;
  k.pushes = 0;
  std::fill(k.pushed.begin(), k.pushed.end(), false);
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  load_->record(k.arc, LoadMetric::kRound, 1);
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.rounds_applied;
  }
  // Serve the pulls this round satisfies.
  std::vector<PullWork> still;
  for (auto& p : k.waiting) {
    if (pull_ready(k, p.req)) {
      serve_pull(shard, k, p);
    } else {
      still.push_back(p);
    }
  }
  k.waiting.swap(still);
  // BSP: pushes parked for the next round can be reduced now.
  if (bsp) {
    auto next = k.parked.find(k.version + 1);
    if (next != k.parked.end()) {
      std::vector<PushWork> ready = std::move(next->second);
      k.parked.erase(next);
      for (auto& p : ready)
        process_push(shard, p);
    }
  }
}

bool ServerService::pull_ready(const KeyState& k, const protocol::PullRequest& req) const {
  switch (options_.sync) {
    case SyncMode::kBsp:
      return k.version >= req.round;
    case SyncMode::kAsync:
      return true;
    case SyncMode::kStaleness: {
      // Every worker's pushes up to round - staleness must be in.
      const uint64_t slowest = *std::min_element(k.last_round.begin(), k.last_round.end());
      return slowest + options_.staleness >= req.round;
    }
  }
  return true;
}

void ServerService::process_pull(Shard& shard, PullWork& w) {
  if (placement_->owner_of_key(w.req.key) != rank()) {
    send_moved(w.conn, w.req.tag, w.req.key);
    return;
  }
  KeyState& k = key_state(shard, w.req.key, w.req.dtype, w.req.bytes);
  if (k.dtype != w.req.dtype || k.bytes != w.req.bytes) {
    send_error(w.conn, w.req.tag,
               InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the pull asks {} of {}",
                                           w.req.key, k.bytes, protocol::dtype_name(k.dtype),
                                           w.req.bytes, protocol::dtype_name(w.req.dtype))));
    return;
  }
  if (pull_ready(k, w.req)) {
    serve_pull(shard, k, w);
  } else {
    k.waiting.push_back(w);
  }
}

void ServerService::serve_pull(Shard& shard, KeyState& k, const PullWork& w) {
  (void)shard;
  std::shared_ptr<transport::RemoteRegion> remote;
  ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = conns_.find(w.conn);
    if (it == conns_.end()) return;  // the worker is gone
    conn = it->second->conn;
    auto t = it->second->tensors.find(key_tensor(w.req.key));
    if (t != it->second->tensors.end()) remote = t->second;
  }
  if (!remote) {
    send_error(w.conn, w.req.tag,
               FailedPrecondition(fmt::format("no TensorKey for tensor {} from this worker",
                                              key_tensor(w.req.key))));
    return;
  }
  if (!k.out_region) {
    send_error(w.conn, w.req.tag, Internal("the key's memory could not be registered"));
    return;
  }
  const uint64_t offset =
      static_cast<uint64_t>(key_chunk(w.req.key)) * session_.welcome().chunk_bytes;
  ++k.inflight;
  const Key key = w.req.key;
  load_->begin_service();  // until the write completed
  Status s = conn->write({k.out_region.get(), 0, remote.get(), offset, k.bytes, w.req.tag},
                         [this, key](Status) {
                           load_->end_service();
                           dispatch(key, PullDone{key});
                         });
  if (!s.ok()) {
    --k.inflight;
    load_->end_service();
    send_error(w.conn, w.req.tag, s.with_context("pull write"));
    return;
  }
  load_->record(k.arc, LoadMetric::kBytesOut, static_cast<double>(k.bytes));
  std::lock_guard<std::mutex> lock(stats_mu_);
  ++stats_.pulls;
  stats_.bytes_out += k.bytes;
}

}  // namespace psld
