#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "tandem/graph/op_registry.h"
#include "tandem/ops/ops.h"

using namespace tandem;

TEST_CASE("nodes get unique, scoped names and keep their placement") {
  ops::register_all();
  Graph g;
  auto x = g.placeholder(kFloat32, {-1, 4}, "x");
  auto w = g.variable(kFloat32, {4, 3}, "w");
  Output y1, y2, y3;
  {
    auto scope = g.name_scope("dense");
    y1 = ops::matmul(x, w);
    y2 = ops::matmul(x, w);
    auto device = g.device_scope("/device:CPU:0");
    y3 = ops::matmul(x, w);
  }
  CHECK(y1.producer().name == "dense/MatMul");
  CHECK(y2.producer().name == "dense/MatMul_1");
  CHECK(y3.producer().device == "/device:CPU:0");
  CHECK(y1.producer().device.empty());
  CHECK(y1.shape() == Shape{-1, 3});
  CHECK(y1.name() == "dense/MatMul:0");
  CHECK(g.find_node("dense/MatMul_1") == &y2.producer());
  CHECK(g.find_node("nope") == nullptr);
  CHECK(g.to_string().find("dense/MatMul = MatMul(x:0, w:0)") != std::string::npos);
  CHECK_THROWS_AS(g.device_scope("GPU0"), InvalidArgument);
}

TEST_CASE("unknown ops are InvalidArgument, with a suggestion") {
  ops::register_all();
  Graph g;
  auto x = g.placeholder(kFloat32, {2}, "x");
  CHECK_THROWS_WITH_AS(g.add("Matmul", {x, x}), doctest::Contains("unknown op \"Matmul\" ("), InvalidArgument);
  CHECK_THROWS_WITH_AS(g.add("Matmul", {x, x}), doctest::Contains("did you mean \"MatMul\"?"), InvalidArgument);
  CHECK_THROWS_WITH_AS(g.add("Frobnicate", {x}), doctest::Contains("unknown op \"Frobnicate\""), InvalidArgument);
}

TEST_CASE("wrong input counts, foreign inputs and undefined inputs are rejected") {
  ops::register_all();
  Graph g, other;
  auto x = g.placeholder(kFloat32, {2}, "x");
  auto y = other.placeholder(kFloat32, {2}, "y");
  CHECK_THROWS_WITH_AS(g.add("Add", {x}), doctest::Contains("got 1 input(s); expected 2"), InvalidArgument);
  CHECK_THROWS_WITH_AS(g.add("Add", {x, y}), doctest::Contains("belongs to another graph"), InvalidArgument);
  CHECK_THROWS_WITH_AS(g.add("Add", {x, Output{}}), doctest::Contains("input 1 is undefined"), InvalidArgument);
  CHECK_THROWS_AS(g.variable(kFloat32, {-1, 2}, "v"), InvalidArgument);
}

TEST_CASE("constants are copied into the graph") {
  ops::register_all();
  Graph g;
  auto t = Tensor::from_vector<float>({1, 2}, {2});
  auto c = g.constant(t, "c");
  t.data<float>()[0] = 42;
  CHECK(c.producer().attrs.get<Tensor>("value").to_vector<float>() == std::vector<float>{1, 2});
  CHECK(c.shape() == Shape{2});
}

TEST_CASE("the registry lists ops and refuses duplicates") {
  ops::register_all();
  auto names = graph::OpRegistry::global().op_names();
  for (const char* op : {"MatMul",
                         "Add",
                         "Sub",
                         "Mul",
                         "Div",
                         "Neg",
                         "BiasAdd",
                         "Relu",
                         "Sigmoid",
                         "Tanh",
                         "Softmax",
                         "LogSoftmax",
                         "SparseSoftmaxCrossEntropyWithLogits",
                         "SoftmaxCrossEntropyWithLogits",
                         "SigmoidCrossEntropyWithLogits",
                         "Square",
                         "Abs",
                         "Sqrt",
                         "Exp",
                         "Log",
                         "Sum",
                         "Mean",
                         "Max",
                         "Reshape",
                         "Transpose",
                         "Conv2D",
                         "MaxPool2D",
                         "AvgPool2D",
                         "Dropout",
                         "FusedBatchNorm",
                         "Cast",
                         "ArgMax",
                         "Equal",
                         "OneHot",
                         "Fill",
                         "ZerosLike"}) {
    const std::string op_name(op);
    CAPTURE(op_name);
    CHECK(std::find(names.begin(), names.end(), std::string(op)) != names.end());
    const auto& def = graph::OpRegistry::global().get(op);
    CHECK((def.kernel(devices::DeviceType::kCPU) != nullptr || def.forwards_input >= 0));  // Reshape is a view
  }
  CHECK_THROWS_AS(graph::OpRegistry::global().add({.name = "MatMul", .shape_fn = nullptr}), AlreadyExists);
}
