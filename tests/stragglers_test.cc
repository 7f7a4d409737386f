// The straggler benchmark's pure part: the policies' placements, the oracle,
// the scenarios' phases and the settle measure.
#include "bench/stragglers.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>

namespace psld::bench {
namespace {

std::vector<ModelTensor> tensors_of(std::initializer_list<uint64_t> real, double scale = 1) {
  std::vector<TensorSpec> specs;
  for (uint64_t n : real)
    specs.push_back({"t" + std::to_string(specs.size()), {n}, n});
  return scale_profile(specs, scale);
}

std::map<ServerId, uint64_t> bytes_per_server(const std::vector<ModelKey>& keys,
                                              const std::vector<ServerId>& owners) {
  std::map<ServerId, uint64_t> out;
  for (size_t i = 0; i < keys.size(); ++i)
    out[owners[i]] += keys[i].bytes;
  return out;
}

TEST(Stragglers, ScalingKeepsAtLeastOneElementAndTheRealSize) {
  auto t = tensors_of({64, 3200, 102760448}, 1.0 / 32);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].elements, 2u);
  EXPECT_EQ(t[0].real_elements, 64u);
  EXPECT_EQ(t[1].elements, 100u);
  EXPECT_EQ(t[2].elements, 3211264u);
  EXPECT_EQ(tensors_of({1}, 1e-6)[0].elements, 1u);
}

TEST(Stragglers, KeysCutTensorsIntoChunksWithConsecutiveIds) {
  auto t = tensors_of({10, 25});  // 40 and 100 bytes
  auto keys = model_keys(t, 32, 7);
  ASSERT_EQ(keys.size(), 2u + 4u);
  EXPECT_EQ(keys[0].key, make_key(7, 0));
  EXPECT_EQ(keys[1].key, make_key(7, 1));
  EXPECT_EQ(keys[1].bytes, 8u);
  EXPECT_EQ(keys[2].key, make_key(8, 0));
  EXPECT_EQ(keys[5].bytes, 4u);
  EXPECT_EQ(keys[5].chunks, 4u);
  uint64_t total = 0;
  for (const auto& k : keys)
    total += k.bytes;
  EXPECT_EQ(total, 140u);
}

TEST(Stragglers, MxnetHashesSmallArraysAndSplitsBigOnesEvenly) {
  // Small arrays: (index * 9973) % n. The big one (real size >= 1e6) is split
  // into n runs of its chunks, whatever its scaled size.
  auto t = tensors_of({10, 10, 10, 2000000}, 1.0 / 1000);  // the big one: 2000 elements
  auto keys = model_keys(t, 400);                          // 20 chunks
  auto owners = mxnet_owners(t, keys, 4);
  EXPECT_EQ(owners[0], 0u);
  EXPECT_EQ(owners[1], 9973u % 4);
  EXPECT_EQ(owners[2], (2 * 9973u) % 4);
  std::map<ServerId, int> chunks;
  for (size_t i = 3; i < keys.size(); ++i)
    ++chunks[owners[i]];
  EXPECT_EQ(chunks, (std::map<ServerId, int>{{0, 5}, {1, 5}, {2, 5}, {3, 5}}));
  // Runs of consecutive chunks.
  for (size_t i = 4; i < keys.size(); ++i)
    EXPECT_GE(owners[i], owners[i - 1]);
}

TEST(Stragglers, BytePsHashesEveryPartitionWithDjb2) {
  EXPECT_EQ(djb2(""), 5381u);
  EXPECT_EQ(djb2("0"), 5381u * 33 + '0');
  EXPECT_EQ(djb2("65536"),
            ((((uint64_t{5381} * 33 + '6') * 33 + '5') * 33 + '5') * 33 + '3') * 33 + '6');
  auto t = tensors_of({10, 40});
  auto keys = model_keys(t, 40);  // tensor 0: 1 chunk; tensor 1: 4 chunks
  auto owners = byteps_owners(keys, 3);
  EXPECT_EQ(owners[0], djb2("0") % 3);
  EXPECT_EQ(owners[1], djb2("65536") % 3);  // tensor 1 << 16 | chunk 0
  EXPECT_EQ(owners[4], djb2("65539") % 3);
}

TEST(Stragglers, RoundRobinGivesWholeTensorsInTurn) {
  auto t = tensors_of({10, 100, 10, 10, 10});
  auto keys = model_keys(t, 40);
  auto owners = round_robin_owners(keys, 3);
  for (size_t i = 0; i < keys.size(); ++i)
    EXPECT_EQ(owners[i], keys[i].tensor % 3);
}

TEST(Stragglers, OracleSplitsInProportionToCapacity) {
  // 400 equal keys, capacities 1, 1, 1, 0.25: loads 4 : 4 : 4 : 1.
  std::vector<ModelTensor> t(400, ModelTensor{"x", 1024, 1024});
  auto keys = model_keys(t, 4096);
  CapacityPhase phase{1, {1, 1, 1, 0.25}};
  auto owners = oracle_owners(keys, {phase});
  auto load = bytes_per_server(keys, owners);
  EXPECT_NEAR(static_cast<double>(load[3]) / static_cast<double>(load[0]), 0.25, 0.02);
  EXPECT_NEAR(static_cast<double>(load[1]) / static_cast<double>(load[0]), 1.0, 0.02);
  // And it predicts no worse than any baseline on the same keys.
  const double best = predicted_round(keys, owners, phase);
  EXPECT_LE(best, predicted_round(keys, round_robin_owners(keys, 4), phase));
  EXPECT_LE(best, predicted_round(keys, byteps_owners(keys, 4), phase));
}

TEST(Stragglers, OracleWeighsPhasesByTheirRounds) {
  // Server 1 is slow for most of the run: the static oracle gives it less.
  std::vector<ModelTensor> t(100, ModelTensor{"x", 1024, 1024});
  auto keys = model_keys(t, 4096);
  auto owners = oracle_owners(keys, {{100, {1, 1}}, {900, {1, 0.25}}});
  auto load = bytes_per_server(keys, owners);
  EXPECT_LT(load[1], load[0] / 2);
  // A server with no capacity gets nothing.
  owners = oracle_owners(keys, {{1, {1, 0}}});
  EXPECT_EQ(bytes_per_server(keys, owners).count(1), 0u);
}

TEST(Stragglers, OracleGivesASlowServerItsShareInTheSmallestKeys) {
  // 40 keys of 128 KiB and 1,000 of 1 KiB; server 3 at a quarter. Its share
  // is what the greedy gives it, but made of small keys: one big key would
  // be a long tail of pulls behind its slow link.
  std::vector<ModelTensor> t(40, ModelTensor{"big", 32768, 32768});
  t.insert(t.end(), 1000, ModelTensor{"small", 256, 256});
  auto keys = model_keys(t, 128 * 1024);
  CapacityPhase phase{1, {1, 1, 1, 0.25}};
  auto owners = oracle_owners(keys, {phase});
  auto load = bytes_per_server(keys, owners);
  EXPECT_NEAR(static_cast<double>(load[3]) / static_cast<double>(load[0]), 0.25, 0.05);
  uint64_t largest_slow = 0, smallest_fast = UINT64_MAX;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (owners[i] == 3) {
      largest_slow = std::max(largest_slow, keys[i].bytes);
    } else {
      smallest_fast = std::min(smallest_fast, keys[i].bytes);
    }
  }
  EXPECT_EQ(largest_slow, 1024u);
  EXPECT_EQ(smallest_fast, 1024u);  // the small keys left over share the rest
  // Its predicted round stays that of an even split by capacity.
  const double total = 40.0 * 128 * 1024 + 1000.0 * 1024;
  EXPECT_LE(predicted_round(keys, owners, phase), total / 3.25 + 128 * 1024);
  // Servers as fast as the fastest keep the greedy's keys: no slow server,
  // no change.
  CapacityPhase even{1, {1, 1, 1, 1}};
  owners = oracle_owners(keys, {even});
  for (const auto& [server, bytes] : bytes_per_server(keys, owners))
    EXPECT_NEAR(static_cast<double>(bytes), total / 4, 128.0 * 1024) << server;
}

TEST(Stragglers, StaticPlacementIsEpochZeroWithEveryKeyWhereTheOwnersSay) {
  auto t = tensors_of({5000, 70, 123456});
  auto keys = model_keys(t, 4096);
  auto owners = byteps_owners(keys, 4);
  auto p = static_placement(keys, owners, 4);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->epoch(), 0u);
  EXPECT_EQ(p->servers().size(), 4u);
  for (size_t i = 0; i < keys.size(); ++i)
    EXPECT_EQ(p->owner_of_key(keys[i].key), owners[i]) << i;
  // Bad input is an error, not a crash.
  EXPECT_FALSE(static_placement(keys, std::vector<ServerId>(keys.size(), 9), 4).ok());
  EXPECT_FALSE(static_placement(keys, {}, 4).ok());
}

TEST(Stragglers, SettleCountsRoundsUntilTheMedianStaysNearTheLevel) {
  // 30 slow rounds, then 70 at the level 10 ms with noise within 5%.
  std::vector<double> ms(30, 100.0);
  ms.reserve(100);
  for (int i = 0; i < 70; ++i)
    ms.push_back(i % 2 ? 10.4 : 9.6);
  auto s = rounds_to_settle(ms, 0, ms.size());
  ASSERT_TRUE(s.has_value());
  EXPECT_GE(*s, 25u);  // the first window whose median is fast starts at 25
  EXPECT_LE(*s, 30u);
  // A later phase is measured from its own start.
  for (int i = 0; i < 10; ++i)
    ms.push_back(50);
  for (int i = 0; i < 40; ++i)
    ms.push_back(20);
  s = rounds_to_settle(ms, 100, ms.size());
  ASSERT_TRUE(s.has_value());
  EXPECT_GE(*s, 5u);
  EXPECT_LE(*s, 10u);
  // A flat phase settles at once; a too-short one cannot tell.
  EXPECT_EQ(rounds_to_settle(std::vector<double>(50, 7.0), 0, 50), 0u);
  EXPECT_FALSE(rounds_to_settle(ms, 0, 15).has_value());
  // A spike late in the phase that lasts a whole window un-settles it.
  std::vector<double> spike(100, 10.0);
  for (int i = 60; i < 75; ++i)
    spike[i] = 40;
  s = rounds_to_settle(spike, 0, spike.size());
  ASSERT_TRUE(s.has_value());
  EXPECT_GE(*s, 70u);
}

TEST(Stragglers, ScenariosAndTheirPhases) {
  auto all = default_scenarios();
  ASSERT_EQ(all.size(), 5u);
  const Scenario& s2 = all[1];
  EXPECT_EQ(s2.id, "S2");
  auto phases = capacity_phases(s2, 4);
  ASSERT_EQ(phases.size(), 3u);
  EXPECT_EQ(phases[0].rounds, 199);  // rounds 1..199
  EXPECT_EQ(phases[1].rounds, 400);  // 200..599
  EXPECT_EQ(phases[2].rounds, 201);  // 600..800
  EXPECT_EQ(phases[0].capacity, (std::vector<double>{1, 1, 1, 1}));
  EXPECT_EQ(phases[1].capacity, (std::vector<double>{1, 0.25, 1, 1}));
  EXPECT_EQ(phases[2].capacity, (std::vector<double>{1, 1, 0.25, 1}));
  // S1's straggler is there from the start: one phase.
  auto p1 = capacity_phases(all[0], 4);
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_EQ(p1[0].rounds, 300);
  EXPECT_EQ(p1[0].capacity, (std::vector<double>{0.25, 1, 1, 1}));
  // Fewer rounds: the events keep their fraction of the run.
  Scenario short2 = with_rounds(s2, 80);
  EXPECT_EQ(short2.events[0].round, 20u);
  EXPECT_EQ(short2.events[1].round, 60u);
  EXPECT_EQ(capacity_phases(short2, 4).size(), 3u);
  // S5's oracle may use the standby server: 4 servers, none slow.
  EXPECT_EQ(capacity_phases(all[4], 4)[0].capacity, (std::vector<double>{1, 1, 1, 1}));
}

}  // namespace
}  // namespace psld::bench
