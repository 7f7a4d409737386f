// The demo's model and data, shared by psld-demo-mlp and
// tests/mlp_equivalence_test.cc: Fashion-MNIST from its gzip'd IDX files and
// a ReLU MLP with softmax cross-entropy whose matrix products run on OpenBLAS.
//
// Nothing here talks to psld: a trainer registers each layer's `params` as a
// tensor, copies `grad` into it and push_pulls; a single-process reference
// calls sgd() instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "psld/status.h"

namespace psld::demo {

inline constexpr int kPixels = 28 * 28;
inline constexpr int kClasses = 10;
// Where the Debian package dataset-fashion-mnist puts the files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  int n = 0;
  std::vector<float> images;  // n x kPixels, scaled to [0, 1]
  std::vector<int> labels;    // n, in [0, kClasses)
};

// Reads DIR/PREFIX-images-idx3-ubyte.gz and DIR/PREFIX-labels-idx1-ubyte.gz
// (PREFIX "train" or "t10k"). NotFound names the package to install;
// DataLoss means the files are not the IDX images and labels expected.
Result<Dataset> load_fashion_mnist(const std::string& dir, const std::string& prefix);

// One dense layer: weights (in x out, row-major) followed by the bias (out),
// in one array so that a layer is one psld tensor.
struct Layer {
  int in = 0, out = 0;
  std::vector<float> params;
  std::vector<float> grad;  // same layout as params
  float* w() { return params.data(); }
  float* b() { return params.data() + static_cast<size_t>(in) * out; }
  float* gw() { return grad.data(); }
  float* gb() { return grad.data() + static_cast<size_t>(in) * out; }
};

class Mlp {
 public:
  // dims = {inputs, hidden..., classes}: ReLU after every layer but the
  // last. Weights He-initialised from `seed` (the same seed gives the same
  // parameters in every process), biases zero.
  Mlp(const std::vector<int>& dims, uint64_t seed);

  // Forward and backward on `batch` rows of x (labels y): returns the mean
  // cross-entropy and leaves in every layer's grad the gradient of
  // grad_scale * that mean. A worker holding 1/k of a combined batch passes
  // 1/k so that the servers' sum of the k gradients is the combined batch's
  // mean gradient.
  float train_step(const float* x, const int* y, int batch, float grad_scale = 1.0f);

  // Forward only: the mean cross-entropy; adds the number of rows whose
  // largest logit is the label to *correct when it is not null.
  float evaluate(const float* x, const int* y, int batch, int* correct);

  // The input of layer `layer` for every row of the last batch, after
  // train_step or evaluate: batch x layers[layer].in, row-major. Layer 0's
  // is the images; a later layer's is the previous layer's ReLU output.
  const std::vector<float>& activations(size_t layer) const { return acts_[layer]; }

  // Plain SGD on every layer: w = w + (-lr) * g, the same fp32 operations,
  // rounded the same way, as psld's server optimizer (kernels::sgd_f32).
  void sgd(float lr);

  std::vector<Layer> layers;

 private:
  float run(const float* x, const int* y, int batch, bool train, float grad_scale, int* correct);

  // Activations of the last batch: acts_[l] is the input of layer l.
  std::vector<std::vector<float>> acts_;
};

}  // namespace psld::demo
