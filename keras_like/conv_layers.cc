// Convolution and pooling layers: Conv2D, MaxPooling2D, AveragePooling2D (NHWC, channels last).
#include "tandem/keras_like/layers.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/tensor_parallel.h"

namespace tandem::keras {
namespace {

// Keras accepts the padding in any case; anything else is rejected when the layer is made, not
// at its first call, and the error names the layer.
ops::Padding layer_padding(std::string_view padding, const std::string& label) {
  try {
    return ops::parse_padding(padding);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(fmt::format("{}: padding \"{}\"; expected \"valid\" or \"same\"", label, padding));
  }
}

void require_positive_pair(const std::array<std::int64_t, 2>& pair, std::string_view what, const std::string& label) {
  TANDEM_REQUIRE(pair[0] > 0 && pair[1] > 0, InvalidArgument, "{}: {} must be two positive integers; got ({}, {})",
                 label, what, pair[0], pair[1]);
}

// Conv and pooling take NHWC images: rank 4, batch first.
void require_image(const Shape& in, const std::string& label) {
  TANDEM_REQUIRE(in.rank() == 4, InvalidArgument,
                 "{}: input has shape {}; expected rank 4 (batch, height, width, channels)", label, in);
}

class Conv2DImpl final : public LayerImpl {
 public:
  Conv2DImpl(std::int64_t filters, std::array<std::int64_t, 2> kernel_size, Conv2DOptions options)
      : LayerImpl("Conv2D", options.name), filters_(filters), kernel_size_(kernel_size), options_(std::move(options)) {
    TANDEM_REQUIRE(filters > 0, InvalidArgument, "{}: filters must be positive; got {}", label(), filters);
    require_positive_pair(kernel_size_, "kernel_size", label());
    require_positive_pair(options_.strides, "strides", label());
    padding_ = layer_padding(options_.padding, label());
    apply_activation(options_.activation, Output{}, label());  // reject unknown names now
  }

  // Output channels split over the devices (filters [kh, kw, in, out] by out, with the bias);
  // the next layer sees the channels gathered.
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override {
    return {{.name = "output_channels",
             .effect = "output split by channels; all-gathered in forward, input gradient all-reduced in backward",
             .weights = {{"kernel", 3}, {"bias", 0}}}};
  }

  void build(const std::vector<TensorSpec>& inputs) override {
    const Shape& in = inputs[0].shape;
    require_image(in, label());
    TANDEM_REQUIRE(in[3] != Shape::kUnknown, InvalidArgument,
                   "{}: the input's channels (last dimension) must be known; got {}", label(), in);
    kernel_ = add_weight({.name = "kernel",
                          .shape = {kernel_size_[0], kernel_size_[1], in[3], filters_},
                          .initializer = options_.kernel_initializer});
    if (options_.use_bias)
      bias_ = add_weight({.name = "bias", .shape = {filters_}, .initializer = options_.bias_initializer});
  }

  bool runs_tensor_parallel(std::string_view name) const override { return name == "output_channels"; }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    Output x = inputs[0];
    const Shape& in = x.shape();
    require_image(in, label());
    const std::int64_t channels = kernel_->global_shape()[2];
    TANDEM_REQUIRE(in[3] == channels, InvalidArgument, "{}: input has {} channels, kernel expects {} (input shape {})",
                   label(), in[3], channels, in);
    // Tensor parallelism over output channels: this device's filters (the kernel here is its
    // piece) on the whole input (f: its gradient all-reduced in backward), the channels gathered.
    const auto& tp = tensor_parallel_call();
    if (tp) x = strategy::tensor_parallel::copy_to_group(x, *tp->group);
    const ops::Conv2DOptions conv{.strides = options_.strides, .padding = padding_};
    const auto fused = fused_activation();
    const bool softmax = options_.activation == "softmax";  // needs every channel: after the gather
    Output y;
    if (bias_ != nullptr && fused && !(tp && softmax)) {
      // Bias and activation applied in the convolution's own pass, while its output is in cache.
      y = ops::fused_conv2d(x, ctx.read(kernel_), ctx.read(bias_), *fused, conv);
    } else {
      y = ops::conv2d(x, ctx.read(kernel_), conv);
      if (bias_ != nullptr) y = ops::bias_add(y, ctx.read(bias_));
      if (!(tp && softmax)) y = apply_activation(options_.activation, y, label());
    }
    if (!tp) return {y};
    y = strategy::tensor_parallel::gather_from_group(y, 3, *tp->group);
    return {softmax ? apply_activation(options_.activation, y, label()) : y};
  }

 private:
  std::optional<ops::Activation> fused_activation() const { return fusable_activation(options_.activation); }

  std::int64_t filters_;
  std::array<std::int64_t, 2> kernel_size_;
  Conv2DOptions options_;
  ops::Padding padding_ = ops::Padding::kValid;
  VariablePtr kernel_, bias_;
};

enum class PoolKind { kMax, kAverage };

class Pooling2DImpl final : public LayerImpl {
 public:
  Pooling2DImpl(PoolKind kind, std::array<std::int64_t, 2> pool_size, Pooling2DOptions options)
      : LayerImpl(kind == PoolKind::kMax ? "MaxPooling2D" : "AveragePooling2D", options.name), kind_(kind) {
    require_positive_pair(pool_size, "pool_size", label());
    if (options.strides) require_positive_pair(*options.strides, "strides", label());
    pool_ = {.pool_size = pool_size,
             .strides = options.strides.value_or(pool_size),  // Keras: strides default to the pool
             .padding = layer_padding(options.padding, label())};
  }

  std::vector<Output> call(CallContext& /*ctx*/, const std::vector<Output>& inputs) override {
    require_image(inputs[0].shape(), label());
    return {kind_ == PoolKind::kMax ? ops::max_pool2d(inputs[0], pool_) : ops::avg_pool2d(inputs[0], pool_)};
  }

 private:
  PoolKind kind_;
  ops::Pool2DOptions pool_;
};

}  // namespace

Conv2D::Conv2D(std::int64_t filters, std::array<std::int64_t, 2> kernel_size, Conv2DOptions options)
    : Layer(std::make_shared<Conv2DImpl>(filters, kernel_size, std::move(options))) {}
Conv2D::Conv2D(std::int64_t filters, std::array<std::int64_t, 2> kernel_size, const char* activation,
               Conv2DOptions options)
    : Conv2D(filters, kernel_size, [&] {
        options.activation = activation != nullptr ? activation : "linear";  // null: Keras's None
        return std::move(options);
      }()) {}

MaxPooling2D::MaxPooling2D(std::array<std::int64_t, 2> pool_size, Pooling2DOptions options)
    : Layer(std::make_shared<Pooling2DImpl>(PoolKind::kMax, pool_size, std::move(options))) {}
AveragePooling2D::AveragePooling2D(std::array<std::int64_t, 2> pool_size, Pooling2DOptions options)
    : Layer(std::make_shared<Pooling2DImpl>(PoolKind::kAverage, pool_size, std::move(options))) {}

}  // namespace tandem::keras
