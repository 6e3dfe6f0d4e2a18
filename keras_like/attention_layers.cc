// Attention layers: MultiHeadAttention (Keras 3's, with its weight shapes and names).
#include <cmath>

#include "tandem/base/random.h"
#include "tandem/keras_like/layers.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/tensor_parallel.h"

namespace tandem::keras {
namespace {

// What a call records besides its tensors (CallContext::arguments()). The inputs are always
// {query, value, key[, attention_mask]}: the call operators put value in the key's place when no
// key is given, so that build() and call() tell a key from a mask by position.
struct AttentionArguments {
  bool use_causal_mask = false;
  bool return_attention_scores = false;
};

constexpr std::size_t kQuery = 0, kValue = 1, kKey = 2, kMask = 3;

class MultiHeadAttentionImpl final : public LayerImpl {
 public:
  MultiHeadAttentionImpl(std::int64_t num_heads, std::int64_t key_dim, MultiHeadAttentionOptions options)
      : LayerImpl("MultiHeadAttention", options.name),
        heads_(num_heads),
        key_dim_(key_dim),
        value_dim_(options.value_dim.value_or(key_dim)),
        options_(std::move(options)),
        // Drawn once, like Dropout's: every graph of the model (each replica's, each rebuild)
        // drops with the same seed.
        seed_(options_.seed ? *options_.seed : next_seed()) {
    TANDEM_REQUIRE(heads_ > 0 && key_dim_ > 0 && value_dim_ > 0, InvalidArgument,
                   "{}: num_heads ({}), key_dim ({}) and value_dim ({}) must be positive", label(), heads_, key_dim_,
                   value_dim_);
    TANDEM_REQUIRE(options_.dropout >= 0.0 && options_.dropout < 1.0, InvalidArgument,
                   "{}: dropout is {}; expected a fraction in [0, 1)", label(), options_.dropout);
    for (const auto d : options_.output_shape) {
      TANDEM_REQUIRE(d > 0, InvalidArgument, "{}: output_shape ({}) must hold positive dimensions", label(),
                     fmt::join(options_.output_shape, ", "));
    }
  }

  // Megatron-LM's attention: each device holds some heads' query, key and value projections
  // (column-parallel) and the matching rows of the output projection (row-parallel); the output
  // is all-reduced in forward, the inputs' gradients in backward.
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override {
    return {{.name = "heads",
             .effect = "heads split; output all-reduced in forward, input gradients all-reduced in backward",
             .weights = {{"query/kernel", 1},
                         {"query/bias", 0},
                         {"key/kernel", 1},
                         {"key/bias", 0},
                         {"value/kernel", 1},
                         {"value/bias", 0},
                         {"attention_output/kernel", 0},
                         {"attention_output/bias", std::nullopt}}}};
  }

  bool runs_tensor_parallel(std::string_view name) const override { return name == "heads"; }

  int min_inputs() const override { return 3; }
  int max_inputs() const override { return 4; }

  void build(const std::vector<TensorSpec>& inputs) override {
    const Shape& query = inputs[kQuery].shape;
    const Shape& value = inputs[kValue].shape;
    const Shape& key = inputs[kKey].shape;
    require_sequence(query, "query");
    require_sequence(value, "value");
    require_sequence(key, "key");
    TANDEM_REQUIRE(value[1] == key[1], InvalidArgument,
                   "{}: value {} and key {} must have the same sequence length (every dimension but the last)",
                   label(), value, key);
    Shape out(options_.output_shape.empty() ? std::vector<std::int64_t>{query[2]} : options_.output_shape);
    // Keras's order (query, key, value, attention_output; kernel before bias), which is also the
    // order of get_weights() and of saved weights.
    query_ = project_weights("query", query[2], key_dim_);
    key_ = project_weights("key", key[2], key_dim_);
    value_ = project_weights("value", value[2], value_dim_);
    Shape output_kernel{heads_, value_dim_};
    for (const auto d : out.dims()) output_kernel.push_back(d);
    output_.kernel =
        add_weight({.name = "attention_output/kernel", .shape = output_kernel, .initializer = options_.kernel_initializer});
    if (options_.use_bias)
      output_.bias = add_weight({.name = "attention_output/bias", .shape = out, .initializer = options_.bias_initializer});
    output_shape_ = out;
  }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    const auto* arguments = std::any_cast<AttentionArguments>(&ctx.arguments());
    const AttentionArguments args = arguments != nullptr ? *arguments : AttentionArguments{};
    Output query = inputs[kQuery], value = inputs[kValue], key = inputs[kKey];
    // Tensor parallelism over heads (Megatron): this device's heads (the kernels here are its
    // pieces); the inputs pass through f (their gradients all-reduced in backward), once per
    // distinct input, and the output projection's partial sums through g.
    const auto& tp = tensor_parallel_call();
    if (tp) {
      const auto same = [](const Output& a, const Output& b) { return a.node == b.node && a.index == b.index; };
      const Output q_in = strategy::tensor_parallel::copy_to_group(query, *tp->group);
      const Output v_in = same(value, query) ? q_in : strategy::tensor_parallel::copy_to_group(value, *tp->group);
      key = same(key, query) ? q_in : same(key, value) ? v_in : strategy::tensor_parallel::copy_to_group(key, *tp->group);
      query = q_in;
      value = v_in;
    }
    const std::int64_t heads = query_.kernel->graph_shape()[1];  // this device's (all without tensor parallelism)
    require_sequence(query.shape(), "query");
    require_sequence(value.shape(), "value");
    require_sequence(key.shape(), "key");
    const std::int64_t t = query.shape()[1], s = value.shape()[1];
    TANDEM_REQUIRE(key.shape()[1] == s, InvalidArgument,
                   "{}: value {} and key {} must have the same sequence length", label(), value.shape(), key.shape());

    // [B, L, C] -> [B, heads, L, dim] per projection.
    const Output q = project(ctx, query, query_, heads, key_dim_, "query");
    const Output k = project(ctx, key, key_, heads, key_dim_, "key");
    const Output v = project(ctx, value, value_, heads, value_dim_, "value");
    const Output mask = inputs.size() > kMask ? attention_mask(inputs[kMask], t, s) : Output{};

    // Scores [B, heads, T, S]; the fused softmax applies 1/sqrt(key_dim) (Keras scales the query
    // instead: the same numbers up to rounding) and the masks. Under the causal mask the scores
    // above the diagonal are never read and the probabilities there are 0, so both products (and
    // the four of their gradients) skip that triangle: half of their multiply-adds, the same bits.
    const bool causal = args.use_causal_mask;
    const Output scores = ops::batch_matmul(q, k, {.adj_y = true, .output_lower_triangular = causal});
    const Output probs = ops::masked_softmax(
        scores, mask, {.scale = 1.0 / std::sqrt(static_cast<double>(key_dim_)), .causal = args.use_causal_mask});
    const Output dropped = ctx.training() && options_.dropout > 0.0
                               ? ops::dropout(probs, {.rate = options_.dropout, .seed = seed_, .training = true})
                               : probs;
    // [B, heads, T, value_dim] -> [B, T, heads * value_dim] -> the output projection.
    Output combined = ops::transpose(ops::batch_matmul(dropped, v, {.a_lower_triangular = causal}), {0, 2, 1, 3});
    combined = ops::reshape(combined, {-1, heads * value_dim_});
    const std::int64_t out_features = output_shape_.num_elements();
    Output y;
    if (tp) {
      // The heads' partial products summed over the group (g), then the whole bias once.
      y = strategy::tensor_parallel::reduce_from_group(
          ops::matmul(combined, ops::reshape(ctx.read(output_.kernel), {heads * value_dim_, out_features})),
          *tp->group);
      if (output_.bias != nullptr) y = ops::bias_add(y, ops::reshape(ctx.read(output_.bias), {out_features}));
    } else {
      y = dense(ctx, combined, output_, heads * value_dim_, out_features);
    }
    Shape y_shape{Shape::kUnknown, t};
    for (const auto d : output_shape_.dims()) y_shape.push_back(d);
    y = ops::reshape(y, y_shape);
    if (args.return_attention_scores) return {y, probs};
    return {y};
  }

 private:
  struct Projection {
    VariablePtr kernel, bias;
  };

  // query, key and value are [batch, length, features] with known length and features (the
  // reshapes to heads need them).
  void require_sequence(const Shape& shape, std::string_view what) const {
    if (shape.rank() != 3) {
      throw Unimplemented(fmt::format(
          "{}: {} has shape {}; only rank 3 (batch, sequence, features) is implemented (Keras's attention_axes "
          "over several axes is not)",
          label(), what, shape));
    }
    TANDEM_REQUIRE(shape[1] != Shape::kUnknown && shape[2] != Shape::kUnknown, InvalidArgument,
                   "{}: {} has shape {}; its sequence length and features must be known", label(), what, shape);
  }

  Projection project_weights(std::string_view name, std::int64_t features, std::int64_t dim) {
    Projection p;
    p.kernel = add_weight({.name = fmt::format("{}/kernel", name),
                           .shape = {features, heads_, dim},
                           .initializer = options_.kernel_initializer});
    if (options_.use_bias)
      p.bias = add_weight(
          {.name = fmt::format("{}/bias", name), .shape = {heads_, dim}, .initializer = options_.bias_initializer});
    return p;
  }

  // x [rows, in] @ kernel (any shape of in * out values) + bias, as one fused op when there is a bias.
  static Output dense(CallContext& ctx, Output x, const Projection& p, std::int64_t in, std::int64_t out) {
    const Output kernel = ops::reshape(ctx.read(p.kernel), {in, out});
    if (p.bias == nullptr) return ops::matmul(x, kernel);
    return ops::dense(x, kernel, ops::reshape(ctx.read(p.bias), {out}), ops::Activation::kLinear);
  }

  // [B, L, C] -> [B, heads, L, dim].
  Output project(CallContext& ctx, Output x, const Projection& p, std::int64_t heads, std::int64_t dim,
                 std::string_view what) const {
    const Shape& in = x.shape();
    const std::int64_t features = p.kernel->global_shape()[0];
    TANDEM_REQUIRE(in[2] == features, InvalidArgument, "{}: {} has {} features, its kernel expects {} (shape {})",
                   label(), what, in[2], features, in);
    Output y = dense(ctx, ops::reshape(x, {-1, features}), p, features, heads * dim);
    y = ops::reshape(y, {-1, in[1], heads, dim});
    return ops::transpose(y, {0, 2, 1, 3});
  }

  // Keras's attention_mask [B, T, S] (or [T, S]) -> [B or 1, 1, T, S], non-zero where attending.
  Output attention_mask(Output mask, std::int64_t t, std::int64_t s) const {
    const Shape& m = mask.shape();
    TANDEM_REQUIRE((m.rank() == 2 || m.rank() == 3) && m.dim(-2) == t && m.dim(-1) == s, InvalidArgument,
                   "{}: attention_mask has shape {}; expected (batch, {}, {}) or ({}, {}) (query by key positions)",
                   label(), m, t, s, t, s);
    // A float mask means what it says when non-zero (Keras casts it to bool).
    if (graph::is_floating(mask.dtype())) mask = ops::cast(ops::abs(ops::sign(mask)), DType::kU8);
    return ops::reshape(mask, {m.rank() == 3 ? Shape::kUnknown : 1, 1, t, s});
  }

  std::int64_t heads_, key_dim_, value_dim_;
  MultiHeadAttentionOptions options_;
  std::uint64_t seed_;
  Projection query_, key_, value_, output_;
  Shape output_shape_;
};

// {query, value[, key]} -> {query, value, key}, checking the count.
template <class T>
std::vector<T> attention_inputs(const std::vector<T>& inputs, const T& mask, const LayerImpl& layer) {
  TANDEM_REQUIRE(inputs.size() == 2 || inputs.size() == 3, InvalidArgument,
                 "{} \"{}\": called on {} tensor(s); expected {{query, value}} or {{query, value, key}}",
                 layer.class_name(), layer.name(), inputs.size());
  std::vector<T> out = inputs;
  if (out.size() == 2) out.push_back(inputs[kValue]);
  if (mask.defined()) out.push_back(mask);
  return out;
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(std::int64_t num_heads, std::int64_t key_dim, MultiHeadAttentionOptions options)
    : Layer(std::make_shared<MultiHeadAttentionImpl>(num_heads, key_dim, std::move(options))) {}

LayerOutputs MultiHeadAttention::operator()(const std::vector<KerasTensor>& inputs,
                                            const AttentionCallOptions<KerasTensor>& options) const {
  return LayerOutputs(impl().call_symbolic(
      attention_inputs(inputs, options.attention_mask, impl()),
      AttentionArguments{.use_causal_mask = options.use_causal_mask,
                         .return_attention_scores = options.return_attention_scores}));
}

std::vector<Output> MultiHeadAttention::operator()(CallContext& ctx, const std::vector<Output>& inputs,
                                                   const AttentionCallOptions<Output>& options) const {
  return Layer::operator()(ctx, attention_inputs(inputs, options.attention_mask, impl()),
                           AttentionArguments{.use_causal_mask = options.use_causal_mask,
                                              .return_attention_scores = options.return_attention_scores});
}

}  // namespace tandem::keras
