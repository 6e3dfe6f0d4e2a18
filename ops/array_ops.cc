// Array ops: shape, type and constant ops, gathers and scatter-adds, slices and concatenation.
// Definitions and builders; kernels in cpu/array_kernels.cc.
#include "tandem/ops/array_ops.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "tandem/graph/detail/low_precision_types.h"
#include "tandem/ops/detail/op_util.h"
#include "tandem/ops/detail/registration.h"
#include "tandem/ops/math_ops.h"

namespace tandem::ops {

using detail::add_op;
using detail::add_op_in;
using detail::GradContext;
using detail::ShapeContext;
using detail::TensorSpec;

Output reshape(Output x, const Shape& shape) { return add_op("Reshape", {x}, {{"shape", shape}}); }
Output transpose(Output x, std::vector<std::int64_t> perm) {
  return add_op("Transpose", {x}, {{"perm", std::move(perm)}});
}
Output cast(Output x, DType dtype) {
  if (x.dtype() == dtype) return x;
  return add_op("Cast", {x}, {{"dtype", dtype}});
}
Output argmax(Output x, int axis) { return add_op("ArgMax", {x}, {{"axis", std::int64_t{axis}}}); }
Output equal(Output a, Output b) { return add_op("Equal", {a, b}); }
Output one_hot(Output indices, std::int64_t depth, double on_value, double off_value) {
  return add_op("OneHot", {indices}, {{"depth", depth}, {"on_value", on_value}, {"off_value", off_value}});
}
Output gather(Output params, Output indices) { return add_op("Gather", {params, indices}); }
Output unsorted_segment_sum(Output data, Output segment_ids, std::int64_t num_segments) {
  return add_op("UnsortedSegmentSum", {data, segment_ids}, {{"num_segments", num_segments}});
}
Output slice(Output x, std::vector<std::int64_t> begin, std::vector<std::int64_t> size) {
  return add_op("Slice", {x}, {{"begin", std::move(begin)}, {"size", std::move(size)}});
}
Output concat(const std::vector<Output>& xs, int axis) {
  TANDEM_REQUIRE(!xs.empty(), InvalidArgument, "concat needs at least one input");
  if (xs.size() == 1) return xs.front();
  return add_op("Concat", xs, {{"axis", std::int64_t{axis}}});
}
Output fill(Graph& graph, const Shape& shape, double value, DType dtype) {
  return add_op_in(graph, "Fill", {}, {{"shape", shape}, {"value", value}, {"dtype", dtype}});
}
Output zeros_like(Output x) { return add_op("ZerosLike", {x}); }
Output ones_like(Output x) { return add_op("OnesLike", {x}); }
Output identity(Output x) { return add_op("Identity", {x}); }
Output copy(Output x) { return add_op("Copy", {x}); }
Output stop_gradient(Output x) { return add_op("StopGradient", {x}); }
Output scalar_like(Output x, double value) {
  TANDEM_REQUIRE(x.defined(), InvalidArgument, "scalar_like: x is undefined");
  Tensor t;
  graph::dispatch<graph::EveryType>(x.dtype(), "scalar_like", [&]<class T>() {
    if constexpr (graph::is_low_precision(graph::dtype_of<T>)) {
      t = Tensor::scalar<T>(static_cast<T>(static_cast<float>(value)));
    } else {
      t = Tensor::scalar<T>(static_cast<T>(value));
    }
  });
  return x.graph->constant(t, "scalar");
}

namespace {

// ----- shape functions -----

std::vector<TensorSpec> reshape_shape(ShapeContext& ctx) {
  const Shape& in = ctx.shape(0);
  const Shape& requested = ctx.attrs().get<Shape>("shape");
  int infer_axis = -1;
  std::int64_t known_product = 1;
  for (int i = 0; i < requested.rank(); ++i) {
    if (requested[i] == Shape::kUnknown) {
      ctx.require(infer_axis < 0, "target shape {} has more than one -1", requested);
      infer_axis = i;
    } else {
      known_product *= requested[i];
    }
  }
  Shape out = requested;
  const std::int64_t n = in.num_elements();
  if (n == Shape::kUnknown) return {TensorSpec{ctx.dtype(0), out}};  // resolved when planned
  if (infer_axis >= 0) {
    ctx.require(known_product > 0 && n % known_product == 0,
                "cannot reshape {} ({} elements) to {}: {} is not a multiple of {}", in, n, requested, n,
                known_product);
    out[infer_axis] = n / known_product;
  } else {
    ctx.require(known_product == n, "cannot reshape {} ({} elements) to {} ({} elements)", in, n, requested,
                known_product);
  }
  return {TensorSpec{ctx.dtype(0), out}};
}

std::vector<TensorSpec> reshape_like_shape(ShapeContext& ctx) {
  const auto n = ctx.shape(0).num_elements();
  const auto m = ctx.shape(1).num_elements();
  ctx.require(n == Shape::kUnknown || m == Shape::kUnknown || n == m, "cannot reshape {} to the shape of {}",
              ctx.shape(0), ctx.shape(1));
  return {TensorSpec{ctx.dtype(0), ctx.shape(1)}};
}

std::vector<TensorSpec> transpose_shape(ShapeContext& ctx) {
  const auto& perm = ctx.attrs().get<std::vector<std::int64_t>>("perm");
  const Shape& in = ctx.shape(0);
  ctx.require(static_cast<int>(perm.size()) == in.rank(), "perm [{}] has {} entries for input {} of rank {}",
              fmt::join(perm, ", "), perm.size(), in, in.rank());
  std::vector<char> seen(perm.size(), 0);
  Shape out;
  for (auto p : perm) {
    ctx.require(p >= 0 && p < in.rank() && !seen[static_cast<std::size_t>(p)],
                "perm [{}] is not a permutation of 0..{}", fmt::join(perm, ", "), in.rank() - 1);
    seen[static_cast<std::size_t>(p)] = 1;
    out.push_back(in[static_cast<int>(p)]);
  }
  return {TensorSpec{ctx.dtype(0), out}};
}

std::vector<TensorSpec> cast_shape(ShapeContext& ctx) {
  const DType to = ctx.attrs().get<DType>("dtype");
  return {TensorSpec{to, ctx.shape(0)}};
}

std::vector<TensorSpec> argmax_shape(ShapeContext& ctx) {
  const Shape& in = ctx.shape(0);
  ctx.require(in.rank() >= 1, "input {} must have rank 1 or more", in);
  const int axis = graph::normalize_axis(static_cast<int>(ctx.attrs().get_int("axis")), in.rank(), ctx.label());
  Shape out;
  for (int i = 0; i < in.rank(); ++i) {
    if (i != axis) out.push_back(in[i]);
  }
  return {TensorSpec{DType::kI64, out}};
}

std::vector<TensorSpec> equal_shape(ShapeContext& ctx) {
  ctx.require_same_dtype(0, 1);
  return {TensorSpec{DType::kU8, detail::broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1))}};
}

std::vector<TensorSpec> one_hot_shape(ShapeContext& ctx) {
  ctx.require(ctx.dtype(0) == DType::kI32 || ctx.dtype(0) == DType::kI64 || ctx.dtype(0) == DType::kU8,
              "indices have dtype {}; expected int32, int64 or uint8", ctx.dtype(0));
  const auto depth = ctx.attrs().get_int("depth");
  ctx.require(depth >= 1, "depth is {}; expected 1 or more", depth);
  Shape out = ctx.shape(0);
  out.push_back(depth);
  return {TensorSpec{DType::kF32, out}};
}

std::vector<TensorSpec> fill_shape(ShapeContext& ctx) {
  const Shape& shape = ctx.attrs().get<Shape>("shape");
  ctx.require(shape.is_fully_defined(), "shape {} must be fully defined", shape);
  return {TensorSpec{ctx.attrs().get<DType>("dtype"), shape}};
}

void require_index_dtype(ShapeContext& ctx, int i, std::string_view what) {
  ctx.require(ctx.dtype(i) == DType::kI32 || ctx.dtype(i) == DType::kI64, "{} have dtype {}; expected int32 or int64",
              what, ctx.dtype(i));
}

std::vector<TensorSpec> gather_shape(ShapeContext& ctx) {
  require_index_dtype(ctx, 1, "indices");
  const Shape& params = ctx.shape(0);
  ctx.require(params.rank() >= 1, "params {} must have rank 1 or more", params);
  Shape out = ctx.shape(1);
  ctx.require(out.rank() + params.rank() - 1 <= Shape::kMaxRank,
              "indices {} and params {} give more than {} dimensions", out, params, Shape::kMaxRank);
  for (int d = 1; d < params.rank(); ++d) out.push_back(params[d]);
  return {TensorSpec{ctx.dtype(0), out}};
}

// UnsortedSegmentSum (data, segment_ids[, like]): num_segments is like.shape[0] when `like` is given
// (the gradient of Gather on params whose first dimension is unknown when it is built), else the
// attribute.
std::vector<TensorSpec> segment_sum_shape(ShapeContext& ctx) {
  ctx.require(ctx.dtype(0) != DType::kU8, "data has dtype uint8; expected a float or int32/int64 dtype");
  require_index_dtype(ctx, 1, "segment ids");
  const Shape& data = ctx.shape(0);
  const Shape& ids = ctx.shape(1);
  bool starts_with_ids = data.rank() >= ids.rank();
  for (int d = 0; starts_with_ids && d < ids.rank(); ++d) {
    starts_with_ids = data[d] == ids[d] || data[d] == Shape::kUnknown || ids[d] == Shape::kUnknown;
  }
  ctx.require(starts_with_ids, "data {} must start with the shape of the segment ids {}", data, ids);
  std::int64_t segments = 0;
  if (ctx.num_inputs() == 3) {
    ctx.require(ctx.shape(2).rank() >= 1, "the tensor giving num_segments has rank 0");
    segments = ctx.shape(2)[0];
  } else {
    segments = ctx.attrs().get_int("num_segments");
    ctx.require(segments >= 0, "num_segments is {}; expected 0 or more", segments);
  }
  Shape out{segments};
  for (int d = ids.rank(); d < data.rank(); ++d) out.push_back(data[d]);
  return {TensorSpec{ctx.dtype(0), out}};
}

std::vector<TensorSpec> slice_shape(ShapeContext& ctx) {
  const Shape& in = ctx.shape(0);
  const auto& begin = ctx.attrs().get<std::vector<std::int64_t>>("begin");
  const auto& size = ctx.attrs().get<std::vector<std::int64_t>>("size");
  ctx.require(std::cmp_equal(begin.size(), in.rank()) && std::cmp_equal(size.size(), in.rank()),
              "begin [{}] and size [{}] need one entry per axis of x {} (rank {})", fmt::join(begin, ", "),
              fmt::join(size, ", "), in, in.rank());
  Shape out;
  for (int d = 0; d < in.rank(); ++d) {
    const std::int64_t b = begin[static_cast<std::size_t>(d)], n = size[static_cast<std::size_t>(d)];
    const std::int64_t dim = in[d];
    ctx.require(b >= 0 && n >= -1, "axis {}: begin {} and size {} (begin must be 0 or more, size -1 or more)", d, b, n);
    ctx.require(dim == Shape::kUnknown || b + std::max<std::int64_t>(n, 0) <= dim,
                "axis {}: [{}, {}) is outside x {}, whose axis {} has {} elements", d, b,
                n == -1 ? std::string("end") : std::to_string(b + n), in, d, dim);
    out.push_back(n != -1 ? n : dim == Shape::kUnknown ? Shape::kUnknown : dim - b);
  }
  return {TensorSpec{ctx.dtype(0), out}};
}

// SliceGrad (dy, x): dy placed at `begin` in zeros shaped like x.
std::vector<TensorSpec> slice_grad_shape(ShapeContext& ctx) {
  ctx.require_same_dtype(0, 1);
  return {ctx.input(1)};
}

std::vector<TensorSpec> concat_shape(ShapeContext& ctx) {
  const Shape& first = ctx.shape(0);
  ctx.require(first.rank() >= 1, "input 0 {} has rank 0; concat needs rank 1 or more", first);
  const int axis = graph::normalize_axis(static_cast<int>(ctx.attrs().get_int("axis")), first.rank(), ctx.label());
  Shape out = first;
  for (int i = 1; i < ctx.num_inputs(); ++i) {
    ctx.require_same_dtype(0, i);
    const Shape& s = ctx.shape(i);
    bool matches = s.rank() == first.rank();
    for (int d = 0; matches && d < s.rank(); ++d) {
      matches = d == axis || s[d] == out[d] || s[d] == Shape::kUnknown || out[d] == Shape::kUnknown;
      if (d != axis && out[d] == Shape::kUnknown) out[d] = s[d];
    }
    ctx.require(matches, "input {} has shape {}, input 0 has {}; they must match except along axis {}", i, s, first,
                axis);
    out[axis] = out[axis] == Shape::kUnknown || s[axis] == Shape::kUnknown ? Shape::kUnknown : out[axis] + s[axis];
  }
  return {TensorSpec{ctx.dtype(0), out}};
}

// ----- gradient functions -----

std::vector<Output> reshape_grad(GradContext& ctx) { return {add_op("ReshapeLike", {ctx.grad(0), ctx.input(0)})}; }

std::vector<Output> reshape_like_grad(GradContext& ctx) {
  return {add_op("ReshapeLike", {ctx.grad(0), ctx.input(0)}), Output{}};
}

std::vector<Output> transpose_grad(GradContext& ctx) {
  const auto& perm = ctx.attrs().get<std::vector<std::int64_t>>("perm");
  std::vector<std::int64_t> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i)
    inverse[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i);
  return {transpose(ctx.grad(0), inverse)};
}

std::vector<Output> cast_grad(GradContext& ctx) {
  if (!graph::is_floating(ctx.input(0).dtype())) return {Output{}};
  return {cast(ctx.grad(0), ctx.input(0).dtype())};
}

std::vector<Output> identity_grad(GradContext& ctx) { return {ctx.grad(0)}; }

std::vector<Output> gather_grad(GradContext& ctx) {
  const Output params = ctx.input(0);
  const Output ids = ctx.input(1);
  const std::int64_t rows = params.shape()[0];
  if (rows != Shape::kUnknown) return {unsorted_segment_sum(ctx.grad(0), ids, rows), Output{}};
  return {add_op("UnsortedSegmentSum", {ctx.grad(0), ids, params}), Output{}};
}

std::vector<Output> segment_sum_grad(GradContext& ctx) {
  std::vector<Output> grads(ctx.node().inputs.size());
  grads[0] = gather(ctx.grad(0), ctx.input(1));
  return grads;
}

std::vector<Output> slice_grad(GradContext& ctx) {
  return {add_op("SliceGrad", {ctx.grad(0), ctx.input(0)},
                 {{"begin", ctx.attrs().get<std::vector<std::int64_t>>("begin")}})};
}

// Each input's gradient is its block of dy. The blocks' offsets along the axis are attributes of
// Slice, so every input's size along the axis must be known here.
std::vector<Output> concat_grad(GradContext& ctx) {
  const int rank = ctx.input(0).shape().rank();
  const auto axis = static_cast<std::size_t>(
      graph::normalize_axis(static_cast<int>(ctx.attrs().get_int("axis")), rank, ctx.node().label()));
  std::vector<Output> grads;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < ctx.node().inputs.size(); ++i) {
    const Shape& s = ctx.input(static_cast<int>(i)).shape();
    const std::int64_t extent = s[static_cast<int>(axis)];
    TANDEM_REQUIRE(extent != Shape::kUnknown, InvalidArgument,
                   "{}: the gradient needs every input's size along axis {}, and input {} is {}", ctx.node().label(),
                   axis, i, s);
    std::vector<std::int64_t> begin(static_cast<std::size_t>(rank), 0), size(static_cast<std::size_t>(rank), -1);
    begin[axis] = offset;
    size[axis] = extent;
    grads.push_back(slice(ctx.grad(0), std::move(begin), std::move(size)));
    offset += extent;
  }
  return grads;
}

}  // namespace

namespace detail {
void register_array_ops() {
  auto& r = OpRegistry::global();
  r.add({.name = "Reshape",
         .min_inputs = 1,
         .max_inputs = 1,
         .shape_fn = reshape_shape,
         .grad_fn = reshape_grad,
         .forwards_input = 0});
  r.add({.name = "ReshapeLike",
         .min_inputs = 2,
         .max_inputs = 2,
         .shape_fn = reshape_like_shape,
         .grad_fn = reshape_like_grad,
         .forwards_input = 0});
  r.add({.name = "Identity",
         .min_inputs = 1,
         .max_inputs = 1,
         .shape_fn = same_as_input0_any,
         .grad_fn = identity_grad,
         .forwards_input = 0});
  // No gradient function: gradients stop here.
  r.add(
      {.name = "StopGradient", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_any, .forwards_input = 0});
  r.add({.name = "Copy", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_any, .grad_fn = identity_grad});
  r.add(
      {.name = "Transpose", .min_inputs = 1, .max_inputs = 1, .shape_fn = transpose_shape, .grad_fn = transpose_grad});
  r.add({.name = "Cast", .min_inputs = 1, .max_inputs = 1, .shape_fn = cast_shape, .grad_fn = cast_grad});
  r.add({.name = "ArgMax", .min_inputs = 1, .max_inputs = 1, .shape_fn = argmax_shape});
  r.add({.name = "Equal", .min_inputs = 2, .max_inputs = 2, .shape_fn = equal_shape});
  r.add({.name = "OneHot", .min_inputs = 1, .max_inputs = 1, .shape_fn = one_hot_shape});
  r.add({.name = "Fill", .min_inputs = 0, .max_inputs = 0, .shape_fn = fill_shape});
  r.add({.name = "Gather", .min_inputs = 2, .max_inputs = 2, .shape_fn = gather_shape, .grad_fn = gather_grad});
  r.add({.name = "UnsortedSegmentSum",
         .min_inputs = 2,
         .max_inputs = 3,
         .shape_fn = segment_sum_shape,
         .grad_fn = segment_sum_grad});
  r.add({.name = "Slice", .min_inputs = 1, .max_inputs = 1, .shape_fn = slice_shape, .grad_fn = slice_grad});
  r.add({.name = "SliceGrad", .min_inputs = 2, .max_inputs = 2, .shape_fn = slice_grad_shape});
  r.add({.name = "Concat",
         .min_inputs = 1,
         .max_inputs = OpDef::kVariadic,
         .shape_fn = concat_shape,
         .grad_fn = concat_grad});
  r.add({.name = "ZerosLike", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_any});
  r.add({.name = "OnesLike", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_any});
}
}  // namespace detail

}  // namespace tandem::ops
