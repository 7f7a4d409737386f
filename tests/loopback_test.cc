// The loopback backend's fault injection, and the progress thread.
#include <gtest/gtest.h>
#include <pthread.h>
#include <time.h>

#include <cstring>
#include <thread>

#include "tests/eventually.h"
#include "tests/transport_test_util.h"
#include "transports/common/progress_thread.h"
#include "transports/loopback/loopback.h"

namespace psld::transport::testing {
namespace {

using namespace std::chrono_literals;

class LoopbackFaults : public ::testing::Test {
 protected:
  void start(const FaultPlan& plan, std::chrono::milliseconds op_timeout = 5s) {
    fabric_ = std::make_shared<LoopbackFabric>();
    fabric_->set_faults(plan);
    TransportOptions o;
    o.common.op_timeout = op_timeout;
    o.loopback.fabric = fabric_;
    server_ = *create_transport("loopback", o, &server_rec_);
    client_ = *create_transport("loopback", o, &client_rec_);
    conn_ = *client_->connect(server_->address());
    ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_accepted() == 1; }));
    src_buf_.assign(4096, 0);
    for (size_t i = 0; i < src_buf_.size(); ++i)
      src_buf_[i] = static_cast<uint8_t>(i * 7 + 1);
    src_ = *client_->register_memory(src_buf_.data(), src_buf_.size(), MemoryKind::kHost);
    dst_ = *server_->allocate_memory(4096, MemoryKind::kHost);
    remote_ = *conn_->import_region(dst_->remote_key());
  }
  void TearDown() override {
    if (client_) client_->shutdown();
    if (server_) server_->shutdown();
  }
  std::vector<Transport*> both() { return {client_.get(), server_.get()}; }

  Status send_u32(uint32_t v, Completion done = nullptr) {
    uint8_t b[4];
    std::memcpy(b, &v, 4);
    return conn_->send({b, 4}, std::move(done));
  }

  std::shared_ptr<LoopbackFabric> fabric_;
  Recorder server_rec_, client_rec_;
  std::unique_ptr<Transport> server_, client_;
  ConnectionPtr conn_;
  std::vector<uint8_t> src_buf_;
  std::shared_ptr<MemoryRegion> src_, dst_;
  std::shared_ptr<RemoteRegion> remote_;
};

TEST_F(LoopbackFaults, DelayHoldsDeliveryBack) {
  FaultPlan plan;
  plan.delay = 30ms;
  start(plan);
  const auto t0 = Clock::now();
  ASSERT_TRUE(send_u32(1).ok());
  ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_messages() == 1; }));
  EXPECT_GE(Clock::now() - t0, 30ms);
}

TEST_F(LoopbackFaults, DroppedOperationTimesOutAndNeverArrives) {
  FaultPlan plan;
  plan.drop = 1.0;
  start(plan, 200ms);
  Status result;
  bool done = false;
  ASSERT_TRUE(conn_
                  ->write({src_.get(), 0, remote_.get(), 0, 64, 5},
                          [&](Status s) {
                            result = s;
                            done = true;
                          })
                  .ok());
  ASSERT_TRUE(pump(
      both(), [&] { return done; }, 5s));
  EXPECT_EQ(result.code(), StatusCode::kTimeout) << result.to_string();
  EXPECT_EQ(server_rec_.num_writes(), 0u);
  EXPECT_TRUE(conn_->is_open()) << "a timed-out operation leaves the connection usable";
  EXPECT_EQ(fabric_->counters().dropped, 1u);
}

TEST_F(LoopbackFaults, DuplicateNotifiesTwiceButCompletesOnce) {
  FaultPlan plan;
  plan.duplicate = 1.0;
  start(plan);
  int completions = 0;
  ASSERT_TRUE(
      conn_->write({src_.get(), 0, remote_.get(), 0, 64, 9}, [&](Status) { ++completions; }).ok());
  ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_writes() == 2 && completions == 1; }));
  pump_for(both(), 20ms);
  EXPECT_EQ(completions, 1);
  EXPECT_EQ(server_rec_.writes[0].notify, 9u);
  EXPECT_EQ(server_rec_.writes[1].notify, 9u);
}

TEST_F(LoopbackFaults, ReorderDeliversEverythingOutOfOrder) {
  FaultPlan plan;
  plan.reorder = 0.3;
  plan.seed = 42;
  start(plan);
  constexpr uint32_t kN = 200;
  for (uint32_t i = 0; i < kN; ++i)
    ASSERT_TRUE(send_u32(i).ok());
  ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_messages() == kN; }));
  std::vector<uint32_t> got;
  for (auto& [conn, bytes] : server_rec_.messages) {
    uint32_t v;
    std::memcpy(&v, bytes.data(), 4);
    got.push_back(v);
  }
  int inversions = 0;
  for (size_t i = 1; i < got.size(); ++i)
    inversions += got[i] < got[i - 1];
  EXPECT_GT(inversions, 0);
  std::sort(got.begin(), got.end());
  for (uint32_t i = 0; i < kN; ++i)
    EXPECT_EQ(got[i], i);
  EXPECT_GT(fabric_->counters().reordered, 0u);
}

TEST_F(LoopbackFaults, CorruptFlipsExactlyOneByte) {
  FaultPlan plan;
  plan.corrupt = 1.0;
  start(plan);
  ASSERT_TRUE(conn_->write({src_.get(), 0, remote_.get(), 0, 4096, 1}, nullptr).ok());
  ASSERT_TRUE(pump(both(), [&] { return server_rec_.num_writes() == 1; }));
  int differing = 0;
  for (size_t i = 0; i < 4096; ++i)
    differing += dst_->data()[i] != src_buf_[i];
  EXPECT_EQ(differing, 1);
}

TEST_F(LoopbackFaults, DisconnectAfterNOperationsBreaksBothEnds) {
  FaultPlan plan;
  plan.disconnect_after = 5;
  start(plan);
  for (uint32_t i = 0; i < 5; ++i)
    ASSERT_TRUE(send_u32(i).ok());
  Status sixth = send_u32(5);
  EXPECT_EQ(sixth.code(), StatusCode::kUnavailable) << sixth.to_string();
  ASSERT_TRUE(pump(both(), [&] {
    return server_rec_.num_disconnects() == 1 && client_rec_.num_disconnects() == 1;
  }));
  EXPECT_FALSE(conn_->is_open());
  EXPECT_EQ(send_u32(6).code(), StatusCode::kUnavailable);
  EXPECT_EQ(fabric_->counters().disconnected, 1u);
}

TEST_F(LoopbackFaults, PlansArePerDialler) {
  fabric_ = std::make_shared<LoopbackFabric>();
  TransportOptions o;
  o.loopback.fabric = fabric_;
  server_ = *create_transport("loopback", o, &server_rec_);
  client_ = *create_transport("loopback", o, &client_rec_);
  Recorder other_rec;
  auto other = *create_transport("loopback", o, &other_rec);
  // Only connections dialled by `other` drop.
  FaultPlan drop_all;
  drop_all.drop = 1.0;
  const std::vector<uint8_t> other_address = other->address();
  fabric_->set_faults(drop_all, std::string(other_address.begin(), other_address.end()));
  auto good = *client_->connect(server_->address());
  auto bad = *other->connect(server_->address());
  const uint8_t b = 1;
  ASSERT_TRUE(good->send({&b, 1}, nullptr).ok());
  ASSERT_TRUE(bad->send({&b, 1}, nullptr).ok());
  pump_for({client_.get(), server_.get(), other.get()}, 30ms);
  EXPECT_EQ(server_rec_.num_messages(), 1u);
  other->shutdown();
}

TEST(LoopbackTransport, NeedsAFabricAndAHandler) {
  TransportOptions o;
  Recorder rec;
  EXPECT_EQ(create_transport("loopback", o, &rec).status().code(), StatusCode::kInvalidArgument);
  o.loopback.fabric = std::make_shared<LoopbackFabric>();
  EXPECT_EQ(create_transport("loopback", o, nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create_transport("no-such-fabric", o, &rec).status().code(), StatusCode::kNotFound);
}

TEST(LoopbackTransport, ConnectToNobodyFails) {
  TransportOptions o;
  o.loopback.fabric = std::make_shared<LoopbackFabric>();
  Recorder rec;
  auto t = *create_transport("loopback", o, &rec);
  const std::string nowhere = "loopback:999";
  auto c = t->connect({reinterpret_cast<const uint8_t*>(nowhere.data()), nowhere.size()});
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  const std::string bogus = "tcp:1.2.3.4";
  c = t->connect({reinterpret_cast<const uint8_t*>(bogus.data()), bogus.size()});
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
}

TEST(LoopbackTransport, InvalidatedRegionRejectsNewWrites) {
  TransportOptions o;
  o.loopback.fabric = std::make_shared<LoopbackFabric>();
  Recorder srec, crec;
  auto server = *create_transport("loopback", o, &srec);
  auto client = *create_transport("loopback", o, &crec);
  auto conn = *client->connect(server->address());
  std::vector<uint8_t> target(256), source(256, 1);
  auto dst = *server->register_memory(target.data(), target.size(), MemoryKind::kHost);
  auto src = *client->register_memory(source.data(), source.size(), MemoryKind::kHost);
  auto remote = *conn->import_region(dst->remote_key());
  ASSERT_TRUE(server->invalidate(target.data(), target.size()).ok());
  // The peer revoked the key: the write fails locally and nothing lands.
  Status s = conn->write({src.get(), 0, remote.get(), 0, 16, 1}, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_EQ(conn->import_region(dst->remote_key()).status().code(), StatusCode::kNotFound);
  pump_for({client.get(), server.get()}, 20ms);
  EXPECT_EQ(srec.num_writes(), 0u);
  EXPECT_EQ(target[0], 0);
}

// CPU time consumed by one thread.
std::chrono::nanoseconds thread_cpu(pthread_t t) {
  clockid_t cid;
  if (pthread_getcpuclockid(t, &cid) != 0) return std::chrono::nanoseconds(-1);
  timespec ts{};
  clock_gettime(cid, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

TEST(ProgressThread, DeliversEventsAndSleepsWhenIdle) {
  TransportOptions o;
  o.loopback.fabric = std::make_shared<LoopbackFabric>();
  Recorder srec, crec;
  auto server = *create_transport("loopback", o, &srec);
  auto client = *create_transport("loopback", o, &crec);
  std::atomic<std::thread::id> handler_thread{};
  srec.write_hook = [&](const ConnectionPtr&, uint32_t, uint64_t) {
    handler_thread = std::this_thread::get_id();
  };
  auto started_pt = ProgressThread::start(*server, 50ms);
  auto started_ct = ProgressThread::start(*client, 50ms);
  ASSERT_TRUE(started_pt.ok() && started_ct.ok());
  ProgressThread& pt = **started_pt;
  ProgressThread& ct = **started_ct;
  auto conn = *client->connect(server->address());
  std::vector<uint8_t> source(64, 2);
  auto src = *client->register_memory(source.data(), source.size(), MemoryKind::kHost);
  auto dst = *server->allocate_memory(64, MemoryKind::kHost);
  auto remote = *conn->import_region(dst->remote_key());
  std::atomic<bool> done{false};
  ASSERT_TRUE(
      conn->write({src.get(), 0, remote.get(), 0, 64, 1}, [&](Status) { done = true; }).ok());
  EXPECT_TRUE(eventually("the write's completion and notification", 5s,
                         [&] { return done && srec.num_writes() != 0; }));
  ASSERT_TRUE(done.load());
  EXPECT_EQ(handler_thread.load(), pt.id()) << "handlers run on the progress thread";

  // Idle for 400 ms: a thread that sleeps in wait() uses a few milliseconds
  // of CPU at most; a spinning one would use all 400.
  const auto cpu0 = thread_cpu(pt.native_handle());
  std::this_thread::sleep_for(400ms);
  const auto cpu1 = thread_cpu(pt.native_handle());
  ASSERT_GE(cpu0.count(), 0);
  EXPECT_LT(cpu1 - cpu0, 40ms) << "the idle progress thread should sleep, not spin";

  // stop() returns promptly even though the thread sleeps up to 50 ms a wait.
  const auto t0 = Clock::now();
  pt.stop();
  ct.stop();
  EXPECT_LT(Clock::now() - t0, 2s);
}

}  // namespace
}  // namespace psld::transport::testing
