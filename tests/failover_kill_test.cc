// Failover against real kills, with `psld launch` over UCX (TCP on
// loopback) and replication.factor = 2 (docs/replication.md): server
// processes are killed with SIGKILL one after another at random rounds while
// the job trains, and the job goes on without them. In sum mode every round
// of every worker is checked against the exact sum; with Adam the final
// parameters are bit-identical to those of a job without replication in
// which nobody died.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/temp_dir.h"
#include "tests/test_process.h"

namespace {

using namespace std::chrono_literals;
using psld::testing::Background;
using psld::testing::psld;
using psld::testing::slurp;
using psld::testing::TempDir;
using psld::testing::trainer;

constexpr int kRounds = 500;
constexpr int kServers = 6;

std::vector<std::string> job_env(bool adam, int factor) {
  std::vector<std::string> env = psld::testing::kLaunchedJobEnv;
  if (adam) {
    for (auto& e : env) {
      if (e == "PSLD_SERVER_MODE=sum") e = "PSLD_SERVER_MODE=optimizer";
    }
    env.push_back("PSLD_OPTIMIZER_KIND=adam");
    env.push_back("PSLD_OPTIMIZER_LR=0.01");
  }
  env.push_back("PSLD_REPLICATION_FACTOR=" + std::to_string(factor));
  // The coordinator says when every range has its copies again: the test
  // kills the next server only then (before, the job would rightly fail).
  env.push_back("PSLD_LOG=warn,coordinator=info");
  return env;
}

std::vector<std::string> job(bool adam, const std::string& dump) {
  std::vector<std::string> argv = {psld(),
                                   "launch",
                                   "-w",
                                   "3",
                                   "-s",
                                   std::to_string(kServers),
                                   "--",
                                   trainer(),
                                   "--rounds",
                                   std::to_string(kRounds),
                                   "--print-every",
                                   "1"};
  if (adam) argv.push_back("--no-check");
  if (!dump.empty()) argv.insert(argv.end(), {"--dump", dump});
  return argv;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1))
    ++n;
  return n;
}

// Kills `kills` of the job's servers, one at a time, each at a random round
// at least 30 rounds after the previous kill and once every range has its
// copies again; returns a line per kill for the log.
std::string kill_servers(Background& run, int kills, std::mt19937& rng) {
  std::set<int> alive;
  for (int s = 0; s < kServers; ++s)
    alive.insert(s);
  int at = 0;
  std::string said;
  for (int k = 0; k < kills; ++k) {
    at += 30 + static_cast<int>(rng() % 50);
    EXPECT_LT(at, kRounds - 20);
    if (!run.wait_for_output("worker 0: round " + std::to_string(at) + "\n", 120s)) {
      ADD_FAILURE() << "the job did not reach round " << at << "\n" << run.output();
      return said;
    }
    if (k > 0) {
      const auto until = std::chrono::steady_clock::now() + 60s;
      while (count(run.output(), "every range has its copies again") < static_cast<size_t>(k)) {
        if (std::chrono::steady_clock::now() > until || run.wait(0ms)) {
          ADD_FAILURE() << "the copies were not made again after kill " << k << "\n"
                        << run.output();
          return said;
        }
        std::this_thread::sleep_for(5ms);
      }
    }
    auto victim = alive.begin();
    std::advance(victim, static_cast<long>(rng() % alive.size()));
    const pid_t pid = run.member("server", *victim);
    if (pid <= 0) {
      ADD_FAILURE() << "no process for server " << *victim << "\n" << run.output();
      return said;
    }
    EXPECT_EQ(kill(pid, SIGKILL), 0);
    said += " server " + std::to_string(*victim) + " at round " + std::to_string(at) + ";";
    alive.erase(victim);
  }
  return said;
}

// Sum mode: the trainer checks every element of every round against the
// exact sum and exits non-zero on the first wrong one.
TEST(FailoverKill, FiveOfSixServersKilledEveryRoundStaysExact) {
  std::mt19937 rng(std::random_device{}());
  Background run(job(false, ""), job_env(false, 2));
  const std::string kills = kill_servers(run, 5, rng);
  auto code = run.wait(180s);
  ASSERT_TRUE(code) << run.output();
  EXPECT_EQ(*code, 0) << run.output();
  EXPECT_EQ(count(run.output(), "ranges fail over to server"), 5u) << run.output();
  std::printf("killed:%s\n", kills.c_str());
}

TEST(FailoverKill, AdamAfterFiveKillsIsBitIdenticalToAJobWithoutReplication) {
  TempDir tmp("psld-failover-kill");
  ASSERT_FALSE(tmp.path().empty());
  {
    Background whole(job(true, tmp.path() + "/whole"), job_env(true, 1));
    auto code = whole.wait(180s);
    ASSERT_TRUE(code) << whole.output();
    ASSERT_EQ(*code, 0) << whole.output();
  }
  const std::string want = slurp(tmp.path() + "/whole");
  ASSERT_EQ(want.size(), (1 + 333 + 70000) * 4u);

  std::mt19937 rng(std::random_device{}());
  Background run(job(true, tmp.path() + "/killed"), job_env(true, 2));
  const std::string kills = kill_servers(run, 5, rng);
  auto code = run.wait(180s);
  ASSERT_TRUE(code) << run.output();
  ASSERT_EQ(*code, 0) << run.output();
  EXPECT_EQ(count(run.output(), "ranges fail over to server"), 5u) << run.output();
  std::printf("killed:%s\n", kills.c_str());
  const std::string got = slurp(tmp.path() + "/killed");
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want) << "the parameters differ from those of the job nobody killed";
}

}  // namespace
