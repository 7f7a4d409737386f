// `psld launch` (tools/launch.h).
#include "tools/launch.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/net.h"
#include "psld/config.h"
#include "psld/coordinator.h"

namespace psld::tools {
namespace {

using namespace std::chrono_literals;

int fail(const std::string& message) {
  std::fprintf(stderr, "psld: %s\n", message.c_str());
  return 1;
}

// ---- launch

struct Child {
  std::string name;  // "worker 0", "server 1"
  pid_t pid = -1;
  int out = -1;  // read end of its stdout+stderr pipe
  std::string partial;
  bool exited = false;
  int status = 0;
};

std::atomic<int> g_signal{0};
void on_signal(int sig) {
  g_signal = sig;
}

pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            int* out_fd) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    // A child never outlives the launcher, even if the launcher is killed.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    for (const auto& [k, v] : env)
      setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const auto& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  *out_fd = fds[0];
  return pid;
}

void drain(Child& c, bool all) {
  char buf[4096];
  while (true) {
    ssize_t n = read(c.out, buf, sizeof(buf));
    if (n <= 0) break;
    c.partial.append(buf, static_cast<size_t>(n));
    if (!all) break;
  }
  size_t nl;
  while ((nl = c.partial.find('\n')) != std::string::npos) {
    std::printf("[%s] %s\n", c.name.c_str(), c.partial.substr(0, nl).c_str());
    c.partial.erase(0, nl + 1);
  }
  std::fflush(stdout);
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
  const int port = psld::free_loopback_port();
  if (port <= 0) return fail("cannot find a free TCP port on 127.0.0.1 for the coordinator");
  const std::string address = fmt::format("127.0.0.1:{}", port);
  config->job.coordinator = address;
  auto coordinator = psld::Coordinator::start(*config);
  if (!coordinator.ok()) return fail(coordinator.status().to_string());

  std::map<std::string, std::string> env = {
      {"PSLD_JOB_COORDINATOR", address},
      {"PSLD_JOB_NUM_WORKERS", std::to_string(workers)},
      {"PSLD_JOB_NUM_SERVERS", std::to_string(servers)},
      {"PSLD_JOB_NUM_STANDBY", std::to_string(standby)},
      {"PSLD_JOB_TRANSPORT", config->job.transport},
  };
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
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

  std::string failure;
  auto stop_all = [&](int sig) {
    for (auto& c : children) {
      if (!c.exited) kill(c.pid, sig);
    }
  };
  auto running = [&] {
    for (auto& c : children) {
      if (!c.exited) return true;
    }
    return false;
  };
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (running()) {
    std::vector<pollfd> fds;
    for (auto& c : children) {
      if (c.out >= 0) fds.push_back({c.out, POLLIN, 0});
    }
    poll(fds.data(), fds.size(), 100);
    for (auto& c : children) {
      if (c.out >= 0) {
        pollfd p{c.out, POLLIN, 0};
        if (poll(&p, 1, 0) > 0) {
          char buf[4096];
          ssize_t n = read(c.out, buf, sizeof(buf));
          if (n > 0) {
            c.partial.append(buf, static_cast<size_t>(n));
            drain(c, false);
          } else {
            close(c.out);
            c.out = -1;
          }
        }
      }
      if (!c.exited) {
        int status = 0;
        if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
          c.exited = true;
          c.status = status;
          const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
          if (!ok && failure.empty() &&
              stop_deadline == std::chrono::steady_clock::time_point::max()) {
            failure = fmt::format("{} (pid {}) {}", c.name, c.pid, describe_exit(status));
            std::fprintf(stderr, "psld launch: %s; stopping the job\n", failure.c_str());
            stop_all(SIGTERM);
            stop_deadline = std::chrono::steady_clock::now() + 5s;
          }
        }
      }
    }
    if (g_signal != 0 && stop_deadline == std::chrono::steady_clock::time_point::max()) {
      failure = fmt::format("interrupted by signal {}", g_signal.load());
      std::fprintf(stderr, "psld launch: %s; stopping the job\n", failure.c_str());
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + 5s;
    }
    if (std::chrono::steady_clock::now() > stop_deadline) stop_all(SIGKILL);
  }
  for (auto& c : children) {
    if (c.out >= 0) {
      drain(c, true);
      if (!c.partial.empty()) std::printf("[%s] %s\n", c.name.c_str(), c.partial.c_str());
      close(c.out);
    }
  }
  psld::Status job = (*coordinator)->wait(1s);
  (*coordinator)->shutdown();
  if (!failure.empty()) return fail("the job failed: " + failure);
  if (!job.ok() && job.code() != psld::StatusCode::kTimeout) return fail(job.message());
  return 0;
}

}  // namespace psld::tools
