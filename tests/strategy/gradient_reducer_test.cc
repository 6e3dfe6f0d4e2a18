// The strategy's gradient reducer, driven as a custom training loop drives it (CTest runs this
// suite with TANDEM_NUM_CPU_DEVICES=4): bucket plans, reduced values against a serial sum,
// overlap, accumulation without communication, compression, the values riding with the last
// bucket, mistakes reported by name, and a strategy that answers per variable (the extension
// point) trained by fit() with no change to the trainer.
#include <doctest/doctest.h>

#include <sched.h>

#include <cmath>
#include <random>

#include "tandem/base/random.h"
#include "tandem/keras_like/keras.h"
#include "tandem/tandem.h"

using namespace tandem;
using strategy::GradientReducer;
using strategy::StepKind;

namespace {

std::vector<std::string> cpu_devices(int n) {
  std::vector<std::string> names;
  for (int d = 0; d < n; ++d) names.push_back(fmt::format("CPU:{}", d));
  return names;
}

Tensor random_tensor(Shape shape, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(shape.num_elements()));
  for (auto& e : v) e = normal(rng);
  return Tensor::from_vector(v, shape);
}

// A small network in the graph API with one executor per replica: loss = sum((relu(x w1) w2 + b)^2).
// Weights: w1 8x32 (1 KiB), w2 32x4, b 4.
struct Toy {
  Strategy& strategy;
  std::shared_ptr<Graph> graph = std::make_shared<Graph>();
  Output x;
  std::vector<std::shared_ptr<strategy::Variable>> variables;
  std::vector<Output> nodes, grads, fetches;
  std::vector<std::unique_ptr<graph::Executor>> executors;
  std::unique_ptr<GradientReducer> reducer;

  explicit Toy(Strategy& s, strategy::GradientReducerOptions options = {}, bool accumulators = false) : strategy(s) {
    const std::vector<std::pair<std::string, Shape>> shapes{{"w1", {8, 32}}, {"w2", {32, 4}}, {"b", {4}}};
    {
      auto scope = strategy.scope();
      std::uint64_t seed = 1;
      for (const auto& [name, shape] : shapes) {
        variables.push_back(strategy.create_variable({.name = name, .initial_value = random_tensor(shape, seed++)}));
        if (accumulators) {
          options.accumulators.push_back(strategy.create_variable(
              {.name = name + "/accumulator", .initial_value = Tensor::zeros(shape, kFloat32), .trainable = false}));
        }
      }
    }
    x = graph->placeholder(kFloat32, {-1, 8}, "x");
    for (const auto& v : variables) nodes.push_back(graph->variable(v->dtype(), v->shape(), v->name()));
    auto out = ops::bias_add(ops::matmul(ops::relu(ops::matmul(x, nodes[0])), nodes[1]), nodes[2]);
    auto loss = ops::reduce_sum(ops::square(out));
    grads = graph::gradients({&loss, 1}, nodes);
    strategy::make_gradients_reducible(*graph, grads);
    std::vector<strategy::GradientSource> sources;
    for (std::size_t k = 0; k < variables.size(); ++k) sources.push_back({variables[k], grads[k]});
    reducer = strategy.make_gradient_reducer(std::move(sources), std::move(options));
    fetches = grads;
    for (std::size_t r = 0; r < strategy.replica_devices().size(); ++r) {
      executors.push_back(std::make_unique<graph::Executor>(graph, *strategy.replica_devices()[r]));
      for (std::size_t k = 0; k < variables.size(); ++k)
        executors[r]->bind_variable(nodes[k], variables[k]->value(static_cast<int>(r)));
    }
  }

  static Tensor input(int replica, int step) {
    return random_tensor({5, 8}, 100 + static_cast<std::uint64_t>(replica * 31 + step));
  }

  // Replica r's own gradients for its input (no reducer), as host copies.
  std::vector<std::vector<float>> local_gradients(int r, int step) {
    std::vector<std::vector<float>> out;
    for (const auto& t : executors[static_cast<std::size_t>(r)]->run({{x, input(r, step)}}, fetches))
      out.push_back(t.to_vector<float>());
    return out;
  }

  // One step through the reducer on every replica; returns each replica's result (host copies).
  std::vector<std::vector<std::vector<float>>> step(int step, StepKind kind) {
    std::vector<std::vector<std::vector<float>>> result(executors.size());
    strategy.run([&](strategy::ReplicaContext& ctx) {
      const int r = ctx.replica_id_in_sync_group();
      reducer->begin_step(r, kind);
      executors[static_cast<std::size_t>(r)]->run({{x, input(r, step)}}, fetches, {.observer = reducer->observer(r)});
      for (const auto& t : reducer->finish_step(r)) result[static_cast<std::size_t>(r)].push_back(t.to_vector<float>());
    });
    return result;
  }
};

void check_close(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  double scale = 1e-3, worst = 0;
  for (float v : want) scale = std::max(scale, static_cast<double>(std::abs(v)));
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]) / scale);
  CHECK_MESSAGE(worst <= tolerance, what, ": relative difference ", worst);
}

std::vector<std::vector<float>> sum_over_replicas(const std::vector<std::vector<std::vector<float>>>& per_replica) {
  auto total = per_replica.front();
  for (std::size_t r = 1; r < per_replica.size(); ++r) {
    for (std::size_t k = 0; k < total.size(); ++k) {
      for (std::size_t i = 0; i < total[k].size(); ++i) total[k][i] += per_replica[r][k][i];
    }
  }
  return total;
}

}  // namespace

TEST_CASE("buckets: reverse creation order, a small first bucket, large gradients alone, one dtype each") {
  MirroredStrategy two({.devices = cpu_devices(2), .distribution = {.first_bucket_bytes = 100, .bucket_bytes = 600}});
  auto scope = two.scope();
  Graph graph;
  std::vector<strategy::GradientSource> sources;
  // Sizes in bytes: 64, 64, 512, 2048, 64 (float64), 64, 64.
  const std::vector<std::pair<Shape, DType>> specs{{{16}, kFloat32},  {{16}, kFloat32}, {{128}, kFloat32},
                                                   {{512}, kFloat32}, {{8}, kFloat64},  {{16}, kFloat32},
                                                   {{16}, kFloat32}};
  for (std::size_t k = 0; k < specs.size(); ++k) {
    const auto& [shape, dtype] = specs[k];
    auto v = two.create_variable({.name = fmt::format("v{}", k), .initial_value = Tensor::zeros(shape, dtype)});
    // Gradients computed in creation order, so the last variable's is the last node: the reverse
    // of what backward does. The completion order must follow the nodes, not the bucket ids.
    sources.push_back({v, graph.placeholder(dtype, shape, fmt::format("g{}", k))});
  }
  const GradientReducer reducer(two, sources);
  // Planned from the last variable: {6} (the first bucket holds at most 100 B), {5}, {4} (float64),
  // {3} (2 KiB: alone), {2, 1} (576 B), {0}; reduced in the order their last gradient is computed.
  CHECK(reducer.buckets() == std::vector<std::vector<std::size_t>>{{0}, {2, 1}, {3}, {4}, {5}, {6}});
}

TEST_CASE("a custom loop's gradients are summed over every replica, overlapping backward") {
  for (const int replicas : {2, 4}) {
    CAPTURE(replicas);
    // 64-byte buckets: every gradient its own bucket, all but the last reduced during backward.
    MirroredStrategy mirrored(
        {.devices = cpu_devices(replicas),
         .distribution = {.first_bucket_bytes = 64, .bucket_bytes = 64, .overlap_communication = true}});
    Toy toy(mirrored);
    CHECK(toy.reducer->buckets().size() == 3);
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<std::vector<float>>> local;
      for (int r = 0; r < replicas; ++r) local.push_back(toy.local_gradients(r, step));
      const auto want = sum_over_replicas(local);
      const auto got = toy.step(step, StepKind::kReduce);
      for (int r = 0; r < replicas; ++r) {
        for (std::size_t k = 0; k < want.size(); ++k)
          check_close(got[static_cast<std::size_t>(r)][k], want[k], 1e-6, toy.variables[k]->name());
        CHECK(got[static_cast<std::size_t>(r)] == got.front());  // bitwise the same on every replica
      }
    }
    for (int r = 0; r < replicas; ++r) CHECK(toy.reducer->overlapped_buckets(r) == 3 * 2);  // 2 of 3 buckets a step
  }
  // Without overlap, every bucket waits for finish_step.
  MirroredStrategy after(
      {.devices = cpu_devices(2),
       .distribution = {.first_bucket_bytes = 64, .bucket_bytes = 64, .overlap_communication = false}});
  Toy toy(after);
  toy.step(0, StepKind::kReduce);
  CHECK(toy.reducer->overlapped_buckets(0) == 0);
}

TEST_CASE("overlap_communication unset: a communication thread only where it leaves the replicas their cores") {
  const strategy::DistributionOptions small{.first_bucket_bytes = 64, .bucket_bytes = 64};
  const auto overlapped_per_step = [&](Strategy& strategy) {
    Toy toy(strategy);
    toy.step(0, StepKind::kReduce);
    return toy.reducer->overlapped_buckets(0);
  };
  MirroredStrategy two({.devices = cpu_devices(2), .distribution = small});
  int threads = 0;
  for (const auto* device : two.replica_devices()) threads += device->intra_op_threads();
  // On this machine: CPU replicas, gradients that stay in the process.
  const bool free_core = threads < devices::usable_cpu_cores();
  CHECK(two.overlaps_communication() == free_core);
  CHECK(overlapped_per_step(two) == (free_core ? 2 : 0));
  auto forced = small;
  {
    // A thread held to one core (usable_cpu_cores reads the caller's mask): the replicas' threads
    // take it, so the collectives wait for backward.
    struct OneCore {
      cpu_set_t all{};
      OneCore() {
        REQUIRE(sched_getaffinity(0, sizeof(all), &all) == 0);
        cpu_set_t one;
        CPU_ZERO(&one);
        for (int c = 0; c < CPU_SETSIZE; ++c) {
          if (CPU_ISSET(c, &all)) {
            CPU_SET(c, &one);
            break;
          }
        }
        REQUIRE(sched_setaffinity(0, sizeof(one), &one) == 0);
      }
      ~OneCore() { sched_setaffinity(0, sizeof(all), &all); }
    } held;
    CHECK(devices::usable_cpu_cores() == 1);
    CHECK_FALSE(two.overlaps_communication());
    // ZeRO stage 2 keeps the thread anyway: its reduced gradients are handed over there.
    MirroredStrategy zero2({.devices = cpu_devices(2), .distribution = {.zero = strategy::ZeroStage::k2}});
    CHECK(zero2.overlaps_communication());
    // What the user sets wins; one replica has nothing to overlap.
    forced.overlap_communication = true;
    MirroredStrategy on({.devices = cpu_devices(2), .distribution = forced});
    CHECK(on.overlaps_communication());
    CHECK(overlapped_per_step(on) == 2);
  }
  forced.overlap_communication = false;
  MirroredStrategy off({.devices = cpu_devices(2), .distribution = forced});
  CHECK_FALSE(off.overlaps_communication());
  MirroredStrategy single({.devices = cpu_devices(1), .distribution = {.overlap_communication = true}});
  CHECK_FALSE(single.overlaps_communication());
}

TEST_CASE("accumulation: micro-steps communicate nothing; the reduce step sums every replica's micro-steps") {
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  Toy toy(two, {}, /*accumulators=*/true);
  const auto before = two.communicator(0).sequence_number();
  const auto local0 = toy.step(0, StepKind::kAccumulate);
  const auto local1 = toy.step(1, StepKind::kAccumulate);
  CHECK(two.communicator(0).sequence_number() == before);  // no collective at all
  CHECK(local0[0] != local0[1]);                           // each replica its own gradients
  const auto reduced = toy.step(2, StepKind::kReduce);
  std::vector<std::vector<std::vector<float>>> parts;
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < 3; ++s) parts.push_back(toy.local_gradients(r, s));
  }
  const auto want = sum_over_replicas(parts);
  for (std::size_t k = 0; k < want.size(); ++k) check_close(reduced[0][k], want[k], 1e-5, toy.variables[k]->name());
  CHECK_THROWS_WITH_AS(Toy(two).step(0, StepKind::kAccumulate), doctest::Contains("needs accumulators"),
                       FailedPrecondition);
}

TEST_CASE(
    "ZeRO's update during backward: a handed-off shard is applied at its release, unless its variable is still read") {
  // One gradient per bucket: b's and w2's are handed off (every bucket but the last, w1's).
  MirroredStrategy two({.devices = cpu_devices(2),
                        .distribution = {.first_bucket_bytes = 1, .bucket_bytes = 1, .zero = strategy::ZeroStage::k2}});
  REQUIRE(two.overlaps_communication());
  std::vector<std::shared_ptr<strategy::Variable>> variables;
  {
    auto scope = two.scope();
    std::uint64_t seed = 1;
    for (const auto& [name, shape] :
         std::vector<std::pair<std::string, Shape>>{{"w1", {8, 32}}, {"w2", {32, 4}}, {"b", {4}}})
      variables.push_back(two.create_variable({.name = name, .initial_value = random_tensor(shape, seed++)}));
  }
  const auto run = [&](bool b_read_late) {
    auto graph = std::make_shared<Graph>();
    const Output x = graph->placeholder(kFloat32, {-1, 8}, "x");
    std::vector<Output> nodes;
    for (const auto& v : variables) nodes.push_back(graph->variable(v->dtype(), v->shape(), v->name()));
    auto out = ops::bias_add(ops::matmul(ops::relu(ops::matmul(x, nodes[0])), nodes[1]), nodes[2]);
    auto loss = ops::reduce_sum(ops::square(out));
    auto grads = graph::gradients({&loss, 1}, nodes);
    strategy::make_gradients_reducible(*graph, grads);
    std::vector<Output> fetches = grads;
    // A node after backward that reads b: its update must wait for the end of the step.
    if (b_read_late) fetches.push_back(ops::reduce_sum(nodes[2]));
    std::vector<strategy::GradientSource> sources;
    for (std::size_t k = 0; k < variables.size(); ++k) sources.push_back({variables[k], grads[k], nodes[k]});
    struct Applied {
      std::size_t gradient;
      std::vector<float> shard;
    };
    std::vector<std::vector<Applied>> applied(2);
    strategy::GradientReducerOptions options;
    options.update = [&](int replica, std::size_t k, const Tensor& shard) {
      applied[static_cast<std::size_t>(replica)].push_back({k, shard.to_vector<float>()});
    };
    auto reducer = two.make_gradient_reducer(std::move(sources), std::move(options));
    const auto hand_offs = reducer->hand_offs(0);
    CHECK(hand_offs.size() == 2);
    std::vector<std::vector<std::vector<float>>> local(2), returned(2);
    std::vector<std::vector<bool>> defined(2);
    two.run([&](strategy::ReplicaContext& ctx) {
      const int r = ctx.replica_id_in_sync_group();
      graph::Executor executor(graph, *two.replica_devices()[static_cast<std::size_t>(r)]);
      for (std::size_t k = 0; k < variables.size(); ++k) executor.bind_variable(nodes[k], variables[k]->value(r));
      const Tensor input = random_tensor({5, 8}, 100 + static_cast<std::uint64_t>(r));
      for (const auto& t : executor.run({{x, input}}, grads))
        local[static_cast<std::size_t>(r)].push_back(t.to_vector<float>());
      reducer->begin_step(r, StepKind::kReduce);
      executor.run({{x, input}}, fetches, {.observer = reducer->observer(r), .hand_offs = hand_offs});
      for (const auto& t : reducer->finish_step(r)) {
        defined[static_cast<std::size_t>(r)].push_back(t.defined());
        returned[static_cast<std::size_t>(r)].push_back(t.defined() ? t.to_vector<float>() : std::vector<float>{});
      }
    });
    const auto want = sum_over_replicas(local);
    const auto shard_of = [&](std::size_t k, int r) {
      const auto spec = *two.zero_shard_spec(*variables[k]);
      std::vector<float> shard(static_cast<std::size_t>(spec.shard_elements), 0.0f);
      for (std::int64_t i = spec.begin(r); i < spec.end(r); ++i)
        shard[static_cast<std::size_t>(i - spec.begin(r))] = want[k][static_cast<std::size_t>(i)];
      return shard;
    };
    for (int r = 0; r < 2; ++r) {
      const auto& got = applied[static_cast<std::size_t>(r)];
      const std::size_t early = b_read_late ? 1 : 2;  // w2 (and b, unless it is read late)
      REQUIRE(got.size() == early);
      for (const auto& [k, shard] : got) {
        CHECK((k == 1 || (k == 2 && !b_read_late)));
        CHECK_FALSE(defined[static_cast<std::size_t>(r)][k]);  // finish_step leaves it to no one
        check_close(shard, shard_of(k, r), 1e-6, variables[k]->name() + " applied during backward");
      }
      for (std::size_t k = 0; k < variables.size(); ++k) {
        if (!defined[static_cast<std::size_t>(r)][k]) continue;
        CHECK((k == 0 || (k == 2 && b_read_late)));
        check_close(returned[static_cast<std::size_t>(r)][k], shard_of(k, r), 1e-6, variables[k]->name() + " returned");
      }
    }
  };
  run(/*b_read_late=*/false);
  run(/*b_read_late=*/true);
}

TEST_CASE("compressed all-reduce: 16-bit sums on the wire, float32 gradients back") {
  MirroredStrategy exact(std::vector<std::string>{"CPU:0", "CPU:1"});
  MirroredStrategy bf16({.devices = cpu_devices(2), .distribution = {.gradient_all_reduce_dtype = DType::kBF16}});
  Toy a(exact), b(bf16);
  const auto want = a.step(0, StepKind::kReduce);
  const auto got = b.step(0, StepKind::kReduce);
  for (std::size_t k = 0; k < want[0].size(); ++k) {
    check_close(got[0][k], want[0][k], 2e-2, a.variables[k]->name());  // bfloat16 keeps 8 bits
    CHECK(got[0][k] == got[1][k]);
  }
  CHECK(got[0] != want[0]);  // the wire really was 16 bits
}

TEST_CASE("a tensor summed with the last bucket rides in its collective") {
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  Toy toy(two, {}, /*accumulators=*/true);
  REQUIRE(toy.reducer->extra_dtype() == kFloat32);
  std::vector<float> sums(2);
  std::vector<bool> carried(2);
  for (const StepKind kind : {StepKind::kReduce, StepKind::kAccumulate}) {
    const auto before = two.communicator(0).sequence_number();
    two.run([&](strategy::ReplicaContext& ctx) {
      const int r = ctx.replica_id_in_sync_group();
      toy.reducer->begin_step(r, kind);
      Tensor extra = Tensor::from_vector<float>({static_cast<float>(r + 1), 10}, {2});
      carried[static_cast<std::size_t>(r)] = toy.reducer->sum_with_last_bucket(r, {&extra, 1});
      toy.executors[static_cast<std::size_t>(r)]->run({{toy.x, Toy::input(r, 0)}}, toy.fetches,
                                                      {.observer = toy.reducer->observer(r)});
      toy.reducer->finish_step(r);
      sums[static_cast<std::size_t>(r)] = extra.data<float>()[0];
    });
    if (kind == StepKind::kReduce) {
      CHECK(carried == std::vector<bool>{true, true});
      CHECK(sums == std::vector<float>{3, 3});
      CHECK(two.communicator(0).sequence_number() == before + 1);  // one bucket, one collective
    } else {
      CHECK(carried == std::vector<bool>{false, false});  // a micro-step reduces no bucket
      CHECK(sums == std::vector<float>{1, 2});
    }
  }
}

TEST_CASE("mistakes are reported naming the variable") {
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  auto scope = two.scope();
  auto v = two.create_variable({.name = "dense/kernel", .initial_value = Tensor::zeros({4}, kFloat32)});
  Graph graph;
  auto node = graph.variable(kFloat32, {4}, "dense/kernel");
  auto loss = ops::reduce_sum(ops::square(node));
  auto grads = graph::gradients({&loss, 1}, std::vector<Output>{node});
  auto read_again = ops::reduce_sum(grads[0]);  // another node reads the gradient
  (void)read_again;
  CHECK_THROWS_WITH_AS(GradientReducer(two, {{v, grads[0]}}), doctest::Contains("\"dense/kernel\""), InvalidArgument);
  CHECK_THROWS_WITH_AS(GradientReducer(two, {{v, grads[0]}}), doctest::Contains("make_gradients_reducible"),
                       InvalidArgument);
  strategy::make_gradients_reducible(graph, grads);
  GradientReducer reducer(two, {{v, grads[0]}});
  // A run without the reducer's observer: the gradient never reaches it.
  reducer.begin_step(0, StepKind::kReduce);
  CHECK_THROWS_WITH_AS(reducer.finish_step(0), doctest::Contains("without the gradient of variable \"dense/kernel\""),
                       FailedPrecondition);
  CHECK_THROWS_WITH_AS(reducer.begin_step(2, StepKind::kReduce), doctest::Contains("replica 2 out of range"),
                       InvalidArgument);
  auto wrong = two.create_variable({.name = "dense/bias", .initial_value = Tensor::zeros({3}, kFloat32)});
  CHECK_THROWS_WITH_AS(GradientReducer(two, {{wrong, grads[0]}}), doctest::Contains("\"dense/bias\" (float32 (3,))"),
                       InvalidArgument);
  OneDeviceStrategy other("CPU:0");
  CHECK_THROWS_WITH_AS(GradientReducer(other, {{v, grads[0]}}), doctest::Contains("was created under"),
                       FailedPrecondition);
}

namespace {

// A strategy that keeps one variable to each replica (its gradient is not communicated), as a
// tensor-parallel strategy keeps its shards: written here, outside the library, with no change
// to the trainer.
class KeepsLastBiasLocal final : public Strategy {
 public:
  KeepsLastBiasLocal()
      : Strategy("KeepsLastBiasLocal", {&devices::get_device("CPU:0"), &devices::get_device("CPU:1")}) {}
  strategy::VariablePlan variable_plan(const strategy::Variable& variable) const override {
    // The bias and its optimizer slots.
    if (variable.name().rfind("head/bias", 0) == 0) return {.reduction = strategy::VariablePlan::Reduction::kNone};
    return {};
  }
};

}  // namespace

TEST_CASE("a strategy decides per variable how its gradient is communicated; fit follows") {
  KeepsLastBiasLocal local;
  set_global_seed(3);
  keras::Model model;
  {
    auto scope = local.scope();
    model = keras::Sequential({keras::Input({8}), keras::Dense(8, "relu"), keras::Dense(3, {.name = "head"})});
    model.compile(keras::SGD{.learning_rate = 0.1}, keras::SparseCategoricalCrossentropy{.from_logits = true});
  }
  std::vector<std::int64_t> labels(64);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int64_t>(i % 3);
  const Tensor x = random_tensor({64, 8}, 9);
  const Tensor y = Tensor::from_vector(labels, {64});
  model.fit(x, y, {.batch_size = 16, .epochs = 2, .verbose = 0});  // checks the replicated copies each epoch
  for (const auto& w : model.weights()) {
    const bool local_bias = w->name() == "head/bias";
    CAPTURE(w->name());
    if (local_bias) {
      CHECK(w->value(0).to_vector<float>() != w->value(1).to_vector<float>());  // each replica's own
    } else {
      CHECK_NOTHROW(w->check_copies_equal());
    }
  }
}
