// keras::distribution: checking a layout map against a model's layers (what ModelParallel does at
// compile), and LayoutMap::megatron's choice of Megatron-LM's column/row pairing for a model.
#include <algorithm>
#include <map>
#include <set>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/keras_like/detail/layouts.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/distribution.h"

namespace tandem::keras::distribution {
namespace {

// A model's layers in the order the checks visit them: each layer, then the layers it tracks (in
// tracking order), depth first.
void flatten_into(const std::shared_ptr<LayerImpl>& layer, std::vector<const LayerImpl*>& out) {
  out.push_back(layer.get());
  for (const auto& tracked : layer->tracked_layers()) flatten_into(tracked, out);
}

std::vector<const LayerImpl*> flat_layers(const std::vector<Layer>& layers) {
  std::vector<const LayerImpl*> out;
  for (const auto& layer : layers) flatten_into(layer.ptr(), out);
  return out;
}

std::string layer_label(const LayerImpl& layer) { return fmt::format("{} \"{}\"", layer.class_name(), layer.name()); }

// "kernel along dimension 1, bias along dimension 0": a split's weights, for messages.
std::string split_text(const TensorParallelSplit& split) {
  std::string out;
  for (const auto& [weight, dim] : split.weights) {
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", weight,
                       dim ? fmt::format("along dimension {}", *dim) : std::string("whole"));
  }
  return fmt::format("{} ({})", split.name, out);
}

// One weight's layout from the map, checked on its own: rank, batch axis, one split dimension
// that its axis's size divides.
VariableLayout weight_layout(const LayerImpl& layer, const Variable& weight, const LayoutMap& map,
                             std::string_view batch) {
  VariableLayout v{.path = weight.name(), .shape = weight.global_shape(), .layer = layer_label(layer)};
  const auto key = map.matching_key(v.path);
  if (!key) return v;
  v.key = *key;
  const TensorLayout layout = *map.get(*key);
  const DeviceMesh& mesh = map.device_mesh();
  TANDEM_REQUIRE(static_cast<int>(layout.axes().size()) == v.shape.rank(), InvalidArgument,
                 "ModelParallel: variable '{}' of shape {} has rank {} but layout_map['{}'] = {} has {} axes; give one "
                 "entry per dimension",
                 v.path, v.shape, v.shape.rank(), *key, layout.to_string(), layout.axes().size());
  for (int d = 0; d < v.shape.rank(); ++d) {
    const auto& axis = layout.axes()[static_cast<std::size_t>(d)];
    if (!axis) continue;
    const std::int64_t parts = mesh.axis_size(*axis);
    TANDEM_REQUIRE(*axis != batch || parts == 1, InvalidArgument,
                   "ModelParallel: variable '{}' of shape {} is split over the batch axis '{}' ({} devices) by "
                   "layout_map['{}'] = {}: the batch axis splits the data, not the weights (weights sharded among the "
                   "data-parallel replicas are ZeRO stage 3: DataParallel(mesh, {{.zero = ZeroStage::k3}}))",
                   v.path, v.shape, *axis, parts, *key, layout.to_string());
    if (parts == 1) continue;
    TANDEM_REQUIRE(v.split_dim < 0, InvalidArgument,
                   "ModelParallel: variable '{}' of shape {} is split along dimensions {} and {} by layout_map['{}'] = "
                   "{}; tensor parallelism splits a variable along one dimension",
                   v.path, v.shape, v.split_dim, d, *key, layout.to_string());
    TANDEM_REQUIRE(v.shape[d] % parts == 0, InvalidArgument,
                   "ModelParallel: variable '{}' of shape {} cannot be split over mesh axis '{}' ({} devices) along "
                   "dimension {}: {} is not a multiple of {} (layout_map['{}'] = {})",
                   v.path, v.shape, *axis, parts, d, v.shape[d], parts, *key, layout.to_string());
    v.split_dim = d;
    v.axis = *axis;
    v.parts = parts;
  }
  return v;
}

// The layer's weights' layouts together: whole, or exactly one of the layer's splits over one axis.
void check_layer(const LayerImpl& layer, std::vector<VariableLayout>& rows) {
  const auto split_row =
      std::find_if(rows.begin(), rows.end(), [](const VariableLayout& v) { return v.split_dim >= 0; });
  if (split_row == rows.end()) return;
  for (const auto& v : rows) {
    TANDEM_REQUIRE(v.split_dim < 0 || v.axis == split_row->axis, InvalidArgument,
                   "ModelParallel: {} splits '{}' over mesh axis '{}' but '{}' over '{}'; a layer's weights are split "
                   "over one axis",
                   v.layer, split_row->path, split_row->axis, v.path, v.axis);
  }
  const auto splits = layer.tensor_parallel_splits();
  TANDEM_REQUIRE(!splits.empty(), InvalidArgument,
                 "ModelParallel: {} has no tensor-parallel split, but layout_map['{}'] splits its variable '{}' of "
                 "shape {} over mesh axis '{}' ({} devices) along dimension {}: its weights must stay whole (a layout "
                 "of None, or no key)",
                 split_row->layer, split_row->key, split_row->path, split_row->shape, split_row->axis, split_row->parts,
                 split_row->split_dim);
  // rows[i] is own_weights()[i]'s layout (check_layouts builds them in that order).
  std::vector<std::string> names;
  std::string given;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    names.push_back(layer.weight_name(*layer.own_weights()[i]));
    given += fmt::format("{}{} {}", given.empty() ? "" : ", ", names[i],
                         rows[i].split_dim >= 0 ? fmt::format("along dimension {}", rows[i].split_dim)
                                                : std::string("whole"));
  }
  for (const auto& split : splits) {
    bool matches = true;
    for (std::size_t i = 0; i < rows.size() && matches; ++i) matches = split.dim_of(names[i]).value_or(-1) == rows[i].split_dim;
    if (!matches) continue;
    for (auto& v : rows) {
      if (v.split_dim >= 0) v.split = split.name;
    }
    return;
  }
  std::string supported;
  for (const auto& split : splits) supported += fmt::format("{}{}", supported.empty() ? "" : "; ", split_text(split));
  throw InvalidArgument(fmt::format(
      "ModelParallel: {} is laid out as {} over mesh axis '{}' ({} devices), which is none of the tensor-parallel "
      "splits {} supports: {}",
      split_row->layer, given, split_row->axis, split_row->parts, layer.class_name(), supported));
}

// "dense/kernel" as a LayoutMap key that matches that path only.
std::string exact_key(const std::string& path) {
  std::string out;
  for (const char c : path) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

bool divides(std::int64_t n, std::int64_t parts) { return n % parts == 0; }

}  // namespace

std::vector<VariableLayout> check_layouts(const Model& model, const LayoutMap& layout_map,
                                          std::string_view batch_dim_name, bool strict) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "ModelParallel: model \"{}\" is not built, so its variables do not exist yet; give the Sequential an "
                 "Input or call model.build(shape) first",
                 model.name());
  std::vector<VariableLayout> out;
  std::set<std::string> used;
  for (const LayerImpl* layer : flat_layers(model.layers())) {
    std::vector<VariableLayout> rows;
    for (const auto& w : layer->own_weights()) {
      rows.push_back(weight_layout(*layer, *w, layout_map, batch_dim_name));
      if (!rows.back().key.empty()) used.insert(rows.back().key);
    }
    check_layer(*layer, rows);
    for (auto& r : rows) out.push_back(std::move(r));
  }
  std::vector<std::string> unmatched;
  for (const auto& key : layout_map.keys()) {
    if (!used.contains(key)) unmatched.push_back(fmt::format("'{}'", key));
  }
  if (!unmatched.empty()) {
    std::string paths;
    for (std::size_t i = 0; i < out.size() && i < 12; ++i) paths += fmt::format("{}{}", i ? ", " : "", out[i].path);
    if (out.size() > 12) paths += fmt::format(", ... ({} in all)", out.size());
    std::string keys;
    for (const auto& k : unmatched) keys += fmt::format("{}{}", keys.empty() ? "" : ", ", k);
    const std::string message = fmt::format(
        "ModelParallel: layout_map key{} {} match{} no variable of model \"{}\" (a key is an exact path or a regular "
        "expression matched against the whole path); its variables are {}",
        unmatched.size() == 1 ? "" : "s", keys, unmatched.size() == 1 ? "es" : "", model.name(), paths);
    if (strict) throw InvalidArgument(message + " (ModelParallelOptions::strict = false makes this a warning)");
    logging::warn("{}", message);
  }
  return out;
}

LayoutMap LayoutMap::megatron(DeviceMesh mesh, std::string axis) {
  mesh.axis_size(axis);  // InvalidArgument naming the mesh's axes
  LayoutMap map(std::move(mesh));
  map.megatron_axis_ = std::move(axis);
  return map;
}

LayoutMap LayoutMap::resolve(const Model& model, std::vector<std::string>* notes) const {
  if (!megatron_axis_) return *this;
  LayoutMap out(mesh_);
  for (const auto& item : entries_) out.insert(item.key, item.layout);
  const std::string& axis = *megatron_axis_;
  const std::int64_t parts = mesh_.axis_size(axis);
  const auto note = [&](std::string line) {
    if (notes != nullptr) notes->push_back(std::move(line));
  };
  // Every weight of `layer` laid out as `split` says, over the axis.
  const auto lay_out = [&](const LayerImpl& layer, const TensorParallelSplit& split) {
    for (const auto& w : layer.own_weights()) {
      const auto dim = split.dim_of(layer.weight_name(*w));
      std::vector<std::optional<std::string>> axes(static_cast<std::size_t>(w->global_shape().rank()));
      if (dim) axes[static_cast<std::size_t>(*dim)] = axis;
      out.insert(exact_key(w->name()), TensorLayout(std::move(axes)));
    }
  };
  const auto split_named = [](const LayerImpl& layer, std::string_view name) {
    for (auto& s : layer.tensor_parallel_splits()) {
      if (s.name == name) return s;
    }
    throw Internal(fmt::format("{} declares no tensor-parallel split \"{}\"", layer_label(layer), name));
  };
  const LayerImpl* column = nullptr;  // a Dense waiting for its row-parallel partner
  const auto unpaired = [&] {
    if (column != nullptr) note(fmt::format("{} kept whole: no Dense follows it to pair with", layer_label(*column)));
    column = nullptr;
  };
  if (parts == 1) return out;
  for (const LayerImpl* layer : flat_layers(model.layers())) {
    const bool user_keyed = std::any_of(layer->own_weights().begin(), layer->own_weights().end(),
                                        [&](const auto& w) { return matching_key(w->name()).has_value(); });
    if (user_keyed) {
      unpaired();
      continue;
    }
    const std::string& kind = layer->class_name();
    if (kind == "Dense") {
      const Shape kernel = layer->own_weights()[0]->global_shape();  // [in, out]
      if (column != nullptr && divides(kernel[0], parts)) {
        lay_out(*column, split_named(*column, "column"));
        lay_out(*layer, split_named(*layer, "row"));
        column = nullptr;
        continue;
      }
      unpaired();
      if (divides(kernel[1], parts)) {
        column = layer;
      } else {
        note(fmt::format("{} kept whole: its {} output features do not divide by {} ('{}')", layer_label(*layer),
                         kernel[1], parts, axis));
      }
    } else if (kind == "MultiHeadAttention") {
      unpaired();
      const std::int64_t heads = layer->own_weights()[0]->global_shape()[1];  // query/kernel [in, heads, dim]
      if (divides(heads, parts)) {
        lay_out(*layer, split_named(*layer, "heads"));
      } else {
        note(fmt::format("{} kept whole: its {} heads do not divide by {} ('{}')", layer_label(*layer), heads, parts,
                         axis));
      }
    } else if (layer->elementwise() || (layer->own_weights().empty() && !layer->tracked_layers().empty())) {
      // Passes a column-parallel output through (or holds layers visited next).
    } else {
      unpaired();
    }
  }
  unpaired();
  return out;
}

namespace detail {

std::map<const LayerImpl*, const LayerImpl*> tensor_parallel_pairs(
    const ModelState& state, const std::map<const LayerImpl*, std::string>& splits, const std::vector<std::size_t>& cuts) {
  std::map<const LayerNode*, std::vector<const LayerNode*>> consumers;
  std::map<const LayerImpl*, int> calls;
  for (const auto& node : state.nodes) {
    if (node->layer != nullptr) ++calls[node->layer.get()];
    for (const auto& in : node->inputs) consumers[in.node().get()].push_back(node.get());
  }
  std::set<const LayerNode*> outputs;
  for (const auto& out : state.outputs) outputs.insert(out.node().get());
  const auto split_of = [&](const LayerNode* node) {
    const auto it = splits.find(node->layer.get());
    return it == splits.end() || calls[node->layer.get()] != 1 ? std::string() : it->second;
  };
  std::map<const LayerNode*, std::size_t> index;
  for (std::size_t n = 0; n < state.nodes.size(); ++n) index[state.nodes[n].get()] = n;
  // Whether a cut (the first call of a later stage) falls in (from, to].
  const auto cut_between = [&](const LayerNode* from, const LayerNode* to) {
    return std::any_of(cuts.begin(), cuts.end(), [&](std::size_t c) { return index[from] < c && c <= index[to]; });
  };
  std::map<const LayerImpl*, const LayerImpl*> pairs;
  for (const auto& node : state.nodes) {
    if (node->layer == nullptr || split_of(node.get()) != "column") continue;
    const LayerNode* at = node.get();
    while (!outputs.contains(at) && consumers[at].size() == 1 && consumers[at][0]->inputs.size() == 1) {
      const LayerNode* next = consumers[at][0];
      if (cut_between(node.get(), next)) break;
      if (split_of(next) == "row") {
        pairs[node->layer.get()] = next->layer.get();
        break;
      }
      if (!next->layer->elementwise() || calls[next->layer.get()] != 1) break;
      at = next;
    }
  }
  return pairs;
}

std::vector<PlannedCollective> tensor_parallel_collectives(const Model& model,
                                                           const std::vector<VariableLayout>& layouts) {
  std::map<std::string, const VariableLayout*> by_path;
  for (const auto& v : layouts) by_path[v.path] = &v;
  std::map<const LayerImpl*, std::string> splits;
  for (const LayerImpl* layer : flat_layers(model.layers())) {
    for (const auto& w : layer->own_weights()) {
      const auto it = by_path.find(w->name());
      if (it != by_path.end() && it->second->split_dim >= 0) splits[layer] = it->second->split;
    }
  }
  std::map<const LayerImpl*, const LayerImpl*> pairs;
  if (model.built() && !splits.empty()) pairs = tensor_parallel_pairs(*model.state(), splits);
  std::set<const LayerImpl*> paired_rows;
  for (const auto& [column, row] : pairs) paired_rows.insert(row);
  std::vector<PlannedCollective> out;
  // Backward computes no input gradient for a layer that no trained layer precedes (what it
  // reads is data), so Megatron's f operator has nothing to all-reduce there.
  bool trained_before = false;
  for (const LayerImpl* layer : flat_layers(model.layers())) {
    const VariableLayout* split = nullptr;
    for (const auto& w : layer->own_weights()) {
      const auto it = by_path.find(w->name());
      if (it != by_path.end() && it->second->split_dim >= 0) split = it->second;
    }
    const bool input_gradient = trained_before;
    const auto& own = layer->own_weights();
    if (layer->trainable() && std::any_of(own.begin(), own.end(), [](const auto& w) { return w->trainable(); })) {
      trained_before = true;
    }
    if (split == nullptr) continue;
    const auto t = static_cast<double>(split->parts);
    const auto element = static_cast<double>(graph::dtype_size(layer->compute_dtype()));
    const double all_reduce = 2 * (t - 1) / t, all_gather = (t - 1) / t;
    const Shape first = layer->own_weights()[0]->global_shape();
    const auto features = [](const Shape& s, int from) {
      double n = 1;
      for (int d = from; d < s.rank(); ++d) n *= static_cast<double>(s[d]);
      return n;
    };
    const auto add = [&](std::string op, std::string what, double elements, double factor) {
      out.push_back({.op = std::move(op),
                     .what = fmt::format("{} {}", layer->name(), what),
                     .bytes_per_device = factor * elements * element,
                     .per_row = true});
    };
    // A column layer without its row partner gathers its output; a row layer without its column
    // partner splits its input here, and gathers that input's gradient in backward.
    if (split->split == "column") {
      if (input_gradient) add("all_reduce", "input gradient (backward)", static_cast<double>(first[0]), all_reduce);
      if (!pairs.contains(layer)) add("all_gather", "output (forward)", static_cast<double>(first[1]), all_gather);
    } else if (split->split == "row") {
      add("all_reduce", "output (forward)", static_cast<double>(first[1]), all_reduce);
      if (!paired_rows.contains(layer) && input_gradient)
        add("all_gather", "input gradient (backward)", static_cast<double>(first[0]), all_gather);
    } else if (split->split == "vocabulary") {
      add("all_reduce", "output (forward)", static_cast<double>(first[1]), all_reduce);
    } else if (split->split == "output") {
      add("all_gather", "output (forward)", static_cast<double>(first[1]), all_gather);
    } else if (split->split == "heads") {
      const auto& w = layer->own_weights();
      const auto output = std::find_if(
          w.begin(), w.end(), [&](const auto& v) { return layer->weight_name(*v) == "attention_output/kernel"; });
      add("all_reduce", "output (forward)", features((*output)->global_shape(), 2), all_reduce);
      if (input_gradient)
        add("all_reduce", "query input gradient (backward)", static_cast<double>(first[0]), all_reduce);
    } else if (split->split == "output_channels") {
      add("all_gather", "output channels (forward, per output position)", static_cast<double>(first[3]), all_gather);
      if (input_gradient) {
        add("all_reduce", "input gradient (backward, per input position)", static_cast<double>(first[2]), all_reduce);
      }
    }
  }
  return out;
}

}  // namespace detail

void ModelParallel::check_model(const Model& model) const {
  const LayoutMap resolved = layout_map_.resolve(model);
  const auto layouts = check_layouts(model, resolved, batch_dim_name(), strict_);
  const DeviceMesh& mesh = device_mesh();
  const std::string stage_axis = pipeline_ ? pipeline_->stage_axis : std::string();
  std::vector<PlannedStage> stages;
  if (pipeline_) stages = cut_into_stages(model, pipeline_->stages, pipeline_->cuts);
  for (std::size_t a = 0; a < mesh.axis_names().size(); ++a) {
    const std::string& axis = mesh.axis_names()[a];
    if (axis == batch_dim_name() || axis == stage_axis || mesh.shape()[a] == 1) continue;
    const auto first =
        std::find_if(layouts.begin(), layouts.end(), [&](const VariableLayout& v) { return v.axis == axis; });
    TANDEM_REQUIRE(first != layouts.end(), InvalidArgument,
                   "ModelParallel: {} has {} devices along axis '{}', but no layout splits a variable of model \"{}\" "
                   "over it, so each of those devices would compute the same rows; give that axis one device, or "
                   "layouts that split over it (LayoutMap::megatron(mesh, \"{}\"))",
                   mesh.to_string(), mesh.shape()[a], axis, model.name(), axis);
  }
  if (pipeline_ && pipeline_->stages > 1) {
    if (pipeline_->virtual_stages > 1) {
      stages = cut_into_stages(model, pipeline_->stages * pipeline_->virtual_stages, pipeline_->cuts);
    }
    prepare_pipeline(model, stages, layouts);
    return;
  }
  prepare_tensor_parallel(model, layouts);
}

}  // namespace tandem::keras::distribution
