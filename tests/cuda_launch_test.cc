// CUDA tensors end to end across processes: `psld launch -w 2 -s 1` with
// trainers whose tensors are in GPU memory (tests/cuda_worker.cc), over UCX.
// With Debian's UCX, which cannot register CUDA memory, they take the staged
// path; a UCX or verbs build that can takes the direct one. The last run also
// keeps the server's keys in GPU memory (server.device = cuda). Skips without
// a CUDA device.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>

#include "kernels/dispatch.h"
#include "tests/test_process.h"

namespace {

TEST(CudaLaunch, TwoWorkersPushAndPullDeviceTensorsExactly) {
  const psld::Status device = psld::kernels::cuda_device_status();
  if (!device.ok()) GTEST_SKIP() << "no CUDA device: " << device.message();
  const std::pair<const char*, const char*> runs[] = {
      {"tcp", "cpu"}, {"sm,tcp", "cpu"}, {"sm,tcp", "cuda"}};
  for (const auto& [tls, server_device] : runs) {
    psld::testing::RunResult r =
        psld::testing::run_process({std::getenv("TEST_PSLD_BINARY"), "launch", "-w", "2", "-s", "1",
                                    "--", std::getenv("TEST_CUDA_WORKER"), "--rounds", "20"},
                                   {"PSLD_SERVER_MODE=sum", std::string("PSLD_UCX_TLS=") + tls,
                                    std::string("PSLD_SERVER_DEVICE=") + server_device,
                                    "PSLD_LOG=info", "UCX_WARN_UNUSED_ENV_VARS=n"},
                                   std::chrono::seconds(180));
    if (std::string(server_device) == "cuda") {
      EXPECT_NE(r.output.find("keys on cuda device "), std::string::npos) << r.output;
    }
    ASSERT_FALSE(r.timed_out) << tls << "\n" << r.output;
    EXPECT_EQ(r.exit_code, 0) << tls << "\n" << r.output;
    for (int w = 0; w < 2; ++w) {
      EXPECT_NE(r.output.find("worker " + std::to_string(w) + ": 20 rounds exact on CUDA tensors"),
                std::string::npos)
          << tls << "\n"
          << r.output;
    }
    // Which path, said at start and for each tensor.
    EXPECT_NE(r.output.find("CUDA tensors go "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("bytes of CUDA memory) goes "), std::string::npos) << r.output;
    std::printf("%s: %s\n", tls, r.output.substr(r.output.find("CUDA tensors go "), 160).c_str());
  }
}

}  // namespace
