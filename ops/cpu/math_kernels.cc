// CPU kernels of the math family: element-wise arithmetic with broadcasting, reductions, MatMul,
// BatchMatMul.
#include <algorithm>
#include <cmath>
#include <limits>

#include "tandem/ops/cpu/broadcast.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/detail/batch_matmul_args.h"
#include "tandem/ops/detail/kernel_args.h"
#include "tandem/ops/cpu/isa.h"

namespace tandem::ops::cpu {
namespace {

using graph::FloatTypes;
using graph::NumericTypes;
using graph::Shape;

// ----- binary element-wise ops with broadcasting -----

struct AddOp {
  template <class T>
  T operator()(T a, T b) const {
    return a + b;
  }
};
struct SubOp {
  template <class T>
  T operator()(T a, T b) const {
    return a - b;
  }
};
struct MulOp {
  template <class T>
  T operator()(T a, T b) const {
    return a * b;
  }
};
struct DivOp {
  template <class T>
  T operator()(T a, T b) const {
    return a / b;
  }
};

// The four unit/zero stride combinations get their own loops so the compiler vectorises them.
template <class T, class Op>
void binary_run(const T* a, std::int64_t sa, const T* b, std::int64_t sb, T* out, std::int64_t n, Op op) {
  if (sa == 1 && sb == 1) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
  } else if (sa == 1 && sb == 0) {
    const T bv = b[0];
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(a[i], bv);
  } else if (sa == 0 && sb == 1) {
    const T av = a[0];
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(av, b[i]);
  } else {
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(a[i * sa], b[i * sb]);
  }
}

template <class T, class Op>
void binary_kernel(KernelContext& ctx, Op op) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& out = ctx.output(0);
  const auto layout = make_broadcast_layout(out.shape(), {&a.shape(), &b.shape()});
  const T* pa = static_cast<const T*>(a.raw_data());
  const T* pb = static_cast<const T*>(b.raw_data());
  T* po = static_cast<T*>(out.raw_data());
  if constexpr (std::is_integral_v<T> && std::is_same_v<Op, DivOp>) {
    for (std::int64_t i = 0; i < b.num_elements(); ++i) {
      TANDEM_REQUIRE(pb[i] != 0, InvalidArgument, "{}: integer division by zero (divisor element {})", ctx.label(), i);
    }
  }
  parallel_elements(ctx, layout.num_elements(), [&](std::int64_t begin, std::int64_t end) {
    for_each_run(layout, begin, end, [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
      binary_run(pa + off[0], inner[0], pb + off[1], inner[1], po + o, n, op);
    });
  });
}

template <class Op>
void binary(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() { binary_kernel<T>(ctx, Op{}); });
}

// ----- unary element-wise ops -----

template <class List, class F>
void unary(KernelContext& ctx, F&& f) {
  graph::dispatch<List>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& x = ctx.input(0);
    Tensor& y = ctx.output(0);
    parallel_elements(ctx, x.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      array_slice<T>(y, begin, end) = f(const_array_slice<T>(x, begin, end));
    });
  });
}

void neg_kernel(KernelContext& ctx) {
  unary<NumericTypes>(ctx, [](const auto& x) { return -x; });
}
void square_kernel(KernelContext& ctx) {
  unary<NumericTypes>(ctx, [](const auto& x) { return x.square(); });
}
void abs_kernel(KernelContext& ctx) {
  unary<NumericTypes>(ctx, [](const auto& x) { return x.abs(); });
}
void sqrt_kernel(KernelContext& ctx) {
  unary<FloatTypes>(ctx, [](const auto& x) { return x.sqrt(); });
}
void exp_kernel(KernelContext& ctx) {
  unary<FloatTypes>(ctx, [](const auto& x) { return x.exp(); });
}
void log_kernel(KernelContext& ctx) {
  unary<FloatTypes>(ctx, [](const auto& x) { return x.log(); });
}
void sign_kernel(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const T* x = in_ptr<T>(ctx, 0);
    T* y = out_ptr<T>(ctx, 0);
    parallel_elements(ctx, ctx.input(0).num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) y[i] = static_cast<T>((x[i] > T(0)) - (x[i] < T(0)));
    });
  });
}

void add_n_kernel(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    Tensor& y = ctx.output(0);
    parallel_elements(ctx, y.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      auto out = array_slice<T>(y, begin, end);
      out = const_array_slice<T>(ctx.input(0), begin, end);
      for (int k = 1; k < ctx.num_inputs(); ++k) out += const_array_slice<T>(ctx.input(k), begin, end);
    });
  });
}

// ----- reductions -----

enum class Reduce { kSum, kMean, kMax };

template <class T>
void reduce_into(KernelContext& ctx, const Tensor& x, const std::vector<int>& axes, Reduce kind, T* out) {
  const auto layout = make_reduction_layout(x.shape(), axes);
  const T* in = static_cast<const T*>(x.raw_data());
  const T init = kind == Reduce::kMax ? std::numeric_limits<T>::lowest() : T(0);
  if (layout.contiguous) {
    const std::int64_t outer = layout.outer, reduce = layout.reduce, inner = layout.inner;
    const T scale = kind == Reduce::kMean && reduce > 0 ? T(1) / static_cast<T>(reduce) : T(1);
    if (inner == 1) {
      // Each output is the reduction of one contiguous row.
      ctx.device().parallel_for(outer, row_grain(reduce), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t o = begin; o < end; ++o) {
          ConstArrayMap<T> row(in + o * reduce, reduce);
          out[o] = reduce == 0 ? init : kind == Reduce::kMax ? row.maxCoeff() : row.sum() * scale;
        }
      });
    } else {
      // Accumulate rows of length `inner`, vectorised across them.
      ctx.device().parallel_for(outer * inner, kElementwiseGrain, [&](std::int64_t begin, std::int64_t end) {
        // Work in whole (outer, inner-range) slabs.
        std::int64_t position = begin;
        while (position < end) {
          const std::int64_t o = position / inner;
          const std::int64_t i0 = position % inner;
          const std::int64_t count = std::min(inner - i0, end - position);
          ArrayMap<T> acc(out + o * inner + i0, count);
          acc.setConstant(init);
          for (std::int64_t r = 0; r < reduce; ++r) {
            ConstArrayMap<T> row(in + (o * reduce + r) * inner + i0, count);
            if (kind == Reduce::kMax) {
              acc = acc.max(row);
            } else {
              acc += row;
            }
          }
          if (kind == Reduce::kMean) acc *= scale;
          position += count;
        }
      });
    }
    return;
  }
  // General (non-adjacent axes): one serial pass over the input.
  const std::int64_t n_out = layout.out_elements;
  std::fill(out, out + n_out, init);
  const Shape& shape = layout.in_shape;
  std::array<std::int64_t, Shape::kMaxRank> index{};
  const std::int64_t n = x.num_elements();
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t o = 0;
    for (int d = 0; d < shape.rank(); ++d)
      o += index[static_cast<std::size_t>(d)] * layout.out_strides[static_cast<std::size_t>(d)];
    out[o] = kind == Reduce::kMax ? std::max(out[o], in[i]) : out[o] + in[i];
    for (int d = shape.rank() - 1; d >= 0; --d) {
      if (++index[static_cast<std::size_t>(d)] < shape[d]) break;
      index[static_cast<std::size_t>(d)] = 0;
    }
  }
  if (kind == Reduce::kMean) {
    const T scale = static_cast<T>(n_out) / static_cast<T>(std::max<std::int64_t>(1, n));
    for (std::int64_t o = 0; o < n_out; ++o) out[o] *= scale;
  }
}

template <Reduce kind>
void reduce_kernel(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& x = ctx.input(0);
    reduce_into<T>(ctx, x, detail::reduction_axes(ctx.attrs(), x.shape().rank()), kind, out_ptr<T>(ctx, 0));
  });
}

// SumGrad / MeanGrad (dy, x): dy stretched back over the reduced axes.
template <Reduce kind>
void reduce_grad_kernel(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& dy = ctx.input(0);
    const Tensor& x = ctx.input(1);
    Tensor& dx = ctx.output(0);
    const auto axes = detail::reduction_axes(ctx.attrs(), x.shape().rank());
    const Shape kept = keep_dims_shape(x.shape(), axes);
    std::int64_t count = 1;
    for (int a : axes) count *= x.shape()[a];
    const T scale = kind == Reduce::kMean ? T(1) / static_cast<T>(std::max<std::int64_t>(1, count)) : T(1);
    const auto layout = make_broadcast_layout(dx.shape(), {&kept});
    const T* pdy = static_cast<const T*>(dy.raw_data());
    T* pdx = static_cast<T*>(dx.raw_data());
    parallel_elements(ctx, dx.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
        const T* src = pdy + off[0];
        if (inner[0] == 0) {
          std::fill(pdx + o, pdx + o + n, src[0] * scale);
        } else {
          for (std::int64_t i = 0; i < n; ++i) pdx[o + i] = src[i] * scale;
        }
      });
    });
  });
}

// MaxGrad (dy, x, y): the gradient goes to the maxima, split equally between ties (TF).
void max_grad_kernel(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& dy = ctx.input(0);
    const Tensor& x = ctx.input(1);
    const Tensor& y = ctx.input(2);
    Tensor& dx = ctx.output(0);
    const auto axes = detail::reduction_axes(ctx.attrs(), x.shape().rank());
    const Shape kept = keep_dims_shape(x.shape(), axes);
    const auto layout = make_broadcast_layout(x.shape(), {&kept});
    const T* px = static_cast<const T*>(x.raw_data());
    const T* py = static_cast<const T*>(y.raw_data());
    const T* pdy = static_cast<const T*>(dy.raw_data());
    T* pdx = static_cast<T*>(dx.raw_data());
    // Pass 1: ties per output position (serial: this op is rare and small).
    std::vector<std::int64_t> ties(static_cast<std::size_t>(y.num_elements()), 0);
    for_each_run(layout, 0, x.num_elements(), [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t r = off[0] + i * inner[0];
        if (px[o + i] == py[r]) ++ties[static_cast<std::size_t>(r)];
      }
    });
    for_each_run(layout, 0, x.num_elements(), [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t r = off[0] + i * inner[0];
        pdx[o + i] = px[o + i] == py[r] ? pdy[r] / static_cast<T>(ties[static_cast<std::size_t>(r)]) : T(0);
      }
    });
  });
}

// SumToShape (x, like): sums x over the axes broadcasting added or stretched.
void sum_to_shape_kernel(KernelContext& ctx) {
  graph::dispatch<NumericTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& x = ctx.input(0);
    const Shape& like = ctx.input(1).shape();
    const std::vector<int> axes = detail::sum_to_shape_axes(x.shape(), like);
    T* out = out_ptr<T>(ctx, 0);
    if (axes.empty()) {  // plans make this case a view (forwards_input_of_same_shape)
      std::copy_n(static_cast<const T*>(x.raw_data()), x.num_elements(), out);
      return;
    }
    reduce_into<T>(ctx, x, axes, Reduce::kSum, out);
  });
}

// ----- MatMul -----

void matmul_kernel(KernelContext& ctx) {
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const Tensor& a = ctx.input(0);
    const Tensor& b = ctx.input(1);
    const bool ta = ctx.attrs().get_bool_or("transpose_a", false);
    const bool tb = ctx.attrs().get_bool_or("transpose_b", false);
    GemmShape s;
    s.transpose_a = ta;
    s.transpose_b = tb;
    s.m = ta ? a.shape()[1] : a.shape()[0];
    s.k = ta ? a.shape()[0] : a.shape()[1];
    s.n = tb ? b.shape()[0] : b.shape()[1];
    s.lda = a.shape()[1];
    s.ldb = b.shape()[1];
    s.ldc = s.n;
    if (s.k == 0) {
      std::fill_n(out_ptr<T>(ctx, 0), s.m * s.n, T(0));
      return;
    }
    gemm<T>(ctx.device(), s, T(1), in_ptr<T>(ctx, 0), in_ptr<T>(ctx, 1), T(0), out_ptr<T>(ctx, 0));
  });
}

// ----- BatchMatMul -----
//
// Each product goes to gemm_serial on one thread, and the batch is split over the device's threads
// (the attention products of a transformer: hundreds of small matrices, each too small to split
// well). A batch too small to share out evenly runs its products one after another, each split
// over the threads by gemm(); so does B shared by every product (one product of the folded batch).

// True when splitting the batch over `threads` keeps them about equally busy.
bool split_batch_over_threads(std::int64_t batch, int threads, std::int64_t macs_per_product) {
  if (threads <= 1 || batch < threads || batch * macs_per_product < kParallelGemmMinMacs) return false;
  return batch % threads == 0 || batch >= 4 * static_cast<std::int64_t>(threads);
}

// BatchMatMulOptions' triangles in each product's terms: a lower-triangular a is an upper-
// triangular op(a) when adjoint.
GemmTriangle gemm_triangle(const detail::BatchMatMulArgs& args) {
  if (args.triangles.output_lower) return GemmTriangle::kLowerC;
  if (args.triangles.a_lower) return args.adj_x ? GemmTriangle::kUpperA : GemmTriangle::kLowerA;
  return GemmTriangle::kNone;
}

void batch_matmul_kernel(KernelContext& ctx) {
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const auto args = detail::batch_matmul_args(ctx.input(0).shape(), ctx.input(1).shape(), ctx.attrs());
    const T* a = in_ptr<T>(ctx, 0);
    const T* b = in_ptr<T>(ctx, 1);
    T* c = out_ptr<T>(ctx, 0);
    if (args.batch * args.c_matrix == 0) return;
    if (args.k == 0) {
      std::fill_n(c, args.batch * args.c_matrix, T(0));
      return;
    }
    GemmShape s{.transpose_a = args.adj_x,
                .transpose_b = args.adj_y,
                .m = args.m,
                .n = args.n,
                .k = args.k,
                .lda = args.lda,
                .ldb = args.ldb,
                .ldc = args.n,
                .triangle = gemm_triangle(args)};
    if (args.fold_batch_into_m) {
      s.m *= args.batch;
      gemm<T>(ctx.device(), s, T(1), a, b, T(0), c);
      return;
    }
    const bool split = split_batch_over_threads(args.batch, ctx.device().intra_op_threads(), args.m * args.n * args.k);
    // Output matrices [ci, ci + count): A and B advance by a_step and b_step matrices.
    const auto run = [&](std::int64_t ci, std::int64_t count, std::int64_t ai, std::int64_t a_step, std::int64_t bi,
                         std::int64_t b_step) {
      for (std::int64_t j = 0; j < count; ++j) {
        const T* pa = a + (ai + j * a_step) * args.a_matrix;
        const T* pb = b + (bi + j * b_step) * args.b_matrix;
        T* pc = c + (ci + j) * args.c_matrix;
        if (split) {
          gemm_serial<T>(s, T(1), pa, pb, T(0), pc);
        } else {
          gemm<T>(ctx.device(), s, T(1), pa, pb, T(0), pc);
        }
      }
    };
    const auto products = [&](std::int64_t begin, std::int64_t end) {
      detail::for_each_strided_run(args, begin, end, run);
    };
    if (split) {
      ctx.device().parallel_for(args.batch, 1, products);
    } else {
      products(0, args.batch);
    }
  });
}

}  // namespace
}  // namespace tandem::ops::cpu

namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS {
void register_math_kernels() {
  using namespace tandem::ops::cpu;
  using devices::DeviceType;
  auto& r = graph::OpRegistry::global();
  init_gemm();
  r.add_kernel("Add", DeviceType::kCPU, binary<AddOp>);
  r.add_kernel("Sub", DeviceType::kCPU, binary<SubOp>);
  r.add_kernel("Mul", DeviceType::kCPU, binary<MulOp>);
  r.add_kernel("Div", DeviceType::kCPU, binary<DivOp>);
  r.add_kernel("Neg", DeviceType::kCPU, neg_kernel);
  r.add_kernel("AddN", DeviceType::kCPU, add_n_kernel);
  r.add_kernel("Square", DeviceType::kCPU, square_kernel);
  r.add_kernel("Abs", DeviceType::kCPU, abs_kernel);
  r.add_kernel("Sqrt", DeviceType::kCPU, sqrt_kernel);
  r.add_kernel("Exp", DeviceType::kCPU, exp_kernel);
  r.add_kernel("Log", DeviceType::kCPU, log_kernel);
  r.add_kernel("Sign", DeviceType::kCPU, sign_kernel);
  r.add_kernel("Sum", DeviceType::kCPU, reduce_kernel<Reduce::kSum>);
  r.add_kernel("Mean", DeviceType::kCPU, reduce_kernel<Reduce::kMean>);
  r.add_kernel("Max", DeviceType::kCPU, reduce_kernel<Reduce::kMax>);
  r.add_kernel("SumGrad", DeviceType::kCPU, reduce_grad_kernel<Reduce::kSum>);
  r.add_kernel("MeanGrad", DeviceType::kCPU, reduce_grad_kernel<Reduce::kMean>);
  r.add_kernel("MaxGrad", DeviceType::kCPU, max_grad_kernel);
  r.add_kernel("SumToShape", DeviceType::kCPU, sum_to_shape_kernel);
  r.add_kernel("MatMul", DeviceType::kCPU, matmul_kernel);
  r.add_kernel("BatchMatMul", DeviceType::kCPU, batch_matmul_kernel);
}
}  // namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS
