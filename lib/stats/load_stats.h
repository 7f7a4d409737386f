// Load statistics on the data path (docs/design.md §5): what servers and workers
// measure, and how one window of it becomes the LoadReport sent to the
// coordinator.
//
// Data-path threads record samples into a LoadRing (wait-free, never
// allocates); the member's report thread closes a window every stats
// interval: it drains the ring, sums the samples per subject (an arc's first
// hash on a server, a server id on a worker) and splits the result into
// LoadReports that each fit a control message.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "lib/protocol/protocol.h"
#include "lib/stats/load_ring.h"

namespace psld {

enum class LoadMetric : uint32_t {
  // Servers; the subject is the first hash of the key's arc.
  kBytesIn = 1,   // a push's bytes landed
  kBytesOut = 2,  // a pull's bytes written
  kBusyNs = 3,    // reduce or update time (CPU)
  kQueueNs = 4,   // a request's wait from arrival to processing (one per request)
  kRound = 5,     // a round (or an async update) applied
  // Workers; the subject is the server.
  kPushedBytes = 6,  // bytes pushed to the server
  kAnswerNs = 7,     // one chunk's time from issue to answer
  // Servers, several of the above in one sample (one ring push and one sum
  // instead of two or three, for every chunk):
  kPushTaken = 8,  // kBytesIn (`aux`) and kQueueNs (`value`) of one push
  kApplied = 9,    // kRound and kBusyNs (`value`: the round's reduces and its update)
};

struct StatSample {
  uint64_t subject = 0;
  uint32_t metric = 0;
  uint32_t aux = 0;  // kPushTaken: the push's bytes
  double value = 0;
};

// What a worker's report says about servers, at any job size (docs/scale.md):
// every server it answered from while the job's workers x servers stay
// within kPeerEntriesPerWindow entries a window at the coordinator, else
// kPeerEntriesPerWindow / workers servers each (at least 4); `configured`
// (stats.worker_peers) when not 0.
inline constexpr size_t kPeerEntriesPerWindow = 65536;
size_t worker_peer_limit(size_t configured, size_t workers, size_t servers);

// Cuts a worker's window of peers (sorted by server) to at most `limit`
// entries: the one with the longest mean answer time, and the limit - 1
// from position ((rank + window) x (limit - 1)) mod size on. In each window the
// job's workers then name every server about equally often, and each
// worker names every server in turn. Sorted by server again.
void sample_peers(std::vector<protocol::PeerLoad>& peers, size_t limit, uint32_t rank,
                  uint64_t window);
// The positions, ascending, that sample_peers keeps of `n` peers whose
// slowest is at `slowest` (all of them when n <= limit or limit is 0).
void sampled_positions(size_t n, size_t limit, uint32_t rank, uint64_t window, size_t slowest,
                       std::vector<size_t>& out);

// A window's report cut into parts of at most protocol::kMaxLoadEntries
// entries, arcs first, then peers; the totals (and `total`'s own entries,
// which should be empty) are in every part.
std::vector<protocol::LoadReport> split_report(const protocol::LoadReport& total,
                                               std::span<const protocol::ArcLoad> arcs,
                                               std::span<const protocol::PeerLoad> peers);

class LoadRecorder {
 public:
  // 65,536 samples (1.5 MiB): several windows of traffic at full speed.
  static constexpr size_t kDefaultCapacity = size_t{1} << 16;

  // `time` measures occupancy (a ManualClock in tests).
  static Result<std::unique_ptr<LoadRecorder>> make(Role role, size_t capacity = kDefaultCapacity,
                                                    TimeSource time = {});

  // Any thread, wait-free.
  void record(uint64_t subject, LoadMetric metric, double value) {
    ring_->push(StatSample{subject, static_cast<uint32_t>(metric), 0, value});
  }
  // A push of `bytes` taken from the queue after `queue_ns` there (servers).
  void record_push(uint64_t subject, uint64_t bytes, double queue_ns) {
    if (bytes > UINT32_MAX) [[unlikely]] {  // chunks are at most 1 GiB (data.chunk_bytes)
      record(subject, LoadMetric::kBytesIn, static_cast<double>(bytes));
      record(subject, LoadMetric::kQueueNs, queue_ns);
      return;
    }
    ring_->push(StatSample{subject, static_cast<uint32_t>(LoadMetric::kPushTaken),
                           static_cast<uint32_t>(bytes), queue_ns});
  }
  // A round applied, `busy_ns` of reducing and updating it (servers).
  void record_round(uint64_t subject, double busy_ns) {
    ring_->push(StatSample{subject, static_cast<uint32_t>(LoadMetric::kApplied), 0, busy_ns});
  }

  // Occupancy (servers): the wall time with at least one request in service
  // (a push from its arrival until it is reduced or parked for a later round,
  // a pull from its write until the write completed). A server waiting for
  // slower workers is not occupied; a server behind a slow link or a busy CPU
  // is. bytes / occupied time is the rate the balancer predicts from.
  // `n` requests begin (end) at once: a batch's pushes, a pass of a server's
  // shard loop.
  void begin_service(uint64_t n = 1);
  void end_service(uint64_t n = 1);

  // One consumer. Drains the ring and returns the window's reports: at least
  // one (an idle window is reported too, so "no traffic" is a measurement),
  // entries sorted by subject and split kMaxLoadEntries per part.
  std::vector<protocol::LoadReport> close_window(uint32_t rank, uint64_t epoch, uint64_t window_ns);

  uint64_t windows() const { return window_; }

  // Workers: at most this many peers a report (sample_peers); 0: all. Before
  // the first close_window().
  void set_peer_limit(size_t limit) { peer_limit_ = limit; }

 private:
  LoadRecorder(Role role, std::unique_ptr<LoadRing<StatSample>> ring, TimeSource time);

  const Role role_;
  const TimeSource time_;
  std::unique_ptr<LoadRing<StatSample>> ring_;
  Mutex busy_mu_;
  uint64_t in_service_ GUARDED_BY(busy_mu_) = 0;
  std::chrono::steady_clock::time_point busy_since_ GUARDED_BY(busy_mu_);
  uint64_t busy_ns_ GUARDED_BY(busy_mu_) = 0;
  uint64_t window_ = 0;
  size_t peer_limit_ = 0;
  uint64_t lost_seen_ = 0;
  size_t arcs_seen_ = 0;  // in the last window: the next one's hash table is made that big
  WindowStats queue_;
  // Per server (workers): answer latencies of the window. Bounded by the
  // number of servers.
  std::map<uint64_t, WindowStats> answers_;
};

}  // namespace psld
