// A training loop written by hand over the graph API, under a distribution strategy: TF's custom
// training loop (strategy.run(step_fn), the loss scaled by the global batch) in C++. The
// strategy's GradientReducer all-reduces the gradients in buckets while each replica's backward
// is still running, exactly as fit() does; the loop only runs the replicas' executors and applies
// plain SGD to each replica's copies.
//
//   build/samples/custom_training_loop                       # MirroredStrategy, 2 logical CPU devices
//   build/samples/custom_training_loop --strategy one        # OneDeviceStrategy("CPU:0")
//   build/samples/custom_training_loop --compare             # both; fails if they differ by > 1e-5
//   build/samples/custom_training_loop --collective-timeout 30   # a replica that stalls fails in 30 s
//
// The model: a 3-layer MLP regressing a smooth function of 16 inputs, 5,377 weights, with small
// buckets (4 KiB, then 16 KiB) so that a step has several of them to overlap with backward.
#include <tandem/data/dataset.h>
#include <tandem/strategy/strategy.h>
#include <tandem/tandem.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace tandem;

struct Options {
  std::string strategy = "mirrored";
  int cpu_devices = 2;
  int steps = 300;
  std::int64_t batch = 64;
  float learning_rate = 0.05f;
  bool compare = false;
  int verbose = 1;
  double collective_timeout = 0;  // seconds; 0: DistributionOptions' default
};

constexpr std::int64_t kFeatures = 16, kHidden = 64, kExamples = 4096;

// y = sin(sum of x's first half) + 0.5 * cos(sum of its second half), x uniform in [-1, 1].
std::pair<Tensor, Tensor> make_data() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> xs(static_cast<std::size_t>(kExamples * kFeatures)), ys(static_cast<std::size_t>(kExamples));
  for (std::int64_t i = 0; i < kExamples; ++i) {
    float a = 0, b = 0;
    for (std::int64_t f = 0; f < kFeatures; ++f) {
      const float v = uniform(rng);
      xs[static_cast<std::size_t>(i * kFeatures + f)] = v;
      (f < kFeatures / 2 ? a : b) += v;
    }
    ys[static_cast<std::size_t>(i)] = std::sin(a) + 0.5f * std::cos(b);
  }
  return {Tensor::from_vector(xs, {kExamples, kFeatures}), Tensor::from_vector(ys, {kExamples, 1})};
}

// Glorot-uniform weights and zero biases, the same for every strategy (a fixed generator).
std::vector<std::pair<std::string, Tensor>> initial_weights() {
  std::mt19937 rng(1);
  const auto glorot = [&](std::int64_t in, std::int64_t out) {
    const float limit = std::sqrt(6.0f / static_cast<float>(in + out));
    std::uniform_real_distribution<float> uniform(-limit, limit);
    std::vector<float> v(static_cast<std::size_t>(in * out));
    for (auto& e : v) e = uniform(rng);
    return Tensor::from_vector(v, {in, out});
  };
  return {{"dense/kernel", glorot(kFeatures, kHidden)}, {"dense/bias", Tensor::zeros({kHidden}, kFloat32)},
          {"dense_1/kernel", glorot(kHidden, kHidden)}, {"dense_1/bias", Tensor::zeros({kHidden}, kFloat32)},
          {"dense_2/kernel", glorot(kHidden, 1)},       {"dense_2/bias", Tensor::zeros({1}, kFloat32)}};
}

struct Result {
  std::vector<double> losses;  // per step, the global batch's mean loss
  std::vector<Tensor> weights;
};

// Trains under `strategy`: everything below is what a user of the graph API writes.
Result train(Strategy& strategy, const Options& options) {
  // Variables through the strategy: one copy per replica device.
  std::vector<std::shared_ptr<strategy::Variable>> variables;
  {
    auto scope = strategy.scope();
    for (auto& [name, value] : initial_weights())
      variables.push_back(strategy.create_variable({.name = name, .initial_value = value}));
  }

  // The graph: per-example squared error summed, times 1 / global batch (fed), so that the sum of
  // the replicas' gradients is the gradient of the global batch's mean loss.
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {-1, kFeatures}, "x");
  auto y = g->placeholder(kFloat32, {-1, 1}, "y");
  auto loss_factor = g->placeholder(kFloat32, {}, "loss_factor");
  std::vector<Output> nodes;
  for (const auto& v : variables) nodes.push_back(g->variable(v->dtype(), v->shape(), v->name()));
  auto h = ops::relu(ops::bias_add(ops::matmul(x, nodes[0]), nodes[1]));
  h = ops::relu(ops::bias_add(ops::matmul(h, nodes[2]), nodes[3]));
  auto prediction = ops::bias_add(ops::matmul(h, nodes[4]), nodes[5]);
  auto loss_sum = ops::reduce_sum(ops::square(prediction - y));
  auto grads = graph::gradients({&loss_sum, 1}, nodes);
  // Scaling the gradients rather than the loss keeps the logged loss a plain sum.
  for (auto& grad : grads) grad = grad * loss_factor;
  strategy::make_gradients_reducible(*g, grads);

  // The strategy's reducer for these gradients, and one executor per replica bound to its copies.
  std::vector<strategy::GradientSource> sources;
  for (std::size_t k = 0; k < variables.size(); ++k) sources.push_back({variables[k], grads[k]});
  auto reducer = strategy.make_gradient_reducer(std::move(sources));
  std::vector<std::unique_ptr<graph::Executor>> executors;
  for (std::size_t r = 0; r < strategy.replica_devices().size(); ++r) {
    executors.push_back(std::make_unique<graph::Executor>(g, *strategy.replica_devices()[r]));
    for (std::size_t k = 0; k < variables.size(); ++k)
      executors[r]->bind_variable(nodes[k], variables[k]->value(static_cast<int>(r)));
  }
  std::vector<Output> fetches{loss_sum};
  fetches.insert(fetches.end(), grads.begin(), grads.end());

  const auto [data_x, data_y] = make_data();
  auto dataset = data::Dataset::from_tensor_slices({data_x, data_y}).batch(options.batch).repeat();
  auto batches = strategy.experimental_distribute_dataset(dataset);
  Result result;
  std::vector<double> replica_loss(executors.size());
  for (int step = 0; step < options.steps; ++step) {
    const auto shards = batches.next();  // one shard per replica
    const Tensor factor = Tensor::scalar<float>(1.0f / static_cast<float>(options.batch));
    strategy.run([&](strategy::ReplicaContext& ctx) {
      const int r = ctx.replica_id_in_sync_group();
      const auto& shard = (*shards)[static_cast<std::size_t>(r)];
      reducer->begin_step(r, strategy::StepKind::kReduce);
      replica_loss[static_cast<std::size_t>(r)] = 0;
      if (shard[0].shape()[0] == 0) {
        reducer->set_zero_gradients(r);
      } else {
        const auto out = executors[static_cast<std::size_t>(r)]->run(
            {{x, shard[0]}, {y, shard[1]}, {loss_factor, factor}}, fetches, {.observer = reducer->observer(r)});
        replica_loss[static_cast<std::size_t>(r)] = out[0].item<float>();
      }
      // Every replica gets the same summed gradients and applies the same update to its copies.
      const auto reduced = reducer->finish_step(r);
      for (std::size_t k = 0; k < variables.size(); ++k) {
        float* w = variables[k]->value(r).data<float>();
        const float* dw = reduced[k].data<float>();
        for (std::int64_t i = 0; i < reduced[k].num_elements(); ++i) w[i] -= options.learning_rate * dw[i];
      }
    });
    double total = 0;
    for (double l : replica_loss) total += l;
    result.losses.push_back(total / static_cast<double>(options.batch));
    if (options.verbose > 0 && (step + 1) % 50 == 0) {
      double window = 0;  // batches differ: the mean over the last 50 steps shows the trend
      for (int s = step - 49; s <= step; ++s) window += result.losses[static_cast<std::size_t>(s)];
      std::printf("steps %4d-%4d  mean loss %.6f\n", step - 48, step + 1, window / 50);
    }
  }
  for (const auto& v : variables) result.weights.push_back(v->read_value());
  if (options.verbose > 0) {
    const auto buckets = reducer->buckets();
    std::printf("%s: %zu gradient bucket(s) a step; %lld bucket reductions overlapped backward on replica 0\n",
                strategy.name().c_str(), buckets.size(), static_cast<long long>(reducer->overlapped_buckets(0)));
  }
  return result;
}

std::unique_ptr<Strategy> make_strategy(const std::string& kind, double collective_timeout) {
  // Small buckets: this model's 21 KB of gradients make three of them.
  strategy::DistributionOptions distribution{.first_bucket_bytes = 4 << 10, .bucket_bytes = 16 << 10};
  if (collective_timeout > 0) {
    distribution.collective_timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(collective_timeout));
  }
  if (kind == "one") return std::make_unique<OneDeviceStrategy>("CPU:0");
  strategy::MirroredOptions mirrored{.distribution = distribution};
  for (const auto* device : devices::list_logical_devices(devices::DeviceType::kCPU)) {
    mirrored.devices.push_back(device->short_name());
  }
  return std::make_unique<MirroredStrategy>(mirrored);
}

// The largest difference relative to the reference's magnitude.
double max_relative_difference(const std::vector<float>& a, const std::vector<float>& reference) {
  double scale = 1e-3, worst = 0;
  for (float v : reference) scale = std::max(scale, static_cast<double>(std::abs(v)));
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - reference[i]) / scale);
  return worst;
}

}  // namespace

int main(int argc, char** argv) try {
  Options options;
  CLI::App app{"A custom training loop over the graph API under a distribution strategy"};
  app.add_option("--strategy", options.strategy, "one (OneDeviceStrategy on CPU:0) or mirrored")
      ->check(CLI::IsMember({"one", "mirrored"}))
      ->capture_default_str();
  app.add_option("--cpu-devices", options.cpu_devices, "logical CPU devices for mirrored")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--steps", options.steps, "training steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", options.batch, "global batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--learning-rate", options.learning_rate, "SGD's learning rate")->capture_default_str();
  app.add_option("--verbose", options.verbose, "0 silent, 1 the mean loss of every 50 steps")->capture_default_str();
  app.add_option("--collective-timeout", options.collective_timeout,
                 "seconds a replica waits for the others in an all-reduce before it fails naming them (default 300)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--compare", options.compare,
               "train under OneDeviceStrategy and MirroredStrategy, and fail when any step's loss or final weight "
               "differs by more than 1e-5 (relative)");
  CLI11_PARSE(app, argc, argv);

  devices::set_logical_device_configuration({.num_cpu_devices = options.cpu_devices});
  if (!options.compare) {
    const auto strategy = make_strategy(options.strategy, options.collective_timeout);
    const Result result = train(*strategy, options);
    std::printf("final loss %.6f\n", result.losses.back());
    return result.losses.back() < result.losses.front() ? 0 : 1;
  }
  const auto one = make_strategy("one", options.collective_timeout);
  const auto mirrored = make_strategy("mirrored", options.collective_timeout);
  const Result reference = train(*one, options);
  const Result result = train(*mirrored, options);
  double loss_difference = 0, weight_difference = 0;
  for (std::size_t s = 0; s < reference.losses.size(); ++s) {
    loss_difference = std::max(loss_difference, std::abs(result.losses[s] - reference.losses[s]) /
                                                    std::max(1.0, std::abs(reference.losses[s])));
  }
  for (std::size_t k = 0; k < reference.weights.size(); ++k) {
    weight_difference = std::max(weight_difference, max_relative_difference(result.weights[k].to_vector<float>(),
                                                                            reference.weights[k].to_vector<float>()));
  }
  const bool equal = loss_difference <= 1e-5 && weight_difference <= 1e-5;
  std::printf("%s vs %s over %d steps: largest loss difference %.2e, largest weight difference %.2e (relative): %s\n",
              mirrored->name().c_str(), one->name().c_str(), options.steps, loss_difference, weight_difference,
              equal ? "equal within 1e-5" : "DIFFERENT");
  return equal ? 0 : 1;
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "custom_training_loop: %s\n", e.what());
  return 2;
}
