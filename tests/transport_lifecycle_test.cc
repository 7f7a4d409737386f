// 1,000 connect / register / write / close cycles leave no leaked file
// descriptors (counted in /proc/self/fd) and, under the sanitizer build's
// LeakSanitizer, no leaked memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "tests/transport_test_util.h"

namespace psld::transport::testing {
namespace {

using namespace std::chrono_literals;

constexpr int kCycles = 1000;
// UCX opens a few descriptors lazily (its async thread's epoll and event
// fds, a shared-memory segment's fd) on first use; the warm-up pays for those.
// What remains allowed is noise, not growth: 1,000 cycles that leaked one fd
// each would be far past it.
constexpr int kFdSlack = 4;

int count_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
    ++n;
  return n;
}

class Counter : public Handler {
 public:
  void on_accept(const ConnectionPtr& conn) override {
    last_accepted = conn;
    ++accepted;
  }
  void on_write(const ConnectionPtr&, uint32_t, uint64_t) override { ++writes; }
  void on_message(const ConnectionPtr&, std::span<const uint8_t>) override { ++messages; }
  void on_disconnect(const ConnectionPtr&, const Status&) override { ++disconnects; }
  int accepted = 0, writes = 0, messages = 0, disconnects = 0;
  ConnectionPtr last_accepted;
};

struct Case {
  std::string label, transport, tls;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.label;
}

class Lifecycle : public ::testing::TestWithParam<Case> {
 protected:
  struct Pair {
    Counter server_rec, client_rec;
    std::unique_ptr<Transport> server, client;
    std::vector<Transport*> both() { return {client.get(), server.get()}; }
  };

  std::unique_ptr<Pair> make_pair() {
    auto p = std::make_unique<Pair>();
    TransportOptions o;
    o.common.op_timeout = 10s;
    o.ucx.tls = GetParam().tls;
    o.loopback.fabric = fabric_;
    auto s = create_transport(GetParam().transport, o, &p->server_rec);
    auto c = create_transport(GetParam().transport, o, &p->client_rec);
    EXPECT_TRUE(s.ok() && c.ok()) << s.status().to_string() << " " << c.status().to_string();
    if (!s.ok() || !c.ok()) return nullptr;
    p->server = std::move(s).value();
    p->client = std::move(c).value();
    return p;
  }

  // One cycle: connect, register a fresh buffer, allocate a landing region,
  // import it, write, send, close, invalidate, let go of everything.
  void cycle(Pair& p, int i) {
    const int accepted = p.server_rec.accepted, writes = p.server_rec.writes,
              messages = p.server_rec.messages, server_gone = p.server_rec.disconnects,
              client_gone = p.client_rec.disconnects;
    auto conn = p.client->connect(p.server->address());
    ASSERT_TRUE(conn.ok()) << conn.status().to_string();
    ASSERT_TRUE(pump(
        p.both(), [&] { return p.server_rec.accepted > accepted; }, 10s));
    std::vector<uint8_t> buf(4096 + static_cast<size_t>(i % 7) * 64, static_cast<uint8_t>(i));
    auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
    ASSERT_TRUE(src.ok()) << src.status().to_string();
    auto dst = p.server->allocate_memory(buf.size(), MemoryKind::kHost);
    ASSERT_TRUE(dst.ok()) << dst.status().to_string();
    auto remote = (*conn)->import_region((*dst)->remote_key());
    ASSERT_TRUE(remote.ok()) << remote.status().to_string();
    bool written = false;
    ASSERT_TRUE((*conn)
                    ->write({src->get(), 0, remote->get(), 0, buf.size(), 1},
                            [&](Status s) {
                              EXPECT_TRUE(s.ok()) << s.to_string();
                              written = true;
                            })
                    .ok());
    const uint8_t hello[] = {1, 2, 3};
    ASSERT_TRUE((*conn)->send(hello, nullptr).ok());
    ASSERT_TRUE(pump(
        p.both(),
        [&] { return written && p.server_rec.writes > writes && p.server_rec.messages > messages; },
        10s));
    (*conn)->close();
    ASSERT_TRUE(pump(
        p.both(),
        [&] {
          return p.server_rec.disconnects > server_gone && p.client_rec.disconnects > client_gone;
        },
        10s));
    EXPECT_TRUE(p.client->invalidate(buf.data(), buf.size()).ok());
    p.server_rec.last_accepted.reset();
  }

  std::shared_ptr<LoopbackFabric> fabric_ = std::make_shared<LoopbackFabric>();
};

TEST_P(Lifecycle, ThousandConnectRegisterCloseCyclesLeakNoDescriptors) {
  const auto names = available_transports();
  if (std::find(names.begin(), names.end(), GetParam().transport) == names.end()) {
    GTEST_SKIP() << GetParam().transport << " is not in this build";
  }
  {
    auto warm = make_pair();
    ASSERT_NE(warm, nullptr);
    cycle(*warm, 0);
  }
  const int fds_before = count_fds();
  const auto start = Clock::now();
  int fds_after_warmup = 0, fds_after_all = 0;
  {
    auto p = make_pair();
    ASSERT_NE(p, nullptr);
    for (int i = 0; i < kCycles; ++i) {
      cycle(*p, i);
      if (HasFatalFailure()) return;
      if (i == 9) fds_after_warmup = count_fds();
    }
    fds_after_all = count_fds();
  }
  const int fds_after = count_fds();
  std::cout << "[          ] " << GetParam().label << ": " << kCycles << " cycles in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
            << " ms; fds " << fds_before << " before, " << fds_after_warmup << " after 10 cycles, "
            << fds_after_all << " after " << kCycles << ", " << fds_after << " after shutdown\n";
  EXPECT_LE(fds_after_all, fds_after_warmup + kFdSlack) << "connections leak descriptors";
  EXPECT_LE(fds_after, fds_before + kFdSlack) << "a transport leaks descriptors";
}

INSTANTIATE_TEST_SUITE_P(Backends, Lifecycle,
                         ::testing::Values(Case{"loopback", "loopback", ""},
                                           Case{"ucx_tcp", "ucx", "tcp"},
                                           Case{"ucx_shm", "ucx", "sm,tcp"}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.label; });

}  // namespace
}  // namespace psld::transport::testing
