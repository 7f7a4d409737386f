// Private to kernels/cuda (.cu files only): a failed CUDA runtime call as a
// Status.
#ifndef PSLD_KERNELS_CUDA_CUDA_ERROR_H_
#define PSLD_KERNELS_CUDA_CUDA_ERROR_H_

#include <cuda_runtime.h>

#include <string>

#include "psld/status.h"

namespace psld::kernels::cuda {

// "what: cudaErrorX (the runtime's text)". Also clears the thread's last
// error, so a later call is not blamed for this one (sticky errors, which
// poison the context, stay and are reported again by every call).
inline Status cuda_failure(const std::string& what, cudaError_t e) {
  (void)cudaGetLastError();
  return Internal(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace psld::kernels::cuda

#endif  // PSLD_KERNELS_CUDA_CUDA_ERROR_H_
