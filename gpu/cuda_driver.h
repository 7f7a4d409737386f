// CudaDriver: the few CUDA driver entry points the transports need to reach
// GPU memory, loaded at run time with dlopen("libcuda.so.1").
//
// Why dlopen and not a link: libcuda comes with the NVIDIA driver, not the
// toolkit, so a machine that builds psld often has none (our development
// machine has nvcc but no driver), and a transport library that linked it
// would not even load there. Loading it when a transport first asks keeps
// every build and machine working; where it is absent, CUDA memory is simply
// not supported and the caller is told why.
//
// The driver API is used rather than the runtime because what verbs needs,
// the dma-buf export of an allocation (cuMemGetHandleForAddressRange), only
// exists there. No CUDA header is needed: the few types are declared here
// with the driver's ABI (CUresult is an int, CUdeviceptr a 64-bit integer,
// CUcontext a pointer).
//
// Tests install a fake with set_for_testing(), so the verbs backend's GPU
// registration path runs without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "psld/status.h"

namespace psld::transport {

// The driver functions, by their ABI symbol names (cuda.h maps the API names
// to the _v2 symbols where they differ). Entries marked optional may be null:
// cuMemGetHandleForAddressRange came with CUDA 11.7 drivers.
struct CudaDriverApi {
  int (*init)(unsigned flags) = nullptr;  // cuInit
  int (*pointer_get_attribute)(void* data, int attribute,
                               uint64_t ptr) = nullptr;  // cuPointerGetAttribute
  int (*ctx_push_current)(void* ctx) = nullptr;          // cuCtxPushCurrent_v2
  int (*ctx_pop_current)(void** ctx) = nullptr;          // cuCtxPopCurrent_v2
  int (*mem_get_address_range)(uint64_t* base, size_t* size,
                               uint64_t ptr) = nullptr;  // cuMemGetAddressRange_v2
  int (*memset_d8)(uint64_t ptr, unsigned char value, size_t n) = nullptr;  // cuMemsetD8_v2
  int (*ctx_synchronize)() = nullptr;                                       // cuCtxSynchronize
  // Optional.
  int (*mem_get_handle_for_address_range)(void* handle, uint64_t ptr, size_t size, int type,
                                          unsigned long long flags) = nullptr;
  int (*get_error_string)(int error, const char** text) = nullptr;  // cuGetErrorString
};

class CudaDriver {
 public:
  // The driver's values for the few enums used (cuda.h).
  static constexpr int kPointerAttributeContext = 1;     // CU_POINTER_ATTRIBUTE_CONTEXT
  static constexpr int kPointerAttributeMemoryType = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
  static constexpr unsigned kMemoryTypeDevice = 2;       // CU_MEMORYTYPE_DEVICE
  static constexpr int kRangeHandleDmaBufFd = 1;         // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD

  // The process's driver, loaded and initialised (cuInit) on the first call.
  // Unavailable, naming the reason, where libcuda.so.1 cannot be loaded, lacks
  // a required function, or cuInit fails (no device); the answer is cached.
  static Result<const CudaDriver*> get();
  // Replaces what get() returns, for tests; nullptr goes back to the real
  // driver. The fake must outlive its use.
  static void set_for_testing(const CudaDriver* fake);

  explicit CudaDriver(CudaDriverApi api, std::string origin = "libcuda.so.1");

  // Where the functions came from ("libcuda.so.1", or a test's name).
  const std::string& origin() const { return origin_; }

  // The whole allocation (cuMemAlloc / cudaMalloc) that contains a pointer.
  struct Allocation {
    uint64_t base = 0;
    size_t size = 0;
  };

  // True when `p` is device memory (not host, pinned or managed memory the
  // CPU can touch).
  bool is_device_memory(const void* p) const;
  // The allocation holding [p, p + length). InvalidArgument when p is not
  // device memory or the range runs past its allocation.
  Result<Allocation> allocation_of(const void* p, size_t length) const;
  // Whether the driver can export dma-buf fds at all.
  bool can_export_dmabuf() const { return api_.mem_get_handle_for_address_range != nullptr; }
  // A dma-buf fd for [base, base + size) of an allocation, which must be
  // page aligned (allocation_of's answer is). The caller closes it.
  Result<int> export_dmabuf(const Allocation& range) const;
  // Zeroes device memory and waits for it.
  Status zero(void* p, size_t n) const;

 private:
  Status check(int rc, std::string_view what) const;
  // Makes the context that owns `p` current for the scope of the guard, so a
  // call works from any thread (the driver API acts on the current context).
  class ContextScope;

  CudaDriverApi api_;
  std::string origin_;
};

}  // namespace psld::transport
