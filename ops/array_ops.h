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
// tf.gather(params, indices) along axis 0 (an embedding lookup): shape indices.shape +
// params.shape[1:], any dtype; indices int32 or int64. An id outside [0, params.shape[0]) raises
// InvalidArgument naming the node and the id (CPUs when the kernel runs; GPUs once the step is
// queued, like a bad label of the sparse cross-entropy). The gradient with respect to params is
// unsorted_segment_sum of the incoming gradient: a scatter-add, never a one-hot product.
Output gather(Output params, Output indices);
// tf.math.unsorted_segment_sum: out [num_segments, data.shape[ids.rank:]...] with
// out[ids[i]] += data[i] (data.shape starts with segment_ids.shape). The sums are deterministic:
// each output row adds its rows in the order of i, whatever the threads. An id outside
// [0, num_segments) raises InvalidArgument like gather's (TF drops negative ids; we refuse them).
Output unsorted_segment_sum(Output data, Output segment_ids, std::int64_t num_segments);
// tf.slice: the block x[begin[i] : begin[i] + size[i]] of every axis; size[i] == -1 means "to the
// end". begin and size have one entry per axis. The gradient pads the incoming gradient with zeros.
Output slice(Output x, std::vector<std::int64_t> begin, std::vector<std::int64_t> size);
// tf.concat along `axis` (negative counts from the end): the inputs agree on every other axis.
// Its gradient is a slice of the incoming gradient per input (which needs the inputs' sizes along
// `axis` known when the gradient is built).
Output concat(const std::vector<Output>& xs, int axis);
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
