#include "lib/stats/load_stats.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <unordered_map>

namespace psld {

namespace {
// Rounded to nearest (half up). Samples are byte counts and nanoseconds,
// whole numbers nearly always: a truncation and a compare, instead of a
// call to llround for each of the several samples of every chunk.
uint64_t as_u64(double v) {
  if (!(v > 0)) return 0;
  if (v >= 0x1p64) return UINT64_MAX;
  const auto whole = static_cast<uint64_t>(v);
  return v - static_cast<double>(whole) >= 0.5 ? whole + 1 : whole;
}

// The entry of a window's map that the previous sample of its kind used.
template <typename T>
struct LastEntry {
  uint64_t subject = 0;
  T* entry = nullptr;
  template <typename Find>
  T& get(uint64_t s, Find&& find) {
    if (entry == nullptr || subject != s) {
      subject = s;
      entry = &find();
    }
    return *entry;
  }
};
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

void LoadRecorder::begin_service(uint64_t n) {
  if (n == 0) return;
  MutexLock lock(busy_mu_);
  if (in_service_ == 0) busy_since_ = time_.now();
  in_service_ += n;
}

void LoadRecorder::end_service(uint64_t n) {
  if (n == 0) return;
  MutexLock lock(busy_mu_);
  if (in_service_ == 0) return;
  in_service_ -= std::min(n, in_service_);
  if (in_service_ == 0) {
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
  // Hashed (a server's samples name a few hundred arcs), sorted at the end.
  std::unordered_map<uint64_t, protocol::ArcLoad> arcs;
  arcs.reserve(arcs_seen_);
  std::map<uint64_t, protocol::PeerLoad> peers;
  // A chunk leaves several samples of one subject, mostly one after another
  // (a server's push: its bytes, its queueing, its reduce; a worker's batch
  // to one server): each map is looked up again only when the subject
  // changes (map entries stay where they are).
  LastEntry<protocol::ArcLoad> last_arc;
  LastEntry<protocol::PeerLoad> last_peer;
  LastEntry<WindowStats> last_answers;
  auto arc = [&](uint64_t subject) -> protocol::ArcLoad& {
    return last_arc.get(subject, [&]() -> protocol::ArcLoad& { return arcs[subject]; });
  };
  auto peer = [&](uint64_t subject) -> protocol::PeerLoad& {
    return last_peer.get(subject, [&]() -> protocol::PeerLoad& { return peers[subject]; });
  };
  auto answers = [&](uint64_t subject) -> WindowStats& {
    return last_answers.get(subject, [&]() -> WindowStats& {
      auto it = answers_.find(subject);
      if (it == answers_.end()) it = answers_.emplace(subject, *WindowStats::make()).first;
      return it->second;
    });
  };
  ring_->drain([&](const StatSample& s) {
    const auto metric = static_cast<LoadMetric>(s.metric);
    switch (metric) {
      case LoadMetric::kBytesIn:
        arc(s.subject).bytes_in += as_u64(s.value);
        total.bytes_in += as_u64(s.value);
        break;
      case LoadMetric::kBytesOut:
        arc(s.subject).bytes_out += as_u64(s.value);
        total.bytes_out += as_u64(s.value);
        break;
      case LoadMetric::kBusyNs:
        arc(s.subject).busy_ns += as_u64(s.value);
        break;
      case LoadMetric::kQueueNs:
        ++arc(s.subject).requests;
        queue_.add(s.value);
        break;
      case LoadMetric::kRound:
        ++total.rounds;
        break;
      case LoadMetric::kPushedBytes:
        peer(s.subject).bytes += as_u64(s.value);
        total.bytes_out += as_u64(s.value);
        break;
      case LoadMetric::kAnswerNs:
        ++peer(s.subject).answers;
        answers(s.subject).add(s.value);
        break;
      case LoadMetric::kPushTaken: {
        protocol::ArcLoad& a = arc(s.subject);
        a.bytes_in += s.aux;
        ++a.requests;
        total.bytes_in += s.aux;
        queue_.add(s.value);
        break;
      }
      case LoadMetric::kApplied:
        arc(s.subject).busy_ns += as_u64(s.value);
        ++total.rounds;
        break;
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
  std::sort(arc_list.begin(), arc_list.end(),
            [](const protocol::ArcLoad& a, const protocol::ArcLoad& b) { return a.lo < b.lo; });
  arcs_seen_ = arcs.size();
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
