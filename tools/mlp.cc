#include "tools/mlp.h"

#include <cblas.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

namespace psld::demo {
namespace {

uint32_t be32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Reads a gzip'd file whole.
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

}  // namespace

Result<Dataset> load_fashion_mnist(const std::string& dir, const std::string& prefix) {
  std::vector<unsigned char> img, lab;
  const std::string ip = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string lp = dir + "/" + prefix + "-labels-idx1-ubyte.gz";
  if (!read_gz(ip, &img) || !read_gz(lp, &lab)) {
    return NotFound("cannot read " + ip + " or " + lp +
                    " (Debian package dataset-fashion-mnist; tools/dev deps installs it)");
  }
  if (img.size() < 16 || lab.size() < 8 || be32(img.data()) != 2051 || be32(lab.data()) != 2049) {
    return DataLoss("not IDX files: " + ip + ", " + lp);
  }
  const uint32_t n = be32(img.data() + 4), rows = be32(img.data() + 8),
                 cols = be32(img.data() + 12);
  if (rows * cols != kPixels || be32(lab.data() + 4) != n ||
      img.size() != 16 + size_t{n} * kPixels || lab.size() != 8 + size_t{n}) {
    return DataLoss("unexpected IDX shapes in " + ip);
  }
  Dataset d;
  d.n = static_cast<int>(n);
  d.images.resize(size_t{n} * kPixels);
  d.labels.resize(n);
  for (size_t i = 0; i < d.images.size(); ++i)
    d.images[i] = img[16 + i] / 255.0f;
  for (uint32_t i = 0; i < n; ++i)
    d.labels[i] = lab[8 + i];
  return d;
}

Mlp::Mlp(const std::vector<int>& dims, uint64_t seed) {
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

float Mlp::train_step(const float* x, const int* y, int batch, float grad_scale) {
  return run(x, y, batch, true, grad_scale, nullptr);
}

float Mlp::evaluate(const float* x, const int* y, int batch, int* correct) {
  return run(x, y, batch, false, 1.0f, correct);
}

void Mlp::sgd(float lr) {
  for (Layer& L : layers) {
    for (size_t i = 0; i < L.params.size(); ++i)
      L.params[i] = L.params[i] + (-lr) * L.grad[i];
  }
}

float Mlp::run(const float* x, const int* y, int batch, bool train, float grad_scale,
               int* correct) {
  acts_.assign(layers.size() + 1, {});
  acts_[0].assign(x, x + static_cast<size_t>(batch) * layers[0].in);
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& L = layers[l];
    std::vector<float>& out = acts_[l + 1];
    out.resize(static_cast<size_t>(batch) * L.out);
    for (int r = 0; r < batch; ++r)
      std::memcpy(&out[static_cast<size_t>(r) * L.out], L.b(), L.out * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, L.out, L.in, 1.0f,
                acts_[l].data(), L.in, L.w(), L.out, 1.0f, out.data(), L.out);
    if (l + 1 < layers.size()) {
      for (float& v : out)
        v = std::max(v, 0.0f);
    }
  }
  // Softmax cross-entropy on the logits, accumulated in double.
  const int classes = layers.back().out;
  std::vector<float>& logits = acts_.back();
  std::vector<float> dlogits(train ? logits.size() : 0);
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
    if (!train) continue;
    for (int c = 0; c < classes; ++c) {
      dlogits[static_cast<size_t>(r) * classes + c] = static_cast<float>(
          (std::exp(z[c] - logsum) - (c == y[r] ? 1.0 : 0.0)) / batch * grad_scale);
    }
  }
  if (!train) return static_cast<float>(loss / batch);
  // Backward.
  std::vector<float> delta = std::move(dlogits);
  for (size_t li = layers.size(); li-- > 0;) {
    Layer& L = layers[li];
    const std::vector<float>& in = acts_[li];
    // dW = in^T * delta; db = column sums of delta.
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, L.in, L.out, batch, 1.0f, in.data(), L.in,
                delta.data(), L.out, 0.0f, L.gw(), L.out);
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

}  // namespace psld::demo
