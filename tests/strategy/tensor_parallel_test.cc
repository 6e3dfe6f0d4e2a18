// Megatron's f and g operators (strategy/tensor_parallel.h) in hand-built graphs on 2 logical CPU
// devices: an MLP whose middle pair of Dense layers is split column- then row-parallel trains as
// the same MLP on one device (every step's loss and the final weights within 1e-5 relative),
// bitwise the same run to run, with the replicated weights' copies bit-identical, and
// communicates exactly the formula's bytes: per step, one all-reduce of the (batch x 8)
// activation forward and one of its gradient backward; over Gloo with one Group per rank (as one
// process per device) it trains bitwise the same. Also, against one device: the
// vocabulary-parallel embedding and cross-entropy, and self-attention split by heads (its output
// and the gradients of its input and of every projection's piece), and a Conv2D split by output
// channels, gathered for the next convolution.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <functional>
#include <thread>

#include "common/error_message.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/store.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/autodiff.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/tensor_parallel.h"
#include "parallel_mlp.h"

using namespace tandem;
namespace tp = tandem::strategy::tensor_parallel;
using graph::Output;

namespace {

using namespace tandem::testing::parallel_mlp;

constexpr int kSteps = 50;

std::vector<float> rows_of(const std::vector<float>& m, std::int64_t cols, std::int64_t r0, std::int64_t n) {
  return {m.begin() + r0 * cols, m.begin() + (r0 + n) * cols};
}

// One device's graph of the MLP (whole, or tensor rank j's piece of its fc1/fc2 pair), run by an
// executor of its own with plain SGD on its variables.
struct Replica {
  strategy::PipelineStage stage;
  std::unique_ptr<graph::Executor> executor;

  Replica(const Mesh& mesh, int j, const tp::Group* group, devices::Device& device)
      : stage(make_stage(mesh, 0, j, group, device, initial_weights())),
        executor(std::make_unique<graph::Executor>(stage.graph, device)) {
    for (std::size_t k = 0; k < stage.variables.size(); ++k)
      executor->bind_variable(stage.variables[k], stage.values[k]);
  }

  double step(int s) {
    const auto [x, y] = batch(s);
    const Tensor components[] = {x, y};
    std::vector<graph::Feed> feeds;
    for (const auto& [placeholder, component] : stage.data) feeds.push_back({placeholder, components[component]});
    std::vector<Output> fetches{stage.loss};
    fetches.insert(fetches.end(), stage.gradients.begin(), stage.gradients.end());
    auto out = executor->run(feeds, fetches);
    const double loss = out[0].item<float>();
    out.erase(out.begin());
    sgd(stage.values, out);
    return loss;
  }

  std::vector<float> value(std::size_t k) const { return stage.values[k].to_vector<float>(); }
};

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;  // whole, in initial_weights() order
  collective::CommunicationStats stats;
  bool replicated_copies_equal = true;
};

Run train_one_device() {
  Replica r({}, 0, nullptr, devices::get_device("CPU:0"));
  Run run;
  for (int s = 0; s < kSteps; ++s) run.losses.push_back(r.step(s));
  for (std::size_t k = 0; k < 8; ++k) run.weights.push_back(r.value(k));
  return run;
}

// backend "in-process": one Group of both devices, as one process holds them; "gloo": a Gloo
// communicator per rank and a Group of one local device each, as one process per device would.
Run train_tensor_parallel(const std::string& backend = "in-process") {
  std::vector<std::unique_ptr<collective::Communicator>> comms;
  std::vector<devices::Device*> devices{&devices::get_device("CPU:0"), &devices::get_device("CPU:1")};
  std::vector<std::shared_ptr<tp::Group>> groups;
  if (backend == "in-process") {
    comms = collective::make_in_process_group(2);
    groups.push_back(tp::Group::create(devices, {comms[0].get(), comms[1].get()}));
    groups.push_back(groups[0]);
  } else {
    comms.resize(2);
    auto store = collective::make_in_memory_store();
    std::thread other([&] { comms[1] = collective::make_gloo_communicator({.rank = 1, .size = 2, .store = store}); });
    comms[0] = collective::make_gloo_communicator({.rank = 0, .size = 2, .store = store});
    other.join();
    for (std::size_t r = 0; r < 2; ++r) groups.push_back(tp::Group::create({devices[r]}, {comms[r].get()}));
  }
  std::vector<std::unique_ptr<Replica>> replicas;
  for (std::size_t r = 0; r < 2; ++r) {
    replicas.push_back(std::make_unique<Replica>(Mesh{.tp = 2}, static_cast<int>(r), groups[r].get(), *devices[r]));
  }
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
      run.weights[2].insert(run.weights[2].end(), k.begin() + row * piece, k.begin() + (row + 1) * piece);
    }
  }
  for (const auto* r : {&a, &b}) {
    const auto bias = r->value(3), k2 = r->value(4);
    run.weights[3].insert(run.weights[3].end(), bias.begin(), bias.end());
    run.weights[4].insert(run.weights[4].end(), k2.begin(), k2.end());
  }
  run.stats = comms[0]->stats();
  return run;
}

bool contains_text(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst,
                     std::abs(static_cast<double>(a[i]) - b[i]) / std::max(1e-3, std::abs(static_cast<double>(b[i]))));
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
  for (std::size_t k = 0; k < 8; ++k) {
    CAPTURE(k);
    CHECK(max_relative_difference(got.weights[k], want.weights[k]) <= 1e-5);
  }
  CHECK(got.replicated_copies_equal);
  // Megatron's f and g: 2 all-reduces a step of a (32 x 8) float32 activation, each sending
  // 2 (t - 1) / t of its 1024 bytes at t = 2.
  CHECK(got.stats.all_reduce.calls == 2 * kSteps);
  CHECK(got.stats.all_reduce.bytes_sent == 2 * kSteps * kBatch * kIn * 4);
  CHECK(got.stats.total().calls == got.stats.all_reduce.calls);
  // Bitwise the same run to run, and across processes: Gloo sums 2 ranks in rank order, as the
  // in-process group does.
  const Run again = train_tensor_parallel();
  CHECK(again.losses == got.losses);
  CHECK(again.weights == got.weights);
  const Run gloo = train_tensor_parallel("gloo");
  CHECK(gloo.losses == got.losses);
  CHECK(gloo.weights == got.weights);
  CHECK(gloo.stats.all_reduce == got.stats.all_reduce);
}

TEST_CASE("tensor_parallel::Group refuses mismatched lists, and a kernel refuses a device outside its group") {
  auto comms = collective::make_in_process_group(2);
  std::vector<devices::Device*> devices{&devices::get_device("CPU:0"), &devices::get_device("CPU:1")};
  CHECK(testing::error_message([&] { tp::Group::create(devices, {comms[0].get()}); }) ==
        "tensor_parallel::Group: 2 devices but 1 communicators; give one communicator per device");
  CHECK(testing::error_message([&] {
          tp::Group::create(devices, {comms[1].get(), comms[1].get()});
        }) == "tensor_parallel::Group: devices CPU:0 and CPU:1 both have rank 1");
  auto three = collective::make_in_process_group(3);
  CHECK(testing::error_message([&] {
          tp::Group::create(devices, {comms[0].get(), three[1].get()});
        }) ==
        "tensor_parallel::Group: the communicator of device CPU:1 (index 1) must belong to one group of at least 2 "
        "ranks with the others");
  const auto group = tp::Group::create(devices, {comms[0].get(), comms[1].get()});
  auto g = std::make_shared<graph::Graph>();
  const Output x = g->placeholder(kFloat32, {2}, "x");
  const Output y = tp::reduce_from_group(x, *group);
  graph::Executor elsewhere(g, devices::get_device("CPU:2"));
  CHECK(contains_text(testing::error_message([&] {
                        elsewhere.run({{x, Tensor::zeros({2}, kFloat32)}}, {y});
                      }),
                      "device CPU:2 is not in tensor-parallel group"));
}

namespace {

using Built = std::pair<std::vector<graph::Feed>, std::vector<Output>>;

// Two devices of one tensor-parallel group; run() builds each device's graph with build(r, graph)
// (its feeds and fetches), runs both at once, and returns each device's fetched values.
struct TwoDevices {
  std::vector<std::unique_ptr<collective::Communicator>> comms = collective::make_in_process_group(2);
  std::vector<devices::Device*> devices{&devices::get_device("CPU:0"), &devices::get_device("CPU:1")};
  std::shared_ptr<tp::Group> group = tp::Group::create(devices, {comms[0].get(), comms[1].get()});

  std::vector<std::vector<std::vector<float>>> run(const std::function<Built(int, graph::Graph&)>& build) {
    std::vector<std::vector<std::vector<float>>> out(2);
    std::vector<std::shared_ptr<graph::Graph>> graphs{std::make_shared<graph::Graph>(),
                                                      std::make_shared<graph::Graph>()};
    std::vector<Built> built;
    for (int r = 0; r < 2; ++r) built.push_back(build(r, *graphs[static_cast<std::size_t>(r)]));
    const auto go = [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      graph::Executor ex(graphs[i], *devices[i]);
      for (const auto& t : ex.run(built[i].first, built[i].second)) out[i].push_back(t.to_vector<float>());
    };
    std::thread other(go, 1);
    go(0);
    other.join();
    return out;
  }
};

// What build's graph fetches, run whole on CPU:0: the reference the two devices are checked against.
std::vector<std::vector<float>> on_one_device(const std::function<Built(graph::Graph&)>& build) {
  auto g = std::make_shared<graph::Graph>();
  const Built built = build(*g);
  graph::Executor ex(g, devices::get_device("CPU:0"));
  std::vector<std::vector<float>> out;
  for (const auto& t : ex.run(built.first, built.second)) out.push_back(t.to_vector<float>());
  return out;
}

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& e : v) e = d(rng);
  return v;
}

void check_close(const std::vector<float>& got, const std::vector<float>& want, double tolerance) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(got[i] - want[i]) <= tolerance * std::max(1.0f, std::abs(want[i])));
  }
}

}  // namespace

TEST_CASE("vocabulary-parallel cross-entropy over 2 devices: the loss and its gradient without gathering the logits") {
  constexpr std::int64_t kRows = 6, kVocab = 10, kPiece = kVocab / 2;
  const std::vector<float> logits = random_floats(kRows * kVocab, 3);
  const std::vector<std::int32_t> labels{0, 7, 4, 5, 9, 2};  // in both halves
  // One device: the full logits.
  std::vector<float> want_loss, want_grad;
  {
    auto g = std::make_shared<graph::Graph>();
    const Output l = g->placeholder(kFloat32, {kRows, kVocab}, "logits");
    const Output y = g->placeholder(DType::kI32, {kRows}, "labels");
    const Output loss = ops::sparse_softmax_cross_entropy_with_logits(l, y);
    const Output total = ops::reduce_sum(loss);
    const Output grad = graph::gradients({&total, 1}, {&l, 1})[0];
    graph::Executor ex(g, devices::get_device("CPU:0"));
    const auto out = ex.run(
        {{l, Tensor::from_vector(logits, {kRows, kVocab})}, {y, Tensor::from_vector(labels, {kRows})}}, {loss, grad});
    want_loss = out[0].to_vector<float>();
    want_grad = out[1].to_vector<float>();
  }
  TwoDevices two;
  const auto got = two.run([&](int r, graph::Graph& g) -> Built {
    const Output piece = g.placeholder(kFloat32, {kRows, kPiece}, "logits_piece");
    const Output y = g.placeholder(DType::kI32, {kRows}, "labels");
    const Output loss = tp::vocab_parallel_cross_entropy(piece, y, r * kPiece, *two.group);
    const Output total = ops::reduce_sum(loss);
    const Output grad = graph::gradients({&total, 1}, {&piece, 1})[0];
    return {{{piece, Tensor::from_vector(columns(logits, kRows, kVocab, r * kPiece, kPiece), {kRows, kPiece})},
             {y, Tensor::from_vector(labels, {kRows})}},
            {loss, grad}};
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    check_close(got[static_cast<std::size_t>(r)][0], want_loss, 1e-6);
    check_close(got[static_cast<std::size_t>(r)][1], columns(want_grad, kRows, kVocab, r * kPiece, kPiece), 1e-6);
  }
  // Three all-reduces of one float per row (maximum, sum of exponentials, the label's logit),
  // none in backward: 3 x 6 x 4 bytes, never the 6 x 10 logits.
  const auto stats = two.comms[0]->stats();
  CHECK(stats.all_reduce.calls == 3);
  CHECK(stats.all_reduce.bytes_sent == 3 * kRows * 4);
}

TEST_CASE("vocabulary-parallel embedding over 2 devices: every id's row, and each piece's gradient") {
  constexpr std::int64_t kVocab = 10, kPiece = kVocab / 2, kDim = 3;
  const std::vector<float> table = random_floats(kVocab * kDim, 5);
  const std::vector<std::int32_t> ids{0, 9, 4, 5, 5, 1, 7, 3};  // [2, 4], a repeat, both halves
  const std::vector<float> weights = random_floats(ids.size() * kDim, 6);
  std::vector<float> want_rows, want_grad;
  {
    auto g = std::make_shared<graph::Graph>();
    const Output t = g->placeholder(kFloat32, {kVocab, kDim}, "table");
    const Output i = g->placeholder(DType::kI32, {2, 4}, "ids");
    const Output w = g->placeholder(kFloat32, {2, 4, kDim}, "w");
    const Output rows = ops::gather(t, i);
    const Output total = ops::reduce_sum(ops::mul(rows, w));
    const Output grad = graph::gradients({&total, 1}, {&t, 1})[0];
    graph::Executor ex(g, devices::get_device("CPU:0"));
    const auto out = ex.run({{t, Tensor::from_vector(table, {kVocab, kDim})},
                             {i, Tensor::from_vector(ids, {2, 4})},
                             {w, Tensor::from_vector(weights, {2, 4, kDim})}},
                            {rows, grad});
    want_rows = out[0].to_vector<float>();
    want_grad = out[1].to_vector<float>();
  }
  TwoDevices two;
  const auto got = two.run([&](int r, graph::Graph& g) -> Built {
    const Output piece = g.placeholder(kFloat32, {kPiece, kDim}, "table_piece");
    const Output i = g.placeholder(DType::kI32, {2, 4}, "ids");
    const Output w = g.placeholder(kFloat32, {2, 4, kDim}, "w");
    const Output rows = tp::vocab_parallel_embedding(i, piece, r * kPiece, *two.group);
    const Output total = ops::reduce_sum(ops::mul(rows, w));
    const Output grad = graph::gradients({&total, 1}, {&piece, 1})[0];
    return {{{piece, Tensor::from_vector(rows_of(table, kDim, r * kPiece, kPiece), {kPiece, kDim})},
             {i, Tensor::from_vector(ids, {2, 4})},
             {w, Tensor::from_vector(weights, {2, 4, kDim})}},
            {rows, grad}};
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    check_close(got[static_cast<std::size_t>(r)][0], want_rows, 1e-6);
    check_close(got[static_cast<std::size_t>(r)][1], rows_of(want_grad, kDim, r * kPiece, kPiece), 1e-6);
  }
  // One all-reduce of the (8 ids x 3) rows forward, none backward.
  const auto stats = two.comms[0]->stats();
  CHECK(stats.all_reduce.calls == 1);
  CHECK(stats.all_reduce.bytes_sent == 8 * kDim * 4);
}

namespace {

// Self-attention with `heads` heads of size kKey over x [kB, kT, kC], with projections given as
// [kC, heads x kKey] (query, key, value) and [heads x kKey, kC] (output). With a group, this
// device's heads only: x enters through f (copy_to_group) and the output projection's partial
// sums leave through g (reduce_from_group) before the bias, as Megatron splits attention.
constexpr std::int64_t kB = 2, kT = 4, kC = 8, kHeads = 4, kKey = 2;

Output attention(Output x, Output wq, Output wk, Output wv, Output wo, Output bo, std::int64_t heads,
                 const tp::Group* group) {
  if (group) x = tp::copy_to_group(x, *group);
  const Output rows = ops::reshape(x, {-1, kC});
  const auto project = [&](Output w) {
    return ops::transpose(ops::reshape(ops::matmul(rows, w), {kB, kT, heads, kKey}), {0, 2, 1, 3});
  };
  const Output q = project(wq), k = project(wk), v = project(wv);
  const Output probs = ops::masked_softmax(ops::batch_matmul(q, k, {.adj_y = true}), Output{},
                                           {.scale = 1.0 / std::sqrt(static_cast<double>(kKey))});
  const Output combined = ops::reshape(ops::transpose(ops::batch_matmul(probs, v), {0, 2, 1, 3}), {-1, heads * kKey});
  Output y = ops::matmul(combined, wo);
  if (group) y = tp::reduce_from_group(y, *group);
  return ops::bias_add(y, bo);
}

}  // namespace

TEST_CASE("attention split by heads over 2 devices: the output and every gradient as one device computes them") {
  // Values of about 0.5, as initialised weights and normalised activations are: scores stay in
  // the softmax's soft range, where float32 sums in another order differ by a few ulps.
  const auto small = [](std::size_t n, unsigned seed) {
    auto v = random_floats(n, seed);
    for (auto& e : v) e *= 0.25f;
    return v;
  };
  const auto wq = small(kC * kHeads * kKey, 11), wk = small(kC * kHeads * kKey, 12), wv = small(kC * kHeads * kKey, 13),
             wo = small(kHeads * kKey * kC, 14), bo = small(kC, 15), x = small(kB * kT * kC, 16),
             w = small(kB * kT * kC, 17);
  const std::int64_t width = kHeads * kKey, piece = width / 2;
  // The outputs: y, then the gradients of sum(y * w) with respect to x, wq, wk, wv, wo, bo.
  const auto build = [&](graph::Graph& g, int r, const tp::Group* group) -> Built {
    const std::int64_t heads = group ? kHeads / 2 : kHeads, cols = heads * kKey;
    const auto slice_columns = [&](const std::vector<float>& m) {
      return group ? columns(m, kC, width, r * piece, piece) : m;
    };
    const std::vector<float> wo_rows =
        group ? std::vector<float>(wo.begin() + r * piece * kC, wo.begin() + (r + 1) * piece * kC) : wo;
    const Output px = g.placeholder(kFloat32, {kB, kT, kC}, "x");
    const Output pq = g.placeholder(kFloat32, {kC, cols}, "wq"), pk = g.placeholder(kFloat32, {kC, cols}, "wk"),
                 pv = g.placeholder(kFloat32, {kC, cols}, "wv"), po = g.placeholder(kFloat32, {cols, kC}, "wo"),
                 pb = g.placeholder(kFloat32, {kC}, "bo"), pw = g.placeholder(kFloat32, {kB * kT, kC}, "w");
    const Output y = attention(px, pq, pk, pv, po, pb, heads, group);
    const Output total = ops::reduce_sum(ops::mul(y, pw));
    const std::vector<Output> xs{px, pq, pk, pv, po, pb};
    std::vector<Output> fetches{y};
    for (const auto& grad : graph::gradients({&total, 1}, xs)) fetches.push_back(grad);
    return {{{px, Tensor::from_vector(x, {kB, kT, kC})},
             {pq, Tensor::from_vector(slice_columns(wq), {kC, cols})},
             {pk, Tensor::from_vector(slice_columns(wk), {kC, cols})},
             {pv, Tensor::from_vector(slice_columns(wv), {kC, cols})},
             {po, Tensor::from_vector(wo_rows, {cols, kC})},
             {pb, Tensor::from_vector(bo, {kC})},
             {pw, Tensor::from_vector(w, {kB * kT, kC})}},
            fetches};
  };
  const auto want = on_one_device([&](graph::Graph& g) { return build(g, 0, nullptr); });
  TwoDevices two;
  const auto got = two.run([&](int r, graph::Graph& g) { return build(g, r, two.group.get()); });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& mine = got[static_cast<std::size_t>(r)];
    check_close(mine[0], want[0], 1e-5);  // y, whole on every device
    check_close(mine[1], want[1], 1e-5);  // x's gradient: summed over the heads by f
    for (std::size_t k : {2, 3, 4}) check_close(mine[k], columns(want[k], kC, width, r * piece, piece), 1e-5);
    check_close(mine[5], rows_of(want[5], kC, r * piece, piece), 1e-5);
    check_close(mine[6], want[6], 1e-5);  // the output bias, whole
  }
  // One all-reduce of the (8 x 8) output forward and one of x's gradient backward.
  const auto stats = two.comms[0]->stats();
  CHECK(stats.all_reduce.calls == 2);
  CHECK(stats.all_reduce.bytes_sent == 2 * kB * kT * kC * 4);
}

TEST_CASE("Conv2D split by output channels over 2 devices, gathered for the next convolution, as one device") {
  constexpr std::int64_t kN = 2, kH = 5, kW = 5, kIn = 3, kOut = 4, kOut2 = 2, kHalf = kOut / 2;
  const auto small = [](std::size_t n, unsigned seed) {
    auto v = random_floats(n, seed);
    for (auto& e : v) e *= 0.25f;
    return v;
  };
  const auto x = small(kN * kH * kW * kIn, 21), f1 = small(3 * 3 * kIn * kOut, 22), b1 = small(kOut, 23),
             f2 = small(3 * 3 * kOut * kOut2, 24), w = small(kN * 3 * 3 * kOut2, 25);
  // Outputs: y, then the gradients of sum(y * w) with respect to x, f1, b1 and f2.
  const auto build = [&](graph::Graph& g, int r, const tp::Group* group) -> Built {
    const std::int64_t out = group ? kHalf : kOut;
    const Output px = g.placeholder(kFloat32, {kN, kH, kW, kIn}, "x");
    const Output pf1 = g.placeholder(kFloat32, {3, 3, kIn, out}, "f1"), pb1 = g.placeholder(kFloat32, {out}, "b1");
    const Output pf2 = g.placeholder(kFloat32, {3, 3, kOut, kOut2}, "f2");
    const Output pw = g.placeholder(kFloat32, {kN, 3, 3, kOut2}, "w");
    Output h = group ? tp::copy_to_group(px, *group) : px;
    h = ops::relu(ops::bias_add(ops::conv2d(h, pf1), pb1));  // [2, 3, 3, out]
    if (group) h = tp::gather_from_group(h, 3, *group);      // the channels made whole
    const Output y = ops::conv2d(h, pf2, {.padding = ops::Padding::kSame});
    const Output total = ops::reduce_sum(ops::mul(y, pw));
    const std::vector<Output> xs{px, pf1, pb1, pf2};
    std::vector<Output> fetches{y};
    for (const auto& grad : graph::gradients({&total, 1}, xs)) fetches.push_back(grad);
    return {{{px, Tensor::from_vector(x, {kN, kH, kW, kIn})},
             {pf1, Tensor::from_vector(group ? columns(f1, 3 * 3 * kIn, kOut, r * kHalf, kHalf) : f1, {3, 3, kIn, out})},
             {pb1, Tensor::from_vector(group ? std::vector<float>(b1.begin() + r * kHalf, b1.begin() + (r + 1) * kHalf) : b1,
                                       {out})},
             {pf2, Tensor::from_vector(f2, {3, 3, kOut, kOut2})},
             {pw, Tensor::from_vector(w, {kN, 3, 3, kOut2})}},
            fetches};
  };
  const auto want = on_one_device([&](graph::Graph& g) { return build(g, 0, nullptr); });
  TwoDevices two;
  const auto got = two.run([&](int r, graph::Graph& g) { return build(g, r, two.group.get()); });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& mine = got[static_cast<std::size_t>(r)];
    check_close(mine[0], want[0], 1e-5);  // y
    check_close(mine[1], want[1], 1e-5);  // x's gradient, summed over the channel pieces by f
    check_close(mine[2], columns(want[2], 3 * 3 * kIn, kOut, r * kHalf, kHalf), 1e-5);
    check_close(mine[3], {want[3].begin() + r * kHalf, want[3].begin() + (r + 1) * kHalf}, 1e-5);
    check_close(mine[4], want[4], 1e-5);  // the replicated second filter
  }
  // Forward: one all-gather of the (2 x 3 x 3 x 4) channels; backward: one all-reduce of x's gradient.
  const auto stats = two.comms[0]->stats();
  CHECK(stats.all_gather.calls == 1);
  CHECK(stats.all_gather.bytes_sent == kN * 3 * 3 * kOut * 4 / 2);
  CHECK(stats.all_reduce.calls == 1);
  CHECK(stats.all_reduce.bytes_sent == kN * kH * kW * kIn * 4);
}
