// bench/transport_bench.cc — psld's UCX transport next to ucx_perftest.
//
// Rows (tools/transport-bench runs this binary and ucx_perftest on the same
// media and prints them side by side):
//
//   ucx_<medium>_write/<bytes>   one-way writes of <bytes> with a window of
//                                16 writes in flight (PSLD_BENCH_WINDOW
//                                changes it), refilled as the
//                                receiver's notifications arrive; bytes/s is
//                                measured to the receiver's on_write, so it
//                                is what an application sees.
//   ucx_<medium>_messages/<bytes> control messages (send(), what load
//                                reports and heartbeats are) of <bytes>,
//                                16 in flight, counted at the receiver's
//                                on_message: messages/s one receiving core
//                                takes at least (docs/scale.md)
//   ucx_<medium>_latency/<bytes> ping-pong: a write with notification one
//                                way, the receiver's handler writes back on
//                                notification; the `one_way` counter is half
//                                a round trip (an iteration is a batch of 256
//                                round trips, timed as one, as ucx_perftest
//                                times its whole run).
//
// medium: tcp (UCX_TLS=tcp) or shm (UCX_TLS=sm,tcp: shared memory carries
// the data, tcp is what sockaddr connection establishment needs in UCX 1.13).
//
// Sender and receiver are two transports in one process, each progressed by
// its own busy-polling thread (the benchmark thread drives the sender), like
// ucx_perftest's two busy-polling processes; on a 2-core machine that is one
// core each. One thread progressing both would serialise sender and receiver
// and halve what either can do.
//
// The target region comes from allocate_memory (landing slots do), the source
// from register_memory on the heap (a trainer's tensor).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transports/transport.h"

namespace psld::transport {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kMaxBytes = int64_t{64} << 20;
constexpr uint32_t kDefaultWindow = 16;

// PSLD_BENCH_WINDOW overrides the number of writes in flight.
uint32_t window() {
  static const uint32_t w = [] {
    const char* env = std::getenv("PSLD_BENCH_WINDOW");
    const long v = env != nullptr ? std::strtol(env, nullptr, 10) : 0;
    return v > 0 ? static_cast<uint32_t>(v) : kDefaultWindow;
  }();
  return w;
}

struct Medium {
  std::string label;
  std::string tls;
};

class alignas(128) CountingHandler : public Handler {
 public:
  void on_accept(const ConnectionPtr& conn) override {
    accepted_conn = conn;
    accepted.store(true);
  }
  void on_write(const ConnectionPtr& conn, uint32_t, uint64_t length) override {
    if (echo.load(std::memory_order_relaxed) && echo_region) {
      // Ping-pong: answer a ping with a write of the same size.
      Status s = conn->write({echo_src, 0, echo_region.get(), 0, length, 0}, nullptr);
      if (!s.ok()) failures.fetch_add(1);
    }
    writes.fetch_add(1, std::memory_order_release);
  }
  void on_message(const ConnectionPtr&, std::span<const uint8_t>) override {
    messages.fetch_add(1, std::memory_order_release);
  }
  void on_disconnect(const ConnectionPtr&, const Status&) override {}

  alignas(128) std::atomic<uint64_t> writes{0};
  alignas(128) std::atomic<uint64_t> messages{0};
  std::atomic<uint64_t> failures{0};
  std::atomic<bool> accepted{false};
  ConnectionPtr accepted_conn;
  std::atomic<bool> echo{false};
  const MemoryRegion* echo_src = nullptr;
  std::shared_ptr<RemoteRegion> echo_region;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Two transports on one medium, connected, with regions both ways, and a
// thread that progresses the receiving side.
class Pair {
 public:
  static Result<std::unique_ptr<Pair>> create(const Medium& m) {
    auto p = std::unique_ptr<Pair>(new Pair);
    TransportOptions o;
    o.ucx.tls = m.tls;
    o.common.op_timeout = std::chrono::seconds(60);
    PSLD_ASSIGN_OR_RETURN(p->receiver_, create_transport("ucx", o, &p->receiver_handler_));
    PSLD_ASSIGN_OR_RETURN(p->sender_, create_transport("ucx", o, &p->sender_handler_));
    PSLD_ASSIGN_OR_RETURN(p->conn_, p->sender_->connect(p->receiver_->address()));
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (!p->receiver_handler_.accepted.load()) {
      p->sender_->progress();
      p->receiver_->progress();
      if (Clock::now() > deadline) return Timeout("the receiver never accepted");
    }
    p->src_buf_.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, kMaxBytes)));
    std::memset(p->src_buf_.get(), 0x5a, kMaxBytes);
    PSLD_ASSIGN_OR_RETURN(
        p->src_, p->sender_->register_memory(p->src_buf_.get(), kMaxBytes, MemoryKind::kHost));
    PSLD_ASSIGN_OR_RETURN(p->dst_, p->receiver_->allocate_memory(kMaxBytes, MemoryKind::kHost));
    PSLD_ASSIGN_OR_RETURN(p->remote_, p->conn_->import_region(p->dst_->remote_key()));
    // The way back, for ping-pong.
    PSLD_ASSIGN_OR_RETURN(p->echo_src_, p->receiver_->allocate_memory(65536, MemoryKind::kHost));
    PSLD_ASSIGN_OR_RETURN(p->echo_dst_, p->sender_->allocate_memory(65536, MemoryKind::kHost));
    PSLD_ASSIGN_OR_RETURN(
        p->receiver_handler_.echo_region,
        p->receiver_handler_.accepted_conn->import_region(p->echo_dst_->remote_key()));
    p->receiver_handler_.echo_src = p->echo_src_.get();
    // One write each way so that the handshake is over and the path chosen.
    for (int i = 0; i < 2; ++i) {
      PSLD_RETURN_IF_ERROR(
          p->conn_->write({p->src_.get(), 0, p->remote_.get(), 0, 64, 0}, nullptr));
      while (p->receiver_handler_.writes.load() < static_cast<uint64_t>(i + 1)) {
        p->sender_->progress();
        p->receiver_->progress();
        if (Clock::now() > deadline) return Timeout("the warm-up write never landed");
      }
    }
    p->path_ = p->conn_->write_path();
    p->running_ = true;
    p->thread_ = std::thread([raw = p.get()] {
      while (raw->running_.load(std::memory_order_relaxed))
        raw->receiver_->progress();
    });
    return p;
  }

  ~Pair() {
    running_ = false;
    if (thread_.joinable()) thread_.join();
    conn_.reset();
    receiver_handler_.accepted_conn.reset();
    receiver_handler_.echo_region.reset();
    remote_.reset();
    if (sender_) sender_->shutdown();
    if (receiver_) receiver_->shutdown();
  }

  Transport& sender() { return *sender_; }
  Connection& conn() { return *conn_; }
  const MemoryRegion* src() const { return src_.get(); }
  const RemoteRegion* remote() const { return remote_.get(); }
  CountingHandler& receiver_handler() { return receiver_handler_; }
  CountingHandler& sender_handler() { return sender_handler_; }
  const std::string& path() const { return path_; }

 private:
  Pair() = default;
  CountingHandler receiver_handler_, sender_handler_;
  std::unique_ptr<Transport> receiver_, sender_;
  ConnectionPtr conn_;
  std::unique_ptr<uint8_t, FreeDeleter> src_buf_;
  std::shared_ptr<MemoryRegion> src_, dst_, echo_src_, echo_dst_;
  std::shared_ptr<RemoteRegion> remote_;
  std::string path_;
  std::atomic<bool> running_{false};
  std::thread thread_;
};

// One pair per medium, made on first use and kept for all its rows.
std::map<std::string, std::unique_ptr<Pair>>& pairs() {
  static std::map<std::string, std::unique_ptr<Pair>> p;
  return p;
}

Pair* pair_for(const Medium& m, benchmark::State& state) {
  auto& slot = pairs()[m.label];
  if (!slot) {
    // Rows run grouped by medium: stop the other media's receiver threads,
    // or they spin on a core this medium's threads need.
    for (auto& [label, other] : pairs()) {
      if (label != m.label) other.reset();
    }
    auto p = Pair::create(m);
    if (!p.ok()) {
      state.SkipWithError(("ucx " + m.label + ": " + p.status().to_string()).c_str());
      return nullptr;
    }
    slot = std::move(p).value();
  }
  return slot.get();
}

void BM_write(benchmark::State& state, const Medium& m) {
  Pair* p = pair_for(m, state);
  if (p == nullptr) return;
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  // Enough writes per iteration that the window's fill and drain are a small
  // part of it: at least 64 MiB or 4 windows.
  const uint64_t batch = std::max<uint64_t>(4 * window(), (uint64_t{64} << 20) / size);
  auto& landed = p->receiver_handler().writes;
  std::atomic<uint64_t> failed{0};
  p->receiver_handler().echo = false;
  for (auto _ : state) {
    const uint64_t base = landed.load(std::memory_order_acquire);
    uint64_t issued = 0;
    const auto t0 = Clock::now();
    while (landed.load(std::memory_order_acquire) - base < batch) {
      while (issued < batch &&
             issued - (landed.load(std::memory_order_acquire) - base) < window()) {
        Status s = p->conn().write({p->src(), 0, p->remote(), 0, size, 0}, [&failed](Status st) {
          if (!st.ok()) failed.fetch_add(1);
        });
        if (!s.ok()) {
          state.SkipWithError(s.to_string().c_str());
          return;
        }
        ++issued;
      }
      p->sender().progress();
    }
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // Completions of the last window.
  p->sender().progress();
  if (failed.load() != 0) state.SkipWithError("some writes failed");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * batch * size));
  state.SetLabel(p->path());
}

// Control messages: `window()` in flight, the next sent as the receiver
// counts one; timed to the receiver's count.
void BM_messages(benchmark::State& state, const Medium& m) {
  Pair* p = pair_for(m, state);
  if (p == nullptr) return;
  const auto size = static_cast<size_t>(state.range(0));
  const std::vector<uint8_t> message(size, 0x5a);
  auto& received = p->receiver_handler().messages;
  constexpr uint64_t kPerIteration = 1024;
  for (auto _ : state) {
    const uint64_t base = received.load(std::memory_order_acquire);
    const auto t0 = Clock::now();
    uint64_t sent = 0;
    while (received.load(std::memory_order_acquire) < base + kPerIteration) {
      while (sent < kPerIteration &&
             sent < received.load(std::memory_order_acquire) - base + window()) {
        Status s = p->conn().send(message, nullptr);
        if (!s.ok()) {
          state.SkipWithError(s.to_string().c_str());
          return;
        }
        ++sent;
      }
      p->sender().progress();
    }
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  state.counters["messages_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kPerIteration), benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kPerIteration * size));
  state.SetLabel(p->path());
}

// Round trips per benchmark iteration: the clock is read once per batch, as
// ucx_perftest reads it once per run (two steady_clock reads per round trip
// were ~20 ns of a ~150 ns one-way figure).
constexpr uint64_t kRoundTripsPerIteration = 256;

void BM_latency(benchmark::State& state, const Medium& m) {
  Pair* p = pair_for(m, state);
  if (p == nullptr) return;
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  auto& pongs = p->sender_handler().writes;
  p->receiver_handler().echo = true;
  // Each iteration is a batch of round trips; Google Benchmark sizes the run
  // by the time reported, so it is the batch's time. The one-way figure is
  // the `one_way` counter: seconds per half round trip.
  for (auto _ : state) {
    const auto t0 = Clock::now();
    for (uint64_t i = 0; i < kRoundTripsPerIteration; ++i) {
      const uint64_t want = pongs.load(std::memory_order_acquire) + 1;
      Status s = p->conn().write({p->src(), 0, p->remote(), 0, size, 1}, nullptr);
      if (!s.ok()) {
        state.SkipWithError(s.to_string().c_str());
        return;
      }
      while (pongs.load(std::memory_order_acquire) < want)
        p->sender().progress();
    }
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  p->receiver_handler().echo = false;
  if (p->receiver_handler().failures.load() != 0) state.SkipWithError("an echo write failed");
  state.counters["one_way"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kRoundTripsPerIteration * 2),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetLabel(p->path());
}

void register_all() {
  static const Medium kMedia[] = {{"tcp", "tcp"}, {"shm", "sm,tcp"}};
  for (const Medium& m : kMedia) {
    auto* bw = benchmark::RegisterBenchmark(("ucx_" + m.label + "_write").c_str(),
                                            [m](benchmark::State& s) { BM_write(s, m); });
    for (int64_t bytes = 4096; bytes <= kMaxBytes; bytes *= 4)
      bw->Arg(bytes);
    bw->UseManualTime()->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("ucx_" + m.label + "_messages").c_str(),
                                 [m](benchmark::State& s) { BM_messages(s, m); })
        ->Arg(320)
        ->Arg(6144)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("ucx_" + m.label + "_latency").c_str(),
                                 [m](benchmark::State& s) { BM_latency(s, m); })
        ->Arg(8)
        ->Arg(4096)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace
}  // namespace psld::transport

int main(int argc, char** argv) {
  // UCX's malloc hooks are not needed (registration is explicit) and cost
  // time on every allocation; the environment still wins.
  setenv("UCX_MEM_MALLOC_HOOKS", "no", 0);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  psld::transport::register_all();
  benchmark::RunSpecifiedBenchmarks();
  psld::transport::pairs().clear();
  benchmark::Shutdown();
  return 0;
}
