// One conformance suite for every transport backend in this build: loopback,
// UCX over TCP, UCX over shared memory, verbs (skipped without an RDMA
// device), and the emulated-link wrapper.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>

#include "kernels/cuda/cuda_kernels.h"
#include "tests/transport_test_util.h"
#include "transports/emulated_link/emulated_link.h"

namespace psld::transport::testing {

std::vector<Backend> conformance_backends() {
  std::vector<Backend> out{{"loopback", "loopback", "", false},
                           {"loopback_link", "loopback", "", true}};
  for (const std::string& name : available_transports()) {
    if (name == "ucx") {
      out.push_back({"ucx_tcp", "ucx", "tcp", false});
      out.push_back({"ucx_shm", "ucx", "sm,tcp", false});
    } else if (name == "verbs") {
      out.push_back({"verbs", "verbs", "", false});
    }
  }
  return out;
}

std::unique_ptr<Transport> make_transport(const Backend& b, Handler* handler,
                                          const std::shared_ptr<LoopbackFabric>& fabric,
                                          std::chrono::milliseconds op_timeout,
                                          std::string* skip_reason) {
  TransportOptions o;
  o.common.op_timeout = op_timeout;
  o.loopback.fabric = fabric;
  o.ucx.tls = b.ucx_tls;
  Result<std::unique_ptr<Transport>> t =
      b.link ? create_emulated_link(b.transport, o, LinkOptions{}, handler)
             : create_transport(b.transport, o, handler);
  if (!t.ok()) {
    if (t.status().code() == StatusCode::kUnavailable) {
      *skip_reason = t.status().message();
      return nullptr;
    }
    ADD_FAILURE() << "create_transport(" << b.transport << "): " << t.status().to_string();
    return nullptr;
  }
  return std::move(t).value();
}

namespace {

using namespace std::chrono_literals;

// A byte pattern that differs at every offset and between fills.
void fill(uint8_t* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<uint8_t>(x);
  }
}

uint64_t checksum(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i)
    h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

class Conformance : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    fabric_ = std::make_shared<LoopbackFabric>();
    std::string skip;
    server_ = make_transport(GetParam(), &server_rec_, fabric_, op_timeout_, &skip);
    if (!skip.empty()) GTEST_SKIP() << GetParam().transport << ": " << skip;
    ASSERT_NE(server_, nullptr);
    client_ = make_transport(GetParam(), &client_rec_, fabric_, op_timeout_, &skip);
    ASSERT_NE(client_, nullptr) << skip;
  }
  void TearDown() override {
    if (client_) client_->shutdown();
    if (server_) server_->shutdown();
  }

  std::vector<Transport*> both() { return {client_.get(), server_.get()}; }

  // Connects client -> server and waits for the accept.
  ConnectionPtr connect() {
    const size_t before = server_rec_.num_accepted();
    auto conn = client_->connect(server_->address());
    EXPECT_TRUE(conn.ok()) << conn.status().to_string();
    if (!conn.ok()) return nullptr;
    EXPECT_TRUE(pump(both(), [&] { return server_rec_.num_accepted() > before; }));
    return *conn;
  }

  // The server's end of the newest accepted connection.
  ConnectionPtr server_end() {
    std::lock_guard<std::mutex> lock(server_rec_.mu);
    return server_rec_.accepted.empty() ? nullptr : server_rec_.accepted.back();
  }

  // A 4096-byte source the client registered and a 1024-byte target the
  // server allocated, imported on `conn`: what the bad-write tests write with.
  struct WriteRegions {
    std::vector<uint8_t> src_buf = std::vector<uint8_t>(4096, 1);
    std::shared_ptr<MemoryRegion> src, dst;
    std::shared_ptr<RemoteRegion> remote;
  };
  void make_write_regions(const ConnectionPtr& conn, WriteRegions* w) {
    auto src = client_->register_memory(w->src_buf.data(), w->src_buf.size(), MemoryKind::kHost);
    ASSERT_TRUE(src.ok());
    w->src = *src;
    auto dst = server_->allocate_memory(1024, MemoryKind::kHost);
    ASSERT_TRUE(dst.ok());
    w->dst = *dst;
    auto remote = conn->import_region(w->dst->remote_key());
    ASSERT_TRUE(remote.ok());
    w->remote = *remote;
  }

  std::chrono::milliseconds op_timeout_ = 20s;
  std::shared_ptr<LoopbackFabric> fabric_;
  Recorder server_rec_, client_rec_;
  std::unique_ptr<Transport> server_, client_;
};

TEST_P(Conformance, ListensAndReportsItsName) {
  EXPECT_FALSE(server_->address().empty());
  EXPECT_FALSE(server_->name().empty());
}

TEST_P(Conformance, MessagesTravelBothWays) {
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  EXPECT_TRUE(conn->is_open());
  EXPECT_FALSE(conn->write_path().empty());
  const std::string hello = "hello, server";
  bool sent = false;
  ASSERT_TRUE(conn->send({reinterpret_cast<const uint8_t*>(hello.data()), hello.size()},
                         [&](Status s) {
                           EXPECT_TRUE(s.ok()) << s.to_string();
                           sent = true;
                         })
                  .ok());
  ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_messages() == 1 && sent; }));
  EXPECT_EQ(
      std::string(server_rec_.messages[0].second.begin(), server_rec_.messages[0].second.end()),
      hello);

  // The reply goes back on the accepted connection.
  ConnectionPtr back = server_rec_.last_message_conn;
  ASSERT_NE(back, nullptr);
  std::vector<uint8_t> big(kMaxMessageBytes);
  fill(big.data(), big.size(), 7);
  ASSERT_TRUE(back->send(big, nullptr).ok());
  ASSERT_TRUE(pump(both(), [&] { return client_rec_.num_messages() == 1; }));
  EXPECT_EQ(client_rec_.messages[0].second, big);
  EXPECT_EQ(client_rec_.messages[0].first, conn->id());
}

TEST_P(Conformance, OversizedMessageIsRejectedLocally) {
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  std::vector<uint8_t> too_big(kMaxMessageBytes + 1);
  Status s = conn->send(too_big, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  pump_for(both(), 50ms);
  EXPECT_EQ(server_rec_.num_messages(), 0u);
}

TEST_P(Conformance, RegistrationIsCachedPerExactRange) {
  std::vector<uint8_t> buf(8192);
  auto a = client_->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = client_->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->get(), b->get()) << "same range must hit the cache";
  auto shorter = client_->register_memory(buf.data(), 4096, MemoryKind::kHost);
  ASSERT_TRUE(shorter.ok());
  EXPECT_NE(shorter->get(), a->get()) << "a different length is a different registration";
  EXPECT_NE((*shorter)->id(), (*a)->id());
  EXPECT_FALSE((*a)->remote_key().empty());

  EXPECT_TRUE(client_->invalidate(buf.data(), buf.size()).ok());
  EXPECT_EQ(client_->invalidate(buf.data(), buf.size()).code(), StatusCode::kNotFound);
  auto again = client_->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(again.ok());
  EXPECT_NE((*again)->id(), (*a)->id()) << "after invalidate a new registration is made";

  EXPECT_EQ(client_->register_memory(nullptr, 16, MemoryKind::kHost).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->register_memory(buf.data(), 0, MemoryKind::kHost).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_P(Conformance, WritesOfEverySizeArriveIntactAtOddOffsets) {
  constexpr size_t kMax = size_t{64} << 20;
  constexpr size_t kPad = 64;
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);

  std::vector<uint8_t> src_buf(kMax + kPad);
  fill(src_buf.data(), src_buf.size(), 1);
  auto src = client_->register_memory(src_buf.data(), src_buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok()) << src.status().to_string();
  auto dst = server_->allocate_memory(kMax + kPad, MemoryKind::kHost);
  ASSERT_TRUE(dst.ok()) << dst.status().to_string();
  auto remote = conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok()) << remote.status().to_string();
  EXPECT_EQ((*remote)->length(), kMax + kPad);

  struct Case {
    size_t length, src_off, dst_off;
  };
  const std::vector<Case> cases = {{1, 1, 3},
                                   {7, 13, 5},
                                   {4095, 3, 33},
                                   {4097, 17, 1},
                                   {65537, 9, 7},
                                   {(1 << 20) + 3, 5, 11},
                                   {(16 << 20) + 5, 1, 63},
                                   {kMax, 63, 1}};
  // At notification time the receiver checks the landed bytes: the write's
  // data must be complete before on_write runs.
  std::map<uint32_t, uint64_t> expected;
  std::map<uint32_t, bool> verified;
  server_rec_.write_hook = [&](const ConnectionPtr&, uint32_t notify, uint64_t length) {
    const Case& c = cases.at(notify);
    EXPECT_EQ(length, c.length);
    verified[notify] = checksum((*dst)->data() + c.dst_off, c.length) == expected[notify];
  };
  for (uint32_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    expected[i] = checksum(src_buf.data() + c.src_off, c.length);
    bool done = false;
    Status result;
    ASSERT_TRUE(conn->write({src->get(), c.src_off, remote->get(), c.dst_off, c.length, i},
                            [&](Status s) {
                              result = s;
                              done = true;
                            })
                    .ok());
    ASSERT_TRUE(pump(both(), [&] { return done && verified.count(i); }))
        << "write of " << c.length << " bytes did not complete";
    EXPECT_TRUE(result.ok()) << result.to_string();
    EXPECT_TRUE(verified[i]) << "bytes of the " << c.length
                             << "-byte write were not all visible at notification";
  }
  EXPECT_EQ(server_rec_.num_writes(), cases.size());
}

// GPU memory: a backend either registers device memory, and then a write
// from device memory into the peer's device memory lands intact, or refuses
// it with Unimplemented and the reason memory_support() gives, so that the
// runtime can stage device tensors through host memory instead.
TEST_P(Conformance, CudaMemoryIsSupportedOrRefusedWithTheReason) {
  EXPECT_TRUE(server_->supports(MemoryKind::kHost));
  const MemorySupport cuda = server_->memory_support(MemoryKind::kCuda);
  EXPECT_FALSE(cuda.detail.empty());
  if (!cuda.supported) {
    std::vector<uint8_t> buf(4096);
    auto reg = server_->register_memory(buf.data(), buf.size(), MemoryKind::kCuda);
    ASSERT_FALSE(reg.ok());
    EXPECT_EQ(reg.status().code(), StatusCode::kUnimplemented) << reg.status().to_string();
    EXPECT_NE(reg.status().message().find(cuda.detail), std::string::npos)
        << reg.status().message() << " does not give the reason: " << cuda.detail;
    auto alloc = server_->allocate_memory(4096, MemoryKind::kCuda);
    ASSERT_FALSE(alloc.ok());
    EXPECT_EQ(alloc.status().code(), StatusCode::kUnimplemented) << alloc.status().to_string();
    GTEST_SKIP() << GetParam().label << " cannot reach CUDA memory here: " << cuda.detail;
  }
  const Status device = kernels::cuda::device_status();
  if (!device.ok()) GTEST_SKIP() << "no CUDA device: " << device.message();

  constexpr size_t kBytes = (size_t{8} << 20) + 12345;
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  void* src_dev = nullptr;
  void* dst_dev = nullptr;
  ASSERT_TRUE(kernels::cuda::device_alloc(kBytes, &src_dev).ok());
  ASSERT_TRUE(kernels::cuda::device_alloc(kBytes, &dst_dev).ok());
  std::vector<uint8_t> pattern(kBytes), back(kBytes, 0);
  fill(pattern.data(), kBytes, 7);
  ASSERT_TRUE(kernels::cuda::copy(src_dev, pattern.data(), kBytes).ok());
  ASSERT_TRUE(kernels::cuda::copy(dst_dev, back.data(), kBytes).ok());
  {
    auto src = client_->register_memory(src_dev, kBytes, MemoryKind::kCuda);
    ASSERT_TRUE(src.ok()) << src.status().to_string();
    auto dst = server_->register_memory(dst_dev, kBytes, MemoryKind::kCuda);
    ASSERT_TRUE(dst.ok()) << dst.status().to_string();
    std::printf("[ info ] %s CUDA registration: %s\n", GetParam().label.c_str(),
                (*dst)->registration().c_str());
    auto remote = conn->import_region((*dst)->remote_key());
    ASSERT_TRUE(remote.ok()) << remote.status().to_string();
    bool done = false;
    Status result;
    ASSERT_TRUE(conn->write({src->get(), 0, remote->get(), 0, kBytes, 5},
                            [&](Status s) {
                              result = s;
                              done = true;
                            })
                    .ok());
    ASSERT_TRUE(pump(both(), [&] { return done && server_rec_.num_writes() == 1; }));
    EXPECT_TRUE(result.ok()) << result.to_string();
    ASSERT_TRUE(kernels::cuda::copy(back.data(), dst_dev, kBytes).ok());
    EXPECT_EQ(checksum(back.data(), kBytes), checksum(pattern.data(), kBytes))
        << "device-to-device write did not land intact";
    EXPECT_TRUE(client_->invalidate(src_dev, kBytes).ok());
    EXPECT_TRUE(server_->invalidate(dst_dev, kBytes).ok());
  }
  EXPECT_TRUE(kernels::cuda::device_free(src_dev).ok());
  EXPECT_TRUE(kernels::cuda::device_free(dst_dev).ok());
}

TEST_P(Conformance, TenThousandWritesAcrossEightConnectionsEachNotifiedOnce) {
  constexpr int kConns = 8;
  constexpr uint32_t kWrites = 10000;
  constexpr size_t kSlot = 64;
  std::vector<ConnectionPtr> conns;
  for (int i = 0; i < kConns; ++i) {
    conns.push_back(connect());
    ASSERT_NE(conns.back(), nullptr);
  }
  std::vector<uint8_t> src_buf(kWrites * kSlot);
  for (uint32_t i = 0; i < kWrites; ++i)
    std::memset(&src_buf[i * kSlot], static_cast<int>(i % 251), kSlot);
  auto src = client_->register_memory(src_buf.data(), src_buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok());
  auto dst = server_->allocate_memory(kWrites * kSlot, MemoryKind::kHost);
  ASSERT_TRUE(dst.ok());
  std::vector<std::shared_ptr<RemoteRegion>> remotes;
  for (auto& c : conns) {
    auto r = c->import_region((*dst)->remote_key());
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    remotes.push_back(*r);
  }
  std::vector<int> notified(kWrites, 0);
  int bad_bytes = 0;
  server_rec_.write_hook = [&](const ConnectionPtr&, uint32_t notify, uint64_t) {
    ASSERT_LT(notify, kWrites);
    ++notified[notify];
    const uint8_t* p = (*dst)->data() + notify * kSlot;
    for (size_t k = 0; k < kSlot; ++k)
      bad_bytes += p[k] != notify % 251;
  };
  uint32_t completed = 0, failed = 0;
  // Every write is issued before any progress: all 10,000 are in flight.
  for (uint32_t i = 0; i < kWrites; ++i) {
    const int c = static_cast<int>(i % kConns);
    Status s = conns[c]->write({src->get(), i * kSlot, remotes[c].get(), i * kSlot, kSlot, i},
                               [&](Status st) {
                                 ++completed;
                                 if (!st.ok()) ++failed;
                               });
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  ASSERT_TRUE(pump(
      both(), [&] { return completed == kWrites && server_rec_.num_writes() == kWrites; }, 60s))
      << "completed " << completed << ", notified " << server_rec_.num_writes();
  pump_for(both(), 50ms);  // a duplicate notification would show up now
  EXPECT_EQ(failed, 0u);
  EXPECT_EQ(bad_bytes, 0);
  EXPECT_EQ(server_rec_.num_writes(), kWrites);
  for (uint32_t i = 0; i < kWrites; ++i)
    ASSERT_EQ(notified[i], 1) << "notify " << i;
}

TEST_P(Conformance, BadWritesFailLocallyAndNeverReachThePeer) {
  ConnectionPtr conn = connect();
  ConnectionPtr other = connect();
  ASSERT_NE(conn, nullptr);
  ASSERT_NE(other, nullptr);
  WriteRegions w;
  ASSERT_NO_FATAL_FAILURE(make_write_regions(conn, &w));
  auto remote_other = other->import_region(w.dst->remote_key());
  ASSERT_TRUE(remote_other.ok());

  int callbacks = 0;
  auto count = [&](Status) { ++callbacks; };
  // Past the end of the remote region, and overflowing offsets.
  EXPECT_EQ(conn->write({w.src.get(), 0, w.remote.get(), 1000, 25, 1}, count).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(conn->write({w.src.get(), 0, w.remote.get(), UINT64_MAX, 2, 1}, count).code(),
            StatusCode::kOutOfRange);
  // Past the end of the local region.
  EXPECT_EQ(conn->write({w.src.get(), 4000, w.remote.get(), 0, 100, 1}, count).code(),
            StatusCode::kOutOfRange);
  // A remote region imported on another connection.
  EXPECT_EQ(conn->write({w.src.get(), 0, remote_other->get(), 0, 8, 1}, count).code(),
            StatusCode::kInvalidArgument);
  // A local region that belongs to another transport.
  std::vector<uint8_t> foreign_buf(64);
  auto foreign =
      server_->register_memory(foreign_buf.data(), foreign_buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(foreign.ok());
  EXPECT_EQ(conn->write({foreign->get(), 0, w.remote.get(), 0, 8, 1}, count).code(),
            StatusCode::kInvalidArgument);
  // Malformed and truncated keys.
  std::vector<uint8_t> key(w.dst->remote_key().begin(), w.dst->remote_key().end());
  EXPECT_FALSE(conn->import_region(std::span<const uint8_t>(key.data(), key.size() / 2)).ok());
  EXPECT_FALSE(conn->import_region({}).ok());
  std::vector<uint8_t> garbage(key.size(), 0xab);
  EXPECT_FALSE(conn->import_region(garbage).ok());

  pump_for(both(), 100ms);
  EXPECT_EQ(callbacks, 0) << "a rejected write must not call its completion";
  EXPECT_EQ(server_rec_.num_writes(), 0u);
  EXPECT_TRUE(conn->is_open()) << "a rejected write must not break the connection";

  // The connection still works.
  bool ok = false;
  ASSERT_TRUE(
      conn->write({w.src.get(), 0, w.remote.get(), 0, 1024, 9}, [&](Status s) { ok = s.ok(); })
          .ok());
  ASSERT_TRUE(pump(both(), [&] { return ok && server_rec_.num_writes() == 1; }));
}

// Regions no backend made (their backend() tag is null), as a caller could
// pass by mistake.
class AlienRegion final : public MemoryRegion {
 public:
  AlienRegion(uint8_t* data, size_t length) : MemoryRegion(data, length, MemoryKind::kHost, 1) {}
};
class AlienRemoteRegion final : public RemoteRegion {
 public:
  explicit AlienRemoteRegion(size_t length) : RemoteRegion(length, 1) {}
};

// Connection::write checks a request once for every backend: each bad case
// fails with the same code and message everywhere, through write() and
// check_write() alike, and never calls the completion.
TEST_P(Conformance, EachBadRequestFailsTheSameWayOnEveryBackend) {
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  WriteRegions w;
  ASSERT_NO_FATAL_FAILURE(make_write_regions(conn, &w));
  AlienRegion alien(w.src_buf.data(), w.src_buf.size());
  AlienRemoteRegion alien_remote(1024);

  const MemoryRegion* l = w.src.get();
  const RemoteRegion* r = w.remote.get();
  struct Case {
    const char* what;
    WriteRequest request;
    StatusCode code;
    std::string message;
  };
  const std::string not_source = "write source is not a region registered with this transport";
  const std::string not_target = "write target was not imported on this connection";
  const std::vector<Case> cases = {
      {"no source", {nullptr, 0, r, 0, 8, 1}, StatusCode::kInvalidArgument, not_source},
      {"no target", {l, 0, nullptr, 0, 8, 1}, StatusCode::kInvalidArgument, not_target},
      {"source of no backend", {&alien, 0, r, 0, 8, 1}, StatusCode::kInvalidArgument, not_source},
      {"target of no backend",
       {l, 0, &alien_remote, 0, 8, 1},
       StatusCode::kInvalidArgument,
       not_target},
      {"past the source's end",
       {l, 4000, r, 0, 100, 1},
       StatusCode::kOutOfRange,
       "write of 100 bytes at offset 4000 exceeds the 4096-byte source region"},
      {"source offset past the end",
       {l, 4097, r, 0, 0, 1},
       StatusCode::kOutOfRange,
       "write of 0 bytes at offset 4097 exceeds the 4096-byte source region"},
      {"source offset overflowing",
       {l, UINT64_MAX, r, 0, 2, 1},
       StatusCode::kOutOfRange,
       "write of 2 bytes at offset 18446744073709551615 exceeds the 4096-byte source region"},
      {"length overflowing",
       {l, 8, r, 0, UINT64_MAX - 4, 1},
       StatusCode::kOutOfRange,
       "write of 18446744073709551611 bytes at offset 8 exceeds the 4096-byte source region"},
      {"past the target's end",
       {l, 0, r, 1000, 25, 1},
       StatusCode::kOutOfRange,
       "write of 25 bytes at offset 1000 exceeds the 1024-byte remote region"},
      {"target offset overflowing",
       {l, 0, r, UINT64_MAX, 2, 1},
       StatusCode::kOutOfRange,
       "write of 2 bytes at offset 18446744073709551615 exceeds the 1024-byte remote region"},
  };
  int callbacks = 0;
  for (const Case& c : cases) {
    Status checked = conn->check_write(c.request);
    EXPECT_EQ(checked.code(), c.code) << c.what << ": " << checked.to_string();
    EXPECT_EQ(checked.message(), c.message) << c.what;
    Status written = conn->write(c.request, [&](Status) { ++callbacks; });
    EXPECT_EQ(written.code(), c.code) << c.what << ": " << written.to_string();
    EXPECT_EQ(written.message(), c.message) << c.what;
  }
  pump_for(both(), 50ms);
  EXPECT_EQ(callbacks, 0) << "a rejected write must not call its completion";
  EXPECT_EQ(server_rec_.num_writes(), 0u);
  EXPECT_TRUE(conn->is_open());

  // Zero bytes at the very end of both regions fit.
  bool ok = false;
  ASSERT_TRUE(conn->write({l, 4096, r, 1024, 0, 7}, [&](Status s) { ok = s.ok(); }).ok());
  ASSERT_TRUE(pump(both(), [&] { return ok && server_rec_.num_writes() == 1; }));

  // A request that fits, on a closed connection.
  conn->close();
  EXPECT_EQ(conn->check_write({l, 0, r, 0, 8, 1}).code(), StatusCode::kUnavailable);
  EXPECT_EQ(conn->write({l, 0, r, 0, 8, 1}, [&](Status) { ++callbacks; }).code(),
            StatusCode::kUnavailable);
  pump_for(both(), 20ms);
  EXPECT_EQ(callbacks, 0);
}

TEST_P(Conformance, CloseTellsThePeerAndLaterCallsFail) {
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  conn->close();
  EXPECT_FALSE(conn->is_open());
  conn->close();  // idempotent
  ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_disconnects() == 1; }));
  const uint8_t byte = 1;
  EXPECT_EQ(conn->send({&byte, 1}, nullptr).code(), StatusCode::kUnavailable);
}

TEST_P(Conformance, ShutdownCompletesEveryPendingOperationOnce) {
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  std::vector<uint8_t> src_buf(1 << 20, 3);
  auto src = client_->register_memory(src_buf.data(), src_buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok());
  auto dst = server_->allocate_memory(1 << 20, MemoryKind::kHost);
  ASSERT_TRUE(dst.ok());
  auto remote = conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());
  std::vector<int> calls(64, 0);
  for (uint32_t i = 0; i < 64; ++i) {
    ASSERT_TRUE(conn->write({src->get(), 0, remote->get(), 0, 1 << 20, i},
                            [&calls, i](Status) { ++calls[i]; })
                    .ok());
  }
  client_->shutdown();
  pump_for({server_.get()}, 50ms);
  for (int c : calls)
    EXPECT_EQ(c, 1);
  client_->shutdown();  // idempotent
}

TEST_P(Conformance, PeerShutdownFailsPendingOperationsWithinTheTimeout) {
  ConnectionPtr conn = connect();
  ASSERT_NE(conn, nullptr);
  server_->shutdown();
  std::vector<uint8_t> buf(64, 1);
  ASSERT_TRUE(pump(
      {client_.get()}, [&] { return client_rec_.num_disconnects() == 1; }, op_timeout_ + 5s))
      << "the client was never told its peer went away";
  const uint8_t byte = 1;
  Status s = conn->send({&byte, 1}, nullptr);
  EXPECT_FALSE(s.ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::ValuesIn(conformance_backends()),
                         backend_label);

}  // namespace
}  // namespace psld::transport::testing
