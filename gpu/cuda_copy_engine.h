// The CUDA CopyEngine (gpu/copy_engine.h): one non-blocking CUDA stream per
// lane on the calling thread's current device, cudaMemcpyAsync for copies,
// cudaHostAlloc for the pinned host memory.
//
// It lives in its own library (psld_cuda_copy_engine_dep in gpu/meson.build) so that only code that
// stages device tensors links the CUDA runtime. In a build without CUDA the same function exists
// and answers Unavailable.
#pragma once

#include <cstddef>
#include <memory>

#include "gpu/copy_engine.h"
#include "psld/status.h"

namespace psld {

// Unavailable("no CUDA device: ...") where the runtime finds no device, or
// ("built without CUDA") in a build without the toolkit.
Result<std::unique_ptr<CopyEngine>> create_cuda_copy_engine(size_t lanes);

}  // namespace psld
