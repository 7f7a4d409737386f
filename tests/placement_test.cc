#include "lib/placement/placement.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/hash.h"

extern char** environ;

namespace psld {
namespace scenarios {
// Defined in placement_emit.cc, which is compiled into this test as well.
Result<std::vector<uint8_t>> placement_scenario_bytes(std::string_view name);
}  // namespace scenarios

namespace {

#define PT_CONCAT_INNER(a, b) a##b
#define PT_CONCAT(a, b) PT_CONCAT_INNER(a, b)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)                     \
  auto tmp = (expr);                                                  \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status().to_string(); \
  lhs = std::move(tmp).value()
// `ASSERT_OK_AND_ASSIGN(auto x, make_x());` declares x or fails the test.
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(PT_CONCAT(result_, __LINE__), lhs, expr)

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
constexpr size_t kNumKeys = 1'000'000;

// 1M pseudo-random keys, the same in every run.
const std::vector<Key>& random_keys() {
  static const std::vector<Key> keys = [] {
    std::vector<Key> k(kNumKeys);
    for (size_t i = 0; i < kNumKeys; ++i)
      k[i] = mix64(i ^ 0x5eed5eed5eedULL);
    return k;
  }();
  return keys;
}

std::vector<ServerId> owners(const Placement& p) {
  const std::vector<Key>& keys = random_keys();
  std::vector<ServerId> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i)
    out[i] = p.owner_of_key(keys[i]);
  return out;
}

std::vector<ServerSpec> equal_servers(size_t n, ServerId first_id = 1) {
  std::vector<ServerSpec> s;
  for (size_t i = 0; i < n; ++i)
    s.push_back({static_cast<ServerId>(first_id + i), 1.0});
  return s;
}

// Keys per server (indexed by server id, ids are small in these tests).
std::vector<size_t> key_counts(const std::vector<ServerId>& own) {
  std::vector<size_t> counts;
  for (ServerId o : own) {
    if (o >= counts.size()) counts.resize(o + 1, 0);
    ++counts[o];
  }
  return counts;
}

// The arcs tile the ring: they start at 0, each starts right after the one
// before, the last ends at 2^64 - 1, and every owner is a member.
void expect_tiles_ring(const Placement& p) {
  ASSERT_GT(p.num_arcs(), 0u);
  EXPECT_EQ(p.arc(0).lo, 0u);
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    const Arc a = p.arc(i);
    ASSERT_LE(a.lo, a.hi) << "arc " << i;
    if (i > 0) {
      ASSERT_EQ(a.lo, p.arc(i - 1).hi + 1) << "arc " << i;
    }
    ASSERT_NE(p.find_server(a.owner), nullptr) << "arc " << i << " owner " << a.owner;
  }
  EXPECT_EQ(p.arc(p.num_arcs() - 1).hi, kMax);
}

// Overwrites the trailing checksum so a crafted buffer passes it and reaches
// the structural checks.
void fix_checksum(std::vector<uint8_t>& b) {
  const uint64_t sum = fnv1a64(std::span<const uint8_t>(b.data(), b.size() - 8));
  for (size_t i = 0; i < 8; ++i)
    b[b.size() - 8 + i] = static_cast<uint8_t>(sum >> (8 * i));
}
void put_u32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
  for (size_t i = 0; i < 4; ++i)
    b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(std::vector<uint8_t>& b, size_t at, uint64_t v) {
  for (size_t i = 0; i < 8; ++i)
    b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// A small placement that has been through a few changes: uneven arcs, a
// draining member, weights other than 1.
Placement small_changed_placement() {
  Placement p = Placement::initial({{1, 1.0}, {2, 2.0}, {5, 0.5}}, 6).value();
  p = p.add_server({8, 1.0}).value().next;
  p = p.isolate_key(make_key(3, 3)).value().next;
  p = p.drain_server(5).value().next;
  return p;
}

// ---- Hashing ------------------------------------------------------------------

TEST(PlacementHash, IsPinnedAcrossBuilds) {
  // Placements travel between processes and versions: the hash of a key must
  // never change. This is splitmix64's first output for seed 0.
  EXPECT_EQ(hash_key(0), 0xe220a8397b1dcdafULL);
  EXPECT_NE(hash_key(1), hash_key(2));
  EXPECT_EQ(fnv1a64(std::span<const uint8_t>()), 0xcbf29ce484222325ULL);
  const uint8_t a = 'a';
  EXPECT_EQ(fnv1a64(std::span<const uint8_t>(&a, 1)), 0xaf63dc4c8601ec8cULL);
}

// ---- Epoch 0 ------------------------------------------------------------------

TEST(PlacementInitial, EqualArcsTileTheRingInProportionToWeight) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial({{3, 1.0}, {1, 2.0}, {2, 0.001}}, 100));
  EXPECT_EQ(p.epoch(), 0u);
  // round(100 * w) virtual nodes, at least one.
  ASSERT_EQ(p.num_arcs(), 100u + 200u + 1u);
  expect_tiles_ring(p);
  EXPECT_EQ(p.arcs_of(1).size(), 200u);
  EXPECT_EQ(p.arcs_of(3).size(), 100u);
  EXPECT_EQ(p.arcs_of(2).size(), 1u);
  const uint64_t w0 = p.arc(0).hi - p.arc(0).lo;
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    const uint64_t w = p.arc(i).hi - p.arc(i).lo;
    EXPECT_LE(std::max(w, w0) - std::min(w, w0), 1u) << "arc " << i;
  }
  ASSERT_EQ(p.servers().size(), 3u);
  EXPECT_EQ(p.servers()[0].id, 1u);  // sorted by id
  EXPECT_EQ(p.servers()[2].id, 3u);
  EXPECT_NEAR(p.share_of(1), 200.0 / 301.0, 1e-9);
  EXPECT_EQ(p.share_of(42), 0.0);
}

TEST(PlacementBackup, IsTheNextMemberByIdWrappingAround) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial({{3, 1.0}, {1, 1.0}, {7, 1.0}}, 10));
  EXPECT_EQ(backup_of(p, 1), std::optional<ServerId>(3));
  EXPECT_EQ(backup_of(p, 3), std::optional<ServerId>(7));
  EXPECT_EQ(backup_of(p, 7), std::optional<ServerId>(1));
  EXPECT_EQ(backup_of(p, 4), std::nullopt);  // not a member
  ASSERT_OK_AND_ASSIGN(Placement one, Placement::initial({{5, 1.0}}, 10));
  EXPECT_EQ(backup_of(one, 5), std::nullopt);
}

// A draining member backs nobody up: the next one that is not takes its
// place, unless every other member drains.
TEST(PlacementBackup, SkipsDrainingMembers) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial({{3, 1.0}, {1, 1.0}, {7, 1.0}}, 10));
  ASSERT_OK_AND_ASSIGN(PlacementChange drain, p.drain_server(3));
  const Placement& d = drain.next;
  EXPECT_EQ(backup_of(d, 1), std::optional<ServerId>(7)) << "3 drains";
  EXPECT_EQ(backup_of(d, 3), std::optional<ServerId>(7)) << "a draining primary has one";
  EXPECT_EQ(backup_of(d, 7), std::optional<ServerId>(1));
  ASSERT_OK_AND_ASSIGN(PlacementChange both, d.drain_server(7));
  EXPECT_EQ(backup_of(both.next, 1), std::optional<ServerId>(3)) << "every other member drains";
  EXPECT_EQ(backup_of(both.next, 7), std::optional<ServerId>(1));
}

TEST(PlacementServerIndex, FindsServersInTheTableAndAboveIt) {
  // Five members: ids below 20 are looked up in the table, 1000 and
  // 4,000,000,000 by the search above it.
  const std::vector<ServerInfo> servers = {{0}, {2}, {3}, {1000}, {4'000'000'000u}};
  const ServerIndex index(servers);
  for (size_t i = 0; i < servers.size(); ++i)
    EXPECT_EQ(index.find(servers[i].id), i) << servers[i].id;
  for (ServerId stranger : {1u, 4u, 19u, 20u, 999u, 1001u, 4'000'000'001u, UINT32_MAX})
    EXPECT_EQ(index.find(stranger), ServerIndex::kNone) << stranger;
  EXPECT_EQ(ServerIndex(std::span<const ServerInfo>()).find(0), ServerIndex::kNone);
  // Any list of distinct ids, in any order.
  const std::vector<ServerId> ids = {7, 5000, 1, 6};
  const ServerIndex of_ids(ids);
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(of_ids.find(ids[i]), i) << ids[i];
  EXPECT_EQ(of_ids.find(0), ServerIndex::kNone);
  EXPECT_EQ(of_ids.find(5001), ServerIndex::kNone);
}

TEST(PlacementInitial, ServersAreInterleavedAroundTheRing) {
  // Equal arcs handed out in token-hash order, not in blocks: each server's
  // arcs are spread, so every quarter of the ring has arcs of every server.
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 256));
  for (int quarter = 0; quarter < 4; ++quarter) {
    std::vector<int> seen(5, 0);
    for (size_t i = quarter * 256; i < (quarter + 1) * 256u; ++i)
      seen[p.arc(i).owner] = 1;
    EXPECT_EQ(seen[1] + seen[2] + seen[3] + seen[4], 4) << "quarter " << quarter;
  }
}

TEST(PlacementInitial, LargestServerHoldsAtMost115PercentOfTheMean) {
  for (size_t n : {4, 16, 64}) {
    ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(n), 256));
    const std::vector<size_t> counts = key_counts(owners(p));
    const double mean = static_cast<double>(kNumKeys) / n;
    size_t largest = 0;
    size_t smallest = kNumKeys;
    for (ServerId id = 1; id <= n; ++id) {
      largest = std::max(largest, counts[id]);
      smallest = std::min(smallest, counts[id]);
    }
    EXPECT_LE(largest, 1.15 * mean) << n << " servers";
    EXPECT_GE(smallest, 0.85 * mean) << n << " servers";
  }
}

void expect_shares_follow_weights(const std::vector<ServerSpec>& specs) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(specs, 256));
  const std::vector<size_t> counts = key_counts(owners(p));
  double total = 0;
  for (const ServerSpec& s : specs)
    total += s.weight;
  for (const ServerSpec& s : specs) {
    const double want = s.weight / total;
    const double got = static_cast<double>(counts[s.id]) / kNumKeys;
    EXPECT_NEAR(got / want, 1.0, 0.15) << "server " << s.id << " weight " << s.weight;
    // The hash space itself is split by weight up to rounding of vnodes.
    EXPECT_NEAR(p.share_of(s.id) / want, 1.0, 0.01) << "server " << s.id;
  }
}

// A static key-to-server map on the ring (psld bench stragglers starts jobs
// from MXNet's and BytePS's placements this way).
TEST(PlacementInitial, WithKeysPutsEachListedKeyOnItsOwnerAtEpochZero) {
  std::vector<Placement::KeyOwner> keys;
  for (uint32_t t = 1; t <= 50; ++t) {
    for (uint32_t c = 0; c < 3; ++c)
      keys.push_back({make_key(t, c), (t * 7 + c) % 4});
  }
  auto p = Placement::initial_with_keys({{0, 1}, {1, 1}, {2, 1}, {3, 1}}, keys);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->epoch(), 0u);
  for (const auto& k : keys)
    EXPECT_EQ(p->owner_of_key(k.key), k.owner);
  // Keys not listed stay where initial() puts them.
  auto plain = Placement::initial({{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  ASSERT_TRUE(plain.ok());
  for (uint32_t t = 100; t < 200; ++t)
    EXPECT_EQ(p->owner_of_key(make_key(t, 0)), plain->owner_of_key(make_key(t, 0)));
  // It survives the wire, and the next change is epoch 1.
  auto back = Placement::deserialize(p->serialize());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, *p);
  auto next = p->move_arc(0, 1);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->next.epoch(), 1u);
  // An owner that is not a member, or a key listed twice, is an error.
  std::vector<Placement::KeyOwner> stranger{{make_key(1, 0), 9}};
  EXPECT_EQ(Placement::initial_with_keys({{0, 1}}, stranger).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<Placement::KeyOwner> twice{{make_key(1, 0), 0}, {make_key(1, 0), 1}};
  EXPECT_EQ(Placement::initial_with_keys({{0, 1}, {1, 1}}, twice).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(PlacementInitial, KeySharesFollowWeights) {
  expect_shares_follow_weights({{1, 1.0}, {2, 2.0}, {3, 3.0}, {4, 4.0}});
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> weight(0.25, 4.0);
  std::vector<ServerSpec> random;
  for (ServerId id = 1; id <= 12; ++id)
    random.push_back({id, weight(rng)});
  expect_shares_follow_weights(random);
}

TEST(PlacementInitial, RejectsBadInput) {
  EXPECT_EQ(Placement::initial({}).status().code(), StatusCode::kInvalidArgument);
  auto dup = Placement::initial({{1, 1.0}, {2, 1.0}, {1, 2.0}});
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("appears twice"), std::string::npos)
      << dup.status().to_string();
  for (double w : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 2e6}) {
    auto r = Placement::initial({{1, 1.0}, {2, w}});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << "weight " << w;
    EXPECT_NE(r.status().message().find("weight"), std::string::npos) << r.status().to_string();
  }
  EXPECT_EQ(Placement::initial({{1, 1.0}}, 0).status().code(), StatusCode::kInvalidArgument);
  // 8 servers x 2^20 vnodes = 2^23 arcs, over kMaxArcs.
  EXPECT_EQ(Placement::initial(equal_servers(8), 1u << 20).status().code(),
            StatusCode::kInvalidArgument);
}

// ---- Lookup -------------------------------------------------------------------

size_t naive_arc_index(const Placement& p, uint64_t h) {
  size_t lo = 0, hi = p.num_arcs() - 1;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (p.arc(mid).hi < h) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

void expect_lookup_matches_naive(const Placement& p) {
  std::vector<uint64_t> probes = {0, 1, kMax, kMax - 1, uint64_t{1} << 63};
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    const Arc a = p.arc(i);
    probes.push_back(a.lo);
    probes.push_back(a.hi);
    if (a.lo > 0) probes.push_back(a.lo - 1);
    if (a.hi < kMax) probes.push_back(a.hi + 1);
  }
  for (uint64_t i = 0; i < 20000; ++i)
    probes.push_back(mix64(i + 991));
  size_t mismatches = 0;
  for (uint64_t h : probes) {
    const size_t got = p.arc_index_of_hash(h);
    if (got != naive_arc_index(p, h) || p.owner_of_hash(h) != p.arc(got).owner) ++mismatches;
    const Arc a = p.arc(got);
    if (h < a.lo || h > a.hi) ++mismatches;
  }
  EXPECT_EQ(mismatches, 0u) << "of " << probes.size() << " probes, " << p.num_arcs() << " arcs";
}

TEST(PlacementLookup, FindsTheArcThatHoldsTheHash) {
  for (uint32_t vnodes : {1u, 3u, 256u}) {
    ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(5), vnodes));
    expect_lookup_matches_naive(p);
  }
  // Hundreds of tiny arcs packed into one index bucket (the binary-search
  // path), and arcs at both ends of the ring.
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 4));
  PlacementDelta d{p.epoch(), p.epoch() + 1, {}, {}};
  const uint64_t base = uint64_t{0x123456789} << 20;
  for (uint64_t i = 0; i < 500; ++i) {
    d.assignments.push_back({base + 3 * i, base + 3 * i + 1, static_cast<ServerId>(1 + i % 4)});
  }
  d.assignments.push_back({kMax - 5, kMax - 5, 2});
  ASSERT_OK_AND_ASSIGN(Placement dense, p.apply(d));
  EXPECT_GT(dense.num_arcs(), 1000u);
  expect_tiles_ring(dense);
  expect_lookup_matches_naive(dense);
  // One arc covering everything.
  ASSERT_OK_AND_ASSIGN(PlacementChange one, p.move_range(0, kMax, 3));
  ASSERT_EQ(one.next.num_arcs(), 1u);
  expect_lookup_matches_naive(one.next);
}

// ---- Add, drain, remove -------------------------------------------------------

TEST(PlacementAddServer, MovesAtMostTheNewServersShare) {
  for (size_t n : {4, 16, 64}) {
    ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(n), 256));
    const std::vector<ServerId> before = owners(p);
    const ServerId added = 1000;
    ASSERT_OK_AND_ASSIGN(PlacementChange c, p.add_server({added, 1.0}));
    expect_tiles_ring(c.next);
    const std::vector<ServerId> after = owners(c.next);
    size_t moved = 0, moved_elsewhere = 0;
    for (size_t i = 0; i < kNumKeys; ++i) {
      if (before[i] == after[i]) continue;
      ++moved;
      if (after[i] != added) ++moved_elsewhere;
    }
    const double fair = 1.0 / (n + 1);
    EXPECT_LE(moved, 1.15 * fair * kNumKeys) << n << " servers";
    EXPECT_GE(moved, 0.85 * fair * kNumKeys) << n << " servers: the new one should fill up";
    EXPECT_EQ(moved_elsewhere, 0u) << "keys may only move to the new server";
    // In the hash space, the new server holds its target and never more.
    EXPECT_LE(c.next.share_of(added), fair * (1 + 1e-9));
    EXPECT_GE(c.next.share_of(added), fair * 0.99);
    // Everyone ends near the mean.
    const std::vector<size_t> counts = key_counts(after);
    for (ServerId id = 1; id <= n; ++id) {
      EXPECT_LE(counts[id], 1.15 * fair * kNumKeys) << "server " << id << " of " << n;
    }
    // Only arcs of old servers got cut: at most one split per donor.
    EXPECT_LE(c.next.num_arcs(), p.num_arcs() + n);
  }
}

TEST(PlacementAddServer, WeightedServerTakesItsWeightedShare) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(3), 256));
  ASSERT_OK_AND_ASSIGN(PlacementChange c, p.add_server({9, 3.0}));
  EXPECT_NEAR(c.next.share_of(9), 0.5, 0.005);
  for (ServerId id = 1; id <= 3; ++id)
    EXPECT_NEAR(c.next.share_of(id), 1.0 / 6, 0.005);
}

TEST(PlacementAddServer, EmptyStandbyOwnsNothing) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(3), 16));
  ASSERT_OK_AND_ASSIGN(PlacementChange c, p.add_server_empty({7, 2.0}));
  ASSERT_NE(c.next.find_server(7), nullptr);
  EXPECT_EQ(c.next.find_server(7)->weight, 2.0);
  EXPECT_EQ(c.next.find_server(7)->state, ServerState::kActive);
  EXPECT_TRUE(c.next.arcs_of(7).empty());
  EXPECT_EQ(owners(c.next), owners(p));
}

TEST(PlacementDrainServer, MovesOnlyTheDrainedServersKeys) {
  for (size_t n : {4, 16, 64}) {
    ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(n), 256));
    const ServerId drained = 2;
    const std::vector<ServerId> before = owners(p);
    ASSERT_OK_AND_ASSIGN(PlacementChange c, p.drain_server(drained));
    expect_tiles_ring(c.next);
    const std::vector<ServerId> after = owners(c.next);
    size_t wrong_moves = 0, stayed = 0, on_drained = 0;
    for (size_t i = 0; i < kNumKeys; ++i) {
      if (before[i] == drained) {
        ++on_drained;
        if (after[i] == drained) ++stayed;
      } else if (after[i] != before[i]) {
        ++wrong_moves;
      }
    }
    EXPECT_GT(on_drained, 0u);
    EXPECT_EQ(stayed, 0u) << "every key of the drained server moves";
    EXPECT_EQ(wrong_moves, 0u) << "no other key moves";
    EXPECT_TRUE(c.next.arcs_of(drained).empty());
    ASSERT_NE(c.next.find_server(drained), nullptr);
    EXPECT_EQ(c.next.find_server(drained)->state, ServerState::kDraining);
    // The drained keys spread over the rest evenly.
    const std::vector<size_t> counts = key_counts(after);
    const double mean = static_cast<double>(kNumKeys) / (n - 1);
    for (ServerId id = 1; id <= n; ++id) {
      if (id != drained) {
        EXPECT_LE(counts[id], 1.15 * mean) << "server " << id << " of " << n;
      }
    }
  }
}

TEST(PlacementDrainServer, ThenRemove) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(3), 8));
  auto busy = p.remove_server(2);
  EXPECT_EQ(busy.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(busy.status().message().find("drain"), std::string::npos) << busy.status().to_string();
  ASSERT_OK_AND_ASSIGN(PlacementChange drained, p.drain_server(2));
  ASSERT_OK_AND_ASSIGN(PlacementChange removed, drained.next.remove_server(2));
  EXPECT_EQ(removed.next.find_server(2), nullptr);
  EXPECT_EQ(removed.next.servers().size(), 2u);
  EXPECT_EQ(owners(removed.next), owners(drained.next));
  EXPECT_EQ(removed.next.epoch(), 2u);
  // Draining a second one leaves one active server; the last cannot go.
  ASSERT_OK_AND_ASSIGN(PlacementChange d3, removed.next.drain_server(3));
  EXPECT_EQ(d3.next.share_of(1), 1.0);
  EXPECT_EQ(d3.next.drain_server(1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(d3.next.set_state(1, ServerState::kDraining).status().code(),
            StatusCode::kFailedPrecondition);
}

TEST(PlacementDrainServer, DrainingServerTakesNoNewArcsUntilReactivated) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(3), 8));
  ASSERT_OK_AND_ASSIGN(PlacementChange s, p.set_state(3, ServerState::kDraining));
  EXPECT_EQ(owners(s.next), owners(p)) << "set_state moves nothing";
  auto refused = s.next.move_arc(0, 3);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("draining"), std::string::npos);
  EXPECT_EQ(s.next.move_range(5, 10, 3).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(PlacementChange back, s.next.set_state(3, ServerState::kActive));
  EXPECT_TRUE(back.next.move_arc(0, 3).ok());
}

// ---- Moving and splitting arcs ------------------------------------------------

TEST(PlacementMoveArc, ChangesTheOwnerOfExactlyTheKeysInTheArc) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 256));
  const size_t index = 517;
  const Arc a = p.arc(index);
  const ServerId to = a.owner == 1 ? 2 : 1;
  ASSERT_OK_AND_ASSIGN(PlacementChange c, p.move_arc(index, to));
  EXPECT_EQ(c.next.arc(index), (Arc{a.lo, a.hi, to}));
  EXPECT_EQ(c.next.num_arcs(), p.num_arcs());
  const std::vector<Key>& keys = random_keys();
  size_t in_arc = 0, mismatches = 0;
  for (Key k : keys) {
    const uint64_t h = hash_key(k);
    const bool inside = h >= a.lo && h <= a.hi;
    const bool changed = p.owner_of_key(k) != c.next.owner_of_key(k);
    in_arc += inside;
    mismatches += inside != changed;
    if (inside && c.next.owner_of_key(k) != to) ++mismatches;
  }
  EXPECT_GT(in_arc, 100u);  // ~1M / 1024
  EXPECT_EQ(mismatches, 0u);
}

TEST(PlacementMoveRange, CutsArcsAtBothEnds) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(2), 4));  // 8 arcs
  const Arc a2 = p.arc(2), a5 = p.arc(5);
  const uint64_t lo = a2.lo + 10, hi = a5.hi - 10;
  ASSERT_OK_AND_ASSIGN(PlacementChange c, p.move_range(lo, hi, 1));
  // [a2.lo, lo-1] | [lo, hi] | [hi+1, a5.hi], arcs 3 and 4 absorbed.
  ASSERT_EQ(c.next.num_arcs(), 8u - 4u + 3u);
  EXPECT_EQ(c.next.arc(2), (Arc{a2.lo, lo - 1, a2.owner}));
  EXPECT_EQ(c.next.arc(3), (Arc{lo, hi, 1}));
  EXPECT_EQ(c.next.arc(4), (Arc{hi + 1, a5.hi, a5.owner}));
  EXPECT_EQ(c.next.arc(5), p.arc(6));
  expect_tiles_ring(c.next);
  EXPECT_EQ(p.move_range(10, 9, 1).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlacementSplitArc, CutsOneArcInTwoWithoutMovingKeys) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(3), 16));
  const Arc a = p.arc(10);
  const uint64_t at = a.lo + (a.hi - a.lo) / 2;
  ASSERT_OK_AND_ASSIGN(PlacementChange c, p.split_arc(at));
  ASSERT_EQ(c.next.num_arcs(), p.num_arcs() + 1);
  EXPECT_EQ(c.next.arc(10), (Arc{a.lo, at - 1, a.owner}));
  EXPECT_EQ(c.next.arc(11), (Arc{at, a.hi, a.owner}));
  EXPECT_EQ(c.next.arc(12), p.arc(11));
  EXPECT_EQ(owners(c.next), owners(p));
  auto nothing = p.split_arc(a.lo);
  EXPECT_EQ(nothing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(nothing.status().message().find("nothing to split"), std::string::npos);
  EXPECT_EQ(p.split_arc(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlacementSplitArc, DownToASingleKey) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 256));
  const std::vector<Key>& keys = random_keys();
  const Key key = keys[123456];
  const uint64_t h = hash_key(key);
  ASSERT_OK_AND_ASSIGN(PlacementChange iso, p.isolate_key(key));
  const size_t index = iso.next.arc_index_of_hash(h);
  const Arc a = iso.next.arc(index);
  EXPECT_EQ(a.lo, h);
  EXPECT_EQ(a.hi, h);
  EXPECT_EQ(a.owner, p.owner_of_key(key));
  EXPECT_EQ(iso.next.num_arcs(), p.num_arcs() + 2);
  const std::vector<ServerId> before = owners(p);
  EXPECT_EQ(owners(iso.next), before) << "isolating moves nothing";

  const ServerId to = a.owner == 4 ? 3 : 4;
  ASSERT_OK_AND_ASSIGN(PlacementChange moved, iso.next.move_arc(index, to));
  const std::vector<ServerId> after = owners(moved.next);
  size_t changed = 0;
  for (size_t i = 0; i < kNumKeys; ++i) {
    if (after[i] == before[i]) continue;
    ++changed;
    EXPECT_EQ(keys[i], key);
  }
  EXPECT_EQ(changed, 1u);
  EXPECT_EQ(moved.next.owner_of_key(key), to);
  // Shares are exact to the hash: a standby given the one-hash arc owns 2^-64.
  ASSERT_OK_AND_ASSIGN(PlacementChange standby, iso.next.add_server_empty({99, 1.0}));
  ASSERT_OK_AND_ASSIGN(PlacementChange tiny, standby.next.move_arc(index, 99));
  EXPECT_EQ(tiny.next.share_of(99), std::ldexp(1.0, -64));
  EXPECT_EQ(tiny.next.arcs_of(99), (std::vector<Arc>{{h, h, 99}}));
  // Isolating it again is a no-op change.
  ASSERT_OK_AND_ASSIGN(PlacementChange again, moved.next.isolate_key(key));
  EXPECT_EQ(again.next.num_arcs(), moved.next.num_arcs());
}

TEST(PlacementCoalesce, MergesNeighboursWithoutMovingKeys) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 64));
  ASSERT_OK_AND_ASSIGN(PlacementChange drained, p.drain_server(1));
  ASSERT_OK_AND_ASSIGN(PlacementChange iso, drained.next.isolate_key(77));
  const Placement& before = iso.next;
  ASSERT_OK_AND_ASSIGN(PlacementChange c, before.coalesce());
  EXPECT_LT(c.next.num_arcs(), before.num_arcs());
  for (size_t i = 1; i < c.next.num_arcs(); ++i) {
    EXPECT_NE(c.next.arc(i).owner, c.next.arc(i - 1).owner) << "arc " << i;
  }
  expect_tiles_ring(c.next);
  EXPECT_EQ(owners(c.next), owners(before));
  ASSERT_OK_AND_ASSIGN(PlacementChange again, c.next.coalesce());
  EXPECT_TRUE(again.delta.assignments.empty());
}

// ---- Errors and immutability --------------------------------------------------

TEST(PlacementChanges, RejectBadInputAndLeaveTheOldEpochAlone) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(3), 8));
  const std::vector<uint8_t> bytes = p.serialize();
  ASSERT_OK_AND_ASSIGN(PlacementChange draining, p.set_state(3, ServerState::kDraining));
  const Placement& q = draining.next;

  auto unknown = p.move_arc(0, 99);
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("99"), std::string::npos);
  EXPECT_EQ(q.move_arc(0, 3).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.move_arc(p.num_arcs(), 1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(p.move_range(0, 5, 99).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.add_server({2, 1.0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.add_server_empty({2, 1.0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.add_server({7, std::nan("")}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.add_server({7, 0.0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.add_server_empty({7, -2.0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.drain_server(99).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.remove_server(99).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.remove_server(1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.set_state(99, ServerState::kActive).status().code(), StatusCode::kNotFound);

  // Successful changes did not touch p either.
  ASSERT_TRUE(p.add_server({7, 1.0}).ok());
  ASSERT_TRUE(p.drain_server(1).ok());
  ASSERT_TRUE(p.isolate_key(5).ok());
  EXPECT_EQ(p.serialize(), bytes);
  EXPECT_EQ(p.epoch(), 0u);
}

// ---- Byte layout ----------------------------------------------------------------

// The layouts in placement.cc, byte by byte, built here without the codec
// that serialize() uses, so that a change of codec cannot change the bytes.
void append_le(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void append_checksum(std::vector<uint8_t>& out) {
  append_le(out, fnv1a64(out), 8);
}

TEST(PlacementLayout, DeltaBytesAreTheDocumentedLayout) {
  PlacementDelta d;
  d.from_epoch = 1;
  d.to_epoch = 2;
  d.membership = {MembershipChange::add({7, 1.5}, ServerState::kDraining),
                  MembershipChange::remove(9)};
  d.assignments = {{0x10, 0x20, 7}};
  const std::vector<uint8_t> expected_head = {
      0x50, 0x53, 0x4c, 0x44,                          // "PSLD"
      0x01, 0x00, 0x00, 0x00,                          // version 1, reserved
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // from_epoch
      0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // to_epoch
      0x02, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // 2 changes, 1 assignment
      0x01, 0x01, 0x00, 0x00, 0x07, 0x00, 0x00, 0x00,  // add, draining, id 7
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f,  // weight 1.5
      0x03, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x00,  // remove id 9: no state
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // and no weight
      0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // lo
      0x20, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // hi
      0x07, 0x00, 0x00, 0x00,                          // owner
  };
  std::vector<uint8_t> expected = expected_head;
  append_checksum(expected);
  EXPECT_EQ(d.serialize(), expected);
}

TEST(PlacementLayout, PlacementBytesAreTheDocumentedLayout) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial({{3, 2.0}, {5, 0.5}}, 2));
  std::vector<uint8_t> expected;
  append_le(expected, 0x504c5350, 4);  // "PSLP"
  append_le(expected, 1, 2);
  append_le(expected, 0, 2);
  append_le(expected, p.epoch(), 8);
  append_le(expected, p.servers().size(), 4);
  append_le(expected, p.num_arcs(), 4);
  for (const ServerInfo& s : p.servers()) {
    append_le(expected, s.id, 4);
    append_le(expected, static_cast<uint8_t>(s.state), 1);
    append_le(expected, 0, 3);
    append_le(expected, std::bit_cast<uint64_t>(s.weight), 8);
  }
  for (size_t i = 0; i < p.num_arcs(); ++i) {
    append_le(expected, p.arc(i).hi, 8);
    append_le(expected, p.arc(i).owner, 4);
  }
  append_checksum(expected);
  const std::vector<uint8_t> bytes = p.serialize();
  EXPECT_EQ(bytes, expected);
  ASSERT_OK_AND_ASSIGN(Placement back, Placement::deserialize(bytes));
  EXPECT_EQ(back.serialize(), bytes);
}

// ---- Deltas -------------------------------------------------------------------

// Every operation's delta survives serialization and reproduces its epoch bit
// for bit; the same delta fails on any other epoch.
TEST(PlacementDelta, RoundTripReproducesEveryOperation) {
  const Placement base = small_changed_placement();
  const Arc a = base.arc(3);
  std::vector<std::pair<std::string, Result<PlacementChange>>> changes;
  changes.emplace_back("move_arc", base.move_arc(3, a.owner == 1 ? 2 : 1));
  changes.emplace_back("move_range", base.move_range(12345, uint64_t{1} << 62, 8));
  changes.emplace_back("split_arc", base.split_arc(a.lo + 1000));
  changes.emplace_back("isolate_key", base.isolate_key(make_key(9, 9)));
  changes.emplace_back("add_server", base.add_server({20, 1.5}));
  changes.emplace_back("add_server_empty", base.add_server_empty({21, 1.0}));
  changes.emplace_back("drain_server", base.drain_server(2));
  changes.emplace_back("remove_server", base.remove_server(5));
  changes.emplace_back("set_state", base.set_state(1, ServerState::kDraining));
  changes.emplace_back("coalesce", base.coalesce());
  changes.emplace_back("hand_over", base.hand_over(2, 8));

  for (auto& [name, change] : changes) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(change.ok()) << change.status().to_string();
    const PlacementDelta& delta = change->delta;
    EXPECT_EQ(delta.from_epoch, base.epoch());
    EXPECT_EQ(delta.to_epoch, base.epoch() + 1);
    EXPECT_EQ(change->next.epoch(), base.epoch() + 1);
    const std::vector<uint8_t> wire = delta.serialize();
    ASSERT_OK_AND_ASSIGN(PlacementDelta decoded, PlacementDelta::deserialize(wire));
    EXPECT_EQ(decoded, delta);
    ASSERT_OK_AND_ASSIGN(Placement rebuilt, base.apply(decoded));
    EXPECT_EQ(rebuilt.serialize(), change->next.serialize());
    EXPECT_TRUE(rebuilt == change->next);

    // Wrong epoch: the delta is from base's epoch, not the next one.
    auto stale = change->next.apply(decoded);
    EXPECT_EQ(stale.status().code(), StatusCode::kFailedPrecondition);
    PlacementDelta skewed = decoded;
    skewed.from_epoch += 1;
    skewed.to_epoch += 1;
    EXPECT_EQ(base.apply(skewed).status().code(), StatusCode::kFailedPrecondition);
  }
}

// A failover's epoch: every arc of the lost server, however many, goes to
// one member in a delta of one membership change, and nothing else moves.
TEST(PlacementHandOver, GivesEveryArcToOneMemberInOneFixedSizeStep) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(6), 256));
  // Servers 1, 2, 3 and 4 lost one after another, each to the next: the last
  // holder owns 5 * 256 arcs, far more than a list of ranges would fit in
  // one control message (7168 bytes).
  for (ServerId lost = 1; lost <= 4; ++lost) {
    SCOPED_TRACE(lost);
    const std::vector<ServerId> before = owners(p);
    ASSERT_OK_AND_ASSIGN(PlacementChange c, p.hand_over(lost, lost + 1));
    const std::vector<uint8_t> wire = c.delta.serialize();
    EXPECT_EQ(wire.size(), 32u + 16 + 8);
    ASSERT_OK_AND_ASSIGN(PlacementDelta decoded, PlacementDelta::deserialize(wire));
    ASSERT_OK_AND_ASSIGN(Placement rebuilt, p.apply(decoded));
    EXPECT_TRUE(rebuilt == c.next);
    EXPECT_EQ(c.next.find_server(lost), nullptr);
    EXPECT_EQ(c.next.num_arcs(), p.num_arcs());
    const std::vector<ServerId> after = owners(c.next);
    for (size_t k = 0; k < after.size(); ++k) {
      ASSERT_EQ(after[k], before[k] == lost ? lost + 1 : before[k]) << "key " << k;
    }
    p = std::move(c.next);
  }
  EXPECT_EQ(p.arcs_of(5).size(), 5u * 256);
  EXPECT_GT(p.arcs_of(5).size() * 20, size_t{7168});
}

TEST(PlacementHandOver, ChainsInOrderAndRejectsWhatDoesNotFit) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 16));
  const uint64_t e = p.epoch();
  // 1 to 2, then 2 to 3: what 1 owned ends at 3, as applying them one by
  // one would.
  PlacementDelta chain{
      e, e + 1, {MembershipChange::hand_over(1, 2), MembershipChange::hand_over(2, 3)}, {}};
  ASSERT_OK_AND_ASSIGN(Placement chained, p.apply(chain));
  ASSERT_OK_AND_ASSIGN(PlacementChange first, p.hand_over(1, 2));
  ASSERT_OK_AND_ASSIGN(PlacementChange second, first.next.hand_over(2, 3));
  EXPECT_EQ(owners(chained), owners(second.next));
  EXPECT_EQ(chained.servers(), second.next.servers());

  // With a replacement: it joins empty and active in the same step.
  ASSERT_OK_AND_ASSIGN(PlacementChange replaced, p.hand_over(1, 2, ServerSpec{7, 1.0}));
  EXPECT_EQ(replaced.delta.membership.size(), 2u);
  ASSERT_NE(replaced.next.find_server(7), nullptr);
  EXPECT_EQ(replaced.next.find_server(7)->state, ServerState::kActive);
  EXPECT_TRUE(replaced.next.arcs_of(7).empty());
  EXPECT_EQ(owners(replaced.next), owners(first.next));
  EXPECT_EQ(backup_of(replaced.next, 4), std::optional<ServerId>(7));
  ASSERT_OK_AND_ASSIGN(PlacementDelta replaced_back,
                       PlacementDelta::deserialize(replaced.delta.serialize()));
  ASSERT_OK_AND_ASSIGN(Placement replaced_rebuilt, p.apply(replaced_back));
  EXPECT_TRUE(replaced_rebuilt == replaced.next);
  EXPECT_EQ(p.hand_over(1, 2, ServerSpec{3, 1.0}).status().code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(p.hand_over(9, 2).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.hand_over(1, 9).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.hand_over(1, 1).status().code(), StatusCode::kInvalidArgument);
  // To a member the same delta removes first.
  PlacementDelta gone{
      e, e + 1, {MembershipChange::remove(2), MembershipChange::hand_over(1, 2)}, {}};
  EXPECT_FALSE(p.apply(gone).ok());
}

TEST(PlacementDelta, ApplyChecksTheResult) {
  const Placement base = small_changed_placement();
  const uint64_t e = base.epoch();
  // Removing a server that still owns arcs.
  PlacementDelta remove_busy{e, e + 1, {MembershipChange::remove(1)}, {}};
  EXPECT_EQ(base.apply(remove_busy).status().code(), StatusCode::kInvalidArgument);
  // ... but fine when the same delta also reassigns its arcs.
  PlacementDelta remove_moved = remove_busy;
  for (const Arc& a : base.arcs_of(1))
    remove_moved.assignments.push_back({a.lo, a.hi, 2});
  ASSERT_OK_AND_ASSIGN(Placement without_1, base.apply(remove_moved));
  EXPECT_EQ(without_1.share_of(1), 0.0);
  EXPECT_EQ(without_1.find_server(1), nullptr);
  // An owner that is not a member.
  PlacementDelta stranger{e, e + 1, {}, {{0, 100, 77}}};
  EXPECT_EQ(base.apply(stranger).status().code(), StatusCode::kInvalidArgument);
  // Adding a member twice, touching an unknown one.
  PlacementDelta twice{e, e + 1, {MembershipChange::add({2, 1.0})}, {}};
  EXPECT_EQ(base.apply(twice).status().code(), StatusCode::kInvalidArgument);
  PlacementDelta unknown{e, e + 1, {MembershipChange::set_state(77, ServerState::kActive)}, {}};
  EXPECT_EQ(base.apply(unknown).status().code(), StatusCode::kNotFound);
  // Epochs only go forward; ranges are not empty.
  PlacementDelta backwards{e, e, {}, {}};
  EXPECT_EQ(base.apply(backwards).status().code(), StatusCode::kInvalidArgument);
  PlacementDelta empty_range{e, e + 1, {}, {{10, 9, 1}}};
  EXPECT_EQ(base.apply(empty_range).status().code(), StatusCode::kInvalidArgument);
  PlacementDelta bad_weight{e, e + 1, {MembershipChange::add({30, std::nan("")})}, {}};
  EXPECT_EQ(base.apply(bad_weight).status().code(), StatusCode::kInvalidArgument);
}

// Overlapping assignments apply in order (a later one wins): one delta with
// all of them equals a chain of deltas with one each.
TEST(PlacementDelta, OverlappingAssignmentsApplyInOrder) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial(equal_servers(4), 8));
  std::mt19937_64 rng(42);
  const uint64_t region = uint64_t{1} << 58;  // keep ranges close so they overlap
  for (int round = 0; round < 20; ++round) {
    PlacementDelta all{p.epoch(), p.epoch() + 1, {}, {}};
    Placement chained = p;
    for (int i = 0; i < 40; ++i) {
      uint64_t lo = rng() % region, hi = rng() % region;
      if (lo > hi) std::swap(lo, hi);
      switch (rng() % 8) {
        case 0:
          lo = 0;
          break;
        case 1:
          hi = kMax;
          break;
        case 2:
          hi = lo;
          break;
        default:
          break;
      }
      const RangeAssignment a{lo, hi, static_cast<ServerId>(1 + rng() % 4)};
      all.assignments.push_back(a);
      PlacementDelta one{chained.epoch(), chained.epoch() + 1, {}, {a}};
      ASSERT_OK_AND_ASSIGN(chained, chained.apply(one));
    }
    ASSERT_OK_AND_ASSIGN(Placement batched, p.apply(all));
    ASSERT_EQ(batched.num_arcs(), chained.num_arcs()) << "round " << round;
    for (size_t i = 0; i < batched.num_arcs(); ++i) {
      ASSERT_EQ(batched.arc(i), chained.arc(i)) << "round " << round << " arc " << i;
    }
    expect_tiles_ring(batched);
  }
}

// ---- Serialization and hostile input ------------------------------------------

TEST(PlacementSerialize, RoundTrip) {
  for (const Placement& p :
       {Placement::initial(equal_servers(5), 64).value(), small_changed_placement()}) {
    const std::vector<uint8_t> bytes = p.serialize();
    ASSERT_OK_AND_ASSIGN(Placement q, Placement::deserialize(bytes));
    EXPECT_TRUE(q == p);
    EXPECT_EQ(q.serialize(), bytes);
    EXPECT_EQ(q.servers(), p.servers());
    for (uint64_t i = 0; i < 1000; ++i) {
      EXPECT_EQ(q.owner_of_key(i), p.owner_of_key(i));
    }
  }
}

void expect_every_truncation_fails(const std::vector<uint8_t>& bytes, bool delta) {
  size_t accepted = 0;
  for (size_t len = 0; len < bytes.size(); ++len) {
    const std::span<const uint8_t> cut(bytes.data(), len);
    const Status s =
        delta ? PlacementDelta::deserialize(cut).status() : Placement::deserialize(cut).status();
    if (s.ok() || s.code() != StatusCode::kDataLoss) ++accepted;
  }
  EXPECT_EQ(accepted, 0u);
}

void expect_every_flip_fails(const std::vector<uint8_t>& bytes, bool delta) {
  size_t accepted = 0;
  std::vector<uint8_t> b = bytes;
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] ^= static_cast<uint8_t>(1u << (i % 8));
    const Status s =
        delta ? PlacementDelta::deserialize(b).status() : Placement::deserialize(b).status();
    if (s.ok() || s.code() != StatusCode::kDataLoss) ++accepted;
    b[i] = bytes[i];
  }
  EXPECT_EQ(accepted, 0u);
}

TEST(PlacementSerialize, RejectsTruncatedAndCorruptedBuffers) {
  const Placement p = small_changed_placement();
  expect_every_truncation_fails(p.serialize(), false);
  expect_every_flip_fails(p.serialize(), false);
  ASSERT_OK_AND_ASSIGN(PlacementChange c, p.add_server({40, 1.0}));
  ASSERT_GT(c.delta.assignments.size(), 0u);
  expect_every_truncation_fails(c.delta.serialize(), true);
  expect_every_flip_fails(c.delta.serialize(), true);
  // A placement is not a delta and vice versa.
  EXPECT_EQ(PlacementDelta::deserialize(p.serialize()).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(Placement::deserialize(c.delta.serialize()).status().code(), StatusCode::kDataLoss);
}

// Buffers with a valid checksum but lying contents.
TEST(PlacementSerialize, RejectsHostilePlacements) {
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::initial({{1, 1.0}, {2, 1.0}}, 2));  // 4 arcs
  const std::vector<uint8_t> good = p.serialize();
  ASSERT_EQ(good.size(), 24u + 2 * 16 + 4 * 12 + 8);
  const size_t servers_at = 24, arcs_at = 24 + 2 * 16;
  auto expect_rejected = [&](const char* what, auto&& edit, const char* message_part) {
    std::vector<uint8_t> b = good;
    edit(b);
    fix_checksum(b);
    auto r = Placement::deserialize(b);
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << what;
    EXPECT_NE(r.status().message().find(message_part), std::string::npos)
        << what << ": " << r.status().to_string();
  };
  expect_rejected(
      "absurd arc count", [&](auto& b) { put_u32(b, 20, 0xffffffffu); }, "arcs");
  expect_rejected(
      "arc count off by one", [&](auto& b) { put_u32(b, 20, 5); }, "buffer has");
  expect_rejected(
      "absurd server count", [&](auto& b) { put_u32(b, 16, 0xffffffffu); }, "servers");
  expect_rejected(
      "no servers", [&](auto& b) { put_u32(b, 16, 0); }, "servers");
  expect_rejected(
      "bad magic", [&](auto& b) { b[0] ^= 0xff; }, "magic");
  expect_rejected(
      "future version", [&](auto& b) { b[4] = 2; }, "version");
  expect_rejected(
      "reserved header", [&](auto& b) { b[6] = 1; }, "reserved");
  expect_rejected(
      "duplicate server", [&](auto& b) { put_u32(b, servers_at + 16, 1); }, "increasing");
  expect_rejected(
      "bad state", [&](auto& b) { b[servers_at + 4] = 7; }, "state");
  expect_rejected(
      "NaN weight", [&](auto& b) { put_u64(b, servers_at + 8, 0x7ff8000000000000ULL); }, "weight");
  expect_rejected(
      "zero weight", [&](auto& b) { put_u64(b, servers_at + 8, 0); }, "weight");
  expect_rejected(
      "unsorted arcs", [&](auto& b) { put_u64(b, arcs_at + 12, 5); }, "sorted");
  expect_rejected(
      "repeated bound", [&](auto& b) { put_u64(b, arcs_at + 12, p.arc(0).hi); }, "sorted");
  expect_rejected(
      "gap at the top", [&](auto& b) { put_u64(b, arcs_at + 3 * 12, kMax - 1); }, "no owner");
  expect_rejected(
      "stranger owns an arc", [&](auto& b) { put_u32(b, arcs_at + 8, 3); }, "not a member");
}

TEST(PlacementSerialize, RejectsHostileDeltas) {
  const PlacementDelta good{
      4, 5, {MembershipChange::add({9, 2.0}), MembershipChange::remove(3)}, {{10, 20, 9}}};
  const std::vector<uint8_t> bytes = good.serialize();
  ASSERT_EQ(bytes.size(), 32u + 2 * 16 + 20 + 8);
  ASSERT_OK_AND_ASSIGN(PlacementDelta back, PlacementDelta::deserialize(bytes));
  EXPECT_EQ(back, good);
  const size_t changes_at = 32, assignments_at = 32 + 2 * 16;
  auto expect_rejected = [&](const char* what, auto&& edit) {
    std::vector<uint8_t> b = bytes;
    edit(b);
    fix_checksum(b);
    auto r = PlacementDelta::deserialize(b);
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << what;
  };
  expect_rejected("absurd assignment count", [&](auto& b) { put_u32(b, 28, 0xffffffffu); });
  expect_rejected("absurd change count", [&](auto& b) { put_u32(b, 24, 0x7fffffffu); });
  expect_rejected("count off by one", [&](auto& b) { put_u32(b, 24, 1); });
  expect_rejected("epoch goes back", [&](auto& b) { put_u64(b, 16, 3); });
  expect_rejected("unknown kind", [&](auto& b) { b[changes_at] = 9; });
  expect_rejected("unknown state", [&](auto& b) { b[changes_at + 1] = 3; });
  expect_rejected("weight on a remove", [&](auto& b) { b[changes_at + 16 + 8] = 1; });
  expect_rejected("state on a remove", [&](auto& b) { b[changes_at + 16 + 1] = 1; });
  expect_rejected("NaN weight",
                  [&](auto& b) { put_u64(b, changes_at + 8, 0x7ff8000000000000ULL); });
  expect_rejected("empty range", [&](auto& b) { put_u64(b, assignments_at, 21); });

  const PlacementDelta hand{4, 5, {MembershipChange::hand_over(3, 9)}, {}};
  const std::vector<uint8_t> hand_bytes = hand.serialize();
  ASSERT_EQ(hand_bytes.size(), 32u + 16 + 8);
  EXPECT_EQ(hand_bytes[changes_at], 4);      // kHandOver
  EXPECT_EQ(hand_bytes[changes_at + 8], 9);  // to, where an add has its weight
  ASSERT_OK_AND_ASSIGN(PlacementDelta hand_back, PlacementDelta::deserialize(hand_bytes));
  EXPECT_EQ(hand_back, hand);
  auto expect_hand_rejected = [&](const char* what, auto&& edit) {
    std::vector<uint8_t> b = hand_bytes;
    edit(b);
    fix_checksum(b);
    EXPECT_EQ(PlacementDelta::deserialize(b).status().code(), StatusCode::kDataLoss) << what;
  };
  expect_hand_rejected("to above 32 bits", [&](auto& b) { b[changes_at + 12] = 1; });
  expect_hand_rejected("state on a hand-over", [&](auto& b) { b[changes_at + 1] = 1; });
  expect_hand_rejected("hand-over to itself", [&](auto& b) { b[changes_at + 8] = 3; });
}

// Random damage with the checksum repaired: every outcome is a clean error or
// a valid object that serializes back to the same bytes.
TEST(PlacementSerialize, RandomDamageNeverBreaksInvariants) {
  const Placement base = small_changed_placement();
  ASSERT_OK_AND_ASSIGN(PlacementChange change, base.add_server({40, 1.0}));
  const std::vector<uint8_t> placement_bytes = base.serialize();
  const std::vector<uint8_t> delta_bytes = change.delta.serialize();
  std::mt19937_64 rng(1234);
  size_t placements_ok = 0, deltas_ok = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const bool delta = iter % 2 == 1;
    std::vector<uint8_t> b = delta ? delta_bytes : placement_bytes;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      // Favour the header and the first entries, where the counts live.
      const size_t at = rng() % 2 == 0 ? rng() % std::min<size_t>(b.size(), 64) : rng() % b.size();
      b[at] = rng() % 4 == 0 ? static_cast<uint8_t>(rng()) : b[at] ^ (1u << (rng() % 8));
    }
    if (rng() % 8 == 0) b.resize(rng() % (b.size() + 40), 0);
    if (b.size() >= 8 && rng() % 4 != 0) fix_checksum(b);
    if (delta) {
      auto d = PlacementDelta::deserialize(b);
      if (!d.ok()) {
        EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
        continue;
      }
      ++deltas_ok;
      EXPECT_EQ(d->serialize(), b);
      auto applied = base.apply(*d);
      if (applied.ok()) {
        expect_tiles_ring(*applied);
        ASSERT_TRUE(Placement::deserialize(applied->serialize()).ok());
      }
    } else {
      auto p = Placement::deserialize(b);
      if (!p.ok()) {
        EXPECT_EQ(p.status().code(), StatusCode::kDataLoss);
        continue;
      }
      ++placements_ok;
      EXPECT_EQ(p->serialize(), b);
      expect_tiles_ring(*p);
    }
  }
  // Some damage is harmless (an epoch number, a weight, an owner id that is a
  // member): make sure the test reached the accepting paths at all.
  EXPECT_GT(placements_ok, 0u);
  EXPECT_GT(deltas_ok, 0u);
}

// ---- Determinism across processes ---------------------------------------------

std::string emitter_path() {
  if (const char* env = std::getenv("PSLD_PLACEMENT_EMIT")) return env;
  // Next to this test binary, where meson builds it.
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : (self.parent_path() / "placement_emit").string();
}

struct ChildOutput {
  int spawn_error = 0;
  int wait_status = 0;
  std::vector<uint8_t> bytes;
};

ChildOutput run_emitter(const std::string& path, const char* scenario) {
  ChildOutput out;
  int fds[2];
  if (pipe(fds) != 0) {
    out.spawn_error = errno;
    return out;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  std::string arg0 = path, arg1 = scenario;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = 0;
  out.spawn_error = posix_spawn(&pid, path.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (out.spawn_error == 0) {
    uint8_t buf[65536];
    for (;;) {
      const ssize_t n = read(fds[0], buf, sizeof(buf));
      if (n > 0) {
        out.bytes.insert(out.bytes.end(), buf, buf + n);
      } else if (n == 0 || errno != EINTR) {
        break;
      }
    }
    while (waitpid(pid, &out.wait_status, 0) < 0 && errno == EINTR) {
    }
  }
  close(fds[0]);
  return out;
}

TEST(PlacementDeterminism, TwoProcessesBuildIdenticalBytes) {
  const std::string path = emitter_path();
  ASSERT_FALSE(path.empty());
  ASSERT_EQ(access(path.c_str(), X_OK), 0)
      << "placement_emit not found at " << path
      << " (meson test sets PSLD_PLACEMENT_EMIT; build the placement_emit target)";
  for (const char* scenario : {"initial", "chain"}) {
    SCOPED_TRACE(scenario);
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> here, scenarios::placement_scenario_bytes(scenario));
    ASSERT_GT(here.size(), 100u);
    const ChildOutput first = run_emitter(path, scenario);
    const ChildOutput second = run_emitter(path, scenario);
    for (const ChildOutput* child : {&first, &second}) {
      ASSERT_EQ(child->spawn_error, 0) << std::strerror(child->spawn_error);
      ASSERT_TRUE(WIFEXITED(child->wait_status) && WEXITSTATUS(child->wait_status) == 0)
          << "placement_emit " << scenario << " failed, wait status " << child->wait_status;
    }
    EXPECT_EQ(first.bytes, second.bytes);
    EXPECT_EQ(first.bytes, here);
  }
  // The chain's final epoch is a valid placement that the deltas rebuild.
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> chain, scenarios::placement_scenario_bytes("chain"));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> initial,
                       scenarios::placement_scenario_bytes("initial"));
  ASSERT_OK_AND_ASSIGN(Placement p, Placement::deserialize(initial));
  std::span<const uint8_t> rest(chain);
  // Final placement first: its size comes from its header.
  const uint32_t servers = rest[16] | rest[17] << 8 | rest[18] << 16 | rest[19] << 24;
  const uint32_t arcs = rest[20] | rest[21] << 8 | rest[22] << 16 | rest[23] << 24;
  const size_t final_size = 24 + 16 * size_t{servers} + 12 * size_t{arcs} + 8;
  ASSERT_LE(final_size, rest.size());
  const std::span<const uint8_t> final_bytes = rest.first(final_size);
  rest = rest.subspan(final_size);
  int deltas = 0;
  while (!rest.empty()) {
    ASSERT_GE(rest.size(), 40u);
    const uint32_t changes = rest[24] | rest[25] << 8 | rest[26] << 16 | rest[27] << 24;
    const uint32_t assigns = rest[28] | rest[29] << 8 | rest[30] << 16 | rest[31] << 24;
    const size_t size = 32 + 16 * size_t{changes} + 20 * size_t{assigns} + 8;
    ASSERT_LE(size, rest.size());
    ASSERT_OK_AND_ASSIGN(PlacementDelta d, PlacementDelta::deserialize(rest.first(size)));
    ASSERT_OK_AND_ASSIGN(p, p.apply(d));
    rest = rest.subspan(size);
    ++deltas;
  }
  EXPECT_EQ(deltas, 10);
  const std::vector<uint8_t> rebuilt = p.serialize();
  EXPECT_TRUE(std::equal(rebuilt.begin(), rebuilt.end(), final_bytes.begin(), final_bytes.end()));
}

}  // namespace
}  // namespace psld
