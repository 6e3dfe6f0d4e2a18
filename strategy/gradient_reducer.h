// tandem/strategy/gradient_reducer.h — a training step's gradient communication, owned by the
// strategy (PyTorch DDP's Reducer; the cross-replica aggregation of tf.distribute's
// optimizer.apply_gradients).
//
// Who calls: the Keras trainer behind fit(), and custom training loops over the graph API, from
// inside Strategy::run: every replica makes the same calls, in the same order, on its own thread.
// One step of replica r:
//
//   reducer.begin_step(r, StepKind::kReduce);           // or kAccumulate: a micro-step
//   auto out = executor[r].run(feeds, fetches, {.observer = reducer.observer(r)});
//   auto grads = reducer.finish_step(r);                // summed over every replica in sync
//   ... apply grads to replica r's copies (the same update on every replica) ...
//
// While the executor runs backward, the observer files each finished gradient into its bucket;
// a bucket whose gradients are all done goes to the replica's communication thread and is
// all-reduced while backward goes on. finish_step waits for those and reduces the rest.
//
// Buckets: the gradients in reverse order of their variables (backward produces the last layer's
// first), the first bucket up to DistributionOptions::first_bucket_bytes (small, so that
// communication starts early), the others up to bucket_bytes; a gradient larger than a bucket gets
// one of its own. Every replica reduces the buckets in one order: by the graph node that completes
// each, so that the collectives match on every rank.
//
// What each variable's gradient needs comes from the strategy (Strategy::variable_plan): an
// all-reduce (data parallelism), a reduce-scatter (ZeRO stages 1 and 2, below) or nothing (a
// variable each replica keeps to itself). This is the
// extension point of the strategies that split variables: a strategy answers per variable, and
// the trainer, which only drives this class, does not change.
//
// ZeRO (DistributionOptions::zero k1, k2, k3): a bucket of reduce-scattered gradients is
// reduce-scattered in one call by ranges (Communicator::reduce_scatter_ranges: each gradient,
// flattened, split into ShardSpec's shards), so that each replica receives the sums of its shards
// only, in its range of each gradient's own buffer (the executor's arena, which holds backward's
// full gradients during the run in any case); finish_step returns, for those variables, 1-D
// gradient shards [shard_elements] (views of those ranges; a zero-padded copy for a shard cut
// short by the variable's end), which the optimizer applies to the replica's range of the
// variable. The replicas' updated ranges are then exchanged by gather_updated, one
// all_gather_ranges per bucket on the variables' own buffers, so that every copy is whole again.
// The in-process group reads and writes the ranges where they are: no packed buffer, no copy
// back, no allocation in the steady state; other backends pack one bucket's worth for the call.
// The sums are formed in the same order as the all-reduce of the same communicator (the
// in-process group adds ranks in rank order for both), so results are bitwise those of unsharded
// data parallelism. Stage 2 differs in memory only: with a communication thread, the executor
// hands over the gradients of every reduce-scattered bucket but the last (hand_offs); after a
// bucket's reduce-scatter the replica's shard is copied into a buffer of the reducer's own, and
// the executor reuses the whole gradients' memory once the next bucket is complete.
//
// ZeRO stage 3 (k3): the weights themselves are sharded variables; the executor gathers each into
// its arena before the steps that read it (bind_gathered_variable, graph::VariableGatherer),
// through this reducer, on the replica's communication thread in order with the buckets.
//
// Throws: from the step calls, what the collectives throw (DeadlineExceeded naming the operation
// and the missing ranks; Unavailable once Strategy::run has aborted a failed step's collectives);
// from the constructor, InvalidArgument naming the variable when a gradient does not match it or
// is read by other nodes of its graph (make_gradients_reducible explains).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/graph/tensor.h"
#include "tandem/strategy/variable.h"

namespace tandem::strategy {

class Strategy;

// One trainable variable and the graph value backward computes as its gradient.
struct GradientSource {
  std::shared_ptr<Variable> variable;
  graph::Output gradient;
  // The variable's node in the same graph (what forward and backward read), for an update during
  // backward (GradientReducerOptions::update), which must wait until no node reads it any more;
  // undefined: the variable is updated after the step.
  graph::Output value = {};
};

// How a variable's gradient is communicated (Strategy::variable_plan answers per variable).
struct VariablePlan {
  enum class Reduction {
    kAllReduce,  // summed over every replica in sync, in buckets (data parallelism)
    kNone,       // not communicated: the replica's own gradient (a variable only it holds)
    // Reduce-scattered (ZeRO): each replica gets the sum of its shard (Strategy::zero_shard_spec:
    // over the data shards), updates that range of its copy, and gather_updated makes copies whole.
    kReduceScatter,
  };
  Reduction reduction = Reduction::kAllReduce;
};

// A reduce step communicates. An accumulation micro-step (Keras 3's gradient_accumulation_steps,
// DDP's no_sync) does not: its gradients are added to the accumulators, and the next reduce step
// adds the accumulated sums to its own gradients before reducing them.
enum class StepKind { kReduce, kAccumulate };

struct GradientReducerOptions {
  // One variable per gradient (same dtype and shape), holding the sum of the micro-steps since
  // the last reduce step; empty: no accumulation. Whoever applies the update clears them (Keras's
  // optimizer keeps them as slots, so that checkpoints carry them).
  std::vector<std::shared_ptr<Variable>> accumulators;
  // ZeRO stages 2 and 3 (handed-off gradients, hand_offs()): updates replica's shard of variable
  // `gradient` (the optimizer's apply_variable) as soon as the sum of that shard is there and no
  // node of backward reads the variable any more, from inside the executor's release of the whole
  // gradient, on replica's thread: no shard of such a gradient outlives its bucket (as PyTorch's
  // optimizer-in-backward does; the ZeRO paper counts the shards as held to the step's end).
  // finish_step then returns an undefined tensor for it. Empty, or a variable whose
  // GradientSource::value is undefined or still read after its release: its shard is kept and
  // returned as before.
  std::function<void(int replica, std::size_t gradient, const Tensor& shard)> update;
};

class GradientReducer {
 public:
  // gradients: every trainable variable's, in the order their variables were created. Buckets are
  // planned here, once; communication threads start with the first step that needs them.
  GradientReducer(Strategy& strategy, std::vector<GradientSource> gradients, GradientReducerOptions options = {});
  virtual ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  Strategy& strategy() const { return strategy_; }
  std::size_t num_gradients() const { return sources_.size(); }
  // Gradient indices per bucket, in the order every replica reduces the buckets.
  std::vector<std::vector<std::size_t>> buckets() const;
  // Buckets replica handed to its communication thread while its backward was still running,
  // since the reducer was made: the overlap the bucketing bought (0 without overlap, or with one
  // bucket: the last bucket is always reduced after backward).
  std::int64_t overlapped_buckets(int replica);

  // --- one replica's step: replica's own thread, inside Strategy::run -------------------------
  // Starts replica's step. Waits first for anything a failed earlier step left on the replica's
  // communication thread (its collectives were aborted, so this is quick).
  virtual void begin_step(int replica, StepKind kind);
  // Pass to Executor::run as RunOptions::observer for the run that computes the gradients.
  graph::NodeObserver* observer(int replica);
  // Instead of a run: replica had no examples this step (a last batch smaller than the replica
  // count). Its gradients are zeros, and it still takes part in every collective.
  virtual void set_zero_gradients(int replica);
  // Sums `extras` (tensors of extra_dtype() on replica's device, any shapes) over the replicas in
  // sync inside the step's last bucket collective, in place: no collective of their own (the
  // step's log sums of a multi-worker step and the layers' moving statistics ride along, so that a
  // step costs one round of communication). Call after begin_step, every replica alike; the sums
  // are in the tensors after finish_step. Returns false, and does nothing, when the step reduces
  // no bucket (a micro-step, no gradients). With a compressed all-reduce
  // (gradient_all_reduce_dtype) they go in one call of their own, after the bucket's: they stay
  // exact.
  virtual bool sum_with_last_bucket(int replica, std::span<const Tensor> extras);
  // The dtype of the last bucket (float32 when there are no gradients).
  DType extra_dtype() const;
  // Waits for the buckets handed over during backward, reduces the others, and returns replica's
  // gradients: on a reduce step summed over the replicas in sync (accumulated micro-steps
  // included); on a micro-step its own, after adding them to the accumulators. The tensors are
  // the run's outputs, reduced in place: valid until replica's next begin_step. Keep no copy of
  // them past the step: while a view of its arena is held, the executor's next run moves to a
  // fresh arena (an allocation and its page faults every step). A reduce-scattered variable's
  // gradient is its 1-D shard [shard_elements] of the sum (a view of the same arena), on reduce
  // steps only; undefined where GradientReducerOptions::update has applied it already.
  virtual std::span<const Tensor> finish_step(int replica);
  // After the optimizer has updated replica's range of each reduce-scattered variable (a reduce
  // step): all-gathers those ranges so that replica's copies are whole and equal to every other
  // replica's, one all_gather per bucket. Every replica calls it, after finish_step; a no-op when
  // no variable is reduce-scattered.
  virtual void gather_updated(int replica);
  // ZeRO stage 3: binds the sharded parameter `variable` to its graph node `node` on replica's
  // executor as a gathered variable (graph::VariableGatherer): the executor asks for its whole
  // value before the steps that read it, and this reducer all-gathers it from the replicas'
  // shards, on replica's communication thread (in order with the gradient buckets, and ahead of
  // need: the executor prefetches one window) or, without one, at once. Call once per variable
  // and replica, before the executor's first run. InvalidArgument for a variable that is whole.
  void bind_gathered_variable(int replica, graph::Executor& executor, graph::Output node,
                              std::shared_ptr<Variable> variable);
  // ZeRO stages 2 and 3 (with a communication thread): the gradients the executor may hand over
  // instead of keeping them whole to the end of the run (graph::HandOff, RunOptions::hand_offs),
  // when the run fetches gradient k as fetch first_fetch + k: every gradient of a
  // reduce-scattered bucket but the last, released once the next bucket is complete. finish_step
  // then returns their shards from buffers of the reducer's own ([shard_elements] each: 1/N of
  // the gradients), or with GradientReducerOptions::update none (the shards were applied at the
  // release), and the whole gradients' memory serves the rest of backward. Empty otherwise.
  std::vector<graph::HandOff> hand_offs(int first_fetch) const;

  // --- device-side steps (a GPU replica's whole step recorded as one CUDA graph) --------------
  // Whether replica's reduction can be queued on its device with no host decision: one worker,
  // no compression, no accumulation, no reduce-scattered variable (ZeRO's packing, shard update
  // and all-gather run on the host path), and a communicator that queues on the device (or no
  // other replica to reduce with).
  virtual bool reduces_on_device(int replica);
  // Queues the all-reduce of `gradients` (the run's gradient values, as finish_step would return
  // them) after the work on replica's compute stream, and returns without waiting. Every replica
  // in sync makes the same call. Only when reduces_on_device(replica).
  virtual void queue_reduction_on_device(int replica, std::span<Tensor> gradients);

  // --- other per-step synchronisation ----------------------------------------------------------
  // Replaces each of `values` (on replica's device) by its sum over the replicas in sync of
  // weight x value: with weights that add up to 1, a weighted mean (the layers' moving
  // statistics, weighted by each replica's share of the batch). One collective when the values
  // share a dtype. Every replica calls it, in the same order.
  virtual void weighted_sum_across_replicas(int replica, std::span<Tensor> values, double weight);
  // The same, riding in the step's last bucket collective as sum_with_last_bucket's tensors do:
  // scales them now; the sums are in them after finish_step.
  // Returns false, and does nothing (not even the scaling), when the step reduces no bucket or a
  // value's dtype is not extra_dtype(): call weighted_sum_across_replicas then.
  virtual bool weighted_sum_with_last_bucket(int replica, std::span<Tensor> values, double weight);

 protected:
  struct ReplicaState;
  ReplicaState& state(int replica);
  // One bucket's collective on replica's thread or its communication thread.
  void reduce_bucket(int replica, std::size_t bucket);

 private:
  struct Plan;
  class Observer;
  class Gatherer;
  void reduce_compressed(int replica, std::size_t bucket, std::span<Tensor> grads, DType wire);
  void reduce_scatter_bucket(int replica, std::size_t bucket, std::span<Tensor> extras);
  void release_gradient(int replica, std::size_t gradient);
  // Replica's shard of gradient k's sum, after its bucket's reduce-scatter: a view of its range
  // of the whole gradient, or a zero-padded copy where the variable's end cuts the range short.
  Tensor shard_of_sum(int replica, std::size_t k);
  // GradientReducerOptions::update of gradient k's reduced shard (a reduce step).
  void update_in_backward(int replica, std::size_t k);

  Strategy& strategy_;
  std::vector<GradientSource> sources_;
  GradientReducerOptions options_;
  std::unique_ptr<Plan> plan_;
  std::vector<std::unique_ptr<ReplicaState>> replicas_;
};

// Prepares backward's gradients for in-place reduction while backward goes on: a gradient that
// another node of the graph still reads (or a view of another value) is replaced by a copy in a
// buffer of its own, since all-reducing it in place would change what that node reads. Call on
// the gradients graph::gradients returned, before making executors of the graph.
void make_gradients_reducible(graph::Graph& graph, std::span<graph::Output> gradients);

}  // namespace tandem::strategy
