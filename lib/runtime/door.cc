#include "lib/runtime/door.h"

#include <algorithm>

#include "base/log.h"

namespace psld {

void Door::refuse(std::string_view who, const transport::ConnectionPtr& conn,
                  const std::string& why) {
  std::string host = conn->peer();
  const auto colon = host.rfind(':');
  if (colon != std::string::npos) host.resize(colon);
  MutexLock lock(mu_);
  ++refused_;
  to_close_.emplace_back(conn, transport::Clock::now());
  // At most 1024 hosts remembered: memory stays bounded under a spoofed flood.
  if (hosts_.size() < 1024 && hosts_.insert(host).second) {
    PSLD_LOG_WARN(
        "{}: refused a connection from {}: {} (further ones from there are refused without a "
        "word; {} so far in all)",
        who, host, why, refused_);
  }
}

std::vector<transport::ConnectionPtr> Door::take_to_close() {
  const auto due = transport::Clock::now() - kCloseGrace;
  MutexLock lock(mu_);
  const auto first_due = std::stable_partition(to_close_.begin(), to_close_.end(),
                                               [&](const auto& e) { return e.second > due; });
  std::vector<transport::ConnectionPtr> out;
  for (auto it = first_due; it != to_close_.end(); ++it)
    out.push_back(std::move(it->first));
  to_close_.erase(first_due, to_close_.end());
  return out;
}

uint64_t Door::num_refused() const {
  MutexLock lock(mu_);
  return refused_;
}

}  // namespace psld
