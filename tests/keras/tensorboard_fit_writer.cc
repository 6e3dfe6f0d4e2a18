// tensorboard_fit_writer [--multiworker] <log_dir> <history.json>: fits a small model for 3
// epochs with the TensorBoard callback (histograms and graph on, validation data) and writes
// fit's History as JSON ({"loss": [...], "val_loss": [...], ...}, values printed exactly), for
// tensorboard_check.py to compare with what the tensorboard package reads from log_dir.
// --multiworker: one worker of a tandem-run job (MultiWorkerMirroredStrategy), every worker given
// the same log_dir (tensorboard_processes.sh checks that only the chief wrote); the History goes
// to <history.json>.<rank>.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "tandem/keras_like/keras.h"
#include "tandem/strategy/multi_worker.h"
#include "common/regression_data.h"

using namespace tandem;

namespace {

using testing::compiled_regression_model;
using testing::regression_data;

// {"name": [v0, v1, ...], ...}; 17 significant digits read back as the same double.
std::string history_json(const keras::History& history) {
  std::string out = "{";
  for (const auto& [name, values] : history.history) {
    out += fmt::format("{}\"{}\": [", out.size() > 1 ? ", " : "", name);
    for (std::size_t i = 0; i < values.size(); ++i) out += fmt::format("{}{:.17g}", i > 0 ? ", " : "", values[i]);
    out += "]";
  }
  return out + "}\n";
}

}  // namespace

int main(int argc, char** argv) {
  const bool multiworker = argc == 4 && std::string(argv[1]) == "--multiworker";
  if (argc != 3 && !multiworker) {
    std::cerr << "usage: tensorboard_fit_writer [--multiworker] <log_dir> <history.json>\n";
    return 2;
  }
  const std::string log_dir = argv[argc - 2];
  std::string history_path = argv[argc - 1];
  try {
    std::unique_ptr<MultiWorkerMirroredStrategy> strategy;
    keras::Model model;
    if (multiworker) {
      strategy = std::make_unique<MultiWorkerMirroredStrategy>();
      history_path += fmt::format(".{}", strategy->worker_rank());
      auto scope = strategy->scope();
      model = compiled_regression_model();
    } else {
      model = compiled_regression_model();
    }
    const auto train = regression_data(48);
    const auto val = regression_data(16);
    auto tb = std::make_shared<keras::TensorBoard>(log_dir, keras::TensorBoardOptions{.histogram_freq = 1});
    const auto history = model.fit(train.x, train.y,
                                   {.batch_size = 16,
                                    .epochs = 3,
                                    .verbose = 0,
                                    .callbacks = {tb},
                                    .validation_data = data::Dataset::from_tensor_slices({val.x, val.y}).batch(16),
                                    .shuffle = false});
    std::ofstream(history_path) << history_json(history);
    if (!tb->train_file().empty()) {
      std::cout << "wrote " << tb->train_file() << "\n  and " << tb->validation_file() << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "tensorboard_fit_writer: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
