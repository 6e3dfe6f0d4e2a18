// tandem/ops/math_ops.h — arithmetic, reductions and matrix products.
//
// Binary ops broadcast like NumPy: shapes are aligned at the last dimension, and a dimension of
// 1 stretches to match. Their gradients sum over the broadcast dimensions.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/graph/graph.h"

namespace tandem::ops {

using graph::Output;

Output add(Output a, Output b);
Output sub(Output a, Output b);
Output mul(Output a, Output b);
Output div(Output a, Output b);
Output neg(Output x);
// Sum of same-shaped tensors in one pass.
Output add_n(const std::vector<Output>& xs);

Output square(Output x);
Output abs(Output x);
Output sqrt(Output x);
Output exp(Output x);
Output log(Output x);
Output sign(Output x);  // -1, 0 or 1; not differentiable

struct ReduceOptions {
  std::vector<std::int64_t> axes;  // empty: all axes
  bool keep_dims = false;
};
Output reduce_sum(Output x, const ReduceOptions& options = {});
Output reduce_mean(Output x, const ReduceOptions& options = {});
Output reduce_max(Output x, const ReduceOptions& options = {});

struct MatMulOptions {
  bool transpose_a = false;
  bool transpose_b = false;
};
// Rank-2 matrix product: op(a) @ op(b).
Output matmul(Output a, Output b, const MatMulOptions& options = {});

struct BatchMatMulOptions {
  bool adj_x = false;  // use a's last two axes transposed
  bool adj_y = false;  // use b's last two axes transposed
  // Causal attention's half products (MultiHeadAttention with use_causal_mask), each about a
  // triangle of a matrix: entry (i, j) of its last two axes is "above the diagonal" when j > i.
  //   a_lower_triangular       a's entries above the diagonal (as stored, before adj_x) count as
  //                            0 whatever is stored: the product is tril(a) @ b, and a's gradient
  //                            above the diagonal is 0. Needs !adj_y.
  //   output_lower_triangular  the product's entries above the diagonal are 0, not computed (the
  //                            scores a causal mask drops). Needs !adj_x and adj_y (q k^T).
  // At most one of the two. On CPUs the register tiles skip the zero half (about half the
  // multiply-adds of a square product); where a's triangle is stored as zeros (attention's
  // probabilities), the bits are those of the plain product.
  bool a_lower_triangular = false;
  bool output_lower_triangular = false;
};
// tf.linalg.matmul / BatchMatMulV2: a [..., m, k] @ b [..., k, n] -> [..., m, n], each of rank 2
// or more. The leading (batch) axes broadcast like NumPy ([2, 1, 3, 4] @ [5, 4, 6] is [2, 5, 3, 6]);
// a broadcast operand is read in place, not copied. The gradient of a broadcast operand is summed
// over the axes it was broadcast along. Shape errors (inner dimensions, batch axes) throw
// InvalidArgument naming the node.
Output batch_matmul(Output a, Output b, const BatchMatMulOptions& options = {});

// TensorFloat-32 for float32 matrix products on GPUs (tf.config.experimental.
// enable_tensor_float_32_execution): about 8x the float32 rate on an H100/H200, with 10-bit
// mantissas in the products. Off by default here (PyTorch's default), so float32 means float32;
// TANDEM_ALLOW_TF32=1 turns it on at start. Mixed-precision policies do not need it: their
// products are 16-bit already. Process-wide; read when a product is queued.
void enable_tensor_float_32_execution(bool enabled);
bool tensor_float_32_execution_enabled();

// Sums `x` over the dimensions that broadcasting added or stretched, to give `like`'s shape
// (the gradient of broadcasting). Used by the binary ops' gradients.
Output sum_to_shape_of(Output x, Output like);

}  // namespace tandem::ops

namespace tandem::graph {
// Operators on graph outputs, found by argument-dependent lookup.
Output operator+(Output a, Output b);
Output operator-(Output a, Output b);
Output operator*(Output a, Output b);
Output operator/(Output a, Output b);
Output operator-(Output x);
}  // namespace tandem::graph
