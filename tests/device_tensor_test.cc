// Tensors in CUDA memory on the worker's staged path (lib/worker/device_staging.h),
// run without a GPU: "device memory" is an arena that is inaccessible
// (PROT_NONE) except inside the fake copy engine's copies, so psld touching
// it any other way (a transport reading a push from it, a memcpy of an
// initial value) crashes the test. The fake engine also finishes a copy only
// when polled a few times, as a real stream would, so psld acting on a copy
// before it is done sends stale bytes and the exact sums below fail.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>

#include "kernels/dispatch.h"
#include "lib/worker/device_staging.h"
#include "tests/cluster.h"
#include "tests/eventually.h"
#include "tests/fake_gpu.h"

namespace psld {
namespace {

using namespace std::chrono_literals;

// What the fake engines of one job did, and how they should misbehave.
struct EngineLog {
  std::atomic<int64_t> host_buffers{0};  // allocated and not yet freed
  std::atomic<uint64_t> copies_to_host{0};
  // The copy off the GPU with this number (from 1) fails; 0: none does.
  uint64_t fail_copy_to_host = 0;
};

class FakeCopyEngine final : public CopyEngine {
 public:
  FakeCopyEngine(FakeDevice& device, std::shared_ptr<EngineLog> log)
      : device_(device), log_(std::move(log)) {}
  size_t lanes() const override { return 2; }
  Result<void*> allocate_host(size_t bytes) override {
    void* p = std::malloc(bytes);
    if (p == nullptr) return ResourceExhausted("fake pinned allocation");
    log_->host_buffers.fetch_add(1);
    return p;
  }
  void free_host(void* p) override {
    if (p == nullptr) return;
    std::free(p);
    log_->host_buffers.fetch_sub(1);
  }
  Status copy_async(void* dst, const void* src, size_t bytes, size_t lane) override {
    if (lane >= 2) return InvalidArgument("no such lane");
    // Lane 0 copies off the GPU (DeviceCopier::Direction::kToHost).
    if (lane == 0 && log_->copies_to_host.fetch_add(1) + 1 == log_->fail_copy_to_host) {
      return Unavailable("fake copy failure (as cudaMemcpyAsync's)");
    }
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[lane].push_back({dst, src, bytes, 3});
    return Status::Ok();
  }
  Result<bool> lane_idle(size_t lane) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = lanes_[lane];
    while (!q.empty()) {
      if (--q.front().polls_left > 0) return false;
      device_.copy(q.front().dst, q.front().src, q.front().bytes);
      q.pop_front();
    }
    return true;
  }

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    int polls_left;  // lane_idle calls before the copy happens
  };
  FakeDevice& device_;
  std::shared_ptr<EngineLog> log_;
  std::mutex mu_;
  std::deque<Copy> lanes_[2];
};

class DeviceTensors : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(device_.ok()) << "mmap of the fake device failed"; }

  // Options that make the device arena CUDA memory and fake its copies.
  std::function<void(RuntimeOptions&)> fake_gpu(std::function<void(RuntimeOptions&)> more = {}) {
    return [this, more](RuntimeOptions& o) {
      FakeDevice* dev = &device_;
      auto log = log_;
      o.memory_kind_of = [dev](const void* p) {
        return dev->contains(p) ? MemoryKind::kCuda : MemoryKind::kHost;
      };
      o.copy_engine = [dev, log]() -> Result<std::unique_ptr<CopyEngine>> {
        return std::unique_ptr<CopyEngine>(new FakeCopyEngine(*dev, log));
      };
      if (more) more(o);
    };
  }

  FakeDevice device_{size_t{256} << 20};
  std::shared_ptr<EngineLog> log_ = std::make_shared<EngineLog>();
};

TEST_P(DeviceTensors, StagedPushPullGivesExactSumsWithoutTouchingDeviceMemory) {
  std::vector<size_t> elems = {1, 7, 1000, 16384, 50001};  // chunks of 64 KiB: 0, 1 and 4 tails
  constexpr int kRounds = 20;
  uint64_t total_bytes = 0;
  for (size_t n : elems)
    total_bytes += n * 4;
  {
    Cluster c(2, 2, fake_gpu(), GetParam());
    ASSERT_TRUE(c.start().ok());
    Status s = on_all(c, [&](size_t wi) -> Status {
      WorkerService& w = *c.workers[wi];
      if (w.gpu_path().find("staged") == std::string::npos) {
        return Internal("gpu_path() does not say staged: " + w.gpu_path());
      }
      std::vector<float*> dev;
      std::vector<uint32_t> handles;
      for (size_t t = 0; t < elems.size(); ++t) {
        auto* d = static_cast<float*>(device_.alloc(elems[t] * 4));
        if (d == nullptr) return Internal("fake device full");
        dev.push_back(d);
        PSLD_ASSIGN_OR_RETURN(
            uint32_t h,
            w.register_tensor("t" + std::to_string(t), DType::kFloat32, elems[t] * 4, d, nullptr));
        handles.push_back(h);
      }
      const float rank = static_cast<float>(w.rank());
      for (int r = 1; r <= kRounds; ++r) {
        std::vector<std::shared_ptr<RequestState>> reqs;
        for (size_t t = 0; t < elems.size(); ++t) {
          std::vector<float> grad(elems[t]);
          for (size_t i = 0; i < elems[t]; ++i)
            grad[i] = rank * 1000.0f + static_cast<float>(r) + static_cast<float>(i % 13);
          device_.upload(dev[t], grad);
          PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
          reqs.push_back(req);
        }
        for (auto& req : reqs)
          PSLD_RETURN_IF_ERROR(req->wait(10s));
        for (size_t t = 0; t < elems.size(); ++t) {
          const std::vector<float> got = device_.download(dev[t], elems[t]);
          for (size_t i = 0; i < elems[t]; ++i) {
            // Ranks 0 and 1: 1000 + 2 * (r + i % 13).
            const float want =
                1000.0f + 2.0f * (static_cast<float>(r) + static_cast<float>(i % 13));
            if (got[i] != want) {
              return Internal("round " + std::to_string(r) + " tensor " + std::to_string(t) +
                              " element " + std::to_string(i) + ": " + std::to_string(got[i]) +
                              " != " + std::to_string(want));
            }
          }
        }
      }
      // Every pushed byte left the GPU once per round, every pulled byte came back once.
      if (w.staged_bytes_to_host() != kRounds * total_bytes ||
          w.staged_bytes_to_device() != kRounds * total_bytes) {
        return Internal("copied " + std::to_string(w.staged_bytes_to_host()) + " bytes off and " +
                        std::to_string(w.staged_bytes_to_device()) + " onto the GPU, not " +
                        std::to_string(kRounds * total_bytes) + " each way");
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_GT(log_->host_buffers.load(), 0);
  }
  EXPECT_EQ(log_->host_buffers.load(), 0) << "pinned staging buffers left after shutdown";
}

TEST_P(DeviceTensors, AdamOnADeviceTensorIsBitIdenticalToTheSameTensorInHostMemory) {
  Cluster c(2, 1, fake_gpu([](RuntimeOptions& o) {
              o.mode = ServerMode::kOptimizer;
              o.optimizer.kind = OptimizerKind::kAdam;
              o.optimizer.lr = 0.01f;
            }),
            GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 40000;  // three chunks
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> init(kN), host(kN, 0.0f);
    for (size_t i = 0; i < kN; ++i)
      init[i] = 0.001f * static_cast<float>(i % 1000) - 0.5f;
    auto* dev = static_cast<float*>(device_.alloc(kN * 4));
    if (dev == nullptr) return Internal("fake device full");
    // Worker 0's initial values: from host memory for both tensors.
    PSLD_ASSIGN_OR_RETURN(
        uint32_t hh, w.register_tensor("host", DType::kFloat32, kN * 4, host.data(), init.data()));
    PSLD_ASSIGN_OR_RETURN(uint32_t hd,
                          w.register_tensor("device", DType::kFloat32, kN * 4, dev, init.data()));
    PSLD_RETURN_IF_ERROR(w.barrier(5s));
    for (uint32_t h : {hh, hd}) {
      PSLD_ASSIGN_OR_RETURN(auto pull, w.submit(h, RequestKind::kPull));
      PSLD_RETURN_IF_ERROR(pull->wait(5s));
    }
    if (host != init || device_.download(dev, kN) != init) {
      return Internal("the initial value did not arrive in both tensors");
    }
    for (int r = 1; r <= 8; ++r) {
      std::vector<float> grad(kN);
      for (size_t i = 0; i < kN; ++i)
        grad[i] = std::sin(0.37f * static_cast<float>(i + 11 * r + 101 * w.rank()));
      host = grad;
      device_.upload(dev, grad);
      PSLD_ASSIGN_OR_RETURN(auto a, w.submit(hh, RequestKind::kPushPull));
      PSLD_ASSIGN_OR_RETURN(auto b, w.submit(hd, RequestKind::kPushPull));
      PSLD_RETURN_IF_ERROR(a->wait(10s));
      PSLD_RETURN_IF_ERROR(b->wait(10s));
      const std::vector<float> got = device_.download(dev, kN);
      if (std::memcmp(got.data(), host.data(), kN * 4) != 0) {
        return Internal("round " + std::to_string(r) +
                        ": the device tensor differs from the host one");
      }
    }
    if (host == init) return Internal("Adam changed nothing");
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_P(DeviceTensors, PushThenPullAndAnInitialValueInDeviceMemory) {
  Cluster c(2, 2, fake_gpu(), GetParam());
  ASSERT_TRUE(c.start().ok());
  constexpr size_t kN = 70000;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<float> init(kN);
    for (size_t i = 0; i < kN; ++i)
      init[i] = static_cast<float>(i);
    auto* dev_init = static_cast<float*>(device_.alloc(kN * 4));
    auto* dev = static_cast<float*>(device_.alloc(kN * 4));
    if (dev == nullptr || dev_init == nullptr) return Internal("fake device full");
    device_.upload(dev_init, init);
    PSLD_ASSIGN_OR_RETURN(uint32_t h,
                          w.register_tensor("w", DType::kFloat32, kN * 4, dev, dev_init));
    PSLD_RETURN_IF_ERROR(w.barrier(5s));
    PSLD_ASSIGN_OR_RETURN(auto pull, w.submit(h, RequestKind::kPull));
    PSLD_RETURN_IF_ERROR(pull->wait(5s));
    if (device_.download(dev, kN) != init) return Internal("the initial value did not arrive");
    for (int r = 1; r <= 5; ++r) {
      device_.upload(dev, std::vector<float>(kN, static_cast<float>(r * (w.rank() + 1))));
      PSLD_ASSIGN_OR_RETURN(auto push, w.submit(h, RequestKind::kPush));
      PSLD_RETURN_IF_ERROR(push->wait(5s));
      PSLD_ASSIGN_OR_RETURN(auto p, w.submit(h, RequestKind::kPull));
      PSLD_RETURN_IF_ERROR(p->wait(5s));
      const std::vector<float> got = device_.download(dev, kN);
      for (size_t i = 0; i < kN; ++i) {
        // Sum mode: round r's value is the sum of its pushes, r * (1 + 2).
        if (got[i] != static_cast<float>(3 * r)) {
          return Internal("round " + std::to_string(r) + " element " + std::to_string(i) + ": " +
                          std::to_string(got[i]));
        }
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_P(DeviceTensors, AFailedCopyFailsTheRequestNamingTheTensorAndNothingHangs) {
  log_->fail_copy_to_host = 4;  // chunk 3
  Cluster c(1, 1, fake_gpu(), GetParam());
  ASSERT_TRUE(c.start().ok());
  WorkerService& w = *c.workers[0];
  constexpr size_t kN = 16384 * 6;  // six chunks
  auto* dev = static_cast<float*>(device_.alloc(kN * 4));
  ASSERT_NE(dev, nullptr);
  auto h = w.register_tensor("grad", DType::kFloat32, kN * 4, dev, nullptr);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  auto req = w.submit(*h, RequestKind::kPushPull);
  ASSERT_TRUE(req.ok());
  Status s = (*req)->wait(10s);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("tensor 'grad' chunk 3"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("fake copy failure"), std::string::npos) << s.to_string();
  // The other chunks finish or fail, none is left behind.
  EXPECT_TRUE(eventually(
      "every chunk to finish", 2s, [&] { return w.operations_in_flight() == 0; }, 10ms));
  EXPECT_EQ(w.operations_in_flight(), 0u) << w.describe_in_flight();
}

TEST_P(DeviceTensors, DirectWhereTheTransportCannotIsAClearErrorThatRegistersNothing) {
  Cluster c(1, 1, fake_gpu([](RuntimeOptions& o) { o.gpu_path = GpuPath::kDirect; }), GetParam());
  ASSERT_TRUE(c.start().ok());
  WorkerService& w = *c.workers[0];
  void* dev = device_.alloc(4096);
  auto h = w.register_tensor("emb", DType::kFloat32, 4096, dev, nullptr);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(h.status().message().find("tensor 'emb' is in CUDA memory"), std::string::npos)
      << h.status().to_string();
  EXPECT_NE(h.status().message().find("data.gpu_path = direct"), std::string::npos)
      << h.status().to_string();
  // Nothing reached the coordinator: the name is still free for any size.
  std::vector<float> host(10);
  EXPECT_TRUE(w.register_tensor("emb", DType::kFloat32, 40, host.data(), nullptr).ok());
  EXPECT_EQ(log_->host_buffers.load(), 0);
}

TEST_P(DeviceTensors, NoCopyEngineIsAClearErrorNamingTheTensor) {
  Cluster c(1, 1, fake_gpu([](RuntimeOptions& o) {
              o.copy_engine = []() -> Result<std::unique_ptr<CopyEngine>> {
                return Unavailable("no CUDA device: cudaGetDeviceCount found none");
              };
            }),
            GetParam());
  ASSERT_TRUE(c.start().ok());
  auto h = c.workers[0]->register_tensor("w", DType::kFloat32, 64, device_.alloc(64), nullptr);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(h.status().message().find("tensor 'w' is in CUDA memory"), std::string::npos)
      << h.status().to_string();
  EXPECT_NE(h.status().message().find("no CUDA device"), std::string::npos)
      << h.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Transports, DeviceTensors, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

// ---- the choice and its description

struct NoHandler final : transport::Handler {
  void on_write(const transport::ConnectionPtr&, uint32_t, uint64_t) override {}
  void on_message(const transport::ConnectionPtr&, std::span<const uint8_t>) override {}
};

TEST(GpuPath, AutoStagesWhereTheTransportRegistersHostMemoryOnly) {
  transport::TransportOptions o;
  o.loopback.fabric = std::make_shared<transport::LoopbackFabric>();
  NoHandler handler;
  auto t = transport::create_transport("loopback", o, &handler);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const GpuPathChoice a = choose_gpu_path(GpuPath::kAuto, **t);
  EXPECT_TRUE(a.possible);
  EXPECT_FALSE(a.direct);
  EXPECT_EQ(a.text.rfind("staged through pinned host memory: ", 0), 0u) << a.text;
  EXPECT_NE(a.text.find("loopback"), std::string::npos) << a.text;
  const GpuPathChoice d = choose_gpu_path(GpuPath::kDirect, **t);
  EXPECT_FALSE(d.possible);
  EXPECT_NE(d.text.find("cannot register CUDA memory"), std::string::npos) << d.text;
  const GpuPathChoice s = choose_gpu_path(GpuPath::kStaged, **t);
  EXPECT_TRUE(s.possible);
  EXPECT_FALSE(s.direct);
  const std::string line = describe_gpu_path(GpuPath::kAuto, **t);
  if (kernels::cuda_device_present()) {
    EXPECT_EQ(line, a.text);
  } else {
    EXPECT_EQ(line.rfind("none here (", 0), 0u) << line;
    EXPECT_NE(line.find("a CUDA tensor would go staged"), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace psld
