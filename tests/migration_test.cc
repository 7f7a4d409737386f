// Live migration (DESIGN.md §7): placement epochs switch while workers train,
// and the results are exactly those of a run without a switch.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "tests/cluster.h"

namespace psld {
namespace {

using protocol::DType;

// Waits until no switch is in flight, proposes the change make(committed
// placement) returns, and waits up to 10 s for its commit.
template <typename Make>
Status switch_to(Cluster& c, const char* what, Make&& make) {
  while (c.coordinator->switching())
    std::this_thread::sleep_for(1ms);
  auto change = make(c.coordinator->current_placement());
  if (!change.ok()) return change.status().with_context(what);
  const uint64_t before = c.coordinator->switches();
  PSLD_RETURN_IF_ERROR(c.coordinator->propose(change->delta).with_context(what));
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (c.coordinator->switches() == before && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  if (c.coordinator->switches() == before) {
    return Timeout(std::string(what) + " did not commit within 10 s");
  }
  return Status::Ok();
}

// Moves the arc of a random chunk of the job's tensors to another active
// server, `count` times, each after the previous switch committed. Returns
// the number of switches committed.
int migrate(Cluster& c, const std::vector<std::pair<TensorId, uint32_t>>& chunks, int count,
            uint32_t seed, const std::atomic<bool>& stop) {
  std::mt19937 rng(seed);
  int done = 0;
  while (done < count && !stop.load()) {
    Status st = switch_to(c, "a forced migration", [&](const Placement& p) {
      const auto [tensor, chunk] = chunks[rng() % chunks.size()];
      const Key key = make_key(tensor, chunk);
      const ServerId from = p.owner_of_key(key);
      std::vector<ServerId> targets;
      for (const auto& s : p.servers()) {
        if (s.state == ServerState::kActive && s.id != from) targets.push_back(s.id);
      }
      return p.move_arc(p.arc_index_of_hash(hash_key(key)), targets[rng() % targets.size()]);
    });
    if (!st.ok()) {
      ADD_FAILURE() << "switch " << done + 1 << ": " << st.to_string();
      return done;
    }
    ++done;
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
  }
  return done;
}

class Migration : public ::testing::TestWithParam<std::string> {};

TEST_P(Migration, BspSumsStayExactThroughTwentyForcedMigrations) {
  Cluster c(
      4, 3, [](RuntimeOptions& o) { o.stats_interval = 20ms; }, GetParam());
  ASSERT_TRUE(c.start().ok());
  // Odd sizes; 64 KiB chunks: single-chunk keys and multi-chunk tensors.
  const std::vector<size_t> elems = {1, 7, 1000, 16384, 50001, 3000, 3001, 77777};
  std::vector<std::pair<TensorId, uint32_t>> chunks;
  std::mutex chunks_mu;
  std::atomic<uint64_t> target{UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  std::atomic<bool> failed{false};
  std::atomic<int> registered{0};

  std::thread mover;
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
    if (wi == 0) {
      // Tensor ids are assigned in registration order from 1.
      std::lock_guard<std::mutex> lock(chunks_mu);
      for (size_t t = 0; t < elems.size(); ++t) {
        const uint64_t n = (elems[t] * 4 + c.base.chunk_bytes - 1) / c.base.chunk_bytes;
        for (uint64_t k = 0; k < n; ++k)
          chunks.emplace_back(static_cast<TensorId>(t + 1), static_cast<uint32_t>(k));
      }
    }
    ++registered;
    const float rank = static_cast<float>(w.rank());
    for (uint64_t r = 1; r <= target.load() && !failed.load(); ++r) {
      uint64_t f = furthest.load();
      while (r > f && !furthest.compare_exchange_weak(f, r)) {
      }
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i)
          data[t][i] = rank * 1000.0f + static_cast<float>(r % 1000) + static_cast<float>(i % 13);
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      for (auto& req : reqs) {
        Status st = req->wait(20s);
        if (!st.ok()) {
          failed = true;
          return st.with_context("round " + std::to_string(r));
        }
      }
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i) {
          const float want =
              6000.0f + 4.0f * (static_cast<float>(r % 1000) + static_cast<float>(i % 13));
          if (data[t][i] != want) {
            failed = true;
            return Internal("round " + std::to_string(r) + " tensor " + std::to_string(t) +
                            " element " + std::to_string(i) + ": " + std::to_string(data[t][i]) +
                            " != " + std::to_string(want));
          }
        }
      }
      if (wi == 0 && r == 3) {
        mover = std::thread([&] {
          std::vector<std::pair<TensorId, uint32_t>> copy;
          {
            std::lock_guard<std::mutex> lock(chunks_mu);
            copy = chunks;
          }
          const int done = migrate(c, copy, 20, 7, failed);
          EXPECT_EQ(done, 20);
          target = furthest.load() + 10;  // a few rounds after the last switch
        });
      }
    }
    return Status::Ok();
  });
  if (mover.joinable()) mover.join();
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_GE(c.coordinator->switches(), 20u);
}

// A job of 4 workers x 3 servers (+ standby) training three tensors with Adam
// on integer-valued gradients, so every sum is exact whatever the order and
// two runs differ only in where the keys live.
struct AdamJob {
  std::vector<std::vector<float>> params;  // worker 0's at the end
  uint64_t rounds = 0;
  uint64_t switches = 0;
  std::optional<Placement> placement;  // the committed one at the end
};

using Mover = std::function<void(Cluster&, const std::vector<std::pair<TensorId, uint32_t>>&,
                                 const std::atomic<bool>& stop)>;

// Runs `rounds` rounds; with rounds == 0, until `mover` is done and 5 more.
AdamJob adam_job(const std::string& backend, uint32_t standby, uint64_t rounds,
                 const Mover& mover) {
  Cluster c(
      4, 3,
      [standby](RuntimeOptions& o) {
        o.num_standby = standby;
        o.mode = ServerMode::kOptimizer;
        o.optimizer.kind = OptimizerKind::kAdam;
        o.optimizer.lr = 0.01f;
        o.stats_interval = 20ms;
      },
      backend);
  AdamJob job;
  EXPECT_TRUE(c.start().ok());
  const std::vector<size_t> elems = {5, 20000, 40001};
  std::vector<std::pair<TensorId, uint32_t>> chunks;
  for (size_t t = 0; t < elems.size(); ++t) {
    const uint64_t n = (elems[t] * 4 + c.base.chunk_bytes - 1) / c.base.chunk_bytes;
    for (uint64_t k = 0; k < n; ++k)
      chunks.emplace_back(static_cast<TensorId>(t + 1), static_cast<uint32_t>(k));
  }
  std::atomic<bool> stop{false};
  std::atomic<int> started{0};
  std::atomic<uint64_t> target{rounds > 0 ? rounds : UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  std::thread moving;
  if (mover) {
    moving = std::thread([&] {
      while (started.load() < 4)
        std::this_thread::sleep_for(1ms);
      mover(c, chunks, stop);
      if (rounds == 0) target = furthest.load() + 5;
    });
  }
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>> data(elems.size());
    std::vector<uint32_t> handles;
    for (size_t t = 0; t < elems.size(); ++t) {
      data[t].assign(elems[t], 0.0f);
      std::vector<float> init(elems[t]);
      for (size_t i = 0; i < elems[t]; ++i)
        init[i] = static_cast<float>(i % 7) - 3.0f;
      PSLD_ASSIGN_OR_RETURN(uint32_t h,
                            w.register_tensor("p" + std::to_string(t), DType::kF32, elems[t] * 4,
                                              data[t].data(), init.data()));
      handles.push_back(h);
    }
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    ++started;
    for (uint64_t r = 1; r <= target.load(); ++r) {
      uint64_t f = furthest.load();
      while (r > f && !furthest.compare_exchange_weak(f, r)) {
      }
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i)
          data[t][i] = static_cast<float>((i + w.rank() + r) % 9) - 4.0f;
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      for (auto& req : reqs) {
        PSLD_RETURN_IF_ERROR(req->wait(20s).with_context("round " + std::to_string(r)));
      }
    }
    if (w.rank() == 0) job.params = data;
    return Status::Ok();
  });
  stop = true;
  if (moving.joinable()) moving.join();
  EXPECT_TRUE(s.ok()) << s.to_string();
  job.rounds = target.load();
  job.switches = c.coordinator->switches();
  job.placement = c.coordinator->current_placement();
  return job;
}

void expect_bit_identical(const std::vector<std::vector<float>>& a,
                          const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (size_t t = 0; t < a.size(); ++t) {
    ASSERT_EQ(a[t].size(), b[t].size());
    for (size_t i = 0; i < a[t].size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(a[t][i]), std::bit_cast<uint32_t>(b[t][i]))
          << "tensor " << t << " element " << i << ": " << a[t][i] << " vs " << b[t][i];
    }
  }
}

TEST_P(Migration, AdamParametersAndMomentsMoveBitExactly) {
  const AdamJob with =
      adam_job(GetParam(), 0, 0, [](Cluster& c, const auto& chunks, const std::atomic<bool>& stop) {
        EXPECT_EQ(migrate(c, chunks, 12, 11, stop), 12);
      });
  EXPECT_GE(with.switches, 12u);
  const AdamJob without = adam_job(GetParam(), 0, with.rounds, nullptr);
  expect_bit_identical(with.params, without.params);
}

TEST_P(Migration, AsyncModeConservesEveryPushAcrossMigrations) {
  Cluster c(
      3, 3,
      [](RuntimeOptions& o) {
        o.sync = SyncMode::kAsync;
        o.stats_interval = 20ms;
      },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 40000;  // three chunks
  // Every worker pushes the same number of times: a switch in async mode
  // completes once every worker pushed the round before it (docs/migration.md).
  const std::vector<std::pair<TensorId, uint32_t>> chunks = {{1, 0}, {1, 1}, {1, 2}};
  std::atomic<bool> stop{false};
  std::atomic<int> started{0};
  std::atomic<uint64_t> pushes{0};
  std::atomic<uint64_t> target{UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  // Tensor memory outlives the workers' use of it (and the final pull).
  std::vector<std::vector<float>> xs(3, std::vector<float>(kN));
  std::thread mover([&] {
    while (started.load() < 3)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(migrate(c, chunks, 10, 5, stop), 10);
    target = furthest.load() + 5;
  });
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float>& x = xs[wi];
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("acc", DType::kF32, kN * 4, x.data(), nullptr));
    ++started;
    for (uint64_t r = 1; r <= target.load() && !stop.load(); ++r) {
      uint64_t f = furthest.load();
      while (r > f && !furthest.compare_exchange_weak(f, r)) {
      }
      std::fill(x.begin(), x.end(), 1.0f);
      PSLD_ASSIGN_OR_RETURN(auto req, w.submit(h, RequestKind::kPush));
      Status st = req->wait(20s);
      if (!st.ok()) {
        stop = true;
        return st.with_context(w.describe_in_flight());
      }
      ++pushes;
      if (r % 10 == 0) std::this_thread::sleep_for(1ms);  // let the switches overlap
    }
    return Status::Ok();
  });
  stop = true;
  mover.join();
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(on_all(c, [&](size_t wi) { return c.workers[wi]->barrier(10s); }).ok());
  // Every push reached an owner; once the last state moved, a pull sees all.
  std::vector<float>& x = xs[0];
  WorkerService& w = *c.workers[0];
  const float want = static_cast<float>(pushes.load());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  Status last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto req = w.submit(0, RequestKind::kPull);
    ASSERT_TRUE(req.ok());
    last = (*req)->wait(10s);
    if (!last.ok()) continue;
    bool all = true;
    for (float v : x) {
      ASSERT_LE(v, want) << "more than was pushed";
      all = all && v == want;
    }
    if (all) break;
    std::this_thread::sleep_for(10ms);
  }
  for (size_t i = 0; i < kN; ++i)
    ASSERT_EQ(x[i], want) << "element " << i << " (" << last.to_string() << ")";
}

// The long run: 4 workers, 3 servers + 1 standby, 1000 BSP rounds with
// 20 forced migrations, a scale-out to the standby and a scale-in while it
// runs; the final parameters are bit-identical to a run without any of it.
TEST(MigrationLong, ThousandRoundsWithScaleOutAndScaleInAreBitIdentical) {
  const AdamJob with = adam_job(
      "loopback", 1, 1000, [&](Cluster& c, const auto& chunks, const std::atomic<bool>& stop) {
        EXPECT_EQ(migrate(c, chunks, 10, 3, stop), 10);
        Status out = switch_to(c, "scale-out", [](const Placement& p) {
          return p.add_server({3, 1.0});
        });
        EXPECT_TRUE(out.ok()) << out.to_string();
        EXPECT_EQ(migrate(c, chunks, 10, 4, stop), 10);
        Status in = switch_to(c, "scale-in", [](const Placement& p) { return p.drain_server(1); });
        EXPECT_TRUE(in.ok()) << in.to_string();
      });
  EXPECT_GE(with.switches, 22u);
  ASSERT_TRUE(with.placement.has_value());
  EXPECT_GT(with.placement->share_of(3), 0.0) << "the standby took no load";
  EXPECT_EQ(with.placement->share_of(1), 0.0) << "the drained server kept load";
  const AdamJob without = adam_job("loopback", 1, 1000, nullptr);
  expect_bit_identical(with.params, without.params);
}

INSTANTIATE_TEST_SUITE_P(Transports, Migration, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace psld
