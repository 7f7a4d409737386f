#include "lib/stats/load_history.h"

#include <algorithm>
#include <bit>
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
      ArcLoadRecord* rec = find_or_add(a.lo);
      if (r.epoch < rec->epoch) continue;  // late, from an older placement
      if (r.epoch > rec->epoch || rec->touched == 0) {
        *rec = ArcLoadRecord{};
        rec->lo = a.lo;
        rec->epoch = r.epoch;
      }
      rec->server = r.rank;
      rec->window = r.window;
      ++rec->windows;
      rec->bytes_in += a.bytes_in;
      rec->bytes_out += a.bytes_out;
      rec->busy_ns += a.busy_ns;
      rec->requests += a.requests;
      rec->total_in += a.bytes_in;
      rec->total_out += a.bytes_out;
      rec->touched = reports_;
    }
    if (arcs_.size() > options_.max_arcs) evict_arcs();
  } else if (r.role == Role::kWorker) {
    for (const auto& p : r.peers) {
      push_bounded(views_[p.server], WorkerViewWindow{r.rank, r.window, r.window_ns, p},
                   options_.server_windows * 4);
    }
  }
}

// Arc `lo`s are hashes, but tests and old epochs use small ones: mixed, so
// that any set spreads over the index.
size_t LoadHistory::slot_of(uint64_t lo) const {
  return index_shift_ >= 64 ? 0 : static_cast<size_t>((lo * 0x9E3779B97F4A7C15ull) >> index_shift_);
}

const ArcLoadRecord* LoadHistory::arc(uint64_t lo) const {
  if (index_.empty()) return nullptr;
  const size_t mask = index_.size() - 1;
  for (size_t i = slot_of(lo);; i = (i + 1) & mask) {
    if (index_[i] == kEmpty) return nullptr;
    if (arcs_[index_[i]].lo == lo) return &arcs_[index_[i]];
  }
}

ArcLoadRecord* LoadHistory::find_or_add(uint64_t lo) {
  if (2 * (arcs_.size() + 1) > index_.size()) {
    // Grow: at most half full keeps probes short.
    size_t size = std::max<size_t>(16, index_.size());
    while (2 * (arcs_.size() + 1) > size)
      size *= 2;
    index_.assign(size, kEmpty);
    index_shift_ = 64 - std::countr_zero(size);
    rebuild_index();
  }
  const size_t mask = index_.size() - 1;
  size_t i = slot_of(lo);
  for (; index_[i] != kEmpty; i = (i + 1) & mask) {
    if (arcs_[index_[i]].lo == lo) return &arcs_[index_[i]];
  }
  index_[i] = static_cast<uint32_t>(arcs_.size());
  ArcLoadRecord& rec = arcs_.emplace_back();
  rec.lo = lo;
  return &rec;  // touched == 0: new
}

void LoadHistory::rebuild_index() {
  std::fill(index_.begin(), index_.end(), kEmpty);
  const size_t mask = index_.size() - 1;
  for (size_t n = 0; n < arcs_.size(); ++n) {
    size_t i = slot_of(arcs_[n].lo);
    while (index_[i] != kEmpty)
      i = (i + 1) & mask;
    index_[i] = static_cast<uint32_t>(n);
  }
}

void LoadHistory::evict_arcs() {
  // Down to 7/8 of the bound, so eviction runs once per many new arcs.
  const size_t keep = options_.max_arcs - options_.max_arcs / 8;
  std::vector<uint64_t> touched;
  touched.reserve(arcs_.size());
  for (const ArcLoadRecord& a : arcs_)
    touched.push_back(a.touched);
  const size_t drop = arcs_.size() - keep;
  std::nth_element(touched.begin(), touched.begin() + static_cast<std::ptrdiff_t>(drop),
                   touched.end());
  // touched[drop] is the oldest report kept: arcs last reported before it
  // go, and of those reported in it only as many as the bound leaves.
  const uint64_t cut = touched[drop];
  size_t ties = keep;
  for (const ArcLoadRecord& a : arcs_)
    ties -= a.touched > cut ? 1 : 0;
  std::vector<ArcLoadRecord> kept;
  kept.reserve(keep);
  size_t sorted = 0;  // kept from the sorted prefix: still sorted, still first
  for (size_t i = 0; i < arcs_.size(); ++i) {
    const ArcLoadRecord& a = arcs_[i];
    if (a.touched > cut || (a.touched == cut && ties > 0)) {
      if (a.touched == cut) --ties;
      kept.push_back(a);
      if (i < sorted_) ++sorted;
    }
  }
  sorted_ = sorted;
  arcs_ = std::move(kept);
  rebuild_index();
}

void LoadHistory::sort_arcs() {
  if (sorted_ == arcs_.size()) return;
  const auto by_lo = [](const ArcLoadRecord& a, const ArcLoadRecord& b) { return a.lo < b.lo; };
  const auto middle = arcs_.begin() + static_cast<std::ptrdiff_t>(sorted_);
  std::sort(middle, arcs_.end(), by_lo);
  std::inplace_merge(arcs_.begin(), middle, arcs_.end(), by_lo);
  sorted_ = arcs_.size();
  rebuild_index();
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
  return n + arcs_.size();
}

}  // namespace psld
