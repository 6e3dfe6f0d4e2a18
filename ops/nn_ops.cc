// Definitions of the nn family: activations, softmax, bias (+ activation), the fused dense
// layer, the fused losses, dropout, batch and layer normalisation, the masked (attention)
// softmax. Kernels: ops/cpu/nn_kernels.cc.
//
// Gradients of the activations are expressed through the op's output y (ReluGrad(dy, y), ...):
// the forward output is kept alive anyway, the input need not be. GELU is the exception: y does
// not determine z, so GeluGrad takes the input, and the fused ops with a GELU epilogue
// (BiasActivation, FusedMatMul) keep z as a second output for BiasActivationGrad (empty for the
// other activations, which cost nothing more than before). Recomputing z in the backward pass
// instead would mean a second matmul. Fused forward ops have fused gradient ops
// (BiasActivationGrad computes dz and the bias gradient in one sweep; FusedBatchNormGrad all three
// parameter gradients and dx in two; LayerNormGrad dx, dgamma and dbeta in one; MaskedSoftmaxGrad
// the softmax's and the scale's derivative in one).
#include "tandem/ops/nn_ops.h"

#include <cmath>

#include "tandem/ops/array_ops.h"
#include "tandem/ops/detail/op_util.h"
#include "tandem/ops/detail/registration.h"
#include "tandem/ops/math_ops.h"

namespace tandem::ops {

std::string_view activation_name(Activation activation) {
  switch (activation) {
    case Activation::kLinear: return "linear";
    case Activation::kRelu: return "relu";
    case Activation::kSigmoid: return "sigmoid";
    case Activation::kTanh: return "tanh";
    case Activation::kGelu: return "gelu";
    case Activation::kGeluApproximate: return "gelu_approximate";
  }
  return "linear";
}

bool activation_gradient_needs_input(Activation activation) {
  return activation == Activation::kGelu || activation == Activation::kGeluApproximate;
}

namespace {

using detail::add_op;
using detail::add_op_multi;
using graph::DType;
using graph::GradContext;
using graph::OpDef;
using graph::OpRegistry;
using graph::ShapeContext;
using graph::TensorSpec;

constexpr std::int64_t kUnknown = Shape::kUnknown;

graph::Attrs activation_attrs(Activation activation) {
  graph::Attrs attrs;
  attrs.set("activation", activation_name(activation));
  return attrs;
}

// The "activation" attribute of a node, checked (a graph built by op name may carry anything).
Activation activation_attr(const ShapeContext& ctx) {
  const auto& name = ctx.attrs().get<std::string>("activation");
  try {
    return parse_activation(name);
  } catch (const InvalidArgument& e) {
    ctx.fail("{}", e.what());
  }
}

Activation activation_attr(const GradContext& ctx) {
  return parse_activation(ctx.attrs().get<std::string>("activation"));
}

bool dims_compatible(std::int64_t a, std::int64_t b) { return a == b || a == kUnknown || b == kUnknown; }
// The better-known of two compatible dimensions.
std::int64_t merge_dims(std::int64_t a, std::int64_t b) { return a == kUnknown ? b : a; }

void require_rank_at_least(const ShapeContext& ctx, int i, int rank, std::string_view what) {
  ctx.require(ctx.shape(i).rank() >= rank, "{} has shape {}; expected rank {} or more", what, ctx.shape(i), rank);
}

void require_float_input(const ShapeContext& ctx, int i, std::string_view what) {
  ctx.require(graph::is_floating(ctx.dtype(i)), "{} has dtype {}; expected a floating-point tensor", what,
              ctx.dtype(i));
}

void require_dtype_like(const ShapeContext& ctx, int i, std::string_view what, int like, std::string_view like_what) {
  ctx.require(ctx.dtype(i) == ctx.dtype(like), "{} has dtype {}; expected {} like {}", what, ctx.dtype(i),
              ctx.dtype(like), like_what);
}

// Checks that input i is a vector with one entry per channel (the last dimension) of input 0,
// and returns the channel count, known from either side when possible.
std::int64_t require_channel_vector(const ShapeContext& ctx, int i, std::string_view what) {
  const Shape& x = ctx.shape(0);
  const Shape& v = ctx.shape(i);
  const std::int64_t channels = x.dim(-1);
  ctx.require(v.rank() == 1 && dims_compatible(v[0], channels),
              "{} has shape {}; expected {} to match the last dimension of input {}", what, v, Shape{channels}, x);
  require_dtype_like(ctx, i, what, 0, "the input");
  return merge_dims(channels, v[0]);
}

void require_positive_epsilon(const ShapeContext& ctx) {
  const double epsilon = ctx.attrs().get_float_or("epsilon", 1e-3);
  ctx.require(epsilon > 0.0, "epsilon is {}; expected a positive number (it keeps 1/sqrt(variance + epsilon) finite)",
              epsilon);
}

// ---- Shape functions ------------------------------------------------------------------------

std::vector<TensorSpec> float_rank1_same(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  require_rank_at_least(ctx, 0, 1, "input");
  return {ctx.input(0)};
}

std::vector<TensorSpec> bias_add_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  require_rank_at_least(ctx, 0, 1, "input");
  const std::int64_t channels = require_channel_vector(ctx, 1, "bias");
  return {TensorSpec{ctx.dtype(0), ctx.shape(0).with_dim(-1, channels)}};
}

// The fused ops' second output: the pre-activation for activations whose gradient needs it
// (GELU), an empty tensor otherwise.
TensorSpec pre_activation_spec(const ShapeContext& ctx, const TensorSpec& y) {
  if (activation_gradient_needs_input(activation_attr(ctx))) return y;
  return TensorSpec{y.dtype, Shape{0}};
}

std::vector<TensorSpec> bias_activation_shape(ShapeContext& ctx) {
  auto specs = bias_add_shape(ctx);
  specs.push_back(pre_activation_spec(ctx, specs[0]));
  return specs;
}

std::vector<TensorSpec> bias_add_grad_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "output gradient");
  require_rank_at_least(ctx, 0, 1, "output gradient");
  return {TensorSpec{ctx.dtype(0), Shape{ctx.shape(0).dim(-1)}}};
}

std::vector<TensorSpec> bias_activation_grad_shape(ShapeContext& ctx) {
  auto specs = detail::same_float_pair(ctx);
  require_rank_at_least(ctx, 0, 1, "output gradient");
  activation_attr(ctx);
  const Shape& shape = specs[0].shape;
  return {specs[0], TensorSpec{ctx.dtype(0), Shape{merge_dims(shape.dim(-1), ctx.shape(1).dim(-1))}}};
}

std::vector<TensorSpec> fused_matmul_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  const Shape& x = ctx.shape(0);
  const Shape& kernel = ctx.shape(1);
  const Shape& bias = ctx.shape(2);
  ctx.require(x.rank() == 2, "input has shape {}; expected rank 2 (batch, features)", x);
  ctx.require(kernel.rank() == 2, "kernel has shape {}; expected rank 2 (features, units)", kernel);
  require_dtype_like(ctx, 1, "kernel", 0, "the input");
  require_dtype_like(ctx, 2, "bias", 0, "the input");
  ctx.require(dims_compatible(x[1], kernel[0]), "input {} has {} features, kernel {} expects {}", x, x[1], kernel,
              kernel[0]);
  ctx.require(bias.rank() == 1 && dims_compatible(bias[0], kernel[1]), "bias has shape {}; expected {} for kernel {}",
              bias, Shape{kernel[1]}, kernel);
  const TensorSpec y{ctx.dtype(0), Shape{x[0], merge_dims(kernel[1], bias[0])}};
  return {y, pre_activation_spec(ctx, y)};
}

// Logits [batch, classes] and what the loss compares them with; outputs loss [batch] and the
// gradient of the loss with respect to the logits [batch, classes].
std::vector<TensorSpec> sparse_xent_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "logits");
  const Shape& logits = ctx.shape(0);
  const Shape& labels = ctx.shape(1);
  ctx.require(logits.rank() == 2, "logits have shape {}; expected rank 2 (batch, classes)", logits);
  ctx.require(ctx.dtype(1) == DType::kI32 || ctx.dtype(1) == DType::kI64,
              "labels have dtype {}; expected int32 or int64 class ids", ctx.dtype(1));
  ctx.require(labels.rank() == 1 && dims_compatible(labels[0], logits[0]),
              "labels have shape {}; expected {} (one class id per row of logits {})", labels, Shape{logits[0]},
              logits);
  const std::int64_t batch = merge_dims(logits[0], labels[0]);
  return {TensorSpec{ctx.dtype(0), Shape{batch}}, TensorSpec{ctx.dtype(0), Shape{batch, logits[1]}}};
}

std::vector<TensorSpec> xent_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "logits");
  const Shape& logits = ctx.shape(0);
  const Shape& labels = ctx.shape(1);
  ctx.require(logits.rank() == 2, "logits have shape {}; expected rank 2 (batch, classes)", logits);
  require_dtype_like(ctx, 1, "labels", 0, "the logits");
  ctx.require(labels.compatible_with(logits), "labels have shape {}; expected the logits' shape {}", labels, logits);
  const Shape shape{merge_dims(logits[0], labels[0]), merge_dims(logits[1], labels[1])};
  return {TensorSpec{ctx.dtype(0), Shape{shape[0]}}, TensorSpec{ctx.dtype(0), shape}};
}

std::vector<TensorSpec> sigmoid_xent_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "logits");
  require_dtype_like(ctx, 1, "labels", 0, "the logits");
  ctx.require(ctx.shape(1).compatible_with(ctx.shape(0)), "labels have shape {}; expected the logits' shape {}",
              ctx.shape(1), ctx.shape(0));
  return {ctx.input(0)};
}

// (dy, logits, labels) -> (dlogits, dlabels).
std::vector<TensorSpec> sigmoid_xent_grad_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "output gradient");
  for (int i = 1; i < 3; ++i) {
    require_dtype_like(ctx, i, i == 1 ? "logits" : "labels", 0, "the output gradient");
    ctx.require(ctx.shape(i).compatible_with(ctx.shape(0)), "input {} has shape {}; expected {}", i, ctx.shape(i),
                ctx.shape(0));
  }
  return {ctx.input(1), ctx.input(1)};
}

void require_dropout_rate(const ShapeContext& ctx) {
  const double rate = ctx.attrs().get_float_or("rate", 0.5);
  ctx.require(rate >= 0.0 && rate < 1.0, "rate is {}; expected a fraction in [0, 1)", rate);
}

std::vector<TensorSpec> dropout_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  require_dropout_rate(ctx);
  return {ctx.input(0), ctx.input(0)};
}

// (x, scale, offset, mean, variance) -> (y, batch_mean, batch_variance, saved_mean, saved_inv_std).
std::vector<TensorSpec> batch_norm_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  ctx.require(ctx.shape(0).rank() >= 2, "input has shape {}; expected rank 2 or more (channels last)", ctx.shape(0));
  require_positive_epsilon(ctx);
  std::int64_t channels = ctx.shape(0).dim(-1);
  constexpr std::string_view kNames[] = {"", "scale", "offset", "mean", "variance"};
  for (int i = 1; i < 5; ++i) channels = merge_dims(channels, require_channel_vector(ctx, i, kNames[i]));
  const TensorSpec stats{ctx.dtype(0), Shape{channels}};
  return {TensorSpec{ctx.dtype(0), ctx.shape(0).with_dim(-1, channels)}, stats, stats, stats, stats};
}

// (dy, x, scale, saved_mean, saved_inv_std[, dbatch_mean, dbatch_variance])
//   -> (dx, dscale, doffset, dmean, dvariance).
std::vector<TensorSpec> batch_norm_grad_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "output gradient");
  ctx.require(ctx.shape(1).compatible_with(ctx.shape(0)), "input has shape {}; expected the output gradient's {}",
              ctx.shape(1), ctx.shape(0));
  require_dtype_like(ctx, 1, "input", 0, "the output gradient");
  ctx.require(ctx.shape(0).rank() >= 2, "output gradient has shape {}; expected rank 2 or more", ctx.shape(0));
  ctx.require(ctx.num_inputs() == 5 || ctx.num_inputs() == 7,
              "{} inputs; expected 5, or 7 with the gradients of batch_mean and batch_variance", ctx.num_inputs());
  std::int64_t channels = ctx.shape(0).dim(-1);
  constexpr std::string_view kNames[] = {
      "", "", "scale", "saved_mean", "saved_inv_std", "batch_mean gradient", "batch_variance gradient"};
  for (int i = 2; i < ctx.num_inputs(); ++i) channels = merge_dims(channels, require_channel_vector(ctx, i, kNames[i]));
  const TensorSpec per_channel{ctx.dtype(0), Shape{channels}};
  return {TensorSpec{ctx.dtype(0), ctx.shape(0).with_dim(-1, channels)}, per_channel, per_channel, per_channel,
          per_channel};
}

bool flag(const ShapeContext& ctx, std::string_view name) { return ctx.attrs().get_bool_or(name, false); }

// Per-row statistics (layer norm's mean and 1 / std) are float32 for 16-bit x: kept for the
// backward pass, they would lose what the normalisation is about in 8 or 11 bits.
DType statistics_dtype(DType x) { return graph::is_low_precision(x) ? DType::kF32 : x; }

// (x[, gamma][, beta]) -> (y, mean, inv_std); attrs "scale" and "center" say which are present.
std::vector<TensorSpec> layer_norm_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  require_rank_at_least(ctx, 0, 1, "input");
  require_positive_epsilon(ctx);
  const bool scale = flag(ctx, "scale"), center = flag(ctx, "center");
  ctx.require(ctx.num_inputs() == 1 + int{scale} + int{center},
              "{} inputs; expected the input{}{} (attributes scale={}, center={})", ctx.num_inputs(),
              scale ? ", gamma" : "", center ? ", beta" : "", scale, center);
  std::int64_t channels = ctx.shape(0).dim(-1);
  if (scale) channels = merge_dims(channels, require_channel_vector(ctx, 1, "gamma"));
  if (center) channels = merge_dims(channels, require_channel_vector(ctx, scale ? 2 : 1, "beta"));
  const Shape& x = ctx.shape(0);
  Shape rows;
  for (int d = 0; d + 1 < x.rank(); ++d) rows.push_back(x[d]);
  const TensorSpec stats{statistics_dtype(ctx.dtype(0)), rows};
  return {TensorSpec{ctx.dtype(0), x.with_dim(-1, channels)}, stats, stats};
}

// (dy, x, mean, inv_std[, gamma]) -> (dx, dgamma, dbeta).
std::vector<TensorSpec> layer_norm_grad_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "output gradient");
  require_rank_at_least(ctx, 0, 1, "output gradient");
  ctx.require(ctx.shape(1).compatible_with(ctx.shape(0)), "input has shape {}; expected the output gradient's {}",
              ctx.shape(1), ctx.shape(0));
  require_dtype_like(ctx, 1, "input", 0, "the output gradient");
  const bool scale = flag(ctx, "scale");
  ctx.require(ctx.num_inputs() == 4 + int{scale}, "{} inputs; expected dy, x, mean, inv_std{}", ctx.num_inputs(),
              scale ? ", gamma" : "");
  const DType stats = statistics_dtype(ctx.dtype(0));
  for (int i = 2; i < 4; ++i) {
    ctx.require(ctx.dtype(i) == stats && ctx.shape(i).rank() == ctx.shape(0).rank() - 1,
                "input {} ({}) is {} {}; expected {} statistics of rank {}", i, i == 2 ? "mean" : "inv_std",
                ctx.dtype(i), ctx.shape(i), stats, ctx.shape(0).rank() - 1);
  }
  std::int64_t channels = ctx.shape(0).dim(-1);
  if (scale) channels = merge_dims(channels, require_channel_vector(ctx, 4, "gamma"));
  const TensorSpec per_channel{ctx.dtype(0), Shape{channels}};
  return {TensorSpec{ctx.dtype(0), ctx.shape(0).with_dim(-1, channels)}, per_channel, per_channel};
}

void require_masked_softmax_attrs(const ShapeContext& ctx) {
  const double scale = ctx.attrs().get_float_or("scale", 1.0);
  ctx.require(std::isfinite(scale), "scale is {}; expected a finite number", scale);
  if (flag(ctx, "causal")) {
    ctx.require(ctx.shape(0).rank() >= 2, "causal: input has shape {}; expected rank 2 or more ([..., T, S])",
                ctx.shape(0));
  }
}

// (x[, mask]) -> y. The mask broadcasts to x like NumPy (right-aligned, each dimension 1 or x's).
std::vector<TensorSpec> masked_softmax_shape(ShapeContext& ctx) {
  require_float_input(ctx, 0, "input");
  require_rank_at_least(ctx, 0, 1, "input");
  require_masked_softmax_attrs(ctx);
  if (ctx.num_inputs() == 2) {
    const Shape& x = ctx.shape(0);
    const Shape& mask = ctx.shape(1);
    const DType mt = ctx.dtype(1);
    ctx.require(mt == DType::kI32 || mt == DType::kI64 || mt == DType::kU8,
                "mask has dtype {}; expected int32, int64 or uint8 (non-zero = attend)", mt);
    bool broadcasts = mask.rank() <= x.rank();
    for (int d = 0; broadcasts && d < mask.rank(); ++d) {
      const std::int64_t m = mask[d], xd = x[d + x.rank() - mask.rank()];
      broadcasts = m == 1 || dims_compatible(m, xd);
    }
    ctx.require(broadcasts, "mask has shape {}, which does not broadcast to the input's {}", mask, x);
  }
  return {ctx.input(0)};
}

// (dy, y) -> dx.
std::vector<TensorSpec> masked_softmax_grad_shape(ShapeContext& ctx) {
  auto specs = detail::same_float_pair(ctx);
  require_rank_at_least(ctx, 0, 1, "output gradient");
  require_masked_softmax_attrs(ctx);
  return specs;
}

// ---- Gradient functions ---------------------------------------------------------------------

std::vector<Output> relu_grad(GradContext& ctx) { return {add_op("ReluGrad", {ctx.grad(0), ctx.output(0)})}; }
std::vector<Output> sigmoid_grad(GradContext& ctx) { return {add_op("SigmoidGrad", {ctx.grad(0), ctx.output(0)})}; }
std::vector<Output> tanh_grad(GradContext& ctx) { return {add_op("TanhGrad", {ctx.grad(0), ctx.output(0)})}; }
std::vector<Output> gelu_grad(GradContext& ctx) {
  return {add_op("GeluGrad", {ctx.grad(0), ctx.input(0)}, ctx.attrs())};
}
std::vector<Output> softmax_grad(GradContext& ctx) { return {add_op("SoftmaxGrad", {ctx.grad(0), ctx.output(0)})}; }
std::vector<Output> log_softmax_grad(GradContext& ctx) {
  return {add_op("LogSoftmaxGrad", {ctx.grad(0), ctx.output(0)})};
}

std::vector<Output> bias_add_grad(GradContext& ctx) { return {ctx.grad(0), add_op("BiasAddGrad", {ctx.grad(0)})}; }

// dz = dy * act'(z) and the bias gradient, from the output y (or the kept pre-activation z for
// GELU); linear needs no new dz. Only y is differentiated: the pre-activation output is internal.
std::pair<Output, Output> bias_activation_backward(GradContext& ctx, Activation activation) {
  if (!ctx.has_grad(0)) return {Output{}, Output{}};
  if (activation == Activation::kLinear) return {ctx.grad(0), add_op("BiasAddGrad", {ctx.grad(0)})};
  const Output saved = activation_gradient_needs_input(activation) ? ctx.output(1) : ctx.output(0);
  auto outs = add_op_multi("BiasActivationGrad", {ctx.grad(0), saved}, activation_attrs(activation));
  return {outs[0], outs[1]};
}

std::vector<Output> bias_activation_grad(GradContext& ctx) {
  auto [dz, dbias] = bias_activation_backward(ctx, activation_attr(ctx));
  return {dz, dbias};
}

std::vector<Output> fused_matmul_grad(GradContext& ctx) {
  auto [dz, dbias] = bias_activation_backward(ctx, activation_attr(ctx));
  if (!dz.defined()) return {Output{}, Output{}, Output{}};
  const Output dx = matmul(dz, ctx.input(1), {.transpose_b = true});
  const Output dkernel = matmul(ctx.input(0), dz, {.transpose_a = true});
  return {dx, dkernel, dbias};
}

// dloss [batch] as a column [batch, 1] that broadcasts over the classes.
Output as_column(Output v) { return reshape(v, Shape{kUnknown, 1}); }

// Only the loss is differentiated; the backprop output is itself a gradient (TF does the same).
std::vector<Output> sparse_xent_grad(GradContext& ctx) {
  if (!ctx.has_grad(0)) return {Output{}, Output{}};
  return {mul(ctx.output(1), as_column(ctx.grad(0))), Output{}};
}

// d loss / d labels = -log_softmax(logits): labels may be a trained distribution (TF allows it).
std::vector<Output> xent_grad(GradContext& ctx) {
  if (!ctx.has_grad(0)) return {Output{}, Output{}};
  const Output dlogits = mul(ctx.output(1), as_column(ctx.grad(0)));
  const Output dlabels = mul(log_softmax(ctx.input(0)), as_column(neg(ctx.grad(0))));
  return {dlogits, dlabels};
}

std::vector<Output> sigmoid_xent_grad(GradContext& ctx) {
  auto outs = add_op_multi("SigmoidCrossEntropyWithLogitsGrad", {ctx.grad(0), ctx.input(0), ctx.input(1)});
  return {outs[0], outs[1]};
}

bool dropout_is_identity(const graph::Attrs& attrs) {
  return !attrs.get_bool_or("training", true) || attrs.get_float_or("rate", 0.5) == 0.0;
}

std::vector<Output> dropout_grad(GradContext& ctx) {
  if (!ctx.has_grad(0)) return {Output{}};  // only the mask was used: it does not depend on x
  if (dropout_is_identity(ctx.attrs())) return {ctx.grad(0)};
  return {mul(ctx.grad(0), ctx.output(1))};
}

// Training: dy -> dx, dscale, doffset; batch_mean and batch_variance are functions of x too, so
// their gradients (rarely present: moving averages are not differentiated) go into dx. No
// gradient reaches the mean and variance inputs, which training mode does not read.
// Inference: batch_mean and batch_variance are the mean and variance inputs, and y depends on
// them, so both get gradients.
std::vector<Output> batch_norm_grad(GradContext& ctx) {
  const bool training = ctx.attrs().get_bool_or("training", true);
  const Output dy = ctx.has_grad(0) ? ctx.grad(0) : zeros_like(ctx.output(0));
  std::vector<Output> inputs{dy, ctx.input(0), ctx.input(1), ctx.output(3), ctx.output(4)};
  if (ctx.has_grad(1) || ctx.has_grad(2)) {
    inputs.push_back(ctx.has_grad(1) ? ctx.grad(1) : zeros_like(ctx.output(1)));
    inputs.push_back(ctx.has_grad(2) ? ctx.grad(2) : zeros_like(ctx.output(2)));
  }
  graph::Attrs attrs;
  attrs.set("training", training);
  auto outs = add_op_multi("FusedBatchNormGrad", std::move(inputs), std::move(attrs));
  if (training) return {outs[0], outs[1], outs[2], Output{}, Output{}};
  return {outs[0], outs[1], outs[2], outs[3], outs[4]};
}

// dx, dgamma, dbeta in one op; the statistics outputs carry no gradient (they are internal).
std::vector<Output> layer_norm_grad(GradContext& ctx) {
  if (!ctx.has_grad(0)) return std::vector<Output>(static_cast<std::size_t>(ctx.node().inputs.size()));
  const bool scale = ctx.attrs().get_bool_or("scale", false), center = ctx.attrs().get_bool_or("center", false);
  std::vector<Output> inputs{ctx.grad(0), ctx.input(0), ctx.output(1), ctx.output(2)};
  if (scale) inputs.push_back(ctx.input(1));
  graph::Attrs attrs;
  attrs.set("scale", scale);
  auto outs = add_op_multi("LayerNormGrad", std::move(inputs), std::move(attrs));
  std::vector<Output> grads{outs[0]};
  if (scale) grads.push_back(outs[1]);
  if (center) grads.push_back(outs[2]);
  return grads;
}

// The mask is not differentiable; masked entries of y are 0, so their dx is 0 too.
std::vector<Output> masked_softmax_grad(GradContext& ctx) {
  graph::Attrs attrs;
  attrs.set("scale", ctx.attrs().get_float_or("scale", 1.0)).set("causal", ctx.attrs().get_bool_or("causal", false));
  std::vector<Output> grads{add_op("MaskedSoftmaxGrad", {ctx.grad(0), ctx.output(0)}, std::move(attrs))};
  if (ctx.node().inputs.size() == 2) grads.emplace_back();
  return grads;
}

// ---- Registration ---------------------------------------------------------------------------

void add_def_range(std::string name, int min_inputs, int max_inputs, int outputs, graph::ShapeFn shape_fn,
                   graph::GradFn grad_fn = nullptr) {
  OpRegistry::global().add(OpDef{.name = std::move(name),
                                 .min_inputs = min_inputs,
                                 .max_inputs = max_inputs,
                                 .num_outputs = outputs,
                                 .shape_fn = shape_fn,
                                 .grad_fn = grad_fn});
}

void add_def(std::string name, int inputs, int outputs, graph::ShapeFn shape_fn, graph::GradFn grad_fn = nullptr) {
  add_def_range(std::move(name), inputs, inputs, outputs, shape_fn, grad_fn);
}

}  // namespace

Activation parse_activation(std::string_view name) {
  for (const Activation a : {Activation::kLinear, Activation::kRelu, Activation::kSigmoid, Activation::kTanh,
                             Activation::kGelu, Activation::kGeluApproximate}) {
    if (name == activation_name(a)) return a;
  }
  throw InvalidArgument(fmt::format(
      "unknown activation \"{}\"; known activations: linear, relu, sigmoid, tanh, gelu, gelu_approximate", name));
}

Output relu(Output x) { return add_op("Relu", {x}); }
Output sigmoid(Output x) { return add_op("Sigmoid", {x}); }
Output tanh(Output x) { return add_op("Tanh", {x}); }
Output gelu(Output x, bool approximate) {
  graph::Attrs attrs;
  attrs.set("approximate", approximate);
  return add_op("Gelu", {x}, std::move(attrs));
}
Output softmax(Output x) { return add_op("Softmax", {x}); }
Output log_softmax(Output x) { return add_op("LogSoftmax", {x}); }

Output bias_add(Output x, Output bias) { return add_op("BiasAdd", {x, bias}); }

Output bias_activation(Output x, Output bias, Activation activation) {
  return add_op_multi("BiasActivation", {x, bias}, activation_attrs(activation))[0];
}

Output dense(Output x, Output kernel, Output bias, Activation activation) {
  return add_op_multi("FusedMatMul", {x, kernel, bias}, activation_attrs(activation))[0];
}

Output sparse_softmax_cross_entropy_with_logits(Output logits, Output labels) {
  return add_op_multi("SparseSoftmaxCrossEntropyWithLogits", {logits, labels})[0];
}

Output softmax_cross_entropy_with_logits(Output logits, Output labels) {
  return add_op_multi("SoftmaxCrossEntropyWithLogits", {logits, labels})[0];
}

Output sigmoid_cross_entropy_with_logits(Output logits, Output labels) {
  return add_op("SigmoidCrossEntropyWithLogits", {logits, labels});
}

Output dropout(Output x, const DropoutOptions& options) {
  TANDEM_REQUIRE(options.rate >= 0.0 && options.rate < 1.0, InvalidArgument,
                 "dropout: rate is {}; expected a fraction in [0, 1)", options.rate);
  graph::Attrs attrs;
  attrs.set("rate", options.rate).set("seed", options.seed).set("training", options.training);
  return add_op_multi("Dropout", {x}, std::move(attrs))[0];
}

BatchNormOutputs fused_batch_norm(Output x, Output scale, Output offset, Output mean, Output variance,
                                  const BatchNormOptions& options) {
  graph::Attrs attrs;
  attrs.set("epsilon", options.epsilon).set("training", options.training);
  auto outs = add_op_multi("FusedBatchNorm", {x, scale, offset, mean, variance}, std::move(attrs));
  return BatchNormOutputs{outs[0], outs[1], outs[2]};
}

Output layer_norm(Output x, Output gamma, Output beta, const LayerNormOptions& options) {
  TANDEM_REQUIRE(options.epsilon > 0.0, InvalidArgument, "layer_norm: epsilon is {}; expected a positive number",
                 options.epsilon);
  std::vector<Output> inputs{x};
  if (gamma.defined()) inputs.push_back(gamma);
  if (beta.defined()) inputs.push_back(beta);
  graph::Attrs attrs;
  attrs.set("epsilon", options.epsilon).set("scale", gamma.defined()).set("center", beta.defined());
  return add_op_multi("LayerNorm", std::move(inputs), std::move(attrs))[0];
}

Output masked_softmax(Output x, Output mask, const MaskedSoftmaxOptions& options) {
  std::vector<Output> inputs{x};
  if (mask.defined()) inputs.push_back(mask);
  graph::Attrs attrs;
  attrs.set("scale", options.scale).set("causal", options.causal);
  return add_op("MaskedSoftmax", std::move(inputs), std::move(attrs));
}

namespace detail {

void register_nn_ops() {
  add_def("Relu", 1, 1, same_as_input0_float, relu_grad);
  add_def("Sigmoid", 1, 1, same_as_input0_float, sigmoid_grad);
  add_def("Tanh", 1, 1, same_as_input0_float, tanh_grad);
  add_def("ReluGrad", 2, 1, same_float_pair);
  add_def("SigmoidGrad", 2, 1, same_float_pair);
  add_def("TanhGrad", 2, 1, same_float_pair);
  add_def("Gelu", 1, 1, same_as_input0_float, gelu_grad);
  add_def("GeluGrad", 2, 1, same_float_pair);

  add_def("Softmax", 1, 1, float_rank1_same, softmax_grad);
  add_def("LogSoftmax", 1, 1, float_rank1_same, log_softmax_grad);
  add_def("SoftmaxGrad", 2, 1, same_float_pair);
  add_def("LogSoftmaxGrad", 2, 1, same_float_pair);

  add_def("BiasAdd", 2, 1, bias_add_shape, bias_add_grad);
  add_def("BiasAddGrad", 1, 1, bias_add_grad_shape);
  add_def("BiasActivation", 2, 2, bias_activation_shape, bias_activation_grad);
  add_def("BiasActivationGrad", 2, 2, bias_activation_grad_shape);
  add_def("FusedMatMul", 3, 2, fused_matmul_shape, fused_matmul_grad);

  add_def("SparseSoftmaxCrossEntropyWithLogits", 2, 2, sparse_xent_shape, sparse_xent_grad);
  add_def("SoftmaxCrossEntropyWithLogits", 2, 2, xent_shape, xent_grad);
  add_def("SigmoidCrossEntropyWithLogits", 2, 1, sigmoid_xent_shape, sigmoid_xent_grad);
  add_def("SigmoidCrossEntropyWithLogitsGrad", 3, 2, sigmoid_xent_grad_shape);

  add_def("Dropout", 1, 2, dropout_shape, dropout_grad);

  add_def("FusedBatchNorm", 5, 5, batch_norm_shape, batch_norm_grad);
  OpRegistry::global().add(OpDef{.name = "FusedBatchNormGrad",
                                 .min_inputs = 5,
                                 .max_inputs = 7,
                                 .num_outputs = 5,
                                 .shape_fn = batch_norm_grad_shape});

  add_def_range("LayerNorm", 1, 3, 3, layer_norm_shape, layer_norm_grad);
  add_def_range("LayerNormGrad", 4, 5, 3, layer_norm_grad_shape);
  add_def_range("MaskedSoftmax", 1, 2, 1, masked_softmax_shape, masked_softmax_grad);
  add_def("MaskedSoftmaxGrad", 2, 1, masked_softmax_grad_shape);
}

}  // namespace detail
}  // namespace tandem::ops
