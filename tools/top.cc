// psld top: a live view of a running job, from its coordinator's
// /status.json (metrics.listen; docs/operations.md). An observer: it has no
// rank, the job does not count or wait for it, and its death is harmless.
#include "tools/top.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "lib/config/fields.h"
#include "lib/coordinator/job_view.h"
#include "psld/config.h"

namespace psld::tools {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kTopUsage =
    R"(usage: psld top [HOST:PORT] [--once] [--json] [--interval SECONDS]
  Shows a running job live, refreshing in place: per server its share of the
  model, MB/s in and out, busy time, queue delay, the balancer's predicted
  rate and straggler flag; per worker its round, round time and answer
  times per server; the placement epoch, the balancer's last decisions with
  their reasons, and the members. HOST:PORT is the coordinator's
  metrics.listen (default: this configuration's, e.g. PSLD_METRICS_LISTEN);
  `psld launch` prints it. q or Ctrl-C quits.
  --once      print the view once and exit (1 when the coordinator cannot
              be reached)
  --json      print the coordinator's status as JSON (one line per refresh)
  --interval  seconds between refreshes (default 1)
)";

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) {
  g_stop = 1;
}

int fail(const std::string& message) {
  std::fprintf(stderr, "psld top: %s\n", message.c_str());
  return 1;
}

// GET http://address/path with everything bounded by `timeout`: the body
// of a 200 answer, or why not.
Result<std::string> http_get(const std::string& address, const std::string& path,
                             std::chrono::milliseconds timeout) {
  std::string host;
  std::string port;
  if (!config_detail::split_endpoint_unbracketed(address, &host, &port) || port == "0") {
    return InvalidArgument(fmt::format("'{}' is not host:port with a port in 1..65535", address));
  }
  const auto deadline = Clock::now() + timeout;
  auto left_ms = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return Unavailable(fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addrs(found, freeaddrinfo);
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = addrs.get(); a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, left_ms()) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 ||
        err != 0) {
      why = err != 0 ? std::strerror(err) : "timed out";
      close(fd);
      fd = -1;
    }
  }
  if (fd < 0) return Unavailable(fmt::format("cannot connect to {}: {}", address, why));
  const std::string request =
      fmt::format("GET {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", path, address);
  std::string in;
  size_t sent = 0;
  Status st;
  while (st.ok()) {
    pollfd p{fd, static_cast<short>(sent < request.size() ? POLLOUT : POLLIN), 0};
    if (poll(&p, 1, left_ms()) != 1) {
      st = Timeout(fmt::format("{} did not answer within {} ms", address, timeout.count()));
      break;
    }
    if (sent < request.size()) {
      const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EINTR) st = Unavailable(std::strerror(errno));
      if (n > 0) sent += static_cast<size_t>(n);
      continue;
    }
    char buf[65536];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0 && errno != EAGAIN && errno != EINTR) st = Unavailable(std::strerror(errno));
    if (n > 0) in.append(buf, static_cast<size_t>(n));
    if (in.size() > (size_t{64} << 20)) st = ResourceExhausted("an answer over 64 MiB");
  }
  close(fd);
  PSLD_RETURN_IF_ERROR(st);
  const size_t head_end = in.find("\r\n\r\n");
  if (in.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos) {
    return DataLoss(fmt::format("{} did not answer HTTP", address));
  }
  const std::string status_line = in.substr(0, in.find("\r\n"));
  if (status_line.find(" 200 ") == std::string::npos) {
    return Unavailable(fmt::format("{}{}: {}", address, path, status_line));
  }
  return in.substr(head_end + 4);
}

std::string mib(double bytes) {
  return fmt::format("{:.1f}", bytes / 1e6);
}

std::string duration(double s) {
  if (s <= 0) return "-";
  if (s < 1e-3) return fmt::format("{:.0f}us", s * 1e6);
  if (s < 1) return fmt::format("{:.1f}ms", s * 1e3);
  return fmt::format("{:.2f}s", s);
}

std::string bytes_text(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{:.0f} B", b);
}

// The view as text, `width` columns at most per line (reasons are cut).
std::string render(const JobView& v, const std::string& address, size_t width) {
  std::string out;
  auto line = [&](std::string s) {
    if (s.size() > width) s = s.substr(0, width - 1) + "~";
    out += s;
    out += '\n';
  };
  size_t up = 0;
  for (const auto& m : v.members)
    up += m.state == "up";
  line(
      fmt::format("psld top  {}  job {}  round {}  epoch {} ({} switch{}{})  {}/{} members up  "
                  "t={:.1f}s",
                  address, v.state, v.round, v.epoch, v.switches, v.switches == 1 ? "" : "es",
                  v.switching ? ", one being voted on" : "", up,
                  v.num_workers + v.num_servers + v.num_standby, v.time_s));
  std::string steps;
  for (const auto& [kind, n] : v.steps)
    steps += fmt::format(", {} {}", n, kind);
  line(fmt::format("model {} in {} tensors  balancer {}{}  migrated {}{}{}",
                   bytes_text(static_cast<double>(v.model_bytes)), v.tensors,
                   v.balancer ? fmt::format("on: {} decisions", v.balancer_decisions) : "off",
                   steps, bytes_text(static_cast<double>(v.migrated_bytes)),
                   v.failovers ? fmt::format("  failovers {}", v.failovers) : "",
                   v.checkpoints ? fmt::format("  checkpoints {} (round {})", v.checkpoints,
                                               v.last_checkpoint_round)
                                 : ""));
  if (!v.failure.empty()) line("failed: " + v.failure);
  line("");
  line(fmt::format("{:>6}  {:<8} {:>6} {:>9} {:>9} {:>5} {:>8} {:>8} {:>10}  {}", "SERVER", "STATE",
                   "SHARE", "IN MB/s", "OUT MB/s", "BUSY", "Q P50", "Q P99", "PRED MB/s", "FLAG"));
  for (const auto& s : v.servers) {
    line(fmt::format("{:>6}  {:<8} {:>5.1f}% {:>9} {:>9} {:>4.0f}% {:>8} {:>8} {:>10}  {}", s.rank,
                     s.state, s.share * 100, mib(s.in_bytes_per_s), mib(s.out_bytes_per_s),
                     s.busy * 100, duration(s.queue_p50_s), duration(s.queue_p99_s),
                     s.predicted_rate > 0 ? mib(s.predicted_rate) : "-",
                     s.straggler ? "STRAGGLER" : ""));
  }
  line("");
  line(fmt::format("{:>6}  {:>8} {:>9}  {}", "WORKER", "ROUND", "ROUND",
                   "ANSWER mean/p99 by server"));
  for (const auto& w : v.workers) {
    std::string answers;
    for (const auto& a : w.answers) {
      answers += fmt::format("  s{} {}/{}", a.server, duration(a.mean_s), duration(a.p99_s));
    }
    line(fmt::format("{:>6}  {:>8} {:>9} {}", w.rank, w.round, duration(w.round_s), answers));
  }
  line("");
  line("DECISIONS (newest last)");
  if (v.decisions.empty()) line(v.balancer ? "  none yet" : "  none: the balancer is off");
  const size_t first = v.decisions.size() > 6 ? v.decisions.size() - 6 : 0;
  for (size_t i = first; i < v.decisions.size(); ++i) {
    const auto& d = v.decisions[i];
    // The reason names the step and its epoch ("rebalance -> epoch 3: ...").
    line(fmt::format("  t={:.1f}s #{} {}", d.at_s, d.decision, d.reason));
  }
  line("");
  std::string members = "MEMBERS";
  for (const auto& m : v.members) {
    std::string one = fmt::format("  {} {} {}", m.role, m.rank, m.state);
    if (m.state == "up" && m.silent_s > 1) one += fmt::format(" (silent {:.1f}s)", m.silent_s);
    if (members.size() + one.size() > width) {
      line(members);
      members = "       ";
    }
    members += one;
  }
  line(members);
  return out;
}

size_t terminal_width() {
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40) return ws.ws_col;
  return 120;
}

// Keys without Enter while the view runs on a terminal; restored on exit.
class RawKeys {
 public:
  RawKeys() {
    if (isatty(STDIN_FILENO) == 0 || tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    active_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
  }
  ~RawKeys() {
    if (active_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  RawKeys(const RawKeys&) = delete;
  RawKeys& operator=(const RawKeys&) = delete;
  // Waits up to `timeout` for a key; true when it was q.
  bool quit_within(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (!g_stop && Clock::now() < until) {
      pollfd p{STDIN_FILENO, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (!active_) {
        std::this_thread::sleep_for(std::min(left, std::chrono::milliseconds(100)));
        continue;
      }
      if (poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count()))) == 1) {
        char c = 0;
        if (read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q')) return true;
      }
    }
    return g_stop != 0;
  }

 private:
  termios saved_{};
  bool active_ = false;
};

}  // namespace

int cmd_top(int argc, char** argv) {
  std::string address;
  bool once = false;
  bool json = false;
  double interval_s = 1;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--once") {
      once = true;
    } else if (a == "--json") {
      json = true;
    } else if (a == "--interval" && i + 1 < argc) {
      char* end = nullptr;
      interval_s = std::strtod(argv[++i], &end);
      if (*end != '\0' || !(interval_s >= 0.1 && interval_s <= 3600)) {
        return fail(fmt::format("--interval '{}': seconds in 0.1..3600", argv[i]));
      }
    } else if (a == "-h" || a == "--help") {
      std::fputs(kTopUsage, stdout);
      return 0;
    } else if (!a.empty() && a[0] != '-' && address.empty()) {
      address = a;
    } else {
      std::fputs(kTopUsage, stderr);
      return fail(fmt::format("unknown argument '{}'", a));
    }
  }
  if (address.empty()) {
    auto config = load_config(ConfigSources{});
    if (!config.ok()) return fail(config.status().message());
    address = config->metrics.listen;
    if (address.empty()) {
      return fail(
          "no address: give the coordinator's metrics.listen (HOST:PORT; psld launch prints it), "
          "or set PSLD_METRICS_LISTEN");
    }
  }
  constexpr std::chrono::seconds kTimeout{2};
  if (once) {
    auto body = http_get(address, "/status.json", kTimeout);
    if (!body.ok()) return fail(body.status().message());
    if (json) {
      std::printf("%s\n", body->c_str());
      return 0;
    }
    auto view = job_view_from_json(*body);
    if (!view.ok()) return fail(view.status().message());
    std::fputs(render(*view, address, terminal_width()).c_str(), stdout);
    return 0;
  }

  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  RawKeys keys;
  std::string last_state;
  const auto interval = std::chrono::milliseconds(static_cast<int64_t>(interval_s * 1000));
  const bool tty = isatty(STDOUT_FILENO) != 0;
  for (;;) {
    auto body = http_get(address, "/status.json", kTimeout);
    if (!body.ok()) {
      // A job that ended closes its endpoint: say how it ended, when known.
      if (last_state.empty()) return fail(body.status().message());
      std::printf("\npsld top: the coordinator at %s is gone (%s); the job was %s\n",
                  address.c_str(), body.status().message().c_str(), last_state.c_str());
      return last_state == "finished" ? 0 : 1;
    }
    auto view = job_view_from_json(*body);
    if (!view.ok()) return fail(view.status().message());
    last_state = view->state;
    if (json) {
      std::printf("%s\n", body->c_str());
      std::fflush(stdout);
    } else {
      // Home and clear, then the view: it refreshes in place.
      std::string screen = tty ? "\033[H\033[2J" : "";
      screen += render(*view, address, terminal_width());
      if (!tty) screen += "\n";
      std::fputs(screen.c_str(), stdout);
      std::fflush(stdout);
    }
    if (keys.quit_within(interval)) return 0;
  }
}

}  // namespace psld::tools
