// The runtime end to end in one process: a coordinator, servers and workers
// on a loopback fabric.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

#include "lib/coordinator/service.h"
#include "lib/server/service.h"
#include "lib/stats/load_history.h"
#include "lib/worker/service.h"
#include "tests/cluster.h"
#include "tests/eventually.h"
#include "transports/loopback/loopback.h"

namespace psld {
namespace {

using namespace std::chrono_literals;

class Runtime : public ::testing::TestWithParam<std::string> {};

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
  // Per worker, declared before the cluster: a pull may still land after a
  // request failed, until the cluster stops.
  std::vector<std::vector<std::vector<float>>> storage_of(4);
  Cluster c(4, 3, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  // Odd sizes: single element, less than a chunk, several chunks with a tail.
  const std::vector<size_t> elems = {1, 7, 1000, 16384, 50001};
  constexpr int kRounds = 30;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>>& storage = storage_of[wi];
    PSLD_ASSIGN_OR_RETURN(std::vector<uint32_t> handles, register_zeroed(w, elems, storage));
    std::vector<float*> data;
    for (auto& v : storage)
      data.push_back(v.data());
    const float rank = static_cast<float>(w.rank());
    // The sum over 4 workers of rank*1000 + r + i%13.
    return exact_push_pull_rounds(
        w, handles, data, elems, kRounds,
        [&](int r, size_t i) { return rank * 1000.0f + static_cast<float>(r + i % 13); },
        [&](int r, size_t i) { return 6000.0f + 4.0f * static_cast<float>(r + i % 13); });
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
  uint64_t rounds = 0;
  for (auto& srv : c.servers)
    rounds += srv->stats().rounds_applied;
  EXPECT_GT(rounds, 0u);
}

// Optimizer mode with plain SGD at `lr`.
void sgd_at(RuntimeOptions& o, float lr) {
  o.mode = ServerMode::kOptimizer;
  o.optimizer.kind = OptimizerKind::kSgd;
  o.optimizer.lr = lr;
}

// Registers `x` as "w" with worker 0's initial value i at element i (kept in
// `init`), then waits for every worker's registration.
Result<uint32_t> register_ramp(WorkerService& w, std::vector<float>& x, std::vector<float>& init) {
  init.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    init[i] = static_cast<float>(i);
  PSLD_ASSIGN_OR_RETURN(
      uint32_t h, w.register_tensor("w", DType::kFloat32, x.size() * 4, x.data(), init.data()));
  PSLD_RETURN_IF_ERROR(w.barrier(5s));
  return h;
}

TEST_P(Runtime, OptimizerModeAppliesSgdFromTheInitialValue) {
  Cluster c(
      2, 2,
      // A power of two: exact on integer-valued data.
      [](RuntimeOptions& o) { sgd_at(o, 0.5f); }, GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 20000;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> x(kN, 0.0f), init;
    PSLD_ASSIGN_OR_RETURN(uint32_t h, register_ramp(w, x, init));
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

// Worker::set_learning_rate: each update uses the rate its round's pushes
// carry; where workers disagree the lowest rank's wins; 0 is the config's.
TEST_P(Runtime, OptimizerModeUsesTheLearningRateThePushesCarry) {
  Cluster c(
      2, 2, [](RuntimeOptions& o) { sgd_at(o, 0.5f); }, GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 5000;
  // Per round: worker 0's rate, worker 1's, and the total step with a
  // gradient of 2 from each (sum 4). Powers of two: exact.
  struct Step {
    double lr0, lr1;
    float drop;
  };
  const std::vector<Step> steps = {{0.5, 0.5, 2.0f},
                                   {0.25, 0.25, 1.0f},
                                   {0.125, 1.0, 0.5f},  // worker 0's rate wins
                                   {0, 0, 2.0f}};       // back to optimizer.lr
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> x(kN, 0.0f), init;
    PSLD_ASSIGN_OR_RETURN(uint32_t h, register_ramp(w, x, init));
    float dropped = 0;
    for (const Step& step : steps) {
      w.set_learning_rate(w.rank() == 0 ? step.lr0 : step.lr1);
      std::fill(x.begin(), x.end(), 2.0f);
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPushPull));
      PSLD_RETURN_IF_ERROR(req->wait(5s));
      dropped += step.drop;
      for (size_t i = 0; i < kN; ++i) {
        if (x[i] != static_cast<float>(i) - dropped) {
          return Internal("x[" + std::to_string(i) + "] = " + std::to_string(x[i]) +
                          " after the step with rates " + std::to_string(step.lr0) + " and " +
                          std::to_string(step.lr1));
        }
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// Worker::allocate: tensors carved from one block at odd offsets, with guard
// elements between them that no pull may touch.
TEST_P(Runtime, TensorsCarvedFromAllocatedMemoryGetExactSumsAndLeaveTheirNeighboursAlone) {
  Cluster c(2, 2, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  const std::vector<size_t> elems = {1, 7, 1000, 50001};
  constexpr size_t kGap = 3;  // guard elements before each tensor and after the last
  constexpr float kGuard = -7.5f;
  size_t total = kGap;
  for (size_t n : elems)
    total += n + kGap;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    PSLD_ASSIGN_OR_RETURN(void* block, w.allocate(total * 4));
    auto* base = static_cast<float*>(block);
    for (size_t i = 0; i < total; ++i) {
      if (base[i] != 0.0f) return Internal("allocate() did not zero the block");
      base[i] = kGuard;
    }
    std::vector<float*> data;
    std::vector<uint32_t> handles;
    size_t at = kGap;
    for (size_t t = 0; t < elems.size(); ++t) {
      data.push_back(base + at);
      PSLD_ASSIGN_OR_RETURN(uint32_t h, w.register_tensor("t" + std::to_string(t), DType::kFloat32,
                                                          elems[t] * 4, data.back(), nullptr));
      handles.push_back(h);
      at += elems[t] + kGap;
    }
    const float rank = static_cast<float>(w.rank());
    for (int r = 1; r <= 10; ++r) {
      PSLD_RETURN_IF_ERROR(exact_push_pull_rounds(
          w, handles, data, elems, 1,
          [&](int, size_t i) { return rank * 100.0f + static_cast<float>(r + i % 11); },
          [&](int, size_t i) { return 100.0f + 2.0f * static_cast<float>(r + i % 11); }));
      size_t g = 0;
      for (size_t t = 0; t <= elems.size(); ++t) {
        for (size_t i = 0; i < kGap; ++i) {
          if (base[g + i] != kGuard) {
            return Internal("a guard element before tensor " + std::to_string(t) + " changed");
          }
        }
        if (t < elems.size()) g += kGap + elems[t];
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
  // The loopback fabric maps allocated memory, as shared memory would be:
  // every push_pull was read in place there. UCX over tcp maps nothing.
  uint64_t in_place = 0, pushes = 0;
  for (auto& srv : c.servers) {
    in_place += srv->stats().pushes_in_place;
    pushes += srv->stats().pushes;
  }
  if (GetParam() == "loopback") {
    // 2 workers x 10 rounds x 7 chunks (one each, and four for 50001 elements).
    EXPECT_EQ(in_place, 140u) << "pushes " << pushes;
  } else {
    EXPECT_EQ(in_place, 0u);
  }
  auto zero = c.workers[0]->allocate(0);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
}

TEST_P(Runtime, Fp16TensorsAreReducedInFp32) {
  Cluster c(2, 1, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<uint16_t> x(300);
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("h", DType::kFloat16, 600, x.data(), nullptr));
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
  ASSERT_TRUE(
      c.workers[0]->register_tensor("fc1.weight", DType::kFloat32, 40, a.data(), nullptr).ok());
  auto r = c.workers[1]->register_tensor("fc1.weight", DType::kFloat32, 80, b.data(), nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fc1.weight"), std::string::npos) << r.status().to_string();
  // And locally, twice with a different shape.
  auto again = c.workers[0]->register_tensor("fc1.weight", DType::kFloat32, 80, b.data(), nullptr);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
}

TEST_P(Runtime, TheCoordinatorHearsEveryPushedByteInTheLoadReports) {
  // Windows of 200 ms: the history's 64 windows hold the whole test, so the
  // reported bytes must add up exactly.
  Cluster c(
      2, 2, [](RuntimeOptions& o) { o.stats_interval = std::chrono::milliseconds(200); },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 100000;  // several chunks on both servers
  constexpr int kRounds = 10;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> x(kN, 1.0f);
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("g", DType::kFloat32, kN * 4, x.data(), nullptr));
    for (int r = 0; r < kRounds; ++r) {
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPushPull));
      PSLD_RETURN_IF_ERROR(req->wait(10s));
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  std::map<uint32_t, uint64_t> pushed;  // by server, as the workers counted
  for (auto& w : c.workers) {
    for (const auto& l : w->server_loads())
      pushed[l.server] += l.bytes_pushed;
  }
  ASSERT_EQ(pushed.size(), 2u);
  // The last windows arrive within an interval or two.
  const uint64_t chunks_per_round = (kN * 4 + c.base.chunk_bytes - 1) / c.base.chunk_bytes;
  const uint64_t want_answers = 2 * kRounds * chunks_per_round;
  std::map<uint32_t, uint64_t> reported_in, reported_arcs;
  uint64_t answers = 0;
  const auto all_reported = [&] {
    const LoadHistory h = c.coordinator->load_history();
    reported_in.clear();
    reported_arcs.clear();
    answers = 0;
    for (const auto& [server, bytes] : pushed) {
      if (const auto* ring = h.server(server)) {
        for (const auto& win : *ring)
          reported_in[server] += win.bytes_in;
      }
      if (const auto* views = h.seen_by_workers(server)) {
        for (const auto& v : *views)
          answers += v.peer.answers;
      }
    }
    for (const ArcLoadRecord& a : h.arcs())
      reported_arcs[a.server] += a.total_in;
    return reported_in == pushed && answers == want_answers;
  };
  EXPECT_TRUE(eventually("the last windows", 5s, all_reported, 50ms));
  EXPECT_EQ(reported_in, pushed);
  // Every chunk of every push_pull was answered, and every worker said so.
  EXPECT_EQ(answers, want_answers);
  const LoadHistory h = c.coordinator->load_history();
  for (const auto& [server, bytes] : pushed) {
    const auto* ring = h.server(server);
    ASSERT_NE(ring, nullptr);
    uint64_t busy = 0, rounds = 0;
    for (const auto& win : *ring) {
      busy += win.busy_ns;
      rounds += win.rounds;
      EXPECT_EQ(win.epoch, 0u);
      EXPECT_EQ(win.lost_samples, 0u);
    }
    EXPECT_GT(busy, 0u) << "server " << server << " served pushes, so it was occupied";
    EXPECT_GT(rounds, 0u);
  }
  // Per-arc bytes add up to the servers' totals (arc windows hold the last 8
  // windows of each arc, which covers this short test).
  EXPECT_EQ(reported_arcs, pushed);
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
                          w.register_tensor("acc", DType::kFloat32, kN * 4, x.data(), nullptr));
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

// Async and bounded staleness with batches: 30 small tensors pushed
// together 20 times by 3 workers (plain pushes, then push_pulls), and
// pulled together: every push counted once.
TEST_P(Runtime, BatchedPushesAreEachCountedOnceInAsyncAndStalenessModes) {
  for (const SyncMode mode : {SyncMode::kAsync, SyncMode::kStaleness}) {
    SCOPED_TRACE(mode == SyncMode::kAsync ? "async" : "staleness");
    constexpr size_t kTensors = 30, kN = 100;
    constexpr int kPushes = 20;
    std::vector<std::vector<std::vector<float>>> storage_of(3);
    uint64_t batches = 0;
    {
      Cluster c(
          3, 2,
          [&](RuntimeOptions& o) {
            o.sync = mode;
            o.staleness = 2;
          },
          GetParam());
      ASSERT_TRUE(c.start().ok());
      Status s = on_all(c, [&](size_t wi) -> Status {
        WorkerService& w = *c.workers[wi];
        PSLD_ASSIGN_OR_RETURN(
            auto handles, register_zeroed(w, std::vector<size_t>(kTensors, kN), storage_of[wi]));
        for (int r = 0; r < kPushes; ++r) {
          for (auto& v : storage_of[wi])
            std::fill(v.begin(), v.end(), 1.0f);
          const RequestKind kind = r % 2 == 0 ? RequestKind::kPush : RequestKind::kPushPull;
          PSLD_ASSIGN_OR_RETURN(auto reqs, w.submit_many(handles, kind));
          for (auto& req : reqs)
            PSLD_RETURN_IF_ERROR(req->wait(5s));
        }
        PSLD_RETURN_IF_ERROR(w.barrier(5s));
        if (wi != 0) return Status::Ok();
        // Once every push reached its server: 3 workers x 20 pushes of 1.
        const auto deadline = std::chrono::steady_clock::now() + 5s;
        while (std::chrono::steady_clock::now() < deadline) {
          PSLD_ASSIGN_OR_RETURN(auto reqs, w.submit_many(handles, RequestKind::kPull));
          for (auto& req : reqs)
            PSLD_RETURN_IF_ERROR(req->wait(5s));
          bool all = true;
          for (const auto& v : storage_of[wi]) {
            for (float x : v) {
              if (x > 60.0f) return Internal("more than the pushed total: " + std::to_string(x));
              all = all && x == 60.0f;
            }
          }
          if (all) return Status::Ok();
          std::this_thread::sleep_for(10ms);
        }
        return Internal("the total never reached 60");
      });
      EXPECT_TRUE(s.ok()) << s.to_string();
      for (auto& srv : c.servers)
        batches += srv->stats().batches;
    }
    EXPECT_GT(batches, 0u);
  }
}

TEST_P(Runtime, AWorkerThatDiesFailsTheJobForEveryone) {
  // Tensor memory must outlive the workers that registered it (the contract
  // of register_tensor): declared before the cluster, destroyed after it.
  std::vector<float> x(100, 1.0f);
  Cluster c(
      3, 1, [](RuntimeOptions& o) { o.heartbeat_timeout = 1s; }, GetParam());
  ASSERT_TRUE(c.start().ok());
  auto h = c.workers[1]->register_tensor("x", DType::kFloat32, 400, x.data(), nullptr);
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

// An idle job's members send the coordinator a heartbeat per interval and a
// load report per stats interval, nothing more. Each message from the
// coordinator (the echo of a heartbeat among them) wakes the member's
// session; a heartbeat loop that sent on every wake played ping-pong with the
// coordinator as fast as the two could go, thousands of messages a second,
// and took the worker's lock each time.
TEST_P(Runtime, HeartbeatsKeepTheirIntervalWhateverTheCoordinatorSends) {
  Cluster c(2, 1, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  const uint64_t members = 3;
  const auto window = 1s;
  const uint64_t before = c.coordinator->messages_received();
  std::this_thread::sleep_for(window);
  const uint64_t got = c.coordinator->messages_received() - before;
  const uint64_t heartbeats = members * (window / c.base.heartbeat_interval + 2);
  const uint64_t reports = members * (window / c.base.stats_interval + 2);
  // Twice that for whatever else a member says (a report in parts, progress);
  // the ping-pong was over 20 times it.
  EXPECT_LE(got, 2 * (heartbeats + reports))
      << "heartbeat interval " << c.base.heartbeat_interval.count() << " ms, stats interval "
      << c.base.stats_interval.count() << " ms";
  EXPECT_GE(got, members * (window / c.base.heartbeat_interval) / 2) << "heartbeats stopped";
}

// Bounded staleness, s = 2: pushes are applied on arrival and a pull of round
// r waits until every worker's pushes up to round r - s are in. Each worker
// pushes a one-hot vector (1 at its own rank) every round, so after a pull
// element k is how many of worker k's pushes the server applied: never less
// than r - s, never more than worker k has pushed. Worker 2 is slow, so
// worker 0 must be held back by the bound.
TEST_P(Runtime, StalenessBoundsHowFarAheadAFastWorkerRuns) {
  constexpr uint32_t kWorkers = 3;
  constexpr uint64_t kStaleness = 2;
  constexpr uint64_t kRounds = 30;
  constexpr uint32_t kFast = 0, kSlow = 2;
  const std::array<std::chrono::milliseconds, kWorkers> delay = {0ms, 3ms, 20ms};
  Cluster c(
      kWorkers, 2,
      [](RuntimeOptions& o) {
        o.sync = SyncMode::kStaleness;
        o.staleness = kStaleness;
      },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  std::array<std::atomic<uint64_t>, kWorkers> pushed{};  // pushes submitted, per worker rank
  // The fast worker's largest r - (slow worker's count); negative while the
  // slow worker is ahead (the fast one can start late).
  int64_t fast_max_lead = -1000;
  uint64_t fast_at_bound = 0;  // rounds where it saw the slow worker exactly s behind
  std::array<std::vector<float>, kWorkers> memory;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    const uint32_t me = w.rank();
    std::vector<float>& x = memory[me];
    x.assign(kWorkers, 0.0f);
    PSLD_ASSIGN_OR_RETURN(
        uint32_t h, w.register_tensor("counts", DType::kFloat32, kWorkers * 4, x.data(), nullptr));
    for (uint64_t r = 1; r <= kRounds; ++r) {
      std::this_thread::sleep_for(delay[me]);
      std::fill(x.begin(), x.end(), 0.0f);
      x[me] = 1.0f;
      pushed[me].fetch_add(1);  // before the push can be applied anywhere
      PSLD_ASSIGN_OR_RETURN(auto push, w.submit(h, RequestKind::kPush));
      PSLD_RETURN_IF_ERROR(push->wait(10s));
      PSLD_ASSIGN_OR_RETURN(auto pull, w.submit(h, RequestKind::kPull));
      PSLD_RETURN_IF_ERROR(pull->wait(10s));
      for (uint32_t k = 0; k < kWorkers; ++k) {
        const uint64_t most = pushed[k].load();  // read after the pull landed
        const float count = x[k];
        const uint64_t least = r > kStaleness ? r - kStaleness : 0;
        if (count != std::floor(count) || count < static_cast<float>(least) ||
            count > static_cast<float>(most)) {
          return Internal("worker " + std::to_string(me) + " round " + std::to_string(r) +
                          ": worker " + std::to_string(k) + "'s count is " + std::to_string(count) +
                          ", not in [" + std::to_string(least) + ", " + std::to_string(most) +
                          "] (staleness " + std::to_string(kStaleness) + ")");
        }
      }
      if (me == kFast) {
        const int64_t lead = static_cast<int64_t>(r) - static_cast<int64_t>(x[kSlow]);
        fast_max_lead = std::max(fast_max_lead, lead);
        if (lead == static_cast<int64_t>(kStaleness)) ++fast_at_bound;
      }
    }
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    // Every push reached its server: the counts add up to every push made.
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (true) {
      PSLD_ASSIGN_OR_RETURN(auto pull, w.submit(h, RequestKind::kPull));
      PSLD_RETURN_IF_ERROR(pull->wait(10s));
      if (std::all_of(x.begin(), x.end(),
                      [&](float v) { return v == static_cast<float>(kRounds); }))
        break;
      if (std::chrono::steady_clock::now() > deadline) {
        std::string counts;
        for (float v : x)
          counts += std::to_string(v) + " ";
        return Internal("worker " + std::to_string(me) + ": the final counts are " + counts +
                        "not " + std::to_string(kRounds) + " each");
      }
      std::this_thread::sleep_for(5ms);
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  // Otherwise the bound was never what held the fast worker back and the
  // checks above prove nothing.
  EXPECT_EQ(fast_max_lead, static_cast<int64_t>(kStaleness));
  EXPECT_GT(fast_at_bound, 0u);
}

// Speaks the worker side of the protocol to one server by hand, to send what
// a WorkerService never does: requests for keys the server does not own.
class RawWorker final : public ProcessRuntime {
 public:
  // listen: also accepts connections (a stand-in for a coordinator). The
  // job's secret gets it past the transport's own door (the ucx bootstrap),
  // so that what it says is the protocol's to judge.
  static Result<std::unique_ptr<RawWorker>> start(const RuntimeOptions& job, bool listen = false) {
    std::unique_ptr<RawWorker> r(new RawWorker);
    NetOptions ep = job.net;
    if (!listen) ep.options.common.listen_address.clear();
    PSLD_RETURN_IF_ERROR(r->ProcessRuntime::start(ep, job.secret));
    return r;
  }
  Result<transport::ConnectionPtr> next_accepted(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !accepted_.empty(); })) {
      return Timeout("nobody connected");
    }
    auto conn = accepted_.front();
    accepted_.erase(accepted_.begin());
    return conn;
  }
  ~RawWorker() override { stop(); }

  // Removes and returns the first message of type T that `match` accepts.
  template <typename T>
  Result<T> next(const std::function<bool(const T&)>& match, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<T> found;
    cv_.wait_for(lock, timeout, [&] {
      for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
        const T* m = std::get_if<T>(&*it);
        if (m != nullptr && match(*m)) {
          found = *m;
          inbox_.erase(it);
          return true;
        }
      }
      return false;
    });
    if (!found) return Timeout("no matching message; inbox holds " + describe_inbox());
    return *found;
  }
  bool wait_write(uint32_t tag, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return writes_.count(tag) > 0; });
  }
  bool wrote(uint32_t tag) {
    std::lock_guard<std::mutex> lock(mu_);
    return writes_.count(tag) > 0;
  }
  // Why the transport closed `conn`; nothing while it is still open.
  std::optional<Status> closed_why(const transport::ConnectionPtr& conn,
                                   std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return closed_.count(conn->id()) > 0; })) {
      return std::nullopt;
    }
    return closed_[conn->id()];
  }

 private:
  RawWorker() = default;
  void on_accept(const transport::ConnectionPtr& conn) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      accepted_.push_back(conn);
    }
    cv_.notify_all();
  }
  void on_control(const transport::ConnectionPtr&, protocol::Message&& message) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_.push_back(std::move(message));
    }
    cv_.notify_all();
  }
  void on_write(const transport::ConnectionPtr&, uint32_t notify, uint64_t length) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writes_[notify] = length;
    }
    cv_.notify_all();
  }
  void on_disconnect(const transport::ConnectionPtr& conn, const Status& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_[conn->id()] = why;
    }
    cv_.notify_all();
  }
  std::string describe_inbox() const {  // mu_ held
    std::string out;
    for (const auto& m : inbox_)
      out += std::string(protocol::message_name(m)) + " ";
    return out.empty() ? "nothing" : out;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<protocol::Message> inbox_;
  std::map<uint32_t, uint64_t> writes_;  // notify tag -> length
  std::vector<transport::ConnectionPtr> accepted_;
  std::map<uint64_t, Status> closed_;  // connection id -> why
};

// docs/runtime.md: "A request for a key the server does not own is answered
// Moved ... none of them takes the server down."
TEST_P(Runtime, ARequestForAKeyTheServerDoesNotOwnIsAnsweredMoved) {
  Cluster c(1, 2, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  ServerService& server = *c.servers[0];
  const std::optional<Placement> placement = c.coordinator->placement();
  ASSERT_TRUE(placement.has_value());
  // A tensor id no worker registered; chunk `owned` is this server's, chunk
  // `other` the other server's.
  constexpr TensorId kTensor = 1000;
  std::optional<uint32_t> owned, other;
  for (uint32_t chunk = 0; chunk < 1000 && !(owned && other); ++chunk) {
    auto& slot = placement->owner_of_key(make_key(kTensor, chunk)) == server.rank() ? owned : other;
    if (!slot) slot = chunk;
  }
  ASSERT_TRUE(owned && other);
  const Key mine = make_key(kTensor, *owned), theirs = make_key(kTensor, *other);
  const uint64_t chunk_bytes = c.base.chunk_bytes;
  constexpr uint64_t kElems = 64;  // of each chunk, at its start

  // Declared before the raw worker: its transport reads and writes them.
  std::vector<float> tensor((std::max(*owned, *other) + 1) * chunk_bytes / 4, -1.0f);
  std::vector<float> source(tensor.size());
  for (size_t i = 0; i < source.size(); ++i)
    source[i] = static_cast<float>(i % 1000);
  auto raw_or = RawWorker::start(c.base);
  ASSERT_TRUE(raw_or.ok()) << raw_or.status().to_string();
  RawWorker& raw = **raw_or;
  auto conn_or = connect_text(raw.transport(), server.address());
  ASSERT_TRUE(conn_or.ok()) << conn_or.status().to_string();
  transport::ConnectionPtr conn = *conn_or;

  // Join as worker 0 and learn where pulls of the tensor land.
  protocol::PeerDial dial(Role::kWorker, 0);
  ASSERT_TRUE(raw.send(conn, dial.hello).ok());
  auto challenge = raw.next<protocol::Challenge>([](const auto&) { return true; }, 5s);
  ASSERT_TRUE(challenge.ok()) << challenge.status().to_string();
  ASSERT_TRUE(raw.send(conn, *dial.answer(c.base.secret, *challenge)).ok());
  auto grant = raw.next<protocol::Grant>([](const auto&) { return true; }, 5s);
  ASSERT_TRUE(grant.ok()) << grant.status().to_string();
  ASSERT_GE(grant->num_slots, 3u);
  auto slots = conn->import_region(grant->slots_key);
  ASSERT_TRUE(slots.ok()) << slots.status().to_string();
  auto tensor_region =
      raw.transport().register_memory(tensor.data(), tensor.size() * 4, MemoryKind::kHost);
  auto source_region =
      raw.transport().register_memory(source.data(), source.size() * 4, MemoryKind::kHost);
  ASSERT_TRUE(tensor_region.ok() && source_region.ok());
  const auto& rkey = (*tensor_region)->remote_key();
  ASSERT_TRUE(raw.send(conn, protocol::TensorKey{7, kTensor,
                                                 std::vector<uint8_t>(rkey.begin(), rkey.end())})
                  .ok());
  ASSERT_TRUE(raw.next<protocol::Ack>([](const auto& a) { return a.request == 7; }, 5s).ok());

  // A push into landing slot `slot`: the metadata, then the write.
  auto push = [&](Key key, uint32_t slot, uint32_t tag, uint8_t flags, uint32_t pull_tag) {
    protocol::PushMeta meta{tag,   slot,    DType::kFloat32, key, 1, kElems * 4, placement->epoch(),
                            flags, pull_tag};
    Status st = raw.send(conn, meta);
    if (!st.ok()) return st;
    const uint64_t offset = static_cast<uint64_t>(key_chunk(key)) * chunk_bytes;
    return conn->write(
        {source_region->get(), offset, slots->get(), slot * grant->slot_bytes, kElems * 4, tag},
        nullptr);
  };
  auto expect_moved = [&](uint32_t tag) {
    auto moved = raw.next<protocol::Moved>([&](const auto& m) { return m.tag == tag; }, 5s);
    ASSERT_TRUE(moved.ok()) << "tag " << tag << ": " << moved.status().to_string();
    EXPECT_EQ(moved->key, theirs);
    EXPECT_EQ(moved->epoch, placement->epoch());
  };
  // The slot of a refused push comes back as a credit.
  auto expect_credit = [&](uint32_t slot) {
    auto credit = raw.next<protocol::Credit>(
        [&](const auto& cr) {
          return std::find(cr.slots.begin(), cr.slots.end(), slot) != cr.slots.end();
        },
        5s);
    EXPECT_TRUE(credit.ok()) << "slot " << slot << ": " << credit.status().to_string();
  };

  ASSERT_TRUE(push(theirs, 0, 11, 0, 0).ok());
  expect_moved(11);
  expect_credit(0);
  ASSERT_TRUE(push(theirs, 1, 12, protocol::kPushThenPull, 13).ok());  // a push_pull
  expect_moved(12);
  expect_credit(1);
  ASSERT_TRUE(raw.send(conn, protocol::PullRequest{14, DType::kFloat32, kElems * 4, theirs, 1,
                                                   placement->epoch()})
                  .ok());
  expect_moved(14);
  EXPECT_EQ(server.stats().rejected, 3u);
  EXPECT_EQ(server.stats().pushes, 0u);
  EXPECT_EQ(server.stats().pulls, 0u);

  // The server is still up and serves a request for its own key: a push_pull
  // of round 1 (one worker: the round is its push) writes the sum back.
  ASSERT_TRUE(push(mine, 2, 21, protocol::kPushThenPull, 22).ok());
  ASSERT_TRUE(raw.wait_write(22, 5s)) << "the push_pull of an owned key was not answered";
  const size_t at = static_cast<size_t>(*owned) * chunk_bytes / 4;
  for (size_t i = at; i < at + kElems; ++i)
    ASSERT_EQ(tensor[i], source[i]) << "element " << i;
  EXPECT_EQ(tensor[at + kElems], -1.0f) << "the pull wrote past its chunk";
  expect_credit(2);
  // Nothing was ever written for the refused requests.
  EXPECT_FALSE(raw.wrote(13));
  EXPECT_FALSE(raw.wrote(14));
  EXPECT_EQ(server.stats().rejected, 3u);
  EXPECT_EQ(server.stats().pushes, 1u);
  EXPECT_EQ(server.malformed_messages(), 0u);

  // A batch in slot 3, partly Moved: the other server's key is answered
  // Moved, this server's is taken (round 2) and answered, and the slot comes
  // back once both let go of it. The write carries both chunks back to back:
  // source elements 0.. for `theirs`, kElems.. for `mine`.
  {
    protocol::PushBatch batch{41, 3, placement->epoch(), {}};
    batch.entries.push_back(
        {42, 43, DType::kFloat32, protocol::kPushThenPull, theirs, 2, kElems * 4, 0, 0});
    batch.entries.push_back(
        {44, 45, DType::kFloat32, protocol::kPushThenPull, mine, 2, kElems * 4, kElems * 4, 0});
    ASSERT_TRUE(raw.send(conn, batch).ok());
    ASSERT_TRUE(conn->write({source_region->get(), 0, slots->get(), 3 * grant->slot_bytes,
                             2 * kElems * 4, 41},
                            nullptr)
                    .ok());
    expect_moved(42);
    ASSERT_TRUE(raw.wait_write(45, 5s)) << "the batch's owned entry was not answered";
    for (size_t i = 0; i < kElems; ++i)
      ASSERT_EQ(tensor[at + i], source[kElems + i]) << "element " << i;
    expect_credit(3);
    EXPECT_FALSE(raw.wrote(43));
    EXPECT_EQ(server.stats().rejected, 4u);
    EXPECT_EQ(server.stats().pushes, 2u);
    EXPECT_EQ(server.stats().batches, 1u);
  }
  // A batch whose entry reaches past its slot is refused, every entry with
  // an error, and nothing is taken.
  {
    protocol::PushBatch bad{51, 3, placement->epoch(), {}};  // slot 3 came back
    bad.entries.push_back(
        {52, 53, DType::kFloat32, protocol::kPushThenPull, mine, 3, kElems * 4, 0, 0});
    bad.entries.push_back({54, 55, DType::kFloat32, protocol::kPushThenPull, mine, 3, kElems * 4,
                           static_cast<uint32_t>(grant->slot_bytes - 4), 0});
    ASSERT_TRUE(raw.send(conn, bad).ok());
    for (uint32_t tag : {52u, 54u}) {
      auto e = raw.next<protocol::Error>([&](const auto& m) { return m.tag == tag; }, 5s);
      ASSERT_TRUE(e.ok()) << "tag " << tag << ": " << e.status().to_string();
      EXPECT_NE(e->message.find("batch of 2 pushes into slot 3 is not valid"), std::string::npos)
          << e->message;
    }
    EXPECT_EQ(server.stats().pushes, 2u);
    EXPECT_EQ(server.stats().rejected, 6u);
  }

  // And the real worker's traffic, to both servers, is exact.
  WorkerService& w = *c.workers[0];
  constexpr size_t kN = 300001;  // 19 chunks of 64 KiB, a short tail
  std::vector<float> x(kN);
  auto h = w.register_tensor("after", DType::kFloat32, kN * 4, x.data(), nullptr);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  for (size_t i = 0; i < kN; ++i)
    x[i] = static_cast<float>(i % 4099);
  auto req = w.submit(*h, RequestKind::kPushPull);
  ASSERT_TRUE(req.ok());
  ASSERT_TRUE((*req)->wait(10s).ok());
  for (size_t i = 0; i < kN; ++i)
    ASSERT_EQ(x[i], static_cast<float>(i % 4099)) << "element " << i;
  EXPECT_GT(server.stats().pushes, 2u);
  EXPECT_EQ(server.stats().rejected, 6u);
}

// UCX over shared memory: servers map the workers' Worker::allocate memory
// and read push_pulls in place; pulls into it are memcpys. Heap tensors in
// the same job still go through slots.
// ThreadSanitizer, as gcc says it (__SANITIZE_THREAD__) and as clang does
// (__has_feature; clang 14 defines no macro), for build-tsan is clang.
#if defined(__SANITIZE_THREAD__)
#define PSLD_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PSLD_UNDER_TSAN 1
#endif
#endif
#ifndef PSLD_UNDER_TSAN
#define PSLD_UNDER_TSAN 0
#endif

// Many small tensors of several sizes, submitted together each round: the
// pushes to each server leave in batches (one message, and one write into
// one slot), and every round's sums are exact; with data.batch_chunk_bytes
// = 0 the same job sends no batch.
void small_tensors_in_batches(const std::string& backend, uint64_t batch_chunk_bytes,
                              uint32_t answer_slots = 4) {
  std::vector<std::vector<std::vector<float>>> storage_of(3);
  Cluster c(
      3, 2,
      [&](RuntimeOptions& o) {
        o.batch_chunk_bytes = batch_chunk_bytes;
        o.batch_bytes = 16384;  // several batches a round, some cut by the size limit
        o.chunk_bytes = 65536;
        o.answer_slots = answer_slots;
      },
      backend);
  ASSERT_TRUE(c.start().ok());
  // 1 element, odd sizes, a chunk at the threshold, two above it, and a
  // tensor of several chunks whose tail is small.
  std::vector<size_t> elems;
  for (size_t i = 0; i < 60; ++i)
    elems.push_back(std::vector<size_t>{1, 7, 100, 1000, 1024, 4096, 5000, 70000}[i % 8]);
  constexpr int kRounds = 15;
  Status s = exact_rounds_together_on_all(
      c, storage_of, elems, kRounds,
      [](float rank, int r, size_t i) { return rank * 100.0f + static_cast<float>(r + i % 11); },
      [](int r, size_t i) { return 300.0f + 3.0f * static_cast<float>(r + i % 11); });
  EXPECT_TRUE(s.ok()) << s.to_string();
  uint64_t batches = 0, batched = 0, pushes = 0, answer_batches = 0, answered = 0, alone = 0;
  for (auto& srv : c.servers) {
    alone += srv->stats().answers_alone;
    batches += srv->stats().batches;
    batched += srv->stats().batched_pushes;
    pushes += srv->stats().pushes;
    answer_batches += srv->stats().answer_batches;
    answered += srv->stats().batched_answers;
  }
  if (batch_chunk_bytes == 0) {
    EXPECT_EQ(batches, 0u);
    EXPECT_EQ(answer_batches, 0u);
    return;
  }
  // The answers to small pulls came back in batches too, several in each
  // (how many share one depends on how many rounds complete in one pass of
  // a server's loop).
  EXPECT_GT(answer_batches, 0u);
  EXPECT_GT(answered, answer_batches);
  EXPECT_LE(answered + alone, 3u * kRounds * 46u);
  // With one answer slot a server often finds it still taken (6 runs here:
  // 121 to 226 of about 1,750 answers went one by one).
  if (answer_slots == 1) {
    EXPECT_GT(alone, 0u);
  }
  // 46 of each worker's 88 chunks a round are at most 16 KiB; 7 of them
  // fill a batch of 16 KiB alone. Nearly all of the other 39 travelled in
  // batches, several in each.
  const uint64_t small = 3u * kRounds * 39u;
  EXPECT_EQ(pushes, 3u * kRounds * 88u);
  EXPECT_GT(batched, small * 9 / 10) << batched << " of " << small;
  EXPECT_LE(batched, small);
  EXPECT_GT(batched, 2 * batches);
}

TEST_P(Runtime, SmallTensorsSubmittedTogetherTravelInBatchesWithExactSums) {
  small_tensors_in_batches(GetParam(), 16384);
}

// A model's shape: each small tensor between two large ones. A batch takes
// the small pushes from further down a server's backlog, past the large
// ones, so nearly all of them still travel in batches; sums exact.
TEST_P(Runtime, SmallTensorsBetweenLargeOnesStillTravelInBatches) {
  std::vector<std::vector<std::vector<float>>> storage_of(2);
  Cluster c(
      2, 2,
      [](RuntimeOptions& o) {
        o.batch_chunk_bytes = 16384;
        o.chunk_bytes = 65536;
      },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  std::vector<size_t> elems;
  for (size_t i = 0; i < 40; ++i)
    elems.push_back(i % 2 == 0 ? 16384 : 10 + i);  // a chunk of 64 KiB, then a small one
  constexpr int kRounds = 10;
  Status s = exact_rounds_together_on_all(
      c, storage_of, elems, kRounds,
      [](float rank, int r, size_t i) { return rank + static_cast<float>(r + i % 5); },
      [](int r, size_t i) { return 1.0f + 2.0f * static_cast<float>(r + i % 5); });
  EXPECT_TRUE(s.ok()) << s.to_string();
  uint64_t batched = 0;
  for (auto& srv : c.servers)
    batched += srv->stats().batched_pushes;
  // 20 small tensors a worker a round. Taken only from runs of neighbours
  // in a server's backlog, those between two large ones on the same server
  // would go alone.
  EXPECT_GT(batched, 2u * kRounds * 20u * 9 / 10);
  EXPECT_LE(batched, 2u * kRounds * 20u);
}

// One answer slot per server: servers often find it taken and write the
// gathered answers one by one from their batch buffer instead.
TEST_P(Runtime, AnswersWithoutAFreeSlotAreWrittenOneByOne) {
  small_tensors_in_batches(GetParam(), 16384, /*answer_slots=*/1);
}

TEST_P(Runtime, WithBatchesOffNothingIsBatched) {
  small_tensors_in_batches(GetParam(), 0);
}

TEST(RuntimeUcxShm, PushPullsOfAllocatedTensorsAreReadInPlaceAndExact) {
  std::map<bool, uint64_t> batches;  // by together
  for (const bool together : {false, true}) {
    SCOPED_TRACE(together ? "submitted together" : "one by one");
    const auto backends = test_backends();
    if (std::find(backends.begin(), backends.end(), "ucx") == backends.end()) {
      GTEST_SKIP() << "built without UCX";
    }
#if PSLD_UNDER_TSAN
    // UCX hands messages over shared memory through its own fifos, which are
    // not instrumented: ThreadSanitizer sees no order between a worker's
    // write and the answer that follows it and reports false races. The
    // plain and ASan builds run this test; over tcp (every other UCX test
    // here) the kernel's sockets give TSan the order.
    GTEST_SKIP() << "UCX's shared-memory fifos are invisible to ThreadSanitizer";
#endif
    Cluster c(
        2, 2,
        [](RuntimeOptions& o) {
          o.net.options.ucx.tls = "sm,tcp";
          o.batch_chunk_bytes = 65536;  // the 64 KiB chunks too
        },
        "ucx");
    ASSERT_TRUE(c.start().ok());
    const std::vector<size_t> elems = {3, 4099, 40000};  // 1 + 1 + 3 chunks of 64 KiB
    Status s = on_all(c, [&](size_t wi) -> Status {
      WorkerService& w = *c.workers[wi];
      std::vector<float*> data;
      PSLD_ASSIGN_OR_RETURN(std::vector<uint32_t> handles, register_allocated(w, elems, data));
      std::vector<float> heap(1000);
      PSLD_ASSIGN_OR_RETURN(uint32_t hh, w.register_tensor("heap", DType::kFloat32, heap.size() * 4,
                                                           heap.data(), nullptr));
      // The heap tensor rides along as a fourth tensor of the same rounds.
      std::vector<uint32_t> all = handles;
      all.push_back(hh);
      data.push_back(heap.data());
      std::vector<size_t> sizes = elems;
      sizes.push_back(heap.size());
      const float rank = static_cast<float>(w.rank());
      return exact_push_pull_rounds(
          w, all, data, sizes, 20,
          [&](int r, size_t i) { return rank + static_cast<float>(r + static_cast<int>(i % 9)); },
          [&](int r, size_t i) {
            return 1.0f + 2.0f * static_cast<float>(r + static_cast<int>(i % 9));
          },
          together);
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
    uint64_t in_place = 0;
    for (auto& srv : c.servers)
      in_place += srv->stats().pushes_in_place;
    // 2 workers x 20 rounds x 5 chunks; the heap tensor's 40 pushes took slots.
    EXPECT_EQ(in_place, 200u);
    uint64_t answered_in_place = 0;
    for (auto& srv : c.servers) {
      batches[together] += srv->stats().batches;
      answered_in_place += srv->stats().answers_in_place;
    }
    // Every pull into the mapped tensors was copied straight into the
    // worker's memory: 2 workers x 20 rounds x 5 chunks (the heap tensor's
    // 40 went as writes).
    EXPECT_EQ(answered_in_place, 200u);
  }
  // Together, the small in-place pushes to a server go in one message (one
  // by one, only a tensor's own chunks can share one).
  EXPECT_GT(batches[true], batches[false]);
  EXPECT_GE(batches[true], 40u);  // at least one a server a round
}

TEST(RuntimeLoopback, UnreachableCoordinatorIsAClearErrorAtStart) {
  Cluster c(1, 1, [](RuntimeOptions& o) { o.connect_timeout = 300ms; });
  c.base.coordinator_address = "loopback:12345";
  auto w = WorkerService::start(c.base);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kUnavailable) << w.status().to_string();
  EXPECT_NE(w.status().message().find("coordinator"), std::string::npos);
}

// Landing slots are granted as workers connect: a job too large for them is
// refused when the server starts, naming the settings, not worker by worker
// once it runs.
TEST(RuntimeLoopback, AServerRefusesLandingSlotsBeyondTheMachinesMemory) {
  RuntimeOptions o;
  o.num_workers = 10'000;
  o.slots_per_worker = 16;
  o.chunk_bytes = uint64_t{4} << 20;
  const Status st = check_landing_memory(o, uint64_t{24} << 30);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("10000 workers would take 625.0 GiB"), std::string::npos)
      << st.to_string();
  EXPECT_NE(st.message().find("lower data.chunk_bytes or data.slots_per_worker"),
            std::string::npos);
  EXPECT_TRUE(check_landing_memory(o, 0).ok());  // memory unknown: no check
  o.num_workers = 64;                            // 4 GiB
  EXPECT_TRUE(check_landing_memory(o, uint64_t{24} << 30).ok());
  // start() checks against this machine before it listens or joins.
  Cluster c(1, 1, [](RuntimeOptions& r) { r.connect_timeout = 300ms; });
  c.base.num_workers = 65'536;
  c.base.chunk_bytes = uint64_t{1} << 30;  // 1 PiB of slots
  auto s = ServerService::start(c.base);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status().to_string();
  EXPECT_NE(s.status().message().find("landing slots"), std::string::npos);
}

TEST_P(Runtime, WrongSecretIsRefused) {
  Cluster c(
      1, 1, [](RuntimeOptions& o) { o.secret = "right"; }, GetParam());
  auto coord = CoordinatorService::start(c.base);
  ASSERT_TRUE(coord.ok());
  RuntimeOptions o = c.base;
  o.coordinator_address = (*coord)->address();
  o.secret = "wrong";
  const auto started = std::chrono::steady_clock::now();
  auto w = WorkerService::start(o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition) << w.status().to_string();
  EXPECT_NE(w.status().message().find("wrong job secret"), std::string::npos)
      << w.status().to_string();
  // Refused, not retried until the connect timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - started, o.connect_timeout)
      << w.status().to_string();
  if (GetParam() == "ucx") {
    // By the transport's bootstrap, before any UCX endpoint existed.
    EXPECT_NE(w.status().message().find("refused the connection"), std::string::npos)
        << w.status().to_string();
  }
  (*coord)->shutdown();
}

// A job whose members do not all arrive: one that gives up after
// connect_timeout names the ranks the coordinator still waited for.
TEST_P(Runtime, AJobThatNeverStartsNamesWhoIsMissing) {
  Cluster c(
      3, 2, [](RuntimeOptions& o) { o.num_standby = 1; }, GetParam());
  auto coord = CoordinatorService::start(c.base);
  ASSERT_TRUE(coord.ok()) << coord.status().to_string();
  RuntimeOptions o = c.base;
  o.coordinator_address = (*coord)->address();
  // Server 0 waits longer than the worker, so that the worker gives up
  // first (a member leaving before the start fails the job for the rest).
  RuntimeOptions server_options = o;
  server_options.rank = 0;
  server_options.connect_timeout = 30s;
  auto server = std::async(std::launch::async,
                           [server_options] { return ServerService::start(server_options); });
  ASSERT_TRUE(
      eventually("server 0 at the coordinator", 10s, [&] { return (*coord)->num_members() >= 1; }));
  // And worker 1: workers 0 and 2 and servers 1 and 2 (the standby) never
  // come. The coordinator tells every member each change.
  o.rank = 1;
  o.connect_timeout = 5s;
  auto w = WorkerService::start(o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kTimeout) << w.status().to_string();
  EXPECT_NE(w.status().message().find("still waits for workers 0 and 2 and servers 1 and 2 (1 "
                                      "of 3 workers and 1 of 3 servers joined)"),
            std::string::npos)
      << w.status().to_string();
  (*coord)->shutdown();
  EXPECT_FALSE(server.get().ok());
}

// A one-worker job still works: a push_pull of 1000 floats comes back exact.
void expect_one_exact_push_pull(WorkerService& worker) {
  std::vector<std::vector<float>> data;
  auto handles = register_zeroed(worker, {1000}, data);
  ASSERT_TRUE(handles.ok()) << handles.status().to_string();
  for (size_t i = 0; i < 1000; ++i)
    data[0][i] = static_cast<float>(i);
  auto req = worker.submit((*handles)[0], RequestKind::kPushPull);
  ASSERT_TRUE(req.ok()) << req.status().to_string();
  ASSERT_TRUE((*req)->wait(10s).ok());
  for (size_t i = 0; i < 1000; ++i)
    ASSERT_EQ(data[0][i], static_cast<float>(i)) << i;
}

// The coordinator's door: connections that do not say a good Hello are
// capped (kMaxUnadmitted wait at once, more are refused at once) and closed
// at the hello deadline (the heartbeat timeout, 2 s here), and the job's own
// members are admitted regardless.
TEST_P(Runtime, UnadmittedConnectionsAreCappedAndClosedAtTheHelloDeadline) {
  Cluster c(1, 1, nullptr, GetParam());
  auto coord = CoordinatorService::start(c.base);
  ASSERT_TRUE(coord.ok()) << coord.status().to_string();
  c.coordinator = std::move(coord).value();
  c.base.coordinator_address = c.coordinator->address();
  auto raw = RawWorker::start(c.base);
  ASSERT_TRUE(raw.ok()) << raw.status().to_string();
  constexpr size_t kCap = CoordinatorService::kMaxUnadmitted;
  std::vector<transport::ConnectionPtr> conns;
  for (size_t i = 0; i < kCap + 6; ++i) {
    auto conn = connect_text((*raw)->transport(), c.coordinator->address());
    ASSERT_TRUE(conn.ok()) << conn.status().to_string();
    conns.push_back(*conn);
  }
  // One of them speaks, but not a Hello: that buys no time.
  ASSERT_TRUE((*raw)->send(conns[0], protocol::BarrierEnter{1}).ok());
  EXPECT_TRUE(eventually("the cap to refuse 6 connections", 10s,
                         [&] { return c.coordinator->num_refused() >= 6; }));
  EXPECT_LE(c.coordinator->num_unadmitted(), kCap);
  const auto flooded = std::chrono::steady_clock::now();
  EXPECT_TRUE(eventually("every unadmitted connection to be closed", 10s,
                         [&] { return c.coordinator->num_unadmitted() == 0; }));
  EXPECT_GE(std::chrono::steady_clock::now() - flooded, 1s);  // not before the deadline
  EXPECT_EQ(c.coordinator->num_refused(), kCap + 6);
  EXPECT_TRUE(eventually("the raw side to see its connections closed", 10s, [&] {
    return std::none_of(conns.begin(), conns.end(), [](const auto& k) { return k->is_open(); });
  }));
  // The job's members still get in, and the job works.
  ASSERT_TRUE(c.start_members().ok());
  expect_one_exact_push_pull(*c.workers[0]);
}

// docs/reliability.md, "Authentication": a server's data port takes nothing
// but the handshake from a peer that has not proven the job secret: a wrong
// proof, a replayed one, a rank the job does not have, and a data message
// first are each refused (told why, closed, counted), and the job's own
// worker is served regardless.
TEST_P(Runtime, AServerAdmitsOnlyPeersThatProveTheJobSecret) {
  Cluster c(
      1, 1, [](RuntimeOptions& o) { o.secret = "right"; }, GetParam());
  ASSERT_TRUE(c.start().ok());
  ServerService& server = *c.servers[0];
  auto raw_or = RawWorker::start(c.base);
  ASSERT_TRUE(raw_or.ok()) << raw_or.status().to_string();
  RawWorker& raw = **raw_or;
  auto dial = [&] {
    auto conn = connect_text(raw.transport(), server.address());
    EXPECT_TRUE(conn.ok()) << conn.status().to_string();
    return conn.ok() ? *conn : nullptr;
  };
  auto challenge_of = [&](const transport::ConnectionPtr& conn, const protocol::PeerHello& h) {
    EXPECT_TRUE(raw.send(conn, h).ok());
    auto ch = raw.next<protocol::Challenge>([](const auto&) { return true; }, 5s);
    EXPECT_TRUE(ch.ok()) << ch.status().to_string();
    return ch.ok() ? *ch : protocol::Challenge{};
  };
  auto expect_refused = [&](const transport::ConnectionPtr& conn, const std::string& why,
                            uint64_t count) {
    auto e = raw.next<protocol::Error>([](const auto&) { return true; }, 5s);
    ASSERT_TRUE(e.ok()) << why << ": " << e.status().to_string();
    EXPECT_NE(e->message.find(why), std::string::npos) << e->message;
    EXPECT_TRUE(eventually("the refused connection to close", 10s, [&] {
      return !conn->is_open();
    })) << why;
    EXPECT_EQ(server.num_refused(), count) << why;
  };

  // A wrong secret.
  auto a = dial();
  ASSERT_NE(a, nullptr);
  protocol::PeerDial wrong(Role::kWorker, 0);
  ASSERT_TRUE(raw.send(a, *wrong.answer("wrong", challenge_of(a, wrong.hello))).ok());
  expect_refused(a, "job secret", 1);

  // A good handshake, then its PeerProof replayed on a new connection with
  // the same hello: the server's nonce differs, so it fails.
  auto b = dial();
  ASSERT_NE(b, nullptr);
  protocol::PeerDial good(Role::kWorker, 0);
  auto proof = good.answer("right", challenge_of(b, good.hello));
  ASSERT_TRUE(raw.send(b, *proof).ok());
  auto grant = raw.next<protocol::Grant>([](const auto&) { return true; }, 5s);
  ASSERT_TRUE(grant.ok()) << grant.status().to_string();
  EXPECT_TRUE(good.proves("right", *grant)) << "the server proves the secret back";
  // A worker, even an authenticated one, cannot ask for a key's state.
  ASSERT_TRUE(
      raw.send(b, protocol::StateRequest{1, make_key(1, 0), 1, DType::kFloat32, 8, {1}}).ok());
  auto not_yours = raw.next<protocol::Error>([](const auto&) { return true; }, 5s);
  ASSERT_TRUE(not_yours.ok()) << not_yours.status().to_string();
  EXPECT_NE(not_yours->message.find("only servers send"), std::string::npos) << not_yours->message;
  auto replay = dial();
  ASSERT_NE(replay, nullptr);
  (void)challenge_of(replay, good.hello);
  ASSERT_TRUE(raw.send(replay, *proof).ok());
  expect_refused(replay, "job secret", 2);

  // A rank the job does not have, and data before the handshake.
  auto d = dial();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(raw.send(d, protocol::PeerHello{Role::kWorker, 7, protocol::make_nonce()}).ok());
  expect_refused(d, "does not have", 3);
  auto e = dial();
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(
      raw.send(e, protocol::StateRequest{1, make_key(1, 0), 1, DType::kFloat32, 8, {1}}).ok());
  expect_refused(e, "before the handshake", 4);
  EXPECT_TRUE(b->is_open()) << "the good connection stays";

  // The job's own worker is served.
  expect_one_exact_push_pull(*c.workers[0]);
}

// Over ucx the job's secret is the transport's too: a dial to a server's
// data port with another secret is refused by the server's bootstrap before
// any UCX endpoint exists, so the protocol's own door never sees it.
TEST(RuntimeUcx, TheServersBootstrapRefusesADialWithAnotherSecret) {
  const auto backends = test_backends();
  if (std::find(backends.begin(), backends.end(), "ucx") == backends.end()) {
    GTEST_SKIP() << "this build has no ucx backend";
  }
  Cluster c(
      1, 1, [](RuntimeOptions& o) { o.secret = "right"; }, "ucx");
  ASSERT_TRUE(c.start().ok());
  ServerService& server = *c.servers[0];
  RuntimeOptions intruder = c.base;
  intruder.secret = "wrong";
  auto raw = RawWorker::start(intruder);
  ASSERT_TRUE(raw.ok()) << raw.status().to_string();
  auto conn = connect_text((*raw)->transport(), server.address());
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  auto why = (*raw)->closed_why(*conn, 10s);
  ASSERT_TRUE(why) << "the intruder's connection is still open after 10 s";
  EXPECT_EQ(why->code(), StatusCode::kFailedPrecondition) << why->to_string();
  EXPECT_NE(why->message().find("wrong job secret"), std::string::npos) << why->to_string();
  EXPECT_EQ(server.num_refused(), 0u) << "the protocol's door saw the intruder";
  expect_one_exact_push_pull(*c.workers[0]);
}

// The data port's door, as the coordinator's: kMaxWaiting connections may
// wait for their handshake, more are refused at once, and the rest are
// closed one heartbeat timeout (2 s) after they connected.
TEST_P(Runtime, AServerCapsAndTimesOutConnectionsThatDoNotShakeHands) {
  Cluster c(1, 1, nullptr, GetParam());
  ASSERT_TRUE(c.start().ok());
  ServerService& server = *c.servers[0];
  auto raw = RawWorker::start(c.base);
  ASSERT_TRUE(raw.ok()) << raw.status().to_string();
  constexpr size_t kCap = Door::kMaxWaiting;
  std::vector<transport::ConnectionPtr> conns;
  for (size_t i = 0; i < kCap + 6; ++i) {
    auto conn = connect_text((*raw)->transport(), server.address());
    ASSERT_TRUE(conn.ok()) << conn.status().to_string();
    conns.push_back(*conn);
  }
  // One says hello and never proves anything: no more time for it.
  ASSERT_TRUE(
      (*raw)->send(conns[0], protocol::PeerHello{Role::kWorker, 0, protocol::make_nonce()}).ok());
  EXPECT_TRUE(eventually("the cap to refuse 6 connections", 10s,
                         [&] { return server.num_refused() >= 6; }));
  const auto flooded = std::chrono::steady_clock::now();
  EXPECT_TRUE(eventually("every connection to be closed", 10s, [&] {
    return std::none_of(conns.begin(), conns.end(), [](const auto& k) { return k->is_open(); });
  }));
  EXPECT_GE(std::chrono::steady_clock::now() - flooded, 1s);  // not before the deadline
  EXPECT_EQ(server.num_refused(), kCap + 6);
  expect_one_exact_push_pull(*c.workers[0]);
}

// A member checks the coordinator's proof too: a coordinator that does not
// know the secret (here a stand-in that answers with another one) gets no
// further than its Welcome.
TEST_P(Runtime, AMemberRefusesACoordinatorThatCannotProveTheSecret) {
  Cluster c(
      1, 1, [](RuntimeOptions& o) { o.secret = "right"; }, GetParam());
  auto fake = RawWorker::start(c.base, /*listen=*/true);
  ASSERT_TRUE(fake.ok()) << fake.status().to_string();
  RuntimeOptions o = c.base;
  o.coordinator_address = (*fake)->address();
  o.connect_timeout = 5s;
  auto worker = std::async(std::launch::async, [o] { return WorkerService::start(o); });
  auto conn = (*fake)->next_accepted(5s);
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  const protocol::Nonce challenge = protocol::make_nonce();
  ASSERT_TRUE((*fake)->send(*conn, protocol::Challenge{challenge}).ok());
  auto hello = (*fake)->next<protocol::Hello>([](const auto&) { return true; }, 5s);
  ASSERT_TRUE(hello.ok()) << hello.status().to_string();
  EXPECT_TRUE(
      protocol::proofs_equal(hello->proof, protocol::hello_proof("right", challenge, *hello)))
      << "the member proves the secret it was given";
  protocol::Welcome welcome{Role::kWorker, 0, 1, 1, 0, c.base.chunk_bytes, {}};
  welcome.proof = protocol::welcome_proof("guess", challenge, *hello, welcome);
  ASSERT_TRUE((*fake)->send(*conn, welcome).ok());
  auto w = worker.get();
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("did not prove it knows the job secret"), std::string::npos)
      << w.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Transports, Runtime, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace psld
