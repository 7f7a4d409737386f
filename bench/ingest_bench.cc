// bench/ingest_bench.cc — what the coordinator's load statistics cost it, per
// report, at the scale of issue 19: 10,000 workers, 1,024 servers, 1,000,448
// arcs (docs/scale.md turns the rows into CPU per stats interval).
//
// Every case takes the encoded control messages of one window, as they come
// off a connection, and does what CoordinatorService::handle_load_report
// does with them: decode, check, and LoadHistory::ingest().
//   BM_ingest_worker/<peers>   one worker's window naming <peers> servers
//                              (1,024: every server, in 7 parts; fewer: the
//                              sample stats.worker_peers leaves)
//   BM_ingest_server/<arcs>    one server's window with <arcs> arcs (977: its
//                              share of 1,000,448), into a history that
//                              already holds every arc of 1,024 servers
//   BM_feed_1m                 BalanceFeed::next(): the balancer's input cut
//                              from that history, once a decision
//   BM_decode_*                their yardsticks in the same run: decoding the
//                              same messages alone, the least any ingest pays
//
// items_per_second counts entries (peers or arcs).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lib/coordinator/balance_feed.h"
#include "lib/protocol/protocol.h"
#include "lib/stats/load_history.h"
#include "lib/stats/load_stats.h"

namespace psld {
namespace {

constexpr uint32_t kServers = 1024;
constexpr uint32_t kVnodes = 977;  // 1,000,448 arcs

using Wire = std::vector<std::vector<uint8_t>>;

// The parts of one report, as LoadRecorder::close_window() cuts them.
Wire encode_parts(const protocol::LoadReport& total, const std::vector<protocol::ArcLoad>& arcs,
                  const std::vector<protocol::PeerLoad>& peers) {
  Wire wire;
  for (auto& part : split_report(total, arcs, peers))
    wire.push_back(protocol::encode(protocol::Message{std::move(part)}));
  return wire;
}

Wire worker_window(uint32_t rank, uint64_t window, uint32_t peers) {
  protocol::LoadReport r;
  r.role = Role::kWorker;
  r.rank = rank;
  r.window = window;
  r.window_ns = 100'000'000;
  r.rounds = window * 2;
  r.bytes_out = uint64_t{peers} << 20;
  std::vector<protocol::PeerLoad> list;
  for (uint32_t i = 0; i < peers; ++i) {
    const uint32_t server = (rank * peers + i) % kServers;
    list.push_back(protocol::PeerLoad{server, 1 << 20, 4, 250'000 + server, 400'000 + server});
  }
  return encode_parts(r, {}, list);
}

Wire server_window(const Placement& p, uint32_t server, uint64_t window) {
  protocol::LoadReport r;
  r.role = Role::kServer;
  r.rank = server;
  r.epoch = p.epoch();
  r.window = window;
  r.window_ns = 100'000'000;
  r.rounds = 2;
  std::vector<protocol::ArcLoad> arcs;
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    const Arc a = p.arc(i);
    if (a.owner != server) continue;
    arcs.push_back(protocol::ArcLoad{a.lo, 1 << 16, 1 << 16, 20'000, 8});
    r.bytes_in += 1 << 16;
    r.bytes_out += 1 << 16;
  }
  return encode_parts(r, arcs, {});
}

// What handle_load_report() does with a message: decode, check, ingest.
bool ingest(LoadHistory& history, const std::vector<uint8_t>& bytes) {
  auto m = protocol::decode(bytes);
  if (!m.ok()) return false;
  auto* r = std::get_if<protocol::LoadReport>(&*m);
  if (r == nullptr) return false;
  for (const auto& peer : r->peers) {
    if (peer.server >= kServers) return false;
  }
  history.ingest(*r);
  return true;
}

// 1,024 servers of 977 arcs each, every server's window 0 ingested.
struct Cluster {
  Placement placement;
  LoadHistory history;
  std::vector<uint32_t> ranks;
};

Cluster* cluster() {
  static std::unique_ptr<Cluster> built = [] {
    std::vector<ServerSpec> specs;
    for (uint32_t i = 0; i < kServers; ++i)
      specs.push_back(ServerSpec{i, 1.0});
    auto p = Placement::initial(specs, kVnodes);
    if (!p.ok()) return std::unique_ptr<Cluster>();
    auto c = std::make_unique<Cluster>(Cluster{*p, LoadHistory{}, {}});
    for (uint32_t s = 0; s < kServers; ++s) {
      c->ranks.push_back(s);
      for (const auto& part : server_window(c->placement, s, 0))
        ingest(c->history, part);
    }
    return c;
  }();
  return built.get();
}

void BM_ingest_worker(benchmark::State& state) {
  const auto peers = static_cast<uint32_t>(state.range(0));
  // 64 workers' windows in turn, so the history's rings stay at their bound.
  std::vector<Wire> wires;
  for (uint32_t w = 0; w < 64; ++w)
    wires.push_back(worker_window(w, 1, peers));
  LoadHistory history;
  size_t i = 0;
  for (auto _ : state) {
    for (const auto& part : wires[i++ % wires.size()])
      benchmark::DoNotOptimize(ingest(history, part));
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * peers);
  state.counters["parts"] = static_cast<double>(wires[0].size());
}
BENCHMARK(BM_ingest_worker)->Arg(1024)->Arg(6);

void BM_decode_worker(benchmark::State& state) {
  const auto peers = static_cast<uint32_t>(state.range(0));
  const Wire wire = worker_window(0, 1, peers);
  for (auto _ : state) {
    for (const auto& part : wire)
      benchmark::DoNotOptimize(protocol::decode(part));
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * peers);
}
BENCHMARK(BM_decode_worker)->Arg(1024)->Arg(6);

void BM_ingest_server(benchmark::State& state) {
  Cluster* c = cluster();
  if (c == nullptr) {
    state.SkipWithError("no placement");
    return;
  }
  // Every server's next window in turn: each ingest adds to 977 arcs' rings
  // among 1,000,448.
  std::vector<Wire> wires;
  for (uint32_t s = 0; s < kServers; s += 37)
    wires.push_back(server_window(c->placement, s, 1));
  size_t i = 0;
  for (auto _ : state) {
    for (const auto& part : wires[i++ % wires.size()])
      benchmark::DoNotOptimize(ingest(c->history, part));
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kVnodes);
  state.counters["parts"] = static_cast<double>(wires[0].size());
}
BENCHMARK(BM_ingest_server)->Arg(kVnodes)->Unit(benchmark::kMicrosecond);

void BM_decode_server(benchmark::State& state) {
  Cluster* c = cluster();
  if (c == nullptr) {
    state.SkipWithError("no placement");
    return;
  }
  const Wire wire = server_window(c->placement, 1, 1);
  for (auto _ : state) {
    for (const auto& part : wire)
      benchmark::DoNotOptimize(protocol::decode(part));
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kVnodes);
}
BENCHMARK(BM_decode_server)->Arg(kVnodes)->Unit(benchmark::kMicrosecond);

void BM_feed_1m(benchmark::State& state) {
  Cluster* c = cluster();
  if (c == nullptr) {
    state.SkipWithError("no placement");
    return;
  }
  std::vector<Wire> windows;
  for (uint32_t s = 0; s < kServers; ++s)
    windows.push_back(server_window(c->placement, s, 2));
  uint64_t seq = 1;
  BalanceFeed feed;
  feed.next(c->history, c->placement, c->ranks, seq, DecisionPoint{0, 0, true});
  size_t ranges = 0;
  double now_s = 0;
  uint64_t round = 0;
  for (auto _ : state) {
    // Every server's window since the previous decision (the feed takes the
    // arcs' load each time).
    state.PauseTiming();
    for (const auto& w : windows) {
      for (const auto& part : w)
        ingest(c->history, part);
    }
    state.ResumeTiming();
    auto in = feed.next(c->history, c->placement, c->ranks, ++seq,
                        DecisionPoint{now_s += 1.0, round += 10, true});
    ranges = in ? in->ranges.size() : 0;
    benchmark::DoNotOptimize(in);
  }
  state.counters["ranges"] = static_cast<double>(ranges);
  state.counters["arc_MB"] = static_cast<double>(c->history.arc_bytes()) / 1e6;
}
BENCHMARK(BM_feed_1m)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace psld

BENCHMARK_MAIN();
