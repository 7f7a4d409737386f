// Small helpers of the verbs backend: errno text, device errors as Status, random ids.
#include "transports/verbs/core.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace psld::transport::verbs_detail {

std::string errno_text(int err) {
  return fmt::format("{} ({})", std::strerror(err), err);
}

Status device_error(std::string_view what, int err) {
  if (err == ENOMEM || err == EAGAIN) {
    return ResourceExhausted(
        fmt::format("{}: {} (pinned memory limit? see ulimit -l)", what, errno_text(err)));
  }
  return FailedPrecondition(fmt::format("{}: {}", what, errno_text(err)));
}

}  // namespace psld::transport::verbs_detail
