// The model's graph and its steps. One graph holds both passes:
//   training:  inputs -> layers (training=true) -> per-example losses -> total loss
//              -> gradients of (total loss * loss_scale) with respect to the trainable weights,
//              plus metric sums and the layers' updates (BatchNormalization's moving statistics);
//   inference: inputs -> layers (training=false) -> outputs, losses and metric sums.
// loss_scale is fed as 1 / global batch size: each replica sums its examples' losses and scales
// by the global batch, so that gradients summed over replicas are the gradient of the mean.
// Each replica runs its own Executor of the graph, bound to its copies of the variables.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string_view>

#include "tandem/base/random.h"
#include "tandem/graph/autodiff.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/ops/ops.h"

namespace tandem::keras::detail {

struct Trainer::Graphs {
  std::shared_ptr<Graph> graph = std::make_shared<Graph>();
  std::vector<Output> x, y;
  Output loss_scale;
  CallContext::VariableNodes variables;
  std::vector<VariablePtr> trainable;
  std::vector<std::pair<VariablePtr, Output>> updates;
  // Fetch lists: [loss, output losses..., metrics..., (train) gradients..., updates...]
  std::vector<Output> train_fetches, test_fetches, predict_fetches;
  std::size_t num_sums = 0;  // fetched scalars before the gradients
  std::vector<std::unique_ptr<graph::Executor>> executors;  // one per replica
  std::vector<graph::Feed> feeds;                            // reused every step
  Tensor loss_scale_value;
  // TANDEM_PROFILE=1: kernel times per op (executor), and the time spent around the graph.
  bool profile = false;
  std::int64_t steps = 0;
  double step_seconds = 0, apply_seconds = 0;
};

namespace {

// Runs the model's layer calls on graph outputs for its inputs.
std::vector<Output> forward(ModelState& model, CallContext& ctx, const std::vector<Output>& inputs) {
  std::map<const LayerNode*, std::vector<Output>> values;
  for (std::size_t i = 0; i < model.inputs.size(); ++i) values[model.inputs[i].node().get()] = {inputs[i]};
  for (const auto& node : model.nodes) {
    std::vector<Output> ins;
    for (const auto& in : node->inputs) ins.push_back(values.at(in.node().get())[static_cast<std::size_t>(in.index())]);
    auto scope = ctx.graph().name_scope(node->layer->name());
    auto outs = node->layer->call(ctx, ins);
    TANDEM_ASSERT(outs.size() == node->outputs.size(), "{} returned {} outputs, {} when built", node->layer->name(),
                  outs.size(), node->outputs.size());
    values[node.get()] = std::move(outs);
  }
  std::vector<Output> result;
  for (const auto& out : model.outputs) result.push_back(values.at(out.node().get())[static_cast<std::size_t>(out.index())]);
  return result;
}

std::string spec_string(const std::vector<graph::TensorSpec>& specs) {
  std::string out;
  for (const auto& s : specs) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", s.dtype, s.shape);
  return out;
}

}  // namespace

Trainer::Trainer(ModelState& model, const std::vector<graph::TensorSpec>& element_spec, bool with_targets)
    : model_(model), element_spec_(element_spec), with_targets_(with_targets), graphs_(std::make_unique<Graphs>()) {
  const std::size_t n_in = model.inputs.size(), n_out = model.outputs.size();
  const std::size_t needed = with_targets ? n_in + n_out : n_in;
  TANDEM_REQUIRE(element_spec.size() >= needed, InvalidArgument,
                 "model \"{}\" has {} input(s){}; the data's elements have {} component(s) ({})", model.name, n_in,
                 with_targets ? fmt::format(" and {} target(s)", n_out) : std::string(), element_spec.size(),
                 spec_string(element_spec));
  TANDEM_REQUIRE(!with_targets || element_spec.size() == needed, Unimplemented,
                 "model \"{}\": elements with {} components; sample weights (a component after the targets) are not "
                 "supported yet",
                 model.name, element_spec.size());
  auto& g = *graphs_;
  Graph& graph = *g.graph;
  std::vector<Output> inputs;
  for (std::size_t i = 0; i < n_in; ++i) {
    const auto& data = element_spec[i];
    const auto& want = model.inputs[i].spec();
    Shape fed = data.shape;
    if (fed.rank() > 0) fed[0] = Shape::kUnknown;
    TANDEM_REQUIRE(fed.compatible_with(want.shape), InvalidArgument,
                   "model \"{}\": input {} (\"{}\") expects shape {}; the data gives {}", model.name, i,
                   model.inputs[i].node()->input_name, want.shape, fed);
    g.x.push_back(graph.placeholder(data.dtype, fed, fmt::format("x_{}", i)));
    // Keras casts inputs to the Input's dtype (uint8 images into a float32 model).
    inputs.push_back(data.dtype == want.dtype ? g.x.back() : ops::cast(g.x.back(), want.dtype));
  }
  g.loss_scale = graph.placeholder(DType::kF32, {}, "loss_scale");

  CallContext train_ctx(graph, /*training=*/true, g.variables);
  std::vector<Output> train_outputs;
  {
    auto scope = graph.name_scope("train");
    train_outputs = forward(model, train_ctx, inputs);
  }
  CallContext infer_ctx(graph, /*training=*/false, g.variables);
  std::vector<Output> infer_outputs;
  {
    auto scope = graph.name_scope("infer");
    infer_outputs = forward(model, infer_ctx, inputs);
  }
  g.predict_fetches = infer_outputs;
  g.updates = train_ctx.updates();

  if (with_targets && model.compiled) {
    for (std::size_t j = 0; j < n_out; ++j) {
      const auto& data = element_spec[n_in + j];
      Shape fed = data.shape;
      if (fed.rank() > 0) fed[0] = Shape::kUnknown;
      g.y.push_back(graph.placeholder(data.dtype, fed, fmt::format("y_{}", j)));
    }
    // The loss and metric sums of one pass.
    const auto sums = [&](const std::vector<Output>& outputs, std::string_view scope_name) {
      auto scope = graph.name_scope(scope_name);
      std::vector<Output> output_losses, metrics;
      Output total;
      for (std::size_t j = 0; j < n_out; ++j) {
        const auto& compiled = model.compiled_outputs[j];
        const Output per_example = per_example_loss(compiled.loss, g.y[j], outputs[j]);
        TANDEM_REQUIRE(per_example.shape().rank() == 1, InvalidArgument,
                       "model \"{}\": the loss of output \"{}\" has shape {} per batch; expected one value per example",
                       model.name, compiled.name, per_example.shape());
        Output sum = ops::cast(ops::reduce_sum(per_example), DType::kF32);
        output_losses.push_back(sum);
        if (compiled.loss_weight != 1.0) sum = sum * ops::scalar_like(sum, compiled.loss_weight);
        total = total.defined() ? total + sum : sum;
        for (const auto& [metric, name] : compiled.metrics) metrics.push_back(metric_sum(metric, g.y[j], outputs[j]));
      }
      std::vector<Output> fetches{total};
      if (n_out > 1) fetches.insert(fetches.end(), output_losses.begin(), output_losses.end());
      fetches.insert(fetches.end(), metrics.begin(), metrics.end());
      return std::pair{total, fetches};
    };
    auto [train_total, train_sums] = sums(train_outputs, "train_loss");
    auto [test_total, test_sums] = sums(infer_outputs, "test_loss");
    (void)test_total;
    g.num_sums = train_sums.size();
    g.test_fetches = test_sums;
    g.train_fetches = train_sums;

    // Gradients of the scaled loss with respect to every trainable weight of the model.
    for (const auto& layer : model.layers) {
      for (const auto& w : layer->trainable_weights()) {
        if (std::find(g.trainable.begin(), g.trainable.end(), w) == g.trainable.end()) g.trainable.push_back(w);
      }
    }
    std::vector<Output> xs;
    for (const auto& w : g.trainable) xs.push_back(train_ctx.read(w));
    const Output scaled = train_total * ops::cast(g.loss_scale, train_total.dtype());
    const auto grads = graph::gradients({&scaled, 1}, xs, {}, {.unconnected = graph::UnconnectedGradients::kZero});
    g.train_fetches.insert(g.train_fetches.end(), grads.begin(), grads.end());
    for (const auto& [variable, value] : g.updates) g.train_fetches.push_back(value);
    model.optimizer->build(g.trainable);
  }

  // One executor per replica, bound to that replica's copies.
  const char* profile = std::getenv("TANDEM_PROFILE");
  g.profile = profile != nullptr && std::string_view(profile) != "0";
  const auto& devices = model.strategy->replica_devices();
  for (std::size_t r = 0; r < devices.size(); ++r) {
    auto executor = std::make_unique<graph::Executor>(g.graph, *devices[r],
                                                      graph::ExecutorOptions{.seed = mix_seed(r), .profile = g.profile});
    for (const auto& variable : g.variables.variables) {
      executor->bind_variable(g.variables.nodes.at(variable.get()), variable->value(static_cast<int>(r)));
    }
    g.executors.push_back(std::move(executor));
  }
  g.loss_scale_value = Tensor::scalar<float>(1.0f);
}

Trainer::~Trainer() {
  const auto& g = *graphs_;
  if (!g.profile || g.steps == 0) return;
  // Printed when the trainer goes away (the model is rebuilt or destroyed).
  const auto per_step = [&](double seconds) { return 1e3 * seconds / static_cast<double>(g.steps); };
  std::fprintf(stderr, "TANDEM_PROFILE model \"%s\": %lld training steps, %.3f ms/step (optimizer %.3f ms/step)\n",
               model_.name.c_str(), static_cast<long long>(g.steps), per_step(g.step_seconds), per_step(g.apply_seconds));
  for (const auto& entry : g.executors.front()->profile()) {
    std::fprintf(stderr, "  %-40s %8lld calls %10.3f ms/step\n", entry.op.c_str(), static_cast<long long>(entry.calls),
                 per_step(entry.seconds));
  }
}

bool Trainer::accepts(const std::vector<graph::TensorSpec>& element_spec, bool with_targets) const {
  if (with_targets && !with_targets_) return false;
  const std::size_t n = model_.inputs.size() + (with_targets ? model_.outputs.size() : 0);
  if (element_spec.size() < n) return false;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& a = element_spec[i];
    const auto& b = element_spec_[i];
    if (a.dtype != b.dtype || a.shape.rank() != b.shape.rank()) return false;
    for (int d = 1; d < a.shape.rank(); ++d) {
      if (a.shape[d] != b.shape[d]) return false;
    }
  }
  return true;
}

const std::vector<graph::Feed>& Trainer::feeds(const data::Element& batch, bool with_targets) {
  auto& g = *graphs_;
  std::vector<graph::Feed>& f = g.feeds;
  f.clear();
  for (std::size_t i = 0; i < g.x.size(); ++i) f.emplace_back(g.x[i], batch[i]);
  if (with_targets) {
    for (std::size_t j = 0; j < g.y.size(); ++j) f.emplace_back(g.y[j], batch[g.x.size() + j]);
    // Scaled by the global batch: the sum over every replica's examples becomes a mean.
    g.loss_scale_value.data<float>()[0] = 1.0f / static_cast<float>(std::max<std::int64_t>(1, batch[0].shape()[0]));
    f.emplace_back(g.loss_scale, g.loss_scale_value);
  }
  return f;
}

StepSums Trainer::read_sums(const std::vector<Tensor>& fetched) const {
  StepSums sums;
  const std::size_t n_out = model_.outputs.size();
  const auto scalar = [&](std::size_t i) { return static_cast<double>(fetched[i].item<float>()); };
  sums.loss = scalar(0);
  std::size_t k = 1;
  if (n_out > 1) {
    for (std::size_t j = 0; j < n_out; ++j) sums.output_loss.push_back(scalar(k++));
  }
  for (; k < graphs_->num_sums; ++k) sums.metrics.push_back(scalar(k));
  return sums;
}

StepSums Trainer::train_step(const data::Element& batch) {
  auto& g = *graphs_;
  TANDEM_REQUIRE(with_targets_ && !g.train_fetches.empty(), FailedPrecondition,
                 "model \"{}\": training needs a compiled model and data with targets", model_.name);
  TANDEM_REQUIRE(model_.strategy->num_replicas_in_sync() == 1, Unimplemented,
                 "model \"{}\": training under {} needs the cross-replica gradient reduction (MirroredStrategy)",
                 model_.name, model_.strategy->name());
  const auto start = std::chrono::steady_clock::now();
  const auto fetched = g.executors[0]->run(feeds(batch, true), g.train_fetches);
  StepSums sums = read_sums(fetched);
  sums.examples = batch[0].shape()[0];
  const auto applying = std::chrono::steady_clock::now();
  const std::vector<Tensor> grads(fetched.begin() + static_cast<std::ptrdiff_t>(g.num_sums),
                                  fetched.begin() + static_cast<std::ptrdiff_t>(g.num_sums + g.trainable.size()));
  model_.optimizer->apply(0, grads);
  model_.optimizer->finish_step();
  for (std::size_t u = 0; u < g.updates.size(); ++u) {
    g.updates[u].first->value(0).copy_from(fetched[g.num_sums + g.trainable.size() + u]);
  }
  if (g.profile) {
    const auto end = std::chrono::steady_clock::now();
    g.steps += 1;
    g.step_seconds += std::chrono::duration<double>(end - start).count();
    g.apply_seconds += std::chrono::duration<double>(end - applying).count();
  }
  return sums;
}

StepSums Trainer::test_step(const data::Element& batch) {
  auto& g = *graphs_;
  TANDEM_REQUIRE(with_targets_ && !g.test_fetches.empty(), FailedPrecondition,
                 "model \"{}\": evaluation needs a compiled model and data with targets", model_.name);
  const auto fetched = g.executors[0]->run(feeds(batch, true), g.test_fetches);
  StepSums sums = read_sums(fetched);
  sums.examples = batch[0].shape()[0];
  return sums;
}

std::vector<Tensor> Trainer::predict_step(const data::Element& batch) {
  auto& g = *graphs_;
  return g.executors[0]->run(feeds(batch, false), g.predict_fetches);
}

}  // namespace tandem::keras::detail
