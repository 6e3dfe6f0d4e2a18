// Model: construction (functional graph of layer calls, Sequential), compile, the fit / evaluate /
// predict loops with their callbacks, summary, and weights.
#include "tandem/keras_like/model.h"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <set>

#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/layers.h"
#include "tandem/keras_like/saving.h"

namespace tandem::keras {

using detail::LayerNode;
using detail::ModelState;

namespace detail {
ModelState::ModelState() = default;
ModelState::~ModelState() = default;
}  // namespace detail

namespace {

ModelState& checked(const std::shared_ptr<ModelState>& state) {
  TANDEM_REQUIRE(state != nullptr, FailedPrecondition,
                 "use of an empty Model handle (assign a Sequential or a Model first)");
  return *state;
}

// Orders the layer calls so that each comes after its inputs, and collects the distinct layers.
void link(ModelState& s) {
  std::set<const LayerNode*> inputs;
  for (const auto& in : s.inputs) {
    TANDEM_REQUIRE(in.defined() && in.node()->layer == nullptr, InvalidArgument,
                   "model \"{}\": inputs must come from keras::Input(); {} is a layer output", s.name, in.name());
    inputs.insert(in.node().get());
  }
  std::set<const LayerNode*> done;
  std::vector<std::shared_ptr<LayerNode>> order;
  std::vector<std::pair<std::shared_ptr<LayerNode>, std::size_t>> stack;
  for (const auto& out : s.outputs) {
    TANDEM_REQUIRE(out.defined(), InvalidArgument, "model \"{}\": an output is undefined", s.name);
    stack.emplace_back(out.node(), 0);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (done.contains(node.get())) {
        stack.pop_back();
        continue;
      }
      if (node->layer == nullptr) {
        TANDEM_REQUIRE(inputs.contains(node.get()), InvalidArgument,
                       "model \"{}\": the outputs depend on input \"{}\", which is not among the model's inputs",
                       s.name, node->input_name);
        done.insert(node.get());
        stack.pop_back();
        continue;
      }
      if (next < node->inputs.size()) {
        auto child = node->inputs[next++].node();
        stack.emplace_back(child, 0);
        continue;
      }
      done.insert(node.get());
      order.push_back(node);
      stack.pop_back();
    }
  }
  s.nodes = order;
  s.layers.clear();
  std::set<const LayerImpl*> seen;
  for (const auto& node : order) {
    if (seen.insert(node->layer.get()).second) s.layers.emplace_back(node->layer);
  }
  // Every weight must belong to the strategy the model runs under.
  for (const auto& layer : s.layers) {
    for (const auto& w : layer->weights()) {
      TANDEM_REQUIRE(
          &w->strategy() == s.strategy, FailedPrecondition,
          "model \"{}\": layer \"{}\" has weights from {}, but the model is being made under {}; build every "
          "layer under one strategy's scope",
          s.name, layer.name(), w->strategy().name(), s.strategy->name());
    }
  }
}

// Enters the model's strategy scope, refusing to run inside another strategy's scope.
strategy::Strategy::Scope enter_model_scope(ModelState& s, std::string_view what) {
  TANDEM_REQUIRE(!strategy::has_strategy() || &strategy::get_strategy() == s.strategy, FailedPrecondition,
                 "model \"{}\" was created under {} but {}() was called in the scope of {}; call it outside that scope "
                 "or build the model under the same strategy",
                 s.name, s.strategy->name(), what, strategy::get_strategy().name());
  return s.strategy->scope();
}

void build_sequential(ModelState& s, const Shape& input_shape, DType dtype) {
  Shape without_batch;
  for (int i = 1; i < input_shape.rank(); ++i) without_batch.push_back(input_shape[i]);
  KerasTensor x = Input(without_batch, dtype);
  s.inputs = {x};
  auto scope = s.strategy->scope();
  for (const auto& layer : s.pending_layers) x = layer(x);
  s.outputs = {x};
  s.pending_layers.clear();
  link(s);
}

// A Sequential given no Input builds from the first data it sees.
void ensure_built(ModelState& s, const std::vector<graph::TensorSpec>& spec) {
  if (!s.pending_layers.empty()) {
    TANDEM_REQUIRE(!spec.empty(), InvalidArgument, "model \"{}\": the data has no components", s.name);
    build_sequential(s, spec[0].shape, spec[0].dtype);
  }
  TANDEM_REQUIRE(!s.outputs.empty(), FailedPrecondition, "model \"{}\" has no layers", s.name);
}

// The strategy's group as training_stats() adds it up: none for one replica on one worker (it
// exchanges nothing, and asking for its communicator would make one).
std::vector<const collective::Communicator*> replica_group(strategy::Strategy& strategy) {
  std::vector<const collective::Communicator*> group;
  const int replicas = static_cast<int>(strategy.replica_devices().size());
  if (replicas == 1 && strategy.num_workers() == 1) return group;
  for (int r = 0; r < replicas; ++r) group.push_back(&strategy.communicator(r));
  return group;
}

ModelState::StatsBaseline stats_now(strategy::Strategy& strategy) {
  ModelState::StatsBaseline now{.group = replica_group(strategy),
                                .cross_worker = strategy.cross_worker_stats(),
                                .tensor_parallel = strategy.tensor_parallel_stats(),
                                .pipeline = strategy.pipeline_stats()};
  for (const auto* c : now.group) now.communication += c->stats();
  return now;
}

// ModelParallel's checks of the layouts against the model (before the first step; compile makes
// them too when the model is built by then).
void check_distribution(const Model& model, const ModelState& s) {
  if (const auto* mp = dynamic_cast<const distribution::ModelParallel*>(s.strategy)) mp->check_model(model);
}

detail::Trainer& trainer_for(const Model& model, ModelState& s, const std::vector<graph::TensorSpec>& spec,
                             bool with_targets) {
  ensure_built(s, spec);
  if (s.trainer == nullptr || !s.trainer->accepts(spec, with_targets)) {
    check_distribution(model, s);
    s.trainer = std::make_unique<detail::Trainer>(s, spec, with_targets);
    s.stats_baseline = stats_now(*s.strategy);
  }
  return *s.trainer;
}

// Keras 3's defaults: the callbacks given, then a History and (unless silent) a ProgbarLogger,
// each only when the caller did not pass one. Returns the History in use.
std::shared_ptr<History> add_defaults(std::vector<CallbackPtr>& callbacks, int verbose, bool with_history) {
  std::shared_ptr<History> history;
  bool has_progbar = false;
  for (const auto& c : callbacks) {
    if (auto h = std::dynamic_pointer_cast<History>(c)) history = h;
    if (std::dynamic_pointer_cast<ProgbarLogger>(c)) has_progbar = true;
  }
  if (!history && with_history) {
    history = std::make_shared<History>();
    callbacks.push_back(history);
  }
  if (!has_progbar && verbose != 0) callbacks.push_back(std::make_shared<ProgbarLogger>());
  return history;
}

std::int64_t steps_of(const data::Dataset& data, const std::optional<std::int64_t>& steps) {
  if (steps) return *steps;
  const auto n = data.cardinality();
  return n >= 0 ? n : -1;
}

// fit, evaluate and predict on data that yields nothing raise alike (Keras's loops fail too, with
// "Unexpected result ... (Empty logs)"): a loss or prediction over no examples is meaningless,
// and 0 would pass for a result. `batches` is the count known beforehand, or the count taken.
void require_batches(const ModelState& s, std::int64_t batches, std::string_view what) {
  TANDEM_REQUIRE(batches != 0, InvalidArgument, "model \"{}\": {} got no batches: the dataset is empty", s.name, what);
}

// fit(x, y), evaluate(x, y) and predict(x) on arrays of no examples, said before anything is built
// (a shuffle of them would complain about its buffer instead).
void require_rows(const Tensor& x, std::string_view call, std::string_view purpose) {
  TANDEM_REQUIRE(x.shape()[0] > 0, InvalidArgument, "{}: x has 0 rows (shape {}): there are no examples to {}", call,
                 x.shape(), purpose);
}

Tensor concatenate_rows(const std::vector<Tensor>& parts) {
  std::int64_t rows = 0;
  for (const auto& p : parts) rows += p.shape()[0];
  Shape shape = parts.front().shape();
  shape[0] = rows;
  Tensor out = Tensor::empty(shape, parts.front().dtype());
  std::size_t offset = 0;
  for (const auto& p : parts) {
    const Tensor host = p.to(devices::default_cpu_device());
    std::memcpy(static_cast<char*>(out.raw_data()) + offset, host.raw_data(), host.nbytes());
    offset += host.nbytes();
  }
  return out;
}

// One pass of evaluation, reporting to `callbacks` through their on_test_* hooks. `what` names the
// data in errors: "evaluate()", "fit()'s validation_data".
Logs run_evaluation(const Model& model, ModelState& s, const data::Dataset& data, std::optional<std::int64_t> steps,
                    CallbackList& callbacks, std::string_view what) {
  auto& trainer = trainer_for(model, s, data.element_spec(), true);
  const std::int64_t total = steps_of(data, steps);
  require_batches(s, total, what);
  Logs logs;
  callbacks.on_test_begin(logs);
  trainer.reset_metrics(detail::Phase::kTest);
  auto iterator = s.strategy->iterate_for_worker(data, {});
  std::int64_t step = 0;
  for (; total < 0 || step < total; ++step) {
    auto batch = iterator->next();
    if (!batch) break;
    Logs batch_logs;
    callbacks.on_test_batch_begin(step, batch_logs);
    trainer.test_step(*batch);
    trainer.write_logs(detail::Phase::kTest, batch_logs);
    callbacks.on_test_batch_end(step, batch_logs);
  }
  require_batches(s, step, what);  // a pipeline of unknown length that yielded nothing
  trainer.write_logs(detail::Phase::kTest, logs);
  callbacks.on_test_end(logs);
  return logs;
}

std::string readable_bytes(double bytes) {
  static constexpr const char* kUnits[] = {"Byte", "KB", "MB", "GB", "TB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return fmt::format("{:.2f} {}", bytes, kUnits[unit]);
}

}  // namespace

Model::Model(std::vector<KerasTensor> inputs, std::vector<KerasTensor> outputs, std::string name)
    : state_(std::make_shared<ModelState>()) {
  auto& s = *state_;
  s.name = name.empty() ? unique_layer_name("Functional") : std::move(name);
  s.strategy = &strategy::get_strategy();
  // A model's weights belong to the strategy they were made under; use it if no scope is open.
  if (!strategy::has_strategy()) {
    for (const auto& out : outputs) {
      if (out.defined() && out.node()->layer && !out.node()->layer->weights().empty()) {
        s.strategy = &out.node()->layer->weights().front()->strategy();
        break;
      }
    }
  }
  TANDEM_REQUIRE(!inputs.empty() && !outputs.empty(), InvalidArgument, "model \"{}\" needs inputs and outputs", s.name);
  s.inputs = std::move(inputs);
  s.outputs = std::move(outputs);
  link(s);
}

Model::Model(KerasTensor input, KerasTensor output, std::string name)
    : Model(std::vector<KerasTensor>{std::move(input)}, std::vector<KerasTensor>{std::move(output)}, std::move(name)) {}

Model Sequential(std::vector<SequentialItem> items, std::string name) {
  Model model;
  model.state_ = std::make_shared<ModelState>();
  auto& s = *model.state_;
  s.name = name.empty() ? unique_layer_name("Sequential") : std::move(name);
  s.sequential = true;
  s.strategy = &strategy::get_strategy();
  std::optional<KerasTensor> x;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    if (item.input().defined()) {
      TANDEM_REQUIRE(i == 0, InvalidArgument, "Sequential \"{}\": an Input may only come first (item {})", s.name, i);
      x = item.input();
      continue;
    }
    TANDEM_REQUIRE(item.layer().defined(), InvalidArgument, "Sequential \"{}\": item {} is an empty layer", s.name, i);
    s.pending_layers.push_back(item.layer());
  }
  if (x) {
    s.inputs = {*x};
    KerasTensor h = *x;
    for (const auto& layer : s.pending_layers) h = layer(h);
    s.outputs = {h};
    s.pending_layers.clear();
    link(s);
  } else {
    // Deferred: the layers are listed now and built on the first data.
    for (const auto& layer : s.pending_layers) s.layers.push_back(layer);
  }
  return model;
}

const std::string& Model::name() const { return checked(state_).name; }
const std::vector<KerasTensor>& Model::inputs() const { return checked(state_).inputs; }
const std::vector<KerasTensor>& Model::outputs() const { return checked(state_).outputs; }
std::vector<Layer> Model::layers() const { return checked(state_).layers; }
bool Model::built() const { return checked(state_).pending_layers.empty(); }
bool Model::compiled() const { return checked(state_).compiled; }

Layer Model::get_layer(std::string_view name) const {
  std::string names;
  for (const auto& layer : checked(state_).layers) {
    if (layer.name() == name) return layer;
    names += fmt::format("{}{}", names.empty() ? "" : ", ", layer.name());
  }
  throw NotFound(fmt::format("model \"{}\" has no layer \"{}\" (layers: {})", state_->name, name, names));
}

void Model::build(const Shape& input_shape) {
  auto& s = checked(state_);
  if (!s.pending_layers.empty()) build_sequential(s, input_shape, DType::kF32);
}

void Model::compile(OptimizerRef optimizer, LossList loss, std::vector<MetricRef> metrics, CompileOptions options) {
  auto& s = checked(state_);
  TANDEM_REQUIRE(!strategy::has_strategy() || &strategy::get_strategy() == s.strategy, FailedPrecondition,
                 "model \"{}\" was created under {} but compile() was called in the scope of {}", s.name,
                 s.strategy->name(), strategy::get_strategy().name());
  if (built()) check_distribution(*this, s);  // before anything changes: a refused compile leaves the model as it was
  const auto& losses = loss.losses();
  const std::size_t n_out = s.outputs.empty() ? 1 : s.outputs.size();  // a deferred Sequential has one output
  TANDEM_REQUIRE(losses.size() == 1 || losses.size() == n_out, InvalidArgument,
                 "model \"{}\" has {} output(s); compile() got {} losses (give one, or one per output)", s.name, n_out,
                 losses.size());
  TANDEM_REQUIRE(options.loss_weights.empty() || options.loss_weights.size() == n_out, InvalidArgument,
                 "model \"{}\" has {} output(s); compile() got {} loss weights", s.name, n_out,
                 options.loss_weights.size());
  std::vector<std::pair<MetricSpec, std::string>> resolved;
  for (const auto& m : metrics) resolved.push_back(m.resolve());
  s.compiled_outputs.clear();
  for (std::size_t j = 0; j < n_out; ++j) {
    detail::CompiledOutput out;
    out.loss = losses[losses.size() == 1 ? 0 : j].spec();
    out.loss_weight = options.loss_weights.empty() ? 1.0 : options.loss_weights[j];
    out.name = j < s.outputs.size() && s.outputs[j].node()->layer ? s.outputs[j].node()->layer->name()
                                                                  : fmt::format("output_{}", j);
    out.metrics = resolved;
    s.compiled_outputs.push_back(std::move(out));
  }
  // Keras 3: under mixed_float16, compile() wraps the optimizer in a LossScaleOptimizer (float16
  // gradients underflow without one). bfloat16 has float32's exponent range and needs none.
  const auto float16_layer = [](const Layer& layer) {
    return layer->dtype_policy().compute_dtype() == DType::kF16 && layer->dtype_policy().is_mixed();
  };
  const bool computes_in_float16 = std::any_of(s.layers.begin(), s.layers.end(), float16_layer) ||
                                   std::any_of(s.pending_layers.begin(), s.pending_layers.end(), float16_layer);
  if (optimizer.loss_scale_optimizer()) {
    s.optimizer = std::make_unique<Optimizer>(*optimizer.loss_scale_optimizer());
  } else if (computes_in_float16) {
    s.optimizer = std::make_unique<Optimizer>(LossScaleOptimizer{.inner_optimizer = optimizer.spec()});
  } else {
    s.optimizer = std::make_unique<Optimizer>(optimizer.spec());
  }
  s.cuda_graphs = options.cuda_graphs;
  s.trainer.reset();  // the graph depends on the losses and metrics
  s.compiled = true;
}

History Model::fit(const data::Dataset& data, const FitOptions& options) {
  auto& s = checked(state_);
  TANDEM_REQUIRE(s.compiled, FailedPrecondition, "model \"{}\": call compile() before fit()", s.name);
  TANDEM_REQUIRE(data.defined(), InvalidArgument, "model \"{}\": fit() got an empty Dataset", s.name);
  TANDEM_REQUIRE(options.epochs >= 0 && options.initial_epoch >= 0, InvalidArgument,
                 "model \"{}\": epochs ({}) and initial_epoch ({}) must not be negative", s.name, options.epochs,
                 options.initial_epoch);
  TANDEM_REQUIRE(!options.steps_per_epoch || *options.steps_per_epoch > 0, InvalidArgument,
                 "model \"{}\": steps_per_epoch must be positive", s.name);
  TANDEM_REQUIRE(options.validation_freq >= 1, InvalidArgument, "model \"{}\": validation_freq must be at least 1",
                 s.name);
  auto scope = enter_model_scope(s, "fit");
  auto& trainer = trainer_for(*this, s, data.element_spec(), true);
  const std::int64_t steps = steps_of(data, options.steps_per_epoch);
  require_batches(s, steps, "fit()");
  // Workers that would train differently meet in different collectives much later: compare now.
  std::string batches;
  for (const auto& spec : data.element_spec()) {
    batches += fmt::format("{}{} {}", batches.empty() ? "" : ", ", spec.dtype, spec.shape);
  }
  s.strategy->check_workers_agree("fit",
                                  {{"batches of", batches},
                                   {"steps per epoch", steps < 0 ? "unknown" : std::to_string(steps)},
                                   {"epochs", fmt::format("{} from epoch {}", options.epochs, options.initial_epoch)},
                                   {"parameters", std::to_string(count_params())}});

  std::vector<CallbackPtr> list = options.callbacks;
  // Under a multi-worker strategy only the chief prints, unless asked otherwise.
  const int verbose = s.strategy->should_log() ? options.verbose : 0;
  const auto history = add_defaults(list, verbose, /*with_history=*/true);
  CallbackList callbacks(std::move(list), this, {.epochs = options.epochs, .steps = steps, .verbose = verbose});
  s.stop_training = false;
  s.resume.reset();
  Logs train_logs;
  callbacks.on_train_begin(train_logs);  // BackupAndRestore may set s.resume
  int first_epoch = options.initial_epoch;
  std::int64_t first_step = 0;
  const bool resumed = s.resume.has_value();
  if (s.resume) {
    first_epoch = std::max(first_epoch, s.resume->epoch);
    first_step = s.resume->epoch == first_epoch ? s.resume->step : 0;
    s.resume.reset();
  }
  // Passes over the data are numbered so that a resumed run sees the shuffles and the data
  // position the interrupted run would have seen: without steps_per_epoch pass = epoch; with it,
  // one pass runs across epochs (Keras) and the next starts where it ends.
  std::unique_ptr<strategy::Strategy::WorkerIterator> iterator;
  std::uint64_t pass = 0;
  std::int64_t pass_position = 0;  // batches taken from the current pass
  const auto start_pass = [&](std::uint64_t index) {
    pass = index;
    pass_position = 0;
    iterator = s.strategy->iterate_for_worker(data, {.epoch = index});
  };
  if (resumed && options.steps_per_epoch && first_epoch > 0) {
    // Where the interrupted run's single iterator was: whole passes of known length are skipped.
    const std::int64_t done = std::int64_t{first_epoch} * *options.steps_per_epoch + first_step;
    const std::int64_t per_pass = data.cardinality();
    start_pass(per_pass > 0 ? static_cast<std::uint64_t>(done / per_pass) : 0);
    pass_position = iterator->skip(per_pass > 0 ? done % per_pass : done);
  }
  // With steps_per_epoch the iterator is in place already; without, the epoch's pass is skipped into.
  const bool skip_in_first_epoch = !options.steps_per_epoch;
  for (int epoch = first_epoch; epoch < options.epochs && !s.stop_training; ++epoch) {
    Logs epoch_logs;
    callbacks.on_epoch_begin(epoch, epoch_logs);
    if (!options.steps_per_epoch || iterator == nullptr) start_pass(static_cast<std::uint64_t>(epoch));
    trainer.reset_metrics(detail::Phase::kTrain);
    std::int64_t step = 0;
    if (first_step > 0) {  // resumed mid-epoch
      if (skip_in_first_epoch) {
        step = iterator->skip(first_step);
        pass_position = step;
      } else {
        step = first_step;
      }
      first_step = 0;
    }
    for (; steps < 0 || step < steps; ++step) {
      auto batch = iterator->next();
      if (!batch && options.steps_per_epoch && pass_position > 0) {
        start_pass(pass + 1);  // ran out mid-epoch: start another pass
        batch = iterator->next();
      }
      if (!batch) break;
      ++pass_position;
      Logs batch_logs;
      callbacks.on_train_batch_begin(step, batch_logs);
      trainer.train_step(*batch);
      trainer.write_logs(detail::Phase::kTrain, batch_logs);
      callbacks.on_train_batch_end(step, batch_logs);
      if (s.stop_training) break;
    }
    require_batches(s, step, "fit()");  // a pipeline of unknown length that yielded nothing
    trainer.write_logs(detail::Phase::kTrain, epoch_logs);
    // Every replica applied the same updates: their copies must still be equal.
    trainer.check_replicas_agree();
    if (options.validation_data && (epoch + 1) % options.validation_freq == 0) {
      // Validation reports to the same callbacks (on_test_*), as in Keras; the bar ignores it.
      const Logs val = run_evaluation(*this, s, *options.validation_data, options.validation_steps, callbacks,
                                      "fit()'s validation_data");
      for (const auto& [key, value] : val) epoch_logs.set(fmt::format("val_{}", key), value);
    }
    callbacks.on_epoch_end(epoch, epoch_logs);
    train_logs = epoch_logs;
  }
  callbacks.on_train_end(train_logs);
  return *history;
}

History Model::fit(const Tensor& x, const Tensor& y, const FitOptions& options) {
  TANDEM_REQUIRE(
      x.defined() && y.defined() && x.shape().rank() >= 1 && y.shape().rank() >= 1 && x.shape()[0] == y.shape()[0],
      InvalidArgument, "fit(x, y): x {} and y {} must have the same number of examples (first dimension)",
      x.defined() ? x.shape() : Shape{}, y.defined() ? y.shape() : Shape{});
  require_rows(x, "fit(x, y)", "train on");
  TANDEM_REQUIRE(options.batch_size > 0, InvalidArgument, "fit(x, y): batch_size must be positive; got {}",
                 options.batch_size);
  TANDEM_REQUIRE(options.validation_split >= 0.0 && options.validation_split < 1.0, InvalidArgument,
                 "fit(x, y): validation_split must be in [0, 1); got {}", options.validation_split);
  TANDEM_REQUIRE(!(options.validation_split > 0 && options.validation_data), InvalidArgument,
                 "fit(x, y): give validation_split or validation_data, not both");
  const std::int64_t n = x.shape()[0];
  // Keras takes the validation examples from the end, before any shuffling.
  const auto n_train = static_cast<std::int64_t>(static_cast<double>(n) * (1.0 - options.validation_split));
  TANDEM_REQUIRE(options.validation_split == 0 || (n_train > 0 && n_train < n), InvalidArgument,
                 "fit(x, y): validation_split {} of {} examples leaves no training or no validation examples",
                 options.validation_split, n);
  auto all = data::Dataset::from_tensor_slices({x, y});
  auto train = all.take(n_train);
  if (options.shuffle) train = train.shuffle(n_train);
  FitOptions o = options;
  if (options.validation_split > 0) o.validation_data = all.skip(n_train).batch(options.batch_size);
  return fit(train.batch(options.batch_size), o);
}

Logs Model::evaluate(const data::Dataset& data, const EvaluateOptions& options) {
  auto& s = checked(state_);
  TANDEM_REQUIRE(s.compiled, FailedPrecondition, "model \"{}\": call compile() before evaluate()", s.name);
  auto scope = enter_model_scope(s, "evaluate");
  std::vector<CallbackPtr> list = options.callbacks;
  const int verbose = s.strategy->should_log() ? options.verbose : 0;
  add_defaults(list, verbose, /*with_history=*/false);
  CallbackList callbacks(std::move(list), this,
                         {.epochs = 1, .steps = steps_of(data, options.steps), .verbose = verbose});
  return run_evaluation(*this, s, data, options.steps, callbacks, "evaluate()");
}

Logs Model::evaluate(const Tensor& x, const Tensor& y, const EvaluateOptions& options) {
  TANDEM_REQUIRE(options.batch_size > 0, InvalidArgument, "evaluate(x, y): batch_size must be positive");
  TANDEM_REQUIRE(x.defined() && x.shape().rank() >= 1, InvalidArgument,
                 "evaluate(x, y): x must have a batch dimension");
  require_rows(x, "evaluate(x, y)", "evaluate");
  return evaluate(data::Dataset::from_tensor_slices({x, y}).batch(options.batch_size), options);
}

std::vector<Tensor> Model::predict_outputs(const data::Dataset& data, const PredictOptions& options) {
  auto& s = checked(state_);
  auto scope = enter_model_scope(s, "predict");
  auto& trainer = trainer_for(*this, s, data.element_spec(), false);
  const std::int64_t total = steps_of(data, options.steps);
  require_batches(s, total, "predict()");
  std::vector<CallbackPtr> callbacks = options.callbacks;
  add_defaults(callbacks, options.verbose, /*with_history=*/false);
  CallbackList list(std::move(callbacks), this, {.epochs = 1, .steps = total, .verbose = options.verbose});
  Logs logs;
  list.on_predict_begin(logs);
  std::vector<std::vector<Tensor>> parts(s.outputs.size());
  auto iterator = data.iterate();
  std::int64_t step = 0;
  for (; total < 0 || step < total; ++step) {
    auto batch = iterator->next();
    if (!batch) break;
    Logs batch_logs;
    list.on_predict_batch_begin(step, batch_logs);
    const auto outputs = trainer.predict_step(*batch);
    for (std::size_t j = 0; j < outputs.size(); ++j)
      parts[j].push_back(outputs[j].to(devices::default_cpu_device()).clone());
    list.on_predict_batch_end(step, batch_logs);
  }
  require_batches(s, step, "predict()");  // a pipeline of unknown length that yielded nothing
  list.on_predict_end(logs);
  std::vector<Tensor> result;
  for (const auto& p : parts) result.push_back(concatenate_rows(p));
  return result;
}

Tensor Model::predict(const data::Dataset& data, const PredictOptions& options) {
  auto outputs = predict_outputs(data, options);
  TANDEM_REQUIRE(outputs.size() == 1, InvalidArgument, "model \"{}\" has {} outputs; use predict_outputs()", name(),
                 outputs.size());
  return outputs.front();
}

Tensor Model::predict(const Tensor& x, const PredictOptions& options) {
  TANDEM_REQUIRE(options.batch_size > 0, InvalidArgument, "predict(x): batch_size must be positive");
  TANDEM_REQUIRE(x.defined() && x.shape().rank() >= 1, InvalidArgument, "predict(x): x must have a batch dimension");
  require_rows(x, "predict(x)", "predict");
  return predict(data::Dataset::from_tensor_slices({x}).batch(options.batch_size), options);
}

std::vector<VariablePtr> Model::trainable_weights() const {
  std::vector<VariablePtr> out;
  for (const auto& layer : checked(state_).layers) {
    for (const auto& w : layer->trainable_weights()) out.push_back(w);
  }
  return out;
}

std::vector<VariablePtr> Model::non_trainable_weights() const {
  std::vector<VariablePtr> out;
  for (const auto& layer : checked(state_).layers) {
    for (const auto& w : layer->non_trainable_weights()) out.push_back(w);
  }
  return out;
}

std::vector<VariablePtr> Model::weights() const {
  // Keras's order: trainable weights, then non-trainable ones.
  auto out = trainable_weights();
  for (const auto& w : non_trainable_weights()) out.push_back(w);
  return out;
}

std::int64_t Model::count_params() const {
  std::int64_t n = 0;
  for (const auto& w : weights()) n += w->global_shape().num_elements();
  return n;
}

std::vector<Tensor> Model::get_weights() const {
  std::vector<Tensor> out;
  for (const auto& w : weights()) out.push_back(w->read_value());
  return out;
}

void Model::set_weights(const std::vector<Tensor>& values) {
  const auto ws = weights();
  TANDEM_REQUIRE(values.size() == ws.size(), InvalidArgument, "model \"{}\" has {} weights; set_weights got {}", name(),
                 ws.size(), values.size());
  for (std::size_t i = 0; i < ws.size(); ++i) {
    TANDEM_REQUIRE(
        values[i].defined() && values[i].dtype() == ws[i]->dtype() && values[i].shape() == ws[i]->global_shape(),
        InvalidArgument, "model \"{}\": set_weights value {} for \"{}\" is {} {}; expected {} {}", name(), i,
        ws[i]->name(), values[i].defined() ? graph::dtype_name(values[i].dtype()) : "undefined",
        values[i].defined() ? values[i].shape() : Shape{}, ws[i]->dtype(), ws[i]->global_shape());
  }
  for (std::size_t i = 0; i < ws.size(); ++i) ws[i]->assign(values[i]);
}

void Model::save_weights(const std::string& path) const { save_model_weights(*this, path); }
void Model::load_weights(const std::string& path) { load_model_weights(*this, path); }

Optimizer& Model::optimizer() const {
  auto& s = checked(state_);
  TANDEM_REQUIRE(s.optimizer != nullptr, FailedPrecondition, "model \"{}\" has no optimizer: call compile() first",
                 s.name);
  return *s.optimizer;
}

strategy::Strategy& Model::distribute_strategy() const { return *checked(state_).strategy; }
bool Model::stop_training() const { return checked(state_).stop_training; }
void Model::set_stop_training(bool stop) { checked(state_).stop_training = stop; }

TrainingTimes Model::training_times() const {
  const auto& s = checked(state_);
  return s.trainer != nullptr ? s.trainer->times() : TrainingTimes{};
}

TrainingStats Model::training_stats() const {
  const auto& s = checked(state_);
  if (s.trainer == nullptr) return {};
  ModelState::StatsBaseline now = stats_now(*s.strategy);
  // A group rebuilt after a failed run counts from zero, from after the baseline was taken:
  // nothing to subtract then (the control communicator's earlier calls stay in cross_worker).
  if (now.group == s.stats_baseline.group) {
    now.communication -= s.stats_baseline.communication;
    now.cross_worker -= s.stats_baseline.cross_worker;
  }
  now.tensor_parallel -= s.stats_baseline.tensor_parallel;
  now.pipeline -= s.stats_baseline.pipeline;
  return {.steps = s.trainer->times().steps,
          .replicas = static_cast<int>(s.strategy->replica_devices().size()),
          .communication = now.communication,
          .cross_worker = now.cross_worker,
          .tensor_parallel = now.tensor_parallel,
          .pipeline = now.pipeline};
}

namespace {
double per_step(std::int64_t value, std::int64_t steps) {
  return steps > 0 ? static_cast<double>(value) / static_cast<double>(steps) : 0.0;
}
}  // namespace

double TrainingStats::bytes_sent_per_step() const { return per_step(communication.total().bytes_sent, steps); }
double TrainingStats::bytes_received_per_step() const {
  return per_step(communication.total().bytes_received, steps);
}
double TrainingStats::bytes_sent_per_replica_step() const { return bytes_sent_per_step() / replicas; }

std::string Model::summary_string(int line_length) const {
  const auto& s = checked(state_);
  // Keras 2's layout for sequential models: columns end at 45%, 85% and 100% of the line.
  const auto col1 = static_cast<std::size_t>(line_length * 0.45);
  const auto col2 = static_cast<std::size_t>(line_length * 0.85);
  const auto width = static_cast<std::size_t>(line_length);
  const auto row = [&](const std::string& a, const std::string& b, const std::string& c) {
    std::string line = " " + a;
    line.resize(std::max(line.size() + 1, col1), ' ');
    line += b;
    line.resize(std::max(line.size() + 1, col2), ' ');
    line += c;
    line.resize(std::max(line.size(), width), ' ');
    return line + "\n";
  };
  std::string out = fmt::format("Model: \"{}\"\n", s.name);
  out += std::string(width, '_') + "\n";
  out += row("Layer (type)", "Output Shape", "Param #");
  out += std::string(width, '=') + "\n";
  std::map<const LayerImpl*, std::vector<const LayerNode*>> calls;
  for (const auto& node : s.nodes) calls[node->layer.get()].push_back(node.get());
  if (!s.sequential) {
    for (const auto& in : s.inputs) {
      out += row(fmt::format("{} (InputLayer)", in.node()->input_name), fmt::format("[{}]", in.shape()), "0");
      out += std::string(width, ' ') + "\n";
    }
  }
  for (const auto& layer : s.layers) {
    std::string shape = "(unbuilt)";
    const auto& nodes = calls[layer.ptr().get()];
    if (nodes.size() == 1) {
      const auto& outs = nodes.front()->outputs;
      shape = outs.size() == 1 ? outs.front().shape.to_string() : "multiple";
    } else if (nodes.size() > 1) {
      shape = "multiple";
    }
    out +=
        row(fmt::format("{} ({})", layer.name(), layer->class_name()), shape, fmt::format("{}", layer->count_params()));
    out += std::string(width, ' ') + "\n";
  }
  std::int64_t trainable = 0, non_trainable = 0;
  for (const auto& w : trainable_weights()) trainable += w->global_shape().num_elements();
  for (const auto& w : non_trainable_weights()) non_trainable += w->global_shape().num_elements();
  const auto bytes = [](std::int64_t params) { return readable_bytes(static_cast<double>(params) * 4.0); };
  out += std::string(width, '=') + "\n";
  out += fmt::format("Total params: {} ({})\n", trainable + non_trainable, bytes(trainable + non_trainable));
  out += fmt::format("Trainable params: {} ({})\n", trainable, bytes(trainable));
  out += fmt::format("Non-trainable params: {} ({})\n", non_trainable, bytes(non_trainable));
  out += std::string(width, '_') + "\n";
  return out;
}

void Model::summary() const { std::cout << summary_string() << std::flush; }

}  // namespace tandem::keras
