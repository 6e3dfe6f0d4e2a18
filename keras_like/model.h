// tandem/keras_like/model.h — models: build, compile, fit, evaluate, predict, summary, save.
//
//   tandem::OneDeviceStrategy strategy("CPU:0");
//   keras::Model model;
//   {
//     auto scope = strategy.scope();
//     model = keras::Sequential({keras::Input({28, 28}), keras::Flatten(),
//                                keras::Dense(128, "relu"), keras::Dense(10)});
//     model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
//   }
//   auto history = model.fit(train.shuffle(60000).batch(128), {.epochs = 10, .validation_data = test.batch(1000)});
//
// A Model is a handle: copies share one model. Its weights live in the strategy whose scope was
// active when its layers were built; fit/evaluate/predict run under that strategy (calling them
// inside another strategy's scope is FailedPrecondition naming both).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/data/dataset.h"
#include "tandem/keras_like/callbacks.h"
#include "tandem/keras_like/layer.h"
#include "tandem/keras_like/losses.h"
#include "tandem/keras_like/metrics.h"
#include "tandem/keras_like/optimizers.h"
#include "tandem/strategy/strategy.h"

namespace tandem::keras {

// One loss, or one per output (in output order).
class LossList {
 public:
  template <class L>
  requires std::is_constructible_v<LossRef, L> LossList(L loss)
      : losses_{LossRef(std::move(loss))} {}  // NOLINT: compile("adam", "mse")
  LossList(std::initializer_list<LossRef> losses) : losses_(losses) {}
  const std::vector<LossRef>& losses() const { return losses_; }

 private:
  std::vector<LossRef> losses_;
};

struct CompileOptions {
  // Weight of each output's loss in the total (default 1 each).
  std::vector<double> loss_weights;
  // On GPUs, record each replica's step as a CUDA graph after two steps and replay it (one launch
  // a step instead of one per op); false runs every kernel each step. TANDEM_CUDA_GRAPHS=0 also
  // turns it off. Models with Dropout run without graphs (their masks change every step).
  bool cuda_graphs = true;
};

struct FitOptions {
  std::int64_t batch_size = 32;  // fit(x, y) only; a Dataset is already batched
  int epochs = 1;
  int verbose = 1;  // 0 silent, 1 progress bar, 2 one line per epoch
  std::vector<CallbackPtr> callbacks;
  double validation_split = 0.0;  // fit(x, y) only: the last fraction of x, y validates
  std::optional<data::Dataset> validation_data;
  bool shuffle = true;  // fit(x, y) only: reshuffle the examples every epoch
  int initial_epoch = 0;
  std::optional<std::int64_t> steps_per_epoch;  // default: one pass over the data
  std::optional<std::int64_t> validation_steps;
  int validation_freq = 1;
};

struct EvaluateOptions {
  std::int64_t batch_size = 32;  // evaluate(x, y) only
  int verbose = 1;
  std::optional<std::int64_t> steps;
  std::vector<CallbackPtr> callbacks;
};

// Where the training steps' time went, summed over every step since the model's trainer was
// made (its first fit, or a fit on data of a new shape), as replica 0 saw it.
struct TrainingTimes {
  std::int64_t steps = 0;
  double step_seconds = 0;         // whole steps, wall time
  double reduce_wait_seconds = 0;  // after backward, waiting for the gradient all-reduce: the part
                                   // of it that overlapping with backward did not hide
  double apply_seconds = 0;        // optimizer and layer updates after the reduction
};

// What the training steps communicated over the same span as TrainingTimes (since the model's
// trainer was made; zeros before the first fit). Bytes follow collective/communicator.h's
// convention (CommunicationStats: what each rank sends and receives under the ring algorithm).
struct TrainingStats {
  std::int64_t steps = 0;  // training steps in the span (training_times().steps)
  int replicas = 1;        // this worker's replicas, whose communicators `communication` adds up
  // Every collective of this worker's replicas on the strategy's group (Strategy::communicator(r),
  // N = num_replicas_in_sync), added up over the replicas, per op: the gradient buckets, with the
  // layers' moving statistics (and across workers the step's log sums) in the last one, and
  // anything else the group did in the span. Nothing for one replica on one worker (no group to exchange through).
  // GPU steps replayed as CUDA graphs (README, "CUDA graphs") queue their all-reduce once, when
  // recorded, and count only then: compile with {.cuda_graphs = false} for every step's bytes.
  collective::CommunicationStats communication;
  // Multi-worker strategies: this worker's own traffic to the other workers
  // (Strategy::cross_worker_stats(), N = the number of workers). Nothing on one worker.
  collective::CommunicationStats cross_worker;
  // Tensor parallelism (keras::distribution::ModelParallel's model axis): the layers' collectives
  // in the groups along that axis, added up over this worker's replicas (Megatron's f and g: a
  // column/row Dense pair all-reduces its (local batch x width) activation once forward and once
  // backward). Nothing without tensor parallelism.
  collective::CommunicationStats tensor_parallel;
  // Pipelines: the stages' sends and receives (a micro-batch's boundary activation forward, its
  // gradient back: 2 m transfers per boundary and step), added up over this worker's replicas.
  collective::CommunicationStats pipeline;

  // Averages per training step (0 before the first step): the bytes every replica of this
  // worker sent (received) together in `communication`, and what one replica sent.
  double bytes_sent_per_step() const;
  double bytes_received_per_step() const;
  double bytes_sent_per_replica_step() const;
};

struct PredictOptions {
  std::int64_t batch_size = 32;  // predict(x) only
  int verbose = 0;
  std::optional<std::int64_t> steps;
  std::vector<CallbackPtr> callbacks;
};

struct ExportOptions {
  std::string format = "onnx";  // the only one: Keras 3 also writes "tf_saved_model"
};

// An element of Sequential's list: a layer, or an Input first.
class SequentialItem {
 public:
  SequentialItem(Layer layer) : layer_(std::move(layer)) {}        // NOLINT
  SequentialItem(KerasTensor input) : input_(std::move(input)) {}  // NOLINT
  const Layer& layer() const { return layer_; }
  const KerasTensor& input() const { return input_; }

 private:
  Layer layer_;
  KerasTensor input_;
};

namespace detail {
struct ModelState;
}

class Model {
 public:
  Model() = default;  // an empty handle
  Model(std::vector<KerasTensor> inputs, std::vector<KerasTensor> outputs, std::string name = "");
  Model(KerasTensor input, KerasTensor output, std::string name = "");

  bool defined() const { return state_ != nullptr; }
  const std::string& name() const;
  const std::vector<KerasTensor>& inputs() const;
  const std::vector<KerasTensor>& outputs() const;
  // Layers in the order they run (a Sequential's own order).
  std::vector<Layer> layers() const;
  Layer get_layer(std::string_view name) const;  // NotFound listing the layer names
  // A Sequential given no Input builds when first called with data, or here.
  void build(const Shape& input_shape);
  bool built() const;

  void compile(OptimizerRef optimizer, LossList loss, std::vector<MetricRef> metrics = {}, CompileOptions options = {});
  bool compiled() const;

  History fit(const data::Dataset& data, const FitOptions& options = {});
  History fit(const Tensor& x, const Tensor& y, const FitOptions& options = {});
  // Returns the loss and metrics ("loss", "accuracy", ...) over the data.
  Logs evaluate(const data::Dataset& data, const EvaluateOptions& options = {});
  Logs evaluate(const Tensor& x, const Tensor& y, const EvaluateOptions& options = {});
  // The model's outputs for every example, concatenated over the batches (host tensors). The data's
  // elements are (x) or (x, y, ...); only x is used.
  Tensor predict(const data::Dataset& data, const PredictOptions& options = {});
  Tensor predict(const Tensor& x, const PredictOptions& options = {});
  std::vector<Tensor> predict_outputs(const data::Dataset& data, const PredictOptions& options = {});
  // Time per phase of the training steps so far (zeros before the first fit).
  TrainingTimes training_times() const;
  // Calls and bytes of the collectives over the same span (TrainingStats).
  TrainingStats training_stats() const;

  // Keras's table: Layer (type), Output Shape, Param #; then total, trainable and
  // non-trainable parameter counts.
  std::string summary_string(int line_length = 65) const;
  void summary() const;  // prints summary_string() to standard output

  std::vector<VariablePtr> weights() const;
  std::vector<VariablePtr> trainable_weights() const;
  std::vector<VariablePtr> non_trainable_weights() const;
  std::int64_t count_params() const;
  std::vector<Tensor> get_weights() const;              // host copies, weights() order
  void set_weights(const std::vector<Tensor>& values);  // checks count, dtypes and shapes first

  // Weights in the safetensors format, named "<layer>/<weight>" ("dense/kernel"), with a
  // checksum. load_weights matches by name, or by structure when the names differ only by
  // auto-generated numbering (saving.h), checks every tensor first and changes nothing on a
  // mismatch.
  void save_weights(const std::string& path) const;
  void load_weights(const std::string& path);

  // Keras 3's model.export(path, format="onnx") (export is a C++ keyword): the inference graph,
  // as predict runs it, written as an ONNX model (opset 17, a dynamic batch dimension, the
  // weights' current values) that ONNX's checker accepts; written atomically. Inputs and outputs
  // keep predict's layouts (NHWC images) and dtypes (float32 outputs under a mixed policy).
  // Throws Unimplemented naming the node (and so its layer) for an op without an ONNX form,
  // InvalidArgument for another format, FailedPrecondition for a model not built.
  void export_model(const std::string& path, const ExportOptions& options = {}) const;

  Optimizer& optimizer() const;  // FailedPrecondition before compile()
  strategy::Strategy& distribute_strategy() const;
  // Set by a callback to end fit() after the current batch (Keras's model.stop_training).
  bool stop_training() const;
  void set_stop_training(bool stop);

  const std::shared_ptr<detail::ModelState>& state() const { return state_; }

 private:
  friend Model Sequential(std::vector<SequentialItem> items, std::string name);
  std::shared_ptr<detail::ModelState> state_;
};

// A linear stack of layers. With an Input first the model is built at once; otherwise it builds
// on the first data it sees (or model.build(shape)).
Model Sequential(std::vector<SequentialItem> items, std::string name = "");

}  // namespace tandem::keras
