// psld/server.h — a parameter server, standalone (`psld server`) or
// embedded in any process.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "psld/config.h"
#include "psld/status.h"

namespace psld {

class ServerService;

class Server {
 public:
  // Listens on config.job.listen, joins the job and waits for it to start
  // (up to liveness.connect_timeout_ms). Serves on its own threads.
  static Result<std::unique_ptr<Server>> start(const Config& config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint32_t rank() const;
  // Where workers reach this server (a transport address, as text).
  std::string address() const;
  // Blocks until the coordinator ends the job (Ok), the job fails (the
  // reason) or the timeout passes (Timeout).
  Status wait(std::chrono::milliseconds timeout = std::chrono::hours(24 * 365));
  // Stops serving; idempotent; the destructor calls it.
  void shutdown();

 private:
  explicit Server(std::unique_ptr<ServerService> impl);
  std::unique_ptr<ServerService> impl_;
};

}  // namespace psld
