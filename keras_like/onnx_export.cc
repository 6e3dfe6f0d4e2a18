// Model::export_model: the model's inference graph as an ONNX model (opset 17), written with the
// ONNX project's own protobuf messages (Debian's libonnx-dev) and checked by its checker before
// the file is written.
//
// The graph exported is the one predict runs (the layers called with training=false), built here
// on a fresh Graph whose inputs have an unknown batch dimension; every tandem op in it maps to one
// or a few ONNX nodes (table below). Layouts: tandem's images are NHWC and ONNX's convolutions and
// pooling NCHW, so each Conv/pool is wrapped in two Transposes (runtimes fold adjacent ones);
// every other op keeps tandem's layout, so the exported model takes and gives exactly what
// predict takes and gives. Weights become initializers (their values now, read whole). An op with
// no mapping is Unimplemented naming the op, the node (whose name carries its layer's) and the
// layer classes that are exportable.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/base/detail/atomic_file.h"
#include "tandem/base/errors.h"
#include "tandem/keras_like/detail/model_state.h"
#include "tandem/keras_like/model.h"
#include "tandem/ops/ops.h"

#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

namespace tandem::keras {

namespace {

constexpr int kOpset = 17;  // LayerNormalization's first opset; what ONNX Runtime and onnx 1.12 read

int onnx_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return onnx::TensorProto::FLOAT;
    case DType::kF64: return onnx::TensorProto::DOUBLE;
    case DType::kI32: return onnx::TensorProto::INT32;
    case DType::kI64: return onnx::TensorProto::INT64;
    case DType::kU8: return onnx::TensorProto::UINT8;
    case DType::kF16: return onnx::TensorProto::FLOAT16;
    case DType::kBF16: return onnx::TensorProto::BFLOAT16;
  }
  return onnx::TensorProto::UNDEFINED;
}

// The ONNX graph being written: node and initializer helpers with unique value names.
class Writer {
 public:
  explicit Writer(onnx::GraphProto& graph) : graph_(graph) {}

  std::string fresh(std::string_view hint) { return fmt::format("{}__{}", hint, counter_++); }

  // Adds a node; returns its first output's name.
  std::string node(std::string_view op, const std::vector<std::string>& inputs, std::string_view hint,
                   const std::function<void(onnx::NodeProto&)>& attributes = {}, int outputs = 1) {
    onnx::NodeProto* n = graph_.add_node();
    n->set_op_type(std::string(op));
    n->set_name(fresh(hint));
    for (const auto& i : inputs) n->add_input(i);
    std::string first;
    for (int o = 0; o < outputs; ++o) {
      const std::string out = outputs == 1 ? fresh(hint) : fresh(fmt::format("{}_{}", hint, o));
      n->add_output(out);
      if (o == 0) first = out;
    }
    if (attributes) attributes(*n);
    return first;
  }
  std::string initializer(const Tensor& value, std::string name) {
    const Tensor host = value.to(devices::default_cpu_device());
    onnx::TensorProto* t = graph_.add_initializer();
    t->set_name(name);
    t->set_data_type(onnx_type(host.dtype()));
    for (const auto d : host.shape().dims()) t->add_dims(d);
    t->set_raw_data(host.raw_data(), host.nbytes());  // little-endian, as ONNX's raw_data
    return name;
  }
  std::string int64s(const std::vector<std::int64_t>& values, std::string_view hint) {
    return initializer(Tensor::from_vector(values, Shape{static_cast<std::int64_t>(values.size())}), fresh(hint));
  }

 private:
  onnx::GraphProto& graph_;
  int counter_ = 0;
};

void set_ints(onnx::NodeProto& n, const std::string& name, const std::vector<std::int64_t>& values) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (const auto v : values) a->add_ints(v);
}
void set_int(onnx::NodeProto& n, const std::string& name, std::int64_t value) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}
void set_float(onnx::NodeProto& n, const std::string& name, double value) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(static_cast<float>(value));
}
void set_string(onnx::NodeProto& n, const std::string& name, const std::string& value) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::STRING);
  a->set_s(value);
}

// Translates the tandem graph's nodes one by one.
class Exporter {
 public:
  Exporter(const Graph& graph, onnx::GraphProto& out, const std::unordered_map<int, VariablePtr>& variables)
      : graph_(graph), w_(out), variables_(variables) {}

  // Translates every node `outputs` depend on, inputs first: node ids are a topological order (a
  // node's inputs were added before it), so one pass in id order over the reachable nodes, with no
  // recursion however deep the model.
  void translate_for(const std::vector<Output>& outputs) {
    std::vector<bool> needed(static_cast<std::size_t>(graph_.num_nodes()), false);
    std::vector<int> stack;
    for (const auto& o : outputs) stack.push_back(o.node);
    while (!stack.empty()) {
      const int id = stack.back();
      stack.pop_back();
      if (needed[static_cast<std::size_t>(id)] || names_.contains(key(Output{nullptr, id, 0}))) continue;
      needed[static_cast<std::size_t>(id)] = true;
      for (const auto& in : graph_.node(id).inputs) stack.push_back(in.node);
    }
    for (int id = 0; id < graph_.num_nodes(); ++id) {
      if (needed[static_cast<std::size_t>(id)]) translate(graph_.node(id));
    }
  }
  // The ONNX name of a translated output.
  std::string value(const Output& o) {
    const auto it = names_.find(key(o));
    TANDEM_REQUIRE(it != names_.end(), Unimplemented,
                   "export to ONNX: output {} of {} is used; only a node's first output is exported", o.index,
                   graph_.node(o.node).label());
    return it->second;
  }
  void name_input(const Output& o, const std::string& name) { names_[key(o)] = name; }

 private:
  static std::int64_t key(const Output& o) { return static_cast<std::int64_t>(o.node) * 64 + o.index; }

  std::string in(const graph::Node& node, std::size_t k) { return value(node.inputs.at(k)); }
  void bind(const graph::Node& node, std::string name) { names_[key(Output{nullptr, node.id, 0})] = std::move(name); }

  std::string scalar_like(double v, DType dtype, std::string_view hint) {
    return w_.initializer(ops_scalar(v, dtype), w_.fresh(hint));
  }
  static Tensor ops_scalar(double v, DType dtype) {
    const Tensor d = Tensor::from_vector(std::vector<double>{v}, Shape{});
    if (dtype == DType::kF64) return d;
    const Tensor f = Tensor::from_vector(std::vector<float>{static_cast<float>(v)}, Shape{});
    if (dtype == DType::kF32) return f;
    Tensor out = Tensor::empty(Shape{}, dtype);
    const float value = static_cast<float>(v);
    graph::narrow_from_float32(&value, dtype, out.raw_data(), 1);
    return out;
  }

  std::string activation(const std::string& x, const std::string& name, DType dtype, const std::string& label) {
    if (name == "linear") return x;
    if (name == "relu") return w_.node("Relu", {x}, "relu");
    if (name == "sigmoid") return w_.node("Sigmoid", {x}, "sigmoid");
    if (name == "tanh") return w_.node("Tanh", {x}, "tanh");
    if (name == "gelu") return gelu(x, false, dtype);
    if (name == "gelu_approximate") return gelu(x, true, dtype);
    throw Unimplemented(fmt::format("export to ONNX: activation \"{}\" of {} has no ONNX form here", name, label));
  }
  // Opset 17 has no Gelu: 0.5 x (1 + erf(x / sqrt 2)), or the tanh form.
  std::string gelu(const std::string& x, bool approximate, DType dtype) {
    std::string inner;
    if (approximate) {
      const std::string cube = w_.node("Mul", {x, w_.node("Mul", {x, x}, "gelu_sq")}, "gelu_cube");
      const std::string poly =
          w_.node("Add", {x, w_.node("Mul", {cube, scalar_like(0.044715, dtype, "gelu_c")}, "gelu_c3")}, "gelu_poly");
      inner = w_.node("Tanh", {w_.node("Mul", {poly, scalar_like(std::sqrt(2.0 / M_PI), dtype, "gelu_k")}, "gelu_arg")},
                      "gelu_tanh");
    } else {
      inner = w_.node("Erf", {w_.node("Mul", {x, scalar_like(M_SQRT1_2, dtype, "gelu_k")}, "gelu_arg")}, "gelu_erf");
    }
    const std::string one_plus = w_.node("Add", {inner, scalar_like(1.0, dtype, "gelu_one")}, "gelu_1p");
    return w_.node("Mul", {w_.node("Mul", {x, one_plus}, "gelu_x"), scalar_like(0.5, dtype, "gelu_half")}, "gelu");
  }

  std::string to_nchw(const std::string& x) {
    return w_.node("Transpose", {x}, "to_nchw", [](auto& n) { set_ints(n, "perm", {0, 3, 1, 2}); });
  }
  std::string to_nhwc(const std::string& x) {
    return w_.node("Transpose", {x}, "to_nhwc", [](auto& n) { set_ints(n, "perm", {0, 2, 3, 1}); });
  }
  static std::string auto_pad(const graph::Node& node) {
    return node.attrs.get<std::string>("padding") == "SAME" ? "SAME_UPPER" : "VALID";
  }

  std::string conv(const graph::Node& node, bool fused) {
    const auto& strides = node.attrs.get<std::vector<std::int64_t>>("strides");
    // HWIO -> OIHW
    const std::string filter = w_.node("Transpose", {in(node, 1)}, "filter_oihw", [](auto& n) {
      set_ints(n, "perm", {3, 2, 0, 1});
    });
    std::vector<std::string> inputs{to_nchw(in(node, 0)), filter};
    if (fused) inputs.push_back(in(node, 2));
    const std::string y = w_.node("Conv", inputs, "conv", [&](auto& n) {
      set_ints(n, "strides", strides);
      set_string(n, "auto_pad", auto_pad(node));
    });
    const std::string out = to_nhwc(y);
    return fused ? activation(out, node.attrs.get<std::string>("activation"), node.outputs[0].dtype, node.label())
                 : out;
  }

  std::string pool(const graph::Node& node, bool max) {
    return pool_of(in(node, 0), node.attrs.get<std::vector<std::int64_t>>("pool_size"),
                   node.attrs.get<std::vector<std::int64_t>>("strides"), auto_pad(node), max);
  }

  // FusedConv2DMaxPool: Conv, the activation, then MaxPool (its argmax output feeds gradients only).
  std::string conv_max_pool(const graph::Node& node) {
    const std::string pad = node.attrs.get<std::string>("pool_padding") == "SAME" ? "SAME_UPPER" : "VALID";
    return pool_of(conv(node, true), node.attrs.get<std::vector<std::int64_t>>("pool_size"),
                   node.attrs.get<std::vector<std::int64_t>>("pool_strides"), pad, true);
  }

  std::string pool_of(const std::string& x, const std::vector<std::int64_t>& size,
                      const std::vector<std::int64_t>& strides, const std::string& pad, bool max) {
    const std::string y =
        w_.node(max ? "MaxPool" : "AveragePool", {to_nchw(x)}, max ? "maxpool" : "avgpool", [&](auto& n) {
          set_ints(n, "kernel_shape", size);
          set_ints(n, "strides", strides);
          set_string(n, "auto_pad", pad);
          // TF's SAME average leaves the padding out of the count.
          if (!max) set_int(n, "count_include_pad", 0);
        });
    return to_nhwc(y);
  }

  std::string matmul(const std::string& a, const std::string& b, bool ta, bool tb, int rank_a, int rank_b) {
    const auto swap_last = [&](const std::string& x, int rank) {
      std::vector<std::int64_t> perm;
      for (int d = 0; d < rank; ++d) perm.push_back(d);
      std::swap(perm[static_cast<std::size_t>(rank - 1)], perm[static_cast<std::size_t>(rank - 2)]);
      return w_.node("Transpose", {x}, "transpose", [perm](auto& n) { set_ints(n, "perm", perm); });
    };
    return w_.node("MatMul", {ta ? swap_last(a, rank_a) : a, tb ? swap_last(b, rank_b) : b}, "matmul");
  }

  std::string reduce(const graph::Node& node, const char* op) {
    const auto axes = node.attrs.get_or<std::vector<std::int64_t>>("axes", {});
    const bool keep = node.attrs.get_or<bool>("keep_dims", false);
    if (std::string_view(op) == "ReduceSum") {
      std::vector<std::string> inputs{in(node, 0)};
      if (!axes.empty()) inputs.push_back(w_.int64s(axes, "axes"));
      return w_.node(op, inputs, "reduce", [&](auto& n) { set_int(n, "keepdims", keep ? 1 : 0); });
    }
    return w_.node(op, {in(node, 0)}, "reduce", [&](auto& n) {
      if (!axes.empty()) set_ints(n, "axes", axes);
      set_int(n, "keepdims", keep ? 1 : 0);
    });
  }

  // Batch normalization with given statistics, elementwise over the last (channel) axis:
  // (x - mean) * scale / sqrt(variance + epsilon) + offset.
  std::string batch_norm(const graph::Node& node) {
    TANDEM_REQUIRE(!node.attrs.get<bool>("training"), Unimplemented,
                   "export to ONNX: {} normalises with batch statistics (training)", node.label());
    const DType dtype = node.inputs[1].dtype();
    const std::string eps = scalar_like(node.attrs.get<double>("epsilon"), dtype, "epsilon");
    const std::string rstd = w_.node(
        "Div", {in(node, 1), w_.node("Sqrt", {w_.node("Add", {in(node, 4), eps}, "var_eps")}, "std")}, "scale_rstd");
    std::string x = in(node, 0);
    if (node.inputs[0].dtype() != dtype) x = cast(x, dtype);
    std::string y =
        w_.node("Add", {w_.node("Mul", {w_.node("Sub", {x, in(node, 3)}, "centered"), rstd}, "scaled"), in(node, 2)},
                "batch_norm");
    if (node.outputs[0].dtype != dtype) y = cast(y, node.outputs[0].dtype);
    return y;
  }
  std::string cast(const std::string& x, DType to) {
    return w_.node("Cast", {x}, "cast", [to](auto& n) { set_int(n, "to", onnx_type(to)); });
  }

  std::string layer_norm(const graph::Node& node) {
    const Shape& shape = node.inputs[0].shape();
    const std::int64_t features = shape[shape.rank() - 1];
    const DType dtype = node.outputs[0].dtype;
    std::size_t k = 1;
    std::string scale, bias;
    if (node.attrs.get<bool>("scale")) {
      scale = in(node, k++);
    } else {
      scale = w_.initializer(Tensor::filled<float>(Shape{features}, 1.0F), w_.fresh("ones"));
    }
    if (node.attrs.get<bool>("center")) bias = in(node, k++);
    std::vector<std::string> inputs{in(node, 0), scale};
    if (!bias.empty()) inputs.push_back(bias);
    TANDEM_REQUIRE(dtype == DType::kF32 || node.attrs.get<bool>("scale"), Unimplemented,
                   "export to ONNX: {} without scale in {}", node.label(), graph::dtype_name(dtype));
    return w_.node("LayerNormalization", inputs, "layer_norm", [&](auto& n) {
      set_int(n, "axis", -1);
      set_float(n, "epsilon", node.attrs.get<double>("epsilon"));
    });
  }

  // softmax(scale * x) where allowed (mask non-zero, and j <= i when causal), 0 elsewhere.
  std::string masked_softmax(const graph::Node& node) {
    const DType dtype = node.outputs[0].dtype;
    const Shape& shape = node.inputs[0].shape();
    std::string x =
        w_.node("Mul", {in(node, 0), scalar_like(node.attrs.get<double>("scale"), dtype, "scale")}, "scaled");
    std::string allowed;
    if (node.inputs.size() > 1) allowed = cast(in(node, 1), DType::kU8);
    if (node.attrs.get<bool>("causal")) {
      const std::int64_t t = shape[shape.rank() - 2], s = shape[shape.rank() - 1];
      TANDEM_REQUIRE(t >= 0 && s >= 0, Unimplemented,
                     "export to ONNX: {} is causal over a sequence length unknown when exporting (give Input a "
                     "fixed length)",
                     node.label());
      std::vector<std::uint8_t> lower(static_cast<std::size_t>(t * s));
      for (std::int64_t i = 0; i < t; ++i)
        for (std::int64_t j = 0; j < s; ++j) lower[static_cast<std::size_t>(i * s + j)] = j <= i ? 1 : 0;
      Tensor mask = Tensor::empty(Shape{t, s}, DType::kU8);
      std::memcpy(mask.raw_data(), lower.data(), lower.size());
      const std::string causal = w_.initializer(mask, w_.fresh("causal"));
      allowed = allowed.empty() ? causal : w_.node("Mul", {allowed, causal}, "mask_and");
    }
    if (allowed.empty()) return w_.node("Softmax", {x}, "softmax", [](auto& n) { set_int(n, "axis", -1); });
    const std::string keep = cast(allowed, DType::kU8);
    const std::string as_bool =
        w_.node("Cast", {keep}, "mask_bool", [](auto& n) { set_int(n, "to", onnx::TensorProto::BOOL); });
    const std::string lowest = scalar_like(-std::numeric_limits<float>::infinity(), dtype, "minus_inf");
    const std::string y = w_.node("Softmax", {w_.node("Where", {as_bool, x, lowest}, "masked")}, "softmax",
                                  [](auto& n) { set_int(n, "axis", -1); });
    // Rows with nothing allowed are NaN in ONNX's softmax and zeros in tandem's: the mask's zeros.
    return w_.node("Where", {as_bool, y, scalar_like(0.0, dtype, "zero")}, "masked_softmax");
  }

  void translate(const graph::Node& node) {
    const std::string& op = node.op_name();
    const DType dtype = node.outputs.empty() ? DType::kF32 : node.outputs[0].dtype;
    std::string y;
    if (op == "Variable") {
      const auto it = variables_.find(node.id);
      TANDEM_REQUIRE(it != variables_.end(), Internal, "export to ONNX: variable node {} of no weight", node.label());
      y = w_.initializer(it->second->read_value(), it->second->name());
    } else if (op == "Const") {
      y = w_.initializer(node.attrs.get<Tensor>("value"), w_.fresh(node.name));
    } else if (op == "Fill") {
      const Shape& shape = node.attrs.get<Shape>("shape");
      Tensor t = Tensor::empty(shape, node.attrs.get<DType>("dtype"));
      const Tensor one = ops_scalar(node.attrs.get<double>("value"), t.dtype());
      const std::size_t size = graph::dtype_size(t.dtype());
      for (std::int64_t i = 0; i < t.num_elements(); ++i)
        std::memcpy(static_cast<char*>(t.raw_data()) + static_cast<std::size_t>(i) * size, one.raw_data(), size);
      y = w_.initializer(t, w_.fresh(node.name));
    } else if (op == "Identity" || op == "StopGradient" || op == "Copy" || op == "Dropout") {
      TANDEM_REQUIRE(op != "Dropout" || !node.attrs.get<bool>("training"), Unimplemented,
                     "export to ONNX: {} drops in training mode", node.label());
      y = w_.node("Identity", {in(node, 0)}, "identity");
    } else if (op == "Cast") {
      y = cast(in(node, 0), node.attrs.get<DType>("dtype"));
    } else if (op == "Relu" || op == "Sigmoid" || op == "Tanh" || op == "Exp" || op == "Log" || op == "Sqrt" ||
               op == "Abs" || op == "Neg" || op == "Sign") {
      y = w_.node(op, {in(node, 0)}, op);
    } else if (op == "Square") {
      const std::string x = in(node, 0);
      y = w_.node("Mul", {x, x}, "square");
    } else if (op == "Gelu") {
      y = gelu(in(node, 0), node.attrs.get_or<bool>("approximate", false), dtype);
    } else if (op == "Softmax" || op == "LogSoftmax") {
      y = w_.node(op, {in(node, 0)}, op, [](auto& n) { set_int(n, "axis", -1); });
    } else if (op == "Add" || op == "Sub" || op == "Mul" || op == "Div") {
      y = w_.node(op, {in(node, 0), in(node, 1)}, op);
    } else if (op == "Equal") {
      y = cast(w_.node("Equal", {in(node, 0), in(node, 1)}, "equal"), DType::kU8);
    } else if (op == "AddN") {
      std::vector<std::string> inputs;
      for (std::size_t k = 0; k < node.inputs.size(); ++k) inputs.push_back(in(node, k));
      y = w_.node("Sum", inputs, "sum");
    } else if (op == "BiasAdd") {
      y = w_.node("Add", {in(node, 0), in(node, 1)}, "bias_add");
    } else if (op == "BiasActivation") {
      y = activation(w_.node("Add", {in(node, 0), in(node, 1)}, "bias_add"), node.attrs.get<std::string>("activation"),
                     dtype, node.label());
    } else if (op == "MatMul") {
      y = matmul(in(node, 0), in(node, 1), node.attrs.get<bool>("transpose_a"), node.attrs.get<bool>("transpose_b"), 2,
                 2);
    } else if (op == "BatchMatMul") {
      // Causal attention's triangles (ops::BatchMatMulOptions) as ONNX's Trilu (upper = 0).
      const auto lower = [&](const std::string& x) {
        return w_.node("Trilu", {x}, "lower_triangle", [](auto& n) { set_int(n, "upper", 0); });
      };
      std::string a = in(node, 0);
      if (node.attrs.get_bool_or("a_lower_triangular", false)) a = lower(a);
      y = matmul(a, in(node, 1), node.attrs.get<bool>("adj_x"), node.attrs.get<bool>("adj_y"),
                 node.inputs[0].shape().rank(), node.inputs[1].shape().rank());
      if (node.attrs.get_bool_or("output_lower_triangular", false)) y = lower(y);
    } else if (op == "FusedMatMul") {
      const std::string product = w_.node("MatMul", {in(node, 0), in(node, 1)}, "matmul");
      y = activation(w_.node("Add", {product, in(node, 2)}, "bias_add"), node.attrs.get<std::string>("activation"),
                     dtype, node.label());
    } else if (op == "Conv2D" || op == "FusedConv2D") {
      y = conv(node, op == "FusedConv2D");
    } else if (op == "FusedConv2DMaxPool") {
      y = conv_max_pool(node);
    } else if (op == "MaxPool2D" || op == "AvgPool2D") {
      y = pool(node, op == "MaxPool2D");
    } else if (op == "Reshape") {
      const Shape& shape = node.attrs.get<Shape>("shape");
      std::vector<std::int64_t> dims(shape.dims().begin(), shape.dims().end());
      // One unknown dimension is ONNX's -1 (inferred) too, whether it keeps the batch or merges it
      // with others (Dense on sequences: [-1, features]). With more, the first keeps the input's
      // batch (ONNX's 0, allowzero 0), and one may remain.
      if (std::count(dims.begin(), dims.end(), Shape::kUnknown) > 1) {
        TANDEM_REQUIRE(dims[0] == Shape::kUnknown && node.inputs[0].shape()[0] == Shape::kUnknown &&
                           std::count(dims.begin() + 1, dims.end(), Shape::kUnknown) == 1,
                       Unimplemented, "export to ONNX: {} reshapes to {}, with unknown dimensions ONNX cannot infer",
                       node.label(), shape);
        dims[0] = 0;
      }
      y = w_.node("Reshape", {in(node, 0), w_.int64s(dims, "shape")}, "reshape");
    } else if (op == "Transpose") {
      const auto perm = node.attrs.get<std::vector<std::int64_t>>("perm");
      y = w_.node("Transpose", {in(node, 0)}, "transpose", [&](auto& n) { set_ints(n, "perm", perm); });
    } else if (op == "Concat") {
      std::vector<std::string> inputs;
      for (std::size_t k = 0; k < node.inputs.size(); ++k) inputs.push_back(in(node, k));
      y = w_.node("Concat", inputs, "concat",
                  [&](auto& n) { set_int(n, "axis", node.attrs.get<std::int64_t>("axis")); });
    } else if (op == "Slice") {
      const auto begin = node.attrs.get<std::vector<std::int64_t>>("begin");
      const auto size = node.attrs.get<std::vector<std::int64_t>>("size");
      std::vector<std::int64_t> end;
      for (std::size_t d = 0; d < begin.size(); ++d)
        end.push_back(size[d] < 0 ? std::numeric_limits<std::int64_t>::max() : begin[d] + size[d]);
      y = w_.node("Slice", {in(node, 0), w_.int64s(begin, "starts"), w_.int64s(end, "ends")}, "slice");
    } else if (op == "Gather") {
      y = w_.node("Gather", {in(node, 0), in(node, 1)}, "gather", [](auto& n) { set_int(n, "axis", 0); });
    } else if (op == "ArgMax") {
      y = w_.node("ArgMax", {in(node, 0)}, "argmax", [&](auto& n) {
        set_int(n, "axis", node.attrs.get<std::int64_t>("axis"));
        set_int(n, "keepdims", 0);
      });
    } else if (op == "Sum") {
      y = reduce(node, "ReduceSum");
    } else if (op == "Mean") {
      y = reduce(node, "ReduceMean");
    } else if (op == "Max") {
      y = reduce(node, "ReduceMax");
    } else if (op == "FusedBatchNorm") {
      y = batch_norm(node);
    } else if (op == "LayerNorm") {
      y = layer_norm(node);
    } else if (op == "MaskedSoftmax") {
      y = masked_softmax(node);
    } else {
      throw Unimplemented(fmt::format(
          "export to ONNX: {} has no ONNX form here (exportable: Dense, Conv2D, MaxPooling2D, AveragePooling2D, "
          "BatchNormalization, LayerNormalization, Dropout, Flatten, Reshape, Activation, Add, Embedding, "
          "MultiHeadAttention and the other layers built from the same ops)",
          node.label()));
    }
    bind(node, y);
  }

  const Graph& graph_;
  Writer w_;
  const std::unordered_map<int, VariablePtr>& variables_;
  std::unordered_map<std::int64_t, std::string> names_;
};

void set_value_info(onnx::ValueInfoProto& info, const std::string& name, DType dtype, const Shape& shape) {
  info.set_name(name);
  auto* tensor = info.mutable_type()->mutable_tensor_type();
  tensor->set_elem_type(onnx_type(dtype));
  auto* dims = tensor->mutable_shape();
  for (int d = 0; d < shape.rank(); ++d) {
    auto* dim = dims->add_dim();
    if (shape[d] < 0) {
      dim->set_dim_param(d == 0 ? "batch" : fmt::format("d{}", d));
    } else {
      dim->set_dim_value(shape[d]);
    }
  }
}

}  // namespace

void Model::export_model(const std::string& path, const ExportOptions& options) const {
  TANDEM_REQUIRE(options.format == "onnx", InvalidArgument,
                 "model \"{}\": export format \"{}\"; tandem exports \"onnx\"", state_->name, options.format);
  auto& model = *state_;
  TANDEM_REQUIRE(!model.inputs.empty() && !model.outputs.empty(), FailedPrecondition,
                 "model \"{}\" is not built: give it an Input or call build() before export_model", model.name);
  for (const auto& layer : model.layers) {
    TANDEM_REQUIRE(!layer->tensor_parallel_call(), Unimplemented,
                   "model \"{}\": {} runs tensor-parallel under {}; export the model from one device (load its "
                   "weights into the same model under OneDeviceStrategy)",
                   model.name, layer->class_name() + " \"" + layer->name() + "\"",
                   model.strategy ? model.strategy->name() : "its strategy");
  }
  ops::register_all();
  Graph graph;
  CallContext::VariableNodes variables;
  CallContext ctx(graph, /*training=*/false, variables);
  std::vector<Output> inputs;
  std::vector<std::string> input_names;
  for (std::size_t i = 0; i < model.inputs.size(); ++i) {
    const auto& spec = model.inputs[i].spec();
    Shape shape = spec.shape;
    if (shape.rank() > 0) shape[0] = Shape::kUnknown;
    inputs.push_back(graph.placeholder(spec.dtype, shape, fmt::format("x_{}", i)));
    input_names.push_back(model.inputs[i].node()->input_name.empty() ? fmt::format("input_{}", i)
                                                                     : model.inputs[i].node()->input_name);
  }
  detail::LayerValues values;
  for (std::size_t i = 0; i < model.inputs.size(); ++i) values[model.inputs[i].node().get()] = {inputs[i]};
  {
    auto scope = graph.name_scope("export");
    detail::run_layer_calls(model, ctx, values, 0, model.nodes.size());
  }
  std::vector<Output> outputs;
  for (const auto& out : model.outputs) {
    Output o = values.at(out.node().get())[static_cast<std::size_t>(out.index())];
    // As predict hands them out: 16-bit outputs of a mixed policy as float32.
    if (graph::is_low_precision(o.dtype())) o = ops::cast(o, DType::kF32);
    outputs.push_back(o);
  }

  std::unordered_map<int, VariablePtr> variable_of_node;
  for (const auto& v : variables.variables) variable_of_node[variables.nodes.at(v.get()).node] = v;

  onnx::ModelProto proto;
  proto.set_ir_version(8);  // ONNX 1.10 to 1.12: what opset 17 pairs with
  proto.set_producer_name("tandem");
  proto.set_producer_version(TANDEM_VERSION);
  auto* opset = proto.add_opset_import();
  opset->set_domain("");
  opset->set_version(kOpset);
  auto* g = proto.mutable_graph();
  g->set_name(model.name.empty() ? "model" : model.name);
  Exporter exporter(graph, *g, variable_of_node);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    exporter.name_input(inputs[i], input_names[i]);
    set_value_info(*g->add_input(), input_names[i], inputs[i].dtype(), inputs[i].shape());
  }
  exporter.translate_for(outputs);
  std::set<std::string> output_names;
  for (std::size_t j = 0; j < outputs.size(); ++j) {
    const std::string inner = exporter.value(outputs[j]);
    std::string name = model.outputs[j].node()->layer ? model.outputs[j].node()->layer->name() : "";
    if (name.empty() || !output_names.insert(name).second) name = fmt::format("output_{}", j);
    // An output must be a node's output under its own name: an Identity names it.
    onnx::NodeProto* n = g->add_node();
    n->set_op_type("Identity");
    n->set_name(name + "/output");
    n->add_input(inner);
    n->add_output(name);
    set_value_info(*g->add_output(), name, outputs[j].dtype(), outputs[j].shape());
  }
  try {
    onnx::checker::check_model(proto);
  } catch (const std::exception& e) {
    throw Internal(fmt::format("export to ONNX: model \"{}\" fails ONNX's checker: {}", model.name, e.what()));
  }
  std::string bytes;
  TANDEM_REQUIRE(proto.SerializeToString(&bytes), Internal,
                 "export to ONNX: model \"{}\" does not serialize (over 2 GiB?)", model.name);
  tandem::detail::AtomicFile file(path);
  file.write(bytes.data(), bytes.size());
  file.commit();
}

}  // namespace tandem::keras
