// Consistent checkpoints of a running job and resuming from them
// (docs/checkpoint.md), on the loopback fabric and over UCX: a job resumed
// from its checkpoint of round R, on as many servers or fewer, ends with
// parameters and Adam moments bit-identical to a run that never stopped; a
// torn checkpoint is never used; what does not match the checkpoint is
// refused by name.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "lib/checkpoint/checkpoint.h"
#include "tests/cluster.h"
#include "tests/temp_dir.h"

namespace psld {
namespace {

using psld::testing::TempDir;

namespace fs = std::filesystem;

const std::vector<size_t> kElems = {5, 20000, 40001};
constexpr uint64_t kRounds = 100;
constexpr uint32_t kEvery = 10;

struct JobRun {
  Status status;
  std::vector<std::vector<float>> params;  // worker 0's at the end
  std::map<uint64_t, std::vector<std::vector<float>>>
      at;                                   // worker 0's after rounds kEvery, 2 kEvery, ...
  std::vector<std::vector<float>> resumed;  // worker 0's right after registering
  uint64_t first_round = 0;                 // rounds the tensors started at
  uint64_t checkpoints = 0;
  uint64_t last_checkpoint = 0;
  uint64_t skipped = 0;
};

// 4 workers train three tensors with Adam on integer-valued gradients for
// rounds first+1..kRounds, checkpointing every kEvery rounds into `dir`
// (resuming from it with `resume`). Each round sleeps a little so that the
// coordinator sees the job between checkpoint rounds.
JobRun adam_run(const std::string& backend, const std::string& dir, bool resume,
                uint32_t servers = 3) {
  Cluster c(
      4, servers,
      [&](RuntimeOptions& o) {
        o.mode = ServerMode::kOptimizer;
        o.optimizer.kind = OptimizerKind::kAdam;
        o.optimizer.lr = 0.01f;
        o.stats_interval = 20ms;
        o.heartbeat_interval = 20ms;
        o.checkpoint.dir = dir;
        o.checkpoint.every_rounds = kEvery;
        o.checkpoint.keep = 3;
        o.checkpoint.resume = resume;
      },
      backend);
  JobRun run;
  run.status = c.start();
  if (!run.status.ok()) return run;
  std::atomic<uint64_t> first{UINT64_MAX};
  run.status = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>> data(kElems.size());
    std::vector<uint32_t> handles;
    for (size_t t = 0; t < kElems.size(); ++t) {
      data[t].assign(kElems[t], 0.0f);
      std::vector<float> init(kElems[t]);
      for (size_t i = 0; i < kElems[t]; ++i)
        init[i] = static_cast<float>(i % 7) - 3.0f;
      PSLD_ASSIGN_OR_RETURN(
          uint32_t h, w.register_tensor("p" + std::to_string(t), DType::kFloat32, kElems[t] * 4,
                                        data[t].data(), init.data()));
      handles.push_back(h);
    }
    PSLD_ASSIGN_OR_RETURN(const uint64_t start, w.tensor_round(handles[0]));
    for (uint32_t h : handles) {
      PSLD_ASSIGN_OR_RETURN(const uint64_t r, w.tensor_round(h));
      if (r != start) return Internal(fmt::format("tensors start at rounds {} and {}", start, r));
    }
    if (w.rank() == 0) {
      first = start;
      run.resumed = data;
    }
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    for (uint64_t r = start + 1; r <= kRounds; ++r) {
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < kElems.size(); ++t) {
        for (size_t i = 0; i < kElems[t]; ++i)
          data[t][i] = static_cast<float>((i + w.rank() + r) % 9) - 4.0f;
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      for (auto& req : reqs)
        PSLD_RETURN_IF_ERROR(req->wait(20s).with_context("round " + std::to_string(r)));
      if (w.rank() == 0 && r % kEvery == 0) run.at[r] = data;
      std::this_thread::sleep_for(3ms);
    }
    if (w.rank() == 0) run.params = data;
    return Status::Ok();
  });
  for (auto& w : c.workers)
    (void)w->shutdown();
  (void)c.coordinator->wait(5s);
  for (auto& s : c.servers)
    s->shutdown();
  c.coordinator->shutdown();  // writes a manifest sealed as the job ended
  run.first_round = first.load();
  run.checkpoints = c.coordinator->checkpoints();
  run.last_checkpoint = c.coordinator->last_checkpoint_round();
  run.skipped = c.coordinator->checkpoints_skipped();
  return run;
}

class CheckpointJob : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointJob, AResumedJobEndsBitIdenticalToOneThatNeverStopped) {
  TempDir dir("psld-checkpoint-job");
  ASSERT_FALSE(dir.path().empty());
  const JobRun whole = adam_run(GetParam(), dir.path(), false);
  ASSERT_TRUE(whole.status.ok()) << whole.status.to_string();
  EXPECT_EQ(whole.first_round, 0u);
  EXPECT_EQ(whole.skipped, 0u);
  ASSERT_GE(whole.checkpoints, 2u) << "the coordinator sealed too few rounds to test with";
  const uint64_t r = whole.last_checkpoint;
  ASSERT_GT(r, 0u);
  ASSERT_LT(r, kRounds);
  ASSERT_EQ(r % kEvery, 0u);

  // On 2 servers instead of 3: every key finds its state wherever it lives now.
  const JobRun resumed = adam_run(GetParam(), dir.path(), true, 2);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.to_string();
  EXPECT_EQ(resumed.first_round, r);
  // register_tensor pulled the parameters of round r, as the first run had them.
  expect_bit_identical(resumed.resumed, whole.at.at(r));
  expect_bit_identical(resumed.params, whole.params);
}

// A checkpoint whose manifest was never written (a job killed while its
// servers wrote, or before the coordinator wrote the manifest) is passed
// over, and so is one whose file changed: the job resumes from the newest
// checkpoint that is whole, and still ends bit-identical.
TEST_P(CheckpointJob, ATornOrDamagedCheckpointIsNeverUsed) {
  TempDir dir("psld-checkpoint-job");
  ASSERT_FALSE(dir.path().empty());
  const JobRun whole = adam_run(GetParam(), dir.path(), false);
  ASSERT_TRUE(whole.status.ok()) << whole.status.to_string();
  ASSERT_GE(whole.checkpoints, 3u) << "the coordinator sealed too few rounds to test with";
  const uint64_t newest = whole.last_checkpoint;
  const std::string torn = checkpoint::round_dir(dir.path(), newest);
  ASSERT_TRUE(fs::remove(torn + "/MANIFEST"));
  // And a newer round that a kill stopped in the middle of a file.
  const std::string later = checkpoint::round_dir(dir.path(), newest + kEvery);
  fs::create_directories(later);
  { std::ofstream(later + "/server-0.psck.tmp") << "half a record"; }
  // The one before the newest: a byte of one of its files flipped.
  auto found = checkpoint::find_latest(dir.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  const uint64_t damaged = found->manifest.round;
  ASSERT_LT(damaged, newest);
  {
    std::fstream f(found->dir + "/" + found->manifest.files.at(0).name,
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  found = checkpoint::find_latest(dir.path());
  ASSERT_TRUE(found.ok()) << found.status().to_string();
  ASSERT_LT(found->manifest.round, damaged);
  EXPECT_EQ(found->skipped.size(), 3u);

  const JobRun resumed = adam_run(GetParam(), dir.path(), true);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.to_string();
  EXPECT_EQ(resumed.first_round, found->manifest.round);
  expect_bit_identical(resumed.resumed, whole.at.at(found->manifest.round));
  expect_bit_identical(resumed.params, whole.params);
}

TEST_P(CheckpointJob, NothingToResumeFromFailsTheStartByName) {
  TempDir dir("psld-checkpoint-job");
  ASSERT_FALSE(dir.path().empty());
  const JobRun run = adam_run(GetParam(), dir.path() + "/none", true);
  ASSERT_FALSE(run.status.ok());
  EXPECT_EQ(run.status.code(), StatusCode::kNotFound) << run.status.to_string();
  EXPECT_NE(run.status.message().find("nothing to resume from"), std::string::npos)
      << run.status.to_string();
  EXPECT_NE(run.status.message().find(dir.path() + "/none"), std::string::npos)
      << run.status.to_string();
}

// Tensors are matched by name: one the checkpoint lacks, or one of another
// size, is refused with both sides said.
TEST_P(CheckpointJob, ATensorThatDoesNotMatchTheCheckpointIsRefused) {
  TempDir dir("psld-checkpoint-job");
  ASSERT_FALSE(dir.path().empty());
  const JobRun whole = adam_run(GetParam(), dir.path(), false);
  ASSERT_TRUE(whole.status.ok()) << whole.status.to_string();
  ASSERT_GE(whole.checkpoints, 1u);
  Cluster c(
      1, 1,
      [&](RuntimeOptions& o) {
        o.mode = ServerMode::kOptimizer;
        o.optimizer.kind = OptimizerKind::kAdam;
        o.checkpoint.dir = dir.path();
        o.checkpoint.every_rounds = kEvery;
        o.checkpoint.resume = true;
      },
      GetParam());
  ASSERT_TRUE(c.start().ok());
  WorkerService& w = *c.workers[0];
  std::vector<float> data(kElems[1] + 1);
  auto other = w.register_tensor("p1", DType::kFloat32, data.size() * 4, data.data(), nullptr);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kAlreadyExists) << other.status().to_string();
  EXPECT_NE(other.status().message().find(
                fmt::format("the checkpoint of round {} has it as {} bytes of fp32",
                            whole.last_checkpoint, kElems[1] * 4)),
            std::string::npos)
      << other.status().to_string();
  auto extra = w.register_tensor("extra", DType::kFloat32, 64, data.data(), nullptr);
  ASSERT_FALSE(extra.ok());
  EXPECT_EQ(extra.status().code(), StatusCode::kFailedPrecondition) << extra.status().to_string();
  EXPECT_NE(extra.status().message().find("tensor 'extra' is not in the checkpoint"),
            std::string::npos)
      << extra.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Backends, CheckpointJob, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace psld
