#include "lib/runtime/door.h"

#include "base/log.h"

namespace psld {

void Door::refuse(std::string_view who, const transport::ConnectionPtr& conn,
                  const std::string& why) {
  std::string host = conn->peer();
  const auto colon = host.rfind(':');
  if (colon != std::string::npos) host.resize(colon);
  MutexLock lock(mu_);
  ++refused_;
  to_close_.push_back(conn);
  // At most 1024 hosts remembered: memory stays bounded under a spoofed flood.
  if (hosts_.size() < 1024 && hosts_.insert(host).second) {
    PSLD_LOG_WARN(
        "{}: refused a connection from {}: {} (further ones from there are refused without a "
        "word; {} so far in all)",
        who, host, why, refused_);
  }
}

std::vector<transport::ConnectionPtr> Door::take_to_close() {
  MutexLock lock(mu_);
  std::vector<transport::ConnectionPtr> out;
  out.swap(to_close_);
  return out;
}

uint64_t Door::num_refused() const {
  MutexLock lock(mu_);
  return refused_;
}

}  // namespace psld
