// The pure Aggregator (lib/server/aggregator.h) alone, without a Cluster:
// every sync mode x dtype x server mode / optimizer, on host memory and on
// the fake GPU of tests/fake_gpu.h (whose memory the host cannot touch and
// whose work runs only when the lane is waited for), against a reference
// written here from the definitions (a round's sum of the workers' pushes,
// then one update; async: one update per push).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "lib/server/aggregator.h"
#include "tests/fake_gpu.h"

namespace psld {
namespace {

using Admission = Aggregator::Admission;

constexpr uint32_t kWorkers = 3;
constexpr size_t kN = 77;  // not a multiple of any vector width

enum class Update { kSum, kSgd, kMomentum, kNesterov, kAdam, kAdamW };

const char* update_name(Update u) {
  switch (u) {
    case Update::kSum:
      return "Sum";
    case Update::kSgd:
      return "Sgd";
    case Update::kMomentum:
      return "Momentum";
    case Update::kNesterov:
      return "Nesterov";
    case Update::kAdam:
      return "Adam";
    case Update::kAdamW:
      return "AdamW";
  }
  return "?";
}

AggregatorOptions options_for(SyncMode sync, Update u) {
  AggregatorOptions o;
  o.sync = sync;
  o.staleness = sync == SyncMode::kStaleness ? 1 : 0;
  o.num_workers = kWorkers;
  o.mode = u == Update::kSum ? ServerMode::kSum : ServerMode::kOptimizer;
  o.optimizer.lr = 0.125f;
  o.optimizer.weight_decay = 0.0625f;
  switch (u) {
    case Update::kSum:
    case Update::kSgd:
      o.optimizer.kind = OptimizerKind::kSgd;
      break;
    case Update::kMomentum:
    case Update::kNesterov:
      o.optimizer.kind = OptimizerKind::kMomentum;
      o.optimizer.momentum = 0.9f;
      o.optimizer.nesterov = u == Update::kNesterov;
      break;
    case Update::kAdam:
      o.optimizer.kind = OptimizerKind::kAdam;
      break;
    case Update::kAdamW:
      o.optimizer.kind = OptimizerKind::kAdamW;
      break;
  }
  return o;
}

// A push in the wire dtype: values that fp16 and bf16 hold exactly.
std::vector<uint8_t> encode(DType dtype, const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * protocol::dtype_bytes(dtype));
  if (dtype == DType::kFloat32) {
    std::memcpy(out.data(), v.data(), out.size());
  } else if (dtype == DType::kFloat16) {
    kernels::f32_to_f16(reinterpret_cast<uint16_t*>(out.data()), v.data(), v.size());
  } else {
    kernels::f32_to_bf16(reinterpret_cast<uint16_t*>(out.data()), v.data(), v.size());
  }
  return out;
}

std::vector<float> decode(DType dtype, const void* p, size_t n) {
  std::vector<float> out(n);
  if (dtype == DType::kFloat32) {
    std::memcpy(out.data(), p, n * sizeof(float));
  } else if (dtype == DType::kFloat16) {
    kernels::f16_to_f32(out.data(), static_cast<const uint16_t*>(p), n);
  } else {
    kernels::bf16_to_f32(out.data(), static_cast<const uint16_t*>(p), n);
  }
  return out;
}

std::vector<float> push_values(uint64_t round, uint32_t worker) {
  std::vector<float> v(kN);
  for (size_t i = 0; i < kN; ++i) {
    const int q = static_cast<int>((i * 7 + round * 5 + worker * 3) % 33) - 16;
    v[i] = static_cast<float>(q) / 4.0f;  // multiples of 1/4 in [-4, 4]
  }
  return v;
}

// The reference: the parameter in fp32 and the optimizer's buffers.
struct Reference {
  AggregatorOptions o;
  Update u;
  std::vector<float> param = std::vector<float>(kN, 0.0f);
  std::vector<float> m = std::vector<float>(kN, 0.0f);
  std::vector<float> v = std::vector<float>(kN, 0.0f);
  uint64_t updates = 0;

  // One update with gradient (or sum) g.
  void update(const std::vector<float>& g, bool bsp) {
    const OptimizerOptions& p = o.optimizer;
    switch (u) {
      case Update::kSum:
        if (bsp) {
          param = g;  // the round's sum
        } else {
          for (size_t i = 0; i < kN; ++i)
            param[i] += g[i];  // the running total
        }
        break;
      case Update::kSgd:
        kernels::sgd_f32(param.data(), g.data(), kN, {p.lr, p.weight_decay});
        break;
      case Update::kMomentum:
      case Update::kNesterov:
        kernels::momentum_f32(
            param.data(), m.data(), g.data(), kN,
            {p.lr, p.momentum, p.dampening, p.weight_decay, p.nesterov, updates == 0});
        break;
      case Update::kAdam:
      case Update::kAdamW:
        kernels::adam_f32(
            param.data(), m.data(), v.data(), g.data(), kN,
            {p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, u == Update::kAdamW, updates + 1});
        break;
    }
    ++updates;
  }
  // What a pull reads, in the key's dtype, back in fp32.
  std::vector<float> output(DType dtype) const {
    std::vector<uint8_t> wire = encode(dtype, param);
    return decode(dtype, wire.data(), kN);
  }
};

// Where the key lives: host memory or the fake GPU.
class Memory {
 public:
  explicit Memory(bool gpu) {
    if (gpu) {
      device_ = std::make_unique<FakeServerDevice>(arena_, 2, log_);
      lane_ = ComputeLane(device_.get(), 1);
    }
  }
  ComputeLane& lane() { return lane_; }
  ServerDeviceLog& log() { return *log_; }
  bool ok() const { return arena_.ok(); }

 private:
  FakeDevice arena_{size_t{64} << 20};
  std::shared_ptr<ServerDeviceLog> log_ = std::make_shared<ServerDeviceLog>();
  std::unique_ptr<ServerDevice> device_;
  ComputeLane lane_;
};

std::vector<float> output_of(const Aggregator& a) {
  return decode(a.dtype(), a.output(), a.size());
}

using Case = std::tuple<SyncMode, DType, Update, bool>;

class AggregatorMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(AggregatorMatrix, MatchesTheReferenceRoundByRound) {
  const auto [sync, dtype, update, gpu] = GetParam();
  Memory mem(gpu);
  ASSERT_TRUE(mem.ok());
  const AggregatorOptions o = options_for(sync, update);
  Aggregator agg(o, dtype, kN * protocol::dtype_bytes(dtype));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  EXPECT_EQ(agg.size(), kN);
  EXPECT_EQ(output_of(agg), std::vector<float>(kN, 0.0f)) << "a new key reads zeros";

  Reference ref{o, update};
  const bool bsp = sync == SyncMode::kBsp;
  for (uint64_t round = 1; round <= 5; ++round) {
    std::vector<float> sum(kN, 0.0f);
    for (uint32_t w = 0; w < kWorkers; ++w) {
      const std::vector<float> g = push_values(round, w);
      const std::vector<uint8_t> wire = encode(dtype, g);
      if (bsp) {
        ASSERT_EQ(agg.admit(w, round), Admission::kNow);
        EXPECT_FALSE(agg.round_complete());
        ASSERT_TRUE(agg.reduce(mem.lane(), w, round, wire.data()).ok());
        for (size_t i = 0; i < kN; ++i)
          sum[i] += g[i];
      } else {
        ASSERT_TRUE(agg.reduce(mem.lane(), w, round, wire.data()).ok());
        ASSERT_TRUE(agg.apply(mem.lane()).ok());
        ref.update(g, false);
        ASSERT_EQ(output_of(agg), ref.output(dtype)) << "round " << round << ", worker " << w;
      }
    }
    if (bsp) {
      ASSERT_TRUE(agg.round_complete());
      EXPECT_FALSE(agg.pull_ready(round));
      ASSERT_TRUE(agg.apply(mem.lane()).ok());
      ref.update(sum, true);
      EXPECT_TRUE(agg.pull_ready(round));
      EXPECT_FALSE(agg.pull_ready(round + 1));
      ASSERT_EQ(output_of(agg), ref.output(dtype)) << "round " << round;
    }
    EXPECT_EQ(agg.version(), ref.updates);
  }
  if (gpu) {
    EXPECT_GT(mem.log().launches.load() + mem.log().copies.load(), 0u);
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [sync, dtype, update, gpu] = info.param;
  const char* s = sync == SyncMode::kBsp ? "Bsp" : sync == SyncMode::kAsync ? "Async" : "Stale";
  return std::string(s) + "_" + std::string(protocol::dtype_name(dtype)) + "_" +
         update_name(update) + (gpu ? "_FakeGpu" : "_Host");
}

INSTANTIATE_TEST_SUITE_P(
    All, AggregatorMatrix,
    ::testing::Combine(::testing::Values(SyncMode::kBsp, SyncMode::kAsync, SyncMode::kStaleness),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(Update::kSum, Update::kSgd, Update::kMomentum,
                                         Update::kNesterov, Update::kAdam, Update::kAdamW),
                       ::testing::Bool()),
    case_name);

TEST(Aggregator, BspSumIsExactOnIntegers) {
  Memory mem(false);
  Aggregator agg(options_for(SyncMode::kBsp, Update::kSum), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  for (uint32_t w = 0; w < kWorkers; ++w) {
    std::vector<float> g(kN, static_cast<float>(w + 1));
    ASSERT_TRUE(agg.reduce(mem.lane(), w, 1, g.data()).ok());
  }
  ASSERT_TRUE(agg.apply(mem.lane()).ok());
  EXPECT_EQ(output_of(agg), std::vector<float>(kN, 6.0f));  // 1 + 2 + 3
}

TEST(Aggregator, BspAdmitsEachWorkerOncePerRound) {
  Memory mem(false);
  Aggregator agg(options_for(SyncMode::kBsp, Update::kSum), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  std::vector<float> g(kN, 1.0f);
  EXPECT_EQ(agg.admit(0, 0), Admission::kApplied) << "round 0 is the initial value";
  EXPECT_EQ(agg.admit(0, 2), Admission::kLater);
  EXPECT_EQ(agg.admit(0, 1), Admission::kNow);
  ASSERT_TRUE(agg.reduce(mem.lane(), 0, 1, g.data()).ok());
  EXPECT_EQ(agg.admit(0, 1), Admission::kTwice);
  EXPECT_EQ(agg.admit(1, 1), Admission::kNow);
  ASSERT_TRUE(agg.reduce(mem.lane(), 1, 1, g.data()).ok());
  ASSERT_TRUE(agg.reduce(mem.lane(), 2, 1, g.data()).ok());
  ASSERT_TRUE(agg.round_complete());
  ASSERT_TRUE(agg.apply(mem.lane()).ok());
  EXPECT_EQ(agg.version(), 1u);
  EXPECT_FALSE(agg.round_complete()) << "a new round starts empty";
  EXPECT_EQ(agg.admit(0, 1), Admission::kApplied);
  EXPECT_EQ(agg.admit(0, 2), Admission::kNow) << "the next round, from every worker again";
}

TEST(Aggregator, StalenessHoldsPullsUntilTheSlowestWorkerIsCloseEnough) {
  Memory mem(false);
  AggregatorOptions o = options_for(SyncMode::kStaleness, Update::kSum);
  o.staleness = 2;
  Aggregator agg(o, DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  std::vector<float> g(kN, 1.0f);
  EXPECT_TRUE(agg.pull_ready(2));
  EXPECT_FALSE(agg.pull_ready(3)) << "no worker pushed anything yet";
  for (uint64_t r = 1; r <= 5; ++r) {
    ASSERT_TRUE(agg.reduce(mem.lane(), 0, r, g.data()).ok());
    ASSERT_TRUE(agg.apply(mem.lane()).ok());
  }
  ASSERT_TRUE(agg.reduce(mem.lane(), 1, 4, g.data()).ok());
  ASSERT_TRUE(agg.apply(mem.lane()).ok());
  EXPECT_FALSE(agg.pull_ready(3)) << "worker 2 has pushed nothing";
  ASSERT_TRUE(agg.reduce(mem.lane(), 2, 1, g.data()).ok());
  ASSERT_TRUE(agg.apply(mem.lane()).ok());
  EXPECT_TRUE(agg.pull_ready(3));
  EXPECT_FALSE(agg.pull_ready(4));
  EXPECT_EQ(output_of(agg), std::vector<float>(kN, 7.0f)) << "every push counted once";
}

TEST(Aggregator, AppliedBeforeCountsRoundsInBspAndPushesInAsync) {
  Memory mem(false);
  std::vector<float> g(kN, 1.0f);
  Aggregator bsp(options_for(SyncMode::kBsp, Update::kSum), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(bsp.allocate(mem.lane()).ok());
  EXPECT_TRUE(bsp.applied_before(1, 0));
  EXPECT_FALSE(bsp.applied_before(2, 0));
  for (uint32_t w = 0; w < kWorkers; ++w)
    ASSERT_TRUE(bsp.reduce(mem.lane(), w, 1, g.data()).ok());
  ASSERT_TRUE(bsp.apply(mem.lane()).ok());
  EXPECT_TRUE(bsp.applied_before(2, 0));

  // Async, a run that began at switch round 3: rounds 3 and 4 from every
  // worker come before switch round 5, in any order.
  Aggregator async(options_for(SyncMode::kAsync, Update::kSum), DType::kFloat32,
                   kN * sizeof(float));
  ASSERT_TRUE(async.allocate(mem.lane()).ok());
  EXPECT_FALSE(async.applied_before(5, 3));
  for (uint32_t w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(async.reduce(mem.lane(), w, 4, g.data()).ok());
    ASSERT_TRUE(async.apply(mem.lane()).ok());
  }
  EXPECT_FALSE(async.applied_before(5, 3));
  for (uint32_t w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(async.reduce(mem.lane(), w, 3, g.data()).ok());
    ASSERT_TRUE(async.apply(mem.lane()).ok());
  }
  EXPECT_TRUE(async.applied_before(5, 3));
}

// Which pushes of each worker an async key holds, out of order and far
// ahead, and the record a replication copy carries of it.
TEST(Aggregator, AsyncRemembersWhichPushesItHoldsAndCopiesThatRecord) {
  Memory mem(false);
  std::vector<float> g(kN, 1.0f);
  Aggregator agg(options_for(SyncMode::kAsync, Update::kSum), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  auto push = [&](uint32_t w, uint64_t r) {
    ASSERT_TRUE(agg.reduce(mem.lane(), w, r, g.data()).ok());
    ASSERT_TRUE(agg.apply(mem.lane()).ok());
  };
  EXPECT_FALSE(agg.applied(0, 1));
  push(0, 2);  // round 1 of worker 0 not in yet
  push(0, 4);
  EXPECT_FALSE(agg.applied(0, 1));
  EXPECT_TRUE(agg.applied(0, 2));
  EXPECT_FALSE(agg.applied(0, 3));
  EXPECT_TRUE(agg.applied(0, 4));
  EXPECT_FALSE(agg.applied(1, 2)) << "per worker";
  push(0, 1);
  push(0, 3);
  for (uint64_t r = 1; r <= 4; ++r)
    EXPECT_TRUE(agg.applied(0, r)) << r;
  EXPECT_FALSE(agg.applied(0, 5));
  // Round 70 of worker 1, with rounds 1..5 missing: the window (64 rounds)
  // moves on, and what it leaves behind counts as in.
  push(1, 70);
  EXPECT_TRUE(agg.applied(1, 70));
  EXPECT_TRUE(agg.applied(1, 6)) << "left behind by the window";
  EXPECT_FALSE(agg.applied(1, 7));
  EXPECT_FALSE(agg.applied(1, 69));
  EXPECT_FALSE(agg.applied(1, 71));

  // The record travels with a copy, and a backup that installs it takes
  // the same pushes as in.
  ASSERT_EQ(agg.seen_bytes(), kWorkers * 2 * sizeof(uint64_t));
  std::vector<uint8_t> record(agg.seen_bytes());
  agg.save_seen(record.data());
  Aggregator backup(options_for(SyncMode::kAsync, Update::kSum), DType::kFloat32,
                    kN * sizeof(float));
  ASSERT_TRUE(backup.allocate(mem.lane()).ok());
  backup.restore_seen(record.data());
  for (uint32_t w = 0; w < kWorkers; ++w) {
    for (uint64_t r = 1; r <= 80; ++r)
      EXPECT_EQ(backup.applied(w, r), agg.applied(w, r)) << w << " " << r;
  }
  Aggregator bsp(options_for(SyncMode::kBsp, Update::kSum), DType::kFloat32, kN * sizeof(float));
  EXPECT_EQ(bsp.seen_bytes(), 0u) << "a BSP round says it all";
  std::vector<uint8_t> untouched(64, 0xA5);
  bsp.save_seen(untouched.data());
  EXPECT_EQ(untouched, std::vector<uint8_t>(64, 0xA5)) << "BSP copies carry no record";
}

TEST(Aggregator, InitialValueIsWrittenAsIs) {
  for (bool gpu : {false, true}) {
    Memory mem(gpu);
    Aggregator agg(options_for(SyncMode::kBsp, Update::kAdam), DType::kBFloat16, kN * 2);
    ASSERT_TRUE(agg.allocate(mem.lane()).ok());
    const std::vector<float> init = push_values(9, 1);
    const std::vector<uint8_t> wire = encode(DType::kBFloat16, init);
    ASSERT_TRUE(agg.set_initial(mem.lane(), wire.data()).ok());
    EXPECT_EQ(output_of(agg), init) << (gpu ? "fake GPU" : "host");
    EXPECT_EQ(agg.version(), 0u);
    EXPECT_EQ(agg.admit(0, 1), Admission::kNow) << "the initial value counts as no push";
  }
}

// Migration: a state saved on one server and restored on another (host or
// device, either way) continues bit-identically.
TEST(Aggregator, SavedStateContinuesBitIdenticallyElsewhere) {
  for (auto [from_gpu, to_gpu] : {std::pair{false, true}, std::pair{true, false}}) {
    Memory from_mem(from_gpu), to_mem(to_gpu), ref_mem(false);
    const AggregatorOptions o = options_for(SyncMode::kBsp, Update::kAdamW);
    Aggregator moving(o, DType::kFloat32, kN * sizeof(float));
    Aggregator staying(o, DType::kFloat32, kN * sizeof(float));
    ASSERT_TRUE(moving.allocate(from_mem.lane()).ok());
    ASSERT_TRUE(staying.allocate(ref_mem.lane()).ok());
    auto run_round = [&](Aggregator& a, ComputeLane& lane, uint64_t round) {
      for (uint32_t w = 0; w < kWorkers; ++w) {
        const std::vector<float> g = push_values(round, w);
        ASSERT_TRUE(a.reduce(lane, w, round, g.data()).ok());
      }
      ASSERT_TRUE(a.apply(lane).ok());
    };
    for (uint64_t r = 1; r <= 3; ++r) {
      run_round(moving, from_mem.lane(), r);
      run_round(staying, ref_mem.lane(), r);
    }
    std::vector<float> state(3 * kN, -1.0f);
    ASSERT_TRUE(moving.save(from_mem.lane(), state.data()).ok());
    Aggregator arrived(o, DType::kFloat32, kN * sizeof(float));
    ASSERT_TRUE(arrived.allocate(to_mem.lane()).ok());
    ASSERT_TRUE(arrived.restore(to_mem.lane(), state.data(), moving.version(), 3).ok());
    EXPECT_EQ(arrived.version(), 3u);
    EXPECT_EQ(output_of(arrived), output_of(staying));
    for (uint64_t r = 4; r <= 6; ++r) {
      run_round(arrived, to_mem.lane(), r);
      run_round(staying, ref_mem.lane(), r);
    }
    EXPECT_EQ(output_of(arrived), output_of(staying))
        << (from_gpu ? "fake GPU -> host" : "host -> fake GPU");
  }
}

TEST(Aggregator, SaveWritesZerosForMomentsTheOptimizerDoesNotKeep) {
  Memory mem(false);
  Aggregator agg(options_for(SyncMode::kBsp, Update::kSgd), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  std::vector<float> state(3 * kN, -1.0f);
  ASSERT_TRUE(agg.save(mem.lane(), state.data()).ok());
  EXPECT_EQ(state, std::vector<float>(3 * kN, 0.0f));
}

// A replica's copy: the first `arrays` arrays only, nothing written past them.
TEST(Aggregator, SaveOfFewerArraysWritesOnlyThose) {
  Memory mem(false);
  Aggregator agg(options_for(SyncMode::kBsp, Update::kSgd), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  for (size_t arrays : {1u, 2u}) {
    std::vector<float> state(3 * kN, -1.0f);
    ASSERT_TRUE(agg.save(mem.lane(), state.data(), arrays).ok());
    for (size_t i = 0; i < state.size(); ++i) {
      ASSERT_EQ(state[i], i < arrays * kN ? 0.0f : -1.0f) << arrays << " arrays, float " << i;
    }
  }
}

TEST(Aggregator, SwappingOnApplyGivesTheSameSumsAsCopying) {
  Memory mem(false);
  const AggregatorOptions o = options_for(SyncMode::kBsp, Update::kSum);
  Aggregator swapping(o, DType::kFloat32, kN * sizeof(float));
  Aggregator copying(o, DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(swapping.allocate(mem.lane()).ok());
  ASSERT_TRUE(copying.allocate(mem.lane()).ok());
  ASSERT_TRUE(swapping.can_swap(mem.lane()));
  swapping.swap_on_apply();
  for (uint64_t r = 1; r <= 4; ++r) {
    const void* before = swapping.output();
    for (uint32_t w = 0; w < kWorkers; ++w) {
      const std::vector<float> g = push_values(r, w);
      ASSERT_TRUE(swapping.reduce(mem.lane(), w, r, g.data()).ok());
      ASSERT_TRUE(copying.reduce(mem.lane(), w, r, g.data()).ok());
    }
    ASSERT_TRUE(swapping.apply(mem.lane()).ok());
    ASSERT_TRUE(copying.apply(mem.lane()).ok());
    EXPECT_NE(swapping.output(), before) << "the accumulator became the parameter";
    EXPECT_EQ(output_of(swapping), output_of(copying)) << "round " << r;
  }
  Aggregator f16(o, DType::kFloat16, kN * 2);
  EXPECT_FALSE(f16.can_swap(mem.lane())) << "only fp32 keys are applied by swapping";
  Memory gpu(true);
  EXPECT_FALSE(swapping.can_swap(gpu.lane())) << "nor keys on a device";
}

TEST(Aggregator, DeviceFaultIsAnErrorNotACrash) {
  Memory mem(true);
  Aggregator agg(options_for(SyncMode::kBsp, Update::kAdam), DType::kFloat32, kN * sizeof(float));
  ASSERT_TRUE(agg.allocate(mem.lane()).ok());
  std::vector<float> g(kN, 1.0f);
  for (uint32_t w = 0; w < kWorkers; ++w)
    ASSERT_TRUE(agg.reduce(mem.lane(), w, 1, g.data()).ok());
  mem.log().fault_launch = mem.log().launches.load() + 1;  // the next kernel faults
  Status st = agg.apply(mem.lane());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("fake kernel fault"), std::string::npos) << st.to_string();
  EXPECT_EQ(agg.version(), 0u) << "a failed round is not applied";
}

}  // namespace
}  // namespace psld
