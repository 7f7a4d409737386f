// UCX memory: registering, allocating, exporting and invalidating regions.
#include "transports/ucx/core.h"

#include <fmt/format.h>

#include <cstring>

#include "gpu/cuda_driver.h"

namespace psld::transport {

namespace ucx_detail {

Result<MappedAllocation> map_allocated(ucp_context_h context, size_t length, bool cuda) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = nullptr;
  mp.length = length;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  if (cuda) {
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  MappedAllocation out;
  const ucs_status_t st = ucp_mem_map(context, &mp, &out.memh);
  if (st != UCS_OK) {
    return ResourceExhausted(
        fmt::format("UCX cannot allocate {} bytes: {}", length, ucs_status_string(st)));
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (ucp_mem_query(out.memh, &attr) != UCS_OK || attr.address == nullptr || attr.length < length) {
    ucp_mem_unmap(context, out.memh);
    return Internal("ucp_mem_query failed on memory UCX just allocated");
  }
  out.base = static_cast<uint8_t*>(attr.address);
  return out;
}

}  // namespace ucx_detail

// ---------------------------------------------------------------------------
// Memory

Result<std::shared_ptr<MemoryRegion>> UcxCore::register_memory(void* data, size_t length,
                                                               MemoryKind kind) {
  if (data == nullptr || length == 0) {
    return InvalidArgument("register_memory needs a non-null pointer and a non-zero length");
  }
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return InvalidArgument("unknown memory kind");
  }
  if (kind == MemoryKind::kCuda && !cuda_supported_) {
    return Unimplemented(fmt::format("ucx cannot register CUDA memory: {}", cuda_detail_));
  }
  if (shut_) return Unavailable("UCX transport is shut down");
  if (auto hit = cache_.find(data, length, kind)) return std::shared_ptr<MemoryRegion>(hit);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = data;
  mp.length = length;
  if (kind == MemoryKind::kCuda) {
    // Named rather than detected: detection needs UCX's memory hooks, which
    // psld's tests turn off, or a driver query per call.
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context_->handle, &mp, &memh);
  if (st != UCS_OK) return ucs_to_status(st, fmt::format("ucp_mem_map of {} bytes", length));
  PSLD_ASSIGN_OR_RETURN(auto region, make_region(static_cast<uint8_t*>(data), length, kind, memh));
  return std::shared_ptr<MemoryRegion>(cache_.insert(std::move(region)));
}

Result<std::shared_ptr<MemoryRegion>> UcxCore::allocate_memory(size_t length, MemoryKind kind) {
  if (length == 0) return InvalidArgument("allocate_memory needs a non-zero length");
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return InvalidArgument("unknown memory kind");
  }
  if (kind == MemoryKind::kCuda && !cuda_supported_) {
    return Unimplemented(fmt::format("ucx cannot allocate CUDA memory: {}", cuda_detail_));
  }
  const CudaDriver* driver = nullptr;
  if (kind == MemoryKind::kCuda) {
    // UCX allocates device memory uninitialised; the driver zeroes it.
    PSLD_ASSIGN_OR_RETURN(driver, CudaDriver::get());
  }
  if (shut_) return Unavailable("UCX transport is shut down");
  // A peer on this host maps host memory allocated this way, and a put into
  // it is a plain memcpy (map_allocated).
  PSLD_ASSIGN_OR_RETURN(MappedAllocation mapped,
                        map_allocated(context_->handle, length, kind == MemoryKind::kCuda));
  const ucp_mem_h memh = mapped.memh;
  if (driver != nullptr) {
    if (Status z = driver->zero(mapped.base, length); !z.ok()) {
      ucp_mem_unmap(context_->handle, memh);
      return z.with_context("zeroing CUDA memory UCX allocated");
    }
  } else {
    std::memset(mapped.base, 0, length);
  }
  PSLD_ASSIGN_OR_RETURN(auto region, make_region(mapped.base, length, kind, memh));
  return std::shared_ptr<MemoryRegion>(std::move(region));
}

// Packs the remote key and exports the region; takes ownership of memh.
Result<std::shared_ptr<UcxRegion>> UcxCore::make_region(uint8_t* data, size_t length,
                                                        MemoryKind kind, ucp_mem_h memh) {
  const uint64_t id = next_region_.fetch_add(1);
  const uint64_t secret = random_u64();
  void* packed = nullptr;
  size_t packed_size = 0;
  ucs_status_t st = ucp_rkey_pack(context_->handle, memh, &packed, &packed_size);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_->handle, memh);
    return ucs_to_status(st, "ucp_rkey_pack");
  }
  RemoteKeyFields k;
  k.kind = kind;
  k.owner = instance_;
  k.region = id;
  k.base = reinterpret_cast<uintptr_t>(data);
  k.length = length;
  k.secret = secret;
  k.packed = {static_cast<const uint8_t*>(packed), packed_size};
  std::vector<uint8_t> key = encode_remote_key(k);
  ucp_rkey_buffer_release(packed);
  std::weak_ptr<UcxCore> weak = weak_from_this();
  auto* raw =
      new UcxRegion(data, length, kind, id, context_, memh, instance_, secret, std::move(key));
  // The deleter unexports the region, so a peer's later write is rejected.
  std::shared_ptr<UcxRegion> region(raw, [weak, id](UcxRegion* p) {
    if (auto core = weak.lock()) {
      MutexLock lock(core->export_mu_);
      core->exported_.erase(id);
      core->unexported_.fetch_add(1, std::memory_order_release);
    }
    delete p;
  });
  MutexLock lock(export_mu_);
  exported_[id] = region;
  return region;
}

Status UcxCore::invalidate(void* data, size_t length) {
  std::vector<std::shared_ptr<UcxRegion>> regions;
  for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kCuda}) {
    if (auto r = cache_.find(data, length, k)) regions.push_back(std::move(r));
  }
  PSLD_RETURN_IF_ERROR(cache_.invalidate(data, length));
  // Peers' writes to these regions are rejected from now on; the memory stays
  // registered until the last holder lets go.
  MutexLock lock(export_mu_);
  for (auto& r : regions)
    exported_.erase(r->id());
  unexported_.fetch_add(1, std::memory_order_release);
  return Status::Ok();
}

}  // namespace psld::transport
