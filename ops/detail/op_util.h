// tandem/ops/detail/op_util.h — shared pieces of op definitions (not kernels).
#pragma once

#include <string_view>
#include <vector>

#include "tandem/graph/op_registry.h"

namespace tandem::ops::detail {

using graph::Attrs;
using graph::GradContext;
using graph::OpDef;
using graph::OpRegistry;
using graph::Output;
using graph::ShapeContext;
using graph::TensorSpec;

// Adds a node to the graph the first input belongs to (registering the ops if needed).
std::vector<Output> add_op_multi(std::string_view op, std::vector<Output> inputs, Attrs attrs = {});
Output add_op(std::string_view op, std::vector<Output> inputs, Attrs attrs = {});
Output add_op_in(Graph& graph, std::string_view op, std::vector<Output> inputs, Attrs attrs = {});

// NumPy broadcasting of two shapes; unknown dimensions broadcast against 1 or an equal unknown.
Shape broadcast_shapes(const ShapeContext& ctx, const Shape& a, const Shape& b);

// Shape functions shared by many ops.
std::vector<TensorSpec> same_as_input0_float(ShapeContext& ctx);  // one float input, same spec out
std::vector<TensorSpec> same_as_input0_any(ShapeContext& ctx);    // any dtype, same spec out
// Two inputs of one float dtype and one shape (y and dy of an activation gradient).
std::vector<TensorSpec> same_float_pair(ShapeContext& ctx);

// True when reducing `grad` (shaped like the broadcast result) to `input`'s shape is provably a
// no-op, so the gradient needs no SumToShape node.
bool broadcast_is_identity(const Shape& input, const Shape& other);

}  // namespace tandem::ops::detail
