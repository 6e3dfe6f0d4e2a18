// tandem/ops/cuda/launchers.h — the CUDA kernels' host entry points.
//
// The .cu files see only this header and CUDA's own: no fmt, Eigen or tandem types reach nvcc,
// which keeps device compilation fast and free of host-library warnings. cuda_kernels.cc turns a
// KernelContext into these calls. Every launcher queues work on `stream` and returns at once;
// none synchronises except where it says so. Shapes are validated by the ops' shape functions
// before a launcher is reached.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/ops/cuda/element_math.h"  // BroadcastArgs, ReduceArgs, WindowGeometry
#include "tandem/ops/detail/masked_softmax_args.h"
#include "tandem/ops/detail/update_rules.h"

namespace tandem::ops::cuda {

// graph::DType's values, mirrored (static_assert in cuda_kernels.cc).
enum class ElementType : std::uint8_t { kF32, kF64, kI32, kI64, kU8, kF16, kBF16 };

enum class BinaryOp : std::uint8_t { kAdd, kSub, kMul, kDiv, kEqual };
enum class UnaryOp : std::uint8_t { kNeg, kSquare, kAbs, kSqrt, kExp, kLog, kSign, kRelu, kSigmoid, kTanh };
// ops::Activation's values.
enum class Activation : std::uint8_t { kLinear, kRelu, kSigmoid, kTanh, kGelu, kGeluApproximate };

// out = a op b (kEqual writes uint8).
void binary(BinaryOp op, ElementType type, const BroadcastArgs& args, const void* a, const void* b, void* out,
            cudaStream_t stream);
// out[i] = x[offset of i under args.strides[0]] * scale: broadcasting (SumGrad, MeanGrad) and
// permuting (Transpose) in one kernel.
void broadcast(ElementType type, const BroadcastArgs& args, const void* x, double scale, void* out,
               cudaStream_t stream);
void unary(UnaryOp op, ElementType type, const void* x, void* y, std::int64_t n, cudaStream_t stream);
// dx = dy * act'(z), from `y`: the activation's output for relu, sigmoid and tanh, its input z for
// GELU (GeluGrad, and BiasActivationGrad below).
void activation_grad(Activation activation, ElementType type, const void* dy, const void* y, void* dx, std::int64_t n,
                     cudaStream_t stream);
// out = sum of `count` inputs (count <= kMaxAddN per call; the caller chains larger sums).
inline constexpr int kMaxAddN = 16;
void add_n(ElementType type, const void* const* inputs, int count, bool accumulate, void* out, std::int64_t n,
           cudaStream_t stream);
void cast(ElementType from, ElementType to, const void* x, void* y, std::int64_t n, cudaStream_t stream);
void fill(ElementType type, double value, void* y, std::int64_t n, cudaStream_t stream);

// y[r, c] = act(x[r, c] + bias[c]) (x may be y). bias null: no bias (the Gelu op). pre, when not
// null, receives x + bias, which GELU's gradient needs (pre may be x).
void bias_activation(Activation activation, ElementType type, const void* x, const void* bias, void* pre, void* y,
                     std::int64_t rows, std::int64_t cols, cudaStream_t stream);
// dz = dy * act'(z) from y (or from z for GELU; unless dz is null: BiasAddGrad) and db[c] = sum
// over rows of dz[r, c].
void bias_activation_grad(Activation activation, ElementType type, const void* dy, const void* y, void* dz, void* db,
                          std::int64_t rows, std::int64_t cols, cudaStream_t stream);

// Sum/Mean/Max over any axes and SumToShape (ReduceArgs: element_math.h).
enum class ReduceKind : std::uint8_t { kSum, kMean, kMax };
void reduce(ReduceKind kind, ElementType type, const ReduceArgs& args, const void* x, void* out, cudaStream_t stream);
// MaxGrad: dx = dy[o] / (ties of y[o]) where x equals its reduction's maximum y[o], else 0 (TF
// splits the gradient equally between ties). One thread per output writes its reduced elements.
void max_grad(ElementType type, const ReduceArgs& args, const void* dy, const void* x, const void* y, void* dx,
              cudaStream_t stream);

// Row-wise over [rows, cols]: softmax or log-softmax.
void softmax(bool log, ElementType type, const void* x, void* y, std::int64_t rows, std::int64_t cols,
             cudaStream_t stream);
// SoftmaxGrad: dx = y * (dy - sum(dy * y)); LogSoftmaxGrad: dx = dy - exp(y) * sum(dy).
void softmax_grad(bool log, ElementType type, const void* dy, const void* y, void* dx, std::int64_t rows,
                  std::int64_t cols, cudaStream_t stream);
// loss[r] = logsumexp(x[r]) - x[r, label]; backprop = softmax(x) - onehot(label). A label outside
// [0, classes) sets *bad_row (device memory, initialised by the caller to rows) to the smallest
// such row, and that row's outputs to NaN.
void sparse_softmax_cross_entropy(ElementType type, ElementType label_type, const void* x, const void* labels,
                                  void* loss, void* backprop, std::int64_t rows, std::int64_t classes,
                                  unsigned long long* bad_row, int* fault, cudaStream_t stream);
// Dense labels: loss[r] = -sum(z * log_softmax(x)); backprop = softmax(x) * sum(z) - z.
void softmax_cross_entropy(ElementType type, const void* x, const void* z, void* loss, void* backprop,
                           std::int64_t rows, std::int64_t classes, cudaStream_t stream);
// max(x, 0) - x * z + log(1 + exp(-|x|)); its gradient (dy * (sigmoid(x) - z), -dy * x).
void sigmoid_cross_entropy(ElementType type, const void* x, const void* z, void* loss, std::int64_t n,
                           cudaStream_t stream);
void sigmoid_cross_entropy_grad(ElementType type, const void* dy, const void* x, const void* z, void* dx, void* dz,
                                std::int64_t n, cudaStream_t stream);
// Dropout with the CPU kernel's counter-based hash: the same (key, element) keeps the same
// elements on both devices. keep when the 53-bit hash >= threshold; y = x * scale, mask = scale.
void dropout(ElementType type, const void* x, void* y, void* mask, std::int64_t n, std::uint64_t key,
             std::uint64_t threshold, double scale, cudaStream_t stream);
// ---- Transformer ops: layer normalisation, masked softmax (one block per row) ----
// LayerNorm over rows of `cols`: y = (x - mean) * inv_std * gamma + beta (gamma, beta may be
// null), the row's mean and inv_std = 1 / sqrt(biased variance + epsilon) stored in the compute
// type (float for 16-bit x, double for double).
void layer_norm(ElementType type, const void* x, const void* gamma, const void* beta, double epsilon, void* y,
                void* mean, void* inv_std, std::int64_t rows, std::int64_t cols, cudaStream_t stream);
// LayerNormGrad: dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma (gamma may be
// null), per row; dgamma = sum of dy * xhat and dbeta = sum of dy per column, deterministic.
void layer_norm_grad(ElementType type, const void* dy, const void* x, const void* mean, const void* inv_std,
                     const void* gamma, void* dx, void* dgamma, void* dbeta, std::int64_t rows, std::int64_t cols,
                     cudaStream_t stream);
// MaskedSoftmax: softmax(scale * x) over each row's attended keys (detail::MaskedSoftmaxRows: the
// causal prefix, and mask, of mask_type int32/int64/uint8, when not null), 0 elsewhere; a row with
// none is all zeros.
void masked_softmax(ElementType type, ElementType mask_type, const void* x, const void* mask,
                    const detail::MaskedSoftmaxRows& rows, double scale, void* y, cudaStream_t stream);
// MaskedSoftmaxGrad: dx = scale * y * (dy - sum(dy * y)) per row (0 beyond a causal row's prefix).
void masked_softmax_grad(ElementType type, const void* dy, const void* y, const detail::MaskedSoftmaxRows& rows,
                         double scale, void* dx, cudaStream_t stream);

// out[r, :] = off, out[r, index[r]] = on (float32 out; an index outside [0, depth) leaves all off).
void one_hot(ElementType index_type, const void* indices, float* out, std::int64_t rows, std::int64_t depth, float on,
             float off, cudaStream_t stream);
// FusedBatchNorm over [rows, channels] (the CPU kernel's formulas, statistics in double with the
// shift by row 0): training computes batch_mean/variance, saved_mean/inv_std from x; inference
// takes them from mean_in/variance_in. Then y = (x - mean) * scale * inv_std + offset.
void batch_norm(ElementType type, bool training, double epsilon, const void* x, const void* scale, const void* offset,
                const void* mean_in, const void* variance_in, void* y, void* batch_mean, void* batch_variance,
                void* saved_mean, void* saved_inv_std, std::int64_t rows, std::int64_t channels, cudaStream_t stream);
// FusedBatchNormGrad: dx, dscale, doffset, dmean, dvariance (the CPU kernel's formulas);
// dbatch_mean / dbatch_variance may be null.
void batch_norm_grad(ElementType type, bool training, const void* dy, const void* x, const void* scale,
                     const void* mean, const void* inv_std, const void* dbatch_mean, const void* dbatch_variance,
                     void* dx, void* dscale, void* doffset, void* dmean, void* dvariance, std::int64_t rows,
                     std::int64_t channels, cudaStream_t stream);
// out[o, i] = argmax over a of x[o, a, i] (int64; the first of equal maxima).
void argmax(ElementType type, const void* x, std::int64_t* out, std::int64_t outer, std::int64_t axis,
            std::int64_t inner, cudaStream_t stream);

// Convolution as im2col + GEMM, and pooling (WindowGeometry: element_math.h).
// col[pixel, (ky * k_w + kx) * in_c + c] = x[n, oh * s_h - pad_top + ky, ow * s_w - pad_left + kx, c]
// (0 outside the image): the patch matrix [batch * out_h * out_w, k_h * k_w * in_c].
void im2col(ElementType type, const WindowGeometry& g, const void* x, void* col, cudaStream_t stream);
// The adjoint: dx[n, h, w, c] = sum of dcol over the patches that read (h, w, c). Gathers, so no
// atomics: each input element is written once.
void col2im(ElementType type, const WindowGeometry& g, const void* dcol, void* dx, cudaStream_t stream);
// Max or average over each window (average counts only the cells inside the image).
void pool(bool average, ElementType type, const WindowGeometry& g, const void* x, void* y, cudaStream_t stream);
// MaxPool2DGrad: each window's dy goes to its first maximum (scan order), summed per input cell.
void max_pool_grad(ElementType type, const WindowGeometry& g, const void* x, const void* dy, void* dx,
                   cudaStream_t stream);
// AvgPool2DGrad: dy / (cells in the window) to every cell of the window, summed per input cell.
void avg_pool_grad(ElementType type, const WindowGeometry& g, const void* dy, void* dx, cudaStream_t stream);
// FusedConv2DMaxPool's pool over y (windows that do not overlap, at most 254 cells): p = each
// window's maximum, argmax = its first maximum's cell in scan order (dh * k_w + dw), or
// kArgmaxNoWinner where no cell won (all NaN) or, with relu, the maximum is not > 0.
inline constexpr std::uint8_t kArgmaxNoWinner = 255;  // ops::detail::kNoWinner
void max_pool_argmax(bool relu, ElementType type, const WindowGeometry& g, const void* y, void* p, std::uint8_t* argmax,
                     cudaStream_t stream);
// The argmax gradient ops' dz (shaped like y): dp at the cell argmax names in each window, 0
// elsewhere (also where no window covers a cell).
void max_pool_argmax_grad(ElementType type, const WindowGeometry& g, const std::uint8_t* argmax, const void* dp,
                          void* dz, cudaStream_t stream);

// One optimizer step over many tensors in one launch: UpdateTensor and UpdateParams are in
// ops/detail/update_rules.h.
using detail::kMaxUpdateTensors;
using detail::UpdateParams;
using detail::UpdateRule;
using detail::UpdateTensor;
// Applies the rule to every tensor of `tensors` (count <= kMaxUpdateTensors; null slots where a
// rule's option is off). The rule's numbers come from `params`, or, when params_in_memory is set,
// from that device memory as the kernel runs (a CUDA graph replays the launch with the step's own
// learning rate). Nothing changes when `fault` (device, may be null) is non-zero.
void apply_update(ElementType type, const UpdateParams& params, const UpdateParams* params_in_memory, const int* fault,
                  const UpdateTensor* tensors, int count, cudaStream_t stream);
// Sum of squares of n elements into *out (device, double), for clipping by norm.
void squared_norm(ElementType type, const void* x, std::int64_t n, double* out, cudaStream_t stream);
// Sets *flag (device int, initialised to 0 by the caller) to 1 when any element is inf or NaN.
void check_finite(ElementType type, const void* x, std::int64_t n, int* flag, cudaStream_t stream);

// The last launch's error, as cudaGetLastError (cuda_kernels.cc checks it after every kernel).
cudaError_t last_launch_error();

}  // namespace tandem::ops::cuda
