// GPU kernels of the engine's ops: each reads its KernelContext (shapes, attrs, device pointers),
// and queues the launcher of ops/cuda/kernels.cu (or cuBLAS, or cuDNN) on the device's compute stream.
// Nothing here synchronises: SparseSoftmaxCrossEntropyWithLogits reports a bad label through a
// deferred check (KernelContext::defer), so every kernel but Dropout's can be recorded in a CUDA
// graph. Every op of the engine has a GPU kernel; an op added later for CPUs only runs through
// the executor's host fallback (graph/executor.cc): correct, but with a copy each way.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "tandem/devices/detail/cuda_check.h"
#include "tandem/graph/op_registry.h"
#include "tandem/ops/cpu/conv_geometry.h"
#include "tandem/ops/cuda/cublas.h"
#include "tandem/ops/cuda/cudnn.h"
#include "tandem/ops/cuda/kernel_util.h"
#include "tandem/ops/cuda/index_args.h"
#include "tandem/ops/cuda/launchers.h"
#include "tandem/ops/detail/device_update.h"
#include "tandem/ops/detail/kernel_args.h"
#include "tandem/ops/detail/dropout_attrs.h"
#include "tandem/ops/detail/registration.h"
#include "tandem/ops/math_ops.h"
#include "tandem/ops/nn_ops.h"

namespace tandem::ops::cuda {
namespace {

using graph::DType;
using graph::KernelContext;
using graph::Shape;
using graph::Tensor;

static_assert(static_cast<int>(ElementType::kF32) == static_cast<int>(DType::kF32));
static_assert(static_cast<int>(ElementType::kF64) == static_cast<int>(DType::kF64));
static_assert(static_cast<int>(ElementType::kI32) == static_cast<int>(DType::kI32));
static_assert(static_cast<int>(ElementType::kI64) == static_cast<int>(DType::kI64));
static_assert(static_cast<int>(ElementType::kU8) == static_cast<int>(DType::kU8));
static_assert(static_cast<int>(ElementType::kF16) == static_cast<int>(DType::kF16));
static_assert(static_cast<int>(ElementType::kBF16) == static_cast<int>(DType::kBF16));
static_assert(static_cast<int>(Activation::kRelu) == static_cast<int>(ops::Activation::kRelu));
static_assert(static_cast<int>(Activation::kTanh) == static_cast<int>(ops::Activation::kTanh));
static_assert(static_cast<int>(Activation::kGelu) == static_cast<int>(ops::Activation::kGelu));
static_assert(static_cast<int>(Activation::kGeluApproximate) == static_cast<int>(ops::Activation::kGeluApproximate));

// ---- Element-wise ------------------------------------------------------------------------------

template <BinaryOp kOp>
void binary_kernel(KernelContext& ctx) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& out = ctx.output(0);
  require_types(ctx, a, kNumeric);
  binary(kOp, type_of(a), broadcast_args(out.shape(), a.shape(), &b.shape()), a.raw_data(), b.raw_data(),
         out.raw_data(), stream_of(ctx));
  check_launch(ctx);
}

template <UnaryOp kOp>
void unary_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const bool float_only = kOp == UnaryOp::kSqrt || kOp == UnaryOp::kExp || kOp == UnaryOp::kLog ||
                          kOp == UnaryOp::kSigmoid || kOp == UnaryOp::kTanh || kOp == UnaryOp::kRelu;
  require_types(ctx, x, float_only ? kFloat : kNumeric);
  unary(kOp, type_of(x), x.raw_data(), ctx.output(0).raw_data(), x.num_elements(), stream_of(ctx));
  check_launch(ctx);
}

template <Activation kActivation>
void activation_grad_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  activation_grad(kActivation, type_of(ctx.input(0)), ctx.input(0).raw_data(), ctx.input(1).raw_data(),
                  ctx.output(0).raw_data(), ctx.input(0).num_elements(), stream_of(ctx));
  check_launch(ctx);
}

void add_n_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kNumeric);
  Tensor& out = ctx.output(0);
  std::vector<const void*> inputs;
  for (int i = 0; i < ctx.num_inputs(); ++i) inputs.push_back(ctx.input(i).raw_data());
  for (std::size_t first = 0; first < inputs.size(); first += kMaxAddN) {
    const int count = static_cast<int>(std::min<std::size_t>(kMaxAddN, inputs.size() - first));
    add_n(type_of(out), inputs.data() + first, count, first > 0, out.raw_data(), out.num_elements(), stream_of(ctx));
  }
  check_launch(ctx);
}

void cast_kernel(KernelContext& ctx) {
  cast(type_of(ctx.input(0)), type_of(ctx.output(0)), ctx.input(0).raw_data(), ctx.output(0).raw_data(),
       ctx.input(0).num_elements(), stream_of(ctx));
  check_launch(ctx);
}

void copy_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  if (x.nbytes() == 0) return;
  TANDEM_CUDA_CHECK(
      cudaMemcpyAsync(ctx.output(0).raw_data(), x.raw_data(), x.nbytes(), cudaMemcpyDeviceToDevice, stream_of(ctx)),
      ctx.device().short_name());
}

void fill_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  fill(type_of(y), ctx.attrs().get<double>("value"), y.raw_data(), y.num_elements(), stream_of(ctx));
  check_launch(ctx);
}

template <int kValue>
void fill_like_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  fill(type_of(y), static_cast<double>(kValue), y.raw_data(), y.num_elements(), stream_of(ctx));
  check_launch(ctx);
}

void transpose_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const auto& perm = ctx.attrs().get<std::vector<std::int64_t>>("perm");
  const BroadcastArgs args = transpose_args(x.shape(), y.shape(), perm);
  broadcast(type_of(x), args, x.raw_data(), 1.0, y.raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// ---- Reductions ----------------------------------------------------------------------------------

template <ReduceKind kKind>
void reduce_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kNumeric);
  reduce(kKind, type_of(x), reduce_args(x.shape(), detail::reduction_axes(ctx.attrs(), x.shape().rank())), x.raw_data(),
         ctx.output(0).raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// SumGrad / MeanGrad (dy, x): dy stretched over the reduced axes (and divided by their size).
template <ReduceKind kKind>
void reduce_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  const Tensor& x = ctx.input(1);
  Tensor& dx = ctx.output(0);
  require_types(ctx, dy, kNumeric);
  const auto axes = detail::reduction_axes(ctx.attrs(), x.shape().rank());
  Shape kept;
  std::int64_t count = 1;
  for (int d = 0; d < x.shape().rank(); ++d) {
    const bool reduced = std::find(axes.begin(), axes.end(), d) != axes.end();
    kept.push_back(reduced ? 1 : x.shape()[d]);
    if (reduced) count *= x.shape()[d];
  }
  const double scale = kKind == ReduceKind::kMean ? 1.0 / static_cast<double>(std::max<std::int64_t>(1, count)) : 1.0;
  broadcast(type_of(dy), broadcast_args(dx.shape(), kept, nullptr), dy.raw_data(), scale, dx.raw_data(),
            stream_of(ctx));
  check_launch(ctx);
}

// MaxGrad (dy, x, y): every input element is written by the thread of its output.
void max_grad_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(1);
  require_types(ctx, x, kNumeric);
  Tensor& dx = ctx.output(0);
  if (dx.num_elements() == 0) return;
  max_grad(type_of(x), reduce_args(x.shape(), detail::reduction_axes(ctx.attrs(), x.shape().rank())),
           ctx.input(0).raw_data(), x.raw_data(), ctx.input(2).raw_data(), dx.raw_data(), stream_of(ctx));
  check_launch(ctx);
}

void sum_to_shape_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Shape& like = ctx.input(1).shape();
  require_types(ctx, x, kNumeric);
  const std::vector<int> axes = detail::sum_to_shape_axes(x.shape(), like);
  reduce(ReduceKind::kSum, type_of(x), reduce_args(x.shape(), axes), x.raw_data(), ctx.output(0).raw_data(),
         stream_of(ctx));
  check_launch(ctx);
}

void argmax_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kNumeric);
  const int rank = x.shape().rank();
  const auto raw_axis = ctx.attrs().get_int("axis");
  const int axis = static_cast<int>(raw_axis < 0 ? raw_axis + rank : raw_axis);
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= x.shape()[d];
  for (int d = axis + 1; d < rank; ++d) inner *= x.shape()[d];
  argmax(type_of(x), x.raw_data(), static_cast<std::int64_t*>(ctx.output(0).raw_data()), outer, x.shape()[axis], inner,
         stream_of(ctx));
  check_launch(ctx);
}

// ---- nn ------------------------------------------------------------------------------------------

detail::RowsCols rows_cols(const Tensor& t) { return detail::rows_cols(t.shape()); }

Activation activation_attr(KernelContext& ctx) {
  return static_cast<Activation>(ops::parse_activation(ctx.attrs().get<std::string>("activation")));
}

// The fused ops' second output when their activation's gradient needs the pre-activation (GELU).
void* pre_activation_output(KernelContext& ctx, Activation activation) {
  return ops::activation_gradient_needs_input(static_cast<ops::Activation>(activation)) ? ctx.output(1).raw_data()
                                                                                        : nullptr;
}

template <bool kWithActivation>
void bias_add_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  const auto [rows, cols] = rows_cols(ctx.input(0));
  const Activation activation = kWithActivation ? activation_attr(ctx) : Activation::kLinear;
  bias_activation(activation, type_of(ctx.input(0)), ctx.input(0).raw_data(), ctx.input(1).raw_data(),
                  pre_activation_output(ctx, activation), ctx.output(0).raw_data(), rows, cols, stream_of(ctx));
  check_launch(ctx);
}

// Gelu: the activation with no bias; GeluGrad (dy, x): dy * gelu'(x).
Activation gelu_form(KernelContext& ctx) {
  return ctx.attrs().get_bool_or("approximate", false) ? Activation::kGeluApproximate : Activation::kGelu;
}

void gelu_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  bias_activation(gelu_form(ctx), type_of(x), x.raw_data(), nullptr, nullptr, ctx.output(0).raw_data(),
                  x.num_elements(), 1, stream_of(ctx));
  check_launch(ctx);
}

void gelu_grad_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  activation_grad(gelu_form(ctx), type_of(ctx.input(0)), ctx.input(0).raw_data(), ctx.input(1).raw_data(),
                  ctx.output(0).raw_data(), ctx.input(0).num_elements(), stream_of(ctx));
  check_launch(ctx);
}

void bias_add_grad_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  const auto [rows, cols] = rows_cols(ctx.input(0));
  bias_activation_grad(Activation::kLinear, type_of(ctx.input(0)), ctx.input(0).raw_data(), nullptr, nullptr,
                       ctx.output(0).raw_data(), rows, cols, stream_of(ctx));
  check_launch(ctx);
}

void bias_activation_grad_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  const auto [rows, cols] = rows_cols(ctx.input(0));
  bias_activation_grad(activation_attr(ctx), type_of(ctx.input(0)), ctx.input(0).raw_data(), ctx.input(1).raw_data(),
                       ctx.output(0).raw_data(), ctx.output(1).raw_data(), rows, cols, stream_of(ctx));
  check_launch(ctx);
}

void matmul_kernel(KernelContext& ctx) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  require_types(ctx, a, kFloat);
  GemmCall call;
  call.dtype = a.dtype();
  call.transpose_a = ctx.attrs().get_bool_or("transpose_a", false);
  call.transpose_b = ctx.attrs().get_bool_or("transpose_b", false);
  call.m = call.transpose_a ? a.shape()[1] : a.shape()[0];
  call.k = call.transpose_a ? a.shape()[0] : a.shape()[1];
  call.n = call.transpose_b ? b.shape()[0] : b.shape()[1];
  call.lda = a.shape()[1];
  call.ldb = b.shape()[1];
  call.a = a.raw_data();
  call.b = b.raw_data();
  call.c = ctx.output(0).raw_data();
  if (call.m * call.n == 0) return;
  if (call.k == 0) {
    fill(type_of(a), 0.0, call.c, call.m * call.n, stream_of(ctx));
    check_launch(ctx);
    return;
  }
  gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
}

// FusedMatMul: the product by cuBLAS, then bias and activation in place (one extra pass; a
// cuBLASLt epilogue would fold it into the product). With GELU the product goes to the second
// output, which keeps the pre-activation.
void fused_matmul_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Tensor& w = ctx.input(1);
  require_types(ctx, x, kFloat);
  GemmCall call;
  call.dtype = x.dtype();
  call.m = x.shape()[0];
  call.k = x.shape()[1];
  call.n = w.shape()[1];
  call.lda = call.k;
  call.ldb = call.n;
  const Activation activation = activation_attr(ctx);
  void* pre = pre_activation_output(ctx, activation);
  call.a = x.raw_data();
  call.b = w.raw_data();
  call.c = pre != nullptr ? pre : ctx.output(0).raw_data();
  if (call.m * call.n == 0) return;
  if (call.k == 0) {
    fill(type_of(x), 0.0, call.c, call.m * call.n, stream_of(ctx));
  } else {
    gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
  }
  bias_activation(activation, type_of(x), call.c, ctx.input(2).raw_data(), pre, ctx.output(0).raw_data(), call.m,
                  call.n, stream_of(ctx));
  check_launch(ctx);
}

template <bool kLog>
void softmax_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  const auto [rows, cols] = rows_cols(ctx.input(0));
  softmax(kLog, type_of(ctx.input(0)), ctx.input(0).raw_data(), ctx.output(0).raw_data(), rows, cols, stream_of(ctx));
  check_launch(ctx);
}

template <bool kLog>
void softmax_grad_kernel(KernelContext& ctx) {
  require_types(ctx, ctx.input(0), kFloat);
  const auto [rows, cols] = rows_cols(ctx.input(0));
  softmax_grad(kLog, type_of(ctx.input(0)), ctx.input(0).raw_data(), ctx.input(1).raw_data(), ctx.output(0).raw_data(),
               rows, cols, stream_of(ctx));
  check_launch(ctx);
}

// A bad label is found on the device (the smallest bad row, in a flag of this node's scratch
// memory) and reported by a deferred check once the step is queued: the kernel itself does not
// wait, so it can be recorded in a CUDA graph.
void sparse_xent_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Tensor& labels = ctx.input(1);
  require_types(ctx, x, kFloat);
  require_types(ctx, labels, {DType::kI32, DType::kI64});
  const std::int64_t rows = x.shape()[0], classes = x.shape()[1];
  if (rows == 0) return;
  std::string label = ctx.label();
  unsigned long long* bad_row =
      defer_bad_id_check(ctx, 0, labels, rows, [label, classes](std::int64_t row, std::int64_t value) {
        throw InvalidArgument(
            fmt::format("{}: label {} in row {} is outside the valid class ids [0, {})", label, value, row, classes));
      });
  sparse_softmax_cross_entropy(type_of(x), type_of(labels), x.raw_data(), labels.raw_data(), ctx.output(0).raw_data(),
                               ctx.output(1).raw_data(), rows, classes, bad_row, static_cast<int*>(ctx.fault_word()),
                               stream_of(ctx));
  check_launch(ctx);
}

void xent_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  softmax_cross_entropy(type_of(x), x.raw_data(), ctx.input(1).raw_data(), ctx.output(0).raw_data(),
                        ctx.output(1).raw_data(), x.shape()[0], x.shape()[1], stream_of(ctx));
  check_launch(ctx);
}

void sigmoid_xent_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  sigmoid_cross_entropy(type_of(x), x.raw_data(), ctx.input(1).raw_data(), ctx.output(0).raw_data(), x.num_elements(),
                        stream_of(ctx));
  check_launch(ctx);
}

void sigmoid_xent_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  require_types(ctx, dy, kFloat);
  sigmoid_cross_entropy_grad(type_of(dy), dy.raw_data(), ctx.input(1).raw_data(), ctx.input(2).raw_data(),
                             ctx.output(0).raw_data(), ctx.output(1).raw_data(), dy.num_elements(), stream_of(ctx));
  check_launch(ctx);
}

// The CPU kernel's mask for the same (executor seed, node, step, attr seed): see nn_kernels.cc.
void dropout_kernel(KernelContext& ctx) {
  const detail::DropoutRun run = detail::read_dropout(ctx);
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  const std::int64_t n = x.num_elements();
  if (!run.active) {
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(ctx.output(0).raw_data(), x.raw_data(), x.nbytes(), cudaMemcpyDeviceToDevice, stream_of(ctx)),
        ctx.device().short_name());
    fill(type_of(x), 1.0, ctx.output(1).raw_data(), n, stream_of(ctx));
    check_launch(ctx);
    return;
  }
  // The CPU rounds 1 / (1 - rate) to its compute type (float for 16-bit tensors) first.
  const double exact = 1.0 / (1.0 - run.rate);
  const double scale = x.dtype() == DType::kF64 ? exact : static_cast<double>(static_cast<float>(exact));
  dropout(type_of(x), x.raw_data(), ctx.output(0).raw_data(), ctx.output(1).raw_data(), n, run.key, run.threshold,
          scale, stream_of(ctx));
  check_launch(ctx);
}

void one_hot_kernel(KernelContext& ctx) {
  const Tensor& indices = ctx.input(0);
  require_types(ctx, indices, {DType::kI32, DType::kI64, DType::kU8});
  const std::int64_t depth = ctx.attrs().get_int("depth");
  one_hot(type_of(indices), indices.raw_data(), static_cast<float*>(ctx.output(0).raw_data()), indices.num_elements(),
          depth, static_cast<float>(ctx.attrs().get_float_or("on_value", 1.0)),
          static_cast<float>(ctx.attrs().get_float_or("off_value", 0.0)), stream_of(ctx));
  check_launch(ctx);
}

void batch_norm_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  const auto [rows, channels] = rows_cols(x);
  batch_norm(type_of(x), ctx.attrs().get_bool_or("training", true), ctx.attrs().get_float_or("epsilon", 1e-3),
             x.raw_data(), ctx.input(1).raw_data(), ctx.input(2).raw_data(), ctx.input(3).raw_data(),
             ctx.input(4).raw_data(), ctx.output(0).raw_data(), ctx.output(1).raw_data(), ctx.output(2).raw_data(),
             ctx.output(3).raw_data(), ctx.output(4).raw_data(), rows, channels, stream_of(ctx));
  check_launch(ctx);
}

void batch_norm_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  require_types(ctx, dy, kFloat);
  const auto [rows, channels] = rows_cols(dy);
  const bool has_stat_grads = ctx.num_inputs() == 7;
  batch_norm_grad(type_of(dy), ctx.attrs().get_bool_or("training", true), dy.raw_data(), ctx.input(1).raw_data(),
                  ctx.input(2).raw_data(), ctx.input(3).raw_data(), ctx.input(4).raw_data(),
                  has_stat_grads ? ctx.input(5).raw_data() : nullptr,
                  has_stat_grads ? ctx.input(6).raw_data() : nullptr, ctx.output(0).raw_data(),
                  ctx.output(1).raw_data(), ctx.output(2).raw_data(), ctx.output(3).raw_data(),
                  ctx.output(4).raw_data(), rows, channels, stream_of(ctx));
  check_launch(ctx);
}

// ---- Transformer ops: LayerNorm, MaskedSoftmax -------------------------------------------------

// LayerNorm (x[, gamma][, beta]) -> (y, mean, inv_std).
void layer_norm_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  const bool scale = ctx.attrs().get_bool_or("scale", false);
  const bool center = ctx.attrs().get_bool_or("center", false);
  const auto [rows, cols] = rows_cols(x);
  layer_norm(type_of(x), x.raw_data(), scale ? ctx.input(1).raw_data() : nullptr,
             center ? ctx.input(scale ? 2 : 1).raw_data() : nullptr, ctx.attrs().get_float_or("epsilon", 1e-3),
             ctx.output(0).raw_data(), ctx.output(1).raw_data(), ctx.output(2).raw_data(), rows, cols, stream_of(ctx));
  check_launch(ctx);
}

// LayerNormGrad (dy, x, mean, inv_std[, gamma]) -> (dx, dgamma, dbeta).
void layer_norm_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  require_types(ctx, dy, kFloat);
  const bool scale = ctx.attrs().get_bool_or("scale", false);
  const auto [rows, cols] = rows_cols(dy);
  layer_norm_grad(type_of(dy), dy.raw_data(), ctx.input(1).raw_data(), ctx.input(2).raw_data(),
                  ctx.input(3).raw_data(), scale ? ctx.input(4).raw_data() : nullptr, ctx.output(0).raw_data(),
                  ctx.output(1).raw_data(), ctx.output(2).raw_data(), rows, cols, stream_of(ctx));
  check_launch(ctx);
}

detail::MaskedSoftmaxRows masked_softmax_rows(KernelContext& ctx, const Shape& x, const Shape* mask) {
  return detail::masked_softmax_rows(x.dims().data(), x.rank(), mask != nullptr ? mask->dims().data() : nullptr,
                                     mask != nullptr ? mask->rank() : 0, mask != nullptr,
                                     ctx.attrs().get_bool_or("causal", false));
}

// MaskedSoftmax (x[, mask]) -> y.
void masked_softmax_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  const Tensor* mask = ctx.num_inputs() == 2 ? &ctx.input(1) : nullptr;
  if (mask != nullptr) require_types(ctx, *mask, {DType::kI32, DType::kI64, DType::kU8});
  masked_softmax(type_of(x), mask != nullptr ? type_of(*mask) : ElementType::kU8, x.raw_data(),
                 mask != nullptr ? mask->raw_data() : nullptr,
                 masked_softmax_rows(ctx, x.shape(), mask != nullptr ? &mask->shape() : nullptr),
                 ctx.attrs().get_float_or("scale", 1.0), ctx.output(0).raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// MaskedSoftmaxGrad (dy, y) -> dx.
void masked_softmax_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  require_types(ctx, dy, kFloat);
  masked_softmax_grad(type_of(dy), dy.raw_data(), ctx.input(1).raw_data(), masked_softmax_rows(ctx, dy.shape(), nullptr),
                      ctx.attrs().get_float_or("scale", 1.0), ctx.output(0).raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// ---- Convolution and pooling: cuDNN where its plan accepts, else im2col + cuBLAS and our kernels ----
//
// Each kernel asks detail::plan_cudnn (ops/detail/cudnn_plan.h) whether cuDNN can take its case;
// when cuDNN is loaded and the plan and an algorithm say yes, cuDNN runs it, otherwise the
// im2col + cuBLAS convolution and the pooling kernels of kernels.cu do. Both paths keep their
// temporaries in this node's scratch memory (fixed addresses under CUDA graphs), in separate slots.

detail::Window2DGeometry conv_geometry(KernelContext& ctx, const Shape& x, const Shape& filter) {
  return detail::conv_geometry(ctx.attrs(), x, filter);
}
detail::Window2DGeometry pool_geometry(KernelContext& ctx, const Shape& x) {
  return detail::pool_geometry(ctx.attrs(), x);
}

// Scratch slots: 0 is the fallback's patch matrix; the cuDNN path uses the others.
constexpr std::size_t kCudnnFilterSlot = 1;     // the filter (or its gradient) as KRSC
constexpr std::size_t kCudnnWorkspaceSlot = 2;  // the algorithm's workspace
constexpr std::size_t kFusedPoolInputSlot = 3;  // FusedConv2DMaxPool's y = act(conv + bias), pooled
constexpr std::size_t kArgmaxDyInputSlot = 4;   // the argmax gradient ops' dz, expanded from argmax
static_assert(kArgmaxNoWinner == detail::kNoWinner);

CudnnTarget cudnn_target(KernelContext& ctx) {
  return {ctx.device().index(), ctx.device().short_name(), stream_of(ctx)};
}

// The plan of this node's case, or a refusal when cuDNN is not usable in this process.
detail::CudnnPlan cudnn_plan(detail::CudnnWindowOp op, const detail::Window2DGeometry& g, DType dtype) {
  if (!cudnn_enabled()) {
    detail::CudnnPlan plan;
    plan.op = op;
    plan.fallback_reason = cudnn_status();
    return plan;
  }
  return detail::plan_cudnn(op, g, dtype, tensor_float_32_execution_enabled());
}

// `from` permuted by `perm` into `to` (Transpose's launcher; shapes from the tensors).
void permute(KernelContext& ctx, const Tensor& from, const std::array<std::int64_t, 4>& perm, Tensor& to) {
  const std::vector<std::int64_t> p(perm.begin(), perm.end());
  broadcast(type_of(from), transpose_args(from.shape(), to.shape(), p), from.raw_data(), 1.0, to.raw_data(),
            stream_of(ctx));
  check_launch(ctx);
}

// The filter as cuDNN reads it: HWIO permuted to KRSC (OHWI) in scratch, unless it already is.
const void* krsc_filter(KernelContext& ctx, const detail::CudnnPlan& plan, const Tensor& filter) {
  if (plan.filter_is_krsc) return filter.raw_data();
  const Shape& f = filter.shape();
  Tensor& krsc = ctx.scratch(kCudnnFilterSlot, {f[3], f[0], f[1], f[2]}, filter.dtype());
  permute(ctx, filter, detail::kHwioToKrsc, krsc);
  return krsc.raw_data();
}

// Runs a convolution direction through cuDNN when the plan and cuDNN's heuristics allow; false
// means nothing was queued and the caller's fallback runs. `run(target, workspace, bytes)` makes
// the call.
template <class Run>
bool try_cudnn_conv(KernelContext& ctx, CudnnConvDirection direction, const detail::CudnnPlan& plan, Run&& run) {
  if (!plan.use_cudnn) return false;
  const CudnnTarget target = cudnn_target(ctx);
  const std::optional<std::size_t> bytes = cudnn_conv_prepare(target, direction, plan);
  if (!bytes) return false;
  void* workspace = nullptr;
  if (*bytes > 0) {
    workspace = ctx.scratch(kCudnnWorkspaceSlot, {static_cast<std::int64_t>(*bytes)}, DType::kU8).raw_data();
  }
  run(target, workspace, *bytes);
  return true;
}

// The patch matrix of x, in this node's scratch memory (kept across runs: its address must not
// change under a CUDA graph, and nothing else may take it between replays).
Tensor& patches(KernelContext& ctx, const detail::Window2DGeometry& g, const Tensor& x) {
  Tensor& col = ctx.scratch(0, {g.out_pixels(), g.patch_size()}, x.dtype());
  im2col(type_of(x), flatten(g), x.raw_data(), col.raw_data(), stream_of(ctx));
  check_launch(ctx);
  return col;
}

// y = conv(x, filter) through cuDNN: x NHWC, the filter permuted to KRSC, y NHWC.
bool conv_forward_cudnn(KernelContext& ctx, const detail::Window2DGeometry& g, const Tensor& x, const Tensor& filter,
                        void* y) {
  const detail::CudnnPlan plan = cudnn_plan(detail::CudnnWindowOp::kConv2D, g, x.dtype());
  const auto direction = CudnnConvDirection::kForward;
  return try_cudnn_conv(ctx, direction, plan, [&](const CudnnTarget& target, void* ws, std::size_t n) {
    cudnn_conv(target, direction, plan, x.raw_data(), krsc_filter(ctx, plan, filter), y, ws, n);
  });
}

// y[pixels, out_c] = col[pixels, patch] @ filter[patch, out_c] (HWIO is [patch, out_c] row-major).
void conv_forward_gemm(KernelContext& ctx, const detail::Window2DGeometry& g, const Tensor& x, const Tensor& filter,
                       void* y) {
  GemmCall call;
  call.dtype = x.dtype();
  call.m = g.out_pixels();
  call.k = g.patch_size();
  call.n = g.out_c;
  if (call.m * call.n == 0) return;
  if (call.k == 0) {
    fill(type_of(x), 0.0, y, call.m * call.n, stream_of(ctx));
    check_launch(ctx);
    return;
  }
  const Tensor& col = patches(ctx, g, x);
  call.lda = call.k;
  call.ldb = call.n;
  call.a = col.raw_data();
  call.b = filter.raw_data();
  call.c = y;
  gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
}

void conv_forward(KernelContext& ctx, const detail::Window2DGeometry& g, const Tensor& x, const Tensor& filter,
                  void* y) {
  const bool cudnn = conv_forward_cudnn(ctx, g, x, filter, y);
  if (!cudnn) conv_forward_gemm(ctx, g, x, filter, y);
  count_cudnn_path(cudnn);
}

void conv2d_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  conv_forward(ctx, conv_geometry(ctx, x.shape(), ctx.input(1).shape()), x, ctx.input(1), ctx.output(0).raw_data());
}

// FusedConv2D: the convolution (cuDNN or GEMM), then bias and activation in place.
void fused_conv2d_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  const auto g = conv_geometry(ctx, x.shape(), ctx.input(1).shape());
  Tensor& y = ctx.output(0);
  conv_forward(ctx, g, x, ctx.input(1), y.raw_data());
  bias_activation(activation_attr(ctx), type_of(x), y.raw_data(), ctx.input(2).raw_data(), nullptr, y.raw_data(),
                  g.out_pixels(), g.out_c, stream_of(ctx));
  check_launch(ctx);
}

// The input gradient of dy (device memory shaped like the convolution's output): cuDNN's data
// gradient, or dcol = dy @ filter^T and dx = col2im(dcol). Conv2DBackpropInput and
// Conv2DBackpropInputArgmax share it.
void conv_backprop_input(KernelContext& ctx, const detail::Window2DGeometry& g, const Tensor& filter, const Tensor& dy,
                         Tensor& dx) {
  if (dx.num_elements() == 0) return;
  const detail::CudnnPlan plan = cudnn_plan(detail::CudnnWindowOp::kConv2D, g, dy.dtype());
  const auto direction = CudnnConvDirection::kBackwardData;
  const bool cudnn = try_cudnn_conv(ctx, direction, plan, [&](const CudnnTarget& target, void* ws, std::size_t n) {
    cudnn_conv(target, direction, plan, dy.raw_data(), krsc_filter(ctx, plan, filter), dx.raw_data(), ws, n);
  });
  count_cudnn_path(cudnn);
  if (cudnn) return;
  Tensor& dcol = ctx.scratch(0, {g.out_pixels(), g.patch_size()}, dy.dtype());
  if (g.out_pixels() * g.patch_size() > 0) {
    if (g.out_c == 0) {
      fill(type_of(dy), 0.0, dcol.raw_data(), dcol.num_elements(), stream_of(ctx));
    } else {
      GemmCall call;
      call.dtype = dy.dtype();
      call.transpose_b = true;
      call.m = g.out_pixels();
      call.k = g.out_c;
      call.n = g.patch_size();
      call.lda = g.out_c;
      call.ldb = g.out_c;
      call.a = dy.raw_data();
      call.b = filter.raw_data();
      call.c = dcol.raw_data();
      gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
    }
  }
  col2im(type_of(dy), flatten(g), dcol.raw_data(), dx.raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// Conv2DBackpropInput(x_like, filter, dy).
void conv2d_backprop_input_kernel(KernelContext& ctx) {
  const Tensor& filter = ctx.input(1);
  require_types(ctx, filter, kFloat);
  conv_backprop_input(ctx, conv_geometry(ctx, ctx.input(0).shape(), filter.shape()), filter, ctx.input(2),
                      ctx.output(0));
}

// The filter gradient of dy (device memory shaped like the convolution's output): cuDNN's
// (KRSC, permuted back to HWIO), or dw[patch, out_c] = col^T @ dy. Conv2DBackpropFilter and
// Conv2DBackpropFilterArgmax share it.
void conv_backprop_filter(KernelContext& ctx, const detail::Window2DGeometry& g, const Tensor& x, const void* dy,
                          Tensor& dw) {
  if (dw.num_elements() == 0) return;
  const detail::CudnnPlan plan = cudnn_plan(detail::CudnnWindowOp::kConv2D, g, x.dtype());
  const auto direction = CudnnConvDirection::kBackwardFilter;
  const bool cudnn = try_cudnn_conv(ctx, direction, plan, [&](const CudnnTarget& target, void* ws, std::size_t n) {
    if (plan.filter_is_krsc) {
      cudnn_conv(target, direction, plan, x.raw_data(), dy, dw.raw_data(), ws, n);
      return;
    }
    const Shape& f = dw.shape();
    Tensor& krsc = ctx.scratch(kCudnnFilterSlot, {f[3], f[0], f[1], f[2]}, dw.dtype());
    cudnn_conv(target, direction, plan, x.raw_data(), dy, krsc.raw_data(), ws, n);
    permute(ctx, krsc, detail::kKrscToHwio, dw);
  });
  count_cudnn_path(cudnn);
  if (cudnn) return;
  if (g.out_pixels() == 0) {
    fill(type_of(x), 0.0, dw.raw_data(), dw.num_elements(), stream_of(ctx));
    check_launch(ctx);
    return;
  }
  const Tensor& col = patches(ctx, g, x);
  GemmCall call;
  call.dtype = x.dtype();
  call.transpose_a = true;
  call.m = g.patch_size();
  call.k = g.out_pixels();
  call.n = g.out_c;
  call.lda = g.patch_size();
  call.ldb = g.out_c;
  call.a = col.raw_data();
  call.b = dy;
  call.c = dw.raw_data();
  gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
}

// Conv2DBackpropFilter(x, filter_like, dy).
void conv2d_backprop_filter_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  conv_backprop_filter(ctx, conv_geometry(ctx, x.shape(), ctx.input(1).shape()), x, ctx.input(2).raw_data(),
                       ctx.output(0));
}

template <bool kAverage>
void pool_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  const auto g = pool_geometry(ctx, x.shape());
  const detail::CudnnPlan plan =
      cudnn_plan(kAverage ? detail::CudnnWindowOp::kAvgPool2D : detail::CudnnWindowOp::kMaxPool2D, g, x.dtype());
  count_cudnn_path(plan.use_cudnn);
  if (plan.use_cudnn) {
    cudnn_pool_forward(cudnn_target(ctx), plan, x.raw_data(), ctx.output(0).raw_data());
    return;
  }
  pool(kAverage, type_of(x), flatten(g), x.raw_data(), ctx.output(0).raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// Always tandem's kernel (plan_cudnn refuses MaxPool2DGrad: cuDNN's choice between tied maxima is
// unspecified, ours is the first in scan order, as on CPUs), so it need not ask for a plan.
void max_pool_grad_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  count_cudnn_path(false);
  max_pool_grad(type_of(x), flatten(pool_geometry(ctx, x.shape())), x.raw_data(), ctx.input(2).raw_data(),
                ctx.output(0).raw_data(), stream_of(ctx));
  check_launch(ctx);
}

// MaxPool2DBiasActivationGrad: MaxPool2DGrad into dz, then BiasActivationGrad over dz in place:
// the same launches, in the same order, as the two ops it stands for (the CPU kernel's single pass
// is not written for GPUs yet).
void max_pool_bias_activation_grad_kernel(KernelContext& ctx) {
  const Tensor& y = ctx.input(0);
  require_types(ctx, y, kFloat);
  count_cudnn_path(false);
  void* dz = ctx.output(0).raw_data();
  max_pool_grad(type_of(y), flatten(pool_geometry(ctx, y.shape())), y.raw_data(), ctx.input(1).raw_data(), dz,
                stream_of(ctx));
  const auto [rows, cols] = rows_cols(y);
  bias_activation_grad(activation_attr(ctx), type_of(y), dz, y.raw_data(), dz, ctx.output(1).raw_data(), rows, cols,
                       stream_of(ctx));
  check_launch(ctx);
}

// FusedConv2DMaxPool: FusedConv2D's launches into y in this node's scratch memory (kept across
// runs: its address must not change under CUDA graphs), then one pass pools y into p and argmax.
void fused_conv2d_max_pool_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  require_types(ctx, x, kFloat);
  Tensor& p = ctx.output(0);
  if (p.num_elements() == 0) return;
  const auto g = conv_geometry(ctx, x.shape(), ctx.input(1).shape());
  Tensor& y = ctx.scratch(kFusedPoolInputSlot, {g.batch, g.out_h, g.out_w, g.out_c}, x.dtype());
  conv_forward(ctx, g, x, ctx.input(1), y.raw_data());
  const Activation activation = activation_attr(ctx);
  bias_activation(activation, type_of(x), y.raw_data(), ctx.input(2).raw_data(), nullptr, y.raw_data(), g.out_pixels(),
                  g.out_c, stream_of(ctx));
  max_pool_argmax(activation == Activation::kRelu, type_of(x), flatten(detail::fused_pool_geometry(ctx.attrs(), g)),
                  y.raw_data(), p.raw_data(), static_cast<std::uint8_t*>(ctx.output(1).raw_data()), stream_of(ctx));
  check_launch(ctx);
}

// The argmax gradient ops' dz (dp at the cell argmax names, 0 elsewhere), expanded into this
// node's scratch memory (the graph never stores it; fixed address under CUDA graphs) so that
// cuDNN or the GEMM can take it.
Tensor& expand_argmax_dz(KernelContext& ctx, const detail::Window2DGeometry& g) {
  const Tensor& dp = ctx.input(3);
  Tensor& dz = ctx.scratch(kArgmaxDyInputSlot, {g.batch, g.out_h, g.out_w, g.out_c}, dp.dtype());
  max_pool_argmax_grad(type_of(dp), flatten(detail::fused_pool_geometry(ctx.attrs(), g)),
                       static_cast<const std::uint8_t*>(ctx.input(2).raw_data()), dp.raw_data(), dz.raw_data(),
                       stream_of(ctx));
  return dz;
}

// Conv2DBackpropFilterArgmax(x, filter_like, argmax, dp): dz expanded, then db = BiasAddGrad(dz)
// and dfilter = Conv2DBackpropFilter(x, filter_like, dz).
void conv2d_backprop_filter_argmax_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Tensor& dp = ctx.input(3);
  require_types(ctx, x, kFloat);
  const auto g = conv_geometry(ctx, x.shape(), ctx.input(1).shape());
  Tensor& dz = expand_argmax_dz(ctx, g);
  bias_activation_grad(Activation::kLinear, type_of(dp), dz.raw_data(), nullptr, nullptr, ctx.output(1).raw_data(),
                       g.out_pixels(), g.out_c, stream_of(ctx));
  check_launch(ctx);
  conv_backprop_filter(ctx, g, x, dz.raw_data(), ctx.output(0));
}

// Conv2DBackpropInputArgmax(x_like, filter, argmax, dp): dz expanded, then Conv2DBackpropInput's
// path.
void conv2d_backprop_input_argmax_kernel(KernelContext& ctx) {
  const Tensor& filter = ctx.input(1);
  require_types(ctx, filter, kFloat);
  const auto g = conv_geometry(ctx, ctx.input(0).shape(), filter.shape());
  const Tensor& dz = expand_argmax_dz(ctx, g);
  check_launch(ctx);
  conv_backprop_input(ctx, g, filter, dz, ctx.output(0));
}

void avg_pool_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(1);
  require_types(ctx, dy, kFloat);
  const auto g = pool_geometry(ctx, ctx.input(0).shape());
  const detail::CudnnPlan plan = cudnn_plan(detail::CudnnWindowOp::kAvgPool2DGrad, g, dy.dtype());
  count_cudnn_path(plan.use_cudnn);
  if (plan.use_cudnn) {
    cudnn_avg_pool_backward(cudnn_target(ctx), plan, ctx.input(0).raw_data(), dy.raw_data(), ctx.output(0).raw_data());
    return;
  }
  avg_pool_grad(type_of(dy), flatten(g), dy.raw_data(), ctx.output(0).raw_data(), stream_of(ctx));
  check_launch(ctx);
}

}  // namespace
}  // namespace tandem::ops::cuda

namespace tandem::ops::detail {

void apply_update_on_device(devices::Device& device, graph::DType dtype, const UpdateParams& params,
                            std::span<const UpdateTensor> tensors, const ParamsInMemory& in_memory) {
  TANDEM_REQUIRE(dtype == graph::DType::kF32 || dtype == graph::DType::kF64, Unimplemented,
                 "optimizer updates on {}: {} variables (float32 and float64 are supported)", device.short_name(),
                 dtype);
  const auto stream = static_cast<cudaStream_t>(device.compute_stream().native_handle());
  devices::detail::ScopedCudaDevice guard(device.index(), device.short_name());
  for (std::size_t first = 0; first < tensors.size(); first += kMaxUpdateTensors) {
    const int count = static_cast<int>(std::min<std::size_t>(kMaxUpdateTensors, tensors.size() - first));
    cuda::apply_update(static_cast<cuda::ElementType>(dtype), params,
                       static_cast<const UpdateParams*>(in_memory.params),
                       static_cast<const int*>(in_memory.fault_word), tensors.data() + first, count, stream);
    const cudaError_t status = cuda::last_launch_error();
    TANDEM_CUDA_CHECK(status, device.short_name());
  }
}

double squared_norm_on_device(const graph::Tensor& t) {
  auto& device = t.device();
  const auto stream = static_cast<cudaStream_t>(device.compute_stream().native_handle());
  devices::detail::ScopedCudaDevice guard(device.index(), device.short_name());
  graph::Tensor sum = graph::Tensor::zeros({1}, graph::DType::kF64, device);
  cuda::squared_norm(static_cast<cuda::ElementType>(t.dtype()), t.raw_data(), t.num_elements(),
                     static_cast<double*>(sum.raw_data()), stream);
  TANDEM_CUDA_CHECK(cuda::last_launch_error(), device.short_name());
  return sum.to_vector<double>()[0];
}

bool all_finite_on_device(std::span<const graph::Tensor> tensors) {
  if (tensors.empty()) return true;
  auto& device = tensors.front().device();
  const auto stream = static_cast<cudaStream_t>(device.compute_stream().native_handle());
  devices::detail::ScopedCudaDevice guard(device.index(), device.short_name());
  graph::Tensor flag = graph::Tensor::zeros({1}, graph::DType::kI32, device);
  for (const auto& t : tensors) {
    cuda::check_finite(static_cast<cuda::ElementType>(t.dtype()), t.raw_data(), t.num_elements(),
                       static_cast<int*>(flag.raw_data()), stream);
  }
  TANDEM_CUDA_CHECK(cuda::last_launch_error(), device.short_name());
  return flag.to_vector<std::int32_t>()[0] == 0;
}

void convert_on_device(devices::Device& device, const void* from, graph::DType from_dtype, void* to,
                       graph::DType to_dtype, std::int64_t n) {
  devices::detail::ScopedCudaDevice guard(device.index(), device.short_name());
  cuda::cast(static_cast<cuda::ElementType>(from_dtype), static_cast<cuda::ElementType>(to_dtype), from, to, n,
             static_cast<cudaStream_t>(device.compute_stream().native_handle()));
  TANDEM_CUDA_CHECK(cuda::last_launch_error(), device.short_name());
}

void register_cuda_kernels() {
  using namespace tandem::ops::cuda;
  auto& r = graph::OpRegistry::global();
  const auto add = [&](std::string_view op, graph::KernelFn fn) {
    r.add_kernel(op, devices::DeviceType::kGPU, fn, {.low_precision = graph::LowPrecision::kNative});
  };
  // Random ops take the step in their seed: a recorded graph would replay one mask forever.
  const auto add_uncapturable = [&](std::string_view op, graph::KernelFn fn) {
    r.add_kernel(op, devices::DeviceType::kGPU, fn,
                 {.low_precision = graph::LowPrecision::kNative, .capturable = false});
  };
  add("Add", binary_kernel<BinaryOp::kAdd>);
  add("Sub", binary_kernel<BinaryOp::kSub>);
  add("Mul", binary_kernel<BinaryOp::kMul>);
  add("Div", binary_kernel<BinaryOp::kDiv>);
  add("Equal", binary_kernel<BinaryOp::kEqual>);
  add("Neg", unary_kernel<UnaryOp::kNeg>);
  add("Square", unary_kernel<UnaryOp::kSquare>);
  add("Abs", unary_kernel<UnaryOp::kAbs>);
  add("Sqrt", unary_kernel<UnaryOp::kSqrt>);
  add("Exp", unary_kernel<UnaryOp::kExp>);
  add("Log", unary_kernel<UnaryOp::kLog>);
  add("Sign", unary_kernel<UnaryOp::kSign>);
  add("Relu", unary_kernel<UnaryOp::kRelu>);
  add("Sigmoid", unary_kernel<UnaryOp::kSigmoid>);
  add("Tanh", unary_kernel<UnaryOp::kTanh>);
  add("ReluGrad", activation_grad_kernel<cuda::Activation::kRelu>);
  add("SigmoidGrad", activation_grad_kernel<cuda::Activation::kSigmoid>);
  add("TanhGrad", activation_grad_kernel<cuda::Activation::kTanh>);
  add("Gelu", gelu_kernel);
  add("GeluGrad", gelu_grad_kernel);
  add("AddN", add_n_kernel);
  add("Cast", cast_kernel);
  add("Copy", copy_kernel);
  add("Fill", fill_kernel);
  add("ZerosLike", fill_like_kernel<0>);
  add("OnesLike", fill_like_kernel<1>);
  add("Transpose", transpose_kernel);
  add("Sum", reduce_kernel<ReduceKind::kSum>);
  add("Mean", reduce_kernel<ReduceKind::kMean>);
  add("Max", reduce_kernel<ReduceKind::kMax>);
  add("SumGrad", reduce_grad_kernel<ReduceKind::kSum>);
  add("MeanGrad", reduce_grad_kernel<ReduceKind::kMean>);
  add("MaxGrad", max_grad_kernel);
  add("SumToShape", sum_to_shape_kernel);
  add("ArgMax", argmax_kernel);
  add("MatMul", matmul_kernel);
  add("FusedMatMul", fused_matmul_kernel);
  add("BiasAdd", bias_add_kernel<false>);
  add("BiasActivation", bias_add_kernel<true>);
  add("BiasAddGrad", bias_add_grad_kernel);
  add("BiasActivationGrad", bias_activation_grad_kernel);
  add("Softmax", softmax_kernel<false>);
  add("LogSoftmax", softmax_kernel<true>);
  add("SoftmaxGrad", softmax_grad_kernel<false>);
  add("LogSoftmaxGrad", softmax_grad_kernel<true>);
  add("SparseSoftmaxCrossEntropyWithLogits", sparse_xent_kernel);
  add("SoftmaxCrossEntropyWithLogits", xent_kernel);
  add("SigmoidCrossEntropyWithLogits", sigmoid_xent_kernel);
  add("SigmoidCrossEntropyWithLogitsGrad", sigmoid_xent_grad_kernel);
  add_uncapturable("Dropout", dropout_kernel);
  add("OneHot", one_hot_kernel);
  add("FusedBatchNorm", batch_norm_kernel);
  add("FusedBatchNormGrad", batch_norm_grad_kernel);
  add("LayerNorm", layer_norm_kernel);
  add("LayerNormGrad", layer_norm_grad_kernel);
  add("MaskedSoftmax", masked_softmax_kernel);
  add("MaskedSoftmaxGrad", masked_softmax_grad_kernel);
  add("Conv2D", conv2d_kernel);
  add("FusedConv2D", fused_conv2d_kernel);
  add("Conv2DBackpropInput", conv2d_backprop_input_kernel);
  add("Conv2DBackpropFilter", conv2d_backprop_filter_kernel);
  add("MaxPool2D", pool_kernel<false>);
  add("AvgPool2D", pool_kernel<true>);
  add("MaxPool2DGrad", max_pool_grad_kernel);
  add("MaxPool2DBiasActivationGrad", max_pool_bias_activation_grad_kernel);
  add("FusedConv2DMaxPool", fused_conv2d_max_pool_kernel);
  add("Conv2DBackpropFilterArgmax", conv2d_backprop_filter_argmax_kernel);
  add("Conv2DBackpropInputArgmax", conv2d_backprop_input_argmax_kernel);
  add("AvgPool2DGrad", avg_pool_grad_kernel);
}

}  // namespace tandem::ops::detail
