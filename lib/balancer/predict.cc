// lib/balancer/predict.cc — predict and detect: rates, loads, stragglers, the scale streaks.
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "lib/balancer/internal.h"

namespace psld {

using namespace balancer_detail;

namespace {

// A rate sample further than this many spreads and this fraction from the
// estimate, kShiftWindows times in a row on the same side, is a new level.
// 0.2 is twice the +-10% that window-to-window noise reaches on a shared host.
constexpr double kShiftSpreads = 3;
constexpr double kShiftFraction = 0.2;
constexpr int kShiftWindows = 2;

// The detection's noise: never taken below this (2% of the time ratio), so
// that a noiseless cluster still needs a real gap; deviations are clipped at
// this many spreads, so that one level change (or the move that follows it)
// does not read as noise; correlation is taken at most this high.
constexpr double kMinSpread = 0.02;
constexpr double kClipSpreads = 3;
constexpr double kMaxCorrelation = 0.8;
// Until it has learnt the noise from its own windows, a server is assumed to
// be as noisy as a shared machine: a prior spread of this much, worth this
// many windows, blended with what it measures (an EWMA of this weight).
constexpr double kPriorSpread = 0.15;
constexpr double kPriorWindows = 2;
constexpr double kSpreadAlpha = 0.1;

// The threshold h (in spreads) of a one-sided CUSUM of unit-variance samples
// with reference k (in spreads) whose mean run length without a change is
// `windows`, by Siegmund's approximation ARL = (e^(2kb) - 2kb - 1) / (2k^2),
// b = h + 1.166 (Siegmund 1985; Montgomery, "Statistical Quality Control").
double cusum_threshold(double k, double windows) {
  // Solve f(b) = e^(2kb) - 2kb - 1 - 2k^2 ARL = 0 by Newton's method from
  // above (f is convex and increasing for b > 0): from the large-b root
  // ln(2k^2 ARL + 1) / 2k, a few steps reach it to machine precision.
  const double target = 2 * k * k * windows;
  double b = std::log1p(target) / (2 * k) + 1 / (2 * k);
  for (int i = 0; i < 8; ++i) {
    const double e = std::exp(std::min(2 * k * b, 700.0));
    const double f = e - 2 * k * b - 1 - target;
    const double step = f / (2 * k * (e - 1));
    b -= step;
    if (std::fabs(step) < 1e-9 * b) break;
  }
  return std::max(0.0, b - 1.166);
}

uint32_t add_windows(uint32_t streak, uint32_t windows) {
  return std::min(kMaxStreak, streak + std::min(windows, kMaxStreak));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

// ---- Predict --------------------------------------------------------------------

void Balancer::Decision::add_rate_sample(Tracked& t, double rate) const {
  // A stale estimate says nothing about today: the first sample after a long
  // gap (a probe of an empty server) starts afresh instead of being averaged
  // with it.
  if (t.rate_samples == 0 || t.windows_since_rate >= options_.probe_after_windows) {
    t.rate = rate;
    t.rate_var = 0;
    t.rate_samples = 1;
    t.shift_windows = 0;
    t.last_rate = rate;
    t.windows_since_rate = 0;
    return;
  }
  // A straggler appears or recovers from one window to the next; an EWMA
  // alone would take ~10 windows to follow. Two samples in a row far from the
  // estimate, on the same side, restart it from them.
  const double d = rate - t.rate;
  const bool far =
      std::fabs(d) > std::max(kShiftSpreads * std::sqrt(t.rate_var), kShiftFraction * t.rate);
  const int side = d > 0 ? 1 : -1;
  t.shift_windows = far ? (t.shift_windows * side > 0 ? t.shift_windows + side : side) : 0;
  if (std::abs(t.shift_windows) >= kShiftWindows) {
    const double half_gap = 0.5 * (rate - t.last_rate);
    t.rate = 0.5 * (rate + t.last_rate);
    t.rate_var = half_gap * half_gap;
    t.rate_samples = 2;
    t.shift_windows = 0;
  } else {
    // Exponentially weighted mean and variance (the incremental form of
    // Finch 2009, "Incremental calculation of weighted mean and variance").
    t.rate += options_.rate_ewma_alpha * d;
    t.rate_var = (1 - options_.rate_ewma_alpha) * (t.rate_var + options_.rate_ewma_alpha * d * d);
    ++t.rate_samples;
  }
  t.last_rate = rate;
  t.windows_since_rate = 0;
}

void Balancer::Decision::ingest() {
  for (const ServerSpec& s : input_.standby)
    standby_ids_.push_back(s.id);
  std::sort(standby_ids_.begin(), standby_ids_.end());
  auto known = [&](ServerId id) {
    return placement_.find_server(id) != nullptr ||
           std::binary_search(standby_ids_.begin(), standby_ids_.end(), id);
  };
  // Forget servers that left: what the balancer holds is bounded by the
  // members and standby servers of the last decision.
  for (auto it = balancer_.servers_.begin(); it != balancer_.servers_.end();) {
    if (known(it->first)) {
      it->second.new_windows = 0;
      ++it;
    } else {
      it = balancer_.servers_.erase(it);
    }
  }
  for (const ServerHistory& h : input_.servers) {
    if (!known(h.id)) continue;
    Tracked& t = balancer_.servers_[h.id];
    for (const ServerWindow& w : h.windows) {
      if (t.seen && w.seq <= t.last_seq) continue;  // read by an earlier decision
      t.seen = true;
      t.last_seq = w.seq;
      t.new_windows = add_windows(t.new_windows, 1);
      if (w.bytes > 0 && w.busy_s > 0) {
        add_rate_sample(t, w.bytes / w.busy_s);
      } else {
        t.windows_since_rate = add_windows(t.windows_since_rate, 1);
      }
      if (w.rounds > 0) {
        t.history.push_back(
            WindowRecord{w.seq, w.epoch, w.busy_s / static_cast<double>(w.rounds), w.round_s});
        while (t.history.size() > options_.history_windows)
          t.history.pop_front();
      }
    }
  }
}

void Balancer::Decision::measure_load() {
  const std::vector<ServerInfo>& infos = placement_.servers();
  members_.resize(infos.size());
  for (size_t m = 0; m < infos.size(); ++m) {
    members_[m].id = infos[m].id;
    members_[m].state = infos[m].state;
    members_[m].weight = infos[m].weight;
    members_[m].tracked = &balancer_.servers_[infos[m].id];
  }
  const ServerIndex index(infos);

  // One pass over the arcs and the ranges together: a million arcs make
  // every pass over them count. The owners' sums are kept apart from the
  // members, small enough to stay in the nearest cache.
  const size_t n_arcs = placement_.num_arcs();
  const std::vector<RangeLoad>& ranges = input_.ranges;
  std::vector<double> owner_load(members_.size(), 0.0);
  std::vector<size_t> owner_arcs(members_.size(), 0);
  arc_load_.clear();
  arc_load_.reserve(n_arcs);
  arc_member_.clear();
  arc_member_.reserve(n_arcs);
  size_t r = 0;  // the first range that may reach the arc
  for (size_t k = 0; k < n_arcs; ++k) {
    const Arc a = placement_.arc(k);
    // A measured range spreads its load over the current arcs it overlaps, in
    // proportion to the hashes they share: keys are hashed, so hashes are the
    // best guess of where the bytes are.
    double load = 0;
    for (; r < ranges.size() && ranges[r].lo <= a.hi; ++r) {
      const RangeLoad& range = ranges[r];
      if (range.bytes_per_round > 0) {
        const u128 shared = hashes_in(std::max(a.lo, range.lo), std::min(a.hi, range.hi));
        load += range.bytes_per_round * fraction_of(shared, hashes_in(range.lo, range.hi));
      }
      if (range.hi > a.hi) break;  // it goes on into the next arc
    }
    const uint32_t m = index.find(a.owner);  // every owner is a member
    arc_load_.push_back(load);
    arc_member_.push_back(m);
    owner_load[m] += load;
    ++owner_arcs[m];
  }
  for (size_t m = 0; m < members_.size(); ++m) {
    members_[m].load = owner_load[m];
    members_[m].arcs = owner_arcs[m];
  }
}

bool Balancer::Decision::estimate_rates() {
  // Plan with a pessimistic rate: a server whose samples scatter gets less
  // load than its mean promises, and never less than half of it.
  std::vector<double> per_weight;
  std::vector<double> any_per_weight;
  for (Member& m : members_) {
    const Tracked& t = *m.tracked;
    if (t.rate_samples == 0 || !(t.rate > 0)) continue;
    m.estimated = true;
    m.rate = std::max(t.rate - options_.rate_confidence * rate_error(t), 0.5 * t.rate);
    (m.active() ? per_weight : any_per_weight).push_back(m.rate / m.weight);
  }
  if (per_weight.empty()) per_weight = any_per_weight;
  if (per_weight.empty()) return false;
  // A server never measured is assumed to be a typical one.
  prior_per_weight_ = median(per_weight);
  for (Member& m : members_) {
    if (!m.estimated) m.rate = prior_per_weight_ * m.weight;
    total_load_ += m.load;
    if (m.active()) {
      active_load_ += m.load;
      active_rate_ += m.rate;
      ++active_count_;
    }
  }
  min_move_ = active_count_ > 0 ? options_.min_move_fraction * total_load_ / active_count_ : 0;
  probe_load_ = active_count_ > 0 ? options_.probe_fraction * active_load_ / active_count_ : 0;
  return true;
}

// ---- Detect ---------------------------------------------------------------------

bool Balancer::Decision::detect(Tracked& t, double load, double others) const {
  if (!(t.last_rate > 0) || !(others > 0) || !(load > 0)) return t.cusum > 0 && t.has_x;
  // A window of an older epoch (the switch or its migration in it) says
  // nothing about this placement; at a new one the test starts again from
  // the level x has there (the noise it learnt is kept).
  if (t.history.empty() || t.history.back().epoch != placement_.epoch()) return false;
  if (t.x_epoch != placement_.epoch()) {
    t.x_epoch = placement_.epoch();
    t.cusum = 0;
    t.has_x = false;
  }
  // This window's time per round (its newest rate sample, not the EWMA)
  // over the others'.
  const double x = std::log(load / t.last_rate / others);
  // x's noise: its variance (blended with a prior while few windows taught
  // it), and the spread the CUSUM sees, that variance times
  // (1 + rho) / (1 - rho) for a lag-1 correlation rho: the variance of a sum
  // of correlated samples.
  const double n = std::min<double>(t.x_samples, 1 / kSpreadAlpha);
  const double sigma = std::max(
      kMinSpread,
      std::sqrt((kPriorWindows * kPriorSpread * kPriorSpread + n * t.x_var) / (kPriorWindows + n)));
  const double rho = t.x_var > 0 ? std::clamp(t.x_cov / t.x_var, 0.0, kMaxCorrelation) : 0.0;
  const double spread = sigma * std::sqrt((1 + rho) / (1 - rho));
  const double k = 0.5 * std::log1p(options_.straggler_threshold);
  // Winsorised: no window adds more than half the threshold (and at least
  // kClipSpreads spreads), so that one spike of a heavy-tailed noise cannot
  // raise the alarm alone, and two windows far above the others in a row
  // can: at 3 spreads a 4x straggler took 4 windows to be believed while the
  // noise was still the prior's. (The threshold is solved for only when the
  // statistic may rise above 0: in a balanced cluster most stay at 0, and a
  // decision on 1,024 servers is timed.)
  const double h =
      t.cusum > 0 || x > k ? cusum_threshold(k / spread, options_.false_alarm_windows) : 0;
  const double clip = std::max(kClipSpreads, 0.5 * h);
  t.cusum = std::max(0.0, t.cusum + std::min(x - k, clip * spread));
  const bool alarm = t.cusum > 0 && t.cusum >= h * spread;
  // The noise is learnt from windows near the level only: a window far from
  // it (beyond kClipSpreads sigmas) is a spike or a change, which is what the
  // test looks for, not noise.
  if (!t.has_x) {
    t.x_mean = x;
  } else if (!alarm && std::fabs(x - t.x_mean) <= kClipSpreads * sigma) {
    const double d = x - t.x_mean;
    const double prev = t.last_x - t.x_mean;
    t.x_mean += kSpreadAlpha * d;
    t.x_var = (1 - kSpreadAlpha) * (t.x_var + kSpreadAlpha * d * d);
    t.x_cov = (1 - kSpreadAlpha) * t.x_cov + kSpreadAlpha * d * prev;
    t.x_samples = std::min(t.x_samples + 1, kMaxStreak);
  }
  t.last_x = x;
  t.has_x = true;
  return alarm;
}

void Balancer::Decision::update_streaks() {
  for (Member& m : members_) {
    Tracked& t = *m.tracked;
    new_windows_ = std::max(new_windows_, t.new_windows);
    if (t.new_windows == 0) continue;
    if (!m.active() || active_count_ < 2) {
      t.straggler_windows = 0;
      continue;
    }
    // "The others": the time per round the rest would have if balanced among
    // themselves. A server above it by the threshold slows the round, once
    // the test says its level has changed.
    const double others = (active_load_ - m.load) / (active_rate_ - m.rate);
    const bool alarm = detect(t, m.load, others);
    const bool straggling = alarm && m.time() > (1 + options_.straggler_threshold) * others;
    t.straggler_windows = straggling ? add_windows(t.straggler_windows, t.new_windows) : 0;
  }

  // The job's pace: the round time workers report (the median over servers,
  // which see the same rounds), and how much of it is not server time.
  std::vector<double> rounds;
  double busiest = 0;
  for (const Member& m : members_) {
    if (m.tracked->history.empty()) continue;
    const WindowRecord& last = m.tracked->history.back();
    busiest = std::max(busiest, last.service_s);
    if (m.active() && last.round_s > 0) rounds.push_back(last.round_s);
  }
  plan_.measured_round_s = busiest;
  if (!rounds.empty()) {
    period_s_ = median(rounds);
    other_s_ = std::max(0.0, period_s_ - busiest);
  }
  if (new_windows_ == 0) return;

  // Server-bound: even balanced, the servers would be busy most of a round.
  const double balanced = plan_.balanced_round_s;
  const bool bound =
      period_s_ > 0 && balanced >= options_.scale_out_utilisation * (other_s_ + balanced);
  balancer_.server_bound_windows_ =
      bound ? add_windows(balancer_.server_bound_windows_, new_windows_) : 0;

  // Scale-in: the slowest active server (the least loaded, then the highest
  // id, among equals), if the others could absorb its load.
  const Member* candidate = nullptr;
  auto key = [](const Member& m) { return std::make_tuple(m.rate, m.load, ~m.id); };
  if (options_.scale_in && active_count_ >= 2 && active_count_ > options_.min_active_servers) {
    for (const Member& m : members_) {
      if (m.active() && (candidate == nullptr || key(m) < key(*candidate))) candidate = &m;
    }
  }
  bool drainable = false;
  if (candidate != nullptr) {
    std::vector<double> rates, times;
    for (const Member& m : members_) {
      if (!m.active()) continue;
      rates.push_back(m.rate);
      times.push_back(m.time());
    }
    const double without = total_load_ / (active_rate_ - candidate->rate);
    const bool fits =
        other_s_ + without <= (1 + options_.scale_in_max_slowdown) * (other_s_ + balanced);
    const bool idle =
        period_s_ > 0 && without <= options_.scale_in_utilisation * (other_s_ + without);
    // Slow, and busy enough for it to matter: a server holding a small
    // tensor or two reads as slow in bytes/s when a fixed cost per chunk is
    // most of its time (docs/scale.md), yet it slows no round. Or slow and
    // emptied: it holds no more than a probe would give it, and its rate was
    // measured, at the load it carried before the balancer took it away.
    // Left active, it would be probed again and again, and at a quarter of
    // the others' speed even a probe's 1% of the model cost S1 10-60 slow
    // rounds each time (docs/stragglers.md).
    const bool busy = candidate->time() >= 0.5 * median(times);
    const bool emptied = candidate->estimated && candidate->tracked->rate_samples > 0 &&
                         candidate->load <= probe_load_ * (1 + 1e-9);
    const bool slow =
        candidate->rate < options_.slow_rate_fraction * median(rates) && (busy || emptied);
    drainable = fits && (idle || slow);
    if (drainable) {
      scale_in_why_ =
          idle ? fmt::format("idle: without it the servers would be busy {:.0f}% of a {} round",
                             100 * without / (other_s_ + without), seconds_text(other_s_ + without))
               : fmt::format("slow{}: {}/s is {:.0f}% of the median {}/s",
                             busy ? "" : " and emptied", bytes_text(candidate->rate),
                             100 * candidate->rate / median(rates), bytes_text(median(rates)));
      scale_in_why_ +=
          fmt::format("; the others absorb its load, predicted round {} -> {}",
                      seconds_text(other_s_ + balanced), seconds_text(other_s_ + without));
    }
  }
  // The streak belongs to the cluster, not to one server: among equal idle
  // servers, noise picks a different slowest one every window.
  if (drainable) {
    balancer_.scale_in_candidate_ = candidate->id;
    balancer_.scale_in_windows_ = add_windows(balancer_.scale_in_windows_, new_windows_);
  } else {
    balancer_.scale_in_windows_ = 0;
  }
}

}  // namespace psld
