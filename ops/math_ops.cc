// Math ops: arithmetic with broadcasting, reductions, MatMul. Definitions and builders; kernels in
// cpu/math_kernels.cc.
#include "tandem/ops/math_ops.h"

#include <atomic>
#include <string_view>

#include <algorithm>

#include "tandem/base/env.h"
#include "tandem/ops/array_ops.h"
#include "tandem/ops/detail/batch_matmul_args.h"
#include "tandem/ops/detail/op_util.h"
#include "tandem/ops/detail/registration.h"

namespace tandem::ops {

using detail::add_op;
using detail::GradContext;
using detail::ShapeContext;
using detail::TensorSpec;

Output add(Output a, Output b) { return add_op("Add", {a, b}); }
Output sub(Output a, Output b) { return add_op("Sub", {a, b}); }
Output mul(Output a, Output b) { return add_op("Mul", {a, b}); }
Output div(Output a, Output b) { return add_op("Div", {a, b}); }
Output neg(Output x) { return add_op("Neg", {x}); }
Output add_n(const std::vector<Output>& xs) {
  TANDEM_REQUIRE(!xs.empty(), InvalidArgument, "add_n needs at least one input");
  if (xs.size() == 1) return xs.front();
  return add_op("AddN", xs);
}
Output square(Output x) { return add_op("Square", {x}); }
Output abs(Output x) { return add_op("Abs", {x}); }
Output sqrt(Output x) { return add_op("Sqrt", {x}); }
Output exp(Output x) { return add_op("Exp", {x}); }
Output log(Output x) { return add_op("Log", {x}); }
Output sign(Output x) { return add_op("Sign", {x}); }

namespace {
graph::Attrs reduce_attrs(const ReduceOptions& options) {
  return {{"axes", options.axes}, {"keep_dims", options.keep_dims}};
}
}  // namespace

Output reduce_sum(Output x, const ReduceOptions& options) { return add_op("Sum", {x}, reduce_attrs(options)); }
Output reduce_mean(Output x, const ReduceOptions& options) { return add_op("Mean", {x}, reduce_attrs(options)); }
Output reduce_max(Output x, const ReduceOptions& options) { return add_op("Max", {x}, reduce_attrs(options)); }

namespace {
std::atomic<bool>& tf32_flag() {
  static std::atomic<bool> flag = env::get_bool(env::kAllowTf32);
  return flag;
}
}  // namespace

void enable_tensor_float_32_execution(bool enabled) { tf32_flag().store(enabled); }
bool tensor_float_32_execution_enabled() { return tf32_flag().load(); }

Output matmul(Output a, Output b, const MatMulOptions& options) {
  return add_op("MatMul", {a, b}, {{"transpose_a", options.transpose_a}, {"transpose_b", options.transpose_b}});
}

Output batch_matmul(Output a, Output b, const BatchMatMulOptions& options) {
  graph::Attrs attrs{{"adj_x", options.adj_x}, {"adj_y", options.adj_y}};
  // Set only when on, so that plain products' graphs (and their exports) are as before.
  if (options.a_lower_triangular) attrs.set("a_lower_triangular", true);
  if (options.output_lower_triangular) attrs.set("output_lower_triangular", true);
  return add_op("BatchMatMul", {a, b}, std::move(attrs));
}

Output sum_to_shape_of(Output x, Output like) {
  if (x.shape() == like.shape() && x.shape().is_fully_defined()) return x;
  return add_op("SumToShape", {x, like});
}

namespace {

// ----- shape functions -----

void require_numeric(ShapeContext& ctx, int i) {
  const DType d = ctx.dtype(i);
  ctx.require(d != DType::kU8, "input {} has dtype {}; expected float32, float64, float16, bfloat16, int32 or int64", i,
              d);
}

std::vector<TensorSpec> binary_shape(ShapeContext& ctx) {
  require_numeric(ctx, 0);
  ctx.require_same_dtype(0, 1);
  return {TensorSpec{ctx.dtype(0), detail::broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1))}};
}

std::vector<TensorSpec> unary_numeric_shape(ShapeContext& ctx) {
  require_numeric(ctx, 0);
  return {ctx.input(0)};
}

std::vector<TensorSpec> add_n_shape(ShapeContext& ctx) {
  for (int i = 1; i < ctx.num_inputs(); ++i) {
    ctx.require_same_dtype(0, i);
    ctx.require(ctx.shape(0).compatible_with(ctx.shape(i)),
                "input {} has shape {}, input 0 has {}; AddN needs equal shapes", i, ctx.shape(i), ctx.shape(0));
  }
  require_numeric(ctx, 0);
  return {ctx.input(0)};
}

// The axes a reduction reduces, normalised and sorted; all axes when the list is empty.
std::vector<int> reduced_axes(const ShapeContext& ctx, const Shape& in) {
  const auto& axes = ctx.attrs().get<std::vector<std::int64_t>>("axes");
  std::vector<int> out;
  if (axes.empty()) {
    for (int i = 0; i < in.rank(); ++i) out.push_back(i);
    return out;
  }
  for (auto a : axes) out.push_back(graph::normalize_axis(static_cast<int>(a), in.rank(), ctx.label()));
  std::sort(out.begin(), out.end());
  ctx.require(std::adjacent_find(out.begin(), out.end()) == out.end(), "axes [{}] repeat an axis",
              fmt::join(axes, ", "));
  return out;
}

Shape reduced_shape(const Shape& in, const std::vector<int>& axes, bool keep_dims) {
  Shape out;
  for (int i = 0; i < in.rank(); ++i) {
    const bool reduced = std::binary_search(axes.begin(), axes.end(), i);
    if (!reduced) {
      out.push_back(in[i]);
    } else if (keep_dims) {
      out.push_back(1);
    }
  }
  return out;
}

std::vector<TensorSpec> reduce_shape(ShapeContext& ctx) {
  require_numeric(ctx, 0);
  const auto axes = reduced_axes(ctx, ctx.shape(0));
  return {TensorSpec{ctx.dtype(0), reduced_shape(ctx.shape(0), axes, ctx.attrs().get_bool_or("keep_dims", false))}};
}

std::vector<TensorSpec> max_reduce_shape(ShapeContext& ctx) {
  auto out = reduce_shape(ctx);
  for (int a : reduced_axes(ctx, ctx.shape(0))) {
    ctx.require(ctx.shape(0)[a] != 0, "cannot take the max over axis {} of size 0 in {}", a, ctx.shape(0));
  }
  return out;
}

// SumGrad / MeanGrad (dy, x): dy broadcast back over the reduced axes, shaped like x.
std::vector<TensorSpec> reduce_grad_shape(ShapeContext& ctx) {
  ctx.require_same_dtype(0, 1);
  return {ctx.input(1)};
}

// MaxGrad (dy, x, y): like x.
std::vector<TensorSpec> max_grad_shape(ShapeContext& ctx) {
  ctx.require_same_dtype(0, 1);
  return {ctx.input(1)};
}

std::vector<TensorSpec> sum_to_shape_shape(ShapeContext& ctx) {
  ctx.require_same_dtype(0, 1);
  const Shape& x = ctx.shape(0);
  const Shape& like = ctx.shape(1);
  ctx.require(like.rank() <= x.rank(), "cannot sum {} down to the larger rank of {}", x, like);
  for (int i = 0; i < like.rank(); ++i) {
    const std::int64_t dx = x[x.rank() - like.rank() + i];
    const std::int64_t dl = like[i];
    ctx.require(dl == 1 || dl == dx || dl == Shape::kUnknown || dx == Shape::kUnknown,
                "cannot sum {} down to {}: dimension {} is {} vs {}", x, like, i, dx, dl);
  }
  return {ctx.input(1)};
}

std::vector<TensorSpec> matmul_shape(ShapeContext& ctx) {
  ctx.require_float(0);
  ctx.require_same_dtype(0, 1);
  const Shape& a = ctx.shape(0);
  const Shape& b = ctx.shape(1);
  ctx.require(a.rank() == 2 && b.rank() == 2, "MatMul takes matrices; got a {} and b {}", a, b);
  const bool ta = ctx.attrs().get_bool_or("transpose_a", false);
  const bool tb = ctx.attrs().get_bool_or("transpose_b", false);
  const std::int64_t m = ta ? a[1] : a[0];
  const std::int64_t ka = ta ? a[0] : a[1];
  const std::int64_t kb = tb ? b[1] : b[0];
  const std::int64_t n = tb ? b[0] : b[1];
  ctx.require(ka == kb || ka == Shape::kUnknown || kb == Shape::kUnknown,
              "inner dimensions differ: a is {}{}, b is {}{} ({} vs {})", a, ta ? " (transposed)" : "", b,
              tb ? " (transposed)" : "", ka, kb);
  return {TensorSpec{ctx.dtype(0), Shape{m, n}}};
}

// The leading (batch) axes of a BatchMatMul operand.
Shape batch_axes(const Shape& s) {
  Shape batch;
  for (int d = 0; d + 2 < s.rank(); ++d) batch.push_back(s[d]);
  return batch;
}

std::vector<TensorSpec> batch_matmul_shape(ShapeContext& ctx) {
  ctx.require_float(0);
  ctx.require_same_dtype(0, 1);
  const Shape& a = ctx.shape(0);
  const Shape& b = ctx.shape(1);
  ctx.require(a.rank() >= 2 && b.rank() >= 2, "BatchMatMul takes tensors of rank 2 or more; got a {} and b {}", a, b);
  const bool adj_x = ctx.attrs().get_bool_or("adj_x", false);
  const bool adj_y = ctx.attrs().get_bool_or("adj_y", false);
  const auto [a_lower, output_lower] = detail::batch_matmul_triangles(ctx.attrs());
  // The combinations whose gradients are products of the same kinds (batch_matmul_grad).
  ctx.require(!(a_lower && output_lower), "a_lower_triangular and output_lower_triangular cannot both be set");
  ctx.require(!a_lower || !adj_y, "a_lower_triangular needs adj_y false (b not transposed)");
  ctx.require(!output_lower || (!adj_x && adj_y),
              "output_lower_triangular needs adj_x false and adj_y true (a @ b^T, as attention's q @ k^T)");
  const std::int64_t m = a.dim(adj_x ? -1 : -2), ka = a.dim(adj_x ? -2 : -1);
  const std::int64_t kb = b.dim(adj_y ? -1 : -2), n = b.dim(adj_y ? -2 : -1);
  ctx.require(ka == kb || ka == Shape::kUnknown || kb == Shape::kUnknown,
              "inner dimensions differ: a is {}{}, b is {}{} ({} vs {})", a, adj_x ? " (adjoint)" : "", b,
              adj_y ? " (adjoint)" : "", ka, kb);
  const Shape ba = batch_axes(a), bb = batch_axes(b);
  const int rank = std::max(ba.rank(), bb.rank());
  for (int d = 0; d < rank; ++d) {
    const int da = d - (rank - ba.rank()), db = d - (rank - bb.rank());
    const std::int64_t x = da >= 0 ? ba[da] : 1, y = db >= 0 ? bb[db] : 1;
    ctx.require(x == y || x == 1 || y == 1 || x == Shape::kUnknown || y == Shape::kUnknown,
                "batch dimensions of a {} and b {} do not broadcast (batch axis {}: {} vs {})", a, b, d, x, y);
  }
  Shape out = detail::broadcast_shapes(ctx, ba, bb);
  out.push_back(m);
  out.push_back(n);
  return {TensorSpec{ctx.dtype(0), out}};
}

// ----- gradient functions -----

// The gradient of a broadcasting binary op for input i, reduced to that input's shape.
Output reduce_for_input(const GradContext& ctx, Output grad, int i) {
  const Output in = ctx.input(i);
  const Output other = ctx.input(1 - i);
  if (detail::broadcast_is_identity(in.shape(), other.shape())) return grad;
  return sum_to_shape_of(grad, in);
}

std::vector<Output> add_grad(GradContext& ctx) {
  return {reduce_for_input(ctx, ctx.grad(0), 0), reduce_for_input(ctx, ctx.grad(0), 1)};
}
std::vector<Output> sub_grad(GradContext& ctx) {
  return {reduce_for_input(ctx, ctx.grad(0), 0), reduce_for_input(ctx, neg(ctx.grad(0)), 1)};
}
std::vector<Output> mul_grad(GradContext& ctx) {
  const Output dy = ctx.grad(0);
  return {reduce_for_input(ctx, mul(dy, ctx.input(1)), 0), reduce_for_input(ctx, mul(dy, ctx.input(0)), 1)};
}
std::vector<Output> div_grad(GradContext& ctx) {
  // y = a / b: da = dy / b; db = -dy * y / b.
  const Output dy = ctx.grad(0);
  const Output b = ctx.input(1);
  return {reduce_for_input(ctx, div(dy, b), 0), reduce_for_input(ctx, neg(div(mul(dy, ctx.output(0)), b)), 1)};
}
std::vector<Output> neg_grad(GradContext& ctx) { return {neg(ctx.grad(0))}; }
std::vector<Output> add_n_grad(GradContext& ctx) { return std::vector<Output>(ctx.node().inputs.size(), ctx.grad(0)); }
std::vector<Output> square_grad(GradContext& ctx) {
  return {mul(ctx.grad(0), mul(ctx.input(0), scalar_like(ctx.input(0), 2.0)))};
}
std::vector<Output> abs_grad(GradContext& ctx) { return {mul(ctx.grad(0), sign(ctx.input(0)))}; }
std::vector<Output> sqrt_grad(GradContext& ctx) {
  // y = sqrt(x): dx = dy / (2 y).
  return {div(ctx.grad(0), mul(ctx.output(0), scalar_like(ctx.output(0), 2.0)))};
}
std::vector<Output> exp_grad(GradContext& ctx) { return {mul(ctx.grad(0), ctx.output(0))}; }
std::vector<Output> log_grad(GradContext& ctx) { return {div(ctx.grad(0), ctx.input(0))}; }

std::vector<Output> sum_grad(GradContext& ctx) { return {add_op("SumGrad", {ctx.grad(0), ctx.input(0)}, ctx.attrs())}; }
std::vector<Output> mean_grad(GradContext& ctx) {
  return {add_op("MeanGrad", {ctx.grad(0), ctx.input(0)}, ctx.attrs())};
}
std::vector<Output> max_grad(GradContext& ctx) {
  return {add_op("MaxGrad", {ctx.grad(0), ctx.input(0), ctx.output(0)}, ctx.attrs())};
}
std::vector<Output> sum_to_shape_grad(GradContext& ctx) {
  // The broadcast back: x's gradient is dy stretched to x's shape (dy + zeros shaped like x).
  return {add(zeros_like(ctx.input(0)), ctx.grad(0)), Output{}};
}

std::vector<Output> matmul_grad(GradContext& ctx) {
  const bool ta = ctx.attrs().get_bool_or("transpose_a", false);
  const bool tb = ctx.attrs().get_bool_or("transpose_b", false);
  const Output a = ctx.input(0);
  const Output b = ctx.input(1);
  const Output dy = ctx.grad(0);
  // C = op(A) op(B). The four cases, arranged so that no explicit transpose is materialised.
  if (!ta && !tb) return {matmul(dy, b, {.transpose_b = true}), matmul(a, dy, {.transpose_a = true})};
  if (!ta && tb) return {matmul(dy, b), matmul(dy, a, {.transpose_a = true})};
  if (ta && !tb) return {matmul(b, dy, {.transpose_b = true}), matmul(a, dy)};
  return {matmul(b, dy, {.transpose_a = true, .transpose_b = true}),
          matmul(dy, a, {.transpose_a = true, .transpose_b = true})};
}

// A BatchMatMul operand's gradient, summed over the batch axes along which it was broadcast.
Output sum_over_broadcast_batch(Output grad, Output input, Output other) {
  if (detail::broadcast_is_identity(batch_axes(input.shape()), batch_axes(other.shape()))) return grad;
  return sum_to_shape_of(grad, input);
}

std::vector<Output> batch_matmul_grad(GradContext& ctx) {
  const bool ax = ctx.attrs().get_bool_or("adj_x", false);
  const bool ay = ctx.attrs().get_bool_or("adj_y", false);
  const Output a = ctx.input(0);
  const Output b = ctx.input(1);
  const Output dy = ctx.grad(0);
  const auto bmm = [](Output x, Output y, bool adj_x, bool adj_y, BatchMatMulOptions triangles = {}) {
    triangles.adj_x = adj_x;
    triangles.adj_y = adj_y;
    return batch_matmul(x, y, triangles);
  };
  // Causal attention's products (see BatchMatMulOptions), with L the lower triangle:
  //   C = L(A) op(B): dA = L(dC op(B)^T), the same product of the output_lower kind, and
  //                   dB = op(L(A))^T dC, with A (as stored) still the lower-triangular operand;
  //   C = L(A B^T):   dA = L(dC) B and dB = L(dC)^T A, dC in the place of a lower-triangular A.
  const detail::BatchMatMulTriangles triangles = detail::batch_matmul_triangles(ctx.attrs());
  if (triangles.a_lower) {
    const BatchMatMulOptions lower_a{.a_lower_triangular = true}, lower_out{.output_lower_triangular = true};
    Output da = ax ? bmm(b, dy, false, true, lower_out) : bmm(dy, b, false, true, lower_out);
    Output db = bmm(a, dy, !ax, false, lower_a);
    return {sum_over_broadcast_batch(da, a, b), sum_over_broadcast_batch(db, b, a)};
  }
  if (triangles.output_lower) {
    const BatchMatMulOptions lower_a{.a_lower_triangular = true};
    return {sum_over_broadcast_batch(bmm(dy, b, false, false, lower_a), a, b),
            sum_over_broadcast_batch(bmm(dy, a, true, false, lower_a), b, a)};
  }
  // C = op(A) op(B): matmul_grad's four cases, batched.
  Output da, db;
  if (!ax && !ay) {
    da = bmm(dy, b, false, true);
    db = bmm(a, dy, true, false);
  } else if (!ax && ay) {
    da = bmm(dy, b, false, false);
    db = bmm(dy, a, true, false);
  } else if (ax && !ay) {
    da = bmm(b, dy, false, true);
    db = bmm(a, dy, false, false);
  } else {
    da = bmm(b, dy, true, true);
    db = bmm(dy, a, true, true);
  }
  // A matrix b shared by a batch of a (a dense layer over a sequence): its gradient is one product
  // over the flattened batch, not a product per matrix and then a sum.
  const std::int64_t k = a.shape().dim(-1), n = dy.shape().dim(-1);
  if (b.shape().rank() == 2 && a.shape().rank() > 2 && !ax && k != Shape::kUnknown && n != Shape::kUnknown) {
    const Output flat_a = reshape(a, {-1, k});
    const Output flat_dy = reshape(dy, {-1, n});
    db = ay ? matmul(flat_dy, flat_a, {.transpose_a = true}) : matmul(flat_a, flat_dy, {.transpose_a = true});
    return {da, db};
  }
  return {sum_over_broadcast_batch(da, a, b), sum_over_broadcast_batch(db, b, a)};
}

}  // namespace

namespace detail {
void register_math_ops() {
  auto& r = OpRegistry::global();
  r.add({.name = "Add", .min_inputs = 2, .max_inputs = 2, .shape_fn = binary_shape, .grad_fn = add_grad});
  r.add({.name = "Sub", .min_inputs = 2, .max_inputs = 2, .shape_fn = binary_shape, .grad_fn = sub_grad});
  r.add({.name = "Mul", .min_inputs = 2, .max_inputs = 2, .shape_fn = binary_shape, .grad_fn = mul_grad});
  r.add({.name = "Div", .min_inputs = 2, .max_inputs = 2, .shape_fn = binary_shape, .grad_fn = div_grad});
  r.add({.name = "Neg", .min_inputs = 1, .max_inputs = 1, .shape_fn = unary_numeric_shape, .grad_fn = neg_grad});
  r.add({.name = "AddN",
         .min_inputs = 1,
         .max_inputs = OpDef::kVariadic,
         .shape_fn = add_n_shape,
         .grad_fn = add_n_grad});
  r.add({.name = "Square", .min_inputs = 1, .max_inputs = 1, .shape_fn = unary_numeric_shape, .grad_fn = square_grad});
  r.add({.name = "Abs", .min_inputs = 1, .max_inputs = 1, .shape_fn = unary_numeric_shape, .grad_fn = abs_grad});
  r.add({.name = "Sqrt", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_float, .grad_fn = sqrt_grad});
  r.add({.name = "Exp", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_float, .grad_fn = exp_grad});
  r.add({.name = "Log", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input0_float, .grad_fn = log_grad});
  r.add({.name = "Sign", .min_inputs = 1, .max_inputs = 1, .shape_fn = unary_numeric_shape});
  r.add({.name = "Sum", .min_inputs = 1, .max_inputs = 1, .shape_fn = reduce_shape, .grad_fn = sum_grad});
  r.add({.name = "Mean", .min_inputs = 1, .max_inputs = 1, .shape_fn = reduce_shape, .grad_fn = mean_grad});
  r.add({.name = "Max", .min_inputs = 1, .max_inputs = 1, .shape_fn = max_reduce_shape, .grad_fn = max_grad});
  r.add({.name = "SumGrad", .min_inputs = 2, .max_inputs = 2, .shape_fn = reduce_grad_shape});
  r.add({.name = "MeanGrad", .min_inputs = 2, .max_inputs = 2, .shape_fn = reduce_grad_shape});
  r.add({.name = "MaxGrad", .min_inputs = 3, .max_inputs = 3, .shape_fn = max_grad_shape});
  r.add({.name = "SumToShape",
         .min_inputs = 2,
         .max_inputs = 2,
         .shape_fn = sum_to_shape_shape,
         .grad_fn = sum_to_shape_grad,
         .forwards_input_of_same_shape = 0});
  r.add({.name = "MatMul", .min_inputs = 2, .max_inputs = 2, .shape_fn = matmul_shape, .grad_fn = matmul_grad});
  r.add({.name = "BatchMatMul",
         .min_inputs = 2,
         .max_inputs = 2,
         .shape_fn = batch_matmul_shape,
         .grad_fn = batch_matmul_grad});
}
}  // namespace detail

}  // namespace tandem::ops

namespace tandem::graph {
Output operator+(Output a, Output b) { return ops::add(a, b); }
Output operator-(Output a, Output b) { return ops::sub(a, b); }
Output operator*(Output a, Output b) { return ops::mul(a, b); }
Output operator/(Output a, Output b) { return ops::div(a, b); }
Output operator-(Output x) { return ops::neg(x); }
}  // namespace tandem::graph
