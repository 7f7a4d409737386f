// The UCX backend's internal header: the classes, constants and hot-path
// helpers that transports/ucx/*.cc share. See ucx_transport.h for what the
// backend offers and docs/transport-results.md for what it measured. The
// code is cut by concern, as in UCX itself: setup.cc (context, worker,
// callbacks), wireup.cc (connect, accept, handshake, remote keys), memory.cc,
// ring.cc (the notification ring: its memory, offer, reading and sleeping),
// rma.cc (the write path, the writer's side of the ring included), am.cc
// (sends and incoming active messages), progress.cc (requests, progress,
// wait, deadlines, closing), transport.cc (shutdown, the Transport and
// Connection objects, the factory), util.cc.
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
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/hash.h"
#include "base/mutex.h"
#include "base/random.h"
#include "base/wire.h"
#include "transports/common/pending_ops.h"
#include "transports/common/registration_cache.h"
#include "transports/common/side_channel.h"
#include "transports/ucx/ucx_transport.h"

namespace psld::transport {

// What every file of the backend shares and nothing outside it uses.
namespace ucx_detail {

constexpr uint32_t kKeyMagic = 0x4b585350;    // "PSXK"
constexpr uint32_t kHelloMagic = 0x48585350;  // "PSXH"
// 2: notifications and messages carry a sequence number, and the handshake
// offers a notification ring. 3: connections start with psld's own bootstrap
// (bootstrap.cc), and every active message names its connection by the
// receiver's token. 4: the hello names the sender's process (pid and
// namespace key).
constexpr uint8_t kWireVersion = 4;
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

// Every active message's header starts with the receiving connection's
// token, which the bootstrap told the sender: connections to one peer
// process share one UCX endpoint (see UcxCore::PeerEp), so the endpoint a
// message arrived on cannot say which connection it is for.
constexpr size_t kTokenBytes = 8;

// ---------------------------------------------------------------------------
// The bootstrap (bootstrap.cc)
//
// A UCX transport listens with a TCP socket of its own, not a UCX listener:
// UCX 1.13's listener aborted the process on one malformed connection
// request, before psld saw the connection (docs/reliability.md). Nothing of
// UCX is reachable through it: a dialer first proves that it knows the job's
// secret, and only then do the two sides exchange UCX worker addresses and
// make endpoints from them. Frames, little-endian:
//
//   [u32 length of the rest][u32 kBootMagic][u8 kWireVersion][u8 type] body
//
//   kChallenge  acceptor -> dialer, at once: nonce_a, instance_a
//   kRequest    dialer -> acceptor: nonce_d, instance_d, token_d, address_d,
//               proof_d
//   kAccept     acceptor -> dialer: token_a, address_a, proof_a
//   kRefuse     acceptor -> dialer: why (text), then the acceptor closes
//   kBye        either way, after the bootstrap: this side closes the
//               connection (its active-message bye follows over UCX)
//
// After the accept the socket stays open for the connection's life, as its
// watch (Watch): the kernel closes it when the process ends, however it
// ends, so an end of stream without a kBye before it says the peer is gone,
// within milliseconds. UCX alone found that only by keep-alive over shared
// memory (op_timeout / 4), which left workers waiting on a killed server for
// seconds. A stopped or cut-off peer keeps its socket open: liveness
// heartbeats find that one (lib/runtime).
//
// A proof is an HMAC-SHA256 keyed by the secret (CommonOptions::secret, may
// be empty) over a label, the side, both nonces, both instances, the tokens
// and the addresses (boot_proof): good for one pair of nonces only, and not
// valid reflected to its sender. Nonces come from libsodium's CSPRNG.
constexpr uint32_t kBootMagic = 0x42585350;  // "PSXB"
constexpr size_t kBootNonceBytes = 32;
constexpr size_t kBootProofBytes = 32;
// UCX 1.13's worker address over tcp and shared memory is ~200-600 bytes;
// one with every device of a large node stays well under this.
constexpr size_t kMaxWorkerAddress = 16 << 10;
constexpr size_t kMaxBootReason = 512;
constexpr size_t kMaxBootFrame = kMaxWorkerAddress + 256;
// Bootstraps being accepted at once; connections beyond are closed at once.
// Above the runtime's own caps of connections that have not said their hello
// (64): a good dialer finishes its bootstrap in a round trip, and the
// runtime's door then counts and refuses the excess itself. Each holds at
// most ~2 * kMaxBootFrame of buffers.
constexpr size_t kMaxAcceptingBoots = 256;

enum class BootType : uint8_t { kChallenge = 1, kRequest, kAccept, kRefuse, kBye };
using BootNonce = std::array<uint8_t, kBootNonceBytes>;
using BootProof = std::array<uint8_t, kBootProofBytes>;

struct BootFrame {
  BootType type = BootType::kChallenge;
  BootNonce nonce{};             // challenge: the acceptor's; request: the dialer's
  uint64_t instance = 0;         // challenge, request: the sender's transport
  uint64_t token = 0;            // request, accept: the sender's connection token
  std::vector<uint8_t> address;  // request, accept: the sender's UCX worker address
  BootProof proof{};             // request, accept
  std::string reason;            // refuse
};
std::vector<uint8_t> encode_boot_frame(const BootFrame& frame);
// Reads the frame at the front of `input`: its length in bytes, 0 when the
// frame is not complete yet, or -1 for bytes that are not a well-formed frame
// (wrong magic or version, a length beyond kMaxBootFrame, a bad body).
ptrdiff_t decode_boot_frame(std::span<const uint8_t> input, BootFrame* frame);
// The proof of the dialer (its request; `accept` null) or of the acceptor
// (its accept, which answers `request`).
BootProof boot_proof(std::string_view secret, const BootFrame& challenge, const BootFrame& request,
                     const BootFrame* accept);
// A connection token: from the CSPRNG, never 0.
uint64_t random_token();

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

// What ucp_ep_print_info says about an endpoint's lanes, condensed.
enum class RmaKind : uint8_t { kEmulated, kSharedMemory, kRdma };

struct LaneSummary {
  RmaKind rma = RmaKind::kEmulated;
  std::string text;  // one line for the log
};

enum class WritePath : uint8_t { kAuto, kPut, kAm };

// ucp_mem_map with UCP_MEM_MAP_ALLOCATE, then where the memory is. UCX picks
// the allocator (UCX_ALLOC_PRIO: sysv, then posix shared memory, ...), so a
// peer on this host can map host memory allocated this way. `cuda`: device
// memory on the calling thread's current device (UCX's cuda_copy allocator).
struct MappedAllocation {
  ucp_mem_h memh = nullptr;
  uint8_t* base = nullptr;
};

// The functions and variables are hidden: libpsld.so does not export them, and
// calls to them stay direct, as when all of this was local to one file.
#pragma GCC visibility push(hidden)

// The WriteHeader as it lies in an active message's header, a notification
// batch and a ring record (store_le and load_le: base/wire.h).
inline void encode_header(const WriteHeader& h, uint8_t* p) {
  store_le(p, h.region, 8);
  store_le(p + 8, h.secret, 8);
  store_le(p + 16, h.offset, 8);
  store_le(p + 24, h.length, 8);
  store_le(p + 32, h.notify, 4);
  store_le(p + 36, h.seq, 8);
}
inline WriteHeader decode_header(const uint8_t* p) {
  return WriteHeader{load_le(p, 8),
                     load_le(p + 8, 8),
                     load_le(p + 16, 8),
                     load_le(p + 24, 8),
                     static_cast<uint32_t>(load_le(p + 32, 4)),
                     load_le(p + 36, 8)};
}
// Whether a write's bytes lie inside a region of `region_length` bytes (the
// region and its secret are checked by the caller).
inline bool in_region(const WriteHeader& h, uint64_t region_length) {
  return h.offset <= region_length && h.length <= region_length - h.offset;
}

// What a peer sends that the backend decodes before any UCX call sees it,
// as functions of bytes alone: tests/fuzz/ucx_fuzz.cc runs them on hostile
// input without a UCX worker.
//
// A remote key (MemoryRegion::remote_key() of a UCX region): magic, version,
// memory kind, the exporting transport's instance, region id, base, length,
// secret, UCX's packed key (a blob), and the fnv1a64 of all of it (wireup.cc).
struct RemoteKeyFields {
  MemoryKind kind = MemoryKind::kHost;
  uint64_t owner = 0;
  uint64_t region = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  uint64_t secret = 0;
  std::span<const uint8_t> packed;  // UCX's packed key, inside the decoded bytes
};
std::vector<uint8_t> encode_remote_key(const RemoteKeyFields& key);
// DataLoss, saying what is wrong, for anything but a well-formed key.
Result<RemoteKeyFields> decode_remote_key(std::span<const uint8_t> key);

// The hello and its answer (one layout): magic, version, the sender's
// instance and connection id, its process (namespace key and pid), the
// address it listens at, and its
// notification ring offer: slot count (0: none), where the ring is in the
// offering process, and UCX's packed key for it (wireup.cc).
struct HelloFields {
  uint64_t instance = 0;
  uint64_t conn = 0;
  // The sender's process: its namespace key (process_namespace_key, 0 if
  // unknown) and pid, so that the key of a peer on this host that ended is
  // refused before UCX tries to attach its memory (UcxCore::unpack_rkey).
  uint64_t process_namespace = 0;
  uint32_t pid = 0;
  std::string listen;
  uint32_t ring_slots = 0;
  uint64_t ring_base = 0;
  std::span<const uint8_t> ring_key;  // inside the decoded bytes
};
std::vector<uint8_t> encode_hello(const HelloFields& hello);
// False for a hello that is malformed, of another version, or padded. The
// ring offer's values are checked where it is mapped (map_peer_ring).
bool decode_hello(std::span<const uint8_t> payload, HelloFields* hello);

// A notification batch (kAmNotify): a u32 count in 1..kNotifyBatch, then
// that many WriteHeaders. The count, or 0 for a malformed batch (am.cc).
size_t notify_batch_records(std::span<const uint8_t> payload);

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
inline uint64_t poll_clock() {
  return __rdtsc();
}
constexpr uint64_t kUcxPollPeriod = 10000;  // ticks
constexpr uint64_t kUcxPollPeriodMax = 16 * kUcxPollPeriod;
#else
inline uint64_t poll_clock() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}
constexpr uint64_t kUcxPollPeriod = 4000;  // ns
constexpr uint64_t kUcxPollPeriodMax = 16 * kUcxPollPeriod;
#endif

// Adds one to a counter that only the holder of a lock writes (and others
// only read): a load and a store, not an atomic read-modify-write.
inline void count_one(std::atomic<uint64_t>& counter) {
  counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

inline std::atomic_ref<uint64_t> ring_word(uint8_t* base, size_t at) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + at));
}

// util.cc
Status ucs_to_status(ucs_status_t st, std::string_view what);
Status parse_socket_address(const std::string& text, bool passive, sockaddr_storage* out,
                            socklen_t* out_len);
std::string socket_address_string(const sockaddr_storage& sa);
LaneSummary summarize_lanes(const std::string& info);
std::string endpoint_info(ucp_ep_h ep);
bool tls_may_use_shared_memory(const std::string& option);
// Which host and process namespace this process runs in: a hash of the
// kernel's boot id and the pid namespace, equal for two processes exactly
// when one's pids are the other's; 0 where /proc does not say.
uint64_t process_namespace_key();
// Whether process `pid` of this namespace has ended (gone from /proc, or a
// zombie, whose memory is already released). False when /proc cannot tell.
bool process_ended(uint32_t pid);
// Whether ucx.tls (else UCX_TLS) names only TCP and this host's transports,
// so that no RDMA device is left out when UCX is held to one interface.
bool tls_without_network_rdma(const std::string& option);
// The next connection's id (transport.cc).
extern std::atomic<uint64_t> g_next_connection_id;

// memory.cc
Result<MappedAllocation> map_allocated(ucp_context_h context, size_t length, bool cuda);

// setup.cc: UCX's callbacks for requests and endpoints.
void send_cb(void* request, ucs_status_t status, void* user_data);
// The parameters every send-side request of this backend starts from (an
// active message, a put, a flush, a close): completion to send_cb with `op`
// as its user data, and the request's flags where it has any.
inline ucp_request_param_t send_param(void* op, uint32_t flags = 0) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = send_cb;
  p.user_data = op;
  if (flags != 0) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = flags;
  }
  return p;
}
// Every active message. No reply flag: the receiver finds the connection
// by the token in the header, and answers on its own endpoint to the peer.
inline ucp_request_param_t am_send_param(void* op) {
  return send_param(op);
}
void recv_am_cb(void* request, ucs_status_t status, size_t length, void* user_data);
void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status);

#pragma GCC visibility pop

}  // namespace ucx_detail

using namespace ucx_detail;

// The UcxCore members that take a WriteHeader were file-local while the backend
// was one file (WriteHeader was in its anonymous namespace), so GCC inlined or
// specialised them in their callers. They are hidden: called directly, not
// exported from libpsld.so. Those of the write path and of the ring fast path
// (notify_one, ring_notify, ring_publish, validate_target_cached) are also
// inline, defined in the one file that calls them (rma.cc, ring.cc), so that
// GCC still inlines them there.
#define PSLD_UCX_HIDDEN [[gnu::visibility("hidden")]]

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
// regions: Connection::write tells its own regions by these, not by
// dynamic_cast (two of them were ~10% of a shared-memory write). One object
// each for all the backend's files, hidden so that taking its address needs
// no GOT load. Transport::backend() of its transports, likewise.
PSLD_UCX_HIDDEN inline const char kUcxRegionTag = 'L';
PSLD_UCX_HIDDEN inline const char kUcxRemoteRegionTag = 'R';
PSLD_UCX_HIDDEN inline const char kUcxTransportTag = 'T';

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
  // A key imported before its connection had an endpoint: unpacked by the
  // first put (UcxCore::unpack_late), under UcxCore::rkey_mu_.
  std::vector<uint8_t> unpack_later_;
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
      : Connection(&kUcxRegionTag, &kUcxRemoteRegionTag),
        core_(std::move(weak_core)),
        core_raw_(core),
        client_(client),
        peer_(std::move(peer)) {}

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
  Status send(std::span<const uint8_t> message, Completion done) override;
  void close() override;
  bool is_open() const override { return open_.load(); }

  // A put that waits for the flush that makes it visible.
  struct Unflushed {
    uint64_t op_id;
    WriteHeader header;
  };

 protected:
  Status check_backend(const WriteRequest& request) const override;
  Status start_write(const WriteRequest& request, Completion done) override;

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
  // What the peer puts at the front of every active message for this
  // connection (kTokenBytes), drawn from the CSPRNG; and the peer's, from
  // the bootstrap.
  const uint64_t token_ = random_token();
  uint64_t peer_token_ = 0;  // guarded by UcxCore::mu_
  // The peer's instance as the bootstrap authenticated it (its hello must
  // say the same), the bootstrap's socket while it runs (-1 after), and the
  // same socket as the connection's watch once it ran (-1 before and after).
  uint64_t boot_instance_ = 0;
  int boot_fd_ = -1;
  int watch_fd_ = -1;
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
  // The endpoint to the peer process, shared with the other connections to
  // it (UcxCore::PeerEp); null until the bootstrap finished, and once closed.
  ucp_ep_h ep_ = nullptr;
  // The peer transport's instance, from the handshake (0 before): the
  // exporter every imported key must name. Atomic: check_backend reads it
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
  Mutex tx_mu_;
  uint64_t tx_seq_ GUARDED_BY(tx_mu_) = 0;
  std::unique_ptr<TxRing> tx_ring_ GUARDED_BY(tx_mu_);
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
  uint8_t header[kTokenBytes + kWriteHeaderBytes] = {};
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

// One bootstrap in progress (bootstrap.cc): a dialer's, for its connection,
// or an acceptor's, for a socket its listener accepted.
struct Boot {
  enum class Stage : uint8_t {
    kConnecting,
    kAwaitChallenge,
    kAwaitRequest,
    kAwaitAccept,
    kClosing
  };
  SideChannel chan;
  bool dialer = false;
  Stage stage = Stage::kConnecting;
  bool write_shut = false;  // kClosing: all said, shutdown(SHUT_WR) done
  uint32_t events = 0;      // what epoll watches
  std::string peer;         // host:port of the other end
  Clock::time_point deadline;
  std::shared_ptr<UcxConnection> conn;  // the dialer's connection
  BootFrame challenge;                  // acceptor: sent; dialer: received
  BootFrame request;                    // dialer: sent
};

// A finished bootstrap's socket, kept open while its connection lives (see
// kBye): its end of stream without a kBye is the peer's death.
struct Watch {
  SideChannel chan;
  std::shared_ptr<UcxConnection> conn;
  std::string peer;
  bool bye_seen = false;  // the peer closes the connection; its UCX bye follows
  uint32_t events = 0;
};

// ---------------------------------------------------------------------------

class UcxCore : public std::enable_shared_from_this<UcxCore> {
 public:
  UcxCore(const TransportOptions& options, Handler* handler, WritePath forced)
      : options_(options), handler_(handler), forced_(forced) {}
  ~UcxCore() {
    shutdown();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (boot_epfd_ >= 0) ::close(boot_epfd_);
  }

  // Runs before the core is shared with any other thread, so it sets up the
  // worker and listener without mu_: no analysis.
  Status init(const sockaddr_storage* listen, socklen_t listen_len) NO_THREAD_SAFETY_ANALYSIS;
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
      MutexLock lock(mu_);
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
    c.refused_connections = refused_boots_.load();
    return c;
  }

  // Connection
  Result<std::shared_ptr<RemoteRegion>> import_region(UcxConnection& conn,
                                                      std::span<const uint8_t> key);
  // The backend's checks of a write (Connection::check_backend); the request
  // passed Connection::write's.
  Status check_backend(const UcxConnection& conn, const WriteRequest& req) const;
  Status write(UcxConnection& conn, const WriteRequest& req, Completion done);
  Status send(UcxConnection& conn, std::span<const uint8_t> message, Completion done);
  void close_connection(UcxConnection& conn);
  void release_rkey(UcxRemoteRegion* remote);
  // Unpacks a key imported before the connection had an endpoint (mu_ held).
  Status unpack_late(UcxConnection& conn, UcxRemoteRegion& remote) REQUIRES(mu_);
  // ucp_ep_rkey_unpack of the key of `owner`'s memory, unless `owner` said
  // hello from this host and its process has ended: UCX 1.13 would try to
  // attach the shared memory that went with it, fail, and crash releasing
  // the half-unpacked key. Unavailable then, a DataLoss if UCX refuses.
  Status unpack_rkey(ucp_ep_h ep, uint64_t owner, const uint8_t* packed, ucp_rkey_h* rkey);

  // UCX callbacks: mu_ is held (UCX calls back only from inside a ucp_* call
  // made under it), which each says to the analysis with mu_.assert_held().
  void on_request_done(OpCtx* op, ucs_status_t status);
  ucs_status_t on_am(unsigned id, const void* header, size_t header_length, void* data,
                     size_t length, const ucp_am_recv_param_t* param);
  void on_ep_error(ucp_ep_h ep, ucs_status_t status);

 private:
  using ConnPtr = std::shared_ptr<UcxConnection>;

  Clock::time_point deadline() const { return Clock::now() + options_.common.op_timeout; }
  void maybe_wake() {
    if (sleepers_.load() > 0) wake();
  }

  OpCtx* new_op(OpCtx::Kind kind) REQUIRES(mu_);
  // Unlinks a finished request's context and keeps it for reuse.
  void unlink_op(OpCtx* op) REQUIRES(mu_);
  // Like finish_request, for a request that carries a user operation.
  void finish_user(UserOp& u, OpCtx* op, ucs_status_ptr_t r, uint64_t conn_id,
                   std::string_view what) REQUIRES(mu_);
  void complete_user(UserOp& u, Status status) REQUIRES(mu_) {
    if (u.op_id != 0) {
      complete(u.op_id, std::move(status));
    } else if (u.done) {
      push_completion(PendingOps::Ready{std::move(u.done), std::move(status)});
    }
  }
  // Hands a ucp_*_nbx result to its OpCtx: completes it now, fails it now, or
  // leaves it to the callback.
  void finish_request(OpCtx* op, ucs_status_ptr_t r) REQUIRES(mu_);
  void complete(uint64_t op_id, Status status) REQUIRES(mu_) {
    PendingOps::Ready r = pending_.take(op_id, std::move(status));
    if (r.done) push_completion(std::move(r));
  }
  void push_completion(PendingOps::Ready r) REQUIRES(mu_) {
    Event e;
    e.kind = Event::kCompletion;
    e.ready = std::move(r);
    queue_event(std::move(e));
  }
  void push_event(Event::Kind kind, const ConnPtr& conn) REQUIRES(mu_) {
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
  void queue_event(Event e) REQUIRES(mu_) {
    events_.push_back(std::move(e));
    ucx_idle_.store(false, std::memory_order_relaxed);
  }

  void start_write(UcxConnection& conn, UserOp u, const std::shared_ptr<UcxRegion>& src,
                   const std::shared_ptr<UcxRemoteRegion>& remote, uint64_t local_offset,
                   uint64_t remote_offset, uint64_t length, uint32_t notify) REQUIRES(mu_);
  void start_flush(UcxConnection& conn) REQUIRES(mu_);
  void on_flushed(const ConnPtr& conn, std::vector<UcxConnection::Unflushed> batch,
                  ucs_status_t status) REQUIRES(mu_);
  // Sends the notifications of writes whose bytes are visible at the peer and
  // completes them.
  void announce(UcxConnection& conn, const UcxConnection::Unflushed* writes, size_t n)
      REQUIRES(mu_);
  // Whether a write to `remote` is a memcpy into the peer's mapped memory.
  // Never from device memory: the CPU cannot read it.
  bool copies_into_mapping(const UcxConnection& conn, const UcxRegion& src,
                           const UcxRemoteRegion& remote) const {
    return forced_ != WritePath::kAm && conn.path_.load() == WritePath::kPut && remote.mapped() &&
           src.kind() == MemoryKind::kHost;
  }
  void start_send(UcxConnection& conn, UserOp u, std::span<const uint8_t> message) REQUIRES(mu_);
  // The notification of one write whose bytes are already in place, as an
  // active message.
  PSLD_UCX_HIDDEN inline void notify_one(UcxConnection& conn, UserOp u, WriteHeader h)
      REQUIRES(mu_);

  // Notification ring (see the comment at kRingMagic).
  // A zeroed ring for a new connection, or null (off, or no memory for it).
  std::shared_ptr<RxRing> allocate_ring();
  // Maps the peer's offered ring where it is on this host (mu_ held).
  void map_peer_ring(UcxConnection& conn, uint32_t slots, uint64_t base,
                     std::span<const uint8_t> packed) REQUIRES(mu_);
  enum class RingResult : uint8_t { kUnavailable, kFull, kPublished, kPublishedPeerAsleep };
  // Publishes a notification in the peer's ring; takes conn.tx_mu_, not mu_.
  PSLD_UCX_HIDDEN inline RingResult ring_notify(UcxConnection& conn, WriteHeader h);
  // Under conn.tx_mu_: whether the ring has no free slot (re-reading the
  // owner's `consumed` when the cached copy says so), and publishing a record
  // in it (never kFull: ask ring_full first).
  static bool ring_full(TxRing& r);
  PSLD_UCX_HIDDEN inline RingResult ring_publish(UcxConnection& conn, TxRing& r, WriteHeader h)
      REQUIRES(conn.tx_mu_);

 public:
  // Connection::write's fast path (see the definition); false, having done
  // nothing, where write() must run.
  static bool write_through_ring(UcxConnection& conn, const WriteRequest& req, Status* status);

 private:
  // Sends kAmWake for a record just published in the ring of a peer asleep
  // in wait(), if the worker and the connection are still up; the _locked
  // one with mu_ held.
  void wake_ring_owner(UcxConnection& conn);
  void wake_ring_owner_locked(UcxConnection& conn) REQUIRES(mu_);
  // Delivers the records of conn's ring in sequence order: those numbered
  // below `below`, and, when `stop_at_gap`, only while each is the next
  // number (a gap is an active message still on its way). mu_ held.
  void drain_ring(const ConnPtr& conn, uint64_t below, bool stop_at_gap) REQUIRES(mu_);
  // An active message numbered `seq` arrived: ring records before it go
  // first.
  void arrived_in_order(const ConnPtr& conn, uint64_t seq) REQUIRES(mu_) {
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
  size_t poll_rings_unlocked() REQUIRES(progress_mu_);
  // Whether a sleeping owner would miss a deliverable record.
  bool ring_has_next(const UcxConnection& conn) const;
  void set_rings_sleeping(bool sleeping) REQUIRES(mu_);
  void release_rings(UcxConnection& conn) REQUIRES(mu_);
  // Validates one notification and queues its on_write.
  PSLD_UCX_HIDDEN void deliver_notification(const ConnPtr& conn, const WriteHeader& h)
      REQUIRES(mu_);
  // Queues on_write(conn, notify, length) for the next delivery. mu_ held.
  void queue_write(ConnectionPtr conn, uint32_t notify, uint64_t length) REQUIRES(mu_);
  bool send_control(UcxConnection& conn, unsigned id, std::vector<uint8_t> payload,
                    OpCtx::Kind kind) REQUIRES(mu_);
  void handle_control(const ConnPtr& conn, unsigned id, uint64_t seq,
                      std::span<const uint8_t> payload) REQUIRES(mu_);
  // Reads a hello (from_server false) or its answer (true), which have one
  // layout, and readies the connection; a malformed one, or one arriving out
  // of turn, closes it and returns false.
  bool accept_peer_hello(const ConnPtr& conn, std::span<const uint8_t> payload, bool from_server)
      REQUIRES(mu_);
  void handle_hello(const ConnPtr& conn, std::span<const uint8_t> payload) REQUIRES(mu_);
  bool hold_early(UcxConnection& conn, unsigned id, uint64_t seq, std::span<const uint8_t> payload)
      REQUIRES(mu_);
  void handle_hello_ack(const ConnPtr& conn, std::span<const uint8_t> payload) REQUIRES(mu_);
  void dispatch_queued(UcxConnection& conn) REQUIRES(mu_);
  static Status foreign_key(const UcxConnection& conn);
  void handle_notify(const ConnPtr& conn, std::span<const uint8_t> payload) REQUIRES(mu_);
  void connection_ready(UcxConnection& conn) REQUIRES(mu_);
  std::vector<uint8_t> hello_payload(const UcxConnection& conn) const;
  PSLD_UCX_HIDDEN bool validate_target(const WriteHeader& h, std::shared_ptr<UcxRegion>* region);
  struct ValidTarget;
  // validate_target for the fast path: no lock while `last` still holds.
  PSLD_UCX_HIDDEN inline bool validate_target_cached(const WriteHeader& h, ValidTarget* last);
  void reject_write(const UcxConnection* conn, const std::string& why);
  ucs_status_t on_am_write(const ConnPtr& conn, const void* header, size_t header_length,
                           void* data, size_t length, const ucp_am_recv_param_t* param)
      REQUIRES(mu_);

  // The bootstrap (bootstrap.cc).
  Status start_listening(const sockaddr_storage& listen,
                         socklen_t listen_len) NO_THREAD_SAFETY_ANALYSIS;
  Status start_dial(const sockaddr_storage& sa, socklen_t sa_len, const std::string& where,
                    const ConnPtr& conn) REQUIRES(mu_);
  void poll_boots() REQUIRES(mu_);
  void accept_boots() REQUIRES(mu_);
  void step_boot(int fd, uint32_t events) REQUIRES(mu_);
  // Handles one frame; false when the boot ended.
  bool on_boot_frame(Boot& b, const BootFrame& f) REQUIRES(mu_);
  // Accepts (the boot becomes a watch) or refuses; true while the boot goes on.
  bool accept_boot(Boot& b, const BootFrame& request) REQUIRES(mu_);
  void refuse_boot(Boot& b, const std::string& tell, const char* log) REQUIRES(mu_);
  // Ends a boot (closing its socket); fail_boot also fails its connection.
  void end_boot(int fd) REQUIRES(mu_);
  // Takes a boot off the tables, its socket still open (still in the epoll set).
  std::unique_ptr<Boot> detach_boot(int fd) REQUIRES(mu_);
  // Turns the finished boot on `fd` into the watch of `conn` (struct Watch).
  void start_watch(int fd, const ConnPtr& conn) REQUIRES(mu_);
  void step_watch(Watch& w) REQUIRES(mu_);
  // Closes a watch's socket, after a kBye if `say_bye`.
  void end_watch(int fd, bool say_bye) REQUIRES(mu_);
  // What epoll watches on a boot's or a watch's socket: input, and room for
  // output while some waits.
  void watch_socket(const SideChannel& chan, uint32_t* have) REQUIRES(mu_);
  void fail_boot(Boot& b, const Status& why) REQUIRES(mu_);
  // A new connection in its handshake: its deadline, the tables, its ring.
  void track_handshake(const ConnPtr& conn) REQUIRES(mu_);
  void expire_boots(Clock::time_point now) REQUIRES(mu_);
  // The endpoint shared by every connection to the peer transport
  // `instance`, made from its worker address the first time.
  Result<ucp_ep_h> peer_ep(uint64_t instance, std::span<const uint8_t> address) REQUIRES(mu_);
  void close_peer_ep(ucp_ep_h ep) REQUIRES(mu_);
  // Marks `conn` closed, fails its operations with `why`, queues its
  // on_disconnect, and closes its endpoint (after a bye, if `send_bye`).
  void close_locked(UcxConnection& conn, const Status& why, bool send_bye) REQUIRES(mu_);
  // Lets go of a closed connection: off the tables, its endpoint (shared
  // with the other connections to its peer) left open.
  void detach(UcxConnection& conn) REQUIRES(mu_);
  void run_deferred() REQUIRES(mu_);
  void check_deadlines(Clock::time_point now) REQUIRES(mu_);
  void drain_graveyard();
  void deliver(Event& e);
  Result<std::shared_ptr<UcxRegion>> make_region(uint8_t* data, size_t length, MemoryKind kind,
                                                 ucp_mem_h memh);

  const TransportOptions options_;
  Handler* const handler_;
  const WritePath forced_;
  const uint64_t instance_ = random_u64() | 1;  // never 0, which means "not known yet"
  const uint64_t namespace_key_ = process_namespace_key();
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
  // The bootstrap: psld's own listening socket (-1: not listening), and the
  // epoll set of it and every boot's socket, polled by progress() and slept
  // on by wait().
  int listen_fd_ = -1;
  int boot_epfd_ = -1;
  std::vector<uint8_t> worker_address_;  // ucp_worker_get_address, copied
  // Set by wait() when the boot sockets woke it: the next progress() polls them.
  std::atomic<bool> boot_wake_{false};

  Mutex progress_mu_;  // one progress() at a time: handlers run in order
  mutable Mutex mu_;   // the worker and everything below
  ucp_worker_h worker_ GUARDED_BY(mu_) = nullptr;
  std::atomic<bool> shut_{false};
  std::map<uint64_t, ConnPtr> conns_ GUARDED_BY(mu_);
  // Connections by their token (what every incoming active message names).
  std::unordered_map<uint64_t, ConnPtr> by_token_ GUARDED_BY(mu_);
  // One endpoint per peer transport, by its instance, shared by every
  // connection to it, kept until it fails or this transport shuts down: two
  // processes that dial each other (servers do) would otherwise make
  // endpoints that UCX pairs across connections, since it matches endpoints
  // made from worker addresses by a per-peer count.
  std::unordered_map<uint64_t, ucp_ep_h> peer_eps_ GUARDED_BY(mu_);
  std::unordered_map<ucp_ep_h, uint64_t> ep_peers_ GUARDED_BY(mu_);
  // Failed endpoints, closed by run_deferred once their connections let go.
  std::vector<ucp_ep_h> dead_eps_ GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<Boot>> boots_ GUARDED_BY(mu_);
  size_t accepting_boots_ GUARDED_BY(mu_) = 0;
  // Not in boots_: boots_ being empty is what lets progress() and wait() go
  // back to their idle pace.
  std::map<int, std::unique_ptr<Watch>> watches_ GUARDED_BY(mu_);
  // Hosts whose refusal was logged (bounded): a flood is one line.
  std::set<std::string> refused_hosts_ GUARDED_BY(mu_);
  std::vector<Event> events_ GUARDED_BY(mu_);
  std::vector<Event> delivering_ GUARDED_BY(progress_mu_);
  int64_t last_deadline_tick_ GUARDED_BY(mu_) = 0;
  OpCtx* live_ops_ GUARDED_BY(mu_) = nullptr;
  size_t live_count_ GUARDED_BY(mu_) = 0;
  std::vector<OpCtx*> free_ops_ GUARDED_BY(mu_);
  size_t handshaking_ GUARDED_BY(mu_) = 0;  // connections with a handshake deadline
  // The lane summaries said at info (bounded): every connection of a job
  // usually has the same, and the rest are said at debug.
  static constexpr size_t kMaxLanesSaid = 32;
  std::set<std::string> lanes_said_ GUARDED_BY(mu_);
  // Deferred work (see the comment at the top of the file).
  struct Flushed {
    ConnPtr conn;
    std::vector<UcxConnection::Unflushed> batch;
    ucs_status_t status;
  };
  std::vector<Flushed> flushed_ GUARDED_BY(mu_);
  std::vector<ConnPtr> acks_ GUARDED_BY(mu_);  // accepted: the hello answer is still to send
  std::vector<ConnPtr> ready_
      GUARDED_BY(mu_);  // connected: the queued operations are still to send
  std::vector<std::pair<ConnPtr, Status>> failed_ GUARDED_BY(mu_);
  std::vector<ConnPtr> to_close_ GUARDED_BY(mu_);
  // Rings of closed connections, unmapped by run_deferred (not inside a UCX
  // callback).
  std::vector<std::shared_ptr<RxRing>> dead_rings_ GUARDED_BY(mu_);

  std::atomic<int> sleepers_{0};
  // Connections whose ring progress() polls (ready, with a ring).
  std::vector<ConnPtr> rx_conns_ GUARDED_BY(mu_);
  // Set by progress() when UCX had nothing to do while a peer writes into one
  // of our rings; then progress() may poll only the rings for up to
  // ucx_poll_period_ after last_ucx_progress_. Any thread clears it to have UCX
  // progressed at once.
  std::atomic<bool> ucx_idle_{false};
  uint64_t last_ucx_progress_ GUARDED_BY(progress_mu_) = 0;  // poll_clock()
  uint64_t ucx_poll_period_ GUARDED_BY(progress_mu_) = kUcxPollPeriod;
  bool rings_attached_ GUARDED_BY(mu_) = false;  // a peer writes into one of our rings
  // Bumped (under mu_) whenever rx_conns_ changes; progress() then copies it.
  std::atomic<uint64_t> rx_version_{0};
  // The last target a ring's records named, as validate_target found it:
  // consecutive writes of a connection mostly land in one region, and this
  // spares them export_mu_ and the table.
  struct ValidTarget {
    uint64_t unexported = ~uint64_t{0};  // unexported_ when validated
    uint64_t region = 0, secret = 0, length = 0;
  };
  // progress()'s own copy of rx_conns_, for the fast path.
  struct Polled {
    ConnectionPtr conn;
    UcxConnection* ucx;
    std::shared_ptr<RxRing> ring;  // keeps it mapped while polled, even once closed
    ValidTarget last;
  };
  std::vector<Polled> polled_ GUARDED_BY(progress_mu_);
  uint64_t polled_version_ GUARDED_BY(progress_mu_) = 0;
  int ring_sleepers_ GUARDED_BY(mu_) = 0;  // threads in wait() that advertised it
  PendingOps pending_;
  RegistrationCache<UcxRegion> cache_;
  std::atomic<uint64_t> next_region_{1};
  Mutex export_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<UcxRegion>> exported_ GUARDED_BY(export_mu_);
  // Bumped (under export_mu_) whenever a region leaves exported_: a target
  // validated while it had some value is still exported while it has it.
  std::atomic<uint64_t> unexported_{0};
  // Held shared while copying into a peer's mapped memory, exclusively while
  // shutdown unmaps it; never held while taking mu_.
  SharedMutex mapping_mu_;
  Mutex rkey_mu_ ACQUIRED_AFTER(mu_);
  // The process behind each peer instance that said hello from this host
  // and pid namespace: its pid (unpack_rkey). Taken after mu_ and rkey_mu_.
  Mutex procs_mu_ ACQUIRED_AFTER(rkey_mu_);
  std::unordered_map<uint64_t, uint32_t> peer_pids_ GUARDED_BY(procs_mu_);
  std::set<UcxRemoteRegion*> live_remotes_ GUARDED_BY(rkey_mu_);
  std::vector<ucp_rkey_h> graveyard_ GUARDED_BY(rkey_mu_);
  std::atomic<bool> graveyard_nonempty_{false};

  std::atomic<uint64_t> writes_put_{0}, writes_am_{0}, flushes_{0}, rejected_writes_{0},
      rejected_messages_{0}, notify_ring_full_{0}, ring_wakeups_{0}, refused_boots_{0};
  // The per-connection ring counters of connections that let go of their
  // rings (release_rings, mu_ held).
  std::atomic<uint64_t> retired_ring_records_{0}, retired_ring_writes_{0};
};

}  // namespace psld::transport
