#include <doctest/doctest.h>

#include <atomic>

#include "tandem/strategy/strategy.h"

using namespace tandem;
using strategy::VariableOptions;

namespace {
VariableOptions options(const std::string& name, std::vector<float> values) {
  VariableOptions o;
  o.name = name;
  o.initial_value = Tensor::from_vector<float>(values, {static_cast<std::int64_t>(values.size())});
  return o;
}
}  // namespace

TEST_CASE("without a scope, the default strategy: one replica on CPU:0") {
  CHECK_FALSE(strategy::has_strategy());
  auto& s = strategy::get_strategy();
  CHECK(&s == &strategy::default_strategy());
  CHECK(s.num_replicas_in_sync() == 1);
  CHECK(s.replica_devices().front() == &devices::default_cpu_device());
  CHECK(s.name().find("DefaultStrategy") == 0);
}

TEST_CASE("scope() makes a strategy current, nests with itself, and refuses a second strategy") {
  OneDeviceStrategy one("CPU:0");
  OneDeviceStrategy other("/device:CPU:0");
  CHECK(one.name().find("OneDeviceStrategy#") == 0);
  CHECK(one.name().find("(CPU:0)") != std::string::npos);
  {
    auto scope = one.scope();
    CHECK(strategy::has_strategy());
    CHECK(&strategy::get_strategy() == &one);
    {
      auto again = one.scope();
      CHECK(&strategy::get_strategy() == &one);
    }
    CHECK_THROWS_WITH_AS(other.scope(), doctest::Contains(one.name().c_str()), FailedPrecondition);
    CHECK(&strategy::get_strategy() == &one);
  }
  CHECK_FALSE(strategy::has_strategy());
  CHECK_THROWS_AS(OneDeviceStrategy("TPU:0"), InvalidArgument);
  CHECK_THROWS_AS(OneDeviceStrategy("CPU:7"), NotFound);
}

TEST_CASE("variables: one copy per replica, assign, read_value, and their strategy") {
  OneDeviceStrategy one("CPU:0");
  auto v = one.create_variable(options("dense/kernel", {1, 2, 3}));
  CHECK(v->name() == "dense/kernel");
  CHECK(&v->strategy() == &one);
  CHECK(v->num_replicas() == 1);
  CHECK(v->shape() == Shape{3});
  CHECK(v->trainable());
  CHECK(v->read_value().to_vector<float>() == std::vector<float>{1, 2, 3});
  v->assign(Tensor::from_vector<float>({4, 5, 6}, {3}));
  CHECK(v->value(0).to_vector<float>() == std::vector<float>{4, 5, 6});
  CHECK_THROWS_WITH_AS(v->assign(Tensor::zeros({2}, kFloat32)), doctest::Contains("dense/kernel"), InvalidArgument);
  CHECK_THROWS_AS(v->value(1), InvalidArgument);
  VariableOptions none;
  none.name = "x";
  CHECK_THROWS_AS(one.create_variable(none), InvalidArgument);
}

TEST_CASE("run calls the function once per replica with its context; reduce adds") {
  OneDeviceStrategy one("CPU:0");
  std::atomic<int> calls{0};
  one.run([&](strategy::ReplicaContext& ctx) {
    CHECK(ctx.replica_id_in_sync_group() == 0);
    CHECK(ctx.num_replicas_in_sync() == 1);
    CHECK(&ctx.device() == &devices::default_cpu_device());
    auto t = Tensor::scalar<float>(2.0f);
    CHECK(ctx.all_reduce(strategy::ReduceOp::kSum, t).item<float>() == 2.0f);
    ++calls;
  });
  CHECK(calls == 1);
  auto sum = one.reduce(strategy::ReduceOp::kSum, {Tensor::from_vector<float>({1, 2}, {2})});
  CHECK(sum.to_vector<float>() == std::vector<float>{1, 2});
  CHECK_THROWS_WITH(one.run([](strategy::ReplicaContext&) { throw DeadlineExceeded("replica failed"); }),
                    "replica failed");
}
