// A small trainer used by the launch tests: joins the job from its
// environment, runs BSP push_pull rounds on integer-valued data and checks
// every element of every round against the exact sum.
//
//   launch_worker [--rounds N] [--fail-rank R] [--fail-code C] [--hang-rank R]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "psld/worker.h"

int main(int argc, char** argv) {
  int rounds = 20, fail_rank = -1, fail_code = 3, die_rank = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--fail-rank")) fail_rank = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--fail-code")) fail_code = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--die-rank")) die_rank = std::atoi(argv[i + 1]);
  }
  auto config = psld::load_config({});
  if (!config.ok()) {
    std::fprintf(stderr, "config: %s\n", config.status().to_string().c_str());
    return 1;
  }
  auto worker = psld::Worker::join(*config);
  if (!worker.ok()) {
    std::fprintf(stderr, "join: %s\n", worker.status().to_string().c_str());
    return 1;
  }
  psld::Worker& w = **worker;
  const int rank = static_cast<int>(w.rank());
  const int n = static_cast<int>(w.num_workers());
  if (rank == fail_rank) {
    std::fprintf(stderr, "worker %d failing on purpose with code %d\n", rank, fail_code);
    return fail_code;
  }
  const std::vector<size_t> sizes = {1, 333, 70000};
  std::vector<std::vector<float>> data;
  std::vector<psld::TensorHandle> handles;
  for (size_t t = 0; t < sizes.size(); ++t) {
    data.emplace_back(sizes[t]);
    auto h = w.register_tensor("t" + std::to_string(t), psld::DType::kFloat32, sizes[t] * 4,
                               data.back().data());
    if (!h.ok()) {
      std::fprintf(stderr, "register: %s\n", h.status().to_string().c_str());
      return 1;
    }
    handles.push_back(*h);
  }
  for (int r = 1; r <= rounds; ++r) {
    if (rank == die_rank && r == rounds / 2) {
      std::fprintf(stderr, "worker %d dying mid-job\n", rank);
      std::fflush(stderr);
      std::_Exit(9);  // no goodbye, no cleanup: as if killed
    }
    std::vector<psld::Request> reqs;
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (size_t i = 0; i < sizes[t]; ++i)
        data[t][i] = static_cast<float>(rank + r + i % 5);
      auto req = w.push_pull(handles[t]);
      if (!req.ok()) {
        std::fprintf(stderr, "push_pull: %s\n", req.status().to_string().c_str());
        return 1;
      }
      reqs.push_back(*req);
    }
    for (auto& q : reqs) {
      psld::Status s = q.wait(std::chrono::seconds(60));
      if (!s.ok()) {
        std::fprintf(stderr, "round %d: %s\n", r, s.to_string().c_str());
        return 1;
      }
    }
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (size_t i = 0; i < sizes[t]; ++i) {
        const float want = static_cast<float>(n * (n - 1) / 2 + n * (r + static_cast<int>(i % 5)));
        if (data[t][i] != want) {
          std::fprintf(stderr, "round %d tensor %zu element %zu: %g != %g\n", r, t, i,
                       static_cast<double>(data[t][i]), static_cast<double>(want));
          return 1;
        }
      }
    }
  }
  std::printf("worker %d: %d rounds exact\n", rank, rounds);
  return w.shutdown().ok() ? 0 : 1;
}
