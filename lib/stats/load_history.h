// LoadHistory: the coordinator's bounded memory of recent load (docs/design.md §5).
//
// Every LoadReport from a server or worker lands here: per server a ring of
// its last windows, per server a ring of what workers saw of it, per arc a
// ring of its last windows. Memory is bounded whatever the job length: rings
// have fixed lengths and arcs beyond `max_arcs` (old epochs' arcs that no
// report mentions any more) are evicted, least recently reported first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>

#include "lib/protocol/protocol.h"

namespace psld {

struct ServerLoadWindow {
  uint64_t window = 0;  // the server's window sequence number
  uint64_t epoch = 0;
  uint64_t window_ns = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t busy_ns = 0;  // occupied wall time
  uint64_t queue_p50_ns = 0;
  uint64_t queue_p99_ns = 0;
  uint64_t rounds = 0;
  uint64_t lost_samples = 0;
};

// One worker's window of what it saw of one server.
struct WorkerViewWindow {
  uint32_t worker = 0;
  uint64_t window = 0;
  uint64_t window_ns = 0;
  protocol::PeerLoad peer;
};

struct ArcLoadWindow {
  uint64_t window = 0;  // of the reporting server
  uint64_t epoch = 0;
  uint32_t server = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t busy_ns = 0;
  uint32_t requests = 0;
};

class LoadHistory {
 public:
  struct Options {
    size_t server_windows = 64;  // per server; and per server for the workers' views
    size_t arc_windows = 8;      // per arc
    size_t max_arcs = size_t{1} << 20;
  };

  LoadHistory() : LoadHistory(Options{}) {}
  explicit LoadHistory(Options options);

  // Takes one part of a report. The window's totals are kept once (from part
  // 0); every part's entries are kept.
  void ingest(const protocol::LoadReport& report);

  // nullptr when nothing was reported yet.
  const std::deque<ServerLoadWindow>* server(uint32_t rank) const;
  const std::deque<WorkerViewWindow>* seen_by_workers(uint32_t server) const;
  // By the arc's first hash.
  const std::map<uint64_t, std::deque<ArcLoadWindow>>& arcs() const { return arcs_; }

  uint64_t reports() const { return reports_; }
  // Windows held, all rings together: bounded by the options.
  size_t entries() const;

 private:
  void evict_arcs();

  Options options_;
  uint64_t reports_ = 0;
  std::map<uint32_t, std::deque<ServerLoadWindow>> servers_;
  std::map<uint32_t, std::deque<WorkerViewWindow>> views_;
  std::map<uint64_t, std::deque<ArcLoadWindow>> arcs_;
  std::map<uint64_t, uint64_t> arc_touched_;  // arc -> report count when last reported
};

}  // namespace psld
