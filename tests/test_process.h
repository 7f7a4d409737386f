// Helpers for tests that start other processes: run one with a deadline and
// capture its output, and find a free TCP port on loopback.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/net.h"

extern char** environ;

namespace psld::testing {

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved
};

// A file's bytes ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The text of /proc/<pid>/<what> ("" when it cannot be read).
inline std::string proc_file(pid_t pid, const std::string& what) {
  return slurp("/proc/" + std::to_string(pid) + "/" + what);
}

// The process state letter from /proc/<pid>/stat ('R', 'S', 'T' stopped,
// 'Z' exited but not reaped), or 0 when there is no such process.
inline char proc_state(pid_t pid) {
  const std::string stat = proc_file(pid, "stat");
  const auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

// Gone or exited (a zombie whose parent has not reaped it yet).
inline bool proc_ended(pid_t pid) {
  const char s = proc_state(pid);
  return s == 0 || s == 'Z' || s == 'X';
}

// The direct children of `pid`: every process whose parent it is, from
// /proc/<n>/stat. (/proc/<pid>/task/<tid>/children missed a live child now
// and then, as its documentation warns, once siblings had exited.)
inline std::vector<pid_t> proc_children(pid_t pid) {
  std::vector<pid_t> out;
  DIR* dir = opendir("/proc");
  if (!dir) return out;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    const std::string stat = slurp(std::string("/proc/") + e->d_name + "/stat");
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::stringstream rest(stat.substr(paren + 1));
    char state = 0;
    pid_t parent = 0;
    if (rest >> state >> parent && parent == pid) out.push_back(std::atoi(e->d_name));
  }
  closedir(dir);
  return out;
}

// The highest "worker 0: round N" a launched trainer (launch_worker
// --print-every) printed in `output`; 0 when none.
inline int last_round(const std::string& output) {
  static const std::regex re("worker 0: round ([0-9]+)");
  int last = 0;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re);
       it != std::sregex_iterator(); ++it)
    last = std::max(last, std::stoi((*it)[1].str()));
  return last;
}

// A process in the background, in a new process group, for tests that act on
// it while it runs: signals, its output so far, its children. Its stdout and
// stderr go to a file, or its stdout to `stdout_fd` when that is given. The
// destructor kills the whole group (after SIGCONT, for a stopped member).
class Background {
 public:
  Background(const std::vector<std::string>& argv, const std::vector<std::string>& env,
             int stdout_fd = -1) {
    char path[] = "/tmp/psld_test_output_XXXXXX";
    fd_ = mkstemp(path);
    if (fd_ < 0) return;
    unlink(path);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, stdout_fd >= 0 ? stdout_fd : fd_, 1);
    posix_spawn_file_actions_adddup2(&actions, fd_, 2);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e)
      envs.emplace_back(*e);
    envs.insert(envs.end(), env.begin(), env.end());
    std::vector<char*> cargv, cenv;
    for (const auto& a : argv)
      cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    for (const auto& e : envs)
      cenv.push_back(const_cast<char*>(e.c_str()));
    cenv.push_back(nullptr);
    if (posix_spawn(&pid_, cargv[0], &actions, &attr, cargv.data(), cenv.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
  }
  ~Background() {
    if (pid_ > 0) {
      kill(-pid_, SIGCONT);
      kill(-pid_, SIGKILL);
      if (!exit_code_) waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) close(fd_);
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  pid_t pid() const { return pid_; }
  bool started() const { return pid_ > 0; }

  std::string output() const {
    std::string out;
    char buf[65536];
    for (off_t off = 0;;) {
      const ssize_t n = pread(fd_, buf, sizeof(buf), off);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
      off += n;
    }
    return out;
  }

  // Waits until the output holds `needle`; false after `timeout` or when the
  // process ended without printing it.
  bool wait_for_output(const std::string& needle, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (output().find(needle) != std::string::npos) return true;
      if (wait(std::chrono::milliseconds(0))) return output().find(needle) != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // The exit code (128 + signal when killed), or nullopt if it still runs
  // after `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!exit_code_) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return exit_code_;
  }

  // The pid of the child of this process whose environment says it is
  // PSLD_JOB_ROLE=role, PSLD_JOB_RANK=rank (a member psld launch started),
  // or -1.
  pid_t member(const std::string& role, int rank) const {
    const std::string want_role = "PSLD_JOB_ROLE=" + role;
    const std::string want_rank = "PSLD_JOB_RANK=" + std::to_string(rank);
    for (pid_t c : proc_children(pid_)) {
      std::stringstream env(proc_file(c, "environ"));
      bool role_ok = false, rank_ok = false;
      for (std::string kv; std::getline(env, kv, '\0');) {
        role_ok |= kv == want_role;
        rank_ok |= kv == want_rank;
      }
      if (role_ok && rank_ok) return c;
    }
    return -1;
  }

 private:
  int fd_ = -1;
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
};

// The psld command and the launch tests' trainer (tests/launch_worker.cc),
// from the test's environment (tests/meson.build sets both).
inline std::string psld() {
  const char* p = std::getenv("TEST_PSLD_BINARY");
  return p != nullptr ? p : "psld";
}
inline std::string trainer() {
  const char* p = std::getenv("TEST_LAUNCH_WORKER");
  return p != nullptr ? p : "launch_worker";
}

// What a launched test job runs with: sums, UCX over TCP, a 3 s heartbeat
// timeout.
inline const std::vector<std::string> kLaunchedJobEnv = {
    "PSLD_SERVER_MODE=sum", "PSLD_UCX_TLS=tcp", "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=3000",
    "PSLD_LIVENESS_HEARTBEAT_INTERVAL_MS=500", "UCX_WARN_UNUSED_ENV_VARS=n"};

// The socket inodes ("socket:[N]") a process holds open.
inline std::set<std::string> sockets_of(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    std::error_code lec;
    const std::string target = std::filesystem::read_symlink(e.path(), lec).string();
    if (target.rfind("socket:", 0) == 0) out.insert(target);
  }
  return out;
}

// The IPv4 TCP sockets among `sockets` that listen (/proc/net/tcp): the
// local address in /proc's hex ("0100007F" is 127.0.0.1) and the port.
struct ListeningSocket {
  std::string address;
  int port = 0;
};
inline std::vector<ListeningSocket> listening_sockets(const std::set<std::string>& sockets) {
  std::vector<ListeningSocket> out;
  std::ifstream tcp("/proc/net/tcp");
  for (std::string line; std::getline(tcp, line);) {
    std::istringstream f(line);
    std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
    f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
    if (state != "0A" || !sockets.count("socket:[" + inode + "]")) continue;
    const auto colon = local.find(':');
    if (colon == std::string::npos) continue;
    out.push_back({local.substr(0, colon), std::stoi(local.substr(colon + 1), nullptr, 16)});
  }
  return out;
}

// Runs argv (argv[0] a path) in a new process group with this process's
// environment plus `env` ("NAME=value"). A run that outlives `timeout` gets
// SIGTERM (a launcher such as mpirun passes it on to processes it put in other
// groups) and, 5 s later, SIGKILL with its whole group; the group is killed at
// the end in any case.
inline RunResult run_process(const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, std::chrono::seconds timeout) {
  RunResult r;
  Background p(argv, env);
  if (!p.started()) {
    r.output = "cannot start " + argv[0];
    return r;
  }
  std::optional<int> code = p.wait(timeout);
  if (!code) {
    r.timed_out = true;
    kill(-p.pid(), SIGTERM);
    code = p.wait(std::chrono::seconds(5));
    if (!code) {
      kill(-p.pid(), SIGKILL);
      code = p.wait(std::chrono::hours(1));
    }
  }
  kill(-p.pid(), SIGKILL);  // whatever the command left behind in its group
  r.exit_code = code.value_or(-1);
  r.output = p.output();
  return r;
}

using ::psld::free_loopback_port;  // base/net.h

}  // namespace psld::testing
