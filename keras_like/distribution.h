// tandem/keras_like/distribution.h — Keras 3's keras.distribution in C++: DeviceMesh, TensorLayout,
// LayoutMap, DataParallel, ModelParallel, set_distribution / distribution(), and plan(): what a
// distribution will put on each device and send each step, computed before anything is allocated.
//
// Who calls it: user code in place of a strategy. Each distribution IS a Strategy (a
// MultiWorkerMirroredStrategy under another name), so compile, fit, callbacks and tandem-run work
// unchanged, in one process or many:
//
//   namespace kd = tandem::keras::distribution;
//   kd::DataParallel dp(kd::DeviceMesh({2}, {"batch"}, {"CPU:0", "CPU:1"}), {.zero = kd::ZeroStage::k1});
//   kd::set_distribution(dp);            // or: auto scope = dp.scope();
//   auto model = keras::Sequential({...});
//   model.compile("adam", ...);
//   kd::print_plan(model, std::cout);    // before the first step
//   model.fit(data.batch(64));
//
// Devices: in one process a mesh names local devices ("CPU:0", "GPU:1"); list_devices() gives
// MirroredStrategy's default (every GPU, else every logical CPU device). In a job of several
// workers (resolve_cluster() finds num_workers > 1) a mesh holds every worker's devices, worker-major,
// each named with the worker's rank as its task: "/job:worker/replica:0/task:1/device:CPU:0" (rank
// 1's CPU:0, whatever the cluster spec calls the task); every worker lists the same mesh and trains
// on its own task's devices, and every worker must hold as many.
//
// What throws: InvalidArgument for a malformed mesh, layout or layout map (the message names the
// key, axis, variable or device), for a path that matches two LayoutMap keys; Unimplemented for
// what ModelParallel cannot do yet (see ModelParallel);
// FailedPrecondition for plan() of a model that is not built. Construction of a distribution blocks like MultiWorkerMirroredStrategy's.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/keras_like/model.h"
#include "tandem/keras_like/optimizers.h"
#include "tandem/strategy/multi_worker.h"
#include "tandem/strategy/pipeline_schedule.h"
#include "tandem/strategy/strategy.h"
#include "tandem/strategy/tensor_parallel.h"

namespace tandem::keras::distribution {

using strategy::DistributionOptions;
using strategy::ZeroStage;

// Keras's DEFAULT_BATCH_DIM_NAME: the axis DataParallel makes from a device list.
inline constexpr const char* kDefaultBatchDimName = "batch";

// The devices a distribution may use (Keras's list_devices): one process, MirroredStrategy's
// default devices ("GPU:0", ... else "CPU:0", ...); several workers, every worker's default
// devices by their global names (see the top of this file). type "cpu" or "gpu" picks a kind of
// local device; "" the default. May create the local devices (as MirroredStrategy does).
std::vector<std::string> list_devices(std::string_view type = "");

// Keras's DeviceMesh: devices arranged in a grid whose axes have names.
class DeviceMesh {
 public:
  // devices empty: list_devices(). InvalidArgument when shape or axis_names is empty, their
  // lengths differ, a dimension is below 1, a name repeats, a device repeats, or the shape's
  // product differs from the number of devices.
  DeviceMesh(std::vector<std::int64_t> shape, std::vector<std::string> axis_names,
             std::vector<std::string> devices = {});

  const std::vector<std::int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  // Row-major: the last axis varies fastest.
  const std::vector<std::string>& devices() const { return devices_; }
  // The devices along `axis`; InvalidArgument naming the axis and the mesh's axes when unknown.
  std::int64_t axis_size(std::string_view axis) const;
  bool has_axis(std::string_view axis) const;
  std::string to_string() const;  // "DeviceMesh(shape=[2], axis_names=[batch])"

 private:
  std::vector<std::int64_t> shape_;
  std::vector<std::string> axis_names_;
  std::vector<std::string> devices_;
};

// Keras's TensorLayout: per dimension of a tensor, the mesh axis it is split over, or nullopt
// (replicated along that dimension). InvalidArgument when an axis appears twice, and when bound
// to a mesh (LayoutMap) that lacks one of its axes.
class TensorLayout {
 public:
  TensorLayout(std::vector<std::optional<std::string>> axes);  // NOLINT: layout_map[k] = {std::nullopt, "model"}
  TensorLayout(std::initializer_list<std::optional<std::string>> axes)  // NOLINT
      : TensorLayout(std::vector<std::optional<std::string>>(axes)) {}
  TensorLayout(std::vector<std::optional<std::string>> axes, const DeviceMesh& mesh);

  const std::vector<std::optional<std::string>>& axes() const { return axes_; }
  const std::optional<DeviceMesh>& device_mesh() const { return mesh_; }
  // Binds the layout to `mesh`, checking its axes (above).
  void bind(const DeviceMesh& mesh);
  // The number of pieces the tensor is split into (the product of the named axes' sizes); 1 when
  // every dimension is replicated or no mesh is bound.
  std::int64_t num_shards() const;
  std::string to_string() const;  // "[None, 'model']"

 private:
  std::vector<std::optional<std::string>> axes_;
  std::optional<DeviceMesh> mesh_;
};

// Keras's LayoutMap: variable paths ("dense/kernel") to layouts. A key is an exact path, or a
// regular expression (std::regex, ECMAScript) matched against the whole path (".*dense.*kernel").
// Lookup: the exact key first; else every key as a regular expression matched in full; two
// matching keys is InvalidArgument naming both and the path. (Keras 3 searches with re.search;
// here a key must match the whole path, so "kernel" does not match "dense/kernel".)
class LayoutMap {
 public:
  explicit LayoutMap(DeviceMesh mesh) : mesh_(std::move(mesh)) {}

  // Megatron-LM's tensor-parallel layouts over `axis`, chosen per model when the model is known
  // (resolve(), at compile and in plan()): each MultiHeadAttention split over heads; Dense layers
  // paired, the first of a pair column-parallel and the next row-parallel when it follows with
  // only Activation and Dropout layers between (an MLP's or a transformer block's feed-forward:
  // one all-reduce forward, one backward); a Dense left without a partner, and every other layer,
  // whole. Layers a custom layer tracks are visited in tracking order. Keys inserted into this map
  // take precedence over the automatic choice. A layer whose dimension does not divide by the
  // axis's size is kept whole (resolve() names it in its `notes`).
  static LayoutMap megatron(DeviceMesh mesh, std::string axis = "model");
  const std::optional<std::string>& megatron_axis() const { return megatron_axis_; }
  // This map with the automatic choices made for `model` as exact-path keys (itself when it is
  // not a megatron() map). `notes` (optional) receives one line per layer kept whole that could
  // have been split.
  LayoutMap resolve(const Model& model, std::vector<std::string>* notes = nullptr) const;

  // layout_map["dense/kernel"] = TensorLayout({std::nullopt, "model"});
  class Entry {
   public:
    // Inserts the layout bound to the map's mesh. InvalidArgument when the key is already there
    // (as Keras) or is not a regular expression, and as TensorLayout::bind.
    Entry& operator=(TensorLayout layout);

   private:
    friend class LayoutMap;
    Entry(LayoutMap& map, std::string key) : map_(map), key_(std::move(key)) {}
    LayoutMap& map_;
    std::string key_;
  };
  Entry operator[](std::string key) { return Entry(*this, std::move(key)); }
  void insert(std::string key, TensorLayout layout);

  // The layout for `path`, or nullopt when no key matches.
  std::optional<TensorLayout> get(std::string_view path) const;
  // The key get() would use for `path`, or nullopt.
  std::optional<std::string> matching_key(std::string_view path) const;
  std::vector<std::string> keys() const;  // in insertion order
  std::size_t size() const { return entries_.size(); }
  const DeviceMesh& device_mesh() const { return mesh_; }

 private:
  struct Item {
    std::string key;
    std::regex pattern;
    TensorLayout layout;
  };
  const Item* find(std::string_view path) const;
  DeviceMesh mesh_;
  std::vector<Item> entries_;
  std::optional<std::string> megatron_axis_;
};

// --- layout checks --------------------------------------------------------------------------------

// One variable's layout as check_layouts() accepted it.
struct VariableLayout {
  std::string path;        // "dense/kernel"
  Shape shape;             // the whole variable's
  std::string layer;       // "Dense \"dense\"" (how errors name it)
  std::string key;         // the LayoutMap key that matched; empty when none
  std::string split;       // the layer's TensorParallelSplit ("column"); empty when the variable is whole
  int split_dim = -1;      // the dimension split; -1 when whole
  std::string axis;        // the mesh axis it is split over; empty when whole
  std::int64_t parts = 1;  // the devices along `axis`
};

// Checks a layout map against a built model, strictly, the way ModelParallel does at compile:
// every split is over one mesh axis other than `batch_dim_name`, along a dimension that the axis's
// size divides; a layer's layouts form exactly one of its TensorParallelSplits (a layer with none
// keeps every weight whole); with `strict`, every key of the map matches a variable (otherwise an
// unmatched key is logged as a warning). A layout whose rank differs from its variable's is
// refused too. Returns every variable's accepted layout, in model.weights() order. Throws
// InvalidArgument naming the variable, its shape, the key, the axis and its size, or the layer
// and the splits it supports; FailedPrecondition when the model is not built.
std::vector<VariableLayout> check_layouts(const Model& model, const LayoutMap& layout_map,
                                          std::string_view batch_dim_name, bool strict = true);

// --- pipelines ------------------------------------------------------------------------------------

// A pipeline over a mesh axis: the model's layer calls cut into consecutive stages, one per device
// along the axis, run over micro-batches in a schedule's order (strategy/pipeline_schedule.h).
struct PipelineOptions {
  std::string stage_axis = "stage";  // the mesh axis the stages run along
  int stages = 0;                    // 0: the stage axis's size
  int microbatches = 0;              // 0: as many as stages
  strategy::PipelineSchedule schedule = strategy::PipelineSchedule::k1F1B;
  int virtual_stages = 1;  // model chunks per stage (interleaved 1F1B)
  // The names of the layers that start stages 1, 2, ... (stages - 1 of them, in model order);
  // empty: stage k starts at the first boundary at or past k/stages of the parameter bytes.
  std::vector<std::string> cuts;
};

// One stage as cut_into_stages() places it.
struct PlannedStage {
  std::string first_layer, last_layer;
  int layer_calls = 0;
  std::int64_t parameter_bytes = 0;
  // The one tensor the stage sends on (its spec, batch unknown); unset on the last stage.
  std::optional<graph::TensorSpec> boundary;
};

// The model's layer calls, in run order, cut into `stages` stages: at `cuts` or balanced by
// parameter bytes (PipelineOptions::cuts). A boundary must be crossed by exactly one tensor (a
// residual connection across it is refused). InvalidArgument naming the layer: a cut that is not
// a layer of the model, cuts out of order or of the wrong count, a boundary that several tensors
// cross, or more stages than layer calls.
std::vector<PlannedStage> cut_into_stages(const Model& model, int stages, const std::vector<std::string>& cuts = {});

// --- plan(): memory and communication per device, from the formulas ---------------------------

// One variable as the plan places it. Bytes are per device.
struct PlannedVariable {
  std::string path;
  Shape shape;
  graph::DType dtype = graph::DType::kF32;
  bool trainable = true;
  std::string layout;  // "replicated", "sharded 1/4: 25 elements, 3 padding", a LayoutMap layout
  std::string layout_key;  // the LayoutMap key that matched; empty when none
  int shards = 1;
  std::int64_t shard_elements = 0;  // elements per device (the whole tensor when replicated)
  std::int64_t padding = 0;         // zeros added so that every shard is as long
  std::int64_t weight_bytes = 0, gradient_bytes = 0, slot_bytes = 0;
};

// Bytes per device, from the ZeRO paper's accounting (arXiv:1910.02054) as tandem builds it:
// weights, gradients and optimizer slots; `gathered` is stage 3's working set: the largest
// layer's weights, gathered whole for its forward and backward. Gradients count as shards at
// stages 2 and 3; the whole gradients in flight during backward (the buckets not yet reduced)
// live in the executor's arena with the activations and are not counted. One departure from the
// paper, what the allocator measures: the gradient accumulator stays whole at every stage.
struct PlannedMemory {
  std::int64_t weights = 0, gradients = 0, slots = 0, gathered = 0;
  std::int64_t total() const { return weights + gradients + slots + gathered; }
};

// One kind of collective a training step issues (on update steps, under gradient accumulation),
// with the bytes each device sends under the bandwidth-optimal ring algorithm (nccl-tests' bus
// bandwidth convention, what the communicators count): all_reduce 2(N-1)/N of the buffer,
// reduce_scatter (N-1)/N of its input, all_gather (N-1)/N of its output.
// Tensor parallelism's collectives (per_row) move activations, so their bytes are per row of the
// local batch (an example; a position of a sequence), over the devices of the layer's axis.
struct PlannedCollective {
  std::string op;    // "all_reduce", "reduce_scatter", "all_gather"
  std::string what;  // "gradients", "updated weights", "weights before forward", ...
  double bytes_per_device = 0;
  bool per_row = false;
};

struct Plan {
  std::string model;
  std::string strategy;  // the strategy's name
  int replicas = 1;      // N: the data-parallel replicas in sync
  ZeroStage zero = ZeroStage::k0;
  std::string optimizer;  // "adam"; "none (not compiled)" when there is none
  int slots_per_variable = 0;  // slot_names(); + 1 under gradient accumulation (the accumulator)
  std::vector<PlannedVariable> variables;
  PlannedMemory memory;                      // at this stage
  std::array<PlannedMemory, 4> memory_by_stage;  // k0..k3 at the same N, for comparison
  std::vector<PlannedCollective> collectives;
  double communication_bytes_per_device = 0;       // the sum over `collectives` per step
  double communication_bytes_per_row = 0;          // the sum over the per-row ones (tensor parallelism)
  std::int64_t local_rows = 0;                     // PlanOptions::batch_rows / replicas (0: not given)
  std::vector<std::string> unmatched_layout_keys;  // LayoutMap keys that matched no variable
  std::vector<std::string> layout_notes;           // LayoutMap::megatron's layers kept whole
  // Set for a pipeline: its schedule, stages, the simulated schedule table (unit forward and
  // backward times) and predicted bubble; the transfers are in `collectives` (per_row).
  struct Pipeline {
    strategy::PipelineConfig config;
    std::vector<PlannedStage> stages;
    double predicted_bubble = 0;
    std::string table;
  };
  std::optional<Pipeline> pipeline;
  std::string to_string() const;
};

struct PlanOptions {
  // Default: the model's strategy's num_replicas_in_sync() and distribution_options().zero.
  std::optional<int> replicas;
  std::optional<ZeroStage> zero;
  // Default: the compiled model's optimizer; none (no slots) before compile.
  std::optional<OptimizerRef> optimizer;
  // Default: the model's strategy's, when it is a ModelParallel.
  const LayoutMap* layout_map = nullptr;
  // Default: the ModelParallel's (its stage axis's size as the stage count).
  std::optional<PipelineOptions> pipeline;
  // Rows of one global batch (examples, times positions for sequences): the per-row collectives
  // are then also totalled per step, over each replica's share of them. 0: per row only.
  std::int64_t batch_rows = 0;
};

// The plan of a built model (its variables exist; a Sequential without an Input needs build()
// first: FailedPrecondition). Allocates nothing: slots are counted from the optimizer's type.
Plan plan(const Model& model, const PlanOptions& options = {});
void print_plan(const Model& model, std::ostream& out, const PlanOptions& options = {});

// --- distributions ------------------------------------------------------------------------------

// Keras's Distribution: a Strategy over a mesh. Destroying the global distribution unsets it.
class Distribution : public strategy::MultiWorkerMirroredStrategy {
 public:
  ~Distribution() override;
  const DeviceMesh& device_mesh() const { return mesh_; }
  // The mesh axis the batch (and the replicas) run along.
  const std::string& batch_dim_name() const { return batch_dim_name_; }
  // Keras's get_variable_layout: the layout a variable of this path and rank gets.
  virtual TensorLayout get_variable_layout(std::string_view path, int rank) const;
  // plan(model) under this distribution's replicas, stage and layout map.
  Plan plan(const Model& model) const;

 protected:
  Distribution(std::string kind, DeviceMesh mesh, std::string batch_dim_name, strategy::MultiWorkerOptions options);

 private:
  DeviceMesh mesh_;
  std::string batch_dim_name_;
};

// The multi-worker side of a distribution (blank fields: MultiWorkerMirroredStrategy's defaults).
struct WorkerOptions {
  strategy::CommunicationOptions communication_options;
  std::shared_ptr<strategy::ClusterResolver> cluster_resolver;  // default: resolve_cluster()
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  bool log_on_all_workers = false;
};

struct DataParallelOptions {
  // ZeRO's stage (DistributionOptions::zero; leave that one at k0, or equal).
  ZeroStage zero = ZeroStage::k0;
  DistributionOptions distribution;
  // Keras's auto_shard_dataset: each worker trains on its rows of every global batch (false:
  // every worker on its own pipeline's batches, AutoShardPolicy::kOff).
  bool auto_shard_dataset = true;
  WorkerOptions workers;
};

// Keras's DataParallel: the batch split over the mesh's first axis, every variable replicated
// (or sharded among the replicas under ZeRO stages 1-3). One process: MirroredStrategy over the
// mesh's devices (bitwise the same training); several: MultiWorkerMirroredStrategy over each
// worker's devices of the mesh. A mesh whose other axes hold more than one device is
// InvalidArgument (the same shard would be computed on each).
class DataParallel final : public Distribution {
 public:
  explicit DataParallel(DataParallelOptions options = {});  // a 1-D mesh of list_devices()
  explicit DataParallel(DeviceMesh mesh, DataParallelOptions options = {});
  explicit DataParallel(std::vector<std::string> devices, DataParallelOptions options = {});
};

struct ModelParallelOptions {
  std::string batch_dim_name;  // default: the mesh's first axis
  // Pipeline parallelism over a mesh axis. Default: none, unless the mesh has an axis named
  // "stage" of several devices (then PipelineOptions' defaults).
  std::optional<PipelineOptions> pipeline;
  // A layout map key that matches no variable of the model is an error at compile (a typo in a
  // regular expression would otherwise leave a layer whole until memory runs out); false: a
  // warning.
  bool strict = true;
  DistributionOptions distribution;
  WorkerOptions workers;
};

// Keras's ModelParallel. At construction: Unimplemented for a layout that splits variables over
// the batch axis (that is ZeRO stage 3: DataParallel with .zero = k3). At compile, and again
// before the first step of fit, evaluate or predict when the model was built later
// (check_model): the layouts are checked against the model (check_layouts, strict unless the
// options say otherwise), and a mesh axis of several devices other than the batch axis must split
// some variable (else InvalidArgument: each device along it would compute the same rows), except
// the pipeline's stage axis, whose cuts and schedule are checked (cut_into_stages,
// validate_pipeline_config). Layouts that pass and split variables then train with tensor
// parallelism (Megatron-LM's column- and row-parallel layers; the groups' collectives in the
// replicas' graphs), and a stage axis of several devices trains as a pipeline (the stages'
// graphs under a strategy::PipelineRunner per pipeline, each stage's variables on its devices
// only), either or both combined with data parallelism over the batch axis, in one process or
// across workers. What is not built is Unimplemented there, naming it, before anything changes:
// ZeRO stages with either, GPU replicas, clipping by norm or loss scaling, a pipeline over layers
// with moving statistics or a layer used by two stages. A variable whose layout has another rank
// than its shape is InvalidArgument at its creation.
class ModelParallel final : public Distribution {
 public:
  explicit ModelParallel(LayoutMap layout_map, ModelParallelOptions options = {});
  ~ModelParallel() override;
  const LayoutMap& layout_map() const { return layout_map_; }
  bool strict() const { return strict_; }
  // The pipeline the options (or a "stage" axis) ask for, its stage count filled in.
  const std::optional<PipelineOptions>& pipeline() const { return pipeline_; }
  TensorLayout get_variable_layout(std::string_view path, int rank) const override;
  // The checks above, for a built model (Model::compile and the first step call it); then, when
  // the layouts split variables, the model is prepared for tensor parallelism (below).
  void check_model(const Model& model) const;

  // Replicas: every device of the mesh (this worker's, in mesh order). Replicas with the same
  // coordinate on the batch axis compute on the same rows (one data shard each); the gradients
  // are summed over the replicas along the batch axis only (the other coordinates fixed).
  int data_shards_in_sync() const override;
  int data_shard(int replica) const override;
  bool leads_data_shard(int replica) const override;
  bool gradient_group_spans_workers() const override { return gradients_span_workers_; }
  // Pipelines (a stage axis of several devices): local replica `replica`'s stage (its coordinate
  // on the stage axis), and its communicator in the group of its pipeline's stages (rank = stage),
  // through which the activations and their gradients pass. Null without a pipeline.
  int pipeline_stage(int replica) const;
  // The pipeline local replica `replica` belongs to (its coordinates but the stage's, as one
  // number), and whether that pipeline's sums count for its data shard (its coordinates on the
  // axes other than the batch and stage axes are 0: one pipeline per data shard counts).
  int pipeline_of(int replica) const;
  bool leads_pipeline(int replica) const;
  collective::Communicator* pipeline_communicator(int replica) const;
  // The model's layer calls cut into the pipeline's virtual stages (stages x virtual_stages), as
  // check_model cut them last; empty before.
  const std::vector<PlannedStage>& planned_stages() const { return planned_stages_; }
  collective::CommunicationStats tensor_parallel_stats() override;
  collective::CommunicationStats pipeline_stats() override;

 protected:
  void agree_on_variable(strategy::VariableOptions& options) override;
  std::vector<std::unique_ptr<collective::Communicator>> make_replica_group() override;
  void abort_other_collectives(const std::string& reason) override;

 private:
  // Tensor parallelism, once check_model has accepted layouts that split variables over the model
  // axis (one mesh axis other than the batch and stage axes): each split variable's copies become
  // their replicas' pieces (Variable::split_into_pieces; optimizer slots follow at compile), and
  // each split layer's call is told its split and whether a partner takes or gives its split
  // activation (LayerImpl::set_tensor_parallel_call). Unimplemented, naming what, for what is
  // not built: a split layer other than Dense, a model axis across workers, with ZeRO, on GPUs.
  // `home` (pipelines): each variable's stage; the pieces of a split variable then live on that
  // stage's replicas only.
  void prepare_tensor_parallel(const Model& model, const std::vector<VariableLayout>& layouts,
                               const std::map<const Variable*, int>* home = nullptr) const;
  // Pipelines, once check_model has accepted the cut: each variable placed on the replicas of the
  // stage whose layers use it (Variable::split_into_pieces with one piece: the others hold
  // nothing; a tensor-split variable's pieces on that stage's replicas). Unimplemented, naming
  // what, for what is not built: ZeRO, GPUs, layers with moving statistics, a layer used by two
  // stages.
  void prepare_pipeline(const Model& model, const std::vector<PlannedStage>& stages,
                        const std::vector<VariableLayout>& layouts) const;
  // At construction: the replicas' coordinates, the model axis and its groups.
  void place_replicas();
  // The communicators of the groups along `axis` (one per position on the other axes), in-process
  // for a group on this worker and the cross-device ops' for one spread over every worker, in
  // local replica order; empty when some group is neither.
  std::vector<std::unique_ptr<collective::Communicator>> communicators_along(std::size_t axis);
  enum class GroupReach { kThisWorker, kEveryWorker, kSomeWorkers };
  GroupReach reach_of(const std::vector<std::int64_t>& key, std::size_t free_axis) const;
  std::map<std::vector<std::int64_t>, std::vector<std::size_t>> groups_along(std::size_t free_axis) const;

  LayoutMap layout_map_;
  bool strict_ = true;
  std::optional<PipelineOptions> pipeline_;
  // Per replica in sync (index in the mesh's device list): its coordinates on the mesh's axes.
  std::vector<std::vector<std::int64_t>> coordinates_;
  std::size_t batch_axis_ = 0;
  // The tensor-parallel groups along the model axis (one per position on the other axes), when
  // the mesh has such an axis and each group's devices are on this worker; else null.
  std::shared_ptr<strategy::tensor_parallel::Group> tensor_group_;
  std::optional<std::size_t> tensor_axis_;
  std::atomic<bool> tensor_group_aborted_{false};
  // Groups spread over the workers: their communicators (the cross-device ops'), which stay
  // aborted after a failure; a new distribution is needed then.
  std::vector<std::unique_ptr<collective::Communicator>> tensor_communicators_;
  bool gradients_span_workers_ = true;
  std::optional<std::size_t> stage_axis_;
  std::vector<std::unique_ptr<collective::Communicator>> pipeline_communicators_;  // per local replica
  mutable std::vector<PlannedStage> planned_stages_;
};

// Keras's set_distribution / distribution(): the distribution code with no strategy scope uses
// (models and optimizers made then are made under it). The caller keeps it alive; destroying it
// unsets it. set_distribution(nullptr) unsets.
void set_distribution(Distribution& distribution);
void set_distribution(std::nullptr_t);
Distribution* distribution();  // null when none is set

}  // namespace tandem::keras::distribution
