#include "gpu/cuda_driver.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace psld::transport {
namespace {

std::atomic<const CudaDriver*> g_fake{nullptr};

size_t host_page_size() {
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

// Loads the real driver once. The handle is never closed: the driver stays
// for the life of the process, as the CUDA runtime keeps it too.
Result<const CudaDriver*> load_real_driver() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    return Unavailable(fmt::format("no CUDA driver: libcuda.so.1 cannot be loaded ({})",
                                   why != nullptr ? why : "unknown reason"));
  }
  CudaDriverApi api;
  std::string missing;
  auto load = [&](auto& fn, const char* symbol, bool required) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, symbol));
    if (fn == nullptr && required) missing += fmt::format(" {}", symbol);
  };
  load(api.init, "cuInit", true);
  load(api.pointer_get_attribute, "cuPointerGetAttribute", true);
  load(api.ctx_push_current, "cuCtxPushCurrent_v2", true);
  load(api.ctx_pop_current, "cuCtxPopCurrent_v2", true);
  load(api.mem_get_address_range, "cuMemGetAddressRange_v2", true);
  load(api.memset_d8, "cuMemsetD8_v2", true);
  load(api.ctx_synchronize, "cuCtxSynchronize", true);
  load(api.mem_get_handle_for_address_range, "cuMemGetHandleForAddressRange", false);
  load(api.get_error_string, "cuGetErrorString", false);
  if (!missing.empty()) {
    return Unavailable(
        fmt::format("the CUDA driver (libcuda.so.1) lacks{}; update the driver", missing));
  }
  if (const int rc = api.init(0); rc != 0) {
    const char* text = nullptr;
    if (api.get_error_string != nullptr) api.get_error_string(rc, &text);
    return Unavailable(fmt::format("no CUDA device: cuInit failed ({}, error {})",
                                   text != nullptr ? text : "no description", rc));
  }
  static const CudaDriver driver(api);
  return &driver;
}

}  // namespace

Result<const CudaDriver*> CudaDriver::get() {
  if (const CudaDriver* fake = g_fake.load()) return fake;
  static const Result<const CudaDriver*> real = load_real_driver();
  return real;
}

void CudaDriver::set_for_testing(const CudaDriver* fake) {
  g_fake.store(fake);
}

CudaDriver::CudaDriver(CudaDriverApi api, std::string origin)
    : api_(api), origin_(std::move(origin)) {}

Status CudaDriver::check(int rc, std::string_view what) const {
  if (rc == 0) return Status::Ok();
  const char* text = nullptr;
  if (api_.get_error_string != nullptr) api_.get_error_string(rc, &text);
  return Unavailable(
      fmt::format("{}: CUDA error {} ({})", what, rc, text != nullptr ? text : "no description"));
}

class CudaDriver::ContextScope {
 public:
  ContextScope(const CudaDriver& driver, const void* p) : driver_(driver) {
    void* ctx = nullptr;
    status_ = driver.check(driver.api_.pointer_get_attribute(&ctx, kPointerAttributeContext,
                                                             reinterpret_cast<uintptr_t>(p)),
                           "cuPointerGetAttribute(CONTEXT)");
    if (status_.ok() && ctx == nullptr) status_ = InvalidArgument("pointer has no CUDA context");
    if (status_.ok()) {
      status_ = driver.check(driver.api_.ctx_push_current(ctx), "cuCtxPushCurrent");
      pushed_ = status_.ok();
    }
  }
  ~ContextScope() {
    if (pushed_) {
      void* popped = nullptr;
      driver_.api_.ctx_pop_current(&popped);
    }
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
  const Status& status() const { return status_; }

 private:
  const CudaDriver& driver_;
  Status status_;
  bool pushed_ = false;
};

bool CudaDriver::is_device_memory(const void* p) const {
  unsigned type = 0;
  const int rc = api_.pointer_get_attribute(&type, kPointerAttributeMemoryType,
                                            reinterpret_cast<uintptr_t>(p));
  return rc == 0 && type == kMemoryTypeDevice;
}

Result<CudaDriver::Allocation> CudaDriver::allocation_of(const void* p, size_t length) const {
  if (!is_device_memory(p)) {
    return InvalidArgument(fmt::format(
        "{} is not CUDA device memory (register host, pinned or managed memory as kHost)", p));
  }
  ContextScope scope(*this, p);
  PSLD_RETURN_IF_ERROR(scope.status());
  Allocation a;
  PSLD_RETURN_IF_ERROR(
      check(api_.mem_get_address_range(&a.base, &a.size, reinterpret_cast<uintptr_t>(p)),
            "cuMemGetAddressRange"));
  const uint64_t begin = reinterpret_cast<uintptr_t>(p);
  if (begin < a.base || length > a.size || begin - a.base > a.size - length) {
    return InvalidArgument(fmt::format(
        "[{}, +{}) runs past its CUDA allocation [{:#x}, +{}); register within one allocation", p,
        length, a.base, a.size));
  }
  // dma-buf export works on whole host pages. Small cudaMalloc allocations
  // share the driver's 2 MiB pages, so rounding out stays in mapped device
  // memory; the MR itself covers only the registered range (its offset and
  // length), so no peer can reach the rest.
  const uint64_t page = host_page_size();
  const uint64_t end = a.base + a.size;
  a.base = a.base / page * page;
  a.size = static_cast<size_t>((end + page - 1) / page * page - a.base);
  return a;
}

Result<int> CudaDriver::export_dmabuf(const Allocation& range) const {
  if (!can_export_dmabuf()) {
    return Unimplemented(
        "this CUDA driver has no cuMemGetHandleForAddressRange (dma-buf export needs driver "
        ">= 515 / CUDA 11.7)");
  }
  // A device address the driver gave as an integer; nothing dereferences it here.
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  ContextScope scope(*this, reinterpret_cast<const void*>(static_cast<uintptr_t>(range.base)));
  PSLD_RETURN_IF_ERROR(scope.status());
  int fd = -1;
  PSLD_RETURN_IF_ERROR(check(
      api_.mem_get_handle_for_address_range(&fd, range.base, range.size, kRangeHandleDmaBufFd, 0),
      "cuMemGetHandleForAddressRange(DMA_BUF_FD)"));
  if (fd < 0) return Internal("cuMemGetHandleForAddressRange returned no fd");
  return fd;
}

Status CudaDriver::zero(void* p, size_t n) const {
  ContextScope scope(*this, p);
  PSLD_RETURN_IF_ERROR(scope.status());
  PSLD_RETURN_IF_ERROR(check(api_.memset_d8(reinterpret_cast<uintptr_t>(p), 0, n), "cuMemsetD8"));
  return check(api_.ctx_synchronize(), "cuCtxSynchronize");
}

}  // namespace psld::transport
