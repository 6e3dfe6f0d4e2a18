// tandem/keras_like/layer.h — layers, symbolic tensors, and how a layer adds itself to a graph.
//
// A Layer is a handle (cheap to copy; copies share one layer) to a LayerImpl. Calling a layer on
// a KerasTensor (the functional API) builds the layer's weights on first use — through the
// strategy whose scope is active, so they are mirrored on every replica — and returns the
// symbolic output:
//
//   auto x = keras::Input({28, 28});
//   auto h = keras::Dense(128, "relu")(keras::Flatten()(x));
//   keras::Model model(x, keras::Dense(10)(h));
//
// When the model trains, each layer's call() adds its ops to the replica graph, reading its
// weights through the CallContext. A custom layer derives from LayerImpl, creates weights in
// build() with add_weight(), and overrides call(); it may hold other layers (track() them in its
// constructor, call them inside its call() with Layer::operator()(CallContext&, ...)), whose
// weights then count among its own:
//
//   class Block : public keras::LayerImpl {
//    public:
//     Block() : LayerImpl("Block", "") { track(norm_); track(dense_); }
//     std::vector<Output> call(keras::CallContext& ctx, const std::vector<Output>& in) override {
//       return {in[0] + dense_(ctx, norm_(ctx, in[0]))};
//     }
//    private:
//     keras::LayerNormalization norm_;
//     keras::Dense dense_{64, "gelu"};
//   };
//   auto y = keras::Layer(std::make_shared<Block>())(x);
//
// Nothing here blocks; errors are InvalidArgument naming the layer.
#pragma once

#include <any>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/graph/graph.h"
#include "tandem/keras_like/initializers.h"
#include "tandem/keras_like/mixed_precision.h"
#include "tandem/strategy/variable.h"

namespace tandem::keras {

using graph::Output;
using graph::TensorSpec;
using strategy::Variable;
using VariablePtr = std::shared_ptr<Variable>;

class Layer;
class LayerImpl;

namespace detail {
struct LayerNode;  // one call of a layer in a functional model
}

// A symbolic tensor: an output of a layer call (or a model input). Its shape starts with the
// batch dimension, unknown (None, -1).
class KerasTensor {
 public:
  KerasTensor() = default;
  KerasTensor(std::shared_ptr<detail::LayerNode> node, int index) : node_(std::move(node)), index_(index) {}

  bool defined() const { return node_ != nullptr; }
  const TensorSpec& spec() const;
  const Shape& shape() const { return spec().shape; }
  DType dtype() const { return spec().dtype; }
  std::string name() const;  // "dense_1:0"

  const std::shared_ptr<detail::LayerNode>& node() const { return node_; }
  int index() const { return index_; }

 private:
  std::shared_ptr<detail::LayerNode> node_;
  int index_ = 0;
};

// A model input of `shape` (without the batch dimension), like keras.Input.
KerasTensor Input(const Shape& shape, DType dtype = DType::kF32, std::string name = "");

// What a layer's call() works with: the graph being built, whether it is the training pass
// (Dropout drops, BatchNormalization uses batch statistics), and its weights as graph nodes.
class CallContext {
 public:
  // Graph nodes of variables, shared by every CallContext of one graph.
  struct VariableNodes {
    std::unordered_map<const Variable*, Output> nodes;
    std::vector<VariablePtr> variables;                 // in first-use order
    std::unordered_map<const Variable*, Output> casts;  // autocast reads, one per variable
  };

  CallContext(Graph& graph, bool training, VariableNodes& variables)
      : graph_(graph), training_(training), variables_(variables) {}

  Graph& graph() const { return graph_; }
  bool training() const { return training_; }
  // The node reading `variable` in this graph (a Variable node, made on first use). While a
  // layer with a mixed policy is being called, a floating variable is read through a cast to the
  // layer's compute dtype (Keras's AutoCastVariable); read_variable() always gives the variable.
  Output read(const VariablePtr& variable);
  Output read_variable(const VariablePtr& variable);
  // The dtype read() casts floating variables to; unset outside mixed-policy layer calls.
  void set_autocast_dtype(std::optional<DType> dtype) { autocast_dtype_ = dtype; }
  std::optional<DType> autocast_dtype() const { return autocast_dtype_; }
  // After a training step, `variable` takes the value `new_value` computed in this step
  // (BatchNormalization's moving statistics). Only collected in the training pass.
  void add_update(const VariablePtr& variable, Output new_value);
  const std::vector<std::pair<VariablePtr, Output>>& updates() const { return updates_; }
  // The arguments of the layer call being made besides its input tensors (Keras's keyword call
  // arguments, e.g. MultiHeadAttention's use_causal_mask), as the layer's own call operator
  // recorded them; empty when it took none. Set by LayerImpl::call_with_policy for the call.
  const std::any& arguments() const { return *arguments_; }
  void set_arguments(const std::any* arguments) { arguments_ = arguments; }

 private:
  static const std::any kNoArguments;

  Graph& graph_;
  bool training_;
  VariableNodes& variables_;
  std::vector<std::pair<VariablePtr, Output>> updates_;
  std::optional<DType> autocast_dtype_;
  const std::any* arguments_ = &kNoArguments;
};

struct WeightOptions {
  std::string name;  // "kernel"; the variable is named "<layer>/<name>"
  Shape shape;
  Initializer initializer = "glorot_uniform";
  bool trainable = true;
  // Default: the layer's variable dtype (float32, or float64 under a "float64" policy).
  std::optional<DType> dtype;
};

// One way tensor parallelism may split a layer's weights over one mesh axis (Megatron-LM's
// column- and row-parallel linear layers, vocabulary-parallel embeddings, attention split over
// heads). `weights` gives, per weight of the layer (its name within the layer: "kernel",
// "query/bias"), the dimension the axis splits, or nullopt for a weight every device holds whole;
// a weight not listed is held whole. keras::distribution::ModelParallel accepts a layer's layouts
// only when they are exactly one of its splits, all over one axis (check_layouts).
struct TensorParallelSplit {
  std::string name;    // "column", "row", "vocabulary", "output", "heads", "output_channels"
  std::string effect;  // what it communicates: "output split by features; input gradient all-reduced"
  std::vector<std::pair<std::string, std::optional<int>>> weights;

  // The dimension `weight` is split along (nullopt: whole).
  std::optional<int> dim_of(std::string_view weight) const;
};

// How a layer whose weights tensor parallelism split computes (set by
// keras::distribution::ModelParallel at compile, from the checked layouts and the model's graph;
// unset for a layer whose weights are whole). The layer's call then inserts the group's
// collectives (strategy/tensor_parallel.h): Megatron's f before a column-parallel layer, g after a
// row-parallel one, a gather after a column-parallel layer whose output no row-parallel layer
// takes, a scatter before a row-parallel layer whose input arrives whole.
struct TensorParallelCall {
  std::string split;  // the layer's TensorParallelSplit: "column", "row"
  std::shared_ptr<strategy::tensor_parallel::Group> group;
  bool input_split = false;   // row: the input arrives split by features (a column-parallel layer's)
  bool output_split = false;  // column: the output leaves split (a row-parallel layer takes it)
};

class LayerImpl : public std::enable_shared_from_this<LayerImpl> {
 public:
  // class_name: "Dense"; name: "" for a unique default from the class ("dense", "dense_1", ...).
  LayerImpl(std::string_view class_name, std::string name);
  virtual ~LayerImpl();
  LayerImpl(const LayerImpl&) = delete;
  LayerImpl& operator=(const LayerImpl&) = delete;

  const std::string& name() const { return name_; }
  const std::string& class_name() const { return class_name_; }
  bool built() const { return built_; }
  // A frozen layer's weights are not trained (they still count as weights).
  bool trainable() const { return trainable_; }
  void set_trainable(bool trainable) { trainable_ = trainable; }
  // The dtype policy: the global one when the layer was made (see mixed_precision.h).
  const mixed_precision::Policy& dtype_policy() const { return dtype_policy_; }
  void set_dtype_policy(const mixed_precision::Policy& policy) { dtype_policy_ = policy; }
  DType compute_dtype() const { return dtype_policy_.compute_dtype(); }
  // Whether the model casts this layer's floating inputs to its compute dtype and reads its
  // variables through casts. BatchNormalization says no: it computes in float32 itself.
  virtual bool autocast() const { return true; }

  // Creates the weights for inputs of these specs (batch dimension unknown). Called once, on the
  // first call, under the strategy scope active then.
  virtual void build(const std::vector<TensorSpec>& inputs);
  // Adds the layer's computation on `inputs` to ctx.graph() and returns its outputs. Throws
  // InvalidArgument naming the layer for inputs it cannot take. Arguments other than tensors
  // arrive in ctx.arguments().
  virtual std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) = 0;
  // call() under the layer's dtype policy, which is how models call layers: Keras's autocast. A
  // mixed-policy layer computes in its compute dtype (floating inputs cast down, variables read
  // through casts); a layer computing in float32 or wider casts 16-bit inputs up. `arguments`
  // are what call() finds in ctx.arguments() (the call's recorded ones when a model replays it).
  std::vector<Output> call_with_policy(CallContext& ctx, std::vector<Output> inputs,
                                       const std::any& arguments = {});
  // How many inputs a call takes: [min_inputs(), max_inputs()] (max -1: any number).
  virtual int min_inputs() const { return 1; }
  virtual int max_inputs() const { return 1; }
  // The tensor-parallel splits this layer supports (above); none by default: a layer that does
  // not declare a split keeps its weights whole on every device, and a layout that splits them is
  // refused at compile.
  virtual std::vector<TensorParallelSplit> tensor_parallel_splits() const { return {}; }
  // Whether the layer maps each feature on its own (Dropout; an Activation other than softmax): a
  // tensor-parallel split activation may pass through it from a column-parallel layer to the
  // row-parallel layer that follows.
  virtual bool elementwise() const { return false; }
  // Whether call() runs the split `name` (one of tensor_parallel_splits()) with its weights split;
  // a layer that declares a split for plan() only answers false, and ModelParallel refuses to
  // train it split.
  virtual bool runs_tensor_parallel(std::string_view /*name*/) const { return false; }
  const std::optional<TensorParallelCall>& tensor_parallel_call() const { return tensor_parallel_; }
  void set_tensor_parallel_call(std::optional<TensorParallelCall> call) { tensor_parallel_ = std::move(call); }

  // Weights: the layer's own in creation order, then those of the layers it tracks, in tracking
  // order. trainable_weights() is empty for a frozen layer (and its tracked layers then count as
  // frozen too).
  std::vector<VariablePtr> weights() const;
  std::vector<VariablePtr> trainable_weights() const;
  std::vector<VariablePtr> non_trainable_weights() const;
  std::int64_t count_params() const;
  // The layer's own weights (not those of the layers it tracks), in creation order, and the
  // layers it tracks, in tracking order.
  const std::vector<VariablePtr>& own_weights() const { return weights_; }
  const std::vector<std::shared_ptr<LayerImpl>>& tracked_layers() const { return tracked_; }
  // A weight's name within this layer: "kernel" for the variable "block/dense/kernel" of the
  // Dense "dense" that "block" tracks.
  std::string weight_name(const Variable& weight) const;

  // The functional API: builds on first use, infers the output specs, records the call with its
  // arguments (given to call() in ctx.arguments() every time the model runs it).
  std::vector<KerasTensor> call_symbolic(const std::vector<KerasTensor>& inputs, std::any arguments = {});
  // Builds (once) for these input specs; checks the input count. Later calls with other specs
  // are checked by call() (Dense "dense": input has 28 features, kernel expects 784).
  void ensure_built(const std::vector<TensorSpec>& inputs);

 protected:
  // Creates a weight through the current strategy (get_strategy()), initialised with a seed
  // drawn from the global seed.
  VariablePtr add_weight(const WeightOptions& options);
  // Makes `layer` part of this one, as Keras tracks the layers a custom layer holds: its weights
  // count among this layer's (a model lists them, saves them, trains them), after this layer's
  // own, and are named under this layer's name as Keras 3 names them ("block/dense/kernel"). Call
  // it in the constructor, before the held layer is built, once per held layer; a tracked layer
  // belongs to this layer only (calling it from the model too would list its weights twice).
  void track(const Layer& layer);
  // "Dense \"dense_1\"": how errors name the layer.
  std::string label() const;

 private:
  std::string class_name_;
  std::string name_;
  bool built_ = false;
  bool trainable_ = true;
  mixed_precision::Policy dtype_policy_ = mixed_precision::global_policy();
  std::vector<VariablePtr> weights_;
  std::vector<std::shared_ptr<LayerImpl>> tracked_;
  std::string path_prefix_;  // "block/" for a layer that "block" tracks: its weights' names start so
  std::optional<TensorParallelCall> tensor_parallel_;

  void set_path_prefix(const std::string& prefix);
};

// What a layer call on several inputs returns: its outputs, and (for a layer with one output)
// the output itself, so that `KerasTensor sum = keras::Add()({a, b});` reads like Keras.
class LayerOutputs : public std::vector<KerasTensor> {
 public:
  using std::vector<KerasTensor>::vector;
  explicit LayerOutputs(std::vector<KerasTensor> outputs) : std::vector<KerasTensor>(std::move(outputs)) {}
  // The single output; InvalidArgument when there are several.
  operator KerasTensor() const;  // NOLINT(google-explicit-constructor)
};

// A handle to a layer. Layer classes (Dense, Conv2D, ...) derive from it and construct the
// matching LayerImpl.
class Layer {
 public:
  Layer() = default;
  explicit Layer(std::shared_ptr<LayerImpl> impl) : impl_(std::move(impl)) {}

  KerasTensor operator()(const KerasTensor& input) const;
  LayerOutputs operator()(const std::vector<KerasTensor>& inputs) const;
  // Calls the layer inside another layer's call() (a custom layer holding it): builds it on
  // first use for these inputs' specs (under the strategy scope active then), names its ops
  // under its name, and returns its outputs. `arguments`: see CallContext::arguments().
  std::vector<Output> operator()(CallContext& ctx, const std::vector<Output>& inputs,
                                 const std::any& arguments = {}) const;
  // The same for a layer with one input and one output.
  Output operator()(CallContext& ctx, Output input) const;

  bool defined() const { return impl_ != nullptr; }
  LayerImpl& impl() const;
  LayerImpl* operator->() const { return &impl(); }
  const std::string& name() const { return impl().name(); }
  const std::shared_ptr<LayerImpl>& ptr() const { return impl_; }
  // Gives this layer its own dtype policy ("float32" for an output layer under a mixed policy,
  // Keras's `dtype="float32"`). Returns the handle, so it chains: Dense(10).set_dtype_policy("float32").
  const Layer& set_dtype_policy(std::string_view policy) const {
    impl().set_dtype_policy(mixed_precision::Policy(policy));
    return *this;
  }

 private:
  std::shared_ptr<LayerImpl> impl_;
};

// A unique layer name for a class ("Dense" -> "dense", "dense_1", ...), as Keras numbers them.
std::string unique_layer_name(std::string_view class_name);

namespace detail {
// One call of a layer: the inputs it took and the specs of what it returned. Input layers have
// no layer and one output.
struct LayerNode {
  std::shared_ptr<LayerImpl> layer;  // null for a model input
  std::vector<KerasTensor> inputs;
  std::vector<TensorSpec> outputs;
  std::string input_name;  // for model inputs
  std::any arguments;      // the call's non-tensor arguments (CallContext::arguments())
};
}  // namespace detail

}  // namespace tandem::keras
