// Private to kernels/cuda (.cu files only): a failed CUDA runtime call as a
// KernelStatus.
#ifndef PSLD_KERNELS_CUDA_CUDA_ERROR_H_
#define PSLD_KERNELS_CUDA_CUDA_ERROR_H_

#include <cuda_runtime.h>

#include <string>

#include "kernels/kernel_status.h"

namespace psld::kernels::cuda {

// "what: cudaErrorX (the runtime's text)". Also clears the thread's last
// error, so a later call is not blamed for this one (sticky errors, which
// poison the context, stay and are reported again by every call).
inline KernelStatus cuda_failure(const std::string& what, cudaError_t e) {
  (void)cudaGetLastError();
  return {KernelError::kCudaError,
          what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

}  // namespace psld::kernels::cuda

#endif  // PSLD_KERNELS_CUDA_CUDA_ERROR_H_
