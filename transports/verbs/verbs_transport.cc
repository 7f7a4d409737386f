// The verbs backend: RC queue pairs on a shared receive queue, writes as
// RDMA WRITE_WITH_IMM, control messages as SENDs, queue-pair setup and
// liveness over a TCP side channel. docs/transports.md ("verbs") has the
// design; this file keeps the comments to the reasons behind each choice.
//
// Locks, in the order they may be taken (never the other way):
//   progress_mu_  one progress() at a time, and teardown excludes it
//   mu_           connections, queue pairs, CQ polling, pools, fds
//   pd_mu_        shared: a registration or deregistration uses the PD;
//                 exclusive: teardown deregisters everything and frees it
//   regions_mu_   the region id -> MR table (leaf)
// PendingOps and RegistrationCache lock internally (leaves). No lock is held
// while a handler or a completion runs.
#include "transports/verbs/verbs_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <infiniband/verbs.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "gpu/cuda_driver.h"
#include "transports/common/pending_ops.h"
#include "transports/common/registration_cache.h"
#include "transports/verbs/send_queue.h"
#include "transports/verbs/side_channel.h"
#include "transports/verbs/verbs_protocol.h"

namespace psld::transport {
namespace verbs {

static_assert(static_cast<int>(LinkLayer::kInfiniBand) == IBV_LINK_LAYER_INFINIBAND);
static_assert(static_cast<int>(LinkLayer::kEthernet) == IBV_LINK_LAYER_ETHERNET);
static_assert(kMtu256 == IBV_MTU_256 && kMtu4096 == IBV_MTU_4096);

namespace {

using namespace std::chrono_literals;

// Receive side: one SRQ shared by every queue pair. Each buffer holds one
// control message; a WRITE_WITH_IMM consumes a receive too (its payload goes
// to the target region, the buffer stays empty). 1024 x 8 KiB = 8 MiB per
// transport. A burst of more arrivals than this waits in the sender's RNR
// retry (see the QP attributes below), it is not lost.
constexpr uint32_t kSrqDepth = 1024;
// Send side: bounce buffers for messages too large to inline.
constexpr uint32_t kSendBuffers = 256;
// Send CQ entries; bounds the work requests posted across all queue pairs.
constexpr int kSendCqDepth = 16384;
// Work requests waiting in software per connection once its send queue is
// full; beyond this write()/send() answer ResourceExhausted.
constexpr size_t kMaxBacklog = 16384;
// Inline data avoids the bounce copy and a DMA read for small messages.
constexpr uint32_t kWantedInline = 128;
constexpr int kPollBatch = 32;
// Completions handled per CQ per progress(), so one call stays short.
constexpr size_t kMaxCompletionsPerProgress = 1024;
// The slow path (side channels, async events, timers) runs at least this
// often while completions keep the fast path busy, and always when idle.
constexpr auto kSlowPathInterval = 1ms;
constexpr auto kMaxSpin = std::chrono::microseconds(50);
// A closed queue pair that reached RTR is destroyed once the device reports
// its last SRQ WQE (IBV_EVENT_QP_LAST_WQE_REACHED), or after this long.
constexpr auto kQpDrainTimeout = 2s;
// shutdown() waits at most this long for flushed send completions.
constexpr auto kTeardownDrain = 1s;
constexpr size_t kMaxPendingHandshakes = 1024;

// Queue pair attributes.
// Local ACK timeout 4.096 us * 2^18 = 1.07 s per try, retry_cnt 7: a peer
// whose NIC vanished is declared dead after ~8.6 s, inside the default 10 s
// op_timeout, without spurious failures under heavy congestion (NCCL's
// long-standing default; shorter values cause RETRY_EXC_ERR at scale). A peer
// process that merely exits is noticed at once through the side channel.
constexpr uint8_t kAckTimeout = 18;
constexpr uint8_t kRetryCount = 7;
// rnr_retry 7 = retry forever on "receiver not ready": flow control (see
// docs/transports.md). min_rnr_timer 12 = the peer waits 0.64 ms per RNR NAK.
constexpr uint8_t kRnrRetry = 7;
constexpr uint8_t kMinRnrTimer = 12;
constexpr uint8_t kHopLimit = 64;

// Side channel bytes after the hello.
constexpr uint8_t kReadyByte = 'R';  // client: my QP is in RTS
constexpr uint8_t kByeByte = 'B';    // either side: closing on purpose

// epoll tags; connection ids are below 2^63.
constexpr uint64_t kTagBit = uint64_t{1} << 63;
constexpr uint64_t kTagWake = kTagBit | 1;
constexpr uint64_t kTagChannel = kTagBit | 2;
constexpr uint64_t kTagAsync = kTagBit | 3;
constexpr uint64_t kTagListen = kTagBit | 4;

std::atomic<uint64_t> g_next_connection_id{1};

std::string errno_text(int err) {
  return fmt::format("{} ({})", std::strerror(err), err);
}

uint64_t random_nonzero_u64() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0)
    v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v;
}

uint32_t side_channel_events(bool want_out) {
  return uint32_t{EPOLLIN} | uint32_t{EPOLLRDHUP} | (want_out ? uint32_t{EPOLLOUT} : 0u);
}

// A verbs call failed on a device that is present: not "unavailable" (which
// callers and tests read as "no RDMA here"), but a resource or setup problem.
Status device_error(std::string_view what, int err) {
  if (err == ENOMEM || err == EAGAIN) {
    return ResourceExhausted(
        fmt::format("{}: {} (pinned memory limit? see ulimit -l)", what, errno_text(err)));
  }
  return FailedPrecondition(fmt::format("{}: {}", what, errno_text(err)));
}

bool set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

const char* mtu_name(int mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return "256";
    case IBV_MTU_512:
      return "512";
    case IBV_MTU_1024:
      return "1024";
    case IBV_MTU_2048:
      return "2048";
    case IBV_MTU_4096:
      return "4096";
  }
  return "?";
}

}  // namespace

class Core;

// ---------------------------------------------------------------------------
// Regions

class VerbsRegion final : public MemoryRegion, public std::enable_shared_from_this<VerbsRegion> {
 public:
  using Owned = std::unique_ptr<uint8_t, void (*)(void*)>;
  VerbsRegion(uint8_t* data, size_t length, MemoryKind kind, uint64_t id, uint64_t transport_id,
              uint32_t lkey, uint32_t rkey, std::weak_ptr<Core> core, Owned owned,
              std::string registration)
      : MemoryRegion(data, length, kind, id),
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
      : RemoteRegion(key.length, key.region_id), key_(key), connection_id_(connection_id) {}
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
      : core_(std::move(core)),
        outbound_(outbound),
        peer_(std::move(peer)),
        chan_(std::move(chan)),
        sq_(sq_depth, kMaxBacklog, budget) {}

  uint64_t id() const override { return id_; }
  std::string peer() const override { return peer_; }
  std::string write_path() const override { return "write-with-imm"; }
  Result<std::shared_ptr<RemoteRegion>> import_region(std::span<const uint8_t> key) override;
  Status check_write(const WriteRequest& request) const override;
  Status write(const WriteRequest& request, Completion done) override;
  Status send(std::span<const uint8_t> message, Completion done) override;
  void close() override;
  bool is_open() const override { return open_.load(); }

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
  Status check_write(const VerbsConnection& c, const WriteRequest& req);
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
                                                std::string* how);
  void detect_cuda_support();

  // Connection setup (mu_ held).
  ConnPtr make_connection_locked(SideChannel chan, bool outbound, std::string peer);
  Status register_connection_locked(const ConnPtr& c);
  Status create_qp_locked(VerbsConnection& c);
  Hello make_hello_locked(const VerbsConnection& c, uint32_t psn, uint64_t nonce) const;
  Status to_rtr_locked(VerbsConnection& c, const Hello& peer);
  Status to_rts_locked(VerbsConnection& c);
  Status side_send_locked(VerbsConnection& c, std::span<const uint8_t> bytes);
  Status accept_hello_locked(const ConnPtr& c, const Hello& peer);
  Status complete_client_locked(const ConnPtr& c, const Hello& reply, Events& events);
  void promote_locked(const ConnPtr& c, Events& events);
  size_t pending_accepts_locked() const;

  // Data path (mu_ held).
  Status check_write_locked(const VerbsConnection& c, const WriteRequest& req) const;
  void drain_locked(const ConnPtr& c, Events& events);
  void drain_all_locked(Events& events);
  void break_locked(const ConnPtr& c, const Status& why, bool local, Events& events);
  void fail_device_locked(const Status& why, Events& events);
  void destroy_qp_locked(VerbsConnection& c);
  void reap_closed_locked(Events& events, std::vector<uint32_t>& reposts, Clock::time_point now);

  // Completions and events (mu_ held).
  size_t poll_send_cq_locked(Events& events);
  size_t poll_recv_cq_locked(Events& events, std::vector<uint32_t>& reposts);
  void on_send_completion_locked(const ibv_wc& wc, Events& events);
  void on_recv_completion_locked(const ibv_wc& wc, Events& events, std::vector<uint32_t>& reposts);
  bool peek_cqs_locked();
  void arm_cqs_locked();
  void post_receives_locked(const std::vector<uint32_t>& buffers);
  void slow_path_locked(Events& events, std::vector<uint32_t>& reposts, Clock::time_point now);
  void drain_cq_events_locked();
  void drain_async_events_locked(Events& events);
  void accept_all_locked(Events& events);
  void handle_side_channel_locked(const ConnPtr& c, uint32_t revents, Events& events);
  void process_side_input_locked(const ConnPtr& c, Events& events);
  ConnPtr find_qp_locked(uint32_t qp_num) const {
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

  std::mutex progress_mu_;
  std::atomic<std::thread::id> progress_owner_{};
  std::atomic<bool> teardown_deferred_{false};

  mutable std::mutex mu_;
  std::atomic<bool> shut_{false};
  bool torn_down_ = false;
  bool device_failed_ = false;
  SlotBudget cq_budget_{0};
  std::map<uint64_t, ConnPtr> conns_;
  std::unordered_map<uint32_t, ConnPtr> by_qp_;
  Events deferred_;                 // from calls outside progress(); run by the next one
  std::vector<ibv_wc> send_stash_;  // polled by wait(), handled by progress()
  std::vector<ibv_wc> recv_stash_;
  bool send_armed_ = false;
  bool recv_armed_ = false;
  bool slow_path_due_ = true;
  Clock::time_point last_slow_path_{};
  uint64_t next_wr_id_ = 1;
  uint64_t drain_cursor_ = 0;  // connection id drain_all_locked() served last
  AdaptiveSpin spin_{kMaxSpin};

  std::shared_mutex pd_mu_;
  std::mutex regions_mu_;
  std::map<uint64_t, ibv_mr*> mrs_;
  std::atomic<uint64_t> next_region_{1};

  PendingOps pending_;
  RegistrationCache<VerbsRegion> cache_;
};

VerbsRegion::~VerbsRegion() {
  if (auto core = core_.lock()) core->deregister(id());
}

// ---------------------------------------------------------------------------
// Setup

Status Core::init() {
  port_ = opts_.verbs.port;
  PSLD_RETURN_IF_ERROR(open_device());
  PSLD_RETURN_IF_ERROR(select_gid());
  PSLD_RETURN_IF_ERROR(create_queues());
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wake_fd_ < 0) return device_error("epoll_create1/eventfd", errno);
  PSLD_RETURN_IF_ERROR(epoll_add(wake_fd_, kTagWake, EPOLLIN));
  PSLD_RETURN_IF_ERROR(epoll_add(channel_->fd, kTagChannel, EPOLLIN));
  PSLD_RETURN_IF_ERROR(epoll_add(ctx_->async_fd, kTagAsync, EPOLLIN));
  PSLD_RETURN_IF_ERROR(start_listening());
  detect_cuda_support();
  PSLD_LOG_INFO("verbs: {} port {} ({}, {}), path MTU {}, {} send WRs per QP, SRQ of {}",
                device_name_, port_, link_ == LinkLayer::kEthernet ? "RoCE" : "InfiniBand",
                use_grh_ ? fmt::format("GID index {} {}", gid_index_, gid_.to_string())
                         : fmt::format("LID {:#x}", port_attr_.lid),
                mtu_name(port_attr_.active_mtu), sq_depth_, recv_pool_.count);
  return Status::Ok();
}

Status Core::open_device() {
  int num = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) {
    return Unavailable(fmt::format(
        "no RDMA device: ibv_get_device_list failed: {} (no RDMA support in this kernel?)",
        errno_text(errno)));
  }
  std::unique_ptr<ibv_device*, void (*)(ibv_device**)> guard(list, ibv_free_device_list);
  if (num == 0) {
    return Unavailable(
        "no RDMA device: libibverbs found none (no RDMA NIC, no Soft-RoCE/rxe link, or no "
        "provider library for it)");
  }
  std::vector<std::string> names, rejected;
  for (int i = 0; i < num && ctx_ == nullptr; ++i) {
    const std::string name = ibv_get_device_name(list[i]);
    names.push_back(name);
    if (!opts_.verbs.device.empty() && name != opts_.verbs.device) continue;
    if (list[i]->transport_type != IBV_TRANSPORT_IB) {
      // iWARP RC queue pairs can only be connected through rdmacm.
      rejected.push_back(name + " (not InfiniBand/RoCE)");
      continue;
    }
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) {
      rejected.push_back(fmt::format("{} (cannot open: {})", name, errno_text(errno)));
      continue;
    }
    ibv_device_attr dattr{};
    ibv_port_attr pattr{};
    std::string why;
    if (ibv_query_device(ctx, &dattr) != 0) {
      why = "ibv_query_device failed";
    } else if (port_ > dattr.phys_port_cnt) {
      why = fmt::format("has {} port(s), not port {}", dattr.phys_port_cnt, port_);
    } else if (ibv_query_port(ctx, port_, &pattr) != 0) {
      why = "ibv_query_port failed";
    } else if (pattr.state != IBV_PORT_ACTIVE) {
      why = fmt::format("port {} is {}", port_, ibv_port_state_str(pattr.state));
    } else if (pattr.link_layer != IBV_LINK_LAYER_ETHERNET && pattr.lid == 0) {
      why = fmt::format("port {} has no LID (is a subnet manager running?)", port_);
    }
    if (!why.empty()) {
      rejected.push_back(fmt::format("{} ({})", name, why));
      ibv_close_device(ctx);
      continue;
    }
    ctx_ = ctx;
    dev_attr_ = dattr;
    port_attr_ = pattr;
    device_name_ = name;
  }
  if (ctx_ != nullptr) return Status::Ok();
  if (!opts_.verbs.device.empty() && rejected.empty()) {
    return Unavailable(fmt::format("no RDMA device named '{}' (verbs.device); present: {}",
                                   opts_.verbs.device, fmt::join(names, ", ")));
  }
  return Unavailable(
      fmt::format("no RDMA device with an active port {}: {}", port_, fmt::join(rejected, "; ")));
}

// RoCE needs a GID (and a GRH on every packet); InfiniBand inside a subnet
// routes by LID and uses a GRH only when verbs.gid_index asks for one.
//
// gid_index -1 on RoCE picks, among the port's RoCE v2 GIDs, an IPv4-mapped
// one (::ffff:a.b.c.d: routable over IP, what RoCE clusters configure), else
// a global IPv6 one, else a link-local one, lowest index first. RoCE v1 GIDs
// are never picked automatically (not routable across subnets); name one with
// verbs.gid_index if the fabric is v1-only. The GID type comes from
// ibv_query_gid_ex (rdma-core >= 32).
Status Core::select_gid() {
  link_ = port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET ? LinkLayer::kEthernet
                                                           : LinkLayer::kInfiniBand;
  const int wanted = opts_.verbs.gid_index;
  if (wanted >= 0) {
    if (wanted >= port_attr_.gid_tbl_len) {
      return InvalidArgument(
          fmt::format("verbs.gid_index {} is past the GID table of {} port {} "
                      "({} entries; see show_gids)",
                      wanted, device_name_, port_, port_attr_.gid_tbl_len));
    }
    ibv_gid g{};
    if (ibv_query_gid(ctx_, port_, wanted, &g) != 0) {
      return device_error(
          fmt::format("ibv_query_gid({} port {} index {})", device_name_, port_, wanted), errno);
    }
    std::memcpy(gid_.raw.data(), g.raw, 16);
    if (gid_.is_zero()) {
      return InvalidArgument(fmt::format("verbs.gid_index {}: that entry of {} port {} is empty",
                                         wanted, device_name_, port_));
    }
    gid_index_ = wanted;
    use_grh_ = true;
    return Status::Ok();
  }
  if (link_ == LinkLayer::kInfiniBand) {
    ibv_gid g{};
    if (ibv_query_gid(ctx_, port_, 0, &g) == 0) std::memcpy(gid_.raw.data(), g.raw, 16);
    gid_index_ = 0;
    use_grh_ = false;
    return Status::Ok();
  }
  int best = -1, best_rank = 0;
  for (int i = 0; i < port_attr_.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx_, port_, static_cast<uint32_t>(i), &e, 0) != 0) continue;
    if (e.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    Gid g;
    std::memcpy(g.raw.data(), e.gid.raw, 16);
    if (g.is_zero()) continue;
    const bool link_local = g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80;
    const int rank = g.is_ipv4_mapped() ? 3 : link_local ? 1 : 2;
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
      gid_ = g;
    }
  }
  if (best < 0) {
    return Unavailable(fmt::format(
        "no RDMA device with a RoCE v2 GID: {} port {} has none (does its netdev have an IP "
        "address?); set verbs.gid_index to use another GID",
        device_name_, port_));
  }
  gid_index_ = best;
  use_grh_ = true;
  return Status::Ok();
}

Status Core::make_pool(BufferPool& pool, uint32_t count, uint32_t bytes, int access) {
  const size_t size = (static_cast<size_t>(count) * bytes + 4095) / 4096 * 4096;
  pool.mem = static_cast<uint8_t*>(std::aligned_alloc(4096, size));
  if (pool.mem == nullptr) return ResourceExhausted(fmt::format("cannot allocate {} bytes", size));
  std::memset(pool.mem, 0, size);
  pool.count = count;
  pool.bytes = bytes;
  pool.mr = ibv_reg_mr(pd_, pool.mem, size, access);
  if (pool.mr == nullptr) {
    return ResourceExhausted(fmt::format(
        "ibv_reg_mr of a {}-byte buffer pool: {} (raise ulimit -l)", size, errno_text(errno)));
  }
  pool.free.clear();
  for (uint32_t i = count; i > 0; --i) {
    pool.free.push_back(static_cast<int>(i - 1));
  }
  return Status::Ok();
}

Status Core::create_queues() {
  pd_ = ibv_alloc_pd(ctx_);
  if (pd_ == nullptr) return device_error("ibv_alloc_pd", errno);
  channel_ = ibv_create_comp_channel(ctx_);
  if (channel_ == nullptr) return device_error("ibv_create_comp_channel", errno);
  // Both fds are read inside progress(), which must never block.
  if (!set_nonblocking(channel_->fd) || !set_nonblocking(ctx_->async_fd)) {
    return device_error("making the completion channel non-blocking", errno);
  }
  if (dev_attr_.max_srq == 0 || dev_attr_.max_srq_wr == 0) {
    return Unimplemented(fmt::format("{} has no shared receive queues", device_name_));
  }
  const uint32_t srq_depth = std::min<uint32_t>(kSrqDepth, dev_attr_.max_srq_wr);
  const int max_cqe = std::max(dev_attr_.max_cqe, 1);
  send_cq_ = ibv_create_cq(ctx_, std::min(kSendCqDepth, max_cqe), nullptr, channel_, 0);
  // With an SRQ a receive completion needs a posted receive, so the SRQ
  // depth bounds what the receive CQ can hold; twice that is slack.
  recv_cq_ =
      ibv_create_cq(ctx_, std::min(static_cast<int>(2 * srq_depth), max_cqe), nullptr, channel_, 0);
  if (send_cq_ == nullptr || recv_cq_ == nullptr) return device_error("ibv_create_cq", errno);
  cq_budget_ = SlotBudget(static_cast<uint32_t>(send_cq_->cqe));
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = srq_depth;
  sa.attr.max_sge = 1;
  srq_ = ibv_create_srq(pd_, &sa);
  if (srq_ == nullptr) return device_error("ibv_create_srq", errno);

  PSLD_RETURN_IF_ERROR(make_pool(recv_pool_, srq_depth, kMaxMessageBytes, IBV_ACCESS_LOCAL_WRITE));
  // Send buffers are only read by the NIC; LOCAL_WRITE is harmless and some
  // providers want it for any MR used in a gather list.
  PSLD_RETURN_IF_ERROR(
      make_pool(send_pool_, kSendBuffers, kMaxMessageBytes, IBV_ACCESS_LOCAL_WRITE));
  std::vector<uint32_t> all;
  for (uint32_t i = 0; i < recv_pool_.count; ++i) {
    all.push_back(i);
  }
  recv_pool_.free.clear();  // the receive pool is "free" when posted
  {
    std::lock_guard<std::mutex> lock(mu_);
    post_receives_locked(all);
  }
  sq_depth_ = std::min<uint32_t>(opts_.verbs.max_inflight,
                                 static_cast<uint32_t>(std::max(dev_attr_.max_qp_wr, 1)));
  sq_depth_ = std::min(sq_depth_, cq_budget_.capacity());
  // wc.byte_len is 32 bits; a port reporting 0 gets the common 1 GiB.
  max_write_bytes_ = port_attr_.max_msg_sz != 0 ? port_attr_.max_msg_sz : (1u << 30);
  max_rd_atomic_ = static_cast<uint8_t>(std::min(1, dev_attr_.max_qp_init_rd_atom));
  max_dest_rd_atomic_ = static_cast<uint8_t>(std::min(1, dev_attr_.max_qp_rd_atom));
  return Status::Ok();
}

Status Core::epoll_add(int fd, uint64_t tag, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) return device_error("epoll_ctl(ADD)", errno);
  return Status::Ok();
}

void Core::epoll_del(int fd) {
  if (epfd_ >= 0 && fd >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
}

Status Core::start_listening() {
  if (opts_.common.listen_address.empty()) return Status::Ok();
  PSLD_ASSIGN_OR_RETURN(HostPort where, parse_host_port(opts_.common.listen_address, false));
  auto fd = tcp_listen(where);
  // Not Unavailable: a port in use is a configuration problem here.
  if (!fd.ok()) return FailedPrecondition(fd.status().message());
  listen_fd_ = *fd;
  PSLD_ASSIGN_OR_RETURN(HostPort bound, socket_address(listen_fd_, /*peer=*/false));
  address_ = format_host_port(bound);
  return epoll_add(listen_fd_, kTagListen, EPOLLIN);
}

Core::~Core() {
  teardown();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (epfd_ >= 0) ::close(epfd_);
}

// ---------------------------------------------------------------------------
// Memory

Result<std::shared_ptr<VerbsRegion>> Core::make_region(uint8_t* data, size_t length,
                                                       MemoryKind kind, VerbsRegion::Owned owned) {
  std::shared_lock<std::shared_mutex> pd_lock(pd_mu_);
  if (pd_ == nullptr) return Unavailable("verbs transport is shut down");
  // REMOTE_WRITE on every region: any registered region may be the target of
  // a peer's write once its remote_key() was handed out (landing slots and
  // pulled tensors both are). Which peers can write is decided by who gets
  // the key; the NIC enforces its bounds. No REMOTE_READ or atomics: psld
  // never issues them, so a key cannot be used to read our memory.
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  std::string how = "ibv_reg_mr";
  ibv_mr* mr = nullptr;
  if (kind == MemoryKind::kCuda) {
    PSLD_ASSIGN_OR_RETURN(mr, register_device_memory_locked(data, length, access, &how));
  } else {
    mr = ibv_reg_mr(pd_, data, length, access);
  }
  if (mr == nullptr) {
    const int err = errno;
    if (err == ENOMEM || err == EAGAIN) {
      return ResourceExhausted(
          fmt::format("ibv_reg_mr of {} bytes: {} (pinned memory limit: raise ulimit -l / memlock)",
                      length, errno_text(err)));
    }
    return InvalidArgument(fmt::format("ibv_reg_mr of {} bytes at {}: {}", length,
                                       static_cast<void*>(data), errno_text(err)));
  }
  const uint64_t id = next_region_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    mrs_[id] = mr;
  }
  return std::make_shared<VerbsRegion>(data, length, kind, id, transport_id_, mr->lkey, mr->rkey,
                                       weak_from_this(), std::move(owned), std::move(how));
}

// GPU memory: the CUDA driver exports the allocation as a dma-buf fd and the
// NIC registers that (ibv_reg_dmabuf_mr: the upstream kernel path since Linux
// 5.12, no out-of-tree module). Where that fails (older kernel or driver, a
// NIC driver without dma-buf support), ibv_reg_mr on the device pointer works
// when nvidia-peermem is loaded. The NIC addresses the MR by the pointer
// (iova = data), so the remote key's address is the same as for host memory.
void Core::detect_cuda_support() {
  Result<const CudaDriver*> driver = CudaDriver::get();
  if (!driver.ok()) {
    cuda_support_ = {false, fmt::format("{}; psld stages device tensors through host memory",
                                        driver.status().message())};
  } else {
#if PSLD_VERBS_HAVE_DMABUF
    const bool dmabuf = (*driver)->can_export_dmabuf();
#else
    const bool dmabuf = false;
#endif
    cuda_support_ = {true, dmabuf ? "ibv_reg_dmabuf_mr on a dma-buf of the allocation "
                                    "(cuMemGetHandleForAddressRange), else ibv_reg_mr through "
                                    "nvidia-peermem"
                                  : "ibv_reg_mr through nvidia-peermem (no dma-buf export: "
                                    "rdma-core or CUDA driver too old)"};
  }
  PSLD_LOG_INFO("verbs: CUDA memory {}: {}",
                cuda_support_.supported ? "supported" : "not supported", cuda_support_.detail);
}

Result<ibv_mr*> Core::register_device_memory_locked(uint8_t* data, size_t length, int access,
                                                    std::string* how) {
  if (!cuda_support_.supported) {
    return Unimplemented(
        fmt::format("verbs cannot register CUDA memory: {}", cuda_support_.detail));
  }
  PSLD_ASSIGN_OR_RETURN(const CudaDriver* driver, CudaDriver::get());
  PSLD_ASSIGN_OR_RETURN(const CudaDriver::Allocation range, driver->allocation_of(data, length));
  std::string dmabuf_failure;
#if PSLD_VERBS_HAVE_DMABUF
  if (Result<int> fd = driver->export_dmabuf(range); fd.ok()) {
    const uint64_t offset = reinterpret_cast<uintptr_t>(data) - range.base;
    ibv_mr* mr =
        ibv_reg_dmabuf_mr(pd_, offset, length, reinterpret_cast<uintptr_t>(data), *fd, access);
    const int err = errno;
    // The MR holds its own reference to the dma-buf.
    ::close(*fd);
    if (mr != nullptr) {
      *how = "ibv_reg_dmabuf_mr";
      return mr;
    }
    dmabuf_failure = fmt::format("ibv_reg_dmabuf_mr: {}", errno_text(err));
  } else {
    dmabuf_failure = fd.status().message();
  }
#else
  dmabuf_failure = "this rdma-core has no ibv_reg_dmabuf_mr (rdma-core >= 34 has)";
#endif
  ibv_mr* mr = ibv_reg_mr(pd_, data, length, access);
  if (mr == nullptr) {
    const int err = errno;
    return Unavailable(fmt::format(
        "cannot register CUDA memory [{}, +{}) with {}: the dma-buf path failed ({}), and "
        "ibv_reg_mr on the device pointer failed too ({}; it needs the nvidia-peermem module: "
        "modprobe nvidia-peermem); psld can stage device tensors through host memory instead",
        static_cast<void*>(data), length, device_name_, dmabuf_failure, errno_text(err)));
  }
  if (!peermem_fallback_logged_.exchange(true)) {
    PSLD_LOG_INFO(
        "verbs: CUDA memory registered with ibv_reg_mr (nvidia-peermem) because the "
        "dma-buf path failed: {}",
        dmabuf_failure);
  }
  *how = "ibv_reg_mr (nvidia-peermem)";
  return mr;
}

void Core::deregister(uint64_t region_id) {
  std::shared_lock<std::shared_mutex> pd_lock(pd_mu_);
  ibv_mr* mr = nullptr;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto it = mrs_.find(region_id);
    if (it == mrs_.end()) return;
    mr = it->second;
    mrs_.erase(it);
  }
  if (const int rc = ibv_dereg_mr(mr); rc != 0) {
    PSLD_LOG_WARN("verbs: ibv_dereg_mr of region {}: {}", region_id, errno_text(rc));
  }
}

Result<std::shared_ptr<MemoryRegion>> Core::register_memory(void* data, size_t length,
                                                            MemoryKind kind) {
  if (data == nullptr || length == 0) {
    return InvalidArgument("register_memory needs a non-null pointer and a non-zero length");
  }
  // CUDA memory: see register_device_memory_locked. Not settled here: whether
  // the bytes of a write into GPU memory are visible to a CUDA kernel as soon
  // as its WRITE_WITH_IMM completion arrives. NCCL flushes first (an RDMA
  // READ of the buffer, or cuFlushGPUDirectRDMAWrites); a server that reduces
  // landed GPU data may need the same (docs/transports.md, "GPU memory").
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return InvalidArgument("unknown memory kind");
  }
  if (kind == MemoryKind::kCuda && !cuda_support_.supported) {
    return Unimplemented(
        fmt::format("verbs cannot register CUDA memory: {}", cuda_support_.detail));
  }
  if (auto hit = cache_.find(data, length, kind)) return std::shared_ptr<MemoryRegion>(hit);
  PSLD_ASSIGN_OR_RETURN(auto region, make_region(static_cast<uint8_t*>(data), length, kind,
                                                 VerbsRegion::Owned(nullptr, std::free)));
  return std::shared_ptr<MemoryRegion>(cache_.insert(std::move(region)));
}

Result<std::shared_ptr<MemoryRegion>> Core::allocate_memory(size_t length, MemoryKind kind) {
  if (length == 0) return InvalidArgument("allocate_memory needs a non-zero length");
  if (kind == MemoryKind::kCuda) {
    return Unimplemented(
        "the verbs transport allocates host memory only; allocate device memory with "
        "cudaMalloc and register_memory it as kCuda");
  }
  if (kind != MemoryKind::kHost) return InvalidArgument("unknown memory kind");
  if (length > SIZE_MAX - 4095) return ResourceExhausted("allocation size overflows");
  // Page-aligned: the NIC pins whole pages anyway, and no other object shares
  // a page that a peer can write.
  const size_t rounded = (length + 4095) / 4096 * 4096;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
  if (p == nullptr) return ResourceExhausted(fmt::format("cannot allocate {} bytes", length));
  std::memset(p, 0, rounded);
  PSLD_ASSIGN_OR_RETURN(auto region,
                        make_region(p, length, kind, VerbsRegion::Owned(p, std::free)));
  return std::shared_ptr<MemoryRegion>(std::move(region));
}

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

  std::lock_guard<std::mutex> lock(mu_);
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

// ---------------------------------------------------------------------------
// Data path

Status Core::check_write_locked(const VerbsConnection& c, const WriteRequest& req) const {
  if (c.state_ == ConnState::kClosed) {
    return Unavailable(fmt::format("connection to {} is closed", c.peer_));
  }
  if (shut_.load()) return Unavailable("verbs transport is shut down");
  const auto* local = dynamic_cast<const VerbsRegion*>(req.local);
  if (local == nullptr || local->transport_id() != transport_id_) {
    return InvalidArgument("write source is not a region registered with this transport");
  }
  const auto* remote = dynamic_cast<const VerbsRemoteRegion*>(req.remote);
  if (remote == nullptr || remote->connection_id() != c.id_) {
    return InvalidArgument("write target was not imported on this connection");
  }
  if (req.local_offset > local->length() || req.length > local->length() - req.local_offset) {
    return OutOfRange(
        fmt::format("write of {} bytes at offset {} exceeds the {}-byte source region", req.length,
                    req.local_offset, local->length()));
  }
  if (req.remote_offset > remote->length() || req.length > remote->length() - req.remote_offset) {
    return OutOfRange(
        fmt::format("write of {} bytes at offset {} exceeds the {}-byte remote region", req.length,
                    req.remote_offset, remote->length()));
  }
  if (req.length > max_write_bytes_) {
    return OutOfRange(
        fmt::format("write of {} bytes exceeds the port's largest message ({} bytes); "
                    "split it",
                    req.length, max_write_bytes_));
  }
  if (c.peer_transport_id_ != 0 && remote->key().transport_id != c.peer_transport_id_) {
    return InvalidArgument("write target's remote key belongs to another transport");
  }
  return Status::Ok();
}

void Core::drain_locked(const ConnPtr& c, Events& events) {
  if (c->state_ != ConnState::kReady || c->sq_.backlog() == 0) return;
  Status failure;
  c->sq_.drain([&](SendItem& item) -> PostResult {
    // An operation that timed out while it waited here is not sent at all:
    // its caller was told Timeout and may already reuse the source.
    if (!pending_.contains(item.op_id)) return PostResult::kDropped;
    ibv_sge sge{};
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    Inflight rec;
    rec.op_id = item.op_id;
    rec.is_write = item.is_write;
    if (item.is_write) {
      sge.addr = item.local_addr;
      sge.length = item.length;
      sge.lkey = item.lkey;
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(item.imm);
      wr.wr.rdma.remote_addr = item.remote_addr;
      wr.wr.rdma.rkey = item.rkey;
      wr.num_sge = item.length > 0 ? 1 : 0;
      rec.src = item.src;
    } else {
      const auto size = static_cast<uint32_t>(item.bytes.size());
      wr.opcode = IBV_WR_SEND;
      wr.num_sge = size > 0 ? 1 : 0;
      if (size > 0 && size <= c->max_inline_) {
        // The provider copies inline data during ibv_post_send.
        sge.addr = reinterpret_cast<uintptr_t>(item.bytes.data());
        sge.length = size;
        wr.send_flags |= IBV_SEND_INLINE;
      } else if (size > 0) {
        if (send_pool_.free.empty()) return PostResult::kNotNow;
        rec.bounce = send_pool_.free.back();
        send_pool_.free.pop_back();
        uint8_t* buf = send_pool_.at(static_cast<uint32_t>(rec.bounce));
        std::memcpy(buf, item.bytes.data(), size);
        sge.addr = reinterpret_cast<uintptr_t>(buf);
        sge.length = size;
        sge.lkey = send_pool_.mr->lkey;
      }
    }
    const uint64_t wr_id = next_wr_id_++;
    wr.wr_id = wr_id;
    wr.sg_list = wr.num_sge > 0 ? &sge : nullptr;
    wr.send_flags |= IBV_SEND_SIGNALED;
    if (const int rc = ibv_post_send(c->qp_, &wr, &bad); rc != 0) {
      if (rec.bounce >= 0) send_pool_.free.push_back(rec.bounce);
      failure = Unavailable(fmt::format("ibv_post_send to {}: {}", c->peer_, errno_text(rc)));
      push_ready(events, pending_.take(item.op_id, failure));
      return PostResult::kFailed;
    }
    c->inflight_.emplace(wr_id, std::move(rec));
    return PostResult::kPosted;
  });
  if (!failure.ok()) break_locked(c, failure, false, events);
}

void Core::drain_all_locked(Events& events) {
  // Round-robin from where the last pass stopped: when the shared CQ budget
  // is what limits (more than kSendCqDepth / max_inflight busy connections),
  // every connection still gets its turn. Breaking a connection never erases
  // it from conns_ here, so the iterator stays valid.
  auto it = conns_.upper_bound(drain_cursor_);
  for (size_t n = 0; n < conns_.size(); ++n, ++it) {
    if (cq_budget_.used() >= cq_budget_.capacity()) return;
    if (it == conns_.end()) it = conns_.begin();
    const ConnPtr c = it->second;
    if (c->sq_.backlog() > 0) {
      drain_locked(c, events);
      drain_cursor_ = c->id_;
    }
  }
}

Status Core::check_write(const VerbsConnection& c, const WriteRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  return check_write_locked(c, req);
}

Status Core::write(VerbsConnection& c, const WriteRequest& req, Completion done) {
  Events events;
  std::lock_guard<std::mutex> lock(mu_);
  PSLD_RETURN_IF_ERROR(check_write_locked(c, req));
  if (c.sq_.backlog() >= c.sq_.max_backlog()) {
    return ResourceExhausted(
        fmt::format("{} operations already wait for send slots on {}; let progress() complete some",
                    c.sq_.backlog(), c.peer_));
  }
  const auto* local = static_cast<const VerbsRegion*>(req.local);
  const auto* remote = static_cast<const VerbsRemoteRegion*>(req.remote);
  SendItem item;
  item.src = local->weak_from_this().lock();
  if (!item.src) return InvalidArgument("write source region is being destroyed");
  item.is_write = true;
  item.local_addr = reinterpret_cast<uintptr_t>(local->data()) + req.local_offset;
  item.lkey = local->lkey();
  item.remote_addr = remote->key().addr + req.remote_offset;
  item.rkey = remote->key().rkey;
  item.remote_transport_id = remote->key().transport_id;
  item.length = static_cast<uint32_t>(req.length);
  item.imm = req.notify;
  item.op_id = pending_.add(c.id_, Clock::now() + opts_.common.op_timeout, std::move(done));
  (void)c.sq_.push(std::move(item));  // room was checked above
  drain_locked(c.shared_from_this(), events);
  if (!events.empty()) {
    for (Event& e : events) {
      deferred_.push_back(std::move(e));
    }
    wake();
  }
  return Status::Ok();
}

Status Core::send(VerbsConnection& c, std::span<const uint8_t> message, Completion done) {
  if (message.size() > kMaxMessageBytes) {
    return InvalidArgument(fmt::format("message of {} bytes exceeds the {}-byte limit",
                                       message.size(), kMaxMessageBytes));
  }
  Events events;
  std::lock_guard<std::mutex> lock(mu_);
  if (c.state_ == ConnState::kClosed || shut_.load()) {
    return Unavailable(fmt::format("connection to {} is closed", c.peer_));
  }
  if (c.sq_.backlog() >= c.sq_.max_backlog()) {
    return ResourceExhausted(
        fmt::format("{} operations already wait for send slots on {}; let progress() complete some",
                    c.sq_.backlog(), c.peer_));
  }
  SendItem item;
  item.bytes.assign(message.begin(), message.end());
  item.op_id = pending_.add(c.id_, Clock::now() + opts_.common.op_timeout, std::move(done));
  (void)c.sq_.push(std::move(item));
  drain_locked(c.shared_from_this(), events);
  if (!events.empty()) {
    for (Event& e : events) {
      deferred_.push_back(std::move(e));
    }
    wake();
  }
  return Status::Ok();
}

Result<std::shared_ptr<RemoteRegion>> Core::import_region(VerbsConnection& c,
                                                          std::span<const uint8_t> key) {
  PSLD_ASSIGN_OR_RETURN(RemoteKey k, decode_remote_key(key));
  std::lock_guard<std::mutex> lock(mu_);
  if (c.peer_transport_id_ != 0 && k.transport_id != c.peer_transport_id_) {
    return InvalidArgument(
        fmt::format("remote key belongs to transport {:#x}, not to this connection's peer {:#x}",
                    k.transport_id, c.peer_transport_id_));
  }
  return std::shared_ptr<RemoteRegion>(std::make_shared<VerbsRemoteRegion>(k, c.id_));
}

void Core::close(VerbsConnection& c) {
  Events events;
  std::lock_guard<std::mutex> lock(mu_);
  if (c.state_ == ConnState::kClosed) return;
  break_locked(c.shared_from_this(), Aborted("connection closed locally"), true, events);
  for (Event& e : events) {
    deferred_.push_back(std::move(e));
  }
  wake();
}

// Closes one connection: its side channel (with a goodbye when we close on
// purpose), its QP to ERR (flushing what is posted), its waiting and pending
// operations failed with `why`. The QP itself is destroyed later by
// reap_closed_locked(), once its flushed completions are in.
void Core::break_locked(const ConnPtr& c, const Status& why, bool local, Events& events) {
  if (c->state_ == ConnState::kClosed) return;
  c->state_ = ConnState::kClosed;
  c->open_ = false;
  if (c->chan_.is_open()) {
    if (local) {
      const uint8_t bye = kByeByte;
      (void)c->chan_.send({&bye, 1});  // best effort: the close says the same
      ::shutdown(c->chan_.fd(), SHUT_WR);
    }
    epoll_del(c->chan_.fd());
    c->chan_.close();
  }
  if (c->qp_ != nullptr) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    if (const int rc = ibv_modify_qp(c->qp_, &a, IBV_QP_STATE); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_modify_qp({:#x}, ERR): {}", c->qp_num_, errno_text(rc));
    }
    c->drain_deadline_ = Clock::now() + kQpDrainTimeout;
  }
  (void)c->sq_.take_backlog();  // their operations fail just below
  for (auto& r : pending_.fail_connection(c->id_, why)) {
    push_ready(events, std::move(r));
  }
  if (c->reported_) {
    Event e;
    e.kind = Event::Kind::kDisconnect;
    e.conn = c;
    e.why = why;
    events.push_back(std::move(e));
  }
  if (!why.ok() && !local) {
    PSLD_LOG_INFO("verbs: connection {} closed: {}", c->peer_, why.message());
  }
}

void Core::fail_device_locked(const Status& why, Events& events) {
  device_failed_ = true;
  std::vector<ConnPtr> all;
  for (auto& [id, c] : conns_) {
    all.push_back(c);
  }
  for (auto& c : all) {
    break_locked(c, why, false, events);
  }
}

// Destroys the QPs of closed connections once safe: every posted send has
// completed (flushed), and the device said the QP will take no more SRQ
// receives (or kQpDrainTimeout passed). The receive CQ is polled first so
// that no completion of this QP is left behind to be attributed to a later
// QP that gets the same number.
void Core::reap_closed_locked(Events& events, std::vector<uint32_t>& reposts,
                              Clock::time_point now) {
  std::vector<ConnPtr> done;
  for (auto& [id, c] : conns_) {
    if (c->state_ != ConnState::kClosed) continue;
    if (c->qp_ != nullptr) {
      if (!c->inflight_.empty() && now < c->drain_deadline_) continue;
      if (c->reached_rtr_ && !c->last_wqe_ && now < c->drain_deadline_) continue;
    }
    done.push_back(c);
  }
  if (done.empty()) return;
  while (poll_recv_cq_locked(events, reposts) >= kMaxCompletionsPerProgress) {
  }
  for (auto& c : done) {
    if (!c->inflight_.empty()) {
      PSLD_LOG_WARN("verbs: destroying QP {:#x} with {} unflushed work requests", c->qp_num_,
                    c->inflight_.size());
    }
    destroy_qp_locked(*c);
    conns_.erase(c->id_);
  }
}

// ---------------------------------------------------------------------------
// Completions

size_t Core::poll_send_cq_locked(Events& events) {
  size_t total = 0;
  for (const ibv_wc& wc : send_stash_) {
    on_send_completion_locked(wc, events);
  }
  total += send_stash_.size();
  send_stash_.clear();
  ibv_wc wcs[kPollBatch];
  while (total < kMaxCompletionsPerProgress) {
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n < 0) {
      fail_device_locked(Unavailable("ibv_poll_cq on the send CQ failed"), events);
      break;
    }
    for (int i = 0; i < n; ++i) {
      on_send_completion_locked(wcs[i], events);
    }
    total += static_cast<size_t>(n);
    if (n < kPollBatch) break;
  }
  return total;
}

size_t Core::poll_recv_cq_locked(Events& events, std::vector<uint32_t>& reposts) {
  size_t total = 0;
  for (const ibv_wc& wc : recv_stash_) {
    on_recv_completion_locked(wc, events, reposts);
  }
  total += recv_stash_.size();
  recv_stash_.clear();
  ibv_wc wcs[kPollBatch];
  while (total < kMaxCompletionsPerProgress) {
    const int n = ibv_poll_cq(recv_cq_, kPollBatch, wcs);
    if (n < 0) {
      fail_device_locked(Unavailable("ibv_poll_cq on the receive CQ failed"), events);
      break;
    }
    for (int i = 0; i < n; ++i) {
      on_recv_completion_locked(wcs[i], events, reposts);
    }
    total += static_cast<size_t>(n);
    if (n < kPollBatch) break;
  }
  return total;
}

void Core::on_send_completion_locked(const ibv_wc& wc, Events& events) {
  ConnPtr c = find_qp_locked(wc.qp_num);
  if (!c) return;  // its QP was destroyed by force; slots were returned then
  auto it = c->inflight_.find(wc.wr_id);
  if (it == c->inflight_.end()) {
    PSLD_LOG_WARN("verbs: completion for unknown work request {} on QP {:#x}", wc.wr_id, wc.qp_num);
    return;
  }
  Inflight rec = std::move(it->second);
  c->inflight_.erase(it);
  c->sq_.complete();
  if (rec.bounce >= 0) send_pool_.free.push_back(rec.bounce);
  if (wc.status == IBV_WC_SUCCESS) {
    push_ready(events, pending_.take(rec.op_id, Status::Ok()));
    return;
  }
  // Only wr_id, status, qp_num and vendor_err are valid in an error
  // completion. A flush error means the QP failed or was closed before:
  // the first error (or the close) already said why.
  Status why = Unavailable(fmt::format("{} to {} failed: {} (vendor error {:#x})",
                                       rec.is_write ? "RDMA write" : "send", c->peer_,
                                       ibv_wc_status_str(wc.status), wc.vendor_err));
  push_ready(events, pending_.take(rec.op_id, why));
  break_locked(c, why, false, events);
}

void Core::on_recv_completion_locked(const ibv_wc& wc, Events& events,
                                     std::vector<uint32_t>& reposts) {
  if (wc.wr_id >= recv_pool_.count) {
    PSLD_LOG_ERROR("verbs: receive completion with unknown buffer {}", wc.wr_id);
    return;
  }
  const auto buffer = static_cast<uint32_t>(wc.wr_id);
  reposts.push_back(buffer);  // after this progress() ran the handlers
  ConnPtr c = find_qp_locked(wc.qp_num);
  if (wc.status != IBV_WC_SUCCESS) {
    if (c) {
      break_locked(c,
                   Unavailable(fmt::format("receive from {} failed: {} (vendor error {:#x})",
                                           c->peer_, ibv_wc_status_str(wc.status), wc.vendor_err)),
                   false, events);
    }
    return;
  }
  if (!c || c->state_ == ConnState::kClosed) return;  // arrived after the close
  if (c->state_ == ConnState::kAwaitReady) promote_locked(c, events);
  Event e;
  e.conn = c;
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    e.kind = Event::Kind::kWrite;
    e.notify = ntohl(wc.imm_data);
    e.length = wc.byte_len;
  } else if (wc.opcode == IBV_WC_RECV && wc.byte_len <= kMaxMessageBytes) {
    e.kind = Event::Kind::kMessage;
    e.buffer = buffer;
    e.length = wc.byte_len;
  } else {
    break_locked(c,
                 Unavailable(fmt::format("unexpected receive from {} (opcode {}, {} bytes)",
                                         c->peer_, static_cast<int>(wc.opcode), wc.byte_len)),
                 false, events);
    return;
  }
  events.push_back(std::move(e));
}

// Polls both CQs into the stashes without handling anything; true if any
// completion is waiting.
bool Core::peek_cqs_locked() {
  if (send_stash_.size() < kMaxCompletionsPerProgress) {
    ibv_wc wcs[kPollBatch];
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n > 0) send_stash_.insert(send_stash_.end(), wcs, wcs + n);
    if (n < 0) slow_path_due_ = true;
  }
  if (recv_stash_.size() < kMaxCompletionsPerProgress) {
    ibv_wc wcs[kPollBatch];
    const int n = ibv_poll_cq(recv_cq_, kPollBatch, wcs);
    if (n > 0) recv_stash_.insert(recv_stash_.end(), wcs, wcs + n);
    if (n < 0) slow_path_due_ = true;
  }
  return !send_stash_.empty() || !recv_stash_.empty();
}

void Core::arm_cqs_locked() {
  if (!send_armed_) {
    if (const int rc = ibv_req_notify_cq(send_cq_, 0); rc == 0) {
      send_armed_ = true;
    } else {
      PSLD_LOG_WARN("verbs: ibv_req_notify_cq(send): {}", errno_text(rc));
    }
  }
  if (!recv_armed_) {
    if (const int rc = ibv_req_notify_cq(recv_cq_, 0); rc == 0) {
      recv_armed_ = true;
    } else {
      PSLD_LOG_WARN("verbs: ibv_req_notify_cq(recv): {}", errno_text(rc));
    }
  }
}

void Core::post_receives_locked(const std::vector<uint32_t>& buffers) {
  constexpr size_t kBatch = 64;
  ibv_recv_wr wrs[kBatch];
  ibv_sge sges[kBatch];
  for (size_t i = 0; i < buffers.size(); i += kBatch) {
    const size_t n = std::min(kBatch, buffers.size() - i);
    for (size_t j = 0; j < n; ++j) {
      const uint32_t b = buffers[i + j];
      sges[j].addr = reinterpret_cast<uintptr_t>(recv_pool_.at(b));
      sges[j].length = recv_pool_.bytes;
      sges[j].lkey = recv_pool_.mr->lkey;
      wrs[j] = ibv_recv_wr{};
      wrs[j].wr_id = b;
      wrs[j].sg_list = &sges[j];
      wrs[j].num_sge = 1;
      wrs[j].next = j + 1 < n ? &wrs[j + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (const int rc = ibv_post_srq_recv(srq_, wrs, &bad); rc != 0) {
      // Losing receive buffers shrinks the SRQ; senders then see more RNR
      // retries, not errors. Nothing else can be done about it here.
      PSLD_LOG_ERROR("verbs: ibv_post_srq_recv: {}", errno_text(rc));
    }
  }
}

void Core::drain_cq_events_locked() {
  ibv_cq* cq = nullptr;
  void* cq_context = nullptr;
  while (channel_ != nullptr && ibv_get_cq_event(channel_, &cq, &cq_context) == 0) {
    ibv_ack_cq_events(cq, 1);
    if (cq == send_cq_) send_armed_ = false;
    if (cq == recv_cq_) recv_armed_ = false;
  }
}

void Core::drain_async_events_locked(Events& events) {
  ibv_async_event ev{};
  while (ibv_get_async_event(ctx_, &ev) == 0) {
    const char* what = ibv_event_type_str(ev.event_type);
    switch (ev.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PATH_MIG_ERR:
        if (ConnPtr c = find_qp_locked(ev.element.qp->qp_num)) {
          break_locked(c, Unavailable(fmt::format("queue pair to {} failed: {}", c->peer_, what)),
                       false, events);
        }
        break;
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        if (ConnPtr c = find_qp_locked(ev.element.qp->qp_num)) c->last_wqe_ = true;
        break;
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_SRQ_ERR:
      case IBV_EVENT_DEVICE_FATAL:
        PSLD_LOG_ERROR("verbs: {} on {}: every connection fails", what, device_name_);
        fail_device_locked(Unavailable(fmt::format("RDMA device {}: {}", device_name_, what)),
                           events);
        break;
      case IBV_EVENT_PORT_ERR:
        PSLD_LOG_WARN("verbs: {} port {} went down", device_name_, ev.element.port_num);
        break;
      default:
        PSLD_LOG_DEBUG("verbs: async event {}", what);
        break;
    }
    ibv_ack_async_event(&ev);
  }
}

// ---------------------------------------------------------------------------
// progress / wait

void Core::slow_path_locked(Events& events, std::vector<uint32_t>& reposts, Clock::time_point now) {
  slow_path_due_ = false;
  last_slow_path_ = now;
  epoll_event evs[64];
  const int n = epoll_wait(epfd_, evs, 64, 0);
  for (int i = 0; i < n; ++i) {
    const uint64_t tag = evs[i].data.u64;
    if (tag == kTagWake) {
      uint64_t v = 0;
      while (::read(wake_fd_, &v, sizeof(v)) > 0) {
      }
    } else if (tag == kTagChannel) {
      drain_cq_events_locked();
    } else if (tag == kTagAsync) {
      drain_async_events_locked(events);
    } else if (tag == kTagListen) {
      if (listen_fd_ >= 0) accept_all_locked(events);
    } else {
      auto it = conns_.find(tag);
      if (it != conns_.end())
        handle_side_channel_locked(ConnPtr(it->second), evs[i].events, events);
    }
  }
  std::vector<ConnPtr> late;
  for (auto& [id, c] : conns_) {
    const bool handshaking = c->state_ == ConnState::kAwaitHello ||
                             c->state_ == ConnState::kAwaitReply ||
                             c->state_ == ConnState::kAwaitReady;
    if (handshaking && now >= c->handshake_deadline_) late.push_back(c);
  }
  for (auto& c : late) {
    if (!c->reported_) PSLD_LOG_WARN("verbs: handshake with {} timed out", c->peer_);
    break_locked(c,
                 Unavailable(fmt::format("handshake with {} did not finish within op_timeout "
                                         "({} ms); is the peer calling progress()?",
                                         c->peer_, opts_.common.op_timeout.count())),
                 false, events);
  }
  reap_closed_locked(events, reposts, now);
}

size_t Core::run_event(Event& e) {
  if (e.kind == Event::Kind::kCompletion) {
    e.ready.run();
    return 1;
  }
  if (shut_.load()) return 0;  // after shutdown() no handler runs
  switch (e.kind) {
    case Event::Kind::kAccept:
      handler_->on_accept(e.conn);
      break;
    case Event::Kind::kWrite:
      if (!e.conn->is_open()) return 0;  // closed by an earlier handler
      handler_->on_write(e.conn, e.notify, e.length);
      break;
    case Event::Kind::kMessage:
      if (!e.conn->is_open()) return 0;
      handler_->on_message(e.conn, {recv_pool_.at(e.buffer), static_cast<size_t>(e.length)});
      break;
    case Event::Kind::kDisconnect:
      handler_->on_disconnect(e.conn, e.why);
      break;
    case Event::Kind::kCompletion:
      break;
  }
  return 1;
}

size_t Core::progress() {
  std::lock_guard<std::mutex> progress_lock(progress_mu_);
  progress_owner_.store(std::this_thread::get_id());
  Events events;
  std::vector<uint32_t> reposts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!torn_down_) {
      events.swap(deferred_);
      const size_t work = poll_send_cq_locked(events) + poll_recv_cq_locked(events, reposts);
      const auto now = Clock::now();
      if (work == 0 || slow_path_due_ || now - last_slow_path_ >= kSlowPathInterval) {
        slow_path_locked(events, reposts, now);
      }
      drain_all_locked(events);
    }
  }
  for (auto& r : pending_.expire(Clock::now())) {
    push_ready(events, std::move(r));
  }
  size_t n = 0;
  for (Event& e : events) {
    n += run_event(e);
  }
  events.clear();  // drops connection references before teardown may run
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!torn_down_ && !reposts.empty()) post_receives_locked(reposts);
  }
  progress_owner_.store(std::thread::id());
  if (teardown_deferred_.exchange(false)) teardown();  // a handler called shutdown()
  return n;
}

void Core::wait(std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  const auto until = start + timeout;
  Clock::time_point timer = Clock::time_point::max();
  AdaptiveSpin::Micros spin_budget{0};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!torn_down_) {
      if (!deferred_.empty() || !send_stash_.empty() || !recv_stash_.empty() || slow_path_due_) {
        return;
      }
      spin_budget = spin_.budget();
    }
  }
  // Spin first while the adaptive budget says completions come quickly; the
  // lock is taken per poll so that writers on other threads get through.
  const auto spin_until = std::min(until, start + spin_budget);
  bool spun = false;
  while (Clock::now() < spin_until) {
    spun = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (torn_down_) break;
    if (peek_cqs_locked() || !deferred_.empty()) {
      spin_.found_work();
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!torn_down_) {
      if (spun) spin_.found_nothing();
      // Arm, then look once more: a completion that arrived between the last
      // poll and the arming raises no event.
      arm_cqs_locked();
      if (peek_cqs_locked()) return;
      for (const auto& [id, c] : conns_) {
        if (c->state_ == ConnState::kClosed) {
          timer = std::min(timer, Clock::now() + 10ms);  // a QP waits to be reaped
        } else if (c->state_ != ConnState::kReady) {
          timer = std::min(timer, c->handshake_deadline_);
        }
      }
    }
  }
  timer = std::min({timer, until, pending_.next_deadline()});
  const auto left = timer - Clock::now();
  const int ms = left <= Clock::duration::zero()
                     ? 0
                     : static_cast<int>(std::min<int64_t>(
                           std::chrono::ceil<std::chrono::milliseconds>(left).count(), INT32_MAX));
  epoll_event evs[16];
  const auto slept_from = Clock::now();
  const int n = epoll_wait(epfd_, evs, 16, ms);
  bool completion = false, other = false;
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == kTagWake) {
      uint64_t v = 0;
      while (::read(wake_fd_, &v, sizeof(v)) > 0) {
      }
    } else {
      (evs[i].data.u64 == kTagChannel ? completion : other) = true;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (completion || other) slow_path_due_ = true;
  // Woken by a completion soon after going to sleep: a spin would have
  // caught it for less.
  if (completion && Clock::now() - slept_from <= kMaxSpin) spin_.found_work();
}

void Core::wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  // EAGAIN means the counter is saturated: a wake is pending anyway.
  (void)!::write(wake_fd_, &one, sizeof(one));
}

// ---------------------------------------------------------------------------
// shutdown and teardown

void Core::shutdown() {
  Events failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_.exchange(true)) return;
    if (listen_fd_ >= 0) {
      epoll_del(listen_fd_);
      ::close(listen_fd_);
      listen_fd_ = -1;
    }
    std::vector<ConnPtr> all;
    for (auto& [id, c] : conns_) {
      all.push_back(c);
    }
    Events events;
    for (auto& c : all) {
      break_locked(c, Aborted("transport shut down"), true, events);
    }
    for (Event& e : deferred_) {
      events.push_back(std::move(e));
    }
    deferred_.clear();
    // Completions still owed run below, exactly once; handler events are
    // dropped (after shutdown no handler runs).
    for (Event& e : events) {
      if (e.kind == Event::Kind::kCompletion) failed.push_back(std::move(e));
    }
  }
  for (auto& r : pending_.fail_all(Aborted("transport shut down"))) {
    push_ready(failed, std::move(r));
  }
  for (Event& e : failed) {
    e.ready.run();
  }
  failed.clear();
  if (progress_owner_.load() == std::this_thread::get_id()) {
    teardown_deferred_ = true;  // a handler inside progress(): it tears down on return
  } else {
    std::lock_guard<std::mutex> progress_lock(progress_mu_);
    teardown();
  }
  wake();
}

// Releases the device in dependency order: QPs (flushed), SRQ, CQs,
// completion channel, MRs, PD, device context. Idempotent; the destructor
// calls it too (after a failed init, with whatever init created).
void Core::teardown() {
  // Regions released here must not be destroyed under pd_mu_ (their
  // destructor takes it shared): they die with this vector, after the locks.
  std::vector<std::shared_ptr<const VerbsRegion>> released;
  std::lock_guard<std::mutex> lock(mu_);
  if (torn_down_) return;
  torn_down_ = true;
  shut_ = true;

  // Collect the flushed completions of posted sends (every QP is in ERR
  // already), so bounce buffers and source regions are released in order.
  const auto deadline = Clock::now() + kTeardownDrain;
  auto busy = [&] {
    for (auto& [id, c] : conns_) {
      if (!c->inflight_.empty()) return true;
    }
    return false;
  };
  while (send_cq_ != nullptr && busy() && Clock::now() < deadline) {
    ibv_wc wcs[kPollBatch];
    const int n = ibv_poll_cq(send_cq_, kPollBatch, wcs);
    if (n < 0) break;
    for (int i = 0; i < n; ++i) {
      ConnPtr c = find_qp_locked(wcs[i].qp_num);
      if (!c) continue;
      auto it = c->inflight_.find(wcs[i].wr_id);
      if (it == c->inflight_.end()) continue;
      if (it->second.bounce >= 0) send_pool_.free.push_back(it->second.bounce);
      released.push_back(std::move(it->second.src));
      c->inflight_.erase(it);
      c->sq_.complete();
    }
    if (n == 0) std::this_thread::sleep_for(100us);
  }
  for (auto& [id, c] : conns_) {
    for (auto& [wr_id, rec] : c->inflight_) {
      released.push_back(std::move(rec.src));
    }
    destroy_qp_locked(*c);
  }
  conns_.clear();
  by_qp_.clear();
  send_stash_.clear();
  recv_stash_.clear();
  deferred_.clear();

  if (srq_ != nullptr) {
    if (const int rc = ibv_destroy_srq(srq_); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_destroy_srq: {}", errno_text(rc));
    }
    srq_ = nullptr;
  }
  drain_cq_events_locked();  // every CQ event must be acked before the CQ goes
  for (ibv_cq** cq : {&send_cq_, &recv_cq_}) {
    if (*cq != nullptr) {
      if (const int rc = ibv_destroy_cq(*cq); rc != 0) {
        PSLD_LOG_WARN("verbs: ibv_destroy_cq: {}", errno_text(rc));
      }
      *cq = nullptr;
    }
  }
  if (channel_ != nullptr) {
    epoll_del(channel_->fd);
    if (const int rc = ibv_destroy_comp_channel(channel_); rc != 0) {
      PSLD_LOG_WARN("verbs: ibv_destroy_comp_channel: {}", errno_text(rc));
    }
    channel_ = nullptr;
  }
  {
    std::unique_lock<std::shared_mutex> pd_lock(pd_mu_);
    for (BufferPool* pool : {&recv_pool_, &send_pool_}) {
      if (pool->mr != nullptr) ibv_dereg_mr(pool->mr);
      pool->mr = nullptr;
      std::free(pool->mem);
      pool->mem = nullptr;
      pool->free.clear();
    }
    {
      std::lock_guard<std::mutex> regions_lock(regions_mu_);
      for (auto& [id, mr] : mrs_) {
        if (const int rc = ibv_dereg_mr(mr); rc != 0) {
          PSLD_LOG_WARN("verbs: ibv_dereg_mr of region {}: {}", id, errno_text(rc));
        }
      }
      mrs_.clear();
    }
    if (pd_ != nullptr) {
      if (const int rc = ibv_dealloc_pd(pd_); rc != 0) {
        PSLD_LOG_WARN("verbs: ibv_dealloc_pd: {}", errno_text(rc));
      }
      pd_ = nullptr;
    }
  }
  if (ctx_ != nullptr) {
    epoll_del(ctx_->async_fd);
    ibv_close_device(ctx_);
    ctx_ = nullptr;
  }
  if (listen_fd_ >= 0) {
    epoll_del(listen_fd_);
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  cache_.clear();
}

// ---------------------------------------------------------------------------
// Connection methods: forward to the core, or fail once it is gone.

Result<std::shared_ptr<RemoteRegion>> VerbsConnection::import_region(std::span<const uint8_t> key) {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->import_region(*this, key);
}

Status VerbsConnection::check_write(const WriteRequest& request) const {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->check_write(*this, request);
}

Status VerbsConnection::write(const WriteRequest& request, Completion done) {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->write(*this, request, std::move(done));
}

Status VerbsConnection::send(std::span<const uint8_t> message, Completion done) {
  auto core = core_.lock();
  if (!core) return Unavailable("verbs transport is gone");
  return core->send(*this, message, std::move(done));
}

void VerbsConnection::close() {
  if (auto core = core_.lock()) core->close(*this);
  open_ = false;
}

// ---------------------------------------------------------------------------

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  ~VerbsTransport() override { shutdown(); }

  std::string_view name() const override { return "verbs"; }
  MemorySupport memory_support(MemoryKind kind) const override {
    return core_->memory_support(kind);
  }
  std::vector<uint8_t> address() const override { return core_->address(); }
  Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address) override {
    return core_->connect(peer_address);
  }
  Result<std::shared_ptr<MemoryRegion>> register_memory(void* data, size_t length,
                                                        MemoryKind kind) override {
    return core_->register_memory(data, length, kind);
  }
  Result<std::shared_ptr<MemoryRegion>> allocate_memory(size_t length, MemoryKind kind) override {
    return core_->allocate_memory(length, kind);
  }
  Status invalidate(void* data, size_t length) override { return core_->invalidate(data, length); }
  size_t progress() override { return core_->progress(); }
  void wait(std::chrono::milliseconds timeout) override { core_->wait(timeout); }
  void wake() override { core_->wake(); }
  void shutdown() override { core_->shutdown(); }

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace verbs

Result<std::unique_ptr<Transport>> create_verbs_transport(const TransportOptions& options,
                                                          Handler* handler) {
  if (handler == nullptr) return InvalidArgument("create_verbs_transport needs a Handler");
  PSLD_RETURN_IF_ERROR(verbs::validate_verbs_options(options));
  auto core = std::make_shared<verbs::Core>(options, handler);
  PSLD_RETURN_IF_ERROR(core->init());
  return std::unique_ptr<Transport>(new verbs::VerbsTransport(std::move(core)));
}

}  // namespace psld::transport
