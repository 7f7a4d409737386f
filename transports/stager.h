// Stager: moves a device-memory range to or from the network through a small
// pinned host bounce buffer, for transports that cannot register GPU memory
// (Transport::supports(MemoryKind::kCuda) is false, e.g. Debian's UCX).
//
// The range is cut into chunks of StagerOptions::chunk_bytes, and the bounce
// buffer holds `buffers` of them (two by default: double buffering). Chunk i
// always uses buffer i % buffers, and each chunk goes through two stages in
// chunk order:
//
//   send    (device -> network): copy chunk into its buffer (GPU, async),
//                                then the caller's transfer sends it
//   receive (network -> device): the caller's transfer fills the buffer,
//                                then the chunk is copied to the device
//
// A buffer is reused only once its chunk has left both stages, so memory is
// bounded by buffers * chunk_bytes and a transfer never reads a buffer that a
// copy is still writing. With two buffers the copy of chunk i+1 runs while
// chunk i is on the wire, so a long range costs about max(copy, transfer) per
// chunk rather than their sum.
//
// The GPU side is a CopyEngine (cuda_copy_engine.h has the CUDA one; tests use
// a fake), so the ordering and overlap logic runs without a GPU. Nothing here
// blocks or spawns threads: poll() advances the pipeline and the caller's
// loop (typically around Transport::progress()) calls it until it is done.
// Errors are values: the first failure stops new work, and poll() reports it
// once nothing the Stager started is still in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

// Asynchronous copies on independent queues ("lanes": CUDA streams), and
// page-locked host memory for them to use.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // How many lanes there are; the Stager needs one per buffer.
  virtual size_t lanes() const = 0;
  // Page-locked host memory: copies from and to it are truly asynchronous.
  virtual Result<void*> allocate_host(size_t bytes) = 0;
  virtual void free_host(void* p) = 0;
  // Queues a copy of `bytes` from `src` to `dst` on `lane` and returns at once.
  virtual Status copy_async(void* dst, const void* src, size_t bytes, size_t lane) = 0;
  // Ok(true) once everything queued on `lane` has finished, Ok(false) while
  // something runs, an error if a copy on it failed.
  virtual Result<bool> lane_idle(size_t lane) = 0;
};

struct StagerOptions {
  // Bytes per chunk. 4 MiB: large enough that per-chunk costs (a copy launch,
  // a write and its notification) stay small next to PCIe and network time,
  // small enough that the pipeline fills quickly.
  size_t chunk_bytes = size_t{4} << 20;
  // Bounce buffers: 2 is double buffering; more let a bursty network run
  // ahead. The bounce memory is buffers * chunk_bytes.
  size_t buffers = 2;
};

// One chunk in the bounce buffer.
struct StagedChunk {
  size_t index = 0;            // chunk number, from 0
  uint64_t offset = 0;         // of the chunk in the device range
  size_t buffer = 0;           // bounce buffer number (index % buffers)
  uint64_t buffer_offset = 0;  // of that buffer in host_buffer(): buffer * chunk_bytes
  std::span<uint8_t> host;     // the chunk's bytes in the bounce buffer
};

// The network side of one chunk: sends chunk.host (send), or arranges for it
// to be filled (receive). Returns an error without calling `done`, or Ok and
// then calls `done` exactly once, from any thread, when the buffer may be
// reused (send) or holds the chunk (receive).
using ChunkTransfer = std::function<Status(const StagedChunk& chunk, Completion done)>;

class Stager {
 public:
  // Allocates the bounce buffer. InvalidArgument for a zero chunk or buffer
  // count or an engine with fewer lanes than buffers.
  static Result<std::unique_ptr<Stager>> create(CopyEngine& engine, StagerOptions options);
  // Frees the bounce buffer. The Stager must be idle (nothing started, or
  // poll() gave its final answer): transfers in flight may still use it.
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // The whole bounce buffer; register it once with the transport (kHost) so
  // that transfers can write from and into it.
  std::span<uint8_t> host_buffer() const { return {host_, total_bytes_}; }
  const StagerOptions& options() const { return options_; }

  // Starts moving device[0, length) out through `transfer`. FailedPrecondition
  // while a previous staging is unfinished.
  Status start_send(const void* device, size_t length, ChunkTransfer transfer);
  // Starts moving `length` bytes from `transfer` into device[0, length).
  Status start_receive(void* device, size_t length, ChunkTransfer transfer);

  // Advances the pipeline: finished copies and transfers free their stage and
  // the next ones start. Ok(true) when every chunk is through, Ok(false) while
  // work remains, or the first failure once nothing is in flight any more.
  Result<bool> poll();
  // Calls poll() and then `step` (e.g. the transport's progress() and a short
  // wait) until poll() finishes; returns its final answer.
  Status drain(const std::function<void()>& step);

  // Whether a staging is under way (started and not yet finished by poll()).
  bool busy() const { return active_; }

 private:
  enum class SlotState : uint8_t { kFree, kCopying, kTransferring, kStaged };
  struct Slot {
    SlotState state = SlotState::kFree;
    size_t chunk = 0;
  };
  // Transfer completions arrive on any thread; they land here, shared with
  // the callbacks so a late one after the Stager is gone touches nothing else.
  struct Inbox {
    std::mutex mu;
    std::vector<std::pair<size_t, Status>> done;  // (buffer, status)
  };

  Stager(CopyEngine& engine, StagerOptions options, uint8_t* host, size_t total_bytes);
  Status start(bool send, uint8_t* device, size_t length, ChunkTransfer transfer);
  StagedChunk chunk_view(size_t chunk) const;
  size_t chunk_length(size_t chunk) const;
  void fail(Status s);
  Status start_copy(size_t chunk);
  Status start_transfer(size_t chunk);
  bool in_flight() const;

  CopyEngine& engine_;
  const StagerOptions options_;
  uint8_t* const host_;
  const size_t total_bytes_;
  std::shared_ptr<Inbox> inbox_ = std::make_shared<Inbox>();

  // The current staging.
  bool active_ = false;
  bool send_ = true;
  uint8_t* device_ = nullptr;
  size_t length_ = 0;
  size_t chunks_ = 0;
  ChunkTransfer transfer_;
  std::vector<Slot> slots_;
  size_t next_first_ = 0;   // next chunk to enter the first stage
  size_t next_second_ = 0;  // next chunk to enter the second stage (chunk order)
  size_t completed_ = 0;
  Status failure_;
};

}  // namespace psld::transport
