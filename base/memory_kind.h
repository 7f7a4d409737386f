// MemoryKind: where a range of memory lives. One enum for the transports
// (what a region holds) and the kernels (where a call's arrays are), so it
// lives in base/, below both.
#pragma once

#include <cstdint>
#include <string_view>

namespace psld {

enum class MemoryKind : uint8_t {
  kHost = 0,  // pageable or pinned host memory
  kCuda = 1,  // CUDA device (or managed) memory
};

// "host", "cuda".
constexpr std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

}  // namespace psld
