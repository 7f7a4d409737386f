// `psld launch` end to end: real processes over UCX (TCP on loopback).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

struct RunResult {
  int exit_code = -1;
  bool timed_out = false;
  std::string output;
};

// Runs argv with extra environment, stdout+stderr to a file, killing the
// whole process group if it outlives `timeout`.
RunResult run(const std::vector<std::string>& argv, const std::vector<std::string>& env,
              std::chrono::seconds timeout) {
  char path[] = "/tmp/psld_launch_test_XXXXXX";
  int fd = mkstemp(path);
  RunResult r;
  if (fd < 0) return r;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, 1);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e)
    envs.emplace_back(*e);
  for (const auto& e : env)
    envs.push_back(e);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv)
    cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs)
    cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, cargv[0], &fa, &attr, cargv.data(), cenv.data()) != 0) {
    close(fd);
    return r;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      r.timed_out = true;
      kill(-pid, SIGKILL);  // the launcher and everything it started
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(-pid, SIGKILL);  // nothing of the job may outlive the test
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  close(fd);
  unlink(path);
  return r;
}

std::string psld() {
  return std::getenv("TEST_PSLD_BINARY");
}
std::string trainer() {
  return std::getenv("TEST_LAUNCH_WORKER");
}

const std::vector<std::string> kEnv = {"PSLD_SERVER_MODE=sum", "PSLD_UCX_TLS=tcp",
                                       "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=3000",
                                       "UCX_WARN_UNUSED_ENV_VARS=n"};

TEST(Launch, WorkersAndServersTrainAndExitCleanly) {
  RunResult r = run({psld(), "launch", "-w", "3", "-s", "2", "--", trainer(), "--rounds", "15"},
                    kEnv, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int w = 0; w < 3; ++w) {
    EXPECT_NE(r.output.find("[worker " + std::to_string(w) + "] worker " + std::to_string(w) +
                            ": 15 rounds exact"),
              std::string::npos)
        << r.output;
  }
}

TEST(Launch, AFailingWorkerStopsTheJobAndIsNamed) {
  RunResult r = run({psld(), "launch", "-w", "3", "-s", "1", "--", trainer(), "--fail-rank", "1",
                     "--fail-code", "7"},
                    kEnv, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("worker 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("status 7"), std::string::npos) << r.output;
}

TEST(Launch, AWorkerKilledMidJobFailsTheOthersWithAClearError) {
  RunResult r = run({psld(), "launch", "-w", "3", "-s", "1", "--", trainer(), "--rounds", "40",
                     "--die-rank", "2"},
                    kEnv, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("worker 2"), std::string::npos) << r.output;
}

TEST(Launch, BadUsageIsExplained) {
  RunResult r = run({psld(), "launch", "-w", "0", "--", "true"}, {}, std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("usage"), std::string::npos) << r.output;
  r = run({psld(), "config", "--job.num_wrkers=2"}, {}, std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("did you mean"), std::string::npos) << r.output;
}

}  // namespace
