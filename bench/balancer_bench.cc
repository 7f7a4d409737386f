// bench/balancer_bench.cc — how long one balancer decision takes.
//
// BM_balancer_decide/<case>: one Balancer::decide() on 512 servers and
// 100,352 arcs (196 virtual nodes each), the input already built, the step's
// next placement included. BM_balancer_decide_1m/<case>: the same on 1,024
// servers and 1,000,448 arcs (977 virtual nodes each), the scale of issue 19's
// control plane. The target is 50 ms for both: the coordinator plans once a
// second (balancer.interval_ms), so a decision must stay a small part of it.
//   hold       no straggler: predict, detect, nothing to move
//   rebalance  one server at half speed, until the straggler test's alarm
//   drain      one server draining: all its arcs (196, 977) leave
//   scale_out  every server saturated, twice max_step_fraction of them on
//              standby: a quarter of the active count joins (128, 256) and
//              every server gives
// BM_balancer_yardstick, BM_balancer_yardstick_1m: their yardsticks in the
// same run (psld bench run's ratio): sorting the arcs' loads once (100,352;
// 1,000,448), the least a decision that ranks arcs by load must do.
//
// A case's cluster, and the balancer primed with the decisions before the
// measured one, are built once per process: at 1,000,448 arcs that takes
// longer than the decisions measured.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "lib/balancer/balancer.h"

namespace psld {
namespace {

constexpr double kRate = 2.5e9;        // bytes/s
constexpr double kArcBytes = 1 << 20;  // per round, before the per-arc spread
constexpr uint64_t kRounds = 10;

// A cluster's size: its servers, their virtual nodes, and the standby
// servers a scale-out may add.
struct Size {
  uint32_t servers = 0;
  uint32_t vnodes = 0;
  uint32_t standby = 0;
  size_t arcs() const { return size_t{servers} * vnodes; }
};
constexpr Size kToday{512, 196, 256};     // 100,352 arcs
constexpr Size kMillion{1024, 977, 512};  // 1,000,448 arcs

enum Case { kHold, kRebalance, kDrain, kScaleOut };

struct Scenario {
  Placement placement;
  std::optional<Balancer> balancer;  // primed with a few decisions
  BalancerInput next;                // the input of the measured decision
};

// One window per server at `seq`, and the load of every arc.
BalancerInput make_input(const Size& size, const Placement& p, uint64_t seq, double slow_factor,
                         double other_s, bool standby) {
  BalancerInput in;
  in.ranges.reserve(p.num_arcs());
  std::vector<double> loads(size.servers + 1, 0.0);
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    const Arc a = p.arc(i);
    // A deterministic spread of 0.5x .. 1.5x per arc.
    const double bytes = kArcBytes * (0.5 + static_cast<double>(i * 2654435761u % 1000) / 1000);
    in.ranges.push_back(RangeLoad{a.lo, a.hi, bytes});
    loads[a.owner] += bytes;
  }
  double slowest = 0;
  for (const ServerInfo& s : p.servers()) {
    const double rate = s.id == 1 ? kRate * slow_factor : kRate;
    slowest = std::max(slowest, loads[s.id] / rate);
  }
  for (const ServerInfo& s : p.servers()) {
    const double rate = s.id == 1 ? kRate * slow_factor : kRate;
    const double bytes = loads[s.id] * kRounds;
    in.servers.push_back(ServerHistory{
        s.id, {ServerWindow{seq, p.epoch(), kRounds, bytes, bytes / rate, other_s + slowest}}});
  }
  for (uint32_t i = 1; standby && i <= size.standby; ++i)
    in.standby.push_back(ServerSpec{size.servers + i, 1.0});
  return in;
}

std::optional<Scenario> make_scenario(const Size& size, Case c) {
  std::vector<ServerSpec> specs;
  for (uint32_t i = 1; i <= size.servers; ++i)
    specs.push_back(ServerSpec{i, 1.0});
  auto initial = Placement::initial(specs, size.vnodes);
  if (!initial.ok()) return std::nullopt;
  Placement p = *initial;
  if (c == kDrain) {
    auto drained = p.set_state(7, ServerState::kDraining);
    if (!drained.ok()) return std::nullopt;
    p = drained->next;
  }
  BalancerOptions o;
  o.scale_in = false;
  auto b = Balancer::make(o);
  if (!b.ok()) return std::nullopt;
  const double slow = c == kRebalance ? 0.5 : 1.0;
  const double other_s = c == kScaleOut ? 0.0 : 1.0;  // worker-bound unless scaling out
  // The measured decision is the first that plans (rebalance: once the
  // straggler test raises its alarm; scale-out: after scale_out_windows
  // saturated windows); the ones before it are holds, taken here. A hold is
  // measured after two windows; a drain at once (it needs no evidence).
  Scenario s{p, std::nullopt, {}};
  uint64_t seq = 1;
  for (; c == kHold && seq < 3; ++seq) {
    auto plan = b->decide(p, make_input(size, p, seq, slow, other_s, false));
    if (!plan.ok() || !plan->steps.empty()) return std::nullopt;
  }
  for (; c == kRebalance || c == kScaleOut; ++seq) {
    if (seq > 64) return std::nullopt;  // never planned
    BalancerInput in = make_input(size, p, seq, slow, other_s, c == kScaleOut);
    Balancer trial = *b;
    auto plan = trial.decide(p, in);
    if (!plan.ok()) return std::nullopt;
    if (!plan->steps.empty()) break;
    *b = std::move(trial);
  }
  s.balancer = std::move(*b);
  s.next = make_input(size, p, seq, slow, other_s, c == kScaleOut);
  return s;
}

// Google Benchmark runs a case's function several times (to size its
// iterations, and once per repetition); the scenario is built the first time.
const Scenario* scenario(const Size& size, Case c) {
  static std::map<std::pair<uint32_t, Case>, std::optional<Scenario>> built;
  auto [it, fresh] = built.try_emplace({size.servers, c});
  if (fresh) it->second = make_scenario(size, c);
  return it->second ? &*it->second : nullptr;
}

void decide(benchmark::State& state, const Size& size, Case c) {
  const Scenario* s = scenario(size, c);
  if (s == nullptr) {
    state.SkipWithError("could not build the scenario");
    return;
  }
  size_t moves = 0;
  for (auto _ : state) {
    state.PauseTiming();
    Balancer b = *s->balancer;  // the same state before every decision
    state.ResumeTiming();
    auto plan = b.decide(s->placement, s->next);
    if (!plan.ok()) {
      state.SkipWithError(plan.status().to_string().c_str());
      return;
    }
    const bool expect_step = c != kHold;
    if (plan->steps.empty() == expect_step) {
      state.SkipWithError(("unexpected plan: " + plan->log).c_str());
      return;
    }
    moves = plan->steps.empty() ? 0 : plan->steps[0].moves.size();
    benchmark::DoNotOptimize(plan);
  }
  state.counters["servers"] = size.servers;
  state.counters["arcs"] = static_cast<double>(s->placement.num_arcs());
  state.counters["moves"] = static_cast<double>(moves);
}

void yardstick(benchmark::State& state, const Size& size) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> spread(0.5 * kArcBytes, 1.5 * kArcBytes);
  std::vector<double> loads(size.arcs());
  for (double& l : loads)
    l = spread(rng);
  std::vector<double> work;
  for (auto _ : state) {
    state.PauseTiming();
    work = loads;
    state.ResumeTiming();
    std::sort(work.begin(), work.end(), std::greater<>());
    benchmark::DoNotOptimize(work.data());
  }
  state.counters["arcs"] = static_cast<double>(loads.size());
}

// BM_balancer_decide<suffix>/<case> for every case, then
// BM_balancer_yardstick<suffix>, in the order they run.
void register_size(const std::string& suffix, const Size& size) {
  const std::pair<const char*, Case> cases[] = {
      {"hold", kHold}, {"rebalance", kRebalance}, {"drain", kDrain}, {"scale_out", kScaleOut}};
  for (const auto& [name, c] : cases) {
    benchmark::RegisterBenchmark(("BM_balancer_decide" + suffix + "/" + name).c_str(), decide, size,
                                 c)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark(("BM_balancer_yardstick" + suffix).c_str(), yardstick, size)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace
}  // namespace psld

int main(int argc, char** argv) {
  psld::register_size("", psld::kToday);
  psld::register_size("_1m", psld::kMillion);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
