// CPU kernels of the nn family (definitions: ops/nn_ops.cc).
//
// Element-wise kernels split the flat range over the device's threads (parallel_elements);
// row-wise kernels (softmax, the cross-entropies, bias) split rows with row_grain, so a chunk is
// always big enough to be worth a thread. Transcendental functions go through Eigen arrays,
// whose exp/tanh/log1p are vectorised; plain arithmetic is written as loops the compiler
// vectorises.
//
// Per-channel sums (bias gradients, batch statistics) accumulate in double and come out the same
// whatever the number of threads: the split depends only on the shape (channel_sums).
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "tandem/ops/cpu/bias_activation.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/detail/dropout_attrs.h"
#include "tandem/ops/detail/kernel_args.h"
#include "tandem/ops/detail/registration.h"
#include "tandem/ops/nn_ops.h"

namespace tandem::ops::cpu {
namespace {

using graph::dispatch;
using graph::FloatTypes;
using graph::IndexTypes;

// Channels summed together in one stack block of accumulators (K x 1 KiB of doubles).
constexpr std::int64_t kChannelBlock = 128;
// The most row partitions a per-channel sum is split into (each needs K x channels doubles),
// and the most scratch doubles the partitions may use together (2 MiB per calling thread).
constexpr std::int64_t kMaxRowPartitions = 64;
constexpr std::int64_t kMaxPartialSums = std::int64_t{1} << 18;

// ---- Small helpers ----------------------------------------------------------------------------

// Scratch memory owned by the calling thread. It only grows, so after the first step a kernel
// that uses it allocates nothing. Two slots per type, for two arrays alive at once.
template <class T>
T* scratch_buffer(std::size_t n, int slot) {
  thread_local std::array<std::vector<T>, 2> buffers;
  auto& buffer = buffers[static_cast<std::size_t>(slot)];
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// dy * act'(z), from the activation's output y.
template <Activation A, class T>
inline T activation_backward(T dy, T y) {
  if constexpr (A == Activation::kLinear) {
    return dy;
  } else if constexpr (A == Activation::kRelu) {
    return y > T(0) ? dy : T(0);
  } else if constexpr (A == Activation::kSigmoid) {
    return dy * y * (T(1) - y);
  } else {
    return dy * (T(1) - y * y);
  }
}

using detail::RowsCols;
RowsCols rows_cols(const Tensor& t) { return detail::rows_cols(t.shape()); }

template <class T>
const T* in_data(KernelContext& ctx, int i) {
  return in_ptr<T>(ctx, i);
}

// ---- Per-channel sums ------------------------------------------------------------------------

template <int K>
using ChannelAccumulators = double[K][kChannelBlock];

// Sums K quantities per element over the rows of a [rows, channels] tensor, in double.
//   accumulate(r0, r1, c0, c1, acc) adds the quantities of rows [r0, r1) and channels [c0, c1) to
//     acc[k][c - c0] (it may also write element-wise outputs: one sweep does both);
//   finish(c0, c1, acc) receives the complete sums of a block of channels.
// When there are at least as many blocks of channels as row partitions would be (many channels,
// or a tensor too small to split), blocks run in parallel over all rows and need no scratch;
// otherwise rows are split into partitions whose partial sums meet in thread-local scratch and
// are added in partition order. Both splits depend only on the shape, so the result is the same
// for any number of threads.
template <int K, class Accumulate, class Finish>
void channel_sums(KernelContext& ctx, std::int64_t rows, std::int64_t channels, Accumulate&& accumulate,
                  Finish&& finish) {
  if (channels <= 0) return;
  const std::int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  const std::int64_t max_partitions =
      std::max<std::int64_t>(1, std::min({kMaxRowPartitions, rows, kMaxPartialSums / (K * channels)}));
  const std::int64_t partitions = std::clamp<std::int64_t>(rows * channels / kElementwiseGrain, 1, max_partitions);
  if (partitions <= blocks) {
    const std::int64_t grain =
        std::max<std::int64_t>(1, kElementwiseGrain / std::max<std::int64_t>(1, rows * kChannelBlock));
    ctx.device().parallel_for(blocks, grain, [&](std::int64_t b0, std::int64_t b1) {
      for (std::int64_t block = b0; block < b1; ++block) {
        const std::int64_t c0 = block * kChannelBlock;
        const std::int64_t c1 = std::min(channels, c0 + kChannelBlock);
        ChannelAccumulators<K> acc = {};
        accumulate(std::int64_t{0}, rows, c0, c1, acc);
        finish(c0, c1, acc);
      }
    });
    return;
  }
  const std::int64_t stride = K * channels;  // doubles per partition
  double* partials = scratch_buffer<double>(static_cast<std::size_t>(partitions * stride), 0);
  ctx.device().parallel_for(partitions, 1, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t r0 = rows * p / partitions;
      const std::int64_t r1 = rows * (p + 1) / partitions;
      double* mine = partials + p * stride;
      for (std::int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
        const std::int64_t c1 = std::min(channels, c0 + kChannelBlock);
        ChannelAccumulators<K> acc = {};
        accumulate(r0, r1, c0, c1, acc);
        for (int k = 0; k < K; ++k) std::copy(acc[k], acc[k] + (c1 - c0), mine + k * channels + c0);
      }
    }
  });
  for (std::int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
    const std::int64_t c1 = std::min(channels, c0 + kChannelBlock);
    ChannelAccumulators<K> acc = {};
    for (std::int64_t p = 0; p < partitions; ++p) {
      for (int k = 0; k < K; ++k) {
        const double* part = partials + p * stride + k * channels + c0;
        for (std::int64_t j = 0; j < c1 - c0; ++j) acc[k][j] += part[j];
      }
    }
    finish(c0, c1, acc);
  }
}

// ---- Activations -----------------------------------------------------------------------------

template <class T, class F>
void map_elements(KernelContext& ctx, F f) {
  const Tensor& in = ctx.input(0);
  const Tensor& out = ctx.output(0);
  parallel_elements(ctx, in.num_elements(), [&](std::int64_t begin, std::int64_t end) {
    array_slice<T>(out, begin, end) = f(const_array_slice<T>(in, begin, end));
  });
}

template <Activation A>
void activation_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(),
                       [&]<class T>() { map_elements<T>(ctx, [](const auto& x) { return activate<A>(x); }); });
}

// ReluGrad, SigmoidGrad, TanhGrad: (dy, y) -> dy * act'(y).
template <Activation A>
void activation_grad_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const T* dy = in_ptr<T>(ctx, 0);
    const T* y = in_ptr<T>(ctx, 1);
    T* dx = out_ptr<T>(ctx, 0);
    parallel_elements(ctx, ctx.input(0).num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) dx[i] = activation_backward<A>(dy[i], y[i]);
    });
  });
}

// ---- Softmax ---------------------------------------------------------------------------------

// Shifted by the row's maximum, so exp never overflows and the sum is at least 1 (no log(0)).
template <bool kLog>
void softmax_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const RowsCols shape_2d = rows_cols(ctx.input(0));
    const std::int64_t rows = shape_2d.rows;
    const std::int64_t cols = shape_2d.cols;
    const T* x = in_ptr<T>(ctx, 0);
    T* y = out_ptr<T>(ctx, 0);
    ctx.device().parallel_for(rows, row_grain(cols), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const ConstArrayMap<T> xr(x + r * cols, cols);
        ArrayMap<T> yr(y + r * cols, cols);
        const T max = xr.maxCoeff();
        if constexpr (kLog) {
          const T log_sum = std::log((xr - max).exp().sum());
          yr = (xr - max) - log_sum;
        } else {
          yr = (xr - max).exp();
          yr *= T(1) / yr.sum();
        }
      }
    });
  });
}

// SoftmaxGrad: dx = y * (dy - sum(dy * y)); LogSoftmaxGrad: dx = dy - exp(y) * sum(dy).
template <bool kLog>
void softmax_grad_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const RowsCols shape_2d = rows_cols(ctx.input(0));
    const std::int64_t rows = shape_2d.rows;
    const std::int64_t cols = shape_2d.cols;
    const T* dy = in_ptr<T>(ctx, 0);
    const T* y = in_ptr<T>(ctx, 1);
    T* dx = out_ptr<T>(ctx, 0);
    ctx.device().parallel_for(rows, row_grain(cols), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const ConstArrayMap<T> g(dy + r * cols, cols);
        const ConstArrayMap<T> yr(y + r * cols, cols);
        ArrayMap<T> out(dx + r * cols, cols);
        if constexpr (kLog) {
          out = g - yr.exp() * g.sum();
        } else {
          out = yr * (g - (g * yr).sum());
        }
      }
    });
  });
}

// ---- Bias, bias + activation, dense ----------------------------------------------------------

// z = act(z + bias[c0:c1]) on rows [r0, r1), columns [c0, c1) of a row-major block.

template <bool kWithActivation>
void bias_add_kernel(KernelContext& ctx) {
  const Activation activation = kWithActivation ? activation_of(ctx) : Activation::kLinear;
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    with_activation(activation, [&]<Activation A>() {
      const RowsCols shape_2d = rows_cols(ctx.input(0));
      const std::int64_t rows = shape_2d.rows;
      const std::int64_t cols = shape_2d.cols;
      const T* x = in_ptr<T>(ctx, 0);
      const T* bias = in_ptr<T>(ctx, 1);
      T* y = out_ptr<T>(ctx, 0);
      ctx.device().parallel_for(rows, row_grain(cols), [&](std::int64_t begin, std::int64_t end) {
        bias_activation_rows<A>(x, y, cols, begin, end, 0, cols, bias);
      });
    });
  });
}

// BiasAddGrad: the sum of dy over every axis but the last.
void bias_add_grad_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const RowsCols shape_2d = rows_cols(ctx.input(0));
    const std::int64_t rows = shape_2d.rows;
    const std::int64_t cols = shape_2d.cols;
    const T* dy = in_ptr<T>(ctx, 0);
    T* db = out_ptr<T>(ctx, 0);
    channel_sums<1>(
        ctx, rows, cols,
        [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, auto& acc) {
          for (std::int64_t r = r0; r < r1; ++r) {
            const T* g = dy + r * cols + c0;
            for (std::int64_t j = 0; j < c1 - c0; ++j) acc[0][j] += static_cast<double>(g[j]);
          }
        },
        [&](std::int64_t c0, std::int64_t c1, const auto& acc) {
          for (std::int64_t c = c0; c < c1; ++c) db[c] = static_cast<T>(acc[0][c - c0]);
        });
  });
}

// BiasActivationGrad: dz = dy * act'(y) and db = sum of dz over rows, in one sweep.
void bias_activation_grad_kernel(KernelContext& ctx) {
  const Activation activation = activation_of(ctx);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    with_activation(activation, [&]<Activation A>() {
      const RowsCols shape_2d = rows_cols(ctx.input(0));
      const std::int64_t rows = shape_2d.rows;
      const std::int64_t cols = shape_2d.cols;
      const T* dy = in_ptr<T>(ctx, 0);
      const T* y = in_ptr<T>(ctx, 1);
      T* dz = out_ptr<T>(ctx, 0);
      T* db = out_ptr<T>(ctx, 1);
      channel_sums<1>(
          ctx, rows, cols,
          [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, auto& acc) {
            // Two loops over the row segment (it stays in L1): fused into one, the compiler
            // turns relu's select into a branch around the accumulation.
            for (std::int64_t r = r0; r < r1; ++r) {
              const std::int64_t o = r * cols + c0;
              for (std::int64_t j = 0; j < c1 - c0; ++j) dz[o + j] = activation_backward<A>(dy[o + j], y[o + j]);
              for (std::int64_t j = 0; j < c1 - c0; ++j) acc[0][j] += static_cast<double>(dz[o + j]);
            }
          },
          [&](std::int64_t c0, std::int64_t c1, const auto& acc) {
            for (std::int64_t c = c0; c < c1; ++c) db[c] = static_cast<T>(acc[0][c - c0]);
          });
    });
  });
}

// FusedMatMul: act(x @ kernel + bias). The product is split over the threads like gemm() splits
// it (the larger side of the output), and each thread applies bias and activation to its block
// right after computing it, while the block is still in its cache.
void fused_matmul_kernel(KernelContext& ctx) {
  const Activation activation = activation_of(ctx);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    with_activation(activation, [&]<Activation A>() {
      const std::int64_t m = ctx.input(0).shape()[0];
      const std::int64_t k = ctx.input(0).shape()[1];
      const std::int64_t n = ctx.input(1).shape()[1];
      const T* x = in_ptr<T>(ctx, 0);
      const T* w = in_ptr<T>(ctx, 1);
      const T* bias = in_ptr<T>(ctx, 2);
      T* out = out_ptr<T>(ctx, 0);
      const GemmShape shape{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n};
      const auto block = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
        if (r0 >= r1 || c0 >= c1) return;
        if (k == 0) {
          for (std::int64_t r = r0; r < r1; ++r) std::fill(out + r * n + c0, out + r * n + c1, T(0));
        } else {
          GemmShape part = shape;
          part.m = r1 - r0;
          part.n = c1 - c0;
          gemm_serial<T>(part, T(1), x + r0 * k, w + c0, T(0), out + r0 * n + c0);
        }
        bias_activation_rows<A>(out, out, n, r0, r1, c0, c1, bias);
      };
      const std::int64_t threads = ctx.device().intra_op_threads();
      if (threads <= 1 || m * n * std::max<std::int64_t>(k, 1) < kParallelGemmMinMacs) {
        block(0, m, 0, n);
        return;
      }
      const bool split_columns = n >= m;
      const std::int64_t extent = split_columns ? n : m;
      const std::int64_t align = split_columns ? kGemmColumnAlignment : 1;
      std::int64_t part_size = (extent + threads - 1) / threads;
      part_size = (part_size + align - 1) / align * align;
      const std::int64_t parts = (extent + part_size - 1) / part_size;
      ctx.device().parallel_for(parts, 1, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t p = begin; p < end; ++p) {
          const std::int64_t lo = p * part_size;
          const std::int64_t hi = std::min(extent, lo + part_size);
          if (split_columns) {
            block(0, m, lo, hi);
          } else {
            block(lo, hi, 0, n);
          }
        }
      });
    });
  });
}

// ---- Cross-entropy losses --------------------------------------------------------------------

// loss[r] = logsumexp(x[r]) - x[r, label]; backprop[r] = softmax(x[r]) - onehot(label).
void sparse_xent_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    dispatch<IndexTypes>(ctx.input(1).dtype(), ctx.label(), [&]<class L>() {
      const std::int64_t rows = ctx.input(0).shape()[0];
      const std::int64_t classes = ctx.input(0).shape()[1];
      const T* x = in_ptr<T>(ctx, 0);
      const L* labels = in_ptr<L>(ctx, 1);
      T* loss = out_ptr<T>(ctx, 0);
      T* backprop = out_ptr<T>(ctx, 1);
      // Checked up front, on one thread: the error names the first bad row, deterministically.
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto label = static_cast<std::int64_t>(labels[r]);
        TANDEM_REQUIRE(label >= 0 && label < classes, InvalidArgument,
                       "{}: label {} in row {} is outside the valid class ids [0, {})", ctx.label(), label, r, classes);
      }
      ctx.device().parallel_for(rows, row_grain(classes), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t r = begin; r < end; ++r) {
          const ConstArrayMap<T> xr(x + r * classes, classes);
          ArrayMap<T> bp(backprop + r * classes, classes);
          const auto label = static_cast<std::int64_t>(labels[r]);
          const T max = xr.maxCoeff();
          bp = (xr - max).exp();
          const T sum = bp.sum();  // >= 1: the maximum contributes exp(0)
          bp *= T(1) / sum;
          bp[label] -= T(1);
          loss[r] = std::log(sum) - (xr[label] - max);
        }
      });
    });
  });
}

// loss[r] = -sum(labels * log_softmax(x)); backprop = softmax(x) * sum(labels) - labels, the exact
// gradient (softmax - labels, as TF writes it, when each row of labels sums to 1).
void xent_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const std::int64_t rows = ctx.input(0).shape()[0];
    const std::int64_t classes = ctx.input(0).shape()[1];
    const T* x = in_ptr<T>(ctx, 0);
    const T* z = in_ptr<T>(ctx, 1);
    T* loss = out_ptr<T>(ctx, 0);
    T* backprop = out_ptr<T>(ctx, 1);
    ctx.device().parallel_for(rows, row_grain(classes), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const ConstArrayMap<T> xr(x + r * classes, classes);
        const ConstArrayMap<T> zr(z + r * classes, classes);
        ArrayMap<T> bp(backprop + r * classes, classes);
        const T max = xr.maxCoeff();
        bp = (xr - max).exp();
        const T sum = bp.sum();  // >= 1
        const T log_sum = std::log(sum);
        loss[r] = -(zr * ((xr - max) - log_sum)).sum();
        bp = bp * (zr.sum() / sum) - zr;
      }
    });
  });
}

// max(x, 0) - x * z + log(1 + exp(-|x|)): exp of a non-positive number never overflows.
void sigmoid_xent_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& logits = ctx.input(0);
    const Tensor& labels = ctx.input(1);
    const Tensor& out = ctx.output(0);
    parallel_elements(ctx, logits.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      const auto x = const_array_slice<T>(logits, begin, end);
      const auto z = const_array_slice<T>(labels, begin, end);
      array_slice<T>(out, begin, end) = x.max(T(0)) - x * z + (-x.abs()).exp().log1p();
    });
  });
}

// (dy, x, z) -> (dy * (sigmoid(x) - z), -dy * x).
void sigmoid_xent_grad_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    parallel_elements(ctx, ctx.input(0).num_elements(), [&](std::int64_t begin, std::int64_t end) {
      const auto dy = const_array_slice<T>(ctx.input(0), begin, end);
      const auto x = const_array_slice<T>(ctx.input(1), begin, end);
      const auto z = const_array_slice<T>(ctx.input(2), begin, end);
      array_slice<T>(ctx.output(0), begin, end) = dy * (activate<Activation::kSigmoid>(x) - z);
      array_slice<T>(ctx.output(1), begin, end) = -dy * x;
    });
  });
}

// ---- Dropout ---------------------------------------------------------------------------------

// Counter-based: element i keeps its value when a hash of (stream key, i) clears the threshold,
// so the mask does not depend on how the elements are split over threads, and the same
// (executor seed, node, step, attr seed) gives the same mask.
void dropout_kernel(KernelContext& ctx) {
  const detail::DropoutRun run = detail::read_dropout(ctx);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const T* x = in_ptr<T>(ctx, 0);
    T* y = out_ptr<T>(ctx, 0);
    T* mask = out_ptr<T>(ctx, 1);
    const std::int64_t n = ctx.input(0).num_elements();
    if (!run.active) {
      parallel_elements(ctx, n, [&](std::int64_t begin, std::int64_t end) {
        std::copy(x + begin, x + end, y + begin);
        std::fill(mask + begin, mask + end, T(1));
      });
      return;
    }
    const std::uint64_t threshold = run.threshold;
    const T scale = static_cast<T>(1.0 / (1.0 - run.rate));
    const std::uint64_t key = run.key;
    parallel_elements(ctx, n, [&](std::int64_t begin, std::int64_t end) {
      // Locals, not captures: the stores through mask and y could alias a captured T, which
      // would force a reload per element and keep the loop from vectorising.
      const T* const in = x;
      T* const out = y;
      T* const keep_mask = mask;
      const T keep_scale = scale;
      const std::uint64_t drop_below = threshold;
      const std::uint64_t stream = key;
      for (std::int64_t i = begin; i < end; ++i) {
        const std::uint64_t bits = detail::dropout_bits(stream, i);
        const T keep = bits >= drop_below ? keep_scale : T(0);
        keep_mask[i] = keep;
        out[i] = in[i] * keep;
      }
    });
  });
}

// ---- Batch normalisation ---------------------------------------------------------------------

// y = (x - mean[c]) * coef[c] + offset[c], with coef = scale * inv_std.
template <class T>
void batch_norm_apply(KernelContext& ctx, std::int64_t rows, std::int64_t channels, const T* x, const T* mean,
                      const T* coef, const T* offset, T* y) {
  ctx.device().parallel_for(rows, row_grain(channels), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * channels;
      T* yr = y + r * channels;
      for (std::int64_t c = 0; c < channels; ++c) yr[c] = (xr[c] - mean[c]) * coef[c] + offset[c];
    }
  });
}

// Outputs: y, batch_mean, batch_variance, saved_mean, saved_inv_std. Training statistics come
// from one pass of sums of (x - x[0, c]) and their squares in double: shifting by a sample of
// the channel keeps the one-pass variance free of cancellation.
void batch_norm_kernel(KernelContext& ctx) {
  const double epsilon = ctx.attrs().get_float_or("epsilon", 1e-3);
  const bool training = ctx.attrs().get_bool_or("training", true);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const RowsCols shape_2d = rows_cols(ctx.input(0));
    const std::int64_t rows = shape_2d.rows;
    const std::int64_t channels = shape_2d.cols;
    const T* x = in_ptr<T>(ctx, 0);
    const T* scale = in_ptr<T>(ctx, 1);
    const T* offset = in_ptr<T>(ctx, 2);
    const T* mean_in = in_ptr<T>(ctx, 3);
    const T* variance_in = in_ptr<T>(ctx, 4);
    T* y = out_ptr<T>(ctx, 0);
    T* batch_mean = out_ptr<T>(ctx, 1);
    T* batch_variance = out_ptr<T>(ctx, 2);
    T* saved_mean = out_ptr<T>(ctx, 3);
    T* saved_inv_std = out_ptr<T>(ctx, 4);
    T* coef = scratch_buffer<T>(static_cast<std::size_t>(channels), 1);
    if (training) {
      const double inv_rows = rows > 0 ? 1.0 / static_cast<double>(rows) : 0.0;
      channel_sums<2>(
          ctx, rows, channels,
          [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, auto& acc) {
            const T* shift = x + c0;
            for (std::int64_t r = r0; r < r1; ++r) {
              const T* xr = x + r * channels + c0;
              for (std::int64_t j = 0; j < c1 - c0; ++j) {
                const double d = static_cast<double>(xr[j]) - static_cast<double>(shift[j]);
                acc[0][j] += d;
                acc[1][j] += d * d;
              }
            }
          },
          [&](std::int64_t c0, std::int64_t c1, const auto& acc) {
            for (std::int64_t c = c0; c < c1; ++c) {
              const double shifted_mean = acc[0][c - c0] * inv_rows;
              const double variance = std::max(0.0, acc[1][c - c0] * inv_rows - shifted_mean * shifted_mean);
              const double mean = (rows > 0 ? static_cast<double>(x[c]) : 0.0) + shifted_mean;
              const double inv_std = 1.0 / std::sqrt(variance + epsilon);
              batch_mean[c] = saved_mean[c] = static_cast<T>(mean);
              batch_variance[c] = static_cast<T>(variance);
              saved_inv_std[c] = static_cast<T>(inv_std);
              coef[c] = static_cast<T>(static_cast<double>(scale[c]) * inv_std);
            }
          });
    } else {
      for (std::int64_t c = 0; c < channels; ++c) {
        const double inv_std = 1.0 / std::sqrt(static_cast<double>(variance_in[c]) + epsilon);
        batch_mean[c] = saved_mean[c] = mean_in[c];
        batch_variance[c] = variance_in[c];
        saved_inv_std[c] = static_cast<T>(inv_std);
        coef[c] = static_cast<T>(static_cast<double>(scale[c]) * inv_std);
      }
    }
    batch_norm_apply<T>(ctx, rows, channels, x, saved_mean, coef, offset, y);
  });
}

// Inputs: dy, x, scale, saved_mean, saved_inv_std[, dbatch_mean, dbatch_variance].
// Outputs: dx, dscale, doffset, dmean, dvariance (the last two are zero in training mode).
// One pass sums dy and dy * (x - mean) per channel; a second writes
//   dx = a[c] * dy + b[c] * (x - mean[c]) + d[c].
void batch_norm_grad_kernel(KernelContext& ctx) {
  const bool training = ctx.attrs().get_bool_or("training", true);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const RowsCols shape_2d = rows_cols(ctx.input(0));
    const std::int64_t rows = shape_2d.rows;
    const std::int64_t channels = shape_2d.cols;
    const T* dy = in_ptr<T>(ctx, 0);
    const T* x = in_ptr<T>(ctx, 1);
    const T* scale = in_ptr<T>(ctx, 2);
    const T* mean = in_ptr<T>(ctx, 3);
    const T* inv_std = in_ptr<T>(ctx, 4);
    const bool has_stat_grads = ctx.num_inputs() == 7;
    const T* dbatch_mean = has_stat_grads ? in_ptr<T>(ctx, 5) : nullptr;
    const T* dbatch_variance = has_stat_grads ? in_ptr<T>(ctx, 6) : nullptr;
    T* dx = out_ptr<T>(ctx, 0);
    T* dscale = out_ptr<T>(ctx, 1);
    T* doffset = out_ptr<T>(ctx, 2);
    T* dmean = out_ptr<T>(ctx, 3);
    T* dvariance = out_ptr<T>(ctx, 4);
    T* coef = scratch_buffer<T>(static_cast<std::size_t>(3 * channels), 1);
    T* a = coef;
    T* b = coef + channels;
    T* d = coef + 2 * channels;
    const double inv_rows = rows > 0 ? 1.0 / static_cast<double>(rows) : 0.0;
    channel_sums<2>(
        ctx, rows, channels,
        [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, auto& acc) {
          for (std::int64_t r = r0; r < r1; ++r) {
            const std::int64_t o = r * channels + c0;
            for (std::int64_t j = 0; j < c1 - c0; ++j) {
              const auto g = static_cast<double>(dy[o + j]);
              acc[0][j] += g;
              acc[1][j] += g * (static_cast<double>(x[o + j]) - static_cast<double>(mean[c0 + j]));
            }
          }
        },
        [&](std::int64_t c0, std::int64_t c1, const auto& acc) {
          for (std::int64_t c = c0; c < c1; ++c) {
            const double r = inv_std[c];
            const double sum_dy = acc[0][c - c0];
            const double ds = r * acc[1][c - c0];  // sum of dy * normalised x
            const double a_c = static_cast<double>(scale[c]) * r;
            const double dbm = has_stat_grads ? static_cast<double>(dbatch_mean[c]) : 0.0;
            const double dbv = has_stat_grads ? static_cast<double>(dbatch_variance[c]) : 0.0;
            a[c] = static_cast<T>(a_c);
            if (training) {
              // The statistics depend on x: the usual batch-norm backward, plus the gradients of
              // batch_mean (1/M each) and batch_variance (2 (x - mean) / M each).
              b[c] = static_cast<T>((-a_c * r * ds + 2.0 * dbv) * inv_rows);
              d[c] = static_cast<T>((-a_c * sum_dy + dbm) * inv_rows);
              dmean[c] = T(0);
              dvariance[c] = T(0);
            } else {
              b[c] = T(0);
              d[c] = T(0);
              dmean[c] = static_cast<T>(-a_c * sum_dy + dbm);
              dvariance[c] = static_cast<T>(-0.5 * a_c * r * ds + dbv);
            }
            dscale[c] = static_cast<T>(ds);
            doffset[c] = static_cast<T>(sum_dy);
          }
        });
    ctx.device().parallel_for(rows, row_grain(channels), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const std::int64_t o = r * channels;
        for (std::int64_t c = 0; c < channels; ++c) dx[o + c] = a[c] * dy[o + c] + b[c] * (x[o + c] - mean[c]) + d[c];
      }
    });
  });
}

}  // namespace
}  // namespace tandem::ops::cpu

namespace tandem::ops::detail {

void register_nn_cpu_kernels() {
  using namespace tandem::ops::cpu;
  auto& registry = graph::OpRegistry::global();
  const auto add = [&](std::string_view op, graph::KernelFn fn) {
    registry.add_kernel(op, devices::DeviceType::kCPU, fn);
  };
  add("Relu", activation_kernel<Activation::kRelu>);
  add("Sigmoid", activation_kernel<Activation::kSigmoid>);
  add("Tanh", activation_kernel<Activation::kTanh>);
  add("ReluGrad", activation_grad_kernel<Activation::kRelu>);
  add("SigmoidGrad", activation_grad_kernel<Activation::kSigmoid>);
  add("TanhGrad", activation_grad_kernel<Activation::kTanh>);
  add("Softmax", softmax_kernel<false>);
  add("LogSoftmax", softmax_kernel<true>);
  add("SoftmaxGrad", softmax_grad_kernel<false>);
  add("LogSoftmaxGrad", softmax_grad_kernel<true>);
  add("BiasAdd", bias_add_kernel<false>);
  add("BiasAddGrad", bias_add_grad_kernel);
  add("BiasActivation", bias_add_kernel<true>);
  add("BiasActivationGrad", bias_activation_grad_kernel);
  add("FusedMatMul", fused_matmul_kernel);
  add("SparseSoftmaxCrossEntropyWithLogits", sparse_xent_kernel);
  add("SoftmaxCrossEntropyWithLogits", xent_kernel);
  add("SigmoidCrossEntropyWithLogits", sigmoid_xent_kernel);
  add("SigmoidCrossEntropyWithLogitsGrad", sigmoid_xent_grad_kernel);
  add("Dropout", dropout_kernel);
  add("FusedBatchNorm", batch_norm_kernel);
  add("FusedBatchNormGrad", batch_norm_grad_kernel);
}

}  // namespace tandem::ops::detail
