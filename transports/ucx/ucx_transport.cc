// The UCX backend; see ucx_transport.h for what it offers and
// docs/transport-results.md for what it measured.
//
// Threading: one mutex (Core::mu_) guards the ucp_worker and every piece of
// connection state, and the worker runs in UCS_THREAD_MODE_SERIALIZED. Every
// UCX callback therefore runs with mu_ held (UCX only calls back from inside
// the ucp_* call that the locked thread made); callbacks never call the
// Handler or a Completion: they queue Events, and progress() delivers them
// after it released mu_, so a handler may call write/send/close freely.
// Callbacks that would have to call UCX themselves (answering a hello,
// closing an endpoint, starting the next flush) are deferred to
// run_deferred(), which runs under mu_ right after the UCX call returned.
//
// Two exceptions, both for the notification ring (see kRingMagic): a write
// publishes its ring record under its connection's tx_mu_ alone (and a small
// one without a completion is copied there too, without even a reference to
// the core: UcxCore::write_through_ring), and progress() reads rings, and
// calls on_write for their records, without mu_ while UCX is idle. Only the
// thread in progress() (progress_mu_) reads rings, so records and the events
// UCX's callbacks queue are still delivered in order.
#include "transports/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/log.h"
#include "base/wire.h"
#include "gpu/cuda_driver.h"
#include "transports/common/pending_ops.h"
#include "transports/common/registration_cache.h"

namespace psld::transport {
namespace {

constexpr uint32_t kKeyMagic = 0x4b585350;    // "PSXK"
constexpr uint32_t kHelloMagic = 0x48585350;  // "PSXH"
// 2: notifications and messages carry a sequence number, and the handshake
// offers a notification ring.
constexpr uint8_t kWireVersion = 2;
// UCX 1.13 packs 9..40 bytes of remote key per region; anything near this
// bound is not a key.
constexpr size_t kMaxPackedRkey = 4096;
// ucp_ep_rkey_unpack takes no length: it trusts the blob's own structure. The
// blob is copied into a zero-padded buffer so that even a blob that passed our
// checksum but lies about its contents cannot make UCX read past it.
constexpr size_t kRkeyPad = 256;
constexpr size_t kMaxAddressString = 256;
// Messages a client holds while its handshake is not answered yet.
constexpr size_t kMaxEarlyMessages = 1024;

// Active-message ids, one handler each.
enum AmId : unsigned {
  kAmHello = 0x50,  // client -> server: who I am
  kAmHelloAck,      // server -> client: who I am; the connection is ready
  kAmMessage,       // Connection::send
  kAmWrite,         // "am" write: header names the target, payload is the data
  kAmNotify,        // "put" writes: the notifications of a flushed batch
  kAmBye,           // Connection::close / shutdown: the peer should close too
  kAmWake,          // a ring record was written while the receiver slept in wait()
};

// The target of one write, as it travels in an "am" write's header and in a
// notification: validated by the receiver before it touches memory.
struct WriteHeader {
  uint64_t region = 0;
  uint64_t secret = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t notify = 0;
  // The connection's sequence number of this notification (see the
  // notification ring below); set when it is sent.
  uint64_t seq = 0;
};
constexpr size_t kWriteHeaderBytes = 44;
// kAmMessage carries its sequence number as the active message's header.
constexpr size_t kSeqHeaderBytes = 8;
// "am" writes up to this size are sent eagerly (UCP_AM_SEND_FLAG_EAGER):
// UCX 1.13 switches to rendezvous at 8 KiB over tcp, and its extra round trip
// dominates mid sizes. Measured here (tcp loopback, 16 writes in flight):
// 16 KiB 2.0 GiB/s eager vs 0.46 rendezvous, 64 KiB 3.1 vs 1.7, 128 KiB 3.6
// vs 3.1, 256 KiB even, 768 KiB rendezvous ahead (5.0-6.0 vs 4.5-5.1). A
// UCX_RNDV_THRESH in the environment switches this off.
constexpr size_t kAmEagerMax = 128 << 10;
// Notifications per active message: 64 * 44 bytes stays well inside UCX's
// eager limit (8 KiB on tcp and sm), so a batch is one message.
constexpr size_t kNotifyBatch = 64;

// Little-endian fields of `n` bytes (at most 8). On a little-endian host
// these are single unaligned moves: the byte loops they replace were not
// merged by the compiler and cost ~10 ns per ring record on each side.
inline void store_le(uint8_t* p, uint64_t v, size_t n) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, n);
  } else {
    for (size_t i = 0; i < n; ++i)
      p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}
inline uint64_t load_le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, n);
  } else {
    for (size_t i = 0; i < n; ++i)
      v |= static_cast<uint64_t>(p[i]) << (8 * i);
  }
  return v;
}
void encode_header(const WriteHeader& h, uint8_t* p) {
  store_le(p, h.region, 8);
  store_le(p + 8, h.secret, 8);
  store_le(p + 16, h.offset, 8);
  store_le(p + 24, h.length, 8);
  store_le(p + 32, h.notify, 4);
  store_le(p + 36, h.seq, 8);
}
WriteHeader decode_header(const uint8_t* p) {
  return WriteHeader{load_le(p, 8),
                     load_le(p + 8, 8),
                     load_le(p + 16, 8),
                     load_le(p + 24, 8),
                     static_cast<uint32_t>(load_le(p + 32, 4)),
                     load_le(p + 36, 8)};
}

// ---------------------------------------------------------------------------
// The notification ring
//
// A write into a local peer's mapped memory is a memcpy; sending its
// notification as an active message cost more than the copy (UCX's am path,
// the worker's tcp lanes polled on every progress: 690 ns one way at 8 B
// against 50 ns for ucx_perftest's ucp_put_lat). So each side of a
// connection offers, in its handshake, a ring of notification records in
// shared memory it allocated (ucp_mem_map with UCP_MEM_MAP_ALLOCATE); a peer
// on the same host maps it through ucp_rkey_ptr and writes records, and the
// owner polls it in progress(). Layout (all little-endian host order: both
// ends run on one host):
//
//   [0, 64)    magic and slot count; written once by the owner
//   [64, 128)  consumed: how many records the owner has read; by the owner
//   [128, 192) sleep epoch, odd while the owner is in wait(); by the owner
//   [192, 256) attached: non-zero while a peer writes here; by the peer
//   [256, ...) slots of 64-byte records, by the peer: the WriteHeader fields,
//              then a stamp at byte 56, stored last with release: ring
//              position + 1, so a slot holds position p exactly when its
//              stamp is p + 1.
//
// Flow control: the writer has at most `slots` records unread (it re-reads
// `consumed` only when its cached copy says full); a full ring falls back to
// an active message. Ordering: every notification and message of a
// connection has a sequence number, whatever carries it; the owner delivers a
// ring record only when its number is the next one, and an active message
// first delivers the ring records numbered below it. Sleep: the owner makes
// its sleep epoch odd before it sleeps and then looks at its rings once more;
// a writer reads the epoch after publishing (a full fence on both sides, so
// one of the two sees the other) and, once per odd epoch, sends kAmWake,
// whose arrival wakes the owner's worker event fd.
constexpr uint64_t kRingMagic = 0x474e495258535000ull;  // "PSXRING\0" read as bytes
constexpr size_t kRingHeaderBytes = 256;
constexpr size_t kRingConsumedAt = 64;
constexpr size_t kRingSleepingAt = 128;
constexpr size_t kRingAttachedAt = 192;
constexpr size_t kRingRecordBytes = 64;
constexpr size_t kRingStampAt = 56;
constexpr uint32_t kMinRingSlots = 16;
constexpr uint32_t kMaxRingSlots = 65536;
// The largest write copied under its connection's tx_mu_ alone
// (UcxCore::write_through_ring); larger ones copy in parallel.
constexpr uint64_t kRingCopyMax = 64 * 1024;
constexpr int kRingPollsPerCall = 4;
// While a ring is in use and UCX has nothing to do, progress() calls
// ucp_worker_progress at most once per this period and polls only the rings
// in between: with tcp lanes on the endpoint a worker progress is an
// epoll_wait, ~300 ns here, against ~40 ns for a ring poll. A period, not a
// count of calls: a caller that progresses this transport once per
// millisecond (a loop that waits on another one) must not see UCX progressed
// only every few dozen milliseconds (with a count of 32 calls, the lifecycle
// test's 1,000 shared-memory connections took 141 s instead of 6-11 s). Any
// UCX work, any new operation and any wait() make the next progress() poll
// UCX again.
//
// The period backs off: it doubles, up to kUcxPollPeriodMax, each time the
// worker had nothing to do, and is back to kUcxPollPeriod when it had. Only
// rings in use: one worker progress per ~50 us (~1% of a busy poll's time,
// against ~10% every 3 us; in the shared-memory ping-pong that was ~10 ns of
// the one-way latency). A message from another peer then waits at most that
// period for a progress() that polls the rings only.
//
// Each such call polls the rings up to kRingPollsPerCall times while they
// are empty: a busy-polling caller then pays progress()'s lock and the clock
// read once per several polls, and notices a record sooner.
//
// The period is read from the time-stamp counter where there is one: 10 ns
// here against 22 ns for steady_clock, in a loop of ~40 ns. It is not
// converted to time: 10,000 ticks are 2.5-10 us at the 1-4 GHz of any x86-64
// server, which is all this heuristic needs.
#if defined(__x86_64__)
uint64_t poll_clock() {
  return __rdtsc();
}
constexpr uint64_t kUcxPollPeriod = 10000;  // ticks
constexpr uint64_t kUcxPollPeriodMax = 16 * kUcxPollPeriod;
#else
uint64_t poll_clock() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}
constexpr uint64_t kUcxPollPeriod = 4000;  // ns
constexpr uint64_t kUcxPollPeriodMax = 16 * kUcxPollPeriod;
#endif

// Adds one to a counter that only the holder of a lock writes (and others
// only read): a load and a store, not an atomic read-modify-write.
void count_one(std::atomic<uint64_t>& counter) {
  counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

std::atomic_ref<uint64_t> ring_word(uint8_t* base, size_t at) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + at));
}

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

uint64_t fnv1a(std::span<const uint8_t> b) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t c : b)
    h = (h ^ c) * 1099511628211ull;
  return h;
}

std::atomic<uint64_t> g_next_connection_id{1};

Status ucs_to_status(ucs_status_t st, std::string_view what) {
  std::string msg = fmt::format("{}: {}", what, ucs_status_string(st));
  switch (st) {
    case UCS_OK:
      return Status::Ok();
    case UCS_ERR_CANCELED:
      return Aborted(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return ResourceExhausted(std::move(msg));
    case UCS_ERR_INVALID_PARAM:
      return InvalidArgument(std::move(msg));
    case UCS_ERR_UNSUPPORTED:
      return Unimplemented(std::move(msg));
    default:
      return Unavailable(std::move(msg));
  }
}

// "host:port" or "[v6]:port" -> a socket address.
Status parse_socket_address(const std::string& text, bool passive, sockaddr_storage* out,
                            socklen_t* out_len) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 == text.size()) {
    return InvalidArgument(
        fmt::format("'{}' is not a socket address; use host:port, e.g. 127.0.0.1:0", text));
  }
  std::string host = text.substr(0, colon);
  const std::string port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgument(fmt::format("cannot resolve '{}': {}", text, gai_strerror(rc)));
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  freeaddrinfo(res);
  return Status::Ok();
}

std::string socket_address_string(const sockaddr_storage& sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (sa.ss_family == AF_INET) {
    sockaddr_in in;
    std::memcpy(&in, &sa, sizeof(in));
    inet_ntop(AF_INET, &in.sin_addr, host, sizeof(host));
    port = ntohs(in.sin_port);
    return fmt::format("{}:{}", host, port);
  }
  if (sa.ss_family == AF_INET6) {
    sockaddr_in6 in6;
    std::memcpy(&in6, &sa, sizeof(in6));
    inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof(host));
    port = ntohs(in6.sin6_port);
    return fmt::format("[{}]:{}", host, port);
  }
  return "unknown";
}

// What ucp_ep_print_info says about an endpoint's lanes, condensed.
enum class RmaKind : uint8_t { kEmulated, kSharedMemory, kRdma };

struct LaneSummary {
  RmaKind rma = RmaKind::kEmulated;
  std::string text;  // one line for the log
};

// Parses UCX 1.13's ucp_ep_print_info, e.g.
//   #  lane[1]:  2:sysv/memory.0 md[1] -> md[1]/sysv/sysdev[255] am am_bw#0 keepalive
//   #  lane[3]:  0:tcp/lo.0 md[0]      -> md[0]/tcp/sysdev[255] rma_bw#0 wireup
//   #  am_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)
//   #  put[1]: 0..<short>..4294967296..<bcopy>..(inf)
// "put[N]" lines exist only for lanes that carry native RMA; over tcp there
// are none, because UCX 1.13 emulates put with active messages there.
LaneSummary summarize_lanes(const std::string& info) {
  struct Lane {
    std::string name;  // tl/dev
    std::string tl;
    std::vector<std::string> roles;
  };
  std::map<int, Lane> lanes;
  std::set<int> rma_lanes;
  std::string am_send;
  std::istringstream in(info);
  std::string line;
  while (std::getline(in, line)) {
    size_t p = line.find_first_not_of("# \t");
    if (p == std::string::npos) continue;
    std::string_view l(line);
    l.remove_prefix(p);
    auto index_of = [&](std::string_view prefix) -> int {
      if (l.substr(0, prefix.size()) != prefix) return -1;
      return std::atoi(std::string(l.substr(prefix.size())).c_str());
    };
    if (int i = index_of("lane["); i >= 0) {
      const size_t colon = l.find("]:");
      if (colon == std::string_view::npos) continue;
      std::istringstream words{std::string(l.substr(colon + 2))};
      std::vector<std::string> tokens;
      for (std::string w; words >> w;)
        tokens.push_back(w);
      if (tokens.empty() || tokens[0] == "cm") continue;  // the connection manager lane
      Lane lane;
      const size_t c = tokens[0].find(':');
      lane.name = c == std::string::npos ? tokens[0] : tokens[0].substr(c + 1);
      lane.tl = lane.name.substr(0, lane.name.find('/'));
      auto arrow = std::find(tokens.begin(), tokens.end(), "->");
      if (arrow != tokens.end() && arrow + 1 != tokens.end()) {
        lane.roles.assign(arrow + 2, tokens.end());
      }
      lanes[i] = lane;
    } else if (int j = index_of("put["); j >= 0) {
      rma_lanes.insert(j);
    } else if (l.substr(0, 8) == "am_send:") {
      am_send = std::string(l.substr(8));
      am_send.erase(0, am_send.find_first_not_of(' '));
    }
  }
  static const std::set<std::string> kShm = {"posix", "sysv", "xpmem", "knem", "cma", "self"};
  LaneSummary s;
  std::vector<std::string> am, rma, rndv, keepalive;
  for (auto& [i, lane] : lanes) {
    for (const std::string& role : lane.roles) {
      if (role == "am") am.push_back(lane.name);
      if (role.rfind("rma_bw", 0) == 0) rndv.push_back(lane.name);
      if (role == "keepalive") keepalive.push_back(lane.name);
    }
    if (rma_lanes.count(i) && lane.tl != "tcp") {
      rma.push_back(lane.name);
      const RmaKind k = kShm.count(lane.tl) ? RmaKind::kSharedMemory : RmaKind::kRdma;
      if (static_cast<int>(k) > static_cast<int>(s.rma)) s.rma = k;
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ","));
  };
  s.text = fmt::format("am={} rma={} rndv={} keepalive={} am_send={}", join(am),
                       rma.empty() ? std::string("emulated") : join(rma), join(rndv),
                       join(keepalive), am_send.empty() ? std::string("?") : am_send);
  return s;
}

std::string endpoint_info(ucp_ep_h ep) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return {};
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string out(buf, size);
  std::free(buf);
  return out;
}

enum class WritePath : uint8_t { kAuto, kPut, kAm };

// Whether a UCX_TLS list can select a shared-memory (mm) transport; only then
// is MM_ERROR_HANDLING meaningful (UCX warns about it otherwise).
bool tls_may_use_shared_memory(const std::string& option) {
  std::string tls = option;
  if (tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls = env != nullptr ? env : "all";
  }
  if (tls.empty() || tls[0] == '^') return true;  // an exclusion list keeps the rest
  std::istringstream in(tls);
  for (std::string name; std::getline(in, name, ',');) {
    if (name == "all" || name == "sm" || name == "shm" || name == "mm" || name == "posix" ||
        name == "sysv" || name == "xpmem") {
      return true;
    }
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------

class UcxCore;
class UcxConnection;

// The ucp_context, shared by the core and every region so that a region that
// outlives its transport can still be unmapped.
struct UcxContext {
  ucp_context_h handle = nullptr;
  UcxContext() = default;
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ~UcxContext() {
    if (handle != nullptr) ucp_cleanup(handle);
  }
};

// MemoryRegion::backend() and RemoteRegion::backend() of this backend's
// regions: check_write tells its own regions by these, not by dynamic_cast
// (two of them were ~10% of a shared-memory write).
const char kUcxRegionTag = 'L';
const char kUcxRemoteRegionTag = 'R';

class UcxRegion final : public MemoryRegion, public std::enable_shared_from_this<UcxRegion> {
 public:
  UcxRegion(uint8_t* data, size_t length, MemoryKind kind, uint64_t id,
            std::shared_ptr<UcxContext> context, ucp_mem_h memh, uint64_t owner, uint64_t secret,
            std::vector<uint8_t> key)
      : MemoryRegion(data, length, kind, id, &kUcxRegionTag),
        context_(std::move(context)),
        memh_(memh),
        owner_(owner),
        secret_(secret) {
    remote_key_ = std::move(key);
    registration_ =
        kind == MemoryKind::kCuda ? "ucp_mem_map (UCS_MEMORY_TYPE_CUDA)" : "ucp_mem_map";
  }
  ~UcxRegion() override { ucp_mem_unmap(context_->handle, memh_); }

  ucp_mem_h memh() const { return memh_; }
  uint64_t owner() const { return owner_; }
  uint64_t secret() const { return secret_; }

 private:
  std::shared_ptr<UcxContext> context_;
  ucp_mem_h memh_;
  uint64_t owner_;
  uint64_t secret_;
};

class UcxRemoteRegion final : public RemoteRegion,
                              public std::enable_shared_from_this<UcxRemoteRegion> {
 public:
  UcxRemoteRegion(size_t length, uint64_t region_id, MemoryKind kind, uint64_t connection_id,
                  uint64_t owner, uint64_t base, uint64_t secret, uint8_t* mapped, ucp_rkey_h rkey,
                  std::weak_ptr<UcxCore> core)
      : RemoteRegion(length, region_id, &kUcxRemoteRegionTag),
        kind_(kind),
        connection_id_(connection_id),
        owner_(owner),
        base_(base),
        secret_(secret),
        mapped_(mapped != nullptr),
        mapped_base_(mapped),
        rkey_(rkey),
        core_(std::move(core)) {}
  ~UcxRemoteRegion() override;

  uint64_t connection_id() const { return connection_id_; }
  // Where the exporter's memory is: device memory is never copied into by
  // this process's CPU, and is written by rendezvous, never eagerly.
  MemoryKind kind() const { return kind_; }
  // The instance of the transport that exported the region.
  uint64_t owner() const { return owner_; }
  uint64_t base() const { return base_; }
  uint64_t secret() const { return secret_; }
  // The exporter's memory is mapped into ours (shared memory), so a put is a
  // memcpy by this process.
  bool mapped() const { return mapped_; }
  // Where the region starts in this process (Transport::local_view); read
  // without UcxCore::mapping_mu_: set at import, cleared only by shutdown().
  const uint8_t* mapped_base() const { return mapped_base_; }

 private:
  friend class UcxCore;
  MemoryKind kind_;
  uint64_t connection_id_;
  uint64_t owner_;
  uint64_t base_;
  uint64_t secret_;
  bool mapped_;
  uint8_t* mapped_base_;  // where base() is mapped here; guarded by UcxCore::mapping_mu_
  ucp_rkey_h rkey_;       // guarded by UcxCore::rkey_mu_ for destruction; read under UcxCore::mu_
  std::weak_ptr<UcxCore> core_;
};

// This side's notification ring of one connection: shared memory the peer
// writes records into and progress() polls. Freed when the connection lets
// go of it; a peer that still has it mapped keeps writing into its own
// mapping harmlessly.
class RxRing {
 public:
  RxRing(std::shared_ptr<UcxContext> context, ucp_mem_h memh, uint8_t* base, uint32_t slots,
         std::vector<uint8_t> packed)
      : context_(std::move(context)),
        memh_(memh),
        base_(base),
        slots_(slots),
        packed_(std::move(packed)) {}
  ~RxRing() { ucp_mem_unmap(context_->handle, memh_); }
  RxRing(const RxRing&) = delete;
  RxRing& operator=(const RxRing&) = delete;

  uint8_t* base() const { return base_; }
  uint32_t slots() const { return slots_; }
  const std::vector<uint8_t>& packed() const { return packed_; }
  uint8_t* slot(uint64_t position) const {
    return base_ + kRingHeaderBytes + (position & (slots_ - 1)) * kRingRecordBytes;
  }
  // Whether the record at ring position `position` is there.
  // seq_cst, not just acquire: with the stamp's store and the sleep flag's
  // store and load it is one side of the sleep handshake (ring_notify and
  // wait()); on x86-64 it is the same plain load.
  bool ready(uint64_t position) const {
    return ring_word(slot(position), kRingStampAt).load(std::memory_order_seq_cst) == position + 1;
  }
  bool attached() const {
    return ring_word(base_, kRingAttachedAt).load(std::memory_order_relaxed) != 0;
  }

  // Next ring position to read. Written only by the thread in progress()
  // (progress_mu_); atomic because wait() looks at it from any thread.
  std::atomic<uint64_t> read{0};

 private:
  std::shared_ptr<UcxContext> context_;
  ucp_mem_h memh_;
  uint8_t* base_;
  uint32_t slots_;
  std::vector<uint8_t> packed_;  // UCX's packed remote key, for the handshake
};

// The peer's notification ring, mapped here; guarded by its connection's
// tx_mu_.
struct TxRing {
  ucp_rkey_h rkey = nullptr;
  uint8_t* base = nullptr;
  uint32_t slots = 0;
  uint64_t written = 0;   // records published
  uint64_t consumed = 0;  // the owner's `consumed`, as last read
  // The owner's sleep epoch we last sent kAmWake for: one wake-up ends that
  // sleep, so the writes that follow it need none.
  uint64_t woken_epoch = 0;
};

class UcxConnection final : public Connection, public std::enable_shared_from_this<UcxConnection> {
 public:
  UcxConnection(UcxCore* core, std::weak_ptr<UcxCore> weak_core, bool client, std::string peer)
      : core_(std::move(weak_core)), core_raw_(core), client_(client), peer_(std::move(peer)) {}

  uint64_t id() const override { return id_; }
  std::string peer() const override { return peer_; }
  std::string write_path() const override {
    switch (path_.load()) {
      case WritePath::kPut:
        return "put";
      case WritePath::kAm:
        return "am";
      case WritePath::kAuto:
        break;
    }
    return "pending (handshake not finished)";
  }
  Result<std::shared_ptr<RemoteRegion>> import_region(std::span<const uint8_t> key) override;
  Status check_write(const WriteRequest& request) const override;
  Status write(const WriteRequest& request, Completion done) override;
  Status send(std::span<const uint8_t> message, Completion done) override;
  void close() override;
  bool is_open() const override { return open_.load(); }

  // A put that waits for the flush that makes it visible.
  struct Unflushed {
    uint64_t op_id;
    WriteHeader header;
  };

 private:
  friend class UcxCore;
  enum class State : uint8_t { kHandshake, kReady, kClosed };

  // An operation started before the handshake finished; sent when it does.
  struct Queued {
    uint64_t op_id = 0;
    bool is_write = false;
    std::shared_ptr<UcxRegion> src;
    std::shared_ptr<UcxRemoteRegion> remote;
    uint64_t local_offset = 0, remote_offset = 0, length = 0;
    uint32_t notify = 0;
    std::vector<uint8_t> message;
  };
  const uint64_t id_ = g_next_connection_id.fetch_add(1);
  std::weak_ptr<UcxCore> core_;
  // The same core, for UcxCore::write_through_ring only, which uses it only
  // while this connection's tx_ring_ is set (see there).
  UcxCore* const core_raw_;
  const bool client_;
  const std::string peer_;
  std::atomic<bool> open_{true};
  std::atomic<WritePath> path_{WritePath::kAuto};

  // Guarded by UcxCore::mu_.
  State state_ = State::kHandshake;
  ucp_ep_h ep_ = nullptr;
  // The peer transport's instance, from the handshake (0 before): the
  // exporter every imported key must name. Atomic: check_write reads it
  // without mu_.
  std::atomic<uint64_t> peer_instance_{0};
  RmaKind rma_ = RmaKind::kEmulated;
  // A write went by am to a region the peer did not allocate through the
  // transport: said once per connection (a peer may have thousands).
  bool am_fallback_logged_ = false;
  Clock::time_point handshake_deadline_;
  bool bye_in_flight_ = false;
  Clock::time_point bye_deadline_;
  std::deque<Queued> queued_;
  // Messages that arrived before the server's handshake answer (client side),
  // with their sequence numbers.
  struct Early {
    unsigned id;
    uint64_t seq;
    std::vector<uint8_t> bytes;
  };
  std::vector<Early> early_;
  // This side's notification ring (offered in the handshake), the next
  // sequence number to deliver, and what the log line says about the rings.
  std::shared_ptr<RxRing> rx_ring_;
  // Written only by the thread in progress(), like RxRing::read.
  std::atomic<uint64_t> rx_next_seq_{0};
  std::string ring_note_;

  // The sending side of the ordering: the next sequence number, and the
  // peer's ring when it is mapped here. Held while a sequence number is
  // taken until its record is published or its active message is handed to
  // UCX, so numbers are visible to the peer in order; after mu_ when both are
  // held.
  std::mutex tx_mu_;
  uint64_t tx_seq_ = 0;
  std::unique_ptr<TxRing> tx_ring_;
  // Set once the peer's ring is mapped: write() skips tx_mu_ when false.
  std::atomic<bool> tx_ring_mapped_{false};
  // Records published in the peer's ring, and writes done by
  // write_through_ring; counted here under tx_mu_ (no atomic read-modify-
  // write on the write path), summed by UcxCore::counters(). Atomic only for
  // counters(), which reads them without tx_mu_.
  std::atomic<uint64_t> ring_records_{0};
  std::atomic<uint64_t> ring_writes_{0};
  std::vector<Unflushed> unflushed_;  // puts issued, not yet covered by a flush
  bool flush_in_flight_ = false;
};

// One outstanding UCX request (or one operation that completed at once).
struct OpCtx {
  enum Kind : uint8_t {
    kPut,
    kFlush,
    kAmWrite,
    kSend,
    kControl,
    kBye,
    kRecvWrite,
    kRecvControl,
    kClose
  };
  Kind kind;
  UcxCore* core = nullptr;
  OpCtx* prev = nullptr;  // intrusive list of live requests, for timeouts and shutdown
  OpCtx* next = nullptr;
  void* request = nullptr;
  uint64_t op_id = 0;  // the user's operation, 0 for internal ones
  Clock::time_point deadline = Clock::time_point::max();
  std::shared_ptr<UcxConnection> conn;
  std::shared_ptr<UcxRegion> region;        // source or target, kept registered
  std::shared_ptr<UcxRemoteRegion> remote;  // keeps the rkey of a put alive
  uint8_t header[kWriteHeaderBytes] = {};
  uint32_t notify = 0;
  uint64_t length = 0;
  unsigned am_id = 0;
  uint64_t seq = 0;  // of a message received by rendezvous
  std::vector<uint8_t> bytes;
  std::vector<UcxConnection::Unflushed> batch;
};

// What progress() delivers, in order, after releasing the worker lock.
struct Event {
  enum Kind : uint8_t { kCompletion, kAccept, kWrite, kMessage, kDisconnect };
  Kind kind = kCompletion;
  PendingOps::Ready ready;
  ConnectionPtr conn;
  uint32_t notify = 0;
  uint64_t length = 0;
  std::vector<uint8_t> bytes;
  Status why;
};

// A user's write or send. Most finish inside the call that starts them (a
// short message, a copy into shared memory): those never enter PendingOps and
// their completion is queued at once. One that has to wait for UCX is added to
// PendingOps then (op_id != 0), which gives it its deadline and makes close
// and shutdown fail it. This keeps a map insert and erase, two allocations
// and a lock, off the latency path.
struct UserOp {
  uint64_t op_id = 0;
  Completion done;
};

// ---------------------------------------------------------------------------

class UcxCore : public std::enable_shared_from_this<UcxCore> {
 public:
  UcxCore(const TransportOptions& options, Handler* handler, WritePath forced)
      : options_(options), handler_(handler), forced_(forced) {}
  ~UcxCore() {
    shutdown();
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  Status init(const sockaddr_storage* listen, socklen_t listen_len);
  void detect_cuda_support();

  // Transport
  std::vector<uint8_t> address() const { return address_; }
  Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address);
  Result<std::shared_ptr<MemoryRegion>> register_memory(void* data, size_t length, MemoryKind kind);
  Result<std::shared_ptr<MemoryRegion>> allocate_memory(size_t length, MemoryKind kind);
  Status invalidate(void* data, size_t length);
  size_t progress();
  void wait(std::chrono::milliseconds timeout);
  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  void shutdown();
  MemorySupport memory_support(MemoryKind kind) const {
    if (kind == MemoryKind::kHost) return {true, "host memory (ucp_mem_map)"};
    return {cuda_supported_, cuda_detail_};
  }
  UcxCounters counters() const {
    UcxCounters c;
    uint64_t ring_records = retired_ring_records_.load();
    uint64_t ring_writes = retired_ring_writes_.load();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, conn] : conns_) {
        ring_records += conn->ring_records_.load(std::memory_order_relaxed);
        ring_writes += conn->ring_writes_.load(std::memory_order_relaxed);
      }
    }
    c.writes_put = writes_put_.load() + ring_writes;
    c.writes_am = writes_am_.load();
    c.flushes = flushes_.load();
    c.rejected_writes = rejected_writes_.load();
    c.rejected_messages = rejected_messages_.load();
    c.notify_ring = ring_records;
    c.notify_ring_full = notify_ring_full_.load();
    c.ring_wakeups = ring_wakeups_.load();
    return c;
  }

  // Connection
  Result<std::shared_ptr<RemoteRegion>> import_region(UcxConnection& conn,
                                                      std::span<const uint8_t> key);
  Status check_write(const UcxConnection& conn, const WriteRequest& req) const;
  Status write(UcxConnection& conn, const WriteRequest& req, Completion done);
  Status send(UcxConnection& conn, std::span<const uint8_t> message, Completion done);
  void close_connection(UcxConnection& conn);
  void release_rkey(UcxRemoteRegion* remote);

  // UCX callbacks (mu_ held).
  void on_request_done(OpCtx* op, ucs_status_t status);
  ucs_status_t on_am(unsigned id, const void* header, size_t header_length, void* data,
                     size_t length, const ucp_am_recv_param_t* param);
  void on_conn_request(ucp_conn_request_h request) { accepts_.push_back(request); }
  void on_ep_error(ucp_ep_h ep, ucs_status_t status);

 private:
  using ConnPtr = std::shared_ptr<UcxConnection>;

  Clock::time_point deadline() const { return Clock::now() + options_.common.op_timeout; }
  void maybe_wake() {
    if (sleepers_.load() > 0) wake();
  }

  OpCtx* new_op(OpCtx::Kind kind);
  // Unlinks a finished request's context and keeps it for reuse.
  void unlink_op(OpCtx* op);
  // Like finish_request, for a request that carries a user operation.
  void finish_user(UserOp& u, OpCtx* op, ucs_status_ptr_t r, uint64_t conn_id,
                   std::string_view what);
  void complete_user(UserOp& u, Status status) {
    if (u.op_id != 0) {
      complete(u.op_id, std::move(status));
    } else if (u.done) {
      push_completion(PendingOps::Ready{std::move(u.done), std::move(status)});
    }
  }
  // Hands a ucp_*_nbx result to its OpCtx: completes it now, fails it now, or
  // leaves it to the callback.
  void finish_request(OpCtx* op, ucs_status_ptr_t r);
  void complete(uint64_t op_id, Status status) {
    PendingOps::Ready r = pending_.take(op_id, std::move(status));
    if (r.done) push_completion(std::move(r));
  }
  void push_completion(PendingOps::Ready r) {
    Event e;
    e.kind = Event::kCompletion;
    e.ready = std::move(r);
    queue_event(std::move(e));
  }
  void push_event(Event::Kind kind, const ConnPtr& conn) {
    Event e;
    e.kind = kind;
    e.conn = conn;
    queue_event(std::move(e));
  }
  // Every event goes through here (mu_ held). An event queued outside
  // progress() (a write's completion, a close) must make the next progress()
  // take the path that delivers events, not the rings-only one: without
  // this, a completion waited for the end of the UCX poll period (up to
  // kUcxPollPeriodMax), and a window of writes refilled by their completions
  // ran at half speed.
  void queue_event(Event e) {
    events_.push_back(std::move(e));
    ucx_idle_.store(false, std::memory_order_relaxed);
  }

  void start_write(UcxConnection& conn, UserOp u, const std::shared_ptr<UcxRegion>& src,
                   const std::shared_ptr<UcxRemoteRegion>& remote, uint64_t local_offset,
                   uint64_t remote_offset, uint64_t length, uint32_t notify);
  void start_flush(UcxConnection& conn);
  void on_flushed(const ConnPtr& conn, std::vector<UcxConnection::Unflushed> batch,
                  ucs_status_t status);
  // Sends the notifications of writes whose bytes are visible at the peer and
  // completes them.
  void announce(UcxConnection& conn, const UcxConnection::Unflushed* writes, size_t n);
  // Whether a write to `remote` is a memcpy into the peer's mapped memory.
  // Never from device memory: the CPU cannot read it.
  bool copies_into_mapping(const UcxConnection& conn, const UcxRegion& src,
                           const UcxRemoteRegion& remote) const {
    return forced_ != WritePath::kAm && conn.path_.load() == WritePath::kPut && remote.mapped() &&
           src.kind() == MemoryKind::kHost;
  }
  void start_send(UcxConnection& conn, UserOp u, std::span<const uint8_t> message);
  // The notification of one write whose bytes are already in place, as an
  // active message.
  void notify_one(UcxConnection& conn, UserOp u, WriteHeader h);

  // Notification ring (see the comment at kRingMagic).
  // A zeroed ring for a new connection, or null (off, or no memory for it).
  std::shared_ptr<RxRing> allocate_ring();
  void write_ring_offer(WireWriter& w, const UcxConnection& conn) const;
  bool read_ring_offer(WireReader& r, uint32_t* slots, uint64_t* base,
                       std::span<const uint8_t>* packed);
  // Maps the peer's offered ring where it is on this host (mu_ held).
  void map_peer_ring(UcxConnection& conn, uint32_t slots, uint64_t base,
                     std::span<const uint8_t> packed);
  enum class RingResult : uint8_t { kUnavailable, kFull, kPublished, kPublishedPeerAsleep };
  // Publishes a notification in the peer's ring; takes conn.tx_mu_, not mu_.
  RingResult ring_notify(UcxConnection& conn, WriteHeader h);
  // Under conn.tx_mu_: whether the ring has no free slot (re-reading the
  // owner's `consumed` when the cached copy says so), and publishing a record
  // in it (never kFull: ask ring_full first).
  static bool ring_full(TxRing& r);
  RingResult ring_publish(UcxConnection& conn, TxRing& r, WriteHeader h);

 public:
  // Connection::write's fast path (see the definition); false, having done
  // nothing, where write() must run.
  static bool write_through_ring(UcxConnection& conn, const WriteRequest& req, Status* status);

 private:
  // Sends kAmWake for a record just published in the ring of a peer asleep
  // in wait(), if the worker and the connection are still up; the _locked
  // one with mu_ held.
  void wake_ring_owner(UcxConnection& conn);
  void wake_ring_owner_locked(UcxConnection& conn);
  // Delivers the records of conn's ring in sequence order: those numbered
  // below `below`, and, when `stop_at_gap`, only while each is the next
  // number (a gap is an active message still on its way). mu_ held.
  void drain_ring(const ConnPtr& conn, uint64_t below, bool stop_at_gap);
  // An active message numbered `seq` arrived: ring records before it go
  // first.
  void arrived_in_order(const ConnPtr& conn, uint64_t seq) {
    drain_ring(conn, seq, false);
    if (conn->rx_next_seq_.load(std::memory_order_relaxed) <= seq) {
      conn->rx_next_seq_.store(seq + 1, std::memory_order_relaxed);
    }
  }
  // The loop under drain_ring and poll_rings_unlocked: hands each record to
  // `deliver` in sequence order. Only the thread in progress() reads rings.
  template <typename Deliver>
  size_t read_ring(UcxConnection& conn, RxRing& r, uint64_t below, bool stop_at_gap,
                   Deliver&& deliver);
  // progress()'s fast path: rings only, without mu_, handlers called at once.
  size_t poll_rings_unlocked();
  // Whether a sleeping owner would miss a deliverable record.
  bool ring_has_next(const UcxConnection& conn) const;
  void set_rings_sleeping(bool sleeping);
  void release_rings(UcxConnection& conn);
  // Validates one notification and queues its on_write.
  void deliver_notification(const ConnPtr& conn, const WriteHeader& h);
  // Queues on_write(conn, notify, length) for the next delivery. mu_ held.
  void queue_write(ConnectionPtr conn, uint32_t notify, uint64_t length);
  bool send_control(UcxConnection& conn, unsigned id, std::vector<uint8_t> payload,
                    OpCtx::Kind kind);
  void handle_control(const ConnPtr& conn, unsigned id, uint64_t seq,
                      std::span<const uint8_t> payload);
  void handle_hello(const ConnPtr& conn, std::span<const uint8_t> payload);
  bool hold_early(UcxConnection& conn, unsigned id, uint64_t seq, std::span<const uint8_t> payload);
  void handle_hello_ack(const ConnPtr& conn, std::span<const uint8_t> payload);
  void dispatch_queued(UcxConnection& conn);
  static Status foreign_key(const UcxConnection& conn);
  void handle_notify(const ConnPtr& conn, std::span<const uint8_t> payload);
  void connection_ready(UcxConnection& conn);
  std::vector<uint8_t> hello_payload(const UcxConnection& conn) const;
  bool validate_target(const WriteHeader& h, std::shared_ptr<UcxRegion>* region);
  struct ValidTarget;
  // validate_target for the fast path: no lock while `last` still holds.
  bool validate_target_cached(const WriteHeader& h, ValidTarget* last);
  void reject_write(const UcxConnection* conn, const std::string& why);
  ucs_status_t on_am_write(const ConnPtr& conn, const void* header, size_t header_length,
                           void* data, size_t length, const ucp_am_recv_param_t* param);

  void accept(ucp_conn_request_h request);
  // Marks `conn` closed, fails its operations with `why`, queues its
  // on_disconnect, and closes its endpoint (after a bye, if `send_bye`).
  void close_locked(UcxConnection& conn, const Status& why, bool send_bye);
  void force_close_ep(UcxConnection& conn);
  void run_deferred();
  void check_deadlines(Clock::time_point now);
  void drain_graveyard();
  void deliver(Event& e);
  Result<std::shared_ptr<UcxRegion>> make_region(uint8_t* data, size_t length, MemoryKind kind,
                                                 ucp_mem_h memh);

  const TransportOptions options_;
  Handler* const handler_;
  const WritePath forced_;
  const uint64_t instance_ = random_u64() | 1;  // never 0, which means "not known yet"
  const size_t am_eager_max_ = std::getenv("UCX_RNDV_THRESH") != nullptr ? 0 : kAmEagerMax;

  std::shared_ptr<UcxContext> context_;
  // Whether this UCX build and configuration handle CUDA memory, found once
  // in init() from the context's memory types; the detail says how or why not.
  bool cuda_supported_ = false;
  std::string cuda_detail_ = "UCX not started";
  int efd_ = -1;
  int wake_fd_ = -1;
  std::vector<uint8_t> address_;
  std::string listen_text_;

  std::mutex progress_mu_;  // one progress() at a time: handlers run in order
  mutable std::mutex mu_;   // the worker and everything below
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  std::atomic<bool> shut_{false};
  std::map<uint64_t, ConnPtr> conns_;
  std::unordered_map<ucp_ep_h, ConnPtr> by_ep_;
  std::vector<Event> events_;
  std::vector<Event> delivering_;  // guarded by progress_mu_
  int64_t last_deadline_tick_ = 0;
  OpCtx* live_ops_ = nullptr;
  size_t live_count_ = 0;
  std::vector<OpCtx*> free_ops_;
  size_t handshaking_ = 0;  // connections with a handshake deadline
  // Deferred work (see the comment at the top of the file).
  std::vector<ucp_conn_request_h> accepts_;
  struct Flushed {
    ConnPtr conn;
    std::vector<UcxConnection::Unflushed> batch;
    ucs_status_t status;
  };
  std::vector<Flushed> flushed_;
  std::vector<ConnPtr> acks_;   // accepted: the hello answer is still to send
  std::vector<ConnPtr> ready_;  // connected: the queued operations are still to send
  std::vector<std::pair<ConnPtr, Status>> failed_;
  std::vector<ConnPtr> to_close_;
  // Rings of closed connections, unmapped by run_deferred (not inside a UCX
  // callback).
  std::vector<std::shared_ptr<RxRing>> dead_rings_;

  std::atomic<int> sleepers_{0};
  // Connections whose ring progress() polls (ready, with a ring); mu_.
  std::vector<ConnPtr> rx_conns_;
  // Set by progress() when UCX had nothing to do while a peer writes into one
  // of our rings; then progress() may poll only the rings for up to
  // ucx_poll_period_ after last_ucx_progress_. Any thread clears it to have UCX
  // progressed at once.
  std::atomic<bool> ucx_idle_{false};
  uint64_t last_ucx_progress_ = 0;             // poll_clock(); progress_mu_
  uint64_t ucx_poll_period_ = kUcxPollPeriod;  // progress_mu_
  bool rings_attached_ = false;                // a peer writes into one of our rings; mu_
  // Bumped (under mu_) whenever rx_conns_ changes; progress() then copies it.
  std::atomic<uint64_t> rx_version_{0};
  // The last target a ring's records named, as validate_target found it:
  // consecutive writes of a connection mostly land in one region, and this
  // spares them export_mu_ and the table.
  struct ValidTarget {
    uint64_t unexported = ~uint64_t{0};  // unexported_ when validated
    uint64_t region = 0, secret = 0, length = 0;
  };
  // progress()'s own copy of rx_conns_, for the fast path; progress_mu_.
  struct Polled {
    ConnectionPtr conn;
    UcxConnection* ucx;
    std::shared_ptr<RxRing> ring;  // keeps it mapped while polled, even once closed
    ValidTarget last;
  };
  std::vector<Polled> polled_;
  uint64_t polled_version_ = 0;
  int ring_sleepers_ = 0;  // threads in wait() that advertised it; mu_
  PendingOps pending_;
  RegistrationCache<UcxRegion> cache_;
  std::atomic<uint64_t> next_region_{1};
  std::mutex export_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<UcxRegion>> exported_;
  // Bumped (under export_mu_) whenever a region leaves exported_: a target
  // validated while it had some value is still exported while it has it.
  std::atomic<uint64_t> unexported_{0};
  // Held shared while copying into a peer's mapped memory, exclusively while
  // shutdown unmaps it; never held while taking mu_.
  std::shared_mutex mapping_mu_;
  std::mutex rkey_mu_;  // after mu_ when both are held
  std::set<UcxRemoteRegion*> live_remotes_;
  std::vector<ucp_rkey_h> graveyard_;
  std::atomic<bool> graveyard_nonempty_{false};

  std::atomic<uint64_t> writes_put_{0}, writes_am_{0}, flushes_{0}, rejected_writes_{0},
      rejected_messages_{0}, notify_ring_full_{0}, ring_wakeups_{0};
  // The per-connection ring counters of connections that let go of their
  // rings (release_rings, mu_ held).
  std::atomic<uint64_t> retired_ring_records_{0}, retired_ring_writes_{0};
};

namespace {

void send_cb(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<OpCtx*>(user_data);
  op->request = nullptr;
  op->core->on_request_done(op, status);
  ucp_request_free(request);
}

void recv_am_cb(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  auto* op = static_cast<OpCtx*>(user_data);
  op->request = nullptr;
  op->core->on_request_done(op, status);
  ucp_request_free(request);
}

template <unsigned Id>
ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                   const ucp_am_recv_param_t* param) {
  return static_cast<UcxCore*>(arg)->on_am(Id, header, header_length, data, length, param);
}

void conn_request_cb(ucp_conn_request_h request, void* arg) {
  static_cast<UcxCore*>(arg)->on_conn_request(request);
}

void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status) {
  static_cast<UcxCore*>(arg)->on_ep_error(ep, status);
}

}  // namespace

UcxRemoteRegion::~UcxRemoteRegion() {
  if (auto core = core_.lock()) core->release_rkey(this);
}

// ---------------------------------------------------------------------------
// Setup

Status UcxCore::init(const sockaddr_storage* listen, socklen_t listen_len) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return ucs_to_status(st, "UCX cannot read its configuration (UCX_* variables)");
  auto release = [&] { ucp_config_release(config); };
  const UcxOptions& ucx = options_.ucx;
  if (!ucx.tls.empty()) {
    st = ucp_config_modify(config, "TLS", ucx.tls.c_str());
    if (st != UCS_OK) {
      release();
      return InvalidArgument(
          fmt::format("ucx.tls '{}' was rejected by UCX ({}); use a UCX_TLS "
                      "value such as tcp, sm,tcp or rc,sm,tcp",
                      ucx.tls, ucs_status_string(st)));
    }
  }
  // UCX 1.13 leaves the shared-memory transports out of any endpoint that asks
  // for peer error handling unless MM_ERROR_HANDLING=y: with "sm,tcp" a
  // connection to a local peer then ran entirely over tcp (4.8 us one way
  // instead of 0.7 us here). With it, sysv/posix carry the active messages
  // and the RMA, and a dead peer is found by keep-alive. The environment
  // still wins.
  if (std::getenv("UCX_MM_ERROR_HANDLING") == nullptr && tls_may_use_shared_memory(ucx.tls)) {
    st = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
    if (st != UCS_OK) PSLD_LOG_DEBUG("ucx: MM_ERROR_HANDLING not set: {}", ucs_status_string(st));
  }
  // Keep-alive finds a peer that died without closing its sockets (shared
  // memory lanes have none). UCX's default of 20 s is longer than a typical
  // op_timeout; probe four times per op_timeout, at most every 100 ms.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    const auto interval = std::clamp<int64_t>(options_.common.op_timeout.count() / 4, 100, 20000);
    st = ucp_config_modify(config, "KEEPALIVE_INTERVAL", fmt::format("{}ms", interval).c_str());
    if (st != UCS_OK) PSLD_LOG_DEBUG("ucx: KEEPALIVE_INTERVAL not set: {}", ucs_status_string(st));
  }

  ucp_params_t params{};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  // Regions are mapped and unmapped from any thread (a MemoryRegion dies
  // wherever its last holder lets go), outside the worker lock: the context
  // must lock itself.
  params.mt_workers_shared = 1;
  params.name = "psld";
  context_ = std::make_shared<UcxContext>();
  st = ucp_init(&params, config, &context_->handle);
  release();
  if (st != UCS_OK) {
    context_->handle = nullptr;
    return Unavailable(
        fmt::format("UCX could not start (ucp_init: {}) with UCX_TLS '{}'; `ucx_info -d` lists the "
                    "transports this machine has",
                    ucs_status_string(st), ucx.tls.empty() ? "(default)" : ucx.tls));
  }
  detect_cuda_support();

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // mu_ serializes every call
  st = ucp_worker_create(context_->handle, &wp, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return ucs_to_status(st, "UCX could not create a worker");
  }
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return ucs_to_status(st, "UCX worker has no event fd");
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return Unavailable(fmt::format("eventfd: {}", std::strerror(errno)));

  auto set_handler = [&](unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    return ucp_worker_set_am_recv_handler(worker_, &hp);
  };
  for (auto [id, cb] :
       {std::pair{kAmHello, &am_cb<kAmHello>}, std::pair{kAmHelloAck, &am_cb<kAmHelloAck>},
        std::pair{kAmMessage, &am_cb<kAmMessage>}, std::pair{kAmWrite, &am_cb<kAmWrite>},
        std::pair{kAmNotify, &am_cb<kAmNotify>}, std::pair{kAmBye, &am_cb<kAmBye>},
        std::pair{kAmWake, &am_cb<kAmWake>}}) {
    st = set_handler(id, cb);
    if (st != UCS_OK) return ucs_to_status(st, "UCX refused an active-message handler");
  }

  if (listen != nullptr) {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(listen);
    lp.sockaddr.addrlen = listen_len;
    lp.conn_handler.cb = conn_request_cb;
    lp.conn_handler.arg = this;
    st = ucp_listener_create(worker_, &lp, &listener_);
    if (st != UCS_OK) {
      listener_ = nullptr;
      return Unavailable(
          fmt::format("UCX cannot listen on '{}': {} (is the address local and "
                      "the port free?)",
                      options_.common.listen_address, ucs_status_string(st)));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    st = ucp_listener_query(listener_, &la);
    if (st != UCS_OK) return ucs_to_status(st, "UCX cannot tell the listener's address");
    // Text, "127.0.0.1:41234": what a launcher builds from MASTER_ADDR and a
    // port, and what logs and configuration files can carry.
    listen_text_ = socket_address_string(la.sockaddr);
    address_.assign(listen_text_.begin(), listen_text_.end());
    PSLD_LOG_INFO("ucx: listening on {} (UCX_TLS {})", listen_text_,
                  ucx.tls.empty() ? std::string("from the environment") : ucx.tls);
  }
  return Status::Ok();
}

// Whether UCX handles CUDA memory here. ucp_context_query's memory_types
// holds a type when one of the context's memory domains with transport
// resources can detect it: for CUDA that is cuda_copy, which exists only in a
// UCX built --with-cuda (Debian's and Ubuntu's packages are not) and is left
// out when UCX_TLS excludes it (e.g. "tcp"). With cuda_copy UCX moves device
// memory correctly on every lane: zero-copy where the NIC can reach GPU
// memory (GPUDirect RDMA: the ib transports with nvidia-peermem or dma-buf),
// else pipelined through its own host buffers.
void UcxCore::detect_cuda_support() {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t st = ucp_context_query(context_->handle, &attr);
  if (st != UCS_OK) {
    cuda_supported_ = false;
    cuda_detail_ = fmt::format(
        "ucp_context_query failed ({}); psld stages device tensors "
        "through host memory",
        ucs_status_string(st));
  } else if ((attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) == 0) {
    cuda_supported_ = false;
    cuda_detail_ =
        options_.ucx.tls.empty()
            ? "this UCX build has no CUDA support (Debian's UCX does not); psld stages device "
              "tensors through host memory"
            : fmt::format(
                  "this UCX build has no CUDA support (Debian's UCX does not), or "
                  "ucx.tls '{}' leaves out cuda_copy; psld stages device tensors "
                  "through host memory",
                  options_.ucx.tls);
  } else {
    cuda_supported_ = true;
    cuda_detail_ =
        "UCX memory type cuda (ucp_mem_map with UCS_MEMORY_TYPE_CUDA; zero-copy where the "
        "NIC reaches GPU memory, else UCX pipelines through host buffers)";
  }
  PSLD_LOG_INFO("ucx: CUDA memory {}: {}", cuda_supported_ ? "supported" : "not supported",
                cuda_detail_);
}

// ---------------------------------------------------------------------------
// Requests

OpCtx* UcxCore::new_op(OpCtx::Kind kind) {
  OpCtx* op;
  if (!free_ops_.empty()) {
    op = free_ops_.back();
    free_ops_.pop_back();
  } else {
    op = new OpCtx;
    op->core = this;
  }
  op->kind = kind;
  op->prev = nullptr;
  op->next = live_ops_;
  if (live_ops_ != nullptr) live_ops_->prev = op;
  live_ops_ = op;
  ++live_count_;
  return op;
}

void UcxCore::unlink_op(OpCtx* op) {
  if (op->prev != nullptr) op->prev->next = op->next;
  if (op->next != nullptr) op->next->prev = op->prev;
  if (live_ops_ == op) live_ops_ = op->next;
  --live_count_;
  op->request = nullptr;
  op->op_id = 0;
  op->deadline = Clock::time_point::max();
  op->conn.reset();
  op->region.reset();
  op->remote.reset();
  op->bytes.clear();  // keeps its capacity for the next message
  op->batch.clear();
  // A bounded pool: enough for a window of writes on a few connections.
  if (free_ops_.size() < 1024 && op->bytes.capacity() <= 2 * kMaxMessageBytes) {
    free_ops_.push_back(op);
  } else {
    delete op;
  }
}

void UcxCore::finish_user(UserOp& u, OpCtx* op, ucs_status_ptr_t r, uint64_t conn_id,
                          std::string_view what) {
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
    if (u.op_id == 0) u.op_id = pending_.add(conn_id, op->deadline, std::move(u.done));
    op->op_id = u.op_id;
    op->request = r;
    return;
  }
  complete_user(u, ucs_to_status(r == nullptr ? UCS_OK : UCS_PTR_STATUS(r), what));
  unlink_op(op);
}

void UcxCore::finish_request(OpCtx* op, ucs_status_ptr_t r) {
  if (r == nullptr) {
    on_request_done(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    on_request_done(op, UCS_PTR_STATUS(r));
  } else {
    op->request = r;
  }
}

void UcxCore::on_request_done(OpCtx* op, ucs_status_t status) {
  switch (op->kind) {
    case OpCtx::kPut:
      // Local completion only; the flush that covers it completes the write.
      if (status != UCS_OK) complete(op->op_id, ucs_to_status(status, "put failed"));
      break;
    case OpCtx::kFlush:
      flushed_.push_back(Flushed{std::move(op->conn), std::move(op->batch), status});
      break;
    case OpCtx::kAmWrite:
      complete(op->op_id, ucs_to_status(status, "write failed"));
      break;
    case OpCtx::kSend:
      complete(op->op_id, ucs_to_status(status, "send failed"));
      break;
    case OpCtx::kControl:
      if (status != UCS_OK && status != UCS_ERR_CANCELED) {
        PSLD_LOG_DEBUG("ucx: control message on connection {} failed: {}",
                       op->conn ? op->conn->id() : 0, ucs_status_string(status));
      }
      break;
    case OpCtx::kBye:
      if (op->conn && op->conn->bye_in_flight_) {
        op->conn->bye_in_flight_ = false;
        to_close_.push_back(op->conn);
      }
      break;
    case OpCtx::kRecvWrite:
      if (status == UCS_OK && op->conn && op->conn->state_ == UcxConnection::State::kReady) {
        queue_write(op->conn, op->notify, op->length);
      } else if (status != UCS_OK) {
        PSLD_LOG_DEBUG("ucx: incoming write on connection {} failed: {}",
                       op->conn ? op->conn->id() : 0, ucs_status_string(status));
      }
      break;
    case OpCtx::kRecvControl:
      if (status == UCS_OK && op->conn) handle_control(op->conn, op->am_id, op->seq, op->bytes);
      break;
    case OpCtx::kClose:
      break;
  }
  unlink_op(op);
}

// ---------------------------------------------------------------------------
// Connections

Result<ConnectionPtr> UcxCore::connect(std::span<const uint8_t> peer_address) {
  const std::string where(peer_address.begin(), peer_address.end());
  if (where.empty() || where.size() > kMaxAddressString ||
      !std::all_of(where.begin(), where.end(), [](char c) { return c > ' ' && c < 127; })) {
    return InvalidArgument(
        "not a UCX transport address: pass the peer's Transport::address(), "
        "host:port text such as 127.0.0.1:41234");
  }
  sockaddr_storage sa{};
  socklen_t sa_len = 0;
  PSLD_RETURN_IF_ERROR(parse_socket_address(where, false, &sa, &sa_len));

  ConnPtr conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr || shut_) return Unavailable("UCX transport is shut down");
    conn =
        std::make_shared<UcxConnection>(this, weak_from_this(), true, fmt::format("ucx {}", where));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep.sockaddr.addrlen = sa_len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ep_error_cb;
    ep.err_handler.arg = this;
    ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->ep_);
    if (st != UCS_OK) {
      return Unavailable(fmt::format("cannot connect to {}: {}", where, ucs_status_string(st)));
    }
    conn->handshake_deadline_ = deadline();
    ++handshaking_;
    conns_[conn->id()] = conn;
    by_ep_[conn->ep_] = conn;
    conn->rx_ring_ = allocate_ring();
    // UCX queues what is sent before wire-up completes, so the hello goes
    // now; writes and sends wait for the answer, which tells us the lanes.
    send_control(*conn, kAmHello, hello_payload(*conn), OpCtx::kControl);
    run_deferred();
  }
  maybe_wake();
  return ConnectionPtr(conn);
}

std::vector<uint8_t> UcxCore::hello_payload(const UcxConnection& conn) const {
  WireWriter w;
  w.u32(kHelloMagic);
  w.u8(kWireVersion);
  w.u64(instance_);
  w.u64(conn.id());
  w.str(listen_text_);
  write_ring_offer(w, conn);
  return w.take();
}

void UcxCore::accept(ucp_conn_request_h request) {
  if (shut_ || listener_ == nullptr) {
    if (listener_ != nullptr) ucp_listener_reject(listener_, request);
    return;
  }
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string who = "unknown client";
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    who = socket_address_string(attr.client_address);
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = ep_error_cb;
  ep.err_handler.arg = this;
  auto conn =
      std::make_shared<UcxConnection>(this, weak_from_this(), false, fmt::format("ucx {}", who));
  ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->ep_);
  if (st != UCS_OK) {
    PSLD_LOG_WARN("ucx: cannot accept a connection from {}: {}", who, ucs_status_string(st));
    return;
  }
  // Invisible to the application until the client's hello arrives.
  conn->handshake_deadline_ = deadline();
  ++handshaking_;
  conns_[conn->id()] = conn;
  by_ep_[conn->ep_] = conn;
  conn->rx_ring_ = allocate_ring();
}

void UcxCore::handle_hello(const ConnPtr& conn, std::span<const uint8_t> payload) {
  WireReader r(payload);
  uint32_t magic = 0;
  uint8_t version = 0;
  uint64_t instance = 0, peer_conn = 0;
  std::string listen;
  uint32_t ring_slots = 0;
  uint64_t ring_base = 0;
  std::span<const uint8_t> ring_key;
  if (conn->client_ || conn->state_ != UcxConnection::State::kHandshake || !r.u32(&magic) ||
      magic != kHelloMagic || !r.u8(&version) || version != kWireVersion || !r.u64(&instance) ||
      !r.u64(&peer_conn) || !r.str(&listen, kMaxAddressString) ||
      !read_ring_offer(r, &ring_slots, &ring_base, &ring_key) || !r.done()) {
    ++rejected_messages_;
    close_locked(*conn, DataLoss("malformed hello from " + conn->peer()), false);
    return;
  }
  conn->peer_instance_ = instance;
  map_peer_ring(*conn, ring_slots, ring_base, ring_key);
  connection_ready(*conn);
  push_event(Event::kAccept, conn);
  acks_.push_back(conn);  // sending is deferred: this runs inside a UCX callback
}

void UcxCore::handle_hello_ack(const ConnPtr& conn, std::span<const uint8_t> payload) {
  WireReader r(payload);
  uint32_t magic = 0;
  uint8_t version = 0;
  uint64_t instance = 0, peer_conn = 0;
  std::string listen;
  uint32_t ring_slots = 0;
  uint64_t ring_base = 0;
  std::span<const uint8_t> ring_key;
  if (!conn->client_ || conn->state_ != UcxConnection::State::kHandshake || !r.u32(&magic) ||
      magic != kHelloMagic || !r.u8(&version) || version != kWireVersion || !r.u64(&instance) ||
      !r.u64(&peer_conn) || !r.str(&listen, kMaxAddressString) ||
      !read_ring_offer(r, &ring_slots, &ring_base, &ring_key) || !r.done()) {
    ++rejected_messages_;
    close_locked(*conn, DataLoss("malformed hello answer from " + conn->peer()), false);
    return;
  }
  conn->peer_instance_ = instance;
  map_peer_ring(*conn, ring_slots, ring_base, ring_key);
  connection_ready(*conn);
  ready_.push_back(conn);  // sending is deferred: this runs inside a UCX callback
  // What the server sent right after accepting (from its on_accept handler)
  // can overtake its deferred answer; it was held until now.
  std::vector<UcxConnection::Early> early;
  early.swap(conn->early_);
  for (auto& e : early)
    handle_control(conn, e.id, e.seq, e.bytes);
}

bool UcxCore::hold_early(UcxConnection& conn, unsigned id, uint64_t seq,
                         std::span<const uint8_t> payload) {
  if (!conn.client_ || conn.state_ != UcxConnection::State::kHandshake) return false;
  // Bounded: a peer cannot make us buffer without limit before it answers.
  if (conn.early_.size() >= kMaxEarlyMessages) return false;
  conn.early_.push_back({id, seq, std::vector<uint8_t>(payload.begin(), payload.end())});
  return true;
}

Status UcxCore::foreign_key(const UcxConnection& conn) {
  return InvalidArgument(
      "remote key was exported by another transport than this connection's peer (" + conn.peer() +
      "); import it on a connection to the transport that registered the region");
}

void UcxCore::dispatch_queued(UcxConnection& conn) {
  // Operations issued during the handshake go out in the order they came.
  std::deque<UcxConnection::Queued> queued;
  queued.swap(conn.queued_);
  for (auto& q : queued) {
    if (conn.state_ != UcxConnection::State::kReady) break;  // closed meanwhile: already failed
    if (!pending_.contains(q.op_id)) continue;               // timed out meanwhile
    if (q.is_write && q.remote->owner() != conn.peer_instance_.load()) {
      // Imported before the handshake named the peer: checked now.
      complete(q.op_id, foreign_key(conn));
    } else if (q.is_write) {
      start_write(conn, UserOp{q.op_id, nullptr}, q.src, q.remote, q.local_offset, q.remote_offset,
                  q.length, q.notify);
    } else {
      start_send(conn, UserOp{q.op_id, nullptr}, q.message);
    }
  }
}

void UcxCore::connection_ready(UcxConnection& conn) {
  conn.state_ = UcxConnection::State::kReady;
  --handshaking_;
  const std::string info = endpoint_info(conn.ep_);
  const LaneSummary lanes = summarize_lanes(info);
  conn.rma_ = lanes.rma;
  WritePath path = forced_;
  std::string why = "forced by ucx.write_path";
  if (path == WritePath::kAuto) {
    if (lanes.rma == RmaKind::kEmulated) {
      path = WritePath::kAm;
      why =
          "UCX only emulates put on these lanes; active-message rendezvous lands the data "
          "straight in the target";
    } else {
      path = WritePath::kPut;
      why = lanes.rma == RmaKind::kRdma ? "native RDMA put"
                                        : "shared-memory put into regions the peer allocated "
                                          "with allocate_memory (others use am)";
    }
  }
  conn.path_ = path;
  if (conn.rx_ring_) {
    rx_conns_.push_back(conn.shared_from_this());
    rx_version_.fetch_add(1, std::memory_order_release);
    // A thread already asleep advertises this ring too, so its writer wakes
    // it. (Records published before now are read by the progress() that
    // runs this: rings are polled after the worker.)
    if (ring_sleepers_ > 0) {
      ring_word(conn.rx_ring_->base(), kRingSleepingAt).store(1, std::memory_order_seq_cst);
    }
  }
  PSLD_LOG_INFO("ucx: connection {} ({}): lanes {}; writes use {} ({}); notify ring: {}", conn.id(),
                conn.peer(), lanes.text, path == WritePath::kPut ? "put" : "am", why,
                conn.ring_note_);
  PSLD_LOG_DEBUG("ucx: connection {} endpoint:\n{}", conn.id(), info);
}

Result<std::shared_ptr<RemoteRegion>> UcxCore::import_region(UcxConnection& conn,
                                                             std::span<const uint8_t> key) {
  WireReader r(key);
  uint32_t magic = 0;
  uint8_t version = 0, kind = 0;
  uint64_t owner = 0, region = 0, base = 0, length = 0, secret = 0, sum = 0;
  std::span<const uint8_t> packed;
  if (!r.u32(&magic) || magic != kKeyMagic) {
    return DataLoss(
        "not a UCX remote key (a key of another transport kind, or corrupted); "
        "import keys made by this connection's peer's ucx transport");
  }
  if (!r.u8(&version) || version != kWireVersion || !r.u8(&kind) || !r.u64(&owner) ||
      !r.u64(&region) || !r.u64(&base) || !r.u64(&length) || !r.u64(&secret) ||
      !r.blob(&packed, kMaxPackedRkey) || key.size() < 8 || !r.u64(&sum) || !r.done()) {
    return DataLoss("malformed UCX remote key (truncated or padded)");
  }
  if (sum != fnv1a(key.first(key.size() - 8))) {
    return DataLoss("UCX remote key failed its checksum (corrupted in transit?)");
  }
  if (length == 0 || base + length < base || packed.empty()) {
    return DataLoss("UCX remote key describes an impossible region");
  }
  if (kind != static_cast<uint8_t>(MemoryKind::kHost) &&
      kind != static_cast<uint8_t>(MemoryKind::kCuda)) {
    return DataLoss("UCX remote key names an unknown memory kind");
  }
  const auto remote_kind = static_cast<MemoryKind>(kind);
  std::vector<uint8_t> padded(packed.size() + kRkeyPad, 0);
  std::memcpy(padded.data(), packed.data(), packed.size());

  std::lock_guard<std::mutex> lock(mu_);
  if (worker_ == nullptr || conn.state_ == UcxConnection::State::kClosed || conn.ep_ == nullptr) {
    return Unavailable("connection to " + conn.peer() + " is closed");
  }
  // Before the handshake answered the peer is not known yet; then the writes
  // check the key (check_write, dispatch_queued).
  if (conn.peer_instance_.load() != 0 && owner != conn.peer_instance_.load()) {
    return foreign_key(conn);
  }
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(conn.ep_, padded.data(), &rkey);
  if (st != UCS_OK) {
    return DataLoss(fmt::format("UCX could not unpack the remote key: {}", ucs_status_string(st)));
  }
  // Shared memory the peer allocated (UCP_MEM_MAP_ALLOCATE) is attached by
  // the unpack; ucp_rkey_ptr says where.
  // Device memory is never mapped for the CPU.
  void* mapped_at = nullptr;
  const bool mapped = remote_kind == MemoryKind::kHost &&
                      ucp_rkey_ptr(rkey, base, &mapped_at) == UCS_OK && mapped_at != nullptr;
  auto remote = std::make_shared<UcxRemoteRegion>(
      length, region, remote_kind, conn.id(), owner, base, secret,
      mapped ? static_cast<uint8_t*>(mapped_at) : nullptr, rkey, weak_from_this());
  {
    std::lock_guard<std::mutex> rlock(rkey_mu_);
    live_remotes_.insert(remote.get());
  }
  return std::shared_ptr<RemoteRegion>(remote);
}

void UcxCore::release_rkey(UcxRemoteRegion* remote) {
  std::lock_guard<std::mutex> lock(rkey_mu_);
  live_remotes_.erase(remote);
  if (remote->rkey_ != nullptr) {
    graveyard_.push_back(remote->rkey_);
    remote->rkey_ = nullptr;
    graveyard_nonempty_ = true;
  }
}

void UcxCore::drain_graveyard() {
  if (!graveyard_nonempty_.load()) return;
  std::vector<ucp_rkey_h> dead;
  {
    std::lock_guard<std::mutex> lock(rkey_mu_);
    dead.swap(graveyard_);
    graveyard_nonempty_ = false;
  }
  for (ucp_rkey_h k : dead)
    ucp_rkey_destroy(k);
}

// ---------------------------------------------------------------------------
// Notification ring

namespace {

// ucp_mem_map with UCP_MEM_MAP_ALLOCATE, then where the memory is. UCX picks
// the allocator (UCX_ALLOC_PRIO: sysv, then posix shared memory, ...), so a
// peer on this host can map host memory allocated this way. `cuda`: device
// memory on the calling thread's current device (UCX's cuda_copy allocator).
struct MappedAllocation {
  ucp_mem_h memh = nullptr;
  uint8_t* base = nullptr;
};
Result<MappedAllocation> map_allocated(ucp_context_h context, size_t length, bool cuda) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = nullptr;
  mp.length = length;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  if (cuda) {
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  MappedAllocation out;
  const ucs_status_t st = ucp_mem_map(context, &mp, &out.memh);
  if (st != UCS_OK) {
    return ResourceExhausted(
        fmt::format("UCX cannot allocate {} bytes: {}", length, ucs_status_string(st)));
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (ucp_mem_query(out.memh, &attr) != UCS_OK || attr.address == nullptr || attr.length < length) {
    ucp_mem_unmap(context, out.memh);
    return Internal("ucp_mem_query failed on memory UCX just allocated");
  }
  out.base = static_cast<uint8_t*>(attr.address);
  return out;
}

}  // namespace

std::shared_ptr<RxRing> UcxCore::allocate_ring() {
  const uint32_t slots = options_.ucx.notify_ring_slots;
  // Only a peer that can map our memory could use it.
  if (slots == 0 || !tls_may_use_shared_memory(options_.ucx.tls)) return nullptr;
  const size_t bytes = kRingHeaderBytes + size_t{slots} * kRingRecordBytes;
  auto mapped = map_allocated(context_->handle, bytes, false);
  if (!mapped.ok()) {
    PSLD_LOG_WARN("ucx: no notification ring ({}); notifications use active messages",
                  mapped.status().message());
    return nullptr;
  }
  const ucp_mem_h memh = mapped->memh;
  void* packed = nullptr;
  size_t packed_size = 0;
  if (ucp_rkey_pack(context_->handle, memh, &packed, &packed_size) != UCS_OK) {
    ucp_mem_unmap(context_->handle, memh);
    PSLD_LOG_WARN("ucx: no notification ring (UCX could not pack a key for its memory)");
    return nullptr;
  }
  std::vector<uint8_t> key(static_cast<uint8_t*>(packed),
                           static_cast<uint8_t*>(packed) + packed_size);
  ucp_rkey_buffer_release(packed);
  uint8_t* base = mapped->base;
  std::memset(base, 0, bytes);
  ring_word(base, 0).store(kRingMagic, std::memory_order_relaxed);
  ring_word(base, 8).store(slots, std::memory_order_relaxed);
  return std::make_shared<RxRing>(context_, memh, base, slots, std::move(key));
}

// Appended to the hello and its answer: slot count (0: none), where the ring
// is in the offering process, and UCX's packed key for it.
void UcxCore::write_ring_offer(WireWriter& w, const UcxConnection& conn) const {
  const RxRing* ring = conn.rx_ring_.get();
  w.u32(ring != nullptr ? ring->slots() : 0);
  w.u64(ring != nullptr ? reinterpret_cast<uintptr_t>(ring->base()) : 0);
  w.blob(ring != nullptr ? std::span<const uint8_t>(ring->packed()) : std::span<const uint8_t>());
}

bool UcxCore::read_ring_offer(WireReader& r, uint32_t* slots, uint64_t* base,
                              std::span<const uint8_t>* packed) {
  return r.u32(slots) && r.u64(base) && r.blob(packed, kMaxPackedRkey);
}

void UcxCore::map_peer_ring(UcxConnection& conn, uint32_t slots, uint64_t base,
                            std::span<const uint8_t> packed) {
  const std::string ours = conn.rx_ring_
                               ? fmt::format("{} slots offered", conn.rx_ring_->slots())
                               : std::string(options_.ucx.notify_ring_slots == 0
                                                 ? "none offered (ucx.notify_ring_slots = 0)"
                                                 : "none offered (ucx.tls has no shared memory)");
  auto note = [&](std::string_view theirs) {
    conn.ring_note_ = fmt::format("{}; peer's {}", ours, theirs);
  };
  if (slots == 0) return note("none");
  if (options_.ucx.notify_ring_slots == 0) return note("unused (ucx.notify_ring_slots = 0)");
  if (forced_ == WritePath::kAm) return note("unused (ucx.write_path = am)");
  if (slots < kMinRingSlots || slots > kMaxRingSlots || (slots & (slots - 1)) != 0 ||
      packed.empty()) {
    ++rejected_messages_;
    return note("malformed, unused");
  }
  std::vector<uint8_t> padded(packed.size() + kRkeyPad, 0);
  std::memcpy(padded.data(), packed.data(), packed.size());
  ucp_rkey_h rkey = nullptr;
  if (ucp_ep_rkey_unpack(conn.ep_, padded.data(), &rkey) != UCS_OK) {
    return note("not mapped (UCX could not unpack its key)");
  }
  void* mapped = nullptr;
  if (ucp_rkey_ptr(rkey, base, &mapped) != UCS_OK || mapped == nullptr) {
    ucp_rkey_destroy(rkey);
    return note("not mapped (the peer is not on this host, or not over shared memory)");
  }
  auto* p = static_cast<uint8_t*>(mapped);
  if (ring_word(p, 0).load(std::memory_order_relaxed) != kRingMagic ||
      ring_word(p, 8).load(std::memory_order_relaxed) != slots) {
    ucp_rkey_destroy(rkey);
    ++rejected_messages_;
    return note("not a ring where the peer said, unused");
  }
  // Tells the owner a writer is there, so its progress() may poll UCX less.
  ring_word(p, kRingAttachedAt).store(1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> tx(conn.tx_mu_);
    conn.tx_ring_ = std::make_unique<TxRing>();
    conn.tx_ring_->rkey = rkey;
    conn.tx_ring_->base = p;
    conn.tx_ring_->slots = slots;
  }
  conn.tx_ring_mapped_.store(true, std::memory_order_release);
  note(fmt::format("mapped, {} slots: shared-memory writes notify through it", slots));
}

UcxCore::RingResult UcxCore::ring_notify(UcxConnection& conn, WriteHeader h) {
  std::lock_guard<std::mutex> tx(conn.tx_mu_);
  TxRing* r = conn.tx_ring_.get();
  if (r == nullptr) return RingResult::kUnavailable;
  if (ring_full(*r)) {
    ++notify_ring_full_;
    return RingResult::kFull;
  }
  return ring_publish(conn, *r, h);
}

bool UcxCore::ring_full(TxRing& r) {
  if (r.written - r.consumed < r.slots) return false;
  r.consumed = ring_word(r.base, kRingConsumedAt).load(std::memory_order_acquire);
  // A peer's bogus `consumed` (ahead of `written`) reads as full: safe.
  return r.written - r.consumed >= r.slots;
}

UcxCore::RingResult UcxCore::ring_publish(UcxConnection& conn, TxRing& r, WriteHeader h) {
  h.seq = conn.tx_seq_++;
  uint8_t* slot = r.base + kRingHeaderBytes + (r.written & (r.slots - 1)) * kRingRecordBytes;
  encode_header(h, slot);
  // The sleep handshake with wait(), Dekker-style: this stamp's store and the
  // flag's load here, the flag's store and the stamp's load there, all
  // seq_cst (operations, not fences, which ThreadSanitizer cannot see), so
  // the owner either sees this record after it said it sleeps, or we see
  // that it sleeps.
  ring_word(slot, kRingStampAt).store(r.written + 1, std::memory_order_seq_cst);
  ++r.written;
  count_one(conn.ring_records_);
  const uint64_t epoch = ring_word(r.base, kRingSleepingAt).load(std::memory_order_seq_cst);
  if ((epoch & 1) == 0 || epoch == r.woken_epoch) return RingResult::kPublished;
  r.woken_epoch = epoch;
  return RingResult::kPublishedPeerAsleep;
}

template <typename Deliver>
size_t UcxCore::read_ring(UcxConnection& conn, RxRing& r, uint64_t below, bool stop_at_gap,
                          Deliver&& deliver) {
  uint64_t read = r.read.load(std::memory_order_relaxed);
  const uint64_t start = read;
  size_t n = 0;
  while (r.ready(read)) {
    const WriteHeader h = decode_header(r.slot(read));
    const uint64_t next = conn.rx_next_seq_.load(std::memory_order_relaxed);
    if (h.seq >= below) break;
    if (h.seq < next) {
      // Only a broken peer numbers twice; consumed so the ring keeps moving.
      r.read.store(++read, std::memory_order_relaxed);
      reject_write(&conn, "notification ring record out of sequence");
      continue;
    }
    if (stop_at_gap && h.seq != next) break;
    r.read.store(++read, std::memory_order_relaxed);
    conn.rx_next_seq_.store(h.seq + 1, std::memory_order_relaxed);
    ++n;
    if (!deliver(h)) break;
  }
  if (read != start) ring_word(r.base(), kRingConsumedAt).store(read, std::memory_order_release);
  return n;
}

void UcxCore::drain_ring(const ConnPtr& conn, uint64_t below, bool stop_at_gap) {
  RxRing* r = conn->rx_ring_.get();
  if (r == nullptr || conn->state_ != UcxConnection::State::kReady) return;
  read_ring(*conn, *r, below, stop_at_gap, [&](const WriteHeader& h) {
    deliver_notification(conn, h);
    return true;
  });
}

// Without mu_: a record is validated and its handler called right here. The
// order of events is kept: whatever a peer sent before it (an active
// message, an earlier record) was delivered by an earlier progress() call,
// since this thread is the only one that runs UCX's callbacks and reads
// rings, and each progress() delivers what it queued before returning.
size_t UcxCore::poll_rings_unlocked() {
  size_t n = 0;
  for (Polled& p : polled_) {
    if (!p.ucx->open_.load(std::memory_order_relaxed)) continue;
    n += read_ring(*p.ucx, *p.ring, std::numeric_limits<uint64_t>::max(), true,
                   [&](const WriteHeader& h) {
                     if (!validate_target_cached(h, &p.last)) {
                       reject_write(p.ucx,
                                    "notification names no region we export, a wrong secret, "
                                    "or bytes outside the region");
                       return true;
                     }
                     if (shut_) return false;  // after shutdown no handler runs
                     handler_->on_write(p.conn, h.notify, h.length);
                     // The handler may have closed the connection.
                     return p.ucx->open_.load(std::memory_order_relaxed);
                   });
  }
  return n;
}

bool UcxCore::ring_has_next(const UcxConnection& conn) const {
  const RxRing* r = conn.rx_ring_.get();
  if (r == nullptr || conn.state_ != UcxConnection::State::kReady) return false;
  const uint64_t read = r->read.load(std::memory_order_relaxed);
  return r->ready(read) &&
         decode_header(r->slot(read)).seq == conn.rx_next_seq_.load(std::memory_order_relaxed);
}

void UcxCore::set_rings_sleeping(bool sleeping) {
  for (const ConnPtr& conn : rx_conns_) {
    auto epoch = ring_word(conn->rx_ring_->base(), kRingSleepingAt);
    const uint64_t now = epoch.load(std::memory_order_relaxed);
    if ((now & 1) != (sleeping ? 1u : 0u)) epoch.store(now + 1, std::memory_order_seq_cst);
  }
}

void UcxCore::release_rings(UcxConnection& conn) {
  if (conn.rx_ring_) {
    auto it = std::find_if(rx_conns_.begin(), rx_conns_.end(),
                           [&](const ConnPtr& c) { return c.get() == &conn; });
    if (it != rx_conns_.end()) rx_conns_.erase(it);
    rx_version_.fetch_add(1, std::memory_order_release);
    dead_rings_.push_back(std::move(conn.rx_ring_));
  }
  std::unique_ptr<TxRing> tx;
  {
    std::lock_guard<std::mutex> lock(conn.tx_mu_);
    tx = std::move(conn.tx_ring_);
    conn.tx_ring_mapped_.store(false, std::memory_order_relaxed);
    // Without the ring nothing counts these any more; counters() reads
    // either the connection's or the retired figure (both under mu_).
    retired_ring_records_ += conn.ring_records_.exchange(0, std::memory_order_relaxed);
    retired_ring_writes_ += conn.ring_writes_.exchange(0, std::memory_order_relaxed);
  }
  if (tx) {
    // The owner's progress() goes back to polling UCX on every call.
    ring_word(tx->base, kRingAttachedAt).store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(rkey_mu_);
    graveyard_.push_back(tx->rkey);  // destroyed outside any UCX callback
    graveyard_nonempty_ = true;
  }
}

void UcxCore::deliver_notification(const ConnPtr& conn, const WriteHeader& h) {
  std::shared_ptr<UcxRegion> region;
  if (!validate_target(h, &region)) {
    reject_write(conn.get(),
                 "notification names no region we export, a wrong secret, or "
                 "bytes outside the region");
    return;
  }
  queue_write(conn, h.notify, h.length);
}

void UcxCore::queue_write(ConnectionPtr conn, uint32_t notify, uint64_t length) {
  Event e;
  e.kind = Event::kWrite;
  e.conn = std::move(conn);
  e.notify = notify;
  e.length = length;
  queue_event(std::move(e));
}

// ---------------------------------------------------------------------------
// Writes and sends

Status UcxCore::check_write(const UcxConnection& conn, const WriteRequest& req) const {
  if (!conn.is_open()) return Unavailable("connection to " + conn.peer() + " is closed");
  if (shut_) return Unavailable("UCX transport is shut down");
  if (req.local == nullptr || req.local->backend() != &kUcxRegionTag ||
      static_cast<const UcxRegion*>(req.local)->owner() != instance_) {
    return InvalidArgument("write source is not a region registered with this transport");
  }
  auto* local = static_cast<const UcxRegion*>(req.local);
  if (req.remote == nullptr || req.remote->backend() != &kUcxRemoteRegionTag ||
      static_cast<const UcxRemoteRegion*>(req.remote)->connection_id() != conn.id()) {
    return InvalidArgument("write target was not imported on this connection");
  }
  auto* remote = static_cast<const UcxRemoteRegion*>(req.remote);
  const uint64_t peer = conn.peer_instance_.load();
  if (peer != 0 && remote->owner() != peer) return foreign_key(conn);
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
  return Status::Ok();
}

Status UcxCore::write(UcxConnection& conn, const WriteRequest& req, Completion done) {
  PSLD_RETURN_IF_ERROR(check_write(conn, req));
  // check_write proved both are ours.
  auto* src_region = const_cast<UcxRegion*>(static_cast<const UcxRegion*>(req.local));
  auto* remote_region =
      const_cast<UcxRemoteRegion*>(static_cast<const UcxRemoteRegion*>(req.remote));
  if (copies_into_mapping(conn, *src_region, *remote_region)) {
    // Done before this call returns, so the caller's references are all the
    // regions need: no shared_ptr of them is taken (four atomic operations
    // on the latency path).
    UcxRegion* src = src_region;
    UcxRemoteRegion* remote = remote_region;
    // Shared memory: the put is this memcpy. It runs outside mu_ so that a
    // large copy does not stall the thread progressing the worker; the
    // notification goes out after it, so the peer cannot see it early.
    {
      std::shared_lock<std::shared_mutex> map(mapping_mu_);
      if (remote->mapped_base_ == nullptr) return Unavailable("UCX transport is shut down");
      if (req.length > 0) {
        std::memcpy(remote->mapped_base_ + req.remote_offset, src->data() + req.local_offset,
                    req.length);
      }
    }
    const WriteHeader h{
        remote->peer_region_id(), remote->secret(), req.remote_offset, req.length, req.notify, 0};
    // The notification ring needs no worker lock: only a completion to queue
    // or a sleeping peer to wake takes mu_.
    RingResult ring = RingResult::kUnavailable;
    if (conn.tx_ring_mapped_.load(std::memory_order_acquire)) ring = ring_notify(conn, h);
    if (ring == RingResult::kPublished && !done) {
      ++writes_put_;
      return Status::Ok();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ring == RingResult::kPublished || ring == RingResult::kPublishedPeerAsleep) {
        // Shut down meanwhile: its completions were run; this one cannot be.
        if (worker_ == nullptr) return Unavailable("UCX transport is shut down");
        ++writes_put_;
        if (ring == RingResult::kPublishedPeerAsleep) wake_ring_owner_locked(conn);
        if (done) push_completion(PendingOps::Ready{std::move(done), Status::Ok()});
      } else {
        if (worker_ == nullptr || conn.state_ != UcxConnection::State::kReady) {
          return Unavailable("connection to " + conn.peer() + " is closed");
        }
        ++writes_put_;
        notify_one(conn, UserOp{0, std::move(done)}, h);
      }
      run_deferred();
    }
    maybe_wake();
    return Status::Ok();
  }
  // Held by the operation until it completes.
  auto src = src_region->weak_from_this().lock();
  auto remote = remote_region->weak_from_this().lock();
  if (!src || !remote) return InvalidArgument("write region is being destroyed");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr || conn.state_ == UcxConnection::State::kClosed) {
      return Unavailable("connection to " + conn.peer() + " is closed");
    }
    if (conn.state_ == UcxConnection::State::kHandshake) {
      UcxConnection::Queued q;
      q.op_id = pending_.add(conn.id(), deadline(), std::move(done));
      q.is_write = true;
      q.src = std::move(src);
      q.remote = std::move(remote);
      q.local_offset = req.local_offset;
      q.remote_offset = req.remote_offset;
      q.length = req.length;
      q.notify = req.notify;
      conn.queued_.push_back(std::move(q));
    } else {
      start_write(conn, UserOp{0, std::move(done)}, src, remote, req.local_offset,
                  req.remote_offset, req.length, req.notify);
      run_deferred();
    }
  }
  maybe_wake();
  return Status::Ok();
}

// A small write with no completion to a peer on this host whose ring is
// mapped here: check, memcpy into the peer's mapped region, publish the
// record, all under the connection's tx_mu_ and nothing else. This is the
// latency path (a shared-memory ping-pong), so it takes no reference to the
// core (weak_ptr::lock is two atomic read-modify-writes), no mapping_mu_ and
// no mu_:
// - The core is alive, and the peer's region and ring are mapped, for as
//   long as conn.tx_ring_ is set under tx_mu_: shutdown() runs
//   release_rings for every connection (close_locked), which clears tx_ring_
//   under tx_mu_, before it unmaps anything, and the core is destroyed only
//   after shutdown(). A write that finds tx_ring_ null takes write().
// - Copies are serialised per connection while tx_mu_ is held, hence the
//   size limit: larger copies run under mapping_mu_ (shared) instead, in
//   parallel.
// Writes with a completion take write(): their completion is queued under mu_.
bool UcxCore::write_through_ring(UcxConnection& conn, const WriteRequest& req, Status* status) {
  std::unique_lock<std::mutex> tx(conn.tx_mu_);
  TxRing* r = conn.tx_ring_.get();
  if (r == nullptr) return false;
  UcxCore& core = *conn.core_raw_;
  if (Status s = core.check_write(conn, req); !s.ok()) {
    *status = std::move(s);
    return true;
  }
  const auto& src = static_cast<const UcxRegion&>(*req.local);
  const auto& remote = static_cast<const UcxRemoteRegion&>(*req.remote);
  // A full ring falls back to an active message; write() counts it.
  if (!core.copies_into_mapping(conn, src, remote) || ring_full(*r)) return false;
  if (req.length > 0) {
    std::memcpy(remote.mapped_base_ + req.remote_offset, src.data() + req.local_offset, req.length);
  }
  const WriteHeader h{
      remote.peer_region_id(), remote.secret(), req.remote_offset, req.length, req.notify, 0};
  const RingResult ring = core.ring_publish(conn, *r, h);
  count_one(conn.ring_writes_);
  *status = Status::Ok();
  if (ring != RingResult::kPublishedPeerAsleep) return true;
  tx.unlock();
  // Rare (once per sleep of the peer): now a reference to the core is needed.
  if (auto c = conn.core_.lock()) c->wake_ring_owner(conn);
  return true;
}

void UcxCore::wake_ring_owner(UcxConnection& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ring_owner_locked(conn);
    run_deferred();
  }
  maybe_wake();
}

void UcxCore::wake_ring_owner_locked(UcxConnection& conn) {
  if (worker_ == nullptr || conn.state_ != UcxConnection::State::kReady) return;
  ++ring_wakeups_;
  send_control(conn, kAmWake, {}, OpCtx::kControl);
}

void UcxCore::start_write(UcxConnection& conn, UserOp u, const std::shared_ptr<UcxRegion>& src,
                          const std::shared_ptr<UcxRemoteRegion>& remote, uint64_t local_offset,
                          uint64_t remote_offset, uint64_t length, uint32_t notify) {
  WriteHeader h{remote->peer_region_id(), remote->secret(), remote_offset, length, notify, 0};
  if (copies_into_mapping(conn, *src, *remote)) {
    // Under mu_, so shutdown cannot unmap meanwhile.
    ++writes_put_;
    if (length > 0) {
      std::memcpy(remote->mapped_base_ + remote_offset, src->data() + local_offset, length);
    }
    const RingResult ring = conn.tx_ring_mapped_.load(std::memory_order_acquire)
                                ? ring_notify(conn, h)
                                : RingResult::kUnavailable;
    if (ring == RingResult::kPublished || ring == RingResult::kPublishedPeerAsleep) {
      if (ring == RingResult::kPublishedPeerAsleep) wake_ring_owner_locked(conn);
      complete_user(u, Status::Ok());
      return;
    }
    notify_one(conn, std::move(u), h);
    return;
  }
  // Over shared memory UCX can put only into memory it maps; a region the
  // peer registered from its own heap is reached by active message unless
  // put was forced (UCX then emulates it).
  const bool put = conn.path_.load() == WritePath::kPut &&
                   (forced_ == WritePath::kPut || conn.rma_ == RmaKind::kRdma);
  if (!put && conn.path_.load() == WritePath::kPut && !conn.am_fallback_logged_) {
    conn.am_fallback_logged_ = true;
    PSLD_LOG_INFO(
        "ucx: region {} of {} is not shared memory this process can map (the peer registered it "
        "with register_memory, not allocate_memory); writes to it, and to any other such region "
        "of this connection, use am",
        remote->peer_region_id(), conn.peer());
  }
  if (put) {
    ++writes_put_;
    // Completes at the flush, which is always later: track it now.
    if (u.op_id == 0) u.op_id = pending_.add(conn.id(), deadline(), std::move(u.done));
    if (length > 0) {
      OpCtx* op = new_op(OpCtx::kPut);
      op->op_id = u.op_id;
      op->deadline = deadline();
      op->region = src;
      op->remote = remote;
      ucp_request_param_t p{};
      p.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
      p.cb.send = send_cb;
      p.user_data = op;
      p.memh = src->memh();
      finish_request(op, ucp_put_nbx(conn.ep_, src->data() + local_offset, length,
                                     remote->base() + remote_offset, remote->rkey_, &p));
      if (!pending_.contains(u.op_id)) return;  // failed at once
    }
    conn.unflushed_.push_back({u.op_id, h});
    if (!conn.flush_in_flight_) start_flush(conn);
    return;
  }
  ++writes_am_;
  ucx_idle_.store(false, std::memory_order_relaxed);  // a rendezvous needs the worker progressed
  OpCtx* op = new_op(OpCtx::kAmWrite);
  op->deadline = deadline();
  op->region = src;
  std::lock_guard<std::mutex> tx(conn.tx_mu_);
  h.seq = conn.tx_seq_++;
  encode_header(h, op->header);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMH;
  p.cb.send = send_cb;
  p.user_data = op;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  // Into device memory always by rendezvous: the receiver then has UCX fetch
  // the bytes straight into the region (ucp_am_recv_data_nbx, which knows the
  // memory type from the region's memh); an eager payload would need a CPU
  // copy into GPU memory, which this transport cannot do.
  if (remote->kind() == MemoryKind::kCuda) {
    p.flags |= UCP_AM_SEND_FLAG_RNDV;
  } else if (length <= am_eager_max_) {
    p.flags |= UCP_AM_SEND_FLAG_EAGER;
  }
  p.memh = src->memh();
  ucs_status_ptr_t r = ucp_am_send_nbx(conn.ep_, kAmWrite, op->header, kWriteHeaderBytes,
                                       src->data() + local_offset, length, &p);
  if (UCS_PTR_IS_ERR(r)) --conn.tx_seq_;  // never sent: the number is free again
  finish_user(u, op, r, conn.id(), "write failed");
}

void UcxCore::notify_one(UcxConnection& conn, UserOp u, WriteHeader h) {
  ucx_idle_.store(false, std::memory_order_relaxed);
  OpCtx* op = new_op(OpCtx::kSend);
  op->deadline = deadline();
  op->bytes.resize(4 + kWriteHeaderBytes);
  store_le(op->bytes.data(), 1, 4);
  std::lock_guard<std::mutex> tx(conn.tx_mu_);
  h.seq = conn.tx_seq_++;
  encode_header(h, op->bytes.data() + 4);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = op;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t r =
      ucp_am_send_nbx(conn.ep_, kAmNotify, nullptr, 0, op->bytes.data(), op->bytes.size(), &p);
  if (UCS_PTR_IS_ERR(r)) --conn.tx_seq_;
  finish_user(u, op, r, conn.id(), "notification failed");
}

// Ordering for ucp_put_nbx (RDMA, or put forced where UCX emulates it): a
// notification leaves only after a flush that covers its put completed, i.e.
// after the bytes are visible at the target. One flush is in flight per
// connection; puts issued meanwhile wait for the next one, so a window of
// writes shares one flush. (Shared memory skips all this: ucp_ep_flush_nbx
// flushes every lane, and UCX 1.13's tcp flush on the rendezvous lanes is a
// round trip, 24 us per ping-pong; the memcpy in write() needs no flush.)
void UcxCore::start_flush(UcxConnection& conn) {
  if (conn.unflushed_.empty() || conn.ep_ == nullptr) return;
  OpCtx* op = new_op(OpCtx::kFlush);
  op->conn = conn.shared_from_this();
  op->batch.swap(conn.unflushed_);
  conn.flush_in_flight_ = true;
  ++flushes_;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = send_cb;
  p.user_data = op;
  finish_request(op, ucp_ep_flush_nbx(conn.ep_, &p));
}

void UcxCore::on_flushed(const ConnPtr& conn, std::vector<UcxConnection::Unflushed> batch,
                         ucs_status_t status) {
  conn->flush_in_flight_ = false;
  if (status == UCS_OK && conn->state_ == UcxConnection::State::kReady) {
    announce(*conn, batch.data(), batch.size());
  } else {
    for (const auto& u : batch)
      complete(u.op_id, ucs_to_status(status, "flush failed"));
  }
  if (conn->state_ == UcxConnection::State::kReady && !conn->unflushed_.empty()) {
    start_flush(*conn);
  }
}

void UcxCore::announce(UcxConnection& conn, const UcxConnection::Unflushed* writes, size_t n) {
  // Only writes still pending are announced: one that timed out was reported
  // as failed, so the receiver must not hear of it.
  std::vector<uint64_t> ops;
  std::vector<uint8_t> payload;
  size_t k = 0;
  // Numbers are taken as the batch is encoded; held until it is sent.
  std::lock_guard<std::mutex> tx(conn.tx_mu_);
  auto send_batch = [&] {
    if (k == 0) return;
    store_le(payload.data(), k, 4);
    const bool sent = send_control(conn, kAmNotify, std::move(payload), OpCtx::kControl);
    if (!sent) conn.tx_seq_ -= k;
    for (uint64_t id : ops) {
      complete(id, sent ? Status::Ok()
                        : Unavailable("the notification to " + conn.peer() + " could not be sent"));
    }
    ops.clear();
    payload.clear();
    k = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    if (!pending_.contains(writes[i].op_id)) continue;
    if (k == 0) payload.assign(4, 0);
    payload.resize(4 + (k + 1) * kWriteHeaderBytes);
    WriteHeader h = writes[i].header;
    h.seq = conn.tx_seq_++;
    encode_header(h, payload.data() + 4 + k * kWriteHeaderBytes);
    ops.push_back(writes[i].op_id);
    if (++k == kNotifyBatch) send_batch();
  }
  send_batch();
}

Status UcxCore::send(UcxConnection& conn, std::span<const uint8_t> message, Completion done) {
  if (message.size() > kMaxMessageBytes) {
    return InvalidArgument(
        fmt::format("message of {} bytes exceeds the {}-byte limit; larger "
                    "payloads belong in a write",
                    message.size(), kMaxMessageBytes));
  }
  if (!conn.is_open()) return Unavailable("connection to " + conn.peer() + " is closed");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr || conn.state_ == UcxConnection::State::kClosed) {
      return Unavailable("connection to " + conn.peer() + " is closed");
    }
    if (conn.state_ == UcxConnection::State::kHandshake) {
      UcxConnection::Queued q;
      q.op_id = pending_.add(conn.id(), deadline(), std::move(done));
      q.message.assign(message.begin(), message.end());
      conn.queued_.push_back(std::move(q));
    } else {
      start_send(conn, UserOp{0, std::move(done)}, message);
      run_deferred();
    }
  }
  maybe_wake();
  return Status::Ok();
}

void UcxCore::start_send(UcxConnection& conn, UserOp u, std::span<const uint8_t> message) {
  ucx_idle_.store(false, std::memory_order_relaxed);
  OpCtx* op = new_op(OpCtx::kSend);
  op->deadline = deadline();
  op->bytes.assign(message.begin(), message.end());  // send() copies before it returns
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = op;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  // Numbered like notifications, so a message never overtakes a write
  // notified through the ring before it.
  std::lock_guard<std::mutex> tx(conn.tx_mu_);
  store_le(op->header, conn.tx_seq_++, kSeqHeaderBytes);
  ucs_status_ptr_t r = ucp_am_send_nbx(conn.ep_, kAmMessage, op->header, kSeqHeaderBytes,
                                       op->bytes.data(), op->bytes.size(), &p);
  if (UCS_PTR_IS_ERR(r)) --conn.tx_seq_;
  finish_user(u, op, r, conn.id(), "send failed");
}

// False when UCX refused the message at once.
bool UcxCore::send_control(UcxConnection& conn, unsigned id, std::vector<uint8_t> payload,
                           OpCtx::Kind kind) {
  if (conn.ep_ == nullptr) return false;
  OpCtx* op = new_op(kind);
  op->conn = conn.shared_from_this();
  op->bytes = std::move(payload);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = op;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t r =
      ucp_am_send_nbx(conn.ep_, id, nullptr, 0, op->bytes.data(), op->bytes.size(), &p);
  const bool ok = !UCS_PTR_IS_ERR(r);
  finish_request(op, r);
  return ok;
}

// ---------------------------------------------------------------------------
// Incoming active messages

bool UcxCore::validate_target(const WriteHeader& h, std::shared_ptr<UcxRegion>* region) {
  std::shared_ptr<UcxRegion> r;
  {
    std::lock_guard<std::mutex> lock(export_mu_);
    auto it = exported_.find(h.region);
    if (it != exported_.end()) r = it->second.lock();
  }
  // The secret makes a region id useless to a peer that never got the key;
  // the bounds keep a valid key inside its region.
  if (!r || r->secret() != h.secret || h.offset > r->length() ||
      h.length > r->length() - h.offset) {
    return false;
  }
  *region = std::move(r);
  return true;
}

bool UcxCore::validate_target_cached(const WriteHeader& h, ValidTarget* last) {
  if (h.region != last->region || h.secret != last->secret ||
      last->unexported != unexported_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(export_mu_);
    auto it = exported_.find(h.region);
    std::shared_ptr<UcxRegion> r = it != exported_.end() ? it->second.lock() : nullptr;
    if (!r || r->secret() != h.secret) return false;
    *last =
        ValidTarget{unexported_.load(std::memory_order_relaxed), h.region, h.secret, r->length()};
  }
  return h.offset <= last->length && h.length <= last->length - h.offset;
}

void UcxCore::reject_write(const UcxConnection* conn, const std::string& why) {
  const uint64_t n = ++rejected_writes_;
  // The first few say why; a flood from a broken peer stays one line in 1000.
  if (n <= 10 || n % 1000 == 0) {
    PSLD_LOG_WARN("ucx: rejected an incoming write from {} ({}; {} rejected so far)",
                  conn != nullptr ? conn->peer() : std::string("an unknown endpoint"), why, n);
  }
}

ucs_status_t UcxCore::on_am(unsigned id, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param) {
  ConnPtr conn;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) {
    auto it = by_ep_.find(param->reply_ep);
    if (it != by_ep_.end()) conn = it->second;
  }
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (!conn || conn->state_ == UcxConnection::State::kClosed) {
    // A late message for a connection we closed; a rendezvous descriptor is
    // released by UCX when we return UCS_OK without receiving it.
    return UCS_OK;
  }
  if (id == kAmWrite) return on_am_write(conn, header, header_length, data, length, param);
  // A message's header is its sequence number; control messages have none.
  const size_t want_header = id == kAmMessage ? kSeqHeaderBytes : 0;
  if (header_length != want_header || length > kMaxMessageBytes + 64) {
    ++rejected_messages_;
    PSLD_LOG_WARN("ucx: dropped a malformed message (id {}, {} bytes) from {}", id, length,
                  conn->peer());
    return UCS_OK;
  }
  const uint64_t seq =
      want_header != 0 ? load_le(static_cast<const uint8_t*>(header), kSeqHeaderBytes) : 0;
  if (rndv) {
    // UCX chose rendezvous for a small message (a low UCX_RNDV_THRESH): fetch
    // it into a buffer and handle it when it lands.
    OpCtx* op = new_op(OpCtx::kRecvControl);
    op->conn = conn;
    op->am_id = id;
    op->seq = seq;
    op->bytes.resize(length);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = recv_am_cb;
    p.user_data = op;
    // Its place in the sequence is taken now, so that a failed receive
    // cannot hold up the ring; it is delivered when it lands.
    if (id == kAmMessage && conn->state_ == UcxConnection::State::kReady) {
      arrived_in_order(conn, seq);
    }
    finish_request(op, ucp_am_recv_data_nbx(worker_, data, op->bytes.data(), length, &p));
    return UCS_OK;
  }
  handle_control(conn, id, seq, {static_cast<const uint8_t*>(data), length});
  return UCS_OK;
}

void UcxCore::handle_control(const ConnPtr& conn, unsigned id, uint64_t seq,
                             std::span<const uint8_t> payload) {
  if (conn->state_ == UcxConnection::State::kClosed) return;
  switch (id) {
    case kAmMessage: {
      if (hold_early(*conn, id, seq, payload)) return;
      if (conn->state_ != UcxConnection::State::kReady) break;
      arrived_in_order(conn, seq);
      Event e;
      e.kind = Event::kMessage;
      e.conn = conn;
      e.bytes.assign(payload.begin(), payload.end());
      queue_event(std::move(e));
      return;
    }
    case kAmNotify:
      if (hold_early(*conn, id, 0, payload)) return;
      if (conn->state_ != UcxConnection::State::kReady) break;
      handle_notify(conn, payload);
      return;
    // The handshake changes state here, at once, so that a message that
    // follows it in the same ucp_worker_progress() finds the connection
    // ready; what it has to send waits for run_deferred().
    case kAmHello:
      handle_hello(conn, payload);
      return;
    case kAmHelloAck:
      handle_hello_ack(conn, payload);
      return;
    case kAmBye:
      // Every notification the peer published before its bye is delivered
      // before the disconnect.
      drain_ring(conn, std::numeric_limits<uint64_t>::max(), false);
      close_locked(*conn, Unavailable("peer closed the connection"), false);
      return;
    case kAmWake:
      return;  // its arrival woke the worker; progress() polls the rings next
    default:
      break;
  }
  ++rejected_messages_;
  PSLD_LOG_WARN("ucx: dropped an unexpected message (id {}) from {}", id, conn->peer());
}

void UcxCore::handle_notify(const ConnPtr& conn, std::span<const uint8_t> payload) {
  if (payload.size() < 4) {
    reject_write(conn.get(), "truncated notification");
    return;
  }
  const uint64_t n = load_le(payload.data(), 4);
  if (n == 0 || n > kNotifyBatch || payload.size() != 4 + n * kWriteHeaderBytes) {
    reject_write(conn.get(), "malformed notification batch");
    return;
  }
  for (uint64_t i = 0; i < n; ++i) {
    const WriteHeader h = decode_header(payload.data() + 4 + i * kWriteHeaderBytes);
    arrived_in_order(conn, h.seq);
    deliver_notification(conn, h);
  }
}

ucs_status_t UcxCore::on_am_write(const ConnPtr& conn, const void* header, size_t header_length,
                                  void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (conn->state_ != UcxConnection::State::kReady || header_length != kWriteHeaderBytes) {
    reject_write(conn.get(), "malformed write header");
    return UCS_OK;
  }
  const WriteHeader h = decode_header(static_cast<const uint8_t*>(header));
  // A rendezvous write is notified when its bytes land, possibly after
  // notifications numbered later; its number is taken now so that a failed
  // receive cannot hold up the ring.
  arrived_in_order(conn, h.seq);
  std::shared_ptr<UcxRegion> region;
  if (h.length != length || !validate_target(h, &region)) {
    reject_write(conn.get(),
                 "write names no region we export, a wrong secret, or bytes outside "
                 "the region");
    return UCS_OK;  // a rendezvous is released unreceived
  }
  uint8_t* dst = region->data() + h.offset;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Rendezvous: UCX fetches the payload straight into the target region,
    // and on_write waits for that to complete.
    OpCtx* op = new_op(OpCtx::kRecvWrite);
    op->conn = conn;
    op->region = region;
    op->notify = h.notify;
    op->length = h.length;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.recv_am = recv_am_cb;
    p.user_data = op;
    p.memh = region->memh();
    finish_request(op, ucp_am_recv_data_nbx(worker_, data, dst, length, &p));
    return UCS_OK;
  }
  // Eager: UCX already holds the bytes; one copy puts them in place. Our
  // writers send to device memory by rendezvous only.
  if (region->kind() != MemoryKind::kHost) {
    reject_write(conn.get(), "eager write into device memory (the writer must use rendezvous)");
    return UCS_OK;
  }
  if (length > 0) std::memcpy(dst, data, length);
  queue_write(conn, h.notify, h.length);
  return UCS_OK;
}

// ---------------------------------------------------------------------------
// Closing

void UcxCore::on_ep_error(ucp_ep_h ep, ucs_status_t status) {
  auto it = by_ep_.find(ep);
  if (it == by_ep_.end()) return;
  ConnPtr conn = it->second;
  failed_.emplace_back(conn, Unavailable(fmt::format("connection to {} failed: {} (peer died or "
                                                     "closed)",
                                                     conn->peer(), ucs_status_string(status))));
}

void UcxCore::close_connection(UcxConnection& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (conn.state_ == UcxConnection::State::kClosed) return;
    close_locked(conn, Aborted("connection closed locally"), true);
    run_deferred();
  }
  maybe_wake();
}

void UcxCore::close_locked(UcxConnection& conn, const Status& why, bool send_bye) {
  if (conn.state_ == UcxConnection::State::kClosed) return;
  if (conn.state_ == UcxConnection::State::kHandshake) --handshaking_;
  const bool was_visible = conn.state_ == UcxConnection::State::kReady || conn.client_;
  conn.state_ = UcxConnection::State::kClosed;
  conn.open_ = false;
  release_rings(conn);
  for (auto& r : pending_.fail_connection(conn.id(), why))
    push_completion(std::move(r));
  conn.queued_.clear();
  conn.unflushed_.clear();
  ConnPtr self = conn.shared_from_this();
  if (was_visible) {
    Event e;
    e.kind = Event::kDisconnect;
    e.conn = self;
    e.why = why;
    queue_event(std::move(e));
  }
  // The bye tells the peer at once, whatever the lanes; UCX's own disconnect
  // (through the connection manager, or a closed socket) comes later or, over
  // shared memory, only with keep-alive.
  if (send_bye && conn.ep_ != nullptr) {
    conn.bye_in_flight_ = true;
    conn.bye_deadline_ = Clock::now() + std::min<Clock::duration>(options_.common.op_timeout,
                                                                  std::chrono::seconds(1));
    send_control(conn, kAmBye, {}, OpCtx::kBye);  // its completion queues the close
    return;
  }
  to_close_.push_back(self);
}

void UcxCore::force_close_ep(UcxConnection& conn) {
  if (conn.ep_ == nullptr) return;
  ucp_ep_h ep = conn.ep_;
  conn.ep_ = nullptr;
  conn.bye_in_flight_ = false;
  by_ep_.erase(ep);
  conns_.erase(conn.id());
  // FORCE: the peer may be dead, and a flushing close would wait for it.
  // Outstanding requests complete with UCS_ERR_CANCELED (their operations
  // already failed above, so PendingOps ignores them).
  OpCtx* op = new_op(OpCtx::kClose);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = op;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  finish_request(op, ucp_ep_close_nbx(ep, &p));
}

void UcxCore::run_deferred() {
  for (;;) {
    if (!accepts_.empty()) {
      std::vector<ucp_conn_request_h> a;
      a.swap(accepts_);
      for (auto* r : a)
        accept(r);
      continue;
    }
    if (!acks_.empty()) {
      std::vector<ConnPtr> a;
      a.swap(acks_);
      for (auto& conn : a) {
        if (conn->state_ == UcxConnection::State::kReady) {
          send_control(*conn, kAmHelloAck, hello_payload(*conn), OpCtx::kControl);
        }
      }
      continue;
    }
    if (!ready_.empty()) {
      std::vector<ConnPtr> r;
      r.swap(ready_);
      for (auto& conn : r)
        dispatch_queued(*conn);
      continue;
    }
    if (!failed_.empty()) {
      std::vector<std::pair<ConnPtr, Status>> f;
      f.swap(failed_);
      for (auto& [conn, why] : f) {
        close_locked(*conn, why, false);
        to_close_.push_back(conn);  // also when a bye was in flight
      }
      continue;
    }
    if (!flushed_.empty()) {
      std::vector<Flushed> f;
      f.swap(flushed_);
      for (auto& x : f)
        on_flushed(x.conn, std::move(x.batch), x.status);
      continue;
    }
    if (!to_close_.empty()) {
      std::vector<ConnPtr> c;
      c.swap(to_close_);
      for (auto& conn : c)
        force_close_ep(*conn);
      continue;
    }
    dead_rings_.clear();
    break;
  }
}

void UcxCore::check_deadlines(Clock::time_point now) {
  if (pending_.next_deadline() <= now) {
    // UCX 1.13 can cancel receives only; a send keeps running after its
    // operation timed out, and its late completion is ignored by PendingOps.
    for (OpCtx* op = live_ops_; op != nullptr; op = op->next) {
      if (op->op_id != 0 && op->request != nullptr && op->deadline <= now) {
        ucp_request_cancel(worker_, op->request);
      }
    }
    for (auto& r : pending_.expire(now))
      push_completion(std::move(r));
  }
  if (handshaking_ == 0 && to_close_.empty()) {
    bool any_bye = false;
    for (auto& [id, conn] : conns_)
      any_bye |= conn->bye_in_flight_;
    if (!any_bye) return;
  }
  std::vector<ConnPtr> expired_handshakes, stuck_byes;
  for (auto& [id, conn] : conns_) {
    if (conn->state_ == UcxConnection::State::kHandshake && conn->handshake_deadline_ <= now) {
      expired_handshakes.push_back(conn);
    }
    if (conn->bye_in_flight_ && conn->bye_deadline_ <= now) stuck_byes.push_back(conn);
  }
  for (auto& conn : expired_handshakes) {
    close_locked(*conn,
                 Unavailable(fmt::format("{} did not answer the handshake within {} ms (nobody "
                                         "listening there, or its transport is not progressed)",
                                         conn->peer(), options_.common.op_timeout.count())),
                 false);
  }
  for (auto& conn : stuck_byes)
    to_close_.push_back(conn);
  run_deferred();
}

// ---------------------------------------------------------------------------
// Progress

size_t UcxCore::progress() {
  std::lock_guard<std::mutex> progress_lock(progress_mu_);
  // The fast path, while UCX is idle and peers write into our rings: no
  // worker lock, no worker progress, just the rings (see kUcxPollPeriod and
  // kRingPollsPerCall).
  if (ucx_idle_.load(std::memory_order_relaxed) &&
      polled_version_ == rx_version_.load(std::memory_order_acquire) &&
      poll_clock() - last_ucx_progress_ < ucx_poll_period_) {
    size_t n = 0;
    for (int i = 0; i < kRingPollsPerCall && n == 0; ++i)
      n = poll_rings_unlocked();
    return n;
  }
  size_t work = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr) return 0;
    drain_graveyard();
    work = ucp_worker_progress(worker_);
    ucx_poll_period_ =
        work == 0 ? std::min(2 * ucx_poll_period_, kUcxPollPeriodMax) : kUcxPollPeriod;
    last_ucx_progress_ = poll_clock();
    run_deferred();
    // Deadlines are milliseconds away: look at them once per tick of the
    // coarse clock (a variable in the vDSO, no TSC read), not on every call of
    // a busy-polling loop, where the check (a clock read and PendingOps' lock)
    // was ~10% of an idle spin.
    timespec coarse{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &coarse);
    const int64_t tick = static_cast<int64_t>(coarse.tv_sec) * 1000000000 + coarse.tv_nsec;
    if (tick != last_deadline_tick_) {
      last_deadline_tick_ = tick;
      check_deadlines(Clock::now());
    }
    if (!rx_conns_.empty()) {
      bool attached = false;
      for (const ConnPtr& conn : rx_conns_) {
        attached |= conn->rx_ring_->attached();
        drain_ring(conn, std::numeric_limits<uint64_t>::max(), true);
      }
      rings_attached_ = attached;
    }
    const uint64_t version = rx_version_.load(std::memory_order_acquire);
    if (polled_version_ != version) {
      polled_.clear();
      for (const ConnPtr& conn : rx_conns_)
        polled_.push_back(Polled{conn, conn.get(), conn->rx_ring_, ValidTarget{}});
      polled_version_ = version;
    }
    // Last, after whatever this call queued (queue_event cleared it): those
    // events are delivered below, so they need no other progress().
    ucx_idle_.store(work == 0 && rings_attached_, std::memory_order_relaxed);
    events_.swap(delivering_);
  }
  for (Event& e : delivering_)
    deliver(e);
  work += delivering_.size();
  delivering_.clear();
  return work;
}

void UcxCore::deliver(Event& e) {
  if (e.kind == Event::kCompletion) {
    e.ready.run();
    return;
  }
  if (shut_) return;  // after shutdown no handler runs
  switch (e.kind) {
    case Event::kAccept:
      handler_->on_accept(e.conn);
      break;
    case Event::kWrite:
      handler_->on_write(e.conn, e.notify, e.length);
      break;
    case Event::kMessage:
      handler_->on_message(e.conn, e.bytes);
      break;
    case Event::kDisconnect:
      handler_->on_disconnect(e.conn, e.why);
      break;
    case Event::kCompletion:
      break;
  }
}

void UcxCore::wait(std::chrono::milliseconds timeout) {
  auto until = Clock::now() + timeout;
  bool advertised = false;
  auto stop_advertising = [&] {
    if (advertised && --ring_sleepers_ == 0) set_rings_sleeping(false);
    advertised = false;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr) return;
    if (!events_.empty()) return;
    ucx_idle_.store(false,
                    std::memory_order_relaxed);  // whatever wakes us, the next progress() asks UCX
    until = std::min(until, pending_.next_deadline());
    if (handshaking_ > 0) until = std::min(until, Clock::now() + std::chrono::milliseconds(10));
    if (!rx_conns_.empty()) {
      // Writers that publish a ring record from now on send kAmWake; one
      // published before is seen here (seq_cst flag store and stamp loads,
      // against ring_notify's stamp store and flag load).
      advertised = true;
      if (ring_sleepers_++ == 0) set_rings_sleeping(true);
      for (const ConnPtr& conn : rx_conns_) {
        if (ring_has_next(*conn)) {
          stop_advertising();
          return;
        }
      }
    }
    // Arming fails with BUSY when events are already pending: no sleep.
    if (ucp_worker_arm(worker_) != UCS_OK) {
      stop_advertising();
      return;
    }
    sleepers_.fetch_add(1);
  }
  pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  const auto left = until - Clock::now();
  if (left > Clock::duration::zero()) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    ppoll(fds, 2, &ts, nullptr);
  }
  if (fds[1].revents & POLLIN) {
    uint64_t v = 0;
    [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof(v));
  }
  if (advertised) {
    std::lock_guard<std::mutex> lock(mu_);
    stop_advertising();
  }
  sleepers_.fetch_sub(1);
}

// ---------------------------------------------------------------------------
// Memory

Result<std::shared_ptr<MemoryRegion>> UcxCore::register_memory(void* data, size_t length,
                                                               MemoryKind kind) {
  if (data == nullptr || length == 0) {
    return InvalidArgument("register_memory needs a non-null pointer and a non-zero length");
  }
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return InvalidArgument("unknown memory kind");
  }
  if (kind == MemoryKind::kCuda && !cuda_supported_) {
    return Unimplemented(fmt::format("ucx cannot register CUDA memory: {}", cuda_detail_));
  }
  if (shut_) return Unavailable("UCX transport is shut down");
  if (auto hit = cache_.find(data, length, kind)) return std::shared_ptr<MemoryRegion>(hit);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = data;
  mp.length = length;
  if (kind == MemoryKind::kCuda) {
    // Named rather than detected: detection needs UCX's memory hooks, which
    // psld's tests turn off, or a driver query per call.
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context_->handle, &mp, &memh);
  if (st != UCS_OK) return ucs_to_status(st, fmt::format("ucp_mem_map of {} bytes", length));
  PSLD_ASSIGN_OR_RETURN(auto region, make_region(static_cast<uint8_t*>(data), length, kind, memh));
  return std::shared_ptr<MemoryRegion>(cache_.insert(std::move(region)));
}

Result<std::shared_ptr<MemoryRegion>> UcxCore::allocate_memory(size_t length, MemoryKind kind) {
  if (length == 0) return InvalidArgument("allocate_memory needs a non-zero length");
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return InvalidArgument("unknown memory kind");
  }
  if (kind == MemoryKind::kCuda && !cuda_supported_) {
    return Unimplemented(fmt::format("ucx cannot allocate CUDA memory: {}", cuda_detail_));
  }
  const CudaDriver* driver = nullptr;
  if (kind == MemoryKind::kCuda) {
    // UCX allocates device memory uninitialised; the driver zeroes it.
    PSLD_ASSIGN_OR_RETURN(driver, CudaDriver::get());
  }
  if (shut_) return Unavailable("UCX transport is shut down");
  // A peer on this host maps host memory allocated this way, and a put into
  // it is a plain memcpy (map_allocated).
  PSLD_ASSIGN_OR_RETURN(MappedAllocation mapped,
                        map_allocated(context_->handle, length, kind == MemoryKind::kCuda));
  const ucp_mem_h memh = mapped.memh;
  if (driver != nullptr) {
    if (Status z = driver->zero(mapped.base, length); !z.ok()) {
      ucp_mem_unmap(context_->handle, memh);
      return z.with_context("zeroing CUDA memory UCX allocated");
    }
  } else {
    std::memset(mapped.base, 0, length);
  }
  PSLD_ASSIGN_OR_RETURN(auto region, make_region(mapped.base, length, kind, memh));
  return std::shared_ptr<MemoryRegion>(std::move(region));
}

// Packs the remote key and exports the region; takes ownership of memh.
Result<std::shared_ptr<UcxRegion>> UcxCore::make_region(uint8_t* data, size_t length,
                                                        MemoryKind kind, ucp_mem_h memh) {
  const uint64_t id = next_region_.fetch_add(1);
  const uint64_t secret = random_u64();
  void* packed = nullptr;
  size_t packed_size = 0;
  ucs_status_t st = ucp_rkey_pack(context_->handle, memh, &packed, &packed_size);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_->handle, memh);
    return ucs_to_status(st, "ucp_rkey_pack");
  }
  // magic, version, kind, exporter, region id, base, length, secret, UCX's
  // packed key, and a checksum over all of it.
  WireWriter w;
  w.u32(kKeyMagic);
  w.u8(kWireVersion);
  w.u8(static_cast<uint8_t>(kind));
  w.u64(instance_);
  w.u64(id);
  w.u64(reinterpret_cast<uintptr_t>(data));
  w.u64(length);
  w.u64(secret);
  w.blob({static_cast<const uint8_t*>(packed), packed_size});
  ucp_rkey_buffer_release(packed);
  w.u64(fnv1a(w.data()));
  std::weak_ptr<UcxCore> weak = weak_from_this();
  auto* raw = new UcxRegion(data, length, kind, id, context_, memh, instance_, secret, w.take());
  // The deleter unexports the region, so a peer's later write is rejected.
  std::shared_ptr<UcxRegion> region(raw, [weak, id](UcxRegion* p) {
    if (auto core = weak.lock()) {
      std::lock_guard<std::mutex> lock(core->export_mu_);
      core->exported_.erase(id);
      core->unexported_.fetch_add(1, std::memory_order_release);
    }
    delete p;
  });
  std::lock_guard<std::mutex> lock(export_mu_);
  exported_[id] = region;
  return region;
}

Status UcxCore::invalidate(void* data, size_t length) {
  std::vector<std::shared_ptr<UcxRegion>> regions;
  for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kCuda}) {
    if (auto r = cache_.find(data, length, k)) regions.push_back(std::move(r));
  }
  PSLD_RETURN_IF_ERROR(cache_.invalidate(data, length));
  // Peers' writes to these regions are rejected from now on; the memory stays
  // registered until the last holder lets go.
  std::lock_guard<std::mutex> lock(export_mu_);
  for (auto& r : regions)
    exported_.erase(r->id());
  unexported_.fetch_add(1, std::memory_order_release);
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Shutdown

void UcxCore::shutdown() {
  std::vector<Event> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_ = true;
    if (worker_ != nullptr) {
      if (listener_ != nullptr) {
        for (ucp_conn_request_h r : accepts_)
          ucp_listener_reject(listener_, r);
        ucp_listener_destroy(listener_);
        listener_ = nullptr;
      }
      accepts_.clear();
      std::vector<ConnPtr> conns;
      for (auto& [id, conn] : conns_)
        conns.push_back(conn);
      for (auto& conn : conns)
        close_locked(*conn, Aborted("transport shut down"), true);
      run_deferred();
      // Give the byes a moment to leave (they do not need the peer to
      // progress on tcp or shared memory); then close whatever is left.
      const auto give_up = Clock::now() + std::min<Clock::duration>(options_.common.op_timeout,
                                                                    std::chrono::milliseconds(200));
      for (;;) {
        bool waiting = false;
        for (auto& [id, conn] : conns_)
          waiting |= conn->bye_in_flight_;
        if (!waiting || Clock::now() > give_up) break;
        ucp_worker_progress(worker_);
        run_deferred();
      }
      for (auto& [id, conn] : conns_)
        to_close_.push_back(conn);
      run_deferred();
      // Force-closing completes every request UCX still holds; wait (briefly)
      // for the close requests themselves.
      const auto close_by = Clock::now() + std::chrono::seconds(1);
      while (live_count_ > 0 && Clock::now() < close_by) {
        ucp_worker_progress(worker_);
        run_deferred();
      }
      {
        // Waits for copies into mapped memory still running in write().
        std::unique_lock<std::shared_mutex> map(mapping_mu_);
        std::lock_guard<std::mutex> rlock(rkey_mu_);
        for (UcxRemoteRegion* remote : live_remotes_) {
          if (remote->rkey_ != nullptr) ucp_rkey_destroy(remote->rkey_);
          remote->rkey_ = nullptr;
          remote->mapped_base_ = nullptr;
        }
        live_remotes_.clear();
      }
      drain_graveyard();
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
      // Requests UCX never called back for are gone with the worker.
      while (live_ops_ != nullptr)
        unlink_op(live_ops_);
      for (OpCtx* op : free_ops_)
        delete op;
      free_ops_.clear();
      by_ep_.clear();
      conns_.clear();
      flushed_.clear();
      acks_.clear();
      ready_.clear();
      failed_.clear();
      to_close_.clear();
      rx_conns_.clear();
      dead_rings_.clear();
    }
    events.swap(events_);
  }
  // Wake threads in wait(); they find the worker gone.
  wake();
  for (int i = 0; i < 1000 && sleepers_.load() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Completions still owed are delivered here, exactly once; handler calls
  // are dropped (after shutdown no handler runs).
  for (Event& e : events) {
    if (e.kind == Event::kCompletion) e.ready.run();
  }
  for (auto& r : pending_.fail_all(Aborted("transport shut down")))
    r.run();
  cache_.clear();
  std::lock_guard<std::mutex> lock(export_mu_);
  exported_.clear();
  unexported_.fetch_add(1, std::memory_order_release);
}

// ---------------------------------------------------------------------------
// Connection methods: thin wrappers that find the core.

Result<std::shared_ptr<RemoteRegion>> UcxConnection::import_region(std::span<const uint8_t> key) {
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->import_region(*this, key);
}

Status UcxConnection::check_write(const WriteRequest& request) const {
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->check_write(*this, request);
}

Status UcxConnection::write(const WriteRequest& request, Completion done) {
  if (!done && request.length <= kRingCopyMax && tx_ring_mapped_.load(std::memory_order_acquire)) {
    Status status;
    if (UcxCore::write_through_ring(*this, request, &status)) return status;
  }
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->write(*this, request, std::move(done));
}

Status UcxConnection::send(std::span<const uint8_t> message, Completion done) {
  auto core = core_.lock();
  if (!core) return Unavailable("UCX transport is gone");
  return core->send(*this, message, std::move(done));
}

void UcxConnection::close() {
  if (auto core = core_.lock()) {
    core->close_connection(*this);
  } else {
    open_ = false;
  }
}

// ---------------------------------------------------------------------------

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(std::shared_ptr<UcxCore> core) : core_(std::move(core)) {}
  ~UcxTransport() override { core_->shutdown(); }

  std::string_view name() const override { return "ucx"; }
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
  const uint8_t* local_view(const RemoteRegion& remote) const override {
    // Host memory the peer allocated and this process mapped (shared memory
    // on one host); device memory is never read by this process's CPU.
    const auto* r = dynamic_cast<const UcxRemoteRegion*>(&remote);
    if (r == nullptr || !r->mapped() || r->kind() != MemoryKind::kHost) return nullptr;
    return r->mapped_base();
  }
  size_t progress() override { return core_->progress(); }
  void wait(std::chrono::milliseconds timeout) override { core_->wait(timeout); }
  void wake() override { core_->wake(); }
  void shutdown() override { core_->shutdown(); }

  const UcxCore& core() const { return *core_; }

 private:
  std::shared_ptr<UcxCore> core_;
};

Result<std::unique_ptr<Transport>> create_ucx_transport(const TransportOptions& options,
                                                        Handler* handler) {
  if (handler == nullptr) return InvalidArgument("create_ucx_transport needs a Handler");
  WritePath forced;
  if (options.ucx.write_path == "auto") {
    forced = WritePath::kAuto;
  } else if (options.ucx.write_path == "put") {
    forced = WritePath::kPut;
  } else if (options.ucx.write_path == "am") {
    forced = WritePath::kAm;
  } else {
    return InvalidArgument(
        fmt::format("ucx.write_path '{}' is not valid; accepted values: auto, "
                    "put, am",
                    options.ucx.write_path));
  }
  if (options.common.op_timeout.count() <= 0) {
    return InvalidArgument("common.op_timeout must be positive");
  }
  const uint32_t slots = options.ucx.notify_ring_slots;
  if (slots != 0 &&
      (slots < kMinRingSlots || slots > kMaxRingSlots || (slots & (slots - 1)) != 0)) {
    return InvalidArgument(
        fmt::format("ucx.notify_ring_slots {} is not valid; use a power of two from {} to {}, or "
                    "0 for no notification ring",
                    slots, kMinRingSlots, kMaxRingSlots));
  }
  sockaddr_storage listen{};
  socklen_t listen_len = 0;
  const bool listening = !options.common.listen_address.empty();
  if (listening) {
    PSLD_RETURN_IF_ERROR(
        parse_socket_address(options.common.listen_address, true, &listen, &listen_len)
            .with_context("common.listen_address"));
  }
  auto core = std::make_shared<UcxCore>(options, handler, forced);
  Status s = core->init(listening ? &listen : nullptr, listen_len);
  if (!s.ok()) {
    core->shutdown();
    return s;
  }
  return std::unique_ptr<Transport>(new UcxTransport(std::move(core)));
}

Result<UcxCounters> ucx_counters(const Transport& transport) {
  auto* t = dynamic_cast<const UcxTransport*>(&transport);
  if (t == nullptr) return InvalidArgument("not a UCX transport");
  return t->core().counters();
}

}  // namespace psld::transport
