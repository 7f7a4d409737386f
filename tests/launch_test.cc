// `psld launch` end to end: real processes over UCX (TCP on loopback, and
// shared memory for the exact-sum tests).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_process.h"

namespace {

using psld::testing::RunResult;

RunResult run(const std::vector<std::string>& argv, const std::vector<std::string>& env,
              std::chrono::seconds timeout) {
  return psld::testing::run_process(argv, env, timeout);
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

// ---- Exact sums at scale: 4 workers x 3 servers, BSP, sum mode; every
// worker checks every element of every tensor after every round
// (tests/exact_worker.cc). Measured on 2 cores, normal build: the 500-round
// runs take 21-23 s (tcp) and 25-36 s (sm), the runs up to 64 MiB 12-15 s
// (tcp) and 10-13 s (sm); this whole file about 80 s.

std::string exact_worker() {
  return std::getenv("TEST_EXACT_WORKER");
}

// The end of a long output: enough to see what failed.
// The end of a job's output for a failure message, without its info and
// debug lines: with PSLD_LOG=info they can bury the one line saying why.
std::string tail(const std::string& s, size_t n = 6000) {
  std::string kept;
  size_t dropped = 0;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) {
    if (line.find("[psld info]") != std::string::npos ||
        line.find("[psld debug]") != std::string::npos) {
      ++dropped;
      continue;
    }
    kept += line;
    kept += '\n';
  }
  if (kept.size() > n) kept = "...\n" + kept.substr(kept.size() - n);
  if (dropped > 0) kept += "(" + std::to_string(dropped) + " info and debug lines left out)\n";
  return kept;
}

// Every "lanes ..." line the ucx transport logs at info level: one per
// distinct lane summary per process (connections with a summary already
// said go to debug), so every kind of connection the job made is here.
std::vector<std::string> lane_lines(const std::string& output) {
  std::vector<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.find("): lanes am=") != std::string::npos) out.push_back(line);
  }
  return out;
}

// `tls` is ucx.tls: "tcp", or "sm,tcp" for shared memory between the
// processes of this machine (tcp only bootstraps the connections).
RunResult run_exact(const std::string& tls, const std::vector<std::string>& args,
                    const std::vector<std::string>& extra_env = {}) {
  std::vector<std::string> argv = {psld(), "launch", "-w", "4", "-s", "3", "--", exact_worker()};
  argv.insert(argv.end(), args.begin(), args.end());
  // PSLD_LOG=info makes each process log every distinct set of UCX lanes its
  // connections use, so the test can tell that the transport it asked for
  // is the one that carried the data.
  // A generous heartbeat timeout: the workers share 2 cores with 3 servers.
  std::vector<std::string> env = {"PSLD_SERVER_MODE=sum", "PSLD_UCX_TLS=" + tls, "PSLD_LOG=info",
                                  "PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=20000",
                                  "UCX_WARN_UNUSED_ENV_VARS=n"};
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  return run(argv, env, std::chrono::seconds(240));
}

void expect_exact(const RunResult& r, int rounds, const std::string& tls) {
  ASSERT_FALSE(r.timed_out) << tail(r.output);
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  for (int w = 0; w < 4; ++w) {
    const std::string done = "[worker " + std::to_string(w) + "] worker " + std::to_string(w) +
                             ": " + std::to_string(rounds) + " rounds x ";
    const size_t at = r.output.find(done);
    ASSERT_NE(at, std::string::npos) << "worker " << w << " did not finish\n" << tail(r.output);
    EXPECT_NE(r.output.find("exact", at), std::string::npos) << tail(r.output);
  }
  const std::vector<std::string> lanes = lane_lines(r.output);
  ASSERT_FALSE(lanes.empty()) << "no connection logged its lanes\n" << tail(r.output);
  for (const std::string& l : lanes) {
    if (tls == "tcp") {
      EXPECT_NE(l.find("lanes am=tcp/"), std::string::npos) << l;
      EXPECT_EQ(l.find("sysv"), std::string::npos) << l;
      EXPECT_EQ(l.find("posix"), std::string::npos) << l;
    } else {
      // Messages over shared memory, pushes put straight into the server's
      // landing slots (memory it allocated through the transport).
      EXPECT_EQ(l.find("lanes am=tcp/"), std::string::npos) << l;
      EXPECT_TRUE(l.find("am=sysv/") != std::string::npos ||
                  l.find("am=posix/") != std::string::npos)
          << l;
      EXPECT_NE(l.find("writes use put"), std::string::npos) << l;
    }
  }
}

// 218 tensors: 1 element of fp16, bf16 and fp32, 200 of odd sizes up to
// 4 KiB, 12 of 64..384 KiB, and 64 KiB - 4 B, 64 KiB, 64 KiB + 4 B. 64 KiB
// chunks, so the large ones are cut into several chunks with a short tail.
const std::vector<std::string> kSmallChunks = {"PSLD_DATA_CHUNK_BYTES=65536"};

TEST(Launch, ExactSumsEveryRoundOverTcp_500RoundsOf218Tensors) {
  RunResult r =
      run_exact("tcp", {"--rounds", "500", "--profile", "small", "--seed", "11"}, kSmallChunks);
  expect_exact(r, 500, "tcp");
}

TEST(Launch, ExactSumsEveryRoundOverSharedMemory_500RoundsOf218Tensors) {
  RunResult r =
      run_exact("sm,tcp", {"--rounds", "500", "--profile", "small", "--seed", "12"}, kSmallChunks);
  expect_exact(r, 500, "sm,tcp");
}

// The same 218 plus odd sizes at every power of two from 128 Ki to 4 Mi
// elements and 16777215 fp32 elements (64 MiB - 4 B), 142 MB a worker;
// the default 4 MiB chunks.
TEST(Launch, ExactSumsEveryRoundOverTcp_TensorsUpTo64MiB) {
  RunResult r = run_exact("tcp", {"--rounds", "10", "--profile", "full", "--seed", "21"});
  expect_exact(r, 10, "tcp");
}

TEST(Launch, ExactSumsEveryRoundOverSharedMemory_TensorsUpTo64MiB) {
  RunResult r = run_exact("sm,tcp", {"--rounds", "10", "--profile", "full", "--seed", "22"});
  expect_exact(r, 10, "sm,tcp");
}

// The checker itself: worker 0 pushes one element off by one in round 2.
TEST(Launch, TheExactWorkerCatchesAWrongSum) {
  RunResult r = run_exact(
      "tcp", {"--rounds", "4", "--profile", "small", "--seed", "13", "--tamper-round", "2"},
      kSmallChunks);
  ASSERT_FALSE(r.timed_out) << tail(r.output);
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_NE(r.output.find("round 2 tensor t217_fp32_16385 element 16384: "), std::string::npos)
      << tail(r.output);
  EXPECT_NE(r.output.find("round 2: 1 wrong elements"), std::string::npos) << tail(r.output);
  EXPECT_EQ(r.output.find("round 1 tensor"), std::string::npos) << tail(r.output);
}

// `psld config` says where servers keep their keys; a job whose servers ask
// for a GPU this machine lacks fails at once and says why.
TEST(Launch, ServerDeviceIsReportedAndAMissingGpuFailsTheJobClearly) {
  RunResult r = run({psld(), "config"}, {}, std::chrono::seconds(20));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("# server keys: in host memory (server.device = cpu)"), std::string::npos)
      << r.output;
  r = run({psld(), "config", "--server.device=cuda"}, {}, std::chrono::seconds(20));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.output.find("# server keys: in GPU memory (server.device = cuda): cuda device ") !=
      std::string::npos) {
    GTEST_SKIP() << "a CUDA device is present: a GPU server starts here";
  }
  EXPECT_NE(r.output.find("# server keys: server.device = cuda, but a server cannot start here: "),
            std::string::npos)
      << r.output;
  r = run({psld(), "launch", "-w", "1", "-s", "1", "--", "true"}, {"PSLD_SERVER_DEVICE=cuda"},
          std::chrono::seconds(60));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("server.device = cuda, but the GPU cannot be used: "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("the job failed: server 0"), std::string::npos) << r.output;
}

TEST(Launch, BadUsageIsExplained) {
  RunResult r = run({psld(), "launch", "-w", "0", "--", "true"}, {}, std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("usage"), std::string::npos) << r.output;
  r = run({psld(), "launch", "-w", "1", "-s", "1", "--slow-server", "0:fast", "--", "true"}, {},
          std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("expected RANK:RATE"), std::string::npos) << r.output;
  r = run({psld(), "launch", "-w", "1", "-s", "1", "--slow-server", "3:25M", "--", "true"}, {},
          std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("only 1 servers"), std::string::npos) << r.output;
  r = run({psld(), "config", "--job.num_wrkers=2"}, {}, std::chrono::seconds(20));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("did you mean"), std::string::npos) << r.output;
}

}  // namespace
