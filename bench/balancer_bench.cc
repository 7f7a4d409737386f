// bench/balancer_bench.cc — how long one balancer decision takes.
//
// BM_balancer_decide/<case>: one Balancer::decide() on 512 servers and
// 100,352 arcs (196 virtual nodes each), the input already built, the step's
// next placement included. The target is 50 ms: the coordinator plans once a
// second (balancer.interval_ms), so a decision must stay a small part of it.
//   hold       no straggler: predict, detect, nothing to move
//   rebalance  one server at half speed for straggler_windows windows
//   drain      one server draining: all its ~196 arcs leave
//   scale_out  every server saturated, 256 standby: 128 join, all 512 give
// BM_balancer_yardstick: their yardstick in the same run (psld bench run's
// ratio): sorting the 100,352 arcs' loads once, the least a decision that
// ranks arcs by load must do.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "lib/balancer/balancer.h"

namespace psld {
namespace {

constexpr uint32_t kServers = 512;
constexpr uint32_t kVnodes = 196;      // 512 x 196 = 100,352 arcs
constexpr double kRate = 2.5e9;        // bytes/s
constexpr double kArcBytes = 1 << 20;  // per round, before the per-arc spread
constexpr uint64_t kRounds = 10;
constexpr uint32_t kStandby = 256;

enum Case { kHold, kRebalance, kDrain, kScaleOut };

struct Scenario {
  Placement placement;
  std::optional<Balancer> balancer;  // primed with a few decisions
  BalancerInput next;                // the input of the measured decision
};

// One window per server at `seq`, and the load of every arc.
BalancerInput make_input(const Placement& p, uint64_t seq, double slow_factor, double other_s,
                         bool standby) {
  BalancerInput in;
  std::vector<double> loads(kServers + 1, 0.0);
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
  for (uint32_t i = 1; standby && i <= kStandby; ++i)
    in.standby.push_back(ServerSpec{kServers + i, 1.0});
  return in;
}

std::optional<Scenario> make_scenario(Case c) {
  std::vector<ServerSpec> specs;
  for (uint32_t i = 1; i <= kServers; ++i)
    specs.push_back(ServerSpec{i, 1.0});
  auto initial = Placement::initial(specs, kVnodes);
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
  const uint32_t priming = c == kScaleOut ? o.scale_out_windows : o.straggler_windows;
  // Priming decisions see no draining arcs yet for kDrain: it drains at once.
  Scenario s{p, std::nullopt, {}};
  for (uint64_t seq = 1; seq < priming && c != kDrain; ++seq) {
    auto plan = b->decide(p, make_input(p, seq, slow, other_s, c == kScaleOut));
    if (!plan.ok() || !plan->steps.empty()) return std::nullopt;
  }
  s.balancer = std::move(*b);
  s.next = make_input(p, priming, slow, other_s, c == kScaleOut);
  return s;
}

void BM_balancer_decide(benchmark::State& state, Case c) {
  std::optional<Scenario> s = make_scenario(c);
  if (!s) {
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
  state.counters["servers"] = kServers;
  state.counters["arcs"] = static_cast<double>(s->placement.num_arcs());
  state.counters["moves"] = static_cast<double>(moves);
}
BENCHMARK_CAPTURE(BM_balancer_decide, hold, kHold)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_balancer_decide, rebalance, kRebalance)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_balancer_decide, drain, kDrain)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_balancer_decide, scale_out, kScaleOut)->Unit(benchmark::kMillisecond);

void BM_balancer_yardstick(benchmark::State& state) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> spread(0.5 * kArcBytes, 1.5 * kArcBytes);
  std::vector<double> loads(size_t{kServers} * kVnodes);
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
BENCHMARK(BM_balancer_yardstick)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace psld

BENCHMARK_MAIN();
