#include "lib/stats/load_stats.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace psld {

namespace {
uint64_t as_u64(double v) {
  return v <= 0 ? 0 : static_cast<uint64_t>(std::llround(v));
}
}  // namespace

size_t worker_peer_limit(size_t configured, size_t workers, size_t servers) {
  if (configured > 0) return configured;
  if (workers == 0 || workers * servers <= kPeerEntriesPerWindow) return 0;  // all
  return std::max<size_t>(4, kPeerEntriesPerWindow / workers);
}

void sampled_positions(size_t n, size_t limit, uint32_t rank, uint64_t window, size_t slowest,
                       std::vector<size_t>& out) {
  out.clear();
  if (limit == 0 || n <= limit) {
    for (size_t i = 0; i < n; ++i)
      out.push_back(i);
    return;
  }
  out.push_back(slowest);
  const size_t turn = limit - 1;
  const auto from = static_cast<size_t>(((uint64_t{rank} + window) * turn) % n);
  for (size_t i = 0; i < turn; ++i) {
    const size_t at = (from + i) % n;
    if (at != slowest) out.push_back(at);
  }
  std::sort(out.begin(), out.end());
}

void sample_peers(std::vector<protocol::PeerLoad>& peers, size_t limit, uint32_t rank,
                  uint64_t window) {
  const size_t n = peers.size();
  if (limit == 0 || n <= limit) return;
  size_t slowest = 0;
  for (size_t i = 1; i < n; ++i) {
    if (peers[i].mean_ns > peers[slowest].mean_ns) slowest = i;
  }
  std::vector<size_t> keep;
  sampled_positions(n, limit, rank, window, slowest, keep);
  std::vector<protocol::PeerLoad> kept;
  kept.reserve(keep.size());
  for (size_t i : keep)
    kept.push_back(peers[i]);
  peers = std::move(kept);
}

Result<std::unique_ptr<LoadRecorder>> LoadRecorder::make(Role role, size_t capacity,
                                                         TimeSource time) {
  PSLD_ASSIGN_OR_RETURN(auto ring, LoadRing<StatSample>::make(capacity));
  return std::unique_ptr<LoadRecorder>(new LoadRecorder(role, std::move(ring), time));
}

LoadRecorder::LoadRecorder(Role role, std::unique_ptr<LoadRing<StatSample>> ring, TimeSource time)
    : role_(role), time_(time), ring_(std::move(ring)), queue_(*WindowStats::make()) {}

void LoadRecorder::begin_service() {
  MutexLock lock(busy_mu_);
  if (in_service_++ == 0) busy_since_ = time_.now();
}

void LoadRecorder::end_service() {
  MutexLock lock(busy_mu_);
  if (in_service_ == 0) return;
  if (--in_service_ == 0) {
    busy_ns_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(time_.now() - busy_since_).count());
  }
}

std::vector<protocol::LoadReport> LoadRecorder::close_window(uint32_t rank, uint64_t epoch,
                                                             uint64_t window_ns) {
  protocol::LoadReport total;
  total.role = role_;
  total.rank = rank;
  total.epoch = epoch;
  total.window = window_++;
  total.window_ns = window_ns;
  std::map<uint64_t, protocol::ArcLoad> arcs;
  std::map<uint64_t, protocol::PeerLoad> peers;
  ring_->drain([&](const StatSample& s) {
    const auto metric = static_cast<LoadMetric>(s.metric);
    switch (metric) {
      case LoadMetric::kBytesIn:
        arcs[s.subject].bytes_in += as_u64(s.value);
        total.bytes_in += as_u64(s.value);
        break;
      case LoadMetric::kBytesOut:
        arcs[s.subject].bytes_out += as_u64(s.value);
        total.bytes_out += as_u64(s.value);
        break;
      case LoadMetric::kBusyNs:
        arcs[s.subject].busy_ns += as_u64(s.value);
        break;
      case LoadMetric::kQueueNs:
        ++arcs[s.subject].requests;
        queue_.add(s.value);
        break;
      case LoadMetric::kRound:
        ++total.rounds;
        break;
      case LoadMetric::kPushedBytes:
        peers[s.subject].bytes += as_u64(s.value);
        total.bytes_out += as_u64(s.value);
        break;
      case LoadMetric::kAnswerNs: {
        ++peers[s.subject].answers;
        auto it = answers_.find(s.subject);
        if (it == answers_.end()) it = answers_.emplace(s.subject, *WindowStats::make()).first;
        it->second.add(s.value);
        break;
      }
    }
  });
  {
    // Occupied time of the window, including the part of a service period
    // still running (the rest goes to the next window).
    MutexLock lock(busy_mu_);
    const auto now = time_.now();
    if (in_service_ > 0) {
      busy_ns_ += static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(now - busy_since_).count());
      busy_since_ = now;
    }
    total.busy_ns = busy_ns_;
    busy_ns_ = 0;
  }
  const WindowSummary q = queue_.close();
  total.queue_p50_ns = as_u64(q.p50);
  total.queue_p99_ns = as_u64(q.p99);
  total.lost_samples = ring_->lost() - lost_seen_;
  lost_seen_ = ring_->lost();

  std::vector<protocol::ArcLoad> arc_list;
  arc_list.reserve(arcs.size());
  for (auto& [lo, a] : arcs) {
    a.lo = lo;
    arc_list.push_back(a);
  }
  std::vector<protocol::PeerLoad> peer_list;
  for (auto& [server, p] : peers) {
    p.server = static_cast<uint32_t>(server);
    auto it = answers_.find(server);
    if (it != answers_.end()) {
      const WindowSummary a = it->second.close();
      p.mean_ns = as_u64(a.mean);
      p.p99_ns = as_u64(a.p99);
    }
    peer_list.push_back(p);
  }
  if (peer_limit_ > 0) sample_peers(peer_list, peer_limit_, rank, total.window);
  return split_report(total, arc_list, peer_list);
}

std::vector<protocol::LoadReport> split_report(const protocol::LoadReport& total,
                                               std::span<const protocol::ArcLoad> arcs,
                                               std::span<const protocol::PeerLoad> peers) {
  const size_t entries = arcs.size() + peers.size();
  const size_t parts =
      std::max<size_t>(1, (entries + protocol::kMaxLoadEntries - 1) / protocol::kMaxLoadEntries);
  std::vector<protocol::LoadReport> out(parts, total);
  size_t next = 0;
  for (size_t i = 0; i < parts; ++i) {
    out[i].part = static_cast<uint32_t>(i);
    out[i].parts = static_cast<uint32_t>(parts);
    for (size_t n = 0; n < protocol::kMaxLoadEntries && next < entries; ++n, ++next) {
      if (next < arcs.size()) {
        out[i].arcs.push_back(arcs[next]);
      } else {
        out[i].peers.push_back(peers[next - arcs.size()]);
      }
    }
  }
  return out;
}

}  // namespace psld
