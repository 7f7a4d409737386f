// The UCX backend (docs/design.md §4): UCP active messages and RMA over whatever
// UCX finds (InfiniBand/RoCE, shared memory, TCP).
//
// One ucp_context and one ucp_worker per Transport, so several transports
// live in one process. Peers connect by socket address (ucp_listener /
// ucp_ep_create with a sockaddr) with peer error handling, so a dead peer
// fails pending operations with Unavailable and raises on_disconnect.
//
// Writes keep the one-sided contract through the fastest primitive UCX has on
// the connection, chosen once its lanes are known and logged at info level:
//
//   "put": the bytes go straight into the peer's region, then a small active
//          message carries the notification. Over shared memory, into a
//          region the peer made with allocate_memory, the put is a memcpy into
//          the peer's segment (mapped through ucp_rkey_ptr); over RDMA it is
//          ucp_put_nbx then ucp_ep_flush_nbx, one flush covering every put
//          issued before it.
//   "am":  an active message whose header names the target (region id,
//          secret, offset) and whose payload UCX moves eagerly or by
//          rendezvous straight into the target region. Used where UCX only
//          emulates put (tcp in UCX 1.13: ucp_put_bw ran at 0.16-1.4 GiB/s at
//          1 MiB on our test machine against 8.7-9.0 GiB/s for active
//          messages, and stalled at 16 MiB), and for heap regions of a
//          shared-memory peer, which UCX cannot map.
//
// UcxOptions.write_path forces one ("put" or "am"); Connection::write_path()
// says which the connection uses. docs/transport-results.md has the figures.
//
// Notifications of "put" writes into a local peer's mapped memory go through
// a notification ring where the peer offered one (UcxOptions::
// notify_ring_slots): shared memory the receiver allocated and polls in
// progress(), so a notification is a memory write, not an active message.
// Every notification and message carries a per-connection sequence number,
// so ring records, active-message fallbacks (ring full) and messages reach
// the handler in the order they were issued. docs/transports.md ("ucx") has
// the protocol.
//
// This header has no UCX types, so tests and tools may include it in any
// build that has the backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

Result<std::unique_ptr<Transport>> create_ucx_transport(const TransportOptions& options,
                                                        Handler* handler);

// What UCX offers here (psld doctor): its version, and every transport/device
// pair its components report ("tcp/eth0", "rc_mlx5/mlx5_0:1", "posix/memory",
// "cuda_copy/cuda"), as `ucx_info -d` lists them; `problems` names memory
// domains that would not open.
struct UcxInventory {
  std::string version;
  std::vector<std::string> transports;
  std::vector<std::string> problems;
};
Result<UcxInventory> ucx_inventory();

// What a UCX transport counted since it was created; for tests and
// diagnostics.
struct UcxCounters {
  uint64_t writes_put = 0;         // writes started on the put path
  uint64_t writes_am = 0;          // writes started on the active-message path
  uint64_t flushes = 0;            // ucp_ep_flush_nbx calls (one covers many puts)
  uint64_t rejected_writes = 0;    // incoming writes or notifications that failed validation
  uint64_t rejected_messages = 0;  // other malformed incoming active messages
  // Notifications of shared-memory writes that went through the peer's
  // notification ring, and those that fell back to an active message because
  // the ring was full.
  uint64_t notify_ring = 0;
  uint64_t notify_ring_full = 0;
  uint64_t ring_wakeups = 0;  // active messages sent to wake a receiver asleep in wait()
  // Bootstrap connections turned away: a wrong secret, garbage, a flood beyond
  // the cap of connections being set up, or silence until the deadline.
  uint64_t refused_connections = 0;
};

// InvalidArgument when `transport` is not a UCX transport.
Result<UcxCounters> ucx_counters(const Transport& transport);

}  // namespace psld::transport
