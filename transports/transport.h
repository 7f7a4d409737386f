// transports/transport.h — the one interface every fabric backend implements.
//
// A transport moves bytes and knows nothing of keys, rounds or balancing. It
// offers exactly what psld's data path needs (docs/design.md §4):
//
//   register memory  -> a local MemoryRegion and a packed remote key
//   listen / connect -> Connections, identified by opaque address blobs
//   write            -> one-sided, zero-copy: local region -> remote region,
//                       and the receiver learns a 32-bit notify value only
//                       after every written byte is visible in its memory
//   send             -> small control messages on the same connection
//   progress / wait  -> completions and incoming events, on the caller's
//                       thread or on an optional progress thread that sleeps
//                       when idle
//
// Backends ("ucx", "verbs", "loopback", and the emulated-link wrapper) are
// chosen at run time by name through create_transport().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/memory_kind.h"
#include "psld/status.h"

namespace psld::transport {

using Clock = std::chrono::steady_clock;

// Regions hold memory of a MemoryKind (base/memory_kind.h); a backend that
// cannot reach CUDA memory says Unimplemented.

// Largest control message; larger payloads belong in a write.
inline constexpr size_t kMaxMessageBytes = 8192;

// A local memory range registered with one transport. Writes read from it
// (as a source) or land in it (as a target, once a peer imported its key).
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  uint8_t* data() const { return data_; }
  size_t length() const { return length_; }
  MemoryKind kind() const { return kind_; }
  // Unique within the transport for its lifetime; never reused.
  uint64_t id() const { return id_; }
  // What a peer passes to Connection::import_region to write into this
  // region. It grants access to [data(), data() + length()) and nothing else.
  std::span<const uint8_t> remote_key() const { return remote_key_; }
  // How the backend registered it, e.g. "ibv_reg_mr", "ibv_reg_dmabuf_mr",
  // "ucp_mem_map (cuda)": for logs and for tests that must know which path a
  // GPU registration took.
  const std::string& registration() const { return registration_; }
  // Identifies the backend class that made this region (an address the
  // backend owns), so that a backend can check that a region is its own
  // without a dynamic_cast on its write path; null if the backend sets none.
  const void* backend() const { return backend_; }

 protected:
  MemoryRegion(uint8_t* data, size_t length, MemoryKind kind, uint64_t id,
               const void* backend = nullptr)
      : data_(data), length_(length), kind_(kind), id_(id), backend_(backend) {}
  std::vector<uint8_t> remote_key_;
  std::string registration_;

 private:
  uint8_t* data_;
  size_t length_;
  MemoryKind kind_;
  uint64_t id_;
  const void* backend_;
};

// A peer's region, imported on one connection.
class RemoteRegion {
 public:
  virtual ~RemoteRegion() = default;
  RemoteRegion(const RemoteRegion&) = delete;
  RemoteRegion& operator=(const RemoteRegion&) = delete;
  size_t length() const { return length_; }
  // The exporting region's id() on the peer.
  uint64_t peer_region_id() const { return peer_region_id_; }
  // As MemoryRegion::backend().
  const void* backend() const { return backend_; }

 protected:
  RemoteRegion(size_t length, uint64_t peer_region_id, const void* backend = nullptr)
      : length_(length), peer_region_id_(peer_region_id), backend_(backend) {}

 private:
  size_t length_;
  uint64_t peer_region_id_;
  const void* backend_;
};

// Called once per operation, on the thread that runs progress(), with Ok or
// the reason it failed (Timeout, Unavailable when the peer is gone, Aborted
// when the connection or transport closed first).
using Completion = std::function<void(Status)>;

// One one-sided write: `length` bytes from local[local_offset] to
// remote[remote_offset]; the receiver's Handler::on_write gets `notify` once
// all of them are visible there.
struct WriteRequest {
  const MemoryRegion* local = nullptr;
  uint64_t local_offset = 0;
  const RemoteRegion* remote = nullptr;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  uint32_t notify = 0;
};

class Connection {
 public:
  virtual ~Connection() = default;

  // A process-unique id for logs and maps.
  virtual uint64_t id() const = 0;
  // Human-readable peer description ("ucx tcp 127.0.0.1:41234", ...).
  virtual std::string peer() const = 0;
  // How writes travel on this connection, e.g. "put" or "am-rndv" for UCX,
  // "write-with-imm" for verbs: silent slow fallbacks are a bug.
  virtual std::string write_path() const = 0;

  // Imports a peer's MemoryRegion::remote_key(). DataLoss for a malformed key.
  virtual Result<std::shared_ptr<RemoteRegion>> import_region(std::span<const uint8_t> key) = 0;

  // Starts a write. Returns an error, without sending anything, when the
  // request does not fit its regions (OutOfRange), uses a region of another
  // transport or connection (InvalidArgument), or the connection is closed
  // (Unavailable). Otherwise `done` is called exactly once: Ok when the source
  // may be reused (the bytes left it), or the failure.
  //
  // The checks every backend needs are made here, once, before the backend
  // sees the request: both regions are present and the backend's own (by
  // their backend() tags), and the write lies inside both, without overflow.
  // They come before the backend's own (check_backend), so a request that is
  // wrong in several ways fails the same way on every backend.
  Status write(const WriteRequest& request, Completion done) {
    if (!fits(request)) [[unlikely]]
      return request_error(request);
    return start_write(request, std::move(done));
  }

  // The checks write() makes before sending anything, without sending: the
  // emulated link uses it to reject a bad write before it queues it.
  Status check_write(const WriteRequest& request) const {
    if (!fits(request)) [[unlikely]]
      return request_error(request);
    return check_backend(request);
  }

  // Sends a control message of at most kMaxMessageBytes; the bytes are copied
  // before send() returns. `done` may be empty.
  virtual Status send(std::span<const uint8_t> message, Completion done) = 0;

  // Fails every pending operation with Aborted and tells the peer. Idempotent.
  virtual void close() = 0;
  virtual bool is_open() const = 0;

  // The MemoryRegion::backend() and RemoteRegion::backend() of the regions
  // this connection writes from and into.
  const void* region_tag() const { return region_tag_; }
  const void* remote_tag() const { return remote_tag_; }

  // What write() answers for a source or target that is not the backend's:
  // for backends that find it out themselves (another transport's region of
  // the same backend).
  static Status foreign_source();
  static Status foreign_target();

 protected:
  // The tags the backend gives its regions (non-null, one address each).
  Connection(const void* region_tag, const void* remote_tag)
      : region_tag_(region_tag), remote_tag_(remote_tag) {}

  // What only the backend can check, after the checks of write(): that the
  // connection is open and its transport up, that the regions belong to this
  // transport and were imported on this connection, and any limit of its own.
  // The regions carry the backend's tags here, so a static_cast to its
  // region classes is safe. check_write() calls it; start_write() makes the
  // same checks itself, where they hold for the write it starts (under the
  // backend's lock), so that a write pays for them once.
  virtual Status check_backend(const WriteRequest& request) const = 0;

  // Starts a write that passed the checks of write(); the contract is
  // write()'s.
  virtual Status start_write(const WriteRequest& request, Completion done) = 0;

 private:
  // No allocation and no formatting: this runs on every write.
  bool fits(const WriteRequest& r) const {
    return r.local != nullptr && r.local->backend() == region_tag_ && r.remote != nullptr &&
           r.remote->backend() == remote_tag_ && r.local_offset <= r.local->length() &&
           r.length <= r.local->length() - r.local_offset &&
           r.remote_offset <= r.remote->length() &&
           r.length <= r.remote->length() - r.remote_offset;
  }
  // Which check failed, and its message; out of line, off the write path.
  Status request_error(const WriteRequest& r) const;

  const void* const region_tag_;
  const void* const remote_tag_;
};

using ConnectionPtr = std::shared_ptr<Connection>;

// What the transport reports, on the thread that runs progress(). Handlers
// must not block; they may call the transport (send, write, close).
class Handler {
 public:
  virtual ~Handler() = default;
  // A peer connected to our address (connect() does not call this).
  virtual void on_accept(const ConnectionPtr& /*conn*/) {}
  // A peer's write of `length` bytes landed; all bytes are visible.
  virtual void on_write(const ConnectionPtr& conn, uint32_t notify, uint64_t length) = 0;
  // A control message arrived. The span is valid during the call only.
  virtual void on_message(const ConnectionPtr& conn, std::span<const uint8_t> message) = 0;
  // The connection is gone (peer closed or died, or a local close()).
  virtual void on_disconnect(const ConnectionPtr& /*conn*/, const Status& /*why*/) {}
};

// Options every backend understands.
struct CommonOptions {
  // A pending write or send that has not completed by then fails with
  // Timeout; its connection stays usable.
  std::chrono::milliseconds op_timeout{10000};
  // Where to listen: "127.0.0.1:0" picks a free port. Empty: do not listen.
  std::string listen_address = "127.0.0.1:0";
  // The job's meeting point (the coordinator's host:port), where the
  // transport learns which network the job uses: with a loopback one (or a
  // loopback listen address) the job is on this host, and UCX's own TCP
  // transport listens on loopback only. Empty: unknown.
  std::string job_address;
  // The network interface the job uses here (job.interface resolved):
  // UCX's own TCP transport then uses only it (UCX_NET_DEVICES still wins).
  // Empty: the job_address rule above, else every interface UCX finds.
  std::string interface;
  // The job's secret: a backend with a bootstrap of its own (ucx) lets a
  // peer in only once it proved it knows the same one (an HMAC, never the
  // secret itself). Empty on both sides is a secret too, and a weak one.
  std::string secret;
};

// Whether a transport can register memory of one kind, and how or why not.
// The runtime uses it to choose between writing device tensors directly and
// staging them through host memory (lib/worker/device_staging.h), and prints it.
struct MemorySupport {
  bool supported = false;
  // How ("ibv_reg_dmabuf_mr on a dma-buf of the allocation, else ibv_reg_mr
  // through nvidia-peermem"), or why not ("this UCX build has no CUDA
  // support ...").
  std::string detail;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view name() const = 0;
  // As MemoryRegion::backend(), for the backend's own functions that take a
  // Transport (ucx_counters, set_link); null if the backend sets none.
  const void* backend() const { return backend_; }

  // What register_memory/allocate_memory do with `kind` in this process,
  // decided when the transport started. The default: host memory only.
  virtual MemorySupport memory_support(MemoryKind kind) const;
  bool supports(MemoryKind kind) const { return memory_support(kind).supported; }

  // The blob peers pass to connect(); empty when not listening.
  virtual std::vector<uint8_t> address() const = 0;
  // Connects to a peer's address() and waits (up to op_timeout) until the
  // connection can carry writes and messages.
  virtual Result<ConnectionPtr> connect(std::span<const uint8_t> peer_address) = 0;

  // Registers [data, data + length). Registration is cached per (address,
  // length, kind): registering the same range again returns the same region;
  // a different range that overlaps is a separate registration. The cache
  // holds the region until invalidate() (call it before freeing or reusing
  // the memory), so a pointer alone is never trusted.
  virtual Result<std::shared_ptr<MemoryRegion>> register_memory(void* data, size_t length,
                                                                MemoryKind kind) = 0;
  // Allocates and registers `length` bytes the transport chooses where to put
  // (e.g. shared memory a local peer can map), zero-filled; freed when the
  // last reference goes. Landing slots use this.
  virtual Result<std::shared_ptr<MemoryRegion>> allocate_memory(size_t length, MemoryKind kind) = 0;
  // Drops the cached registrations of exactly this range; the region stays
  // valid for holders of its shared_ptr until they let go. Returns NotFound if
  // nothing was registered for it.
  virtual Status invalidate(void* data, size_t length) = 0;

  // Where a peer's region is mapped into this process, so that its bytes can
  // be read in place, or nullptr. Only memory the peer got from
  // allocate_memory can be mapped, and only where the transport maps it
  // (UCX: a peer on this host over shared memory; loopback: always). The
  // view stays valid while `remote` is held and until shutdown(). It has no
  // ordering of its own: bytes the peer wrote before sending a control
  // message are visible once that message was received. A wrapper that
  // meters traffic (the emulated link) answers nullptr, so that nothing
  // bypasses it.
  virtual const uint8_t* local_view(const RemoteRegion& remote) const {
    (void)remote;
    return nullptr;
  }

  // Runs completions and handler calls that are ready; returns how many.
  virtual size_t progress() = 0;
  // Sleeps until progress() may have work, or the timeout passes.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // Wakes a thread in wait().
  virtual void wake() = 0;

  // Closes every connection and stops listening. Pending operations fail with
  // Aborted. Idempotent; the destructor calls it.
  virtual void shutdown() = 0;

 protected:
  explicit Transport(const void* backend = nullptr) : backend_(backend) {}

 private:
  const void* backend_;
};

// Backend-specific options; each backend reads only its own.
struct UcxOptions {
  // UCX_TLS for this transport's context, e.g. "tcp", "sm,self" or
  // "rc,sm,self". Empty: whatever the environment or UCX chooses.
  std::string tls;
  // How writes travel: "auto" (true put where the lane is RDMA or shared
  // memory, else active-message rendezvous into the target), "put" or "am".
  std::string write_path = "auto";
  // Slots of the per-connection notification ring a peer on this host writes
  // its notifications into (shared memory the receiver polls, instead of an
  // active message per write); a power of two from 16 to 65536, or 0 for no
  // ring. Either side's 0 turns the ring off for the connection.
  uint32_t notify_ring_slots = 256;
};

struct VerbsOptions {
  // RDMA device name (e.g. "mlx5_0"); empty: the first active port found.
  std::string device;
  uint8_t port = 1;
  int gid_index = -1;  // -1: pick a RoCE v2 GID automatically
  uint32_t max_inflight = 1024;
};

class LoopbackFabric;  // transports/loopback/loopback.h

struct LoopbackOptions {
  // The in-process "network" transports connect over; transports on
  // different fabrics cannot see each other. Required.
  std::shared_ptr<LoopbackFabric> fabric;
};

struct TransportOptions {
  CommonOptions common;
  UcxOptions ucx;
  VerbsOptions verbs;
  LoopbackOptions loopback;
};

// The backends compiled into this build, e.g. {"loopback", "ucx", "verbs"}.
std::vector<std::string> available_transports();

// Creates a transport by name. NotFound for an unknown name (the message lists
// available_transports()), Unavailable when the backend is built but its
// hardware or library is missing here ("verbs": no RDMA device).
Result<std::unique_ptr<Transport>> create_transport(std::string_view name,
                                                    const TransportOptions& options,
                                                    Handler* handler);

}  // namespace psld::transport
