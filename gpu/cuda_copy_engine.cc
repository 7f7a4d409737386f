#include "gpu/cuda_copy_engine.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <vector>

namespace psld {
namespace {

Status cuda_error(cudaError_t e, std::string_view what) {
  return Unavailable(fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(std::vector<cudaStream_t> streams) : streams_(std::move(streams)) {}
  ~CudaCopyEngine() override {
    for (cudaStream_t s : streams_) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  }

  size_t lanes() const override { return streams_.size(); }

  Result<void*> allocate_host(size_t bytes) override {
    void* p = nullptr;
    // Portable: pinned for every device, should the caller switch devices.
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      return ResourceExhausted(
          fmt::format("cudaHostAlloc of {} bytes: {}", bytes, cudaGetErrorString(e)));
    }
    return p;
  }
  void free_host(void* p) override {
    if (p != nullptr) cudaFreeHost(p);
  }

  Status copy_async(void* dst, const void* src, size_t bytes, size_t lane) override {
    if (lane >= streams_.size()) return InvalidArgument("copy engine: no such lane");
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, streams_[lane]);
    return e == cudaSuccess ? Status::Ok() : cuda_error(e, "cudaMemcpyAsync");
  }

  Result<bool> lane_idle(size_t lane) override {
    if (lane >= streams_.size()) return InvalidArgument("copy engine: no such lane");
    const cudaError_t e = cudaStreamQuery(streams_[lane]);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    return cuda_error(e, "cudaStreamQuery");
  }

 private:
  std::vector<cudaStream_t> streams_;
};

}  // namespace

Result<std::unique_ptr<CopyEngine>> create_cuda_copy_engine(size_t lanes) {
  if (lanes == 0) return InvalidArgument("copy engine: lanes must be positive");
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    return Unavailable(fmt::format("no CUDA device: {}", e != cudaSuccess
                                                             ? cudaGetErrorString(e)
                                                             : "cudaGetDeviceCount found none"));
  }
  std::vector<cudaStream_t> streams;
  for (size_t i = 0; i < lanes; ++i) {
    cudaStream_t s = nullptr;
    if (const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        e != cudaSuccess) {
      for (cudaStream_t made : streams)
        cudaStreamDestroy(made);
      return cuda_error(e, "cudaStreamCreateWithFlags");
    }
    streams.push_back(s);
  }
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(std::move(streams)));
}

}  // namespace psld
