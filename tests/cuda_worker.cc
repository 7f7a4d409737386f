// A trainer whose tensors live in CUDA device memory, for the multi-process
// GPU test (tests/cuda_launch_test.cc): joins the job from its environment,
// runs BSP push_pull rounds on integer-valued gradients written into
// cudaMalloc'd tensors, and checks every element of every round (copied back
// to the host) against the exact sum. Worker 0 also sets an initial value
// from device memory, which every worker checks first.
//
//   cuda_worker [--rounds N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "psld/worker.h"

namespace cuda = psld::kernels::cuda;

namespace {

int fail(const std::string& what) {
  std::fprintf(stderr, "cuda_worker: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
  }
  auto config = psld::load_config({});
  if (!config.ok()) return fail("config: " + config.status().to_string());
  auto worker = psld::Worker::join(*config);
  if (!worker.ok()) return fail("join: " + worker.status().to_string());
  psld::Worker& w = **worker;
  const int rank = static_cast<int>(w.rank());
  const int n = static_cast<int>(w.num_workers());
  std::printf("worker %d: CUDA tensors go %s\n", rank, w.gpu_path().c_str());

  // One element, less than a chunk, and several chunks with a tail (the
  // default chunk is 4 MiB).
  const std::vector<size_t> sizes = {1, 333, 70000, (size_t{5} << 20) / 4 + 3};
  std::vector<float*> dev;
  std::vector<psld::TensorHandle> handles;
  for (size_t t = 0; t < sizes.size(); ++t) {
    void* p = nullptr;
    if (auto s = cuda::device_alloc(sizes[t] * 4, &p); !s.ok())
      return fail("cudaMalloc: " + s.message());
    dev.push_back(static_cast<float*>(p));
    auto h = w.register_tensor("t" + std::to_string(t), psld::DType::kFloat32, sizes[t] * 4, p);
    if (!h.ok()) return fail("register: " + h.status().to_string());
    handles.push_back(*h);
  }
  // An initial value from device memory, pulled by everyone.
  const size_t kInit = 100003;
  std::vector<float> host(kInit);
  for (size_t i = 0; i < kInit; ++i)
    host[i] = static_cast<float>(i % 1000);
  void* init_dev = nullptr;
  void* param_dev = nullptr;
  if (auto s = cuda::device_alloc(kInit * 4, &init_dev); !s.ok()) return fail(s.message());
  if (auto s = cuda::device_alloc(kInit * 4, &param_dev); !s.ok()) return fail(s.message());
  if (auto s = cuda::copy(init_dev, host.data(), kInit * 4); !s.ok()) return fail(s.message());
  auto hp = w.register_tensor("param", psld::DType::kFloat32, kInit * 4, param_dev, init_dev);
  if (!hp.ok()) return fail("register param: " + hp.status().to_string());
  if (auto s = w.barrier(); !s.ok()) return fail("barrier: " + s.to_string());
  auto pull = w.pull(*hp);
  if (!pull.ok()) return fail("pull: " + pull.status().to_string());
  if (auto s = pull->wait(std::chrono::seconds(60)); !s.ok()) return fail("pull: " + s.to_string());
  std::vector<float> got(kInit);
  if (auto s = cuda::copy(got.data(), param_dev, kInit * 4); !s.ok()) return fail(s.message());
  if (got != host) return fail("the initial value did not arrive in device memory");

  std::vector<float> buf;
  for (int r = 1; r <= rounds; ++r) {
    std::vector<psld::Request> reqs;
    for (size_t t = 0; t < sizes.size(); ++t) {
      buf.resize(sizes[t]);
      for (size_t i = 0; i < sizes[t]; ++i)
        buf[i] = static_cast<float>(rank + r + static_cast<int>(i % 5));
      if (auto s = cuda::copy(dev[t], buf.data(), sizes[t] * 4); !s.ok()) return fail(s.message());
      auto req = w.push_pull(handles[t]);
      if (!req.ok()) return fail("push_pull: " + req.status().to_string());
      reqs.push_back(*req);
    }
    for (auto& q : reqs) {
      if (auto s = q.wait(std::chrono::seconds(60)); !s.ok()) {
        return fail("round " + std::to_string(r) + ": " + s.to_string());
      }
    }
    for (size_t t = 0; t < sizes.size(); ++t) {
      buf.resize(sizes[t]);
      if (auto s = cuda::copy(buf.data(), dev[t], sizes[t] * 4); !s.ok()) return fail(s.message());
      for (size_t i = 0; i < sizes[t]; ++i) {
        const float want = static_cast<float>(n * (n - 1) / 2 + n * (r + static_cast<int>(i % 5)));
        if (buf[i] != want) {
          return fail("round " + std::to_string(r) + " tensor " + std::to_string(t) + " element " +
                      std::to_string(i) + ": " + std::to_string(buf[i]) +
                      " != " + std::to_string(want));
        }
      }
    }
  }
  std::printf("worker %d: %d rounds exact on CUDA tensors\n", rank, rounds);
  const bool ok = w.shutdown().ok();
  for (float* p : dev)
    (void)cuda::device_free(p);
  (void)cuda::device_free(init_dev);
  (void)cuda::device_free(param_dev);
  return ok ? 0 : 1;
}
