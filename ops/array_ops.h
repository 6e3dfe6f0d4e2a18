// tandem/ops/array_ops.h — shape, type and constant ops.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/graph/graph.h"

namespace tandem::ops {

using graph::Output;

// Same value, new shape; one dimension may be -1 (inferred). A view: no data moves.
Output reshape(Output x, const Shape& shape);
// Permutes dimensions: y.shape[i] = x.shape[perm[i]].
Output transpose(Output x, std::vector<std::int64_t> perm);
// Converts element type (float <-> int truncates toward zero, like static_cast).
Output cast(Output x, DType dtype);
// Index of the largest value along `axis` (first one on ties), as int64.
Output argmax(Output x, int axis = -1);
// Element-wise a == b with broadcasting, as uint8 (0 or 1).
Output equal(Output a, Output b);
// indices (int32/int64) -> one-hot float32 with a new last axis of size depth; out-of-range
// indices give an all-`off` row (TF semantics).
Output one_hot(Output indices, std::int64_t depth, double on_value = 1.0, double off_value = 0.0);
// A tensor of `shape` filled with `value`.
Output fill(Graph& graph, const Shape& shape, double value, DType dtype = DType::kF32);
Output zeros_like(Output x);
Output ones_like(Output x);
Output identity(Output x);
// A copy of x in its own buffer (Identity is a view); its gradient is the incoming gradient.
Output copy(Output x);
// Identity whose gradient is zero (no gradient flows back through it).
Output stop_gradient(Output x);
// A constant scalar of x's dtype (broadcasts against x).
Output scalar_like(Output x, double value);

}  // namespace tandem::ops
