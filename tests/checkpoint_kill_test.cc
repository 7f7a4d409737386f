// Checkpoints against real kills, with `psld launch` over UCX (TCP on
// loopback): a job training with Adam and checkpointing every 5 rounds is
// killed with SIGKILL, launcher and every child at once, at random moments
// (in the middle of a server's file or of the manifest, as it comes), and
// resumed with `psld launch --resume` each time; its final parameters are
// bit-identical to those of a run that was never stopped. A checkpoint torn
// by a kill is never used: it would show as a different result.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lib/checkpoint/checkpoint.h"
#include "tests/temp_dir.h"
#include "tests/test_process.h"

namespace {

using psld::testing::TempDir;

using namespace std::chrono_literals;
using psld::testing::Background;
using psld::testing::psld;
using psld::testing::slurp;
using psld::testing::trainer;
namespace fs = std::filesystem;

// Rounds take well under a millisecond here and a checkpoint is sealed on the
// next progress report (every 20 ms) once its files are synced: a job must
// run long enough to seal some before it ends.
constexpr int kRounds = 1000;

std::vector<std::string> adam_env(const std::string& dir) {
  std::vector<std::string> env = psld::testing::kLaunchedJobEnv;
  for (auto& e : env) {
    if (e == "PSLD_SERVER_MODE=sum") e = "PSLD_SERVER_MODE=optimizer";
  }
  env.push_back("PSLD_OPTIMIZER_KIND=adam");
  // Progress reports (which checkpoint rounds are sealed on) come often.
  env.push_back("PSLD_STATS_INTERVAL_MS=20");
  env.push_back("PSLD_OPTIMIZER_LR=0.01");
  if (!dir.empty()) {
    env.push_back("PSLD_CHECKPOINT_DIR=" + dir);
    env.push_back("PSLD_CHECKPOINT_EVERY_ROUNDS=5");
  }
  return env;
}

std::vector<std::string> job(const std::string& dump, bool resume, const std::string& dir) {
  std::vector<std::string> argv = {psld(), "launch", "-w", "3", "-s", "2"};
  if (resume) argv.insert(argv.end(), {"--resume", dir});
  argv.insert(argv.end(), {"--", trainer(), "--rounds", std::to_string(kRounds), "--no-check",
                           "--print-every", "1", "--dump", dump});
  return argv;
}

TEST(CheckpointKill, AJobKilledAtRandomAndResumedEndsBitIdentical) {
  TempDir tmp("psld-checkpoint-kill");
  ASSERT_FALSE(tmp.path().empty());
  const std::string dir = tmp.path() + "/ckpt";

  // The run nobody stops, without checkpoints.
  {
    Background whole(job(tmp.path() + "/whole", false, ""), adam_env(""));
    auto code = whole.wait(180s);
    ASSERT_TRUE(code) << whole.output();
    ASSERT_EQ(*code, 0) << whole.output();
  }
  const std::string want = slurp(tmp.path() + "/whole");
  ASSERT_EQ(want.size(), (1 + 333 + 70000) * 4u);

  std::mt19937 rng(std::random_device{}());
  uint64_t resumed_from = 0;
  int kills = 0;
  size_t torn = 0;  // newer round directories a kill left without a whole checkpoint
  std::string rounds;
  for (int attempt = 0; attempt < 12 && kills < 5; ++attempt) {
    const bool resume = psld::checkpoint::find_latest(dir).ok();
    Background run(job(tmp.path() + "/killed", resume, dir), adam_env(dir));
    // Some rounds past where it starts, then a kill at a random moment.
    const uint64_t from = resume ? psld::checkpoint::find_latest(dir)->manifest.round : 0;
    const uint64_t at = from + 20 + rng() % 30;
    if (at >= kRounds - 5) break;
    if (!run.wait_for_output("worker 0: round " + std::to_string(at) + "\n", 120s)) {
      FAIL() << "the job did not reach round " << at << "\n" << run.output();
    }
    // A checkpoint is whole once its files are written and synced, which on a
    // busy disk can take longer than the rounds to `at` do: kill only once
    // this run has sealed one of its own (the later ones are still being
    // written when the kill comes, at a random moment).
    const auto sealed_by = std::chrono::steady_clock::now() + 60s;
    bool ended = false;
    for (;;) {
      auto latest = psld::checkpoint::find_latest(dir);
      if (latest.ok() && (!resume || latest->manifest.round > from)) break;
      if (run.wait(std::chrono::milliseconds(0))) {
        ended = true;  // it finished before it sealed one: nothing left to kill
        break;
      }
      if (std::chrono::steady_clock::now() > sealed_by) {
        FAIL() << "no whole checkpoint past round " << from << " 60 s after round " << at << ": "
               << latest.status().to_string() << "\n"
               << run.output();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (ended) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 40));
    ASSERT_EQ(kill(-run.pid(), SIGKILL), 0);
    ASSERT_TRUE(run.wait(10s));
    ++kills;
    if (resume) {
      EXPECT_NE(run.output().find("worker 0: resumed at round " + std::to_string(from)),
                std::string::npos)
          << run.output();
    }
    auto found = psld::checkpoint::find_latest(dir);
    ASSERT_TRUE(found.ok()) << "no checkpoint after a run to round " << at << ": "
                            << found.status().to_string() << "\n"
                            << run.output();
    EXPECT_GE(found->manifest.round, resumed_from);
    resumed_from = found->manifest.round;
    torn += found->skipped.size();
    rounds += " " + std::to_string(at) + "->" + std::to_string(resumed_from);
  }
  std::printf(
      "%d kills (round seen before the kill -> newest whole checkpoint):%s; %zu torn checkpoints "
      "passed over\n",
      kills, rounds.c_str(), torn);
  ASSERT_GE(kills, 3);
  EXPECT_GE(torn, 1u) << "no kill landed while a checkpoint was being written";

  Background last(job(tmp.path() + "/killed", true, dir), adam_env(dir));
  auto code = last.wait(180s);
  ASSERT_TRUE(code) << last.output();
  ASSERT_EQ(*code, 0) << last.output();
  EXPECT_NE(last.output().find("worker 0: resumed at round "), std::string::npos) << last.output();
  const std::string got = slurp(tmp.path() + "/killed");
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want) << "the resumed job's parameters differ from the run never stopped";
}

}  // namespace
