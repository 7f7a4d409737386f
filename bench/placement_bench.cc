// bench/placement_bench.cc — key lookups per second on the placement ring.
//
// BM_placement_lookup/<arcs>: owner_of_key (hashing included) for a stream of
// pseudo-random keys on a placement of <arcs> arcs. The target is 20 million
// lookups/s on one core with 1k arcs: a worker looks up every chunk of every
// push and pull, so the ring must never show up next to a 4 MiB transfer.
// BM_placement_yardstick/<arcs>: its yardstick in the same run (psld bench
// run's ratio): the same hash, then a plain binary search over <arcs> sorted
// arc ends and an owner load, what a ring without the bucket index does.
// main() is in kernels_bench.cc.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "base/hash.h"
#include "lib/placement/placement.h"

namespace psld {
namespace {

void BM_placement_lookup(benchmark::State& state) {
  const auto arcs = static_cast<uint32_t>(state.range(0));
  // 100 equal servers with arcs/100 virtual nodes each (at least 4 servers):
  // epoch 0 has exactly `arcs` arcs.
  const uint32_t servers = arcs >= 100'000 ? 100 : 4;
  std::vector<ServerSpec> specs;
  for (uint32_t i = 0; i < servers; ++i)
    specs.push_back({i + 1, 1.0});
  auto placement = Placement::initial(specs, arcs / servers);
  if (!placement.ok() || placement->num_arcs() != arcs) {
    state.SkipWithError("could not build a placement with the requested number of arcs");
    return;
  }
  const Placement& p = *placement;
  // Keys of consecutive chunks of a few tensors, like a push would produce;
  // the hash scatters them over the ring.
  Key key = make_key(17, 0);
  for (auto _ : state) {
    benchmark::DoNotOptimize(p.owner_of_key(key));
    ++key;
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
  state.counters["arcs"] = static_cast<double>(p.num_arcs());
}
BENCHMARK(BM_placement_lookup)->Arg(1000)->Arg(100'000);

void BM_placement_yardstick(benchmark::State& state) {
  const auto arcs = static_cast<size_t>(state.range(0));
  std::mt19937_64 rng(7);
  std::vector<uint64_t> upper(arcs);
  for (uint64_t& u : upper)
    u = rng();
  std::sort(upper.begin(), upper.end());
  upper.back() = UINT64_MAX;  // every hash has an arc
  std::vector<ServerId> owner(arcs);
  for (size_t i = 0; i < arcs; ++i)
    owner[i] = static_cast<ServerId>(i % 100 + 1);
  Key key = make_key(17, 0);
  for (auto _ : state) {
    const uint64_t h = hash_key(key);
    benchmark::DoNotOptimize(
        owner[std::lower_bound(upper.begin(), upper.end(), h) - upper.begin()]);
    ++key;
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
  state.counters["arcs"] = static_cast<double>(arcs);
}
BENCHMARK(BM_placement_yardstick)->Arg(1000)->Arg(100'000);

}  // namespace
}  // namespace psld
