// Small helpers of the verbs backend: errno text, device errors as Status, random ids.
#include "transports/verbs/core.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace psld::transport::verbs_detail {

std::string errno_text(int err) {
  return fmt::format("{} ({})", std::strerror(err), err);
}

uint64_t random_nonzero_u64() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0)
    v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v;
}

Status device_error(std::string_view what, int err) {
  if (err == ENOMEM || err == EAGAIN) {
    return ResourceExhausted(
        fmt::format("{}: {} (pinned memory limit? see ulimit -l)", what, errno_text(err)));
  }
  return FailedPrecondition(fmt::format("{}: {}", what, errno_text(err)));
}

}  // namespace psld::transport::verbs_detail
