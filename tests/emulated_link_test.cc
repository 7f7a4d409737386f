// The emulated link: token-bucket bandwidth and added latency over any
// backend (loopback here, so the link is the only limit).
#include "transports/emulated_link/emulated_link.h"

#include <gtest/gtest.h>

#include <cmath>

#include "tests/transport_test_util.h"
#include "transports/loopback/loopback.h"

namespace psld::transport::testing {
namespace {

using namespace std::chrono_literals;

constexpr size_t kChunk = 256 * 1024;

struct Pair {
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
    server = server_link ? *create_emulated_link("loopback", o, *server_link, &server_rec)
                         : *create_transport("loopback", o, &server_rec);
    client = *create_emulated_link("loopback", o, client_link, &client_rec);
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

  // Writes `total` bytes in kChunk writes, all issued at once, and returns
  // the time from the first issue to the last notification.
  std::chrono::duration<double> transfer(uint64_t total) {
    const size_t before = server_rec.num_writes();
    const uint64_t n = total / kChunk;
    const auto t0 = Clock::now();
    for (uint64_t i = 0; i < n; ++i) {
      EXPECT_TRUE(
          conn->write({src.get(), 0, remote.get(), 0, kChunk, static_cast<uint32_t>(i)}, nullptr)
              .ok());
    }
    EXPECT_TRUE(pump(
        {client.get(), server.get()}, [&] { return server_rec.num_writes() == before + n; }, 60s));
    return Clock::now() - t0;
  }
};

class LinkRate : public ::testing::TestWithParam<double> {};

TEST_P(LinkRate, MeasuredThroughputIsWithinTenPercentOfTheSetting) {
  const double rate = GetParam() * 1e6;  // MB/s
  LinkOptions link;
  link.egress_bytes_per_second = rate;
  Pair p(link);
  // About 0.4 s of traffic: long enough that the 64 KiB burst and the
  // per-operation overhead stay well under 1%.
  const uint64_t total = static_cast<uint64_t>(rate * 0.4) / kChunk * kChunk;
  const double seconds = p.transfer(total).count();
  const double measured = static_cast<double>(total) / seconds;
  EXPECT_NEAR(measured / rate, 1.0, 0.10)
      << "set " << rate / 1e6 << " MB/s, measured " << measured / 1e6 << " MB/s";
}

INSTANTIATE_TEST_SUITE_P(MBps, LinkRate, ::testing::Values(50.0, 200.0, 1000.0),
                         [](const auto& info) {
                           return std::to_string(static_cast<int>(info.param));
                         });

TEST(EmulatedLink, IngressShapingPacesNotifications) {
  LinkOptions unlimited;
  LinkOptions slow_in;
  slow_in.ingress_bytes_per_second = 100e6;
  Pair p(unlimited, &slow_in);
  const uint64_t total = 40 * kChunk;  // ~10.5 MB: ~0.1 s at 100 MB/s
  const double seconds = p.transfer(total).count();
  EXPECT_GE(seconds, 0.9 * static_cast<double>(total) / 100e6);
}

TEST(EmulatedLink, LatencyIsAddedToEveryOperation) {
  LinkOptions link;
  link.latency = 20ms;
  Pair p(link);
  const auto t0 = Clock::now();
  ASSERT_TRUE(p.conn->write({p.src.get(), 0, p.remote.get(), 0, 64, 1}, nullptr).ok());
  ASSERT_TRUE(
      pump({p.client.get(), p.server.get()}, [&] { return p.server_rec.num_writes() == 1; }));
  EXPECT_GE(Clock::now() - t0, 20ms);
}

TEST(EmulatedLink, RateCanChangeWhileRunning) {
  LinkOptions fast;
  fast.egress_bytes_per_second = 400e6;
  Pair p(fast);
  const uint64_t total = 40 * kChunk;
  const double t_fast = p.transfer(total).count();
  LinkOptions slow = fast;
  slow.egress_bytes_per_second = 100e6;
  ASSERT_TRUE(set_link(*p.client, slow).ok());
  EXPECT_EQ(get_link(*p.client).egress_bytes_per_second, 100e6);
  const double t_slow = p.transfer(total).count();
  // 4x less bandwidth: at least 3x longer (the slow run's own lower bound).
  EXPECT_GE(t_slow, 0.9 * static_cast<double>(total) / 100e6);
  EXPECT_GT(t_slow, 2.5 * t_fast);
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
  link.egress_bytes_per_second = 1e6;  // 256 KiB takes 0.25 s: the shaper holds most of them
  Pair p(link);
  std::vector<int> calls(8, 0);
  std::vector<Status> results(8);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(p.conn
                    ->write({p.src.get(), 0, p.remote.get(), 0, kChunk, static_cast<uint32_t>(i)},
                            [&, i](Status s) {
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
