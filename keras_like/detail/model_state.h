// tandem/keras_like/detail/model_state.h — what a Model handle points to, and its trainer.
#pragma once

#include <map>
#include <memory>
#include <optional>
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

// What one replica's step adds to the running means of an epoch.
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
  bool cuda_graphs = true;  // CompileOptions::cuda_graphs
  bool stop_training = false;
  // Where fit continues from, set by BackupAndRestore in on_train_begin: the epoch, and the
  // batches of it already trained (0: the epoch from its start).
  struct ResumePoint {
    int epoch = 0;
    std::int64_t step = 0;
  };
  std::optional<ResumePoint> resume;
  std::unique_ptr<Trainer> trainer;
  // Model::training_stats() counts from this: the communicators' stats when the trainer was made.
  struct StatsBaseline {
    std::vector<const collective::Communicator*> group;  // the strategy's group then
    collective::CommunicationStats communication, cross_worker, tensor_parallel, pipeline;
  };
  StatsBaseline stats_baseline;

  ModelState();
  ~ModelState();
};

enum class Phase { kTrain, kTest };

// Graph values of layer calls' outputs (and model inputs), by call.
using LayerValues = std::map<const LayerNode*, std::vector<Output>>;
// Adds the model's layer calls [first, end) (indices into model.nodes) to ctx's graph, reading
// their inputs from `values` and adding their outputs there.
void run_layer_calls(ModelState& model, CallContext& ctx, LayerValues& values, std::size_t first, std::size_t end);
// The loss and metric sums of one pass over the model's outputs against `targets`: `total` (the
// weighted loss, summed over the examples) and the fetches [total, output losses (several outputs
// only)..., metric sums...] that StepSums reads.
struct StepSumOutputs {
  Output total;
  std::vector<Output> fetches;
};
StepSumOutputs step_sum_outputs(ModelState& model, Graph& graph, const std::vector<Output>& outputs,
                                const std::vector<Output>& targets, std::string_view scope_name);

// Builds and runs the model's graph: one graph with the training pass (loss, metrics, gradients,
// layer updates) and the inference pass (evaluate, predict), instantiated once per replica of the
// model's strategy. A training step splits the global batch across the replicas, runs them in
// parallel, has the strategy's gradient reducer communicate the gradients, and applies the
// optimizer on every replica.
class Trainer {
 public:
  // element_spec: the data's components: the inputs, then (when training or evaluating) the targets.
  Trainer(ModelState& model, const std::vector<graph::TensorSpec>& element_spec, bool with_targets);
  ~Trainer();
  // Whether this trainer's graph takes data of this spec.
  bool accepts(const std::vector<graph::TensorSpec>& element_spec, bool with_targets) const;

  // One optimisation step on this worker's share of a global batch of `global_examples` rows
  // (inputs then targets; on one worker the whole batch); updates the weights and adds to the
  // training metrics (summed across workers: every worker's logs are the global ones).
  // The batch's replica_shards are used when it was staged on the devices.
  void train_step(const strategy::Strategy::WorkerBatch& batch);
  // Adds one batch (this worker's share) to the test metrics, summed across workers.
  void test_step(const strategy::Strategy::WorkerBatch& batch);
  // The model's outputs for a batch, replicas' shards concatenated in order (host tensors).
  std::vector<Tensor> predict_step(const data::Element& batch);

  // Metric state: SyncOnReadVariables per replica, summed when read.
  void reset_metrics(Phase phase);
  // "loss", "<output>_loss", metric names; prefixed ("val_").
  void write_logs(Phase phase, Logs& logs, std::string_view prefix = "") const;
  // Checks that every mirrored weight's copies are still equal (FailedPrecondition otherwise).
  void check_replicas_agree() const;
  TrainingTimes times() const;

 private:
  struct Graphs;
  struct Replica;
  struct Metrics;
  // The batch's shard for each replica: the staged ones, or split_batch's views of `local`.
  std::vector<data::Element> shards_of(const strategy::Strategy::WorkerBatch& batch) const;
  // whole_step: the step runs as one piece of device work (runs_whole_step; every replica alike).
  // rider: the batch's WorkerBatch::rider values, carried with the step's sums when they ride.
  // borrowed: `shard` is one row lent by another replica to a replica without examples (ZeRO stage
  // 3, lend_rows): it runs for the parameter gathers only and counts as no examples.
  void run_replica_step(int replica, const data::Element& shard, std::int64_t global_examples, bool update,
                        bool whole_step, std::span<const double> rider, bool borrowed = false);
  // ZeRO stage 3: every replica must take part in every parameter gather, so a replica whose
  // shard is empty (a last batch smaller than the replica count) gets one row of another
  // replica's shard to run on. Returns, per replica, whether its shard was replaced so.
  std::vector<bool> lend_rows(std::vector<data::Element>& shards) const;
  // Adds each replica's step sums to `metrics`: as they are on one worker; on several, gathered
  // from every worker first (each replica in sync keeps its own part).
  void add_step_sums(Metrics& metrics, std::vector<StepSums>& per_replica);
  // Whether replica r's training step runs as one piece of device work (see trainer.cc).
  bool runs_whole_step(int r) const;
  // Sets options.tail (and its addresses) to queue the step's all-reduce and update after backward.
  void whole_step_work(Replica& replica, graph::RunOptions& options);
  // The step's fetched scalars [loss, output losses..., metrics...].
  std::vector<double> read_step_scalars(Replica& replica, std::span<const Tensor> fetched);

  // Pipelines (keras::distribution::ModelParallel with a stage axis; pipeline_trainer.cc): each
  // local replica runs its stage's graphs (one per model chunk) under a strategy::PipelineRunner
  // per pipeline, instead of the whole graph.
  struct Pipeline;
  // Returns the number of step sums its last stages fetch.
  std::size_t build_pipeline();
  void count_step(double seconds);
  void pipeline_add_sums(Phase phase, std::vector<StepSums>& per_replica);
  void pipeline_train_step(const strategy::Strategy::WorkerBatch& batch);
  void pipeline_test_step(const strategy::Strategy::WorkerBatch& batch);
  std::vector<Tensor> pipeline_predict_step(const data::Element& batch);
  std::shared_ptr<Pipeline> pipeline_;  // shared: its deleter is made where Pipeline is complete

  ModelState& model_;
  std::vector<graph::TensorSpec> element_spec_;
  bool with_targets_;
  std::unique_ptr<Graphs> graphs_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<Metrics> train_metrics_, test_metrics_;
  // TANDEM_PROFILE: replica 0's kernel calls and seconds in evaluation and prediction runs, by op,
  // which its executor's profile counts too; the report of training steps leaves them out.
  std::map<std::string, std::pair<std::int64_t, double>> untrained_profile_;
  // Runs replica r's executor; for replica 0 under TANDEM_PROFILE, counts its kernels as untrained.
  std::vector<Tensor> run_untrained(int r, const std::vector<graph::Feed>& feeds, const std::vector<Output>& fetches);
};

}  // namespace tandem::keras::detail
