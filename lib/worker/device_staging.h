// Tensors in CUDA memory on the worker's data path (docs/gpu.md).
//
// A tensor registered from CUDA device memory travels one of two ways:
//  - direct: the transport registers the device memory itself (verbs on a
//    dma-buf, a UCX built with CUDA), so pushes read it and servers write
//    pulls straight into it, as for host memory;
//  - staged: the transport registers a pinned host "shadow" of the tensor.
//    A push copies each chunk device -> shadow and writes it to its server
//    as soon as that chunk's copy is done, so the copies of later chunks run
//    while earlier ones are on the wire; a pulled chunk lands in the shadow
//    and is copied shadow -> device before its request completes.
//
// DeviceCopier runs the staged path's copies on a thread of its own, so that
// neither the trainer's thread nor the transport's progress thread waits for
// PCIe; choose_gpu_path decides between the two ways and says why, for the
// worker's start-up line and `psld config`.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "gpu/copy_engine.h"
#include "lib/config/runtime_options.h"
#include "psld/status.h"
#include "transports/transport.h"

namespace psld {

struct GpuPathChoice {
  bool possible = false;  // false: a CUDA tensor cannot be registered (why: text)
  bool direct = false;    // true: direct, false: staged
  std::string text;       // "staged through pinned host memory: <the transport's reason>"
};

// What `requested` means with `transport`: direct where it can register CUDA
// memory (or must, with kDirect), else staged.
GpuPathChoice choose_gpu_path(GpuPath requested, const transport::Transport& transport);

// The worker's start-up line and `psld config` say this: the choice, and
// whether this machine has a CUDA device at all.
std::string describe_gpu_path(GpuPath requested, const transport::Transport& transport);
// The same for a process that has no transport yet (`psld config`): starts
// the options' transport without listening, asks it, and stops it; says so
// when the transport does not start here.
std::string describe_gpu_path(const RuntimeOptions& options);

// The copies of the staged path, in order, on one thread.
class DeviceCopier {
 public:
  enum class Direction : uint8_t { kToHost, kToDevice };
  using Done = std::function<void(Status)>;

  // Takes the engine (it needs two lanes: one per direction, so a push's
  // copies and a pull's overlap) and starts the thread.
  static Result<std::unique_ptr<DeviceCopier>> start(std::unique_ptr<CopyEngine> engine);
  // stop(), then the engine goes.
  ~DeviceCopier();
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  // Pinned host memory from the engine, for shadows; free_host after the
  // transport let go of it.
  Result<void*> allocate_host(size_t bytes) { return engine_->allocate_host(bytes); }
  void free_host(void* p) { engine_->free_host(p); }

  // Queues a copy of `bytes` from `src` to `dst`; `done` runs on the
  // copier's thread once the bytes are there (Ok) or the copy failed, with
  // no lock of the copier held. Copies of one direction run in the order
  // queued. After stop(), `done` gets Aborted at once.
  void copy(Direction direction, void* dst, const void* src, size_t bytes, Done done);
  // Queues a copy and waits for it (initial values).
  Status copy_and_wait(Direction direction, void* dst, const void* src, size_t bytes);

  // Finishes the copies already running (the hardware may be writing into
  // memory the caller is about to free), fails the queued ones with Aborted
  // and joins the thread. Idempotent.
  void stop();

  // Bytes copied so far, each way.
  uint64_t bytes_to_host() const;
  uint64_t bytes_to_device() const;

 private:
  struct Job {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
    Done done;
  };
  // One direction: its queue, the copy running on its lane, and its count.
  struct Lane {
    std::deque<Job> queue;
    bool running = false;
    Job current;
    uint64_t bytes = 0;
  };

  explicit DeviceCopier(std::unique_ptr<CopyEngine> engine);
  void run();

  std::unique_ptr<CopyEngine> engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Lane lanes_[2];  // indexed by Direction, which is also the engine lane
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace psld
