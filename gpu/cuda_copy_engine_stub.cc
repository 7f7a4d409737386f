// create_cuda_copy_engine in a build without the CUDA toolkit.
#include "gpu/cuda_copy_engine.h"

namespace psld {

Result<std::unique_ptr<CopyEngine>> create_cuda_copy_engine(size_t /*lanes*/) {
  return Unavailable(
      "built without CUDA: no CUDA copy engine (configure with the CUDA toolkit, -Dcuda=enabled)");
}

}  // namespace psld
