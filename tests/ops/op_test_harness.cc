#include "op_test_harness.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "tandem/graph/autodiff.h"
#include "tandem/graph/detail/low_precision_types.h"

namespace tandem::testing {

using graph::Executor;
using graph::Feed;
using graph::Tensor;

std::int64_t RefTensor::offset(std::initializer_list<std::int64_t> index) const {
  if (static_cast<int>(index.size()) != shape.rank()) throw std::logic_error("RefTensor::at: wrong number of indices");
  std::int64_t flat = 0;
  int d = 0;
  for (auto i : index) flat = flat * shape[d++] + i;
  return flat;
}
double& RefTensor::at(std::initializer_list<std::int64_t> index) {
  return values[static_cast<std::size_t>(offset(index))];
}
double RefTensor::at(std::initializer_list<std::int64_t> index) const {
  return values[static_cast<std::size_t>(offset(index))];
}

RefTensor to_ref(const Tensor& t) {
  RefTensor r(t.shape());
  graph::dispatch<graph::EveryType>(t.dtype(), "to_ref", [&]<class T>() {
    const auto v = t.to_vector<T>();
    for (std::size_t i = 0; i < v.size(); ++i) {
      if constexpr (graph::is_low_precision(graph::dtype_of<T>)) {
        r.values[i] = static_cast<double>(static_cast<float>(v[i]));
      } else {
        r.values[i] = static_cast<double>(v[i]);
      }
    }
  });
  return r;
}

namespace {

std::uint64_t name_seed(const std::string& name) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  return h;
}

RefTensor generate(const InputSpec& spec, std::mt19937_64& rng) {
  RefTensor r(spec.shape);
  switch (spec.kind) {
    case InputSpec::Kind::kValues:
      REQUIRE(static_cast<std::int64_t>(spec.values.size()) == r.size());
      r.values = spec.values;
      return r;
    case InputSpec::Kind::kIndex: {
      std::uniform_int_distribution<std::int64_t> dist(0, spec.index_limit - 1);
      for (auto& v : r.values) v = static_cast<double>(dist(rng));
      return r;
    }
    case InputSpec::Kind::kFloat: break;
  }
  std::uniform_real_distribution<double> magnitude(spec.min_abs, spec.max_abs);
  std::bernoulli_distribution negative(0.5);
  for (auto& v : r.values) {
    v = magnitude(rng);
    if (!spec.positive && negative(rng)) v = -v;
  }
  if (spec.distinct) {
    // Spread values so that every pair differs by at least 1e-3: finite differences must not
    // swap which element is the largest.
    std::vector<std::size_t> order(r.values.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    const double span = spec.max_abs - spec.min_abs;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const double u = (static_cast<double>(k) + 0.5) / static_cast<double>(order.size());
      double v = spec.min_abs + u * span;
      if (!spec.positive) v = (2.0 * u - 1.0) * spec.max_abs;
      if (!spec.positive && std::abs(v) < spec.min_abs * 0.5) v = v < 0 ? -spec.min_abs * 0.5 : spec.min_abs * 0.5;
      r.values[order[k]] = v;
    }
  }
  return r;
}

bool is_float_input(const InputSpec& spec) {
  return spec.kind == InputSpec::Kind::kFloat || (spec.kind == InputSpec::Kind::kValues && !spec.integral);
}

Tensor make_tensor(const RefTensor& r, DType dtype) {
  Tensor t;
  graph::dispatch<graph::EveryType>(dtype, "make_tensor", [&]<class T>() {
    std::vector<T> v(r.values.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      if constexpr (graph::is_low_precision(graph::dtype_of<T>)) {
        v[i] = static_cast<T>(static_cast<float>(r.values[i]));
      } else {
        v[i] = static_cast<T>(r.values[i]);
      }
    }
    t = Tensor::from_vector<T>(v, r.shape);
  });
  return t;
}

// One instance of the case's graph at a float dtype, with a projected scalar loss for gradients.
struct Instance {
  std::shared_ptr<Graph> graph = std::make_shared<Graph>();
  std::vector<Output> placeholders;
  std::vector<DType> input_dtypes;
  std::vector<Output> outputs;
  std::vector<Output> weights;  // projection weights, one per gradient output
  Output loss;
  std::vector<int> grad_inputs;
  std::vector<Output> grads;
  std::unique_ptr<Executor> executor;

  Instance(const OpCase& c, DType float_dtype, bool with_gradient, std::mt19937_64& rng,
           devices::Device& device = devices::default_cpu_device()) {
    for (const auto& spec : c.inputs) {
      const DType dt = is_float_input(spec) ? float_dtype : spec.index_dtype;
      input_dtypes.push_back(dt);
      placeholders.push_back(graph->placeholder(dt, spec.shape, "input"));
    }
    outputs = c.build(placeholders);
    if (with_gradient) {
      std::vector<Output> terms;
      std::uniform_real_distribution<double> w(-1.0, 1.0);
      for (int k : c.gradient_outputs) {
        const Output o = outputs[static_cast<std::size_t>(k)];
        RefTensor weight(o.shape());
        for (auto& v : weight.values) v = w(rng);
        const Output wk = graph->constant(make_tensor(weight, o.dtype()), "projection");
        weights.push_back(wk);
        terms.push_back(ops::reduce_sum(ops::mul(o, wk)));
      }
      loss = terms.size() == 1 ? terms.front() : ops::add_n(terms);
      std::vector<Output> xs;
      for (int i = 0; i < static_cast<int>(c.inputs.size()); ++i) {
        const auto& spec = c.inputs[static_cast<std::size_t>(i)];
        if (is_float_input(spec) && spec.differentiable) {
          grad_inputs.push_back(i);
          xs.push_back(placeholders[static_cast<std::size_t>(i)]);
        }
      }
      grads = graph::gradients({&loss, 1}, xs, {}, {.unconnected = graph::UnconnectedGradients::kZero});
    }
    executor = std::make_unique<Executor>(graph, device);
  }

  std::vector<Tensor> run(const std::vector<RefTensor>& values, const std::vector<Output>& fetches) {
    std::vector<Feed> feeds;
    for (std::size_t i = 0; i < values.size(); ++i)
      feeds.emplace_back(placeholders[i], make_tensor(values[i], input_dtypes[i]));
    return executor->run(feeds, fetches, graph::RunOptions{.random_step = 7});
  }
};

void compare(const OpCase& c, const char* pass, std::size_t output, const RefTensor& got, const RefTensor& want,
             double tolerance) {
  INFO("case \"", c.name, "\", ", std::string(pass), ", output ", output);
  REQUIRE_MESSAGE(got.shape == want.shape, "shape ", got.shape.to_string(), " vs reference ", want.shape.to_string());
  int reported = 0;
  for (std::int64_t i = 0; i < got.size(); ++i) {
    const double g = got[i];
    const double w = want[i];
    const bool ok = g == w || std::abs(g - w) <= tolerance * (1.0 + std::abs(w)) || (std::isnan(g) && std::isnan(w));
    if (!ok && reported++ < 5) {
      CHECK_MESSAGE(ok, "element ", i, ": got ", g, ", reference ", w);
    }
  }
  CHECK_MESSAGE(reported == 0, reported, " element(s) outside tolerance ", tolerance);
}

#if TANDEM_OP_TEST_GPU
// The GPU pass (ops_gpu_test): every output, and in float32/float64 every gradient, computed by
// the GPU kernels against the CPU kernels on the same inputs and projection. Ops without a GPU
// kernel run through the executor's host fallback and match exactly.
void compare_gpu_with_cpu(const OpCase& c, const std::vector<RefTensor>& values, const std::mt19937_64& rng) {
  auto* gpu = devices::list_logical_devices(devices::DeviceType::kGPU).front();
  for (const DType dt : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    const bool low = graph::is_low_precision(dt);
    if (low && !c.check_low_precision) continue;
    const bool with_gradient = c.check_gradient && !low;
    std::mt19937_64 cpu_rng = rng, gpu_rng = rng;  // the same projection weights
    Instance cpu(c, dt, with_gradient, cpu_rng);
    Instance device(c, dt, with_gradient, gpu_rng, *gpu);
    std::vector<Output> cpu_fetches = cpu.outputs, gpu_fetches = device.outputs;
    cpu_fetches.insert(cpu_fetches.end(), cpu.grads.begin(), cpu.grads.end());
    gpu_fetches.insert(gpu_fetches.end(), device.grads.begin(), device.grads.end());
    const auto want = cpu.run(values, cpu_fetches);
    const auto got = device.run(values, gpu_fetches);
    REQUIRE(got.size() == want.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      const bool is_gradient = k >= cpu.outputs.size();
      const bool is_float = graph::is_floating(got[k].dtype());
      double tol = 0.0;
      if (is_float) {
        switch (got[k].dtype()) {
          case DType::kF64: tol = 1e-9; break;
          case DType::kBF16: tol = c.bf16_tolerance; break;
          case DType::kF16: tol = c.f16_tolerance; break;
          default: tol = std::max(c.f32_tolerance, 1e-5) * (is_gradient ? 20 : 5); break;
        }
      }
      const std::string pass =
          fmt::format("GPU against CPU, {} {}", graph::dtype_name(dt), is_gradient ? "gradient" : "forward");
      compare(c, pass.c_str(), k, to_ref(got[k]), to_ref(want[k]), tol);
    }
  }
}
#endif

}  // namespace

void run_op_case(const OpCase& c) {
  std::mt19937_64 rng(name_seed(c.name));
  std::vector<RefTensor> values;
  for (const auto& spec : c.inputs) values.push_back(generate(spec, rng));
  const auto expected = c.reference(values);

  // 1 and 2: forward passes against the reference.
  for (const DType dt : {DType::kF64, DType::kF32}) {
    Instance instance(c, dt, false, rng);
    const auto got = instance.run(values, instance.outputs);
    REQUIRE_MESSAGE(got.size() == expected.size(), "case ", c.name, ": reference gives ", expected.size(),
                    " outputs, op gives ", got.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      const bool is_float = graph::is_floating(got[k].dtype());
      const double tol = !is_float ? 0.0 : dt == DType::kF64 ? c.f64_tolerance : c.f32_tolerance;
      compare(c, dt == DType::kF64 ? "float64 forward" : "float32 forward", k, to_ref(got[k]), expected[k], tol);
    }
  }

  // 3: the 16-bit passes, against the reference on the rounded inputs.
  if (c.check_low_precision) {
    for (const DType dt : {DType::kBF16, DType::kF16}) {
      std::vector<RefTensor> rounded = values;
      for (std::size_t i = 0; i < rounded.size(); ++i) {
        if (is_float_input(c.inputs[i])) rounded[i] = to_ref(make_tensor(values[i], dt));
      }
      const auto want = c.reference(rounded);
      Instance instance(c, dt, false, rng);
      const auto got = instance.run(values, instance.outputs);
      REQUIRE(got.size() == want.size());
      const char* pass = dt == DType::kBF16 ? "bfloat16 forward" : "float16 forward";
      for (std::size_t k = 0; k < got.size(); ++k) {
        const bool is_float = graph::is_floating(got[k].dtype());
        // A 16-bit output is rounded to its own type; a float32 one (a loss) is not.
        const bool low = graph::is_low_precision(got[k].dtype());
        const double tol = !is_float            ? 0.0
                           : !low               ? c.f32_tolerance * 10
                           : dt == DType::kBF16 ? c.bf16_tolerance
                                                : c.f16_tolerance;
        compare(c, pass, k, to_ref(got[k]), want[k], tol);
      }
    }
  }
#if TANDEM_OP_TEST_GPU
  compare_gpu_with_cpu(c, values, rng);
#endif
  if (!c.check_gradient) return;

  // 4: autodiff against central differences, in float64.
  Instance instance(c, DType::kF64, true, rng);
  std::vector<Output> fetches{instance.loss};
  for (const auto& g : instance.grads) fetches.push_back(g);
  const auto analytic = instance.run(values, fetches);
  for (std::size_t gi = 0; gi < instance.grad_inputs.size(); ++gi) {
    const int input = instance.grad_inputs[gi];
    RefTensor grad = to_ref(analytic[gi + 1]);
    INFO("case \"", c.name, "\", gradient of input ", input);
    REQUIRE(grad.shape == values[static_cast<std::size_t>(input)].shape);
    std::vector<std::int64_t> elements(static_cast<std::size_t>(grad.size()));
    for (std::size_t i = 0; i < elements.size(); ++i) elements[i] = static_cast<std::int64_t>(i);
    if (static_cast<int>(elements.size()) > c.max_checked_elements) {
      std::shuffle(elements.begin(), elements.end(), rng);
      elements.resize(static_cast<std::size_t>(c.max_checked_elements));
    }
    int failures = 0;
    for (const auto e : elements) {
      auto perturbed = values;
      double& x = perturbed[static_cast<std::size_t>(input)][e];
      const double x0 = x;
      const double h = c.finite_difference_step * std::max(1.0, std::abs(x0));
      x = x0 + h;
      const double plus = instance.run(perturbed, {instance.loss})[0].item<double>();
      x = x0 - h;
      const double minus = instance.run(perturbed, {instance.loss})[0].item<double>();
      const double numeric = (plus - minus) / (2.0 * h);
      const double got = grad[e];
      const bool ok = std::abs(numeric - got) <= c.gradient_tolerance * (1.0 + std::abs(numeric));
      if (!ok && failures++ < 5) {
        CHECK_MESSAGE(ok, "element ", e, ": autodiff ", got, ", finite difference ", numeric);
      }
    }
    CHECK_MESSAGE(failures == 0, failures, " gradient element(s) outside tolerance ", c.gradient_tolerance);
  }
}

}  // namespace tandem::testing
