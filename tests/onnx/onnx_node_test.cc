// ONNX operator conformance: the node tests the ONNX project publishes (Debian's libonnx-testdata,
// /usr/include/onnx/backend/test/data/node: per test a model.onnx and test_data_set_N/ with
// input_K.pb and output_K.pb TensorProtos) as an oracle for tandem's kernels that nobody here
// wrote.
//
// Each test's graph is rebuilt from tandem's ops (ONNX's NCHW convolutions and pooling through
// transposes to tandem's NHWC, ONNX attributes to tandem's options), run on every device this
// build can use (the CPU; a GPU where present), and its outputs compared as ONNX's own backend
// runner compares them (numpy.testing.assert_allclose, rtol 1e-3, atol 1e-7; shapes exact).
//
// Every test ends in one of three states, each printed with its reason and written, one line per
// test, to onnx_node_results.txt in the working folder:
//   pass   every output within tolerance on every device;
//   skip   an operator, attribute, dtype or input tandem does not implement (named), or a case
//          tandem's op refuses with a typed error (its message) — ONNX semantics tandem lacks;
//   fail   a wrong value, a wrong shape, or any other error.
// The suite fails on any failure not in kKnownFailures (each with its reason), and when fewer
// than kMinimumPasses tests pass (the bar: 80 on the CPU).
//
// TANDEM_ONNX_NODE_DATA overrides the data folder; a missing folder fails, naming it
// (scripts/install-deps.sh installs libonnx-testdata).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <onnx/onnx_pb.h>

#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/ops/ops.h"

namespace {

namespace fs = std::filesystem;
using tandem::Tensor;
using tandem::graph::DType;
using tandem::graph::Graph;
using tandem::graph::Output;
using tandem::graph::Shape;
namespace ops = tandem::ops;

constexpr double kRtol = 1e-3, kAtol = 1e-7;  // onnx/backend/test/runner's defaults
constexpr int kMinimumPasses = 80;

// Failures understood and not fixed yet: test name -> why. Empty: every failure found was fixed.
const std::map<std::string, std::string> kKnownFailures = {};

// What tandem does not implement, thrown by a mapper: the test is skipped with this reason.
struct Unsupported {
  std::string reason;
};

// ----- TensorProto <-> Tensor --------------------------------------------------------------------

std::string onnx_type_name(int type) {
  return onnx::TensorProto_DataType_IsValid(type)
             ? onnx::TensorProto_DataType_Name(static_cast<onnx::TensorProto_DataType>(type))
             : fmt::format("type {}", type);
}

DType dtype_of(int type) {
  switch (type) {
    case onnx::TensorProto::FLOAT: return DType::kF32;
    case onnx::TensorProto::DOUBLE: return DType::kF64;
    case onnx::TensorProto::INT32: return DType::kI32;
    case onnx::TensorProto::INT64: return DType::kI64;
    case onnx::TensorProto::BOOL: return DType::kU8;  // tandem stores booleans as uint8
    case onnx::TensorProto::FLOAT16: return DType::kF16;
    case onnx::TensorProto::BFLOAT16: return DType::kBF16;
    default:
      throw Unsupported{
          fmt::format("dtype {} (tandem has float32/64, float16, bfloat16, int32/64, bool)", onnx_type_name(type))};
  }
}

// Booleans and uint8 share tandem's kU8; ONNX's UINT8 is not a boolean, and tandem's arithmetic
// on it is not ONNX's (no wrap-around contract): refused above rather than half-supported.

Tensor from_proto(const onnx::TensorProto& proto) {
  const DType dtype = dtype_of(proto.data_type());
  std::vector<std::int64_t> dims(proto.dims().begin(), proto.dims().end());
  const Shape shape(dims);
  Tensor out = Tensor::zeros(shape, dtype);
  const auto n = static_cast<std::size_t>(shape.num_elements());
  const std::size_t size = tandem::graph::dtype_size(dtype);
  auto* dst = static_cast<unsigned char*>(out.raw_data());
  if (proto.has_raw_data()) {
    REQUIRE_MESSAGE(proto.raw_data().size() == n * size, "raw_data of ", proto.name(), " has the wrong size");
    std::memcpy(dst, proto.raw_data().data(), n * size);
    return out;
  }
  for (std::size_t i = 0; i < n; ++i) {
    switch (proto.data_type()) {
      case onnx::TensorProto::FLOAT: reinterpret_cast<float*>(dst)[i] = proto.float_data(static_cast<int>(i)); break;
      case onnx::TensorProto::DOUBLE: reinterpret_cast<double*>(dst)[i] = proto.double_data(static_cast<int>(i)); break;
      case onnx::TensorProto::INT64:
        reinterpret_cast<std::int64_t*>(dst)[i] = proto.int64_data(static_cast<int>(i));
        break;
      case onnx::TensorProto::INT32:
        reinterpret_cast<std::int32_t*>(dst)[i] = proto.int32_data(static_cast<int>(i));
        break;
      case onnx::TensorProto::BOOL: dst[i] = static_cast<unsigned char>(proto.int32_data(static_cast<int>(i))); break;
      default: {  // float16 / bfloat16: the bits in int32_data
        const auto bits = static_cast<std::uint16_t>(proto.int32_data(static_cast<int>(i)));
        std::memcpy(dst + i * 2, &bits, 2);
      }
    }
  }
  return out;
}

onnx::TensorProto read_tensor_proto(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  onnx::TensorProto proto;
  REQUIRE_MESSAGE(proto.ParseFromIstream(&in), "cannot parse ", path.string());
  return proto;
}

// Every element as a double (host copy), for comparison.
std::vector<double> doubles(const Tensor& tensor) {
  const Tensor t = tensor.to(tandem::devices::default_cpu_device());
  const auto n = static_cast<std::size_t>(t.num_elements());
  std::vector<double> out(n);
  const void* src = t.raw_data();
  switch (t.dtype()) {
    case DType::kF32:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<const float*>(src)[i];
      break;
    case DType::kF64:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<const double*>(src)[i];
      break;
    case DType::kI32:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<const std::int32_t*>(src)[i];
      break;
    case DType::kI64:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<const std::int64_t*>(src)[i]);
      break;
    case DType::kU8:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<const unsigned char*>(src)[i];
      break;
    case DType::kF16:
    case DType::kBF16: {
      std::vector<float> wide(n);
      tandem::graph::widen_to_float32(t.dtype(), src, wide.data(), static_cast<std::int64_t>(n));
      for (std::size_t i = 0; i < n; ++i) out[i] = wide[i];
      break;
    }
  }
  return out;
}

std::vector<std::int64_t> int64s(const Tensor& t) {
  std::vector<std::int64_t> out;
  for (const double v : doubles(t)) out.push_back(static_cast<std::int64_t>(v));
  return out;
}

// ----- one node ----------------------------------------------------------------------------------

// What a mapper sees: the node, its inputs as graph values, and the values known when the graph is
// built (the test's inputs, Constant nodes), which ONNX passes as tensors where tandem takes
// attributes (Reshape's shape, Slice's starts, ReduceSum's axes, OneHot's depth).
struct NodeContext {
  const onnx::NodeProto& node;
  int opset = 0;
  Graph& graph;
  std::vector<Output> inputs;                // an undefined Output for an omitted optional input
  std::vector<std::optional<Tensor>> known;  // per input: its value when known at build time
  std::set<std::string> read;                // the attributes the mapper looked at
  std::map<int, Tensor> known_outputs;       // outputs whose values the mapper knows (Shape's)

  const onnx::AttributeProto* attribute(const std::string& name) {
    read.insert(name);
    for (const auto& a : node.attribute())
      if (a.name() == name) return &a;
    return nullptr;
  }
  std::int64_t i(const std::string& name, std::int64_t fallback) {
    const auto* a = attribute(name);
    return a ? a->i() : fallback;
  }
  double f(const std::string& name, double fallback) {
    const auto* a = attribute(name);
    return a ? a->f() : fallback;
  }
  std::string s(const std::string& name, const std::string& fallback) {
    const auto* a = attribute(name);
    return a ? a->s() : fallback;
  }
  std::optional<std::vector<std::int64_t>> ints(const std::string& name) {
    const auto* a = attribute(name);
    if (!a) return std::nullopt;
    return std::vector<std::int64_t>(a->ints().begin(), a->ints().end());
  }
  bool has(std::size_t k) const { return k < inputs.size() && inputs[k].defined(); }
  Output in(std::size_t k) const {
    if (!has(k)) throw Unsupported{fmt::format("input {} is required", k)};
    return inputs[k];
  }
  std::vector<std::int64_t> constant(std::size_t k) const {
    if (k >= known.size() || !known[k]) throw Unsupported{fmt::format("input {} computed in the graph", k)};
    return int64s(*known[k]);
  }
  std::vector<double> constant_values(std::size_t k) const {
    if (k >= known.size() || !known[k]) throw Unsupported{fmt::format("input {} computed in the graph", k)};
    return doubles(*known[k]);
  }
  // Refuses an attribute whose value changes the result and that the mapper does not handle.
  void refuse_if(bool condition, const std::string& what) const {
    if (condition) throw Unsupported{what};
  }
};

using Mapper = std::function<std::vector<Output>(NodeContext&)>;

int rank_of(const Output& x) { return x.shape().rank(); }

std::int64_t normalized_axis(std::int64_t axis, int rank) { return axis < 0 ? axis + rank : axis; }

std::vector<std::int64_t> iota(int n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// The permutation that moves `axis` to the end, and its inverse.
std::vector<std::int64_t> axis_to_last(int rank, std::int64_t axis) {
  std::vector<std::int64_t> perm;
  for (int d = 0; d < rank; ++d)
    if (d != axis) perm.push_back(d);
  perm.push_back(axis);
  return perm;
}
std::vector<std::int64_t> inverse(const std::vector<std::int64_t>& perm) {
  std::vector<std::int64_t> inv(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inv[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i);
  return inv;
}

std::int64_t product(const Shape& s, int from, int to) {
  std::int64_t p = 1;
  for (int d = from; d < to; ++d) p *= s[d];
  return p;
}

Shape shape_of(const std::vector<std::int64_t>& dims) { return Shape(dims); }

// f applied along `axis` of x when f works on the last axis only.
Output along_axis(Output x, std::int64_t axis, const std::function<Output(Output)>& f) {
  const int rank = rank_of(x);
  if (axis == rank - 1) return f(x);
  const auto perm = axis_to_last(rank, axis);
  return ops::transpose(f(ops::transpose(x, perm)), inverse(perm));
}

// Softmax and LogSoftmax: from opset 13 along `axis` (default -1); before, over the 2-D
// coercion of x at `axis` (default 1).
Mapper softmax_like(bool log) {
  return [log](NodeContext& c) -> std::vector<Output> {
    const Output x = c.in(0);
    const int rank = rank_of(x);
    const auto f = [log](Output v) { return log ? ops::log_softmax(v) : ops::softmax(v); };
    if (c.opset >= 13) return {along_axis(x, normalized_axis(c.i("axis", -1), rank), f)};
    const auto axis = static_cast<int>(normalized_axis(c.i("axis", 1), rank));
    const Shape flat{product(x.shape(), 0, axis), product(x.shape(), axis, rank)};
    return {ops::reshape(f(ops::reshape(x, flat)), x.shape())};
  };
}

Mapper unary(Output (*f)(Output)) {
  return [f](NodeContext& c) -> std::vector<Output> { return {f(c.in(0))}; };
}
Mapper binary(Output (*f)(Output, Output)) {
  return [f](NodeContext& c) -> std::vector<Output> { return {f(c.in(0), c.in(1))}; };
}

// ONNX's reductions: axes as an attribute (before opset 13 for ReduceSum, 18 for the others) or
// an input; keepdims (default 1); ReduceSum's noop_with_empty_axes.
Mapper reduction(Output (*f)(Output, const ops::ReduceOptions&), bool square, int axes_input_from) {
  return [=](NodeContext& c) -> std::vector<Output> {
    Output x = c.in(0);
    if (square) x = ops::square(x);
    std::vector<std::int64_t> axes;
    if (c.opset >= axes_input_from) {
      if (c.has(1)) axes = c.constant(1);
    } else if (auto a = c.ints("axes")) {
      axes = *a;
    }
    const bool keep = c.i("keepdims", 1) != 0;
    if (axes.empty() && c.i("noop_with_empty_axes", 0) != 0) return {ops::identity(x)};
    for (auto& a : axes) a = normalized_axis(a, rank_of(x));
    return {f(x, {.axes = axes, .keep_dims = keep})};
  };
}

std::vector<Output> gemm(NodeContext& c) {
  const double alpha = c.f("alpha", 1.0), beta = c.f("beta", 1.0);
  Output y =
      ops::matmul(c.in(0), c.in(1), {.transpose_a = c.i("transA", 0) != 0, .transpose_b = c.i("transB", 0) != 0});
  if (alpha != 1.0) y = ops::mul(y, ops::scalar_like(y, alpha));
  if (c.has(2)) {
    Output bias = c.in(2);
    if (beta != 1.0) bias = ops::mul(bias, ops::scalar_like(bias, beta));
    y = ops::add(y, bias);
  }
  return {y};
}

std::vector<Output> matmul(NodeContext& c) {
  const Output a = c.in(0), b = c.in(1);
  c.refuse_if(rank_of(a) < 2 || rank_of(b) < 2, "MatMul of a vector (tandem's products take matrices)");
  if (rank_of(a) == 2 && rank_of(b) == 2) return {ops::matmul(a, b)};
  return {ops::batch_matmul(a, b)};
}

std::vector<Output> transpose(NodeContext& c) {
  const Output x = c.in(0);
  auto perm = c.ints("perm");
  if (!perm) {
    perm = iota(rank_of(x));
    std::reverse(perm->begin(), perm->end());
  }
  return {ops::transpose(x, *perm)};
}

std::vector<Output> reshape(NodeContext& c) {
  const Output x = c.in(0);
  auto dims = c.constant(1);
  const bool allow_zero = c.i("allowzero", 0) != 0;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] == 0 && !allow_zero) dims[d] = x.shape()[static_cast<int>(d)];  // 0: copy the input's
  }
  return {ops::reshape(x, shape_of(dims))};
}

std::vector<Output> flatten(NodeContext& c) {
  const Output x = c.in(0);
  const int rank = rank_of(x);
  const auto axis = static_cast<int>(normalized_axis(c.i("axis", 1), rank));
  return {ops::reshape(x, Shape{product(x.shape(), 0, axis), product(x.shape(), axis, rank)})};
}

std::vector<Output> squeeze(NodeContext& c) {
  const Output x = c.in(0);
  const int rank = rank_of(x);
  std::vector<std::int64_t> axes = c.opset >= 13 ? (c.has(1) ? c.constant(1) : std::vector<std::int64_t>{})
                                                 : c.ints("axes").value_or(std::vector<std::int64_t>{});
  std::set<std::int64_t> drop;
  for (const auto a : axes) drop.insert(normalized_axis(a, rank));
  std::vector<std::int64_t> dims;
  for (int d = 0; d < rank; ++d) {
    const bool dropped = axes.empty() ? x.shape()[d] == 1 : drop.count(d) > 0;
    if (!dropped) dims.push_back(x.shape()[d]);
  }
  return {ops::reshape(x, shape_of(dims))};
}

std::vector<Output> unsqueeze(NodeContext& c) {
  const Output x = c.in(0);
  const std::vector<std::int64_t> axes =
      c.opset >= 13 ? c.constant(1) : c.ints("axes").value_or(std::vector<std::int64_t>{});
  const int rank = rank_of(x) + static_cast<int>(axes.size());
  std::set<std::int64_t> added;
  for (const auto a : axes) added.insert(normalized_axis(a, rank));
  std::vector<std::int64_t> dims;
  int next = 0;
  for (int d = 0; d < rank; ++d) dims.push_back(added.count(d) ? 1 : x.shape()[next++]);
  return {ops::reshape(x, shape_of(dims))};
}

std::vector<Output> cast(NodeContext& c) {
  const auto to = c.i("to", 0);
  c.refuse_if(to == onnx::TensorProto::BOOL, "Cast to BOOL (tandem's uint8 is not a boolean cast)");
  return {ops::cast(c.in(0), dtype_of(static_cast<int>(to)))};
}

std::vector<Output> argmax(NodeContext& c) {
  const Output x = c.in(0);
  c.refuse_if(c.i("select_last_index", 0) != 0, "ArgMax select_last_index=1 (tandem takes the first on ties)");
  const auto axis = normalized_axis(c.i("axis", 0), rank_of(x));
  Output y = ops::argmax(x, static_cast<int>(axis));
  if (c.i("keepdims", 1) != 0) {
    std::vector<std::int64_t> dims(x.shape().dims().begin(), x.shape().dims().end());
    dims[static_cast<std::size_t>(axis)] = 1;
    y = ops::reshape(y, shape_of(dims));
  }
  return {y};
}

std::vector<Output> one_hot(NodeContext& c) {
  const Output indices = c.in(0);
  const auto depth = c.constant(1).at(0);
  const auto values = c.constant_values(2);
  for (const auto i : c.constant(0)) {
    c.refuse_if(i < 0, "OneHot of negative indices (tandem follows TF: an index out of [0, depth) is an all-off row)");
  }
  const Output index =
      indices.dtype() == DType::kI32 || indices.dtype() == DType::kI64 ? indices : ops::cast(indices, DType::kI64);
  Output y = ops::one_hot(index, depth, values.at(1), values.at(0));
  const int rank = rank_of(y);
  const auto axis = normalized_axis(c.i("axis", -1), rank);
  if (axis != rank - 1) {
    // one_hot puts the new axis last; ONNX puts it at `axis`.
    std::vector<std::int64_t> perm;
    for (int d = 0; d < rank - 1; ++d) {
      if (d == axis) perm.push_back(rank - 1);
      perm.push_back(d);
    }
    y = ops::transpose(y, perm);
  }
  return {y};
}

std::vector<Output> gather(NodeContext& c) {
  const Output data = c.in(0), indices = c.in(1);
  for (const auto i : c.constant(1)) c.refuse_if(i < 0, "Gather of negative indices (tandem refuses ids below 0)");
  const int rank = rank_of(data);
  const auto axis = normalized_axis(c.i("axis", 0), rank);
  if (axis == 0) return {ops::gather(data, indices)};
  // Move `axis` to the front, gather, and move the index dimensions back to where `axis` was.
  std::vector<std::int64_t> front{axis};
  for (int d = 0; d < rank; ++d)
    if (d != axis) front.push_back(d);
  const Output g = ops::gather(ops::transpose(data, front), indices);
  const int k = rank_of(indices);
  std::vector<std::int64_t> perm;
  for (int d = 0; d < axis; ++d) perm.push_back(k + d);
  for (int d = 0; d < k; ++d) perm.push_back(d);
  for (int d = static_cast<int>(axis) + 1; d < rank; ++d) perm.push_back(k + d - 1);
  return {ops::transpose(g, perm)};
}

std::vector<Output> concat(NodeContext& c) {
  std::vector<Output> xs;
  for (std::size_t k = 0; k < c.inputs.size(); ++k) xs.push_back(c.in(k));
  return {ops::concat(xs, static_cast<int>(c.i("axis", 0)))};
}

// Slice (opset 10+): starts, ends, axes, steps as inputs; ends clamp to the dimension.
std::vector<Output> slice(NodeContext& c) {
  const Output x = c.in(0);
  const int rank = rank_of(x);
  c.refuse_if(c.opset < 10, "Slice before opset 10");
  const auto starts = c.constant(1), ends = c.constant(2);
  const auto axes = c.has(3) ? c.constant(3) : iota(static_cast<int>(starts.size()));
  const auto steps = c.has(4) ? c.constant(4) : std::vector<std::int64_t>(starts.size(), 1);
  std::vector<std::int64_t> begin(static_cast<std::size_t>(rank), 0), size(static_cast<std::size_t>(rank), -1);
  for (std::size_t k = 0; k < starts.size(); ++k) {
    c.refuse_if(steps[k] != 1, "Slice with steps other than 1 (tandem's slice is contiguous)");
    const auto d = static_cast<std::size_t>(normalized_axis(axes[k], rank));
    const std::int64_t n = x.shape()[static_cast<int>(d)];
    const auto clamp = [n](std::int64_t v) { return std::clamp(v < 0 ? v + n : v, std::int64_t{0}, n); };
    const std::int64_t b = clamp(starts[k]), e = clamp(ends[k]);
    begin[d] = b;
    size[d] = std::max<std::int64_t>(e - b, 0);
  }
  return {ops::slice(x, begin, size)};
}

std::vector<Output> sum(NodeContext& c) {
  Output y = c.in(0);
  for (std::size_t k = 1; k < c.inputs.size(); ++k) y = ops::add(y, c.in(k));
  return {c.inputs.size() == 1 ? ops::identity(y) : y};
}

// Zero (or `value`) padding of an NHWC tensor's height and width, [top, left, bottom, right].
Output pad_hw(Output x, const std::vector<std::int64_t>& pads, double value) {
  Graph& g = *x.graph;
  for (const int d : {1, 2}) {
    const auto before = pads[static_cast<std::size_t>(d - 1)], after = pads[static_cast<std::size_t>(d + 1)];
    if (before == 0 && after == 0) continue;
    const auto block = [&](std::int64_t n) {
      std::vector<std::int64_t> dims(x.shape().dims().begin(), x.shape().dims().end());
      dims[static_cast<std::size_t>(d)] = n;
      return ops::fill(g, shape_of(dims), value, x.dtype());
    };
    std::vector<Output> parts;
    if (before > 0) parts.push_back(block(before));
    parts.push_back(x);
    if (after > 0) parts.push_back(block(after));
    x = ops::concat(parts, d);
  }
  return x;
}

// The padding of a 2-D window op: kSame when ONNX's auto_pad or pads equal TF's SAME (extra at the
// end), kValid with explicit pads applied first otherwise. Returns {padding, pads to apply}.
struct WindowPadding {
  ops::Padding padding = ops::Padding::kValid;
  std::vector<std::int64_t> explicit_pads{0, 0, 0, 0};
};
WindowPadding window_padding(NodeContext& c, const Shape& nchw, const std::vector<std::int64_t>& kernel,
                             const std::vector<std::int64_t>& strides) {
  const std::string auto_pad = c.s("auto_pad", "NOTSET");
  WindowPadding out;
  if (auto_pad == "SAME_UPPER") {
    out.padding = ops::Padding::kSame;
    return out;
  }
  if (auto_pad == "VALID") return out;
  c.refuse_if(auto_pad != "NOTSET",
              fmt::format("auto_pad {} (tandem's SAME pads at the end, as SAME_UPPER)", auto_pad));
  const auto pads = c.ints("pads").value_or(std::vector<std::int64_t>{0, 0, 0, 0});
  // TF's SAME for these sizes, as [top, left, bottom, right].
  std::vector<std::int64_t> same(4);
  for (int d = 0; d < 2; ++d) {
    const std::int64_t in = nchw[2 + d], s = strides[static_cast<std::size_t>(d)];
    const std::int64_t total =
        std::max<std::int64_t>((((in + s - 1) / s) - 1) * s + kernel[static_cast<std::size_t>(d)] - in, 0);
    same[static_cast<std::size_t>(d)] = total / 2;
    same[static_cast<std::size_t>(d) + 2] = total - total / 2;
  }
  if (pads == same && std::any_of(pads.begin(), pads.end(), [](auto p) { return p != 0; })) {
    out.padding = ops::Padding::kSame;
    return out;
  }
  out.explicit_pads = pads;
  return out;
}

Output to_nhwc(Output x) { return ops::transpose(x, {0, 2, 3, 1}); }
Output to_nchw(Output x) { return ops::transpose(x, {0, 3, 1, 2}); }

std::vector<Output> conv(NodeContext& c) {
  const Output x = c.in(0), w = c.in(1);
  c.refuse_if(rank_of(x) != 4, fmt::format("Conv of rank {} (tandem's convolutions are 2-D)", rank_of(x)));
  c.refuse_if(c.i("group", 1) != 1, "Conv with group > 1");
  const auto dilations = c.ints("dilations").value_or(std::vector<std::int64_t>{1, 1});
  c.refuse_if(dilations != std::vector<std::int64_t>{1, 1}, "Conv with dilations");
  const auto strides = c.ints("strides").value_or(std::vector<std::int64_t>{1, 1});
  const std::vector<std::int64_t> kernel{w.shape()[2], w.shape()[3]};
  c.ints("kernel_shape");  // implied by the filter
  const auto padding = window_padding(c, x.shape(), kernel, strides);
  const Output input = pad_hw(to_nhwc(x), padding.explicit_pads, 0.0);
  Output y = ops::conv2d(input, ops::transpose(w, {2, 3, 1, 0}),
                         {.strides = {strides[0], strides[1]}, .padding = padding.padding});
  y = to_nchw(y);
  if (c.has(2)) y = ops::add(y, ops::reshape(c.in(2), Shape{1, w.shape()[0], 1, 1}));
  return {y};
}

Mapper pool(bool max) {
  return [max](NodeContext& c) -> std::vector<Output> {
    const Output x = c.in(0);
    c.refuse_if(rank_of(x) != 4, fmt::format("pooling of rank {} (tandem's pooling is 2-D)", rank_of(x)));
    c.refuse_if(c.node.output_size() > 1, "MaxPool's Indices output");
    c.refuse_if(c.i("ceil_mode", 0) != 0, "ceil_mode=1");
    c.refuse_if(c.i("storage_order", 0) != 0, "storage_order=1");
    const auto dilations = c.ints("dilations").value_or(std::vector<std::int64_t>{1, 1});
    c.refuse_if(dilations != std::vector<std::int64_t>{1, 1}, "pooling with dilations");
    const auto kernel = c.ints("kernel_shape").value();
    const auto strides = c.ints("strides").value_or(std::vector<std::int64_t>{1, 1});
    const auto padding = window_padding(c, x.shape(), kernel, strides);
    const bool padded =
        std::any_of(padding.explicit_pads.begin(), padding.explicit_pads.end(), [](auto p) { return p != 0; });
    const bool include_pad = c.i("count_include_pad", 0) != 0;
    if (!max) {
      // Explicit zero padding counts the pads; TF's SAME (tandem's) does not.
      c.refuse_if(padded && !include_pad, "AveragePool with explicit pads not counted (count_include_pad=0)");
      c.refuse_if(padding.padding == ops::Padding::kSame && include_pad, "AveragePool SAME with count_include_pad=1");
    }
    const Output input = pad_hw(to_nhwc(x), padding.explicit_pads, max ? -INFINITY : 0.0);
    const ops::Pool2DOptions options{
        .pool_size = {kernel[0], kernel[1]}, .strides = {strides[0], strides[1]}, .padding = padding.padding};
    return {to_nchw(max ? ops::max_pool2d(input, options) : ops::avg_pool2d(input, options))};
  };
}

Mapper global_pool(bool max) {
  return [max](NodeContext& c) -> std::vector<Output> {
    const Output x = c.in(0);
    std::vector<std::int64_t> axes;
    for (int d = 2; d < rank_of(x); ++d) axes.push_back(d);
    const ops::ReduceOptions options{.axes = axes, .keep_dims = true};
    return {max ? ops::reduce_max(x, options) : ops::reduce_mean(x, options)};
  };
}

// BatchNormalization in inference mode over the channel axis 1.
std::vector<Output> batch_norm(NodeContext& c) {
  c.refuse_if(c.i("training_mode", 0) != 0 || c.node.output_size() > 1, "BatchNormalization training_mode");
  c.f("momentum", 0.9);  // only training mode uses it
  const Output x = c.in(0);
  const auto y = along_axis(x, 1, [&](Output v) {
    return ops::fused_batch_norm(v, c.in(1), c.in(2), c.in(3), c.in(4),
                                 {.epsilon = c.f("epsilon", 1e-5), .training = false})
        .y;
  });
  return {y};
}

// LayerNormalization (opset 17): over axes [axis, rank), through a 2-D view.
// Its optional Mean and InvStdDev outputs (kept for training) are computed from tandem's reductions:
// layer_norm keeps its own per-row statistics internal.
std::vector<Output> layer_norm(NodeContext& c) {
  c.refuse_if(c.i("stash_type", 1) != 1, "LayerNormalization stash_type other than float32");
  const Output x = c.in(0);
  const int rank = rank_of(x);
  const auto axis = static_cast<int>(normalized_axis(c.i("axis", -1), rank));
  const double epsilon = c.f("epsilon", 1e-5);
  const std::int64_t inner = product(x.shape(), axis, rank);
  const Shape flat{product(x.shape(), 0, axis), inner};
  const Output scale = ops::reshape(c.in(1), Shape{inner});
  const Output bias = c.has(2) ? ops::reshape(c.in(2), Shape{inner}) : Output{};
  std::vector<Output> out{
      ops::reshape(ops::layer_norm(ops::reshape(x, flat), scale, bias, {.epsilon = epsilon}), x.shape())};
  if (c.node.output_size() > 1) {
    std::vector<std::int64_t> axes;
    for (int d = axis; d < rank; ++d) axes.push_back(d);
    const Output mean = ops::reduce_mean(x, {.axes = axes, .keep_dims = true});
    const Output variance = ops::reduce_mean(ops::square(ops::sub(x, mean)), {.axes = axes, .keep_dims = true});
    out.push_back(mean);
    out.push_back(
        ops::div(ops::scalar_like(variance, 1.0), ops::sqrt(ops::add(variance, ops::scalar_like(variance, epsilon)))));
  }
  return out;
}

// Dropout at inference: the identity, and an all-true mask when asked for.
std::vector<Output> dropout(NodeContext& c) {
  c.refuse_if(c.has(2) && c.constant(2).at(0) != 0, "Dropout training_mode");
  c.f("ratio", 0.5);
  c.i("seed", 0);
  const Output x = c.in(0);
  std::vector<Output> out{ops::identity(x)};
  if (c.node.output_size() > 1) out.push_back(ops::fill(c.graph, x.shape(), 1.0, DType::kU8));
  return out;
}

// Constant: a tensor, or one of the scalar and list forms (value_float, value_ints, ...).
std::vector<Output> constant(NodeContext& c) {
  Tensor value;
  if (const auto* t = c.attribute("value")) {
    value = from_proto(t->t());
  } else if (const auto* f = c.attribute("value_float")) {
    value = Tensor::scalar<float>(f->f());
  } else if (const auto* fs = c.attribute("value_floats")) {
    value = Tensor::from_vector(std::vector<float>(fs->floats().begin(), fs->floats().end()), Shape{fs->floats_size()});
  } else if (const auto* i = c.attribute("value_int")) {
    value = Tensor::scalar<std::int64_t>(i->i());
  } else if (const auto* is = c.attribute("value_ints")) {
    value =
        Tensor::from_vector(std::vector<std::int64_t>(is->ints().begin(), is->ints().end()), Shape{is->ints_size()});
  } else {
    throw Unsupported{"Constant of a string or sparse value"};
  }
  c.known_outputs.emplace(0, value);
  return {c.graph.constant(value)};
}

// Shape: known when the graph is built (tandem's graphs have static shapes), so a constant.
std::vector<Output> shape(NodeContext& c) {
  const Output x = c.in(0);
  const int rank = rank_of(x);
  const auto clamp = [rank](std::int64_t v) { return std::clamp<std::int64_t>(v < 0 ? v + rank : v, 0, rank); };
  const std::int64_t begin = clamp(c.i("start", 0)), end = clamp(c.i("end", rank));
  std::vector<std::int64_t> dims;
  for (std::int64_t d = begin; d < end; ++d) dims.push_back(x.shape()[static_cast<int>(d)]);
  const Tensor value = Tensor::from_vector(dims, Shape{static_cast<std::int64_t>(dims.size())});
  c.known_outputs.emplace(0, value);
  return {c.graph.constant(value)};
}

// ConstantOfShape: tandem's fill, of the shape and dtype given.
std::vector<Output> constant_of_shape(NodeContext& c) {
  const auto dims = c.constant(0);
  double fill = 0.0;
  DType dtype = DType::kF32;
  if (const auto* v = c.attribute("value")) {
    const Tensor t = from_proto(v->t());
    fill = doubles(t).at(0);
    dtype = t.dtype();
  }
  return {ops::fill(c.graph, shape_of(dims), fill, dtype)};
}

const std::map<std::string, Mapper>& mappers() {
  static const std::map<std::string, Mapper> table = {
      {"Abs", unary(ops::abs)},
      {"Add", binary(ops::add)},
      {"ArgMax", argmax},
      {"AveragePool", pool(false)},
      {"BatchNormalization", batch_norm},
      {"Cast", cast},
      {"Concat", concat},
      {"Constant", constant},
      {"ConstantOfShape", constant_of_shape},
      {"Conv", conv},
      {"Div", binary(ops::div)},
      {"Dropout", dropout},
      {"Equal", binary(ops::equal)},
      {"Exp", unary(ops::exp)},
      {"Flatten", flatten},
      {"Gather", gather},
      {"Gemm", gemm},
      {"GlobalAveragePool", global_pool(false)},
      {"GlobalMaxPool", global_pool(true)},
      {"Identity", unary(ops::identity)},
      {"LayerNormalization", layer_norm},
      {"Log", unary(ops::log)},
      {"LogSoftmax", softmax_like(true)},
      {"MatMul", matmul},
      {"MaxPool", pool(true)},
      {"Mul", binary(ops::mul)},
      {"Neg", unary(ops::neg)},
      {"OneHot", one_hot},
      {"ReduceMax", reduction(ops::reduce_max, false, 18)},
      {"ReduceMean", reduction(ops::reduce_mean, false, 18)},
      {"ReduceSum", reduction(ops::reduce_sum, false, 13)},
      {"ReduceSumSquare", reduction(ops::reduce_sum, true, 18)},
      {"Relu", unary(ops::relu)},
      {"Reshape", reshape},
      {"Shape", shape},
      {"Sigmoid", unary(ops::sigmoid)},
      {"Sign", unary(ops::sign)},
      {"Slice", slice},
      {"Softmax", softmax_like(false)},
      {"Sqrt", unary(ops::sqrt)},
      {"Squeeze", squeeze},
      {"Sub", binary(ops::sub)},
      {"Sum", sum},
      {"Tanh", unary(ops::tanh)},
      {"Transpose", transpose},
      {"Unsqueeze", unsqueeze},
  };
  return table;
}

// ----- one test ----------------------------------------------------------------------------------

enum class Outcome { kPass, kSkip, kFail };
struct Result {
  std::string test;
  Outcome outcome = Outcome::kPass;
  std::string reason;
  std::set<std::string> op_types;
};

int opset_of(const onnx::ModelProto& model) {
  for (const auto& o : model.opset_import())
    if (o.domain().empty() || o.domain() == "ai.onnx") return static_cast<int>(o.version());
  return 0;
}

// Builds the test's graph with the values of one data set known, runs it on `device`, and
// compares with the expected outputs. Throws Unsupported, or returns "" / what differs.
std::string run_data_set(const onnx::ModelProto& model, const fs::path& data_set, tandem::devices::Device& device) {
  const auto& g = model.graph();
  std::set<std::string> initializers;
  auto graph = std::make_shared<Graph>();
  std::map<std::string, Output> values;
  std::map<std::string, Tensor> known;
  for (const auto& init : g.initializer()) {
    Tensor t = from_proto(init);
    values[init.name()] = graph->constant(t);
    known.emplace(init.name(), t);
    initializers.insert(init.name());
  }
  std::vector<tandem::graph::Feed> feeds;
  int k = 0;
  for (const auto& input : g.input()) {
    if (initializers.count(input.name())) continue;
    const fs::path file = data_set / fmt::format("input_{}.pb", k++);
    if (!input.type().has_tensor_type()) throw Unsupported{"a non-tensor input (sequence or optional)"};
    Tensor t = from_proto(read_tensor_proto(file));
    const Output p = graph->placeholder(t.dtype(), t.shape(), input.name());
    values[input.name()] = p;
    known.emplace(input.name(), t);
    feeds.emplace_back(p, t.to(device));
  }
  const int opset = opset_of(model);
  for (const auto& node : g.node()) {
    if (!node.domain().empty() && node.domain() != "ai.onnx") throw Unsupported{"domain " + node.domain()};
    const auto it = mappers().find(node.op_type());
    if (it == mappers().end()) throw Unsupported{node.op_type() + " not implemented"};
    NodeContext c{
        .node = node, .opset = opset, .graph = *graph, .inputs = {}, .known = {}, .read = {}, .known_outputs = {}};
    for (const auto& name : node.input()) {
      if (name.empty()) {
        c.inputs.emplace_back();
        c.known.emplace_back();
        continue;
      }
      c.inputs.push_back(values.at(name));
      const auto kv = known.find(name);
      c.known.push_back(kv == known.end() ? std::nullopt : std::optional<Tensor>(kv->second));
    }
    auto outputs = it->second(c);
    for (const auto& a : node.attribute()) {
      if (!c.read.count(a.name())) throw Unsupported{fmt::format("{} attribute {}", node.op_type(), a.name())};
    }
    for (const auto& [o, value] : c.known_outputs) known.emplace(node.output(o), value);
    for (int o = 0; o < node.output_size() && o < static_cast<int>(outputs.size()); ++o) {
      if (!node.output(o).empty()) values[node.output(o)] = outputs[static_cast<std::size_t>(o)];
    }
  }
  std::vector<Output> fetches;
  std::vector<Tensor> expected;
  for (int o = 0; o < g.output_size(); ++o) {
    const auto v = values.find(g.output(o).name());
    if (v == values.end()) throw Unsupported{fmt::format("output {} not produced", g.output(o).name())};
    fetches.push_back(v->second);
    expected.push_back(from_proto(read_tensor_proto(data_set / fmt::format("output_{}.pb", o))));
  }
  tandem::graph::Executor executor(graph, device);
  const auto got = executor.run(feeds, fetches);
  for (std::size_t o = 0; o < got.size(); ++o) {
    if (got[o].shape() != expected[o].shape()) {
      return fmt::format("output {} has shape {}, expected {}", o, got[o].shape(), expected[o].shape());
    }
    const bool integral =
        expected[o].dtype() == DType::kI32 || expected[o].dtype() == DType::kI64 || expected[o].dtype() == DType::kU8;
    const auto a = doubles(got[o]), b = doubles(expected[o]);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const bool same_nan = std::isnan(a[i]) && std::isnan(b[i]);
      const bool close = integral ? a[i] == b[i] : std::abs(a[i] - b[i]) <= kAtol + kRtol * std::abs(b[i]);
      if (!same_nan && !close) {
        return fmt::format("output {} element {}: {} where ONNX expects {} (rtol {}, atol {})", o, i, a[i], b[i], kRtol,
                           kAtol);
      }
    }
  }
  return "";
}

Result run_test(const fs::path& dir, const std::vector<tandem::devices::Device*>& devices) {
  Result result{.test = dir.filename().string(), .outcome = Outcome::kPass, .reason = {}, .op_types = {}};
  onnx::ModelProto model;
  {
    std::ifstream in(dir / "model.onnx", std::ios::binary);
    if (!model.ParseFromIstream(&in)) return {result.test, Outcome::kFail, "model.onnx does not parse", {}};
  }
  for (const auto& node : model.graph().node()) result.op_types.insert(node.op_type());
  std::vector<fs::path> data_sets;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_directory() && entry.path().filename().string().starts_with("test_data_set_"))
      data_sets.push_back(entry.path());
  std::sort(data_sets.begin(), data_sets.end());
  try {
    for (auto* device : devices) {
      for (const auto& data_set : data_sets) {
        const std::string difference = run_data_set(model, data_set, *device);
        if (!difference.empty()) {
          result.outcome = Outcome::kFail;
          result.reason =
              fmt::format("{} on {}: {}", data_set.filename().string(), device->name().short_form(), difference);
          return result;
        }
      }
    }
  } catch (const Unsupported& u) {
    result.outcome = Outcome::kSkip;
    result.reason = u.reason;
  } catch (const tandem::InvalidArgument& e) {
    result.outcome = Outcome::kSkip;
    result.reason = fmt::format("tandem refuses: {}", e.what());
  } catch (const tandem::Unimplemented& e) {
    result.outcome = Outcome::kSkip;
    result.reason = fmt::format("tandem refuses: {}", e.what());
  } catch (const std::exception& e) {
    result.outcome = Outcome::kFail;
    result.reason = e.what();
  }
  return result;
}

fs::path data_folder() {
  const char* env = std::getenv("TANDEM_ONNX_NODE_DATA");
  return env != nullptr ? fs::path(env) : fs::path(TANDEM_ONNX_NODE_DATA);
}

std::vector<tandem::devices::Device*> test_devices() {
  std::vector<tandem::devices::Device*> devices{&tandem::devices::default_cpu_device()};
  for (auto* d : tandem::devices::list_logical_devices(tandem::devices::DeviceType::kGPU)) {
    devices.push_back(d);
    break;  // one GPU is enough: every GPU runs the same kernels
  }
  return devices;
}

}  // namespace

TEST_CASE("ONNX node tests: tandem's ops match ONNX's published outputs") {
  const fs::path folder = data_folder();
  REQUIRE_MESSAGE(fs::is_directory(folder), "no ONNX node test data at ", folder.string());
  std::vector<fs::path> tests;
  for (const auto& entry : fs::directory_iterator(folder))
    if (entry.is_directory() && fs::exists(entry.path() / "model.onnx")) tests.push_back(entry.path());
  std::sort(tests.begin(), tests.end());
  const auto devices = test_devices();

  std::vector<Result> results;
  for (const auto& t : tests) results.push_back(run_test(t, devices));

  std::ofstream out("onnx_node_results.txt");
  int passed = 0, skipped = 0;
  std::map<std::string, int> passed_by_op;
  std::vector<std::string> unexpected;
  for (const auto& r : results) {
    const char* state = r.outcome == Outcome::kPass ? "pass" : r.outcome == Outcome::kSkip ? "skip" : "fail";
    const std::string line =
        r.reason.empty() ? fmt::format("{} {}", state, r.test) : fmt::format("{} {}: {}", state, r.test, r.reason);
    out << line << "\n";
    if (r.outcome == Outcome::kPass) {
      ++passed;
      for (const auto& op : r.op_types) ++passed_by_op[op];
    } else if (r.outcome == Outcome::kSkip) {
      ++skipped;
    } else {
      std::printf("%s\n", line.c_str());
      if (!kKnownFailures.count(r.test)) unexpected.push_back(line);
    }
  }
  std::string devices_named;
  for (const auto* d : devices) devices_named += (devices_named.empty() ? "" : ", ") + d->name().short_form();
  std::printf(
      "ONNX node tests from %s on %s: %d passed, %d skipped, %d failed (of %zu); details in "
      "onnx_node_results.txt\n",
      folder.string().c_str(), devices_named.c_str(), passed, skipped,
      static_cast<int>(results.size()) - passed - skipped, results.size());
  std::string ops_passed;
  for (const auto& [op, n] : passed_by_op) ops_passed += fmt::format(" {}:{}", op, n);
  std::printf("passed per operator:%s\n", ops_passed.c_str());
  for (const auto& u : unexpected) FAIL_CHECK(u);
  CHECK(passed >= kMinimumPasses);
}
