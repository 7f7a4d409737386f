// psld sim (tools/sim): traces, determinism, the scenarios' shape, and
// properties of the real balancer over many random simulated clusters.
#include "tools/sim/sim.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "base/hash.h"
#include "bench/profiles.h"
#include "tests/temp_dir.h"

namespace psld::sim {
namespace {

using bench::CapacityEvent;
using bench::Policy;

std::vector<bench::ModelTensor> resnet(double scale = 1.0 / 32) {
  auto profile = bench::load_profile("resnet50");
  EXPECT_TRUE(profile.ok()) << profile.status().to_string();
  return bench::scale_profile(*profile, scale);
}

SimOptions scenario_options(const bench::Scenario& sc, Policy policy) {
  auto profile = bench::load_profile(sc.profile);
  EXPECT_TRUE(profile.ok());
  const auto tensors = bench::scale_profile(*profile, sc.scale);
  SimOptions o;
  o.servers = sc.servers;
  o.standby = sc.standby;
  o.rounds = sc.rounds;
  o.resource = sc.resource;
  o.events = sc.events;
  o.keys = bench::model_keys(tensors, bench::chunk_bytes_for(policy, sc.scale));
  o.balance = policy == Policy::kPsld;
  if (policy == Policy::kMxnet) {
    auto p =
        bench::static_placement(o.keys, bench::mxnet_owners(tensors, o.keys, o.servers), o.servers);
    EXPECT_TRUE(p.ok());
    o.initial = std::make_shared<const Placement>(*p);
  }
  return o;
}

bench::Scenario scenario(const std::string& id) {
  for (const bench::Scenario& s : bench::default_scenarios())
    if (s.id == id) return s;
  ADD_FAILURE() << "no scenario " << id;
  return {};
}

double rounds_per_s(const SimResult& r) {
  return static_cast<double>(r.run.round_ms.size()) / r.run.seconds;
}

TEST(SimTrace, StepMovingOscillateWalkAndFile) {
  auto step = parse_trace("step:2:100:0.25", 4, 300, 1);
  ASSERT_TRUE(step.ok()) << step.status().to_string();
  ASSERT_EQ(step->size(), 1u);
  EXPECT_EQ((*step)[0].round, 100u);
  EXPECT_EQ((*step)[0].server, 2u);
  EXPECT_DOUBLE_EQ((*step)[0].factor, 0.25);

  // A straggler at 0.5 moves 0 -> 1 -> 2 every 100 rounds; the one it
  // leaves recovers at the same round.
  auto moving = parse_trace("moving:0.5:100", 3, 250, 1);
  ASSERT_TRUE(moving.ok());
  std::map<ServerId, double> at_150, at_250;
  for (const CapacityEvent& e : *moving) {
    if (e.round <= 150) at_150[e.server] = e.factor;
    if (e.round <= 250) at_250[e.server] = e.factor;
  }
  EXPECT_DOUBLE_EQ(at_150[0], 1.0);
  EXPECT_DOUBLE_EQ(at_150[1], 0.5);
  EXPECT_DOUBLE_EQ(at_250[1], 1.0);
  EXPECT_DOUBLE_EQ(at_250[2], 0.5);

  auto osc = parse_trace("oscillate:1:0.25:50", 4, 200, 1);
  ASSERT_TRUE(osc.ok());
  ASSERT_EQ(osc->size(), 5u);
  EXPECT_DOUBLE_EQ((*osc)[0].factor, 0.25);
  EXPECT_DOUBLE_EQ((*osc)[1].factor, 1.0);
  EXPECT_EQ((*osc)[1].round, 50u);

  auto walk = parse_trace("walk:0.1:0.2", 2, 100, 7);
  ASSERT_TRUE(walk.ok());
  EXPECT_EQ(walk->size(), 200u);
  for (const CapacityEvent& e : *walk) {
    EXPECT_GE(e.factor, 0.2 - 1e-12);
    EXPECT_LE(e.factor, 1.0);
  }
  auto again = parse_trace("walk:0.1:0.2", 2, 100, 7);
  ASSERT_TRUE(again.ok());
  for (size_t i = 0; i < walk->size(); ++i)
    EXPECT_EQ((*walk)[i].factor, (*again)[i].factor) << "the walk depends only on the seed";

  psld::testing::TempDir dir("psld-sim");
  const std::string path = dir.path() + "/trace.txt";
  std::ofstream(path) << "# round server factor\n0 1 0.5\n\n120 1 1  # recovers\n";
  auto file = parse_trace("file:" + path, 4, 300, 1);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  ASSERT_EQ(file->size(), 2u);
  EXPECT_EQ((*file)[1].round, 120u);
}

TEST(SimTrace, BadSpecsAreRefusedWithTheReason) {
  const std::pair<const char*, const char*> bad[] = {
      {"step:9:0:0.5", "from 0 to 3"},           {"step:1:0:0", "above 0"},
      {"step:1:x:0.5", "not a number"},          {"moving:0.5:0", "PERIOD must be above 0"},
      {"walk:2:0.5", "SIGMA in (0, 1]"},         {"noise:1", "expected step:"},
      {"file:/nonexistent/t", "cannot be read"},
  };
  for (const auto& [spec, why] : bad) {
    auto r = parse_trace(spec, 4, 300, 1);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_NE(r.status().message().find(why), std::string::npos)
        << spec << ": " << r.status().message();
  }
  psld::testing::TempDir dir("psld-sim");
  const std::string path = dir.path() + "/bad.txt";
  std::ofstream(path) << "0 1\n";
  auto r = parse_trace("file:" + path, 4, 300, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(":1: expected 'ROUND SERVER FACTOR'"), std::string::npos)
      << r.status().message();
}

TEST(Sim, BadOptionsAreRefused) {
  SimOptions o;
  EXPECT_FALSE(simulate(o).ok()) << "no keys";
  o.keys = bench::model_keys(resnet(), 128000);
  o.events = {{0, 7, 0.5}};
  auto r = simulate(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("names server 7"), std::string::npos);
}

TEST(Sim, SameSeedSameRunAndNoiseDependsOnIt) {
  SimOptions o = scenario_options(scenario("S2"), Policy::kPsld);
  o.noise = 1;
  o.seed = 11;
  auto a = simulate(o);
  auto b = simulate(o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->run.round_ms, b->run.round_ms);
  ASSERT_EQ(a->steps.size(), b->steps.size());
  for (size_t i = 0; i < a->steps.size(); ++i)
    EXPECT_EQ(a->steps[i].reason, b->steps[i].reason);
  o.seed = 12;
  auto c = simulate(o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->run.round_ms, c->run.round_ms);
}

// S1 without noise: the balancer takes the load off the slow server, and the
// job ends far faster than MXNet's static placement, near the oracle's split.
TEST(Sim, S1TheBalancerMovesTheLoadOffTheStraggler) {
  const bench::Scenario sc = scenario("S1");
  auto mxnet = simulate(scenario_options(sc, Policy::kMxnet));
  auto psld = simulate(scenario_options(sc, Policy::kPsld));
  ASSERT_TRUE(mxnet.ok() && psld.ok());
  EXPECT_EQ(mxnet->run.switches, 0u);
  EXPECT_TRUE(mxnet->steps.empty());
  EXPECT_GT(rounds_per_s(*psld), 2 * rounds_per_s(*mxnet));
  EXPECT_GE(psld->run.switches, 1u);
  EXPECT_GT(psld->migrated_bytes, 0);
  // Server 0 runs at a quarter of the others: 1/13 of the model is its fair share.
  EXPECT_LT(psld->run.final_shares[0], 0.12);
  EXPECT_GT(psld->reports, 0u);
  EXPECT_GT(psld->decisions, 10u);
}

// S5: the job has a standby server; only psld may use it, by scaling out.
TEST(Sim, StandbyServersReportButHoldNothingUntilAdded) {
  SimOptions o = scenario_options(scenario("S5"), Policy::kPsld);
  o.balance = false;
  auto r = simulate(o);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->run.final_shares.size(), 4u);
  EXPECT_EQ(r->run.final_shares[3], 0.0);
  EXPECT_EQ(r->final_placement->find_server(3), nullptr);
}

// Under ASan and UBSan (build-asan, the unit suite in CI) the large cases
// run shorter: the same code, a fraction of the rounds or clusters.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// Workers' reports cut to a sample (stats.worker_peers, here automatic: 2,000
// workers x 64 servers is past 65,536 entries a window) leave every decision
// as it is with every worker naming every server: the balancer reads the
// servers' windows and the workers' rounds, which every report carries.
TEST(Sim, SampledWorkerReportsMakeTheDecisionsOfFullOnes) {
  SimOptions o;
  o.workers = 2000;
  o.servers = 64;
  o.rounds = kSanitized ? 150 : 300;  // 47 s under the sanitizers at 300
  o.capacity = 12.5e9;
  o.cores = 0;
  o.chunk_s = 1e-6;
  o.noise = 0.5;
  o.keys = bench::model_keys(resnet(1.0 / 4), 64 << 10);
  o.events = {CapacityEvent{0, 3, 0.25}, CapacityEvent{o.rounds / 2, 17, 0.5}};
  o.balance = true;
  o.stats_interval_s = 0.1;
  o.balancer_interval_s = 1.0;
  SimOptions full = o;
  full.worker_peers = 65536;
  auto sampled = simulate(o);
  auto every = simulate(full);
  ASSERT_TRUE(sampled.ok()) << sampled.status().to_string();
  ASSERT_TRUE(every.ok()) << every.status().to_string();
  EXPECT_EQ(sampled->worker_reports, every->worker_reports);
  EXPECT_GT(sampled->worker_reports, 0u);
  // 32 servers (65,536 / 2,000) a report instead of every server pushed to.
  EXPECT_LE(sampled->peer_entries, sampled->worker_reports * 32);
  EXPECT_GT(every->peer_entries, sampled->peer_entries * 3 / 2);
  ASSERT_GE(sampled->steps.size(), 1u);  // the balancer acted: the comparison says something
  ASSERT_EQ(sampled->steps.size(), every->steps.size());
  for (size_t i = 0; i < sampled->steps.size(); ++i) {
    EXPECT_EQ(sampled->steps[i].round, every->steps[i].round);
    EXPECT_EQ(sampled->steps[i].reason, every->steps[i].reason);
  }
  EXPECT_EQ(sampled->run.round_ms, every->run.round_ms);
}

// ---- Properties of the real balancer over many random simulated clusters.

struct ClusterCase {
  SimOptions options;
  std::string name;
};

// Cluster `seed`: 2-8 servers (sometimes a standby), each at a constant
// capacity of 0.2-1x from the start, ResNet-50 or VGG-16, noise 0, 0.5 or 1.
ClusterCase random_cluster(uint64_t seed, const std::vector<bench::ModelTensor>& resnet,
                           const std::vector<bench::ModelTensor>& vgg) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  ClusterCase c;
  SimOptions& o = c.options;
  o.servers = 2 + static_cast<uint32_t>(rng() % 7);
  o.standby = rng() % 4 == 0 ? 1 : 0;
  o.workers = 1 + static_cast<uint32_t>(rng() % 8);
  o.rounds = 200;
  const bool big = rng() % 2 == 0;
  o.keys = bench::model_keys(big ? vgg : resnet, big ? 32000 : 128000);
  o.noise = 0.5 * static_cast<double>(rng() % 3);
  o.seed = seed;
  o.balance = true;
  for (ServerId id = 0; id < o.servers; ++id) {
    if (u(rng) < 0.4) o.events.push_back({0, id, 0.2 + 0.8 * u(rng)});
  }
  c.name = fmt::format("cluster {}: {} servers + {} standby, {} workers, {}, noise {}", seed,
                       o.servers, o.standby, o.workers, big ? "vgg16" : "resnet50", o.noise);
  return c;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

TEST(SimProperties, ManyRandomClustersStayOwnedCalmAndNoWorseThanWhereTheyStarted) {
  const auto r50 = resnet();
  auto vgg_profile = bench::load_profile("vgg16");
  ASSERT_TRUE(vgg_profile.ok());
  const auto vgg = bench::scale_profile(*vgg_profile, 1.0 / 128);
  // 1,000 clusters take about 9 s here, and 200 s under ASan and UBSan:
  // 150 of them there.
  const uint64_t clusters = kSanitized ? 150 : 1000;
  size_t balanced = 0;
  size_t restless = 0;       // clusters with more than 3 switches in their second half
  size_t late_switches = 0;  // all clusters' switches in their second half
  for (uint64_t seed = 1; seed <= clusters; ++seed) {
    ClusterCase c = random_cluster(seed, r50, vgg);
    SCOPED_TRACE(c.name);
    // Every key has one owner, a member; a server that is draining never
    // gains a key.
    std::vector<ServerId> owner;
    std::vector<uint64_t> switch_rounds;
    uint64_t epoch = 0;
    bool owned = true;
    c.options.on_round = [&](uint64_t round, const Placement& p) {
      if (p.epoch() != epoch) {
        epoch = p.epoch();
        switch_rounds.push_back(round);
      }
      for (size_t k = 0; k < c.options.keys.size(); ++k) {
        const ServerId now = p.owner_of_key(c.options.keys[k].key);
        const ServerInfo* info = p.find_server(now);
        if (info == nullptr) owned = false;
        if (k < owner.size() && owner[k] != now && info != nullptr &&
            info->state == ServerState::kDraining) {
          owned = false;
        }
        if (k >= owner.size()) owner.push_back(now);
        owner[k] = now;
      }
    };
    auto psld = simulate(c.options);
    ASSERT_TRUE(psld.ok()) << psld.status().to_string();
    ASSERT_TRUE(owned) << "a key without a member owner, or moved onto a draining server";
    // Constant capacities: the balancer settles and does not oscillate.
    size_t late = 0;
    for (uint64_t r : switch_rounds)
      late += r > c.options.rounds / 2 ? 1 : 0;
    std::string steps;
    for (const SimStep& st : psld->steps)
      steps += fmt::format("\n  round {}: {}", st.round, st.reason.substr(0, 240));
    // No runaway: never more than 6 switches in 100 rounds of constant
    // capacities, and (below) at most 3 in nearly every cluster.
    EXPECT_LE(late, 6u) << "switches in the second half (100 rounds):" << steps;
    restless += late > 3 ? 1 : 0;
    late_switches += late;
    // Once settled, never worse than the placement it started from: the
    // same cluster, noise and seed with the balancer off.
    SimOptions fixed = c.options;
    fixed.balance = false;
    fixed.on_round = nullptr;
    auto start = simulate(fixed);
    ASSERT_TRUE(start.ok());
    const auto& a = psld->run.round_ms;
    const auto& b = start->run.round_ms;
    const double settled = median_of({a.end() - 50, a.end()});
    const double initial = median_of({b.end() - 50, b.end()});
    EXPECT_LE(settled, 1.1 * initial) << "worse than the initial placement once settled";
    balanced += settled < 0.95 * initial ? 1 : 0;
  }
  // Not a test that passes by doing nothing: many clusters start imbalanced.
  EXPECT_GT(balanced, clusters / 4);
  EXPECT_LE(restless, clusters / 50) << "clusters with more than 3 switches in 100 settled rounds";
  EXPECT_LE(late_switches, clusters / 2) << "switches in all clusters' settled halves";
  std::printf(
      "%zu clusters: %zu faster than where they started, %zu with more than 3 switches "
      "in their settled 100 rounds, %zu such switches in all\n",
      static_cast<size_t>(clusters), balanced, restless, late_switches);
}

}  // namespace
}  // namespace psld::sim
