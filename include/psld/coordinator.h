// psld/coordinator.h — the job's control plane, standalone (`psld
// coordinator`) or embedded (worker 0 of an mpirun job, a test).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "psld/config.h"
#include "psld/status.h"

namespace psld {

class CoordinatorService;

class Coordinator {
 public:
  // Listens on config.job.coordinator and admits num_workers workers and
  // num_servers (+ num_standby) servers.
  static Result<std::unique_ptr<Coordinator>> start(const Config& config);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // The address members dial (config.job.coordinator with the real port).
  std::string address() const;
  // Where /metrics and /status.json are served (config.metrics.listen with
  // the real port; docs/operations.md); "" when metrics.listen is empty.
  std::string metrics_address() const;
  // Blocks until every worker finished (Ok), the job failed (Aborted with the
  // reason, naming the process) or the timeout passed (Timeout).
  Status wait(std::chrono::milliseconds timeout = std::chrono::hours(24 * 365));
  // Ends the job for everyone; idempotent; the destructor calls it.
  void shutdown();

 private:
  explicit Coordinator(std::unique_ptr<CoordinatorService> impl);
  std::unique_ptr<CoordinatorService> impl_;
};

}  // namespace psld
