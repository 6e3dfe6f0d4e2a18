// Regularisation and normalisation layers: Dropout, BatchNormalization, LayerNormalization.
#include <algorithm>

#include "tandem/base/random.h"
#include "tandem/keras_like/layers.h"
#include "tandem/ops/ops.h"

namespace tandem::keras {
namespace {

void require_positive_epsilon(double epsilon, const std::string& label) {
  TANDEM_REQUIRE(epsilon > 0.0, InvalidArgument,
                 "{}: epsilon is {}; expected a positive number (it keeps 1/sqrt(variance + epsilon) finite)", label,
                 epsilon);
}

class DropoutImpl final : public LayerImpl {
 public:
  bool elementwise() const override { return true; }
  DropoutImpl(double rate, DropoutOptions options)
      : LayerImpl("Dropout", std::move(options.name)),
        rate_(rate),
        // Drawn once, here: every call of the layer (each replica's graph, each rebuild) then
        // uses the same seed, and a given seed is not consumed from the global sequence.
        seed_(options.seed ? *options.seed : next_seed()) {
    TANDEM_REQUIRE(rate >= 0.0 && rate < 1.0, InvalidArgument, "{}: rate is {}; expected a fraction in [0, 1)", label(),
                   rate);
  }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    // Keras returns the inputs themselves outside training (and for rate 0): no op at all, so
    // inference graphs carry nothing for dropout.
    if (!ctx.training() || rate_ == 0.0) return {inputs[0]};
    return {ops::dropout(inputs[0], {.rate = rate_, .seed = seed_, .training = true})};
  }

 private:
  double rate_;
  std::uint64_t seed_;
};

class BatchNormalizationImpl final : public LayerImpl {
 public:
  explicit BatchNormalizationImpl(BatchNormalizationOptions options)
      : LayerImpl("BatchNormalization", options.name), options_(std::move(options)) {
    require_positive_epsilon(options_.epsilon, label());
  }

  void build(const std::vector<TensorSpec>& inputs) override {
    const Shape& in = inputs[0].shape;
    TANDEM_REQUIRE(in.rank() >= 2 && in[in.rank() - 1] != Shape::kUnknown, InvalidArgument,
                   "{}: input has shape {}; expected rank 2 or more with known channels (last dimension)", label(), in);
    const Shape channels{in[in.rank() - 1]};
    // Keras's creation order, which is also the order of get_weights() and of saved weights.
    if (options_.scale)
      gamma_ = add_weight({.name = "gamma", .shape = channels, .initializer = options_.gamma_initializer});
    if (options_.center)
      beta_ = add_weight({.name = "beta", .shape = channels, .initializer = options_.beta_initializer});
    moving_mean_ = add_weight({.name = "moving_mean",
                               .shape = channels,
                               .initializer = options_.moving_mean_initializer,
                               .trainable = false});
    moving_variance_ = add_weight({.name = "moving_variance",
                                   .shape = channels,
                                   .initializer = options_.moving_variance_initializer,
                                   .trainable = false});
  }

  // Keras 3 computes batch normalization of 16-bit inputs in float32 (the variance of
  // activations loses too much in 8 mantissa bits) and casts the result to the compute dtype.
  bool autocast() const override { return false; }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    const DType out_dtype =
        graph::is_floating(inputs[0].dtype()) && dtype_policy().is_mixed() ? compute_dtype() : inputs[0].dtype();
    const Output x = graph::is_low_precision(inputs[0].dtype()) ? ops::cast(inputs[0], DType::kF32) : inputs[0];
    const Shape& in = x.shape();
    const std::int64_t channels = moving_mean_->shape()[0];
    TANDEM_REQUIRE(in.rank() >= 2 && in[in.rank() - 1] == channels, InvalidArgument,
                   "{}: input has {} channels, the layer expects {} (input shape {})", label(),
                   in.rank() >= 1 ? in[in.rank() - 1] : 0, channels, in);
    // Without scale / center the op still takes them: a constant 1 / 0 per channel.
    const Output scale = gamma_ ? ctx.read(gamma_) : ops::fill(ctx.graph(), Shape{channels}, 1.0, x.dtype());
    const Output offset = beta_ ? ctx.read(beta_) : ops::fill(ctx.graph(), Shape{channels}, 0.0, x.dtype());
    const Output moving_mean = ctx.read(moving_mean_);
    const Output moving_variance = ctx.read(moving_variance_);
    const bool training = ctx.training();
    const auto outs = ops::fused_batch_norm(x, scale, offset, moving_mean, moving_variance,
                                            {.epsilon = options_.epsilon, .training = training});
    if (training) {
      // Keras 3: moving = moving * momentum + batch * (1 - momentum), with the biased batch
      // variance (what the op returns); applied after the step.
      ctx.add_update(moving_mean_, moving_average(moving_mean, outs.batch_mean));
      ctx.add_update(moving_variance_, moving_average(moving_variance, outs.batch_variance));
    }
    return {outs.y.dtype() == out_dtype ? outs.y : ops::cast(outs.y, out_dtype)};
  }

 private:
  Output moving_average(Output moving, Output batch) const {
    return ops::add(ops::mul(moving, ops::scalar_like(moving, options_.momentum)),
                    ops::mul(batch, ops::scalar_like(batch, 1.0 - options_.momentum)));
  }

  BatchNormalizationOptions options_;
  VariablePtr gamma_, beta_, moving_mean_, moving_variance_;
};

class LayerNormalizationImpl final : public LayerImpl {
 public:
  explicit LayerNormalizationImpl(LayerNormalizationOptions options)
      : LayerImpl("LayerNormalization", options.name), options_(std::move(options)) {
    require_positive_epsilon(options_.epsilon, label());
    TANDEM_REQUIRE(!options_.axis.axes.empty(), InvalidArgument, "{}: axis is empty; expected -1 or a list of axes",
                   label());
  }

  // Keras 3 computes layer normalization of 16-bit inputs in float32 with float32 gamma and beta
  // (the variance loses too much in 8 mantissa bits) and returns the compute dtype.
  bool autocast() const override { return false; }

  void build(const std::vector<TensorSpec>& inputs) override {
    const Shape& in = inputs[0].shape;
    const int rank = in.rank();
    std::vector<int> axes;
    for (int a : options_.axis.axes) {
      TANDEM_REQUIRE(a >= -rank && a < rank, InvalidArgument, "{}: axis {} is out of range for input of shape {}",
                     label(), a, in);
      axes.push_back(a < 0 ? a + rank : a);
    }
    std::sort(axes.begin(), axes.end());
    axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
    // The fused op normalises over the last axis; trailing axes flatten into it. Others would
    // need a transpose each way (not implemented; Keras's default is the last axis).
    const bool trailing = axes.front() == rank - static_cast<int>(axes.size()) && axes.front() > 0;
    if (!trailing) {
      throw Unimplemented(fmt::format(
          "{}: normalising over axes {} of input shape {} is not implemented; the axes must be the last ones, "
          "without the batch axis (e.g. -1, or [-2, -1])",
          label(), fmt::join(options_.axis.axes, ", "), in));
    }
    normalized_axes_ = static_cast<int>(axes.size());
    Shape params;
    for (int a : axes) {
      TANDEM_REQUIRE(in[a] != Shape::kUnknown, InvalidArgument,
                     "{}: the input's dimension {} (normalised) must be known; got {}", label(), a, in);
      params.push_back(in[a]);
    }
    // Keras's creation order: gamma, then beta.
    if (options_.scale)
      gamma_ = add_weight({.name = "gamma", .shape = params, .initializer = options_.gamma_initializer});
    if (options_.center)
      beta_ = add_weight({.name = "beta", .shape = params, .initializer = options_.beta_initializer});
    params_ = params;
  }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    Output x = inputs[0];
    const Shape in = x.shape();
    const int rank = in.rank();
    const int k = normalized_axes_;
    bool matches = rank > k;
    for (int i = 0; matches && i < k; ++i) matches = in[rank - k + i] == params_[i];
    TANDEM_REQUIRE(matches, InvalidArgument, "{}: input has shape {}; the layer normalises trailing dimensions {}",
                   label(), in, params_);
    const DType out_dtype = graph::is_floating(x.dtype()) ? compute_dtype() : x.dtype();
    if (graph::is_low_precision(x.dtype())) x = ops::cast(x, DType::kF32);
    Output gamma = gamma_ ? ctx.read(gamma_) : Output{};
    Output beta = beta_ ? ctx.read(beta_) : Output{};
    if (k > 1) {
      // Several trailing axes: one axis of their product, for the op and for gamma and beta.
      const std::int64_t features = params_.num_elements();
      Shape flat;
      for (int i = 0; i < rank - k; ++i) flat.push_back(in[i]);
      flat.push_back(features);
      TANDEM_REQUIRE(std::count(flat.dims().begin(), flat.dims().end(), Shape::kUnknown) <= 1, InvalidArgument,
                     "{}: input has shape {}; with several axes only the batch dimension may be unknown", label(),
                     in);
      x = ops::reshape(x, flat);
      if (gamma.defined()) gamma = ops::reshape(gamma, {features});
      if (beta.defined()) beta = ops::reshape(beta, {features});
    }
    Output y = ops::layer_norm(x, gamma, beta, {.epsilon = options_.epsilon});
    if (k > 1) y = ops::reshape(y, in);
    return {y.dtype() == out_dtype ? y : ops::cast(y, out_dtype)};
  }

 private:
  LayerNormalizationOptions options_;
  int normalized_axes_ = 1;
  Shape params_;
  VariablePtr gamma_, beta_;
};

}  // namespace

Dropout::Dropout(double rate, DropoutOptions options)
    : Layer(std::make_shared<DropoutImpl>(rate, std::move(options))) {}
BatchNormalization::BatchNormalization(BatchNormalizationOptions options)
    : Layer(std::make_shared<BatchNormalizationImpl>(std::move(options))) {}
LayerNormalization::LayerNormalization(LayerNormalizationOptions options)
    : Layer(std::make_shared<LayerNormalizationImpl>(std::move(options))) {}

}  // namespace tandem::keras
