// tandem/strategy/strategy.h — where replicas run and how they agree (tf.distribute).
//
// A Strategy owns a set of replica devices. Under `auto scope = strategy.scope();`, variables
// (Keras weights, optimizer slots, metric state) are created through it, one copy per replica.
// Changing one line — the strategy — moves a model from one device to many:
//
//   tandem::OneDeviceStrategy strategy("CPU:0");       // or: tandem::MirroredStrategy strategy;
//   { auto scope = strategy.scope(); model = keras::Sequential({...}); model.compile(...); }
//   model.fit(dataset, {.epochs = 10});
//
// With no scope active, get_strategy() is the global strategy (set_global_strategy, Keras's
// set_distribution) when one is set, else the default strategy: one replica on the default device.
#pragma once

#include <chrono>
#include <functional>
#include <span>
#include <mutex>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/data/dataset.h"
#include "tandem/devices/device.h"
#include "tandem/strategy/cross_device_ops.h"
#include "tandem/strategy/gradient_reducer.h"
#include "tandem/strategy/variable.h"

namespace tandem::strategy {

using collective::ReduceOp;

class Strategy;

// ZeRO's stages of sharded data parallelism (arXiv:1910.02054; DeepSpeed's zero_optimization.stage,
// FSDP's sharding strategies): what the replicas in sync split among themselves (ShardSpec)
// instead of each keeping a whole copy. k0: nothing (plain data parallelism); k1: optimizer
// slots; k2: slots and gradients; k3: slots, gradients and parameters.
enum class ZeroStage { k0 = 0, k1 = 1, k2 = 2, k3 = 3 };

// How a strategy's replicas exchange gradients during fit (the DDP reducer's knobs).
enum class FetchToDevice { kAuto, kNever, kAlways };
inline constexpr int kDefaultDevicePrefetchBatches = 2;

struct DistributionOptions {
  // Gradients are packed into buckets in reverse layer order; each bucket is all-reduced as soon
  // as its last gradient is computed. The first bucket is small so that communication starts
  // early (PyTorch DDP's defaults).
  std::int64_t first_bucket_bytes = std::int64_t{1} << 20;
  std::int64_t bucket_bytes = std::int64_t{25} << 20;
  // All-reduce buckets on a communication thread while backward goes on (true), or all of them
  // after backward (false). Unset (the default): Strategy::overlaps_communication() decides, on
  // unless that thread could only take cores from the replicas' own work.
  std::optional<bool> overlap_communication;
  std::chrono::milliseconds collective_timeout = collective::kDefaultTimeout;
  // The dtype gradients travel in. Unset (the default): their own dtype, float32 under the mixed
  // policies. kBF16 or kF16 (a mixed policy's compute dtype) halves the bytes on the wire, like
  // PyTorch DDP's bf16/fp16_compress_hook: each replica rounds its gradients to 16 bits, the sum
  // is formed in 16 bits, and every replica widens the result back before the optimizer.
  // Gradients that must stay exact (float64) are never compressed.
  std::optional<graph::DType> gradient_all_reduce_dtype;
  // Input batches copied to the replicas' devices ahead of the step that uses them (TF's
  // InputOptions.experimental_fetch_to_device, PyTorch's pin_memory + non_blocking copies): a
  // staging thread splits each batch into replica shards, packs them into page-locked memory and
  // queues their host-to-device copies on each device's input stream while the current step
  // computes. kAuto stages for devices the host cannot address (GPUs); kAlways on every device
  // (on CPUs a copy the step could have skipped, for testing); kNever feeds host tensors, copied
  // when the step starts.
  FetchToDevice fetch_to_device = FetchToDevice::kAuto;
  // Batches staged ahead of the one being trained on (each holds a copy of the batch in pinned
  // host memory and on every replica device).
  int device_prefetch_batches = kDefaultDevicePrefetchBatches;
  // Sharded data parallelism (ZeroStage): each replica keeps and updates 1/N of the state the
  // stage names, reduce-scattering gradients and all-gathering the updated weights.
  ZeroStage zero = ZeroStage::k0;
  // Stages 2 and 3: reduce-scattered gradients are bucketed up to the smaller of this and
  // bucket_bytes (DeepSpeed's reduce_bucket_size). A bucket's whole gradients stay in memory
  // until it is reduced and the next one is complete, so smaller buckets hold less; a gradient
  // larger than a bucket gets one of its own.
  std::int64_t reduce_bucket_bytes = std::int64_t{4} << 20;
};

// What a function run by Strategy::run sees: which replica it is, and collective operations
// across the replicas in sync.
class ReplicaContext {
 public:
  ReplicaContext(Strategy& strategy, int replica_id) : strategy_(strategy), replica_id_(replica_id) {}
  Strategy& strategy() const { return strategy_; }
  int replica_id_in_sync_group() const { return replica_id_; }
  int num_replicas_in_sync() const;
  devices::Device& device() const;
  // Combines `value` across the replicas in sync and returns the result (each replica calls it;
  // it blocks until all have, or the strategy's collective timeout passes).
  Tensor all_reduce(ReduceOp op, const Tensor& value);
  collective::Communicator& communicator() const;

 private:
  Strategy& strategy_;
  int replica_id_;
};

class Strategy {
 public:
  virtual ~Strategy();  // joins the replica threads
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // Makes this the current strategy of the calling thread until the guard ends. Entering the
  // scope of a second strategy inside another's raises FailedPrecondition naming both (TF does
  // the same); re-entering the same strategy nests.
  class [[nodiscard]] Scope {
   public:
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    friend class Strategy;
    explicit Scope(Strategy& strategy);
  };
  Scope scope();

  // "OneDeviceStrategy#1 (CPU:0)": how errors name it.
  const std::string& name() const { return name_; }
  // Replicas taking part in each step, across all workers.
  virtual int num_replicas_in_sync() const { return static_cast<int>(devices_.size()); }
  // This worker's replica devices, in replica order.
  const std::vector<devices::Device*>& replica_devices() const { return devices_; }

  // A variable with one copy per replica device, each initialised to options.initial_value: a
  // MirroredVariable, or a SyncOnReadVariable when options.synchronization is kOnRead. With
  // options.sharded under DistributionOptions::zero >= k1, a sharded MirroredVariable instead:
  // each copy is its replica's shard of the value (ShardSpec::even over num_replicas_in_sync()).
  std::shared_ptr<Variable> create_variable(VariableOptions options);
  // The index among all replicas in sync (across workers) of local replica `replica`: the shard
  // it holds of a sharded variable, and its rank in the replicas' communicator.
  int global_replica_index(int replica) const { return worker_rank() * static_cast<int>(devices_.size()) + replica; }

  // Calls fn once per local replica with its ReplicaContext: replica 0 on the calling thread, the
  // others on the strategy's replica threads, in parallel. Blocks until all have returned. When a
  // replica throws, the strategy aborts its collectives, so that replicas waiting for it fail at
  // once instead of waiting for their timeout, and the first error is rethrown here.
  void run(const std::function<void(ReplicaContext&)>& fn);
  // Combines one tensor per local replica (host result).
  Tensor reduce(ReduceOp op, const std::vector<Tensor>& per_replica) const;
  // Whether this worker writes checkpoints and logs (the chief; always true on one worker).
  virtual bool should_checkpoint() const { return true; }
  // Whether this worker prints progress (the chief, unless asked otherwise).
  virtual bool should_log() const { return true; }

  // --- workers (processes) of a multi-worker job; one worker for the other strategies ---------
  virtual int num_workers() const { return 1; }
  virtual int worker_rank() const { return 0; }
  // Workers of this job running on this machine, this one included: they share its cores.
  virtual int workers_on_this_machine() const { return 1; }
  // Replaces each value by its sum over the workers. Who calls: every worker, the same calls in
  // the same order, from the thread that runs fit; blocks until all have called (or the
  // collective timeout). A no-op on one worker.
  virtual void sum_across_workers(std::span<double> /*values*/) {}
  // Replaces each host tensor by the chief's. Same rules as sum_across_workers.
  virtual void broadcast_from_chief(std::span<Tensor> /*host_values*/) {}
  // Checks that every worker is about to do the same thing: `what` ("fit") and `facts`, pairs of
  // a name and its value in words ({"steps per epoch", "235"}), are compared with the chief's;
  // a difference is InvalidArgument on every worker naming the fact, both workers and both
  // values, before any step runs (workers that disagree would otherwise meet in different
  // collectives much later). Same rules as sum_across_workers; a no-op on one worker.
  virtual void check_workers_agree(std::string_view /*what*/,
                                   const std::vector<std::pair<std::string, std::string>>& /*facts*/) {}
  // What this worker's communicators to the other workers have done (collective/communicator.h's
  // CommunicationStats, N = the number of workers): MultiWorkerMirroredStrategy's gradient and
  // control communicators added up. Nothing on one worker. Any thread may call it.
  virtual collective::CommunicationStats cross_worker_stats() { return {}; }
  // What this worker's replicas did in tensor-parallel groups (the layers' collectives of
  // keras::distribution::ModelParallel's model axis), added up; nothing for other strategies.
  virtual collective::CommunicationStats tensor_parallel_stats() { return {}; }
  // The same for pipelines' point-to-point transfers (activations forward, their gradients back).
  virtual collective::CommunicationStats pipeline_stats() { return {}; }

  // Values the workers sum across workers before the step after this one (the FILE and OFF
  // policies' agreement on the next batch: its rows, whether every worker has one), which a
  // training step carries in its gradients' last collective when it can, so that the agreement
  // costs no collective of its own. The trainer adds this worker's `values` to what it sums there
  // and, once the step is done, puts the sums over the workers in `values` and sets `summed`;
  // otherwise (no bucket to ride in: a micro-step, evaluation) the iterator sums them itself. The
  // same on every worker: whether a step carries them depends on the step and the model only.
  struct StepRider {
    std::vector<double> values;
    bool summed = false;
  };

  // One worker's share of each global batch, and the global batch's size (what the loss is
  // scaled by). Returned by iterate_for_worker.
  struct WorkerBatch {
    data::Element local;               // this worker's rows, split again among its replicas
    std::int64_t global_examples = 0;  // rows of the global batch, across every worker
    // When the batch was fetched to the devices (DistributionOptions::fetch_to_device): `local`
    // split as split_batch splits it, each shard already on its replica's device, ready for the
    // replica's compute stream (which waits for the copy). Empty otherwise.
    std::vector<data::Element> replica_shards;
    // Keeps the staging buffers of replica_shards; when the last copy of the batch goes, they are
    // reused for a later batch once each device has finished the work queued so far. Drop a
    // batch after queueing the step that reads it.
    std::shared_ptr<const void> staging;
    // What the training step on this batch may carry for the iterator (above); null: nothing.
    std::shared_ptr<StepRider> rider;
  };
  class WorkerIterator {
   public:
    virtual ~WorkerIterator() = default;
    // nullopt at the end (every worker ends at the same step); blocks like data::Iterator::next.
    virtual std::optional<WorkerBatch> next() = 0;
    // Skips n global batches (a resumed run); returns how many were skipped.
    virtual std::int64_t skip(std::int64_t n);
  };
  // A pass over `dataset` whose elements are global batches, as fit and evaluate see it: on one
  // worker each element whole; under MultiWorkerMirroredStrategy this worker's share; fetched to
  // the replicas' devices ahead of use as DistributionOptions::fetch_to_device asks. Callers: the
  // thread that runs the steps; next() blocks until a batch is ready.
  std::unique_ptr<WorkerIterator> iterate_for_worker(const data::Dataset& dataset,
                                                     const data::IterateOptions& options) const;
  // Whether iterate_for_worker stages batches on the devices (fetch_to_device resolved).
  bool fetches_to_device() const;

  // --- how training communicates (the strategy's part of a step; see gradient_reducer.h) -------
  // How `variable`'s gradient is communicated during training. Data-parallel strategies (these)
  // all-reduce every gradient; under DistributionOptions::zero >= k1 they reduce-scatter the
  // gradients of trainable (unsharded) variables, each replica updating its shard and the
  // reducer all-gathering the results (GradientReducer::gather_updated); a strategy that splits
  // variables answers per variable.
  virtual VariablePlan variable_plan(const Variable& variable) const;
  // How ZeRO shards `variable`'s gradient, slots and update when variable_plan reduce-scatters
  // it: ShardSpec::even of its graph_shape() (a tensor-parallel piece, a stage's weight) over the
  // data shards (data_shards_in_sync, shard data_shard(r)); unset otherwise. The reducer, the
  // optimizer and the pipeline trainer all take it from here.
  std::optional<ShardSpec> zero_shard_spec(const Variable& variable) const;
  // Checks that the copies of every variable this strategy replicates are still bit-identical
  // (every replica applied the same updates); FailedPrecondition naming the first that differs.
  // Variables whose gradients are not reduced (variable_plan) keep per-replica values, and
  // sharded variables hold different shards: skipped.
  virtual void check_replicas_agree(std::span<const std::shared_ptr<Variable>> variables) const;
  // The gradient reducer for one training graph (fit() makes one per model graph; a custom loop
  // makes its own). A strategy with another way of communicating returns a subclass.
  virtual std::unique_ptr<GradientReducer> make_gradient_reducer(std::vector<GradientSource> gradients,
                                                                 GradientReducerOptions options = {});

  // The group communicator of one replica (created on first use with the cross-device ops).
  collective::Communicator& communicator(int replica);
  const CrossDeviceOps& cross_device_ops() const { return *cross_device_ops_; }
  const DistributionOptions& distribution_options() const { return distribution_; }
  // Whether the gradient reducer hands each completed bucket to a communication thread while
  // backward goes on: DistributionOptions::overlap_communication when set, always false with one
  // replica in sync. Unset, it is on unless the thread could only compete with the replicas for
  // cores: CPU replicas whose intra-op threads, over every worker on this machine, already take
  // every usable core, and gradients that stay on this machine (in process, shared memory or
  // loopback), so that the collective is CPU work rather than a wait. There, reducing after
  // backward measured as fast or faster (bench_fit --strategy mirrored). ZeRO stages 2 and 3 keep
  // the thread: stage 2's hand-offs of reduced gradients and stage 3's gather prefetch run on it.
  bool overlaps_communication() const;

  // Splits a global batch into one shard per local replica along dimension 0, as evenly as
  // possible (the first replicas get one more example; some may get none). Views, not copies.
  // Replicas that share a data shard (data_shard below: tensor parallelism) get the same rows.
  std::vector<data::Element> split_batch(const data::Element& global_batch) const;

  // --- data shards: which rows each replica computes on -----------------------------------------
  // Data-parallel strategies give every replica its own rows. A strategy whose replicas compute
  // together on the same rows (tensor parallelism: keras::distribution::ModelParallel's model
  // axis) says so here; the trainer then feeds them the same rows, draws the same random streams
  // for them, and counts their logged sums once. ZeRO shards state over the same shards: replica
  // r keeps shard data_shard(r) of each sharded slot, gradient or weight (of its piece, for a
  // tensor-parallel one), its communicator being the group of those shards.
  // The distinct shards of each global batch, across every worker.
  virtual int data_shards_in_sync() const { return num_replicas_in_sync(); }
  // The global index of local replica `replica`'s shard; the local replicas' shards form a
  // consecutive range.
  virtual int data_shard(int replica) const { return global_replica_index(replica); }
  // Whether local replica `replica` is the first replica in sync (across workers) of its shard:
  // the one whose logged sums count, and which writes a whole variable's ZeRO shard.
  virtual bool leads_data_shard(int /*replica*/) const { return true; }
  // The number of distinct shards among the local replicas, and the first of them (they are
  // consecutive).
  int local_data_shards() const;
  int first_local_data_shard() const;
  // Whether the gradient communicators (communicator()) span every worker, so that values riding
  // in their collectives reach every worker. False when tensor parallelism spans the workers and
  // each data-parallel group stays on one.
  virtual bool gradient_group_spans_workers() const { return true; }
  // Each element of `dataset` (a global batch) as one shard per replica: TF's
  // experimental_distribute_dataset. next() of the returned iterator yields split_batch(element).
  class DistributedIterator {
   public:
    DistributedIterator(const Strategy& strategy, std::unique_ptr<data::Iterator> it)
        : strategy_(strategy), iterator_(std::move(it)) {}
    std::optional<std::vector<data::Element>> next();

   private:
    const Strategy& strategy_;
    std::unique_ptr<data::Iterator> iterator_;
  };
  DistributedIterator experimental_distribute_dataset(const data::Dataset& dataset) const;

 protected:
  // Called by create_variable before the copies are made: a multi-worker strategy checks that
  // every worker creates the same variable and broadcasts the chief's initial value.
  virtual void agree_on_variable(VariableOptions& /*options*/) {}
  // The replicas' gradient communicators, one per local replica in replica order (communicator()
  // returns them): by default one group of every replica made by the cross-device ops; a strategy
  // whose gradients are summed over groups of replicas (ModelParallel: the replicas along the
  // batch axis) makes those groups. Called under the group lock, again after an abort.
  virtual std::vector<std::unique_ptr<collective::Communicator>> make_replica_group();
  // Called when a failed replica aborts the group: a strategy with communicators of its own
  // (tensor-parallel groups) aborts them too, so that replicas waiting in them fail at once.
  virtual void abort_other_collectives(const std::string& /*reason*/) {}
  // Makes the group again with make_replica_group(), keeping the old one alive: for a subclass
  // whose override needs state its constructor sets up after a base constructor made the default
  // group (MultiWorkerMirroredStrategy connects its group at construction). Every worker calls it
  // at the same point.
  void remake_replica_group();
  // This worker's batches in host memory, before any staging (iterate_for_worker's source).
  virtual std::unique_ptr<WorkerIterator> worker_batches(const data::Dataset& dataset,
                                                         const data::IterateOptions& options) const;
  // `cross_device_ops` null = chosen for the devices as TensorFlow does (choose_cross_device_ops).
  Strategy(std::string kind, std::vector<devices::Device*> devices,
           std::shared_ptr<CrossDeviceOps> cross_device_ops = nullptr, DistributionOptions distribution = {});

 private:
  struct ReplicaThreads;
  void abort_collectives(const std::string& reason);
  std::shared_ptr<Variable> create_sharded_variable(VariableOptions options);

  std::string name_;
  std::vector<devices::Device*> devices_;
  std::shared_ptr<CrossDeviceOps> cross_device_ops_;
  DistributionOptions distribution_;
  std::mutex group_mutex_;
  std::vector<std::unique_ptr<collective::Communicator>> group_;
  bool group_aborted_ = false;
  // Groups replaced after an abort stay alive: a communication thread of the failed step may
  // still be returning from one of their (aborted) calls.
  std::vector<std::vector<std::unique_ptr<collective::Communicator>>> retired_groups_;
  std::unique_ptr<ReplicaThreads> threads_;
};

// The strategy of the innermost active scope on this thread, else the global strategy when one is
// set, else the default strategy.
Strategy& get_strategy();
// Makes `strategy` what get_strategy() returns on every thread where no scope is active (Keras's
// keras.distribution.set_distribution); nullptr restores the default strategy. The caller keeps
// it alive while it is set. has_strategy() still answers for scopes only.
void set_global_strategy(Strategy* strategy);
Strategy* global_strategy();  // null when none is set
// True when a strategy scope is active on this thread.
bool has_strategy();
// One replica on the default device (CPU:0), used when no scope is active.
Strategy& default_strategy();

// MirroredStrategy's devices (MirroredOptions::devices): these names, or its default when empty.
// Throws as devices::get_device does, InvalidArgument for a device listed twice.
std::vector<devices::Device*> mirrored_devices(const std::vector<std::string>& names);

// One replica on one device.
class OneDeviceStrategy final : public Strategy {
 public:
  // device: any accepted device name ("CPU:0", "/device:GPU:0"); InvalidArgument / NotFound as
  // devices::get_device raises.
  explicit OneDeviceStrategy(std::string_view device);
};

struct MirroredOptions {
  // Device names; default: every GPU (when this build has GPU kernels), or else every logical CPU
  // device. Without GPUs, a strategy made before the first device (tensor, graph, strategy) splits
  // the CPU into one logical device per usable core (at most devices::kMaxDefaultCpuDevices, each
  // with its share of the cores), unless set_logical_device_configuration or
  // TANDEM_NUM_CPU_DEVICES chose a layout; made later, it takes the CPU devices there are.
  std::vector<std::string> devices;
  // Default: chosen as TF does (NCCL when all devices are GPUs, else the in-process reduction).
  std::shared_ptr<CrossDeviceOps> cross_device_ops;
  DistributionOptions distribution;
};

// Synchronous data parallelism over the local devices: one replica per device, each running the
// model on its shard of every global batch; gradients are summed across replicas and every
// replica applies the same update to its own copy of each variable.
class MirroredStrategy final : public Strategy {
 public:
  explicit MirroredStrategy(MirroredOptions options = {});
  explicit MirroredStrategy(std::vector<std::string> devices);
};

}  // namespace tandem::strategy

namespace tandem {
using strategy::MirroredStrategy;
using strategy::OneDeviceStrategy;
using strategy::Strategy;
}  // namespace tandem
