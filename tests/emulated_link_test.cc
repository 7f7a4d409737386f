// The emulated link: token-bucket bandwidth and added latency over any
// backend (loopback here, so the link is the only limit).
#include "transports/emulated_link/emulated_link.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>

#include "base/clock.h"
#include "tests/transport_test_util.h"
#include "transports/loopback/loopback.h"

namespace psld::transport::testing {
namespace {

using namespace std::chrono_literals;

constexpr size_t kChunk = 256 * 1024;

// The link runs on a ManualClock: an operation is released exactly when the
// clock reaches the moment its last byte would have left, and the tests say
// that moment to the nanosecond. (The loopback backend underneath keeps real
// time but adds none: it delivers inside the next progress().)
struct Pair {
  ManualClock clock;
  std::shared_ptr<LoopbackFabric> fabric = std::make_shared<LoopbackFabric>();
  Recorder server_rec, client_rec;
  std::unique_ptr<Transport> server, client;
  ConnectionPtr conn;
  std::vector<uint8_t> source = std::vector<uint8_t>(kChunk, 0x42);
  std::shared_ptr<MemoryRegion> src, dst;
  std::shared_ptr<RemoteRegion> remote;

  // Either end may be the shaped one.
  Pair(const LinkOptions& client_link, const LinkOptions* server_link = nullptr) {
    TransportOptions o;
    o.loopback.fabric = fabric;
    server = server_link ? *create_emulated_link("loopback", o, *server_link, &server_rec,
                                                 TimeSource(&clock))
                         : *create_transport("loopback", o, &server_rec);
    client = *create_emulated_link("loopback", o, client_link, &client_rec, TimeSource(&clock));
    conn = *client->connect(server->address());
    EXPECT_TRUE(pump({client.get(), server.get()}, [&] { return server_rec.num_accepted() == 1; }));
    src = *client->register_memory(source.data(), source.size(), MemoryKind::kHost);
    dst = *server->allocate_memory(kChunk, MemoryKind::kHost);
    remote = *conn->import_region(dst->remote_key());
  }
  ~Pair() {
    client->shutdown();
    server->shutdown();
  }

  // Issues `n` writes of kChunk bytes at once, at the clock's present time.
  void issue(uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      EXPECT_TRUE(
          conn->write({src.get(), 0, remote.get(), 0, kChunk, static_cast<uint32_t>(i)}, nullptr)
              .ok());
    }
  }

  // Sets the clock to `t` and drives both ends until neither has anything
  // left to do at that time; returns the writes the server was told of.
  size_t writes_at(ManualClock::time_point t) {
    clock.set(t);
    while (client->progress() + server->progress() > 0) {
    }
    return server_rec.num_writes();
  }

  // Expects the k-th (from 1) of `n` writes issued at once, after `before`
  // had arrived, to arrive exactly at arrival(k): at that nanosecond and not
  // one before.
  void expect_arrivals(size_t before, uint64_t n,
                       const std::function<ManualClock::time_point(uint64_t)>& arrival) {
    for (uint64_t k = 1; k <= n; ++k) {
      const auto at = arrival(k);
      EXPECT_EQ(writes_at(at - std::chrono::nanoseconds(1)), before + k - 1) << "write " << k;
      EXPECT_EQ(writes_at(at), before + k) << "write " << k;
    }
  }
};

// The time a link of `rate` bytes per second takes to carry `bytes` (the
// tests' rates divide a second into whole nanoseconds).
std::chrono::nanoseconds carry(uint64_t bytes, uint64_t rate) {
  return std::chrono::nanoseconds(bytes * 1'000'000'000 / rate);
}

constexpr uint64_t kOpBytes = kChunk + LinkOptions{}.per_op_overhead_bytes;
constexpr uint64_t kBurst = LinkOptions{}.burst_bytes;

class LinkRate : public ::testing::TestWithParam<uint64_t> {};

TEST_P(LinkRate, EachWriteArrivesWhenTheLinkHasCarriedItsBytes) {
  const uint64_t rate = GetParam() * 1'000'000;  // MB/s
  LinkOptions link;
  link.egress_bytes_per_second = static_cast<double>(rate);
  Pair p(link);
  const auto t0 = p.clock.now();
  constexpr uint64_t kWrites = 16;  // 4 MiB
  p.issue(kWrites);
  // The idle link lends one burst; after it, each write's bytes and its
  // per-operation overhead pass at exactly the set rate.
  p.expect_arrivals(0, kWrites,
                    [&](uint64_t k) { return t0 + carry(k * kOpBytes - kBurst, rate); });
}

INSTANTIATE_TEST_SUITE_P(MBps, LinkRate, ::testing::Values(50, 200, 1000),
                         [](const auto& info) { return std::to_string(info.param); });

TEST(EmulatedLink, IngressShapingPacesNotifications) {
  LinkOptions unlimited;
  LinkOptions slow_in;
  slow_in.ingress_bytes_per_second = 100e6;
  Pair p(unlimited, &slow_in);
  const auto t0 = p.clock.now();
  constexpr uint64_t kWrites = 40;  // ~10.5 MB: ~0.1 s at 100 MB/s
  p.issue(kWrites);
  // The bytes reach the shaped end now; their notifications wait for it.
  EXPECT_EQ(p.writes_at(t0), 0u);
  p.expect_arrivals(0, kWrites,
                    [&](uint64_t k) { return t0 + carry(k * kOpBytes - kBurst, 100'000'000); });
}

// A heartbeat on one connection must not queue behind another connection's
// bulk backlog: the link shares itself among connections by bytes (fair
// queuing), so a message on an idle connection waits for at most about one
// write of each busy one. (One FIFO for the whole link once held a server's
// control messages for seconds behind 256 MiB of pushes, and the failure
// detector declared the slow server dead.) A connection that sends many
// small messages gets its share by bytes too, not one message per turn:
// served one operation each, a coordinator's four messages a second queued
// behind 4 MiB writes without bound, and a slow server's coordinator fell
// silent for longer than the heartbeat timeout. Within a connection, order
// is kept.
void expect_messages_overtake_backlog(bool shape_egress, size_t messages) {
  LinkOptions slow;
  (shape_egress ? slow.egress_bytes_per_second : slow.ingress_bytes_per_second) = 100e6;
  LinkOptions unlimited;
  Pair p(shape_egress ? slow : unlimited, shape_egress ? nullptr : &slow);
  ConnectionPtr control = *p.client->connect(p.server->address());
  ASSERT_TRUE(
      pump({p.client.get(), p.server.get()}, [&] { return p.server_rec.num_accepted() == 2; }));
  const auto t0 = p.clock.now();
  constexpr uint64_t kWrites = 40;  // ~10.5 MB: ~0.1 s at 100 MB/s
  p.issue(kWrites);
  const uint8_t heartbeat[] = {7};
  for (size_t i = 0; i < messages; ++i)
    ASSERT_TRUE(control->send(heartbeat, nullptr).ok());
  p.writes_at(t0);  // everything reaches the link now
  // Delivered after the first write or two (those the burst let through and
  // the one in service), long before the backlog ends.
  const auto backlog_done = t0 + carry(kWrites * kOpBytes - kBurst, 100'000'000);
  p.writes_at(t0 + carry(2 * kOpBytes, 100'000'000));
  EXPECT_EQ(p.server_rec.num_messages(), messages);
  EXPECT_LE(p.server_rec.num_writes(), 3u);
  // The bulk connection's writes still arrive in order and all of them, by
  // the time the link has carried them and the heartbeats' few bytes.
  p.writes_at(backlog_done +
              carry(messages * (LinkOptions{}.per_op_overhead_bytes + 1), 100'000'000));
  EXPECT_EQ(p.server_rec.num_writes(), kWrites);
}

TEST(EmulatedLink, AMessageOnAnIdleConnectionOvertakesAnotherConnectionsBacklogOnEgress) {
  expect_messages_overtake_backlog(true, 1);
}

TEST(EmulatedLink, AMessageOnAnIdleConnectionOvertakesAnotherConnectionsBacklogOnIngress) {
  expect_messages_overtake_backlog(false, 1);
}

TEST(EmulatedLink, ManySmallMessagesShareTheLinkByBytesOnEgress) {
  expect_messages_overtake_backlog(true, 20);
}

TEST(EmulatedLink, ManySmallMessagesShareTheLinkByBytesOnIngress) {
  expect_messages_overtake_backlog(false, 20);
}

TEST(EmulatedLink, LatencyIsAddedToEveryOperation) {
  LinkOptions link;
  link.latency = 20ms;
  Pair p(link);
  const auto t0 = p.clock.now();
  ASSERT_TRUE(p.conn->write({p.src.get(), 0, p.remote.get(), 0, 64, 1}, nullptr).ok());
  EXPECT_EQ(p.writes_at(t0 + 20ms - 1ns), 0u);
  EXPECT_EQ(p.writes_at(t0 + 20ms), 1u);
  // A message too, sent later, on an otherwise idle link.
  const auto t1 = t0 + 25ms;
  p.writes_at(t1);
  const uint8_t hello[] = {1, 2, 3};
  ASSERT_TRUE(p.conn->send(hello, nullptr).ok());
  p.writes_at(t1 + 20ms - 1ns);
  EXPECT_EQ(p.server_rec.num_messages(), 0u);
  p.writes_at(t1 + 20ms);
  EXPECT_EQ(p.server_rec.num_messages(), 1u);
}

TEST(EmulatedLink, RateCanChangeWhileRunning) {
  LinkOptions fast;
  fast.egress_bytes_per_second = 400e6;
  Pair p(fast);
  constexpr uint64_t kWrites = 40;
  const auto t0 = p.clock.now();
  p.issue(kWrites);
  const auto fast_done = t0 + carry(kWrites * kOpBytes - kBurst, 400'000'000);
  EXPECT_EQ(p.writes_at(fast_done - 1ns), kWrites - 1);
  EXPECT_EQ(p.writes_at(fast_done), kWrites);
  LinkOptions slow = fast;
  slow.egress_bytes_per_second = 100e6;
  ASSERT_TRUE(set_link(*p.client, slow).ok());
  EXPECT_EQ(get_link(*p.client).egress_bytes_per_second, 100e6);
  // Issued the moment the link fell idle, so with no idle credit: 4x less
  // bandwidth, each write takes 4x as long.
  p.issue(kWrites);
  p.expect_arrivals(kWrites, kWrites,
                    [&](uint64_t k) { return fast_done + carry(k * kOpBytes, 100'000'000); });
}

TEST(EmulatedLink, RejectsBadOptionsWithTheFieldName) {
  LinkOptions bad;
  bad.egress_bytes_per_second = -1;
  Status s = validate_link_options(bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("egress_bytes_per_second"), std::string::npos);
  bad = LinkOptions{};
  bad.ingress_bytes_per_second = NAN;
  EXPECT_NE(validate_link_options(bad).message().find("ingress_bytes_per_second"),
            std::string::npos);
  bad = LinkOptions{};
  bad.burst_bytes = 0;
  EXPECT_FALSE(validate_link_options(bad).ok());

  TransportOptions o;
  o.loopback.fabric = std::make_shared<LoopbackFabric>();
  Recorder rec;
  auto plain = *create_transport("loopback", o, &rec);
  EXPECT_EQ(set_link(*plain, LinkOptions{}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create_emulated_link("nope", o, LinkOptions{}, &rec).status().code(),
            StatusCode::kNotFound);
}

TEST(EmulatedLink, ShutdownFailsHeldOperationsOnce) {
  LinkOptions link;
  link.egress_bytes_per_second = 1e6;  // 256 KiB takes 0.25 s, and the clock stands still
  Pair p(link);
  std::vector<int> calls(8, 0);
  std::vector<Status> results(8);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(p.conn
                    ->write({p.src.get(), 0, p.remote.get(), 0, kChunk, static_cast<uint32_t>(i)},
                            [&, i](const Status& s) {
                              ++calls[i];
                              results[i] = s;
                            })
                    .ok());
  }
  p.client->shutdown();
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(calls[i], 1) << i;
    EXPECT_EQ(results[i].code(), StatusCode::kAborted) << results[i].to_string();
  }
}

}  // namespace
}  // namespace psld::transport::testing
