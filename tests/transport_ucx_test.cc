// What only the UCX backend does: choosing its write path from the lanes,
// honouring ucx.write_path, validating remote keys and incoming writes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
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

Result<std::unique_ptr<Transport>> make_ucx(const std::string& tls, Handler* h,
                                            const std::string& write_path = "auto",
                                            std::chrono::milliseconds timeout = 10s) {
  TransportOptions o;
  o.common.op_timeout = timeout;
  o.ucx.tls = tls;
  o.ucx.write_path = write_path;
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
  UcxPair(const std::string& tls, const std::string& write_path = "auto") {
    auto s = make_ucx(tls, &server_rec, write_path);
    auto c = make_ucx(tls, &client_rec, write_path);
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

}  // namespace
}  // namespace psld::transport::testing
