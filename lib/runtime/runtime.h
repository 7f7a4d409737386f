// ProcessRuntime: one transport, its progress thread, and decoding of control
// messages, shared by the coordinator, servers and workers.
//
// Handler calls arrive on the progress thread; subclasses must keep them
// short (queue heavy work elsewhere: docs/design.md §4, the transport progress
// thread never reduces or updates).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "lib/protocol/protocol.h"
#include "psld/status.h"
#include "transports/common/progress_thread.h"
#include "transports/emulated_link/emulated_link.h"
#include "transports/transport.h"

namespace psld {

struct NetOptions {
  std::string transport = "ucx";
  transport::TransportOptions options;
  // Wrap the transport in an emulated link (straggler experiments).
  bool emulate_link = false;
  transport::LinkOptions link;
};

class ProcessRuntime : public transport::Handler {
 public:
  ~ProcessRuntime() override;

  // Creates the transport and starts its progress thread. Call once, from
  // the subclass's factory, after the subclass is fully constructed. The
  // job's secret is the transport's too (a backend with a bootstrap of its
  // own, ucx, refuses a peer that does not know it before any endpoint
  // exists), whatever options.options.common.secret says.
  Status start(NetOptions options, const std::string& job_secret);
  // Stops the progress thread and shuts the transport down; idempotent.
  void stop();

  transport::Transport& transport() { return *transport_; }
  std::string address() const;

  // Encodes and sends; Unavailable when the connection is gone.
  Status send(const transport::ConnectionPtr& conn, const protocol::Message& message);

  // Messages that failed to decode (each is also logged once).
  uint64_t malformed_messages() const { return malformed_.load(); }
  // Control messages received and decoded.
  uint64_t messages_received() const { return received_.load(std::memory_order_relaxed); }

 protected:
  // A decoded control message.
  virtual void on_control(const transport::ConnectionPtr& conn, protocol::Message&& message) = 0;
  // A message that did not decode: by default logged and counted; the
  // connection stays up (a peer's bug must not take the job down).
  virtual void on_malformed(const transport::ConnectionPtr& conn, const Status& why);

 private:
  void on_message(const transport::ConnectionPtr& conn, std::span<const uint8_t> message) final;

  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::ProgressThread> progress_;
  std::atomic<uint64_t> malformed_{0};
  std::atomic<uint64_t> received_{0};
};

// Connects to `address` (a transport address blob in text form).
Result<transport::ConnectionPtr> connect_text(transport::Transport& t, const std::string& address);

}  // namespace psld
