// bench/bench_util.h — what the in-process benchmarks (ps_bench, stragglers)
// share: a watchdog so that a stuck phase never hangs a run, running a
// function on threads, and UCX's environment.
#pragma once

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "psld/status.h"

namespace psld::bench {

// Ends the process with a message when the phase it watches overruns: a
// stuck transfer or shutdown must not leave a CI job waiting forever.
class Watchdog {
 public:
  explicit Watchdog(std::string program)
      : program_(std::move(program)), thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches a new phase: `what` must end (the next arm() or disarm()) within `limit`.
  void arm(std::chrono::milliseconds limit, std::string what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      deadline_ = std::chrono::steady_clock::now() + limit;
      limit_ = limit;
      what_ = std::move(what);
    }
    cv_.notify_all();
  }
  void disarm() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      deadline_.reset();
    }
    cv_.notify_all();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (deadline_ && std::chrono::steady_clock::now() >= *deadline_) {
        std::fprintf(stderr, "%s: %s did not finish within %.0f s; giving up\n", program_.c_str(),
                     what_.c_str(), std::chrono::duration<double>(limit_).count());
        std::fflush(stderr);
        std::_Exit(3);
      }
      if (deadline_) {
        cv_.wait_until(lock, *deadline_);
      } else {
        cv_.wait(lock);
      }
    }
  }

  const std::string program_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::optional<std::chrono::steady_clock::time_point> deadline_;
  std::chrono::milliseconds limit_{0};
  std::string what_;
  std::thread thread_;  // last: it starts once the rest is built
};

// Runs fn(i) for i in [0, n) on n threads and returns the first error.
inline Status on_threads(uint32_t n, const std::function<Status(uint32_t)>& fn) {
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] { results[i] = fn(i); });
  }
  for (auto& t : threads)
    t.join();
  for (auto& s : results) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// Registration is explicit, so UCX's malloc hooks and memory events only
// cost time. UCX reads these when its libraries load, before main runs: this
// sets what the environment leaves unset and starts the program again (the
// environment still wins). Returns only when nothing was missing or the exec
// failed (then UCX keeps its defaults).
inline void reexec_with_ucx_defaults(char** argv) {
  const char* const kUcxEnv[][2] = {
      {"UCX_MEM_MALLOC_HOOKS", "no"}, {"UCX_MEM_EVENTS", "no"}, {"UCX_WARN_UNUSED_ENV_VARS", "n"}};
  bool missing = false;
  for (const auto& [name, value] : kUcxEnv) {
    if (std::getenv(name) == nullptr) {
      missing = true;
      setenv(name, value, 0);
    }
  }
  if (missing) execv("/proc/self/exe", argv);
}

}  // namespace psld::bench
