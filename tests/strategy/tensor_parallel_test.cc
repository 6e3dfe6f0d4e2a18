// Megatron's f and g operators (strategy/tensor_parallel.h) in hand-built graphs on 2 logical CPU
// devices: an MLP whose middle pair of Dense layers is split column- then row-parallel trains as
// the same MLP on one device (every step's loss and the final weights within 1e-5 relative),
// bitwise the same run to run, with the replicated weights' copies bit-identical, and
// communicates exactly the formula's bytes: per step, one all-reduce of the (batch x 8)
// activation forward and one of its gradient backward.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <thread>

#include "common/error_message.h"
#include "tandem/collective/in_process.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/autodiff.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/tensor_parallel.h"

using namespace tandem;
namespace tp = tandem::strategy::tensor_parallel;
using graph::Output;

namespace {

constexpr std::int64_t kIn = 8, kWide = 16, kBatch = 32;
constexpr int kSteps = 50;
constexpr float kLearningRate = 0.05f;

// The whole model's weights: pre (8 -> 8, tanh), fc1 (8 -> 16, relu), fc2 (16 -> 8, tanh), head (8 -> 1).
struct Weights {
  std::vector<float> pre_k, pre_b, fc1_k, fc1_b, fc2_k, fc2_b, head_k, head_b;
};

Weights initial_weights() {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  const auto draw = [&](std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& e : v) e = u(rng);
    return v;
  };
  return {draw(kIn * kIn), draw(kIn), draw(kIn * kWide), draw(kWide), draw(kWide * kIn), draw(kIn), draw(kIn),
          draw(1)};
}

std::pair<std::vector<float>, std::vector<float>> batch(int step) {
  std::mt19937 rng(static_cast<unsigned>(1000 + step));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(kBatch * kIn)), y(static_cast<std::size_t>(kBatch));
  for (auto& v : x) v = n(rng);
  for (std::int64_t i = 0; i < kBatch; ++i) {
    float s = 0;
    for (std::int64_t f = 0; f < kIn; ++f) s += std::sin(x[static_cast<std::size_t>(i * kIn + f)] * (1.0f + f * 0.1f));
    y[static_cast<std::size_t>(i)] = s / 4;
  }
  return {x, y};
}

// Columns [c0, c0 + n) of a row-major (rows x cols) matrix; rows [r0, r0 + n) of one.
std::vector<float> columns(const std::vector<float>& m, std::int64_t rows, std::int64_t cols, std::int64_t c0,
                           std::int64_t n) {
  std::vector<float> out;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = c0; c < c0 + n; ++c) out.push_back(m[static_cast<std::size_t>(r * cols + c)]);
  }
  return out;
}
std::vector<float> rows_of(const std::vector<float>& m, std::int64_t cols, std::int64_t r0, std::int64_t n) {
  return {m.begin() + r0 * cols, m.begin() + (r0 + n) * cols};
}

// One device's graph and executor: variables (host tensors it updates with SGD), feeds, fetches.
struct Replica {
  std::shared_ptr<graph::Graph> g = std::make_shared<graph::Graph>();
  Output x, y, loss;
  std::vector<Output> variables, gradients;
  std::vector<Tensor> values;
  std::unique_ptr<graph::Executor> executor;

  Output variable(const std::vector<float>& init, const Shape& shape, devices::Device& device, const char* name) {
    variables.push_back(g->variable(kFloat32, shape, name));
    values.push_back(Tensor::from_vector(init, shape, device));
    return variables.back();
  }

  // group null: the whole model on one device; else this device's pieces of fc1 and fc2.
  Replica(const Weights& w, devices::Device& device, const tp::Group* group, int rank) {
    const std::int64_t t = group ? group->size() : 1, piece = kWide / t;
    x = g->placeholder(kFloat32, {-1, kIn}, "x");
    y = g->placeholder(kFloat32, {-1, 1}, "y");
    const Output pre_k = variable(w.pre_k, {kIn, kIn}, device, "pre/kernel");
    const Output pre_b = variable(w.pre_b, {kIn}, device, "pre/bias");
    const Output fc1_k = variable(columns(w.fc1_k, kIn, kWide, rank * piece, piece), {kIn, piece}, device, "fc1/kernel");
    const Output fc1_b = variable({w.fc1_b.begin() + rank * piece, w.fc1_b.begin() + (rank + 1) * piece}, {piece},
                                  device, "fc1/bias");
    const Output fc2_k = variable(rows_of(w.fc2_k, kIn, rank * piece, piece), {piece, kIn}, device, "fc2/kernel");
    const Output fc2_b = variable(w.fc2_b, {kIn}, device, "fc2/bias");
    const Output head_k = variable(w.head_k, {kIn, 1}, device, "head/kernel");
    const Output head_b = variable(w.head_b, {1}, device, "head/bias");
    Output h = ops::tanh(ops::bias_add(ops::matmul(x, pre_k), pre_b));
    if (group) h = tp::copy_to_group(h, *group);  // f: whole input to each piece; gradient summed
    h = ops::relu(ops::bias_add(ops::matmul(h, fc1_k), fc1_b));
    h = ops::matmul(h, fc2_k);
    if (group) h = tp::reduce_from_group(h, *group);  // g: the pieces' partial sums added
    h = ops::tanh(ops::bias_add(h, fc2_b));
    const Output prediction = ops::bias_add(ops::matmul(h, head_k), head_b);
    const Output sum = ops::reduce_sum(ops::square(prediction - y));
    loss = sum * ops::scalar_like(sum, 1.0 / kBatch);
    gradients = graph::gradients({&loss, 1}, variables);
    executor = std::make_unique<graph::Executor>(g, device);
    for (std::size_t k = 0; k < variables.size(); ++k) executor->bind_variable(variables[k], values[k]);
  }

  double step(int s) {
    const auto [xs, ys] = batch(s);
    std::vector<Output> fetches{loss};
    fetches.insert(fetches.end(), gradients.begin(), gradients.end());
    const auto out = executor->run({{x, Tensor::from_vector(xs, {kBatch, kIn})}, {y, Tensor::from_vector(ys, {kBatch, 1})}},
                                   fetches);
    for (std::size_t k = 0; k < values.size(); ++k) {
      float* v = values[k].data<float>();
      const float* d = out[k + 1].data<float>();
      for (std::int64_t i = 0; i < values[k].num_elements(); ++i) v[i] -= kLearningRate * d[i];
    }
    return out[0].item<float>();
  }

  std::vector<float> value(std::size_t k) const { return values[k].to_vector<float>(); }
};

struct Run {
  std::vector<double> losses;
  Weights weights;  // whole, the pieces put back together
  collective::CommunicationStats stats;
  bool replicated_copies_equal = true;
};

Run train_one_device() {
  Replica r(initial_weights(), devices::get_device("CPU:0"), nullptr, 0);
  Run run;
  for (int s = 0; s < kSteps; ++s) run.losses.push_back(r.step(s));
  run.weights = {r.value(0), r.value(1), r.value(2), r.value(3), r.value(4), r.value(5), r.value(6), r.value(7)};
  return run;
}

Run train_tensor_parallel() {
  auto comms = collective::make_in_process_group(2);
  std::vector<devices::Device*> devices{&devices::get_device("CPU:0"), &devices::get_device("CPU:1")};
  const auto group = tp::Group::create(devices, {comms[0].get(), comms[1].get()});
  const Weights w = initial_weights();
  std::vector<std::unique_ptr<Replica>> replicas;
  for (int r = 0; r < 2; ++r) replicas.push_back(std::make_unique<Replica>(w, *devices[static_cast<std::size_t>(r)], group.get(), r));
  Run run;
  std::vector<double> losses(2);
  for (int s = 0; s < kSteps; ++s) {
    std::thread other([&] { losses[1] = replicas[1]->step(s); });
    losses[0] = replicas[0]->step(s);
    other.join();
    CHECK(losses[0] == losses[1]);  // every device computes the whole loss
    run.losses.push_back(losses[0]);
  }
  const auto& a = *replicas[0];
  const auto& b = *replicas[1];
  for (std::size_t k : {0, 1, 5, 6, 7}) run.replicated_copies_equal &= a.value(k) == b.value(k);
  run.weights = {a.value(0), a.value(1), {}, {}, {}, a.value(5), a.value(6), a.value(7)};
  // fc1's kernel: each device's 8 columns of every row; its bias and fc2's kernel: concatenated.
  const std::int64_t piece = kWide / 2;
  for (std::int64_t row = 0; row < kIn; ++row) {
    for (const auto* r : {&a, &b}) {
      const auto k = r->value(2);
      run.weights.fc1_k.insert(run.weights.fc1_k.end(), k.begin() + row * piece, k.begin() + (row + 1) * piece);
    }
  }
  for (const auto* r : {&a, &b}) {
    const auto bias = r->value(3), k2 = r->value(4);
    run.weights.fc1_b.insert(run.weights.fc1_b.end(), bias.begin(), bias.end());
    run.weights.fc2_k.insert(run.weights.fc2_k.end(), k2.begin(), k2.end());
  }
  run.stats = comms[0]->stats();
  return run;
}

bool contains_text(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / std::max(1e-3, std::abs(static_cast<double>(b[i]))));
  }
  return worst;
}

}  // namespace

TEST_CASE("a column- then row-parallel Dense pair over 2 devices trains as one device, and sends the formula's bytes") {
  const Run want = train_one_device();
  const Run got = train_tensor_parallel();
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-5 * std::abs(want.losses[s]));
  }
  CHECK(want.losses.back() < 0.5 * want.losses.front());  // it trains
  const auto whole = [](const Weights& w) {
    return std::vector<std::vector<float>>{w.pre_k, w.pre_b, w.fc1_k, w.fc1_b, w.fc2_k, w.fc2_b, w.head_k, w.head_b};
  };
  for (std::size_t k = 0; k < 8; ++k) {
    CAPTURE(k);
    CHECK(max_relative_difference(whole(got.weights)[k], whole(want.weights)[k]) <= 1e-5);
  }
  CHECK(got.replicated_copies_equal);
  // Megatron's f and g: 2 all-reduces a step of a (32 x 8) float32 activation, each sending
  // 2 (t - 1) / t of its 1024 bytes at t = 2.
  CHECK(got.stats.all_reduce.calls == 2 * kSteps);
  CHECK(got.stats.all_reduce.bytes_sent == 2 * kSteps * kBatch * kIn * 4);
  CHECK(got.stats.total().calls == got.stats.all_reduce.calls);
  // Bitwise the same run to run.
  const Run again = train_tensor_parallel();
  CHECK(again.losses == got.losses);
  CHECK(whole(again.weights) == whole(got.weights));
}

TEST_CASE("tensor_parallel::Group refuses mismatched lists, and a kernel refuses a device outside its group") {
  auto comms = collective::make_in_process_group(2);
  std::vector<devices::Device*> devices{&devices::get_device("CPU:0"), &devices::get_device("CPU:1")};
  CHECK(testing::error_message([&] { tp::Group::create(devices, {comms[0].get()}); }) ==
        "tensor_parallel::Group: 2 devices but 1 communicators; give one communicator per device");
  CHECK(testing::error_message([&] { tp::Group::create(devices, {comms[1].get(), comms[0].get()}); }) ==
        "tensor_parallel::Group: the communicator of device CPU:0 (index 0) must be rank 0 of a group of 2");
  const auto group = tp::Group::create(devices, {comms[0].get(), comms[1].get()});
  auto g = std::make_shared<graph::Graph>();
  const Output x = g->placeholder(kFloat32, {2}, "x");
  const Output y = tp::reduce_from_group(x, *group);
  graph::Executor elsewhere(g, devices::get_device("CPU:2"));
  CHECK(contains_text(testing::error_message([&] { elsewhere.run({{x, Tensor::zeros({2}, kFloat32)}}, {y}); }),
                      "device CPU:2 is not in tensor-parallel group"));
}
