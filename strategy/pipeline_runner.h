// tandem/strategy/pipeline_runner.h — runs a model cut into pipeline stages, one graph per device
// (per model chunk under interleaving), over micro-batches in the order a schedule
// (pipeline_schedule.h: GPipe, 1F1B, interleaved 1F1B) gives, passing activations forward and
// their gradients back with the communicator's point-to-point send and recv.
//
// Each stage is a graph on its own device (PipelineStage below): it reads the activation its
// predecessor sent (or, on the first stage, the micro-batch's data), computes its layers and
// sends its output on; the last stage computes the loss. Under interleaved 1F1B each device holds
// v graphs, its model chunks: chunk c of device d is virtual stage c·p + d, so the model runs
// through devices 0..p-1 v times. Backward runs the stage's graph again
// with the gradient of its output fed (graph::gradients with grad_ys): the forward is recomputed
// there (GPipe's re-materialisation), so what a stage keeps from a micro-batch's forward to its
// backward is only the activation it received (its "stash"). Gradients are summed over the
// micro-batches; the caller applies them (its optimizer), as after GradientReducer::finish_step.
// The loss a last stage computes should be the micro-batch's share of the global batch's loss
// (its rows' losses summed times 1 / global rows), so that the summed gradients are the global
// batch's and the step's loss is the sum of the micro-batches' losses.
//
// Who calls: one thread, step() once per training step; step() runs every device on a thread of
// its own (stage 0 on the caller's) and returns when all are done.
// What blocks: step(), until every stage has run its list; a transfer waits for the neighbour up
// to CallOptions' timeout.
// After a failed step the group is aborted: make a new runner over a new group to go on.
// What throws: the constructor, InvalidArgument for stages that do not chain (a missing input,
// output, loss or gradient, a communicator of another size or rank); step(), InvalidArgument for
// micro-batches of the wrong count. A stage whose action fails aborts the group, so the others
// stop promptly (Unavailable), and step() rethrows the first failure, of its own type, prefixed
// with "pipeline stage S, micro-batch M, <action>: ".
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/devices/device.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/strategy/pipeline_schedule.h"

namespace tandem::strategy {

struct PipelineStage {
  // The stage's number in the pipeline (its device's rank in the pipeline group); -1: its position
  // in the list the runner is given. A runner may hold some stages only (one process per stage:
  // each runner its own), numbered so.
  int index = -1;
  // Interleaved 1F1B: which of its device's model chunks this graph is (virtual stage
  // chunk x stages + index); 0 otherwise.
  int chunk = 0;
  std::shared_ptr<const graph::Graph> graph;
  devices::Device* device = nullptr;
  // Placeholders fed from the micro-batch's components: {placeholder, component index}.
  std::vector<std::pair<graph::Output, int>> data;
  graph::Output input;                   // the received activation's placeholder; undefined on stage 0
  graph::Output output;                  // the activation sent on; undefined on the last stage
  graph::Output loss;                    // the last stage's scalar loss; undefined elsewhere
  graph::Output output_gradient;         // placeholder for d loss / d output; undefined on the last stage
  graph::Output input_gradient;          // d loss / d input; undefined on stage 0
  std::vector<graph::Output> variables;  // Variable nodes, bound to `values`
  std::vector<Tensor> values;
  std::vector<graph::Output> gradients;  // d loss / d each variable
  // The last stage's: fetched with its loss in each micro-batch's forward (the step's loss and
  // metric sums, a prediction's outputs), returned per micro-batch (PipelineStepResult::fetched).
  std::vector<graph::Output> fetches;

  // Fills gradients and input_gradient from the rest: the last stage differentiates its loss,
  // the others their output seeded with output_gradient.
  void add_gradients();
};

struct PipelineRunnerOptions {
  collective::CallOptions transfers;  // each send and recv's timeout
  // Called before each action on its stage's thread (tests inject failures; a profiler times).
  std::function<void(int stage, const PipelineAction& action)> before_action;
  // Evaluation and prediction: each micro-batch's forward and its activations' transfers only, in
  // the schedule's order. Stages need no gradients then; the last stage a loss or fetches.
  bool forward_only = false;
};

// Per stage: in the order of the runner's stages (its local ones; chunks are stages too).
struct PipelineStepResult {
  bool has_loss = false;                       // whether the runner holds the last stage
  std::vector<double> losses;                  // per micro-batch, from the last stage (0 without it)
  std::vector<std::vector<Tensor>> fetched;    // per micro-batch, the last stage's fetches (empty without it)
  std::vector<std::vector<Tensor>> gradients;  // per stage, per variable: summed over micro-batches
  std::vector<int> peak_stashed;               // per stage, the most micro-batches between forward and backward
  std::vector<double> forward_seconds, backward_seconds;  // per stage, summed over micro-batches
  double loss() const;                                    // the sum over micro-batches
};

class PipelineRunner {
 public:
  // `stages`: every stage of the pipeline, or some (PipelineStage::index), in increasing order of
  // (index, chunk), each device's v = config.virtual_stages chunks together; config.stages counts
  // the devices. communicators[k] is the k-th device's (of the distinct indices, in order): rank
  // index of one group of config.stages ranks.
  PipelineRunner(std::vector<PipelineStage> stages, PipelineConfig config,
                 std::vector<collective::Communicator*> communicators, PipelineRunnerOptions options = {});
  ~PipelineRunner();

  // One step over `microbatches` (config.microbatches of them, each the data components that
  // PipelineStage::data index). Throws as the top of this file says.
  PipelineStepResult step(const std::vector<std::vector<Tensor>>& microbatches);

  const PipelinePlan& plan() const { return plan_; }
  std::vector<PipelineStage>& stages() { return stages_; }

 private:
  // One device's stages: its rank, its chunks' positions in stages_, its communicator.
  struct Device {
    int index = 0;
    std::vector<std::size_t> chunks;
    collective::Communicator* communicator = nullptr;
  };
  void run_device(const Device& device, const std::vector<std::vector<Tensor>>& microbatches,
                  PipelineStepResult& result);

  std::vector<PipelineStage> stages_;
  std::vector<Device> devices_;
  PipelineConfig config_;
  PipelinePlan plan_;
  std::vector<collective::Communicator*> communicators_;
  PipelineRunnerOptions options_;
  std::vector<std::unique_ptr<graph::Executor>> executors_;
};

}  // namespace tandem::strategy
