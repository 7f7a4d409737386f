// The "verbs" transport: libibverbs RC queue pairs on InfiniBand or RoCE.
//
// Writes are one RDMA WRITE_WITH_IMM each (the immediate carries the notify
// value, and its receive completion tells the peer that every byte landed);
// control messages are RDMA SENDs from a registered bounce pool into a shared
// receive queue. Queue pairs are set up over a TCP side channel that stays
// open to tell each side when the other one goes away. docs/transports.md
// ("verbs") explains the design; transports/transport.h states the contract.
//
// create_verbs_transport answers Unavailable("no RDMA device: ...") on a
// machine without an RDMA device, and InvalidArgument for bad options before
// it looks for one.
#pragma once

#include <memory>

#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

Result<std::unique_ptr<Transport>> create_verbs_transport(const TransportOptions& options,
                                                          Handler* handler);

}  // namespace psld::transport
