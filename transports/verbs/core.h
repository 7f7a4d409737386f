// The verbs backend: RC queue pairs on a shared receive queue, writes as
// RDMA WRITE_WITH_IMM, control messages as SENDs, queue-pair setup and
// liveness over a TCP side channel. docs/transports.md ("verbs") has the
// design; these files keep the comments to the reasons behind each choice.
//
// Locks, in the order they may be taken (never the other way):
//   progress_mu_  one progress() at a time, and teardown excludes it
//   mu_           connections, queue pairs, CQ polling, pools, fds
//   pd_mu_        shared: a registration or deregistration uses the PD;
//                 exclusive: teardown deregisters everything and frees it
//   regions_mu_   the region id -> MR table (leaf)
// PendingOps and RegistrationCache lock internally (leaves). No lock is held
// while a handler or a completion runs.
//
// core.h declares what the backend's files share: the constants, the
// regions, the connections and the core. setup.cc opens the device, memory.cc
// registers memory, wireup.cc sets up queue pairs and connections, rma.cc is
// the data path, progress.cc handles completions and waits, transport.cc
// shuts down and holds the Transport and its factory; util.cc has helpers.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/mutex.h"
#include "base/random.h"
#include "psld/status.h"
#include "transports/common/pending_ops.h"
#include "transports/common/registration_cache.h"
#include "transports/transport.h"
#include "transports/verbs/send_queue.h"
#include "transports/verbs/side_channel.h"
#include "transports/verbs/verbs_protocol.h"

namespace psld::transport {

// Constants and helpers of the verbs backend, shared by its files.
namespace verbs_detail {

using namespace std::chrono_literals;

// Receive side: one SRQ shared by every queue pair. Each buffer holds one
// control message; a WRITE_WITH_IMM consumes a receive too (its payload goes
// to the target region, the buffer stays empty). 1024 x 8 KiB = 8 MiB per
// transport. A burst of more arrivals than this waits in the sender's RNR
// retry (see the QP attributes below), it is not lost.
inline constexpr uint32_t kSrqDepth = 1024;
// Send side: bounce buffers for messages too large to inline.
inline constexpr uint32_t kSendBuffers = 256;
// Send CQ entries; bounds the work requests posted across all queue pairs.
inline constexpr int kSendCqDepth = 16384;
// Work requests waiting in software per connection once its send queue is
// full; beyond this write()/send() answer ResourceExhausted.
inline constexpr size_t kMaxBacklog = 16384;
// Inline data avoids the bounce copy and a DMA read for small messages.
inline constexpr uint32_t kWantedInline = 128;
inline constexpr int kPollBatch = 32;
// Completions handled per CQ per progress(), so one call stays short.
inline constexpr size_t kMaxCompletionsPerProgress = 1024;
// The slow path (side channels, async events, timers) runs at least this
// often while completions keep the fast path busy, and always when idle.
inline constexpr auto kSlowPathInterval = 1ms;
inline constexpr auto kMaxSpin = std::chrono::microseconds(50);
// A closed queue pair that reached RTR is destroyed once the device reports
// its last SRQ WQE (IBV_EVENT_QP_LAST_WQE_REACHED), or after this long.
inline constexpr auto kQpDrainTimeout = 2s;
// shutdown() waits at most this long for flushed send completions.
inline constexpr auto kTeardownDrain = 1s;
inline constexpr size_t kMaxPendingHandshakes = 1024;

// Queue pair attributes.
// Local ACK timeout 4.096 us * 2^18 = 1.07 s per try, retry_cnt 7: a peer
// whose NIC vanished is declared dead after ~8.6 s, inside the default 10 s
// op_timeout, without spurious failures under heavy congestion (NCCL's
// long-standing default; shorter values cause RETRY_EXC_ERR at scale). A peer
// process that merely exits is noticed at once through the side channel.
inline constexpr uint8_t kAckTimeout = 18;
inline constexpr uint8_t kRetryCount = 7;
// rnr_retry 7 = retry forever on "receiver not ready": flow control (see
// docs/transports.md). min_rnr_timer 12 = the peer waits 0.64 ms per RNR NAK.
inline constexpr uint8_t kRnrRetry = 7;
inline constexpr uint8_t kMinRnrTimer = 12;
inline constexpr uint8_t kHopLimit = 64;

// Side channel bytes after the hello.
inline constexpr uint8_t kReadyByte = 'R';  // client: my QP is in RTS
inline constexpr uint8_t kByeByte = 'B';    // either side: closing on purpose

// epoll tags; connection ids are below 2^63.
inline constexpr uint64_t kTagBit = uint64_t{1} << 63;
inline constexpr uint64_t kTagWake = kTagBit | 1;
inline constexpr uint64_t kTagChannel = kTagBit | 2;
inline constexpr uint64_t kTagAsync = kTagBit | 3;
inline constexpr uint64_t kTagListen = kTagBit | 4;

inline std::atomic<uint64_t> g_next_connection_id{1};

// Defined in util.cc.
std::string errno_text(int err);
// A verbs call failed on a device that is present: not "unavailable" (which
// callers and tests read as "no RDMA here"), but a resource or setup problem.
Status device_error(std::string_view what, int err);

}  // namespace verbs_detail

namespace verbs {

using namespace verbs_detail;

static_assert(static_cast<int>(LinkLayer::kInfiniBand) == IBV_LINK_LAYER_INFINIBAND);
static_assert(static_cast<int>(LinkLayer::kEthernet) == IBV_LINK_LAYER_ETHERNET);
static_assert(kMtu256 == IBV_MTU_256 && kMtu4096 == IBV_MTU_4096);

class Core;

// ---------------------------------------------------------------------------
// Regions

// MemoryRegion::backend() and RemoteRegion::backend() of this backend's
// regions: how Connection::write tells its own, without a dynamic_cast.
inline const char kVerbsRegionTag = 'L';
inline const char kVerbsRemoteRegionTag = 'R';

class VerbsRegion final : public MemoryRegion, public std::enable_shared_from_this<VerbsRegion> {
 public:
  using Owned = std::unique_ptr<uint8_t, void (*)(void*)>;
  VerbsRegion(uint8_t* data, size_t length, MemoryKind kind, uint64_t id, uint64_t transport_id,
              uint32_t lkey, uint32_t rkey, std::weak_ptr<Core> core, Owned owned,
              std::string registration)
      : MemoryRegion(data, length, kind, id, &kVerbsRegionTag),
        transport_id_(transport_id),
        lkey_(lkey),
        core_(std::move(core)),
        owned_(std::move(owned)) {
    registration_ = std::move(registration);
    RemoteKey key;
    key.transport_id = transport_id;
    key.region_id = id;
    key.addr = reinterpret_cast<uintptr_t>(data);
    key.length = length;
    key.rkey = rkey;
    key.secret = random_nonzero_u64();
    remote_key_ = encode_remote_key(key);
  }
  ~VerbsRegion() override;

  uint64_t transport_id() const { return transport_id_; }
  uint32_t lkey() const { return lkey_; }

 private:
  uint64_t transport_id_;
  uint32_t lkey_;
  std::weak_ptr<Core> core_;
  Owned owned_;  // allocate_memory's buffer; freed after the MR is gone
};

class VerbsRemoteRegion final : public RemoteRegion {
 public:
  VerbsRemoteRegion(const RemoteKey& key, uint64_t connection_id)
      : RemoteRegion(key.length, key.region_id, &kVerbsRemoteRegionTag),
        key_(key),
        connection_id_(connection_id) {}
  const RemoteKey& key() const { return key_; }
  uint64_t connection_id() const { return connection_id_; }

 private:
  RemoteKey key_;
  uint64_t connection_id_;
};

// ---------------------------------------------------------------------------
// Connections

enum class ConnState {
  kAwaitHello,  // server: TCP accepted, waiting for the client's hello
  kAwaitReply,  // client: hello sent, QP in INIT, waiting for the reply
  kAwaitReady,  // server: QP in RTS, reply sent, waiting for the client's ready
  kReady,
  kClosed,  // QP in ERR (if any) until drained and destroyed
};

// A write or message accepted by write()/send(), waiting for a send slot.
struct SendItem {
  uint64_t op_id = 0;
  bool is_write = false;
  std::shared_ptr<const VerbsRegion> src;  // keeps the MR alive while posted
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t remote_transport_id = 0;
  uint32_t length = 0;
  uint32_t imm = 0;
  std::vector<uint8_t> bytes;  // a message's copy
};

// A posted work request, by wr_id, until its completion is polled.
struct Inflight {
  uint64_t op_id = 0;
  bool is_write = false;
  int bounce = -1;
  std::shared_ptr<const VerbsRegion> src;
};

class VerbsConnection final : public Connection,
                              public std::enable_shared_from_this<VerbsConnection> {
 public:
  VerbsConnection(std::weak_ptr<Core> core, SideChannel chan, bool outbound, std::string peer,
                  uint32_t sq_depth, SlotBudget* budget)
      : Connection(&kVerbsRegionTag, &kVerbsRemoteRegionTag),
        core_(std::move(core)),
        outbound_(outbound),
        peer_(std::move(peer)),
        chan_(std::move(chan)),
        sq_(sq_depth, kMaxBacklog, budget) {}

  uint64_t id() const override { return id_; }
  std::string peer() const override { return peer_; }
  std::string write_path() const override { return "write-with-imm"; }
  Result<std::shared_ptr<RemoteRegion>> import_region(std::span<const uint8_t> key) override;
  Status send(std::span<const uint8_t> message, Completion done) override;
  void close() override;
  bool is_open() const override { return open_.load(); }

 protected:
  Status check_backend(const WriteRequest& request) const override;
  Status start_write(const WriteRequest& request, Completion done) override;

 private:
  friend class Core;

  const uint64_t id_ = g_next_connection_id.fetch_add(1);
  const std::weak_ptr<Core> core_;
  const bool outbound_;
  const std::string peer_;
  std::atomic<bool> open_{true};

  // Everything below is guarded by Core::mu_.
  ConnState state_ = ConnState::kAwaitHello;
  SideChannel chan_;
  bool want_out_ = false;  // EPOLLOUT registered
  ibv_qp* qp_ = nullptr;
  uint32_t qp_num_ = 0;
  uint32_t max_inline_ = 0;
  bool reached_rtr_ = false;  // from then on the QP may consume SRQ receives
  bool last_wqe_ = false;     // IBV_EVENT_QP_LAST_WQE_REACHED seen
  Hello local_hello_;
  uint64_t peer_transport_id_ = 0;  // known once the hello arrived
  Clock::time_point handshake_deadline_;
  Clock::time_point drain_deadline_;
  bool reported_ = false;  // the application knows it (on_disconnect is owed)
  bool ready_byte_seen_ = false;
  SendQueue<SendItem> sq_;
  std::unordered_map<uint64_t, Inflight> inflight_;
};

// ---------------------------------------------------------------------------
// The core: everything a transport owns. Connections and regions point at it
// weakly, so one that outlives the transport fails cleanly.

class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(const TransportOptions& options, Handler* handler)
      : opts_(options), handler_(handler), transport_id_(random_nonzero_u64()) {}
  ~Core();

  Status init();

  std::vector<uint8_t> address() const {
    return std::vector<uint8_t>(address_.begin(), address_.end());
  }
  Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address);
  Result<std::shared_ptr<MemoryRegion>> register_memory(void* data, size_t length, MemoryKind kind);
  Result<std::shared_ptr<MemoryRegion>> allocate_memory(size_t length, MemoryKind kind);
  Status invalidate(void* data, size_t length) { return cache_.invalidate(data, length); }
  MemorySupport memory_support(MemoryKind kind) const {
    if (kind == MemoryKind::kHost) return {true, "host memory (ibv_reg_mr)"};
    return cuda_support_;
  }
  size_t progress();
  void wait(std::chrono::milliseconds timeout);
  void wake();
  void shutdown();

  Result<std::shared_ptr<RemoteRegion>> import_region(VerbsConnection& c,
                                                      std::span<const uint8_t> key);
  // The backend's checks of a write (Connection::check_backend); the request
  // passed Connection::write's.
  Status check_backend(const VerbsConnection& c, const WriteRequest& req);
  Status write(VerbsConnection& c, const WriteRequest& req, Completion done);
  Status send(VerbsConnection& c, std::span<const uint8_t> message, Completion done);
  void close(VerbsConnection& c);

  // A region's destructor: deregisters its MR unless teardown already did.
  void deregister(uint64_t region_id);

 private:
  using ConnPtr = std::shared_ptr<VerbsConnection>;

  // What progress() runs once mu_ is released.
  struct Event {
    enum class Kind { kCompletion, kAccept, kWrite, kMessage, kDisconnect };
    Kind kind = Kind::kCompletion;
    PendingOps::Ready ready;
    ConnPtr conn;
    uint32_t notify = 0;
    uint64_t length = 0;
    uint32_t buffer = 0;
    Status why;
  };
  using Events = std::vector<Event>;

  struct BufferPool {
    uint8_t* mem = nullptr;
    uint32_t count = 0;
    uint32_t bytes = 0;
    ibv_mr* mr = nullptr;
    std::vector<int> free;
    uint8_t* at(uint32_t i) const { return mem + static_cast<size_t>(i) * bytes; }
  };

  static void push_ready(Events& events, PendingOps::Ready r) {
    if (!r.done) return;
    Event e;
    e.ready = std::move(r);
    events.push_back(std::move(e));
  }
  static void push_event(Events& events, Event::Kind kind, ConnPtr conn) {
    Event e;
    e.kind = kind;
    e.conn = std::move(conn);
    events.push_back(std::move(e));
  }

  // init() steps
  Status open_device();
  Status select_gid();
  Status create_queues();
  Status make_pool(BufferPool& pool, uint32_t count, uint32_t bytes, int access);
  Status start_listening();
  Status epoll_add(int fd, uint64_t tag, uint32_t events);
  void epoll_del(int fd);

  Result<std::shared_ptr<VerbsRegion>> make_region(uint8_t* data, size_t length, MemoryKind kind,
                                                   VerbsRegion::Owned owned);
  // Registers GPU memory (pd_mu_ held shared); *how names the call that did.
  Result<ibv_mr*> register_device_memory_locked(uint8_t* data, size_t length, int access,
                                                std::string* how) REQUIRES_SHARED(pd_mu_);
  void detect_cuda_support();

  // Connection setup (mu_ held).
  ConnPtr make_connection_locked(SideChannel chan, bool outbound, std::string peer) REQUIRES(mu_);
  Status register_connection_locked(const ConnPtr& c) REQUIRES(mu_);
  Status create_qp_locked(VerbsConnection& c) REQUIRES(mu_);
  Hello make_hello_locked(const VerbsConnection& c, uint32_t psn, uint64_t nonce) const
      REQUIRES(mu_);
  Status to_rtr_locked(VerbsConnection& c, const Hello& peer) REQUIRES(mu_);
  Status to_rts_locked(VerbsConnection& c) REQUIRES(mu_);
  Status side_send_locked(VerbsConnection& c, std::span<const uint8_t> bytes) REQUIRES(mu_);
  Status accept_hello_locked(const ConnPtr& c, const Hello& peer) REQUIRES(mu_);
  Status complete_client_locked(const ConnPtr& c, const Hello& reply, Events& events) REQUIRES(mu_);
  void promote_locked(const ConnPtr& c, Events& events) REQUIRES(mu_);
  size_t pending_accepts_locked() const REQUIRES(mu_);

  // Data path (mu_ held).
  Status check_backend_locked(const VerbsConnection& c, const WriteRequest& req) const
      REQUIRES(mu_);
  void drain_locked(const ConnPtr& c, Events& events) REQUIRES(mu_);
  void drain_all_locked(Events& events) REQUIRES(mu_);
  void break_locked(const ConnPtr& c, const Status& why, bool local, Events& events) REQUIRES(mu_);
  void fail_device_locked(const Status& why, Events& events) REQUIRES(mu_);
  void destroy_qp_locked(VerbsConnection& c) REQUIRES(mu_);
  void reap_closed_locked(Events& events, std::vector<uint32_t>& reposts, Clock::time_point now)
      REQUIRES(mu_);

  // Completions and events (mu_ held).
  size_t poll_send_cq_locked(Events& events) REQUIRES(mu_);
  size_t poll_recv_cq_locked(Events& events, std::vector<uint32_t>& reposts) REQUIRES(mu_);
  void on_send_completion_locked(const ibv_wc& wc, Events& events) REQUIRES(mu_);
  void on_recv_completion_locked(const ibv_wc& wc, Events& events, std::vector<uint32_t>& reposts)
      REQUIRES(mu_);
  bool peek_cqs_locked() REQUIRES(mu_);
  void arm_cqs_locked() REQUIRES(mu_);
  void post_receives_locked(const std::vector<uint32_t>& buffers) REQUIRES(mu_);
  void slow_path_locked(Events& events, std::vector<uint32_t>& reposts, Clock::time_point now)
      REQUIRES(mu_);
  void drain_cq_events_locked() REQUIRES(mu_);
  void drain_async_events_locked(Events& events) REQUIRES(mu_);
  void accept_all_locked(Events& events) REQUIRES(mu_);
  void handle_side_channel_locked(const ConnPtr& c, uint32_t revents, Events& events) REQUIRES(mu_);
  void process_side_input_locked(const ConnPtr& c, Events& events) REQUIRES(mu_);
  ConnPtr find_qp_locked(uint32_t qp_num) const REQUIRES(mu_) {
    auto it = by_qp_.find(qp_num);
    return it == by_qp_.end() ? nullptr : it->second;
  }

  size_t run_event(Event& e);
  void teardown();

  const TransportOptions opts_;
  Handler* const handler_;
  const uint64_t transport_id_;

  // Device resources; set by init(), released by teardown() in order.
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;  // guarded by pd_mu_ once init() returned
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* send_cq_ = nullptr;
  ibv_cq* recv_cq_ = nullptr;
  ibv_srq* srq_ = nullptr;
  ibv_device_attr dev_attr_{};
  ibv_port_attr port_attr_{};
  std::string device_name_;
  // Set once in init(): whether kCuda registration can work in this process.
  MemorySupport cuda_support_;
  std::atomic<bool> peermem_fallback_logged_{false};
  uint8_t port_ = 1;
  LinkLayer link_ = LinkLayer::kInfiniBand;
  bool use_grh_ = false;
  int gid_index_ = 0;
  Gid gid_;
  uint32_t sq_depth_ = 0;
  uint32_t max_write_bytes_ = 0;
  uint8_t max_rd_atomic_ = 0;
  uint8_t max_dest_rd_atomic_ = 0;
  BufferPool recv_pool_;
  BufferPool send_pool_;
  int epfd_ = -1;
  int wake_fd_ = -1;
  int listen_fd_ = -1;
  std::string address_;

  Mutex progress_mu_;
  std::atomic<std::thread::id> progress_owner_{};
  std::atomic<bool> teardown_deferred_{false};

  mutable Mutex mu_;
  std::atomic<bool> shut_{false};
  bool torn_down_ GUARDED_BY(mu_) = false;
  bool device_failed_ GUARDED_BY(mu_) = false;
  SlotBudget cq_budget_ GUARDED_BY(mu_){0};
  std::map<uint64_t, ConnPtr> conns_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, ConnPtr> by_qp_ GUARDED_BY(mu_);
  Events deferred_ GUARDED_BY(mu_);  // from calls outside progress(); run by the next one
  std::vector<ibv_wc> send_stash_ GUARDED_BY(mu_);  // polled by wait(), handled by progress()
  std::vector<ibv_wc> recv_stash_ GUARDED_BY(mu_);
  bool send_armed_ GUARDED_BY(mu_) = false;
  bool recv_armed_ GUARDED_BY(mu_) = false;
  bool slow_path_due_ GUARDED_BY(mu_) = true;
  Clock::time_point last_slow_path_ GUARDED_BY(mu_){};
  uint64_t next_wr_id_ GUARDED_BY(mu_) = 1;
  uint64_t drain_cursor_ GUARDED_BY(mu_) = 0;  // connection id drain_all_locked() served last
  AdaptiveSpin spin_{kMaxSpin};

  SharedMutex pd_mu_;
  Mutex regions_mu_;
  std::map<uint64_t, ibv_mr*> mrs_ GUARDED_BY(regions_mu_);
  std::atomic<uint64_t> next_region_{1};

  PendingOps pending_;
  RegistrationCache<VerbsRegion> cache_;
};

}  // namespace verbs
}  // namespace psld::transport
