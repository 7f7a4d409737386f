#include "lib/server/service.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"

namespace psld {

using protocol::DType;
using transport::ConnectionPtr;

namespace kn = psld::kernels;

namespace {
// A shipped key's state: {u64 version, u64 reserved}, then parameter, first
// and second moment, fp32.
constexpr uint64_t kStateHeader = 16;

double ns_since(transport::Clock::time_point t) {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(transport::Clock::now() - t).count());
}

// A key's array: host memory (new[]), or the server's device memory when it
// has a device (server.device = cuda).
template <typename T>
struct ArrayFree {
  ServerDevice* device = nullptr;
  void operator()(T* p) const {
    if (device != nullptr) {
      device->free(p);
    } else {
      delete[] p;
    }
  }
};
template <typename T>
using Array = std::unique_ptr<T[], ArrayFree<T>>;

// n zeroed elements.
template <typename T>
Result<Array<T>> make_array(ServerDevice* device, size_t n) {
  if (device == nullptr) return Array<T>(new T[n](), ArrayFree<T>{});
  PSLD_ASSIGN_OR_RETURN(void* p, device->allocate(std::max<size_t>(n, 1) * sizeof(T)));
  return Array<T>(static_cast<T*>(p), ArrayFree<T>{device});
}

Status ensure_array(ServerDevice* device, Array<float>& a, size_t n) {
  if (a) return Status::Ok();
  PSLD_ASSIGN_OR_RETURN(a, make_array<float>(device, n));
  return Status::Ok();
}

// Pinned host memory of the device (a key's output, which pulls are written from).
struct HostFree {
  ServerDevice* device = nullptr;
  void operator()(uint8_t* p) const { device->free_host(p); }
};
using HostBuffer = std::unique_ptr<uint8_t, HostFree>;

// Host memory the device page-locked (ServerDevice::pin).
struct Unpin {
  ServerDevice* device = nullptr;
  void operator()(uint8_t* p) const { device->unpin(p); }
};
using PinnedRange = std::unique_ptr<uint8_t, Unpin>;

// The key-state operations, on the host (at once) or queued on the device's
// lane; finish_on() waits for the lane.
Status copy_on(ServerDevice* device, size_t lane, void* dst, const void* src, size_t bytes) {
  if (device != nullptr) return device->copy(dst, src, bytes, lane);
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

// fn(where, stream) calls one kernel of kernels/dispatch.h; on the host it
// runs at once, with no std::function in between.
template <typename Fn>
Status run_on(ServerDevice* device, size_t lane, const Fn& fn) {
  if (device != nullptr) return device->launch(lane, ServerDevice::Launch(fn));
  return status_from_kernel(fn(kn::MemoryKind::kHost, nullptr));
}

Status finish_on(ServerDevice* device, size_t lane) {
  return device != nullptr ? device->synchronize(lane) : Status::Ok();
}
}  // namespace

struct ServerService::KeyState {
  Key key = 0;
  uint64_t arc = 0;  // first hash of the key's arc: the subject of its load samples
  DType dtype = DType::kF32;
  uint64_t bytes = 0;  // of the chunk in the workers' dtype
  size_t n = 0;        // elements
  // Allocated once, in host memory or on the server's device: the source of
  // pull writes (param or out16 on the host; out_host with a device) is
  // registered with the transport, so it must never move.
  Array<float> param;
  Array<float> acc;
  Array<float> m, v;      // optimizer state, allocated on first use
  Array<uint16_t> out16;  // fp16/bf16 keys: param converted
  HostBuffer out_host;    // with a device: the output, copied from the device
  std::shared_ptr<transport::MemoryRegion> out_region;
  // BSP sum mode, fp32: acc is registered too, and a round is applied by
  // swapping param and acc (and their regions) instead of copying.
  std::shared_ptr<transport::MemoryRegion> acc_region;
  uint64_t version = 0;  // rounds (BSP) or pushes (async) applied
  uint32_t pushes = 0;   // BSP: pushes reduced into acc for round version + 1
  std::vector<bool> pushed;
  std::map<uint64_t, std::vector<PushWork>> parked;  // BSP: pushes for later rounds
  std::deque<PushWork> deferred;                     // async: waiting for pull writes
  std::vector<PullWork> waiting;
  uint32_t inflight = 0;  // pull writes reading param right now
  bool apply_pending = false;
  std::vector<uint64_t> last_round;  // per worker, for bounded staleness
  std::vector<uint64_t> applied;     // per worker: async pushes applied in this run
  // Migration. A key this server gained waits for its state: pushes park,
  // pulls wait, until the previous owner's write lands in `incoming`.
  bool awaiting_state = false;
  uint64_t state_round = 0;  // the switch round it was gained at
  // The switch round this server's run of ownership began (0: from the first
  // epoch). A key that leaves and comes back gets a new KeyState for the new
  // run; the old one still finishes its rounds and ships them.
  uint64_t owned_from = 0;
  std::shared_ptr<transport::MemoryRegion> incoming;
  std::vector<StateWork> successors;  // state requests waiting for their round
  // Gained at a switch while this server owned nothing before: rounds >= the
  // switch are held (not applied, no pull answered, no plain push accepted)
  // until the transfer is final, so an abort can still give the key back.
  bool awaiting_final = false;
  // As an old owner, the switch round this run last offered its state at,
  // started shipping it at, and shipped it at (the write completed): the
  // run ended there. An abort that gives the key back clears shipped_round
  // (the run goes on), so that the run is not freed.
  uint64_t offered_round = 0;
  uint64_t shipping_round = 0;
  uint64_t shipped_round = 0;
  // A device operation on the key failed (a CUDA error): every request for
  // it is answered with this.
  Status failed;
};

struct ServerService::Shard {
  size_t index = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Work> queue;
  bool stop = false;
  // Per key, its runs of ownership here, oldest first.
  std::unordered_map<Key, std::vector<std::unique_ptr<KeyState>>> keys;
  std::map<uint64_t, std::vector<uint32_t>> credits;   // connection -> freed slots
  std::map<uint64_t, std::vector<uint32_t>> accepted;  // connection -> plain push tags taken
  // With a device: where pushes are copied to before they are reduced.
  Array<uint8_t> stage;
  uint64_t stage_bytes = 0;
  // The keys (runs) this shard still has to ship for the transfer at
  // out_round (0: none scanned yet).
  uint64_t out_round = 0;
  std::set<std::pair<Key, uint64_t>> outgoing;
  // The last LowWatermark: no request of a tensor's rounds below the
  // round it gives that tensor will come.
  protocol::LowWatermark low;
  std::thread thread;
};

struct ServerService::WorkerConn {
  ConnectionPtr conn;
  bool hello = false;
  uint32_t rank = 0;
  std::shared_ptr<transport::MemoryRegion> slots;
  // With a device: the slots page-locked for its copies; unpinned before
  // the slots go (declared after them).
  PinnedRange pinned;
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;
  std::vector<uint8_t> slot_busy;
  std::map<uint32_t, protocol::PushMeta> metas;  // tag -> metadata waiting for its write
  std::map<uint32_t, uint64_t> early;  // tag -> length of a write waiting for its metadata
  // Where each tensor's pulls land (the worker's memory and the tensor's
  // offset in it), and where this process maps that memory, if it does
  // (then push_pulls are read in place: protocol::kPushMapped).
  struct TensorTarget {
    std::shared_ptr<transport::RemoteRegion> remote;
    uint64_t offset = 0;
    const uint8_t* view = nullptr;
  };
  std::map<TensorId, TensorTarget> tensors;
};

Result<std::unique_ptr<ServerService>> ServerService::start(const RuntimeOptions& options) {
  if (options.endpoint.options.common.listen_address.empty()) {
    return InvalidArgument("a server needs a listen address");
  }
  if (options.server_threads == 0 || options.server_threads > 256) {
    return InvalidArgument("server_threads must be in [1, 256]");
  }
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
  PSLD_ASSIGN_OR_RETURN(s->load_, LoadRecorder::make(protocol::Role::kServer));
  PSLD_RETURN_IF_ERROR(s->Endpoint::start(options.endpoint));
  for (uint32_t i = 0; i < options.server_threads; ++i) {
    s->shards_.push_back(std::make_unique<Shard>());
    s->shards_.back()->index = i;
  }
  for (auto& shard : s->shards_) {
    Shard* raw = shard.get();
    shard->thread = std::thread([srv = s.get(), raw] { srv->shard_loop(*raw); });
  }
  s->session_.on_epoch(
      [srv = s.get()](const protocol::EpochChange& e) { srv->on_epoch_change(e); });
  s->session_.on_final([srv = s.get()](const protocol::EpochFinal& f) { srv->on_final(f); });
  s->session_.on_watermark(
      [srv = s.get()](const protocol::LowWatermark& w) { srv->dispatch_all(Trim{w}); });
  s->session_.on_tick([srv = s.get()] { srv->on_tick(); });
  PSLD_RETURN_IF_ERROR(s->session_.join(s->transport().address()));
  {
    std::lock_guard<std::mutex> lock(s->epoch_mu_);
    s->epochs_.emplace(s->session_.placement());
    s->owned_ever_ = !s->epochs_->latest().arcs_of(s->rank()).empty();
  }
  s->session_.start_reports(options.stats_interval, [srv = s.get()](uint64_t window_ns) {
    std::vector<protocol::Message> out;
    for (auto& r : srv->load_->close_window(srv->rank(), srv->newest_epoch(), window_ns))
      out.emplace_back(std::move(r));
    return out;
  });
  PSLD_LOG_INFO("server {} listening at {}; keys {}", s->rank(), s->address(),
                s->device_ ? "on " + s->device_->describe() : std::string("in host memory"));
  return s;
}

ServerService::ServerService(const RuntimeOptions& options)
    : options_(options),
      session_(*this, protocol::Role::kServer, options),
      compute_rate_(options.compute_bytes_per_second) {}

void ServerService::set_compute_rate(double bytes_per_second) {
  compute_rate_.store(bytes_per_second);
}

void ServerService::pace_compute(uint64_t bytes) {
  transport::Clock::time_point until;
  {
    const double rate = compute_rate_.load(std::memory_order_relaxed);
    if (rate <= 0) return;
    std::lock_guard<std::mutex> lock(compute_mu_);
    const auto now = transport::Clock::now();
    const auto cost = std::chrono::duration_cast<transport::Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / rate));
    compute_free_ = std::max(compute_free_, now) + cost;
    until = compute_free_;
  }
  std::this_thread::sleep_until(until);
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
  std::lock_guard<std::mutex> lock(epoch_mu_);
  const Placement& p = epochs_->latest();
  return p.arc(p.arc_index_of_hash(hash_key(key))).lo;
}

ServerId ServerService::owner_for(Key key, uint64_t round) const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  if (prepared_ && round >= prepared_->switch_round) {
    return prepared_->placement->owner_of_key(key);
  }
  return epochs_->owner(key, round);
}

uint64_t ServerService::newest_epoch() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return prepared_ ? prepared_->epoch : epochs_->latest().epoch();
}

std::optional<std::pair<uint64_t, ServerId>> ServerService::gained(Key key, uint64_t round) const {
  // Walk back from the epoch that serves `round` while this server owns the
  // key: where that run of epochs starts, the key arrived from the owner
  // before it. An epoch followed by one with the same switch round (an
  // aborted transfer) served no round and is skipped, so an old owner that
  // got its keys back continues its run.
  // Runs on every request: no allocation, and nothing to walk before the
  // first switch.
  std::lock_guard<std::mutex> lock(epoch_mu_);
  const size_t committed = epochs_->size();
  const size_t total = committed + (prepared_ ? 1 : 0);
  if (total == 1) return std::nullopt;
  auto switch_round = [&](size_t i) {
    return i < committed ? epochs_->entry(i).switch_round : prepared_->switch_round;
  };
  auto owner = [&](size_t i) {
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
    (void)send(conn, protocol::Moved{tag, key, newest_epoch()});
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
    PinnedRange pinned;
    if (device_) {
      uint8_t* base = (*slots)->data();
      Status st = device_->pin(base, options_.slots_per_worker * slot_bytes);
      if (st.ok()) {
        pinned = PinnedRange(base, Unpin{device_.get()});
      } else if (!pin_warned_.exchange(true)) {
        PSLD_LOG_WARN(
            "server {}: landing slots stay pageable, so pushes reach the GPU through the CUDA "
            "runtime's bounce buffer: {}",
            rank(), st.to_string());
      }
    }
    std::lock_guard<std::mutex> lock(conns_mu_);
    w->hello = true;
    w->rank = hello->worker_rank;
    w->pinned = std::move(pinned);  // first: a second hello unpins the old slots before they go
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
  if (auto* req = std::get_if<protocol::StateRequest>(&message)) {
    // Another server took over this key and wants its state (migration).
    auto region = conn->import_region(req->region);
    if (!region.ok()) {
      PSLD_LOG_ERROR("server {}: a state request for key {:#x} with a bad region: {}", rank(),
                     req->key, region.status().to_string());
      return;
    }
    dispatch(req->key, StateWork{conn->id(), *req, *region});
    return;
  }
  if (auto* offer = std::get_if<protocol::StateOffer>(&message)) {
    // An old owner says a key it loses to this server reached the switch.
    if (offer->bytes == 0 || offer->bytes > session_.welcome().chunk_bytes ||
        offer->bytes % protocol::dtype_bytes(offer->dtype) != 0) {
      PSLD_LOG_WARN("server {}: a state offer for key {:#x} of an invalid size ignored", rank(),
                    offer->key);
      return;
    }
    dispatch(offer->key, Offered{*offer});
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
    const uint8_t* view = transport().local_view(**remote);
    if (view != nullptr && key->offset > (*remote)->length()) view = nullptr;
    w->tensors[key->tensor] = {*remote, key->offset, view};
    lock.unlock();
    (void)send(conn,
               protocol::Ack{key->request, view != nullptr ? protocol::kAckMapped : uint8_t{0}});
  } else if (auto* mapped = std::get_if<protocol::PushMeta>(&message);
             mapped != nullptr && (mapped->flags & protocol::kPushMapped)) {
    // Read in place from the worker's tensor: no slot, no write to wait for.
    uint64_t seen = max_round_seen_.load();
    while (mapped->round > seen && !max_round_seen_.compare_exchange_weak(seen, mapped->round)) {
    }
    auto t = w->tensors.find(key_tensor(mapped->key));
    const uint64_t at = t == w->tensors.end()
                            ? 0
                            : t->second.offset + static_cast<uint64_t>(key_chunk(mapped->key)) *
                                                     session_.welcome().chunk_bytes;
    if (t == w->tensors.end() || t->second.view == nullptr || mapped->bytes == 0 ||
        mapped->bytes > session_.welcome().chunk_bytes ||
        mapped->bytes % protocol::dtype_bytes(mapped->dtype) != 0 ||
        at > t->second.remote->length() || mapped->bytes > t->second.remote->length() - at) {
      lock.unlock();
      send_error(conn->id(), mapped->tag,
                 InvalidArgument(fmt::format(
                     "an in-place push of {} bytes of key {:#x}: this server does not map that "
                     "much of the tensor's memory",
                     mapped->bytes, mapped->key)));
      return;
    }
    PushWork work{conn->id(),       *mapped, t->second.view + at,
                  t->second.remote, w->rank, transport::Clock::now()};
    lock.unlock();
    {
      std::lock_guard<std::mutex> stats(stats_mu_);
      ++stats_.pushes_in_place;
      stats_.bytes_in += work.meta.bytes;
    }
    load_->begin_service();
    dispatch(mapped->key, std::move(work));
  } else if (auto* meta = std::get_if<protocol::PushMeta>(&message)) {
    // Before the push is looked at: an epoch prepared after this line sees it.
    uint64_t seen = max_round_seen_.load();
    while (meta->round > seen && !max_round_seen_.compare_exchange_weak(seen, meta->round)) {
    }
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
    PushWork work{conn->id(), *meta,   w->slots->data() + meta->slot * w->slot_bytes,
                  nullptr,    w->rank, transport::Clock::now()};
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
  {
    std::unique_lock<std::mutex> lock(peers_mu_);
    auto it = incoming_.find({conn->id(), tag});
    if (it != incoming_.end()) {
      const auto [key, run] = it->second;
      incoming_.erase(it);
      lock.unlock();
      dispatch(key, StateArrived{key, run});
      return;
    }
  }
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
                nullptr,    w.rank,       transport::Clock::now()};
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

void ServerService::dispatch_all(const Work& work) {
  for (auto& shard : shards_) {
    {
      std::lock_guard<std::mutex> lock(shard->mu);
      shard->queue.push_back(work);
    }
    shard->cv.notify_one();
  }
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
    if (push->requeued) {
      process_push(shard, *push);  // its arrival was counted the first time
      return;
    }
    const uint64_t arc = arc_of(push->meta.key);
    load_->record(arc, LoadMetric::kBytesIn, static_cast<double>(push->meta.bytes));
    load_->record(arc, LoadMetric::kQueueNs, ns_since(push->arrived));
    process_push(shard, *push);
    load_->end_service();  // reduced, parked for a later round, or refused
  } else if (auto* pull = std::get_if<PullWork>(&work)) {
    if (!pull->requeued) {
      load_->record(arc_of(pull->req.key), LoadMetric::kQueueNs, ns_since(pull->arrived));
    }
    process_pull(shard, *pull);
  } else if (auto* sw = std::get_if<StateWork>(&work)) {
    const protocol::StateRequest& req = sw->req;
    if (owner_for(req.key, req.switch_round - 1) != rank()) {
      PSLD_LOG_ERROR(
          "server {}: asked for the state of key {:#x} as of round {}, which it does "
          "not own",
          rank(), req.key, req.switch_round - 1);
      return;
    }
    if (owner_for(req.key, req.switch_round) == rank()) {
      // The key stays here after all: an abort gave it back before the
      // request of the (lost) successor arrived.
      PSLD_LOG_DEBUG("server {}: a state request for key {:#x} at round {} is void", rank(),
                     req.key, req.switch_round);
      return;
    }
    KeyState& k = key_state(shard, req.key, req.dtype, req.bytes, req.switch_round - 1);
    k.successors.push_back(*sw);
    maybe_ship(shard, k);
  } else if (auto* arrived = std::get_if<StateArrived>(&work)) {
    KeyState* k = find_run(shard, arrived->key, arrived->run);
    if (k != nullptr && k->awaiting_state) install_state(shard, *k);
  } else if (auto* scan = std::get_if<TransferScan>(&work)) {
    scan_outgoing(shard, scan->switch_round);
  } else if (auto* done = std::get_if<ShipDone>(&work)) {
    if (!done->ok) return;  // logged where it failed; the key stays to ship
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.states_out;
    }
    KeyState* k = find_run(shard, done->key, done->run);
    // The run ended at that switch, unless an abort gave the key back
    // while the write was on its way (scan_outgoing already looked then).
    if (k != nullptr && owner_for(done->key, done->switch_round) != rank()) {
      k->shipped_round = done->switch_round;
    }
    if (shard.out_round == done->switch_round && shard.outgoing.erase({done->key, done->run})) {
      note_outgoing(shard);
    }
    free_runs(shard, done->key);
  } else if (auto* offered = std::get_if<Offered>(&work)) {
    const protocol::StateOffer& o = offered->offer;
    // Only a key this server gains at that very switch: anything else is a
    // stale offer (the transfer was aborted, or the key moved on since).
    if (owner_for(o.key, o.switch_round) != rank()) return;
    const auto g = gained(o.key, o.switch_round);
    if (!g || g->first != o.switch_round) return;
    // Every worker has pushed every round below the watermark, so a run
    // that began below it was created here: missing, it was freed, and the
    // offer is stale (created again, it would ask for a state nobody ships).
    if (o.switch_round < protocol::round_of(shard.low.low, shard.low.tensors, key_tensor(o.key)) &&
        find_run(shard, o.key, o.switch_round) == nullptr) {
      return;
    }
    (void)key_state(shard, o.key, o.dtype, o.bytes, o.switch_round);  // asks for the state
  } else if (auto* release = std::get_if<Release>(&work)) {
    release_final(shard, release->switch_round);
  } else if (auto* dial = std::get_if<Dial>(&work)) {
    for (ServerId id : dial->servers)
      (void)peer(id);
  } else if (auto* mark = std::get_if<Trim>(&work)) {
    trim(shard, mark->mark);
  } else {
    const PullDone& pd = std::get<PullDone>(work);
    KeyState* found = find_run(shard, pd.key, pd.run);
    if (found == nullptr) return;
    KeyState& k = *found;
    if (k.inflight > 0) --k.inflight;
    if (k.inflight == 0) {
      if (k.apply_pending) {
        k.apply_pending = false;
        apply_round(shard, k);
      }
      while (k.inflight == 0 && !k.deferred.empty() && !k.awaiting_state && !k.awaiting_final) {
        PushWork next = std::move(k.deferred.front());
        k.deferred.pop_front();
        process_push(shard, next);
      }
      maybe_ship(shard, k);
      free_runs(shard, pd.key);  // k may be gone from here on
    }
  }
}

ServerService::KeyState& ServerService::key_state(Shard& shard, Key key, DType dtype,
                                                  uint64_t bytes, uint64_t round) {
  const auto g = gained(key, round);
  const uint64_t run = g ? g->first : 0;
  auto& runs = shard.keys[key];
  for (auto& r : runs) {
    if (r->owned_from == run) return *r;
  }
  auto it = std::upper_bound(runs.begin(), runs.end(), run,
                             [](uint64_t v, const auto& r) { return v < r->owned_from; });
  it = runs.insert(it, std::make_unique<KeyState>());
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.runs;
  }
  KeyState& k = **it;
  k.owned_from = run;
  k.key = key;
  k.arc = arc_of(key);
  k.dtype = dtype;
  k.bytes = bytes;
  k.n = bytes / protocol::dtype_bytes(dtype);
  k.pushed.assign(session_.welcome().num_workers, false);
  k.last_round.assign(session_.welcome().num_workers, 0);
  k.applied.assign(session_.welcome().num_workers, 0);
  // Zeroed: a key pulled before any push reads zeros.
  Status made = [&]() -> Status {
    ServerDevice* dev = device_.get();
    PSLD_ASSIGN_OR_RETURN(k.param, make_array<float>(dev, k.n));
    PSLD_ASSIGN_OR_RETURN(k.acc, make_array<float>(dev, k.n));
    if (dtype != DType::kF32) {
      PSLD_ASSIGN_OR_RETURN(k.out16, make_array<uint16_t>(dev, k.n));
    }
    if (dev != nullptr) {
      PSLD_ASSIGN_OR_RETURN(void* out, dev->allocate_host(bytes));
      std::memset(out, 0, bytes);
      k.out_host = HostBuffer(static_cast<uint8_t*>(out), HostFree{dev});
    }
    return Status::Ok();
  }();
  if (!made.ok()) {
    fail_key(shard, k, made.with_context(fmt::format("allocating {} bytes", bytes)));
  } else {
    void* out = k.out_host             ? static_cast<void*>(k.out_host.get())
                : dtype == DType::kF32 ? static_cast<void*>(k.param.get())
                                       : static_cast<void*>(k.out16.get());
    auto region = transport().register_memory(out, bytes, transport::MemoryKind::kHost);
    if (region.ok()) {
      k.out_region = *region;
    } else {
      PSLD_LOG_ERROR("server {}: cannot register key {:#x}: {}", rank(), key,
                     region.status().to_string());
    }
  }
  if (dtype == DType::kF32 && options_.mode == ServerMode::kSum &&
      options_.sync == SyncMode::kBsp && k.out_region && !device_) {
    auto acc = transport().register_memory(k.acc.get(), bytes, transport::MemoryKind::kHost);
    if (acc.ok()) k.acc_region = *acc;  // else: apply copies, as for other keys
  }
  if (g) {
    k.awaiting_final = hold_until_final(k.owned_from);
    request_state(k, g->first, g->second);
  }
  // A run that holds round out_round - 1 of a key leaving at out_round,
  // created after this shard looked for such keys: it ships too.
  const uint64_t leaving_at = shard.out_round;
  if (leaving_at > 0 && round < leaving_at && owner_for(key, leaving_at - 1) == rank() &&
      owner_for(key, leaving_at) != rank()) {
    const auto held = gained(key, leaving_at - 1);
    if ((held ? held->first : 0) == k.owned_from) {
      shard.outgoing.insert({key, k.owned_from});
      note_outgoing(shard);
    }
  }
  return k;
}

ServerService::KeyState* ServerService::find_run(Shard& shard, Key key, uint64_t run) {
  auto it = shard.keys.find(key);
  if (it == shard.keys.end()) return nullptr;
  for (auto& r : it->second) {
    if (r->owned_from == run) return r.get();
  }
  return nullptr;
}

void ServerService::free_slot(Shard& shard, uint64_t conn, uint32_t slot) {
  if (slot == protocol::kNoSlot) return;  // read in place: it took no slot
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = conns_.find(conn);
    if (it != conns_.end() && slot < it->second->slot_busy.size()) it->second->slot_busy[slot] = 0;
  }
  shard.credits[conn].push_back(slot);
}

ConnectionPtr ServerService::peer(ServerId id) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peers_.find(id);
  if (it != peers_.end() && it->second->is_open()) return it->second;
  for (const auto& entry : session_.servers()) {
    if (entry.rank != id) continue;
    auto conn = connect_text(transport(), std::string(entry.address.begin(), entry.address.end()));
    if (!conn.ok()) {
      PSLD_LOG_ERROR("server {}: cannot reach server {}: {}", rank(), id,
                     conn.status().to_string());
      return nullptr;
    }
    peers_[id] = *conn;
    return *conn;
  }
  return nullptr;
}

void ServerService::request_state(KeyState& k, uint64_t switch_round, ServerId from) {
  k.awaiting_state = true;
  k.state_round = switch_round;
  auto region = transport().allocate_memory(kStateHeader + 3 * k.n * sizeof(float),
                                            transport::MemoryKind::kHost);
  ConnectionPtr conn = peer(from);
  if (!region.ok() || !conn) {
    PSLD_LOG_ERROR("server {}: cannot ask server {} for key {:#x}: {}", rank(), from, k.key,
                   region.ok() ? "no connection" : region.status().to_string());
    return;
  }
  k.incoming = *region;
  protocol::StateRequest req{
      0,
      k.key,
      switch_round,
      k.dtype,
      k.bytes,
      std::vector<uint8_t>(k.incoming->remote_key().begin(), k.incoming->remote_key().end())};
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    req.tag = next_state_tag_++;
    if (req.tag == 0) req.tag = next_state_tag_++;
    incoming_[{conn->id(), req.tag}] = {k.key, k.owned_from};
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.states_requested;
  }
  PSLD_LOG_DEBUG("server {}: key {:#x} moves here at round {}; asking server {} for it", rank(),
                 k.key, switch_round, from);
  Status st = send(conn, req);
  if (!st.ok()) {
    PSLD_LOG_ERROR("server {}: asking server {} for key {:#x}: {}", rank(), from, k.key,
                   st.to_string());
  }
}

void ServerService::install_state(Shard& shard, KeyState& k) {
  uint64_t version = 0;
  std::memcpy(&version, k.incoming->data(), sizeof(version));
  const float* in = reinterpret_cast<const float*>(k.incoming->data() + kStateHeader);
  const OptimizerKind kind = options_.optimizer.kind;
  const bool optimizer = options_.mode == ServerMode::kOptimizer;
  const bool with_m = optimizer && (kind != OptimizerKind::kSgd || options_.optimizer.momentum > 0);
  const bool with_v = optimizer && (kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW);
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  const size_t bytes = k.n * sizeof(float);
  Status st = k.failed;
  if (st.ok()) st = copy_on(dev, lane, k.param.get(), in, bytes);
  if (st.ok() && with_m) st = ensure_array(dev, k.m, k.n);
  if (st.ok() && with_m) st = copy_on(dev, lane, k.m.get(), in + k.n, bytes);
  if (st.ok() && with_v) st = ensure_array(dev, k.v, k.n);
  if (st.ok() && with_v) st = copy_on(dev, lane, k.v.get(), in + 2 * k.n, bytes);
  if (st.ok()) st = publish(shard, k);  // waits for the copies out of `incoming`
  // BSP: version is the round, state_round - 1. Async: the updates applied,
  // which Adam's bias correction counts; every worker pushed up to the switch.
  k.version = version;
  std::fill(k.last_round.begin(), k.last_round.end(), k.state_round - 1);
  k.awaiting_state = false;
  k.incoming.reset();
  if (!st.ok()) {
    fail_key(shard, k, st.with_context("installing the state that migrated here"));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.states_in;
  }
  PSLD_LOG_DEBUG("server {}: key {:#x} arrived as of round {}", rank(), k.key, k.version);
  if (k.awaiting_final) return;  // served once the transfer is final
  resume(shard, k);
}

void ServerService::resume(Shard& shard, KeyState& k) {
  serve_ready_pulls(shard, k);
  release_parked(shard, k);
  while (k.inflight == 0 && !k.deferred.empty()) {
    PushWork next = std::move(k.deferred.front());
    k.deferred.pop_front();
    process_push(shard, next);
  }
  maybe_ship(shard, k);
}

bool ServerService::ready_to_ship(const KeyState& k, uint64_t switch_round) const {
  if (k.awaiting_state || k.awaiting_final || !k.failed.ok()) return false;
  if (options_.sync == SyncMode::kBsp) return k.version >= switch_round - 1;
  // Async and staleness: every worker's pushes of this run's rounds up to the
  // switch are applied (counted: pushes may be applied out of round order).
  const uint64_t first = std::max<uint64_t>(k.owned_from, 1);
  const uint64_t want = switch_round > first ? switch_round - first : 0;
  for (uint64_t a : k.applied) {
    if (a < want) return false;
  }
  return true;
}

void ServerService::maybe_ship(Shard& shard, KeyState& k) {
  if (!k.successors.empty()) {
    std::vector<StateWork> still;
    for (auto& w : k.successors) {
      if (ready_to_ship(k, w.req.switch_round)) {
        ship_state(shard, k, w);
      } else {
        still.push_back(std::move(w));
      }
    }
    k.successors.swap(still);
  }
  maybe_offer(shard, k);
}

// Parameter, then the two moments (zeros when the optimizer keeps none),
// fp32, into the successor's region with one write.
void ServerService::ship_state(Shard& shard, KeyState& k, const StateWork& w) {
  const uint64_t bytes = kStateHeader + 3 * k.n * sizeof(float);
  auto staging = transport().allocate_memory(bytes, transport::MemoryKind::kHost);
  ConnectionPtr conn = worker_connection(w.conn);
  if (!staging.ok() || !conn) {
    PSLD_LOG_ERROR("server {}: cannot ship key {:#x}: {}", rank(), k.key,
                   staging.ok() ? "the successor is gone" : staging.status().to_string());
    return;
  }
  std::memset((*staging)->data(), 0, kStateHeader);
  std::memcpy((*staging)->data(), &k.version, sizeof(k.version));
  float* out = reinterpret_cast<float*>((*staging)->data() + kStateHeader);
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  const size_t array_bytes = k.n * sizeof(float);
  Status copied = copy_on(dev, lane, out, k.param.get(), array_bytes);
  if (k.m) {
    if (copied.ok()) copied = copy_on(dev, lane, out + k.n, k.m.get(), array_bytes);
  } else {
    std::memset(out + k.n, 0, array_bytes);
  }
  if (k.v) {
    if (copied.ok()) copied = copy_on(dev, lane, out + 2 * k.n, k.v.get(), array_bytes);
  } else {
    std::memset(out + 2 * k.n, 0, array_bytes);
  }
  if (copied.ok()) copied = finish_on(dev, lane);
  if (!copied.ok()) {
    fail_key(shard, k, copied.with_context("copying the state to ship"));
    return;
  }
  PSLD_LOG_DEBUG("server {}: shipping key {:#x} as of round {}", rank(), k.key, k.version);
  // Both regions must outlive the write (an emulated link queues it).
  auto region = *staging;
  auto target = w.region;
  k.shipping_round = w.req.switch_round;
  const Key key = k.key;
  const uint64_t run = k.owned_from, round = w.req.switch_round;
  Status st = conn->write({region.get(), 0, target.get(), 0, bytes, w.req.tag},
                          [this, region, target, key, run, round](Status s) {
                            if (!s.ok()) {
                              PSLD_LOG_ERROR("shipping the state of key {:#x} failed: {}", key,
                                             s.to_string());
                            }
                            // Completed: the transfer may be done (docs/migration.md).
                            dispatch(key, ShipDone{key, run, round, s.ok()});
                          });
  if (!st.ok()) {
    PSLD_LOG_ERROR("server {}: shipping key {:#x}: {}", rank(), k.key, st.to_string());
  }
}

void ServerService::serve_ready_pulls(Shard& shard, KeyState& k) {
  std::vector<PullWork> still;
  for (auto& p : k.waiting) {
    if (pull_ready(k, p.req)) {
      serve_pull(shard, k, p);
    } else {
      still.push_back(p);
    }
  }
  k.waiting.swap(still);
}

void ServerService::release_parked(Shard& shard, KeyState& k) {
  if (options_.sync != SyncMode::kBsp) return;
  auto next = k.parked.find(k.version + 1);
  if (next == k.parked.end()) return;
  std::vector<PushWork> ready = std::move(next->second);
  k.parked.erase(next);
  for (auto& p : ready)
    process_push(shard, p);
}

void ServerService::on_epoch_change(const protocol::EpochChange& change) {
  using protocol::EpochStep;
  protocol::EpochVote vote{change.epoch, change.switch_round, false, 0};
  bool scan = false;
  Dial dial;  // the servers this switch brings keys from
  std::vector<std::tuple<uint64_t, Key, Work>> wake;
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    const ServerId me = rank();
    if (change.step == EpochStep::kPrepare) {
      auto next = epochs_->follow(change.epoch, change.delta);
      if (!next.ok()) {
        PSLD_LOG_ERROR("server {}: a prepare refused: {}", me, next.status().to_string());
        return;
      }
      // A round at or past the switch already seen here means the switch is
      // too early: vote no and change nothing (a push this server took must
      // never be refused later). Otherwise, from here on rounds >=
      // switch_round of the keys this server loses are refused. Pushes arrive
      // on this same thread, so none slips in between.
      vote.max_round = max_round_seen_.load();
      vote.yes = vote.max_round < change.switch_round;
      if (vote.yes) {
        // Gaining keys, never having owned any: all this server will hold
        // is the transfer, which an abort can undo until it is final (the
        // coordinator decides by the same rule).
        if (!owned_ever_ && !(*next)->arcs_of(me).empty()) {
          gate_round_ = change.switch_round;
          gate_final_ = false;
        }
        prepared_ = Prepared{change.epoch, change.switch_round, *next};
        for_each_overlap(
            epochs_->latest(), **next, [&](uint64_t, uint64_t, ServerId was, ServerId now) {
              if (now == me && was != me &&
                  std::find(dial.servers.begin(), dial.servers.end(), was) == dial.servers.end())
                dial.servers.push_back(was);
            });
      }
    } else {
      std::shared_ptr<const Placement> next;
      if (change.step == EpochStep::kCommit) {
        if (!prepared_ || prepared_->epoch != change.epoch) {
          PSLD_LOG_ERROR("server {}: commit of epoch {} that was not prepared", me, change.epoch);
          return;
        }
        next = prepared_->placement;
      } else {
        // An abort is committed without a prepare: it only takes keys away
        // from the lost server (protocol.h).
        auto n = epochs_->follow(change.epoch, change.delta);
        if (!n.ok()) {
          PSLD_LOG_ERROR("server {}: an abort refused: {}", me, n.status().to_string());
          return;
        }
        next = *n;
      }
      prepared_.reset();
      bool losing = false;
      for_each_overlap(epochs_->latest(), *next, [&](uint64_t, uint64_t, ServerId a, ServerId b) {
        losing = losing || (a == me && b != me);
      });
      epochs_->push(next, change.switch_round);
      const bool held = !gate_final_ && gate_round_ == change.switch_round;
      if (!held && !next->arcs_of(me).empty()) owned_ever_ = true;
      if (change.step == EpochStep::kCommit) {
        transfer_ = Transfer{change.epoch,
                             change.switch_round,
                             losing,
                             /*reported=*/!losing,
                             std::vector<int64_t>(shards_.size(), -1),
                             {}};
        scan = losing;
      } else if (transfer_.switch_round == change.switch_round) {
        // The same transfer without the lost server: what this server still
        // has to ship is looked for again (keys given back no longer count).
        transfer_.epoch = change.epoch;
        std::fill(transfer_.pending.begin(), transfer_.pending.end(), -1);
        scan = transfer_.losing;
      }
      PSLD_LOG_INFO("server {}: epoch {} from round {}{}", me, change.epoch, change.switch_round,
                    change.step == EpochStep::kAbort
                        ? fmt::format(" (server {} lost: its transfer aborted)", change.lost_server)
                        : "");
      // Requests that waited for this epoch are looked at again.
      const uint64_t newest = change.epoch;
      std::vector<std::tuple<uint64_t, Key, Work>> still;
      for (auto& f : future_) {
        (std::get<0>(f) <= newest ? wake : still).push_back(std::move(f));
      }
      future_.swap(still);
    }
  }
  if (change.step == EpochStep::kPrepare) {
    (void)session_.send_to_coordinator(vote);
    // Connected ahead (on a shard thread: a dial blocks), so that the first
    // state request of the switch does not wait for a connection.
    if (!dial.servers.empty()) dispatch(0, std::move(dial));
    return;
  }
  if (change.step == EpochStep::kAbort) forget_peer(change.lost_server);
  if (scan) dispatch_all(TransferScan{change.switch_round});
  for (auto& [epoch, key, work] : wake)
    dispatch(key, std::move(work));
}

void ServerService::on_final(const protocol::EpochFinal& final) {
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    if (gate_final_ || gate_round_ != final.switch_round) return;
    gate_final_ = true;
    owned_ever_ = true;
  }
  PSLD_LOG_INFO("server {}: the transfer at round {} is final; serving the keys it brought", rank(),
                final.switch_round);
  dispatch_all(Release{final.switch_round});
}

bool ServerService::hold_until_final(uint64_t run) const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return run != 0 && run == gate_round_ && !gate_final_;
}

bool ServerService::wait_for_epoch(uint64_t epoch, Key key, Work work) {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  const uint64_t newest = prepared_ ? prepared_->epoch : epochs_->latest().epoch();
  if (epoch <= newest || future_.size() >= kMaxWaitingForEpoch) return false;
  std::visit(
      [](auto& w) {
        if constexpr (requires { w.requeued; }) w.requeued = true;
      },
      work);
  future_.emplace_back(epoch, key, std::move(work));
  return true;
}

void ServerService::forget_peer(ServerId id) {
  ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return;
    conn = it->second;
    peers_.erase(it);
    for (auto in = incoming_.begin(); in != incoming_.end();) {
      in = in->first.first == conn->id() ? incoming_.erase(in) : std::next(in);
    }
  }
  conn->close();  // for good: the coordinator removed it from the job
}

void ServerService::on_tick() {
  std::optional<protocol::TransferDone> report;
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    Transfer& t = transfer_;
    if (t.switch_round == 0 || !t.losing || t.reported) return;
    const auto now = transport::Clock::now();
    if (t.reached == transport::Clock::time_point{} && max_round_seen_.load() + 1 >= t.switch_round)
      t.reached = now;
    // Twice the heartbeat timeout: longer than the coordinator takes to
    // find a successor that hung, whose transfer must still be abortable.
    if (t.reached == transport::Clock::time_point{} ||
        now - t.reached < 2 * options_.heartbeat_timeout) {
      return;
    }
    int64_t late = 0;
    for (int64_t p : t.pending) {
      if (p < 0) return;  // a shard has not looked yet
      late += p;
    }
    // The switch arrived here two heartbeat timeouts ago and some keys are
    // still not at it (a tensor pushed less often than others, or not at
    // all any more): waiting for them could hold the gained keys, and the
    // workers waiting on them, forever. They ship when they get there.
    t.reported = true;
    report = protocol::TransferDone{t.epoch, t.switch_round, static_cast<uint64_t>(late)};
  }
  PSLD_LOG_INFO(
      "server {}: {} keys leaving at round {} have not reached it {} ms after the switch; "
      "reporting the transfer done without them",
      rank(), report->late_keys, report->switch_round, 2 * options_.heartbeat_timeout.count());
  (void)session_.send_to_coordinator(*report);
}

void ServerService::note_outgoing(const Shard& shard) {
  std::optional<protocol::TransferDone> report;
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    Transfer& t = transfer_;
    if (t.reported || shard.out_round != t.switch_round) return;
    t.pending[shard.index] = static_cast<int64_t>(shard.outgoing.size());
    for (int64_t p : t.pending) {
      if (p != 0) return;
    }
    t.reported = true;
    report = protocol::TransferDone{t.epoch, t.switch_round, 0};
  }
  PSLD_LOG_DEBUG("server {}: every key leaving at round {} shipped", rank(), report->switch_round);
  (void)session_.send_to_coordinator(*report);
}

// The keys of this shard that leave at switch_round and were not shipped
// yet: each must ship before the transfer is done.
void ServerService::scan_outgoing(Shard& shard, uint64_t switch_round) {
  const ServerId me = rank();
  shard.out_round = switch_round;
  shard.outgoing.clear();
  std::vector<KeyState*> leaving;
  for (auto& [key, runs] : shard.keys) {
    if (owner_for(key, switch_round) == me) {
      // Stays here, or came back with an abort: requests for it at this
      // switch came from a successor that is gone, and a run that shipped
      // its state to it goes on instead of ending there.
      for (auto& r : runs) {
        std::erase_if(r->successors,
                      [&](const StateWork& w) { return w.req.switch_round == switch_round; });
        if (r->shipped_round == switch_round) r->shipped_round = 0;
      }
      continue;
    }
    if (owner_for(key, switch_round - 1) != me) continue;
    const auto held = gained(key, switch_round - 1);
    KeyState* k = find_run(shard, key, held ? held->first : 0);
    if (k == nullptr || k->shipped_round == switch_round) continue;
    shard.outgoing.insert({key, k->owned_from});
    leaving.push_back(k);
  }
  note_outgoing(shard);
  for (KeyState* k : leaving)
    maybe_offer(shard, *k);
}

void ServerService::maybe_offer(Shard& shard, KeyState& k) {
  const uint64_t t = shard.out_round;
  if (t == 0 || k.offered_round == t || k.shipping_round == t) return;
  if (!shard.outgoing.count({k.key, k.owned_from})) return;
  for (const auto& w : k.successors) {
    if (w.req.switch_round == t) return;  // asked for already
  }
  if (!ready_to_ship(k, t)) return;
  k.offered_round = t;
  const ServerId to = owner_for(k.key, t);
  ConnectionPtr conn = peer(to);
  if (!conn) return;  // logged by peer()
  PSLD_LOG_DEBUG("server {}: offering key {:#x} to server {} at round {}", rank(), k.key, to, t);
  (void)send(conn, protocol::StateOffer{k.key, t, k.dtype, k.bytes});
}

void ServerService::release_final(Shard& shard, uint64_t switch_round) {
  for (auto& [key, runs] : shard.keys) {
    for (auto& r : runs) {
      KeyState& k = *r;
      if (!k.awaiting_final || k.owned_from != switch_round) continue;
      k.awaiting_final = false;
      if (!k.awaiting_state) resume(shard, k);  // else once the state lands
    }
  }
}

// A run that ended at switch round T (the key left here at T) is needed
// while its state has not reached the successor, while an abort could still
// give the key back to it, and while a worker may still send a request for
// a round < T (docs/migration.md, "Freeing old runs"). The last watermark
// says neither of the last two can happen once it gives the key's tensor a
// round >= T (and that holds for good); shipped_round says the first is
// over. Nothing may be queued on the run either.
bool ServerService::done_with(const Shard& shard, const KeyState& k) const {
  const uint64_t low = protocol::round_of(shard.low.low, shard.low.tensors, key_tensor(k.key));
  return k.shipped_round != 0 && k.shipped_round <= low && k.inflight == 0 && k.waiting.empty() &&
         k.deferred.empty() && k.parked.empty() && k.successors.empty() && !k.awaiting_state &&
         !k.awaiting_final && !shard.outgoing.count({k.key, k.owned_from});
}

void ServerService::trim(Shard& shard, const protocol::LowWatermark& mark) {
  shard.low = mark;
  uint64_t freed = 0;
  for (auto it = shard.keys.begin(); it != shard.keys.end();) {
    freed += std::erase_if(it->second, [&](const auto& r) { return done_with(shard, *r); });
    it = it->second.empty() ? shard.keys.erase(it) : std::next(it);
  }
  note_freed(freed);
}

// A run may become free after the watermark passed its end: its write
// completed, its last pull write finished.
void ServerService::free_runs(Shard& shard, Key key) {
  auto it = shard.keys.find(key);
  if (it == shard.keys.end()) return;
  const uint64_t freed =
      std::erase_if(it->second, [&](const auto& r) { return done_with(shard, *r); });
  if (it->second.empty()) shard.keys.erase(it);
  note_freed(freed);
}

void ServerService::note_freed(uint64_t freed) {
  if (freed == 0) return;
  PSLD_LOG_DEBUG("server {}: freed {} runs of ownership", rank(), freed);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.runs -= freed;
  stats_.runs_freed += freed;
}

void ServerService::flush_credits(Shard& shard) {
  for (auto& [conn_id, tags] : shard.accepted)
    shard.credits[conn_id];  // a credit message also for accepted pushes alone
  for (auto& [conn_id, slots] : shard.credits) {
    auto acc = shard.accepted.find(conn_id);
    std::vector<uint32_t> tags;
    if (acc != shard.accepted.end()) tags = std::move(acc->second);
    if (slots.empty() && tags.empty()) continue;
    ConnectionPtr conn = worker_connection(conn_id);
    if (!conn) continue;
    // At most 1024 entries a message: well inside a control message.
    constexpr size_t kPerMessage = 1024;
    size_t si = 0, ti = 0;
    while (si < slots.size() || ti < tags.size()) {
      protocol::Credit credit;
      while (si < slots.size() && credit.slots.size() < kPerMessage)
        credit.slots.push_back(slots[si++]);
      while (ti < tags.size() && credit.slots.size() + credit.accepted.size() < kPerMessage)
        credit.accepted.push_back(tags[ti++]);
      (void)send(conn, credit);
    }
  }
  shard.credits.clear();
  shard.accepted.clear();
}

// With a device the chunk is first copied to the shard's staging buffer in
// GPU memory (pushes land in host memory), then reduced there.
Status ServerService::reduce_push(Shard& shard, KeyState& k, const PushWork& w) {
  PSLD_RETURN_IF_ERROR(k.failed);
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  const void* src = w.data;
  if (dev != nullptr) {
    if (shard.stage_bytes < k.bytes) {
      PSLD_RETURN_IF_ERROR(dev->synchronize(lane));  // nothing reads the old one any more
      shard.stage.reset();
      shard.stage_bytes = 0;
      PSLD_ASSIGN_OR_RETURN(shard.stage, make_array<uint8_t>(dev, k.bytes));
      shard.stage_bytes = k.bytes;
    }
    PSLD_RETURN_IF_ERROR(dev->copy(shard.stage.get(), w.data, k.bytes, lane));
    src = shard.stage.get();
  }
  const bool first = k.pushes == 0;
  float* acc = k.acc.get();
  const size_t n = k.n;
  Status st;
  switch (k.dtype) {
    case DType::kF32: {
      const auto* x = static_cast<const float*>(src);
      st = first ? copy_on(dev, lane, acc, x, k.bytes)
                 : run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
                     return kn::reduce_f32(where, acc, x, n, stream);
                   });
      break;
    }
    case DType::kF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
        return first ? kn::f16_to_f32(where, acc, x, n, stream)
                     : kn::reduce_f16(where, acc, x, n, stream);
      });
      break;
    }
    case DType::kBF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
        return first ? kn::bf16_to_f32(where, acc, x, n, stream)
                     : kn::reduce_bf16(where, acc, x, n, stream);
      });
      break;
    }
  }
  if (st.ok()) st = finish_on(dev, lane);
  PSLD_RETURN_IF_ERROR(st.with_context("reducing a push"));
  ++k.pushes;
  pace_compute(k.bytes);
  return Status::Ok();
}

Status ServerService::publish(const Shard& shard, KeyState& k) {
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  const float* param = k.param.get();
  uint16_t* out16 = k.out16.get();
  const size_t n = k.n;
  if (k.dtype == DType::kF16) {
    PSLD_RETURN_IF_ERROR(run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
      return kn::f32_to_f16(where, out16, param, n, stream);
    }));
  }
  if (k.dtype == DType::kBF16) {
    PSLD_RETURN_IF_ERROR(run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
      return kn::f32_to_bf16(where, out16, param, n, stream);
    }));
  }
  if (dev == nullptr) return Status::Ok();
  const void* out = k.dtype == DType::kF32 ? static_cast<const void*>(param) : out16;
  PSLD_RETURN_IF_ERROR(dev->copy(k.out_host.get(), out, k.bytes, lane));
  return dev->synchronize(lane);
}

void ServerService::fail_key(Shard& shard, KeyState& k, const Status& why) {
  if (k.failed.ok()) {
    k.failed = why.with_context(fmt::format("server {}, key {:#x} ({})", rank(), k.key,
                                            device_ ? device_->describe() : "host memory"));
    PSLD_LOG_ERROR("{}; every request for this key fails from now on", k.failed.to_string());
  }
  for (const PullWork& p : k.waiting)
    send_error(p.conn, p.req.tag, k.failed);
  k.waiting.clear();
  auto refuse = [&](const PushWork& w) {
    free_slot(shard, w.conn, w.meta.slot);
    send_error(w.conn, w.meta.tag, k.failed);
  };
  for (const auto& [round, pushes] : k.parked) {
    for (const PushWork& w : pushes)
      refuse(w);
  }
  k.parked.clear();
  for (const PushWork& w : k.deferred)
    refuse(w);
  k.deferred.clear();
  k.apply_pending = false;
}

void ServerService::process_push(Shard& shard, PushWork& w) {
  const protocol::PushMeta& meta = w.meta;
  const uint64_t round = (meta.flags & protocol::kPushInit) ? 0 : meta.round;
  if (owner_for(meta.key, round) != rank()) {
    if (wait_for_epoch(meta.epoch, meta.key, w)) return;  // keeps its slot meanwhile
    free_slot(shard, w.conn, meta.slot);
    send_moved(w.conn, meta.tag, meta.key);
    return;
  }
  KeyState& k = key_state(shard, meta.key, meta.dtype, meta.bytes, round);
  if (k.dtype != meta.dtype || k.bytes != meta.bytes) {
    free_slot(shard, w.conn, meta.slot);
    send_error(w.conn, meta.tag,
               InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the push has {} of {}",
                                           meta.key, k.bytes, protocol::dtype_name(k.dtype),
                                           meta.bytes, protocol::dtype_name(meta.dtype))));
    return;
  }
  if (!k.failed.ok()) {
    free_slot(shard, w.conn, meta.slot);
    send_error(w.conn, meta.tag, k.failed);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.pushes;
  }
  const bool then_pull = (meta.flags & protocol::kPushThenPull) != 0;
  if (k.awaiting_final) {
    // Held, not taken: if this server dies before the transfer is final,
    // the worker still has the push to send to the old owner again.
    if (options_.sync == SyncMode::kBsp) {
      k.parked[meta.round].push_back(w);
    } else {
      k.deferred.push_back(w);
    }
    return;
  }
  // A plain push completes at the worker once taken here (reduced or kept).
  if (!then_pull && !w.taken) {
    shard.accepted[w.conn].push_back(meta.tag);
    w.taken = true;
  }
  if (k.awaiting_state) {
    // Gained by migration: everything waits for the state (and a push_pull's
    // pull is queued when its push is processed again).
    if (options_.sync == SyncMode::kBsp) {
      k.parked[meta.round].push_back(w);
    } else {
      k.deferred.push_back(w);
    }
    return;
  }
  PullWork follow{w.conn, protocol::PullRequest{meta.pull_tag, meta.dtype, meta.bytes, meta.key,
                                                meta.round, meta.epoch}};

  if (meta.flags & protocol::kPushInit) {
    // The initial value, round 0: written into the parameter as is.
    k.pushes = 0;
    Status st = reduce_push(shard, k, w);
    if (st.ok()) {
      st = copy_on(device_.get(), shard.index, k.param.get(), k.acc.get(), k.n * sizeof(float));
    }
    if (st.ok()) st = publish(shard, k);
    k.pushes = 0;
    free_slot(shard, w.conn, meta.slot);
    if (!st.ok()) {
      fail_key(shard, k, st.with_context("the initial value"));
      send_error(w.conn, meta.tag, k.failed);
      return;
    }
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
    Status st = reduce_push(shard, k, w);
    load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
    free_slot(shard, w.conn, meta.slot);
    if (!st.ok()) {
      fail_key(shard, k, st);
      send_error(w.conn, meta.tag, k.failed);
      return;
    }
    k.pushed[w.worker] = true;
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
  Status st = reduce_push(shard, k, w);
  load_->record(k.arc, LoadMetric::kBusyNs, ns_since(start));
  free_slot(shard, w.conn, meta.slot);
  if (!st.ok()) {
    fail_key(shard, k, st);
    send_error(w.conn, meta.tag, k.failed);
    return;
  }
  k.last_round[w.worker] = std::max(k.last_round[w.worker], meta.round);
  ++k.applied[w.worker];
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
  ServerDevice* dev = device_.get();
  const size_t lane = shard.index;
  float* param = k.param.get();
  const float* acc = k.acc.get();
  const size_t n = k.n;
  Status st = k.failed;
  if (!st.ok()) {
    // Nothing to apply: fail_key answered what waited.
  } else if (sum_mode) {
    if (bsp) {
      // The round's sum. No pull write reads param now (apply waits for
      // them), and the next round's first push overwrites acc whole.
      if (k.acc_region) {
        std::swap(k.param, k.acc);
        std::swap(k.out_region, k.acc_region);
      } else {
        st = copy_on(dev, lane, param, acc, n * sizeof(float));
      }
    } else {
      st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
        return kn::reduce_f32(where, param, acc, n, stream);  // the running total
      });
    }
  } else {
    const OptimizerOptions& o = options_.optimizer;
    switch (o.kind) {
      case OptimizerKind::kSgd: {
        const kn::SgdParams p{o.lr, o.weight_decay};
        st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
          return kn::sgd_f32(where, param, acc, n, p, stream);
        });
        break;
      }
      case OptimizerKind::kMomentum: {
        st = ensure_array(dev, k.m, n);
        if (!st.ok()) break;
        float* m = k.m.get();
        const kn::MomentumParams p{o.lr,           o.momentum, o.dampening,
                                   o.weight_decay, o.nesterov, k.version == 0};
        st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
          return kn::momentum_f32(where, param, m, acc, n, p, stream);
        });
        break;
      }
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        st = ensure_array(dev, k.m, n);
        if (st.ok()) st = ensure_array(dev, k.v, n);
        if (!st.ok()) break;
        float* m = k.m.get();
        float* v = k.v.get();
        const kn::AdamParams p{o.lr,         o.beta1,        o.beta2,
                               o.eps,        o.weight_decay, o.kind == OptimizerKind::kAdamW,
                               k.version + 1};
        st = run_on(dev, lane, [=](kn::MemoryKind where, void* stream) {
          return kn::adam_f32(where, param, m, v, acc, n, p, stream);
        });
        break;
      }
    }
  }
  if (st.ok()) st = publish(shard, k);
  if (!st.ok()) {
    fail_key(shard, k, st.with_context(fmt::format("applying round {}", k.version + 1)));
    return;
  }
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
  serve_ready_pulls(shard, k);
  maybe_ship(shard, k);
  // BSP: pushes parked for the next round can be reduced now.
  if (bsp) release_parked(shard, k);
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
  if (owner_for(w.req.key, w.req.round) != rank()) {
    if (wait_for_epoch(w.req.epoch, w.req.key, w)) return;
    send_moved(w.conn, w.req.tag, w.req.key);
    return;
  }
  KeyState& k = key_state(shard, w.req.key, w.req.dtype, w.req.bytes, w.req.round);
  if (k.dtype != w.req.dtype || k.bytes != w.req.bytes) {
    send_error(w.conn, w.req.tag,
               InvalidArgument(fmt::format("key {:#x} holds {} bytes of {}, the pull asks {} of {}",
                                           w.req.key, k.bytes, protocol::dtype_name(k.dtype),
                                           w.req.bytes, protocol::dtype_name(w.req.dtype))));
    return;
  }
  if (!k.failed.ok()) {
    send_error(w.conn, w.req.tag, k.failed);
    return;
  }
  if (!k.awaiting_state && !k.awaiting_final && pull_ready(k, w.req)) {
    serve_pull(shard, k, w);
  } else {
    k.waiting.push_back(w);
  }
}

void ServerService::serve_pull(Shard& shard, KeyState& k, const PullWork& w) {
  (void)shard;
  std::shared_ptr<transport::RemoteRegion> remote;
  uint64_t base = 0;  // of the tensor in `remote`
  ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    auto it = conns_.find(w.conn);
    if (it == conns_.end()) return;  // the worker is gone
    conn = it->second->conn;
    auto t = it->second->tensors.find(key_tensor(w.req.key));
    if (t != it->second->tensors.end()) {
      remote = t->second.remote;
      base = t->second.offset;
    }
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
      base + static_cast<uint64_t>(key_chunk(w.req.key)) * session_.welcome().chunk_bytes;
  ++k.inflight;
  const Key key = w.req.key;
  const uint64_t run = k.owned_from;
  load_->begin_service();  // until the write completed
  Status s = conn->write({k.out_region.get(), 0, remote.get(), offset, k.bytes, w.req.tag},
                         [this, key, run](Status) {
                           load_->end_service();
                           dispatch(key, PullDone{key, run});
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
