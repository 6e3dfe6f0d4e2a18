// tests/strategy/parallel_mlp.h — the MLP that the hybrid-parallel tests and the 2-process
// model-parallel worker train: pre (8 -> 8, tanh), fc1 (8 -> 16, relu; column-parallel), fc2
// (16 -> 8, tanh; row-parallel), head (8 -> 1) and a squared-error loss over a batch of 32, cut
// into stages, its fc1/fc2 pair split over tensor ranks.
#pragma once

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tandem/graph/graph.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/pipeline_runner.h"
#include "tandem/strategy/tensor_parallel.h"
#include "tandem/strategy/variable.h"

namespace tandem::testing::parallel_mlp {

namespace tp = tandem::strategy::tensor_parallel;
using graph::Output;

constexpr std::int64_t kIn = 8, kWide = 16, kBatch = 32;
constexpr float kLearningRate = 0.05f;

// pre (8 -> 8, tanh), fc1 (8 -> 16, relu; column-parallel), fc2 (16 -> 8, tanh; row-parallel),
// head (8 -> 1): kernels and biases, whole.
inline std::vector<std::vector<float>> initial_weights() {
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<std::vector<float>> w;
  for (const auto n : {kIn * kIn, kIn, kIn * kWide, kWide, kWide * kIn, kIn, kIn, std::int64_t{1}}) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& e : v) e = u(rng);
    w.push_back(v);
  }
  return w;
}

inline std::pair<Tensor, Tensor> batch(int step) {
  std::mt19937 rng(static_cast<unsigned>(900 + step));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(kBatch * kIn)), y(static_cast<std::size_t>(kBatch));
  for (auto& v : x) v = n(rng);
  for (std::int64_t i = 0; i < kBatch; ++i) {
    float s = 0;
    for (std::int64_t f = 0; f < kIn; ++f) s += std::sin(x[static_cast<std::size_t>(i * kIn + f)] * (0.7f + f * 0.1f));
    y[static_cast<std::size_t>(i)] = s / 4;
  }
  return {Tensor::from_vector(x, {kBatch, kIn}), Tensor::from_vector(y, {kBatch, 1})};
}

inline std::vector<float> columns(const std::vector<float>& m, std::int64_t rows, std::int64_t cols, std::int64_t c0,
                                  std::int64_t n) {
  std::vector<float> out;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = c0; c < c0 + n; ++c) out.push_back(m[static_cast<std::size_t>(r * cols + c)]);
  }
  return out;
}

// The device at mesh coordinates (data replica b, tensor rank j, stage s).
struct Mesh {
  int dp = 1, tp = 1, pp = 1;
  int device(int b, int j, int s) const { return (b * pp + s) * tp + j; }
  int size() const { return dp * tp * pp; }
};

// Stage s of 1 or 2 (2: pre, fc1, fc2 | head) as tensor rank j of `group` (null: no tensor
// parallelism), its variables' pieces from the whole weights.
inline strategy::PipelineStage make_stage(const Mesh& mesh, int s, int j, const tp::Group* group,
                                          devices::Device& device, const std::vector<std::vector<float>>& w) {
  auto g = std::make_shared<graph::Graph>();
  strategy::PipelineStage st;
  st.index = s;
  st.device = &device;
  const auto variable = [&](const std::vector<float>& init, const Shape& shape, const std::string& name) {
    st.variables.push_back(g->variable(kFloat32, shape, name));
    st.values.push_back(Tensor::from_vector(init, shape, device));
    return st.variables.back();
  };
  const bool first = s == 0, last = s == mesh.pp - 1;
  Output h = g->placeholder(kFloat32, {-1, kIn}, first ? "x" : "input");
  if (first) {
    st.data.push_back({h, 0});
  } else {
    st.input = h;
  }
  if (first) {
    const std::int64_t piece = kWide / mesh.tp;
    const Output pre_k = variable(w[0], {kIn, kIn}, "pre/kernel"), pre_b = variable(w[1], {kIn}, "pre/bias");
    const Output fc1_k = variable(columns(w[2], kIn, kWide, j * piece, piece), {kIn, piece}, "fc1/kernel");
    const Output fc1_b = variable({w[3].begin() + j * piece, w[3].begin() + (j + 1) * piece}, {piece}, "fc1/bias");
    const Output fc2_k =
        variable({w[4].begin() + j * piece * kIn, w[4].begin() + (j + 1) * piece * kIn}, {piece, kIn}, "fc2/kernel");
    const Output fc2_b = variable(w[5], {kIn}, "fc2/bias");
    h = ops::tanh(ops::bias_add(ops::matmul(h, pre_k), pre_b));
    if (group) h = tp::copy_to_group(h, *group);
    h = ops::relu(ops::bias_add(ops::matmul(h, fc1_k), fc1_b));
    h = ops::matmul(h, fc2_k);
    if (group) h = tp::reduce_from_group(h, *group);
    h = ops::tanh(ops::bias_add(h, fc2_b));
  }
  if (last) {
    const Output head_k = variable(w[6], {kIn, 1}, "head/kernel"), head_b = variable(w[7], {1}, "head/bias");
    const Output prediction = ops::bias_add(ops::matmul(h, head_k), head_b);
    const Output y = g->placeholder(kFloat32, {-1, 1}, "y");
    st.data.push_back({y, 1});
    const Output sum = ops::reduce_sum(ops::square(prediction - y));
    st.loss = sum * ops::scalar_like(sum, 1.0 / kBatch);
  } else {
    st.output = h;
    st.output_gradient = g->placeholder(kFloat32, {-1, kIn}, "output_gradient");
  }
  st.add_gradients();
  st.graph = g;
  return st;
}

// SGD on a stage's values.
inline void sgd(std::vector<Tensor>& values, const std::vector<Tensor>& gradients) {
  for (std::size_t k = 0; k < values.size(); ++k) {
    float* v = values[k].data<float>();
    const float* d = gradients[k].data<float>();
    for (std::int64_t i = 0; i < values[k].num_elements(); ++i) v[i] -= kLearningRate * d[i];
  }
}

// Micro-batch m of `microbatches` of rows [first, first + rows) of (x, y).
inline std::vector<Tensor> microbatch(const Tensor& x, const Tensor& y, std::int64_t first, std::int64_t rows) {
  return {strategy::flat_view(x, first * kIn, rows * kIn).reshape({rows, kIn}),
          strategy::flat_view(y, first, rows).reshape({rows, 1})};
}

}  // namespace tandem::testing::parallel_mlp
