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

}  // namespace
}  // namespace psld::sim
