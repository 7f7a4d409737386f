// Where a server keeps its keys and runs its reduce and optimizer kernels
// (docs/gpu.md, "GPU servers"; config server.device).
//
// With server.device = cpu (the default) a server needs none of this: its
// keys live in host memory and the CPU kernels run on the shard threads.
// With server.device = cuda each key's parameter, accumulator and optimizer
// moments live in GPU memory, and a shard thread queues copies and kernels
// on its own lane (a CUDA stream) and waits for them with synchronize().
// Pushes still land in host memory (the transport's landing slots), and
// pulls are still written from host memory (a pinned copy of each key's
// output): the server copies host -> GPU before a reduce and GPU -> host
// after an update.
//
// The interface exists so that tests can run the server's GPU path on a
// fake device whose memory the host cannot touch (tests/fake_gpu.h); the
// CUDA one is create_cuda_server_device.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "kernels/dispatch.h"
#include "psld/status.h"

namespace psld {

class ServerDevice {
 public:
  // A kernel call to queue: called with where the arrays are (and so which
  // kernels to run, kernels/dispatch.h) and the lane's stream.
  using Launch = std::function<Status(MemoryKind where, void* stream)>;

  virtual ~ServerDevice() = default;
  // "cuda device 0: NVIDIA H200, 139.8 GiB, sm_90", for the start-up line.
  virtual std::string describe() const = 0;
  // Independent queues of work, one per shard thread.
  virtual size_t lanes() const = 0;
  // Device memory, zeroed; free(nullptr) is fine.
  virtual Result<void*> allocate(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  // Page-locked host memory, which copies to and from the device read and
  // write without a bounce; free_host(nullptr) is fine.
  virtual Result<void*> allocate_host(size_t bytes) = 0;
  virtual void free_host(void* p) = 0;
  // Page-locks host memory allocated elsewhere (the landing slots) so that
  // copies from it run without the runtime's bounce; unpin() before the
  // memory goes. An error leaves the memory pageable: copies still work.
  virtual Status pin(void* p, size_t bytes) = 0;
  virtual void unpin(void* p) = 0;
  // Queue a copy (any direction, the kind of each pointer decides) or a
  // kernel on `lane`, after everything queued there before. An error here
  // is a launch that failed; a fault while the work runs is reported by
  // synchronize().
  virtual Status copy(void* dst, const void* src, size_t bytes, size_t lane) = 0;
  virtual Status launch(size_t lane, const Launch& fn) = 0;
  // Waits until everything queued on `lane` has run; the first error of it.
  virtual Status synchronize(size_t lane) = 0;
};

// The calling thread's current CUDA device with `lanes` non-blocking
// streams. Unavailable with the reason where there is no device, or in a
// build without CUDA.
Result<std::unique_ptr<ServerDevice>> create_cuda_server_device(size_t lanes);

// The device a server with server.device = cuda would use here, in words,
// or why it could not start (Unavailable). For `psld config`.
Result<std::string> describe_server_device();

}  // namespace psld
