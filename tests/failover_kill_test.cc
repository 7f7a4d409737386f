// Failover against real kills, with `psld launch` over UCX (TCP on
// loopback) and replication.factor = 2 (docs/replication.md): server
// processes are killed with SIGKILL one after another at random rounds while
// the job trains, and the job goes on without them. In sum mode every round
// of every worker is checked against the exact sum; with Adam the final
// parameters are bit-identical to those of a job without replication in
// which nobody died; in async mode the parameters end holding the total of
// every push, each counted once.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
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

// 20 kills: each failover brings a standby into the ring in the lost
// server's place, so the job keeps 4 servers until the standbys run out
// and ends on the one left.
constexpr int kServers = 4;
constexpr int kStandby = 17;
constexpr int kKills = 20;

// How the killed job trains: BSP sums checked every round, BSP Adam, or
// async sums whose totals are checked at the end.
enum class Mode { kSum, kAdam, kAsyncSum };

std::vector<std::string> job_env(Mode mode, int factor) {
  const bool adam = mode == Mode::kAdam;
  std::vector<std::string> env = psld::testing::kLaunchedJobEnv;
  if (mode == Mode::kAsyncSum) env.push_back("PSLD_DATA_SYNC=async");
  if (adam) {
    for (auto& e : env) {
      if (e == "PSLD_SERVER_MODE=sum") e = "PSLD_SERVER_MODE=optimizer";
    }
    env.push_back("PSLD_OPTIMIZER_KIND=adam");
    env.push_back("PSLD_OPTIMIZER_LR=0.01");
  }
  env.push_back("PSLD_REPLICATION_FACTOR=" + std::to_string(factor));
  // 25 processes start at once on two cores, and every worker dials 21
  // servers; a kill closes the victim's sockets, so it is found at once
  // whatever the heartbeat timeout.
  for (auto& e : env) {
    if (e.rfind("PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=", 0) == 0) {
      e = "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=10000";
    }
  }
  env.push_back("PSLD_LIVENESS_CONNECT_TIMEOUT_MS=60000");
  // The coordinator says when every range has its copies again: the test
  // kills the next server only then (before, the job would rightly fail).
  env.push_back("PSLD_LOG=warn,coordinator=info");
  return env;
}

// A job of 3 workers, kServers servers and `standby` standby servers. With a `stop_file` it runs
// until the test writes its last round there (rounds take about a millisecond here, so a fixed
// count would end the job before the kills do); otherwise for `rounds` rounds.
std::vector<std::string> job(Mode mode, const std::string& dump, const std::string& stop_file,
                             int rounds, int standby) {
  std::vector<std::string> argv = {psld(),
                                   "launch",
                                   "-w",
                                   "3",
                                   "-s",
                                   std::to_string(kServers),
                                   "--standby",
                                   std::to_string(standby),
                                   "--",
                                   trainer(),
                                   "--print-every",
                                   "1"};
  if (stop_file.empty()) {
    argv.insert(argv.end(), {"--rounds", std::to_string(rounds)});
  } else {
    argv.insert(argv.end(), {"--rounds", "1000000", "--stop-file", stop_file});
  }
  if (mode == Mode::kAdam) argv.push_back("--no-check");
  if (mode == Mode::kAsyncSum) argv.push_back("--total");
  if (!dump.empty()) argv.insert(argv.end(), {"--dump", dump});
  return argv;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1))
    ++n;
  return n;
}

// Waits until the coordinator said `n` times that every range has its copies
// again; false (with a failure) after 60 s or when the job ended.
bool copies_made(Background& run, size_t n) {
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (count(run.output(), "every range has its copies again") < n) {
    if (std::chrono::steady_clock::now() > until || run.wait(0ms)) {
      ADD_FAILURE() << "the copies were not made again after kill " << n << "\n" << run.output();
      return false;
    }
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

struct Kills {
  std::string said;    // a line per kill for the log
  int last_round = 0;  // the job's last round, written to its stop file; 0 on failure
};

// Kills kKills of the job's servers, one at a time, each a member of the
// placement at the time, at a random round at least 10 rounds after the
// previous kill and once every range has its copies again; then, once the
// copies of the last kill are made too, ends the job 200 rounds after the
// last round it printed. The coordinator replaces each lost member by the
// lowest-ranked standby left, and so does this list.
Kills kill_servers(Background& run, const std::string& stop_file, std::mt19937& rng) {
  std::vector<int> members;
  std::deque<int> standby;
  for (int s = 0; s < kServers + kStandby; ++s)
    (s < kServers ? members.push_back(s) : standby.push_back(s));
  int at = 0;
  Kills out;
  // In async mode worker 0 may be many rounds ahead of a worker still
  // joining (connecting to 21 servers on two loaded cores): the first kill
  // may come during that join, which goes on without the lost server.
  for (int k = 0; k < kKills; ++k) {
    at += 10 + static_cast<int>(rng() % 20);
    if (!run.wait_for_output("worker 0: round " + std::to_string(at) + "\n", 120s)) {
      ADD_FAILURE() << "the job did not reach round " << at << "\n" << run.output();
      return out;
    }
    if (k > 0 && !copies_made(run, k)) return out;
    const size_t index = rng() % members.size();
    const int victim = members[index];
    const pid_t pid = run.member("server", victim);
    if (pid <= 0) {
      ADD_FAILURE() << "no process for server " << victim << "\n" << run.output();
      return out;
    }
    EXPECT_EQ(kill(pid, SIGKILL), 0);
    out.said += " server " + std::to_string(victim) + " at round " + std::to_string(at) + ";";
    members.erase(members.begin() + static_cast<long>(index));
    if (!standby.empty()) {
      members.push_back(standby.front());
      standby.pop_front();
    }
  }
  if (!copies_made(run, kKills)) return out;
  out.last_round = psld::testing::last_round(run.output()) + 200;
  std::ofstream(stop_file) << out.last_round << "\n";
  return out;
}

// A replicated job under kill_servers, to its end: its output and kills,
// and whether it ended cleanly after kKills failovers.
struct KilledJob {
  Kills kills;
  std::string output;
  bool ok = false;
};

KilledJob run_killed_job(Mode mode, const std::string& dump, const std::string& dir) {
  KilledJob out;
  const std::string stop_file = dir + "/stop";
  std::mt19937 rng(std::random_device{}());
  Background run(job(mode, dump, stop_file, 0, kStandby), job_env(mode, 2));
  out.kills = kill_servers(run, stop_file, rng);
  std::printf("killed:%s\n", out.kills.said.c_str());
  if (out.kills.last_round == 0) return out;  // said why; the group is killed on return
  auto code = run.wait(180s);
  out.output = run.output();
  if (!code) {
    ADD_FAILURE() << "the job did not end 180 s after its last round was set\n" << out.output;
    return out;
  }
  EXPECT_EQ(*code, 0) << out.output;
  EXPECT_EQ(count(out.output, "ranges fail over to server"), size_t{kKills}) << out.output;
  out.ok = *code == 0;
  return out;
}

// Runs a killed job in `mode` to its end; every worker must have printed
// "worker W: <last round> <what>".
void expect_every_worker_said(Mode mode, const std::string& what) {
  TempDir tmp("psld-failover-kill");
  ASSERT_FALSE(tmp.path().empty());
  const KilledJob killed = run_killed_job(mode, "", tmp.path());
  ASSERT_TRUE(killed.ok);
  for (int w = 0; w < 3; ++w) {
    const std::string want =
        "worker " + std::to_string(w) + ": " + std::to_string(killed.kills.last_round) + " " + what;
    EXPECT_NE(killed.output.find(want), std::string::npos) << want << "\n" << killed.output;
  }
}

// Sum mode: the trainer checks every element of every round against the
// exact sum and exits non-zero on the first wrong one.
TEST(FailoverKill, TwentyServersKilledEveryRoundStaysExact) {
  expect_every_worker_said(Mode::kSum, "rounds exact");
}

// Async: each worker pushes at its own pace, and the pushes a killed
// server had applied but not copied are sent again by the workers; after
// the last round every worker pulls the totals (the trainer's --total),
// which must hold every push of every worker once.
TEST(FailoverKill, AsyncPushesAreCountedOnceThroughTwentyKills) {
  expect_every_worker_said(Mode::kAsyncSum, "rounds total exact");
}

TEST(FailoverKill, AdamAfterTwentyKillsIsBitIdenticalToAJobWithoutReplication) {
  TempDir tmp("psld-failover-kill");
  ASSERT_FALSE(tmp.path().empty());
  const KilledJob killed = run_killed_job(Mode::kAdam, tmp.path() + "/killed", tmp.path());
  ASSERT_TRUE(killed.ok);

  // The same rounds with one copy and nobody killed.
  Background whole(job(Mode::kAdam, tmp.path() + "/whole", "", killed.kills.last_round, 0),
                   job_env(Mode::kAdam, 1));
  auto whole_code = whole.wait(180s);
  ASSERT_TRUE(whole_code) << whole.output();
  ASSERT_EQ(*whole_code, 0) << whole.output();
  const std::string want = slurp(tmp.path() + "/whole");
  ASSERT_EQ(want.size(), (1 + 333 + 70000) * 4u);
  const std::string got = slurp(tmp.path() + "/killed");
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want) << "the parameters differ from those of the job nobody killed";
}

}  // namespace
