// keras::distribution::ModelParallel on its mesh: where each replica sits, the groups its
// gradients and its tensor-parallel layers communicate in, and a model's preparation for tensor
// parallelism once its layouts are checked (Megatron-LM's column/row pairing found in the model's
// graph, the split weights cut into their replicas' pieces).
#include <algorithm>
#include <map>
#include <set>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/keras_like/detail/layouts.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/strategy/cross_device_ops.h"

namespace tandem::keras::distribution {
namespace {

// Row-major coordinates of device `index` of a mesh of `shape`.
std::vector<std::int64_t> unravel(std::int64_t index, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> coordinates(shape.size());
  for (std::size_t a = shape.size(); a-- > 0;) {
    coordinates[a] = index % shape[a];
    index /= shape[a];
  }
  return coordinates;
}

// Every layer of the model with the layers it tracks, depth first.
void collect(const std::shared_ptr<LayerImpl>& layer, std::vector<std::shared_ptr<LayerImpl>>& out) {
  out.push_back(layer);
  for (const auto& tracked : layer->tracked_layers()) collect(tracked, out);
}

}  // namespace

// Where a group of replicas (those sharing a key) lives: wholly on this worker, or spread evenly
// over every worker (the cross-device ops' groups span all workers), or neither.
ModelParallel::GroupReach ModelParallel::reach_of(const std::vector<std::int64_t>& key, std::size_t free_axis) const {
  std::int64_t here = 0, everywhere = 0;
  const int local = static_cast<int>(replica_devices().size());
  std::vector<std::int64_t> per_worker(static_cast<std::size_t>(num_workers()), 0);
  for (std::size_t g = 0; g < coordinates_.size(); ++g) {
    auto other = coordinates_[g];
    other[free_axis] = 0;
    if (other != key) continue;
    ++everywhere;
    ++per_worker[g / static_cast<std::size_t>(local)];
    if (static_cast<int>(g) / local == worker_rank()) ++here;
  }
  if (here == everywhere) return GroupReach::kThisWorker;
  const bool even = std::all_of(per_worker.begin(), per_worker.end(), [&](std::int64_t n) { return n == here; });
  return even ? GroupReach::kEveryWorker : GroupReach::kSomeWorkers;
}

// The local replicas grouped by their coordinates with `free_axis`'s set to 0 (the groups along
// that axis), in key order: the same order on every worker.
std::map<std::vector<std::int64_t>, std::vector<std::size_t>> ModelParallel::groups_along(std::size_t free_axis) const {
  std::map<std::vector<std::int64_t>, std::vector<std::size_t>> groups;
  for (std::size_t r = 0; r < replica_devices().size(); ++r) {
    auto key = coordinates_[static_cast<std::size_t>(global_replica_index(static_cast<int>(r)))];
    key[free_axis] = 0;
    groups[key].push_back(r);
  }
  return groups;
}

void ModelParallel::place_replicas() {
  const DeviceMesh& mesh = device_mesh();
  const auto& names = mesh.axis_names();
  batch_axis_ = static_cast<std::size_t>(std::find(names.begin(), names.end(), batch_dim_name()) - names.begin());
  const std::string stage = pipeline_ ? pipeline_->stage_axis : std::string();
  for (std::size_t a = 0; a < names.size() && !tensor_axis_; ++a) {
    if (a != batch_axis_ && names[a] != stage && mesh.shape()[a] > 1) tensor_axis_ = a;
  }
  for (std::size_t i = 0; i < mesh.devices().size(); ++i)
    coordinates_.push_back(unravel(static_cast<std::int64_t>(i), mesh.shape()));
  const auto batch_groups = groups_along(batch_axis_);
  for (const auto& [key, members] : batch_groups) {
    if (reach_of(key, batch_axis_) != GroupReach::kEveryWorker && num_workers() > 1) gradients_span_workers_ = false;
  }
  // The base made the default group (every replica) if it made one: ours sums along the batch
  // axis only, when that is another group.
  const bool default_group =
      batch_groups.size() == 1 && reach_of(batch_groups.begin()->first, batch_axis_) == GroupReach::kEveryWorker;
  if (num_workers() > 1 && !default_group) remake_replica_group();
  if (pipeline_ && pipeline_->stages > 1) {
    stage_axis_ = static_cast<std::size_t>(std::find(names.begin(), names.end(), pipeline_->stage_axis) - names.begin());
    pipeline_communicators_ = communicators_along(*stage_axis_);
  }
  if (!tensor_axis_) return;
  // The groups along the model axis: in-process communicators for groups on this worker, the
  // cross-device ops' (Gloo, shared memory) for groups spread over every worker; none when some
  // group is neither (prepare_tensor_parallel refuses splits then).
  const auto& devices = replica_devices();
  const auto groups = groups_along(*tensor_axis_);
  std::set<GroupReach> reaches;
  for (const auto& [key, members] : groups) reaches.insert(reach_of(key, *tensor_axis_));
  if (reaches == std::set{GroupReach::kThisWorker}) {
    std::vector<int> group_of(devices.size());
    int id = 0;
    for (const auto& [key, members] : groups) {
      for (const std::size_t r : members) group_of[r] = id;
      ++id;
    }
    tensor_group_ = strategy::tensor_parallel::Group::create_in_process(devices, group_of);
  } else if (reaches == std::set{GroupReach::kEveryWorker}) {
    std::vector<devices::Device*> ordered;
    std::vector<collective::Communicator*> communicators;
    for (const auto& [key, members] : groups) {  // in the same order on every worker
      std::vector<devices::Device*> subset;
      for (const std::size_t r : members) subset.push_back(devices[r]);
      auto made = cross_device_ops().make_group(subset);
      for (std::size_t k = 0; k < members.size(); ++k) {
        ordered.push_back(devices[members[k]]);
        communicators.push_back(made[k].get());
        tensor_communicators_.push_back(std::move(made[k]));
      }
    }
    tensor_group_ = strategy::tensor_parallel::Group::create_grouped(ordered, communicators);
  }
}

std::vector<std::unique_ptr<collective::Communicator>> ModelParallel::communicators_along(std::size_t axis) {
  const auto& devices = replica_devices();
  std::vector<std::unique_ptr<collective::Communicator>> out(devices.size());
  const strategy::InProcessAllReduce in_process;
  for (const auto& [key, members] : groups_along(axis)) {  // in the same order on every worker
    std::vector<devices::Device*> subset;
    for (const std::size_t r : members) subset.push_back(devices[r]);
    const GroupReach reach = reach_of(key, axis);
    if (reach == GroupReach::kSomeWorkers) return {};
    auto made = reach == GroupReach::kThisWorker && num_workers() > 1 ? in_process.make_group(subset)
                                                                      : cross_device_ops().make_group(subset);
    for (std::size_t k = 0; k < members.size(); ++k) out[members[k]] = std::move(made[k]);
  }
  return out;
}

int ModelParallel::pipeline_of(int replica) const {
  auto key = coordinates_[static_cast<std::size_t>(global_replica_index(replica))];
  if (stage_axis_) key[*stage_axis_] = 0;
  std::int64_t index = 0;
  for (std::size_t a = 0; a < key.size(); ++a) index = index * device_mesh().shape()[a] + key[a];
  return static_cast<int>(index);
}

bool ModelParallel::leads_pipeline(int replica) const {
  const auto& c = coordinates_[static_cast<std::size_t>(global_replica_index(replica))];
  for (std::size_t a = 0; a < c.size(); ++a) {
    if (a != batch_axis_ && (!stage_axis_ || a != *stage_axis_) && c[a] != 0) return false;
  }
  return true;
}

int ModelParallel::pipeline_stage(int replica) const {
  return stage_axis_ ? static_cast<int>(coordinates_[static_cast<std::size_t>(global_replica_index(replica))][*stage_axis_])
                     : 0;
}

collective::Communicator* ModelParallel::pipeline_communicator(int replica) const {
  if (pipeline_communicators_.empty()) return nullptr;
  return pipeline_communicators_[static_cast<std::size_t>(replica)].get();
}

void ModelParallel::prepare_pipeline(const Model& model, const std::vector<PlannedStage>& stages,
                                     const std::vector<VariableLayout>& layouts) const {
  const int p = pipeline_->stages;
  const std::string& axis = pipeline_->stage_axis;
  TANDEM_REQUIRE(!pipeline_communicators_.empty(), Unimplemented,
                 "ModelParallel: the pipelines along '{}' of {} are on some workers but not all: lay the mesh out so "
                 "that each pipeline is on one worker or spread evenly over every worker",
                 axis, device_mesh().to_string());
  // ZeRO stages 1 and 2 shard each stage's slots along the batch axis (the same stage of every
  // pipeline); stage 3 would gather each stage's weights per micro-batch.
  TANDEM_REQUIRE(distribution_options().zero != strategy::ZeroStage::k3, Unimplemented,
                 "ModelParallel: model \"{}\" has a pipeline over '{}', and ZeRO stage 3 is asked; sharding a "
                 "pipeline stage's parameters is not built yet: use ZeRO stage 1 or 2 with pipelines",
                 model.name(), axis);
  for (const auto* device : replica_devices()) {
    TANDEM_REQUIRE(device->type() == devices::DeviceType::kCPU, Unimplemented,
                   "ModelParallel: pipeline stages run on CPU devices only for now; replica device {} is not one",
                   device->short_name());
  }
  // Each layer's device: the stage (virtual stage k runs on device k mod p) whose calls use it.
  std::map<const Variable*, int> home;
  std::size_t call = 0;
  std::vector<const detail::LayerNode*> calls;
  for (const auto& node : model.state()->nodes) {
    if (node->layer != nullptr) calls.push_back(node.get());
  }
  for (std::size_t k = 0; k < stages.size(); ++k) {
    const int device = static_cast<int>(k) % p;
    for (int c = 0; c < stages[k].layer_calls; ++c, ++call) {
      const LayerImpl& layer = *calls[call]->layer;
      TANDEM_REQUIRE(layer.non_trainable_weights().empty(), Unimplemented,
                     "ModelParallel: {} \"{}\" keeps non-trainable state (moving statistics) updated by training; "
                     "under a pipeline that is not built yet",
                     layer.class_name(), layer.name());
      for (const auto& w : layer.weights()) {
        const auto [it, inserted] = home.emplace(w.get(), device);
        TANDEM_REQUIRE(inserted || it->second == device, Unimplemented,
                       "ModelParallel: {} \"{}\" is called in stages {} and {} of the pipeline over '{}'; a layer "
                       "shared across stages is not built yet: cut the model elsewhere",
                       layer.class_name(), layer.name(), it->second, device, axis);
      }
    }
  }
  // Everything is checked: the split variables take their pieces on their stage's devices, the
  // others whole there.
  // A weight no stage's calls read lives on stage 0.
  for (const auto& w : model.weights()) home.emplace(w.get(), 0);
  planned_stages_ = stages;
  prepare_tensor_parallel(model, layouts, &home);
  for (const auto& w : model.weights()) {
    if (w->tensor_split()) continue;  // split by tensor parallelism, on its stage
    const int device = home.at(w.get());
    std::vector<int> piece_of_replica;
    for (const auto& c : coordinates_) piece_of_replica.push_back(static_cast<int>(c[*stage_axis_]) == device ? 0 : -1);
    w->split_into_pieces({.dim = 0,
                          .parts = 1,
                          .axis = axis,
                          .global_shape = w->global_shape(),
                          .piece_of_replica = std::move(piece_of_replica)});
  }
}

ModelParallel::~ModelParallel() = default;

int ModelParallel::data_shards_in_sync() const { return static_cast<int>(device_mesh().shape()[batch_axis_]); }

int ModelParallel::data_shard(int replica) const {
  return static_cast<int>(coordinates_[static_cast<std::size_t>(global_replica_index(replica))][batch_axis_]);
}

bool ModelParallel::leads_data_shard(int replica) const {
  // Its pipeline's first stage (every replica, without a pipeline) of the pipeline that counts.
  return leads_pipeline(replica) && pipeline_stage(replica) == 0;
}

std::vector<std::unique_ptr<collective::Communicator>> ModelParallel::make_replica_group() {
  // After an abort the tensor-parallel groups are renewed with the gradient groups (between steps).
  if (tensor_group_ && tensor_group_aborted_.exchange(false)) tensor_group_->renew();
  // The gradients are summed along the batch axis: one group per position on the other axes, on
  // this worker (in-process) or over every worker (the cross-device ops').
  const auto groups = groups_along(batch_axis_);
  if (groups.size() == 1 &&
      (num_workers() == 1 || reach_of(groups.begin()->first, batch_axis_) == GroupReach::kEveryWorker))
    return Distribution::make_replica_group();
  const auto& devices = replica_devices();
  std::vector<std::unique_ptr<collective::Communicator>> out(devices.size());
  const strategy::InProcessAllReduce in_process;
  for (const auto& [key, members] : groups) {  // in the same order on every worker
    std::vector<devices::Device*> subset;
    for (const std::size_t r : members) subset.push_back(devices[r]);
    const GroupReach reach = reach_of(key, batch_axis_);
    TANDEM_REQUIRE(reach != GroupReach::kSomeWorkers, Unimplemented,
                   "ModelParallel: the replicas along the batch axis '{}' of {} are on some workers but not all; lay "
                   "the mesh out so that each such group is on one worker or spread evenly over all of them",
                   batch_dim_name(), device_mesh().to_string());
    auto communicators = reach == GroupReach::kThisWorker && num_workers() > 1 ? in_process.make_group(subset)
                                                                               : cross_device_ops().make_group(subset);
    for (std::size_t k = 0; k < members.size(); ++k) out[members[k]] = std::move(communicators[k]);
  }
  return out;
}

collective::CommunicationStats ModelParallel::tensor_parallel_stats() {
  collective::CommunicationStats total = tensor_group_ ? tensor_group_->stats() : collective::CommunicationStats{};
  for (const auto& c : tensor_communicators_) total += c->stats();
  return total;
}

collective::CommunicationStats ModelParallel::pipeline_stats() {
  collective::CommunicationStats total;
  for (const auto& c : pipeline_communicators_) total += c->stats();
  return total;
}

void ModelParallel::abort_other_collectives(const std::string& reason) {
  if (!tensor_group_) return;
  tensor_group_->abort(reason);
  for (auto& c : tensor_communicators_) c->abort(reason);
  tensor_group_aborted_ = true;
}

void ModelParallel::prepare_tensor_parallel(const Model& model, const std::vector<VariableLayout>& layouts,
                                            const std::map<const Variable*, int>* home) const {
  std::map<std::string, const VariableLayout*> split_paths;
  for (const auto& v : layouts) {
    if (v.split_dim >= 0) split_paths[v.path] = &v;
  }
  if (split_paths.empty()) return;
  const DeviceMesh& mesh = device_mesh();
  const VariableLayout& first = *split_paths.begin()->second;
  // Everything is checked before anything is split: a refusal leaves the model as it was.
  for (const auto& [path, v] : split_paths) {
    TANDEM_REQUIRE(tensor_axis_ && v->axis == mesh.axis_names()[*tensor_axis_], Unimplemented,
                   "ModelParallel: {} splits '{}' over mesh axis '{}', but tensor parallelism runs over one axis, "
                   "'{}' here: split every layer over that axis",
                   v->layer, path, v->axis, tensor_axis_ ? mesh.axis_names()[*tensor_axis_] : std::string("none"));
  }
  const std::string& axis = first.axis;
  TANDEM_REQUIRE(tensor_group_ != nullptr, Unimplemented,
                 "ModelParallel: {} is split over mesh axis '{}', whose groups of {} devices are on some workers but "
                 "not all: lay out {} so that each group along '{}' is on one worker or spread evenly over every "
                 "worker",
                 first.layer, axis, first.parts, mesh.to_string(), axis);
  // ZeRO shards each piece's optimizer slots (stage 1), gradients (2) and the piece itself (3, the
  // executors gathering it per layer) along the batch axis: the data-parallel replicas holding it.
  for (const auto* device : replica_devices()) {
    TANDEM_REQUIRE(device->type() == devices::DeviceType::kCPU, Unimplemented,
                   "ModelParallel: {} is split over '{}', but tensor-parallel collectives have CPU kernels only, and "
                   "replica device {} is a {}",
                   first.layer, axis, device->short_name(),
                   device->type() == devices::DeviceType::kGPU ? "GPU" : "device");
  }
  std::vector<std::shared_ptr<LayerImpl>> layers;
  for (const auto& layer : model.layers()) collect(layer.ptr(), layers);
  std::map<const LayerImpl*, std::string> splits;
  for (const auto& layer : layers) {
    for (const auto& w : layer->own_weights()) {
      const auto it = split_paths.find(w->name());
      if (it == split_paths.end()) continue;
      const VariableLayout& v = *it->second;
      TANDEM_REQUIRE(layer->runs_tensor_parallel(v.split), Unimplemented,
                     "ModelParallel: {} is {}-split over '{}' ('{}' along dimension {}): a valid layout, which plan() "
                     "shows, but training this layer split is not built yet (tensor-parallel Dense, Conv2D, "
                     "MultiHeadAttention and Embedding are); keep its weights whole (no layout for them) to train",
                     v.layer, v.split, axis, v.path, v.split_dim);
      splits[layer.get()] = v.split;
    }
  }
  // Under a pipeline, a pair split by a stage boundary is two lone layers (the boundary carries a
  // whole activation).
  std::vector<std::size_t> cuts;
  if (home != nullptr) {
    std::size_t call = 0;
    for (std::size_t k = 0; k + 1 < planned_stages_.size(); ++k) cuts.push_back(call += planned_stages_[k].layer_calls);
  }
  const auto pairs = detail::tensor_parallel_pairs(*model.state(), splits, cuts);
  std::set<const LayerImpl*> paired_rows;
  for (const auto& [column, row] : pairs) paired_rows.insert(row);

  // The pieces: replica g holds piece (its coordinate on the model axis); under a pipeline, only
  // the replicas of the variable's stage hold one.
  for (const auto& layer : layers) {
    for (const auto& w : layer->own_weights()) {
      const auto it = split_paths.find(w->name());
      if (it == split_paths.end()) continue;
      const int stage = home == nullptr ? -1 : home->at(w.get());
      std::vector<int> piece_of_replica;
      for (const auto& c : coordinates_) {
        const bool here = home == nullptr || static_cast<int>(c[*stage_axis_]) == stage;
        piece_of_replica.push_back(here ? static_cast<int>(c[*tensor_axis_]) : -1);
      }
      w->split_into_pieces({.dim = it->second->split_dim,
                            .parts = static_cast<int>(it->second->parts),
                            .axis = axis,
                            .global_shape = w->global_shape(),
                            .piece_of_replica = std::move(piece_of_replica),
                            .group = tensor_group_});
    }
    const auto split = splits.find(layer.get());
    if (split == splits.end()) continue;
    // Logged once, when the layer is first prepared (check_model runs at compile and again
    // before the first step).
    const bool first_time = !layer->tensor_parallel_call();
    TensorParallelCall call{.split = split->second, .group = tensor_group_};
    if (split->second == "column") {
      call.output_split = pairs.contains(layer.get());
      if (!call.output_split && first_time) {
        logging::info(
            "ModelParallel: {} \"{}\" is column-split with no row-split Dense taking its output; its output "
            "is gathered over '{}' (one all-gather forward)",
            layer->class_name(), layer->name(), axis);
      }
    } else if (split->second == "row") {
      call.input_split = paired_rows.contains(layer.get());
      if (!call.input_split && first_time) {
        logging::info(
            "ModelParallel: {} \"{}\" is row-split with no column-split Dense giving its input; its input "
            "is split over '{}' (one all-gather backward)",
            layer->class_name(), layer->name(), axis);
      }
    }
    layer->set_tensor_parallel_call(std::move(call));
  }
}

}  // namespace tandem::keras::distribution
