// psld doctor --serve / --peer HOST:PORT: a short latency and bandwidth check
// between two nodes through psld's own transport, next to ucx_perftest's
// active-message primitives between the same nodes (docs/operations.md,
// "psld doctor").
//
// The serving side listens on job.listen with the job's transport options
// (ucx.tls, job.interface, job.secret: the peer must know the same secret)
// and, where ucx_perftest is installed, keeps a ucx_perftest server on a
// port of its own. The peer connects, the two swap the keys of a 4 MiB
// landing region and an echo region in messages, and the peer measures:
//   latency:   8-byte writes with a notification, each echoed by an 8-byte
//              write back; half the median round trip;
//   bandwidth: 4 MiB writes, 8 in flight, each acknowledged by an 8-byte
//              write back; bytes acknowledged over the time taken.
// Then it runs ucx_perftest ucp_am_lat (8 B) and ucp_am_bw (4 MiB) against
// the server's ucx_perftest with the same UCX_TLS, and prints both with
// psld's figure over perftest's as the ratio.
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/net.h"
#include "lib/config/fields.h"
#include "lib/config/interface.h"
#include "lib/config/runtime_options.h"
#include "psld/config.h"
#include "tools/doctor.h"
#include "transports/common/progress_thread.h"
#include "transports/transport.h"

extern char** environ;

namespace psld::tools {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using transport::ConnectionPtr;

constexpr uint64_t kBulkBytes = uint64_t{4} << 20;
constexpr uint64_t kSmallBytes = 8;
constexpr uint32_t kPing = 1;  // notify values
constexpr uint32_t kBulk = 2;
constexpr int kPings = 2000;
constexpr int kWindow = 8;
constexpr auto kBulkTime = 2s;
// Messages: 'K' + u16 ucx_perftest port (0: none) + the landing region's key;
// 'D': the peer is done.
constexpr uint8_t kKeys = 'K';
constexpr uint8_t kDone = 'D';

std::vector<uint8_t> keys_message(uint16_t perftest_port, std::span<const uint8_t> key) {
  std::vector<uint8_t> m(3 + key.size());
  m[0] = kKeys;
  m[1] = static_cast<uint8_t>(perftest_port >> 8);
  m[2] = static_cast<uint8_t>(perftest_port & 0xff);
  std::copy(key.begin(), key.end(), m.begin() + 3);
  return m;
}

// Progresses a transport on a thread that never sleeps, as ucx_perftest's
// processes do: the figures compare the transports and the link, not how
// quickly a sleeping thread wakes (psld's runtime sleeps when idle).
class BusyProgress {
 public:
  explicit BusyProgress(transport::Transport& t)
      : t_(t), thread_([this] {
          while (!stop_.load(std::memory_order_relaxed))
            t_.progress();
        }) {}
  ~BusyProgress() { stop(); }
  BusyProgress(const BusyProgress&) = delete;
  BusyProgress& operator=(const BusyProgress&) = delete;
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  transport::Transport& t_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Both sides: one connection, its peer's regions once the keys came.
class Side : public transport::Handler {
 public:
  void on_accept(const ConnectionPtr& conn) override {
    std::lock_guard<std::mutex> lock(mu);
    if (this->conn) {
      conn->close();  // one peer at a time
      return;
    }
    this->conn = conn;
    cv.notify_all();
  }
  void on_write(const ConnectionPtr& c, uint32_t notify, uint64_t) override {
    if (serving) {
      // Echo every ping and acknowledge every bulk write with 8 bytes back.
      std::shared_ptr<transport::RemoteRegion> back;
      {
        std::lock_guard<std::mutex> lock(mu);
        back = peer_echo;
      }
      if (back) (void)c->write({small.get(), 0, back.get(), 0, kSmallBytes, notify}, nullptr);
      return;
    }
    if (notify == kPing) pongs.fetch_add(1, std::memory_order_release);
    if (notify == kBulk) acks.fetch_add(1, std::memory_order_release);
  }
  void on_message(const ConnectionPtr& c, std::span<const uint8_t> m) override {
    if (m.empty()) return;
    std::lock_guard<std::mutex> lock(mu);
    if (m[0] == kDone) {
      done = true;
    } else if (m[0] == kKeys && m.size() > 3) {
      perftest_port = static_cast<uint16_t>((m[1] << 8) | m[2]);
      auto region = c->import_region(m.subspan(3));
      if (region.ok()) {
        (serving ? peer_echo : peer_landing) = *region;
      } else {
        error = region.status().to_string();
      }
      if (serving && region.ok()) {
        (void)c->send(keys_message(our_perftest_port, landing->remote_key()), nullptr);
      }
    }
    cv.notify_all();
  }
  void on_disconnect(const ConnectionPtr&, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu);
    gone = true;
    error = why.to_string();
    cv.notify_all();
  }

  bool serving = false;
  uint16_t our_perftest_port = 0;
  std::shared_ptr<transport::MemoryRegion> landing;  // 4 MiB: bulk writes land here
  std::shared_ptr<transport::MemoryRegion> small;    // 8 B: the source of echoes
  std::shared_ptr<transport::MemoryRegion> echo;     // where the peer's echoes land

  std::mutex mu;
  std::condition_variable cv;
  ConnectionPtr conn;
  std::shared_ptr<transport::RemoteRegion> peer_landing;  // the peer: server's landing
  std::shared_ptr<transport::RemoteRegion> peer_echo;     // the server: peer's echo region
  uint16_t perftest_port = 0;
  bool done = false;
  bool gone = false;
  std::string error;
  std::atomic<uint64_t> pongs{0};
  std::atomic<uint64_t> acks{0};
};

Result<RuntimeOptions> options_of(const Config& config) {
  RuntimeOptions o = runtime_options_from_config(config);
  PSLD_RETURN_IF_ERROR(apply_interface(config, o));
  o.net.options.common.op_timeout = 10s;
  o.net.options.common.secret = config.job.secret;
  return o;
}

std::optional<std::string> find_perftest() {
  std::stringstream path(std::getenv("PATH") != nullptr ? std::getenv("PATH") : "/usr/bin");
  for (std::string dir; std::getline(path, dir, ':');) {
    const std::string p = dir + "/ucx_perftest";
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return std::nullopt;
}

// Runs argv with UCX_TLS=tls (when set), its output to a pipe: in its own
// process group (`own_group`, killed as a group), or in this process's
// group, so that whoever kills this process's group (a test, a terminal's
// Ctrl-C) stops it too.
struct Child {
  pid_t pid = -1;
  int out = -1;
};
Result<Child> spawn(const std::vector<std::string>& argv, const std::string& tls,
                    bool own_group = true) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Unavailable("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (own_group) {
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
  }
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "UCX_TLS=", 8) != 0) env.emplace_back(*e);
  }
  if (!tls.empty()) env.push_back("UCX_TLS=" + tls);
  env.emplace_back("UCX_WARN_UNUSED_ENV_VARS=n");
  std::vector<char*> cargv;
  std::vector<char*> cenv;
  cargv.reserve(argv.size() + 1);
  cenv.reserve(env.size() + 1);
  for (const auto& a : argv)
    cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : env)
    cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  Child c;
  const int rc = posix_spawn(&c.pid, cargv[0], &actions, &attr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return Unavailable(fmt::format("cannot start {}: {}", argv[0], std::strerror(rc)));
  }
  c.out = fds[0];
  return c;
}

std::optional<std::string> run_child(const std::vector<std::string>& argv, const std::string& tls,
                                     std::chrono::seconds timeout) {
  auto c = spawn(argv, tls);
  if (!c.ok()) return std::nullopt;
  fcntl(c->out, F_SETFL, O_NONBLOCK);
  std::string out;
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  bool exited = false;
  while (Clock::now() < deadline) {
    char buf[4096];
    ssize_t n;
    while ((n = read(c->out, buf, sizeof(buf))) > 0)
      out.append(buf, static_cast<size_t>(n));
    if (waitpid(c->pid, &status, WNOHANG) == c->pid) {
      exited = true;
      while ((n = read(c->out, buf, sizeof(buf))) > 0)
        out.append(buf, static_cast<size_t>(n));
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  if (!exited) {
    kill(-c->pid, SIGKILL);
    waitpid(c->pid, &status, 0);
  }
  close(c->out);
  if (!exited || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return std::nullopt;
  }
  return out;
}

// The last CSV row of `ucx_perftest -v`:
// iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,...
std::optional<std::vector<double>> perftest_row(const std::string& out) {
  std::optional<std::vector<double>> row;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    const size_t first = line.find_first_not_of(' ');
    if (first == std::string::npos || !std::isdigit(static_cast<unsigned char>(line[first]))) {
      continue;
    }
    std::vector<double> v;
    std::istringstream f(line);
    for (std::string cell; std::getline(f, cell, ',');)
      v.push_back(std::strtod(cell.c_str(), nullptr));
    if (v.size() >= 6) row = v;
  }
  return row;
}

std::string host_of(const std::string& address) {
  std::string host;
  std::string port;
  return config_detail::split_endpoint_unbracketed(address, &host, &port) ? host : address;
}

}  // namespace

int cmd_doctor_serve(const Config& config, bool once) {
  auto o = options_of(config);
  if (!o.ok()) return std::fprintf(stderr, "psld doctor: %s\n", o.status().message().c_str()), 1;
  Side side;
  side.serving = true;
  std::optional<std::string> perftest = find_perftest();
  if (perftest)
    side.our_perftest_port = static_cast<uint16_t>(std::max(0, free_tcp_port(INADDR_ANY)));
  auto t = transport::create_transport(o->net.transport, o->net.options, &side);
  if (!t.ok()) {
    std::fprintf(stderr, "psld doctor: %s\n", t.status().to_string().c_str());
    return 1;
  }
  auto landing = (*t)->allocate_memory(kBulkBytes, MemoryKind::kHost);
  auto small = (*t)->allocate_memory(kSmallBytes, MemoryKind::kHost);
  if (!landing.ok() || !small.ok()) {
    std::fprintf(stderr, "psld doctor: cannot allocate the landing region\n");
    return 1;
  }
  side.landing = *landing;
  side.small = *small;
  // Serving waits idle between peers: the sleeping progress thread, and a
  // busy one while a peer is connected.
  auto progress = transport::ProgressThread::start(**t);
  if (!progress.ok()) return 1;
  const std::vector<uint8_t> addr = (*t)->address();
  std::printf("psld doctor: serving at %s over %s%s\n",
              std::string(addr.begin(), addr.end()).c_str(), o->net.transport.c_str(),
              perftest ? fmt::format(", ucx_perftest on port {}", side.our_perftest_port).c_str()
                       : " (no ucx_perftest here)");
  std::fflush(stdout);
  // ucx_perftest serves one client per run: a new server after each.
  std::optional<Child> perf;
  auto start_perftest = [&] {
    if (!perftest || side.our_perftest_port == 0) return;
    // In this process's group: a serving side killed with its group (as
    // tests stop it) takes its ucx_perftest server along.
    auto c = spawn({*perftest, "-p", std::to_string(side.our_perftest_port)},
                   o->net.options.ucx.tls, /*own_group=*/false);
    if (c.ok()) {
      close(c->out);  // its output is not needed
      perf = *c;
    }
  };
  start_perftest();
  std::unique_ptr<BusyProgress> busy;
  std::unique_lock<std::mutex> lock(side.mu);
  while (!(once && (side.done || side.gone))) {
    side.cv.wait_for(lock, 100ms);
    if (perf && waitpid(perf->pid, nullptr, WNOHANG) == perf->pid) {
      perf.reset();
      lock.unlock();
      start_perftest();
      lock.lock();
    }
    const bool peer = side.conn && !side.gone && !side.done;
    if (peer && !busy) {  // a peer: progress without sleeping while it measures
      lock.unlock();
      (*progress)->stop();
      busy = std::make_unique<BusyProgress>(**t);
      lock.lock();
    } else if (!peer && busy) {
      lock.unlock();
      busy.reset();
      progress = transport::ProgressThread::start(**t);
      lock.lock();
      if (!progress.ok()) break;
    }
    if ((side.gone || side.done) && !once) {  // ready for the next peer
      if (side.conn) side.conn->close();
      side.conn.reset();
      side.peer_echo.reset();
      side.gone = false;
      side.done = false;
    }
  }
  lock.unlock();
  if (perf) {
    kill(perf->pid, SIGKILL);
    waitpid(perf->pid, nullptr, 0);
  }
  busy.reset();
  if (progress.ok()) (*progress)->stop();
  side.conn.reset();
  side.peer_echo.reset();
  (*t)->shutdown();
  std::printf("psld doctor: the peer is done\n");
  return 0;
}

int cmd_doctor_peer(const Config& config, const std::string& address) {
  Config c = config;
  c.job.listen = "";
  auto o = options_of(c);
  if (!o.ok()) return std::fprintf(stderr, "psld doctor: %s\n", o.status().message().c_str()), 1;
  o->net.options.common.listen_address.clear();
  o->net.options.common.job_address = address;
  Side side;
  auto t = transport::create_transport(o->net.transport, o->net.options, &side);
  if (!t.ok()) {
    std::fprintf(stderr, "psld doctor: %s\n", t.status().to_string().c_str());
    return 1;
  }
  auto src = (*t)->allocate_memory(kBulkBytes, MemoryKind::kHost);
  auto echo = (*t)->allocate_memory(kSmallBytes, MemoryKind::kHost);
  if (!src.ok() || !echo.ok()) return std::fprintf(stderr, "psld doctor: allocate failed\n"), 1;
  std::memset((*src)->data(), 0x5a, kBulkBytes);
  auto progress = std::make_unique<BusyProgress>(**t);
  auto conn = (*t)->connect({reinterpret_cast<const uint8_t*>(address.data()), address.size()});
  auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "psld doctor: peer %s: %s\n", address.c_str(), why.c_str());
    progress->stop();
    (*t)->shutdown();
    return 1;
  };
  if (!conn.ok()) return fail(conn.status().to_string());
  if (Status s = (*conn)->send(keys_message(0, (*echo)->remote_key()), nullptr); !s.ok()) {
    return fail(s.to_string());
  }
  {
    std::unique_lock<std::mutex> lock(side.mu);
    if (!side.cv.wait_for(lock, 10s, [&] { return side.peer_landing || side.gone; }) ||
        !side.peer_landing) {
      return fail("no keys from the serving side within 10 s" +
                  (side.error.empty() ? "" : ": " + side.error) +
                  " (is `psld doctor --serve` running there, with the same job.secret?)");
    }
  }
  const auto* remote = side.peer_landing.get();
  // From here this thread progresses the transport itself, as ucx_perftest
  // does: one busy thread per side.
  progress->stop();
  auto wait_for = [&](std::atomic<uint64_t>& counter, uint64_t want) {
    const auto deadline = Clock::now() + 10s;
    while (counter.load(std::memory_order_acquire) < want) {
      if (Clock::now() > deadline) return false;
      (*t)->progress();
    }
    return true;
  };
  // Latency: ping-pong of 8 bytes.
  std::vector<double> rtt_us;
  for (int i = 0; i < kPings + 100; ++i) {
    const auto t0 = Clock::now();
    Status s = (*conn)->write({src->get(), 0, remote, 0, kSmallBytes, kPing}, nullptr);
    if (!s.ok()) return fail("ping: " + s.to_string());
    if (!wait_for(side.pongs, static_cast<uint64_t>(i) + 1))
      return fail("a ping got no echo in 10 s");
    if (i >= 100) {  // the first 100 warm the path up
      rtt_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  std::sort(rtt_us.begin(), rtt_us.end());
  const double one_way_us = rtt_us[rtt_us.size() / 2] / 2;
  const double p99_us = rtt_us[rtt_us.size() * 99 / 100] / 2;
  // Bandwidth: 4 MiB writes, kWindow in flight, for kBulkTime.
  uint64_t issued = 0;
  const auto start = Clock::now();
  while (Clock::now() - start < kBulkTime) {
    while (issued < side.acks.load(std::memory_order_acquire) + kWindow) {
      Status s = (*conn)->write({src->get(), 0, remote, 0, kBulkBytes, kBulk}, nullptr);
      if (!s.ok()) return fail("bulk write: " + s.to_string());
      ++issued;
    }
    (*t)->progress();
  }
  if (!wait_for(side.acks, issued)) return fail("bulk writes went unacknowledged for 10 s");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double mib_s = static_cast<double>(issued * kBulkBytes) / seconds / (1 << 20);
  const std::string path = (*conn)->write_path();
  const uint16_t perf_port = side.perftest_port;

  // ucx_perftest between the same two nodes, same UCX_TLS.
  std::optional<double> perf_lat;
  std::optional<double> perf_bw;
  std::string perf_note;
  const auto perftest = find_perftest();
  if (!perftest) {
    perf_note = "no ucx_perftest here (Debian: ucx-utils)";
  } else if (perf_port == 0) {
    perf_note = "no ucx_perftest on the serving side";
  } else {
    const std::string host = host_of(address);
    const std::string tls = o->net.options.ucx.tls;
    auto lat = run_child({*perftest, host, "-p", std::to_string(perf_port), "-t", "ucp_am_lat",
                          "-s", "8", "-n", "20000", "-w", "2000", "-v"},
                         tls, 30s);
    if (lat) {
      if (auto row = perftest_row(*lat)) perf_lat = (*row)[1];
    }
    std::this_thread::sleep_for(300ms);  // the server side starts its next ucx_perftest
    auto bw = run_child({*perftest, host, "-p", std::to_string(perf_port), "-t", "ucp_am_bw", "-s",
                         std::to_string(kBulkBytes), "-n", "200", "-w", "20", "-v"},
                        tls, 30s);
    if (bw) {
      if (auto row = perftest_row(*bw)) perf_bw = (*row)[5];
    }
    if (!perf_lat || !perf_bw) perf_note = "a ucx_perftest run failed or timed out";
  }
  // Only now: a --serve-once side ends, its ucx_perftest with it.
  (void)(*conn)->send(std::vector<uint8_t>{kDone}, nullptr);
  for (const auto until = Clock::now() + 100ms; Clock::now() < until;)
    (*t)->progress();  // let the goodbye leave
  side.conn.reset();
  side.peer_landing.reset();
  conn->reset();
  (*t)->shutdown();
  auto ratio = [](double a, std::optional<double> b) {
    return b && *b > 0 ? fmt::format("{:.2f}x", a / *b) : std::string("n/a");
  };
  std::printf("psld doctor: peer %s over %s (UCX_TLS=%s), write path %s\n", address.c_str(),
              o->net.transport.c_str(),
              o->net.options.ucx.tls.empty() ? "(UCX's choice)" : o->net.options.ucx.tls.c_str(),
              path.c_str());
  std::printf("%-22s %14s %24s %7s\n", "", "psld", "ucx_perftest", "ratio");
  std::printf("%-22s %14s %24s %7s\n", "latency 8 B, one-way",
              fmt::format("{:.2f} us", one_way_us).c_str(),
              perf_lat ? fmt::format("{:.2f} us (ucp_am_lat)", *perf_lat).c_str() : "n/a",
              // Lower is better: perftest's over psld's, so that higher is better.
              perf_lat ? fmt::format("{:.2f}x", *perf_lat / one_way_us).c_str() : "n/a");
  std::printf("%-22s %14s %24s %7s\n", "bandwidth, 4 MiB",
              fmt::format("{:.0f} MiB/s", mib_s).c_str(),
              perf_bw ? fmt::format("{:.0f} MiB/s (ucp_am_bw)", *perf_bw).c_str() : "n/a",
              ratio(mib_s, perf_bw).c_str());
  std::printf("%-22s %14s\n", "latency p99, one-way", fmt::format("{:.2f} us", p99_us).c_str());
  if (!perf_note.empty()) std::printf("ucx_perftest: %s\n", perf_note.c_str());
  std::printf("(ratios: higher is better for psld; latency is ucx_perftest's over psld's)\n");
  return 0;
}

}  // namespace psld::tools
