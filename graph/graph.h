// tandem/graph/graph.h — a dataflow graph of named ops.
//
// A Graph is built once (by hand, by autodiff, by Keras layers) and then run by one or more
// Executors, each on its own device and thread. It is append-only: a node's inputs must exist
// before it, so node ids are already a topological order. Shapes are inferred when a node is
// added (a mismatch throws InvalidArgument naming the node and both shapes); dimensions unknown
// at construction (the batch) are -1 and become concrete when an executor plans a run.
//
// Threading: building is single-threaded. Once executors run, the graph must not change.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tandem/graph/attrs.h"
#include "tandem/graph/dtype.h"
#include "tandem/graph/shape.h"

namespace tandem::graph {

class Graph;
struct Node;
struct OpDef;

// What one output of a node will hold.
struct TensorSpec {
  DType dtype = DType::kF32;
  Shape shape;
  bool operator==(const TensorSpec&) const = default;
};

// One output of one node: what ops take as inputs and executors fetch.
struct Output {
  Graph* graph = nullptr;
  int node = -1;
  int index = 0;

  bool defined() const { return graph != nullptr && node >= 0; }
  const Node& producer() const;
  const TensorSpec& spec() const;
  DType dtype() const { return spec().dtype; }
  const Shape& shape() const { return spec().shape; }
  std::string name() const;  // "dense/MatMul:0"
  bool operator==(const Output& other) const {
    return graph == other.graph && node == other.node && index == other.index;
  }
};

struct Node {
  int id = -1;
  std::string name;  // unique in the graph, with its name scope: "dense_1/MatMul"
  const OpDef* op = nullptr;
  std::vector<Output> inputs;
  Attrs attrs;
  std::vector<TensorSpec> outputs;
  std::string device;  // requested placement ("" = the executor's device)

  const std::string& op_name() const;
  // MatMul "dense_1/MatMul": how errors name a node. Made once, when the node is added, because
  // kernels pass it on every call.
  const std::string& label() const { return label_; }

 private:
  friend class Graph;
  std::string label_;
};

struct NodeOptions {
  std::string name;    // default: the op's name, made unique ("MatMul", "MatMul_1")
  std::string device;  // default: the graph's current device scope
};

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;  // Outputs point at their graph
  Graph& operator=(const Graph&) = delete;

  // Adds a node running `op` and returns its outputs. Throws InvalidArgument for an unknown op,
  // a wrong number of inputs, inputs from another graph, or inputs the op's shape function
  // rejects; the message names the node.
  std::vector<Output> add_node(std::string_view op, std::vector<Output> inputs, Attrs attrs = {},
                               const NodeOptions& options = {});
  // add_node for ops with exactly one output.
  Output add(std::string_view op, std::vector<Output> inputs, Attrs attrs = {}, const NodeOptions& options = {});

  // A value fed at run time. Unknown dimensions (-1) accept any size.
  Output placeholder(DType dtype, const Shape& shape, std::string_view name = "Placeholder");
  // A value stored in the graph.
  Output constant(const Tensor& value, std::string_view name = "Const");
  // A value bound per executor (each replica binds its own copy): weights and optimizer slots.
  Output variable(DType dtype, const Shape& shape, std::string_view name = "Variable");

  int num_nodes() const { return static_cast<int>(nodes_.size()); }
  const Node& node(int id) const;
  const Node* find_node(std::string_view name) const;
  std::vector<Output> outputs_of(int node_id);

  // RAII scopes. Names of nodes added while a NameScope lives get "prefix/"; nodes added while a
  // DeviceScope lives request that device. Scopes nest and must end in reverse order.
  class [[nodiscard]] Scope {
   public:
    ~Scope() { *slot_ = std::move(saved_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    friend class Graph;
    Scope(std::string* slot, std::string value) : slot_(slot), saved_(std::exchange(*slot, std::move(value))) {}
    std::string* slot_;
    std::string saved_;
  };
  Scope name_scope(std::string_view prefix);
  Scope device_scope(std::string_view device);  // validates the name (DeviceName::parse)
  // The device nodes added now request ("" when no DeviceScope lives).
  const std::string& current_device_scope() const { return device_scope_; }

  // A node name not yet used, with the current name scope: base, base_1, base_2, ...
  std::string unique_name(std::string_view base);

  // One line per node: "12 dense/MatMul = MatMul(x:0, dense/kernel:0) -> float32 (None, 128)".
  std::string to_string() const;

 private:
  std::vector<std::unique_ptr<Node>> nodes_;
  std::unordered_map<std::string, int> ids_by_name_;
  std::unordered_map<std::string, int> name_counts_;
  std::string name_scope_;
  std::string device_scope_;
};

}  // namespace tandem::graph

namespace tandem {
using graph::Graph;
using graph::Output;
}  // namespace tandem
