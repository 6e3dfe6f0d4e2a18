// GPU kernels of BatchMatMul (cuBLAS strided-batched products), Gather, UnsortedSegmentSum,
// Slice, SliceGrad and Concat: each reads its KernelContext and queues cuBLAS or the launchers of
// array_kernels.cu on the device's compute stream. Nothing here synchronises: a bad id is found on
// the device and reported by a deferred check (kernel_util.h), so every kernel can be recorded in
// a CUDA graph.
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/graph/op_registry.h"
#include "tandem/ops/cuda/array_launchers.h"
#include "tandem/ops/cuda/cublas.h"
#include "tandem/ops/cuda/kernel_util.h"
#include "tandem/ops/detail/gather_args.h"
#include "tandem/ops/detail/batch_matmul_args.h"
#include "tandem/ops/detail/slice_args.h"
#include "tandem/ops/detail/registration.h"

namespace tandem::ops::cuda {
namespace {

using graph::DType;
using graph::KernelContext;
using graph::Shape;
using graph::Tensor;

constexpr std::initializer_list<DType> kIndex = {DType::kI32, DType::kI64};

int element_bytes(const Tensor& t) { return static_cast<int>(graph::dtype_size(t.dtype())); }

// BatchMatMul: one cuBLAS call per strided run of the batch (one call when the batch axes are
// equal or one operand is shared by all), a broadcast operand read in place through a stride of 0.
// The triangles (BatchMatMulOptions) cost a pass here instead of saving half the product: a
// lower-triangular a is copied with its upper triangle zeroed into this node's scratch, and a
// lower-triangular output is cleared above the diagonal after the product.
void batch_matmul_kernel(KernelContext& ctx) {
  const Tensor& a_input = ctx.input(0);
  const Tensor& b = ctx.input(1);
  require_types(ctx, a_input, kFloat);
  const auto args = detail::batch_matmul_args(a_input.shape(), b.shape(), ctx.attrs());
  Tensor& c = ctx.output(0);
  if (c.num_elements() == 0) return;
  if (args.k == 0) {
    fill(type_of(c), 0.0, c.raw_data(), c.num_elements(), stream_of(ctx));
    check_launch(ctx);
    return;
  }
  const int element_bytes = static_cast<int>(graph::dtype_size(a_input.dtype()));
  const Shape& as = a_input.shape();
  const std::int64_t a_rows = as.dim(-2), a_cols = as.dim(-1);
  const Tensor* a_ptr = &a_input;
  if (args.triangles.a_lower) {
    Tensor& lower = ctx.scratch(0, as, a_input.dtype());
    lower_triangle(element_bytes, a_input.raw_data(), lower.raw_data(), a_input.num_elements() / (a_rows * a_cols),
                   a_rows, a_cols, stream_of(ctx));
    check_launch(ctx);
    a_ptr = &lower;
  }
  const Tensor& a = *a_ptr;
  const auto bytes = static_cast<std::int64_t>(element_bytes);
  GemmCall call;
  call.dtype = a.dtype();
  call.transpose_a = args.adj_x;
  call.transpose_b = args.adj_y;
  call.m = args.m;
  call.n = args.n;
  call.k = args.k;
  call.lda = args.lda;
  call.ldb = args.ldb;
  if (args.fold_batch_into_m) {
    call.m *= args.batch;
    call.a = a.raw_data();
    call.b = b.raw_data();
    call.c = c.raw_data();
    gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
    return;
  }
  detail::for_each_strided_run(args, 0, args.batch,
                               [&](std::int64_t ci, std::int64_t count, std::int64_t ai, std::int64_t a_step,
                                   std::int64_t bi, std::int64_t b_step) {
                                 call.a = static_cast<const char*>(a.raw_data()) + ai * args.a_matrix * bytes;
                                 call.b = static_cast<const char*>(b.raw_data()) + bi * args.b_matrix * bytes;
                                 call.c = static_cast<char*>(c.raw_data()) + ci * args.c_matrix * bytes;
                                 call.batch = count;
                                 call.stride_a = a_step * args.a_matrix;
                                 call.stride_b = b_step * args.b_matrix;
                                 gemm(ctx.device().index(), ctx.device().short_name(), stream_of(ctx), call);
                               });
  if (args.triangles.output_lower) {
    lower_triangle(element_bytes, c.raw_data(), c.raw_data(), args.batch, args.m, args.n, stream_of(ctx));
    check_launch(ctx);
  }
}

// The deferred report of a bad id, in the CPU kernels' words.
unsigned long long* defer_id_check(KernelContext& ctx, const Tensor& ids, const detail::IdRange& range) {
  return defer_bad_id_check(ctx, 0, ids, ids.num_elements(),
                            [label = ctx.label(), range, shape = ids.shape()](std::int64_t position, std::int64_t id) {
                              detail::throw_bad_id(label, range, id, position, shape);
                            });
}

void gather_kernel(KernelContext& ctx) {
  const Tensor& params = ctx.input(0);
  const Tensor& ids = ctx.input(1);
  require_types(ctx, ids, kIndex);
  const std::int64_t rows = params.shape()[0];
  unsigned long long* bad = defer_id_check(ctx, ids, detail::gather_id_range(rows));
  gather(element_bytes(params), type_of(ids), params.raw_data(), ids.raw_data(), ctx.output(0).raw_data(),
         ids.num_elements(), rows, detail::row_elements(params.shape(), 1), bad, static_cast<int*>(ctx.fault_word()),
         stream_of(ctx));
  check_launch(ctx);
}

void segment_sum_kernel(KernelContext& ctx) {
  const Tensor& data = ctx.input(0);
  const Tensor& ids = ctx.input(1);
  Tensor& out = ctx.output(0);
  require_types(ctx, data, kNumeric);
  require_types(ctx, ids, kIndex);
  const std::int64_t n = ids.num_elements(), segments = out.shape()[0];
  TANDEM_REQUIRE(n < INT_MAX && segments < INT_MAX, Unimplemented,
                 "{} on {}: {} ids into {} segments; the GPU kernel takes fewer than 2^31 of each", ctx.label(),
                 ctx.device().short_name(), n, segments);
  unsigned long long* bad = defer_id_check(ctx, ids, detail::segment_id_range(segments));
  Tensor& scratch = ctx.scratch(1, {static_cast<std::int64_t>(segment_sum_scratch_bytes(n, segments))}, DType::kU8);
  unsorted_segment_sum(type_of(data), type_of(ids), data.raw_data(), ids.raw_data(), out.raw_data(), n, segments,
                       detail::row_elements(data.shape(), ids.shape().rank()), scratch.raw_data(), bad,
                       static_cast<int*>(ctx.fault_word()), stream_of(ctx));
  check_launch(ctx);
}

void copy_block(KernelContext& ctx, const detail::BlockCopy& copy, const Tensor& src, void* dst) {
  block_copy(element_bytes(src), copy, src.raw_data(), dst, stream_of(ctx));
  check_launch(ctx);
}

void slice_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  copy_block(ctx, detail::slice_copy(x.shape(), ctx.attrs().get<std::vector<std::int64_t>>("begin"), y.shape()), x,
             y.raw_data());
}

// SliceGrad (dy, x): zeros shaped like x, then dy copied in at `begin`.
void slice_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  Tensor& dx = ctx.output(0);
  ctx.device().fill_zero(dx.raw_data(), dx.nbytes());
  copy_block(ctx, detail::slice_grad_copy(dy.shape(), ctx.attrs().get<std::vector<std::int64_t>>("begin"), dx.shape()),
             dy, dx.raw_data());
}

void concat_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  std::vector<Shape> shapes;
  for (int i = 0; i < ctx.num_inputs(); ++i) shapes.push_back(ctx.input(i).shape());
  const auto copies = detail::concat_copies(ctx.attrs(), ctx.label(), shapes, y.shape());
  for (int i = 0; i < ctx.num_inputs(); ++i) {
    copy_block(ctx, copies[static_cast<std::size_t>(i)], ctx.input(i), y.raw_data());
  }
}

}  // namespace
}  // namespace tandem::ops::cuda

namespace tandem::ops::detail {

void register_cuda_array_kernels() {
  using namespace tandem::ops::cuda;
  auto& r = graph::OpRegistry::global();
  const graph::KernelOptions native{.low_precision = graph::LowPrecision::kNative};
  r.add_kernel("BatchMatMul", devices::DeviceType::kGPU, batch_matmul_kernel, native);
  r.add_kernel("Gather", devices::DeviceType::kGPU, gather_kernel, native);
  r.add_kernel("UnsortedSegmentSum", devices::DeviceType::kGPU, segment_sum_kernel, native);
  r.add_kernel("Slice", devices::DeviceType::kGPU, slice_kernel, native);
  r.add_kernel("SliceGrad", devices::DeviceType::kGPU, slice_grad_kernel, native);
  r.add_kernel("Concat", devices::DeviceType::kGPU, concat_kernel, native);
}

}  // namespace tandem::ops::detail
