// OpenMPI's mpirun as the launcher: `mpirun -np N trainer` with
// job.colocate_servers makes a whole job (coordinator in rank 0, a server in
// every rank) with no psld process of its own.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "psld/worker.h"
#include "tests/test_process.h"

namespace {

using psld::testing::free_loopback_port;
using psld::testing::run_process;

std::string find_mpirun() {
  for (const char* p : {"/usr/bin/mpirun", "/usr/local/bin/mpirun"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// mpirun as root needs --allow-run-as-root; three ranks on two cores need
// --oversubscribe. -x exports each variable to every rank.
std::vector<std::string> mpirun_argv(int np, int port, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np",
                                   std::to_string(np)};
  for (const std::string& e :
       {std::string("PSLD_JOB_COLOCATE_SERVERS=true"),
        "PSLD_JOB_COORDINATOR=127.0.0.1:" + std::to_string(port),
        std::string("PSLD_SERVER_MODE=sum"), std::string("PSLD_UCX_TLS=tcp"),
        std::string("PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=5000"),
        std::string("UCX_WARN_UNUSED_ENV_VARS=n"), std::string("UCX_MEM_MALLOC_HOOKS=no"),
        std::string("UCX_MEM_EVENTS=no")}) {
    argv.push_back("-x");
    argv.push_back(e);
  }
  argv.push_back(std::getenv("TEST_LAUNCH_WORKER"));
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// No rank may outlive mpirun: pgrep finds none of the trainer's processes.
bool trainer_processes_left() {
  const std::string cmd =
      std::string("pgrep -f '^") + std::getenv("TEST_LAUNCH_WORKER") + "' >/dev/null";
  return std::system(cmd.c_str()) == 0;
}

class Mpirun : public ::testing::Test {
 protected:
  void SetUp() override {
    if (find_mpirun().empty()) {
      GTEST_SKIP()
          << "mpirun not installed (Debian package openmpi-bin; tools/dev deps installs it)";
    }
    port_ = free_loopback_port();
    ASSERT_GT(port_, 0);
  }
  void TearDown() override { EXPECT_FALSE(trainer_processes_left()); }
  int port_ = -1;
};

TEST_F(Mpirun, ColocatedJobTrainsExactlyAndExitsCleanly) {
  auto r = run_process(mpirun_argv(3, port_, {"--rounds", "20"}), {}, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int w = 0; w < 3; ++w) {
    EXPECT_NE(r.output.find("worker " + std::to_string(w) + ": 20 rounds exact"), std::string::npos)
        << r.output;
  }
}

TEST_F(Mpirun, ARankThatFailsStopsTheJob) {
  auto r = run_process(mpirun_argv(3, port_, {"--rounds", "20", "--fail-rank", "2"}), {},
                       std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("worker 2 failing on purpose"), std::string::npos) << r.output;
}

TEST(Colocated, TheRankMustBeKnownAtStart) {
  psld::Config config;
  config.job.colocate_servers = true;
  config.job.num_workers = 2;
  config.job.num_servers = 2;
  auto w = psld::Worker::join(config);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), psld::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("job.colocate_servers"), std::string::npos)
      << w.status().to_string();
}

}  // namespace
