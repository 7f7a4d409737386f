// Servers that keep their keys in GPU memory and reduce and update them with
// the GPU's kernels (server.device = cuda; lib/server/server_device.h), run on the
// fake GPU of tests/fake_gpu.h: the keys' memory is inaccessible to the host
// and the fake's copies and kernels run only when the server waits for them,
// so a server that touches a key from the host crashes the test and one that
// serves a pull before its update finished sends stale bytes.
//
// The last test uses the real CUDA device where there is one, and otherwise
// checks that asking for it fails clearly.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/dispatch.h"
#include "tests/cluster.h"
#include "tests/fake_gpu.h"

namespace psld {
namespace {

using namespace std::chrono_literals;

class GpuServers : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(arena_.ok()) << "mmap of the fake device failed"; }

  // Options that give every server a fake GPU.
  std::function<void(RuntimeOptions&)> gpu_servers(std::function<void(RuntimeOptions&)> more = {}) {
    return [this, more](RuntimeOptions& o) {
      o.server_device = ServerDeviceKind::kCuda;
      o.server_device_factory = fake_factory();
      if (more) more(o);
    };
  }
  std::function<Result<std::unique_ptr<ServerDevice>>(size_t)> fake_factory() {
    FakeDevice* arena = &arena_;
    auto log = log_;
    return [arena, log](size_t lanes) -> Result<std::unique_ptr<ServerDevice>> {
      return std::unique_ptr<ServerDevice>(new FakeServerDevice(*arena, lanes, log));
    };
  }
  // Every device and pinned allocation was given back.
  void expect_all_freed() {
    EXPECT_EQ(log_->live.load(), 0) << "device allocations never freed";
    EXPECT_EQ(log_->live_host.load(), 0) << "pinned host allocations never freed";
    EXPECT_EQ(log_->live_pins.load(), 0) << "landing slots never unpinned";
    EXPECT_EQ(log_->bad_frees.load(), 0u);
  }

  FakeDevice arena_{size_t{1} << 30};
  std::shared_ptr<ServerDeviceLog> log_ = std::make_shared<ServerDeviceLog>();
};

// One tensor of a job: its dtype, elements, and the worker's memory for it.
struct Tensor {
  DType dtype;
  size_t n;
  std::vector<float> f32;
  std::vector<uint16_t> half;  // fp16 or bf16
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : half.data(); }
  uint64_t bytes() const { return n * protocol::dtype_bytes(dtype); }
  void set(const std::vector<float>& v) {
    if (dtype == DType::kFloat32) {
      f32 = v;
    } else if (dtype == DType::kFloat16) {
      kernels::f32_to_f16(half.data(), v.data(), n);
    } else {
      kernels::f32_to_bf16(half.data(), v.data(), n);
    }
  }
  std::vector<float> get() const {
    if (dtype == DType::kFloat32) return f32;
    std::vector<float> out(n);
    if (dtype == DType::kFloat16) {
      kernels::f16_to_f32(out.data(), half.data(), n);
    } else {
      kernels::bf16_to_f32(out.data(), half.data(), n);
    }
    return out;
  }
};

std::vector<Tensor> make_tensors(const std::vector<std::pair<DType, size_t>>& shapes) {
  std::vector<Tensor> out;
  for (auto [dtype, n] : shapes) {
    Tensor t{dtype, n, {}, {}};
    if (dtype == DType::kFloat32) {
      t.f32.assign(n, 0.0f);
    } else {
      t.half.assign(n, 0);
    }
    out.push_back(std::move(t));
  }
  return out;
}

// fp32, fp16 and bf16 tensors of 1 element to several 64 KiB chunks, BSP
// sums of integer values (exact in every dtype) over 8 rounds, two server
// threads (two lanes) per server.
TEST_P(GpuServers, SumsOfEveryDtypeAreExactWithKeysInGpuMemory) {
  const std::vector<std::pair<DType, size_t>> shapes = {
      {DType::kFloat32, 1},     {DType::kFloat32, 1000},  {DType::kFloat32, 50001},
      {DType::kFloat16, 7},     {DType::kFloat16, 40000}, {DType::kBFloat16, 3},
      {DType::kBFloat16, 33000}};
  {
    Cluster c(2, 2, gpu_servers([](RuntimeOptions& o) {
                o.mode = ServerMode::kSum;
                o.server_threads = 2;
              }),
              GetParam());
    ASSERT_TRUE(c.start().ok());
    Status s = on_all(c, [&](size_t wi) -> Status {
      WorkerService& w = *c.workers[wi];
      std::vector<Tensor> tensors = make_tensors(shapes);
      std::vector<uint32_t> handles;
      for (size_t t = 0; t < tensors.size(); ++t) {
        PSLD_ASSIGN_OR_RETURN(uint32_t h,
                              w.register_tensor("t" + std::to_string(t), tensors[t].dtype,
                                                tensors[t].bytes(), tensors[t].data(), nullptr));
        handles.push_back(h);
      }
      const float rank = static_cast<float>(w.rank());
      for (int r = 1; r <= 8; ++r) {
        std::vector<std::shared_ptr<RequestState>> reqs;
        for (size_t t = 0; t < tensors.size(); ++t) {
          std::vector<float> v(tensors[t].n);
          for (size_t i = 0; i < v.size(); ++i)
            v[i] = rank * 8.0f + static_cast<float>(r) + static_cast<float>(i % 5);
          tensors[t].set(v);
          PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
          reqs.push_back(req);
        }
        for (auto& req : reqs)
          PSLD_RETURN_IF_ERROR(req->wait(10s).with_context("round " + std::to_string(r)));
        for (size_t t = 0; t < tensors.size(); ++t) {
          const std::vector<float> got = tensors[t].get();
          for (size_t i = 0; i < got.size(); ++i) {
            // Ranks 0 and 1: 8 + 2 * (r + i % 5).
            const float want = 8.0f + 2.0f * (static_cast<float>(r) + static_cast<float>(i % 5));
            if (got[i] != want) {
              return Internal(fmt::format("round {} tensor {} ({}) element {}: {} != {}", r, t,
                                          protocol::dtype_name(tensors[t].dtype), i, got[i], want));
            }
          }
        }
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
    // Every push went through the device: a copy in, a kernel or a copy
    // into the accumulator, and a copy out per update.
    EXPECT_GT(log_->launches.load(), 0u);
    EXPECT_GT(log_->copies.load(), 0u);
    // Each worker's landing slots on each server, pinned, and the pushes
    // copied from them.
    EXPECT_EQ(log_->pins.load(), 2u * 2u);
    EXPECT_GE(log_->copies_from_pinned.load(), 2u * 8u * 12u);
    uint64_t pushes = 0;
    for (auto& srv : c.servers)
      pushes += srv->stats().pushes;
    // 12 keys (64 KiB chunks: 1 + 1 + 4 fp32, 1 + 2 fp16, 1 + 2 bf16).
    EXPECT_EQ(pushes, 2u * 8u * 12u);
  }
  expect_all_freed();
}

// Adam (fp32 and bf16 keys) and SGD with Nesterov momentum: servers on the
// GPU give the very bits servers on the CPU give.
std::vector<std::vector<float>> optimizer_job(const std::string& backend, OptimizerKind kind,
                                              const std::function<void(RuntimeOptions&)>& gpu) {
  Cluster c(
      3, 2,
      [&](RuntimeOptions& o) {
        o.mode = ServerMode::kOptimizer;
        o.optimizer.kind = kind;
        o.optimizer.lr = 0.01f;
        o.optimizer.weight_decay = 0.001f;
        if (kind == OptimizerKind::kMomentum) {
          o.optimizer.momentum = 0.9f;
          o.optimizer.nesterov = true;
        }
        if (gpu) gpu(o);
      },
      backend);
  EXPECT_TRUE(c.start().ok());
  const std::vector<std::pair<DType, size_t>> shapes = {
      {DType::kFloat32, 5}, {DType::kFloat32, 40001}, {DType::kBFloat16, 20000}};
  std::vector<std::vector<float>> result;
  std::mutex result_mu;
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<Tensor> tensors = make_tensors(shapes);
    std::vector<uint32_t> handles;
    for (size_t t = 0; t < tensors.size(); ++t) {
      std::vector<float> init(tensors[t].n);
      for (size_t i = 0; i < init.size(); ++i)
        init[i] = static_cast<float>(i % 7) - 3.0f;
      Tensor initial = tensors[t];
      initial.set(init);
      PSLD_ASSIGN_OR_RETURN(
          uint32_t h, w.register_tensor("p" + std::to_string(t), tensors[t].dtype,
                                        tensors[t].bytes(), tensors[t].data(), initial.data()));
      handles.push_back(h);
    }
    PSLD_RETURN_IF_ERROR(w.barrier(10s));
    for (int r = 1; r <= 12; ++r) {
      std::vector<std::shared_ptr<RequestState>> reqs;
      for (size_t t = 0; t < tensors.size(); ++t) {
        std::vector<float> g(tensors[t].n);
        for (size_t i = 0; i < g.size(); ++i)
          g[i] = static_cast<float>((i + w.rank() + static_cast<size_t>(r)) % 9) - 4.0f;
        tensors[t].set(g);
        PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
        reqs.push_back(req);
      }
      for (auto& req : reqs)
        PSLD_RETURN_IF_ERROR(req->wait(10s).with_context("round " + std::to_string(r)));
    }
    if (w.rank() == 0) {
      std::lock_guard<std::mutex> lock(result_mu);
      for (auto& t : tensors)
        result.push_back(t.get());
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
  return result;
}

TEST_P(GpuServers, AdamIsBitIdenticalToServersOnTheCpu) {
  const auto gpu = optimizer_job(GetParam(), OptimizerKind::kAdamW, gpu_servers());
  const auto cpu = optimizer_job(GetParam(), OptimizerKind::kAdamW, nullptr);
  expect_bit_identical(gpu, cpu);
  EXPECT_NE(gpu[1][0], -3.0f) << "AdamW changed nothing";
  EXPECT_GT(log_->launches.load(), 0u);
  expect_all_freed();
}

TEST_P(GpuServers, NesterovMomentumIsBitIdenticalToServersOnTheCpu) {
  const auto gpu = optimizer_job(GetParam(), OptimizerKind::kMomentum, gpu_servers());
  const auto cpu = optimizer_job(GetParam(), OptimizerKind::kMomentum, nullptr);
  expect_bit_identical(gpu, cpu);
  expect_all_freed();
}

// Async: every push is added to the running total as it arrives; after a
// barrier a pull reads the sum of all of them.
TEST_P(GpuServers, AsyncRunningTotalsAreExactWithKeysInGpuMemory) {
  constexpr size_t kN = 30000;  // two chunks
  constexpr int kPushes = 10;
  {
    Cluster c(2, 1, gpu_servers([](RuntimeOptions& o) {
                o.mode = ServerMode::kSum;
                o.sync = SyncMode::kAsync;
              }),
              GetParam());
    ASSERT_TRUE(c.start().ok());
    Status s = on_all(c, [&](size_t wi) -> Status {
      WorkerService& w = *c.workers[wi];
      std::vector<float> data(kN);
      PSLD_ASSIGN_OR_RETURN(
          uint32_t h, w.register_tensor("total", DType::kFloat32, kN * 4, data.data(), nullptr));
      PSLD_RETURN_IF_ERROR(w.barrier(10s));
      for (int r = 1; r <= kPushes; ++r) {
        for (size_t i = 0; i < kN; ++i)
          data[i] = static_cast<float>(r + static_cast<int>(w.rank()) + static_cast<int>(i % 3));
        PSLD_ASSIGN_OR_RETURN(auto push, w.submit(h, RequestKind::kPush));
        PSLD_RETURN_IF_ERROR(push->wait(10s));
      }
      PSLD_RETURN_IF_ERROR(w.barrier(10s));
      PSLD_ASSIGN_OR_RETURN(auto pull, w.submit(h, RequestKind::kPull));
      PSLD_RETURN_IF_ERROR(pull->wait(10s));
      for (size_t i = 0; i < kN; ++i) {
        // sum over r = 1..10 and ranks 0, 1 of r + rank + i % 3
        const float want = 2.0f * 55.0f + 10.0f + 20.0f * static_cast<float>(i % 3);
        if (data[i] != want) {
          return Internal(fmt::format("element {}: {} != {}", i, data[i], want));
        }
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  expect_all_freed();
}

// A kernel that faults on the GPU fails the requests of its key with the
// server, the key and the device's message, and every later request for
// that key; the job's other key goes on; nothing waits for a timeout.
TEST_P(GpuServers, AFaultOnTheGpuFailsItsKeysRequestsClearlyAndNothingHangs) {
  log_->fault_launch = 5;
  {
    Cluster c(2, 1, gpu_servers([](RuntimeOptions& o) { o.mode = ServerMode::kSum; }), GetParam());
    ASSERT_TRUE(c.start().ok());
    constexpr size_t kN = 1000;
    constexpr int kRounds = 6;
    // Per tensor, per worker: the first round that failed (0: none).
    std::vector<std::vector<int>> first_failure(2, std::vector<int>(2, 0));
    std::vector<std::vector<std::string>> errors(2, std::vector<std::string>(2));
    std::mutex mu;
    Status s = on_all(c, [&](size_t wi) -> Status {
      WorkerService& w = *c.workers[wi];
      std::vector<std::vector<float>> data(2, std::vector<float>(kN));
      std::vector<uint32_t> handles;
      for (size_t t = 0; t < 2; ++t) {
        PSLD_ASSIGN_OR_RETURN(uint32_t h,
                              w.register_tensor("t" + std::to_string(t), DType::kFloat32, kN * 4,
                                                data[t].data(), nullptr));
        handles.push_back(h);
      }
      for (int r = 1; r <= kRounds; ++r) {
        std::vector<std::shared_ptr<RequestState>> reqs;
        for (size_t t = 0; t < 2; ++t) {
          if (first_failure[t][wi] != 0) {
            reqs.push_back(nullptr);
            continue;
          }
          std::fill(data[t].begin(), data[t].end(), static_cast<float>(r));
          PSLD_ASSIGN_OR_RETURN(auto req, w.submit(handles[t], RequestKind::kPushPull));
          reqs.push_back(req);
        }
        for (size_t t = 0; t < 2; ++t) {
          if (!reqs[t]) continue;
          Status st = reqs[t]->wait(10s);
          if (st.code() == StatusCode::kTimeout) return st.with_context("a request hung");
          if (!st.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            first_failure[t][wi] = r;
            errors[t][wi] = st.to_string();
            continue;
          }
          if (data[t][0] != static_cast<float>(2 * r)) {
            return Internal(fmt::format("round {} tensor {}: {}", r, t, data[t][0]));
          }
        }
      }
      return Status::Ok();
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
    // Exactly one tensor's key got the fault, at the same round for both workers.
    const size_t bad = first_failure[0][0] != 0 ? 0 : 1;
    EXPECT_NE(first_failure[bad][0], 0);
    EXPECT_EQ(first_failure[bad][0], first_failure[bad][1]);
    EXPECT_LT(first_failure[bad][0], kRounds);
    for (size_t wi = 0; wi < 2; ++wi) {
      EXPECT_EQ(first_failure[1 - bad][wi], 0) << errors[1 - bad][wi];
      // Both workers: the one whose push faulted and the one whose pull waited.
      const std::string& e = errors[bad][wi];
      EXPECT_NE(e.find("fake kernel fault"), std::string::npos) << e;
      EXPECT_NE(e.find("server 0, key 0x"), std::string::npos) << e;
      EXPECT_NE(e.find("reducing a push"), std::string::npos) << e;
    }
  }
  expect_all_freed();
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuServers, ::testing::ValuesIn(test_backends()),
                         [](const auto& info) { return info.param; });

// server.device = cuda with the real CUDA device: where there is none, the
// server does not start and says why; where there is one, sums are exact.
TEST(CudaServerDevice, WithoutAGpuAServerSaysWhyItCannotStartElseSumsAreExact) {
  if (!kernels::cuda_device_present()) {
    RuntimeOptions o;
    o.net.transport = "loopback";
    o.net.options.common.listen_address = "server";
    o.server_device = ServerDeviceKind::kCuda;
    auto server = ServerService::start(o);
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(server.status().message().find("server.device = cuda, but the GPU cannot be used"),
              std::string::npos)
        << server.status().to_string();
    EXPECT_NE(server.status().message().find(kernels::cuda_device_status().message()),
              std::string::npos)
        << server.status().to_string();
    GTEST_SKIP() << "no CUDA device: checked the error only ("
                 << kernels::cuda_device_status().message() << ")";
  }
  Cluster c(2, 1, [](RuntimeOptions& o) {
    o.mode = ServerMode::kSum;
    o.server_device = ServerDeviceKind::kCuda;
    o.server_threads = 2;
  });
  ASSERT_TRUE(c.start().ok());
  const std::vector<size_t> elems = {1, 1000, 50001};
  Status s = on_all(c, [&](size_t wi) -> Status {
    WorkerService& w = *c.workers[wi];
    std::vector<std::vector<float>> storage;
    PSLD_ASSIGN_OR_RETURN(auto handles, register_zeroed(w, elems, storage));
    std::vector<float*> data;
    for (auto& v : storage)
      data.push_back(v.data());
    const float rank = static_cast<float>(w.rank());
    return exact_push_pull_rounds(
        w, handles, data, elems, 10,
        [&](int r, size_t i) { return rank * 1000.0f + static_cast<float>(r + i % 13); },
        [](int r, size_t i) { return 1000.0f + 2.0f * static_cast<float>(r + i % 13); });
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

}  // namespace
}  // namespace psld
