#include "lib/stats/load_history.h"

#include <algorithm>
#include <vector>

namespace psld {

namespace {
template <typename T>
void push_bounded(std::deque<T>& ring, const T& value, size_t capacity) {
  ring.push_back(value);
  while (ring.size() > capacity)
    ring.pop_front();
}
}  // namespace

LoadHistory::LoadHistory(Options options) : options_(options) {
  options_.server_windows = std::max<size_t>(1, options_.server_windows);
  options_.arc_windows = std::max<size_t>(1, options_.arc_windows);
  options_.max_arcs = std::max<size_t>(1, options_.max_arcs);
}

void LoadHistory::ingest(const protocol::LoadReport& r) {
  ++reports_;
  if (r.role == Role::kServer) {
    if (r.part == 0) {
      push_bounded(
          servers_[r.rank],
          ServerLoadWindow{r.window, r.epoch, r.window_ns, r.bytes_in, r.bytes_out, r.busy_ns,
                           r.queue_p50_ns, r.queue_p99_ns, r.rounds, r.lost_samples},
          options_.server_windows);
    }
    for (const auto& a : r.arcs) {
      push_bounded(
          arcs_[a.lo],
          ArcLoadWindow{r.window, r.epoch, r.rank, a.bytes_in, a.bytes_out, a.busy_ns, a.requests},
          options_.arc_windows);
      arc_touched_[a.lo] = reports_;
    }
    if (arcs_.size() > options_.max_arcs) evict_arcs();
  } else if (r.role == Role::kWorker) {
    for (const auto& p : r.peers) {
      push_bounded(views_[p.server], WorkerViewWindow{r.rank, r.window, r.window_ns, p},
                   options_.server_windows * 4);
    }
  }
}

void LoadHistory::evict_arcs() {
  // Down to 7/8 of the bound, so eviction runs once per many new arcs.
  const size_t keep = options_.max_arcs - options_.max_arcs / 8;
  std::vector<std::pair<uint64_t, uint64_t>> by_age;  // (last report, arc)
  by_age.reserve(arc_touched_.size());
  for (const auto& [lo, touched] : arc_touched_)
    by_age.emplace_back(touched, lo);
  const size_t drop = by_age.size() - keep;
  std::nth_element(by_age.begin(), by_age.begin() + static_cast<std::ptrdiff_t>(drop),
                   by_age.end());
  for (size_t i = 0; i < drop; ++i) {
    arcs_.erase(by_age[i].second);
    arc_touched_.erase(by_age[i].second);
  }
}

const std::deque<ServerLoadWindow>* LoadHistory::server(uint32_t rank) const {
  auto it = servers_.find(rank);
  return it == servers_.end() ? nullptr : &it->second;
}

const std::deque<WorkerViewWindow>* LoadHistory::seen_by_workers(uint32_t server) const {
  auto it = views_.find(server);
  return it == views_.end() ? nullptr : &it->second;
}

size_t LoadHistory::entries() const {
  size_t n = 0;
  for (const auto& [rank, ring] : servers_)
    n += ring.size();
  for (const auto& [rank, ring] : views_)
    n += ring.size();
  for (const auto& [lo, ring] : arcs_)
    n += ring.size();
  return n;
}

}  // namespace psld
