#include "lib/runtime/runtime.h"

#include "base/log.h"

namespace psld {

ProcessRuntime::~ProcessRuntime() {
  stop();
}

Status ProcessRuntime::start(NetOptions options, const std::string& job_secret) {
  options.options.common.secret = job_secret;
  Result<std::unique_ptr<transport::Transport>> t =
      options.emulate_link
          ? transport::create_emulated_link(options.transport, options.options, options.link, this)
          : transport::create_transport(options.transport, options.options, this);
  if (!t.ok()) return t.status().with_context("creating the '" + options.transport + "' transport");
  transport_ = std::move(t).value();
  PSLD_ASSIGN_OR_RETURN(progress_, transport::ProgressThread::start(*transport_));
  return Status::Ok();
}

void ProcessRuntime::stop() {
  if (progress_) progress_->stop();
  if (transport_) transport_->shutdown();
}

std::string ProcessRuntime::address() const {
  if (!transport_) return {};
  auto blob = transport_->address();
  return std::string(blob.begin(), blob.end());
}

Status ProcessRuntime::send(const transport::ConnectionPtr& conn,
                            const protocol::Message& message) {
  if (!conn) return Unavailable("no connection");
  // Encoded into this thread's buffer, which keeps its capacity: send()
  // copies the bytes before it returns. A send from inside a send on this
  // thread (a transport running a callback) gets a buffer of its own.
  thread_local std::vector<uint8_t> buffer;
  thread_local bool in_use = false;
  if (in_use) return conn->send(protocol::encode(message), nullptr);
  in_use = true;
  protocol::encode_to(message, buffer);
  Status st = conn->send(buffer, nullptr);
  in_use = false;
  return st;
}

void ProcessRuntime::on_message(const transport::ConnectionPtr& conn,
                                std::span<const uint8_t> bytes) {
  Result<protocol::Message> m = protocol::decode(bytes);
  if (!m.ok()) {
    malformed_.fetch_add(1);
    on_malformed(conn, m.status());
    return;
  }
  received_.fetch_add(1, std::memory_order_relaxed);
  on_control(conn, std::move(m).value());
}

void ProcessRuntime::on_malformed(const transport::ConnectionPtr& conn, const Status& why) {
  PSLD_LOG_WARN("dropped a malformed message from {}: {}", conn->peer(), why.to_string());
}

Result<transport::ConnectionPtr> connect_text(transport::Transport& t, const std::string& address) {
  return t.connect({reinterpret_cast<const uint8_t*>(address.data()), address.size()});
}

}  // namespace psld
