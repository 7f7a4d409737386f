// The emulated link: a wrapper around any backend that limits its bandwidth
// with token buckets and adds latency, so that a test or benchmark can make
// one server a bandwidth straggler on a single machine (docs/design.md §4).
//
// Egress (writes and messages this transport sends) is shaped before the
// operation is handed to the inner transport. Ingress (writes and messages
// arriving) is shaped by holding back their notification: the bytes may
// already sit in memory, but the application learns of them no earlier than
// a link of that capacity would have delivered them, which is what a slow
// NIC looks like from above.
#pragma once

#include <chrono>
#include <memory>
#include <string_view>

#include "base/clock.h"
#include "psld/status.h"
#include "transports/transport.h"

namespace psld::transport {

struct LinkOptions {
  double egress_bytes_per_second = 0;    // 0: unlimited
  double ingress_bytes_per_second = 0;   // 0: unlimited
  std::chrono::microseconds latency{0};  // one way, added to everything sent
  // Bytes that may pass at full speed after an idle period. 64 KiB is a few
  // socket buffers' worth; a larger burst hides the limit on short runs.
  uint64_t burst_bytes = 64 * 1024;
  // Each operation also costs this many bytes of wire overhead (headers).
  uint64_t per_op_overhead_bytes = 64;
};

// InvalidArgument names the bad field (negative rates, zero burst).
Status validate_link_options(const LinkOptions& link);

// Creates the `inner` backend wrapped in an emulated link. The wrapper's
// name() is "<inner>+link". The link's buckets and latency run on `time`
// (a ManualClock in tests); the inner backend keeps the steady clock.
Result<std::unique_ptr<Transport>> create_emulated_link(std::string_view inner,
                                                        const TransportOptions& options,
                                                        const LinkOptions& link, Handler* handler,
                                                        TimeSource time = {});

// Changes the link of a transport made by create_emulated_link while it runs
// (a straggler that appears at round 200). InvalidArgument for any other
// transport.
Status set_link(Transport& transport, const LinkOptions& link);
LinkOptions get_link(const Transport& transport);

}  // namespace psld::transport
