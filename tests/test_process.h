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

#include <chrono>
#include <fstream>
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

// Runs argv (argv[0] a path) in a new process group with this process's
// environment plus `env` ("NAME=value"). A run that outlives `timeout` gets
// SIGTERM (a launcher such as mpirun passes it on to processes it put in other
// groups) and, 5 s later, SIGKILL with its whole group; the group is killed at
// the end in any case.
inline RunResult run_process(const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, std::chrono::seconds timeout) {
  char path[] = "/tmp/psld_test_output_XXXXXX";
  const int fd = mkstemp(path);
  RunResult r;
  if (fd < 0) {
    r.output = "mkstemp failed";
    return r;
  }
  unlink(path);  // the open descriptor keeps the file until the end
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fd, 1);
  posix_spawn_file_actions_adddup2(&actions, fd, 2);
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
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, cargv[0], &actions, &attr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (spawned != 0) {
    close(fd);
    r.output = "cannot start " + argv[0];
    return r;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      r.timed_out = true;
      kill(-pid, SIGTERM);
      const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (waitpid(pid, &status, WNOHANG) == 0 && std::chrono::steady_clock::now() < grace) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(-pid, SIGKILL);  // whatever the command left behind in its group
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::string out;
  char buf[65536];
  for (off_t off = 0;;) {
    const ssize_t n = pread(fd, buf, sizeof(buf), off);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    off += n;
  }
  close(fd);
  r.output = std::move(out);
  return r;
}

using ::psld::free_loopback_port;  // base/net.h

}  // namespace psld::testing
