// The runtime end to end in one process: a coordinator, servers and workers
// on a loopback fabric.
#include <gtest/gtest.h>

#include <future>
#include <numeric>

#include "lib/coordinator.h"
#include "lib/server.h"
#include "lib/worker.h"
#include "transports/loopback/loopback.h"

namespace psld {
namespace {

using namespace std::chrono_literals;
using protocol::DType;

struct Cluster {
  std::shared_ptr<transport::LoopbackFabric> fabric = std::make_shared<transport::LoopbackFabric>();
  RuntimeOptions base;
  std::unique_ptr<CoordinatorService> coordinator;
  std::vector<std::unique_ptr<ServerService>> servers;
  std::vector<std::unique_ptr<WorkerService>> workers;

  explicit Cluster(uint32_t num_workers, uint32_t num_servers,
                   const std::function<void(RuntimeOptions&)>& tweak = nullptr,
                   const std::string& transport = "loopback") {
    base.endpoint.transport = transport;
    base.endpoint.options.loopback.fabric = fabric;
    base.endpoint.options.ucx.tls = "tcp";
    base.endpoint.options.common.op_timeout = 5s;
    base.num_workers = num_workers;
    base.num_servers = num_servers;
    base.chunk_bytes = 64 * 1024;
    base.slots_per_worker = 4;
    base.heartbeat_interval = 50ms;
    base.heartbeat_timeout = 2s;
    base.connect_timeout = 5s;
    if (tweak) tweak(base);
  }

  Status start() {
    auto c = CoordinatorService::start(base);
    if (!c.ok()) return c.status();
    coordinator = std::move(c).value();
    base.coordinator_address = coordinator->address();
    std::vector<std::future<Result<std::unique_ptr<ServerService>>>> sf;
    for (uint32_t i = 0; i < base.num_servers; ++i) {
      sf.push_back(std::async(std::launch::async, [this] { return ServerService::start(base); }));
    }
    std::vector<std::future<Result<std::unique_ptr<WorkerService>>>> wf;
    for (uint32_t i = 0; i < base.num_workers; ++i) {
      RuntimeOptions o = base;
      o.rank = static_cast<int32_t>(i);
      wf.push_back(std::async(std::launch::async, [o] { return WorkerService::start(o); }));
    }
    Status first;
    for (auto& f : sf) {
      auto s = f.get();
      if (s.ok())
        servers.push_back(std::move(s).value());
      else if (first.ok())
        first = s.status();
    }
    for (auto& f : wf) {
      auto w = f.get();
      if (w.ok())
        workers.push_back(std::move(w).value());
      else if (first.ok())
        first = w.status();
    }
    return first;
  }

  ~Cluster() {
    for (auto& w : workers)
      (void)w->shutdown();
    if (coordinator) (void)coordinator->wait(2s);
    for (auto& s : servers)
      s->shutdown();
    if (coordinator) coordinator->shutdown();
  }
};

class Runtime : public ::testing::TestWithParam<std::string> {};

// Runs fn(worker index) on every worker concurrently and returns the first error.
Status on_all(Cluster& c, const std::function<Status(size_t)>& fn) {
  std::vector<std::future<Status>> fs;
  for (size_t i = 0; i < c.workers.size(); ++i) {
    fs.push_back(std::async(std::launch::async, [&, i] { return fn(i); }));
  }
  Status first;
  for (auto& f : fs) {
    Status s = f.get();
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

TEST_P(Runtime, ClusterStartsAndAllWorkersGetRanks) {
  Cluster c(3, 2, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  std::set<uint32_t> ranks;
  for (auto& w : c.workers)
    ranks.insert(w->rank());
  EXPECT_EQ(ranks, (std::set<uint32_t>{0, 1, 2}));
  EXPECT_EQ(c.coordinator->num_members(), 5u);
  ASSERT_TRUE(on_all(c, [&](size_t i) { return c.workers[i]->barrier(5s); }).ok());
}

TEST_P(Runtime, BspSumModeGivesExactSumsEveryRound) {
  Cluster c(4, 3, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  // Odd sizes: single element, less than a chunk, several chunks with a tail.
  const std::vector<size_t> elems = {1, 7, 1000, 16384, 50001};
  constexpr int kRounds = 30;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>> data(elems.size());
    std::vector<uint32_t> handles;
    for (size_t t = 0; t < elems.size(); ++t) {
      data[t].assign(elems[t], 0.0f);
      PSLD_ASSIGN_OR_RETURN(uint32_t h, w.register_tensor("t" + std::to_string(t), DType::kF32,
                                                          elems[t] * 4, data[t].data(), nullptr));
      handles.push_back(h);
    }
    const float rank = static_cast<float>(w.rank());
    for (int r = 1; r <= kRounds; ++r) {
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i) {
          data[t][i] = rank * 1000.0f + static_cast<float>(r) + static_cast<float>(i % 13);
        }
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      for (auto& req : reqs)
        PSLD_RETURN_IF_ERROR(req->wait(10s));
      // The sum over 4 workers of rank*1000 + r + i%13.
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i) {
          const float want = 6000.0f + 4.0f * (static_cast<float>(r) + static_cast<float>(i % 13));
          if (data[t][i] != want) {
            return Internal("round " + std::to_string(r) + " tensor " + std::to_string(t) +
                            " element " + std::to_string(i) + ": " + std::to_string(data[t][i]) +
                            " != " + std::to_string(want));
          }
        }
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
  uint64_t rounds = 0;
  for (auto& srv : c.servers)
    rounds += srv->stats().rounds_applied;
  EXPECT_GT(rounds, 0u);
}

TEST_P(Runtime, OptimizerModeAppliesSgdFromTheInitialValue) {
  Cluster c(
      2, 2,
      [](RuntimeOptions& o) {
        o.mode = ServerMode::kOptimizer;
        o.optimizer.kind = OptimizerKind::kSgd;
        o.optimizer.lr = 0.5f;  // a power of two: exact on integer-valued data
      },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 20000;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> x(kN, 0.0f), init(kN);
    for (size_t i = 0; i < kN; ++i)
      init[i] = static_cast<float>(i);
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("w", DType::kF32, kN * 4, x.data(), init.data()));
    PSLD_RETURN_IF_ERROR(w.barrier(5s));
    PSLD_ASSIGN_OR_RETURN(auto pull, w.submit(h, RequestKind::kPull));
    PSLD_RETURN_IF_ERROR(pull->wait(5s));
    for (size_t i = 0; i < kN; ++i) {
      if (x[i] != init[i]) return Internal("the initial value did not arrive");
    }
    for (int r = 1; r <= 5; ++r) {
      std::fill(x.begin(), x.end(), 2.0f);  // each worker's gradient
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPushPull));
      PSLD_RETURN_IF_ERROR(req->wait(5s));
      for (size_t i = 0; i < kN; ++i) {
        // w_r = w_{r-1} - 0.5 * (2 + 2)
        const float want = static_cast<float>(i) - 2.0f * static_cast<float>(r);
        if (x[i] != want) return Internal("wrong parameter after round " + std::to_string(r));
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_P(Runtime, Fp16TensorsAreReducedInFp32) {
  Cluster c(2, 1, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<uint16_t> x(300);
    PSLD_ASSIGN_OR_RETURN(uint32_t h, w.register_tensor("h", DType::kF16, 600, x.data(), nullptr));
    for (auto& v : x)
      v = kernels::f32_to_f16_scalar(1.5f + static_cast<float>(w.rank()));
    PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPushPull));
    PSLD_RETURN_IF_ERROR(req->wait(5s));
    for (auto v : x) {
      if (kernels::f16_to_f32_scalar(v) != 4.0f) return Internal("fp16 sum is wrong");
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_P(Runtime, SameNameWithDifferentSizesIsAClearError) {
  Cluster c(2, 1, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  std::vector<float> a(10), b(20);
  ASSERT_TRUE(c.workers[0]->register_tensor("fc1.weight", DType::kF32, 40, a.data(), nullptr).ok());
  auto r = c.workers[1]->register_tensor("fc1.weight", DType::kF32, 80, b.data(), nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fc1.weight"), std::string::npos) << r.status().to_string();
  // And locally, twice with a different shape.
  auto again = c.workers[0]->register_tensor("fc1.weight", DType::kF32, 80, b.data(), nullptr);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
}

TEST_P(Runtime, AsyncModeConservesTheTotalOfAllPushes) {
  Cluster c(
      3, 2, [](RuntimeOptions& o) { o.sync = SyncMode::kAsync; }, GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 5000;
  constexpr int kPushes = 20;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> x(kN);
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("acc", DType::kF32, kN * 4, x.data(), nullptr));
    for (int r = 0; r < kPushes; ++r) {
      std::fill(x.begin(), x.end(), 1.0f);
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPush));
      PSLD_RETURN_IF_ERROR(req->wait(5s));
    }
    PSLD_RETURN_IF_ERROR(w.barrier(5s));
    if (wi != 0) return Status::Ok();
    // Pushes are applied as they arrive; once every push has reached its
    // server, a pull sees all of them: 3 workers x 20 pushes of 1.
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < deadline) {
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPull));
      PSLD_RETURN_IF_ERROR(req->wait(5s));
      if (std::all_of(x.begin(), x.end(), [](float v) { return v == 60.0f; })) return Status::Ok();
      if (std::any_of(x.begin(), x.end(), [](float v) { return v > 60.0f; })) {
        return Internal("more than the pushed total: " + std::to_string(x[0]));
      }
      std::this_thread::sleep_for(10ms);
    }
    return Internal("the total never reached 60: x[0] = " + std::to_string(x[0]));
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_P(Runtime, AWorkerThatDiesFailsTheJobForEveryone) {
  // Tensor memory must outlive the workers that registered it (the contract
  // of register_tensor): declared before the cluster, destroyed after it.
  std::vector<float> x(100, 1.0f);
  Cluster c(
      3, 1, [](RuntimeOptions& o) { o.heartbeat_timeout = 1s; }, GetParam());
  ASSERT_TRUE(c.start().ok());
  auto h = c.workers[1]->register_tensor("x", DType::kF32, 400, x.data(), nullptr);
  ASSERT_TRUE(h.ok());
  // Worker 2 vanishes without saying goodbye (its transport closes).
  c.workers[2]->stop();
  // Worker 1 is waiting for a round that can never complete.
  // The news may already be in (then submit says so) or arrive while waiting.
  auto req = c.workers[1]->submit(*h, RequestKind::kPushPull);
  Status st = req.ok() ? (*req)->wait(5s) : req.status();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.code(), StatusCode::kTimeout) << "the failure must be reported, not waited out";
  EXPECT_NE(st.message().find("worker 2"), std::string::npos) << st.to_string();
  Status job = c.coordinator->wait(5s);
  EXPECT_EQ(job.code(), StatusCode::kAborted) << job.to_string();
}

TEST(RuntimeLoopback, UnreachableCoordinatorIsAClearErrorAtStart) {
  Cluster c(1, 1, [](RuntimeOptions& o) { o.connect_timeout = 300ms; });
  c.base.coordinator_address = "loopback:12345";
  auto w = WorkerService::start(c.base);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kUnavailable) << w.status().to_string();
  EXPECT_NE(w.status().message().find("coordinator"), std::string::npos);
}

TEST_P(Runtime, WrongSecretIsRefused) {
  Cluster c(
      1, 1, [](RuntimeOptions& o) { o.secret = "right"; }, GetParam());
  auto coord = CoordinatorService::start(c.base);
  ASSERT_TRUE(coord.ok());
  RuntimeOptions o = c.base;
  o.coordinator_address = (*coord)->address();
  o.secret = "wrong";
  auto w = WorkerService::start(o);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("secret"), std::string::npos) << w.status().to_string();
  (*coord)->shutdown();
}

std::vector<std::string> backends() {
  std::vector<std::string> out{"loopback"};
  for (const auto& t : transport::available_transports()) {
    if (t == "ucx") out.push_back("ucx");
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Transports, Runtime, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace psld
