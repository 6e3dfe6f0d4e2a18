// The model's graph and its steps, on every replica of the model's strategy.
//
// One graph holds both passes:
//   training:  inputs -> layers (training=true) -> per-example losses -> total loss
//              -> gradients of (total loss * loss_scale) with respect to the trainable weights,
//              plus metric sums and the layers' updates (BatchNormalization's moving statistics);
//   inference: inputs -> layers (training=false) -> outputs, losses and metric sums.
// Each replica runs its own Executor of the graph on its device, bound to its copies of the
// variables, on its shard of the global batch. loss_scale is fed as 1 / global batch size: each
// replica sums its examples' losses and scales by the global batch, so the gradients summed over
// replicas are the gradient of the mean, and equal one device's on the same examples. Under a
// LossScaleOptimizer the fed value is also multiplied by the current loss scale (a power of two,
// so the gradients are exactly scaled); the optimizer checks the reduced gradients, unscales
// them as it applies them, or skips the step (every replica sees the same reduced values, so all
// take the same decision). The logged loss sums are taken before the scaling.
//
// A model cut into pipeline stages (ModelParallel with a stage axis) is run by the stages' own
// graphs instead: pipeline_trainer.cc, behind the same public steps.
//
// How the gradients are communicated is the strategy's business: the trainer asks it for a
// GradientReducer (strategy/gradient_reducer.h), hands the reducer's observer to each replica's
// run, and takes the reduced gradients from it (PyTorch keeps DDP's Reducer in its distributed
// package, not in its model API, for the same reason: a new strategy changes nothing here). Every
// replica then applies the gradients it got to its own copies.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string_view>

#include "tandem/base/env.h"
#include "tandem/base/log.h"
#include "tandem/base/random.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/op_registry.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/ops/ops.h"

namespace tandem::keras::detail {

namespace {

// Runs the model's layer calls on graph outputs for its inputs.
std::vector<Output> forward(ModelState& model, CallContext& ctx, const std::vector<Output>& inputs) {
  LayerValues values;
  for (std::size_t i = 0; i < model.inputs.size(); ++i) values[model.inputs[i].node().get()] = {inputs[i]};
  run_layer_calls(model, ctx, values, 0, model.nodes.size());
  std::vector<Output> result;
  for (const auto& out : model.outputs)
    result.push_back(values.at(out.node().get())[static_cast<std::size_t>(out.index())]);
  return result;
}

// Every output's targets suit its loss (Keras checks in the loss; here before the graph exists, so
// that the error names the loss and the output layer rather than whichever node fails first).
void check_targets(const ModelState& model, std::span<const graph::TensorSpec> targets) {
  for (std::size_t j = 0; j < model.outputs.size(); ++j) {
    const auto& compiled = model.compiled_outputs[j];
    Shape y = targets[j].shape;
    if (y.rank() > 0) y[0] = Shape::kUnknown;
    const Shape& output = model.outputs[j].spec().shape;
    const auto requirement = target_shape_requirement(compiled.loss, y, output);
    TANDEM_REQUIRE(!requirement, InvalidArgument,
                   "model \"{}\", output \"{}\": loss {} needs {}; the data's targets have shape {}", model.name,
                   compiled.name, LossRef(compiled.loss).name(), *requirement, y);
  }
}

std::string spec_string(const std::vector<graph::TensorSpec>& specs) {
  std::string out;
  for (const auto& s : specs) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", s.dtype, s.shape);
  return out;
}

// Step sums travel as [loss, output losses..., metrics..., examples], one such slot per replica in
// sync (global replica worker x local replicas + replica). A worker fills its own replicas' slots
// and leaves zeros in the others, so a SUM across workers gathers every replica's sums exactly
// (x + 0 is x in any order), and each worker then adds them up replica by replica, exactly as
// MirroredStrategy's trainer does with its replicas: the logs of N workers are bitwise those of N
// replicas in one process.
std::size_t sums_width(const StepSums& sums) { return 2 + sums.output_loss.size() + sums.metrics.size(); }

template <class T>
void write_sums(const StepSums& sums, T* p) {
  *p++ = static_cast<T>(sums.loss);
  for (double v : sums.output_loss) *p++ = static_cast<T>(v);
  for (double v : sums.metrics) *p++ = static_cast<T>(v);
  *p = static_cast<T>(sums.examples);
}

template <class T>
StepSums read_sums(const StepSums& shape, const T* p) {
  StepSums sums = shape;
  sums.loss = static_cast<double>(*p++);
  for (double& v : sums.output_loss) v = static_cast<double>(*p++);
  for (double& v : sums.metrics) v = static_cast<double>(*p++);
  sums.examples = static_cast<std::int64_t>(std::llround(static_cast<double>(*p)));
  return sums;
}

// `sums` in slot `slot` of `slots` of a flat tensor of `dtype`, zeros elsewhere, followed by the
// step's rider values (WorkerBatch::rider: `rider`, or as many zeros when null).
void sums_to_tensor(const StepSums& sums, Tensor& out, DType dtype, std::size_t slot, std::size_t slots,
                    std::size_t rider_size, const double* rider) {
  const std::size_t width = sums_width(sums);
  const auto n = static_cast<std::int64_t>(width * slots + rider_size);
  if (!out.defined() || out.num_elements() != n || out.dtype() != dtype) out = Tensor::empty({n}, dtype);
  graph::dispatch<graph::FloatTypes>(dtype, "step sums", [&]<class T>() {
    std::fill_n(out.data<T>(), n, T(0));
    write_sums(sums, out.data<T>() + slot * width);
    for (std::size_t k = 0; rider != nullptr && k < rider_size; ++k) out.data<T>()[width * slots + k] = T(rider[k]);
  });
}

StepSums sums_from_tensor(const StepSums& shape, const Tensor& t, std::size_t slot) {
  StepSums sums;
  graph::dispatch<graph::FloatTypes>(
      t.dtype(), "step sums", [&]<class T>() { sums = read_sums(shape, t.data<T>() + slot * sums_width(shape)); });
  return sums;
}

// The largest whole numbers float32 and float64 hold exactly.
constexpr double kExactInFloat32 = 1 << 24;
constexpr double kExactInFloat64 = 9007199254740992.0;  // 2^53

// Whether `dtype` holds every step sum exactly: float32 and float64 hold the fetched float32
// scalars, and the examples up to 2^24 (float32) or 2^53 rows.
bool holds_step_sums(DType dtype, std::int64_t global_examples) {
  return dtype == DType::kF64 || (dtype == DType::kF32 && static_cast<double>(global_examples) < kExactInFloat32);
}

// The rider's sums over the workers, from the tail of a reduced sums tensor; false when one is
// beyond what the tensor's dtype holds exactly (the iterator then sums them itself: every
// worker sees the same sums, so all decide alike).
bool read_rider(const Tensor& sums, std::vector<double>& values) {
  const std::size_t first = static_cast<std::size_t>(sums.num_elements()) - values.size();
  const double exact = sums.dtype() == DType::kF64 ? kExactInFloat64 : kExactInFloat32;
  bool held = true;
  graph::dispatch<graph::FloatTypes>(sums.dtype(), "step rider", [&]<class T>() {
    for (std::size_t k = 0; k < values.size(); ++k) {
      values[k] = static_cast<double>(sums.data<T>()[first + k]);
      held = held && std::abs(values[k]) < exact;
    }
  });
  return held;
}

// The examples in a replica's shard of a batch (0 for an empty shard).
std::int64_t rows_of(const data::Element& shard) { return shard.empty() ? 0 : shard[0].shape()[0]; }

}  // namespace

void run_layer_calls(ModelState& model, CallContext& ctx, LayerValues& values, std::size_t first, std::size_t end) {
  for (std::size_t n = first; n < end; ++n) {
    const auto& node = model.nodes[n];
    std::vector<Output> ins;
    for (const auto& in : node->inputs) ins.push_back(values.at(in.node().get())[static_cast<std::size_t>(in.index())]);
    auto scope = ctx.graph().name_scope(node->layer->name());
    auto outs = node->layer->call_with_policy(ctx, ins, node->arguments);
    TANDEM_ASSERT(outs.size() == node->outputs.size(), "{} returned {} outputs, {} when built", node->layer->name(),
                  outs.size(), node->outputs.size());
    values[node.get()] = std::move(outs);
  }
}

StepSumOutputs step_sum_outputs(ModelState& model, Graph& graph, const std::vector<Output>& outputs,
                                const std::vector<Output>& targets, std::string_view scope_name) {
  auto scope = graph.name_scope(scope_name);
  const std::size_t n_out = model.outputs.size();
  std::vector<Output> output_losses, metrics;
  Output total;
  for (std::size_t j = 0; j < n_out; ++j) {
    const auto& compiled = model.compiled_outputs[j];
    const Output per_example = per_example_loss(compiled.loss, targets[j], outputs[j]);
    TANDEM_REQUIRE(per_example.shape().rank() == 1, InvalidArgument,
                   "model \"{}\": the loss of output \"{}\" has shape {} per batch; expected one value per example",
                   model.name, compiled.name, per_example.shape());
    Output sum = ops::cast(ops::reduce_sum(per_example), DType::kF32);
    output_losses.push_back(sum);
    if (compiled.loss_weight != 1.0) sum = sum * ops::scalar_like(sum, compiled.loss_weight);
    total = total.defined() ? total + sum : sum;
    for (const auto& [metric, name] : compiled.metrics) metrics.push_back(metric_sum(metric, targets[j], outputs[j]));
  }
  StepSumOutputs out{.total = total, .fetches = {total}};
  if (n_out > 1) out.fetches.insert(out.fetches.end(), output_losses.begin(), output_losses.end());
  out.fetches.insert(out.fetches.end(), metrics.begin(), metrics.end());
  return out;
}

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
  // The strategy's part of every training step: the gradients' communication.
  std::unique_ptr<strategy::GradientReducer> reducer;
  // ZeRO stages 2 and 3: the gradients the executors hand to the reducer during backward instead
  // of keeping them whole to the end of the run (GradientReducer::hand_offs).
  std::vector<graph::HandOff> hand_offs;
  // TANDEM_PROFILE=1: kernel times per op (replica 0's executor), printed with `times`.
  bool profile = false;
  // ZeRO stage 3: the model's parameters are sharded and gathered by the executors (the reducer's
  // bind_gathered_variable); every replica then runs every step (lend_rows).
  bool gathers = false;
  TrainingTimes times;  // always kept (three clock reads a step): Model::training_times()
};

struct Trainer::Replica {
  int index = 0;
  std::unique_ptr<graph::Executor> executor;
  std::vector<graph::Feed> feeds;
  // The loss's factor (1 / global batch, times the loss scale) as fed: on the replica's device,
  // rewritten only when it changes (a host feed would be one more copy, and on GPUs one more
  // synchronisation, per step).
  Tensor loss_scale_value;
  float loss_scale_fed = 0;
  // The step's scalars read from a GPU: copied here together, one synchronisation for all.
  devices::PinnedHostBuffer scalar_staging;
  std::vector<Tensor> tail_grads;  // whole-step work: the gradients among the fetches
  std::vector<Tensor> grads;       // the step's reduced gradients, as the optimizer takes them
  bool applied = true;             // false when loss scaling skipped this step (non-finite gradients)
  StepSums sums;
  // With several workers, every replica's step sums (sums_to_tensor's slots) ride along with the
  // gradients' last collective (the reducer's sum_with_last_bucket), so that the logs need no
  // collective of their own; and so do the layers' updates (update_values, weighted by the
  // replica's share of the batch).
  Tensor sums_tensor;
  bool sums_reduced = false;
  std::vector<Tensor> update_values;
  bool updates_reduced = false;
};

// Metric state of one phase: per replica, the sums of (loss, output losses..., metrics...) and of
// the examples; reading sums the replicas' parts (TF keeps metrics as SyncOnRead variables). The
// parts are host doubles, not device variables: no kernel reads them, and on a GPU each bump of a
// device scalar would synchronise the host with the device, several times a step.
struct Trainer::Metrics {
  // Per replica in sync (of every worker, by global replica): [loss, output losses..., metrics...].
  std::vector<std::vector<double>> sums;
  std::vector<double> counts;  // per replica in sync: examples

  Metrics(std::size_t replicas, std::size_t num_sums)
      : sums(replicas, std::vector<double>(num_sums, 0.0)), counts(replicas, 0.0) {}
  void reset() {
    for (auto& part : sums) std::fill(part.begin(), part.end(), 0.0);
    std::fill(counts.begin(), counts.end(), 0.0);
  }
  // Replica `r`'s part only: replicas may add concurrently.
  void add(int r, const StepSums& step) {
    auto& part = sums[static_cast<std::size_t>(r)];
    std::size_t k = 0;
    part[k++] += step.loss;
    for (double v : step.output_loss) part[k++] += v;
    for (double v : step.metrics) part[k++] += v;
    counts[static_cast<std::size_t>(r)] += static_cast<double>(step.examples);
  }
  double read(std::size_t i) const {
    double t = 0;
    for (const auto& part : sums) t += part[i];
    return t;
  }
  double examples() const {
    double t = 0;
    for (double c : counts) t += c;
    return t;
  }
};

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
  if (with_targets && model.compiled) check_targets(model, std::span(element_spec).subspan(n_in));
  if (const auto* mp = dynamic_cast<const distribution::ModelParallel*>(model.strategy);
      mp != nullptr && mp->pipeline() && mp->pipeline()->stages > 1) {
    const std::size_t num_sums = build_pipeline();
    if (with_targets && model.compiled) {
      const auto parts = static_cast<std::size_t>(model.strategy->num_replicas_in_sync());
      train_metrics_ = std::make_unique<Metrics>(parts, num_sums);
      test_metrics_ = std::make_unique<Metrics>(parts, num_sums);
    }
    return;
  }
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
  // 16-bit outputs (a mixed policy) are handed out, and taken by losses and metrics, as float32.
  for (auto* outputs : {&train_outputs, &infer_outputs}) {
    for (auto& o : *outputs) {
      if (graph::is_low_precision(o.dtype())) o = ops::cast(o, DType::kF32);
    }
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
    // The loss and metric sums of each pass.
    auto [train_total, train_sums] = step_sum_outputs(model, graph, train_outputs, g.y, "train_loss");
    g.num_sums = train_sums.size();
    g.test_fetches = step_sum_outputs(model, graph, infer_outputs, g.y, "test_loss").fetches;
    g.train_fetches = train_sums;

    // Gradients of the scaled loss with respect to every trainable weight of the model.
    for (const auto& layer : model.layers) {
      for (const auto& w : layer->trainable_weights()) {
        if (std::find(g.trainable.begin(), g.trainable.end(), w) == g.trainable.end()) g.trainable.push_back(w);
      }
    }
    std::vector<Output> xs;
    for (const auto& w : g.trainable) xs.push_back(train_ctx.read_variable(w));
    const Output scaled = train_total * ops::cast(g.loss_scale, train_total.dtype());
    auto grads = graph::gradients({&scaled, 1}, xs, {}, {.unconnected = graph::UnconnectedGradients::kZero});
    // The strategy reduces them in place while backward goes on: each needs a buffer of its own.
    strategy::make_gradients_reducible(graph, grads);
    g.train_fetches.insert(g.train_fetches.end(), grads.begin(), grads.end());
    for (const auto& [variable, value] : g.updates) g.train_fetches.push_back(value);
    model.optimizer->build(g.trainable);
    std::vector<strategy::GradientSource> sources;
    for (std::size_t k = 0; k < grads.size(); ++k) {
      sources.push_back({g.trainable[k], grads[k], g.variables.nodes.at(g.trainable[k].get())});
    }
    // ZeRO stages 2 and 3: each handed-off shard updates its variable during backward, so that no
    // gradient shard outlives its bucket (the reducer decides which ones may).
    strategy::GradientReducerOptions reducer_options{.accumulators = model.optimizer->accumulators()};
    if (model.optimizer->updates_per_variable(0)) {
      reducer_options.update = [optimizer = model.optimizer.get()](int replica, std::size_t k, const Tensor& shard) {
        optimizer->apply_variable(replica, k, shard);
      };
    }
    g.reducer = model.strategy->make_gradient_reducer(std::move(sources), std::move(reducer_options));
    g.hand_offs = g.reducer->hand_offs(static_cast<int>(g.num_sums));
  }

  // One replica per device of the strategy, with an executor bound to that replica's copies.
  g.profile = env::get_bool(env::kProfile);
  const auto& devices = model.strategy->replica_devices();
  for (std::size_t r = 0; r < devices.size(); ++r) {
    auto replica = std::make_unique<Replica>();
    replica->index = static_cast<int>(r);
    // Random streams differ between the data shards of all workers (Dropout masks), and agree
    // among replicas that compute on the same rows (tensor parallelism: the masks of a replicated
    // activation must be the same on every device of the group).
    const auto data_shard = static_cast<std::uint64_t>(model.strategy->data_shard(static_cast<int>(r)));
    replica->executor = std::make_unique<graph::Executor>(
        g.graph, *devices[r],
        graph::ExecutorOptions{.seed = mix_seed(data_shard), .profile = g.profile, .cuda_graphs = model.cuda_graphs});
    for (const auto& variable : g.variables.variables) {
      TANDEM_REQUIRE(&variable->strategy() == model.strategy, FailedPrecondition,
                     "model \"{}\": variable \"{}\" was created under {}, not under {} which runs the model; create "
                     "every variable inside the strategy's scope",
                     model.name, variable->name(), variable->strategy().name(), model.strategy->name());
      const Output node = g.variables.nodes.at(variable.get());
      if (variable->sharding()) {
        // Stage 3: a reducer gathers it, also where there is nothing to train (predict).
        if (!g.reducer) g.reducer = model.strategy->make_gradient_reducer({});
        g.reducer->bind_gathered_variable(static_cast<int>(r), *replica->executor, node, variable);
        g.gathers = true;
        continue;
      }
      replica->executor->bind_variable(node, variable->value(static_cast<int>(r)));
    }
    replica->loss_scale_value = Tensor::zeros({}, DType::kF32, *devices[r]);
    replicas_.push_back(std::move(replica));
  }
  if (with_targets && model.compiled) {
    // One part per replica in sync, of every worker: the logs add them up in one order everywhere.
    const auto parts = static_cast<std::size_t>(model.strategy->num_replicas_in_sync());
    train_metrics_ = std::make_unique<Metrics>(parts, g.num_sums);
    test_metrics_ = std::make_unique<Metrics>(parts, g.num_sums);
  }
}

Trainer::~Trainer() {
  const auto& g = *graphs_;
  const auto& t = g.times;
  if (!g.profile || t.steps == 0 || replicas_.empty()) return;
  // Printed when the trainer goes away (the model is rebuilt or destroyed).
  const auto per_step = [&](double seconds) { return 1e3 * seconds / static_cast<double>(t.steps); };
  std::string report = fmt::format(
      "TANDEM_PROFILE model \"{}\": {} training steps on {} replica(s), {:.3f} ms/step (waiting for gradient "
      "all-reduce {:.3f}, optimizer {:.3f} ms/step; replica 0's kernels below)",
      model_.name, t.steps, replicas_.size(), per_step(t.step_seconds), per_step(t.reduce_wait_seconds),
      per_step(t.apply_seconds));
  // The executor's profile counts evaluation and prediction runs too: left out here.
  std::vector<graph::OpProfile> trained;
  std::int64_t untrained_calls = 0;
  double untrained_seconds = 0;
  for (auto entry : replicas_.front()->executor->profile()) {
    if (const auto it = untrained_profile_.find(entry.op); it != untrained_profile_.end()) {
      entry.calls -= it->second.first;
      entry.seconds -= it->second.second;
      untrained_calls += it->second.first;
      untrained_seconds += it->second.second;
    }
    if (entry.calls > 0) trained.push_back(entry);
  }
  std::sort(trained.begin(), trained.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  for (const auto& entry : trained) {
    report += fmt::format("\n  {:<40} {:>8} calls {:>10.3f} ms/step", entry.op, entry.calls, per_step(entry.seconds));
  }
  if (untrained_calls > 0) {
    report += fmt::format("\n  (not counted above: {} kernel calls, {:.1f} ms in all, of evaluation and prediction)",
                          untrained_calls, 1e3 * untrained_seconds);
  }
  logging::info("{}", report);
}

std::vector<Tensor> Trainer::run_untrained(int r, const std::vector<graph::Feed>& feeds,
                                           const std::vector<Output>& fetches) {
  graph::Executor& executor = *replicas_[static_cast<std::size_t>(r)]->executor;
  if (!graphs_->profile || r != 0) return executor.run(feeds, fetches);
  const auto before = executor.profile();
  auto fetched = executor.run(feeds, fetches);
  for (const auto& entry : executor.profile()) {
    auto& [calls, seconds] = untrained_profile_[entry.op];
    calls += entry.calls;
    seconds += entry.seconds;
    for (const auto& old : before) {
      if (old.op != entry.op) continue;
      calls -= old.calls;
      seconds -= old.seconds;
    }
  }
  return fetched;
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

// A GPU replica's whole training step as device work in one executor run: forward and backward,
// the gradient all-reduce queued on the device (NCCL), the optimizer update reading its numbers
// from device memory, the layers' moving statistics copied into their variables. Nothing in it
// waits for the host, so the executor records it as one CUDA graph and replays it. It needs a
// step with no host decision in it: no loss scaling or clipping by norm (they read gradients on
// the host), no accumulation, a reduction the strategy can queue on the device; and with several
// replicas no moving statistics (their sum across replicas is weighted by each replica's
// examples). Other steps run as before, in parts.
bool Trainer::runs_whole_step(int r) const {
  const Replica& replica = *replicas_[static_cast<std::size_t>(r)];
  if (!model_.cuda_graphs || replica.executor->device().host_accessible()) return false;
  if (!model_.optimizer->can_update_from_device_memory(r)) return false;
  if (replicas_.size() > 1 && !graphs_->updates.empty()) return false;
  return graphs_->reducer->reduces_on_device(r);
}

void Trainer::whole_step_work(Replica& replica, graph::RunOptions& options) {
  auto& g = *graphs_;
  const int r = replica.index;
  auto& optimizer = *model_.optimizer;
  optimizer.stage_update_params(r);
  options.observer = nullptr;  // the gradients are reduced on the device, by the tail
  options.tail_addresses = optimizer.update_addresses(r);
  for (const auto& [variable, output] : g.updates) options.tail_addresses.push_back(variable->value(r).raw_data());
  options.tail = [this, &replica](const graph::TailContext& tail) {
    auto& graphs = *graphs_;
    const int rr = replica.index;
    auto& grads = replica.tail_grads;
    grads.assign(tail.fetched.begin() + static_cast<std::ptrdiff_t>(graphs.num_sums),
                 tail.fetched.begin() + static_cast<std::ptrdiff_t>(graphs.num_sums + graphs.trainable.size()));
    graphs.reducer->queue_reduction_on_device(rr, grads);
    model_.optimizer->queue_update_from_device_memory(rr, grads, tail.fault_word);
    for (std::size_t u = 0; u < graphs.updates.size(); ++u) {
      graphs.updates[u].first->value(rr).copy_from(tail.fetched[graphs.num_sums + graphs.trainable.size() + u]);
    }
  };
}

std::vector<double> Trainer::read_step_scalars(Replica& replica, std::span<const Tensor> fetched) {
  const std::size_t n = graphs_->num_sums;
  std::vector<double> values(n);
  if (n == 0) return values;
  auto& device = fetched.front().device();
  if (device.host_accessible()) {
    for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<double>(fetched[i].item<float>());
    return values;
  }
  if (replica.scalar_staging.bytes() < n * sizeof(float))
    replica.scalar_staging = devices::PinnedHostBuffer(device, n * sizeof(float));
  auto* staged = static_cast<float*>(replica.scalar_staging.data());
  for (std::size_t i = 0; i < n; ++i) {
    TANDEM_ASSERT(fetched[i].dtype() == DType::kF32 && fetched[i].num_elements() == 1,
                  "model \"{}\": step scalar {} is {} {}", model_.name, i, fetched[i].dtype(), fetched[i].shape());
    device.copy_to_host_async(staged + i, fetched[i].raw_data(), sizeof(float), device.compute_stream());
  }
  device.compute_stream().synchronize();
  for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<double>(staged[i]);
  return values;
}

std::vector<bool> Trainer::lend_rows(std::vector<data::Element>& shards) const {
  std::vector<bool> lent(shards.size(), false);
  if (!graphs_->gathers) return lent;
  const auto donor = std::find_if(shards.begin(), shards.end(), [](const data::Element& e) { return rows_of(e) > 0; });
  for (std::size_t r = 0; r < shards.size(); ++r) {
    if (rows_of(shards[r]) > 0) continue;
    TANDEM_REQUIRE(donor != shards.end(), FailedPrecondition,
                   "model \"{}\": ZeRO stage 3 needs at least one example on each worker for every batch (each "
                   "replica takes part in the parameter gathers); this worker's share of a batch is empty",
                   model_.name);
    data::Element row;
    for (const Tensor& component : *donor) {
      Shape shape = component.shape();
      shape[0] = 1;
      row.push_back(Tensor(shape, component.dtype(), component.buffer(), component.byte_offset()));
    }
    shards[r] = std::move(row);
    lent[r] = true;
  }
  return lent;
}

void Trainer::run_replica_step(int r, const data::Element& shard, std::int64_t global_examples, bool update,
                               bool whole_step, std::span<const double> rider, bool borrowed) {
  auto& g = *graphs_;
  Replica& replica = *replicas_[static_cast<std::size_t>(r)];
  const std::int64_t run_rows = rows_of(shard);
  const std::int64_t rows = borrowed ? 0 : run_rows;
  auto& reducer = *g.reducer;
  // A micro-step of gradient accumulation does not communicate (DDP's no_sync).
  reducer.begin_step(r, update ? strategy::StepKind::kReduce : strategy::StepKind::kAccumulate);
  replica.sums = StepSums{};
  std::vector<Tensor> fetched;
  if (run_rows > 0) {
    auto& feeds = replica.feeds;
    feeds.clear();
    for (std::size_t i = 0; i < g.x.size(); ++i) feeds.emplace_back(g.x[i], shard[i]);
    for (std::size_t j = 0; j < g.y.size(); ++j) feeds.emplace_back(g.y[j], shard[g.x.size() + j]);
    // Scaled by the global batch: the sum over every replica's examples becomes a mean.
    // A borrowed row's loss is scaled by 0: its gradients are zeros, as for a replica without examples.
    float loss_scale = borrowed ? 0.0f : 1.0f / static_cast<float>(std::max<std::int64_t>(1, global_examples));
    if (model_.optimizer->loss_scale_optimizer()) loss_scale *= static_cast<float>(model_.optimizer->loss_scale(r));
    if (loss_scale != replica.loss_scale_fed) {
      replica.loss_scale_value.copy_from(Tensor::scalar<float>(loss_scale));
      replica.loss_scale_fed = loss_scale;
    }
    feeds.emplace_back(g.loss_scale, replica.loss_scale_value);
    // Dropout's masks follow the optimizer's step count, not the executor's run count, so that a
    // run resumed from a backup draws what the interrupted run would have drawn.
    graph::RunOptions run_options{.random_step = static_cast<std::uint64_t>(model_.optimizer->iterations()),
                                  .observer = reducer.observer(r),
                                  .hand_offs = g.hand_offs};
    if (whole_step) whole_step_work(replica, run_options);
    fetched = replica.executor->run(feeds, g.train_fetches, run_options);
    replica.tail_grads.clear();  // views of the arena (see replica.grads below)
    const auto scalars = read_step_scalars(replica, fetched);
    replica.sums.loss = scalars[0];
    std::size_t k = 1;
    if (model_.outputs.size() > 1) {
      for (std::size_t j = 0; j < model_.outputs.size(); ++j) replica.sums.output_loss.push_back(scalars[k++]);
    }
    for (; k < g.num_sums; ++k) replica.sums.metrics.push_back(scalars[k]);
    replica.sums.examples = rows;
    // It had no examples, or another replica computed the same rows and counts them: zeros.
    if (borrowed || !model_.strategy->leads_data_shard(r)) {
      replica.sums.examples = 0;
      replica.sums.loss = 0;
      std::fill(replica.sums.output_loss.begin(), replica.sums.output_loss.end(), 0.0);
      std::fill(replica.sums.metrics.begin(), replica.sums.metrics.end(), 0.0);
    }
    if (whole_step) {  // the gradients were reduced and applied inside the run
      replica.applied = true;
      replica.sums_reduced = false;
      return;
    }
  } else {
    // An empty shard (the last batch had fewer examples than replicas): nothing to run, but the
    // replica still takes part in every collective, with zero gradients.
    reducer.set_zero_gradients(r);
    replica.sums.output_loss.assign(model_.outputs.size() > 1 ? model_.outputs.size() : 0, 0.0);
    replica.sums.metrics.assign(g.num_sums - 1 - replica.sums.output_loss.size(), 0.0);
  }

  // The step's log sums (several workers) and the layers' updates ride in the gradients' last
  // collective: one round of communication a step. Every replica of every worker takes the same
  // decisions (they depend on the step, the global batch and the model only).
  replica.sums_reduced = false;
  const auto& strategy = *model_.strategy;
  if (strategy.num_workers() > 1 && strategy.gradient_group_spans_workers() &&
      replica.executor->device().host_accessible() && holds_step_sums(reducer.extra_dtype(), global_examples)) {
    const auto slot = static_cast<std::size_t>(strategy.worker_rank()) * replicas_.size() + static_cast<std::size_t>(r);
    // The rider's values once per worker (replica 0's), so that the sum is over the workers.
    sums_to_tensor(replica.sums, replica.sums_tensor, reducer.extra_dtype(), slot,
                   static_cast<std::size_t>(strategy.num_replicas_in_sync()), rider.size(),
                   r == 0 ? rider.data() : nullptr);
    replica.sums_reduced = reducer.sum_with_last_bucket(r, {&replica.sums_tensor, 1});
  }
  // Layer updates (moving statistics): the replicas' values averaged, weighted by their examples,
  // so that every copy stays equal.
  auto& updates = replica.update_values;
  updates.clear();
  for (std::size_t u = 0; u < g.updates.size(); ++u) {
    const VariablePtr& variable = g.updates[u].first;
    updates.push_back(rows > 0 ? fetched[g.num_sums + g.trainable.size() + u].clone()
                               : Tensor::zeros(variable->shape(), variable->dtype(), variable->value(r).device()));
  }
  const double weight = static_cast<double>(rows) / static_cast<double>(std::max<std::int64_t>(1, global_examples));
  replica.updates_reduced = !updates.empty() && reducer.weighted_sum_with_last_bucket(r, updates, weight);
  const auto reducing = std::chrono::steady_clock::now();
  const auto reduced = reducer.finish_step(r);  // on a micro-step: accumulated, not communicated
  const auto applying = std::chrono::steady_clock::now();
  replica.applied = true;
  if (update) {
    replica.grads.assign(reduced.begin(), reduced.end());
    replica.applied = model_.optimizer->apply(r, replica.grads);
    // They are views of the executor's arena: kept past the step, they would make the next run
    // move to a fresh arena (an allocation and its page faults every step).
    replica.grads.clear();
    // ZeRO: each replica updated its range of each variable; the all-gather makes them whole (a
    // no-op without reduce-scattered variables; after a skipped step it gathers what is there).
    reducer.gather_updated(r);
  }
  if (!replica.updates_reduced) reducer.weighted_sum_across_replicas(r, updates, weight);
  for (std::size_t u = 0; u < g.updates.size(); ++u) g.updates[u].first->value(r).copy_from(updates[u]);
  if (r == 0) {
    const auto end = std::chrono::steady_clock::now();
    g.times.reduce_wait_seconds += std::chrono::duration<double>(applying - reducing).count();
    g.times.apply_seconds += std::chrono::duration<double>(end - applying).count();
  }
}

void Trainer::add_step_sums(Metrics& metrics, std::vector<StepSums>& per_replica) {
  auto& strategy = *model_.strategy;
  if (strategy.num_workers() == 1) {
    for (std::size_t r = 0; r < per_replica.size(); ++r) metrics.add(static_cast<int>(r), per_replica[r]);
    return;
  }
  // No gradient collective to ride in (evaluation, a micro-step): one small all-reduce on the
  // control group gathers every replica's sums (sums_to_tensor's layout, in float64).
  const std::size_t width = sums_width(per_replica.front());
  const std::size_t first = static_cast<std::size_t>(strategy.worker_rank()) * per_replica.size();
  std::vector<double> values(width * static_cast<std::size_t>(strategy.num_replicas_in_sync()), 0.0);
  for (std::size_t r = 0; r < per_replica.size(); ++r) write_sums(per_replica[r], values.data() + (first + r) * width);
  strategy.sum_across_workers(values);
  for (std::size_t slot = 0; slot * width < values.size(); ++slot) {
    metrics.add(static_cast<int>(slot), read_sums(per_replica.front(), values.data() + slot * width));
  }
}

std::vector<data::Element> Trainer::shards_of(const strategy::Strategy::WorkerBatch& batch) const {
  if (!batch.replica_shards.empty()) {
    TANDEM_ASSERT(batch.replica_shards.size() == replicas_.size(), "model \"{}\": {} staged shards for {} replicas",
                  model_.name, batch.replica_shards.size(), replicas_.size());
    return batch.replica_shards;
  }
  if (replicas_.size() == 1) return {batch.local};
  return model_.strategy->split_batch(batch.local);
}

void Trainer::train_step(const strategy::Strategy::WorkerBatch& batch) {
  if (pipeline_) return pipeline_train_step(batch);
  auto& g = *graphs_;
  TANDEM_REQUIRE(with_targets_ && !g.train_fetches.empty(), FailedPrecondition,
                 "model \"{}\": training needs a compiled model and data with targets", model_.name);
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t examples = batch.global_examples;
  const bool update = model_.optimizer->is_update_step();
  auto& strategy = *model_.strategy;
  auto shards = shards_of(batch);
  // Every replica or none: their collectives must match. An empty shard (a last batch smaller
  // than the replica count) runs the step in parts.
  bool whole_step = update;
  for (std::size_t r = 0; r < replicas_.size() && whole_step; ++r) {
    whole_step = rows_of(shards[r]) > 0 && runs_whole_step(static_cast<int>(r));
  }
  std::span<const double> rider;
  if (batch.rider != nullptr) rider = batch.rider->values;
  const std::vector<bool> lent = lend_rows(shards);
  if (replicas_.size() == 1) {
    run_replica_step(0, shards.front(), examples, update, whole_step, rider, lent.front());
  } else {
    strategy.run([&](strategy::ReplicaContext& ctx) {
      const int r = ctx.replica_id_in_sync_group();
      run_replica_step(r, shards[static_cast<std::size_t>(r)], examples, update, whole_step, rider,
                       lent[static_cast<std::size_t>(r)]);
    });
  }
  if (const Replica& first = *replicas_.front(); first.sums_reduced) {
    // Every replica's sums, gathered in the last bucket's collective, and the rider's.
    for (int slot = 0; slot < strategy.num_replicas_in_sync(); ++slot)
      train_metrics_->add(slot, sums_from_tensor(first.sums, first.sums_tensor, static_cast<std::size_t>(slot)));
    if (batch.rider != nullptr) batch.rider->summed = read_rider(first.sums_tensor, batch.rider->values);
  } else {
    std::vector<StepSums> sums;
    for (const auto& replica : replicas_) sums.push_back(replica->sums);
    add_step_sums(*train_metrics_, sums);
  }
  // A step skipped by loss scaling does not count (Keras: iterations are the inner optimizer's).
  for (const auto& replica : replicas_) {
    TANDEM_ASSERT(replica->applied == replicas_.front()->applied,
                  "model \"{}\": loss scaling skipped the step on some replicas only", model_.name);
  }
  if (replicas_.front()->applied) model_.optimizer->finish_step();
  g.times.steps += 1;
  g.times.step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TrainingTimes Trainer::times() const { return graphs_->times; }

void Trainer::pipeline_add_sums(Phase phase, std::vector<StepSums>& per_replica) {
  add_step_sums(phase == Phase::kTrain ? *train_metrics_ : *test_metrics_, per_replica);
}

void Trainer::count_step(double seconds) {
  graphs_->times.steps += 1;
  graphs_->times.step_seconds += seconds;
}

void Trainer::test_step(const strategy::Strategy::WorkerBatch& batch) {
  if (pipeline_) return pipeline_test_step(batch);
  auto& g = *graphs_;
  TANDEM_REQUIRE(with_targets_ && !g.test_fetches.empty(), FailedPrecondition,
                 "model \"{}\": evaluation needs a compiled model and data with targets", model_.name);
  std::vector<StepSums> step_sums(replicas_.size());
  for (auto& sums : step_sums) {
    sums.output_loss.assign(model_.outputs.size() > 1 ? model_.outputs.size() : 0, 0.0);
    sums.metrics.assign(g.num_sums - 1 - sums.output_loss.size(), 0.0);
  }
  auto shards = shards_of(batch);
  const std::vector<bool> lent = lend_rows(shards);
  const auto body = [&](int r, const data::Element& shard) {
    Replica& replica = *replicas_[static_cast<std::size_t>(r)];
    const std::int64_t rows = rows_of(shard);
    if (rows == 0) return;  // step_sums[r] stays zero (with the right number of entries)
    auto& feeds = replica.feeds;
    feeds.clear();
    for (std::size_t i = 0; i < g.x.size(); ++i) feeds.emplace_back(g.x[i], shard[i]);
    for (std::size_t j = 0; j < g.y.size(); ++j) feeds.emplace_back(g.y[j], shard[g.x.size() + j]);
    const auto fetched = run_untrained(r, feeds, g.test_fetches);
    if (lent[static_cast<std::size_t>(r)]) return;  // ran for the parameter gathers only
    const auto scalars = read_step_scalars(replica, fetched);
    StepSums sums;
    sums.loss = scalars[0];
    std::size_t k = 1;
    if (model_.outputs.size() > 1) {
      for (std::size_t j = 0; j < model_.outputs.size(); ++j) sums.output_loss.push_back(scalars[k++]);
    }
    for (; k < g.num_sums; ++k) sums.metrics.push_back(scalars[k]);
    sums.examples = rows;
    if (!model_.strategy->leads_data_shard(r)) return;  // another replica computed these rows: zeros
    step_sums[static_cast<std::size_t>(r)] = std::move(sums);
  };
  if (replicas_.size() == 1) {
    body(0, shards.front());
  } else {
    model_.strategy->run([&](strategy::ReplicaContext& ctx) {
      body(ctx.replica_id_in_sync_group(), shards[static_cast<std::size_t>(ctx.replica_id_in_sync_group())]);
    });
  }
  add_step_sums(*test_metrics_, step_sums);
}

std::vector<Tensor> Trainer::predict_step(const data::Element& batch) {
  if (pipeline_) return pipeline_predict_step(batch);
  auto& g = *graphs_;
  const auto body = [&](int r, const data::Element& shard) {
    Replica& replica = *replicas_[static_cast<std::size_t>(r)];
    auto& feeds = replica.feeds;
    feeds.clear();
    for (std::size_t i = 0; i < g.x.size(); ++i) feeds.emplace_back(g.x[i], shard[i]);
    std::vector<Tensor> out;
    for (const auto& t : run_untrained(r, feeds, g.predict_fetches))
      out.push_back(t.to(devices::default_cpu_device()).clone());
    return out;
  };
  if (replicas_.size() == 1) return body(0, batch);
  auto shards = model_.strategy->split_batch(batch);
  const std::vector<bool> lent = lend_rows(shards);
  std::vector<std::vector<Tensor>> parts(replicas_.size());
  model_.strategy->run([&](strategy::ReplicaContext& ctx) {
    const auto r = static_cast<std::size_t>(ctx.replica_id_in_sync_group());
    if (rows_of(shards[r]) == 0) return;
    auto out = body(static_cast<int>(r), shards[r]);
    // A lent row ran for the parameter gathers only; a replica that is not its shard's first
    // computed the same rows as that one (tensor parallelism).
    if (!lent[r] && model_.strategy->leads_data_shard(static_cast<int>(r))) parts[r] = std::move(out);
  });
  // The replicas' outputs, concatenated in replica order.
  std::vector<Tensor> result;
  for (std::size_t j = 0; j < g.predict_fetches.size(); ++j) {
    std::int64_t rows = 0;
    Tensor first;
    for (const auto& p : parts) {
      if (p.empty()) continue;
      rows += p[j].shape()[0];
      if (!first.defined()) first = p[j];
    }
    Shape shape = first.shape();
    shape[0] = rows;
    Tensor out = Tensor::empty(shape, first.dtype());
    std::size_t offset = 0;
    for (const auto& p : parts) {
      if (p.empty()) continue;
      std::memcpy(static_cast<char*>(out.raw_data()) + offset, p[j].raw_data(), p[j].nbytes());
      offset += p[j].nbytes();
    }
    result.push_back(std::move(out));
  }
  return result;
}

void Trainer::reset_metrics(Phase phase) {
  auto& metrics = phase == Phase::kTrain ? train_metrics_ : test_metrics_;
  if (metrics) metrics->reset();
}

void Trainer::write_logs(Phase phase, Logs& logs, std::string_view prefix) const {
  const auto& metrics = phase == Phase::kTrain ? train_metrics_ : test_metrics_;
  if (!metrics) return;
  const double n = std::max(1.0, metrics->examples());
  std::size_t k = 0;
  logs.set(fmt::format("{}loss", prefix), metrics->read(k++) / n);
  const bool several = model_.compiled_outputs.size() > 1;
  if (several) {
    for (const auto& out : model_.compiled_outputs)
      logs.set(fmt::format("{}{}_loss", prefix, out.name), metrics->read(k++) / n);
  }
  for (const auto& out : model_.compiled_outputs) {
    for (const auto& [metric, name] : out.metrics) {
      logs.set(several ? fmt::format("{}{}_{}", prefix, out.name, name) : fmt::format("{}{}", prefix, name),
               metrics->read(k++) / n);
    }
  }
}

void Trainer::check_replicas_agree() const {
  if (replicas_.size() < 2) return;
  model_.strategy->check_replicas_agree(graphs_->variables.variables);
}

}  // namespace tandem::keras::detail
