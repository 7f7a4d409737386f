#include "transports/loopback/loopback.h"

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>

#include "base/mutex.h"
#include "base/random.h"
#include "base/wire.h"
#include "transports/common/pending_ops.h"
#include "transports/common/registration_cache.h"

namespace psld::transport {
namespace {

constexpr uint32_t kKeyMagic = 0x4b52424c;  // "LBRK"
constexpr std::string_view kAddressPrefix = "loopback:";
// A reordered delivery is held back this long so that later ones overtake it.
constexpr auto kReorderHold = std::chrono::milliseconds(2);

std::atomic<uint64_t> g_next_connection_id{1};

// MemoryRegion::backend() and RemoteRegion::backend() of this backend's
// regions: how it tells its own, without a dynamic_cast.
const char kLbRegionTag = 'L';
const char kLbRemoteRegionTag = 'R';

}  // namespace

std::vector<uint8_t> encode_loopback_key(const LoopbackKey& k) {
  WireWriter w(4 + 5 * 8);
  w.u32(kKeyMagic);
  w.u64(k.fabric_token);
  w.u64(k.node);
  w.u64(k.region);
  w.u64(k.length);
  w.u64(k.secret);
  return w.take();
}

Result<LoopbackKey> decode_loopback_key(std::span<const uint8_t> key) {
  WireReader r(key);
  uint32_t magic = 0;
  LoopbackKey k;
  if (!r.u32(&magic) || magic != kKeyMagic || !r.u64(&k.fabric_token) || !r.u64(&k.node) ||
      !r.u64(&k.region) || !r.u64(&k.length) || !r.u64(&k.secret) || !r.done()) {
    return DataLoss("malformed loopback remote key");
  }
  return k;
}

// ---------------------------------------------------------------------------
// Fabric

struct LoopbackFabric::Impl {
  Mutex mu;
  const uint64_t token = random_u64();
  uint64_t next_node GUARDED_BY(mu) = 1;
  uint64_t next_connection_seq GUARDED_BY(mu) = 0;
  std::map<std::string, std::weak_ptr<void>> listeners GUARDED_BY(mu);  // address -> Node
  std::map<std::string, FaultPlan> plans GUARDED_BY(mu);                // "" = default
  Counters counters GUARDED_BY(mu);

  FaultPlan plan_for(const std::string& from) REQUIRES(mu) {
    auto it = plans.find(from);
    if (it != plans.end()) return it->second;
    it = plans.find("");
    return it != plans.end() ? it->second : FaultPlan{};
  }
};

LoopbackFabric::LoopbackFabric() : impl_(std::make_shared<Impl>()) {}

void LoopbackFabric::set_faults(const FaultPlan& plan, const std::string& from) {
  MutexLock lock(impl_->mu);
  impl_->plans[from] = plan;
}

LoopbackFabric::Counters LoopbackFabric::counters() const {
  MutexLock lock(impl_->mu);
  return impl_->counters;
}

// ---------------------------------------------------------------------------
// The shared core of one transport. Connections and regions point at it
// weakly, so a peer's operation on a transport that was destroyed fails
// cleanly instead of touching freed memory.

struct Node;

class LbRegion final : public MemoryRegion, public std::enable_shared_from_this<LbRegion> {
 public:
  LbRegion(uint8_t* data, size_t length, MemoryKind kind, uint64_t id, uint64_t node_id,
           uint64_t fabric_token, std::unique_ptr<uint8_t, void (*)(void*)> owned)
      : MemoryRegion(data, length, kind, id, &kLbRegionTag),
        node_id_(node_id),
        owned_(std::move(owned)) {
    secret_ = random_u64();
    remote_key_ = encode_loopback_key({fabric_token, node_id, id, length, secret_});
  }
  uint64_t node_id() const { return node_id_; }
  uint64_t secret() const { return secret_; }
  // From allocate_memory: the fabric owns the memory.
  bool allocated() const { return owned_ != nullptr; }

 private:
  uint64_t node_id_;
  uint64_t secret_ = 0;
  std::unique_ptr<uint8_t, void (*)(void*)> owned_;
};

class LbRemoteRegion final : public RemoteRegion {
 public:
  // `mapped`: the peer's allocate_memory region, shared with this importer
  // as shared memory would be (Transport::local_view); null otherwise.
  LbRemoteRegion(size_t length, uint64_t region_id, uint64_t connection_id,
                 std::shared_ptr<const MemoryRegion> mapped)
      : RemoteRegion(length, region_id, &kLbRemoteRegionTag),
        connection_id_(connection_id),
        mapped_(std::move(mapped)) {}
  uint64_t connection_id() const { return connection_id_; }
  const uint8_t* view() const { return mapped_ ? mapped_->data() : nullptr; }

 private:
  uint64_t connection_id_;
  // Keeps the memory, as an attached segment outlives its exporter.
  std::shared_ptr<const MemoryRegion> mapped_;
};

class LbConnection;

struct Node : std::enable_shared_from_this<Node> {
  std::shared_ptr<LoopbackFabric::Impl> fabric;
  Handler* handler = nullptr;
  CommonOptions common;
  uint64_t id = 0;
  std::string address;
  bool listening = false;

  Mutex mu;
  std::condition_variable cv;
  // Ordered by due time, then by posting order.
  std::map<std::pair<Clock::time_point, uint64_t>, std::function<void()>> inbox GUARDED_BY(mu);
  uint64_t next_event GUARDED_BY(mu) = 0;
  std::map<uint64_t, std::weak_ptr<LbRegion>> exported GUARDED_BY(mu);
  std::map<uint64_t, std::weak_ptr<LbConnection>> connections GUARDED_BY(mu);
  bool shut GUARDED_BY(mu) = false;

  std::atomic<uint64_t> next_region{1};
  RegistrationCache<LbRegion> cache;
  PendingOps pending;
  Mutex progress_mu;  // one progress() at a time

  // Queues fn to run in this node's progress() at `due`. False after shutdown.
  bool post(Clock::time_point due, std::function<void()> fn) {
    {
      MutexLock lock(mu);
      if (shut) return false;
      inbox.emplace(std::make_pair(due, next_event++), std::move(fn));
    }
    cv.notify_all();
    return true;
  }

  std::shared_ptr<LbRegion> exported_region(uint64_t region_id) {
    MutexLock lock(mu);
    auto it = exported.find(region_id);
    return it == exported.end() ? nullptr : it->second.lock();
  }
};

class LbConnection final : public Connection, public std::enable_shared_from_this<LbConnection> {
 public:
  LbConnection(std::weak_ptr<Node> self, std::weak_ptr<Node> peer, uint64_t peer_node_id,
               std::string peer_address, const FaultPlan& plan, uint64_t seq)
      : Connection(&kLbRegionTag, &kLbRemoteRegionTag),
        self_(std::move(self)),
        peer_node_(std::move(peer)),
        peer_node_id_(peer_node_id),
        peer_address_(std::move(peer_address)),
        plan_(plan),
        rng_(plan.seed * 0x9e3779b97f4a7c15ull + seq) {}

  void set_peer(std::weak_ptr<LbConnection> peer) { peer_ = std::move(peer); }

  uint64_t id() const override { return id_; }
  std::string peer() const override { return fmt::format("loopback {}", peer_address_); }
  std::string write_path() const override { return "memcpy"; }
  bool is_open() const override { return open_.load(); }

  Result<std::shared_ptr<RemoteRegion>> import_region(std::span<const uint8_t> key) override {
    PSLD_ASSIGN_OR_RETURN(const LoopbackKey k, decode_loopback_key(key));
    auto self = self_.lock();
    if (!self || k.fabric_token != self->fabric->token) {
      return InvalidArgument("remote key comes from another loopback fabric");
    }
    if (k.node != peer_node_id_) {
      return InvalidArgument(
          fmt::format("remote key belongs to transport {}, not to this connection's peer {}",
                      k.node, peer_node_id_));
    }
    auto peer = peer_node_.lock();
    auto target = peer ? peer->exported_region(k.region) : nullptr;
    if (!target || target->secret() != k.secret || target->length() != k.length) {
      return NotFound("remote key names a region the peer does not export (deregistered?)");
    }
    std::shared_ptr<const MemoryRegion> mapped;
    if (target->allocated()) mapped = target;
    return std::shared_ptr<RemoteRegion>(
        std::make_shared<LbRemoteRegion>(k.length, k.region, id_, std::move(mapped)));
  }

  Status send(std::span<const uint8_t> message, Completion done) override;
  void close() override { break_connection(Aborted("connection closed locally"), true); }

  // Closes both ends: pending operations fail with `why` and both handlers
  // hear on_disconnect. `local` says whether this end asked for it.
  void break_connection(const Status& why, bool local);

 protected:
  Status check_backend(const WriteRequest& req) const override;
  Status start_write(const WriteRequest& req, Completion done) override;

 private:
  friend Result<ConnectionPtr> connect_nodes(const std::shared_ptr<Node>&, const std::string&);

  struct Plan {
    bool drop = false, duplicate = false, reorder = false, corrupt = false;
    uint64_t corrupt_pick = 0;
  };
  // Draws this operation's faults; Unavailable if it is the one that breaks
  // the connection.
  Result<Plan> draw();
  // Posts a delivery to the peer (twice when duplicated) and counts it.
  Status deliver(const Plan& plan, const std::function<void(LbConnection& peer_end)>& at_peer,
                 uint64_t op_id);

  const uint64_t id_ = g_next_connection_id.fetch_add(1);
  std::weak_ptr<Node> self_;
  std::weak_ptr<Node> peer_node_;
  uint64_t peer_node_id_;
  std::string peer_address_;
  std::weak_ptr<LbConnection> peer_;
  std::atomic<bool> open_{true};

  Mutex mu_;
  FaultPlan plan_;
  std::mt19937_64 rng_ GUARDED_BY(mu_);
  uint64_t ops_ GUARDED_BY(mu_) = 0;
};

Result<LbConnection::Plan> LbConnection::draw() {
  Plan p;
  bool disconnect = false;
  {
    MutexLock lock(mu_);
    ++ops_;
    if (ops_ > plan_.disconnect_after) disconnect = true;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    p.drop = u(rng_) < plan_.drop;
    p.duplicate = u(rng_) < plan_.duplicate;
    p.reorder = u(rng_) < plan_.reorder;
    p.corrupt = u(rng_) < plan_.corrupt;
    p.corrupt_pick = rng_();
  }
  if (disconnect) {
    if (auto self = self_.lock()) {
      MutexLock lock(self->fabric->mu);
      ++self->fabric->counters.disconnected;
    }
    break_connection(Unavailable("injected fault: the link went down"), false);
    return Unavailable("connection to " + peer() + " went down (injected fault)");
  }
  return p;
}

Status LbConnection::deliver(const Plan& plan, const std::function<void(LbConnection&)>& at_peer,
                             uint64_t op_id) {
  auto self = self_.lock();
  auto peer_node = peer_node_.lock();
  if (!self || !peer_node) return Unavailable("peer transport is gone");
  {
    MutexLock lock(self->fabric->mu);
    auto& c = self->fabric->counters;
    if (plan.drop) ++c.dropped;
    if (plan.duplicate) ++c.duplicated;
    if (plan.reorder) ++c.reordered;
    if (plan.corrupt) ++c.corrupted;
    if (!plan.drop) c.delivered += plan.duplicate ? 2 : 1;
  }
  if (plan.drop) return Status::Ok();  // the sender's op times out, as on a real lossy link

  auto due = Clock::now() + plan_.delay + (plan.reorder ? kReorderHold : Clock::duration(0));
  std::weak_ptr<LbConnection> peer_weak = peer_;
  std::weak_ptr<Node> self_weak = self_;
  const int copies = plan.duplicate ? 2 : 1;
  for (int i = 0; i < copies; ++i) {
    const bool last = i + 1 == copies;
    auto fn = [peer_weak, self_weak, at_peer, op_id, last] {
      auto peer_end = peer_weak.lock();
      if (!peer_end || !peer_end->is_open()) return;  // the break already failed the op
      at_peer(*peer_end);
      if (!last) return;
      // The bytes landed: the sender's operation is complete.
      if (auto sender = self_weak.lock()) {
        sender->post(Clock::now(),
                     [sender, op_id] { sender->pending.take(op_id, Status::Ok()).run(); });
      }
    };
    if (!peer_node->post(due, std::move(fn))) return Unavailable("peer transport shut down");
  }
  return Status::Ok();
}

Status LbConnection::check_backend(const WriteRequest& req) const {
  if (!is_open()) return Unavailable("connection to " + peer() + " is closed");
  auto self = self_.lock();
  if (!self) return Unavailable("transport is shut down");
  // Connection::write proved both are this backend's.
  if (static_cast<const LbRegion*>(req.local)->node_id() != self->id) return foreign_source();
  auto* remote = static_cast<const LbRemoteRegion*>(req.remote);
  if (remote->connection_id() != id_) return foreign_target();
  auto peer_node = peer_node_.lock();
  if (!peer_node || !peer_node->exported_region(remote->peer_region_id())) {
    return NotFound("remote region was deregistered by the peer (stale key)");
  }
  return Status::Ok();
}

Status LbConnection::start_write(const WriteRequest& req, Completion done) {
  PSLD_RETURN_IF_ERROR(check_backend(req));
  auto self = self_.lock();
  auto peer_node = peer_node_.lock();
  auto dst = peer_node ? peer_node->exported_region(req.remote->peer_region_id()) : nullptr;
  if (!self || !dst) return Unavailable("peer transport is gone");
  // Keeps the source alive until the delivery ran, even if the caller drops it.
  auto src =
      const_cast<LbRegion*>(static_cast<const LbRegion*>(req.local))->weak_from_this().lock();
  if (!src) return InvalidArgument("write source region is being destroyed");

  PSLD_ASSIGN_OR_RETURN(Plan plan, draw());
  const uint64_t op_id =
      self->pending.add(id_, Clock::now() + self->common.op_timeout, std::move(done));
  const uint64_t src_off = req.local_offset, dst_off = req.remote_offset, len = req.length;
  const uint32_t notify = req.notify;
  const bool corrupt = plan.corrupt && len > 0;
  const uint64_t pick = plan.corrupt_pick;
  auto at_peer = [src, dst, src_off, dst_off, len, notify, corrupt, pick](LbConnection& end) {
    if (len > 0) std::memcpy(dst->data() + dst_off, src->data() + src_off, len);
    if (corrupt) dst->data()[dst_off + pick % len] ^= 0x5a;
    auto node = end.self_.lock();
    if (node) node->handler->on_write(end.shared_from_this(), notify, len);
  };
  Status s = deliver(plan, at_peer, op_id);
  if (!s.ok()) {
    self->pending.take(op_id, s).run();  // fails the op here; report through done only
    return Status::Ok();
  }
  return Status::Ok();
}

Status LbConnection::send(std::span<const uint8_t> message, Completion done) {
  if (message.size() > kMaxMessageBytes) {
    return InvalidArgument(fmt::format("message of {} bytes exceeds the {}-byte limit",
                                       message.size(), kMaxMessageBytes));
  }
  if (!is_open()) return Unavailable("connection to " + peer() + " is closed");
  auto self = self_.lock();
  if (!self) return Unavailable("transport is shut down");
  PSLD_ASSIGN_OR_RETURN(Plan plan, draw());
  const uint64_t op_id =
      self->pending.add(id_, Clock::now() + self->common.op_timeout, std::move(done));
  auto bytes = std::make_shared<std::vector<uint8_t>>(message.begin(), message.end());
  if (plan.corrupt && !bytes->empty()) (*bytes)[plan.corrupt_pick % bytes->size()] ^= 0x5a;
  auto at_peer = [bytes](LbConnection& end) {
    auto node = end.self_.lock();
    if (node) node->handler->on_message(end.shared_from_this(), *bytes);
  };
  Status s = deliver(plan, at_peer, op_id);
  if (!s.ok()) self->pending.take(op_id, s).run();
  return Status::Ok();
}

void LbConnection::break_connection(const Status& why, bool local) {
  if (open_.exchange(false)) {
    auto self = self_.lock();
    if (self) {
      auto me = shared_from_this();
      auto failed = self->pending.fail_connection(id_, why);
      auto shared_failed = std::make_shared<std::vector<PendingOps::Ready>>(std::move(failed));
      const bool posted = self->post(Clock::now(), [self, me, shared_failed, why] {
        for (auto& r : *shared_failed)
          r.run();
        self->handler->on_disconnect(me, why);
      });
      // After shutdown nothing runs in progress() any more: complete here.
      if (!posted) {
        for (auto& r : *shared_failed)
          r.run();
      }
    }
    if (auto peer = peer_.lock()) {
      peer->break_connection(local ? Unavailable("peer closed the connection") : why,
                             /*local=*/false);
    }
  }
}

// ---------------------------------------------------------------------------

class LoopbackTransport final : public Transport {
 public:
  explicit LoopbackTransport(std::shared_ptr<Node> node) : node_(std::move(node)) {}
  // shutdown() can throw only std::bad_alloc (its containers), which ends
  // the process either way.
  ~LoopbackTransport() override { shutdown(); }  // NOLINT(bugprone-exception-escape)

  std::string_view name() const override { return "loopback"; }

  std::vector<uint8_t> address() const override {
    if (!node_->listening) return {};
    return std::vector<uint8_t>(node_->address.begin(), node_->address.end());
  }

  Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address) override;

  Result<std::shared_ptr<MemoryRegion>> register_memory(void* data, size_t length,
                                                        MemoryKind kind) override {
    if (data == nullptr || length == 0) {
      return InvalidArgument("register_memory needs a non-null pointer and a non-zero length");
    }
    if (kind != MemoryKind::kHost) {
      return Unimplemented(memory_support(kind).detail);
    }
    if (auto hit = node_->cache.find(data, length, kind)) return std::shared_ptr<MemoryRegion>(hit);
    auto region = make_region(static_cast<uint8_t*>(data), length, kind, {nullptr, std::free});
    return std::shared_ptr<MemoryRegion>(node_->cache.insert(region));
  }

  Result<std::shared_ptr<MemoryRegion>> allocate_memory(size_t length, MemoryKind kind) override {
    if (length == 0) return InvalidArgument("allocate_memory needs a non-zero length");
    if (kind != MemoryKind::kHost) {
      return Unimplemented(memory_support(kind).detail);
    }
    const size_t rounded = (length + 63) / 64 * 64;
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
    if (p == nullptr) return ResourceExhausted(fmt::format("cannot allocate {} bytes", length));
    std::memset(p, 0, rounded);
    return std::shared_ptr<MemoryRegion>(make_region(p, length, kind, {p, std::free}));
  }

  const uint8_t* local_view(const RemoteRegion& remote) const override {
    if (remote.backend() != &kLbRemoteRegionTag) return nullptr;
    return static_cast<const LbRemoteRegion&>(remote).view();
  }

  Status invalidate(void* data, size_t length) override {
    auto region = node_->cache.find(data, length, MemoryKind::kHost);
    PSLD_RETURN_IF_ERROR(node_->cache.invalidate(data, length));
    if (region) {
      MutexLock lock(node_->mu);
      node_->exported.erase(region->id());  // peers can no longer write here
    }
    return Status::Ok();
  }

  size_t progress() override {
    MutexLock progress_lock(node_->progress_mu);
    size_t n = 0;
    for (auto& r : node_->pending.expire(Clock::now())) {
      r.run();
      ++n;
    }
    // Run what is due now; events posted while running wait for the next call,
    // so one progress() cannot spin forever on a chatty peer.
    std::vector<std::function<void()>> due;
    {
      MutexLock lock(node_->mu);
      const auto now = Clock::now();
      while (!node_->inbox.empty() && node_->inbox.begin()->first.first <= now) {
        due.push_back(std::move(node_->inbox.begin()->second));
        node_->inbox.erase(node_->inbox.begin());
      }
    }
    for (auto& fn : due)
      fn();
    return n + due.size();
  }

  void wait(std::chrono::milliseconds timeout) override {
    UniqueLock lock(node_->mu);
    auto until = std::min(Clock::now() + timeout, node_->pending.next_deadline());
    if (!node_->inbox.empty()) until = std::min(until, node_->inbox.begin()->first.first);
    node_->cv.wait_until(lock.native(), until, [&]() REQUIRES(node_->mu) {
      return node_->shut || woken_ ||
             (!node_->inbox.empty() && node_->inbox.begin()->first.first <= Clock::now());
    });
    woken_ = false;
  }

  void wake() override {
    {
      MutexLock lock(node_->mu);
      woken_ = true;
    }
    node_->cv.notify_all();
  }

  void shutdown() override {
    {
      MutexLock lock(node_->fabric->mu);
      node_->fabric->listeners.erase(node_->address);
    }
    std::vector<std::shared_ptr<LbConnection>> conns;
    // Events still queued are dropped: after shutdown no handler runs. The
    // operations they would have completed are still pending and fail below.
    std::map<std::pair<Clock::time_point, uint64_t>, std::function<void()>> dropped;
    {
      MutexLock lock(node_->mu);
      if (node_->shut) return;
      node_->shut = true;
      for (auto& [id, weak] : node_->connections) {
        if (auto c = weak.lock()) conns.push_back(c);
      }
      dropped.swap(node_->inbox);
      node_->connections.clear();
      node_->exported.clear();
    }
    for (auto& c : conns)
      c->break_connection(Aborted("transport shut down"), true);
    // Completions still owed are delivered here, exactly once.
    for (auto& r : node_->pending.fail_all(Aborted("transport shut down")))
      r.run();
    node_->cache.clear();
    node_->cv.notify_all();
  }

  const std::shared_ptr<Node>& node() const { return node_; }

 private:
  std::shared_ptr<LbRegion> make_region(uint8_t* data, size_t length, MemoryKind kind,
                                        std::unique_ptr<uint8_t, void (*)(void*)> owned) {
    const uint64_t id = node_->next_region.fetch_add(1);
    // The deleter unexports the region, so a peer's later write fails cleanly.
    std::weak_ptr<Node> weak = node_;
    auto* raw =
        new LbRegion(data, length, kind, id, node_->id, node_->fabric->token, std::move(owned));
    std::shared_ptr<LbRegion> region(raw, [weak, id](LbRegion* r) {
      if (auto n = weak.lock()) {
        MutexLock lock(n->mu);
        n->exported.erase(id);
      }
      delete r;
    });
    MutexLock lock(node_->mu);
    node_->exported[id] = region;
    return region;
  }

  std::shared_ptr<Node> node_;
  bool woken_ GUARDED_BY(node_->mu) = false;
};

Result<ConnectionPtr> connect_nodes(const std::shared_ptr<Node>& self, const std::string& address) {
  std::shared_ptr<Node> target;
  FaultPlan plan;
  uint64_t seq = 0;
  {
    MutexLock lock(self->fabric->mu);
    auto it = self->fabric->listeners.find(address);
    if (it != self->fabric->listeners.end())
      target = std::static_pointer_cast<Node>(it->second.lock());
    plan = self->fabric->plan_for(self->address);
    seq = self->fabric->next_connection_seq++;
  }
  if (!target) return Unavailable(fmt::format("nobody listens at '{}' on this fabric", address));
  auto mine = std::make_shared<LbConnection>(self, target, target->id, address, plan, 2 * seq);
  auto theirs =
      std::make_shared<LbConnection>(target, self, self->id, self->address, plan, 2 * seq + 1);
  mine->set_peer(theirs);
  theirs->set_peer(mine);
  {
    MutexLock lock(self->mu);
    if (self->shut) return Unavailable("transport is shut down");
    self->connections[mine->id()] = mine;
  }
  {
    MutexLock lock(target->mu);
    target->connections[theirs->id()] = theirs;
  }
  std::weak_ptr<Node> tw = target;
  if (!target->post(Clock::now(), [tw, theirs] {
        if (auto t = tw.lock()) t->handler->on_accept(theirs);
      })) {
    return Unavailable(fmt::format("the transport at '{}' shut down", address));
  }
  return ConnectionPtr(mine);
}

Result<ConnectionPtr> LoopbackTransport::connect(std::span<const uint8_t> peer_address) {
  std::string address(peer_address.begin(), peer_address.end());
  if (address.rfind(kAddressPrefix, 0) != 0) {
    return InvalidArgument(fmt::format("'{}' is not a loopback address", address));
  }
  return connect_nodes(node_, address);
}

Result<std::unique_ptr<Transport>> create_loopback_transport(const TransportOptions& options,
                                                             Handler* handler) {
  if (!options.loopback.fabric) {
    return InvalidArgument("the loopback transport needs options.loopback.fabric");
  }
  if (options.common.op_timeout.count() <= 0) {
    return InvalidArgument("common.op_timeout must be positive");
  }
  auto node = std::make_shared<Node>();
  node->fabric = options.loopback.fabric->impl_;
  node->handler = handler;
  node->common = options.common;
  {
    MutexLock lock(node->fabric->mu);
    node->id = node->fabric->next_node++;
    node->address = fmt::format("{}{}", kAddressPrefix, node->id);
    node->listening = !options.common.listen_address.empty();
    if (node->listening) node->fabric->listeners[node->address] = node;
  }
  return std::unique_ptr<Transport>(new LoopbackTransport(std::move(node)));
}

}  // namespace psld::transport
