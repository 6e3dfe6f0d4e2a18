#include "tandem/ops/detail/cudnn_plan.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

namespace tandem::ops::detail {
namespace {

constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();

// NCHW-ordered dims of an NHWC tensor, with its strides.
CudnnTensor4d nhwc_tensor(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c) {
  CudnnTensor4d t;
  t.n = static_cast<int>(n);
  t.c = static_cast<int>(c);
  t.h = static_cast<int>(h);
  t.w = static_cast<int>(w);
  t.c_stride = 1;
  t.w_stride = static_cast<int>(c);
  t.h_stride = static_cast<int>(w * c);
  t.n_stride = static_cast<int>(h * w * c);
  return t;
}

// Whether permuting `shape` by `perm` leaves its bytes where they are: true when the dimensions
// larger than 1 keep their relative order.
bool permutation_is_identity_in_memory(const std::array<std::int64_t, 4>& shape,
                                       const std::array<std::int64_t, 4>& perm) {
  std::int64_t last = -1;
  for (std::int64_t from : perm) {
    if (shape[static_cast<std::size_t>(from)] == 1) continue;
    if (from < last) return false;
    last = from;
  }
  return true;
}

CudnnPlan fall_back(CudnnWindowOp op, std::string reason) {
  CudnnPlan plan;
  plan.op = op;
  plan.fallback_reason = std::move(reason);
  return plan;
}

}  // namespace

std::int64_t cudnn_output_size(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t pad) {
  return (in + 2 * pad - k) / stride + 1;
}

CudnnPlan plan_cudnn(CudnnWindowOp op, const Window2DGeometry& g, graph::DType dtype, bool tf32) {
  using graph::DType;
  const bool conv = op == CudnnWindowOp::kConv2D;
  if (op == CudnnWindowOp::kMaxPool2DGrad) {
    return fall_back(op,
                     "MaxPool2DGrad keeps tandem's kernel: cuDNN sends each window's gradient to one of its "
                     "maxima, which one unspecified, where tandem sends it to the first in scan order");
  }
  if (dtype == DType::kF64) {
    return fall_back(op,
                     "float64 runs on tandem's kernels (cuDNN's NHWC convolution and pooling take float32, "
                     "float16 and bfloat16)");
  }
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return fall_back(op, fmt::format("{} is not a floating-point type cuDNN takes (float32, float16, bfloat16)",
                                     graph::dtype_name(dtype)));
  }
  const std::int64_t out_c = conv ? g.out_c : g.in_c;
  if (g.batch <= 0 || g.in_h <= 0 || g.in_w <= 0 || g.in_c <= 0 || out_c <= 0 || g.k_h <= 0 || g.k_w <= 0 ||
      g.out_h <= 0 || g.out_w <= 0) {
    return fall_back(op, fmt::format("an empty tensor (x {}x{}x{}x{}, window {}x{}, output {}x{}x{}x{}): cuDNN rejects "
                                     "zero dimensions",
                                     g.batch, g.in_h, g.in_w, g.in_c, g.k_h, g.k_w, g.batch, g.out_h, g.out_w, out_c));
  }
  const std::int64_t x_elements = g.batch * g.in_h * g.in_w * g.in_c;
  const std::int64_t y_elements = g.batch * g.out_h * g.out_w * out_c;
  const std::int64_t filter_elements = conv ? g.k_h * g.k_w * g.in_c * g.out_c : 0;
  if (x_elements > kMaxInt || y_elements > kMaxInt || filter_elements > kMaxInt || g.k_h > kMaxInt || g.k_w > kMaxInt ||
      g.stride_h > kMaxInt || g.stride_w > kMaxInt) {
    return fall_back(
        op, fmt::format("sizes beyond int (x {} elements, output {}, filter {}, window {}x{}, strides "
                        "{}x{}): cuDNN's legacy descriptors take int, at most {}",
                        x_elements, y_elements, filter_elements, g.k_h, g.k_w, g.stride_h, g.stride_w, kMaxInt));
  }
  const std::int64_t pad_bottom = window_pad_after(g.in_h, g.k_h, g.stride_h, g.out_h, g.pad_top);
  const std::int64_t pad_right = window_pad_after(g.in_w, g.k_w, g.stride_w, g.out_w, g.pad_left);
  if (pad_bottom != g.pad_top || pad_right != g.pad_left) {
    return fall_back(op, fmt::format("asymmetric SAME padding (rows {} before, {} after; columns {} before, {} after): "
                                     "cuDNN's legacy descriptors pad both sides alike",
                                     g.pad_top, pad_bottom, g.pad_left, pad_right));
  }
  const std::int64_t cudnn_h = cudnn_output_size(g.in_h, g.k_h, g.stride_h, g.pad_top);
  const std::int64_t cudnn_w = cudnn_output_size(g.in_w, g.k_w, g.stride_w, g.pad_left);
  if (cudnn_h != g.out_h || cudnn_w != g.out_w) {
    return fall_back(
        op, fmt::format("cuDNN's output would be {}x{} where TF's is {}x{}", cudnn_h, cudnn_w, g.out_h, g.out_w));
  }

  CudnnPlan plan;
  plan.op = op;
  plan.use_cudnn = true;
  plan.data_type = dtype == DType::kF32   ? CudnnDataType::kFloat
                   : dtype == DType::kF16 ? CudnnDataType::kHalf
                                          : CudnnDataType::kBFloat16;
  // 16-bit data accumulates in float32 (cuDNN's PSEUDO_HALF / PSEUDO_BFLOAT16 configurations),
  // like tandem's own kernels and cuBLAS calls.
  plan.compute_type = CudnnDataType::kFloat;
  plan.math_type = dtype == DType::kF32 && !tf32 ? CudnnMathType::kFma : CudnnMathType::kTensorOp;
  plan.x = nhwc_tensor(g.batch, g.in_h, g.in_w, g.in_c);
  plan.y = nhwc_tensor(g.batch, g.out_h, g.out_w, out_c);
  plan.window_h = static_cast<int>(g.k_h);
  plan.window_w = static_cast<int>(g.k_w);
  plan.pad_h = static_cast<int>(g.pad_top);
  plan.pad_w = static_cast<int>(g.pad_left);
  plan.stride_h = static_cast<int>(g.stride_h);
  plan.stride_w = static_cast<int>(g.stride_w);
  if (conv) {
    plan.filter = {static_cast<int>(g.out_c), static_cast<int>(g.in_c), static_cast<int>(g.k_h),
                   static_cast<int>(g.k_w)};
    plan.filter_is_krsc = permutation_is_identity_in_memory({g.k_h, g.k_w, g.in_c, g.out_c}, kHwioToKrsc);
  } else {
    // The CPU kernels divide by the cells inside the image, which is what excluding padding means.
    plan.pooling_mode =
        op == CudnnWindowOp::kMaxPool2D ? CudnnPoolingMode::kMax : CudnnPoolingMode::kAverageExcludePadding;
  }
  return plan;
}

}  // namespace tandem::ops::detail
