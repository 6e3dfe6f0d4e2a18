// The worker program of the 2-process ModelParallel fit test (model_parallel_fit_processes.sh),
// started by tandem-run, or alone with --reference:
//   --mesh BxT --out DIR   ModelParallel over a B x T mesh of (batch, model) of every worker's
//                          devices, fc1/fc2 tensor-parallel (parallel_fit_mlp.h), trained as the
//                          in-process test trains it; checked here against OneDeviceStrategy
//                          (within 1e-5) and written to DIR/rank-R.txt bit for bit (hex floats)
//   --axes batch,stage     the mesh's second axis is a pipeline's instead (2 stages, 1F1B, 4
//                          micro-batches); batch,model,stage (a 3-D --mesh): both
//   --reference            the same mesh over this one process's devices, written as rank 0
//   --zero 1|2|3           ZeRO over tensor parallelism: each piece's slots (gradients, weights) sharded
// Every worker also saves the weights into DIR/weights/ together; rank 0 loads them on one device
// and checks that they evaluate to the run's loss, and with --pieces-on-every-worker that every
// worker's file holds pieces of split weights (each piece written by a worker holding it).
// Exit status 1, with the difference on stderr, when the run is not equivalent to one device.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "common/temp_dir.h"
#include "keras/parallel_fit_mlp.h"
#include "tandem/keras_like/sharded_checkpoint.h"

using namespace tandem;
using namespace tandem::testing::parallel_fit;
namespace kd = tandem::keras::distribution;

int main(int argc, char** argv) {
  CLI::App app("model_parallel_fit_worker: ModelParallel's tensor parallelism under fit across processes");
  std::vector<std::int64_t> mesh_shape;
  std::vector<std::string> axes{"batch", "model"};
  std::string out;
  bool reference = false;
  app.add_option("--mesh", mesh_shape, "devices per axis")->required()->delimiter('x')->expected(2, 3);
  app.add_option("--axes", axes, "the mesh's axes: batch,model, batch,stage or batch,model,stage")
      ->delimiter(',')
      ->expected(2, 3);
  app.add_option("--out", out)->required();
  app.add_flag("--reference", reference, "one process over its own devices");
  int zero = 0;
  app.add_option("--zero", zero,
                 "ZeRO stage (1, 2, 3: each piece's slots, gradients, weights sharded along the batch axis)")
      ->check(CLI::Range(0, 3));
  bool pieces_on_every_worker = false;
  app.add_flag("--pieces-on-every-worker", pieces_on_every_worker,
               "the mesh puts split weights' pieces on every worker: each worker's checkpoint file must hold some");
  CLI11_PARSE(app, argc, argv);
  try {
    Run want;
    {
      OneDeviceStrategy one("CPU:0");
      want = train(one);
    }
    const kd::DeviceMesh mesh(mesh_shape, axes, kd::list_devices("cpu"));
    const bool tensor = mesh.has_axis("model"), pipeline = mesh.has_axis("stage");
    kd::ModelParallel mp(tensor ? pair_layouts(mesh) : kd::LayoutMap(mesh),
                         {.pipeline = pipeline ? std::optional(kd::PipelineOptions{.microbatches = 4}) : std::nullopt,
                          .distribution = {.zero = static_cast<strategy::ZeroStage>(zero)}});
    // Saved by every worker together (a checkpoint directory: the pieces may be on several), and
    // loaded on one device below.
    const std::string saved = fmt::format("{}/weights/", out);
    const Run got = train(mp, saved);
    const int rank = reference ? 0 : mp.worker_rank();
    std::filesystem::create_directories(out);
    std::ofstream file(fmt::format("{}/rank-{}.txt", out, rank));
    for (const double loss : got.losses) file << fmt::format("loss {:a}\n", loss);
    file << fmt::format("evaluation {:a}\n", got.evaluation);
    for (const auto& w : got.weights) {
      file << "weight";
      for (const float v : w) file << fmt::format(" {:a}", v);
      file << "\n";
    }
    // Per device and step: the same in one process as in two.
    file << fmt::format(
        "tensor_parallel_bytes_per_device_and_step {}\n",
        got.stats.tensor_parallel.total().bytes_sent / std::max<std::int64_t>(1, got.stats.steps * got.stats.replicas));
    std::string difference_from_one_device = difference(got, want);
    if (rank == 0 && pieces_on_every_worker && !reference) {
      // Each piece is written by a worker that holds it, so that no worker gathers the others'.
      const auto index = keras::parse_checkpoint_index(
          testing::read_file_bytes(fmt::format("{}/weights/{}", out, keras::kCheckpointIndexName)), "index.json");
      std::set<std::string> files;
      for (const auto& t : index.tensors) {
        if (!t.split) continue;
        for (const auto& c : t.chunks) files.insert(c.file);
      }
      if (files.size() != index.files.size() && difference_from_one_device.empty())
        difference_from_one_device = fmt::format("the split weights' pieces are in {} of the {} workers' files",
                                                 files.size(), index.files.size());
    }
    if (rank == 0) {
      OneDeviceStrategy one("CPU:0");
      Model reloaded = [&] {
        auto scope = one.scope();
        return make_mlp();
      }();
      {
        auto scope = one.scope();
        reloaded.compile("adam", "mse");
      }
      reloaded.load_weights(saved);
      const auto [x, y] = make_data(kSteps + 1);
      const double loss = reloaded.evaluate(x, y, {.batch_size = kBatch, .verbose = 0}).at("loss");
      if (std::abs(loss - got.evaluation) > 1e-6 * std::abs(got.evaluation) && difference_from_one_device.empty())
        difference_from_one_device = fmt::format("the saved weights evaluate to {} on one device, not {}", loss,
                                                 got.evaluation);
    }
    if (!difference_from_one_device.empty()) {
      std::fprintf(stderr, "model_parallel_fit_worker rank %d: differs from one device: %s\n", rank,
                   difference_from_one_device.c_str());
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_parallel_fit_worker: %s\n", e.what());
    return 1;
  }
}
