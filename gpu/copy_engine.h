// CopyEngine: asynchronous copies between host and device memory on
// independent queues ("lanes": CUDA streams), and page-locked host memory
// for them to use. The worker stages tensors in CUDA memory through one
// (lib/worker/device_staging.h); gpu/cuda_copy_engine.h has the CUDA one, and
// tests use a fake, so the staging logic runs without a GPU.
#pragma once

#include <cstddef>

#include "psld/status.h"

namespace psld {

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // How many lanes there are.
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

}  // namespace psld
