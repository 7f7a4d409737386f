// lib/stats/trace.h — Chrome traces (trace.dir, trace.rounds; docs/operations.md,
// "Traces"): what one process did during a range of rounds, as the JSON
// trace-event format that Perfetto and chrome://tracing open.
//
// Events are kept in memory (at most max_events; the rest are counted as
// dropped) and written once, to DIR/psld-<role><rank>-<pid>.json, when the
// process first sees a round past the range or when it stops, whichever
// comes first; the file appears whole (written aside, then renamed).
//
// Kinds used:
//   complete spans ('X') on the recording thread: a server's reduce and
//     update of a key, a migration's shipping;
//   async spans ('b'/'e', nested by id) for things that overlap on one
//     thread: a worker's chunk and, inside it, its push, wait and pull;
//   instants ('i'): epoch switches, balancer steps.
// Timestamps are microseconds of the monotonic clock, which every process
// of a host shares, so the files of one host line up in one view.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/mutex.h"
#include "psld/status.h"

namespace psld {

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    std::string dir;
    uint64_t first_round = 1;
    uint64_t last_round = 10;
    size_t max_events = size_t{1} << 20;
  };

  // nullptr when options.dir is empty (tracing off). `role` and `rank`
  // ("worker", 3; -1: none) name the process in the trace and the file.
  static std::unique_ptr<TraceRecorder> make(const Options& options, std::string_view role,
                                             int64_t rank);
  ~TraceRecorder();

  // Whether events of `round` are recorded. A round past the range writes
  // the file (once) and returns false.
  bool wants(uint64_t round);

  // `args` is a JSON object's body without braces ("\"key\":3,\"round\":7"),
  // or empty; json_string() quotes a string for it.
  void complete(std::string_view name, std::string_view cat, Clock::time_point start,
                Clock::time_point end, const std::string& args = "") EXCLUDES(mu_);
  void async_begin(std::string_view name, std::string_view cat, uint64_t id, Clock::time_point at,
                   const std::string& args = "") EXCLUDES(mu_);
  void async_end(std::string_view name, std::string_view cat, uint64_t id, Clock::time_point at)
      EXCLUDES(mu_);
  void instant(std::string_view name, std::string_view cat, Clock::time_point at,
               const std::string& args = "") EXCLUDES(mu_);

  // Writes the file now (idempotent: later events are not recorded).
  Status write() EXCLUDES(mu_);
  // The file written, "" before.
  std::string path() const EXCLUDES(mu_);
  uint64_t dropped() const { return dropped_.load(); }

 private:
  TraceRecorder(Options options, std::string_view role, int64_t rank)
      : options_(std::move(options)), role_(role), rank_(rank) {}
  void add(std::string event) EXCLUDES(mu_);

  const Options options_;
  const std::string role_;
  const int64_t rank_;
  mutable Mutex mu_;
  std::vector<std::string> events_ GUARDED_BY(mu_);  // each one JSON object
  std::string path_ GUARDED_BY(mu_);
  std::atomic<bool> done_{false};
  std::atomic<uint64_t> dropped_{0};
};

// A JSON string literal of `s`, quotes included.
std::string json_string(std::string_view s);

}  // namespace psld
