// ProgressThread: drives a transport's progress() on a thread of its own and
// sleeps in wait() when there is nothing to do, so an idle transport costs no
// CPU. The transport's completions and handler calls then run on this thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "base/thread.h"
#include "transports/transport.h"

namespace psld::transport {

class ProgressThread {
 public:
  // idle_wait bounds one sleep; wake() or any event ends it sooner.
  static Result<std::unique_ptr<ProgressThread>> start(
      Transport& transport, std::chrono::milliseconds idle_wait = std::chrono::milliseconds(100)) {
    std::unique_ptr<ProgressThread> p(new ProgressThread(transport, idle_wait));
    PSLD_RETURN_IF_ERROR(
        start_thread(p->thread_, "transport progress", [raw = p.get()] { raw->run(); }));
    return p;
  }
  ~ProgressThread() { stop(); }
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Stops and joins; idempotent. Call before the transport is destroyed.
  void stop() {
    if (stop_.exchange(true)) return;
    transport_.wake();
    if (thread_.joinable()) thread_.join();
  }

  std::thread::id id() const { return thread_.get_id(); }
  // For measuring the thread (its CPU clock, say).
  std::thread::native_handle_type native_handle() { return thread_.native_handle(); }

 private:
  ProgressThread(Transport& transport, std::chrono::milliseconds idle_wait)
      : transport_(transport), idle_wait_(idle_wait) {}
  void run() {
    while (!stop_.load(std::memory_order_acquire)) {
      if (transport_.progress() == 0) transport_.wait(idle_wait_);
    }
  }

  Transport& transport_;
  const std::chrono::milliseconds idle_wait_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace psld::transport
