// tandem/ops/detail/batch_matmul_args.h — how a BatchMatMul walks its batch, for every backend.
//
// The CPU kernel (ops/cpu/math_kernels.cc) and the GPU kernel (ops/cuda/array_cuda_kernels.cc) read
// the same description: the product of one pair of matrices, and the batch axes as a broadcast
// layout whose "elements" are whole matrices (stride 0 where an operand is broadcast), so that a
// broadcast operand is read in place, never copied. tests/ops/math_ops_test.cc checks it. Pure
// host code; nothing here throws (the op's shape function has validated the shapes).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tandem/graph/attrs.h"
#include "tandem/graph/shape.h"
#include "tandem/ops/cpu/broadcast.h"

namespace tandem::ops::detail {

// BatchMatMulOptions' triangles (ops/math_ops.h), as the op's attributes hold them: read here
// once for the shape function, the gradient and both backends' kernels.
struct BatchMatMulTriangles {
  bool a_lower = false;       // a_lower_triangular: a's entries above the diagonal count as 0
  bool output_lower = false;  // output_lower_triangular: the product's are 0
  bool any() const { return a_lower || output_lower; }
};
inline BatchMatMulTriangles batch_matmul_triangles(const graph::Attrs& attrs) {
  return {.a_lower = attrs.get_bool_or("a_lower_triangular", false),
          .output_lower = attrs.get_bool_or("output_lower_triangular", false)};
}

struct BatchMatMulArgs {
  bool adj_x = false, adj_y = false;                      // op(A) = A^T (of the last two axes) when adj_x
  BatchMatMulTriangles triangles;
  std::int64_t m = 0, n = 0, k = 0;                       // each product: C[m, n] = op(A)[m, k] op(B)[k, n]
  std::int64_t lda = 0, ldb = 0;                          // the stored row lengths of A and B (their last dimension)
  std::int64_t a_matrix = 0, b_matrix = 0, c_matrix = 0;  // elements of one matrix of each
  std::int64_t batch = 0;                                 // output matrices
  // The batch axes, merged where possible: operand 0 is A, operand 1 is B; strides in matrices.
  cpu::BroadcastLayout layout;
  // B is shared by every product and A is not broadcast nor adjoint: the batch is one product
  // [batch * m, k] @ [k, n] (a dense layer applied to a sequence), which threads better. Never with
  // a triangle: each product's diagonal starts at its own first row.
  bool fold_batch_into_m = false;
};

inline BatchMatMulArgs batch_matmul_args(const graph::Shape& a, const graph::Shape& b, bool adj_x, bool adj_y) {
  BatchMatMulArgs args;
  args.adj_x = adj_x;
  args.adj_y = adj_y;
  const int ra = a.rank(), rb = b.rank();
  args.m = adj_x ? a[ra - 1] : a[ra - 2];
  args.k = adj_x ? a[ra - 2] : a[ra - 1];
  args.n = adj_y ? b[rb - 2] : b[rb - 1];
  args.lda = a[ra - 1];
  args.ldb = b[rb - 1];
  args.a_matrix = a[ra - 2] * a[ra - 1];
  args.b_matrix = b[rb - 2] * b[rb - 1];
  args.c_matrix = args.m * args.n;
  graph::Shape a_batch, b_batch, out_batch;
  for (int d = 0; d < ra - 2; ++d) a_batch.push_back(a[d]);
  for (int d = 0; d < rb - 2; ++d) b_batch.push_back(b[d]);
  const int rank = std::max(ra, rb) - 2;
  for (int d = 0; d < rank; ++d) {
    const int da = d - (rank - a_batch.rank()), db = d - (rank - b_batch.rank());
    out_batch.push_back(std::max(da >= 0 ? a_batch[da] : 1, db >= 0 ? b_batch[db] : 1));
  }
  args.layout = cpu::make_broadcast_layout(out_batch, {&a_batch, &b_batch});
  args.batch = out_batch.num_elements();
  args.fold_batch_into_m = !adj_x && b_batch.num_elements() == 1 && a_batch.num_elements() == args.batch;
  return args;
}

// The kernels' entry: the node's attributes (adj_x, adj_y and the triangles).
inline BatchMatMulArgs batch_matmul_args(const graph::Shape& a, const graph::Shape& b, const graph::Attrs& attrs) {
  BatchMatMulArgs args = batch_matmul_args(a, b, attrs.get_bool_or("adj_x", false), attrs.get_bool_or("adj_y", false));
  args.triangles = batch_matmul_triangles(attrs);
  if (args.triangles.any()) args.fold_batch_into_m = false;
  return args;
}

// Calls run(c_first, count, a_first, a_stride, b_first, b_stride) for runs of output matrices
// [c_first, c_first + count) along which A and B advance by fixed strides (all in matrices): the
// innermost merged batch axis. A GPU issues one strided-batched product per run.
template <class Run>
void for_each_strided_run(const BatchMatMulArgs& args, std::int64_t begin, std::int64_t end, Run&& run) {
  cpu::for_each_run(args.layout, begin, end,
                    [&](std::int64_t c, std::int64_t count, const auto& offsets, const auto& strides) {
                      run(c, count, offsets[0], strides[0], offsets[1], strides[1]);
                    });
}

}  // namespace tandem::ops::detail
