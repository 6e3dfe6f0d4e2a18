// keras::distribution: the mesh, layouts and layout map, the distributions as strategies, and the
// plan from the ZeRO paper's formulas.
#include "tandem/keras_like/distribution.h"

#include <algorithm>
#include <cctype>
#include <ostream>
#include <set>

#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/devices/device_name.h"
#include "tandem/keras_like/detail/layouts.h"

namespace tandem::keras::distribution {
namespace {

template <class T>
std::string join(const std::vector<T>& items, std::string_view separator = ", ") {
  std::string out;
  for (const auto& item : items) out += fmt::format("{}{}", out.empty() ? "" : separator, item);
  return out;
}

std::string quoted_keys(const std::vector<std::string>& keys) {
  std::vector<std::string> quoted;
  for (const auto& k : keys) quoted.push_back(fmt::format("'{}'", k));
  return join(quoted);
}

// The global name of rank `task`'s local device `device` in a job of several workers.
std::string global_device_name(int task, const std::string& device) {
  return fmt::format("/job:worker/replica:0/task:{}/device:{}", task, device);
}

std::vector<std::string> short_names(const std::vector<devices::Device*>& devices) {
  std::vector<std::string> names;
  for (const auto* d : devices) names.push_back(d->short_name());
  return names;
}

std::shared_ptr<strategy::ClusterResolver> resolver_of(const WorkerOptions& options) {
  return options.cluster_resolver ? options.cluster_resolver
                                  : std::shared_ptr<strategy::ClusterResolver>(strategy::resolve_cluster());
}

// The options of the MultiWorkerMirroredStrategy a distribution is: this worker's devices of the
// mesh (all of them on one worker), checked to be named as the top of distribution.h says.
strategy::MultiWorkerOptions worker_options(std::string_view kind, const DeviceMesh& mesh, const WorkerOptions& workers,
                                            DistributionOptions distribution, strategy::AutoShardPolicy policy) {
  strategy::MultiWorkerOptions options;
  options.cluster_resolver = resolver_of(workers);
  const int num_workers = std::max(1, options.cluster_resolver->num_workers());
  const int rank = options.cluster_resolver->rank();
  std::vector<int> per_task(static_cast<std::size_t>(num_workers), 0);
  int last_task = 0;
  for (const auto& name : mesh.devices()) {
    const auto parsed = devices::DeviceName::parse(name);
    TANDEM_REQUIRE(num_workers == 1 || name.find("/task:") != std::string::npos, InvalidArgument,
                   "{}: mesh device \"{}\" names no task, but this job has {} workers: name each device with its "
                   "worker's rank, as \"{}\" (keras::distribution::list_devices() lists them)",
                   kind, name, num_workers, global_device_name(1, "CPU:0"));
    TANDEM_REQUIRE(parsed.task < num_workers, InvalidArgument,
                   "{}: mesh device \"{}\" is on task {}, but this job has {} worker{} (tasks 0 to {})", kind, name,
                   parsed.task, num_workers, num_workers == 1 ? "" : "s", num_workers - 1);
    TANDEM_REQUIRE(parsed.task >= last_task, InvalidArgument,
                   "{}: mesh device \"{}\" of task {} comes after a device of task {}: list the devices worker by "
                   "worker (worker-major), the order of the replicas in sync",
                   kind, name, parsed.task, last_task);
    last_task = parsed.task;
    ++per_task[static_cast<std::size_t>(parsed.task)];
    if (parsed.task == rank) options.local_devices.push_back(devices::DeviceName{.type = parsed.type, .index = parsed.index}.short_form());
  }
  for (int t = 0; t < num_workers; ++t) {
    TANDEM_REQUIRE(per_task[static_cast<std::size_t>(t)] == per_task[0], InvalidArgument,
                   "{}: the mesh holds {} devices of task 0 but {} of task {}: every worker must train on as many "
                   "devices",
                   kind, per_task[0], per_task[static_cast<std::size_t>(t)], t);
  }
  options.communication_options = workers.communication_options;
  options.rendezvous_timeout = workers.rendezvous_timeout;
  options.log_on_all_workers = workers.log_on_all_workers;
  options.distribution = distribution;
  options.auto_shard_policy = policy;
  return options;
}

// DataParallel's checks, and its options as a MultiWorkerMirroredStrategy's.
strategy::MultiWorkerOptions data_parallel_options(const DeviceMesh& mesh, DataParallelOptions options) {
  for (std::size_t a = 1; a < mesh.shape().size(); ++a) {
    TANDEM_REQUIRE(mesh.shape()[a] == 1, InvalidArgument,
                   "DataParallel: {} has {} devices along axis '{}'; DataParallel splits the batch over the first "
                   "axis ('{}') only and would compute the same rows on each of them: give a 1-D mesh",
                   mesh.to_string(), mesh.shape()[a], mesh.axis_names()[a], mesh.axis_names()[0]);
  }
  TANDEM_REQUIRE(options.distribution.zero == strategy::ZeroStage::k0 || options.distribution.zero == options.zero,
                 InvalidArgument,
                 "DataParallel: DataParallelOptions::zero is stage {} but its distribution.zero is stage {}; set "
                 "DataParallelOptions::zero only",
                 static_cast<int>(options.zero), static_cast<int>(options.distribution.zero));
  options.distribution.zero = options.zero;
  return worker_options("DataParallel", mesh, options.workers, options.distribution,
                        options.auto_shard_dataset ? strategy::AutoShardPolicy::kAuto : strategy::AutoShardPolicy::kOff);
}

DeviceMesh one_axis_mesh(std::vector<std::string> devices) {
  const auto n = static_cast<std::int64_t>(devices.size());
  return DeviceMesh({n}, {kDefaultBatchDimName}, std::move(devices));
}

std::string model_parallel_batch_dim(const LayoutMap& layout_map, const ModelParallelOptions& options) {
  const DeviceMesh& mesh = layout_map.device_mesh();
  const std::string batch = options.batch_dim_name.empty() ? mesh.axis_names()[0] : options.batch_dim_name;
  mesh.axis_size(batch);  // InvalidArgument naming the mesh's axes
  return batch;
}

// ModelParallel's check at construction (the rest waits for the model: check_model), and its
// options.
strategy::MultiWorkerOptions model_parallel_options(const LayoutMap& layout_map, const ModelParallelOptions& options) {
  const DeviceMesh& mesh = layout_map.device_mesh();
  const std::string batch = model_parallel_batch_dim(layout_map, options);
  for (const auto& key : layout_map.keys()) {
    const TensorLayout layout = *layout_map.get(key);
    for (const auto& axis : layout.axes()) {
      TANDEM_REQUIRE(!axis || *axis != batch || mesh.axis_size(*axis) == 1, Unimplemented,
                     "ModelParallel: layout_map['{}'] = {} splits variables over the batch axis '{}' ({} devices): "
                     "that is ZeRO stage 3; use DataParallel(mesh, {{.zero = ZeroStage::k3}})",
                     key, layout.to_string(), *axis, mesh.axis_size(*axis));
    }
  }
  TANDEM_REQUIRE(!layout_map.megatron_axis() || *layout_map.megatron_axis() != batch, InvalidArgument,
                 "ModelParallel: LayoutMap::megatron splits over '{}', which is the batch axis; name the model axis",
                 batch);
  return worker_options("ModelParallel", mesh, options.workers, options.distribution, strategy::AutoShardPolicy::kAuto);
}

// The pipeline ModelParallel's options (or a "stage" axis of several devices) ask for, checked
// against the mesh, its stage and micro-batch counts filled in.
std::optional<PipelineOptions> model_parallel_pipeline(const LayoutMap& layout_map,
                                                       const ModelParallelOptions& options) {
  const DeviceMesh& mesh = layout_map.device_mesh();
  const std::string batch = model_parallel_batch_dim(layout_map, options);
  std::optional<PipelineOptions> p = options.pipeline;
  if (!p && mesh.has_axis("stage") && mesh.axis_size("stage") > 1) p = PipelineOptions{};
  if (!p) return p;
  TANDEM_REQUIRE(mesh.has_axis(p->stage_axis), InvalidArgument,
                 "ModelParallel: the pipeline's stage axis '{}' is not an axis of {}", p->stage_axis, mesh.to_string());
  TANDEM_REQUIRE(
      p->stage_axis != batch, InvalidArgument,
      "ModelParallel: the pipeline's stage axis '{}' is the batch axis; give the stages an axis of their own",
      p->stage_axis);
  const auto size = static_cast<int>(mesh.axis_size(p->stage_axis));
  TANDEM_REQUIRE(p->stages == 0 || p->stages == size, InvalidArgument,
                 "ModelParallel: PipelineOptions::stages is {} but the stage axis '{}' of {} has {} devices", p->stages,
                 p->stage_axis, mesh.to_string(), size);
  for (const auto& key : layout_map.keys()) {
    const TensorLayout layout = *layout_map.get(key);
    for (const auto& axis : layout.axes()) {
      TANDEM_REQUIRE(!axis || *axis != p->stage_axis || size == 1, InvalidArgument,
                     "ModelParallel: layout_map['{}'] = {} splits variables over '{}', the pipeline's stage axis: the "
                     "stages split the layers, not their weights",
                     key, layout.to_string(), *axis);
    }
  }
  p->stages = size;
  if (p->microbatches == 0) p->microbatches = size;
  strategy::validate_pipeline_config({.stages = p->stages,
                                      .microbatches = p->microbatches,
                                      .virtual_stages = p->virtual_stages,
                                      .schedule = p->schedule});
  return p;
}

// --- plan -----------------------------------------------------------------------------------------

// What the plan needs of one variable.
struct VariableFacts {
  std::string path;
  Shape shape;
  graph::DType dtype;
  bool trainable;
  std::optional<TensorLayout> layout;  // from the layout map
  std::string layout_key;
  std::string split;  // the layer's tensor-parallel split ("column"); empty when whole
  std::int64_t elements() const { return shape.num_elements(); }
  std::int64_t element_bytes() const { return static_cast<std::int64_t>(graph::dtype_size(dtype)); }
};

// The elements per device of a tensor split as `layout` says (ceil per split dimension).
std::int64_t layout_shard_elements(const VariableFacts& v) {
  std::int64_t elements = 1;
  const DeviceMesh& mesh = *v.layout->device_mesh();
  for (int d = 0; d < v.shape.rank(); ++d) {
    const auto& axis = v.layout->axes()[static_cast<std::size_t>(d)];
    const std::int64_t parts = axis ? mesh.axis_size(*axis) : 1;
    elements *= (v.shape[d] + parts - 1) / parts;
  }
  return elements;
}

// One variable's place and bytes per device at `stage` on `replicas` replicas, each of its
// `slots` slots the size of the variable (the paper's K Ψ).
// slots: the optimizer's slots per variable; accumulator: one more, the gradient accumulator,
// which stages 1 and 2 keep whole (it sums micro-steps that are not communicated).
PlannedVariable place(const VariableFacts& v, int replicas, ZeroStage stage, int slots, bool accumulator) {
  PlannedVariable p{.path = v.path, .shape = v.shape, .dtype = v.dtype, .trainable = v.trainable,
                    .layout_key = v.layout_key};
  const std::int64_t n = v.elements(), b = v.element_bytes();
  const bool layout_split = v.layout && v.layout->num_shards() > 1;
  if (layout_split) {
    p.shards = static_cast<int>(v.layout->num_shards());
    p.shard_elements = layout_shard_elements(v);
    p.padding = p.shard_elements * p.shards - n;
    p.layout = fmt::format("{}{} ({} of {} elements each)", v.split.empty() ? "" : v.split + " ", v.layout->to_string(),
                           p.shard_elements, n);
    p.weight_bytes = p.shard_elements * b;
    if (v.trainable) {
      // ZeRO over tensor parallelism: each piece's slots (stage 1 on), gradients (2 on) and
      // weights (3) sharded over the data-parallel replicas holding that piece.
      const std::int64_t zero_shard = strategy::ShardSpec::even(Shape{p.shard_elements}, replicas).shard_elements;
      const int k = static_cast<int>(stage);
      if (k >= 3) p.weight_bytes = zero_shard * b;
      p.gradient_bytes = (k >= 2 ? zero_shard : p.shard_elements) * b;
      p.slot_bytes = slots * (k >= 1 ? zero_shard : p.shard_elements) * b + (accumulator ? p.shard_elements * b : 0);
    }
    return p;
  }
  p.weight_bytes = n * b;
  p.shard_elements = n;
  p.layout = "replicated";
  if (!v.trainable) return p;
  const auto spec = strategy::ShardSpec::even(v.shape, replicas);
  const std::int64_t shard = spec.shard_elements;
  const int k = static_cast<int>(stage);
  // Stages 2 and 3 as built: the executor hands each reduce-scattered bucket's whole gradients to
  // the reducer, which copies this replica's shard out, and reuses their memory once the next
  // bucket is complete (GradientReducer::hand_offs): a shard per variable, plus whole gradients in
  // flight (the last bucket's, and one or two being reduced) that live in the arena with the
  // activations and are not counted here. Where the optimizer updates during backward
  // (GradientReducerOptions::update) the handed-off shards are applied at once and never held:
  // the row is then an upper bound. The gradient accumulator stays whole at every stage.
  p.gradient_bytes = (k >= 2 ? shard : n) * b;
  p.slot_bytes = slots * (k >= 1 ? shard : n) * b + (accumulator ? n * b : 0);
  if (k >= 3) p.weight_bytes = shard * b;
  if (k >= 1 && replicas > 1) {
    static constexpr const char* kWhat[] = {"", "slots", "gradients, slots", "weights, gradients, slots"};
    p.shards = replicas;
    p.shard_elements = shard;
    p.padding = shard * replicas - n;
    p.layout = fmt::format("{} 1/{}: {} element{}{}", kWhat[k], replicas, shard, shard == 1 ? "" : "s",
                           p.padding > 0 ? fmt::format(" (+{} padding)", p.padding) : "");
  }
  return p;
}

PlannedMemory memory_of(const std::vector<PlannedVariable>& rows, std::int64_t largest_layer_bytes, int replicas,
                        ZeroStage stage) {
  PlannedMemory m;
  for (const auto& r : rows) {
    m.weights += r.weight_bytes;
    m.gradients += r.gradient_bytes;
    m.slots += r.slot_bytes;
  }
  if (stage == ZeroStage::k3 && replicas > 1) m.gathered = largest_layer_bytes;
  return m;
}

// The collectives of one update step, bytes per device under the ring convention.
std::vector<PlannedCollective> collectives_of(const std::vector<VariableFacts>& variables, int replicas,
                                              ZeroStage stage, std::optional<graph::DType> wire_dtype) {
  if (replicas <= 1) return {};
  double gradients = 0, padded_gradients = 0, padded_weights = 0;
  for (const auto& v : variables) {
    if (!v.trainable) continue;
    const bool compress = wire_dtype && v.dtype != graph::DType::kF64;
    const auto gb = static_cast<double>(compress ? graph::dtype_size(*wire_dtype) : graph::dtype_size(v.dtype));
    // A tensor-split variable's replicas (along the batch axis) reduce the piece each holds.
    const std::int64_t elements = v.layout && v.layout->num_shards() > 1 ? layout_shard_elements(v) : v.elements();
    const auto padded =
        static_cast<double>(strategy::ShardSpec::even(Shape{elements}, replicas).shard_elements * replicas);
    gradients += static_cast<double>(elements) * gb;
    padded_gradients += padded * gb;
    padded_weights += padded * static_cast<double>(v.element_bytes());
  }
  const double f = static_cast<double>(replicas - 1) / replicas;
  switch (stage) {
    case ZeroStage::k0:
      return {{"all_reduce", "gradients", 2 * f * gradients}};
    case ZeroStage::k1:
    case ZeroStage::k2:
      return {{"reduce_scatter", "gradients", f * padded_gradients},
              {"all_gather", "updated weights", f * padded_weights}};
    case ZeroStage::k3:
      return {{"all_gather", "weights before forward", f * padded_weights},
              {"all_gather", "weights before backward", f * padded_weights},
              {"reduce_scatter", "gradients", f * padded_gradients}};
  }
  return {};
}

// "1234567 (1.18 MiB)": exact, and readable.
std::string bytes_text(double bytes) {
  const bool mib = bytes >= 1024.0 * 1024.0;
  return fmt::format("{:.0f} ({:.2f} {})", bytes, bytes / (mib ? 1024.0 * 1024.0 : 1024.0), mib ? "MiB" : "KiB");
}

}  // namespace

// --- devices and mesh -------------------------------------------------------------------------------

namespace {

// list_devices for the job `resolver` describes.
std::vector<std::string> job_devices(const strategy::ClusterResolver& resolver, std::string_view type) {
  std::string kind(type);
  std::transform(kind.begin(), kind.end(), kind.begin(), [](unsigned char c) { return std::tolower(c); });
  TANDEM_REQUIRE(kind.empty() || kind == "cpu" || kind == "gpu", InvalidArgument,
                 "list_devices: device type \"{}\"; expected \"cpu\", \"gpu\" or \"\" (the default devices)", type);
  std::vector<std::string> local;
  if (kind.empty()) {
    local = resolver.num_workers() > 1 ? strategy::default_worker_devices(resolver)
                                       : short_names(strategy::mirrored_devices({}));
  } else {
    local = short_names(devices::list_logical_devices(kind == "cpu" ? devices::DeviceType::kCPU : devices::DeviceType::kGPU));
  }
  if (resolver.num_workers() <= 1) return local;
  std::vector<std::string> global;
  for (int task = 0; task < resolver.num_workers(); ++task) {
    for (const auto& d : local) global.push_back(global_device_name(task, d));
  }
  return global;
}

}  // namespace

std::vector<std::string> list_devices(std::string_view type) { return job_devices(*strategy::resolve_cluster(), type); }

DeviceMesh::DeviceMesh(std::vector<std::int64_t> shape, std::vector<std::string> axis_names,
                       std::vector<std::string> devices)
    : shape_(std::move(shape)), axis_names_(std::move(axis_names)), devices_(std::move(devices)) {
  TANDEM_REQUIRE(!shape_.empty() && !axis_names_.empty(), InvalidArgument,
                 "DeviceMesh: shape and axis_names cannot be empty; got shape [{}], axis_names [{}]", join(shape_),
                 join(axis_names_));
  TANDEM_REQUIRE(shape_.size() == axis_names_.size(), InvalidArgument,
                 "DeviceMesh: shape [{}] has {} axes but axis_names [{}] has {} names; give one name per axis",
                 join(shape_), shape_.size(), join(axis_names_), axis_names_.size());
  std::int64_t product = 1;
  for (std::size_t a = 0; a < shape_.size(); ++a) {
    TANDEM_REQUIRE(shape_[a] >= 1, InvalidArgument, "DeviceMesh: axis '{}' has size {}; expected 1 or more",
                   axis_names_[a], shape_[a]);
    for (std::size_t b = 0; b < a; ++b) {
      TANDEM_REQUIRE(axis_names_[a] != axis_names_[b], InvalidArgument,
                     "DeviceMesh: axis name '{}' appears twice in [{}]; axis names must differ", axis_names_[a],
                     join(axis_names_));
    }
    product *= shape_[a];
  }
  if (devices_.empty()) devices_ = list_devices();
  TANDEM_REQUIRE(product == static_cast<std::int64_t>(devices_.size()), InvalidArgument,
                 "DeviceMesh: shape [{}] holds {} devices but {} were given ({})", join(shape_), product,
                 devices_.size(), join(devices_));
  std::set<std::string> seen;
  for (const auto& d : devices_) {
    TANDEM_REQUIRE(seen.insert(d).second, InvalidArgument, "DeviceMesh: device \"{}\" appears twice in ({})", d,
                   join(devices_));
  }
}

bool DeviceMesh::has_axis(std::string_view axis) const {
  return std::find(axis_names_.begin(), axis_names_.end(), axis) != axis_names_.end();
}

std::int64_t DeviceMesh::axis_size(std::string_view axis) const {
  const auto it = std::find(axis_names_.begin(), axis_names_.end(), axis);
  TANDEM_REQUIRE(it != axis_names_.end(), InvalidArgument, "'{}' is not an axis of {}; its axes are {}", axis,
                 to_string(), quoted_keys(axis_names_));
  return shape_[static_cast<std::size_t>(it - axis_names_.begin())];
}

std::string DeviceMesh::to_string() const {
  return fmt::format("DeviceMesh(shape=[{}], axis_names=[{}])", join(shape_), join(axis_names_));
}

// --- layouts ----------------------------------------------------------------------------------------

TensorLayout::TensorLayout(std::vector<std::optional<std::string>> axes) : axes_(std::move(axes)) {
  for (std::size_t a = 0; a < axes_.size(); ++a) {
    for (std::size_t b = 0; b < a; ++b) {
      TANDEM_REQUIRE(!axes_[a] || axes_[a] != axes_[b], InvalidArgument,
                     "TensorLayout {}: mesh axis '{}' splits dimensions {} and {}; an axis may split one dimension "
                     "only",
                     to_string(), *axes_[a], b, a);
    }
  }
}

TensorLayout::TensorLayout(std::vector<std::optional<std::string>> axes, const DeviceMesh& mesh)
    : TensorLayout(std::move(axes)) {
  bind(mesh);
}

void TensorLayout::bind(const DeviceMesh& mesh) {
  for (const auto& axis : axes_) {
    TANDEM_REQUIRE(!axis || mesh.has_axis(*axis), InvalidArgument,
                   "TensorLayout {}: '{}' is not an axis of {}; its axes are {}", to_string(), *axis, mesh.to_string(),
                   quoted_keys(mesh.axis_names()));
  }
  mesh_ = mesh;
}

std::int64_t TensorLayout::num_shards() const {
  if (!mesh_) return 1;
  std::int64_t n = 1;
  for (const auto& axis : axes_) n *= axis ? mesh_->axis_size(*axis) : 1;
  return n;
}

std::string TensorLayout::to_string() const {
  std::vector<std::string> parts;
  for (const auto& axis : axes_) parts.push_back(axis ? fmt::format("'{}'", *axis) : "None");
  return fmt::format("[{}]", join(parts));
}

LayoutMap::Entry& LayoutMap::Entry::operator=(TensorLayout layout) {
  map_.insert(key_, std::move(layout));
  return *this;
}

void LayoutMap::insert(std::string key, TensorLayout layout) {
  for (const auto& item : entries_) {
    TANDEM_REQUIRE(item.key != key, InvalidArgument,
                   "LayoutMap: key '{}' is already there (layout {}); each key may be set once", key,
                   item.layout.to_string());
  }
  std::regex pattern;
  try {
    pattern = std::regex(key, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw InvalidArgument(fmt::format("LayoutMap: key '{}' is not a regular expression: {}", key, e.what()));
  }
  layout.bind(mesh_);
  entries_.push_back({std::move(key), std::move(pattern), std::move(layout)});
}

const LayoutMap::Item* LayoutMap::find(std::string_view path) const {
  for (const auto& item : entries_) {
    if (item.key == path) return &item;
  }
  const Item* found = nullptr;
  for (const auto& item : entries_) {
    if (!std::regex_match(path.begin(), path.end(), item.pattern)) continue;
    TANDEM_REQUIRE(found == nullptr, InvalidArgument,
                   "LayoutMap: path '{}' matches the keys '{}' and '{}'; make each variable path match one key at "
                   "most",
                   path, found->key, item.key);
    found = &item;
  }
  return found;
}

std::optional<TensorLayout> LayoutMap::get(std::string_view path) const {
  const Item* item = find(path);
  return item ? std::optional<TensorLayout>(item->layout) : std::nullopt;
}

std::optional<std::string> LayoutMap::matching_key(std::string_view path) const {
  const Item* item = find(path);
  return item ? std::optional<std::string>(item->key) : std::nullopt;
}

std::vector<std::string> LayoutMap::keys() const {
  std::vector<std::string> out;
  for (const auto& item : entries_) out.push_back(item.key);
  return out;
}

// --- plan -------------------------------------------------------------------------------------------

Plan plan(const Model& model, const PlanOptions& options) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "plan: model \"{}\" is not built, so its variables do not exist yet; give the Sequential an Input or "
                 "call model.build(shape) first",
                 model.name());
  const strategy::Strategy& strategy = model.distribute_strategy();
  const auto* mp = dynamic_cast<const ModelParallel*>(&strategy);
  const LayoutMap* given_map = options.layout_map != nullptr ? options.layout_map : mp ? &mp->layout_map() : nullptr;
  Plan p;
  // The layouts as compile will check them (megatron()'s choices made for this model).
  std::optional<LayoutMap> resolved;
  std::vector<VariableLayout> layouts;
  if (given_map != nullptr) {
    resolved = given_map->resolve(model, &p.layout_notes);
    const std::string batch = mp ? mp->batch_dim_name() : given_map->device_mesh().axis_names()[0];
    layouts = check_layouts(model, *resolved, batch, /*strict=*/false);
  }
  const LayoutMap* layout_map = resolved ? &*resolved : nullptr;
  p.model = model.name();
  p.strategy = strategy.name();
  // Under ModelParallel the replicas in sync are the devices along the batch axis.
  const int default_replicas =
      mp ? static_cast<int>(mp->device_mesh().axis_size(mp->batch_dim_name())) : strategy.num_replicas_in_sync();
  p.replicas = options.replicas.value_or(default_replicas);
  TANDEM_REQUIRE(p.replicas >= 1, InvalidArgument, "plan: {} replicas; expected 1 or more", p.replicas);
  p.zero = options.zero.value_or(strategy.distribution_options().zero);
  TANDEM_REQUIRE(options.batch_rows >= 0, InvalidArgument, "plan: batch_rows is {}; expected 0 or more",
                 options.batch_rows);
  p.local_rows = (options.batch_rows + p.replicas - 1) / p.replicas;  // the first replicas' share, as split_batch

  std::optional<Optimizer> optimizer;
  if (options.optimizer) {
    if (options.optimizer->loss_scale_optimizer()) {
      optimizer.emplace(*options.optimizer->loss_scale_optimizer());
    } else {
      optimizer.emplace(options.optimizer->spec());
    }
  }
  const Optimizer* rule = optimizer ? &*optimizer : model.compiled() ? &model.optimizer() : nullptr;
  p.optimizer = rule ? rule->name() : "none (not compiled: no slots counted)";
  const bool accumulates = rule != nullptr && rule->accumulation_steps() > 1;
  if (rule) p.slots_per_variable = static_cast<int>(slot_names(rule->spec()).size()) + (accumulates ? 1 : 0);

  std::vector<VariableFacts> facts;
  std::set<std::string> used_keys;
  for (const auto& v : model.weights()) {
    VariableFacts f{.path = v->name(), .shape = v->global_shape(), .dtype = v->dtype(), .trainable = v->trainable()};
    if (layout_map != nullptr) {
      if (auto key = layout_map->matching_key(f.path)) {
        f.layout = layout_map->get(*key);
        TANDEM_REQUIRE(static_cast<int>(f.layout->axes().size()) == f.shape.rank(), InvalidArgument,
                       "plan: variable '{}' of shape {} has rank {} but layout_map['{}'] = {} has {} axes", f.path,
                       f.shape, f.shape.rank(), *key, f.layout->to_string(), f.layout->axes().size());
        f.layout_key = *key;
        used_keys.insert(*key);
        for (const auto& l : layouts) {
          if (l.path == f.path) f.split = l.split;
        }
      }
    }
    facts.push_back(std::move(f));
  }
  if (layout_map != nullptr) {
    for (const auto& key : layout_map->keys()) {
      if (!used_keys.contains(key)) p.unmatched_layout_keys.push_back(key);
    }
  }
  // Stage 3 gathers one layer's weights whole at a time: the largest is the working set.
  std::int64_t largest_layer = 0;
  for (const auto& layer : model.layers()) {
    std::int64_t bytes = 0;
    for (const auto& w : layer->trainable_weights()) {
      bytes += w->global_shape().num_elements() * static_cast<std::int64_t>(graph::dtype_size(w->dtype()));
    }
    largest_layer = std::max(largest_layer, bytes);
  }
  for (int stage = 0; stage < 4; ++stage) {
    std::vector<PlannedVariable> rows;
    for (const auto& f : facts) {
      rows.push_back(place(f, p.replicas, static_cast<ZeroStage>(stage), p.slots_per_variable - (accumulates ? 1 : 0),
                           accumulates));
    }
    p.memory_by_stage[static_cast<std::size_t>(stage)] =
        memory_of(rows, largest_layer, p.replicas, static_cast<ZeroStage>(stage));
    if (static_cast<ZeroStage>(stage) == p.zero) p.variables = std::move(rows);
  }
  p.memory = p.memory_by_stage[static_cast<std::size_t>(p.zero)];
  p.collectives = collectives_of(facts, p.replicas, p.zero, strategy.distribution_options().gradient_all_reduce_dtype);
  for (const auto& c : p.collectives) p.communication_bytes_per_device += c.bytes_per_device;
  for (auto& c : detail::tensor_parallel_collectives(model, layouts)) {
    p.communication_bytes_per_row += c.bytes_per_device;
    p.collectives.push_back(std::move(c));
  }
  std::optional<PipelineOptions> pipe = options.pipeline;
  if (!pipe && mp != nullptr) pipe = mp->pipeline();
  if (pipe) {
    if (pipe->stages == 0) {
      TANDEM_REQUIRE(given_map != nullptr, InvalidArgument,
                     "plan: PipelineOptions::stages is 0 (the stage axis's size) but there is no mesh to read it from; "
                     "give the stage count");
      pipe->stages = static_cast<int>(given_map->device_mesh().axis_size(pipe->stage_axis));
    }
    if (pipe->microbatches == 0) pipe->microbatches = pipe->stages;
    Plan::Pipeline pp;
    pp.config = {.stages = pipe->stages,
                 .microbatches = pipe->microbatches,
                 .virtual_stages = pipe->virtual_stages,
                 .schedule = pipe->schedule};
    pp.predicted_bubble = strategy::predicted_bubble(pp.config);
    pp.stages = cut_into_stages(model, pipe->stages, pipe->cuts);
    // Unit forward and backward times per model chunk: the schedule's shape, not a prediction of
    // seconds.
    const double chunk = 1.0 / pipe->virtual_stages;
    pp.table = strategy::format_pipeline_table(pp.config,
                                               strategy::simulate_pipeline(strategy::make_pipeline_schedule(pp.config),
                                                                           {.forward = chunk, .backward = chunk}));
    for (std::size_t k = 0; k + 1 < pp.stages.size(); ++k) {
      const auto& boundary = *pp.stages[k].boundary;
      double elements = 1;
      for (int d = 1; d < boundary.shape.rank(); ++d) elements *= static_cast<double>(boundary.shape[d]);
      double bytes = elements * static_cast<double>(graph::dtype_size(boundary.dtype));
      // A column-parallel Dense leaves its output split by features: each device of the model
      // axis sends its piece to its counterpart in the next stage.
      const std::string column_kernel = pp.stages[k].last_layer + "/kernel";
      for (const auto& l : layouts) {
        if (l.path == column_kernel && l.split == "column") bytes /= static_cast<double>(l.parts);
      }
      p.collectives.push_back(
          {.op = "send",
           .what = fmt::format("stage {} -> {}: {}'s output (forward)", k, k + 1, pp.stages[k].last_layer),
           .bytes_per_device = bytes,
           .per_row = true});
      p.collectives.push_back({.op = "send",
                               .what = fmt::format("stage {} -> {}: its gradient (backward)", k + 1, k),
                               .bytes_per_device = bytes,
                               .per_row = true});
      p.communication_bytes_per_row += 2 * bytes;
    }
    p.pipeline = std::move(pp);
  }
  return p;
}

std::string Plan::to_string() const {
  std::string out = fmt::format("Plan for model \"{}\" under {}: {} replica{} in sync, ZeRO stage {}, optimizer {} ({} "
                                "slot{} per variable)\n",
                                model, strategy, replicas, replicas == 1 ? "" : "s", static_cast<int>(zero), optimizer,
                                slots_per_variable, slots_per_variable == 1 ? "" : "s");
  // The table: one row per variable, bytes per device.
  std::vector<std::array<std::string, 7>> table{
      {"Variable", "Shape", "DType", "Layout", "Weights", "Gradients", "Slots"}};
  for (const auto& v : variables) {
    table.push_back({v.path, v.shape.to_string(), std::string(graph::dtype_name(v.dtype)),
                     v.layout + (v.layout_key.empty() ? "" : fmt::format(" ['{}']", v.layout_key)),
                     std::to_string(v.weight_bytes), std::to_string(v.gradient_bytes), std::to_string(v.slot_bytes)});
  }
  std::array<std::size_t, 7> width{};
  for (const auto& row : table) {
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : table) {
    std::string line;
    for (std::size_t c = 0; c < row.size(); ++c) {
      line += c < 4 ? fmt::format("{:<{}}  ", row[c], width[c]) : fmt::format("{:>{}}  ", row[c], width[c]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += "  " + line + "\n";
  }
  out += fmt::format("Bytes per device: weights {}, gradients {}, slots {}{}, total {}\n", memory.weights,
                     memory.gradients, memory.slots,
                     memory.gathered > 0 ? fmt::format(", gathered layer {}", memory.gathered) : "",
                     bytes_text(static_cast<double>(memory.total())));
  if (zero >= ZeroStage::k2 && replicas > 1) {
    out +=
        "  (gradients: 1/N shards, an upper bound: on CPUs, with no loss scaling, clipping by norm or accumulation, "
        "each bucket's shards but the last update their variables during backward and are not held)\n";
  }
  const auto replicated = static_cast<double>(memory_by_stage[0].total());
  out += fmt::format("By ZeRO stage on {} replica{}:", replicas, replicas == 1 ? "" : "s");
  for (std::size_t s = 0; s < memory_by_stage.size(); ++s) {
    const auto total = static_cast<double>(memory_by_stage[s].total());
    out += fmt::format(" k{} {} ({:.2f}x){}", s, memory_by_stage[s].total(), replicated > 0 ? total / replicated : 1.0,
                       s + 1 < memory_by_stage.size() ? "," : "\n");
  }
  const auto per_step = std::count_if(collectives.begin(), collectives.end(), [](const auto& c) { return !c.per_row; });
  if (per_step == 0) {
    out += "Collectives per step: none (one replica)\n";
  } else {
    out += "Collectives per update step (bytes each device sends):\n";
    for (const auto& c : collectives) {
      if (!c.per_row) out += fmt::format("  {:<15} {:<24} {}\n", c.op, c.what, bytes_text(c.bytes_per_device));
    }
    out += fmt::format("  {:<15} {:<24} {}\n", "total", "", bytes_text(communication_bytes_per_device));
  }
  if (static_cast<std::size_t>(per_step) < collectives.size()) {
    out +=
        "Tensor-parallel collectives and pipeline transfers per row of the local batch (bytes each device sends; x "
        "rows per step):\n";
    const auto per_step_text = [&](double per_row) {
      return local_rows > 0
                 ? fmt::format("  x {} rows = {}", local_rows, bytes_text(per_row * static_cast<double>(local_rows)))
                 : std::string();
    };
    for (const auto& c : collectives) {
      if (c.per_row) {
        out += fmt::format("  {:<15} {:<40} {:.0f}{}\n", c.op, c.what, c.bytes_per_device,
                           per_step_text(c.bytes_per_device));
      }
    }
    out += fmt::format("  {:<15} {:<40} {:.0f}{}\n", "total", "", communication_bytes_per_row,
                       per_step_text(communication_bytes_per_row));
  }
  for (const auto& note : layout_notes) out += fmt::format("LayoutMap::megatron: {}\n", note);
  if (pipeline) {
    out += fmt::format(
        "Pipeline: {} stages, {} micro-batches, schedule {}{}; each device holds its stage's weights (and "
        "their gradients and slots):\n",
        pipeline->config.stages, pipeline->config.microbatches,
        strategy::pipeline_schedule_name(pipeline->config.schedule),
        pipeline->config.virtual_stages > 1 ? fmt::format(", {} chunks per stage", pipeline->config.virtual_stages)
                                            : std::string());
    for (std::size_t k = 0; k < pipeline->stages.size(); ++k) {
      const auto& st = pipeline->stages[k];
      out += fmt::format("  stage {}: {} to {} ({} layer call{}), {} parameter bytes{}\n", k, st.first_layer,
                         st.last_layer, st.layer_calls, st.layer_calls == 1 ? "" : "s", st.parameter_bytes,
                         st.boundary
                             ? fmt::format(", sends {} {}", graph::dtype_name(st.boundary->dtype), st.boundary->shape)
                             : std::string());
    }
    out += pipeline->table;
    if (!out.empty() && out.back() != '\n') out += '\n';
  }
  if (!unmatched_layout_keys.empty()) {
    out += fmt::format("LayoutMap keys that match no variable of the model: {}\n", quoted_keys(unmatched_layout_keys));
  }
  return out;
}

void print_plan(const Model& model, std::ostream& out, const PlanOptions& options) {
  out << plan(model, options).to_string() << std::flush;
}

// --- distributions ------------------------------------------------------------------------------------

Distribution::Distribution(std::string kind, DeviceMesh mesh, std::string batch_dim_name,
                           strategy::MultiWorkerOptions options)
    : MultiWorkerMirroredStrategy(std::move(kind), std::move(options)),
      mesh_(std::move(mesh)),
      batch_dim_name_(std::move(batch_dim_name)) {}

Distribution::~Distribution() {
  if (strategy::global_strategy() == this) strategy::set_global_strategy(nullptr);
}

TensorLayout Distribution::get_variable_layout(std::string_view /*path*/, int rank) const {
  return TensorLayout(std::vector<std::optional<std::string>>(static_cast<std::size_t>(rank)), mesh_);
}

Plan Distribution::plan(const Model& model) const {
  const auto* mp = dynamic_cast<const ModelParallel*>(this);
  return distribution::plan(
      model, {.replicas = mp ? static_cast<int>(device_mesh().axis_size(batch_dim_name())) : num_replicas_in_sync(),
              .zero = distribution_options().zero,
              .layout_map = mp ? &mp->layout_map() : nullptr});
}

// The default mesh of the job the options name (their cluster resolver, else the environment's).
DataParallel::DataParallel(DataParallelOptions options)
    : DataParallel(one_axis_mesh(job_devices(*resolver_of(options.workers), "")), std::move(options)) {}

DataParallel::DataParallel(DeviceMesh mesh, DataParallelOptions options)
    : Distribution("DataParallel", mesh, mesh.axis_names()[0], data_parallel_options(mesh, std::move(options))) {}

DataParallel::DataParallel(std::vector<std::string> devices, DataParallelOptions options)
    : DataParallel(one_axis_mesh(std::move(devices)), std::move(options)) {}

ModelParallel::ModelParallel(LayoutMap layout_map, ModelParallelOptions options)
    : Distribution("ModelParallel", layout_map.device_mesh(), model_parallel_batch_dim(layout_map, options),
                   model_parallel_options(layout_map, options)),
      layout_map_(std::move(layout_map)),
      strict_(options.strict),
      pipeline_(model_parallel_pipeline(layout_map_, options)) {
  place_replicas();
}

TensorLayout ModelParallel::get_variable_layout(std::string_view path, int rank) const {
  if (auto layout = layout_map_.get(path)) return *layout;
  return Distribution::get_variable_layout(path, rank);
}

void ModelParallel::agree_on_variable(strategy::VariableOptions& options) {
  MultiWorkerMirroredStrategy::agree_on_variable(options);
  const auto key = layout_map_.matching_key(options.name);
  if (!key) return;
  const TensorLayout layout = *layout_map_.get(*key);
  const Shape& shape = options.initial_value.shape();
  TANDEM_REQUIRE(static_cast<int>(layout.axes().size()) == shape.rank(), InvalidArgument,
                 "{}: variable '{}' of shape {} has rank {} but layout_map['{}'] = {} has {} axes; give one entry per "
                 "dimension",
                 name(), options.name, shape, shape.rank(), *key, layout.to_string(), layout.axes().size());
}

void set_distribution(Distribution& distribution) { strategy::set_global_strategy(&distribution); }

void set_distribution(std::nullptr_t) { strategy::set_global_strategy(nullptr); }

Distribution* distribution() { return dynamic_cast<Distribution*>(strategy::global_strategy()); }

}  // namespace tandem::keras::distribution
