#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <unordered_map>

#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/op_registry.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using graph::Executor;

namespace {

Tensor random_tensor(const Shape& shape, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<std::size_t>(shape.num_elements()));
  for (auto& x : v) x = dist(rng);
  return Tensor::from_vector<float>(v, shape);
}

// A 784-256-128-10 MLP with softmax cross-entropy, and its gradients.
struct Mlp {
  std::shared_ptr<Graph> g = std::make_shared<Graph>();
  Output x, labels, loss;
  std::vector<Output> weights, grads;

  Mlp() {
    x = g->placeholder(kFloat32, {-1, 784}, "x");
    labels = g->placeholder(kInt64, {-1}, "labels");
    const std::vector<std::int64_t> sizes{784, 256, 128, 10};
    Output h = x;
    for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
      auto scope = g->name_scope(fmt::format("dense_{}", l));
      auto w = g->variable(kFloat32, {sizes[l], sizes[l + 1]}, "kernel");
      auto b = g->variable(kFloat32, {sizes[l + 1]}, "bias");
      weights.push_back(w);
      weights.push_back(b);
      h = ops::bias_add(ops::matmul(h, w), b);
      if (l + 2 < sizes.size()) h = ops::relu(h);
    }
    loss = ops::reduce_mean(ops::sparse_softmax_cross_entropy_with_logits(h, labels));
    grads = graph::gradients({&loss, 1}, weights);
  }

  void bind(Executor& ex) const {
    std::uint32_t seed = 1;
    for (const auto& w : weights) {
      const Shape s = w.shape();
      ex.bind_variable(w, random_tensor(s, seed++, 0.05f).to(ex.device()));
    }
  }

  std::vector<graph::Feed> feeds(std::int64_t batch, std::uint32_t seed) const {
    std::mt19937 rng(seed);
    std::vector<std::int64_t> y(static_cast<std::size_t>(batch));
    for (auto& v : y) v = static_cast<std::int64_t>(rng() % 10);
    return {{x, random_tensor({batch, 784}, seed)}, {labels, Tensor::from_vector<std::int64_t>(y, {batch})}};
  }

  std::vector<Output> fetches() const {
    std::vector<Output> f{loss};
    f.insert(f.end(), grads.begin(), grads.end());
    return f;
  }
};

}  // namespace

TEST_CASE("the planner reuses buffers: peak bytes stay below one buffer per value on an MLP") {
  Mlp mlp;
  Executor ex(mlp.g, devices::default_cpu_device());
  mlp.bind(ex);
  ex.run(mlp.feeds(128, 1), mlp.fetches());
  const auto stats = ex.last_plan_stats();
  MESSAGE("MLP step: ", stats.nodes_run, " kernels, arena ", stats.arena_bytes, " bytes vs ", stats.unshared_bytes,
          " without reuse");
  CHECK(stats.arena_bytes < stats.unshared_bytes);
  CHECK(stats.nodes_run > 10);
}

TEST_CASE("a steady-state step allocates nothing, and a new batch size gets its own plan") {
  Mlp mlp;
  auto& device = devices::default_cpu_device();
  Executor ex(mlp.g, device);
  mlp.bind(ex);
  const auto feeds = mlp.feeds(64, 2);
  const auto fetches = mlp.fetches();
  ex.run(feeds, fetches);  // plans and allocates the arena
  ex.run(feeds, fetches);
  const auto before = device.allocator().stats().num_allocations;
  for (int i = 0; i < 5; ++i) ex.run(feeds, fetches);
  CHECK(device.allocator().stats().num_allocations == before);
  CHECK(ex.last_plan_stats().plans_cached == 1);
  ex.run(mlp.feeds(17, 3), fetches);  // a last, partial batch
  CHECK(ex.last_plan_stats().plans_cached == 2);
}

TEST_CASE("SumToShape with nothing to sum in a plan is a view of its input: no kernel, the same values") {
  // A residual add of two (?, 3) values: the graph cannot tell their batch axes agree, so each
  // operand's gradient is a SumToShape; a plan with both batches 4 makes both views, a plan that
  // stretches b (batch 1) runs b's sum.
  auto g = std::make_shared<Graph>();
  auto a = g->placeholder(kFloat32, {Shape::kUnknown, 3}, "a");
  auto b = g->placeholder(kFloat32, {Shape::kUnknown, 3}, "b");
  auto sum = ops::add(a, b);
  auto loss = ops::reduce_sum(ops::mul(sum, sum));
  const auto grads = graph::gradients({&loss, 1}, std::vector<Output>{a, b});
  int sums = 0;
  for (int id = 0; id < g->num_nodes(); ++id) sums += g->node(id).op->name == "SumToShape";
  REQUIRE(sums == 4);  // the Add's two operands and the Mul's
  Executor ex(g, devices::default_cpu_device());
  const auto va = random_tensor({4, 3}, 1), vb = random_tensor({4, 3}, 2);
  auto out = ex.run({{a, va}, {b, vb}}, {grads[0], grads[1]});
  const int views = ex.last_plan_stats().nodes_run;
  const auto pa = va.to_vector<float>(), pb = vb.to_vector<float>();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CHECK(out[0].to_vector<float>()[i] == 2 * (pa[i] + pb[i]));
    CHECK(out[1].to_vector<float>()[i] == 2 * (pa[i] + pb[i]));
  }
  const auto one = random_tensor({1, 3}, 3);
  out = ex.run({{a, va}, {b, one}}, {grads[0], grads[1]});
  CHECK(ex.last_plan_stats().nodes_run == views + 1);  // b's gradient is summed over the rows
  const auto p1 = one.to_vector<float>();
  for (std::size_t j = 0; j < 3; ++j) {
    float column = 0;
    for (std::size_t r = 0; r < 4; ++r) column += 2 * (pa[r * 3 + j] + p1[j]);
    CHECK(out[1].to_vector<float>()[j] == doctest::Approx(column));
  }
}

TEST_CASE("fetched intermediates stay valid when held across the next run") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  auto y = ops::exp(x) + x;
  Executor ex(g, devices::default_cpu_device());
  auto first = ex.run({{x, Tensor::from_vector<float>({0, 1}, {2})}}, {y})[0];
  const auto first_values = first.to_vector<float>();
  auto second = ex.run({{x, Tensor::from_vector<float>({5, 6}, {2})}}, {y})[0];
  CHECK(first.to_vector<float>() == first_values);
  CHECK(second.to_vector<float>()[0] == doctest::Approx(std::exp(5.0f) + 5.0f));
}

TEST_CASE("only what the fetches need runs: an unfed placeholder on another branch is fine") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  auto other = g->placeholder(kFloat32, {2}, "other");
  auto used = x * x;
  auto unused = other + x;
  (void)unused;
  Executor ex(g, devices::default_cpu_device());
  CHECK(ex.run({{x, Tensor::from_vector<float>({2, 3}, {2})}}, {used})[0].to_vector<float>() ==
        std::vector<float>{4, 9});
  CHECK(ex.last_plan_stats().nodes_run == 1);
  CHECK_THROWS_WITH_AS(ex.run({{x, Tensor::from_vector<float>({2, 3}, {2})}}, {unused}),
                       doctest::Contains("Placeholder \"other\" must be fed"), InvalidArgument);
}

TEST_CASE("bad feeds and bindings are refused with the node and the expectation named") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {-1, 3}, "x");
  auto w = g->variable(kFloat32, {3, 2}, "w");
  auto y = ops::matmul(x, w);
  Executor ex(g, devices::default_cpu_device());
  CHECK_THROWS_WITH_AS(ex.run({{x, Tensor::zeros({2, 3}, kFloat32)}}, {y}),
                       doctest::Contains("Variable \"w\" is not bound"), FailedPrecondition);
  CHECK_THROWS_WITH_AS(ex.bind_variable(w, Tensor::zeros({2, 3}, kFloat32)),
                       doctest::Contains("expected float32 (3, 2)"), InvalidArgument);
  ex.bind_variable(w, Tensor::filled<float>({3, 2}, 1.0f));
  CHECK_THROWS_WITH_AS(
      ex.run({{x, Tensor::zeros({2, 4}, kFloat32)}}, {y}),
      doctest::Contains("Placeholder \"x\": fed a float32 tensor of shape (2, 4); expected float32 (None, 3)"),
      InvalidArgument);
  CHECK_THROWS_WITH_AS(ex.run({{x, Tensor::zeros({2, 3}, kFloat64)}}, {y}), doctest::Contains("fed a float64"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ex.run({{y, Tensor::zeros({2, 2}, kFloat32)}}, {y}),
                       doctest::Contains("only placeholders can be fed"), InvalidArgument);
  // Updating a bound variable in place is seen by the next run.
  auto out = ex.run({{x, Tensor::filled<float>({1, 3}, 1.0f)}}, {y})[0];
  CHECK(out.to_vector<float>() == std::vector<float>{3, 3});
  ex.variable(w).data<float>()[0] = 4.0f;
  out = ex.run({{x, Tensor::filled<float>({1, 3}, 1.0f)}}, {y})[0];
  CHECK(out.to_vector<float>() == std::vector<float>{6, 3});
}

TEST_CASE("a feed on another device is copied to the executor's device") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  auto y = x + x;
  Executor ex(g, devices::get_device("CPU:1"));
  auto out = ex.run({{x, Tensor::from_vector<float>({1, 2}, {2}, devices::get_device("CPU:0"))}}, {y})[0];
  CHECK(&out.device() == &devices::get_device("CPU:1"));
  CHECK(out.to_vector<float>() == std::vector<float>{2, 4});
}

TEST_CASE("two instances of one graph run concurrently on two devices and match a sequential run") {
  Mlp mlp;
  const auto fetches = mlp.fetches();
  auto& d0 = devices::get_device("CPU:0");
  auto& d1 = devices::get_device("CPU:1");

  // Sequential reference, one instance per device.
  std::vector<std::vector<std::vector<float>>> expected(2);
  for (int r = 0; r < 2; ++r) {
    Executor ex(mlp.g, r == 0 ? d0 : d1);
    mlp.bind(ex);
    for (int step = 0; step < 5; ++step) {
      const auto out = ex.run(mlp.feeds(32, static_cast<std::uint32_t>(100 * r + step)), fetches);
      for (const auto& t : out) expected[static_cast<std::size_t>(r)].push_back(t.to_vector<float>());
    }
  }
  // The same, both replicas at once.
  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Executor ex(mlp.g, r == 0 ? d0 : d1);
      mlp.bind(ex);
      for (int step = 0; step < 5; ++step) {
        const auto out = ex.run(mlp.feeds(32, static_cast<std::uint32_t>(100 * r + step)), fetches);
        for (const auto& t : out) got[static_cast<std::size_t>(r)].push_back(t.to_vector<float>());
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(got == expected);
}

TEST_CASE("a node placed on a GPU cannot run on a CPU executor") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  Output y;
  {
    auto on_gpu = g->device_scope("GPU:0");
    y = x + x;
  }
  Executor ex(g, devices::default_cpu_device());
  CHECK_THROWS_WITH_AS(ex.run({{x, Tensor::zeros({2}, kFloat32)}}, {y}), doctest::Contains("is placed on GPU:0"),
                       FailedPrecondition);
}

namespace {

// A device of type GPU whose memory is host memory, reachable only through the copy functions
// (as a real GPU's): the executor must run ops without a GPU kernel on host copies.
class FakeGpu final : public devices::Device {
 public:
  FakeGpu() : Device(make_name()), allocator_("GPU:7 (fake)") {}
  devices::Allocator& allocator() override { return allocator_; }
  devices::Stream& compute_stream() override { return devices::default_cpu_device().compute_stream(); }
  bool host_accessible() const override { return false; }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void fill_zero(void* dst, std::size_t bytes) override { std::memset(dst, 0, bytes); }
  void synchronize() override {}

 private:
  static devices::DeviceName make_name() {
    devices::DeviceName name;
    name.type = devices::DeviceType::kGPU;
    name.index = 7;
    return name;
  }
  devices::CpuAllocator allocator_;
};

}  // namespace

// An op registered only for CPUs, as an op the GPU backend has not covered yet would be.
void host_only_kernel(graph::KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  REQUIRE(x.dtype() == kFloat32);  // 16-bit inputs arrive widened
  const float* in = static_cast<const float*>(x.raw_data());
  float* out = static_cast<float*>(ctx.output(0).raw_data());
  for (std::int64_t i = 0; i < x.num_elements(); ++i) out[i] = 2.0f * in[i] + 1.0f;
}
std::vector<graph::TensorSpec> same_spec(graph::ShapeContext& ctx) { return {ctx.input(0)}; }

void register_host_only_op() {
  ops::register_all();
  auto& registry = graph::OpRegistry::global();
  if (registry.find("TestHostOnly") == nullptr) {
    registry.add({.name = "TestHostOnly", .min_inputs = 1, .max_inputs = 1, .shape_fn = same_spec});
    registry.add_kernel("TestHostOnly", devices::DeviceType::kCPU, host_only_kernel);
  }
}

TEST_CASE("ops without a kernel for the executor's device run on host copies, with the same results") {
  register_host_only_op();
  FakeGpu gpu;
  for (const DType dtype : {kFloat32, DType::kBF16}) {
    CAPTURE(graph::dtype_name(dtype));
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(dtype, {4, 33}, "x");
    auto y = g->add("TestHostOnly", {g->add("TestHostOnly", {x})});
    Tensor xv = random_tensor({4, 33}, 1);
    if (dtype != kFloat32) {
      auto cg = std::make_shared<Graph>();
      auto p = cg->placeholder(kFloat32, xv.shape(), "p");
      auto c = ops::cast(p, dtype);
      Executor e(cg, devices::default_cpu_device());
      xv = e.run({{p, xv}}, {c})[0];
    }
    Executor cpu(g, devices::default_cpu_device());
    Executor fake(g, gpu);
    const std::vector<graph::Feed> feeds{{x, xv}};
    const std::vector<Output> fetches{y};
    const Tensor want = cpu.run(feeds, fetches)[0];
    for (int run = 0; run < 2; ++run) {  // the second run reuses the host buffers
      const auto got = fake.run(feeds, fetches);
      CHECK(&got[0].device() == &gpu);
      const Tensor host = got[0].to(devices::default_cpu_device());
      CHECK(host.dtype() == dtype);
      CHECK(std::memcmp(host.raw_data(), want.raw_data(), want.nbytes()) == 0);
    }
    const auto stats = fake.last_plan_stats();
    CHECK(stats.ops_on_host == std::vector<std::string>{"TestHostOnly"});
  }
}

TEST_CASE("a run's tail is queued after the kernels with the fetches; GPU plans give it a fault word zeroed per run") {
  register_host_only_op();  // the fake GPU has no kernels: its plan runs this op on host copies
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2, 3}, "x");
  auto y = g->add("TestHostOnly", {x});
  const Tensor xv = random_tensor({2, 3}, 4);
  const std::vector<graph::Feed> feeds{{x, xv}};
  const std::vector<Output> fetches{y};

  Executor cpu(g, devices::default_cpu_device());
  const Tensor want = cpu.run(feeds, fetches)[0];
  int calls = 0;
  graph::RunOptions options;
  options.tail = [&](const graph::TailContext& tail) {
    ++calls;
    REQUIRE(tail.fetched.size() == 1);
    CHECK(tail.fetched[0].to_vector<float>() == want.to_vector<float>());
    CHECK(tail.fault_word == nullptr);  // CPU kernels throw instead
  };
  for (int run = 0; run < 3; ++run) cpu.run(feeds, fetches, options);
  CHECK(calls == 3);

  FakeGpu gpu;
  Executor fake(g, gpu);
  calls = 0;
  const void* first_word = nullptr;
  options.tail = [&](const graph::TailContext& tail) {
    ++calls;
    REQUIRE(tail.fault_word != nullptr);
    if (first_word == nullptr) first_word = tail.fault_word;
    CHECK(tail.fault_word == first_word);  // one word per plan: its address is part of a recording
    std::int32_t word = -1;
    gpu.copy_to_host(&word, tail.fault_word, sizeof(word));
    CHECK(word == 0);              // cleared at the start of every run
    const std::int32_t fault = 1;  // as a kernel that found bad input would
    gpu.copy_from_host(const_cast<void*>(tail.fault_word), &fault, sizeof(fault));
    CHECK(tail.fetched[0].to(devices::default_cpu_device()).to_vector<float>() == want.to_vector<float>());
  };
  for (int run = 0; run < 3; ++run) fake.run(feeds, fetches, options);
  CHECK(calls == 3);
}

namespace {

// A gatherer that copies each variable's value from a host store, counting the gathers and
// checking that every gather is started before it is finished.
class CopyingGatherer final : public graph::VariableGatherer {
 public:
  std::unordered_map<int, Tensor> store;
  std::vector<int> started;  // node ids, in the order gathers started
  int finished = 0;
  void start_gather(int node_id, const Tensor& whole) override {
    pending_.push_back(node_id);
    started.push_back(node_id);
    Tensor target = whole;
    target.copy_from(store.at(node_id));
  }
  void finish_gather(int node_id) override {
    const auto it = std::find(pending_.begin(), pending_.end(), node_id);
    REQUIRE_MESSAGE(it != pending_.end(), "gather of node ", node_id, " finished before it was started");
    pending_.erase(it);
    ++finished;
  }

 private:
  std::vector<int> pending_;
};

}  // namespace

TEST_CASE("gathered variables: the same results, a window for forward and one for backward, memory in the arena") {
  Mlp mlp;
  auto& device = devices::default_cpu_device();
  Executor plain(mlp.g, device), gathered(mlp.g, device);
  mlp.bind(plain);
  CopyingGatherer gatherer;
  for (const auto& w : mlp.weights) {
    gatherer.store[w.node] = plain.variable(w).clone();
    gathered.bind_gathered_variable(w, &gatherer);
  }
  const auto feeds = mlp.feeds(32, 4);
  const auto fetches = mlp.fetches();
  for (int run = 0; run < 2; ++run) {
    const auto expected = plain.run(feeds, fetches, {.random_step = 0});
    const auto got = gathered.run(feeds, fetches, {.random_step = 0});
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CHECK_MESSAGE(std::memcmp(expected[i].raw_data(), got[i].raw_data(), expected[i].nbytes()) == 0, "fetch ", i);
    }
  }
  const auto stats = gathered.last_plan_stats();
  // Six weights gathered for forward; backward reads the kernels of the second and third layers
  // again (for their input gradients; each bias was gathered after its kernel's last forward
  // reader, so each kernel's window had closed): 8. The first layer's kernel is not read back.
  CHECK(stats.gathers == 8);
  CHECK(gatherer.finished == 16);
  const std::int64_t weights = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10;
  CHECK(stats.gathered_bytes == 4 * (weights + 256 * 128 + 128 * 10));
  // The windows live in the arena and share its bytes with the other values by lifetime.
  CHECK(stats.arena_bytes <= plain.last_plan_stats().arena_bytes + stats.gathered_bytes);
  CHECK(stats.arena_bytes < stats.unshared_bytes);
  // Fetching a gathered variable is refused: its whole value exists only during the run.
  CHECK_THROWS_AS(gathered.run(feeds, {mlp.weights[0]}), InvalidArgument);
}

namespace {

class ReleaseRecorder final : public graph::NodeObserver {
 public:
  std::vector<int> released;
  std::vector<int> done;
  void node_done(int node_id, std::span<Tensor* const>) override { done.push_back(node_id); }
  void release(int tag) override { released.push_back(tag); }
};

}  // namespace

TEST_CASE("hand-offs: handed fetches come back undefined, are released after their node, and free arena bytes") {
  Mlp mlp;
  auto& device = devices::default_cpu_device();
  Executor keep(mlp.g, device), hand(mlp.g, device);
  mlp.bind(keep);
  for (const auto& w : mlp.weights) hand.bind_variable(w, keep.variable(w));
  const auto feeds = mlp.feeds(64, 5);
  const auto fetches = mlp.fetches();  // [loss, gradients...]
  // Hand off every gradient but the last computed (the first layer's), each released as soon as
  // the first layer's kernel gradient has been computed.
  const int until = mlp.grads[0].node;
  std::vector<graph::HandOff> hand_offs;
  for (std::size_t k = 2; k < mlp.grads.size(); ++k) {
    hand_offs.push_back({.fetch = static_cast<int>(k) + 1, .until_node = until, .tag = static_cast<int>(k)});
  }
  ReleaseRecorder observer;
  const auto expected = keep.run(feeds, fetches, {.random_step = 0});
  const auto got = hand.run(feeds, fetches, {.random_step = 0, .observer = &observer, .hand_offs = hand_offs});
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (i >= 3) {
      CHECK_FALSE(got[i].defined());
    } else {
      CHECK(std::memcmp(expected[i].raw_data(), got[i].raw_data(), expected[i].nbytes()) == 0);
    }
  }
  CHECK(observer.released == std::vector<int>{2, 3, 4, 5});
  // Released after `until` ran, before the next node.
  CHECK(std::find(observer.done.begin(), observer.done.end(), until) != observer.done.end());
  CHECK(hand.last_plan_stats().arena_bytes <= keep.last_plan_stats().arena_bytes);
  // A hand-off needs an observer, and a node that runs after the fetch.
  CHECK_THROWS_AS(hand.run(feeds, fetches, {.hand_offs = hand_offs}), InvalidArgument);
  const std::vector<graph::HandOff> early{{.fetch = 1, .until_node = mlp.x.node, .tag = 0}};
  CHECK_THROWS_AS(hand.run(feeds, fetches, {.observer = &observer, .hand_offs = early}), InvalidArgument);
}
