// psld-demo-mlp: data-parallel training of an MLP classifier on
// Fashion-MNIST with psld, run by `tools/dev demo` under `psld launch`.
//
// Each worker trains on its shard of the 60,000 training images; every round
// it computes the gradient of its mini-batch (tools/mlp.h), writes it into
// the registered parameter tensors and push_pulls them: the servers sum the
// workers' gradients, apply SGD with momentum and write the new parameters
// straight back. Worker 0 prints a live table and, at the end, the test-set
// accuracy.
//
//   psld-demo-mlp [--rounds N] [--batch B] [--hidden H] [--data DIR]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "psld/worker.h"
#include "tools/mlp.h"

namespace {

using psld::demo::Dataset;
using psld::demo::Mlp;

int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], name)) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

std::string arg_str(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], name)) return argv[i + 1];
  }
  return fallback;
}

}  // namespace

// psld returns errors as values; what could still leave main is
// std::bad_alloc, and ending the demo then is right.
int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape)
  const int rounds = arg_int(argc, argv, "--rounds", 600);
  const int batch = arg_int(argc, argv, "--batch", 64);
  const int hidden = arg_int(argc, argv, "--hidden", 512);
  const std::string dir = arg_str(argc, argv, "--data", psld::demo::kFashionMnistDir);
  openblas_set_num_threads(1);  // one core per worker process

  auto config = psld::load_config({});
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().to_string().c_str());
    return 1;
  }
  auto joined = psld::Worker::join(*config);
  if (!joined.ok()) {
    std::fprintf(stderr, "cannot join the job: %s\n", joined.status().to_string().c_str());
    return 1;
  }
  psld::Worker& worker = **joined;
  const int rank = static_cast<int>(worker.rank());
  const int workers = static_cast<int>(worker.num_workers());

  auto train_set = psld::demo::load_fashion_mnist(dir, "train");
  auto test_set = psld::demo::load_fashion_mnist(dir, "t10k");
  for (const auto* set : {&train_set, &test_set}) {
    if (!set->ok()) {
      std::fprintf(stderr, "%s\n", set->status().message().c_str());
      return 1;
    }
  }
  const Dataset& train = *train_set;
  const Dataset& test = *test_set;
  // Worker 0's initial weights are everyone's: the same seed everywhere.
  Mlp model({psld::demo::kPixels, hidden, hidden, psld::demo::kClasses}, 42);
  std::vector<psld::TensorHandle> handles;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    auto& L = model.layers[l];
    std::vector<float> init = L.params;
    auto h = worker.register_tensor("layer" + std::to_string(l), psld::DType::kFloat32,
                                    L.params.size() * 4, L.params.data(), init.data());
    if (!h.ok()) {
      std::fprintf(stderr, "register: %s\n", h.status().to_string().c_str());
      return 1;
    }
    handles.push_back(*h);
  }
  if (auto s = worker.barrier(); !s.ok()) {
    std::fprintf(stderr, "barrier: %s\n", s.to_string().c_str());
    return 1;
  }
  for (const psld::TensorHandle& h : handles) {
    auto req = worker.pull(h);
    if (!req.ok() || !req->wait().ok()) {
      std::fprintf(stderr, "initial pull failed\n");
      return 1;
    }
  }

  // This worker's shard: every workers-th image starting at rank.
  std::vector<int> shard;
  for (int i = rank; i < train.n; i += workers)
    shard.push_back(i);
  std::mt19937_64 rng(1000 + rank);
  std::vector<float> xb(static_cast<size_t>(batch) * 784);
  std::vector<int> yb(batch);
  size_t cursor = shard.size();
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  double loss_sum = 0;
  int loss_n = 0;
  // Per-server load as this worker sees it: bytes sent to each server and
  // how long each took to answer, per print interval.
  std::vector<psld::ServerLoad> last_loads = worker.server_loads();
  if (rank == 0) {
    std::printf("%6s %9s %10s %9s", "round", "loss", "images/s", "round ms");
    for (const auto& l : last_loads)
      std::printf("   server %u: MB/s  answer ms", l.server);
    std::printf("\n");
    std::fflush(stdout);
  }
  for (int r = 1; r <= rounds; ++r) {
    for (int i = 0; i < batch; ++i) {
      if (cursor == shard.size()) {
        std::shuffle(shard.begin(), shard.end(), rng);
        cursor = 0;
      }
      const int idx = shard[cursor++];
      std::memcpy(&xb[static_cast<size_t>(i) * 784], &train.images[static_cast<size_t>(idx) * 784],
                  784 * 4);
      yb[i] = train.labels[idx];
    }
    loss_sum += model.train_step(xb.data(), yb.data(), batch);
    ++loss_n;
    // The gradient goes out through the registered memory; the new
    // parameters come back into it.
    std::vector<psld::Request> reqs;
    for (size_t l = 0; l < model.layers.size(); ++l) {
      auto& L = model.layers[l];
      std::memcpy(L.params.data(), L.grad.data(), L.grad.size() * 4);
      auto req = worker.push_pull(handles[l]);
      if (!req.ok()) {
        std::fprintf(stderr, "push_pull: %s\n", req.status().to_string().c_str());
        return 1;
      }
      reqs.push_back(*req);
    }
    for (auto& q : reqs) {
      if (auto s = q.wait(std::chrono::seconds(60)); !s.ok()) {
        std::fprintf(stderr, "round %d: %s\n", r, s.to_string().c_str());
        return 1;
      }
    }
    if (rank == 0 && (r % 25 == 0 || r == rounds)) {
      const auto now = std::chrono::steady_clock::now();
      const double secs = std::chrono::duration<double>(now - last).count();
      std::printf("%6d %9.4f %10.0f %9.1f", r, loss_sum / loss_n, 25.0 * batch * workers / secs,
                  1000.0 * secs / 25.0);
      const std::vector<psld::ServerLoad> loads = worker.server_loads();
      for (size_t i = 0; i < loads.size() && i < last_loads.size(); ++i) {
        const double mb =
            static_cast<double>(loads[i].bytes_pushed - last_loads[i].bytes_pushed) / 1e6;
        const double answers = static_cast<double>(loads[i].answers - last_loads[i].answers);
        const double latency_us =
            loads[i].mean_answer_us * static_cast<double>(loads[i].answers) -
            last_loads[i].mean_answer_us * static_cast<double>(last_loads[i].answers);
        std::printf("   %22.1f %10.2f", mb / secs, answers > 0 ? latency_us / answers / 1e3 : 0.0);
      }
      std::printf("\n");
      std::fflush(stdout);
      last_loads = loads;
      last = now;
      loss_sum = 0;
      loss_n = 0;
    }
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0) {
    int correct = 0;
    double loss = 0;
    const int chunk = 500;
    for (int i = 0; i < test.n; i += chunk) {
      const int b = std::min(chunk, test.n - i);
      loss +=
          model.evaluate(&test.images[static_cast<size_t>(i) * 784], &test.labels[i], b, &correct) *
          b;
    }
    std::printf("trained %d rounds x %d workers x %d images in %.1f s (%.0f images/s)\n", rounds,
                workers, batch, total, rounds * double(batch) * workers / total);
    std::printf("test loss %.4f, test accuracy %.2f%%\n", loss / test.n, 100.0 * correct / test.n);
  }
  return worker.shutdown().ok() ? 0 : 1;
}
