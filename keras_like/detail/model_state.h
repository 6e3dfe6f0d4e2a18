// tandem/keras_like/detail/model_state.h — what a Model handle points to, and its trainer.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/data/dataset.h"
#include "tandem/graph/executor.h"
#include "tandem/keras_like/model.h"

namespace tandem::keras::detail {

// One output's compiled loss and metrics.
struct CompiledOutput {
  LossSpec loss;
  double loss_weight = 1.0;
  std::string name;  // the output layer's name (prefixes logs of multi-output models)
  std::vector<std::pair<MetricSpec, std::string>> metrics;
};

// Sums one step adds to the running means of an epoch (all replicas together).
struct StepSums {
  double loss = 0;                  // total loss summed over the examples (not scaled)
  std::vector<double> output_loss;  // per output, for models with several
  std::vector<double> metrics;      // per (output, metric), in compile order
  std::int64_t examples = 0;
};

class Trainer;

struct ModelState {
  std::string name;
  bool sequential = false;
  std::vector<Layer> pending_layers;  // a Sequential given no Input: built on first data
  std::vector<KerasTensor> inputs, outputs;
  std::vector<std::shared_ptr<LayerNode>> nodes;  // layer calls in run order
  std::vector<Layer> layers;                      // distinct layers in run order
  strategy::Strategy* strategy = nullptr;         // whose scope made the model

  bool compiled = false;
  std::unique_ptr<Optimizer> optimizer;
  std::vector<CompiledOutput> compiled_outputs;
  bool stop_training = false;
  std::unique_ptr<Trainer> trainer;

  ModelState();
  ~ModelState();
};

// Builds and runs the model's graph: one graph with the training pass (loss, metrics, gradients,
// layer updates) and the inference pass (evaluate, predict), instantiated once per replica.
class Trainer {
 public:
  // element_spec: the data's components: the inputs, then (when training or evaluating) the targets.
  Trainer(ModelState& model, const std::vector<graph::TensorSpec>& element_spec, bool with_targets);
  ~Trainer();
  // Whether this trainer's graph takes data of this spec.
  bool accepts(const std::vector<graph::TensorSpec>& element_spec, bool with_targets) const;

  // One optimisation step on a batch (inputs then targets); updates the weights.
  StepSums train_step(const data::Element& batch);
  StepSums test_step(const data::Element& batch);
  std::vector<Tensor> predict_step(const data::Element& batch);

 private:
  struct Graphs;
  const std::vector<graph::Feed>& feeds(const data::Element& batch, bool with_targets);
  StepSums read_sums(const std::vector<Tensor>& fetched) const;

  ModelState& model_;
  std::vector<graph::TensorSpec> element_spec_;
  bool with_targets_;
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace tandem::keras::detail
