#include "transports/transport.h"

#include <fmt/format.h>

#include "transports/backends.h"

// Core code asks for a backend by name; which ones this build has is the
// generated registry's (transports/backends.h), not the preprocessor's.

namespace psld::transport {

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
  std::vector<std::string> names;
  for (const BackendFactory& b : built_backends())
    names.emplace_back(b.name);
  return names;
}

Result<std::unique_ptr<Transport>> create_transport(std::string_view name,
                                                    const TransportOptions& options,
                                                    Handler* handler) {
  if (handler == nullptr) return InvalidArgument("create_transport needs a Handler");
  for (const BackendFactory& b : built_backends()) {
    if (b.name == name) return b.create(options, handler);
  }
  return NotFound(fmt::format("no transport named '{}' in this build; available: {}", name,
                              fmt::join(available_transports(), ", ")));
}

}  // namespace psld::transport
