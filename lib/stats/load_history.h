// LoadHistory: the coordinator's bounded memory of recent load (docs/design.md §5).
//
// Every LoadReport from a server or worker lands here: per server a ring of
// its last windows, per server a ring of what workers saw of it, per arc its
// load since the balancer last took it and its totals. Memory is bounded
// whatever the job length: rings have fixed lengths and arcs beyond
// `max_arcs` (old epochs' arcs that no report mentions any more) are
// evicted, least recently reported first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <utility>
#include <vector>

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

// One arc's load as the coordinator keeps it: what its owner reported since
// the balancer last took it (BalanceFeed, once a decision), and its totals in
// its newest epoch. A report of a newer epoch starts the record again; one of
// an older epoch (a late part from the previous owner) is ignored.
struct ArcLoadRecord {
  uint64_t lo = 0;  // the arc's first hash
  uint64_t epoch = 0;
  uint64_t window = 0;  // the newest window reported, of `server`
  uint32_t server = 0;
  uint32_t windows = 0;  // windows since the last take
  // Since the last take.
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t busy_ns = 0;
  uint32_t requests = 0;
  // Every window of `epoch`.
  uint64_t total_in = 0;
  uint64_t total_out = 0;
  uint64_t touched = 0;  // report count when last reported (eviction)
};

class LoadHistory {
 public:
  struct Options {
    size_t server_windows = 64;  // per server; and per server for the workers' views
    size_t max_arcs = size_t{1} << 21;
  };

  LoadHistory() : LoadHistory(Options{}) {}
  explicit LoadHistory(Options options);

  // Takes one part of a report. The window's totals are kept once (from part
  // 0); every part's entries are kept. Costs one hash lookup per arc and one
  // ring push per peer (bench/ingest_bench.cc, docs/scale.md).
  void ingest(const protocol::LoadReport& report);

  // nullptr when nothing was reported yet.
  const std::deque<ServerLoadWindow>* server(uint32_t rank) const;
  const std::deque<WorkerViewWindow>* seen_by_workers(uint32_t server) const;

  // By the arc's first hash; nullptr when not held.
  const ArcLoadRecord* arc(uint64_t lo) const;
  size_t num_arcs() const { return arcs_.size(); }
  // Memory the arcs take: 96 bytes a record (and the vector's spare room),
  // 8-16 bytes of index.
  size_t arc_bytes() const {
    return arcs_.capacity() * sizeof(ArcLoadRecord) + index_.size() * sizeof(uint32_t);
  }
  // Every arc held: in the order of lo after a take, new ones at the end.
  std::span<const ArcLoadRecord> arcs() const { return arcs_; }
  // Calls `fn` for every arc of `epoch` with load since the previous take,
  // in the order of `lo`, then clears every arc's since-the-take load (those
  // of other epochs too: they are no evidence about `epoch`).
  template <typename Fn>
  void take_arcs(uint64_t epoch, Fn&& fn) {
    sort_arcs();
    for (ArcLoadRecord& a : arcs_) {
      if (a.windows > 0 && a.epoch == epoch) fn(std::as_const(a));
      a.windows = 0;
      a.bytes_in = a.bytes_out = a.busy_ns = 0;
      a.requests = 0;
    }
  }

  uint64_t reports() const { return reports_; }
  // Windows held in the rings, plus one per arc: bounded by the options.
  size_t entries() const;

 private:
  ArcLoadRecord* find_or_add(uint64_t lo);
  size_t slot_of(uint64_t lo) const;
  void rebuild_index();
  void evict_arcs();
  // Merges the arcs added since the last call into the sorted ones. Once a
  // placement settles no arc is new and this costs nothing.
  void sort_arcs();

  Options options_;
  uint64_t reports_ = 0;
  std::map<uint32_t, std::deque<ServerLoadWindow>> servers_;
  std::map<uint32_t, std::deque<WorkerViewWindow>> views_;
  // Arcs, dense, and an open-addressing index of them by `lo` (linear
  // probing, at most half full; kEmpty marks a free slot). A std::map of
  // rings per arc took 2.8 us an arc at 1,000,448 arcs, and about 1 GB.
  static constexpr uint32_t kEmpty = ~uint32_t{0};
  std::vector<ArcLoadRecord> arcs_;  // [0, sorted_) in the order of lo
  size_t sorted_ = 0;
  std::vector<uint32_t> index_;
  int index_shift_ = 64;
};

}  // namespace psld
