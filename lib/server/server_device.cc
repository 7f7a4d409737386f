#include "lib/server/server_device.h"

#include <vector>

#include "kernels/cuda/cuda_kernels.h"

namespace psld {
namespace {

namespace cu = kernels::cuda;

class CudaServerDevice final : public ServerDevice {
 public:
  CudaServerDevice(std::string description, std::vector<void*> streams)
      : description_(std::move(description)), streams_(std::move(streams)) {}
  ~CudaServerDevice() override {
    for (void* s : streams_) {
      (void)cu::stream_synchronize(s);
      (void)cu::stream_destroy(s);
    }
  }

  std::string describe() const override { return description_; }
  size_t lanes() const override { return streams_.size(); }

  Result<void*> allocate(size_t bytes) override {
    void* p = nullptr;
    Status s = cu::device_alloc(bytes, &p);
    if (s.ok()) s = cu::zero(p, bytes);
    if (!s.ok()) {
      (void)cu::device_free(p);
      return s;
    }
    return p;
  }
  void free(void* p) override { (void)cu::device_free(p); }

  Result<void*> allocate_host(size_t bytes) override {
    void* p = nullptr;
    PSLD_RETURN_IF_ERROR(cu::host_alloc(bytes, &p));
    return p;
  }
  void free_host(void* p) override { (void)cu::host_free(p); }
  Status pin(void* p, size_t bytes) override { return cu::host_register(p, bytes); }
  void unpin(void* p) override { (void)cu::host_unregister(p); }

  Status copy(void* dst, const void* src, size_t bytes, size_t lane) override {
    if (lane >= streams_.size()) return InvalidArgument("server device: no such lane");
    return cu::copy_async(dst, src, bytes, streams_[lane]);
  }
  Status launch(size_t lane, const Launch& fn) override {
    if (lane >= streams_.size()) return InvalidArgument("server device: no such lane");
    return fn(MemoryKind::kCuda, streams_[lane]);
  }
  Status synchronize(size_t lane) override {
    if (lane >= streams_.size()) return InvalidArgument("server device: no such lane");
    return cu::stream_synchronize(streams_[lane]);
  }

 private:
  std::string description_;
  std::vector<void*> streams_;
};

}  // namespace

Result<std::unique_ptr<ServerDevice>> create_cuda_server_device(size_t lanes) {
  if (lanes == 0) return InvalidArgument("server device: lanes must be positive");
  std::string description;
  PSLD_RETURN_IF_ERROR(cu::describe_device(&description));
  std::vector<void*> streams;
  for (size_t i = 0; i < lanes; ++i) {
    void* s = nullptr;
    Status st = cu::stream_create(&s);
    if (!st.ok()) {
      for (void* made : streams)
        (void)cu::stream_destroy(made);
      return st;
    }
    streams.push_back(s);
  }
  return std::unique_ptr<ServerDevice>(
      new CudaServerDevice(std::move(description), std::move(streams)));
}

Result<std::string> describe_server_device() {
  std::string description;
  PSLD_RETURN_IF_ERROR(cu::describe_device(&description));
  return description;
}

}  // namespace psld
