// base/hash.h — deterministic 64-bit hashing for placement and checksums.
//
// Placement hashes must be the same in every process of a job, on every run and
// every build, so nothing here uses std::hash (whose values the standard leaves
// to the implementation, and which is the identity for integers in libstdc++).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "psld/keys.h"

namespace psld {

// The splitmix64 finalizer (Steele, Lea, Flood 2014; the constants are
// Stafford's "Mix13"): every output bit depends on every input bit, and it is a
// bijection of uint64, so two distinct inputs never collide.
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;  // golden-ratio increment: keeps mix64(0) != 0
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Where a key lands on the placement ring. A bijection: two different keys
// always have different hashes, so an arc of one hash holds exactly one key.
constexpr uint64_t hash_key(Key key) {
  return mix64(key);
}

// An order-sensitive hash of two words, for derived pseudo-random orders
// (e.g. a server's virtual-node tokens, hash_pair(server, replica)).
constexpr uint64_t hash_pair(uint64_t a, uint64_t b) {
  return mix64(mix64(a) ^ b);
}

// 64-bit FNV-1a: the checksum of serialized placements and deltas. Any change
// of a single byte changes the result (each step is a bijection of the state),
// which is what catches a truncated or corrupted epoch on the wire; it is not a
// defence against a forger, which the transport's authentication is.
constexpr uint64_t fnv1a64(std::span<const uint8_t> bytes, uint64_t h = 0xcbf29ce484222325ULL) {
  for (uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace psld
