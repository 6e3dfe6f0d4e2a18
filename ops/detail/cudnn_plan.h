// tandem/ops/detail/cudnn_plan.h — whether cuDNN can run a 2-D window op, and with which numbers.
//
// The GPU kernels of Conv2D, FusedConv2D, Conv2DBackpropInput, Conv2DBackpropFilter and the pooling
// ops ask plan_cudnn() first: it either accepts the case and returns every number the cuDNN
// descriptors take (in cuDNN's order), or says why the case stays on tandem's own kernels. It is a
// pure function with no CUDA or cuDNN type in sight, so that it is compiled and tested in every
// build (tests/ops/cudnn_plan_test.cc); ops/cuda/cudnn.cc only copies its numbers into descriptors.
//
// Layouts: tensors are NHWC, described to cuDNN as 4-D tensors with dims in NCHW order and NHWC
// strides. Filters are HWIO (Keras); cuDNN's legacy filter descriptors take only KCRS (NCHW) or
// KRSC (NHWC: k = output channel outermost, then rows, columns, input channels), so the filter is
// permuted HWIO -> OHWI (= KRSC) before the forward and data-gradient calls, and the filter
// gradient OHWI -> HWIO afterwards. The permutations are Transpose's `perm` (output dimension d is
// input dimension perm[d]).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "tandem/graph/dtype.h"
#include "tandem/ops/cpu/conv_geometry.h"

namespace tandem::ops::detail {

// The ops that may go through cuDNN. A convolution's forward pass, data gradient and filter
// gradient share one plan: they use the same descriptors.
enum class CudnnWindowOp : std::uint8_t { kConv2D, kMaxPool2D, kAvgPool2D, kMaxPool2DGrad, kAvgPool2DGrad };

// cudnnDataType_t's values (static_assert in ops/cuda/cudnn.cc).
enum class CudnnDataType : int { kFloat = 0, kDouble = 1, kHalf = 2, kBFloat16 = 9 };
// cudnnMathType_t's values. kFma forbids tensor cores: on Ampere and later, cuDNN's default math
// lets float32 convolutions round their inputs to TF32.
enum class CudnnMathType : int { kDefault = 0, kTensorOp = 1, kFma = 3 };
// cudnnPoolingMode_t's values.
enum class CudnnPoolingMode : int { kMax = 0, kAverageExcludePadding = 2 };

// cudnnSetTensor4dDescriptorEx's arguments: dims in NCHW order, strides of the NHWC storage.
struct CudnnTensor4d {
  int n = 0, c = 0, h = 0, w = 0;
  int n_stride = 0, c_stride = 0, h_stride = 0, w_stride = 0;
};

// cudnnSetFilter4dDescriptor's arguments with format CUDNN_TENSOR_NHWC (KRSC storage):
// k output channels, c input channels, h x w window.
struct CudnnFilter4d {
  int k = 0, c = 0, h = 0, w = 0;
};

// Transpose permutations between tandem's HWIO filter and cuDNN's KRSC (= OHWI) one.
inline constexpr std::array<std::int64_t, 4> kHwioToKrsc{3, 0, 1, 2};
inline constexpr std::array<std::int64_t, 4> kKrscToHwio{1, 2, 3, 0};

struct CudnnPlan {
  CudnnWindowOp op = CudnnWindowOp::kConv2D;
  bool use_cudnn = false;
  std::string fallback_reason;  // why tandem's kernels run instead; empty when use_cudnn

  // Everything below is set only when use_cudnn.
  CudnnDataType data_type = CudnnDataType::kFloat;
  CudnnDataType compute_type = CudnnDataType::kFloat;  // convolutions: float32 for 16-bit data too
  CudnnMathType math_type = CudnnMathType::kFma;       // convolutions
  CudnnTensor4d x;                                     // the op's input (convolution: x / dx)
  CudnnTensor4d y;                                     // the op's output (convolution: y / dy)
  CudnnFilter4d filter;                                // convolutions
  // The HWIO filter's bytes are already KRSC when every dimension that moves is 1 (one output
  // channel, or a 1x1 window over one input channel): no permutation is needed then.
  bool filter_is_krsc = false;
  CudnnPoolingMode pooling_mode = CudnnPoolingMode::kMax;  // pooling
  int window_h = 0, window_w = 0;                          // filter or pool window
  int pad_h = 0, pad_w = 0;                                // symmetric: before = after
  int stride_h = 1, stride_w = 1;
  int dilation_h = 1, dilation_w = 1;  // convolutions; tandem's ops have no dilation
};

// The plan for `op` over geometry `g` in `dtype`. `tf32` is tensor_float_32_execution_enabled()
// (it picks the math type of float32 convolutions). A case falls back when:
//   - the op is MaxPool2DGrad: cuDNN sends each window's gradient to one of its maxima, which
//     one unspecified (and with atomics); tandem's CPU and GPU kernels send it to the first
//     maximum in scan order, deterministically;
//   - the dtype is float64 (cuDNN's NHWC paths are for float32 and 16-bit types) or not floating;
//   - a dimension is 0 (cuDNN rejects empty tensors; tandem's kernels write the zeros);
//   - a tensor has 2^31 elements or more (the legacy descriptors take int);
//   - SAME padding is asymmetric (TF puts the odd padding row or column at the bottom or right;
//     the legacy descriptors pad both sides alike);
//   - cuDNN's output size for the symmetric padding would differ from TF's (a safety net).
CudnnPlan plan_cudnn(CudnnWindowOp op, const Window2DGeometry& g, graph::DType dtype, bool tf32);

// cuDNN's output extent for symmetric padding `pad` on both sides: (in + 2 pad - k) / stride + 1.
std::int64_t cudnn_output_size(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t pad);

}  // namespace tandem::ops::detail
