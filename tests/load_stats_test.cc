// Load statistics: what a window of samples becomes (LoadRecorder) and the
// coordinator's bounded memory of it (LoadHistory).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <vector>

#include "base/clock.h"
#include "lib/stats/load_history.h"
#include "lib/stats/load_stats.h"

namespace psld {
namespace {

using protocol::LoadReport;

TEST(LoadRecorder, SumsEachArcAndTheTotals) {
  auto rec = *LoadRecorder::make(Role::kServer);
  rec->record(0x100, LoadMetric::kBytesIn, 1000);
  rec->record(0x100, LoadMetric::kBytesIn, 24);
  rec->record(0x100, LoadMetric::kBytesOut, 512);
  rec->record(0x200, LoadMetric::kBytesIn, 7);
  rec->record(0x200, LoadMetric::kBusyNs, 300);
  rec->record(0x200, LoadMetric::kQueueNs, 50);
  rec->record(0x200, LoadMetric::kQueueNs, 150);
  rec->record(0x200, LoadMetric::kRound, 1);
  auto reports = rec->close_window(3, 9, 100'000'000);
  ASSERT_EQ(reports.size(), 1u);
  const LoadReport& r = reports[0];
  EXPECT_EQ(r.role, Role::kServer);
  EXPECT_EQ(r.rank, 3u);
  EXPECT_EQ(r.epoch, 9u);
  EXPECT_EQ(r.window, 0u);
  EXPECT_EQ(r.window_ns, 100'000'000u);
  EXPECT_EQ(r.bytes_in, 1031u);
  EXPECT_EQ(r.bytes_out, 512u);
  EXPECT_EQ(r.rounds, 1u);
  EXPECT_EQ(r.lost_samples, 0u);
  ASSERT_EQ(r.arcs.size(), 2u);
  EXPECT_EQ(r.arcs[0].lo, 0x100u);
  EXPECT_EQ(r.arcs[0].bytes_in, 1024u);
  EXPECT_EQ(r.arcs[0].bytes_out, 512u);
  EXPECT_EQ(r.arcs[1].lo, 0x200u);
  EXPECT_EQ(r.arcs[1].busy_ns, 300u);
  EXPECT_EQ(r.arcs[1].requests, 2u);
  EXPECT_GE(r.queue_p99_ns, 50u);
  // The next window starts empty and still reports (no traffic is a fact).
  auto next = rec->close_window(3, 9, 100'000'000);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].window, 1u);
  EXPECT_EQ(next[0].bytes_in, 0u);
  EXPECT_TRUE(next[0].arcs.empty());
}

// The combined samples a server records for each push and each round add up
// to what their separate samples would.
TEST(LoadRecorder, APushTakenAndARoundAppliedCountAsTheirSeparateSamples) {
  auto combined = *LoadRecorder::make(Role::kServer);
  auto separate = *LoadRecorder::make(Role::kServer);
  for (uint64_t arc : {0x300u, 0x100u, 0x300u}) {
    combined->record_push(arc, 4096 + arc, 70);
    separate->record(arc, LoadMetric::kBytesIn, static_cast<double>(4096 + arc));
    separate->record(arc, LoadMetric::kQueueNs, 70);
  }
  combined->record_round(0x300, 1234);
  separate->record(0x300, LoadMetric::kBusyNs, 1234);
  separate->record(0x300, LoadMetric::kRound, 1);
  // Larger than the sample's 32-bit field: recorded as the two samples.
  combined->record_push(0x100, uint64_t{5} << 32, 10);
  separate->record(0x100, LoadMetric::kBytesIn, static_cast<double>(uint64_t{5} << 32));
  separate->record(0x100, LoadMetric::kQueueNs, 10);
  const LoadReport a = combined->close_window(1, 2, 1000)[0];
  const LoadReport b = separate->close_window(1, 2, 1000)[0];
  EXPECT_EQ(a.bytes_in, b.bytes_in);
  EXPECT_EQ(a.bytes_in, 3 * 4096u + 0x300 * 2 + 0x100 + (uint64_t{5} << 32));
  EXPECT_EQ(a.rounds, 1u);
  EXPECT_EQ(a.rounds, b.rounds);
  EXPECT_EQ(a.queue_p50_ns, b.queue_p50_ns);
  EXPECT_EQ(a.queue_p99_ns, b.queue_p99_ns);
  ASSERT_EQ(a.arcs.size(), 2u);
  ASSERT_EQ(b.arcs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(a.arcs[i].lo, b.arcs[i].lo);
    EXPECT_EQ(a.arcs[i].bytes_in, b.arcs[i].bytes_in);
    EXPECT_EQ(a.arcs[i].busy_ns, b.arcs[i].busy_ns);
    EXPECT_EQ(a.arcs[i].requests, b.arcs[i].requests);
  }
  EXPECT_EQ(a.arcs[0].requests, 2u);  // 0x100: two pushes
  EXPECT_EQ(a.arcs[1].busy_ns, 1234u);
}

TEST(LoadRecorder, ManyArcsAreSplitIntoPartsThatEachFitAMessage) {
  auto rec = *LoadRecorder::make(Role::kServer);
  constexpr uint64_t kArcs = 500;
  for (uint64_t a = 0; a < kArcs; ++a)
    rec->record(a << 40, LoadMetric::kBytesIn, static_cast<double>(a + 1));
  auto reports = rec->close_window(1, 2, 1000);
  ASSERT_EQ(reports.size(), (kArcs + protocol::kMaxLoadEntries - 1) / protocol::kMaxLoadEntries);
  std::set<uint64_t> seen;
  for (size_t i = 0; i < reports.size(); ++i) {
    EXPECT_EQ(reports[i].part, i);
    EXPECT_EQ(reports[i].parts, reports.size());
    EXPECT_EQ(reports[i].bytes_in, kArcs * (kArcs + 1) / 2);  // totals in every part
    const auto bytes = protocol::encode(reports[i]);
    EXPECT_LE(bytes.size(), 8192u);
    auto back = protocol::decode(bytes);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    for (const auto& a : std::get<LoadReport>(*back).arcs)
      EXPECT_TRUE(seen.insert(a.lo).second);
  }
  EXPECT_EQ(seen.size(), kArcs);
}

TEST(LoadRecorder, SamplesTheRingOverwroteAreReportedLost) {
  auto rec = *LoadRecorder::make(Role::kServer, 16);
  for (int i = 0; i < 100; ++i)
    rec->record(1, LoadMetric::kBytesIn, 1);
  auto r = rec->close_window(0, 0, 1);
  EXPECT_EQ(r[0].bytes_in, 16u);
  EXPECT_EQ(r[0].lost_samples, 84u);
  EXPECT_EQ(rec->close_window(0, 0, 1)[0].lost_samples, 0u);  // counted once
}

TEST(LoadRecorder, OccupancyCountsOverlappingServiceOnceAndSplitsAtWindows) {
  using namespace std::chrono_literals;
  ManualClock clock;
  auto rec = *LoadRecorder::make(Role::kServer, LoadRecorder::kDefaultCapacity, TimeSource(&clock));
  EXPECT_EQ(rec->close_window(0, 0, 1)[0].busy_ns, 0u);  // idle
  clock.advance(5ms);                                    // idle time is not occupied
  rec->begin_service();
  clock.advance(3ms);
  rec->begin_service();  // overlapping requests: one busy period
  clock.advance(20ms);
  rec->end_service();
  clock.advance(1ms);
  // Still in service: the window gets the busy period up to its close.
  EXPECT_EQ(rec->close_window(0, 0, 1)[0].busy_ns, 24'000'000u);
  clock.advance(10ms);
  rec->end_service();
  clock.advance(7ms);  // idle after the period ended
  EXPECT_EQ(rec->close_window(0, 0, 1)[0].busy_ns, 10'000'000u);
  clock.advance(2ms);
  EXPECT_EQ(rec->close_window(0, 0, 1)[0].busy_ns, 0u);  // idle again
  rec->end_service();                                    // unbalanced: ignored
  clock.advance(2ms);
  EXPECT_EQ(rec->close_window(0, 0, 1)[0].busy_ns, 0u);
}

TEST(LoadRecorder, WorkersReportEachServersAnswers) {
  auto rec = *LoadRecorder::make(Role::kWorker);
  for (int i = 1; i <= 100; ++i)
    rec->record(2, LoadMetric::kAnswerNs, i * 1000.0);
  rec->record(2, LoadMetric::kPushedBytes, 4096);
  rec->record(0, LoadMetric::kPushedBytes, 8);
  auto r = rec->close_window(5, 1, 1000)[0];
  EXPECT_EQ(r.role, Role::kWorker);
  ASSERT_EQ(r.peers.size(), 2u);
  EXPECT_EQ(r.peers[0].server, 0u);
  EXPECT_EQ(r.peers[0].bytes, 8u);
  EXPECT_EQ(r.peers[0].answers, 0u);
  EXPECT_EQ(r.peers[1].server, 2u);
  EXPECT_EQ(r.peers[1].answers, 100u);
  EXPECT_EQ(r.peers[1].mean_ns, 50'500u);
  EXPECT_EQ(r.peers[1].p99_ns, 99'000u);
}

TEST(WorkerPeers, EveryServerUntilTheJobIsLargeThenASampleOfFixedSize) {
  EXPECT_EQ(worker_peer_limit(0, 4, 4), 0u);  // all
  EXPECT_EQ(worker_peer_limit(0, 64, 1024), 0u);
  EXPECT_EQ(worker_peer_limit(0, 10'000, 1024), 6u);
  EXPECT_EQ(worker_peer_limit(0, 65'536, 1024), 4u);
  EXPECT_EQ(worker_peer_limit(16, 4, 4), 16u);
}

TEST(WorkerPeers, TheSlowestAlwaysAndEveryServerCoveredEachWindow) {
  constexpr uint32_t kServers = 1024, kWorkers = 10'000;
  const size_t limit = worker_peer_limit(0, kWorkers, kServers);
  std::vector<protocol::PeerLoad> all;
  for (uint32_t s = 0; s < kServers; ++s)
    all.push_back({s, 100, 1, 1000 + (s == 77 ? 5000u : s % 13), 2000});
  for (uint64_t window : {0u, 1u, 9u}) {
    std::vector<size_t> named(kServers, 0);
    for (uint32_t w = 0; w < kWorkers; ++w) {
      auto peers = all;
      sample_peers(peers, limit, w, window);
      ASSERT_LE(peers.size(), limit);
      ASSERT_GE(peers.size(), limit - 1);
      ASSERT_TRUE(std::is_sorted(peers.begin(), peers.end(),
                                 [](const auto& a, const auto& b) { return a.server < b.server; }));
      bool slowest = false;
      for (const auto& p : peers) {
        ++named[p.server];
        slowest = slowest || p.server == 77;
      }
      ASSERT_TRUE(slowest) << "worker " << w;
    }
    // (limit - 1) x workers rotating entries over 1,024 servers: 48 or 49 each.
    const size_t even = (limit - 1) * kWorkers / kServers;
    for (uint32_t s = 0; s < kServers; ++s) {
      if (s == 77) continue;
      EXPECT_GE(named[s], even) << "server " << s;
      EXPECT_LE(named[s], even + 1) << "server " << s;
    }
  }
  // One worker names every server within ceil(1,023 / 5) windows.
  std::set<uint32_t> seen;
  for (uint64_t window = 0; window < (kServers + limit - 2) / (limit - 1); ++window) {
    auto peers = all;
    sample_peers(peers, limit, 3, window);
    for (const auto& p : peers)
      seen.insert(p.server);
  }
  EXPECT_EQ(seen.size(), kServers);
}

TEST(WorkerPeers, ARecorderWithALimitReportsThatMany) {
  auto rec = *LoadRecorder::make(Role::kWorker);
  rec->set_peer_limit(4);
  for (uint64_t s = 0; s < 100; ++s) {
    rec->record(s, LoadMetric::kPushedBytes, 10);
    rec->record(s, LoadMetric::kAnswerNs, s == 42 ? 1e6 : 1e3);
  }
  auto reports = rec->close_window(1, 0, 100'000'000);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].bytes_out, 1000u);  // the totals count every server
  ASSERT_EQ(reports[0].peers.size(), 4u);
  bool slowest = false;
  for (const auto& p : reports[0].peers)
    slowest = slowest || p.server == 42;
  EXPECT_TRUE(slowest);
}

LoadReport server_report(uint32_t rank, uint64_t window, const std::vector<uint64_t>& arcs) {
  LoadReport r;
  r.role = Role::kServer;
  r.rank = rank;
  r.window = window;
  r.bytes_in = 10;
  for (uint64_t lo : arcs)
    r.arcs.push_back({lo, 1, 2, 3, 4});
  return r;
}

TEST(LoadHistory, KeepsTheRecentWindowsOfEachServerAndEachArcsLoad) {
  LoadHistory h(LoadHistory::Options{4, 100});
  for (uint64_t w = 0; w < 10; ++w)
    h.ingest(server_report(1, w, {0x10, 0x20}));
  ASSERT_NE(h.server(1), nullptr);
  EXPECT_EQ(h.server(1)->size(), 4u);
  EXPECT_EQ(h.server(1)->front().window, 6u);
  EXPECT_EQ(h.server(1)->back().window, 9u);
  EXPECT_EQ(h.server(0), nullptr);
  ASSERT_EQ(h.num_arcs(), 2u);
  const ArcLoadRecord* a = h.arc(0x10);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->server, 1u);
  EXPECT_EQ(a->window, 9u);
  EXPECT_EQ(a->windows, 10u);  // every window since the start: none taken yet
  EXPECT_EQ(a->bytes_in, 10u);
  EXPECT_EQ(a->bytes_out, 20u);
  EXPECT_EQ(a->busy_ns, 30u);
  EXPECT_EQ(a->requests, 40u);
  EXPECT_EQ(h.arc(0x30), nullptr);
  // Part 1 of a window adds entries, not a second copy of the totals.
  LoadReport part = server_report(1, 10, {0x30});
  part.part = 1;
  part.parts = 2;
  h.ingest(part);
  EXPECT_EQ(h.server(1)->back().window, 9u);
  ASSERT_NE(h.arc(0x30), nullptr);
  EXPECT_EQ(h.arc(0x30)->bytes_in, 1u);
}

TEST(LoadHistory, TakingAnArcsLoadClearsItAndANewEpochStartsItAgain) {
  LoadHistory h;
  LoadReport r = server_report(1, 0, {0x10, 0x20});
  r.epoch = 3;
  h.ingest(r);
  r.window = 1;
  h.ingest(r);
  std::map<uint64_t, uint64_t> taken;
  // Another epoch's take sees nothing, and clears.
  h.take_arcs(2, [&](const ArcLoadRecord& a) { taken[a.lo] += a.bytes_in; });
  EXPECT_TRUE(taken.empty());
  h.ingest(r);
  h.take_arcs(3, [&](const ArcLoadRecord& a) { taken[a.lo] += a.bytes_in; });
  EXPECT_EQ(taken, (std::map<uint64_t, uint64_t>{{0x10, 1}, {0x20, 1}}));
  taken.clear();
  h.take_arcs(3, [&](const ArcLoadRecord& a) { taken[a.lo] += a.bytes_in; });
  EXPECT_TRUE(taken.empty());  // nothing since the take
  EXPECT_EQ(h.arc(0x10)->total_in, 3u);
  // The arc moves to server 2 at epoch 4; a late part of epoch 3 from
  // server 1 changes nothing.
  LoadReport moved = server_report(2, 0, {0x10});
  moved.epoch = 4;
  h.ingest(moved);
  h.ingest(r);
  const ArcLoadRecord* a = h.arc(0x10);
  EXPECT_EQ(a->server, 2u);
  EXPECT_EQ(a->epoch, 4u);
  EXPECT_EQ(a->total_in, 1u);
  h.take_arcs(4, [&](const ArcLoadRecord& rec) { taken[rec.lo] += rec.bytes_in; });
  EXPECT_EQ(taken, (std::map<uint64_t, uint64_t>{{0x10, 1}}));
}

TEST(LoadHistory, FindsEveryArcOfAMillion) {
  LoadHistory h;
  std::vector<uint64_t> los;
  uint64_t x = 88172645463325252ull;
  for (int i = 0; i < 1'000'000; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    los.push_back(x);
  }
  for (size_t i = 0; i < los.size(); i += 160) {
    const size_t end = std::min(los.size(), i + 160);
    h.ingest(server_report(static_cast<uint32_t>(i % 7), 0, {los.begin() + i, los.begin() + end}));
  }
  EXPECT_EQ(h.num_arcs(), los.size());
  for (uint64_t lo : los) {
    const ArcLoadRecord* a = h.arc(lo);
    ASSERT_NE(a, nullptr);
    ASSERT_EQ(a->lo, lo);
  }
  EXPECT_EQ(h.arc(12345), nullptr);
  // A take gives them in the order of lo; arcs added later merge into it.
  const auto take = [&] {
    std::vector<uint64_t> order;
    h.take_arcs(0, [&](const ArcLoadRecord& a) { order.push_back(a.lo); });
    return order;
  };
  std::vector<uint64_t> order = take();
  ASSERT_EQ(order.size(), los.size());
  EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
  EXPECT_TRUE(take().empty());
  std::vector<uint64_t> more;
  for (uint64_t i = 1; i <= 1000; ++i)
    more.push_back(i * 0x0123456789ull);
  h.ingest(server_report(1, 1, {more.begin(), more.begin() + 160}));
  h.ingest(server_report(1, 1, {los.begin(), los.begin() + 10}));
  for (size_t i = 160; i < more.size(); i += 160) {
    h.ingest(
        server_report(1, 1, {more.begin() + i, more.begin() + std::min(more.size(), i + 160)}));
  }
  order = take();
  EXPECT_EQ(order.size(), more.size() + 10);
  EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
  for (uint64_t lo : more)
    ASSERT_NE(h.arc(lo), nullptr);
  ASSERT_NE(h.arc(los[5]), nullptr);
  EXPECT_EQ(h.arc(los[5])->total_in, 2u);
}

TEST(LoadHistory, MemoryIsBoundedWhateverTheJobLength) {
  constexpr size_t kServerWindows = 16, kMaxArcs = 1000;
  LoadHistory h(LoadHistory::Options{kServerWindows, kMaxArcs});
  size_t peak = 0;
  // 100,000 windows from 8 servers; the arcs change every window (as after
  // placement changes), and workers report on every server.
  for (uint64_t w = 0; w < 100'000; ++w) {
    const uint32_t server = static_cast<uint32_t>(w % 8);
    h.ingest(server_report(server, w, {w * 3, w * 3 + 1, w * 3 + 2}));
    LoadReport worker;
    worker.role = Role::kWorker;
    worker.rank = static_cast<uint32_t>(w % 4);
    worker.window = w;
    worker.peers.push_back({server, 100, 1, 10, 20});
    h.ingest(worker);
    peak = std::max(peak, h.entries());
  }
  EXPECT_LE(h.num_arcs(), kMaxArcs);
  const size_t bound = 8 * kServerWindows + 8 * kServerWindows * 4 + kMaxArcs;
  EXPECT_LE(peak, bound);
  // The newest arcs survived eviction, and the index still finds them.
  EXPECT_NE(h.arc(99'999 * 3), nullptr);
  EXPECT_NE(h.arc(99'999 * 3 + 2), nullptr);
  EXPECT_EQ(h.arc(0), nullptr);
  EXPECT_GT(h.num_arcs(), kMaxArcs / 2);
}

}  // namespace
}  // namespace psld
