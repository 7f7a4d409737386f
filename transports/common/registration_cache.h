// RegistrationCache: the per-transport cache of memory registrations.
//
// Registering memory is expensive (pinning pages, building keys), so a range
// registered twice returns the first registration. The cache key is the whole
// (address, length, kind) triple, and entries leave only through invalidate():
// a trainer that frees a buffer and gets the same address back for a tensor
// of another size must not silently write through the old registration
// (ps-lite's pointer-keyed cache did exactly that).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

template <typename Region>
class RegistrationCache {
 public:
  // The cached region for exactly this range, or nullptr.
  std::shared_ptr<Region> find(const void* data, size_t length, MemoryKind kind) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key{reinterpret_cast<uintptr_t>(data), length, kind});
    return it == entries_.end() ? nullptr : it->second;
  }

  // Caches `region` unless another thread cached the same range first; returns
  // whichever is cached.
  std::shared_ptr<Region> insert(std::shared_ptr<Region> region) {
    std::lock_guard<std::mutex> lock(mu_);
    Key key{reinterpret_cast<uintptr_t>(region->data()), region->length(), region->kind()};
    auto [it, inserted] = entries_.emplace(key, std::move(region));
    return it->second;
  }

  // Drops every kind registered for exactly this range.
  Status invalidate(const void* data, size_t length) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t erased = 0;
    for (uint8_t k = 0; k <= static_cast<uint8_t>(MemoryKind::kCuda); ++k) {
      erased += entries_.erase(
          Key{reinterpret_cast<uintptr_t>(data), length, static_cast<MemoryKind>(k)});
    }
    if (erased == 0) {
      return NotFound(
          "no registration for this exact range (address and length must match "
          "the register_memory call)");
    }
    return Status::Ok();
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.clear();
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size();
  }

 private:
  using Key = std::tuple<uintptr_t, size_t, MemoryKind>;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<Region>> entries_;
};

}  // namespace psld::transport
