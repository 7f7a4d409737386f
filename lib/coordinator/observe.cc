// What the coordinator shows operators (docs/operations.md): the job as one
// copy (JobView) for the metrics endpoint and `psld top`, built from the
// load reports it already receives and from the balancer's decisions.
#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "base/log.h"
#include "lib/coordinator/service.h"

namespace psld {

using transport::Clock;

namespace {

double seconds(uint64_t ns) {
  return static_cast<double>(ns) / 1e9;
}

}  // namespace

// mu_ held; `r` passed handle_load_report's checks.
void CoordinatorService::observe_report(const protocol::LoadReport& r) {
  if (r.role == Role::kServer) {
    if (r.part != 0) return;  // the window's totals come with part 0
    ServerTotals& t = server_totals_[r.rank];
    t.bytes_in += r.bytes_in;
    t.bytes_out += r.bytes_out;
    ++t.reports;
    return;
  }
  WorkerPace& p = pace_[r.rank];
  if (r.part == 0) {
    p.answers.clear();
    // A worker's `rounds` is the highest round it pushed so far: the rounds
    // of this window are what it grew by. The first report only sets where
    // counting starts (a resumed job starts far above 0).
    if (p.seen && r.rounds > p.round && r.window_ns > 0) {
      const uint64_t n = r.rounds - p.round;
      const double window_s = seconds(r.window_ns);
      p.round_s = window_s / static_cast<double>(n);
      p.rounds += n;
      p.rounds_sum_s += window_s;
      for (size_t i = 0; i < p.buckets.size(); ++i) {
        if (p.round_s <= JobView::kRoundBuckets[i]) p.buckets[i] += n;
      }
    }
    p.seen = true;
    p.round = std::max(p.round, r.rounds);
  }
  for (const auto& peer : r.peers) {
    p.answers.push_back({peer.server, peer.answers, seconds(peer.mean_ns), seconds(peer.p99_ns)});
  }
}

// mu_ held.
void CoordinatorService::observe_decision(const Plan& plan, const PlanStep* published) {
  predictions_ = plan.servers;
  if (published == nullptr) return;
  const std::string kind(step_kind_name(published->kind));
  ++steps_[kind];
  decisions_.push_back({plan.decision,
                        std::chrono::duration<double>(Clock::now() - started_).count(),
                        published->change.next.epoch(), kind, published->reason});
  while (decisions_.size() > JobView::kMaxDecisions)
    decisions_.pop_front();
  if (trace_ && trace_->wants(std::max<uint64_t>(max_round_, 1))) {
    trace_->instant(
        kind, "balancer", Clock::now(),
        fmt::format(R"("decision":{},"reason":{})", plan.decision, json_string(published->reason)));
  }
}

// mu_ held. Every chunk of the registered tensors: its key and bytes.
void CoordinatorService::for_each_chunk(const std::function<void(Key, uint64_t)>& fn) const {
  for (const auto& [name, t] : tensors_) {
    if (t.chunk_bytes == 0) continue;
    const uint64_t chunks = (t.bytes + t.chunk_bytes - 1) / t.chunk_bytes;
    for (uint64_t c = 0; c < chunks; ++c) {
      fn(make_key(t.id, static_cast<uint32_t>(c)),
         std::min(t.chunk_bytes, t.bytes - c * t.chunk_bytes));
    }
  }
}

// mu_ held. Parameter bytes of the registered tensors whose owner differs.
uint64_t CoordinatorService::moved_bytes(const Placement& before, const Placement& after) const {
  uint64_t moved = 0;
  for_each_chunk([&](Key key, uint64_t bytes) {
    if (before.owner_of_key(key) != after.owner_of_key(key)) moved += bytes;
  });
  return moved;
}

// mu_ held. Recomputed when the epoch or the tensors changed: one lookup per
// chunk of the model.
const std::map<uint32_t, uint64_t>& CoordinatorService::owned_bytes() const {
  if (!placement_) {
    owned_.clear();
    return owned_;
  }
  const std::pair<uint64_t, size_t> key{placement_->epoch(), tensors_.size()};
  if (owned_for_ == key) return owned_;
  // Counted into a local: the lambda runs under mu_ too, but the analysis
  // cannot see that.
  std::map<uint32_t, uint64_t> owned;
  const Placement& placement = *placement_;
  for_each_chunk([&](Key k, uint64_t bytes) { owned[placement.owner_of_key(k)] += bytes; });
  owned_ = std::move(owned);
  owned_for_ = key;
  return owned_;
}

MetricsEndpoint::Page CoordinatorService::metrics_page(const std::string& path) const {
  if (path == "/metrics") {
    return {"text/plain; version=0.0.4; charset=utf-8", to_prometheus(view())};
  }
  if (path == "/status.json") return {"application/json", to_json(view())};
  return {"text/plain; charset=utf-8",
          "psld coordinator: /metrics (Prometheus text), /status.json (psld top)\n"};
}

JobView CoordinatorService::view() const {
  MutexLock lock(mu_);
  const auto now = Clock::now();
  JobView v;
  v.time_s = std::chrono::duration<double>(now - started_).count();
  if (job_over_) {
    v.state = job_status_.ok() ? "finished" : "failed";
    if (!job_status_.ok()) v.failure = job_status_.message();
  } else {
    v.state = job_started_ ? "running" : "joining";
  }
  v.num_workers = options_.num_workers;
  v.num_servers = options_.num_servers;
  v.num_standby = options_.num_standby;
  v.epoch = placement_ ? placement_->epoch() : 0;
  v.round = max_round_;
  v.switching = switch_.has_value();
  v.switches = switches_;
  v.aborts = aborts_;
  v.failovers = failovers_;
  v.checkpoints = checkpoints_;
  v.last_checkpoint_round = last_checkpoint_round_;
  v.tensors = tensors_.size();
  for (const auto& [name, t] : tensors_)
    v.model_bytes += t.bytes;
  v.migrated_bytes = migrated_bytes_;
  v.balancer = balancer_.has_value();
  v.balancer_decisions = balancer_ ? balancer_->decisions() : 0;
  v.steps = steps_;
  v.unadmitted = unadmitted_locked();
  v.refused = door_.num_refused();

  // Members: who is connected now, and everyone admitted before.
  std::map<std::pair<Role, uint32_t>, const Member*> connected;
  for (const auto& [id, m] : members_) {
    if (m.welcomed) connected[{m.role, m.rank}] = &m;
  }
  for (const auto& [who, info] : admitted_) {
    JobView::Member e;
    e.role = std::string(role_name(who.first));
    e.rank = who.second;
    e.host = info.first;
    e.pid = info.second;
    auto it = connected.find(who);
    const bool finished = who.first == Role::kWorker && finished_workers_.count(who.second) > 0;
    if (finished) {
      e.state = "finished";
    } else if (it == connected.end()) {
      e.state = who.first == Role::kServer && lost_servers_.count(who.second) ? "lost" : "gone";
    }
    if (it != connected.end()) {
      e.silent_s = std::chrono::duration<double>(now - it->second->last_seen).count();
    }
    v.members.push_back(std::move(e));
  }

  // What the workers' newest reports say of each server: one summary per
  // server, whatever the number of workers.
  struct Seen {
    double weighted_s = 0;  // mean x answers, summed
    uint64_t answers = 0;
    double p99_s = 0;
    uint32_t workers = 0;
  };
  std::map<uint32_t, Seen> seen;
  for (const auto& [rank, p] : pace_) {
    for (const auto& a : p.answers) {
      Seen& s = seen[a.server];
      s.weighted_s += a.mean_s * static_cast<double>(a.answers);
      s.answers += a.answers;
      s.p99_s = std::max(s.p99_s, a.p99_s);
      ++s.workers;
    }
  }

  const auto& owned = owned_bytes();
  const uint32_t all_servers = options_.num_servers + options_.num_standby;
  for (uint32_t rank = 0; rank < all_servers; ++rank) {
    if (!admitted_.count({Role::kServer, rank})) continue;  // not joined yet
    JobView::Server s;
    s.rank = rank;
    const ServerInfo* info = placement_ ? placement_->find_server(rank) : nullptr;
    if (lost_servers_.count(rank)) {
      s.state = "lost";
    } else if (info == nullptr) {
      s.state = "standby";
    } else {
      s.state = std::string(server_state_name(info->state));
    }
    if (auto it = owned.find(rank); it != owned.end() && info != nullptr) {
      s.owned_bytes = it->second;
      s.share = v.model_bytes > 0
                    ? static_cast<double>(it->second) / static_cast<double>(v.model_bytes)
                    : 0;
    }
    if (auto it = server_totals_.find(rank); it != server_totals_.end()) {
      s.bytes_in = it->second.bytes_in;
      s.bytes_out = it->second.bytes_out;
      s.reports = it->second.reports;
    }
    if (const auto* ring = load_.server(rank); ring != nullptr && !ring->empty()) {
      const ServerLoadWindow& w = ring->back();
      const double window_s = seconds(w.window_ns);
      if (window_s > 0) {
        s.in_bytes_per_s = static_cast<double>(w.bytes_in) / window_s;
        s.out_bytes_per_s = static_cast<double>(w.bytes_out) / window_s;
        s.busy = std::min(1.0, seconds(w.busy_ns) / window_s);
      }
      s.queue_p50_s = seconds(w.queue_p50_ns);
      s.queue_p99_s = seconds(w.queue_p99_ns);
    }
    if (auto it = seen.find(rank); it != seen.end()) {
      s.answer_mean_s = it->second.answers > 0
                            ? it->second.weighted_s / static_cast<double>(it->second.answers)
                            : 0;
      s.answer_p99_s = it->second.p99_s;
      s.answer_workers = it->second.workers;
    }
    // Plan::servers is sorted by id: a lookup, not a scan per server, under
    // the lock the control path needs.
    auto p = std::lower_bound(predictions_.begin(), predictions_.end(), rank,
                              [](const ServerPrediction& a, uint32_t id) { return a.id < id; });
    if (p != predictions_.end() && p->id == rank) {
      s.predicted_rate = p->rate_bytes_per_s;
      s.predicted_round_s = p->predicted_round_s;
      s.straggler = balancer_ && p->straggler_windows >= balancer_->options().straggler_windows;
    }
    v.servers.push_back(std::move(s));
  }

  for (const auto& [rank, p] : pace_) {
    JobView::Worker w;
    w.rank = rank;
    w.round = p.round;
    w.round_s = p.round_s;
    w.buckets = p.buckets;
    w.rounds = p.rounds;
    w.rounds_sum_s = p.rounds_sum_s;
    w.answers = p.answers;
    std::sort(w.answers.begin(), w.answers.end(),
              [](const auto& a, const auto& b) { return a.server < b.server; });
    v.workers.push_back(std::move(w));
  }
  v.decisions.assign(decisions_.begin(), decisions_.end());
  return v;
}

}  // namespace psld
