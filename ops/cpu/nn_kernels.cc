// CPU kernels of the nn family (definitions: ops/nn_ops.cc).
//
// Element-wise kernels split the flat range over the device's threads (parallel_elements);
// row-wise kernels (softmax, the cross-entropies, bias) split rows with row_grain, so a chunk is
// always big enough to be worth a thread. Transcendental functions go through Eigen arrays,
// whose exp/tanh/log1p are vectorised; plain arithmetic is written as loops the compiler
// vectorises.
//
// Per-channel sums (bias gradients, batch statistics, layer norm's dgamma and dbeta) accumulate in
// double and come out the same whatever the number of threads: the split depends only on the
// shape (channel_sums, partitioned_row_sums).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/ops/cpu/bias_activation.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/cpu/gemm_tiles.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/detail/dropout_attrs.h"
#include "tandem/ops/detail/kernel_args.h"
#include "tandem/ops/detail/masked_softmax_args.h"
#include "tandem/ops/cpu/isa.h"
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

using detail::RowsCols;
RowsCols rows_cols(const Tensor& t) { return detail::rows_cols(t.shape()); }

template <class T>
const T* in_data(KernelContext& ctx, int i) {
  return in_ptr<T>(ctx, i);
}

// ---- Per-channel sums ------------------------------------------------------------------------

template <int K>
using ChannelAccumulators = double[K][kChannelBlock];

// A partition's K sums per channel seen like ChannelAccumulators (sums[k][c] for channels from 0).
struct PartitionSums {
  double* data;
  std::int64_t channels;
  double* operator[](int k) const { return data + k * channels; }
};

// How many row partitions a sum of K quantities per channel over [rows, channels] is split into:
// about one per kElementwiseGrain elements, at most kMaxRowPartitions, and few enough that their
// partial sums fit in kMaxPartialSums doubles. A function of the shape only.
template <int K>
std::int64_t row_partitions(std::int64_t rows, std::int64_t channels) {
  const std::int64_t max_partitions = std::max<std::int64_t>(
      1, std::min({kMaxRowPartitions, rows, kMaxPartialSums / (K * std::max<std::int64_t>(1, channels))}));
  return std::clamp<std::int64_t>(rows * channels / kElementwiseGrain, 1, max_partitions);
}

// Splits the rows into `partitions` ranges run on the device's threads: accumulate_rows(r0, r1,
// sums) adds the range's K quantities per channel to its own zeroed sums (quantity k of channel c
// at sums[k * channels + c]; whole rows, so it may also write row-wise outputs). Returns the
// ranges' sums added in range order: the same for any number of threads. The result lives in
// the calling thread's scratch until its next call.
template <int K, class AccumulateRows>
const double* partitioned_row_sums(KernelContext& ctx, std::int64_t rows, std::int64_t channels,
                                   std::int64_t partitions, AccumulateRows&& accumulate_rows) {
  const std::int64_t stride = K * channels;  // doubles per partition
  double* partials = scratch_buffer<double>(static_cast<std::size_t>((partitions + 1) * stride), 0);
  double* totals = partials + partitions * stride;
  ctx.device().parallel_for(partitions, 1, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      double* mine = partials + p * stride;
      std::fill(mine, mine + stride, 0.0);
      accumulate_rows(rows * p / partitions, rows * (p + 1) / partitions, mine);
    }
  });
  std::fill(totals, totals + stride, 0.0);
  for (std::int64_t p = 0; p < partitions; ++p) {
    const double* part = partials + p * stride;
    for (std::int64_t i = 0; i < stride; ++i) totals[i] += part[i];
  }
  return totals;
}

// Sums K quantities per element over the rows of a [rows, channels] tensor, in double.
//   accumulate(r0, r1, c0, c1, acc) adds the quantities of rows [r0, r1) and channels [c0, c1) to
//     acc[k][c - c0] (it may also write element-wise outputs: one sweep does both; acc is a
//     ChannelAccumulators or a PartitionSums);
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
  const std::int64_t partitions = row_partitions<K>(rows, channels);
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
  // Whole rows at a time, into the partition's own sums: rows stream through the cache in order
  // (blocks of a few hundred bytes per row, 2 KiB apart, defeat the hardware prefetcher).
  const double* totals = partitioned_row_sums<K>(
      ctx, rows, channels, partitions, [&](std::int64_t r0, std::int64_t r1, double* mine) {
        PartitionSums sums{mine, channels};
        accumulate(r0, r1, std::int64_t{0}, channels, sums);
      });
  for (std::int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
    const std::int64_t c1 = std::min(channels, c0 + kChannelBlock);
    ChannelAccumulators<K> acc;
    for (int k = 0; k < K; ++k) std::copy(totals + k * channels + c0, totals + k * channels + c1, acc[k]);
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

// ReluGrad, SigmoidGrad, TanhGrad: (dy, y) -> dy * act'(y); GeluGrad: (dy, x) -> dy * gelu'(x).
template <Activation A>
void activation_grad_kernel(KernelContext& ctx) {
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const T* dy = in_ptr<T>(ctx, 0);
    const T* saved = in_ptr<T>(ctx, 1);
    T* dx = out_ptr<T>(ctx, 0);
    parallel_elements(ctx, ctx.input(0).num_elements(), [&](std::int64_t begin, std::int64_t end) {
      activation_backward<A>(dy + begin, saved + begin, dx + begin, end - begin);
    });
  });
}

// Gelu and GeluGrad: the "approximate" attribute picks the form.
template <bool kGrad>
void gelu_kernel(KernelContext& ctx) {
  const auto run = [&]<Activation A>() {
    if constexpr (kGrad) {
      activation_grad_kernel<A>(ctx);
    } else {
      activation_kernel<A>(ctx);
    }
  };
  if (ctx.attrs().get_bool_or("approximate", false)) {
    run.template operator()<Activation::kGeluApproximate>();
  } else {
    run.template operator()<Activation::kGelu>();
  }
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

// BiasAdd, and BiasActivation, which also writes the pre-activation x + bias to its second output
// when the activation's gradient needs it (GELU).
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
      T* pre = activation_gradient_needs_input(A) ? out_ptr<T>(ctx, 1) : nullptr;
      ctx.device().parallel_for(rows, row_grain(cols), [&](std::int64_t begin, std::int64_t end) {
        bias_activation_rows<A>(x, y, pre, cols, begin, end, 0, cols, bias);
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

// BiasActivationGrad: dz = dy * act'(z) (from y, or from z for GELU) and db = sum of dz over rows,
// in one sweep.
void bias_activation_grad_kernel(KernelContext& ctx) {
  const Activation activation = activation_of(ctx);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    with_activation(activation, [&]<Activation A>() {
      const RowsCols shape_2d = rows_cols(ctx.input(0));
      const std::int64_t rows = shape_2d.rows;
      const std::int64_t cols = shape_2d.cols;
      const T* dy = in_ptr<T>(ctx, 0);
      const T* saved = in_ptr<T>(ctx, 1);
      T* dz = out_ptr<T>(ctx, 0);
      T* db = out_ptr<T>(ctx, 1);
      channel_sums<1>(
          ctx, rows, cols,
          [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, auto& acc) {
            // Two loops over the row segment (it stays in L1): fused into one, the compiler
            // turns relu's select into a branch around the accumulation.
            for (std::int64_t r = r0; r < r1; ++r) {
              const std::int64_t o = r * cols + c0;
              activation_backward<A>(dy + o, saved + o, dz + o, c1 - c0);
              for (std::int64_t j = 0; j < c1 - c0; ++j) acc[0][j] += static_cast<double>(dz[o + j]);
            }
          },
          [&](std::int64_t c0, std::int64_t c1, const auto& acc) {
            for (std::int64_t c = c0; c < c1; ++c) db[c] = static_cast<T>(acc[0][c - c0]);
          });
    });
  });
}

// FusedMatMul: act(x @ kernel + bias). float32 products go to the register tiles, which hand over
// each block of whole output rows (about 1 MiB of x's rows, so the block's output is still in the
// last-level cache) to bias and activation as soon as it is complete; otherwise the product is
// split over the threads like gemm() splits it (the larger side of the output), and each thread
// applies bias and activation to its block right after computing it, in its cache. With GELU
// the product goes to the second output, which keeps the pre-activation for the gradient.
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
      T* pre = activation_gradient_needs_input(A) ? out_ptr<T>(ctx, 1) : nullptr;
      T* product = pre != nullptr ? pre : out;
      const GemmShape shape{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n};
      if constexpr (std::is_same_v<T, float>) {
        // The register tiles hand over each block of the product as it is complete.
        const auto epilogue = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
          bias_activation_rows<A>(product, out, pre, n, r0, r1, c0, c1, bias);
        };
        const tiles::BlockDone done(epilogue);
        if (gemm_tiles_enabled() && tiles::gemm(ctx.device(), shape, x, w, product, &done)) return;
      }
      const auto block = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
        if (r0 >= r1 || c0 >= c1) return;
        if (k == 0) {
          for (std::int64_t r = r0; r < r1; ++r) std::fill(product + r * n + c0, product + r * n + c1, T(0));
        } else {
          GemmShape part = shape;
          part.m = r1 - r0;
          part.n = c1 - c0;
          gemm_serial<T>(part, T(1), x + r0 * k, w + c0, T(0), product + r0 * n + c0);
        }
        bias_activation_rows<A>(product, out, pre, n, r0, r1, c0, c1, bias);
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

// ---- Layer normalisation ---------------------------------------------------------------------

// Inputs: x[, gamma][, beta] (attributes scale, center); outputs: y, mean and inv_std per row.
// Each row is read twice while it is in L1: its mean, then the variance around that mean (two
// passes keep the variance free of cancellation), y written on the second.
void layer_norm_kernel(KernelContext& ctx) {
  const double epsilon = ctx.attrs().get_float_or("epsilon", 1e-3);
  const bool scale = ctx.attrs().get_bool_or("scale", false);
  const bool center = ctx.attrs().get_bool_or("center", false);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const auto [rows, cols] = rows_cols(ctx.input(0));
    if (rows == 0) return;
    const T* x = in_ptr<T>(ctx, 0);
    const T* gamma = scale ? in_ptr<T>(ctx, 1) : nullptr;
    const T* beta = center ? in_ptr<T>(ctx, scale ? 2 : 1) : nullptr;
    T* y = out_ptr<T>(ctx, 0);
    T* mean = out_ptr<T>(ctx, 1);  // the statistics are T too: float32 for 16-bit x, widened
    T* inv_std = out_ptr<T>(ctx, 2);
    const T inv_cols = T(1) / static_cast<T>(cols);
    const T eps = static_cast<T>(epsilon);
    ctx.device().parallel_for(rows, row_grain(cols), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const ConstArrayMap<T> xr(x + r * cols, cols);
        ArrayMap<T> yr(y + r * cols, cols);
        const T mu = xr.sum() * inv_cols;
        const T inv = T(1) / std::sqrt((xr - mu).square().sum() * inv_cols + eps);
        mean[r] = mu;
        inv_std[r] = inv;
        const auto normalised = (xr - mu) * inv;
        if (gamma != nullptr && beta != nullptr) {
          yr = normalised * ConstArrayMap<T>(gamma, cols) + ConstArrayMap<T>(beta, cols);
        } else if (gamma != nullptr) {
          yr = normalised * ConstArrayMap<T>(gamma, cols);
        } else if (beta != nullptr) {
          yr = normalised + ConstArrayMap<T>(beta, cols);
        } else {
          yr = normalised;
        }
      }
    });
  });
}

// Inputs: dy, x, mean, inv_std[, gamma]; outputs: dx, dgamma, dbeta, in one sweep. With
// xhat = (x - mean) * inv_std and g = dy * gamma, each row's
//   dx = inv_std * (g - mean(g) - xhat * mean(g * xhat))
// is written while dgamma += dy * xhat and dbeta += dy accumulate per channel, in double, over
// partitions of whole rows added in a fixed order (partitioned_row_sums).
void layer_norm_grad_kernel(KernelContext& ctx) {
  const bool scale = ctx.attrs().get_bool_or("scale", false);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const auto [rows, cols] = rows_cols(ctx.input(0));
    if (cols == 0) return;
    const T* dy = in_ptr<T>(ctx, 0);
    const T* x = in_ptr<T>(ctx, 1);
    const T* mean = in_ptr<T>(ctx, 2);
    const T* inv_std = in_ptr<T>(ctx, 3);
    const T* gamma = scale ? in_ptr<T>(ctx, 4) : nullptr;
    T* dx = out_ptr<T>(ctx, 0);
    T* dgamma = out_ptr<T>(ctx, 1);
    T* dbeta = out_ptr<T>(ctx, 2);
    const T inv_cols = T(1) / static_cast<T>(cols);
    const double* totals = partitioned_row_sums<2>(
        ctx, rows, cols, row_partitions<2>(rows, cols), [&](std::int64_t r0, std::int64_t r1, double* sums) {
          double* sum_dy_xhat = sums;
          double* sum_dy = sums + cols;
          for (std::int64_t r = r0; r < r1; ++r) {
            const std::int64_t o = r * cols;
            const T inv = inv_std[r];
            const ConstArrayMap<T> g(dy + o, cols);
            ArrayMap<T> out(dx + o, cols);
            out = (ConstArrayMap<T>(x + o, cols) - mean[r]) * inv;  // xhat, in dx's row while in L1
            const T* xhat = dx + o;
            for (std::int64_t c = 0; c < cols; ++c) {
              sum_dy_xhat[c] += static_cast<double>(dy[o + c] * xhat[c]);
              sum_dy[c] += static_cast<double>(dy[o + c]);
            }
            if (gamma != nullptr) {
              const ConstArrayMap<T> gm(gamma, cols);
              const T mean_g = (g * gm).sum() * inv_cols;
              const T mean_gx = (g * gm * out).sum() * inv_cols;
              out = inv * (g * gm - mean_g - out * mean_gx);
            } else {
              const T mean_g = g.sum() * inv_cols;
              const T mean_gx = (g * out).sum() * inv_cols;
              out = inv * (g - mean_g - out * mean_gx);
            }
          }
        });
    for (std::int64_t c = 0; c < cols; ++c) {
      dgamma[c] = static_cast<T>(totals[c]);
      dbeta[c] = static_cast<T>(totals[cols + c]);
    }
  });
}

// ---- Masked softmax --------------------------------------------------------------------------

// A causal row's prefix rounded up to whole 64-byte vectors (within the row): Eigen evaluates a
// length that is not a multiple of its packet size with a scalar tail, and a scalar exp costs
// more than the vector exp of the few keys beyond the prefix, which are then overwritten with 0.
template <class T>
std::int64_t whole_vectors(std::int64_t n, std::int64_t cols) {
  constexpr std::int64_t kLanes = 64 / sizeof(T);
  return std::min(cols, (n + kLanes - 1) / kLanes * kLanes);
}

// Row r of y = softmax(scale * x) over the keys it attends to (detail/masked_softmax_args.h), 0
// elsewhere; all zeros when it attends to none. A causal row ends at its query: the keys beyond
// take no exp (but those of its last vector). With a mask (M its element type), keep holds the
// row's 0/1 flags.
template <class T, class M>
void masked_softmax_row(const detail::MaskedSoftmaxRows& a, std::int64_t r, const T* xr, const M* mask, T scale,
                        T* keep, T* yr) {
  const std::int64_t n = detail::attended_prefix(a, r);
  const std::int64_t padded = whole_vectors<T>(n, a.cols);
  if (n == 0) {
    std::fill(yr, yr + a.cols, T(0));
    return;
  }
  ArrayMap<T> ys(yr, padded);
  T max = -std::numeric_limits<T>::infinity();
  if (mask == nullptr) {
    max = (ConstArrayMap<T>(xr, n) * scale).maxCoeff();
    ys = (ConstArrayMap<T>(xr, padded) * scale - max).exp();
    std::fill(yr + n, yr + a.cols, T(0));
  } else {
    const M* mr = mask + detail::mask_row_offset(a, r);
    const std::int64_t stride = a.col_stride;
    for (std::int64_t j = 0; j < n; ++j) keep[j] = mr[j * stride] != 0 ? T(1) : T(0);
    std::fill(keep + n, keep + padded, T(0));
    for (std::int64_t j = 0; j < n; ++j) max = keep[j] != T(0) ? std::max(max, scale * xr[j]) : max;
    if (!(max > -std::numeric_limits<T>::infinity())) {  // nothing to attend
      std::fill(yr, yr + a.cols, T(0));
      return;
    }
    // Masked keys take exp(0) and are then multiplied by 0: no inf, NaN or denormal on the way.
    for (std::int64_t j = 0; j < padded; ++j) yr[j] = keep[j] != T(0) ? scale * xr[j] - max : T(0);
    ys = ys.exp() * ConstArrayMap<T>(keep, padded);
    std::fill(yr + padded, yr + a.cols, T(0));
  }
  ys *= T(1) / ys.sum();  // the sum is >= 1: the maximum contributes exp(0)
}

// Inputs: x[, mask] (int32, int64 or uint8, broadcast to x); attributes scale, causal.
void masked_softmax_kernel(KernelContext& ctx) {
  const double scale = ctx.attrs().get_float_or("scale", 1.0);
  const bool causal = ctx.attrs().get_bool_or("causal", false);
  const bool has_mask = ctx.num_inputs() == 2;
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Shape& xs = ctx.input(0).shape();
    const Shape empty;
    const Shape& ms = has_mask ? ctx.input(1).shape() : empty;
    const auto a =
        detail::masked_softmax_rows(xs.dims().data(), xs.rank(), ms.dims().data(), ms.rank(), has_mask, causal);
    const T* x = in_ptr<T>(ctx, 0);
    T* y = out_ptr<T>(ctx, 0);
    const auto run = [&]<class M>(const M* mask) {
      ctx.device().parallel_for(a.rows, row_grain(a.cols), [&](std::int64_t begin, std::int64_t end) {
        T* keep = mask != nullptr ? scratch_buffer<T>(static_cast<std::size_t>(a.cols), 1) : nullptr;
        for (std::int64_t r = begin; r < end; ++r) {
          masked_softmax_row<T, M>(a, r, x + r * a.cols, mask, static_cast<T>(scale), keep, y + r * a.cols);
        }
      });
    };
    if (!has_mask) {
      run(static_cast<const std::uint8_t*>(nullptr));
    } else {
      dispatch<graph::IntegerTypes>(ctx.input(1).dtype(), ctx.label(), [&]<class M>() { run(in_ptr<M>(ctx, 1)); });
    }
  });
}

// MaskedSoftmaxGrad (dy, y): dx = scale * y * (dy - sum(dy * y)) per row; masked entries of y are
// 0, so their dx is 0, and a causal row's keys beyond its query are skipped.
void masked_softmax_grad_kernel(KernelContext& ctx) {
  const double scale = ctx.attrs().get_float_or("scale", 1.0);
  const bool causal = ctx.attrs().get_bool_or("causal", false);
  dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Shape& shape = ctx.input(0).shape();
    const auto a = detail::masked_softmax_rows(shape.dims().data(), shape.rank(), nullptr, 0, false, causal);
    const T* dy = in_ptr<T>(ctx, 0);
    const T* y = in_ptr<T>(ctx, 1);
    T* dx = out_ptr<T>(ctx, 0);
    const auto s = static_cast<T>(scale);
    ctx.device().parallel_for(a.rows, row_grain(a.cols), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const std::int64_t o = r * a.cols, n = detail::attended_prefix(a, r);
        const std::int64_t padded = whole_vectors<T>(n, a.cols);
        const T dot = (ConstArrayMap<T>(dy + o, n) * ConstArrayMap<T>(y + o, n)).sum();
        ArrayMap<T>(dx + o, padded) = s * ConstArrayMap<T>(y + o, padded) * (ConstArrayMap<T>(dy + o, padded) - dot);
        std::fill(dx + o + n, dx + o + a.cols, T(0));
      }
    });
  });
}

}  // namespace
}  // namespace tandem::ops::cpu

namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS {

void register_nn_kernels() {
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
  add("Gelu", gelu_kernel<false>);
  add("GeluGrad", gelu_kernel<true>);
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
  add("LayerNorm", layer_norm_kernel);
  add("LayerNormGrad", layer_norm_grad_kernel);
  add("MaskedSoftmax", masked_softmax_kernel);
  add("MaskedSoftmaxGrad", masked_softmax_grad_kernel);
}

}  // namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS
