// Array family: reshape, transpose, cast, argmax, equal, one-hot, fills, identity, copy, gather and
// scatter-add, slice, concat.
#include <doctest/doctest.h>

#include "op_test_harness.h"
#include "tandem/devices/detail/cpu_device.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/detail/low_precision_types.h"

#include <cmath>
#include <limits>

using namespace tandem;
using namespace tandem::testing;

namespace {
RefTensor with_shape(RefTensor r, const Shape& s) {
  r.shape = s;
  return r;
}
}  // namespace

TEST_CASE("Reshape (with an inferred dimension) and its gradient") {
  OpCase c;
  c.name = "Reshape";
  c.inputs = {InputSpec::floats({2, 3, 4})};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::reshape(in[0], {4, -1})}; };
  c.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{with_shape(in[0], {4, 6})}; };
  run_op_case(c);
}

TEST_CASE("Reshape with an unknown batch dimension resolves when run") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {-1, 28, 28}, "x");
  auto flat = ops::reshape(x, {-1, 784});
  CHECK(flat.shape() == Shape{-1, 784});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::zeros({3, 28, 28}, kFloat32)}}, {flat});
  CHECK(out[0].shape() == Shape{3, 784});
  Graph bad;
  auto y = bad.placeholder(kFloat32, {2, 3}, "y");
  CHECK_THROWS_WITH_AS(ops::reshape(y, {4, 2}), doctest::Contains("cannot reshape (2, 3) (6 elements) to (4, 2)"),
                       InvalidArgument);
}

TEST_CASE("Transpose") {
  // The last four keep the innermost axes in place (rows of 8 or more: the kernel's row copy);
  // {0, 2, 1, 3} is attention's head split, {0, 1, 2} the identity.
  const std::vector<std::pair<std::vector<std::int64_t>, Shape>> cases{
      {{1, 0}, Shape{3, 5}},           {{2, 0, 1}, Shape{2, 3, 4}},       {{0, 2, 1}, Shape{2, 3, 4}},
      {{1, 2, 0}, Shape{2, 3, 4}},     {{0, 2, 1, 3}, Shape{2, 3, 5, 8}}, {{1, 0, 2}, Shape{3, 4, 16}},
      {{2, 0, 1, 3}, Shape{2, 3, 2, 9}}, {{0, 1, 2}, Shape{2, 3, 4}}};
  for (const auto& [perm, in] : cases) {
    OpCase c;
    c.name = fmt::format("Transpose [{}] of {}", fmt::join(perm, ","), in);
    c.inputs = {InputSpec::floats(in)};
    c.build = [perm](const std::vector<Output>& x) { return std::vector<Output>{ops::transpose(x[0], perm)}; };
    c.reference = [perm](const std::vector<RefTensor>& x) {
      const Shape& s = x[0].shape;
      Shape out;
      for (auto p : perm) out.push_back(s[static_cast<int>(p)]);
      RefTensor r(out);
      std::vector<std::int64_t> idx(static_cast<std::size_t>(s.rank()));
      for (std::int64_t i = 0; i < x[0].size(); ++i) {
        std::int64_t rest = i;
        for (int d = s.rank() - 1; d >= 0; --d) {
          idx[static_cast<std::size_t>(d)] = rest % s[d];
          rest /= s[d];
        }
        std::int64_t o = 0;
        for (int d = 0; d < out.rank(); ++d)
          o = o * out[d] + idx[static_cast<std::size_t>(perm[static_cast<std::size_t>(d)])];
        r[o] = x[0][i];
      }
      return std::vector<RefTensor>{r};
    };
    run_op_case(c);
  }
  Graph g;
  auto x = g.placeholder(kFloat32, {2, 3}, "x");
  CHECK_THROWS_WITH_AS(ops::transpose(x, {0, 0}), doctest::Contains("not a permutation"), InvalidArgument);
}

TEST_CASE("Transpose's row copy splits among 1, 2 and 3 threads mid-axis: every element where it belongs") {
  // Attention's head split of [batch, tokens, heads, depth] with 2 x 40 x 4 x 130 = 41600 floats:
  // rows of 130 split between threads inside the token axis.
  const Shape in{2, 40, 4, 130};
  std::vector<float> x(static_cast<std::size_t>(in.num_elements()));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  std::vector<float> want;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t t = 0; t < 40; ++t)
        for (std::int64_t d = 0; d < 130; ++d) want.push_back(static_cast<float>(((b * 40 + t) * 4 + h) * 130 + d));
  auto g = std::make_shared<Graph>();
  auto p = g->placeholder(kFloat32, in, "x");
  auto y = ops::transpose(p, {0, 2, 1, 3});
  for (const int threads : {1, 2, 3}) {
    devices::detail::CpuDevice device(100 + threads, threads);
    graph::Executor ex(g, device);
    INFO(threads, " threads");
    CHECK(ex.run({{p, Tensor::from_vector<float>(x, in)}}, {y})[0].to_vector<float>() == want);
  }
}

TEST_CASE("Cast between float types carries the gradient; to int truncates") {
  OpCase c;
  c.name = "Cast float to float64 and back";
  c.inputs = {InputSpec::floats({3, 4})};
  c.build = [](const std::vector<Output>& in) {
    const DType other = in[0].dtype() == kFloat32 ? kFloat64 : kFloat32;
    return std::vector<Output>{ops::cast(ops::mul(ops::cast(in[0], other), ops::cast(in[0], other)), in[0].dtype())};
  };
  c.reference = [](const std::vector<RefTensor>& in) {
    RefTensor r(in[0].shape);
    for (std::int64_t i = 0; i < r.size(); ++i) r[i] = in[0][i] * in[0][i];
    return std::vector<RefTensor>{r};
  };
  // The product runs in float32 in the float64 pass: compare loosely, and take finite
  // differences with a step float32 resolves (exact for a quadratic).
  c.f64_tolerance = 1e-6;
  c.finite_difference_step = 1e-2;
  c.gradient_tolerance = 1e-4;
  run_op_case(c);

  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {4}, "x");
  auto i = ops::cast(x, kInt32);
  auto u = ops::cast(ops::cast(i, kInt64), kUInt8);
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<float>({1.9f, -1.9f, 0.2f, 7.0f}, {4})}}, {i, u});
  CHECK(out[0].to_vector<std::int32_t>() == std::vector<std::int32_t>{1, -1, 0, 7});
  CHECK(out[1].to_vector<std::uint8_t>() == std::vector<std::uint8_t>{1, 255, 0, 7});
}

TEST_CASE(
    "Cast to and from float16 and bfloat16: round to nearest even, overflow, NaN, gradients in the source dtype") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {8}, "x");
  auto h = ops::cast(x, DType::kF16);
  auto b = ops::cast(x, DType::kBF16);
  auto h_back = ops::cast(h, kFloat32);
  auto b_back = ops::cast(b, kFloat32);
  auto b_to_h = ops::cast(b, DType::kF16);  // 16 bits to 16 bits, through float
  auto b_to_i = ops::cast(b, kInt32);
  graph::Executor ex(g, devices::default_cpu_device());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 1 + 2^-11 is halfway between two float16 values (ties to even: 1); 1 + 3 * 2^-11 rounds up.
  // 1 + 2^-8 is halfway between two bfloat16 values. 70000 overflows float16 but not bfloat16.
  const std::vector<float> values{1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-8f, 70000.0f, -2.5f, nan, -inf,
                                  3.0e38f};
  auto out = ex.run({{x, Tensor::from_vector<float>(values, {8})}}, {h_back, b_back, b_to_h, b_to_i, h, b});
  const auto hv = out[0].to_vector<float>();
  const auto bv = out[1].to_vector<float>();
  CHECK(hv[0] == 1.0f);
  CHECK(hv[1] == 1.0f + 0x1p-9f);
  CHECK(hv[3] == inf);
  CHECK(hv[4] == -2.5f);
  CHECK(std::isnan(hv[5]));
  CHECK(hv[6] == -inf);
  CHECK(bv[2] == 1.0f);
  CHECK(bv[3] == 70144.0f);  // bfloat16 keeps float32's range: 70000 rounds to 137 * 2^9
  CHECK(std::isnan(bv[5]));
  CHECK(std::isfinite(bv[7]));
  CHECK(out[2].dtype() == DType::kF16);
  CHECK(static_cast<float>(out[2].to_vector<graph::float16>()[4]) == -2.5f);
  CHECK(out[3].to_vector<std::int32_t>()[4] == -2);
  CHECK(out[4].nbytes() == 16);
  CHECK(out[5].nbytes() == 16);

  // The gradient of a cast comes back in the source dtype.
  auto loss = ops::reduce_sum(ops::mul(b, b));
  const std::vector<Output> xs{x};
  auto grads = graph::gradients({&loss, 1}, xs);
  CHECK(grads[0].dtype() == kFloat32);
  graph::Executor grad_ex(g, devices::default_cpu_device());
  const std::vector<float> ramp{1, 2, 3, 4, 5, 6, 7, 8};
  auto grad = grad_ex.run({{x, Tensor::from_vector<float>(ramp, {8})}}, {grads[0]});
  CHECK(grad[0].to_vector<float>() == std::vector<float>{2, 4, 6, 8, 10, 12, 14, 16});
}

TEST_CASE("a kernel without 16-bit code runs on float32 copies and rounds once: same result, every run") {
  // MatMul has no 16-bit CPU code: the executor widens its inputs, runs the float32 kernel and
  // rounds the output. Compare with the float32 product rounded once.
  auto g = std::make_shared<Graph>();
  auto a = g->placeholder(DType::kBF16, {3, 5}, "a");
  auto b = g->placeholder(DType::kBF16, {5, 2}, "b");
  auto c = ops::matmul(a, b);
  CHECK(c.dtype() == DType::kBF16);
  std::vector<graph::bfloat16> av, bv;
  std::vector<float> af, bf;
  for (int i = 0; i < 15; ++i) {
    av.emplace_back(0.37f * static_cast<float>(i) - 2.0f);
    af.push_back(static_cast<float>(av.back()));
  }
  for (int i = 0; i < 10; ++i) {
    bv.emplace_back(0.71f - 0.13f * static_cast<float>(i));
    bf.push_back(static_cast<float>(bv.back()));
  }
  graph::Executor ex(g, devices::default_cpu_device());
  const Tensor at = Tensor::from_vector(av, {3, 5}), bt = Tensor::from_vector(bv, {5, 2});
  for (int run = 0; run < 2; ++run) {  // the second run reuses the float32 copies
    const auto got = ex.run({{a, at}, {b, bt}}, {c})[0].to_vector<graph::bfloat16>();
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 2; ++j) {
        float want = 0;
        for (int k = 0; k < 5; ++k)
          want += af[static_cast<std::size_t>(i * 5 + k)] * bf[static_cast<std::size_t>(k * 2 + j)];
        CHECK(static_cast<float>(got[static_cast<std::size_t>(i * 2 + j)]) ==
              doctest::Approx(static_cast<float>(graph::bfloat16(want))).epsilon(1e-6));
      }
    }
  }
}

TEST_CASE("ArgMax, Equal and OneHot (no gradients)") {
  OpCase argmax;
  argmax.name = "ArgMax axis 1";
  argmax.inputs = {InputSpec::floats({6, 5}).with_distinct()};
  argmax.build = [](const std::vector<Output>& in) {
    return std::vector<Output>{ops::argmax(in[0], 1), ops::argmax(in[0], 0)};
  };
  argmax.reference = [](const std::vector<RefTensor>& in) {
    RefTensor rows(Shape{6}), cols(Shape{5});
    for (int r = 0; r < 6; ++r) {
      int best = 0;
      for (int k = 1; k < 5; ++k) best = in[0].at({r, k}) > in[0].at({r, best}) ? k : best;
      rows[r] = best;
    }
    for (int k = 0; k < 5; ++k) {
      int best = 0;
      for (int r = 1; r < 6; ++r) best = in[0].at({r, k}) > in[0].at({best, k}) ? r : best;
      cols[k] = best;
    }
    return std::vector<RefTensor>{rows, cols};
  };
  argmax.check_gradient = false;
  run_op_case(argmax);

  OpCase eq;
  eq.name = "Equal with broadcasting";
  eq.inputs = {InputSpec{.shape = {2, 3}, .kind = InputSpec::Kind::kValues, .values = {1, 2, 3, 4, 5, 6}},
               InputSpec{.shape = {3}, .kind = InputSpec::Kind::kValues, .values = {1, 5, 6}}};
  eq.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::equal(in[0], in[1])}; };
  eq.reference = [](const std::vector<RefTensor>&) {
    RefTensor r(Shape{2, 3});
    r.values = {1, 0, 0, 0, 1, 1};
    return std::vector<RefTensor>{r};
  };
  eq.check_gradient = false;
  run_op_case(eq);

  OpCase oh;
  oh.name = "OneHot";
  oh.inputs = {InputSpec{.shape = {4}, .kind = InputSpec::Kind::kValues, .integral = true, .values = {0, 2, 5, -1}}};
  oh.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::one_hot(in[0], 3, 1.0, 0.0)}; };
  oh.reference = [](const std::vector<RefTensor>&) {
    RefTensor r(Shape{4, 3});
    r.values = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0};  // out-of-range rows are all off
    return std::vector<RefTensor>{r};
  };
  oh.check_gradient = false;
  run_op_case(oh);
}

TEST_CASE("non-differentiable ops stop gradients") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {3}, "x");
  auto y = ops::reduce_sum(ops::cast(ops::equal(x, x), kFloat32));
  auto z = ops::reduce_sum(ops::stop_gradient(x));
  auto w = ops::reduce_sum(ops::mul(x, ops::cast(ops::argmax(ops::reshape(x, {1, 3}), 1), kFloat32)));
  std::vector<Output> ys{y, z};
  auto grads = graph::gradients(ys, {&x, 1});
  CHECK_FALSE(grads[0].defined());
  auto zero = graph::gradients({&y, 1}, {&x, 1}, {}, {.unconnected = graph::UnconnectedGradients::kZero});
  auto gw = graph::gradients({&w, 1}, {&x, 1});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<float>({1, 5, 2}, {3})}}, {zero[0], gw[0]});
  CHECK(out[0].to_vector<float>() == std::vector<float>{0, 0, 0});
  CHECK(out[1].to_vector<float>() == std::vector<float>{1, 1, 1});  // argmax is 1, a constant
}

TEST_CASE("Fill, ZerosLike, OnesLike, Identity") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat64, {2, 2}, "x");
  auto f = ops::fill(*g, {2, 3}, 2.5, kFloat32);
  auto z = ops::zeros_like(x);
  auto o = ops::ones_like(x);
  auto i = ops::identity(x);
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<double>({1, 2, 3, 4}, {2, 2})}}, {f, z, o, i});
  CHECK(out[0].to_vector<float>() == std::vector<float>(6, 2.5f));
  CHECK(out[1].to_vector<double>() == std::vector<double>(4, 0.0));
  CHECK(out[2].to_vector<double>() == std::vector<double>(4, 1.0));
  CHECK(out[3].to_vector<double>() == std::vector<double>{1, 2, 3, 4});

  OpCase id;
  id.name = "Identity gradient";
  id.inputs = {InputSpec::floats({3, 2})};
  id.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::identity(in[0])}; };
  id.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{in[0]}; };
  run_op_case(id);
}

TEST_CASE("Copy: its own buffer, the input's values, the incoming gradient") {
  OpCase c;
  c.name = "Copy";
  c.inputs = {InputSpec::floats({3, 4})};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::copy(in[0])}; };
  c.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{in[0]}; };
  run_op_case(c);

  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2, 2}, "x");
  auto copied = ops::copy(x);
  graph::Executor ex(g, devices::default_cpu_device());
  const Tensor input = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  auto out = ex.run({{x, input}}, {copied});
  CHECK(out[0].to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  CHECK(out[0].raw_data() != input.raw_data());  // not a view of the fed tensor
}

namespace {

// The GPUs of this process: none in CPU builds or without a driver (the CPU suites), every GPU
// under ops_gpu_test on a GPU machine.
std::vector<devices::Device*> gpus() {
  if (devices::num_gpus() == 0) return {};
  return devices::list_logical_devices(devices::DeviceType::kGPU);
}

// Row-major multi-index helpers for the references below.
std::vector<std::int64_t> unravel(std::int64_t i, const Shape& s) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(s.rank()));
  for (int d = s.rank() - 1; d >= 0; --d) {
    idx[static_cast<std::size_t>(d)] = i % s[d];
    i /= s[d];
  }
  return idx;
}
std::int64_t ravel(const std::vector<std::int64_t>& idx, const Shape& s) {
  std::int64_t o = 0;
  for (int d = 0; d < s.rank(); ++d) o = o * s[d] + idx[static_cast<std::size_t>(d)];
  return o;
}

RefTensor gather_ref(const RefTensor& params, const RefTensor& ids) {
  Shape out = ids.shape;
  for (int d = 1; d < params.shape.rank(); ++d) out.push_back(params.shape[d]);
  const std::int64_t width = params.size() / params.shape[0];
  RefTensor r(out);
  for (std::int64_t i = 0; i < ids.size(); ++i)
    for (std::int64_t j = 0; j < width; ++j) r[i * width + j] = params[static_cast<std::int64_t>(ids[i]) * width + j];
  return r;
}

RefTensor segment_sum_ref(const RefTensor& data, const RefTensor& ids, std::int64_t segments) {
  Shape out{segments};
  for (int d = ids.shape.rank(); d < data.shape.rank(); ++d) out.push_back(data.shape[d]);
  const std::int64_t width = ids.size() == 0 ? 0 : data.size() / ids.size();
  RefTensor r(out);
  for (std::int64_t i = 0; i < ids.size(); ++i)
    for (std::int64_t j = 0; j < width; ++j) r[static_cast<std::int64_t>(ids[i]) * width + j] += data[i * width + j];
  return r;
}

RefTensor slice_ref(const RefTensor& x, const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& size) {
  Shape out;
  for (int d = 0; d < x.shape.rank(); ++d) {
    const auto du = static_cast<std::size_t>(d);
    out.push_back(size[du] == -1 ? x.shape[d] - begin[du] : size[du]);
  }
  RefTensor r(out);
  for (std::int64_t i = 0; i < r.size(); ++i) {
    auto idx = unravel(i, out);
    for (std::size_t d = 0; d < idx.size(); ++d) idx[d] += begin[d];
    r[i] = x[ravel(idx, x.shape)];
  }
  return r;
}

RefTensor concat_ref(const std::vector<RefTensor>& xs, int axis) {
  Shape out = xs[0].shape;
  out[axis] = 0;
  for (const auto& x : xs) out[axis] += x.shape[axis];
  RefTensor r(out);
  std::int64_t offset = 0;
  for (const auto& x : xs) {
    for (std::int64_t i = 0; i < x.size(); ++i) {
      auto idx = unravel(i, x.shape);
      idx[static_cast<std::size_t>(axis)] += offset;
      r[ravel(idx, out)] = x[i];
    }
    offset += x.shape[axis];
  }
  return r;
}

OpCase gather_case(const Shape& params, const Shape& ids, DType index_dtype) {
  OpCase c;
  c.name = fmt::format("Gather {} by {} {}", params, ids, graph::dtype_name(index_dtype));
  c.inputs = {InputSpec::floats(params), InputSpec::indices(ids, params[0], index_dtype)};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::gather(in[0], in[1])}; };
  c.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{gather_ref(in[0], in[1])}; };
  return c;
}

OpCase slice_case(const Shape& x, std::vector<std::int64_t> begin, std::vector<std::int64_t> size) {
  OpCase c;
  c.name = fmt::format("Slice {} begin [{}] size [{}]", x, fmt::join(begin, ","), fmt::join(size, ","));
  c.inputs = {InputSpec::floats(x)};
  c.build = [begin, size](const std::vector<Output>& in) {
    return std::vector<Output>{ops::slice(in[0], begin, size)};
  };
  c.reference = [begin, size](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{slice_ref(in[0], begin, size)};
  };
  return c;
}

OpCase concat_case(const std::vector<Shape>& shapes, int axis) {
  OpCase c;
  c.name = fmt::format("Concat axis {} of {} inputs, first {}", axis, shapes.size(), shapes[0]);
  for (const auto& s : shapes) c.inputs.push_back(InputSpec::floats(s));
  c.build = [axis](const std::vector<Output>& in) { return std::vector<Output>{ops::concat(in, axis)}; };
  c.reference = [axis](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{concat_ref(in, axis < 0 ? axis + in[0].shape.rank() : axis)};
  };
  return c;
}

}  // namespace

TEST_CASE("Gather along axis 0, with its scatter-add gradient") {
  run_op_case(gather_case({7, 3}, {5}, kInt32));
  run_op_case(gather_case({7, 3, 2}, {2, 4}, kInt64));
  run_op_case(gather_case({9}, {3, 2}, kInt32));  // rows of one element
  run_op_case(gather_case({6, 4}, {}, kInt64));   // a scalar index: one row
  // An embedding lookup of GPT size: the threaded row copies and a many-to-one scatter-add.
  OpCase big = gather_case({155, 128}, {8, 128}, kInt32);
  big.max_checked_elements = 16;
  run_op_case(big);
}

TEST_CASE("UnsortedSegmentSum, with Gather as its gradient") {
  for (const DType index_dtype : {kInt32, kInt64}) {
    OpCase c;
    c.name = fmt::format("UnsortedSegmentSum {}", graph::dtype_name(index_dtype));
    c.inputs = {InputSpec::floats({2, 6, 3}), InputSpec::indices({2, 6}, 4, index_dtype)};
    // 5 segments for ids in [0, 4): the last one is empty (zeros).
    c.build = [](const std::vector<Output>& in) {
      return std::vector<Output>{ops::unsorted_segment_sum(in[0], in[1], 5)};
    };
    c.reference = [](const std::vector<RefTensor>& in) {
      return std::vector<RefTensor>{segment_sum_ref(in[0], in[1], 5)};
    };
    run_op_case(c);
  }
}

TEST_CASE("the scatter-add is bitwise the same on 1, 2 and 3 threads (and GPUs): rows add in the order of their ids") {
  // Skewed ids, like characters of text: a third of them are 0.
  const std::int64_t n = 4096, width = 128, segments = 155;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  std::vector<float> data(static_cast<std::size_t>(n * width));
  std::uint64_t state = 12345;
  const auto next = [&] { return (state = state * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (auto& id : ids) id = next() % 3 == 0 ? 0 : static_cast<std::int32_t>(next() % segments);
  for (auto& v : data) v = static_cast<float>(static_cast<double>(next() % 2000000) / 1e6 - 1.0);
  // The same sums in the same order, serially.
  std::vector<float> want(static_cast<std::size_t>(segments * width), 0.0f);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < width; ++j)
      want[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)] * width + j)] +=
          data[static_cast<std::size_t>(i * width + j)];
  auto g = std::make_shared<Graph>();
  auto d = g->placeholder(kFloat32, {n, width}, "data");
  auto s = g->placeholder(kInt32, {n}, "ids");
  auto sum = ops::unsorted_segment_sum(d, s, segments);
  const auto check_on = [&](devices::Device& device) {
    graph::Executor ex(g, device);
    auto out = ex.run({{d, Tensor::from_vector<float>(data, {n, width})}, {s, Tensor::from_vector(ids, {n})}}, {sum});
    INFO(device.short_name(), ", ", device.intra_op_threads(), " threads");
    CHECK(out[0].to_vector<float>() == want);
  };
  for (const int threads : {1, 2, 3}) {
    devices::detail::CpuDevice device(100 + threads, threads);
    check_on(device);
  }
  for (auto* gpu : gpus()) check_on(*gpu);  // the sorted GPU scatter-add gives the same bits
}

TEST_CASE("Gather and UnsortedSegmentSum refuse an id outside the rows, naming the node and the id") {
  auto g = std::make_shared<Graph>();
  auto params = g->placeholder(kFloat32, {7, 2}, "params");
  auto ids = g->placeholder(kInt64, {4}, "ids");
  auto rows = ops::gather(params, ids);
  auto h = std::make_shared<Graph>();
  auto data = h->placeholder(kFloat32, {3, 2}, "data");
  auto seg = h->placeholder(kInt32, {3}, "seg");
  auto total = ops::unsorted_segment_sum(data, seg, 2);
  const Tensor p = Tensor::zeros({7, 2}, kFloat32);
  // CPUs throw before writing; GPUs through the check deferred until the step is queued.
  std::vector<devices::Device*> devices{&devices::default_cpu_device()};
  for (auto* gpu : gpus()) devices.push_back(gpu);
  for (auto* device : devices) {
    INFO(device->short_name());
    graph::Executor ex(g, *device);
    CHECK_THROWS_WITH_AS(ex.run({{params, p}, {ids, Tensor::from_vector<std::int64_t>({1, 6, 9, 0}, {4})}}, {rows}),
                         doctest::Contains("Gather \"Gather\": index 9 (element 2 of indices (4,)) is outside "
                                           "[0, 7), the rows of params"),
                         InvalidArgument);
    CHECK_THROWS_WITH_AS(ex.run({{params, p}, {ids, Tensor::from_vector<std::int64_t>({-1, 0, 0, 0}, {4})}}, {rows}),
                         doctest::Contains("index -1 (element 0"), InvalidArgument);
    graph::Executor hx(h, *device);
    CHECK_THROWS_WITH_AS(
        hx.run({{data, Tensor::zeros({3, 2}, kFloat32)}, {seg, Tensor::from_vector<std::int32_t>({0, 2, 1}, {3})}},
               {total}),
        doctest::Contains("UnsortedSegmentSum \"UnsortedSegmentSum\": segment id 2 (element 1 of "
                          "segment_ids (3,)) is outside [0, 2)"),
        InvalidArgument);
  }
}

TEST_CASE("Gather's gradient when params' first dimension is unknown takes num_segments from params") {
  auto g = std::make_shared<Graph>();
  auto params = g->placeholder(kFloat32, {-1, 2}, "params");
  auto ids = g->placeholder(kInt32, {3}, "ids");
  auto loss = ops::reduce_sum(ops::gather(params, ids));
  auto grads = graph::gradients({&loss, 1}, {&params, 1});
  CHECK(grads[0].shape() == Shape{-1, 2});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out =
      ex.run({{params, Tensor::zeros({4, 2}, kFloat32)}, {ids, Tensor::from_vector<std::int32_t>({3, 0, 3}, {3})}},
             {grads[0]});
  CHECK(out[0].to_vector<float>() == std::vector<float>{1, 1, 0, 0, 0, 0, 2, 2});
}

TEST_CASE("Gather, UnsortedSegmentSum shape and dtype errors") {
  ops::register_all();
  Graph g;
  auto params = g.placeholder(kFloat32, {7, 2}, "params");
  auto scalar = g.placeholder(kFloat32, {}, "scalar");
  auto ids = g.placeholder(kInt64, {4}, "ids");
  auto float_ids = g.placeholder(kFloat32, {4}, "float_ids");
  CHECK_THROWS_WITH_AS(ops::gather(params, float_ids), doctest::Contains("indices have dtype float32"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::gather(scalar, ids), doctest::Contains("params () must have rank 1 or more"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::unsorted_segment_sum(params, ids, 3),
                       doctest::Contains("data (7, 2) must start with the shape of the segment ids (4,)"),
                       InvalidArgument);
  auto data = g.placeholder(kFloat32, {4, 2}, "data");
  CHECK_THROWS_WITH_AS(ops::unsorted_segment_sum(data, ids, -1), doctest::Contains("num_segments is -1"),
                       InvalidArgument);
  CHECK(ops::unsorted_segment_sum(data, ids, 3).shape() == Shape{3, 2});
  CHECK(ops::gather(params, g.placeholder(kInt32, {-1, 5}, "batch_ids")).shape() == Shape{-1, 5, 2});
}

TEST_CASE("Slice, with size -1 to the end, and its zero-padding gradient") {
  run_op_case(slice_case({4, 5, 6}, {1, 0, 2}, {2, -1, 3}));
  run_op_case(slice_case({5, 7}, {0, 3}, {-1, 4}));
  run_op_case(slice_case({5, 7}, {2, 0}, {2, 7}));  // whole rows: one contiguous block
  run_op_case(slice_case({9}, {4}, {3}));
  run_op_case(slice_case({3, 4, 2}, {0, 1, 1}, {3, 0, 1}));  // empty
  run_op_case(slice_case({128, 96}, {0, 0}, {100, -1}));     // large enough for the threaded copy
}

TEST_CASE("Concat along any axis, with slices as its gradient") {
  run_op_case(concat_case({{2, 3, 4}, {2, 1, 4}, {2, 2, 4}}, 1));
  run_op_case(concat_case({{2, 3, 4}, {2, 3, 1}}, -1));
  run_op_case(concat_case({{1, 3}, {4, 3}, {2, 3}}, 0));
  run_op_case(concat_case({{5}, {0}, {2}}, 0));  // an empty input
}

TEST_CASE("Slice and Concat shape errors name the node") {
  ops::register_all();
  Graph g;
  auto x = g.placeholder(kFloat32, {-1, 5}, "x");
  CHECK(ops::slice(x, {0, 1}, {-1, 3}).shape() == Shape{-1, 3});
  CHECK(ops::slice(x, {1, 1}, {-1, -1}).shape() == Shape{-1, 4});
  CHECK_THROWS_WITH_AS(
      ops::slice(x, {0, 3}, {-1, 3}),
      doctest::Contains("Slice \"Slice_2\": axis 1: [3, 6) is outside x (None, 5), whose axis 1 has 5"),
      InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::slice(x, {0}, {1}), doctest::Contains("need one entry per axis of x (None, 5) (rank 2)"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::slice(x, {0, -1}, {1, 1}), doctest::Contains("axis 1: begin -1"), InvalidArgument);
  auto y = g.placeholder(kFloat32, {3, 4}, "y");
  auto z = g.placeholder(kFloat32, {3, 5}, "z");
  CHECK(ops::concat({y, z}, 1).shape() == Shape{3, 9});
  CHECK(ops::concat({x, z}, 0).shape() == Shape{-1, 5});
  CHECK_THROWS_WITH_AS(ops::concat({y, z}, 0),
                       doctest::Contains("Concat \"Concat_2\": input 1 has shape (3, 5), input 0 has (3, 4); they must "
                                         "match except along axis 0"),
                       InvalidArgument);
  CHECK_THROWS_AS(ops::concat({y, z}, 2), InvalidArgument);
  CHECK_THROWS_AS(ops::concat({y, g.placeholder(kFloat64, {3, 4}, "w")}, 1), InvalidArgument);
  // The gradient slices dy at offsets it must know.
  auto loss = ops::reduce_sum(ops::concat({x, z}, 0));
  CHECK_THROWS_WITH_AS(graph::gradients({&loss, 1}, {&z, 1}),
                       doctest::Contains("needs every input's size along axis 0, and input 0 is (None, 5)"),
                       InvalidArgument);
}
