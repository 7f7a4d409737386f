// The C API end to end: a coordinator and a server in this process (C++ API,
// UCX over TCP on loopback), one worker through psld/c_api.h.
#include "psld/c_api.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <string>
#include <vector>

#include "psld/coordinator.h"
#include "psld/server.h"
#include "tests/test_process.h"

namespace {

TEST(CApi, AWorkerPushPullsThroughTheCApi) {
  const std::string coordinator =
      "127.0.0.1:" + std::to_string(psld::testing::free_loopback_port());
  psld::Config cfg;
  cfg.job.coordinator = coordinator;
  cfg.job.transport = "ucx";
  cfg.ucx.tls = "tcp";
  cfg.server.mode = psld::ServerMode::kSum;
  auto coord = psld::Coordinator::start(cfg);
  ASSERT_TRUE(coord.ok()) << coord.status().to_string();
  auto server = std::async(std::launch::async, [&] { return psld::Server::start(cfg); });

  const std::vector<std::string> flags = {"--job.coordinator=" + coordinator, "--job.transport=ucx",
                                          "--ucx.tls=tcp"};
  std::vector<const char*> argv;
  for (const auto& f : flags)
    argv.push_back(f.c_str());
  psld_worker* w = nullptr;
  ASSERT_EQ(psld_worker_join(static_cast<int>(argv.size()), argv.data(), &w), PSLD_OK)
      << psld_last_error();
  auto srv = server.get();
  ASSERT_TRUE(srv.ok()) << srv.status().to_string();

  uint32_t rank = 99, workers = 0;
  ASSERT_EQ(psld_worker_rank(w, &rank, &workers), PSLD_OK);
  EXPECT_EQ(rank, 0u);
  EXPECT_EQ(workers, 1u);
  ASSERT_NE(psld_worker_gpu_path(w), nullptr);
  EXPECT_NE(std::string(psld_worker_gpu_path(w)).find("staged through pinned host memory"),
            std::string::npos)
      << psld_worker_gpu_path(w);
  EXPECT_EQ(psld_worker_gpu_path(nullptr), nullptr);

  std::vector<float> x(1000, 3.0f);
  uint32_t t = 0;
  // A dtype that is no psld_dtype is refused before it becomes a psld::DType.
  EXPECT_EQ(psld_register_tensor(w, "bad", 7, x.size() * 4, x.data(), nullptr, &t),
            PSLD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(psld_last_error()).find("dtype 7 is not one of"), std::string::npos)
      << psld_last_error();
  ASSERT_EQ(psld_register_tensor(w, "x", PSLD_FLOAT32, x.size() * 4, x.data(), nullptr, &t),
            PSLD_OK)
      << psld_last_error();
  for (int round = 1; round <= 3; ++round) {
    for (auto& v : x)
      v = static_cast<float>(round);
    psld_request* r = nullptr;
    ASSERT_EQ(psld_push_pull(w, t, &r), PSLD_OK) << psld_last_error();
    ASSERT_EQ(psld_request_wait(r, 10000), PSLD_OK) << psld_last_error();
    EXPECT_EQ(psld_request_test(r), 1);
    psld_request_free(r);
    for (float v : x)
      ASSERT_EQ(v, static_cast<float>(round));  // one worker: the sum is its push
  }
  uint64_t rounds = 0;
  ASSERT_EQ(psld_tensor_round(w, t, &rounds), PSLD_OK) << psld_last_error();
  EXPECT_EQ(rounds, 3u);
  EXPECT_EQ(psld_tensor_round(w, 99, &rounds), PSLD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(psld_last_error()).find("unknown tensor handle"), std::string::npos)
      << psld_last_error();

  // A tensor in memory from psld_allocate, past the block's start.
  void* block = nullptr;
  ASSERT_EQ(psld_allocate(w, 4096, &block), PSLD_OK) << psld_last_error();
  auto* y = static_cast<float*>(block) + 8;
  std::fill(y, y + 100, 2.5f);
  uint32_t ty = 0;
  ASSERT_EQ(psld_register_tensor(w, "y", PSLD_FLOAT32, 400, y, nullptr, &ty), PSLD_OK)
      << psld_last_error();
  psld_request* ry = nullptr;
  ASSERT_EQ(psld_push_pull(w, ty, &ry), PSLD_OK) << psld_last_error();
  ASSERT_EQ(psld_request_wait(ry, 10000), PSLD_OK) << psld_last_error();
  psld_request_free(ry);
  EXPECT_EQ(y[0], 2.5f);
  EXPECT_EQ(y[99], 2.5f);
  EXPECT_EQ(static_cast<float*>(block)[7], 0.0f);
  EXPECT_EQ(psld_allocate(w, 0, &block), PSLD_INVALID_ARGUMENT);

  // Many tensors at once: one request each, exact, and a bad handle submits
  // nothing.
  std::vector<std::vector<float>> small(20, std::vector<float>(64));
  std::vector<uint32_t> handles;
  for (size_t i = 0; i < small.size(); ++i) {
    uint32_t h = 0;
    ASSERT_EQ(psld_register_tensor(w, ("small" + std::to_string(i)).c_str(), PSLD_FLOAT32, 256,
                                   small[i].data(), nullptr, &h),
              PSLD_OK)
        << psld_last_error();
    handles.push_back(h);
  }
  for (int round = 1; round <= 2; ++round) {
    for (size_t i = 0; i < small.size(); ++i)
      std::fill(small[i].begin(), small[i].end(), static_cast<float>(round * 100 + i));
    std::vector<psld_request*> reqs(handles.size(), nullptr);
    ASSERT_EQ(psld_push_pull_many(w, handles.data(), handles.size(), reqs.data()), PSLD_OK)
        << psld_last_error();
    for (psld_request* r : reqs) {
      ASSERT_EQ(psld_request_wait(r, 10000), PSLD_OK) << psld_last_error();
      psld_request_free(r);
    }
    for (size_t i = 0; i < small.size(); ++i)
      ASSERT_EQ(small[i][63], static_cast<float>(round * 100 + i)) << i;
  }
  std::vector<psld_request*> pulled(handles.size(), nullptr);
  ASSERT_EQ(psld_pull_many(w, handles.data(), handles.size(), pulled.data()), PSLD_OK)
      << psld_last_error();
  for (psld_request* r : pulled) {
    ASSERT_EQ(psld_request_wait(r, 10000), PSLD_OK) << psld_last_error();
    psld_request_free(r);
  }
  std::vector<uint32_t> with_bad = {handles[0], 12345};
  std::vector<psld_request*> untouched(2, nullptr);
  EXPECT_EQ(psld_push_many(w, with_bad.data(), with_bad.size(), untouched.data()),
            PSLD_INVALID_ARGUMENT);
  EXPECT_EQ(untouched[0], nullptr);
  EXPECT_EQ(psld_push_pull_many(w, nullptr, 3, untouched.data()), PSLD_INVALID_ARGUMENT);
  EXPECT_EQ(psld_push_pull_many(w, handles.data(), 0, nullptr), PSLD_OK);

  // Errors are codes plus a message, never a crash.
  uint32_t bad = 0;
  EXPECT_EQ(psld_register_tensor(w, nullptr, PSLD_FLOAT32, 4, x.data(), nullptr, &bad),
            PSLD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(psld_last_error()), "");
  EXPECT_EQ(psld_register_tensor(w, "x", PSLD_FLOAT32, 8, x.data(), nullptr, &bad),
            PSLD_ALREADY_EXISTS)
      << psld_last_error();
  psld_request* none = nullptr;
  EXPECT_EQ(psld_pull(w, 12345, &none), PSLD_INVALID_ARGUMENT);

  EXPECT_EQ(psld_barrier(w, 5000), PSLD_OK) << psld_last_error();
  EXPECT_EQ(psld_worker_shutdown(w), PSLD_OK) << psld_last_error();
  EXPECT_TRUE((*coord)->wait(std::chrono::seconds(5)).ok());
  (*srv)->shutdown();
  (*coord)->shutdown();
}

}  // namespace
