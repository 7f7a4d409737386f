#include "transports/transport.h"

#include <fmt/format.h>

#include "transports/loopback/loopback.h"
#if PSLD_HAVE_UCX
#include "transports/ucx/ucx_transport.h"
#endif
#if PSLD_HAVE_VERBS
#include "transports/verbs/verbs_transport.h"
#endif

// The only place that knows which backends were compiled in; core code asks
// by name (docs/design.md §4: never #ifdef outside transports/).

namespace psld::transport {

std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

MemorySupport Transport::memory_support(MemoryKind kind) const {
  if (kind == MemoryKind::kHost) return {true, "host memory"};
  return {false,
          fmt::format("the {} transport registers host memory only; psld stages {} "
                      "tensors through host memory",
                      name(), kind == MemoryKind::kCuda ? "device" : memory_kind_name(kind))};
}

Status Connection::foreign_source() {
  return InvalidArgument("write source is not a region registered with this transport");
}

Status Connection::foreign_target() {
  return InvalidArgument("write target was not imported on this connection");
}

Status Connection::request_error(const WriteRequest& r) const {
  if (r.local == nullptr || r.local->backend() != region_tag_) return foreign_source();
  if (r.remote == nullptr || r.remote->backend() != remote_tag_) return foreign_target();
  const uint64_t local = r.local->length(), remote = r.remote->length();
  if (r.local_offset > local || r.length > local - r.local_offset) {
    return OutOfRange(
        fmt::format("write of {} bytes at offset {} exceeds the {}-byte source region", r.length,
                    r.local_offset, local));
  }
  if (r.remote_offset > remote || r.length > remote - r.remote_offset) {
    return OutOfRange(
        fmt::format("write of {} bytes at offset {} exceeds the {}-byte remote region", r.length,
                    r.remote_offset, remote));
  }
  return Status::Ok();
}

std::vector<std::string> available_transports() {
  std::vector<std::string> names{"loopback"};
#if PSLD_HAVE_UCX
  names.emplace_back("ucx");
#endif
#if PSLD_HAVE_VERBS
  names.emplace_back("verbs");
#endif
  return names;
}

Result<std::unique_ptr<Transport>> create_transport(std::string_view name,
                                                    const TransportOptions& options,
                                                    Handler* handler) {
  if (handler == nullptr) return InvalidArgument("create_transport needs a Handler");
  if (name == "loopback") return create_loopback_transport(options, handler);
#if PSLD_HAVE_UCX
  if (name == "ucx") return create_ucx_transport(options, handler);
#endif
#if PSLD_HAVE_VERBS
  if (name == "verbs") return create_verbs_transport(options, handler);
#endif
  return NotFound(fmt::format("no transport named '{}' in this build; available: {}", name,
                              fmt::join(available_transports(), ", ")));
}

}  // namespace psld::transport
