#include "tandem/keras_like/layer.h"

#include <cctype>
#include <map>
#include <mutex>

#include "tandem/base/random.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/strategy.h"

namespace tandem::keras {
namespace {

// Keras's to_snake_case: "Conv2D" -> "conv2d", "MaxPooling2D" -> "max_pooling2d".
std::string snake_case(std::string_view name) {
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (std::isupper(c) && i > 0) {
      const auto prev = static_cast<unsigned char>(name[i - 1]);
      const bool next_lower = i + 1 < name.size() && std::islower(static_cast<unsigned char>(name[i + 1]));
      if (std::islower(prev) || (next_lower && prev != '_' && !std::isdigit(prev))) out += '_';
    }
    out += static_cast<char>(std::tolower(c));
  }
  return out;
}

}  // namespace

std::string unique_layer_name(std::string_view class_name) {
  static std::mutex mutex;
  static std::map<std::string, int> counts;
  const std::string base = snake_case(class_name);
  std::lock_guard lock(mutex);
  const int n = counts[base]++;
  return n == 0 ? base : fmt::format("{}_{}", base, n);
}

const TensorSpec& KerasTensor::spec() const {
  TANDEM_REQUIRE(defined(), InvalidArgument, "use of an undefined KerasTensor");
  return node_->outputs[static_cast<std::size_t>(index_)];
}

std::string KerasTensor::name() const {
  if (!defined()) return "<undefined>";
  const std::string& owner = node_->layer ? node_->layer->name() : node_->input_name;
  return fmt::format("{}:{}", owner, index_);
}

KerasTensor Input(const Shape& shape, DType dtype, std::string name) {
  Shape full{Shape::kUnknown};
  for (auto d : shape.dims()) {
    TANDEM_REQUIRE(d > 0 || d == Shape::kUnknown, InvalidArgument, "Input shape {} has a dimension {}", shape, d);
    full.push_back(d);
  }
  auto node = std::make_shared<detail::LayerNode>();
  node->outputs.push_back(TensorSpec{dtype, full});
  node->input_name = name.empty() ? unique_layer_name("InputLayer") : std::move(name);
  return KerasTensor(std::move(node), 0);
}

const std::any CallContext::kNoArguments;

Output CallContext::read(const VariablePtr& variable) {
  const Output node = read_variable(variable);
  if (!autocast_dtype_ || !graph::is_floating(node.dtype()) || node.dtype() == *autocast_dtype_) return node;
  auto it = variables_.casts.find(variable.get());
  if (it != variables_.casts.end() && it->second.dtype() == *autocast_dtype_) return it->second;
  // One cast per variable and graph, made outside any layer's name scope would be nicer to read;
  // it is made where the first reader is, which is where Keras's AutoCastVariable reads too.
  const Output cast = ops::cast(node, *autocast_dtype_);
  variables_.casts[variable.get()] = cast;
  return cast;
}

Output CallContext::read_variable(const VariablePtr& variable) {
  TANDEM_REQUIRE(variable != nullptr, InvalidArgument, "CallContext::read of a null variable");
  auto it = variables_.nodes.find(variable.get());
  if (it != variables_.nodes.end()) return it->second;
  const Output node = graph_.variable(variable->dtype(), variable->graph_shape(), variable->name());
  variables_.nodes.emplace(variable.get(), node);
  variables_.variables.push_back(variable);
  return node;
}

void CallContext::add_update(const VariablePtr& variable, Output new_value) {
  if (!training_) return;
  TANDEM_REQUIRE(new_value.dtype() == variable->dtype() && new_value.shape().compatible_with(variable->shape()),
                 InvalidArgument, "update of variable \"{}\": {} {} does not match its {} {}", variable->name(),
                 new_value.dtype(), new_value.shape(), variable->dtype(), variable->shape());
  updates_.emplace_back(variable, new_value);
}

LayerImpl::LayerImpl(std::string_view class_name, std::string name)
    : class_name_(class_name), name_(name.empty() ? unique_layer_name(class_name) : std::move(name)) {}

LayerImpl::~LayerImpl() = default;

void LayerImpl::build(const std::vector<TensorSpec>& /*inputs*/) {}

std::string LayerImpl::label() const { return fmt::format("{} \"{}\"", class_name_, name_); }

std::vector<VariablePtr> LayerImpl::weights() const {
  std::vector<VariablePtr> out = weights_;
  for (const auto& layer : tracked_) {
    for (auto& w : layer->weights()) out.push_back(std::move(w));
  }
  return out;
}

std::vector<VariablePtr> LayerImpl::trainable_weights() const {
  std::vector<VariablePtr> out;
  if (!trainable_) return out;
  for (const auto& w : weights_) {
    if (w->trainable()) out.push_back(w);
  }
  for (const auto& layer : tracked_) {
    for (auto& w : layer->trainable_weights()) out.push_back(std::move(w));
  }
  return out;
}

std::vector<VariablePtr> LayerImpl::non_trainable_weights() const {
  if (!trainable_) return weights();
  std::vector<VariablePtr> out;
  for (const auto& w : weights_) {
    if (!w->trainable()) out.push_back(w);
  }
  for (const auto& layer : tracked_) {
    for (auto& w : layer->non_trainable_weights()) out.push_back(std::move(w));
  }
  return out;
}

std::int64_t LayerImpl::count_params() const {
  std::int64_t n = 0;
  for (const auto& w : weights()) n += w->global_shape().num_elements();
  return n;
}

void LayerImpl::track(const Layer& layer) {
  TANDEM_REQUIRE(layer.defined() && layer.ptr().get() != this, InvalidArgument,
                 "{}: track() needs another layer; got {}", label(), layer.defined() ? "itself" : "an empty handle");
  for (const auto& t : tracked_) {
    TANDEM_REQUIRE(t != layer.ptr(), InvalidArgument, "{}: {} is tracked already", label(), layer->label());
  }
  TANDEM_REQUIRE(!layer->built(), InvalidArgument,
                 "{}: {} is built already; track the layers it holds before building them (in its constructor)",
                 label(), layer->label());
  tracked_.push_back(layer.ptr());
  layer->set_path_prefix(path_prefix_ + name_ + "/");
}

void LayerImpl::set_path_prefix(const std::string& prefix) {
  path_prefix_ = prefix;
  for (const auto& t : tracked_) t->set_path_prefix(path_prefix_ + name_ + "/");
}

std::optional<int> TensorParallelSplit::dim_of(std::string_view weight) const {
  for (const auto& [weight_name, dim] : weights) {
    if (weight_name == weight) return dim;
  }
  return std::nullopt;
}

std::string LayerImpl::weight_name(const Variable& weight) const {
  const std::string prefix = path_prefix_ + name_ + "/";
  const std::string& path = weight.name();
  return path.starts_with(prefix) ? path.substr(prefix.size()) : path;
}

VariablePtr LayerImpl::add_weight(const WeightOptions& options) {
  TANDEM_REQUIRE(options.shape.is_fully_defined(), InvalidArgument,
                 "{}: weight \"{}\" has shape {}; it must be fully defined", label(), options.name, options.shape);
  strategy::VariableOptions variable;
  variable.name = fmt::format("{}{}/{}", path_prefix_, name_, options.name);
  variable.initial_value =
      options.initializer(options.shape, options.dtype.value_or(dtype_policy_.variable_dtype()), next_seed());
  variable.trainable = options.trainable;
  auto created = strategy::get_strategy().create_variable(std::move(variable));
  weights_.push_back(created);
  return created;
}

std::vector<Output> LayerImpl::call_with_policy(CallContext& ctx, std::vector<Output> inputs,
                                                const std::any& arguments) {
  // The context is shared by every layer of the graph: what this call sets, it restores (a
  // custom layer's call() calls the layers it holds through here too).
  struct Restore {
    CallContext& ctx;
    std::optional<DType> autocast = ctx.autocast_dtype();
    const std::any* arguments = &ctx.arguments();
    ~Restore() {
      ctx.set_autocast_dtype(autocast);
      ctx.set_arguments(arguments);
    }
  } restore{ctx};
  ctx.set_arguments(&arguments);
  if (!autocast()) {
    // A layer that handles its dtypes itself reads its variables as they are.
    ctx.set_autocast_dtype(std::nullopt);
    return call(ctx, inputs);
  }
  const DType compute = dtype_policy_.compute_dtype();
  for (auto& in : inputs) {
    const bool cast = graph::is_floating(in.dtype()) && in.dtype() != compute &&
                      (dtype_policy_.is_mixed() || graph::is_low_precision(in.dtype()));
    if (cast) in = ops::cast(in, compute);
  }
  ctx.set_autocast_dtype(dtype_policy_.is_mixed() ? std::optional<DType>(compute) : std::nullopt);
  return call(ctx, inputs);
}

void LayerImpl::ensure_built(const std::vector<TensorSpec>& inputs) {
  const int n = static_cast<int>(inputs.size());
  TANDEM_REQUIRE(n >= min_inputs() && (max_inputs() < 0 || n <= max_inputs()), InvalidArgument,
                 "{}: called on {} input(s); it takes {}", label(), n,
                 max_inputs() < 0               ? fmt::format("at least {}", min_inputs())
                 : min_inputs() == max_inputs() ? fmt::format("{}", min_inputs())
                                                : fmt::format("{} to {}", min_inputs(), max_inputs()));
  if (built_) return;
  build(inputs);
  built_ = true;
}

std::vector<KerasTensor> LayerImpl::call_symbolic(const std::vector<KerasTensor>& inputs, std::any arguments) {
  std::vector<TensorSpec> specs;
  for (const auto& in : inputs) {
    TANDEM_REQUIRE(in.defined(), InvalidArgument, "{}: called on an undefined KerasTensor", label());
    specs.push_back(in.spec());
  }
  ensure_built(specs);
  // The output specs come from the layer's own ops: call it once on placeholders in a scratch
  // graph, so that shape errors are raised now, at model construction, naming the layer.
  Graph scratch;
  CallContext::VariableNodes variables;
  CallContext context(scratch, /*training=*/false, variables);
  std::vector<Output> placeholders;
  for (const auto& spec : specs) placeholders.push_back(scratch.placeholder(spec.dtype, spec.shape, "input"));
  const auto outputs = call_with_policy(context, placeholders, arguments);
  auto node = std::make_shared<detail::LayerNode>();
  node->layer = shared_from_this();
  node->inputs = inputs;
  node->arguments = std::move(arguments);
  for (const auto& o : outputs) node->outputs.push_back(o.spec());
  std::vector<KerasTensor> result;
  for (int i = 0; i < static_cast<int>(outputs.size()); ++i) result.emplace_back(node, i);
  return result;
}

LayerImpl& Layer::impl() const {
  TANDEM_REQUIRE(impl_ != nullptr, FailedPrecondition, "use of an empty Layer handle");
  return *impl_;
}

KerasTensor Layer::operator()(const KerasTensor& input) const {
  auto outputs = impl().call_symbolic({input});
  TANDEM_REQUIRE(outputs.size() == 1, InvalidArgument, "{} \"{}\" returns {} outputs; call it with a vector",
                 impl().class_name(), impl().name(), outputs.size());
  return outputs.front();
}

LayerOutputs Layer::operator()(const std::vector<KerasTensor>& inputs) const {
  return LayerOutputs(impl().call_symbolic(inputs));
}

std::vector<Output> Layer::operator()(CallContext& ctx, const std::vector<Output>& inputs,
                                     const std::any& arguments) const {
  LayerImpl& layer = impl();
  std::vector<TensorSpec> specs;
  for (const auto& in : inputs) {
    TANDEM_REQUIRE(in.defined(), InvalidArgument, "{} \"{}\": called on an undefined graph output",
                   layer.class_name(), layer.name());
    specs.push_back(TensorSpec{in.dtype(), in.shape().rank() > 0 ? in.shape().with_dim(0, Shape::kUnknown) : in.shape()});
  }
  layer.ensure_built(specs);
  auto scope = ctx.graph().name_scope(layer.name());
  return layer.call_with_policy(ctx, inputs, arguments);
}

Output Layer::operator()(CallContext& ctx, Output input) const {
  auto outputs = (*this)(ctx, std::vector<Output>{input});
  TANDEM_REQUIRE(outputs.size() == 1, InvalidArgument, "{} \"{}\" returns {} outputs; call it with a vector",
                 impl().class_name(), impl().name(), outputs.size());
  return outputs.front();
}

LayerOutputs::operator KerasTensor() const {
  TANDEM_REQUIRE(size() == 1, InvalidArgument, "a layer call with {} outputs used as one tensor; index it instead",
                 size());
  return front();
}

}  // namespace tandem::keras
