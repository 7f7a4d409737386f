// What only the UCX backend does: choosing its write path from the lanes,
// honouring ucx.write_path, validating remote keys and incoming writes.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "tests/transport_test_util.h"
#include "transports/ucx/ucx_transport.h"

namespace psld::transport::testing {
namespace {

using namespace std::chrono_literals;

void fill(uint8_t* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<uint8_t>(x);
  }
}

const uint32_t kDefaultRingSlots = UcxOptions{}.notify_ring_slots;

Result<std::unique_ptr<Transport>> make_ucx(const std::string& tls, Handler* h,
                                            const std::string& write_path = "auto",
                                            std::chrono::milliseconds timeout = 10s,
                                            uint32_t ring_slots = kDefaultRingSlots) {
  TransportOptions o;
  o.common.op_timeout = timeout;
  o.ucx.tls = tls;
  o.ucx.write_path = write_path;
  o.ucx.notify_ring_slots = ring_slots;
  return create_transport("ucx", o, h);
}

UcxCounters counters(const Transport& t) {
  auto c = ucx_counters(t);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? *c : UcxCounters{};
}

// A server and a client on one medium, connected.
class UcxPair {
 public:
  UcxPair(const std::string& tls, const std::string& write_path = "auto",
          uint32_t ring_slots = kDefaultRingSlots) {
    auto s = make_ucx(tls, &server_rec, write_path, 10s, ring_slots);
    auto c = make_ucx(tls, &client_rec, write_path, 10s, ring_slots);
    if (!s.ok() || !c.ok()) {
      ADD_FAILURE() << s.status().to_string() << " / " << c.status().to_string();
      return;
    }
    server = std::move(s).value();
    client = std::move(c).value();
    auto conn_or = client->connect(server->address());
    if (!conn_or.ok()) {
      ADD_FAILURE() << conn_or.status().to_string();
      return;
    }
    conn = *conn_or;
    // Accepted, and the answer to the client's hello arrived: the client's
    // write path is decided.
    if (!pump(
            both(),
            [&] {
              return server_rec.num_accepted() == 1 && conn->write_path().rfind("pending", 0) != 0;
            },
            10s)) {
      ADD_FAILURE() << "the handshake did not finish";
      conn.reset();
    }
  }
  ~UcxPair() {
    if (client) client->shutdown();
    if (server) server->shutdown();
  }
  std::vector<Transport*> both() { return {client.get(), server.get()}; }
  ConnectionPtr server_end() {
    std::lock_guard<std::mutex> lock(server_rec.mu);
    return server_rec.accepted.empty() ? nullptr : server_rec.accepted.back();
  }

  // Writes `length` bytes and checks, when the receiver is notified, that
  // they all landed.
  void write_and_check(const MemoryRegion& src, const RemoteRegion& remote, MemoryRegion& dst,
                       size_t length, uint32_t notify) {
    const size_t before = server_rec.num_writes();
    bool done = false, intact = false;
    Status result;
    server_rec.write_hook = [&](const ConnectionPtr&, uint32_t n, uint64_t len) {
      intact = n == notify && len == length && std::memcmp(dst.data(), src.data(), length) == 0;
    };
    ASSERT_TRUE(conn->write({&src, 0, &remote, 0, length, notify},
                            [&](Status s) {
                              result = s;
                              done = true;
                            })
                    .ok());
    ASSERT_TRUE(pump(
        both(), [&] { return done && server_rec.num_writes() > before; }, 20s))
        << "write of " << length << " bytes did not complete";
    EXPECT_TRUE(result.ok()) << result.to_string();
    EXPECT_TRUE(intact) << "the " << length << "-byte write was not all there at notification";
    server_rec.write_hook = nullptr;
  }

  Recorder server_rec, client_rec;
  std::unique_ptr<Transport> server, client;
  ConnectionPtr conn;
};

TEST(Ucx, AutomaticPathOverTcpIsActiveMessages) {
  UcxPair p("tcp");
  ASSERT_NE(p.conn, nullptr);
  std::vector<uint8_t> buf(1 << 20);
  fill(buf.data(), buf.size(), 1);
  auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  auto dst = p.server->allocate_memory(buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto remote = p.conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok()) << remote.status().to_string();
  for (size_t len : {size_t{100}, size_t{1} << 20})
    p.write_and_check(**src, **remote, **dst, len, 5);
  // Decided once the handshake told the client its lanes: tcp has no native
  // put in UCX 1.13.
  EXPECT_EQ(p.conn->write_path(), "am");
  // Addresses are host:port text, as a launcher would build them.
  const auto address = p.server->address();
  const std::string text(address.begin(), address.end());
  EXPECT_EQ(text.rfind("127.0.0.1:", 0), 0u) << text;
  ASSERT_NE(p.server_end(), nullptr);
  EXPECT_EQ(p.server_end()->write_path(), "am");
  const UcxCounters c = counters(*p.client);
  EXPECT_EQ(c.writes_am, 2u);
  EXPECT_EQ(c.writes_put, 0u);
}

TEST(Ucx, ForcedPutOverTcpStillDeliversIntactWrites) {
  UcxPair p("tcp", "put");
  ASSERT_NE(p.conn, nullptr);
  std::vector<uint8_t> buf((1 << 20) + 7);
  fill(buf.data(), buf.size(), 2);
  auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  auto dst = p.server->allocate_memory(buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto remote = p.conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());
  for (size_t len : {size_t{1}, size_t{4097}, buf.size()}) {
    p.write_and_check(**src, **remote, **dst, len, static_cast<uint32_t>(len));
  }
  EXPECT_EQ(p.conn->write_path(), "put");
  const UcxCounters c = counters(*p.client);
  EXPECT_EQ(c.writes_put, 3u);
  EXPECT_GE(c.flushes, 1u) << "put is followed by a flush before the notification";
}

TEST(Ucx, SharedMemoryPutsIntoAllocatedRegionsAndFallsBackForHeapRegions) {
  UcxPair p("sm,tcp");
  ASSERT_NE(p.conn, nullptr);
  std::vector<uint8_t> buf(256 << 10);
  fill(buf.data(), buf.size(), 3);
  auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok());
  auto allocated = p.server->allocate_memory(buf.size(), MemoryKind::kHost);
  std::vector<uint8_t> heap(buf.size());
  auto registered = p.server->register_memory(heap.data(), heap.size(), MemoryKind::kHost);
  ASSERT_TRUE(allocated.ok() && registered.ok());
  auto to_allocated = p.conn->import_region((*allocated)->remote_key());
  auto to_registered = p.conn->import_region((*registered)->remote_key());
  ASSERT_TRUE(to_allocated.ok() && to_registered.ok());

  p.write_and_check(**src, **to_allocated, **allocated, buf.size(), 1);
  EXPECT_EQ(p.conn->write_path(), "put");
  UcxCounters c = counters(*p.client);
  EXPECT_EQ(c.writes_put, 1u);
  p.write_and_check(**src, **to_registered, **registered, buf.size(), 2);
  c = counters(*p.client);
  EXPECT_EQ(c.writes_put, 1u);
  EXPECT_EQ(c.writes_am, 1u) << "a heap region the peer cannot map is reached by active message";
}

TEST(Ucx, InvalidWritePathIsAClearInvalidArgument) {
  Recorder rec;
  auto t = make_ucx("tcp", &rec, "fast");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("ucx.write_path"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("auto, put, am"), std::string::npos) << t.status().message();
}

TEST(Ucx, BadOptionsAreInvalidArguments) {
  Recorder rec;
  TransportOptions o;
  o.ucx.tls = "tcp";
  o.common.listen_address = "no-port-here";
  auto t = create_transport("ucx", o, &rec);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().to_string();
  o.common.listen_address = "127.0.0.1:0";
  o.common.op_timeout = 0ms;
  EXPECT_EQ(create_transport("ucx", o, &rec).status().code(), StatusCode::kInvalidArgument);
}

TEST(Ucx, CudaMemoryIsUnimplementedForNow) {
  Recorder rec;
  auto t = make_ucx("tcp", &rec);
  ASSERT_TRUE(t.ok());
  std::vector<uint8_t> buf(64);
  EXPECT_EQ((*t)->register_memory(buf.data(), buf.size(), MemoryKind::kCuda).status().code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ((*t)->allocate_memory(64, MemoryKind::kCuda).status().code(),
            StatusCode::kUnimplemented);
}

TEST(Ucx, KeysFromAnotherTransportAreRejected) {
  UcxPair p("tcp");
  ASSERT_NE(p.conn, nullptr);
  // Another transport kind: a loopback key.
  Recorder lrec;
  TransportOptions lo;
  lo.loopback.fabric = std::make_shared<LoopbackFabric>();
  auto loop = create_transport("loopback", lo, &lrec);
  ASSERT_TRUE(loop.ok());
  auto loop_region = (*loop)->allocate_memory(4096, MemoryKind::kHost);
  ASSERT_TRUE(loop_region.ok());
  auto r = p.conn->import_region((*loop_region)->remote_key());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
  EXPECT_NE(r.status().message().find("not a UCX remote key"), std::string::npos);

  // A UCX key, but from a transport this connection does not lead to.
  Recorder third_rec;
  auto third = make_ucx("tcp", &third_rec);
  ASSERT_TRUE(third.ok());
  auto foreign = (*third)->allocate_memory(4096, MemoryKind::kHost);
  ASSERT_TRUE(foreign.ok());
  r = p.conn->import_region((*foreign)->remote_key());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();

  // Imported before the handshake named the peer, the same key is refused by
  // the first write instead, and nothing reaches the server.
  auto early = p.client->connect(p.server->address());
  ASSERT_TRUE(early.ok());
  auto early_remote = (*early)->import_region((*foreign)->remote_key());
  ASSERT_TRUE(early_remote.ok()) << "the owner cannot be checked before the handshake";
  std::vector<uint8_t> src_buf(64, 1);
  auto src = p.client->register_memory(src_buf.data(), src_buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok());
  Status result;
  bool done = false;
  Status started = (*early)->write({src->get(), 0, early_remote->get(), 0, 64, 1}, [&](Status s) {
    result = s;
    done = true;
  });
  if (started.ok()) {
    ASSERT_TRUE(pump(
        p.both(), [&] { return done; }, 10s));
    EXPECT_EQ(result.code(), StatusCode::kInvalidArgument) << result.to_string();
  } else {
    EXPECT_EQ(started.code(), StatusCode::kInvalidArgument) << started.to_string();
  }
  pump_for(p.both(), 50ms);
  EXPECT_EQ(p.server_rec.num_writes(), 0u);

  // Every single flipped bit of a valid key is caught (checksum, magic,
  // bounds), never handed to UCX as garbage.
  auto own = p.server->allocate_memory(4096, MemoryKind::kHost);
  ASSERT_TRUE(own.ok());
  std::vector<uint8_t> key((*own)->remote_key().begin(), (*own)->remote_key().end());
  for (size_t i = 0; i < key.size(); ++i) {
    key[i] ^= 0x10;
    EXPECT_FALSE(p.conn->import_region(key).ok()) << "flipped byte " << i;
    key[i] ^= 0x10;
  }
  EXPECT_TRUE(p.conn->import_region(key).ok());
}

TEST(Ucx, WritesToAnInvalidatedRegionAreRejectedByTheReceiver) {
  UcxPair p("tcp");
  ASSERT_NE(p.conn, nullptr);
  // 1 MiB: above the 128 KiB up to which "am" writes go eager, so the second
  // write is a rendezvous the receiver must refuse to receive.
  std::vector<uint8_t> src_buf(1 << 20, 9), landing(1 << 20, 0);
  auto src = p.client->register_memory(src_buf.data(), src_buf.size(), MemoryKind::kHost);
  auto dst = p.server->register_memory(landing.data(), landing.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto remote = p.conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());
  ASSERT_TRUE(p.server->invalidate(landing.data(), landing.size()).ok());
  dst->reset();  // the server lets go: the region is gone
  // Eager (small) and rendezvous (large) writes alike.
  int completions = 0;
  for (size_t len : {size_t{64}, src_buf.size()}) {
    ASSERT_TRUE(
        p.conn->write({src->get(), 0, remote->get(), 0, len, 1}, [&](Status) { ++completions; })
            .ok());
  }
  ASSERT_TRUE(pump(
      p.both(), [&] { return counters(*p.server).rejected_writes == 2; }, 10s))
      << "rejected " << counters(*p.server).rejected_writes;
  ASSERT_TRUE(pump(
      p.both(), [&] { return completions == 2; }, 15s));
  pump_for(p.both(), 50ms);
  EXPECT_EQ(p.server_rec.num_writes(), 0u);
  EXPECT_TRUE(std::all_of(landing.begin(), landing.end(), [](uint8_t b) { return b == 0; }))
      << "a rejected write touched memory";
  EXPECT_TRUE(p.conn->is_open()) << "a stale key does not break the connection";
}

TEST(Ucx, ConnectingToNobodyFailsWithinTheTimeout) {
  std::vector<uint8_t> address;
  {
    Recorder gone_rec;
    auto gone = make_ucx("tcp", &gone_rec);
    ASSERT_TRUE(gone.ok());
    address = (*gone)->address();
  }
  Recorder rec;
  auto t = make_ucx("tcp", &rec, "auto", 2s);
  ASSERT_TRUE(t.ok());
  auto conn = (*t)->connect(address);
  if (!conn.ok()) {
    EXPECT_EQ(conn.status().code(), StatusCode::kUnavailable) << conn.status().to_string();
    return;
  }
  Status result;
  bool done = false;
  const uint8_t byte = 1;
  ASSERT_TRUE((*conn)
                  ->send({&byte, 1},
                         [&](Status s) {
                           result = s;
                           done = true;
                         })
                  .ok());
  ASSERT_TRUE(pump(
      {t->get()}, [&] { return done && rec.num_disconnects() == 1; }, 5s));
  EXPECT_FALSE(result.ok());
  EXPECT_FALSE((*conn)->is_open());
  EXPECT_EQ((*t)->connect(std::vector<uint8_t>{1, 2, 3}).status().code(),
            StatusCode::kInvalidArgument);
  const std::string no_port = "localhost";
  EXPECT_EQ((*t)->connect({reinterpret_cast<const uint8_t*>(no_port.data()), no_port.size()})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(Ucx, HandlersMayCloseAndSendFromInsideProgress) {
  // The server answers every message and then closes; both happen inside its
  // progress(), on the thread that runs it.
  struct Answering : Recorder {
    void on_message(const ConnectionPtr& conn, std::span<const uint8_t> m) override {
      Recorder::on_message(conn, m);
      EXPECT_TRUE(conn->send(m, nullptr).ok());
      conn->close();
    }
  };
  Answering server_rec;
  Recorder client_rec;
  auto server = make_ucx("tcp", &server_rec);
  auto client = make_ucx("tcp", &client_rec);
  ASSERT_TRUE(server.ok() && client.ok());
  auto conn = (*client)->connect((*server)->address());
  ASSERT_TRUE(conn.ok());
  const std::string hi = "ping";
  ASSERT_TRUE(
      (*conn)->send({reinterpret_cast<const uint8_t*>(hi.data()), hi.size()}, nullptr).ok());
  std::vector<Transport*> both{client->get(), server->get()};
  ASSERT_TRUE(pump(
      both, [&] { return client_rec.num_messages() == 1 && client_rec.num_disconnects() == 1; },
      10s));
}

TEST(Ucx, AServerMayTalkAsSoonAsItAccepts) {
  // The server's first message usually reaches the client in the same
  // ucp_worker_progress() call as the handshake answer; it must not be lost.
  struct Greeting : Recorder {
    void on_accept(const ConnectionPtr& conn) override {
      Recorder::on_accept(conn);
      const uint8_t hi[] = {'h', 'i'};
      EXPECT_TRUE(conn->send(hi, nullptr).ok());
    }
  };
  for (const std::string tls : {"tcp", "sm,tcp"}) {
    Greeting server_rec;
    Recorder client_rec;
    auto server = make_ucx(tls, &server_rec);
    auto client = make_ucx(tls, &client_rec);
    ASSERT_TRUE(server.ok() && client.ok());
    for (int i = 0; i < 20; ++i) {
      auto conn = (*client)->connect((*server)->address());
      ASSERT_TRUE(conn.ok());
      std::vector<Transport*> both{client->get(), server->get()};
      ASSERT_TRUE(pump(
          both, [&] { return client_rec.num_messages() == static_cast<size_t>(i + 1); }, 10s))
          << tls << ": greeting " << i << " lost";
      EXPECT_EQ(counters(**client).rejected_messages, 0u);
      (*conn)->close();
    }
  }
}

TEST(Ucx, ProgressThreadsSleepInWaitAndAreWokenByNewOperations) {
  // Each transport is driven by its own thread that sleeps in wait() when
  // idle; the test thread only issues operations. An operation started while
  // the progress thread sleeps must wake it: with 50 ms waits, 2,000 writes
  // that each waited out a sleep would take 100 s.
  struct Counting : Handler {
    void on_accept(const ConnectionPtr& c) override {
      std::lock_guard<std::mutex> lock(mu);
      accepted = c;
    }
    void on_write(const ConnectionPtr&, uint32_t, uint64_t) override { ++writes; }
    void on_message(const ConnectionPtr&, std::span<const uint8_t>) override { ++messages; }
    std::mutex mu;
    ConnectionPtr accepted;
    std::atomic<int> writes{0}, messages{0};
  };
  for (const std::string tls : {"tcp", "sm,tcp"}) {
    Counting server_rec, client_rec;
    auto server = make_ucx(tls, &server_rec);
    auto client = make_ucx(tls, &client_rec);
    ASSERT_TRUE(server.ok() && client.ok());
    std::atomic<bool> run{true};
    auto drive = [&run](Transport* t) {
      while (run.load()) {
        if (t->progress() == 0) t->wait(50ms);
      }
    };
    std::thread server_thread(drive, server->get()), client_thread(drive, client->get());
    auto conn = (*client)->connect((*server)->address());
    ASSERT_TRUE(conn.ok());
    std::vector<uint8_t> buf(64 << 10, 1);
    auto src = (*client)->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
    auto dst = (*server)->allocate_memory(buf.size(), MemoryKind::kHost);
    ASSERT_TRUE(src.ok() && dst.ok());
    auto remote = (*conn)->import_region((*dst)->remote_key());
    ASSERT_TRUE(remote.ok());
    constexpr int kOps = 2000;
    std::atomic<int> completed{0}, failed{0};
    const auto start = Clock::now();
    for (int i = 0; i < kOps; ++i) {
      const uint64_t len = i % 3 == 0 ? buf.size() : 64;
      ASSERT_TRUE((*conn)
                      ->write({src->get(), 0, remote->get(), 0, len, static_cast<uint32_t>(i)},
                              [&](Status s) {
                                if (!s.ok()) ++failed;
                                ++completed;
                              })
                      .ok());
      const uint8_t m = 1;
      ASSERT_TRUE((*conn)->send({&m, 1}, nullptr).ok());
      // Now and then the test thread pauses, so progress threads fall asleep.
      if (i % 100 == 0) std::this_thread::sleep_for(2ms);
    }
    const auto deadline = Clock::now() + 20s;
    while ((completed.load() < kOps || server_rec.writes.load() < kOps ||
            server_rec.messages.load() < kOps) &&
           Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    const auto took = Clock::now() - start;
    // One at a time: each write waits for its completion and its landing, so
    // both progress threads are asleep when the next one starts.
    constexpr int kSequential = 100;
    const auto seq_start = Clock::now();
    for (int i = 0; i < kSequential && Clock::now() < deadline; ++i) {
      const int want = server_rec.writes.load() + 1, done_before = completed.load();
      ASSERT_TRUE((*conn)
                      ->write({src->get(), 0, remote->get(), 0, 64, 0},
                              [&](Status s) {
                                if (!s.ok()) ++failed;
                                ++completed;
                              })
                      .ok());
      while ((server_rec.writes.load() < want || completed.load() == done_before) &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(100us);
      }
    }
    const auto sequential = Clock::now() - seq_start;
    run = false;
    server_thread.join();
    client_thread.join();
    // wake() ends a long wait at once. With the progress threads gone this
    // thread is the only waiter (a second waiter may take the wake-up first;
    // wake() wakes one thread in wait()), and a wake that comes before the
    // wait starts still ends it: the eventfd stays readable until a wait
    // consumes it.
    while ((*client)->progress() > 0) {
    }
    const auto before_wake = Clock::now();
    std::thread sleeper([&] { (*client)->wait(10s); });
    std::this_thread::sleep_for(20ms);
    (*client)->wake();
    sleeper.join();
    const auto woke_after = Clock::now() - before_wake;
    EXPECT_EQ(completed.load(), kOps + kSequential) << tls;
    EXPECT_EQ(failed.load(), 0) << tls;
    EXPECT_EQ(server_rec.writes.load(), kOps + kSequential) << tls;
    // Woken by each operation, 100 one-at-a-time writes take milliseconds;
    // left to 50 ms timeouts they would take seconds.
    EXPECT_LT(sequential, 2s) << tls << ": a new operation did not wake the progress threads";
    EXPECT_EQ(server_rec.messages.load(), kOps) << tls;
    EXPECT_LT(took, 10s) << tls << ": sleeping progress threads were not woken";
    EXPECT_LT(woke_after, 2s) << tls << ": wake() did not end wait()";
    conn->reset();
    {
      std::lock_guard<std::mutex> lock(server_rec.mu);
      server_rec.accepted.reset();
    }
  }
}

// ---------------------------------------------------------------------------
// The notification ring (shared-memory connections)

// Records every write notification and message of one connection as one
// sequence, checking at each write notification that the write's bytes are
// there.
struct OrderChecker : Handler {
  void on_accept(const ConnectionPtr& c) override {
    std::lock_guard<std::mutex> lock(mu);
    accepted = c;
  }
  void on_write(const ConnectionPtr&, uint32_t notify, uint64_t length) override {
    if (landing != nullptr) {
      uint8_t want[kChunk];
      fill(want, kChunk, notify);
      if (length != kChunk || std::memcmp(landing + offset_of(notify), want, kChunk) != 0) {
        ++not_there;
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(notify);
  }
  void on_message(const ConnectionPtr&, std::span<const uint8_t> m) override {
    uint32_t index = 0;
    if (m.size() == sizeof(index)) std::memcpy(&index, m.data(), sizeof(index));
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(index);
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return order.size();
  }
  static constexpr size_t kChunk = 64;
  // Each write has its own place, so a later write cannot hide a missing one.
  static size_t offset_of(uint32_t index) { return size_t{index} * kChunk; }

  std::mutex mu;
  ConnectionPtr accepted;
  std::vector<uint32_t> order;
  const uint8_t* landing = nullptr;
  std::atomic<int> not_there{0};
};

TEST(UcxRing, WrapsAroundWithWritesAndMessagesInFlightAllDeliveredOnceInOrder) {
  // A 16-slot ring, and bursts of 100 writes (every 7th followed by a
  // message) while the receiver does not progress: each burst fills the ring
  // and the rest falls back to active messages; then the receiver catches
  // up. Notifications and messages must arrive exactly once, in the order
  // they were issued, with every write's bytes in place.
  constexpr uint32_t kSlots = 16, kBursts = 12, kPerBurst = 100;
  OrderChecker server_rec;
  Recorder client_rec;
  auto server = make_ucx("sm,tcp", &server_rec, "auto", 10s, kSlots);
  auto client = make_ucx("sm,tcp", &client_rec, "auto", 10s, kSlots);
  ASSERT_TRUE(server.ok() && client.ok());
  std::vector<Transport*> both{client->get(), server->get()};
  auto conn = (*client)->connect((*server)->address());
  ASSERT_TRUE(conn.ok());
  const size_t bytes = OrderChecker::offset_of(kBursts * kPerBurst * 2);
  auto dst = (*server)->allocate_memory(bytes, MemoryKind::kHost);
  std::vector<uint8_t> src_buf(bytes);
  auto src = (*client)->register_memory(src_buf.data(), src_buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(dst.ok() && src.ok());
  server_rec.landing = (*dst)->data();
  // A key imported before the handshake finished cannot be mapped (UCX does
  // not know the lanes yet) and would be written by active message.
  ASSERT_TRUE(pump(
      both, [&] { return (*conn)->write_path() == "put"; }, 10s));
  auto remote = (*conn)->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());

  uint32_t index = 0;
  int completed = 0, failed = 0;
  for (uint32_t burst = 0; burst < kBursts; ++burst) {
    for (uint32_t i = 0; i < kPerBurst; ++i, ++index) {
      const size_t at = OrderChecker::offset_of(index);
      fill(src_buf.data() + at, OrderChecker::kChunk, index);
      ASSERT_TRUE((*conn)
                      ->write({src->get(), at, remote->get(), at, OrderChecker::kChunk, index},
                              [&](Status s) {
                                ++completed;
                                if (!s.ok()) ++failed;
                              })
                      .ok());
      if (i % 7 == 6) {
        ++index;
        ASSERT_TRUE(
            (*conn)->send({reinterpret_cast<const uint8_t*>(&index), sizeof(index)}, nullptr).ok());
      }
    }
    // Sender side only: UCX sends what it queued, the receiver sleeps.
    pump_for({client->get()}, 2ms);
    ASSERT_TRUE(pump(
        both, [&] { return server_rec.count() == index; }, 20s))
        << "burst " << burst << ": " << server_rec.count() << " of " << index << " arrived";
  }
  ASSERT_TRUE(pump(
      both, [&] { return completed == static_cast<int>(kBursts * kPerBurst); }, 10s));
  pump_for(both, 20ms);
  EXPECT_EQ(failed, 0);
  EXPECT_EQ(server_rec.not_there.load(), 0) << "a write's bytes were not there at notification";
  std::vector<uint32_t> expected(index);
  for (uint32_t i = 0; i < index; ++i)
    expected[i] = i;
  {
    std::lock_guard<std::mutex> lock(server_rec.mu);
    EXPECT_EQ(server_rec.order, expected) << "lost, duplicated or reordered notifications";
  }
  const UcxCounters c = counters(**client);
  EXPECT_GE(c.notify_ring, uint64_t{kSlots} * kBursts) << "the ring wrapped around";
  EXPECT_GT(c.notify_ring_full, 0u) << "bursts larger than the ring fell back";
  EXPECT_EQ(c.notify_ring + c.notify_ring_full, uint64_t{kBursts} * kPerBurst);
  EXPECT_EQ(counters(**server).rejected_writes, 0u);
  conn->reset();
  std::lock_guard<std::mutex> lock(server_rec.mu);
  server_rec.accepted.reset();
}

TEST(UcxRing, AFullRingFallsBackToActiveMessagesAndUsesTheRingAgainOnceRead) {
  UcxPair p("sm,tcp", "auto", 16);
  ASSERT_NE(p.conn, nullptr);
  std::vector<uint8_t> buf(64, 7);
  auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  auto dst = p.server->allocate_memory(4096, MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto remote = p.conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());
  // The server does not progress: 16 records fit, the other 24 go as active
  // messages.
  for (uint32_t i = 0; i < 40; ++i)
    ASSERT_TRUE(p.conn->write({src->get(), 0, remote->get(), 0, 64, i}, nullptr).ok());
  UcxCounters c = counters(*p.client);
  EXPECT_EQ(c.notify_ring, 16u);
  EXPECT_EQ(c.notify_ring_full, 24u);
  ASSERT_TRUE(pump(
      p.both(), [&] { return p.server_rec.num_writes() == 40; }, 10s));
  // Read: the ring has room again.
  ASSERT_TRUE(p.conn->write({src->get(), 0, remote->get(), 0, 64, 40}, nullptr).ok());
  c = counters(*p.client);
  EXPECT_EQ(c.notify_ring, 17u);
  ASSERT_TRUE(pump(
      p.both(), [&] { return p.server_rec.num_writes() == 41; }, 10s));
  std::lock_guard<std::mutex> lock(p.server_rec.mu);
  for (uint32_t i = 0; i < 41; ++i)
    EXPECT_EQ(p.server_rec.writes[i].notify, i);
}

TEST(UcxRing, WritesRacingTheTransportsDestructionEndWithACleanError) {
  // Small writes without completion go through the ring's fast path, which
  // takes no reference to the transport's core and no mapping lock: the
  // connection's ring being mapped is what keeps both alive. One thread
  // writes as fast as it can (small ones, and every 16th too large for the
  // fast path) while the sending transport is destroyed under it. Every
  // write must succeed or fail with Unavailable, never touch unmapped or
  // freed memory (ASan, TSan), and the receiver sees at most what succeeded.
  for (int round = 0; round < 3; ++round) {
    UcxPair p("sm,tcp");
    ASSERT_NE(p.conn, nullptr);
    constexpr size_t kLarge = 128 * 1024;
    std::vector<uint8_t> buf(kLarge, 3);
    auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
    auto dst = p.server->allocate_memory(kLarge, MemoryKind::kHost);
    ASSERT_TRUE(src.ok() && dst.ok());
    ASSERT_EQ(p.conn->write_path(), "put");
    auto remote = p.conn->import_region((*dst)->remote_key());
    ASSERT_TRUE(remote.ok());
    ASSERT_TRUE(p.conn->write({src->get(), 0, remote->get(), 0, 64, 0}, nullptr).ok());
    ASSERT_TRUE(pump(
        p.both(), [&] { return p.server_rec.num_writes() == 1; }, 10s));

    std::atomic<bool> run{true};
    std::thread server_thread([&] {
      while (run.load())
        p.server->progress();
    });
    std::atomic<uint64_t> ok{1};
    Status last;
    std::thread writer([&] {
      for (uint32_t i = 1;; ++i) {
        const uint64_t length = i % 16 == 0 ? kLarge : 64;
        Status s = p.conn->write({src->get(), 0, remote->get(), 0, length, i}, nullptr);
        if (!s.ok()) {
          last = s;
          return;
        }
        ok.fetch_add(1);
      }
    });
    // Some thousands of writes in, then the client transport goes away.
    const auto deadline = Clock::now() + 10s;
    while (ok.load() < 2000 && Clock::now() < deadline) {
      p.client->progress();
    }
    p.client.reset();
    writer.join();
    // What was published still arrives.
    pump_for({p.server.get()}, 20ms);
    run = false;
    server_thread.join();
    EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.to_string();
    EXPECT_GE(ok.load(), 2000u);
    EXPECT_LE(static_cast<uint64_t>(p.server_rec.num_writes()), ok.load());
    EXPECT_EQ(counters(*p.server).rejected_writes, 0u);
    remote->reset();
    p.conn.reset();
  }
}

TEST(UcxRing, OffWhenEitherSideSaysSoOrOverTcp) {
  for (uint32_t server_slots : {0u, kDefaultRingSlots}) {
    Recorder server_rec, client_rec;
    auto server = make_ucx("sm,tcp", &server_rec, "auto", 10s, server_slots);
    auto client = make_ucx("sm,tcp", &client_rec, "auto", 10s, kDefaultRingSlots - server_slots);
    ASSERT_TRUE(server.ok() && client.ok());
    auto conn = (*client)->connect((*server)->address());
    ASSERT_TRUE(conn.ok());
    std::vector<Transport*> both{client->get(), server->get()};
    ASSERT_TRUE(pump(
        both, [&] { return (*conn)->write_path() == "put"; }, 10s));
    auto dst = (*server)->allocate_memory(4096, MemoryKind::kHost);
    std::vector<uint8_t> buf(64, 1);
    auto src = (*client)->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
    ASSERT_TRUE(dst.ok() && src.ok());
    auto remote = (*conn)->import_region((*dst)->remote_key());
    ASSERT_TRUE(remote.ok());
    ASSERT_TRUE((*conn)->write({src->get(), 0, remote->get(), 0, 64, 1}, nullptr).ok());
    ASSERT_TRUE(pump(
        both, [&] { return server_rec.num_writes() == 1; }, 10s));
    EXPECT_EQ(counters(**client).notify_ring, 0u) << "server slots " << server_slots;
    EXPECT_EQ(counters(**client).writes_put, 1u);
  }
  UcxPair tcp("tcp");
  ASSERT_NE(tcp.conn, nullptr);
  auto dst = tcp.server->allocate_memory(4096, MemoryKind::kHost);
  std::vector<uint8_t> buf(64, 1);
  auto src = tcp.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(dst.ok() && src.ok());
  auto remote = tcp.conn->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());
  tcp.write_and_check(**src, **remote, **dst, 64, 3);
  EXPECT_EQ(counters(*tcp.client).notify_ring, 0u);

  Recorder rec;
  for (uint32_t bad : {1u, 8u, 100u, 131072u}) {
    auto t = make_ucx("sm,tcp", &rec, "auto", 10s, bad);
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("ucx.notify_ring_slots"), std::string::npos)
        << t.status().message();
  }
}

TEST(UcxRing, RecordsNamingAnInvalidatedRegionAreRejected) {
  // The receiver remembers the last target its ring's records named; a region
  // invalidated since must not pass on that memory.
  UcxPair p("sm,tcp");
  ASSERT_NE(p.conn, nullptr);
  std::vector<uint8_t> buf(64, 5);
  auto src = p.client->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  auto kept = p.server->allocate_memory(4096, MemoryKind::kHost);
  auto dropped = p.server->allocate_memory(4096, MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && kept.ok() && dropped.ok());
  auto to_kept = p.conn->import_region((*kept)->remote_key());
  auto to_dropped = p.conn->import_region((*dropped)->remote_key());
  ASSERT_TRUE(to_kept.ok() && to_dropped.ok());
  for (uint32_t i = 0; i < 3; ++i)
    p.write_and_check(**src, **to_dropped, **dropped, 64, i);
  dropped->reset();  // no longer exported
  ASSERT_TRUE(p.conn->write({src->get(), 0, to_dropped->get(), 0, 64, 7}, nullptr).ok());
  ASSERT_TRUE(pump(
      p.both(), [&] { return counters(*p.server).rejected_writes == 1; }, 10s));
  p.write_and_check(**src, **to_kept, **kept, 64, 8);
  EXPECT_EQ(p.server_rec.num_writes(), 4u);
  EXPECT_GE(counters(*p.client).notify_ring, 5u);
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

TEST(UcxRing, AReceiverAsleepInWaitIsWokenPromptlyAndIdleCostsNoCpu) {
  // Both sides are driven by threads that sleep in wait() for up to 10 s when
  // idle. A write notified through the ring while the receiver sleeps must
  // wake it (kAmWake): a stranded record would wait out the 10 s.
  struct Counting : Handler {
    void on_accept(const ConnectionPtr& c) override {
      std::lock_guard<std::mutex> lock(mu);
      accepted = c;
    }
    void on_write(const ConnectionPtr&, uint32_t, uint64_t) override { ++writes; }
    void on_message(const ConnectionPtr&, std::span<const uint8_t>) override {}
    std::mutex mu;
    ConnectionPtr accepted;
    std::atomic<int> writes{0};
  };
  Counting server_rec, client_rec;
  auto server = make_ucx("sm,tcp", &server_rec);
  auto client = make_ucx("sm,tcp", &client_rec);
  ASSERT_TRUE(server.ok() && client.ok());
  std::atomic<bool> run{true};
  auto drive = [&run](Transport* t) {
    while (run.load()) {
      if (t->progress() == 0) t->wait(10s);
    }
  };
  std::thread server_thread(drive, server->get()), client_thread(drive, client->get());
  auto conn = (*client)->connect((*server)->address());
  ASSERT_TRUE(conn.ok());
  std::vector<uint8_t> buf(64, 1);
  auto src = (*client)->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  auto dst = (*server)->allocate_memory(4096, MemoryKind::kHost);
  ASSERT_TRUE(src.ok() && dst.ok());
  const auto until = Clock::now() + 20s;
  while ((*conn)->write_path() != "put" && Clock::now() < until)
    std::this_thread::sleep_for(1ms);
  auto remote = (*conn)->import_region((*dst)->remote_key());
  ASSERT_TRUE(remote.ok());
  constexpr int kWrites = 50;
  auto slowest = Clock::duration::zero();
  for (int i = 0; i < kWrites && Clock::now() < until; ++i) {
    // Long enough for the receiver to fall asleep.
    std::this_thread::sleep_for(5ms);
    const int want = server_rec.writes.load() + 1;
    const auto t0 = Clock::now();
    ASSERT_TRUE((*conn)->write({src->get(), 0, remote->get(), 0, 64, 0}, nullptr).ok());
    while (server_rec.writes.load() < want && Clock::now() < until)
      std::this_thread::sleep_for(20us);
    slowest = std::max(slowest, Clock::now() - t0);
  }
  EXPECT_EQ(server_rec.writes.load(), kWrites);
  EXPECT_LT(slowest, 1s) << "a notification waited for the receiver's wait() to time out";
  const UcxCounters c = counters(**client);
  EXPECT_GT(c.notify_ring, 0u);
  EXPECT_GT(c.ring_wakeups, 0u) << "the receiver never slept while a record came";
  // Idle, with rings mapped both ways: the progress threads sleep.
  std::this_thread::sleep_for(50ms);
  const double cpu0 = process_cpu_seconds();
  std::this_thread::sleep_for(300ms);
  const double cpu = process_cpu_seconds() - cpu0;
  EXPECT_LT(cpu, 0.1) << "idle progress threads used " << cpu << " s of CPU in 0.3 s";
  run = false;
  (*server)->wake();
  (*client)->wake();
  server_thread.join();
  client_thread.join();
  conn->reset();
  std::lock_guard<std::mutex> lock(server_rec.mu);
  server_rec.accepted.reset();
}

// The peer-death test's child process (tests/transport_peer_death_child.cc):
// a listening transport in another process, exporting an allocated region.
class Child {
 public:
  static std::string path() {
    char self[4096] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return {};
    std::string dir(self, static_cast<size_t>(n));
    return dir.substr(0, dir.rfind('/')) + "/transport_peer_death_child";
  }
  // Starts it; empty on success, else why not.
  std::string start(const std::string& tls) {
    const std::string exe = path();
    if (exe.empty() || access(exe.c_str(), X_OK) != 0) return "no " + exe + " (build it)";
    int out[2], in[2];
    if (pipe(out) != 0 || pipe(in) != 0) return "pipe failed";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    std::string transport = "ucx";
    std::string tls_arg = tls;
    char* argv[] = {const_cast<char*>(exe.c_str()), transport.data(), tls_arg.data(), nullptr};
    const int rc = posix_spawn(&pid_, exe.c_str(), &fa, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(out[1]);
    ::close(in[0]);
    stdin_ = in[1];
    if (rc != 0) return "posix_spawn failed";
    FILE* f = fdopen(out[0], "r");
    char line[8192];
    while (f != nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
      std::string l(line);
      while (!l.empty() && (l.back() == '\n'))
        l.pop_back();
      if (l.rfind("SKIP ", 0) == 0) return l;
      if (l.rfind("ADDR ", 0) == 0) address = unhex(l.substr(5));
      if (l.rfind("KEY ", 0) == 0 && key.empty()) key = unhex(l.substr(4));
      if (l == "READY") break;
    }
    if (f != nullptr) std::fclose(f);
    return address.empty() || key.empty() ? "the child did not say where it is" : "";
  }
  void kill_now() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  ~Child() {
    kill_now();
    if (stdin_ >= 0) ::close(stdin_);
  }
  std::vector<uint8_t> address, key;

 private:
  static std::vector<uint8_t> unhex(const std::string& h) {
    std::vector<uint8_t> out;
    for (size_t i = 0; i + 1 < h.size(); i += 2)
      out.push_back(static_cast<uint8_t>(std::stoi(h.substr(i, 2), nullptr, 16)));
    return out;
  }
  pid_t pid_ = -1;
  int stdin_ = -1;
};

TEST(UcxRing, APeerKilledWhileItsRingIsInUseFailsWritesWithinTheTimeout) {
  Child child;
  const std::string why = child.start("sm,tcp");
  if (!why.empty()) GTEST_SKIP() << why;
  Recorder rec;
  auto t = make_ucx("sm,tcp", &rec, "auto", 2s, 16);
  ASSERT_TRUE(t.ok());
  auto conn = (*t)->connect(child.address);
  ASSERT_TRUE(conn.ok());
  ASSERT_TRUE(pump(
      {t->get()}, [&] { return (*conn)->write_path() == "put"; }, 10s));
  auto remote = (*conn)->import_region(child.key);
  ASSERT_TRUE(remote.ok()) << remote.status().to_string();
  std::vector<uint8_t> buf(4096, 3);
  auto src = (*t)->register_memory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(src.ok());
  int started = 0, completed = 0, failed = 0;
  auto write_some = [&](int n) {
    for (int i = 0; i < n; ++i) {
      Status s = (*conn)->write({src->get(), 0, remote->get(), 0, 4096, 1}, [&](Status st) {
        ++completed;
        if (!st.ok()) ++failed;
      });
      if (!s.ok()) break;
      ++started;
    }
  };
  // The ring in use: many writes while the child reads them.
  for (int round = 0; round < 20; ++round) {
    write_some(50);
    pump_for({t->get()}, 1ms);
  }
  ASSERT_GT(counters(**t).notify_ring, 0u) << "the ring was not used";
  child.kill_now();
  // Writes after the death: the ring fills (nobody reads it), then active
  // messages, which fail once UCX notices.
  const auto killed = Clock::now();
  write_some(100);
  ASSERT_TRUE(pump(
      {t->get()}, [&] { return rec.num_disconnects() == 1 && completed == started; }, 10s))
      << completed << " of " << started << " completed, " << rec.num_disconnects()
      << " disconnects";
  EXPECT_LT(Clock::now() - killed, 8s);
  EXPECT_FALSE((*conn)->is_open());
  EXPECT_EQ((*conn)->write({src->get(), 0, remote->get(), 0, 64, 1}, nullptr).code(),
            StatusCode::kUnavailable);
  // Unmapping the dead peer's memory and ours is for shutdown; nothing may
  // touch it afterwards (ASan would say).
  remote->reset();
  conn->reset();
  (*t)->shutdown();
}

}  // namespace
}  // namespace psld::transport::testing
