// psld-demo-mlp: data-parallel training of an MLP classifier on
// Fashion-MNIST with psld, run by `tools/dev demo` under `psld launch`.
//
// Each worker trains on its shard of the 60,000 training images; every round
// it computes the gradient of its mini-batch (OpenBLAS sgemm), writes it into
// the registered parameter tensors and push_pulls them: the servers sum the
// workers' gradients, apply SGD with momentum and write the new parameters
// straight back. Worker 0 prints a live table and, at the end, the test-set
// accuracy.
//
//   psld-demo-mlp [--rounds N] [--batch B] [--hidden H] [--data DIR]
#include <cblas.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "psld/worker.h"

namespace {

struct Dataset {
  int n = 0;
  std::vector<float> images;  // n x 784, scaled to [0, 1]
  std::vector<int> labels;
};

uint32_t be32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Reads a gzip'd IDX file whole.
bool read_gz(const std::string& path, std::vector<unsigned char>* out) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0)
    out->insert(out->end(), buf, buf + n);
  gzclose(f);
  return n == 0;
}

bool load(const std::string& dir, const std::string& prefix, Dataset* d, std::string* error) {
  std::vector<unsigned char> img, lab;
  const std::string ip = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string lp = dir + "/" + prefix + "-labels-idx1-ubyte.gz";
  if (!read_gz(ip, &img) || !read_gz(lp, &lab)) {
    *error = "cannot read " + ip + " or " + lp +
             " (Debian package dataset-fashion-mnist; tools/dev demo installs it)";
    return false;
  }
  if (img.size() < 16 || lab.size() < 8 || be32(img.data()) != 2051 || be32(lab.data()) != 2049) {
    *error = "not IDX files: " + ip + ", " + lp;
    return false;
  }
  const uint32_t n = be32(img.data() + 4), rows = be32(img.data() + 8),
                 cols = be32(img.data() + 12);
  if (rows * cols != 784 || be32(lab.data() + 4) != n || img.size() != 16 + size_t{n} * 784 ||
      lab.size() != 8 + size_t{n}) {
    *error = "unexpected IDX shapes in " + ip;
    return false;
  }
  d->n = static_cast<int>(n);
  d->images.resize(size_t{n} * 784);
  d->labels.resize(n);
  for (size_t i = 0; i < d->images.size(); ++i)
    d->images[i] = img[16 + i] / 255.0f;
  for (uint32_t i = 0; i < n; ++i)
    d->labels[i] = lab[8 + i];
  return true;
}

// One dense layer's parameters live in one registered tensor: weights
// (in x out, row-major) followed by the bias (out).
struct Layer {
  int in = 0, out = 0;
  std::vector<float> params;  // registered with psld: gradients in, parameters out
  std::vector<float> grad;
  psld::TensorHandle handle;
  float* w() { return params.data(); }
  float* b() { return params.data() + static_cast<size_t>(in) * out; }
  float* gw() { return grad.data(); }
  float* gb() { return grad.data() + static_cast<size_t>(in) * out; }
};

struct Mlp {
  std::vector<Layer> layers;
  // Activations per layer for a batch (inputs of layer l are acts[l]).
  std::vector<std::vector<float>> acts, deltas;

  Mlp(const std::vector<int>& dims, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (size_t l = 0; l + 1 < dims.size(); ++l) {
      Layer layer;
      layer.in = dims[l];
      layer.out = dims[l + 1];
      layer.params.resize(static_cast<size_t>(layer.in) * layer.out + layer.out);
      layer.grad.resize(layer.params.size());
      // He initialisation for ReLU layers.
      std::normal_distribution<float> nd(0.0f, std::sqrt(2.0f / static_cast<float>(layer.in)));
      for (size_t i = 0; i < static_cast<size_t>(layer.in) * layer.out; ++i)
        layer.params[i] = nd(rng);
      layers.push_back(std::move(layer));
    }
  }

  // Forward pass on `batch` rows of x; returns the mean cross-entropy and,
  // when `train`, leaves the gradient in every layer's grad.
  float step(const float* x, const int* y, int batch, bool train, int* correct) {
    acts.assign(layers.size() + 1, {});
    acts[0].assign(x, x + static_cast<size_t>(batch) * layers[0].in);
    for (size_t l = 0; l < layers.size(); ++l) {
      Layer& L = layers[l];
      std::vector<float>& out = acts[l + 1];
      out.resize(static_cast<size_t>(batch) * L.out);
      for (int r = 0; r < batch; ++r)
        std::memcpy(&out[static_cast<size_t>(r) * L.out], L.b(), L.out * 4);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, L.out, L.in, 1.0f,
                  acts[l].data(), L.in, L.w(), L.out, 1.0f, out.data(), L.out);
      if (l + 1 < layers.size()) {
        for (float& v : out)
          v = std::max(v, 0.0f);
      }
    }
    // Softmax cross-entropy on the logits.
    const int classes = layers.back().out;
    std::vector<float>& logits = acts.back();
    std::vector<float> dlogits(logits.size());
    double loss = 0;
    for (int r = 0; r < batch; ++r) {
      float* z = &logits[static_cast<size_t>(r) * classes];
      const float m = *std::max_element(z, z + classes);
      double sum = 0;
      for (int c = 0; c < classes; ++c)
        sum += std::exp(static_cast<double>(z[c] - m));
      const double logsum = std::log(sum) + m;
      loss += logsum - z[y[r]];
      if (correct && std::max_element(z, z + classes) - z == y[r]) ++*correct;
      for (int c = 0; c < classes; ++c) {
        dlogits[static_cast<size_t>(r) * classes + c] =
            static_cast<float>((std::exp(z[c] - logsum) - (c == y[r] ? 1.0 : 0.0)) / batch);
      }
    }
    if (!train) return static_cast<float>(loss / batch);
    // Backward.
    std::vector<float> delta = std::move(dlogits);
    for (size_t li = layers.size(); li-- > 0;) {
      Layer& L = layers[li];
      const std::vector<float>& in = acts[li];
      // dW = in^T * delta; db = column sums of delta.
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, L.in, L.out, batch, 1.0f, in.data(),
                  L.in, delta.data(), L.out, 0.0f, L.gw(), L.out);
      std::fill(L.gb(), L.gb() + L.out, 0.0f);
      for (int r = 0; r < batch; ++r) {
        for (int c = 0; c < L.out; ++c)
          L.gb()[c] += delta[static_cast<size_t>(r) * L.out + c];
      }
      if (li == 0) break;
      std::vector<float> prev(static_cast<size_t>(batch) * L.in);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, L.in, L.out, 1.0f, delta.data(),
                  L.out, L.w(), L.out, 0.0f, prev.data(), L.in);
      for (size_t i = 0; i < prev.size(); ++i) {
        if (in[i] <= 0.0f) prev[i] = 0.0f;  // ReLU'
      }
      delta = std::move(prev);
    }
    return static_cast<float>(loss / batch);
  }
};

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

int main(int argc, char** argv) {
  const int rounds = arg_int(argc, argv, "--rounds", 600);
  const int batch = arg_int(argc, argv, "--batch", 64);
  const int hidden = arg_int(argc, argv, "--hidden", 512);
  const std::string dir = arg_str(argc, argv, "--data", "/usr/share/datasets/fashion-mnist");
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

  Dataset train, test;
  std::string error;
  if (!load(dir, "train", &train, &error) || !load(dir, "t10k", &test, &error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  // Worker 0's initial weights are everyone's: the same seed everywhere.
  Mlp model({784, hidden, hidden, 10}, 42);
  for (size_t l = 0; l < model.layers.size(); ++l) {
    auto& L = model.layers[l];
    std::vector<float> init = L.params;
    auto h = worker.register_tensor("layer" + std::to_string(l), psld::DType::kFloat32,
                                    L.params.size() * 4, L.params.data(), init.data());
    if (!h.ok()) {
      std::fprintf(stderr, "register: %s\n", h.status().to_string().c_str());
      return 1;
    }
    L.handle = *h;
  }
  if (auto s = worker.barrier(); !s.ok()) {
    std::fprintf(stderr, "barrier: %s\n", s.to_string().c_str());
    return 1;
  }
  for (auto& L : model.layers) {
    auto req = worker.pull(L.handle);
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
    loss_sum += model.step(xb.data(), yb.data(), batch, true, nullptr);
    ++loss_n;
    // The gradient goes out through the registered memory; the new
    // parameters come back into it.
    std::vector<psld::Request> reqs;
    for (auto& L : model.layers) {
      std::memcpy(L.params.data(), L.grad.data(), L.grad.size() * 4);
      auto req = worker.push_pull(L.handle);
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
      loss += model.step(&test.images[static_cast<size_t>(i) * 784], &test.labels[i], b, false,
                         &correct) *
              b;
    }
    std::printf("trained %d rounds x %d workers x %d images in %.1f s (%.0f images/s)\n", rounds,
                workers, batch, total, rounds * double(batch) * workers / total);
    std::printf("test loss %.4f, test accuracy %.2f%%\n", loss / test.n, 100.0 * correct / test.n);
  }
  return worker.shutdown().ok() ? 0 : 1;
}
