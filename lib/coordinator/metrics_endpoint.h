// lib/coordinator/metrics_endpoint.h — the coordinator's read-only HTTP
// endpoint (metrics.listen, docs/operations.md): GET /metrics (Prometheus
// text), /status.json (what `psld top` shows) and / (an index).
//
// One thread, poll(2) over at most kMaxConnections connections; a request
// has kDeadline from its connection to be answered, its head at most
// kMaxRequestBytes; every connection is closed after one answer. A
// connection over the cap is closed at once and counted. Sockets are
// close-on-exec (`psld launch`'s children inherit none). Nothing a client
// sends can block the job: the thread only reads the view the coordinator
// copies for it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "psld/status.h"

namespace psld {

class MetricsEndpoint {
 public:
  static constexpr size_t kMaxConnections = 16;
  static constexpr size_t kMaxRequestBytes = 8192;
  static constexpr std::chrono::seconds kDeadline{2};

  struct Page {
    std::string content_type;
    std::string body;
  };
  // Called on the endpoint's thread for each GET of a known path.
  using Source = std::function<Page(const std::string& path)>;

  // Listens on `listen` ("host:port", port 0: any; IPv6 in brackets).
  // Paths other than those `paths` names are answered 404.
  static Result<std::unique_ptr<MetricsEndpoint>> start(const std::string& listen,
                                                        std::vector<std::string> paths,
                                                        Source source);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // "host:port" with the real port (IPv6 in brackets).
  const std::string& address() const { return address_; }
  uint64_t served() const { return served_.load(); }
  uint64_t refused() const { return refused_.load(); }

 private:
  MetricsEndpoint() = default;
  void run();

  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: stop
  std::string address_;
  std::vector<std::string> paths_;
  Source source_;
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> refused_{0};
  std::thread thread_;
};

}  // namespace psld
