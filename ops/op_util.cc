#include "tandem/ops/detail/op_util.h"

#include "tandem/ops/ops.h"

namespace tandem::ops::detail {

std::vector<Output> add_op_multi(std::string_view op, std::vector<Output> inputs, Attrs attrs) {
  TANDEM_REQUIRE(!inputs.empty() && inputs.front().defined(), InvalidArgument, "{}: the first input is undefined", op);
  Graph& graph = *inputs.front().graph;
  register_all();
  return graph.add_node(op, std::move(inputs), std::move(attrs));
}

Output add_op(std::string_view op, std::vector<Output> inputs, Attrs attrs) {
  TANDEM_REQUIRE(!inputs.empty() && inputs.front().defined(), InvalidArgument, "{}: the first input is undefined", op);
  Graph& graph = *inputs.front().graph;  // before `inputs` is moved from
  return add_op_in(graph, op, std::move(inputs), std::move(attrs));
}

Output add_op_in(Graph& graph, std::string_view op, std::vector<Output> inputs, Attrs attrs) {
  register_all();
  return graph.add(op, std::move(inputs), std::move(attrs));
}

Shape broadcast_shapes(const ShapeContext& ctx, const Shape& a, const Shape& b) {
  const int rank = std::max(a.rank(), b.rank());
  Shape out;
  for (int i = 0; i < rank; ++i) {
    const int ia = a.rank() - rank + i;
    const int ib = b.rank() - rank + i;
    const std::int64_t da = ia >= 0 ? a[ia] : 1;
    const std::int64_t db = ib >= 0 ? b[ib] : 1;
    std::int64_t d = 0;
    if (da == db) {
      d = da;
    } else if (da == 1) {
      d = db;
    } else if (db == 1) {
      d = da;
    } else if (da == Shape::kUnknown) {
      d = db;  // the unknown one must be 1 or equal at run time; the run-time plan checks
    } else if (db == Shape::kUnknown) {
      d = da;
    } else {
      ctx.fail("shapes {} and {} cannot be broadcast together (dimension {}: {} vs {})", a, b, i, da, db);
    }
    out.push_back(d);
  }
  return out;
}

bool broadcast_is_identity(const Shape& input, const Shape& other) {
  if (input.rank() < other.rank()) return false;
  for (int i = 0; i < input.rank(); ++i) {
    const int io = other.rank() - input.rank() + i;
    const std::int64_t d = input[i];
    const std::int64_t o = io >= 0 ? other[io] : 1;
    if (o == 1) continue;                                                  // other stretches to input's size
    if (d == o && d != Shape::kUnknown) continue;                          // equal, known
    if (d != Shape::kUnknown && d != 1 && o == Shape::kUnknown) continue;  // other must be 1 or d
    return false;
  }
  return true;
}

std::vector<TensorSpec> same_as_input0_float(ShapeContext& ctx) {
  ctx.require_float(0);
  return {ctx.input(0)};
}

std::vector<TensorSpec> same_as_input0_any(ShapeContext& ctx) { return {ctx.input(0)}; }

std::vector<TensorSpec> same_float_pair(ShapeContext& ctx) {
  ctx.require_float(0);
  ctx.require_same_dtype(0, 1);
  ctx.require(ctx.shape(0).compatible_with(ctx.shape(1)), "inputs have different shapes: {} and {}", ctx.shape(0),
              ctx.shape(1));
  return {ctx.input(0)};
}

}  // namespace tandem::ops::detail
