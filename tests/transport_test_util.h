// Shared pieces of the transport tests: a recording Handler, a pump that
// drives several transports until a condition holds, and the list of backends
// every conformance test runs on.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transports/loopback/loopback.h"
#include "transports/transport.h"

namespace psld::transport::testing {

struct WriteEvent {
  uint64_t connection;
  uint32_t notify;
  uint64_t length;
};

class Recorder : public Handler {
 public:
  void on_accept(const ConnectionPtr& conn) override {
    std::lock_guard<std::mutex> lock(mu);
    accepted.push_back(conn);
  }
  void on_write(const ConnectionPtr& conn, uint32_t notify, uint64_t length) override {
    if (write_hook) write_hook(conn, notify, length);
    std::lock_guard<std::mutex> lock(mu);
    writes.push_back({conn->id(), notify, length});
  }
  void on_message(const ConnectionPtr& conn, std::span<const uint8_t> message) override {
    std::lock_guard<std::mutex> lock(mu);
    messages.emplace_back(conn->id(), std::vector<uint8_t>(message.begin(), message.end()));
    last_message_conn = conn;
  }
  void on_disconnect(const ConnectionPtr& conn, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu);
    disconnects.emplace_back(conn->id(), why);
  }

  size_t num_accepted() {
    std::lock_guard<std::mutex> lock(mu);
    return accepted.size();
  }
  size_t num_writes() {
    std::lock_guard<std::mutex> lock(mu);
    return writes.size();
  }
  size_t num_messages() {
    std::lock_guard<std::mutex> lock(mu);
    return messages.size();
  }
  size_t num_disconnects() {
    std::lock_guard<std::mutex> lock(mu);
    return disconnects.size();
  }

  std::mutex mu;
  std::vector<ConnectionPtr> accepted;
  std::vector<WriteEvent> writes;
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> messages;
  ConnectionPtr last_message_conn;
  std::vector<std::pair<uint64_t, Status>> disconnects;
  // Called on the progress thread before the write is recorded: the place to
  // check the landed bytes, proving they were visible at notification time.
  std::function<void(const ConnectionPtr&, uint32_t, uint64_t)> write_hook;
};

// Drives every transport until `done` holds or `timeout` passes.
inline bool pump(const std::vector<Transport*>& transports, const std::function<bool()>& done,
                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    size_t n = 0;
    for (Transport* t : transports)
      n += t->progress();
    if (n == 0) transports.front()->wait(std::chrono::milliseconds(1));
  }
  return true;
}

// Runs progress for a while regardless (to let anything that should not
// arrive have its chance).
inline void pump_for(const std::vector<Transport*>& transports, std::chrono::milliseconds d) {
  pump(
      transports, [] { return false; }, d);
}

// One backend configuration of the conformance suite.
struct Backend {
  std::string label;      // test-name suffix: loopback, ucx_tcp, ucx_shm, verbs
  std::string transport;  // create_transport() name
  std::string ucx_tls;
  bool link = false;  // wrap in an emulated link (unlimited) to test the wrapper too
};

inline void PrintTo(const Backend& b, std::ostream* os) {
  *os << b.label;
}

inline std::string backend_label(const ::testing::TestParamInfo<Backend>& info) {
  return info.param.label;
}

// Creates a transport for `b`, or skips the test with the reason (no RDMA
// device, backend not in this build).
std::unique_ptr<Transport> make_transport(const Backend& b, Handler* handler,
                                          const std::shared_ptr<LoopbackFabric>& fabric,
                                          std::chrono::milliseconds op_timeout,
                                          std::string* skip_reason);

// The backends this build has.
std::vector<Backend> conformance_backends();

}  // namespace psld::transport::testing
