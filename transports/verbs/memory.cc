// Memory of the verbs backend: regions, registration (host, dma-buf, nvidia-peermem), allocation.
#include "transports/verbs/core.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/log.h"
#include "gpu/cuda_driver.h"

namespace psld::transport {
namespace verbs {

VerbsRegion::~VerbsRegion() {
  if (auto core = core_.lock()) core->deregister(id());
}

// ---------------------------------------------------------------------------
// Memory

Result<std::shared_ptr<VerbsRegion>> Core::make_region(uint8_t* data, size_t length,
                                                       MemoryKind kind, VerbsRegion::Owned owned) {
  ReaderLock pd_lock(pd_mu_);
  if (pd_ == nullptr) return Unavailable("verbs transport is shut down");
  // REMOTE_WRITE on every region: any registered region may be the target of
  // a peer's write once its remote_key() was handed out (landing slots and
  // pulled tensors both are). Which peers can write is decided by who gets
  // the key; the NIC enforces its bounds. No REMOTE_READ or atomics: psld
  // never issues them, so a key cannot be used to read our memory.
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  std::string how = "ibv_reg_mr";
  ibv_mr* mr = nullptr;
  if (kind == MemoryKind::kCuda) {
    PSLD_ASSIGN_OR_RETURN(mr, register_device_memory_locked(data, length, access, &how));
  } else {
    mr = ibv_reg_mr(pd_, data, length, access);
  }
  if (mr == nullptr) {
    const int err = errno;
    if (err == ENOMEM || err == EAGAIN) {
      return ResourceExhausted(
          fmt::format("ibv_reg_mr of {} bytes: {} (pinned memory limit: raise ulimit -l / memlock)",
                      length, errno_text(err)));
    }
    return InvalidArgument(fmt::format("ibv_reg_mr of {} bytes at {}: {}", length,
                                       static_cast<void*>(data), errno_text(err)));
  }
  const uint64_t id = next_region_.fetch_add(1);
  {
    MutexLock lock(regions_mu_);
    mrs_[id] = mr;
  }
  return std::make_shared<VerbsRegion>(data, length, kind, id, transport_id_, mr->lkey, mr->rkey,
                                       weak_from_this(), std::move(owned), std::move(how));
}

// GPU memory: the CUDA driver exports the allocation as a dma-buf fd and the
// NIC registers that (ibv_reg_dmabuf_mr: the upstream kernel path since Linux
// 5.12, no out-of-tree module). Where that fails (older kernel or driver, a
// NIC driver without dma-buf support), ibv_reg_mr on the device pointer works
// when nvidia-peermem is loaded. The NIC addresses the MR by the pointer
// (iova = data), so the remote key's address is the same as for host memory.
void Core::detect_cuda_support() {
  Result<const CudaDriver*> driver = CudaDriver::get();
  if (!driver.ok()) {
    cuda_support_ = {false, fmt::format("{}; psld stages device tensors through host memory",
                                        driver.status().message())};
  } else {
#if PSLD_VERBS_HAVE_DMABUF
    const bool dmabuf = (*driver)->can_export_dmabuf();
#else
    const bool dmabuf = false;
#endif
    cuda_support_ = {true, dmabuf ? "ibv_reg_dmabuf_mr on a dma-buf of the allocation "
                                    "(cuMemGetHandleForAddressRange), else ibv_reg_mr through "
                                    "nvidia-peermem"
                                  : "ibv_reg_mr through nvidia-peermem (no dma-buf export: "
                                    "rdma-core or CUDA driver too old)"};
  }
  PSLD_LOG_INFO("verbs: CUDA memory {}: {}",
                cuda_support_.supported ? "supported" : "not supported", cuda_support_.detail);
}

Result<ibv_mr*> Core::register_device_memory_locked(uint8_t* data, size_t length, int access,
                                                    std::string* how) {
  if (!cuda_support_.supported) {
    return Unimplemented(
        fmt::format("verbs cannot register CUDA memory: {}", cuda_support_.detail));
  }
  PSLD_ASSIGN_OR_RETURN(const CudaDriver* driver, CudaDriver::get());
  PSLD_ASSIGN_OR_RETURN(const CudaDriver::Allocation range, driver->allocation_of(data, length));
  std::string dmabuf_failure;
#if PSLD_VERBS_HAVE_DMABUF
  if (Result<int> fd = driver->export_dmabuf(range); fd.ok()) {
    const uint64_t offset = reinterpret_cast<uintptr_t>(data) - range.base;
    ibv_mr* mr =
        ibv_reg_dmabuf_mr(pd_, offset, length, reinterpret_cast<uintptr_t>(data), *fd, access);
    const int err = errno;
    // The MR holds its own reference to the dma-buf.
    ::close(*fd);
    if (mr != nullptr) {
      *how = "ibv_reg_dmabuf_mr";
      return mr;
    }
    dmabuf_failure = fmt::format("ibv_reg_dmabuf_mr: {}", errno_text(err));
  } else {
    dmabuf_failure = fd.status().message();
  }
#else
  dmabuf_failure = "this rdma-core has no ibv_reg_dmabuf_mr (rdma-core >= 34 has)";
#endif
  ibv_mr* mr = ibv_reg_mr(pd_, data, length, access);
  if (mr == nullptr) {
    const int err = errno;
    return Unavailable(fmt::format(
        "cannot register CUDA memory [{}, +{}) with {}: the dma-buf path failed ({}), and "
        "ibv_reg_mr on the device pointer failed too ({}; it needs the nvidia-peermem module: "
        "modprobe nvidia-peermem); psld can stage device tensors through host memory instead",
        static_cast<void*>(data), length, device_name_, dmabuf_failure, errno_text(err)));
  }
  if (!peermem_fallback_logged_.exchange(true)) {
    PSLD_LOG_INFO(
        "verbs: CUDA memory registered with ibv_reg_mr (nvidia-peermem) because the "
        "dma-buf path failed: {}",
        dmabuf_failure);
  }
  *how = "ibv_reg_mr (nvidia-peermem)";
  return mr;
}

void Core::deregister(uint64_t region_id) {
  ReaderLock pd_lock(pd_mu_);
  ibv_mr* mr = nullptr;
  {
    MutexLock lock(regions_mu_);
    auto it = mrs_.find(region_id);
    if (it == mrs_.end()) return;
    mr = it->second;
    mrs_.erase(it);
  }
  if (const int rc = ibv_dereg_mr(mr); rc != 0) {
    PSLD_LOG_WARN("verbs: ibv_dereg_mr of region {}: {}", region_id, errno_text(rc));
  }
}

Result<std::shared_ptr<MemoryRegion>> Core::register_memory(void* data, size_t length,
                                                            MemoryKind kind) {
  if (data == nullptr || length == 0) {
    return InvalidArgument("register_memory needs a non-null pointer and a non-zero length");
  }
  // CUDA memory: see register_device_memory_locked. Not settled here: whether
  // the bytes of a write into GPU memory are visible to a CUDA kernel as soon
  // as its WRITE_WITH_IMM completion arrives. NCCL flushes first (an RDMA
  // READ of the buffer, or cuFlushGPUDirectRDMAWrites); a server that reduces
  // landed GPU data may need the same (docs/transports.md, "GPU memory").
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return InvalidArgument("unknown memory kind");
  }
  if (kind == MemoryKind::kCuda && !cuda_support_.supported) {
    return Unimplemented(
        fmt::format("verbs cannot register CUDA memory: {}", cuda_support_.detail));
  }
  if (auto hit = cache_.find(data, length, kind)) return std::shared_ptr<MemoryRegion>(hit);
  PSLD_ASSIGN_OR_RETURN(auto region, make_region(static_cast<uint8_t*>(data), length, kind,
                                                 VerbsRegion::Owned(nullptr, std::free)));
  return std::shared_ptr<MemoryRegion>(cache_.insert(std::move(region)));
}

Result<std::shared_ptr<MemoryRegion>> Core::allocate_memory(size_t length, MemoryKind kind) {
  if (length == 0) return InvalidArgument("allocate_memory needs a non-zero length");
  if (kind == MemoryKind::kCuda) {
    return Unimplemented(
        "the verbs transport allocates host memory only; allocate device memory with "
        "cudaMalloc and register_memory it as kCuda");
  }
  if (kind != MemoryKind::kHost) return InvalidArgument("unknown memory kind");
  if (length > SIZE_MAX - 4095) return ResourceExhausted("allocation size overflows");
  // Page-aligned: the NIC pins whole pages anyway, and no other object shares
  // a page that a peer can write.
  const size_t rounded = (length + 4095) / 4096 * 4096;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
  if (p == nullptr) return ResourceExhausted(fmt::format("cannot allocate {} bytes", length));
  std::memset(p, 0, rounded);
  PSLD_ASSIGN_OR_RETURN(auto region,
                        make_region(p, length, kind, VerbsRegion::Owned(p, std::free)));
  return std::shared_ptr<MemoryRegion>(std::move(region));
}

}  // namespace verbs
}  // namespace psld::transport
