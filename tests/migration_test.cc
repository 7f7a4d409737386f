// Live migration (docs/design.md §7): placement epochs switch while workers train,
// and the results are exactly those of a run without a switch.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "lib/placement/epoch_log.h"
#include "tests/cluster.h"
#include "tests/eventually.h"
#include "tests/fake_gpu.h"

namespace psld {
namespace {

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

// 4 workers train (BSP, sums checked every round) while 20 forced switches
// move random chunks' arcs. `allocated`: the tensors are in Worker::allocate
// memory, which loopback servers map, so push_pulls are read in place.
// `together`: 24 more small tensors, and each round's push_pulls submitted
// at once, so that small pushes travel in batches (data.batch_chunk_bytes)
// whose entries a switch splits between servers, some answered Moved.
void bsp_sums_through_migrations(const std::string& backend, bool allocated,
                                 bool together = false) {
  // Per worker, declared before the cluster: a server may still write a pull
  // into a tensor after a request failed, until the cluster stops.
  std::vector<std::vector<std::vector<float>>> storage_of(4);
  Cluster c(
      4, 3, [](RuntimeOptions& o) { o.stats_interval = 20ms; }, backend);
  ASSERT_TRUE(c.start().ok());
  // Odd sizes; 64 KiB chunks: single-chunk keys and multi-chunk tensors.
  std::vector<size_t> elems = {1, 7, 1000, 16384, 50001, 3000, 3001, 77777};
  for (size_t i = 0; together && i < 24; ++i)
    elems.push_back(1 + i * 131);
  std::vector<std::pair<TensorId, uint32_t>> chunks;
  std::mutex chunks_mu;
  std::atomic<uint64_t> target{UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  std::atomic<bool> failed{false};
  std::atomic<int> registered{0};

  std::thread mover;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>>& storage = storage_of[wi];
    std::vector<float*> data;
    std::vector<uint32_t> handles;
    if (allocated) {
      PSLD_ASSIGN_OR_RETURN(handles, register_allocated(w, elems, data));
    } else {
      PSLD_ASSIGN_OR_RETURN(handles, register_zeroed(w, elems, storage));
      for (auto& v : storage)
        data.push_back(v.data());
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
        if (together) continue;
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      if (together) {
        PSLD_ASSIGN_OR_RETURN(reqs, w.submit_many(handles, RequestKind::kPushPull));
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
  uint64_t in_place = 0, batches = 0;
  for (auto& srv : c.servers) {
    in_place += srv->stats().pushes_in_place;
    batches += srv->stats().batches;
  }
  if (together) {
    EXPECT_GT(batches, 0u);
  }

  if (allocated && backend == "loopback") {
    EXPECT_GT(in_place, 0u);
  } else if (!allocated) {
    EXPECT_EQ(in_place, 0u);
  }
}

TEST_P(Migration, BspSumsStayExactThroughTwentyForcedMigrations) {
  bsp_sums_through_migrations(GetParam(), false);
}

TEST_P(Migration, PushPullsReadInPlaceStayExactThroughTwentyForcedMigrations) {
  bsp_sums_through_migrations(GetParam(), true);
}

TEST_P(Migration, BatchedPushPullsStayExactThroughTwentyForcedMigrations) {
  bsp_sums_through_migrations(GetParam(), false, /*together=*/true);
}

TEST_P(Migration, BatchedInPlacePushPullsStayExactThroughTwentyForcedMigrations) {
  bsp_sums_through_migrations(GetParam(), true, /*together=*/true);
}

// Waits (up to 20 s, while training goes on and no switch is in flight)
// until the servers shipped `ships` key states in all, so that training
// passed every switch round (the placement's owners hold the keys), and
// then until every server holds exactly one run of ownership per key it
// owns: every run that ended was freed (docs/migration.md, "Freeing old
// runs").
Status runs_settle(Cluster& c, const std::vector<std::pair<TensorId, uint32_t>>& chunks,
                   uint64_t ships) {
  std::string off;  // what is not settled yet
  const auto settled = [&] {
    const Placement p = c.coordinator->current_placement();
    off.clear();
    uint64_t shipped = 0;
    for (const auto& s : c.servers)
      shipped += s->stats().states_out;
    if (shipped < ships) off = fmt::format(" {} of {} key states shipped;", shipped, ships);
    for (const auto& s : c.servers) {
      if (!off.empty()) break;
      uint64_t owned = 0;
      for (const auto& [tensor, chunk] : chunks)
        owned += p.owner_of_key(make_key(tensor, chunk)) == s->rank();
      const uint64_t runs = s->stats().runs;
      if (runs != owned)
        off += fmt::format(" server {} holds {} runs for {} keys;", s->rank(), runs, owned);
    }
    return off.empty();
  };
  if (eventually("old runs to be freed", 20s, settled, 5ms)) return Status::Ok();
  return Timeout("old runs were not freed within 20 s:" + off);
}

// The range of one key forced back and forth between two servers 60 times
// while 4 workers train (BSP, sums checked every round): every sum stays
// exact, and every 10 switches each server is back to one run of ownership
// per key it owns. Without freeing, each switch would leave one run per key
// of the range behind on the server it takes the range from.
TEST_P(Migration, OldRunsAreFreedWhileARangeMovesBackAndForth) {
  std::vector<std::vector<std::vector<float>>> data_of(4);  // outlives the cluster
  Cluster c(
      4, 3, [](RuntimeOptions& o) { o.stats_interval = 20ms; }, GetParam());
  ASSERT_TRUE(c.start().ok());
  const std::vector<size_t> elems = {7, 1000, 16384, 50001, 3001};
  std::vector<std::pair<TensorId, uint32_t>> chunks;
  for (size_t t = 0; t < elems.size(); ++t) {
    const uint64_t n = (elems[t] * 4 + c.base.chunk_bytes - 1) / c.base.chunk_bytes;
    for (uint64_t k = 0; k < n; ++k)
      chunks.emplace_back(static_cast<TensorId>(t + 1), static_cast<uint32_t>(k));
  }
  std::atomic<uint64_t> target{UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  std::atomic<bool> failed{false};
  std::atomic<int> started{0};
  uint64_t moved_keys = 0, switches = 0;
  Status settled;
  std::thread mover([&] {
    while (started.load() < 4 && !failed.load())
      std::this_thread::sleep_for(1ms);
    const Key key = make_key(1, 0);
    const Placement first = c.coordinator->current_placement();
    const Arc range = first.arc(first.arc_index_of_hash(hash_key(key)));
    const ServerId a = range.owner, b = (range.owner + 1) % 3;
    for (const auto& [tensor, chunk] : chunks) {
      const uint64_t h = hash_key(make_key(tensor, chunk));
      moved_keys += h >= range.lo && h <= range.hi;
    }
    std::mt19937 rng(13);
    for (int i = 1; i <= 60 && !failed.load() && settled.ok(); ++i) {
      settled = switch_to(c, "a move back and forth", [&](const Placement& p) {
        return p.move_range(range.lo, range.hi, p.owner_of_key(key) == a ? b : a);
      });
      if (!settled.ok()) break;
      ++switches;
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 10));
      if (i % 10 == 0) {
        settled = runs_settle(c, chunks, switches * moved_keys)
                      .with_context(fmt::format("after {} switches", i));
      }
    }
    target = furthest.load() + 5;
  });
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>>& data = data_of[wi];
    PSLD_ASSIGN_OR_RETURN(std::vector<uint32_t> handles, register_zeroed(w, elems, data));
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    ++started;
    const float rank = static_cast<float>(w.rank());
    for (uint64_t r = 1; r <= target.load() && !failed.load(); ++r) {
      uint64_t f = furthest.load();
      while (r > f && !furthest.compare_exchange_weak(f, r)) {
      }
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i)
          data[t][i] = rank * 1000.0f + static_cast<float>((r + i) % 97);
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      for (auto& req : reqs) {
        Status st = req->wait(20s);
        if (!st.ok()) {
          failed = true;
          return st.with_context("round " + std::to_string(r) + ": " + w.describe_in_flight());
        }
      }
      for (size_t t = 0; t < elems.size(); ++t) {
        for (size_t i = 0; i < elems[t]; ++i) {
          const float want = 6000.0f + 4.0f * static_cast<float>((r + i) % 97);
          if (data[t][i] != want) {
            failed = true;
            return Internal(
                fmt::format("round {} tensor {} element {}: {} != {}", r, t, i, data[t][i], want));
          }
        }
      }
    }
    return Status::Ok();
  });
  if (!s.ok()) failed = true;
  mover.join();
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(settled.ok()) << settled.to_string();
  EXPECT_EQ(switches, 60u);
  ASSERT_GT(moved_keys, 0u);
  // Each switch ended one run per key of the range; each was freed once.
  uint64_t freed = 0;
  for (const auto& srv : c.servers)
    freed += srv->stats().runs_freed;
  EXPECT_EQ(freed, switches * moved_keys);
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
AdamJob adam_job(const std::string& backend, uint32_t standby, uint64_t rounds, const Mover& mover,
                 const std::function<void(uint32_t, RuntimeOptions&)>& server_tweak = nullptr) {
  std::vector<std::vector<std::vector<float>>> data_of(4);  // outlives the cluster
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
  c.server_tweak = server_tweak;
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
    std::vector<std::vector<float>>& data = data_of[wi];
    data.resize(elems.size());
    std::vector<uint32_t> handles;
    for (size_t t = 0; t < elems.size(); ++t) {
      data[t].assign(elems[t], 0.0f);
      std::vector<float> init(elems[t]);
      for (size_t i = 0; i < elems[t]; ++i)
        init[i] = static_cast<float>(i % 7) - 3.0f;
      PSLD_ASSIGN_OR_RETURN(
          uint32_t h, w.register_tensor("p" + std::to_string(t), DType::kFloat32, elems[t] * 4,
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

TEST_P(Migration, AdamParametersAndMomentsMoveBitExactly) {
  const AdamJob with =
      adam_job(GetParam(), 0, 0, [](Cluster& c, const auto& chunks, const std::atomic<bool>& stop) {
        EXPECT_EQ(migrate(c, chunks, 12, 11, stop), 12);
      });
  EXPECT_GE(with.switches, 12u);
  const AdamJob without = adam_job(GetParam(), 0, with.rounds, nullptr);
  expect_bit_identical(with.params, without.params);
}

// Keys move between servers that keep them in GPU memory (servers 0 and 2,
// on the fake GPU of tests/fake_gpu.h, which crashes the test if the host
// touches that memory) and one that keeps them in host memory: parameters
// and Adam moments cross every way bit-exactly.
TEST_P(Migration, AdamMovesBitExactlyBetweenGpuAndCpuServers) {
  FakeDevice arena(size_t{1} << 30);
  ASSERT_TRUE(arena.ok()) << "mmap of the fake device failed";
  auto log = std::make_shared<ServerDeviceLog>();
  const AdamJob with = adam_job(
      GetParam(), 0, 0,
      [](Cluster& c, const auto& chunks, const std::atomic<bool>& stop) {
        EXPECT_EQ(migrate(c, chunks, 12, 13, stop), 12);
      },
      [&](uint32_t i, RuntimeOptions& o) {
        if (i == 1) return;
        o.server_device = ServerDeviceKind::kCuda;
        o.server_device_factory = [&arena,
                                   log](size_t lanes) -> Result<std::unique_ptr<ServerDevice>> {
          return std::unique_ptr<ServerDevice>(new FakeServerDevice(arena, lanes, log));
        };
      });
  EXPECT_GE(with.switches, 12u);
  const AdamJob without = adam_job(GetParam(), 0, with.rounds, nullptr);
  expect_bit_identical(with.params, without.params);
  EXPECT_GT(log->launches.load(), 0u);
  EXPECT_EQ(log->live.load(), 0) << "device allocations never freed";
  EXPECT_EQ(log->live_host.load(), 0) << "pinned host allocations never freed";
}

TEST_P(Migration, AsyncModeConservesEveryPushAcrossMigrations) {
  constexpr size_t kN = 40000;  // three chunks
  // Tensor memory outlives the workers' use of it (and the final pull) and
  // the cluster: a pull that timed out may still land until it stops.
  std::vector<std::vector<float>> xs(3, std::vector<float>(kN));
  Cluster c(
      3, 3,
      [](RuntimeOptions& o) {
        o.sync = SyncMode::kAsync;
        o.stats_interval = 20ms;
      },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  // Every worker pushes the same number of times: a switch in async mode
  // completes once every worker pushed the round before it (docs/migration.md).
  const std::vector<std::pair<TensorId, uint32_t>> chunks = {{1, 0}, {1, 1}, {1, 2}};
  std::atomic<bool> stop{false};
  std::atomic<int> started{0};
  std::atomic<uint64_t> pushes{0};
  std::atomic<uint64_t> target{UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  std::thread mover([&] {
    while (started.load() < 3)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(migrate(c, chunks, 10, 5, stop), 10);
    // Past the last switch: a worker that stops one round short of it may
    // still pull the round before, from the run that ends there.
    target = std::max(furthest.load() + 5, c.coordinator->last_switch_round());
  });
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float>& x = xs[wi];
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("acc", DType::kFloat32, kN * 4, x.data(), nullptr));
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
  // Every run that ended was freed once the slowest worker passed its end:
  // one run per key in all.
  uint64_t runs = 0;
  const auto one_run_per_key = [&] {
    runs = 0;
    for (const auto& srv : c.servers)
      runs += srv->stats().runs;
    return runs == chunks.size();
  };
  EXPECT_TRUE(eventually("one run per key", 20s, one_run_per_key, 5ms));
  EXPECT_EQ(runs, chunks.size());
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

// ---- Aborting a transfer whose target dies (docs/migration.md, "Abort").

// An abort epoch has the switch round of the epoch it replaces: from that
// round on, the abort's owners serve; the replaced epoch serves no round.
TEST(EpochLogAbort, AnAbortEpochTakesOverEveryRoundOfTheEpochItReplaces) {
  auto e0 = Placement::initial({{0, 1.0}, {1, 1.0}, {2, 1.0}});
  ASSERT_TRUE(e0.ok());
  EpochLog log(std::make_shared<const Placement>(*e0));
  auto out = e0->add_server({3, 1.0});
  ASSERT_TRUE(out.ok());
  log.push(std::make_shared<const Placement>(out->next), 10);
  // Give every range of server 3 back to its owner in epoch 0, and remove it.
  PlacementDelta back{1, 2, {MembershipChange::remove(3)}, {}};
  for_each_overlap(*e0, out->next, [&](uint64_t lo, uint64_t hi, ServerId was, ServerId now) {
    if (now == 3) back.assignments.push_back({lo, hi, was});
  });
  ASSERT_FALSE(back.assignments.empty());
  auto aborted = log.follow(2, back.serialize());
  ASSERT_TRUE(aborted.ok()) << aborted.status().to_string();
  log.push(*aborted, 10);
  uint64_t pieces = 0;
  for_each_overlap(*e0, log.latest(), [&](uint64_t lo, uint64_t, ServerId was, ServerId now) {
    ++pieces;
    EXPECT_EQ(was, now) << "range from " << lo;
  });
  EXPECT_GT(pieces, 0u);
  EXPECT_EQ(log.latest().find_server(3), nullptr);
  for (uint64_t k = 0; k < 200; ++k) {
    const Key key = make_key(1, static_cast<uint32_t>(k));
    EXPECT_EQ(log.owner(key, 9), e0->owner_of_key(key));
    EXPECT_EQ(log.owner(key, 10), e0->owner_of_key(key));
    EXPECT_EQ(log.owner(key, 1000), e0->owner_of_key(key));
  }
}

// A scale-out to `id` that also moves the arcs holding `chunks` to it, so
// that a test knows which keys travel.
Result<PlacementDelta> scale_out_taking(const Placement& p, ServerId id,
                                        const std::vector<std::pair<TensorId, uint32_t>>& chunks) {
  PSLD_ASSIGN_OR_RETURN(PlacementChange add, p.add_server({id, 1.0}));
  PlacementDelta d = add.delta;
  for (const auto& [tensor, chunk] : chunks) {
    const Arc a = add.next.arc(add.next.arc_index_of_hash(hash_key(make_key(tensor, chunk))));
    if (a.owner != id) d.assignments.push_back({a.lo, a.hi, id});
  }
  std::sort(d.assignments.begin(), d.assignments.end(),
            [](const RangeAssignment& a, const RangeAssignment& b) { return a.lo < b.lo; });
  d.assignments.erase(std::unique(d.assignments.begin(), d.assignments.end()), d.assignments.end());
  return d;
}

constexpr ServerId kStandby = 3;

// Makes the standby's transfer (of a job whose tensors all keep pace) take
// long enough to be killed in the middle of. On loopback, everything on the
// connections the standby dials (its state requests, and the states written
// back on them) takes 400 ms: an emulated link would only hold back the
// standby's notifications, and the old owners' writes would complete (and
// the transfer end) at once. On UCX such a job is killed at the commit
// instead (KillAt::kCommit).
void slow_transfer(Cluster& c, const std::string& backend) {
  if (backend != "loopback") return;
  transport::FaultPlan plan;
  plan.delay = 400ms;
  c.fabric->set_faults(plan, c.servers[kStandby]->address());
}

// When scale_out_and_kill kills: at the commit, once the standby asked for
// a key's state, or once one landed there (the transfer must then be held
// open by something else: a key that has not reached the switch).
enum class KillAt { kCommit, kRequested, kInstalled };

// Scales out to the standby, taking the arcs of `chunks`, and kills server
// `victim` at `when`, while the transfer is open. Returns the placement
// before the scale-out.
Result<Placement> scale_out_and_kill(Cluster& c,
                                     const std::vector<std::pair<TensorId, uint32_t>>& chunks,
                                     ServerId victim, KillAt when) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (c.coordinator->switching() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  const Placement before = c.coordinator->current_placement();
  PSLD_ASSIGN_OR_RETURN(PlacementDelta delta, scale_out_taking(before, kStandby, chunks));
  const uint64_t switches = c.coordinator->switches();
  PSLD_RETURN_IF_ERROR(c.coordinator->propose(delta).with_context("the scale-out"));
  ServerService& standby = *c.servers[kStandby];
  auto committed = [&] { return c.coordinator->switches() > switches; };
  auto reached = [&] {
    const ServerStats st = standby.stats();
    return when == KillAt::kCommit ||
           (when == KillAt::kRequested ? st.states_requested : st.states_in) > 0;
  };
  while (std::chrono::steady_clock::now() < deadline &&
         !(committed() && (reached() || !c.coordinator->transferring()))) {
    std::this_thread::sleep_for(1ms);
  }
  if (!committed()) return Timeout("the scale-out did not commit");
  if (!c.coordinator->transferring()) {
    return FailedPrecondition("the transfer was final before the kill: it is too fast here");
  }
  kill_server(c, victim);
  return before;
}

// Waits until the coordinator published an abort and closed the transfer.
Status wait_for_abort(Cluster& c) {
  eventually("an abort and the transfer closed", 10s,
             [&] { return c.coordinator->aborts() != 0 && !c.coordinator->switching(); });
  if (c.coordinator->aborts() == 0) return Timeout("no abort within 10 s of the kill");
  if (c.coordinator->switching()) return Timeout("the transfer is still open 10 s after the abort");
  return Status::Ok();
}

class MigrationAbort : public ::testing::TestWithParam<std::string> {};

// Trains `tensors` (one handle each, of elems[t] floats) for rounds 1..target
// on every worker with push_pull, BSP sums checked exactly every round; the
// last tensor lags: it is pushed every other step only, so its rounds run at
// half the others' pace. Calls at_round(3) on worker 0 from its own thread.
struct SumJob {
  // Per worker, per tensor. The caller declares them before the cluster: a
  // server may still write a pull into a tensor after a request failed,
  // until the cluster stops.
  using Tensors = std::vector<std::vector<std::vector<float>>>;
  Cluster& c;
  Tensors& tensors;
  std::vector<size_t> elems;
  std::atomic<uint64_t> target{UINT64_MAX};
  std::atomic<uint64_t> furthest{0};
  std::atomic<bool> failed{false};

  Status run(const std::function<void()>& at_round_3) {
    std::thread controller;
    tensors.resize(c.workers.size());
    Status s = on_all(c, [&](size_t wi) -> Status {
      WorkerService& w = *c.workers[wi];
      std::vector<std::vector<float>>& data = tensors[wi];
      PSLD_ASSIGN_OR_RETURN(std::vector<uint32_t> handles, register_zeroed(w, elems, data));
      PSLD_RETURN_IF_ERROR(w.barrier(10s));
      const float rank = static_cast<float>(w.rank());
      const size_t lagging = elems.size() - 1;
      for (uint64_t r = 1; r <= target.load() && !failed.load(); ++r) {
        uint64_t f = furthest.load();
        while (r > f && !furthest.compare_exchange_weak(f, r)) {
        }
        std::vector<std::shared_ptr<RequestState>> reqs;
        auto value = [&](size_t t, size_t i) {
          const uint64_t round = t == lagging ? r / 2 : r;
          return static_cast<float>((round + i + t) % 11);
        };
        auto pushed = [&](size_t t) { return t != lagging || r % 2 == 0; };
        for (size_t t = 0; t < elems.size(); ++t) {
          if (!pushed(t)) continue;
          for (size_t i = 0; i < elems[t]; ++i)
            data[t][i] = rank * 100.0f + value(t, i);
          PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
          reqs.push_back(req);
        }
        for (auto& req : reqs) {
          Status st = req->wait(20s);
          if (!st.ok()) {
            failed = true;
            return st.with_context("round " + std::to_string(r) + ": " + w.describe_in_flight());
          }
        }
        for (size_t t = 0; t < elems.size(); ++t) {
          if (!pushed(t)) continue;
          for (size_t i = 0; i < elems[t]; ++i) {
            const float want = 600.0f + 4.0f * value(t, i);
            if (data[t][i] != want) {
              failed = true;
              return Internal(fmt::format("round {} tensor {} element {}: {} != {}", r, t, i,
                                          data[t][i], want));
            }
          }
        }
        if (wi == 0 && r == 3) controller = std::thread(at_round_3);
      }
      return Status::Ok();
    });
    if (controller.joinable()) controller.join();
    return s;
  }
};

// The case: 4 workers x 3 servers + 1 standby, BSP sums checked
// every round; a scale-out to the standby whose transfer is cut by the
// standby's death after a key's state landed there (the lagging tensor's
// key has not reached the switch, which holds the transfer open). The job
// goes on, every sum exact, the ranges back where they were, and later
// switches still work.
TEST_P(MigrationAbort, StandbyKilledMidTransferGivesItsRangesBackAndTrainingGoesOn) {
  SumJob::Tensors tensors;
  Cluster c(
      4, 3,
      [](RuntimeOptions& o) {
        o.num_standby = 1;
        o.stats_interval = 20ms;
      },
      GetParam());
  c.server_tweak = numbered_servers(GetParam());
  ASSERT_TRUE(c.start().ok());
  // 16 tensors of one 64 KiB chunk, one of odd size over two chunks, and the
  // lagging one; the standby takes 8 + 1 + 1 of their chunks and whatever
  // its share brings.
  SumJob job{c, tensors, std::vector<size_t>(16, 16384)};
  job.elems.push_back(20001);
  job.elems.push_back(16384);
  std::vector<std::pair<TensorId, uint32_t>> moving;
  for (TensorId t = 1; t <= 8; ++t)
    moving.emplace_back(t, 0);
  moving.emplace_back(17, 1);
  moving.emplace_back(18, 0);
  std::optional<Placement> before, after;
  Status control;
  uint64_t states_in = 0;
  Status s = job.run([&] {
    auto b = scale_out_and_kill(c, moving, kStandby, KillAt::kInstalled);
    if (b.ok()) {
      before = *b;
      states_in = c.servers[kStandby]->stats().states_in;
      control = wait_for_abort(c);
      after = c.coordinator->current_placement();
    } else {
      control = b.status();
    }
    // The job goes on with switches between the live servers.
    if (control.ok()) {
      EXPECT_EQ(migrate(c, moving, 2, 9, job.failed), 2);
    }
    job.target = job.furthest.load() + 10;
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(control.ok()) << control.to_string();
  EXPECT_GE(states_in, 1u);
  EXPECT_EQ(c.coordinator->aborts(), 1u);
  EXPECT_GE(c.coordinator->switches(), 3u);  // the scale-out, then two moves
  // Every request completed; nothing waits anywhere.
  for (auto& w : c.workers)
    EXPECT_EQ(w->operations_in_flight(), 0u) << w->describe_in_flight();
  ASSERT_TRUE(before.has_value() && after.has_value());
  // Right after the abort every range was back with its owner before the
  // scale-out, and the lost server no member any more.
  EXPECT_EQ(after->find_server(kStandby), nullptr) << "the lost server is still a member";
  EXPECT_EQ(after->epoch(), before->epoch() + 2);  // the scale-out, then the abort
  size_t pieces = 0;
  for_each_overlap(*before, *after, [&](uint64_t lo, uint64_t, ServerId was, ServerId is) {
    ++pieces;
    EXPECT_EQ(was, is) << "the range from " << lo;
  });
  EXPECT_GT(pieces, 0u);
  const Placement now = c.coordinator->current_placement();
  EXPECT_EQ(now.find_server(kStandby), nullptr);
  for (const auto& [tensor, chunk] : moving)
    EXPECT_NE(now.owner_of_key(make_key(tensor, chunk)), kStandby);
}

// Without a kill, the lagging tensor's key does not reach the switch while
// the gained keys hold the workers at it: the old owner reports the
// transfer done without it two heartbeat timeouts after the switch, and the
// job goes on (it ships when it gets there).
TEST_P(MigrationAbort, AKeyThatLagsBehindTheSwitchDoesNotHoldTheTransferForever) {
  SumJob::Tensors tensors;
  Cluster c(
      4, 3,
      [](RuntimeOptions& o) {
        o.num_standby = 1;
        o.stats_interval = 20ms;
        o.heartbeat_timeout = 500ms;
      },
      GetParam());
  c.server_tweak = numbered_servers(GetParam());
  ASSERT_TRUE(c.start().ok());
  SumJob job{c, tensors, std::vector<size_t>(4, 16384)};
  job.elems.push_back(16384);
  const std::vector<std::pair<TensorId, uint32_t>> moving = {{1, 0}, {2, 0}, {5, 0}};
  Status control;
  Status s = job.run([&] {
    const uint64_t switches = c.coordinator->switches();
    control = switch_to(c, "the scale-out", [&](const Placement& p) -> Result<PlacementChange> {
      PSLD_ASSIGN_OR_RETURN(PlacementDelta d, scale_out_taking(p, kStandby, moving));
      PSLD_ASSIGN_OR_RETURN(Placement next, p.apply(d));
      return PlacementChange{std::move(next), std::move(d)};
    });
    if (control.ok() &&
        !eventually("the transfer to end", 20s, [&] { return !c.coordinator->switching(); })) {
      control = Timeout("the transfer never ended");
    }
    EXPECT_GT(c.coordinator->switches(), switches);
    job.target = 2 * job.furthest.load() + 10;  // the lagging key gets there too
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(control.ok()) << control.to_string();
  EXPECT_EQ(c.coordinator->aborts(), 0u);
  EXPECT_EQ(c.coordinator->current_placement().owner_of_key(make_key(5, 0)), kStandby);
  EXPECT_GE(c.servers[kStandby]->stats().states_in, moving.size());
  for (auto& w : c.workers)
    EXPECT_EQ(w->operations_in_flight(), 0u) << w->describe_in_flight();
}

// The same with Adam: parameters and both moments are bit-identical to a
// run without any of it (nothing the standby held was applied).
TEST_P(MigrationAbort, AdamIsBitIdenticalAfterAStandbyDiesMidTransfer) {
  Status control;
  const AdamJob with = adam_job(
      GetParam(), 1, 0,
      [&](Cluster& c, const auto& chunks, const std::atomic<bool>&) {
        slow_transfer(c, GetParam());
        auto b = scale_out_and_kill(
            c, chunks, kStandby, GetParam() == "loopback" ? KillAt::kRequested : KillAt::kCommit);
        control = b.ok() ? wait_for_abort(c) : b.status();
      },
      numbered_servers(GetParam()));
  ASSERT_TRUE(control.ok()) << control.to_string();
  ASSERT_TRUE(with.placement.has_value());
  EXPECT_EQ(with.placement->find_server(kStandby), nullptr);
  const AdamJob without = adam_job(GetParam(), 1, with.rounds, nullptr);
  expect_bit_identical(with.params, without.params);
}

// An old owner that dies mid-transfer takes parameters nobody else has: the
// job fails, every worker hears why, and nothing hangs.
TEST_P(MigrationAbort, AnOldOwnerDyingMidTransferFailsTheJobClearly) {
  constexpr size_t kTensors = 8, kN = 16384;
  // Declared before the cluster: a surviving server may still write a pull
  // into a worker's tensor after the request failed, until the cluster stops.
  std::vector<std::vector<std::vector<float>>> tensors(
      4, std::vector<std::vector<float>>(kTensors, std::vector<float>(kN)));
  Cluster c(
      4, 3,
      [](RuntimeOptions& o) {
        o.num_standby = 1;
        o.stats_interval = 20ms;
      },
      GetParam());
  c.server_tweak = numbered_servers(GetParam());
  ASSERT_TRUE(c.start().ok());
  std::vector<std::pair<TensorId, uint32_t>> moving;
  for (TensorId t = 1; t <= kTensors; ++t)
    moving.emplace_back(t, 0);
  // The victim: the owner of the first moving key, which loses it.
  const ServerId victim =
      c.coordinator->current_placement().owner_of_key(make_key(moving[0].first, 0));
  std::atomic<bool> stop{false};
  Status control;
  std::thread controller;
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> results(c.workers.size());
  (void)on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>>& data = tensors[wi];
    std::vector<uint32_t> handles;
    for (size_t t = 0; t < kTensors; ++t) {
      PSLD_ASSIGN_OR_RETURN(uint32_t h, w.register_tensor("t" + std::to_string(t), DType::kFloat32,
                                                          kN * 4, data[t].data(), nullptr));
      handles.push_back(h);
    }
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    for (uint64_t r = 1; r < 100000 && !stop.load(); ++r) {
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < kTensors; ++t) {
        std::fill(data[t].begin(), data[t].end(), static_cast<float>(r % 5));
        auto req = w.submit(handles[t], RequestKind::kPushPull);
        if (!req.ok()) {
          results[wi] = req.status();
          return req.status();
        }
        reqs.push_back(*req);
      }
      for (auto& req : reqs) {
        Status st = req->wait(20s);
        if (!st.ok()) {
          results[wi] = st;
          return st;
        }
      }
      if (wi == 0 && r == 3) {
        controller = std::thread([&] {
          // Held open on loopback, where it would otherwise end within a
          // millisecond of the commit, before a loaded host gets to the kill.
          slow_transfer(c, GetParam());
          control = scale_out_and_kill(c, moving, victim, KillAt::kCommit).status();
          if (!control.ok()) stop = true;
        });
      }
    }
    results[wi] = Internal("the job went on after an old owner died");
    return results[wi];
  });
  stop = true;
  if (controller.joinable()) controller.join();
  ASSERT_TRUE(control.ok()) << control.to_string();
  const Status job = c.coordinator->wait(10s);
  EXPECT_EQ(job.code(), StatusCode::kAborted) << job.to_string();
  const std::string server = fmt::format("server {}", victim);
  EXPECT_NE(job.message().find(server), std::string::npos) << job.to_string();
  EXPECT_NE(job.message().find("held parameters"), std::string::npos) << job.to_string();
  EXPECT_EQ(c.coordinator->aborts(), 0u);
  for (size_t wi = 0; wi < results.size(); ++wi) {
    EXPECT_EQ(results[wi].code(), StatusCode::kAborted) << results[wi].to_string();
    EXPECT_NE(results[wi].message().find("the job failed"), std::string::npos)
        << results[wi].to_string();
    EXPECT_NE(results[wi].message().find(server), std::string::npos) << results[wi].to_string();
    EXPECT_EQ(c.workers[wi]->operations_in_flight(), 0u) << c.workers[wi]->describe_in_flight();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 15s) << "the failure took too long to reach";
}

INSTANTIATE_TEST_SUITE_P(Transports, MigrationAbort, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Transports, Migration, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace psld
