// `psld launch` (tools/launch.h).
#include "tools/launch.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/net.h"
#include "lib/protocol/auth.h"
#include "psld/config.h"
#include "psld/coordinator.h"

namespace psld::tools {
namespace {

using namespace std::chrono_literals;

int fail(const std::string& message) {
  std::fprintf(stderr, "psld: %s\n", message.c_str());
  return 1;
}

// ---- the children and their output

// A line longer than this is cut into pieces of this size, so a child that
// never prints a newline (a progress bar redrawn with '\r') costs bounded
// memory and linear time.
constexpr size_t kMaxLineBytes = 64 * 1024;
// What the launcher holds for its own stdout when whoever reads it falls
// behind; past this, children's lines are dropped (and counted), never
// waited for: a slow reader must not stall the job.
constexpr size_t kMaxQueuedBytes = 8 * 1024 * 1024;
// From the first SIGTERM to the children until SIGKILL.
constexpr auto kStopGrace = 3s;

// The launcher's stdout, written only as far as it takes bytes without
// blocking: poll() says POLLOUT, and a write of at most PIPE_BUF bytes to a
// pipe then never blocks. (Setting O_NONBLOCK instead would change the file
// description the shell and other processes share.)
class Output {
 public:
  explicit Output(int fd) : fd_(fd) {}

  int fd() const { return fd_; }
  bool pending() const { return !broken_ && (!queue_.empty() || dropped_ > 0); }

  void line(const std::string& who, std::string_view text) {
    if (broken_) return;
    if (queue_.size() + who.size() + text.size() + 4 > kMaxQueuedBytes) {
      ++dropped_;
      return;
    }
    if (dropped_ > 0) say_dropped();
    queue_ += '[';
    queue_ += who;
    queue_ += "] ";
    queue_ += text;
    queue_ += '\n';
  }

  // Writes what stdout takes now, at most `budget` bytes.
  void write_some(size_t budget = 1 << 20) {
    if (dropped_ > 0 && queue_.size() < kMaxQueuedBytes / 2) say_dropped();
    while (!broken_ && !queue_.empty() && budget > 0) {
      pollfd p{fd_, POLLOUT, 0};
      if (poll(&p, 1, 0) <= 0) return;
      if (p.revents & (POLLERR | POLLHUP)) {
        broken_ = true;  // nobody reads it any more: the job goes on
        queue_.clear();
        return;
      }
      if (!(p.revents & POLLOUT)) return;
      const size_t n = std::min({queue_.size() - head_, size_t{PIPE_BUF}, budget});
      const ssize_t w = write(fd_, queue_.data() + head_, n);
      if (w < 0) {
        if (errno == EAGAIN || errno == EINTR) return;
        broken_ = true;
        queue_.clear();
        return;
      }
      head_ += static_cast<size_t>(w);
      budget -= std::min(budget, static_cast<size_t>(w));
      if (head_ == queue_.size()) {
        queue_.clear();
        head_ = 0;
      } else if (head_ > kMaxQueuedBytes / 4) {
        queue_.erase(0, head_);
        head_ = 0;
      }
    }
  }

  // At the end: keeps writing until done or `deadline`.
  void finish(std::chrono::steady_clock::time_point deadline) {
    while (pending() && std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLOUT, 0};
      poll(&p, 1, 50);
      write_some();
    }
  }

 private:
  void say_dropped() {
    const std::string note = fmt::format(
        "[psld launch] {} lines of output dropped: this launcher's stdout was not read fast "
        "enough\n",
        dropped_);
    dropped_ = 0;
    queue_ += note;
  }

  int fd_;
  std::string queue_;
  size_t head_ = 0;  // queue_[0, head_) is written
  size_t dropped_ = 0;
  bool broken_ = false;
};

struct Child {
  std::string name;  // "worker 0", "server 1"
  pid_t pid = -1;
  int out = -1;  // read end of its stdout+stderr pipe, non-blocking
  std::string partial;
  bool exited = false;
  int status = 0;
};

// Signals reach the loop through a pipe, so poll() wakes at once; handlers
// are installed without SA_RESTART.
std::atomic<int> g_signal{0};
std::atomic<int> g_signals{0};
int g_wake_fd = -1;
void on_signal(int sig) {
  if (sig != SIGCHLD) {
    g_signal = sig;
    g_signals.fetch_add(1);
  }
  const int saved = errno;
  const char byte = 0;
  (void)!write(g_wake_fd, &byte, 1);
  errno = saved;
}

// Everything the child needs is built before fork(): between fork and exec
// it calls only async-signal-safe functions (the coordinator's threads run in
// this process).
pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            int* out_fd) {
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string_view::npos && env.count(std::string(kv.substr(0, eq)))) continue;
    envs.emplace_back(kv);
  }
  for (const auto& [k, v] : env)
    envs.push_back(k + "=" + v);
  std::vector<char*> args, envp;
  for (const auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const auto& e : envs)
    envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const std::string cannot = "cannot run " + argv[0] + "\n";

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    // A child never outlives the launcher, even if the launcher is killed.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    // Nothing else of this process crosses: not the coordinator's listening
    // sockets (UCX opens them without close-on-exec), not its connections.
    close_range(3, ~0U, 0);
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE})
      sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(args[0], args.data(), envp.data());
    (void)!write(STDERR_FILENO, cannot.data(), cannot.size());
    _exit(127);
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  *out_fd = fds[0];
  return pid;
}

// Whole lines of c.partial go to `out`; a tail longer than kMaxLineBytes is
// cut.
void split_lines(Child& c, Output& out) {
  size_t start = 0;
  for (size_t nl; (nl = c.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    out.line(c.name, std::string_view(c.partial).substr(start, nl - start));
  }
  while (c.partial.size() - start >= kMaxLineBytes) {
    out.line(c.name, std::string_view(c.partial).substr(start, kMaxLineBytes));
    start += kMaxLineBytes;
  }
  c.partial.erase(0, start);
}

// Reads what the child's pipe holds now (bounded per call, so one chatty
// child cannot starve the loop); at end of stream, the last partial line
// goes out and the pipe is closed.
void read_output(Child& c, Output& out) {
  char buf[64 * 1024];
  for (int i = 0; i < 4 && c.out >= 0; ++i) {
    const ssize_t n = read(c.out, buf, sizeof(buf));
    if (n > 0) {
      c.partial.append(buf, static_cast<size_t>(n));
      split_lines(c, out);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (!c.partial.empty()) out.line(c.name, c.partial);
    c.partial.clear();
    close(c.out);
    c.out = -1;
  }
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return "stopped";
}

// "0:25M" -> {0, 25000000}; nullopt when malformed.
std::optional<std::pair<int, uint64_t>> parse_slow_server(const std::string& text) {
  const auto colon = text.find(':');
  if (colon == std::string::npos || colon == 0) return std::nullopt;
  char* end = nullptr;
  const long rank = std::strtol(text.c_str(), &end, 10);
  if (end != text.c_str() + colon || rank < 0) return std::nullopt;
  const char* rate_text = text.c_str() + colon + 1;
  const double rate = std::strtod(rate_text, &end);
  if (end == rate_text || !(rate > 0)) return std::nullopt;
  double scale = 1;
  const std::string suffix = end;
  if (suffix == "K" || suffix == "k") {
    scale = 1e3;
  } else if (suffix == "M") {
    scale = 1e6;
  } else if (suffix == "G") {
    scale = 1e9;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  return std::make_pair(static_cast<int>(rank), static_cast<uint64_t>(rate * scale));
}

}  // namespace

int cmd_launch(int argc, char** argv, const char* kUsage) {
  int workers = 0, servers = 0, standby = 0;
  std::string transport;
  std::string resume;            // --resume DIR
  std::map<int, uint64_t> slow;  // server rank -> link bytes/s
  int i = 2;
  auto need = [&](const char* flag) -> const char* {
    if (i + 1 >= argc) {
      fail(fmt::format("{} needs a value", flag));
      return nullptr;
    }
    return argv[++i];
  };
  for (; i < argc; ++i) {
    std::string a = argv[i];
    const char* v = nullptr;
    if (a == "--") {
      ++i;
      break;
    } else if (a == "-w" || a == "--workers") {
      if (!(v = need("-w"))) return 2;
      workers = std::atoi(v);
    } else if (a == "-s" || a == "--servers") {
      if (!(v = need("-s"))) return 2;
      servers = std::atoi(v);
    } else if (a == "--standby") {
      if (!(v = need("--standby"))) return 2;
      standby = std::atoi(v);
    } else if (a == "--transport") {
      if (!(v = need("--transport"))) return 2;
      transport = v;
    } else if (a == "--resume") {
      if (!(v = need("--resume"))) return 2;
      resume = v;
      if (resume.empty())
        return fail("--resume needs a checkpoint directory\n" + std::string(kUsage));
    } else if (a == "--slow-server") {
      if (!(v = need("--slow-server"))) return 2;
      auto parsed = parse_slow_server(v);
      if (!parsed) {
        return fail(fmt::format("--slow-server {}: expected RANK:RATE, e.g. 0:25M\n{}", v, kUsage));
      }
      slow[parsed->first] = parsed->second;
    } else if (!a.empty() && a[0] == '-') {
      return fail("unknown option " + a + "\n" + kUsage);
    } else {
      break;
    }
  }
  if (workers < 1 || servers < 1 || standby < 0) {
    return fail(std::string("launch needs -w N (>= 1) and -s M (>= 1)\n") + kUsage);
  }
  for (const auto& [rank, rate] : slow) {
    if (rank >= servers + standby) {
      return fail(
          fmt::format("--slow-server {}: there are only {} servers", rank, servers + standby));
    }
  }
  if (i >= argc)
    return fail(std::string("launch needs a PROGRAM to run as the workers\n") + kUsage);
  std::vector<std::string> program(argv + i, argv + argc);

  // The coordinator runs in this process; its real port goes to the children.
  psld::ConfigSources sources;
  auto config = psld::load_config(sources);
  if (!config.ok()) return fail(config.status().message());
  config->job.num_workers = workers;
  config->job.num_servers = servers;
  config->job.num_standby = standby;
  if (!transport.empty()) config->job.transport = transport;
  if (!resume.empty()) {
    // The newest complete checkpoint in DIR, which the job goes on writing
    // into (with checkpoint.every_rounds): docs/checkpoint.md.
    config->checkpoint.dir = resume;
    config->checkpoint.resume = true;
    if (psld::Status valid = psld::validate(*config); !valid.ok()) return fail(valid.message());
  }
  // Every job has a secret: without one given (PSLD_JOB_SECRET,
  // PSLD_SECRET_FILE, a config file), a random one for this job alone. The
  // children get it in their environment, which only their user can read
  // (/proc/PID/environ), never on a command line.
  std::optional<std::string> made_secret;
  if (config->job.secret.empty()) {
    made_secret = psld::protocol::make_secret();
    config->job.secret = *made_secret;
  }
  const int port = psld::free_loopback_port();
  if (port <= 0) return fail("cannot find a free TCP port on 127.0.0.1 for the coordinator");
  const std::string address = fmt::format("127.0.0.1:{}", port);
  config->job.coordinator = address;
  auto coordinator = psld::Coordinator::start(*config);
  if (!coordinator.ok()) return fail(coordinator.status().to_string());
  if (const std::string metrics = (*coordinator)->metrics_address(); !metrics.empty()) {
    std::fprintf(stderr, "psld launch: metrics at http://%s/metrics; watch with `psld top %s`\n",
                 metrics.c_str(), metrics.c_str());
  }

  std::map<std::string, std::string> env = {
      {"PSLD_JOB_COORDINATOR", address},
      {"PSLD_JOB_NUM_WORKERS", std::to_string(workers)},
      {"PSLD_JOB_NUM_SERVERS", std::to_string(servers)},
      {"PSLD_JOB_NUM_STANDBY", std::to_string(standby)},
      {"PSLD_JOB_TRANSPORT", config->job.transport},
  };
  if (made_secret) env["PSLD_JOB_SECRET"] = *made_secret;
  if (!resume.empty()) {
    env["PSLD_CHECKPOINT_DIR"] = resume;
    env["PSLD_CHECKPOINT_RESUME"] = "true";
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) return fail("cannot make a pipe");
  g_wake_fd = wake[1];
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_NOCLDSTOP;  // no SA_RESTART: a signal interrupts what it meets
  for (int sig : {SIGINT, SIGTERM, SIGCHLD})
    sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<Child> children;
  char self[4096] = {};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return fail("cannot find myself");
  for (int s = 0; s < servers + standby; ++s) {
    Child c;
    c.name = fmt::format("server {}", s);
    auto e = env;
    e["PSLD_JOB_ROLE"] = "server";
    e["PSLD_JOB_RANK"] = std::to_string(s);
    if (auto it = slow.find(s); it != slow.end()) {
      e["PSLD_LINK_EGRESS_BYTES_PER_SECOND"] = std::to_string(it->second);
      e["PSLD_LINK_INGRESS_BYTES_PER_SECOND"] = std::to_string(it->second);
      std::fprintf(stderr, "psld: server %d is behind a %.1f MB/s link\n", s,
                   static_cast<double>(it->second) / 1e6);
    }
    c.pid = spawn({self, "server"}, e, &c.out);
    if (c.pid < 0) return fail("cannot start a server");
    children.push_back(std::move(c));
  }
  for (int w = 0; w < workers; ++w) {
    Child c;
    c.name = fmt::format("worker {}", w);
    auto e = env;
    e["PSLD_JOB_ROLE"] = "worker";
    e["PSLD_JOB_RANK"] = std::to_string(w);
    e["PSLD_JOB_LOCAL_RANK"] = std::to_string(w);
    c.pid = spawn(program, e, &c.out);
    if (c.pid < 0) return fail("cannot start " + program[0]);
    children.push_back(std::move(c));
  }

  Output out(STDOUT_FILENO);
  std::string failure;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  auto stop_all = [&](int sig) {
    for (auto& c : children) {
      if (c.exited) continue;
      kill(c.pid, sig);
      if (sig != SIGKILL) kill(c.pid, SIGCONT);  // a stopped child must see it too
    }
  };
  auto stop_job = [&](const std::string& why) {
    if (stop_deadline != std::chrono::steady_clock::time_point::max()) return;
    if (failure.empty()) failure = why;
    std::fprintf(stderr, "psld launch: %s; stopping the job\n", why.c_str());
    stop_all(SIGTERM);
    stop_deadline = std::chrono::steady_clock::now() + kStopGrace;
  };
  auto running = [&] {
    for (auto& c : children) {
      if (!c.exited) return true;
    }
    return false;
  };
  int signals_seen = 0;
  const bool replicated = config->replication.factor > 1;
  while (running()) {
    std::vector<pollfd> fds;
    fds.push_back({wake[0], POLLIN, 0});
    if (out.pending()) fds.push_back({out.fd(), POLLOUT, 0});
    for (auto& c : children) {
      if (c.out >= 0) fds.push_back({c.out, POLLIN, 0});
    }
    poll(fds.data(), fds.size(), 100);
    char sink[256];
    while (read(wake[0], sink, sizeof(sink)) > 0) {
    }
    for (auto& c : children) {
      if (c.out >= 0) read_output(c, out);
    }
    out.write_some();
    int status = 0;
    for (pid_t pid; (pid = waitpid(-1, &status, WNOHANG)) > 0;) {
      for (auto& c : children) {
        if (c.pid != pid || c.exited) continue;
        c.exited = true;
        c.status = status;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
          const std::string what =
              fmt::format("{} (pid {}) {}", c.name, c.pid, describe_exit(status));
          if (replicated && c.name.rfind("server ", 0) == 0 &&
              stop_deadline == std::chrono::steady_clock::time_point::max()) {
            // Its ranges fail over to their backups (docs/replication.md);
            // where they cannot, the coordinator fails the job, and the
            // workers' exits stop it.
            std::fprintf(stderr, "psld launch: %s; replication.factor is %u, so the job goes on\n",
                         what.c_str(), config->replication.factor);
            continue;
          }
          stop_job(what);
        }
      }
    }
    if (const int n = g_signals.load(); n > signals_seen) {
      signals_seen = n;
      if (stop_deadline == std::chrono::steady_clock::time_point::max()) {
        stop_job(fmt::format("interrupted by signal {}", g_signal.load()));
      } else {
        stop_all(SIGKILL);  // asked twice: no more grace
      }
    }
    if (std::chrono::steady_clock::now() > stop_deadline) stop_all(SIGKILL);
  }
  // Every child is reaped; what their pipes still hold (a grandchild may keep
  // one open: read what is there, never wait for it) goes out, briefly.
  for (auto& c : children) {
    if (c.out < 0) continue;
    read_output(c, out);
    if (!c.partial.empty()) out.line(c.name, c.partial);
    if (c.out >= 0) close(c.out);
  }
  out.finish(std::chrono::steady_clock::now() + 2s);
  close(wake[0]);

  // The coordinator's verdict names the root cause (a silent server) where the
  // first exit names only its consequence (another server leaving).
  psld::Status job = (*coordinator)->wait(1s);
  const bool interrupted = g_signal != 0;
  const auto verdict = [&]() -> int {
    if (interrupted) {
      fail("the job failed: " + failure);
      return 128 + g_signal.load();
    }
    if (!job.ok() && job.code() != psld::StatusCode::kTimeout) {
      fail("the job failed: " + job.message() +
           (failure.empty() ? std::string() : " (then " + failure + ")"));
      return 1;
    }
    if (!failure.empty()) {
      fail("the job failed: " + failure);
      return 1;
    }
    return 0;
  }();
  // Stopping closes the connections, to peers that are gone: bounded, and
  // past the bound this process ends anyway, with its verdict.
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    (*coordinator)->shutdown();
    stopped = true;
  });
  for (auto until = std::chrono::steady_clock::now() + 5s;
       !stopped && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  if (!stopped) {
    std::fprintf(stderr, "psld launch: the coordinator did not stop within 5 s; exiting\n");
    std::fflush(stdout);
    _exit(verdict == 0 ? 1 : verdict);
  }
  stopper.join();
  return verdict;
}

}  // namespace psld::tools
