#include "tools/sim/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>

#include "base/hash.h"
#include "lib/coordinator/balance_feed.h"
#include "lib/stats/load_history.h"
#include "lib/stats/load_stats.h"

namespace psld::sim {

namespace {

using bench::CapacityEvent;

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    out.emplace_back(s.substr(start, at == std::string_view::npos ? s.npos : at - start));
    if (at == std::string_view::npos) return out;
    start = at + 1;
  }
}

Result<double> number(std::string_view spec, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
    return InvalidArgument(fmt::format("trace '{}': '{}' is not a number", spec, text));
  }
  return v;
}

Result<uint64_t> whole(std::string_view spec, const std::string& text, uint64_t max) {
  PSLD_ASSIGN_OR_RETURN(double v, number(spec, text));
  if (v < 0 || v > static_cast<double>(max) || v != std::floor(v)) {
    return InvalidArgument(
        fmt::format("trace '{}': '{}' must be a whole number from 0 to {}", spec, text, max));
  }
  return static_cast<uint64_t>(v);
}

Result<double> factor(std::string_view spec, const std::string& text) {
  PSLD_ASSIGN_OR_RETURN(double v, number(spec, text));
  if (!(v > 0 && v <= 1e3)) {
    return InvalidArgument(
        fmt::format("trace '{}': factor '{}' must be above 0 (at most 1000)", spec, text));
  }
  return v;
}

// A server's noise: an AR(1) series of exponential draws with rare spikes.
class NoiseSource {
 public:
  explicit NoiseSource(uint64_t seed) : rng_(seed) {}
  double next() {
    std::exponential_distribution<double> base(4.0);  // mean 0.25
    std::uniform_real_distribution<double> u(0.0, 1.0);
    double draw = base(rng_);
    if (u(rng_) < 0.05) draw += 1 + 2 * u(rng_);  // a spike of 1-3
    level_ = 0.5 * level_ + 0.5 * draw;
    return level_;
  }

 private:
  std::mt19937_64 rng_;
  double level_ = 0;
};

// The window a server is filling, reported every stats interval.
struct Window {
  uint64_t seq = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  double busy_s = 0;
  uint64_t rounds = 0;
  std::map<uint64_t, uint64_t> arcs;  // arc lo -> bytes each way
};

// What the placement in force gives each server and arc, per round and worker.
struct Loads {
  std::vector<double> bytes;   // per server id: each way, per worker
  std::vector<double> chunks;  // per server id
  // Per arc (by its first hash) that holds keys: its owner and its bytes
  // per worker.
  std::map<uint64_t, std::pair<ServerId, uint64_t>> arcs;
  std::vector<ServerId> owner;  // per key
};

Loads loads_of(const Placement& p, const std::vector<bench::ModelKey>& keys,
               const std::vector<uint64_t>& hashes, size_t ids) {
  Loads l;
  l.bytes.assign(ids, 0.0);
  l.chunks.assign(ids, 0.0);
  l.owner.resize(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    const size_t arc = p.arc_index_of_hash(hashes[k]);
    const Arc a = p.arc(arc);
    l.owner[k] = a.owner;
    if (a.owner < ids) {
      l.bytes[a.owner] += static_cast<double>(keys[k].bytes);
      l.chunks[a.owner] += 1;
    }
    auto& arc_load = l.arcs[a.lo];
    arc_load.first = a.owner;
    arc_load.second += keys[k].bytes;
  }
  return l;
}

Status validate(const SimOptions& o) {
  if (o.workers == 0 || o.servers == 0) return InvalidArgument("sim: no workers or no servers");
  if (o.keys.empty()) return InvalidArgument("sim: the model has no keys");
  if (o.rounds == 0) return InvalidArgument("sim: no rounds to run");
  if (!(o.capacity > 0) || !std::isfinite(o.capacity)) {
    return InvalidArgument("sim: the capacity must be a positive number of bytes/s");
  }
  if (!(o.stats_interval_s > 0) || !(o.balancer_interval_s > 0)) {
    return InvalidArgument("sim: the stats and balancer intervals must be above 0");
  }
  if (o.chunk_s < 0 || o.other_s < 0 || o.noise < 0 || o.migration_bytes_per_byte < 0) {
    return InvalidArgument("sim: costs and noise cannot be negative");
  }
  const uint64_t ids = uint64_t{o.servers} + o.standby;
  for (const CapacityEvent& e : o.events) {
    if (e.server >= ids) {
      return InvalidArgument(
          fmt::format("sim: an event names server {}, the job has {}", e.server, ids));
    }
    if (!(e.factor > 0)) return InvalidArgument("sim: a capacity factor must be above 0");
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<CapacityEvent>> parse_trace(std::string_view spec, uint32_t servers,
                                               uint64_t rounds, uint64_t seed) {
  const std::vector<std::string> f = split(spec, ':');
  std::vector<CapacityEvent> out;
  auto server = [&](const std::string& text) -> Result<ServerId> {
    PSLD_ASSIGN_OR_RETURN(uint64_t id, whole(spec, text, servers == 0 ? 0 : servers - 1));
    return static_cast<ServerId>(id);
  };
  const std::string& kind = f[0];
  if (kind == "step" && f.size() == 4) {
    PSLD_ASSIGN_OR_RETURN(ServerId id, server(f[1]));
    PSLD_ASSIGN_OR_RETURN(uint64_t at, whole(spec, f[2], rounds));
    PSLD_ASSIGN_OR_RETURN(double x, factor(spec, f[3]));
    out.push_back({at, id, x});
  } else if (kind == "moving" && f.size() == 3) {
    PSLD_ASSIGN_OR_RETURN(double x, factor(spec, f[1]));
    PSLD_ASSIGN_OR_RETURN(uint64_t period, whole(spec, f[2], rounds));
    if (period == 0)
      return InvalidArgument(fmt::format("trace '{}': PERIOD must be above 0", spec));
    ServerId at = 0;
    for (uint64_t r = 0; r <= rounds; r += period, at = (at + 1) % servers) {
      if (r > 0) out.push_back({r, (at + servers - 1) % servers, 1.0});
      out.push_back({r, at, x});
    }
  } else if (kind == "oscillate" && f.size() == 4) {
    PSLD_ASSIGN_OR_RETURN(ServerId id, server(f[1]));
    PSLD_ASSIGN_OR_RETURN(double x, factor(spec, f[2]));
    PSLD_ASSIGN_OR_RETURN(uint64_t period, whole(spec, f[3], rounds));
    if (period == 0)
      return InvalidArgument(fmt::format("trace '{}': PERIOD must be above 0", spec));
    bool slow = true;
    for (uint64_t r = 0; r <= rounds; r += period, slow = !slow)
      out.push_back({r, id, slow ? x : 1.0});
  } else if (kind == "walk" && f.size() == 3) {
    PSLD_ASSIGN_OR_RETURN(double sigma, number(spec, f[1]));
    PSLD_ASSIGN_OR_RETURN(double lo, factor(spec, f[2]));
    if (!(sigma > 0 && sigma <= 1) || lo > 1) {
      return InvalidArgument(
          fmt::format("trace '{}': SIGMA in (0, 1] and LO in (0, 1] are needed", spec));
    }
    std::mt19937_64 rng(seed ^ 0x5157'a1c0'7aceULL);
    std::normal_distribution<double> step(0.0, sigma);
    for (ServerId id = 0; id < servers; ++id) {
      double log_x = 0;
      for (uint64_t r = 1; r <= rounds; ++r) {
        log_x = std::clamp(log_x + step(rng), std::log(lo), 0.0);
        out.push_back({r, id, std::exp(log_x)});
      }
    }
  } else if (kind == "file" && f.size() >= 2) {
    const std::string path(spec.substr(5));
    std::ifstream in(path);
    if (!in) return NotFound(fmt::format("trace file {} cannot be read", path));
    std::string line;
    size_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      const size_t hash = line.find('#');
      if (hash != std::string::npos) line.resize(hash);
      std::istringstream words(line);
      std::string a, b, c, extra;
      if (!(words >> a)) continue;
      if (!(words >> b >> c) || (words >> extra)) {
        return InvalidArgument(
            fmt::format("{}:{}: expected 'ROUND SERVER FACTOR', got '{}'", path, n, line));
      }
      auto r = whole(spec, a, rounds);
      auto id = server(b);
      auto x = factor(spec, c);
      if (!r.ok() || !id.ok() || !x.ok()) {
        return InvalidArgument(fmt::format("{}:{}: '{}': ROUND 0-{}, SERVER 0-{}, FACTOR > 0", path,
                                           n, line, rounds, servers - 1));
      }
      out.push_back({*r, *id, *x});
    }
  } else {
    return InvalidArgument(
        fmt::format("trace '{}': expected step:SERVER:ROUND:FACTOR, moving:FACTOR:PERIOD, "
                    "oscillate:SERVER:FACTOR:PERIOD, walk:SIGMA:LO or file:PATH",
                    spec));
  }
  std::stable_sort(out.begin(), out.end(), [](const CapacityEvent& a, const CapacityEvent& b) {
    return a.round < b.round;
  });
  return out;
}

Result<SimResult> simulate(const SimOptions& o) {
  PSLD_RETURN_IF_ERROR(validate(o));
  const size_t ids = size_t{o.servers} + o.standby;
  std::vector<ServerSpec> specs;
  for (ServerId id = 0; id < o.servers; ++id)
    specs.push_back({id, 1.0});
  PSLD_ASSIGN_OR_RETURN(Placement placement,
                        o.initial ? Result<Placement>(*o.initial) : Placement::initial(specs));
  std::optional<Balancer> balancer;
  if (o.balance) {
    PSLD_ASSIGN_OR_RETURN(Balancer b, Balancer::make(o.balancer));
    balancer.emplace(std::move(b));
  }
  LoadHistory history;
  BalanceFeed feed;
  std::vector<uint32_t> ranks(ids);
  for (size_t i = 0; i < ids; ++i)
    ranks[i] = static_cast<uint32_t>(i);

  std::vector<uint64_t> hashes;
  hashes.reserve(o.keys.size());
  double model_bytes = 0;
  for (const bench::ModelKey& k : o.keys) {
    hashes.push_back(hash_key(k.key));
    model_bytes += static_cast<double>(k.bytes);
  }
  Loads loads = loads_of(placement, o.keys, hashes, ids);
  {
    // As the coordinator does: the balancer cuts arcs between chunks.
    std::vector<ChunkPoint> chunks;
    chunks.reserve(o.keys.size());
    for (size_t i = 0; i < o.keys.size(); ++i)
      chunks.push_back(ChunkPoint{hashes[i], static_cast<double>(o.keys[i].bytes)});
    feed.set_chunks(std::move(chunks));
  }

  std::vector<double> factor(ids, 1.0);
  std::vector<NoiseSource> noise;
  for (size_t i = 0; i < ids; ++i)
    noise.emplace_back(o.seed * 1000003 + i);
  std::vector<Window> windows(ids);
  const double workers = o.workers;
  const bool link = o.resource == bench::Resource::kLink;

  SimResult result;
  result.run.policy = o.balance ? bench::Policy::kPsld : bench::Policy::kOracle;
  result.run.round_ms.reserve(o.rounds);
  double now_s = 0;
  double next_stats_s = o.stats_interval_s;
  double next_decision_s = 0;
  uint64_t last_switch_round = 0;
  struct Pending {
    Placement next;
    uint64_t round = 0;
  };
  std::optional<Pending> pending;
  size_t event = 0;

  using CpuClock = std::chrono::steady_clock;
  const auto ingest = [&](const protocol::LoadReport& r) {
    const auto t0 = CpuClock::now();
    history.ingest(r);
    result.ingest_s += std::chrono::duration<double>(CpuClock::now() - t0).count();
    ++result.reports;
  };
  // Every worker's window: its round and, for the servers its sample names,
  // what it saw (chunks answered, each server's time a round).
  const size_t peer_limit = worker_peer_limit(o.worker_peers, o.workers, ids);
  uint64_t max_round = 0;  // the highest round a worker reported
  uint64_t worker_window = 0;
  uint64_t window_first_round = 1;
  std::vector<size_t> pushed_to, positions;
  protocol::LoadReport wr;
  // A server's time a round in its current window (rounds > 0).
  const auto per_round_s = [&](size_t s) {
    return windows[s].busy_s / static_cast<double>(windows[s].rounds);
  };
  auto report_workers = [&](uint64_t round) {
    const uint64_t rounds = round + 1 - window_first_round;
    window_first_round = round + 1;
    pushed_to.clear();
    size_t slowest = 0;
    for (size_t i = 0; i < ids; ++i) {
      if (loads.chunks[i] == 0 || windows[i].rounds == 0) continue;
      if (!pushed_to.empty() && per_round_s(i) > per_round_s(pushed_to[slowest]))
        slowest = pushed_to.size();
      pushed_to.push_back(i);
    }
    wr.role = Role::kWorker;
    wr.window = worker_window++;
    wr.window_ns = static_cast<uint64_t>(o.stats_interval_s * 1e9);
    wr.rounds = round;
    wr.bytes_out = static_cast<uint64_t>(model_bytes) * rounds;
    for (uint32_t w = 0; w < o.workers; ++w) {
      wr.rank = w;
      wr.peers.clear();
      sampled_positions(pushed_to.size(), peer_limit, w, wr.window, slowest, positions);
      for (size_t at : positions) {
        const size_t i = pushed_to[at];
        const auto answer_ns = static_cast<uint64_t>(per_round_s(i) * 1e9);
        wr.peers.push_back(protocol::PeerLoad{
            static_cast<uint32_t>(i), static_cast<uint64_t>(loads.bytes[i]) * rounds,
            static_cast<uint32_t>(loads.chunks[i] * static_cast<double>(rounds)), answer_ns,
            answer_ns});
      }
      result.peer_entries += wr.peers.size();
      ingest(wr);
      ++result.worker_reports;
      max_round = std::max(max_round, wr.rounds);  // CoordinatorService::handle_load_report
    }
  };

  // Every server's window as a LoadReport into the coordinator's history.
  auto report = [&] {
    for (size_t i = 0; i < ids; ++i) {
      Window& w = windows[i];
      protocol::LoadReport r;
      r.role = Role::kServer;
      r.rank = static_cast<uint32_t>(i);
      r.epoch = placement.epoch();
      r.window = w.seq++;
      r.window_ns = static_cast<uint64_t>(o.stats_interval_s * 1e9);
      r.bytes_in = w.bytes_in;
      r.bytes_out = w.bytes_out;
      r.busy_ns = static_cast<uint64_t>(w.busy_s * 1e9);
      r.rounds = w.rounds;
      for (const auto& [lo, bytes] : w.arcs)
        r.arcs.push_back(protocol::ArcLoad{lo, bytes, bytes, 0, 0});
      result.arc_entries += r.arcs.size();
      ingest(r);
      const uint64_t seq = w.seq;
      w = Window{};
      w.seq = seq;
    }
  };

  for (uint64_t r = 1; r <= o.rounds; ++r) {
    while (event < o.events.size() && o.events[event].round <= r) {
      factor[o.events[event].server] = o.events[event].factor;
      ++event;
    }
    bool migrating = pending.has_value();
    std::vector<double> extra_s(ids, 0.0);
    if (pending && pending->round == r) {
      // The switch: the moved keys' bytes leave one link and enter another.
      report();  // windows do not straddle epochs
      const Loads next = loads_of(pending->next, o.keys, hashes, ids);
      for (size_t k = 0; k < o.keys.size(); ++k) {
        const ServerId from = loads.owner[k], to = next.owner[k];
        if (from == to) continue;
        const double bytes = static_cast<double>(o.keys[k].bytes) * o.migration_bytes_per_byte;
        result.migrated_bytes += bytes;
        if (link && from < ids) extra_s[from] += bytes / (o.capacity * factor[from]);
        if (link && to < ids) extra_s[to] += bytes / (o.capacity * factor[to]);
      }
      placement = std::move(pending->next);
      loads = next;
      last_switch_round = r;
      pending.reset();
      migrating = true;
    }
    // The links (or reduces) in parallel, then the job's CPU on its cores.
    double slowest = 0;
    double cpu_s = 0;
    std::vector<double> busy(ids, 0.0);
    for (size_t i = 0; i < ids; ++i) {
      const double bytes = workers * loads.bytes[i];
      if (bytes == 0 && extra_s[i] == 0) continue;
      double t = bytes / (o.capacity * factor[i]);
      if (o.noise > 0) t *= 1 + o.noise * noise[i].next();
      const double cpu = o.chunk_s * workers * loads.chunks[i];
      if (o.cores == 0) {
        t += cpu;
      } else {
        cpu_s += cpu / o.cores;
      }
      busy[i] = t + extra_s[i] + (o.cores == 0 ? 0 : cpu);
      slowest = std::max(slowest, t + extra_s[i]);
    }
    const double round_s = slowest + cpu_s + o.other_s;
    now_s += round_s;
    result.run.round_ms.push_back(round_s * 1e3);
    result.run.migrating.push_back(migrating);
    for (size_t i = 0; i < ids; ++i) {
      Window& w = windows[i];
      const auto bytes = static_cast<uint64_t>(workers * loads.bytes[i]);
      w.bytes_in += bytes;
      w.bytes_out += bytes;
      w.busy_s += busy[i];
      w.rounds += 1;
    }
    for (const auto& [lo, arc] : loads.arcs) {
      const auto& [owner, bytes] = arc;
      if (owner < ids) windows[owner].arcs[lo] += static_cast<uint64_t>(workers) * bytes;
    }
    if (now_s >= next_stats_s) {
      if (o.worker_reports) report_workers(r);
      report();
      while (next_stats_s <= now_s)
        next_stats_s += o.stats_interval_s;
    }
    if (balancer && !pending && now_s >= next_decision_s) {
      next_decision_s = now_s + o.balancer_interval_s;
      const uint64_t job_round = o.worker_reports ? max_round : r;
      const auto t0 = CpuClock::now();
      auto input = feed.next(history, placement, ranks, balancer->decisions() + 1,
                             DecisionPoint{now_s, job_round, job_round > last_switch_round});
      std::optional<Result<Plan>> decided;
      if (input) decided.emplace(balancer->decide(placement, *input));
      result.coordinator_s += std::chrono::duration<double>(CpuClock::now() - t0).count();
      if (decided) {
        PSLD_ASSIGN_OR_RETURN(Plan plan, std::move(*decided));
        ++result.decisions;
        if (!plan.steps.empty()) {
          const PlanStep& step = plan.steps.front();
          result.steps.push_back(SimStep{r, std::string(step_kind_name(step.kind)), step.reason});
          pending = Pending{step.change.next, std::max(r + o.switch_margin, last_switch_round + 1)};
        }
      }
    }
    if (o.on_round) o.on_round(r, placement);
  }
  result.coordinator_s += result.ingest_s;
  result.run.seconds = now_s;
  result.run.switches = placement.epoch();
  result.run.final_shares.assign(ids, 0.0);
  for (size_t k = 0; k < o.keys.size(); ++k) {
    if (loads.owner[k] < ids) {
      result.run.final_shares[loads.owner[k]] += static_cast<double>(o.keys[k].bytes) / model_bytes;
    }
  }
  result.final_placement = std::move(placement);
  return result;
}

}  // namespace psld::sim
