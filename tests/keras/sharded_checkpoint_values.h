// What the sharded checkpoint tests save and load (sharded_checkpoint_test.cc, in this process,
// and sharded_checkpoint_worker.cc, as workers under tandem-run): sharded variables made by
// hand as a ZeRO strategy makes them (a ShardSpec over the replicas in sync), a replicated one and
// a step counter, with values whose every element differs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/keras_like/sharded_checkpoint.h"
#include "tandem/strategy/strategy.h"
#include "tandem/strategy/variable.h"

namespace tandem::testing {

using strategy::ShardSpec;
using strategy::Strategy;
using strategy::Variable;
using VariablePtr = std::shared_ptr<Variable>;

// A distinct value per element, so that a misplaced element shows.
inline std::vector<float> pattern(std::int64_t n, float base) {
  std::vector<float> out;
  for (std::int64_t i = 0; i < n; ++i) out.push_back(base + 0.001f * static_cast<float>(i) + 1.0f / (3.0f + i));
  return out;
}

// A variable of `strategy` sharded over its replicas in sync (ShardSpec::even), holding `value`;
// replica r of worker w holds shard w x local + r.
inline VariablePtr sharded_variable(Strategy& strategy, const std::string& name, const Shape& shape,
                                    const std::vector<float>& value) {
  const auto spec = ShardSpec::even(shape, strategy.num_replicas_in_sync());
  std::vector<Tensor> copies;
  const int local = static_cast<int>(strategy.replica_devices().size());
  for (int r = 0; r < local; ++r) {
    const int s = strategy.worker_rank() * local + r;
    std::vector<float> shard(static_cast<std::size_t>(spec.shard_elements), 0.0f);
    for (std::int64_t i = spec.begin(s); i < spec.end(s); ++i)
      shard[static_cast<std::size_t>(i - spec.begin(s))] = value[static_cast<std::size_t>(i)];
    copies.push_back(Tensor::from_vector<float>(shard, {spec.shard_elements}, *strategy.replica_devices()[r]));
  }
  return std::make_shared<strategy::MirroredVariable>(strategy, strategy::VariableOptions{.name = name}, copies, spec);
}

inline VariablePtr replicated_variable(Strategy& strategy, const std::string& name, const Tensor& value) {
  auto scope = strategy.scope();
  return strategy.create_variable({.name = name, .initial_value = value});
}

// The test's tensors: two sharded (35 elements over 4 shards: 9, 9, 9, 8; 3 over 4: the last
// shard padding only), one replicated, and a step counter.
inline const Shape kA{5, 7};
inline const Shape kB{3};
inline const std::vector<float> kValueA = pattern(35, 1.0f);
inline const std::vector<float> kValueB = pattern(3, -2.0f);
inline const std::vector<float> kValueC = {0.5f, -0.25f, 3.0f, 7.5f};

inline keras::CheckpointContents contents_on(Strategy& strategy) {
  return {.variables = {{"a", sharded_variable(strategy, "a", kA, kValueA)},
                        {"b", sharded_variable(strategy, "b", kB, kValueB)},
                        {"c", replicated_variable(strategy, "c", Tensor::from_vector<float>(kValueC, {2, 2}))}},
          .values = {{"step", Tensor::scalar<std::int64_t>(20)}},
          .metadata = {{"format", "tandem.checkpoint"}, {"epoch", "3"}}};
}

}  // namespace tandem::testing
