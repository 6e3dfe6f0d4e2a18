// Core layers: Dense, Embedding, Flatten, Reshape, Activation, Add.
#include "tandem/keras_like/layers.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/tensor_parallel.h"

namespace tandem::keras {
namespace {

constexpr std::string_view kKnownActivations = "linear, relu, sigmoid, tanh, softmax, gelu, gelu_approximate";

std::int64_t product_of_non_batch(const Shape& shape) {
  std::int64_t n = 1;
  for (int i = 1; i < shape.rank(); ++i) {
    if (shape[i] == Shape::kUnknown) return Shape::kUnknown;
    n *= shape[i];
  }
  return n;
}

class DenseImpl final : public LayerImpl {
 public:
  DenseImpl(std::int64_t units, DenseOptions options)
      : LayerImpl("Dense", options.name), units_(units), options_(std::move(options)) {
    TANDEM_REQUIRE(units > 0, InvalidArgument, "Dense: units must be positive; got {}", units);
    apply_activation(options_.activation, Output{}, label());  // reject unknown names now
  }

  // Megatron-LM's linear layers: column-parallel (each device computes some output features; the
  // input's gradient is summed over the devices), row-parallel (each device takes some input
  // features; the partial outputs are summed, then the whole bias added).
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override {
    return {{.name = "column",
             .effect = "output split by features; input gradient all-reduced in backward",
             .weights = {{"kernel", 1}, {"bias", 0}}},
            {.name = "row",
             .effect = "input split by features; output all-reduced in forward",
             .weights = {{"kernel", 0}, {"bias", std::nullopt}}}};
  }

  void build(const std::vector<TensorSpec>& inputs) override {
    const Shape& in = inputs[0].shape;
    TANDEM_REQUIRE(in.rank() >= 2 && in[in.rank() - 1] != Shape::kUnknown, InvalidArgument,
                   "{}: the input's last dimension must be known (features); got {}", label(), in);
    const std::int64_t features = in[in.rank() - 1];
    kernel_ = add_weight({.name = "kernel", .shape = {features, units_}, .initializer = options_.kernel_initializer});
    if (options_.use_bias)
      bias_ = add_weight({.name = "bias", .shape = {units_}, .initializer = options_.bias_initializer});
  }

  bool runs_tensor_parallel(std::string_view name) const override { return name == "column" || name == "row"; }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    Output x = inputs[0];
    const Shape& in = x.shape();
    // Tensor parallelism (Megatron-LM): the kernel here is this device's piece.
    const auto& tp = tensor_parallel_call();
    const bool column = tp && tp->split == "column", row = tp && tp->split == "row";
    const std::int64_t features = row && tp->input_split ? kernel_->graph_shape()[0] : kernel_->global_shape()[0];
    TANDEM_REQUIRE(in.rank() >= 2 && in[in.rank() - 1] == features, InvalidArgument,
                   "{}: input has {} features, kernel expects {} (input shape {})", label(),
                   in.rank() >= 1 ? in[in.rank() - 1] : 0, features, in);
    // Rank > 2: apply to every position of the leading dimensions.
    const std::int64_t units = column && tp->output_split ? kernel_->graph_shape()[1] : units_;
    Shape out_shape = in.with_dim(-1, units);
    const bool flatten = in.rank() > 2;
    if (flatten) x = ops::reshape(x, {-1, features});
    if (row && !tp->input_split) x = strategy::tensor_parallel::scatter_to_group(x, 1, *tp->group);
    if (column) x = strategy::tensor_parallel::copy_to_group(x, *tp->group);  // f
    const Output kernel = ctx.read(kernel_);
    const auto fused = fused_activation();
    Output y;
    if (row) {
      // The partial products summed over the group (g), then the whole bias once.
      y = strategy::tensor_parallel::reduce_from_group(ops::matmul(x, kernel), *tp->group);
      if (bias_ != nullptr) y = ops::bias_add(y, ctx.read(bias_));
      y = apply_activation(options_.activation, y, label());
    } else if (column && options_.activation == "softmax") {
      // The softmax needs every output feature: gathered first (and split again for a partner).
      y = ops::matmul(x, kernel);
      if (bias_ != nullptr) y = ops::bias_add(y, ctx.read(bias_));
      y = apply_activation(options_.activation, strategy::tensor_parallel::gather_from_group(y, 1, *tp->group),
                           label());
      if (tp->output_split) y = strategy::tensor_parallel::scatter_to_group(y, 1, *tp->group);
    } else if (bias_ != nullptr && fused) {
      y = ops::dense(x, kernel, ctx.read(bias_), *fused);  // matmul + bias + activation in one op
    } else {
      y = ops::matmul(x, kernel);
      if (bias_ != nullptr) y = ops::bias_add(y, ctx.read(bias_));
      y = apply_activation(options_.activation, y, label());
    }
    if (column && !tp->output_split && options_.activation != "softmax")
      y = strategy::tensor_parallel::gather_from_group(y, 1, *tp->group);
    if (flatten) {
      Shape target = out_shape;
      target[0] = Shape::kUnknown;
      y = ops::reshape(y, target);
    }
    return {y};
  }

 private:
  std::optional<ops::Activation> fused_activation() const { return fusable_activation(options_.activation); }

  std::int64_t units_;
  DenseOptions options_;
  VariablePtr kernel_, bias_;
};

class EmbeddingImpl final : public LayerImpl {
 public:
  EmbeddingImpl(std::int64_t input_dim, std::int64_t output_dim, EmbeddingOptions options)
      : LayerImpl("Embedding", options.name), input_dim_(input_dim), output_dim_(output_dim),
        initializer_(std::move(options.embeddings_initializer)) {
    TANDEM_REQUIRE(input_dim > 0 && output_dim > 0, InvalidArgument,
                   "{}: input_dim ({}) and output_dim ({}) must be positive", label(), input_dim, output_dim);
  }

  // Megatron-LM's vocabulary-parallel embedding (each device looks up the ids of its rows, zeros
  // elsewhere, summed over the devices), or the table split by output features (gathered).
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override {
    return {{.name = "vocabulary",
             .effect = "masked lookup of each device's rows; output all-reduced in forward",
             .weights = {{"embeddings", 0}}},
            {.name = "output",
             .effect = "output split by features; all-gathered in forward",
             .weights = {{"embeddings", 1}}}};
  }

  // Keras 3: the table is read as it is (float32 under a mixed policy) and the rows looked up are
  // cast to the compute dtype, so the table's gradient is a float32 scatter-add.
  bool autocast() const override { return false; }

  void build(const std::vector<TensorSpec>& /*inputs*/) override {
    embeddings_ = add_weight({.name = "embeddings", .shape = {input_dim_, output_dim_}, .initializer = initializer_});
  }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    Output ids = inputs[0];
    TANDEM_REQUIRE(ids.shape().rank() >= 1, InvalidArgument, "{}: ids have shape {}; expected (batch, ...)", label(),
                   ids.shape());
    if (ids.dtype() != DType::kI32 && ids.dtype() != DType::kI64) ids = ops::cast(ids, DType::kI32);
    const auto& tp = tensor_parallel_call();
    Output rows;
    if (tp && tp->split == "vocabulary") {
      // Megatron's masked lookup: this device's rows of the table, zeros for the other ids,
      // summed over the group.
      rows = strategy::tensor_parallel::vocab_parallel_embedding(
          ids, ctx.read(embeddings_), strategy::tensor_parallel::kVocabStartOfRank, *tp->group);
    } else {
      rows = ops::gather(ctx.read(embeddings_), ids);
      // Split by output features: this device's columns of every row, gathered.
      if (tp) rows = strategy::tensor_parallel::gather_from_group(rows, rows.shape().rank() - 1, *tp->group);
    }
    if (graph::is_floating(rows.dtype()) && rows.dtype() != compute_dtype()) rows = ops::cast(rows, compute_dtype());
    return {rows};
  }
  bool runs_tensor_parallel(std::string_view name) const override { return name == "output" || name == "vocabulary"; }

 private:
  std::int64_t input_dim_, output_dim_;
  Initializer initializer_;
  VariablePtr embeddings_;
};

class FlattenImpl final : public LayerImpl {
 public:
  explicit FlattenImpl(std::string name) : LayerImpl("Flatten", std::move(name)) {}
  std::vector<Output> call(CallContext& /*ctx*/, const std::vector<Output>& inputs) override {
    const Shape& in = inputs[0].shape();
    const std::int64_t n = product_of_non_batch(in);
    TANDEM_REQUIRE(n != Shape::kUnknown, InvalidArgument, "{}: every dimension but the batch must be known; got {}",
                   label(), in);
    return {ops::reshape(inputs[0], {-1, in.rank() == 1 ? 1 : n})};
  }
};

class ReshapeImpl final : public LayerImpl {
 public:
  ReshapeImpl(Shape target, std::string name) : LayerImpl("Reshape", std::move(name)), target_(target) {}
  std::vector<Output> call(CallContext& /*ctx*/, const std::vector<Output>& inputs) override {
    const Shape& in = inputs[0].shape();
    const std::int64_t n = product_of_non_batch(in);
    TANDEM_REQUIRE(n != Shape::kUnknown, InvalidArgument, "{}: every dimension but the batch must be known; got {}",
                   label(), in);
    // Resolve the target's own -1 here: the op's one -1 is the batch.
    Shape target{Shape::kUnknown};
    std::int64_t known = 1;
    int infer = -1;
    for (int i = 0; i < target_.rank(); ++i) {
      if (target_[i] == Shape::kUnknown) {
        TANDEM_REQUIRE(infer < 0, InvalidArgument, "{}: target shape {} has more than one -1", label(), target_);
        infer = i;
      } else {
        known *= target_[i];
      }
      target.push_back(target_[i]);
    }
    if (infer >= 0) {
      TANDEM_REQUIRE(known > 0 && n % known == 0, InvalidArgument, "{}: cannot reshape {} to (None, {})", label(), in,
                     target_.to_string());
      target[infer + 1] = n / known;
    } else {
      TANDEM_REQUIRE(known == n, InvalidArgument, "{}: cannot reshape {} ({} values per example) to target {} ({})",
                     label(), in, n, target_, known);
    }
    return {ops::reshape(inputs[0], target)};
  }

 private:
  Shape target_;
};

class ActivationImpl final : public LayerImpl {
 public:
  ActivationImpl(std::string activation, std::string name)
      : LayerImpl("Activation", std::move(name)), activation_(std::move(activation)) {
    apply_activation(activation_, Output{}, label());
  }
  std::vector<Output> call(CallContext& /*ctx*/, const std::vector<Output>& inputs) override {
    return {apply_activation(activation_, inputs[0], label())};
  }
  bool elementwise() const override { return activation_ != "softmax"; }

 private:
  std::string activation_;
};

class AddImpl final : public LayerImpl {
 public:
  explicit AddImpl(std::string name) : LayerImpl("Add", std::move(name)) {}
  int min_inputs() const override { return 2; }
  int max_inputs() const override { return -1; }
  std::vector<Output> call(CallContext& /*ctx*/, const std::vector<Output>& inputs) override {
    for (const auto& in : inputs) {
      TANDEM_REQUIRE(in.shape().compatible_with(inputs[0].shape()), InvalidArgument,
                     "{}: inputs have different shapes: {} and {}", label(), inputs[0].shape(), in.shape());
    }
    return {ops::add_n(inputs)};
  }
};

}  // namespace

Output apply_activation(std::string_view activation, Output x, std::string_view layer_label) {
  const auto element_wise = fusable_activation(activation);
  TANDEM_REQUIRE(element_wise || activation == "softmax", InvalidArgument, "{}: unknown activation \"{}\"; known: {}",
                 layer_label, activation, kKnownActivations);
  if (!x.defined()) return x;
  if (element_wise) {
    switch (*element_wise) {
      case ops::Activation::kLinear:
        return x;
      case ops::Activation::kRelu:
        return ops::relu(x);
      case ops::Activation::kSigmoid:
        return ops::sigmoid(x);
      case ops::Activation::kTanh:
        return ops::tanh(x);
      case ops::Activation::kGelu:
        return ops::gelu(x, /*approximate=*/false);
      case ops::Activation::kGeluApproximate:
        return ops::gelu(x, /*approximate=*/true);
    }
  }
  // Softmax of 16-bit logits in float32, and a float32 result (Keras's advice for the output
  // layer of a mixed-precision model, done for the user).
  if (graph::is_low_precision(x.dtype())) x = ops::cast(x, DType::kF32);
  return ops::softmax(x);
}

std::optional<ops::Activation> fusable_activation(std::string_view a) {
  if (a == "linear" || a.empty()) return ops::Activation::kLinear;
  if (a == "relu") return ops::Activation::kRelu;
  if (a == "sigmoid") return ops::Activation::kSigmoid;
  if (a == "tanh") return ops::Activation::kTanh;
  if (a == "gelu") return ops::Activation::kGelu;
  if (a == "gelu_approximate") return ops::Activation::kGeluApproximate;
  return std::nullopt;
}

Dense::Dense(std::int64_t units, DenseOptions options)
    : Layer(std::make_shared<DenseImpl>(units, std::move(options))) {}
Dense::Dense(std::int64_t units, const char* activation, DenseOptions options)
    : Dense(units, [&] {
        options.activation = activation;
        return std::move(options);
      }()) {}
Embedding::Embedding(std::int64_t input_dim, std::int64_t output_dim, EmbeddingOptions options)
    : Layer(std::make_shared<EmbeddingImpl>(input_dim, output_dim, std::move(options))) {}
Flatten::Flatten(std::string name) : Layer(std::make_shared<FlattenImpl>(std::move(name))) {}
Reshape::Reshape(const Shape& target_shape, std::string name)
    : Layer(std::make_shared<ReshapeImpl>(target_shape, std::move(name))) {}
Activation::Activation(std::string activation, std::string name)
    : Layer(std::make_shared<ActivationImpl>(std::move(activation), std::move(name))) {}
Add::Add(std::string name) : Layer(std::make_shared<AddImpl>(std::move(name))) {}

}  // namespace tandem::keras
