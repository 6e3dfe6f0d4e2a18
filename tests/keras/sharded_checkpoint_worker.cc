// The worker program of the multi-process sharded checkpoint test (sharded_checkpoint_test.cc),
// started by tandem-run: each worker is a MultiWorkerMirroredStrategy of one replica.
//   --mode save --dir D         the test's tensors (sharded_checkpoint_values.h) sharded over the
//                               workers, saved into D together
//   --mode load --dir D --out O each worker loads its shards of D's "a" and "b" and the whole "c"
//                               and writes them to O/worker-<rank>.safetensors for the test to check
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <string>

#include "keras/sharded_checkpoint_values.h"
#include "tandem/keras_like/saving.h"
#include "tandem/keras_like/sharded_checkpoint.h"
#include "tandem/strategy/multi_worker.h"

using namespace tandem;

int main(int argc, char** argv) {
  CLI::App app("sharded_checkpoint_worker: the worker program of the sharded checkpoint test");
  std::string mode, dir, out;
  app.add_option("--mode", mode)->required()->check(CLI::IsMember({"save", "load"}));
  app.add_option("--dir", dir)->required();
  app.add_option("--out", out);
  CLI11_PARSE(app, argc, argv);
  try {
    MultiWorkerMirroredStrategy strategy;
    if (mode == "save") {
      keras::save_checkpoint_directory(strategy, dir, testing::contents_on(strategy));
      return 0;
    }
    const keras::CheckpointReader reader(dir);
    keras::NamedTensors result;
    for (const auto& [name, shape] :
         {std::pair{std::string("a"), testing::kA}, std::pair{std::string("b"), testing::kB}}) {
      auto target = testing::sharded_variable(strategy, name, shape,
                                              std::vector<float>(static_cast<std::size_t>(shape.num_elements()), 9.0f));
      keras::assign_checkpoint_value(*target, reader.read_for(name, *target));
      result.emplace_back(name, target->value(0));
    }
    auto c = testing::replicated_variable(strategy, "c", Tensor::zeros({2, 2}, DType::kF32));
    keras::assign_checkpoint_value(*c, reader.read_for("c", *c));
    result.emplace_back("c", c->read_value());
    keras::write_safetensors(fmt::format("{}/worker-{}.safetensors", out, strategy.worker_rank()), result);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sharded_checkpoint_worker: %s\n", e.what());
    return 1;
  }
}
