// 64 random bits from the system's source (std::random_device, which is
// getrandom/urandom with libstdc++ on Linux): nonces, connection secrets and
// instance ids that must differ across processes and runs. One definition
// for every transport and the coordinator.
#pragma once

#include <cstdint>
#include <random>

namespace psld {

inline uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Never 0, for values where 0 means "none" or "not known yet".
inline uint64_t random_nonzero_u64() {
  uint64_t v = 0;
  while (v == 0)
    v = random_u64();
  return v;
}

}  // namespace psld
