// 2-D convolution and pooling: builders, shape functions and gradients (kernels: cpu/conv_kernels.cc).
//
// Ops, all NHWC with HWIO filters and TF's semantics:
//   Conv2D(x, filter)                        attrs strides [sh, sw], padding "VALID" | "SAME"
//   Conv2DBackpropInput(x_like, filter, dy)  dL/dx; x_like only provides the shape
//   Conv2DBackpropFilter(x, filter_like, dy) dL/dfilter; filter_like only provides the shape
//   MaxPool2D(x), MaxPool2DGrad(x, y, dy)    attrs pool_size, strides, padding
//   AvgPool2D(x), AvgPool2DGrad(x_like, dy)
//   MaxPool2DBiasActivationGrad(y, dp)       -> (dz, db) for p = MaxPool2D(y), y = act(z + b), act
//                                            relu or linear: FusedConv2D's gradient when a max
//                                            pool follows it (attrs: the pool's, activation)
//   FusedConv2DMaxPool(x, filter, bias)      -> (p, argmax): p = MaxPool2D(act(conv + bias)) without
//                                            the convolution's output in memory; argmax (uint8) the
//                                            winning cell of each window and channel, or 255 where
//                                            relu's derivative is 0 (attrs: the convolution's
//                                            strides, padding, activation; pool_size, pool_strides,
//                                            pool_padding VALID, windows disjoint)
//   Conv2DBackpropFilterArgmax(x, filter_like, argmax, dp) -> (dfilter, db): its filter and bias
//                                            gradients, from dz = dp at the cell argmax names and
//                                            0 elsewhere, expanded from argmax as the kernel reads
//                                            it (dz is never stored)
//   Conv2DBackpropInputArgmax(x_like, filter, argmax, dp) -> dx: its input gradient, from the same
//                                            dz, expanded image by image
// The backprop ops are linear in their non-shape inputs, so they have gradients too (second
// derivatives, and gradient checks of the backprop kernels themselves).
#include "tandem/ops/conv_ops.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>

#include "tandem/ops/cpu/conv_geometry.h"
#include "tandem/ops/detail/op_util.h"
#include "tandem/ops/detail/registration.h"

namespace tandem::ops {

using graph::Attrs;
using graph::Shape;

Padding parse_padding(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "valid") return Padding::kValid;
  if (lower == "same") return Padding::kSame;
  throw InvalidArgument(fmt::format("padding \"{}\": expected \"valid\" or \"same\"", name));
}

namespace {

Attrs window_attrs(std::array<std::int64_t, 2> strides, Padding padding) {
  Attrs attrs;
  attrs.set(detail::kStridesAttr, std::vector<std::int64_t>{strides[0], strides[1]});
  attrs.set(detail::kPaddingAttr, detail::padding_name(padding));
  return attrs;
}

Attrs pool_attrs(const Pool2DOptions& options) {
  Attrs attrs = window_attrs(options.strides, options.padding);
  attrs.set(detail::kPoolSizeAttr, std::vector<std::int64_t>{options.pool_size[0], options.pool_size[1]});
  return attrs;
}

}  // namespace

Output conv2d(Output x, Output filter, const Conv2DOptions& options) {
  return detail::add_op("Conv2D", {x, filter}, window_attrs(options.strides, options.padding));
}

Output fused_conv2d(Output x, Output filter, Output bias, Activation activation, const Conv2DOptions& options) {
  // FusedConv2D's gradient differentiates its activation through the output y; GELU needs its
  // input, so it follows the fused convolution as its own op.
  if (activation_gradient_needs_input(activation)) {
    return gelu(fused_conv2d(x, filter, bias, Activation::kLinear, options), activation == Activation::kGeluApproximate);
  }
  Attrs attrs = window_attrs(options.strides, options.padding);
  attrs.set("activation", activation_name(activation));
  return detail::add_op("FusedConv2D", {x, filter, bias}, std::move(attrs));
}

namespace {

// FusedConv2DMaxPool in place of MaxPool2D(x) when x is a FusedConv2D's output the kernels can
// pool while it is in cache and nothing else reads (see max_pool2d in conv_ops.h).
std::optional<Output> fuse_conv_max_pool(Output x, const Pool2DOptions& options) {
  if (!x.defined() || x.index != 0) return std::nullopt;
  const graph::Node& conv = x.producer();
  if (conv.op_name() != "FusedConv2D") return std::nullopt;
  const auto& activation = conv.attrs.get<std::string>("activation");
  if (activation != activation_name(Activation::kRelu) && activation != activation_name(Activation::kLinear))
    return std::nullopt;
  if (x.dtype() != graph::kFloat32 && x.dtype() != graph::kFloat64) return std::nullopt;
  const auto [k_h, k_w] = options.pool_size;
  const auto [s_h, s_w] = options.strides;
  if (options.padding != Padding::kValid || k_h < 1 || k_w < 1 || s_h < k_h || s_w < k_w ||
      k_h * k_w > detail::kMaxFusedPoolCells)
    return std::nullopt;
  // Its windows must fit (the MaxPool2D node reports a window larger than the input).
  const Shape& y = x.shape();
  if ((y[1] >= 0 && y[1] < k_h) || (y[2] >= 0 && y[2] < k_w)) return std::nullopt;
  Graph& graph = *x.graph;
  if (conv.device != graph.current_device_scope()) return std::nullopt;  // a placement boundary
  for (int id = 0; id < graph.num_nodes(); ++id) {
    for (const Output& input : graph.node(id).inputs) {
      if (input == x) return std::nullopt;
    }
  }
  Attrs attrs = conv.attrs;
  attrs.set(detail::kPoolSizeAttr, std::vector<std::int64_t>{k_h, k_w});
  attrs.set(detail::kPoolStridesAttr, std::vector<std::int64_t>{s_h, s_w});
  attrs.set(detail::kPoolPaddingAttr, detail::padding_name(options.padding));
  return detail::add_op_multi("FusedConv2DMaxPool", conv.inputs, std::move(attrs))[0];
}

}  // namespace

Output max_pool2d(Output x, const Pool2DOptions& options) {
  if (auto fused = fuse_conv_max_pool(x, options)) return *fused;
  return detail::add_op("MaxPool2D", {x}, pool_attrs(options));
}

Output avg_pool2d(Output x, const Pool2DOptions& options) {
  return detail::add_op("AvgPool2D", {x}, pool_attrs(options));
}

namespace detail {
namespace {

using graph::GradContext;
using graph::OpDef;
using graph::OpRegistry;
using graph::ShapeContext;
using graph::TensorSpec;

// Reads and validates the window attributes of the node being added or planned.
WindowAttrs checked_window_attrs(const ShapeContext& ctx, bool pooling) {
  const auto positive_pair = [&](std::string_view name) {
    const auto& v = ctx.attrs().get<std::vector<std::int64_t>>(name);
    ctx.require(v.size() == 2 && v[0] > 0 && v[1] > 0, "{} must be two positive integers (height, width), got [{}]",
                name, fmt::join(v, ", "));
  };
  try {
    positive_pair(kStridesAttr);
    if (pooling) positive_pair(kPoolSizeAttr);
    return read_window_attrs(ctx.attrs(), pooling);
  } catch (const InvalidArgument& e) {
    // A missing or mistyped attribute, or a bad padding name: say which node.
    if (std::string_view(e.what()).starts_with(ctx.label())) throw;
    ctx.fail("{}", e.what());
  }
}

void require_nhwc(const ShapeContext& ctx, int i, std::string_view what) {
  ctx.require(ctx.shape(i).rank() == 4, "{} must have rank 4 ({}), got shape {}", what,
              what == "filter" || what == "filter_like" ? "height, width, in_channels, out_channels"
                                                        : "batch, height, width, channels",
              ctx.shape(i));
}

// Output shape of a window of k_h x k_w over NHWC `x` with out_c output channels. `window_what`
// names the window in errors ("filter (3, 3, 1, 32)", "pool window 2x2").
Shape window_output_shape(const ShapeContext& ctx, const Shape& x, std::int64_t k_h, std::int64_t k_w,
                          std::int64_t out_c, const WindowAttrs& attrs, const std::string& window_what) {
  const std::int64_t in_h = x[1], in_w = x[2];
  if (attrs.padding == Padding::kValid) {
    const bool fits = (in_h < 0 || k_h < 0 || in_h >= k_h) && (in_w < 0 || k_w < 0 || in_w >= k_w);
    ctx.require(fits, "with VALID padding the {} does not fit in the input {} (window {}x{}, input {}x{})", window_what,
                x, k_h, k_w, in_h, in_w);
  }
  const auto out = [&](std::int64_t in, std::int64_t k, std::int64_t s) {
    return k < 0 ? Shape::kUnknown : window_output_size(in, k, s, attrs.padding);
  };
  return Shape{x[0], out(in_h, k_h, attrs.strides[0]), out(in_w, k_w, attrs.strides[1]), out_c};
}

// The shape Conv2D gives for x and filter; checks ranks and channels.
Shape conv_output_shape(const ShapeContext& ctx, int x_index, int filter_index, const WindowAttrs& attrs) {
  const Shape& x = ctx.shape(x_index);
  const Shape& f = ctx.shape(filter_index);
  const std::int64_t x_c = x[3], f_c = f[2];
  ctx.require(x_c < 0 || f_c < 0 || x_c == f_c, "input {} has {} channels but the filter {} expects {}", x, x_c, f,
              f_c);
  ctx.require(f[0] != 0 && f[1] != 0, "the filter {} has an empty window", f);
  return window_output_shape(ctx, x, f[0], f[1], f[3], attrs, fmt::format("filter {}", f));
}

// Where one input fixes a shape another input also gives (dy vs the forward output).
void require_compatible(const ShapeContext& ctx, const Shape& got, const Shape& want, std::string_view what,
                        std::string_view from) {
  ctx.require(got.compatible_with(want), "{} has shape {}, but {} gives {}", what, got, from, want);
}

// `like` with its unknown dimensions taken from `other` where that one knows them.
Shape merge_shapes(const Shape& like, const Shape& other) {
  Shape merged = like;
  for (int i = 0; i < like.rank() && i < other.rank(); ++i) {
    if (merged[i] < 0) merged[i] = other[i];
  }
  return merged;
}

void require_float_inputs(const ShapeContext& ctx) {
  ctx.require_float(0);
  for (int i = 1; i < ctx.num_inputs(); ++i) ctx.require_same_dtype(0, i);
}

std::vector<TensorSpec> conv2d_shape(ShapeContext& ctx) {
  require_float_inputs(ctx);
  require_nhwc(ctx, 0, "input");
  require_nhwc(ctx, 1, "filter");
  const auto attrs = checked_window_attrs(ctx, false);
  return {TensorSpec{ctx.dtype(0), conv_output_shape(ctx, 0, 1, attrs)}};
}

std::vector<TensorSpec> fused_conv2d_shape(ShapeContext& ctx) {
  auto out = conv2d_shape(ctx);
  ctx.require_same_dtype(0, 2);
  const Shape& filter = ctx.shape(1);
  const Shape& bias = ctx.shape(2);
  ctx.require(bias.rank() == 1 && (bias[0] == filter[3] || bias[0] == Shape::kUnknown || filter[3] == Shape::kUnknown),
              "bias of shape {} does not match the filter's {} output channels (filter {})", bias, filter[3], filter);
  const Activation activation = parse_activation(ctx.attrs().get<std::string>("activation"));
  ctx.require(!activation_gradient_needs_input(activation),
              "activation {} is not fused into a convolution (its gradient needs the pre-activation); ops::fused_conv2d "
              "applies it after",
              activation_name(activation));
  return out;
}

std::vector<TensorSpec> conv2d_backprop_input_shape(ShapeContext& ctx) {
  require_float_inputs(ctx);
  require_nhwc(ctx, 0, "x_like");
  require_nhwc(ctx, 1, "filter");
  require_nhwc(ctx, 2, "dy");
  const auto attrs = checked_window_attrs(ctx, false);
  const Shape y = conv_output_shape(ctx, 0, 1, attrs);
  require_compatible(ctx, ctx.shape(2), y, "dy",
                     fmt::format("Conv2D of x_like {} and filter {}", ctx.shape(0), ctx.shape(1)));
  Shape x = ctx.shape(0);
  if (x[0] < 0) x[0] = ctx.shape(2)[0];  // the batch is known once dy's is
  return {TensorSpec{ctx.dtype(0), x}};
}

std::vector<TensorSpec> conv2d_backprop_filter_shape(ShapeContext& ctx) {
  require_float_inputs(ctx);
  require_nhwc(ctx, 0, "x");
  require_nhwc(ctx, 1, "filter_like");
  require_nhwc(ctx, 2, "dy");
  const auto attrs = checked_window_attrs(ctx, false);
  const Shape y = conv_output_shape(ctx, 0, 1, attrs);
  require_compatible(ctx, ctx.shape(2), y, "dy",
                     fmt::format("Conv2D of x {} and filter {}", ctx.shape(0), ctx.shape(1)));
  Shape f = ctx.shape(1);
  if (f[3] < 0) f[3] = ctx.shape(2)[3];
  return {TensorSpec{ctx.dtype(0), f}};
}

Shape pool_output_shape(const ShapeContext& ctx, const WindowAttrs& attrs) {
  const Shape& x = ctx.shape(0);
  return window_output_shape(ctx, x, attrs.pool_size[0], attrs.pool_size[1], x[3], attrs,
                             fmt::format("pool window {}x{}", attrs.pool_size[0], attrs.pool_size[1]));
}

std::vector<TensorSpec> pool_shape(ShapeContext& ctx) {
  require_float_inputs(ctx);
  require_nhwc(ctx, 0, "input");
  const auto attrs = checked_window_attrs(ctx, true);
  return {TensorSpec{ctx.dtype(0), pool_output_shape(ctx, attrs)}};
}

// MaxPool2DGrad(x, y, dy) and AvgPool2DGrad(x_like, dy): the last input is dy, shaped like the
// pool's output; so is y.
std::vector<TensorSpec> pool_grad_shape(ShapeContext& ctx) {
  require_float_inputs(ctx);
  require_nhwc(ctx, 0, ctx.num_inputs() == 3 ? "x" : "x_like");
  const auto attrs = checked_window_attrs(ctx, true);
  const Shape y = pool_output_shape(ctx, attrs);
  const std::string from = fmt::format("pooling {}", ctx.shape(0));
  if (ctx.num_inputs() == 3) require_compatible(ctx, ctx.shape(1), y, "y", from);
  const int dy = ctx.num_inputs() - 1;
  require_compatible(ctx, ctx.shape(dy), y, "dy", from);
  return {TensorSpec{ctx.dtype(0), merge_shapes(ctx.shape(0), Shape{ctx.shape(dy)[0], -1, -1, ctx.shape(dy)[3]})}};
}

// MaxPool2DBiasActivationGrad(y, dp): y is the pool's input, dp the gradient of its output.
std::vector<TensorSpec> max_pool_bias_activation_grad_shape(ShapeContext& ctx) {
  require_float_inputs(ctx);
  require_nhwc(ctx, 0, "y");
  require_nhwc(ctx, 1, "dp");
  const auto attrs = checked_window_attrs(ctx, true);
  const Activation activation = parse_activation(ctx.attrs().get<std::string>("activation"));
  ctx.require(activation == Activation::kRelu || activation == Activation::kLinear,
              "activation {} is not fused into a max pool's gradient (relu or linear)", activation_name(activation));
  require_compatible(ctx, ctx.shape(1), pool_output_shape(ctx, attrs), "dp", fmt::format("pooling {}", ctx.shape(0)));
  const Shape y = merge_shapes(ctx.shape(0), Shape{ctx.shape(1)[0], -1, -1, ctx.shape(1)[3]});
  return {TensorSpec{ctx.dtype(0), y}, TensorSpec{ctx.dtype(0), Shape{y[3]}}};
}

// FusedConv2DMaxPool(x, filter, bias): FusedConv2D's checks, then its pool's over the output.
std::vector<TensorSpec> fused_conv2d_max_pool_shape(ShapeContext& ctx) {
  const TensorSpec y = fused_conv2d_shape(ctx)[0];
  const auto& activation = ctx.attrs().get<std::string>("activation");
  ctx.require(activation == activation_name(Activation::kRelu) || activation == activation_name(Activation::kLinear),
              "activation {} is not fused into a convolution with a max pool (relu or linear)", activation);
  const auto positive_pair = [&](std::string_view name) {
    const auto& v = ctx.attrs().get<std::vector<std::int64_t>>(name);
    ctx.require(v.size() == 2 && v[0] > 0 && v[1] > 0, "{} must be two positive integers (height, width), got [{}]",
                name, fmt::join(v, ", "));
  };
  positive_pair(kPoolSizeAttr);
  positive_pair(kPoolStridesAttr);
  WindowAttrs pool;
  try {
    pool = read_fused_pool_attrs(ctx.attrs());
  } catch (const InvalidArgument& e) {
    ctx.fail("{}", e.what());
  }
  const auto [k_h, k_w] = pool.pool_size;
  ctx.require(pool.padding == Padding::kValid && pool.strides[0] >= k_h && pool.strides[1] >= k_w &&
                  k_h * k_w <= kMaxFusedPoolCells,
              "pool window {}x{}, strides [{}, {}], padding {}: FusedConv2DMaxPool takes VALID windows that do not "
              "overlap, up to {} cells (MaxPool2D takes the others)",
              k_h, k_w, pool.strides[0], pool.strides[1], padding_name(pool.padding), kMaxFusedPoolCells);
  const Shape p =
      window_output_shape(ctx, y.shape, k_h, k_w, y.shape[3], pool, fmt::format("pool window {}x{}", k_h, k_w));
  return {TensorSpec{y.dtype, p}, TensorSpec{graph::kUInt8, p}};
}

// The argmax gradient ops' (x, filter, argmax, dp): the specs of dz (shaped like Conv2D(x,
// filter)) and db, after checking that argmax and dp are that convolution's pooled shape.
std::vector<TensorSpec> pooled_dz_db_shape(ShapeContext& ctx) {
  ctx.require_float(0);
  ctx.require_same_dtype(0, 1);
  ctx.require_same_dtype(0, 3);
  ctx.require(ctx.dtype(2) == graph::kUInt8, "argmax must be uint8 (FusedConv2DMaxPool's), got {}",
              graph::dtype_name(ctx.dtype(2)));
  require_nhwc(ctx, 0, "x");
  require_nhwc(ctx, 1, "filter");
  require_nhwc(ctx, 2, "argmax");
  require_nhwc(ctx, 3, "dp");
  const auto attrs = checked_window_attrs(ctx, false);
  Shape z = conv_output_shape(ctx, 0, 1, attrs);
  WindowAttrs pool;
  try {
    pool = read_fused_pool_attrs(ctx.attrs());
  } catch (const InvalidArgument& e) {
    ctx.fail("{}", e.what());
  }
  const Shape p = window_output_shape(ctx, z, pool.pool_size[0], pool.pool_size[1], z[3], pool,
                                      fmt::format("pool window {}x{}", pool.pool_size[0], pool.pool_size[1]));
  const std::string from = fmt::format("Conv2D of x {} and filter {}, pooled", ctx.shape(0), ctx.shape(1));
  require_compatible(ctx, ctx.shape(2), p, "argmax", from);
  require_compatible(ctx, ctx.shape(3), p, "dp", from);
  z = merge_shapes(z, Shape{ctx.shape(3)[0], -1, -1, ctx.shape(3)[3]});
  return {TensorSpec{ctx.dtype(0), z}, TensorSpec{ctx.dtype(0), Shape{z[3]}}};
}

// Conv2DBackpropFilterArgmax(x, filter_like, argmax, dp) -> (dfilter, db).
std::vector<TensorSpec> conv2d_backprop_filter_argmax_shape(ShapeContext& ctx) {
  const auto dz_db = pooled_dz_db_shape(ctx);
  Shape f = ctx.shape(1);
  if (f[3] < 0) f[3] = dz_db[1].shape[0];
  return {TensorSpec{ctx.dtype(0), f}, dz_db[1]};
}

// Conv2DBackpropInputArgmax(x_like, filter, argmax, dp) -> dx, shaped like x.
std::vector<TensorSpec> conv2d_backprop_input_argmax_shape(ShapeContext& ctx) {
  const auto dz_db = pooled_dz_db_shape(ctx);
  Shape x = ctx.shape(0);
  if (x[0] < 0) x[0] = dz_db[0].shape[0];
  return {TensorSpec{ctx.dtype(0), x}};
}

// --- gradients -------------------------------------------------------------------------------

// y = Conv2D(x, w): dx = BackpropInput(x, w, dy), dw = BackpropFilter(x, w, dy).
std::vector<Output> conv2d_grad(GradContext& ctx) {
  const Output x = ctx.input(0), w = ctx.input(1), dy = ctx.grad(0);
  return {add_op("Conv2DBackpropInput", {x, w, dy}, ctx.attrs()),
          add_op("Conv2DBackpropFilter", {x, w, dy}, ctx.attrs())};
}

// When y = act(conv + b) has its gradient from a MaxPool2D of it alone (dy = MaxPool2DGrad(y, p,
// dp)) and act is relu or linear: {dz, db} by MaxPool2DBiasActivationGrad(y, dp), one pass over y
// where MaxPool2DGrad and BiasActivationGrad take three (y in, dy out; dy and y in, dz out). The
// MaxPool2DGrad node is left without consumers, and executors prune it.
std::optional<std::vector<Output>> pooled_bias_activation_grad(GradContext& ctx, const std::string& activation) {
  if (activation != activation_name(Activation::kRelu) && activation != activation_name(Activation::kLinear))
    return std::nullopt;
  const Output dy = ctx.grad(0);
  if (!dy.defined()) return std::nullopt;
  const graph::Node& pool_grad = dy.producer();
  if (pool_grad.op_name() != "MaxPool2DGrad" || !(pool_grad.inputs[0] == ctx.output(0))) return std::nullopt;
  Attrs attrs = pool_grad.attrs;
  attrs.set("activation", activation);
  return add_op_multi("MaxPool2DBiasActivationGrad", {ctx.output(0), pool_grad.inputs[2]}, std::move(attrs));
}

// y = act(conv(x, w) + b): the activation's derivative and the bias gradient in one sweep
// (BiasActivationGrad, or MaxPool2DBiasActivationGrad when a max pool follows), then the
// convolution's gradients of that.
std::vector<Output> fused_conv2d_grad(GradContext& ctx) {
  const Output x = ctx.input(0), w = ctx.input(1);
  const std::string& activation = ctx.attrs().get<std::string>("activation");
  auto dz_db = pooled_bias_activation_grad(ctx, activation);
  if (!dz_db)
    dz_db = add_op_multi("BiasActivationGrad", {ctx.grad(0), ctx.output(0)}, Attrs{{"activation", activation}});
  const Output dz = (*dz_db)[0];
  return {add_op("Conv2DBackpropInput", {x, w, dz}, ctx.attrs()),
          add_op("Conv2DBackpropFilter", {x, w, dz}, ctx.attrs()), (*dz_db)[1]};
}

// (p, argmax) = FusedConv2DMaxPool(x, w, b): every gradient straight from argmax and dp, dz
// expanded inside the kernels as they read it, never stored. When nothing needs dx (a first
// layer) executors prune its node.
std::vector<Output> fused_conv2d_max_pool_grad(GradContext& ctx) {
  if (!ctx.has_grad(0)) return {Output{}, Output{}, Output{}};
  const Output x = ctx.input(0), w = ctx.input(1), argmax = ctx.output(1), dp = ctx.grad(0);
  const auto dw_db = add_op_multi("Conv2DBackpropFilterArgmax", {x, w, argmax, dp}, ctx.attrs());
  return {add_op("Conv2DBackpropInputArgmax", {x, w, argmax, dp}, ctx.attrs()), dw_db[0], dw_db[1]};
}

// dx = BackpropInput(w, dy) is bilinear: <g, dx> = <Conv2D(g, w), dy>, so
// d/dw = BackpropFilter(g, w, dy) and d/ddy = Conv2D(g, w).
std::vector<Output> conv2d_backprop_input_grad(GradContext& ctx) {
  const Output w = ctx.input(1), dy = ctx.input(2), g = ctx.grad(0);
  return {Output{}, add_op("Conv2DBackpropFilter", {g, w, dy}, ctx.attrs()), add_op("Conv2D", {g, w}, ctx.attrs())};
}

// dw = BackpropFilter(x, dy): <G, dw> = <Conv2D(x, G), dy>, so d/dx = BackpropInput(x, G, dy)
// and d/ddy = Conv2D(x, G).
std::vector<Output> conv2d_backprop_filter_grad(GradContext& ctx) {
  const Output x = ctx.input(0), dy = ctx.input(2), g = ctx.grad(0);
  return {add_op("Conv2DBackpropInput", {x, g, dy}, ctx.attrs()), Output{}, add_op("Conv2D", {x, g}, ctx.attrs())};
}

std::vector<Output> max_pool2d_grad(GradContext& ctx) {
  return {add_op("MaxPool2DGrad", {ctx.input(0), ctx.output(0), ctx.grad(0)}, ctx.attrs())};
}

std::vector<Output> avg_pool2d_grad(GradContext& ctx) {
  return {add_op("AvgPool2DGrad", {ctx.input(0), ctx.grad(0)}, ctx.attrs())};
}

// AvgPool2DGrad is linear in dy and is AvgPool2D's adjoint: d/ddy = AvgPool2D(g).
std::vector<Output> avg_pool2d_grad_grad(GradContext& ctx) {
  return {Output{}, add_op("AvgPool2D", {ctx.grad(0)}, ctx.attrs())};
}

}  // namespace

void register_conv_ops() {
  auto& r = OpRegistry::global();
  r.add(OpDef{.name = "Conv2D", .min_inputs = 2, .max_inputs = 2, .shape_fn = conv2d_shape, .grad_fn = conv2d_grad});
  r.add(OpDef{.name = "FusedConv2D",
              .min_inputs = 3,
              .max_inputs = 3,
              .shape_fn = fused_conv2d_shape,
              .grad_fn = fused_conv2d_grad});
  r.add(OpDef{.name = "Conv2DBackpropInput",
              .min_inputs = 3,
              .max_inputs = 3,
              .shape_fn = conv2d_backprop_input_shape,
              .grad_fn = conv2d_backprop_input_grad});
  r.add(OpDef{.name = "Conv2DBackpropFilter",
              .min_inputs = 3,
              .max_inputs = 3,
              .shape_fn = conv2d_backprop_filter_shape,
              .grad_fn = conv2d_backprop_filter_grad});
  r.add(
      OpDef{.name = "MaxPool2D", .min_inputs = 1, .max_inputs = 1, .shape_fn = pool_shape, .grad_fn = max_pool2d_grad});
  // Not differentiable (TF's MaxPoolGradGrad is not implemented yet).
  r.add(OpDef{.name = "MaxPool2DGrad", .min_inputs = 3, .max_inputs = 3, .shape_fn = pool_grad_shape});
  // Not differentiable either (it stands for MaxPool2DGrad).
  r.add(OpDef{.name = "MaxPool2DBiasActivationGrad",
              .min_inputs = 2,
              .max_inputs = 2,
              .num_outputs = 2,
              .shape_fn = max_pool_bias_activation_grad_shape});
  r.add(OpDef{.name = "FusedConv2DMaxPool",
              .min_inputs = 3,
              .max_inputs = 3,
              .num_outputs = 2,
              .shape_fn = fused_conv2d_max_pool_shape,
              .grad_fn = fused_conv2d_max_pool_grad});
  // Not differentiable (they stand for MaxPool2DGrad too).
  r.add(OpDef{.name = "Conv2DBackpropFilterArgmax",
              .min_inputs = 4,
              .max_inputs = 4,
              .num_outputs = 2,
              .shape_fn = conv2d_backprop_filter_argmax_shape});
  r.add(OpDef{.name = "Conv2DBackpropInputArgmax",
              .min_inputs = 4,
              .max_inputs = 4,
              .shape_fn = conv2d_backprop_input_argmax_shape});
  r.add(
      OpDef{.name = "AvgPool2D", .min_inputs = 1, .max_inputs = 1, .shape_fn = pool_shape, .grad_fn = avg_pool2d_grad});
  r.add(OpDef{.name = "AvgPool2DGrad",
              .min_inputs = 2,
              .max_inputs = 2,
              .shape_fn = pool_grad_shape,
              .grad_fn = avg_pool2d_grad_grad});
}

}  // namespace detail
}  // namespace tandem::ops
