#include "tandem/graph/graph.h"

#include "tandem/devices/device_name.h"
#include "tandem/graph/op_registry.h"

namespace tandem::graph {

const Node& Output::producer() const {
  TANDEM_REQUIRE(defined(), InvalidArgument, "use of an undefined Output (no node)");
  return graph->node(node);
}

const TensorSpec& Output::spec() const {
  const Node& n = producer();
  return n.outputs[static_cast<std::size_t>(index)];
}

std::string Output::name() const {
  if (!defined()) return "<undefined>";
  return fmt::format("{}:{}", producer().name, index);
}

const std::string& Node::op_name() const { return op->name; }

const Node& Graph::node(int id) const {
  TANDEM_REQUIRE(id >= 0 && id < num_nodes(), InvalidArgument, "node id {} is not in this graph ({} nodes)", id,
                 num_nodes());
  return *nodes_[static_cast<std::size_t>(id)];
}

const Node* Graph::find_node(std::string_view name) const {
  const auto it = ids_by_name_.find(std::string(name));
  return it == ids_by_name_.end() ? nullptr : nodes_[static_cast<std::size_t>(it->second)].get();
}

std::vector<Output> Graph::outputs_of(int node_id) {
  const Node& n = node(node_id);
  std::vector<Output> outs;
  for (int i = 0; i < static_cast<int>(n.outputs.size()); ++i) outs.push_back(Output{this, node_id, i});
  return outs;
}

std::string Graph::unique_name(std::string_view base) {
  std::string name = name_scope_.empty() ? std::string(base) : fmt::format("{}/{}", name_scope_, base);
  if (!ids_by_name_.contains(name)) return name;
  int& count = name_counts_[name];
  std::string candidate;
  do {
    candidate = fmt::format("{}_{}", name, ++count);
  } while (ids_by_name_.contains(candidate));
  return candidate;
}

Graph::Scope Graph::name_scope(std::string_view prefix) {
  TANDEM_REQUIRE(!prefix.empty() && prefix.find(':') == std::string_view::npos, InvalidArgument,
                 "name scope \"{}\" must be non-empty and must not contain ':'", prefix);
  std::string scope = name_scope_.empty() ? std::string(prefix) : fmt::format("{}/{}", name_scope_, prefix);
  return Scope(&name_scope_, std::move(scope));
}

Graph::Scope Graph::device_scope(std::string_view device) {
  if (!device.empty()) devices::DeviceName::parse(device);  // reject malformed names now
  return Scope(&device_scope_, std::string(device));
}

std::vector<Output> Graph::add_node(std::string_view op_name, std::vector<Output> inputs, Attrs attrs,
                                    const NodeOptions& options) {
  const OpDef& op = OpRegistry::global().get(op_name);
  std::string name = unique_name(options.name.empty() ? op.name : options.name);
  const auto label = [&] { return fmt::format("{} \"{}\"", op.name, name); };

  const int n = static_cast<int>(inputs.size());
  const bool count_ok = n >= op.min_inputs && (op.max_inputs == OpDef::kVariadic || n <= op.max_inputs);
  TANDEM_REQUIRE(count_ok, InvalidArgument, "{}: got {} input(s); expected {}", label(), n,
                 op.max_inputs == OpDef::kVariadic ? fmt::format("at least {}", op.min_inputs)
                 : op.min_inputs == op.max_inputs  ? fmt::format("{}", op.min_inputs)
                                                   : fmt::format("{} to {}", op.min_inputs, op.max_inputs));
  std::vector<TensorSpec> input_specs;
  input_specs.reserve(inputs.size());
  for (int i = 0; i < n; ++i) {
    const Output& in = inputs[static_cast<std::size_t>(i)];
    TANDEM_REQUIRE(in.defined(), InvalidArgument, "{}: input {} is undefined (an Output with no node)", label(), i);
    TANDEM_REQUIRE(in.graph == this, InvalidArgument, "{}: input {} ({}) belongs to another graph", label(), i,
                   in.name());
    TANDEM_REQUIRE(in.index < static_cast<int>(in.producer().outputs.size()), InvalidArgument,
                   "{}: input {} refers to output {} of {}, which has {} output(s)", label(), i, in.index,
                   in.producer().label(), in.producer().outputs.size());
    input_specs.push_back(in.spec());
  }
  ShapeContext shape_context(op, name, attrs, input_specs);
  std::vector<TensorSpec> outputs = op.shape_fn(shape_context);
  TANDEM_ASSERT(static_cast<int>(outputs.size()) == op.num_outputs,
                "{}: shape function returned {} outputs, op declares {}", label(), outputs.size(), op.num_outputs);

  std::string device = options.device.empty() ? device_scope_ : options.device;
  if (!device.empty()) devices::DeviceName::parse(device);

  auto node = std::make_unique<Node>();
  node->id = num_nodes();
  node->name = std::move(name);
  node->op = &op;
  node->inputs = std::move(inputs);
  node->attrs = std::move(attrs);
  node->outputs = std::move(outputs);
  node->device = std::move(device);
  node->label_ = fmt::format("{} \"{}\"", op.name, node->name);
  ids_by_name_.emplace(node->name, node->id);
  nodes_.push_back(std::move(node));
  return outputs_of(num_nodes() - 1);
}

Output Graph::add(std::string_view op, std::vector<Output> inputs, Attrs attrs, const NodeOptions& options) {
  auto outs = add_node(op, std::move(inputs), std::move(attrs), options);
  TANDEM_ASSERT(outs.size() == 1, "Graph::add used for op {} with {} outputs; use add_node", op, outs.size());
  return outs[0];
}

Output Graph::placeholder(DType dtype, const Shape& shape, std::string_view name) {
  return add("Placeholder", {}, Attrs{{"dtype", dtype}, {"shape", shape}}, NodeOptions{.name = std::string(name)});
}

Output Graph::constant(const Tensor& value, std::string_view name) {
  TANDEM_REQUIRE(value.defined(), InvalidArgument, "Graph::constant \"{}\": the value is an undefined tensor", name);
  // The graph keeps its own host copy: a later change to the caller's tensor must not change the graph.
  return add("Const", {}, Attrs{{"value", value.to(devices::default_cpu_device()).clone()}},
             NodeOptions{.name = std::string(name)});
}

Output Graph::variable(DType dtype, const Shape& shape, std::string_view name) {
  TANDEM_REQUIRE(shape.is_fully_defined(), InvalidArgument, "variable \"{}\": shape {} must be fully defined", name,
                 shape);
  return add("Variable", {}, Attrs{{"dtype", dtype}, {"shape", shape}}, NodeOptions{.name = std::string(name)});
}

std::string Graph::to_string() const {
  std::string out;
  for (const auto& n : nodes_) {
    std::string ins;
    for (const auto& in : n->inputs) ins += fmt::format("{}{}", ins.empty() ? "" : ", ", in.name());
    std::string outs;
    for (const auto& o : n->outputs) outs += fmt::format("{}{} {}", outs.empty() ? "" : ", ", o.dtype, o.shape);
    const std::string attrs = n->attrs.items().empty() ? std::string() : fmt::format(" {}", n->attrs.to_string());
    const std::string device = n->device.empty() ? std::string() : fmt::format(" @{}", n->device);
    out += fmt::format("{:>4} {} = {}({}){} -> {}{}\n", n->id, n->name, n->op->name, ins, attrs, outs, device);
  }
  return out;
}

}  // namespace tandem::graph
