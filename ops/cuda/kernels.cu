// CUDA kernels of the engine's ops (host entry points: launchers.h).
//
// 16-bit types (__half, __nv_bfloat16) are loaded into float, computed in float and rounded once
// when stored, like the CPU path; float64 computes in double. Element-wise kernels use a
// grid-stride loop over a capped grid; row-wise kernels (softmax, cross-entropy) use one block per
// row with shared-memory reductions; column sums (bias gradients, batch-norm sums) split the rows
// into chunks summed in parallel, then add the chunks in a fixed order, so results do not depend
// on scheduling (no atomics on values).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tandem/ops/cuda/device_common.cuh"
#include "tandem/ops/cuda/launchers.h"
#include "tandem/ops/detail/dropout_hash.h"
#include "tandem/ops/detail/update_rules.h"

namespace tandem::ops::cuda {
namespace {

__device__ __forceinline__ float d_exp(float x) { return expf(x); }
__device__ __forceinline__ double d_exp(double x) { return exp(x); }
__device__ __forceinline__ float d_log(float x) { return logf(x); }
__device__ __forceinline__ double d_log(double x) { return log(x); }
__device__ __forceinline__ float d_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double d_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float d_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double d_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float d_erf(float x) { return erff(x); }
__device__ __forceinline__ double d_erf(double x) { return erf(x); }
__device__ __forceinline__ float d_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double d_rsqrt(double x) { return rsqrt(x); }

// ---- Element-wise ------------------------------------------------------------------------------

template <class C>
__device__ __forceinline__ C apply_binary(BinaryOp op, C a, C b) {
  switch (op) {
    case BinaryOp::kAdd: return a + b;
    case BinaryOp::kSub: return a - b;
    case BinaryOp::kMul: return a * b;
    case BinaryOp::kDiv: return a / b;
    case BinaryOp::kEqual: return a == b ? C(1) : C(0);
  }
  return C(0);
}

template <class T, class Out>
__global__ void binary_kernel(BinaryOp op, BroadcastArgs args, const T* a, const T* b, Out* out) {
  TANDEM_GRID_STRIDE(i, args.elements) {
    store(out, i, apply_binary(op, load(a, broadcast_offset(args, i, 0)), load(b, broadcast_offset(args, i, 1))));
  }
}

template <class T>
__global__ void broadcast_kernel(BroadcastArgs args, const T* x, double scale, T* out) {
  TANDEM_GRID_STRIDE(i, args.elements) {
    const std::int64_t offset = broadcast_offset(args, i, 0);
    if (scale == 1.0) {
      out[i] = x[offset];
    } else {
      store(out, i, load(x, offset) * static_cast<compute_t<T>>(scale));
    }
  }
}

template <class C>
__device__ __forceinline__ C apply_unary(UnaryOp op, C x) {
  switch (op) {
    case UnaryOp::kNeg: return -x;
    case UnaryOp::kSquare: return x * x;
    case UnaryOp::kAbs: return x < C(0) ? -x : x;
    case UnaryOp::kSign: return static_cast<C>((x > C(0)) - (x < C(0)));
    case UnaryOp::kRelu: return x > C(0) ? x : C(0);
    default: break;
  }
  if constexpr (std::is_floating_point_v<C>) {
    switch (op) {
      case UnaryOp::kSqrt: return d_sqrt(x);
      case UnaryOp::kExp: return d_exp(x);
      case UnaryOp::kLog: return d_log(x);
      case UnaryOp::kSigmoid: return C(1) / (C(1) + d_exp(-x));  // exp overflow gives exactly 0
      case UnaryOp::kTanh: return d_tanh(x);
      default: break;
    }
  }
  return x;
}

template <class T>
__global__ void unary_kernel(UnaryOp op, const T* x, T* y, std::int64_t n) {
  TANDEM_GRID_STRIDE(i, n) { store(y, i, apply_unary(op, load(x, i))); }
}

// GELU's tanh form: 0.5 z (1 + tanh(kGeluK * (z + kGeluC * z^3))), as ops/cpu/bias_activation.h.
constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluC = 0.044715;
constexpr double kSqrtHalf = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;

// dy * act'(z) from v: the output y for relu, sigmoid and tanh, the input z for GELU.
template <class C>
__device__ __forceinline__ C activation_backward(Activation a, C dy, C v) {
  switch (a) {
    case Activation::kLinear: return dy;
    case Activation::kRelu: return v > C(0) ? dy : C(0);
    case Activation::kSigmoid: return dy * v * (C(1) - v);
    case Activation::kTanh: return dy * (C(1) - v * v);
    case Activation::kGelu:  // Phi(z) + z phi(z)
      return dy * (C(0.5) * (C(1) + d_erf(v * C(kSqrtHalf))) + v * C(kInvSqrt2Pi) * d_exp(C(-0.5) * v * v));
    case Activation::kGeluApproximate: {
      const C t = d_tanh(C(kGeluK) * (v + C(kGeluC) * v * v * v));
      return dy * (C(0.5) * (C(1) + t) + C(0.5 * kGeluK) * v * (C(1) - t * t) * (C(1) + C(3 * kGeluC) * v * v));
    }
  }
  return dy;
}

template <class C>
__device__ __forceinline__ C activate(Activation a, C z) {
  switch (a) {
    case Activation::kLinear: return z;
    case Activation::kRelu: return z > C(0) ? z : C(0);
    case Activation::kSigmoid: return C(1) / (C(1) + d_exp(-z));
    case Activation::kTanh: return d_tanh(z);
    case Activation::kGelu: return C(0.5) * z * (C(1) + d_erf(z * C(kSqrtHalf)));
    case Activation::kGeluApproximate: return C(0.5) * z * (C(1) + d_tanh(C(kGeluK) * (z + C(kGeluC) * z * z * z)));
  }
  return z;
}

template <class T>
__global__ void activation_grad_kernel(Activation a, const T* dy, const T* y, T* dx, std::int64_t n) {
  TANDEM_GRID_STRIDE(i, n) { store(dx, i, activation_backward(a, load(dy, i), load(y, i))); }
}

template <class T>
struct AddNInputs {
  const T* p[kMaxAddN];
};
template <class T>
__global__ void add_n_kernel(AddNInputs<T> in, int count, bool accumulate, T* out, std::int64_t n) {
  TANDEM_GRID_STRIDE(i, n) {
    compute_t<T> sum = accumulate ? load(out, i) : compute_t<T>(0);
    for (int k = 0; k < count; ++k) sum += load(in.p[k], i);
    store(out, i, sum);
  }
}

template <class From, class To>
__global__ void cast_kernel(const From* x, To* y, std::int64_t n) {
  TANDEM_GRID_STRIDE(i, n) {
    if constexpr (std::is_integral_v<From> && std::is_integral_v<To>) {
      y[i] = static_cast<To>(x[i]);
    } else if constexpr (std::is_same_v<From, double> || std::is_same_v<To, double> || std::is_integral_v<From>) {
      // Through double: exact for every float and every int32; int64 beyond 2^53 rounds, as a
      // cast to a floating type must.
      if constexpr (std::is_integral_v<To>) {
        y[i] = static_cast<To>(static_cast<double>(load(x, i)));
      } else {
        store(y, i, static_cast<double>(load(x, i)));
      }
    } else {
      // float, float16, bfloat16 to float, float16, bfloat16 or an integer: through float (which
      // holds every 16-bit value exactly), one rounding.
      if constexpr (std::is_integral_v<To>) {
        y[i] = static_cast<To>(static_cast<float>(load(x, i)));
      } else {
        store(y, i, static_cast<float>(load(x, i)));
      }
    }
  }
}

template <class T>
__global__ void fill_kernel(double value, T* y, std::int64_t n) {
  TANDEM_GRID_STRIDE(i, n) {
    if constexpr (std::is_integral_v<T>) {
      y[i] = static_cast<T>(value);
    } else {
      store(y, i, static_cast<compute_t<T>>(value));
    }
  }
}

template <class T>
__global__ void bias_activation_kernel(Activation a, const T* x, const T* bias, T* pre, T* y, std::int64_t rows,
                                       std::int64_t cols) {
  TANDEM_GRID_STRIDE(i, rows * cols) {
    compute_t<T> z = load(x, i);
    if (bias != nullptr) z += load(bias, i % cols);
    if (pre != nullptr) {
      store(pre, i, z);
      z = load(pre, i);  // the gradient differentiates at the stored (rounded) z
    }
    store(y, i, activate(a, z));
  }
}

// ---- Column sums (element_math.h: row chunks, then chunk partials in order) -------------------------

// Pass 1: block (column block, chunk) adds q's K quantities over its chunk's rows, per column, and
// writes them to partial[(k * chunks + chunk) * cols + c].
template <int K, class Quantities>
__global__ void column_partials_kernel(Quantities q, std::int64_t rows, std::int64_t cols, ColumnChunks split,
                                       double* partial) {
  __shared__ double shared[K][kRowGroups][kColumnsPerBlock];
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(kColumnsPerBlock) + threadIdx.x;
  const std::int64_t chunk = blockIdx.y;
  double sum[K] = {};
  if (c < cols) {
    const std::int64_t end = chunk_end(split, chunk, rows);
    for (std::int64_t r = chunk_begin(split, chunk) + threadIdx.y; r < end; r += kRowGroups) q(r, c, sum);
  }
  for (int k = 0; k < K; ++k) shared[k][threadIdx.y][threadIdx.x] = sum[k];
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (int k = 0; k < K; ++k) {
    double total = 0;
    for (int g = 0; g < kRowGroups; ++g) total += shared[k][g][threadIdx.x];
    partial[(k * split.chunks + chunk) * cols + c] = total;
  }
}

// Pass 2: one thread per column adds its partials in chunk order and hands the totals to `finish`.
template <int K, class Finish>
__global__ void column_totals_kernel(Finish finish, const double* partial, std::int64_t cols, std::int64_t chunks) {
  TANDEM_GRID_STRIDE(c, cols) {
    double total[K];
    for (int k = 0; k < K; ++k) {
      total[k] = 0;
      for (std::int64_t chunk = 0; chunk < chunks; ++chunk) total[k] += partial[(k * chunks + chunk) * cols + c];
    }
    finish(c, total);
  }
}

// Both passes; the partials live in stream-ordered memory (like batch norm's coefficients), which a
// CUDA graph records as allocation nodes.
template <int K, class Quantities, class Finish>
void column_sums(Quantities q, Finish finish, std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  const ColumnChunks split = column_chunks(rows);
  double* partial = nullptr;
  const auto bytes = static_cast<std::size_t>(K * split.chunks * cols) * sizeof(double);
  if (cudaMallocAsync(reinterpret_cast<void**>(&partial), bytes, stream) != cudaSuccess) {
    return;  // the error stays set: the caller's launch check reports it
  }
  const dim3 block(kColumnsPerBlock, kRowGroups);
  const dim3 grid(static_cast<unsigned>((cols + kColumnsPerBlock - 1) / kColumnsPerBlock),
                  static_cast<unsigned>(split.chunks));
  column_partials_kernel<K><<<grid, block, 0, stream>>>(q, rows, cols, split, partial);
  column_totals_kernel<K><<<blocks_for(cols), kThreads, 0, stream>>>(finish, partial, cols, split.chunks);
  cudaFreeAsync(partial, stream);
}

// Bias gradient: dz = dy * act'(y) (written when dz is not null), summed over rows.
template <class T>
struct BiasGradRows {
  Activation a;
  const T* dy;
  const T* y;
  T* dz;
  std::int64_t cols;
  __device__ void operator()(std::int64_t r, std::int64_t c, double* sum) const {
    const std::int64_t i = r * cols + c;
    compute_t<T> g = load(dy, i);
    if (y != nullptr) g = activation_backward(a, g, load(y, i));
    if (dz != nullptr) store(dz, i, g);
    sum[0] += static_cast<double>(g);
  }
};
template <class T>
struct StoreColumnTotal {
  T* out;
  __device__ void operator()(std::int64_t c, const double* total) const { store(out, c, total[0]); }
};

// ---- Reductions --------------------------------------------------------------------------------

template <class T>
__global__ void reduce_kernel(ReduceKind kind, ReduceArgs args, const T* x, T* out) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(o, args.out_elements) {
    const std::int64_t base = reduce_base(args, o);
    C acc = 0;
    if (kind == ReduceKind::kMax) {
      if constexpr (std::is_floating_point_v<C>) acc = -INFINITY;  // empty: the lowest value
      if (args.reduced_elements > 0) acc = load(x, base);
    }
    for (std::int64_t r = 0; r < args.reduced_elements; ++r) {
      const C v = load(x, reduce_offset(args, base, r));
      if (kind == ReduceKind::kMax) {
        acc = v > acc ? v : acc;
      } else {
        acc += v;
      }
    }
    if (kind == ReduceKind::kMean && args.reduced_elements > 0) acc = acc / static_cast<C>(args.reduced_elements);
    store(out, o, acc);
  }
}

template <class T>
__global__ void max_grad_kernel(ReduceArgs args, const T* dy, const T* x, const T* y, T* dx) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(o, args.out_elements) {
    const std::int64_t base = reduce_base(args, o);
    const C best = load(y, o);
    std::int64_t ties = 0;
    for (std::int64_t r = 0; r < args.reduced_elements; ++r)
      ties += load(x, reduce_offset(args, base, r)) == best ? 1 : 0;
    const C share = ties > 0 ? load(dy, o) / static_cast<C>(ties) : C(0);
    for (std::int64_t r = 0; r < args.reduced_elements; ++r) {
      const std::int64_t i = reduce_offset(args, base, r);
      store(dx, i, load(x, i) == best ? share : C(0));
    }
  }
}

// ---- Row-wise: softmax and cross-entropy ---------------------------------------------------------

// Block-wide reductions over kThreads threads; every thread gets the result.
template <class C>
__device__ C block_max(C v, C* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s)
      shared[threadIdx.x] =
          shared[threadIdx.x] > shared[threadIdx.x + s] ? shared[threadIdx.x] : shared[threadIdx.x + s];
    __syncthreads();
  }
  const C result = shared[0];
  __syncthreads();
  return result;
}
template <class C>
__device__ C block_sum(C v, C* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const C result = shared[0];
  __syncthreads();
  return result;
}

template <class T>
__global__ void softmax_kernel(bool log_softmax, const T* x, T* y, std::int64_t cols) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  C max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) max = load(xr, c) > max ? load(xr, c) : max;
  max = block_max(max, shared);
  C sum = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) sum += d_exp(load(xr, c) - max);
  sum = block_sum(sum, shared);
  const C log_sum = d_log(sum);
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const C shifted = load(xr, c) - max;
    store(yr, c, log_softmax ? shifted - log_sum : d_exp(shifted) / sum);
  }
}

template <class T>
__global__ void softmax_grad_kernel(bool log_softmax, const T* dy, const T* y, T* dx, std::int64_t cols) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  C s = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads)
    s += log_softmax ? load(dy, o + c) : load(dy, o + c) * load(y, o + c);
  s = block_sum(s, shared);
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const C g = load(dy, o + c), yv = load(y, o + c);
    store(dx, o + c, log_softmax ? g - d_exp(yv) * s : yv * (g - s));
  }
}

template <class T, class L>
__global__ void sparse_xent_kernel(const T* x, const L* labels, T* loss, T* backprop, std::int64_t classes,
                                   unsigned long long* bad_row, int* fault) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * classes;
  T* bp = backprop + row * classes;
  const auto label = static_cast<std::int64_t>(labels[row]);
  if (label < 0 || label >= classes) {
    if (threadIdx.x == 0) {
      atomicMin(bad_row, static_cast<unsigned long long>(row));
      if (fault != nullptr) *fault = 1;  // every writer writes the same value
      store(loss, row, C(NAN));
    }
    for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) store(bp, c, C(NAN));
    return;
  }
  C max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) max = load(xr, c) > max ? load(xr, c) : max;
  max = block_max(max, shared);
  C sum = 0;
  for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) sum += d_exp(load(xr, c) - max);
  sum = block_sum(sum, shared);  // >= 1: the maximum contributes exp(0)
  for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) {
    const C p = d_exp(load(xr, c) - max) / sum;
    store(bp, c, c == label ? p - C(1) : p);
  }
  if (threadIdx.x == 0) store(loss, row, d_log(sum) - (load(xr, label) - max));
}

template <class T>
__global__ void xent_kernel(const T* x, const T* z, T* loss, T* backprop, std::int64_t classes) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t o = blockIdx.x * classes;
  C max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) max = load(x, o + c) > max ? load(x, o + c) : max;
  max = block_max(max, shared);
  C sum = 0, zsum = 0;
  for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) {
    sum += d_exp(load(x, o + c) - max);
    zsum += load(z, o + c);
  }
  sum = block_sum(sum, shared);
  zsum = block_sum(zsum, shared);
  const C log_sum = d_log(sum);
  C l = 0;
  for (std::int64_t c = threadIdx.x; c < classes; c += kThreads) {
    const C shifted = load(x, o + c) - max, zc = load(z, o + c);
    l += zc * (shifted - log_sum);
    store(backprop, o + c, d_exp(shifted) * (zsum / sum) - zc);
  }
  l = block_sum(l, shared);
  if (threadIdx.x == 0) store(loss, blockIdx.x, -l);
}

template <class T>
__global__ void sigmoid_xent_kernel(const T* x, const T* z, T* loss, std::int64_t n) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(i, n) {
    const C xv = load(x, i), zv = load(z, i);
    const C ax = xv < C(0) ? -xv : xv;
    store(loss, i, (xv > C(0) ? xv : C(0)) - xv * zv + d_log(C(1) + d_exp(-ax)));
  }
}

template <class T>
__global__ void sigmoid_xent_grad_kernel(const T* dy, const T* x, const T* z, T* dx, T* dz, std::int64_t n) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(i, n) {
    const C g = load(dy, i), xv = load(x, i);
    store(dx, i, g * (C(1) / (C(1) + d_exp(-xv)) - load(z, i)));
    store(dz, i, -g * xv);
  }
}

template <class T>
__global__ void dropout_kernel(const T* x, T* y, T* mask, std::int64_t n, std::uint64_t key, std::uint64_t threshold,
                               compute_t<T> scale) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(i, n) {
    const std::uint64_t bits = detail::dropout_bits(key, i);
    const C keep = bits >= threshold ? scale : C(0);
    store(mask, i, keep);
    store(y, i, load(x, i) * keep);
  }
}

template <class I>
__global__ void one_hot_kernel(const I* indices, float* out, std::int64_t rows, std::int64_t depth, float on,
                               float off) {
  TANDEM_GRID_STRIDE(i, rows * depth) {
    const std::int64_t r = i / depth, k = i % depth;
    out[i] = static_cast<std::int64_t>(indices[r]) == k ? on : off;
  }
}

// Batch-norm statistics: per channel, the sums of d and d^2 with d = x - x[row 0] (shifted for
// precision), then mean, variance, 1 / std and the coefficient scale / std.
template <class T>
struct ShiftedMoments {
  const T* x;
  std::int64_t channels;
  __device__ void operator()(std::int64_t r, std::int64_t c, double* sum) const {
    const double d = static_cast<double>(load(x, r * channels + c)) - static_cast<double>(load(x, c));
    sum[0] += d;
    sum[1] += d * d;
  }
};
template <class T>
struct BatchNormStats {
  bool training;
  double epsilon;
  const T* x;
  const T* scale;
  const T* mean_in;
  const T* variance_in;
  T* batch_mean;
  T* batch_variance;
  T* saved_mean;
  T* saved_inv_std;
  double* coef;
  std::int64_t rows;
  __device__ void operator()(std::int64_t c, const double* total) const {
    double mean, variance;
    if (training) {
      const double inv_rows = rows > 0 ? 1.0 / static_cast<double>(rows) : 0.0;
      const double shifted_mean = total[0] * inv_rows;
      variance = total[1] * inv_rows - shifted_mean * shifted_mean;
      variance = variance > 0.0 ? variance : 0.0;
      mean = (rows > 0 ? static_cast<double>(load(x, c)) : 0.0) + shifted_mean;
    } else {
      mean = static_cast<double>(load(mean_in, c));
      variance = static_cast<double>(load(variance_in, c));
    }
    const double inv_std = 1.0 / sqrt(variance + epsilon);
    store(batch_mean, c, mean);
    store(saved_mean, c, mean);
    store(batch_variance, c, variance);
    store(saved_inv_std, c, inv_std);
    // The CPU kernel rounds mean and coef to T before applying them: do the same.
    coef[c] = static_cast<double>(static_cast<compute_t<T>>(static_cast<double>(load(scale, c)) * inv_std));
  }
};

template <class T>
__global__ void batch_norm_apply_kernel(const T* x, const T* mean, const double* coef, const T* offset, T* y,
                                        std::int64_t rows, std::int64_t channels) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(i, rows * channels) {
    const std::int64_t c = i % channels;
    store(y, i, (load(x, i) - load(mean, c)) * static_cast<C>(coef[c]) + load(offset, c));
  }
}

// Batch-norm gradient: per channel, sum(dy) and sum(dy * (x - mean)), then the coefficients of dx
// and the gradients of scale, offset and (inference) of the moving statistics.
template <class T>
struct GradMoments {
  const T* dy;
  const T* x;
  const T* mean;
  std::int64_t channels;
  __device__ void operator()(std::int64_t r, std::int64_t c, double* sum) const {
    const std::int64_t i = r * channels + c;
    const double g = static_cast<double>(load(dy, i));
    sum[0] += g;
    sum[1] += g * (static_cast<double>(load(x, i)) - static_cast<double>(load(mean, c)));
  }
};
template <class T>
struct BatchNormGradSums {
  bool training;
  const T* scale;
  const T* inv_std;
  const T* dbatch_mean;
  const T* dbatch_variance;
  double* coef;
  T* dscale;
  T* doffset;
  T* dmean;
  T* dvariance;
  std::int64_t rows, channels;
  __device__ void operator()(std::int64_t c, const double* total) const {
    const double sum_dy = total[0], sum_dyx = total[1];
    const double inv_rows = rows > 0 ? 1.0 / static_cast<double>(rows) : 0.0;
    const double r = static_cast<double>(load(inv_std, c));
    const double ds = r * sum_dyx;
    const double a = static_cast<double>(load(scale, c)) * r;
    const double dbm = dbatch_mean != nullptr ? static_cast<double>(load(dbatch_mean, c)) : 0.0;
    const double dbv = dbatch_variance != nullptr ? static_cast<double>(load(dbatch_variance, c)) : 0.0;
    using C = compute_t<T>;
    // Rounded to T like the CPU kernel's coefficients.
    coef[c] = static_cast<double>(static_cast<C>(a));
    if (training) {
      coef[channels + c] = static_cast<double>(static_cast<C>((-a * r * ds + 2.0 * dbv) * inv_rows));
      coef[2 * channels + c] = static_cast<double>(static_cast<C>((-a * sum_dy + dbm) * inv_rows));
      store(dmean, c, 0.0);
      store(dvariance, c, 0.0);
    } else {
      coef[channels + c] = 0.0;
      coef[2 * channels + c] = 0.0;
      store(dmean, c, -a * sum_dy + dbm);
      store(dvariance, c, -0.5 * a * r * ds + dbv);
    }
    store(dscale, c, ds);
    store(doffset, c, sum_dy);
  }
};

template <class T>
__global__ void batch_norm_grad_apply_kernel(const T* dy, const T* x, const T* mean, const double* coef, T* dx,
                                             std::int64_t rows, std::int64_t channels) {
  using C = compute_t<T>;
  TANDEM_GRID_STRIDE(i, rows * channels) {
    const std::int64_t c = i % channels;
    const C a = static_cast<C>(coef[c]), b = static_cast<C>(coef[channels + c]),
            d = static_cast<C>(coef[2 * channels + c]);
    store(dx, i, a * load(dy, i) + b * (load(x, i) - load(mean, c)) + d);
  }
}

template <class T>
__global__ void argmax_kernel(const T* x, std::int64_t* out, std::int64_t outer, std::int64_t axis,
                              std::int64_t inner) {
  TANDEM_GRID_STRIDE(i, outer * inner) {
    const std::int64_t o = i / inner, in = i % inner;
    const T* base = x + o * axis * inner + in;
    std::int64_t best = 0;
    auto best_value = load(base, 0);
    for (std::int64_t a = 1; a < axis; ++a) {
      const auto v = load(base, a * inner);
      if (v > best_value) {
        best_value = v;
        best = a;
      }
    }
    out[i] = best;
  }
}

// ---- Transformer ops: layer normalisation, masked softmax (one block per row) -------------------

// LayerNorm: two block sums over the row (mean, then the variance around it), then y.
template <class T>
__global__ void layer_norm_kernel(const T* x, const T* gamma, const T* beta, double epsilon, T* y,
                                  compute_t<T>* mean, compute_t<T>* inv_std, std::int64_t cols) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  C s = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) s += load(x, o + c);
  const C mu = block_sum(s, shared) / static_cast<C>(cols);
  s = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const C d = load(x, o + c) - mu;
    s += d * d;
  }
  const C inv = d_rsqrt(block_sum(s, shared) / static_cast<C>(cols) + static_cast<C>(epsilon));
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    inv_std[blockIdx.x] = inv;
  }
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    C v = (load(x, o + c) - mu) * inv;
    if (gamma != nullptr) v *= load(gamma, c);
    if (beta != nullptr) v += load(beta, c);
    store(y, o + c, v);
  }
}

// LayerNormGrad's dx: two block sums over the row, then dx.
template <class T>
__global__ void layer_norm_grad_kernel(const T* dy, const T* x, const compute_t<T>* mean,
                                       const compute_t<T>* inv_std, const T* gamma, T* dx, std::int64_t cols) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  const C mu = mean[blockIdx.x], inv = inv_std[blockIdx.x];
  C sum_g = 0, sum_gx = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const C g = load(dy, o + c) * (gamma != nullptr ? load(gamma, c) : C(1));
    sum_g += g;
    sum_gx += g * (load(x, o + c) - mu) * inv;
  }
  const C mean_g = block_sum(sum_g, shared) / static_cast<C>(cols);
  const C mean_gx = block_sum(sum_gx, shared) / static_cast<C>(cols);
  for (std::int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const C g = load(dy, o + c) * (gamma != nullptr ? load(gamma, c) : C(1));
    store(dx, o + c, inv * (g - mean_g - (load(x, o + c) - mu) * inv * mean_gx));
  }
}

// LayerNormGrad's column sums: dy * xhat and dy.
template <class T>
struct LayerNormParamRows {
  const T* dy;
  const T* x;
  const compute_t<T>* mean;
  const compute_t<T>* inv_std;
  std::int64_t cols;
  __device__ void operator()(std::int64_t r, std::int64_t c, double* sum) const {
    const std::int64_t i = r * cols + c;
    const compute_t<T> g = load(dy, i);
    sum[0] += static_cast<double>(g * (load(x, i) - mean[r]) * inv_std[r]);
    sum[1] += static_cast<double>(g);
  }
};
template <class T>
struct StoreColumnTotals2 {
  T* first;
  T* second;
  __device__ void operator()(std::int64_t c, const double* total) const {
    store(first, c, total[0]);
    store(second, c, total[1]);
  }
};

// Whether key c of a row attends: inside the causal prefix n, and the mask (when there is one)
// non-zero there.
template <class M>
__device__ __forceinline__ bool attends(const M* mask, std::int64_t mask_row, std::int64_t col_stride, std::int64_t c,
                                        std::int64_t n) {
  return c < n && (mask == nullptr || mask[mask_row + c * col_stride] != 0);
}

template <class T, class M>
__global__ void masked_softmax_kernel(const T* x, const M* mask, detail::MaskedSoftmaxRows a, double scale, T* y) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t row = blockIdx.x;
  const std::int64_t o = row * a.cols;
  const std::int64_t n = detail::attended_prefix(a, row);
  const std::int64_t mask_row = mask != nullptr ? detail::mask_row_offset(a, row) : 0;
  const C s = static_cast<C>(scale);
  C max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < n; c += kThreads) {
    if (attends(mask, mask_row, a.col_stride, c, n)) max = fmax(max, s * load(x, o + c));
  }
  max = block_max(max, shared);
  if (!(max > -INFINITY)) {  // nothing to attend: zeros (the whole block takes this branch)
    for (std::int64_t c = threadIdx.x; c < a.cols; c += kThreads) store(y, o + c, C(0));
    return;
  }
  C sum = 0;
  for (std::int64_t c = threadIdx.x; c < n; c += kThreads) {
    if (attends(mask, mask_row, a.col_stride, c, n)) sum += d_exp(s * load(x, o + c) - max);
  }
  sum = block_sum(sum, shared);
  for (std::int64_t c = threadIdx.x; c < a.cols; c += kThreads) {
    store(y, o + c, attends(mask, mask_row, a.col_stride, c, n) ? d_exp(s * load(x, o + c) - max) / sum : C(0));
  }
}

template <class T>
__global__ void masked_softmax_grad_kernel(const T* dy, const T* y, detail::MaskedSoftmaxRows a, double scale,
                                           T* dx) {
  using C = compute_t<T>;
  __shared__ C shared[kThreads];
  const std::int64_t row = blockIdx.x;
  const std::int64_t o = row * a.cols;
  const std::int64_t n = detail::attended_prefix(a, row);
  C dot = 0;
  for (std::int64_t c = threadIdx.x; c < n; c += kThreads) dot += load(dy, o + c) * load(y, o + c);
  dot = block_sum(dot, shared);
  const C s = static_cast<C>(scale);
  for (std::int64_t c = threadIdx.x; c < a.cols; c += kThreads) {
    store(dx, o + c, c < n ? s * load(y, o + c) * (load(dy, o + c) - dot) : C(0));
  }
}

// ---- Windows: im2col, col2im, pooling ----------------------------------------------------------

template <class T>
__global__ void im2col_kernel(WindowGeometry g, const T* x, T* col) {
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.k_h * g.k_w * g.in_c;
  TANDEM_GRID_STRIDE(i, total) {
    const std::int64_t source = im2col_source(g, i);
    col[i] = source >= 0 ? x[source] : T(0.0f);
  }
}

template <class T>
__global__ void col2im_kernel(WindowGeometry g, const T* dcol, T* dx) {
  using C = compute_t<T>;
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  TANDEM_GRID_STRIDE(i, total) {
    C sum = 0;
    for_each_col2im_source(g, i, [&](std::int64_t source) { sum += load(dcol, source); });
    store(dx, i, sum);
  }
}

template <class T>
__global__ void pool_kernel(bool average, WindowGeometry g, const T* x, T* y) {
  using C = compute_t<T>;
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.in_c;
  TANDEM_GRID_STRIDE(i, total) {
    const Pixel p = pixel_of(i, g.out_h, g.out_w, g.in_c);
    const Window win = window_at(g, p.h, p.w);
    C acc = average ? C(0) : C(-INFINITY);
    for (std::int64_t h = win.h0; h < win.h1; ++h) {
      for (std::int64_t w = win.w0; w < win.w1; ++w) {
        const C v = load(x, ((p.n * g.in_h + h) * g.in_w + w) * g.in_c + p.c);
        acc = average ? acc + v : (v > acc ? v : acc);
      }
    }
    if (average) acc = acc / static_cast<C>(win.count());
    store(y, i, acc);
  }
}

template <class T>
__global__ void pool_grad_kernel(bool average, WindowGeometry g, const T* x, const T* dy, T* dx) {
  using C = compute_t<T>;
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  TANDEM_GRID_STRIDE(i, total) {
    const Pixel p = pixel_of(i, g.in_h, g.in_w, g.in_c);
    C sum = 0;
    for_each_pool_window_of(g, i, [&](std::int64_t out, const Window& win) {
      const C grad = load(dy, out);
      if (average) {
        sum += grad / static_cast<C>(win.count());
        return;
      }
      // This window's first maximum, in the CPU kernel's scan order (rows, then columns).
      C best = C(-INFINITY);
      std::int64_t best_h = -1, best_w = -1;
      for (std::int64_t h = win.h0; h < win.h1; ++h) {
        for (std::int64_t w = win.w0; w < win.w1; ++w) {
          const C v = load(x, ((p.n * g.in_h + h) * g.in_w + w) * g.in_c + p.c);
          if (v > best) {
            best = v;
            best_h = h;
            best_w = w;
          }
        }
      }
      if (best_h == p.h && best_w == p.w) sum += grad;
    });
    store(dx, i, sum);
  }
}

// FusedConv2DMaxPool's pool: one thread per output element scans its window in the CPU kernel's
// order (rows, then columns), cells outside y skipped.
template <class T>
__global__ void max_pool_argmax_kernel(bool relu, WindowGeometry g, const T* y, T* p, std::uint8_t* argmax) {
  using C = compute_t<T>;
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.in_c;
  TANDEM_GRID_STRIDE(i, total) {
    const Pixel o = pixel_of(i, g.out_h, g.out_w, g.in_c);
    const std::int64_t top = o.h * g.stride_h - g.pad_top, left = o.w * g.stride_w - g.pad_left;
    C best = C(-INFINITY);
    int winner = kArgmaxNoWinner;
    for (std::int64_t dh = 0; dh < g.k_h; ++dh) {
      const std::int64_t h = top + dh;
      if (h < 0 || h >= g.in_h) continue;
      for (std::int64_t dw = 0; dw < g.k_w; ++dw) {
        const std::int64_t w = left + dw;
        if (w < 0 || w >= g.in_w) continue;
        const C v = load(y, ((o.n * g.in_h + h) * g.in_w + w) * g.in_c + o.c);
        if (v > best) {  // the first maximum wins; NaN never does
          best = v;
          winner = static_cast<int>(dh * g.k_w + dw);
        }
      }
    }
    // relu's derivative is 0 at a maximum <= 0: no cell takes the window's gradient.
    if (relu && !(best > C(0))) winner = kArgmaxNoWinner;
    store(p, i, best);
    argmax[i] = static_cast<std::uint8_t>(winner);
  }
}

// The argmax gradient ops' dz: one thread per element of dz (shaped like the pool's input) finds
// the one window that can cover it (windows do not overlap) and takes its dp when argmax names it.
template <class T>
__global__ void max_pool_argmax_grad_kernel(WindowGeometry g, const std::uint8_t* argmax, const T* dp, T* dz) {
  using C = compute_t<T>;
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  TANDEM_GRID_STRIDE(i, total) {
    const Pixel q = pixel_of(i, g.in_h, g.in_w, g.in_c);
    const std::int64_t top = q.h + g.pad_top, left = q.w + g.pad_left;
    const std::int64_t oh = top / g.stride_h, ow = left / g.stride_w;
    const std::int64_t dh = top - oh * g.stride_h, dw = left - ow * g.stride_w;
    C grad = 0;
    if (oh < g.out_h && ow < g.out_w && dh < g.k_h && dw < g.k_w) {
      const std::int64_t out = ((q.n * g.out_h + oh) * g.out_w + ow) * g.in_c + q.c;
      if (argmax[out] == dh * g.k_w + dw) grad = load(dp, out);
    }
    store(dz, i, grad);
  }
}

// ---- Optimizer updates ---------------------------------------------------------------------------

struct UpdateBatch {
  UpdateTensor tensors[kMaxUpdateTensors];
};
// The kernel takes the batch by value: its parameters must fit CUDA's classic 4 KiB limit.
static_assert(sizeof(UpdateBatch) + sizeof(UpdateParams) + 2 * sizeof(void*) <= 4096,
              "update_kernel's parameters exceed 4 KiB: lower kMaxUpdateTensors");

// blockIdx.y picks the tensor; x covers its elements with a grid-stride loop.
template <class T>
__global__ void update_kernel(UpdateParams by_value, const UpdateParams* in_memory, const int* fault,
                              UpdateBatch batch) {
  if (fault != nullptr && *fault != 0) return;  // the step found bad input: leave the weights as they were
  const UpdateParams& p = in_memory != nullptr ? *in_memory : by_value;
  const UpdateTensor& t = batch.tensors[blockIdx.y];
  const std::int64_t elements = t.elements;
  T* var = static_cast<T*>(t.var);
  const T* g = static_cast<const T*>(t.grad);
  T* s0 = static_cast<T*>(t.slots[0]);
  T* s1 = static_cast<T*>(t.slots[1]);
  T* s2 = static_cast<T*>(t.slots[2]);
  const detail::GradientTransform<T> gt{static_cast<T>(p.gradient_scale), static_cast<T>(p.clip_value), p.clip};
  TANDEM_GRID_STRIDE(i, elements) {
    const T gi = gt(g[i]);
    switch (p.rule) {
      case UpdateRule::kSgd: {
        const detail::SgdStep<T> s{static_cast<T>(p.rate), static_cast<T>(p.momentum), p.nesterov};
        if (s0 == nullptr) {
          detail::sgd_plain(var[i], gi, s);
        } else {
          detail::sgd_momentum(var[i], s0[i], gi, s);
        }
        break;
      }
      case UpdateRule::kRmsprop: {
        const detail::RmspropStep<T> s{static_cast<T>(p.rate), static_cast<T>(p.rho), static_cast<T>(p.momentum),
                                       static_cast<T>(p.epsilon)};
        detail::rmsprop_element(var[i], s0[i], s1 != nullptr ? s1 + i : nullptr, s2 != nullptr ? s2 + i : nullptr, gi,
                                s);
        break;
      }
      case UpdateRule::kAdam: {
        const detail::AdamStep<T> s{static_cast<T>(p.rate), static_cast<T>(p.beta_1_complement),
                                    static_cast<T>(p.beta_2_complement), static_cast<T>(p.epsilon),
                                    t.weight_decay ? static_cast<T>(p.decay) : T(0)};
        detail::adam_general(var[i], s0[i], s1[i], s2 != nullptr ? s2 + i : nullptr, gi, s);
        break;
      }
    }
  }
}

template <class T>
__global__ void squared_norm_kernel(const T* x, std::int64_t n, double* out) {
  __shared__ double shared[kThreads];
  double s = 0;
  TANDEM_GRID_STRIDE(i, n) {
    const double v = static_cast<double>(load(x, i));
    s += v * v;
  }
  s = block_sum(s, shared);
  if (threadIdx.x == 0) atomicAdd(out, s);  // order varies: clipping needs no bitwise repeatability
}

template <class T>
__global__ void check_finite_kernel(const T* x, std::int64_t n, int* flag) {
  TANDEM_GRID_STRIDE(i, n) {
    const auto v = load(x, i);
    if (!isfinite(static_cast<double>(v))) *flag = 1;
  }
}

}  // namespace

void binary(BinaryOp op, ElementType type, const BroadcastArgs& args, const void* a, const void* b, void* out,
            cudaStream_t stream) {
  if (args.elements == 0) return;
  with_any_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (op == BinaryOp::kEqual) {
      binary_kernel<T, std::uint8_t><<<blocks_for(args.elements), kThreads, 0, stream>>>(
          op, args, static_cast<const T*>(a), static_cast<const T*>(b), static_cast<std::uint8_t*>(out));
    } else {
      binary_kernel<T, T><<<blocks_for(args.elements), kThreads, 0, stream>>>(
          op, args, static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out));
    }
  });
}

void broadcast(ElementType type, const BroadcastArgs& args, const void* x, double scale, void* out,
               cudaStream_t stream) {
  if (args.elements == 0) return;
  with_any_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    broadcast_kernel<T><<<blocks_for(args.elements), kThreads, 0, stream>>>(args, static_cast<const T*>(x), scale,
                                                                            static_cast<T*>(out));
  });
}

void unary(UnaryOp op, ElementType type, const void* x, void* y, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  with_numeric_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unary_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(op, static_cast<const T*>(x), static_cast<T*>(y), n);
  });
}

void activation_grad(Activation activation, ElementType type, const void* dy, const void* y, void* dx, std::int64_t n,
                     cudaStream_t stream) {
  if (n == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    activation_grad_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(activation, static_cast<const T*>(dy),
                                                                      static_cast<const T*>(y), static_cast<T*>(dx), n);
  });
}

void add_n(ElementType type, const void* const* inputs, int count, bool accumulate, void* out, std::int64_t n,
           cudaStream_t stream) {
  if (n == 0) return;
  with_numeric_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    AddNInputs<T> in{};
    for (int k = 0; k < count; ++k) in.p[k] = static_cast<const T*>(inputs[k]);
    add_n_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(in, count, accumulate, static_cast<T*>(out), n);
  });
}

void cast(ElementType from, ElementType to, const void* x, void* y, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  with_any_type(from, [&](auto* from_tag) {
    using From = std::remove_pointer_t<decltype(from_tag)>;
    with_any_type(to, [&](auto* to_tag) {
      using To = std::remove_pointer_t<decltype(to_tag)>;
      cast_kernel<From, To>
          <<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const From*>(x), static_cast<To*>(y), n);
    });
  });
}

void fill(ElementType type, double value, void* y, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  with_any_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fill_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(value, static_cast<T*>(y), n);
  });
}

void bias_activation(Activation activation, ElementType type, const void* x, const void* bias, void* pre, void* y,
                     std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_activation_kernel<T><<<blocks_for(rows * cols), kThreads, 0, stream>>>(
        activation, static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(pre), static_cast<T*>(y),
        rows, cols);
  });
}

void bias_activation_grad(Activation activation, ElementType type, const void* dy, const void* y, void* dz, void* db,
                          std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  if (cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    column_sums<1>(
        BiasGradRows<T>{activation, static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dz), cols},
        StoreColumnTotal<T>{static_cast<T*>(db)}, rows, cols, stream);
  });
}

void reduce(ReduceKind kind, ElementType type, const ReduceArgs& args, const void* x, void* out, cudaStream_t stream) {
  if (args.out_elements == 0) return;
  with_numeric_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    reduce_kernel<T><<<blocks_for(args.out_elements), kThreads, 0, stream>>>(kind, args, static_cast<const T*>(x),
                                                                             static_cast<T*>(out));
  });
}

void max_grad(ElementType type, const ReduceArgs& args, const void* dy, const void* x, const void* y, void* dx,
              cudaStream_t stream) {
  if (args.out_elements == 0) return;
  with_numeric_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    max_grad_kernel<T><<<blocks_for(args.out_elements), kThreads, 0, stream>>>(
        args, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(y), static_cast<T*>(dx));
  });
}

void softmax(bool log, ElementType type, const void* x, void* y, std::int64_t rows, std::int64_t cols,
             cudaStream_t stream) {
  if (rows * cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_kernel<T>
        <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(log, static_cast<const T*>(x), static_cast<T*>(y), cols);
  });
}

void softmax_grad(bool log, ElementType type, const void* dy, const void* y, void* dx, std::int64_t rows,
                  std::int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_grad_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        log, static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), cols);
  });
}

void sparse_softmax_cross_entropy(ElementType type, ElementType label_type, const void* x, const void* labels,
                                  void* loss, void* backprop, std::int64_t rows, std::int64_t classes,
                                  unsigned long long* bad_row, int* fault, cudaStream_t stream) {
  if (rows == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto launch = [&](auto* label_tag) {
      using L = std::remove_pointer_t<decltype(label_tag)>;
      sparse_xent_kernel<T, L><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const L*>(labels), static_cast<T*>(loss), static_cast<T*>(backprop),
          classes, bad_row, fault);
    };
    if (label_type == ElementType::kI32) {
      launch(static_cast<std::int32_t*>(nullptr));
    } else {
      launch(static_cast<std::int64_t*>(nullptr));
    }
  });
}

void softmax_cross_entropy(ElementType type, const void* x, const void* z, void* loss, void* backprop,
                           std::int64_t rows, std::int64_t classes, cudaStream_t stream) {
  if (rows == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    xent_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(z), static_cast<T*>(loss), static_cast<T*>(backprop), classes);
  });
}

void sigmoid_cross_entropy(ElementType type, const void* x, const void* z, void* loss, std::int64_t n,
                           cudaStream_t stream) {
  if (n == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    sigmoid_xent_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(z),
                                                                   static_cast<T*>(loss), n);
  });
}

void sigmoid_cross_entropy_grad(ElementType type, const void* dy, const void* x, const void* z, void* dx, void* dz,
                                std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    sigmoid_xent_grad_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(x),
                                                 static_cast<const T*>(z), static_cast<T*>(dx), static_cast<T*>(dz), n);
  });
}

void dropout(ElementType type, const void* x, void* y, void* mask, std::int64_t n, std::uint64_t key,
             std::uint64_t threshold, double scale, cudaStream_t stream) {
  if (n == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dropout_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                              static_cast<T*>(mask), n, key, threshold,
                                                              static_cast<compute_t<T>>(scale));
  });
}

void one_hot(ElementType index_type, const void* indices, float* out, std::int64_t rows, std::int64_t depth, float on,
             float off, cudaStream_t stream) {
  if (rows * depth == 0) return;
  const auto launch = [&](auto* tag) {
    using I = std::remove_pointer_t<decltype(tag)>;
    one_hot_kernel<I>
        <<<blocks_for(rows * depth), kThreads, 0, stream>>>(static_cast<const I*>(indices), out, rows, depth, on, off);
  };
  switch (index_type) {
    case ElementType::kI32: launch(static_cast<std::int32_t*>(nullptr)); break;
    case ElementType::kU8: launch(static_cast<std::uint8_t*>(nullptr)); break;
    default: launch(static_cast<std::int64_t*>(nullptr)); break;
  }
}

void batch_norm(ElementType type, bool training, double epsilon, const void* x, const void* scale, const void* offset,
                const void* mean_in, const void* variance_in, void* y, void* batch_mean, void* batch_variance,
                void* saved_mean, void* saved_inv_std, std::int64_t rows, std::int64_t channels, cudaStream_t stream) {
  if (channels == 0) return;
  double* coef = nullptr;
  if (cudaMallocAsync(reinterpret_cast<void**>(&coef), static_cast<std::size_t>(channels) * sizeof(double), stream) !=
      cudaSuccess) {
    return;  // the error stays set: the caller's launch check reports it
  }
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // Inference reads the moving statistics: no sums (rows 0 makes pass 1 read nothing).
    column_sums<2>(ShiftedMoments<T>{static_cast<const T*>(x), channels},
                   BatchNormStats<T>{training, epsilon, static_cast<const T*>(x), static_cast<const T*>(scale),
                                     static_cast<const T*>(mean_in), static_cast<const T*>(variance_in),
                                     static_cast<T*>(batch_mean), static_cast<T*>(batch_variance),
                                     static_cast<T*>(saved_mean), static_cast<T*>(saved_inv_std), coef, rows},
                   training ? rows : 0, channels, stream);
    if (rows > 0) {
      batch_norm_apply_kernel<T><<<blocks_for(rows * channels), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(saved_mean), coef, static_cast<const T*>(offset),
          static_cast<T*>(y), rows, channels);
    }
  });
  cudaFreeAsync(coef, stream);
}

void batch_norm_grad(ElementType type, bool training, const void* dy, const void* x, const void* scale,
                     const void* mean, const void* inv_std, const void* dbatch_mean, const void* dbatch_variance,
                     void* dx, void* dscale, void* doffset, void* dmean, void* dvariance, std::int64_t rows,
                     std::int64_t channels, cudaStream_t stream) {
  if (channels == 0) return;
  double* coef = nullptr;
  if (cudaMallocAsync(reinterpret_cast<void**>(&coef), static_cast<std::size_t>(3 * channels) * sizeof(double),
                      stream) != cudaSuccess) {
    return;
  }
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    column_sums<2>(
        GradMoments<T>{static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(mean), channels},
        BatchNormGradSums<T>{training, static_cast<const T*>(scale), static_cast<const T*>(inv_std),
                             static_cast<const T*>(dbatch_mean), static_cast<const T*>(dbatch_variance), coef,
                             static_cast<T*>(dscale), static_cast<T*>(doffset), static_cast<T*>(dmean),
                             static_cast<T*>(dvariance), rows, channels},
        rows, channels, stream);
    if (rows > 0) {
      batch_norm_grad_apply_kernel<T><<<blocks_for(rows * channels), kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(mean), coef, static_cast<T*>(dx),
          rows, channels);
    }
  });
  cudaFreeAsync(coef, stream);
}

void argmax(ElementType type, const void* x, std::int64_t* out, std::int64_t outer, std::int64_t axis,
            std::int64_t inner, cudaStream_t stream) {
  if (outer * inner == 0 || axis == 0) return;
  with_numeric_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    argmax_kernel<T>
        <<<blocks_for(outer * inner), kThreads, 0, stream>>>(static_cast<const T*>(x), out, outer, axis, inner);
  });
}

void layer_norm(ElementType type, const void* x, const void* gamma, const void* beta, double epsilon, void* y,
                void* mean, void* inv_std, std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using C = compute_t<T>;
    layer_norm_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta), epsilon,
        static_cast<T*>(y), static_cast<C*>(mean), static_cast<C*>(inv_std), cols);
  });
}

void layer_norm_grad(ElementType type, const void* dy, const void* x, const void* mean, const void* inv_std,
                     const void* gamma, void* dx, void* dgamma, void* dbeta, std::int64_t rows, std::int64_t cols,
                     cudaStream_t stream) {
  if (cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using C = compute_t<T>;
    const auto* dy_t = static_cast<const T*>(dy);
    const auto* x_t = static_cast<const T*>(x);
    const auto* mean_c = static_cast<const C*>(mean);
    const auto* inv_std_c = static_cast<const C*>(inv_std);
    if (rows > 0) {
      layer_norm_grad_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          dy_t, x_t, mean_c, inv_std_c, static_cast<const T*>(gamma), static_cast<T*>(dx), cols);
    }
    column_sums<2>(LayerNormParamRows<T>{dy_t, x_t, mean_c, inv_std_c, cols},
                   StoreColumnTotals2<T>{static_cast<T*>(dgamma), static_cast<T*>(dbeta)}, rows, cols, stream);
  });
}

void masked_softmax(ElementType type, ElementType mask_type, const void* x, const void* mask,
                    const detail::MaskedSoftmaxRows& rows, double scale, void* y, cudaStream_t stream) {
  if (rows.rows * rows.cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto launch = [&](auto* mask_tag) {
      using M = std::remove_pointer_t<decltype(mask_tag)>;
      masked_softmax_kernel<T, M><<<static_cast<unsigned>(rows.rows), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const M*>(mask), rows, scale, static_cast<T*>(y));
    };
    if (mask == nullptr || mask_type == ElementType::kU8) {
      launch(static_cast<std::uint8_t*>(nullptr));
    } else if (mask_type == ElementType::kI32) {
      launch(static_cast<std::int32_t*>(nullptr));
    } else {
      launch(static_cast<std::int64_t*>(nullptr));
    }
  });
}

void masked_softmax_grad(ElementType type, const void* dy, const void* y, const detail::MaskedSoftmaxRows& rows,
                         double scale, void* dx, cudaStream_t stream) {
  if (rows.rows * rows.cols == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    masked_softmax_grad_kernel<T><<<static_cast<unsigned>(rows.rows), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y), rows, scale, static_cast<T*>(dx));
  });
}

void im2col(ElementType type, const WindowGeometry& g, const void* x, void* col, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.k_h * g.k_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    im2col_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(g, static_cast<const T*>(x), static_cast<T*>(col));
  });
}

void col2im(ElementType type, const WindowGeometry& g, const void* dcol, void* dx, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    col2im_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(g, static_cast<const T*>(dcol), static_cast<T*>(dx));
  });
}

void pool(bool average, ElementType type, const WindowGeometry& g, const void* x, void* y, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pool_kernel<T>
        <<<blocks_for(total), kThreads, 0, stream>>>(average, g, static_cast<const T*>(x), static_cast<T*>(y));
  });
}

void max_pool_grad(ElementType type, const WindowGeometry& g, const void* x, const void* dy, void* dx,
                   cudaStream_t stream) {
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pool_grad_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(false, g, static_cast<const T*>(x),
                                                                    static_cast<const T*>(dy), static_cast<T*>(dx));
  });
}

void avg_pool_grad(ElementType type, const WindowGeometry& g, const void* dy, void* dx, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pool_grad_kernel<T>
        <<<blocks_for(total), kThreads, 0, stream>>>(true, g, nullptr, static_cast<const T*>(dy), static_cast<T*>(dx));
  });
}

void max_pool_argmax(bool relu, ElementType type, const WindowGeometry& g, const void* y, void* p, std::uint8_t* argmax,
                     cudaStream_t stream) {
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    max_pool_argmax_kernel<T>
        <<<blocks_for(total), kThreads, 0, stream>>>(relu, g, static_cast<const T*>(y), static_cast<T*>(p), argmax);
  });
}

void max_pool_argmax_grad(ElementType type, const WindowGeometry& g, const std::uint8_t* argmax, const void* dp,
                          void* dz, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.in_h * g.in_w * g.in_c;
  if (total == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    max_pool_argmax_grad_kernel<T>
        <<<blocks_for(total), kThreads, 0, stream>>>(g, argmax, static_cast<const T*>(dp), static_cast<T*>(dz));
  });
}

void apply_update(ElementType type, const UpdateParams& params, const UpdateParams* params_in_memory, const int* fault,
                  const UpdateTensor* tensors, int count, cudaStream_t stream) {
  if (count == 0) return;
  UpdateBatch batch{};
  std::int64_t largest = 0;
  for (int k = 0; k < count; ++k) {
    batch.tensors[k] = tensors[k];
    largest = tensors[k].elements > largest ? tensors[k].elements : largest;
  }
  if (largest == 0) return;
  const dim3 grid(static_cast<unsigned>(blocks_for(largest)), static_cast<unsigned>(count));
  if (type == ElementType::kF64) {
    update_kernel<double><<<grid, kThreads, 0, stream>>>(params, params_in_memory, fault, batch);
  } else {
    update_kernel<float><<<grid, kThreads, 0, stream>>>(params, params_in_memory, fault, batch);
  }
}

void squared_norm(ElementType type, const void* x, std::int64_t n, double* out, cudaStream_t stream) {
  if (n == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    squared_norm_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), n, out);
  });
}

void check_finite(ElementType type, const void* x, std::int64_t n, int* flag, cudaStream_t stream) {
  if (n == 0) return;
  with_float_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    check_finite_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), n, flag);
  });
}

cudaError_t last_launch_error() { return cudaGetLastError(); }

}  // namespace tandem::ops::cuda
