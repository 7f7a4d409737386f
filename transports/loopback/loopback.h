// The loopback backend: transports in one process connected through a
// LoopbackFabric, for deterministic tests of everything above the transport
// layer, with injectable faults (delay, drop, duplicate, reorder, corrupt,
// disconnect).
//
// It keeps the contract of the real backends: a write's bytes are copied into
// the target region before the receiver's on_write runs, completions and
// handler calls happen only inside progress(), and a pending operation
// completes exactly once (Ok, Timeout, Unavailable or Aborted).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

// Faults applied to each write and message a connection sends. Probabilities
// are in [0, 1]; draws come from a generator seeded by `seed` and the
// connection's creation order, so a test sees the same faults every run.
struct FaultPlan {
  std::chrono::microseconds delay{0};  // added to every delivery
  double drop = 0;                     // vanishes: the sender's op times out
  double duplicate = 0;                // delivered twice
  double reorder = 0;                  // delivered after the next operation
  double corrupt = 0;                  // one byte of the payload flipped
  // After this many operations on the connection it breaks: both ends see
  // on_disconnect and every pending operation fails with Unavailable.
  uint64_t disconnect_after = UINT64_MAX;
  uint64_t seed = 1;
};

// A loopback region's remote key: the fabric's token, the exporting
// transport, the region's id, length and secret. Exposed for
// tests/fuzz/loopback_fuzz.cc; import_region decodes it first.
struct LoopbackKey {
  uint64_t fabric_token = 0;
  uint64_t node = 0;
  uint64_t region = 0;
  uint64_t length = 0;
  uint64_t secret = 0;
};
std::vector<uint8_t> encode_loopback_key(const LoopbackKey& key);
// DataLoss for anything but exactly a key's bytes.
Result<LoopbackKey> decode_loopback_key(std::span<const uint8_t> key);

Result<std::unique_ptr<Transport>> create_loopback_transport(const TransportOptions& options,
                                                             Handler* handler);

// The in-process "network". Thread-safe. Faults set here apply to connections
// created afterwards.
class LoopbackFabric {
 public:
  LoopbackFabric();
  LoopbackFabric(const LoopbackFabric&) = delete;
  LoopbackFabric& operator=(const LoopbackFabric&) = delete;

  // Faults for connections whose dialling side's address is `from` (empty:
  // every connection without a specific plan).
  void set_faults(const FaultPlan& plan, const std::string& from = "");

  // Counters over all connections, for tests.
  struct Counters {
    uint64_t delivered = 0, dropped = 0, duplicated = 0, reordered = 0, corrupted = 0,
             disconnected = 0;
  };
  Counters counters() const;

  struct Impl;  // defined in loopback.cc

 private:
  friend Result<std::unique_ptr<Transport>> create_loopback_transport(const TransportOptions&,
                                                                      Handler*);
  std::shared_ptr<Impl> impl_;
};

}  // namespace psld::transport
