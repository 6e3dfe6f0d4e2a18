#include "tandem/graph/autodiff.h"

#include <map>

#include "tandem/graph/op_registry.h"

namespace tandem::graph {
namespace {

// Sums the gradient contributions to one value (one AddN when there are several).
Output sum_contributions(Graph& g, std::vector<Output>& parts) {
  if (parts.empty()) return Output{};
  if (parts.size() == 1) return parts.front();
  Output sum = g.add("AddN", parts);
  parts.assign(1, sum);
  return sum;
}

}  // namespace

std::vector<Output> gradients(std::span<const Output> ys, std::span<const Output> xs, std::span<const Output> grad_ys,
                              const GradientOptions& options) {
  TANDEM_REQUIRE(!ys.empty(), InvalidArgument, "gradients: no ys to differentiate");
  TANDEM_REQUIRE(grad_ys.empty() || grad_ys.size() == ys.size(), InvalidArgument,
                 "gradients: {} grad_ys for {} ys; pass one per y or none", grad_ys.size(), ys.size());
  Graph& g = *ys.front().graph;
  for (const auto& o : ys) {
    TANDEM_REQUIRE(o.defined() && o.graph == &g, InvalidArgument, "gradients: y {} is undefined or from another graph",
                   o.name());
    TANDEM_REQUIRE(is_floating(o.dtype()), InvalidArgument,
                   "gradients: y {} has dtype {}; only floating-point values can be differentiated", o.name(),
                   o.dtype());
  }
  for (const auto& o : xs) {
    TANDEM_REQUIRE(o.defined() && o.graph == &g, InvalidArgument, "gradients: x {} is undefined or from another graph",
                   o.name());
  }
  const int num_nodes = g.num_nodes();
  int last_y = 0;
  for (const auto& y : ys) last_y = std::max(last_y, y.node);

  // Nodes that reach a y (walking inputs backwards) and are reached from an x (forwards).
  std::vector<char> reaches_y(static_cast<std::size_t>(num_nodes), 0);
  for (const auto& y : ys) reaches_y[static_cast<std::size_t>(y.node)] = 1;
  for (int id = last_y; id >= 0; --id) {
    if (!reaches_y[static_cast<std::size_t>(id)]) continue;
    for (const auto& in : g.node(id).inputs) reaches_y[static_cast<std::size_t>(in.node)] = 1;
  }
  std::vector<char> from_x(static_cast<std::size_t>(num_nodes), 0);
  int first_x = num_nodes;
  for (const auto& x : xs) {
    from_x[static_cast<std::size_t>(x.node)] = 1;
    first_x = std::min(first_x, x.node);
  }
  for (int id = first_x; id <= last_y; ++id) {
    if (from_x[static_cast<std::size_t>(id)]) continue;
    for (const auto& in : g.node(id).inputs) {
      if (from_x[static_cast<std::size_t>(in.node)] && is_floating(in.dtype())) {
        from_x[static_cast<std::size_t>(id)] = 1;
        break;
      }
    }
  }
  const auto relevant = [&](int id) {
    return reaches_y[static_cast<std::size_t>(id)] && from_x[static_cast<std::size_t>(id)];
  };

  // Gradient contributions per (node, output).
  std::map<std::pair<int, int>, std::vector<Output>> contributions;
  const auto scope = g.name_scope(options.name_scope);
  for (std::size_t i = 0; i < ys.size(); ++i) {
    Output seed;
    if (!grad_ys.empty()) {
      seed = grad_ys[i];
      TANDEM_REQUIRE(seed.defined() && seed.dtype() == ys[i].dtype() && seed.shape().compatible_with(ys[i].shape()),
                     InvalidArgument, "gradients: grad_ys[{}] is {} {}; expected {} {} like y {}", i,
                     seed.defined() ? dtype_name(seed.dtype()) : "undefined", seed.defined() ? seed.shape() : Shape{},
                     ys[i].dtype(), ys[i].shape(), ys[i].name());
    } else {
      seed = g.add("OnesLike", {ys[i]}, {}, NodeOptions{.name = "grad_ys"});
    }
    contributions[{ys[i].node, ys[i].index}].push_back(seed);
  }

  std::vector<Output> output_grads;
  for (int id = last_y; id >= first_x; --id) {
    if (!relevant(id)) continue;
    const Node& node = g.node(id);
    const int num_outputs = static_cast<int>(node.outputs.size());
    output_grads.assign(static_cast<std::size_t>(num_outputs), Output{});
    bool any = false;
    for (int o = 0; o < num_outputs; ++o) {
      auto it = contributions.find({id, o});
      if (it == contributions.end()) continue;
      const auto node_scope = g.name_scope(node.name);
      output_grads[static_cast<std::size_t>(o)] = sum_contributions(g, it->second);
      any = true;
    }
    if (!any || node.op->grad_fn == nullptr || node.inputs.empty()) continue;
    // Only ask for input gradients when some input is itself on an x -> y path.
    bool wants_input_grad = false;
    for (const auto& in : node.inputs)
      wants_input_grad |= from_x[static_cast<std::size_t>(in.node)] && is_floating(in.dtype());
    if (!wants_input_grad) continue;

    std::vector<Output> input_grads;
    {
      const auto node_scope = g.name_scope(node.name);
      GradContext context(g, node, output_grads);
      input_grads = node.op->grad_fn(context);
    }
    TANDEM_ASSERT(input_grads.size() == node.inputs.size(), "{}: gradient function returned {} gradients for {} inputs",
                  node.label(), input_grads.size(), node.inputs.size());
    for (std::size_t i = 0; i < node.inputs.size(); ++i) {
      const Output& in = node.inputs[i];
      const Output& grad = input_grads[i];
      if (!grad.defined() || !from_x[static_cast<std::size_t>(in.node)] || !is_floating(in.dtype())) continue;
      TANDEM_ASSERT(grad.dtype() == in.dtype() && grad.shape().compatible_with(in.shape()),
                    "{}: gradient for input {} is {} {}, input is {} {}", node.label(), i, grad.dtype(), grad.shape(),
                    in.dtype(), in.shape());
      contributions[{in.node, in.index}].push_back(grad);
    }
  }

  std::vector<Output> result;
  for (const auto& x : xs) {
    auto it = contributions.find({x.node, x.index});
    Output grad;
    if (it != contributions.end()) {
      const auto node_scope = g.name_scope(g.node(x.node).name);
      grad = sum_contributions(g, it->second);
    }
    if (!grad.defined() && options.unconnected == UnconnectedGradients::kZero) {
      grad = g.add("ZerosLike", {x}, {}, NodeOptions{.name = "unconnected"});
    }
    result.push_back(grad);
  }
  return result;
}

}  // namespace tandem::graph
