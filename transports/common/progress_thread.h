// ProgressThread: drives a transport's progress() on a thread of its own and
// sleeps in wait() when there is nothing to do, so an idle transport costs no
// CPU. The transport's completions and handler calls then run on this thread.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "transports/transport.h"

namespace psld::transport {

class ProgressThread {
 public:
  // idle_wait bounds one sleep; wake() or any event ends it sooner.
  explicit ProgressThread(Transport& transport,
                          std::chrono::milliseconds idle_wait = std::chrono::milliseconds(100))
      : transport_(transport), idle_wait_(idle_wait), thread_([this] { run(); }) {}
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
  void run() {
    while (!stop_.load(std::memory_order_acquire)) {
      if (transport_.progress() == 0) transport_.wait(idle_wait_);
    }
  }

  Transport& transport_;
  const std::chrono::milliseconds idle_wait_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts after the other members exist
};

}  // namespace psld::transport
