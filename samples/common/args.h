// samples/common/args.h — the Keras samples' command line: --epochs N --batch N --seed N
// --strategy one|mirrored|multiworker --cpu-devices N --dtype-policy P --backup DIR
// --checkpoint PATH --collective-timeout S --zero 0|1|2|3 --print-plan --mesh 2x2 --axes batch,model
// --pipeline-stages N --microbatches M --schedule gpipe|1f1b|interleaved-1f1b --export model.onnx
// --tensorboard DIR (and --help),
// parsed with CLI11; the
// strategy they choose and the callbacks they ask for.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/base/env.h"
#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/keras_like/callbacks.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/mixed_precision.h"
#include "tandem/strategy/multi_worker.h"
#include "tandem/strategy/strategy.h"

namespace samples {

struct Args {
  int epochs;  // unused (and no --epochs flag) when has_epochs is false: char_gpt counts --steps
  bool has_epochs = true;
  std::int64_t batch;
  std::uint64_t seed = 0;
  int verbose = 1;
  double expect_accuracy = 0.0;          // exit non-zero when the test accuracy ends below this
  std::string strategy = "mirrored";     // "one", "mirrored" or "multiworker"
  int cpu_devices = 0;                   // logical CPU devices; 0: MirroredStrategy's default, one per usable core
  std::string dtype_policy = "float32";  // keras::mixed_precision's global policy, set by parse_args
  std::string backup_dir;                // keras::BackupAndRestore's folder; "": none
  std::string checkpoint_path;           // keras::ModelCheckpoint's path; "": none
  double collective_timeout = 0;         // seconds a collective waits for the others; 0: the default
  int zero = 0;                          // ZeRO stage (DistributionOptions::zero) of mirrored and multiworker
  bool print_plan = false;               // print keras::distribution::plan before training
  std::string export_path;               // after training, Model::export_model to this ONNX file; "": none
  std::string tensorboard_dir;           // keras::TensorBoard's log_dir; "": none
  std::vector<std::int64_t> mesh;        // --mesh 2x2: a keras::distribution::ModelParallel on it; empty: none
  std::vector<std::string> axes{"batch", "model"};  // the mesh's axis names; megatron splits over "model"
  int pipeline_stages = 1;               // > 1: a "stage" axis of this many devices added to the mesh
  int microbatches = 0;                  // the pipeline's micro-batches; 0: as many as stages
  std::string schedule = "1f1b";         // the pipeline's schedule
  // Set when the sample must end at once with this status: 0 after --help, else the command line
  // was wrong (parse_args has printed why).
  std::optional<int> exit_code;
};

// Parses the common flags; defaults are the sample's own. add_options adds a sample's own flags
// (char_gpt's model size, --steps, --generate) to the same command line. --help prints the flags
// on stdout; a bad flag or value prints what is wrong on stderr; both set exit_code.
inline Args parse_args(int argc, char** argv, Args defaults, const char* description,
                       const std::function<void(CLI::App&)>& add_options = {}) {
  Args a = defaults;
  CLI::App app(description);
  if (a.has_epochs) {
    app.add_option("--epochs", a.epochs, "passes over the training data")
        ->capture_default_str()
        ->check(CLI::Range(0, 1000000));
  }
  app.add_option("--batch", a.batch, "global batch size (split among the replicas)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  app.add_option("--seed", a.seed, "tandem::set_global_seed's seed")->capture_default_str();
  app.add_option("--verbose", a.verbose, "0 silent, 1 progress bar, 2 one line per epoch")
      ->capture_default_str()
      ->check(CLI::Range(0, 2));
  app.add_option("--strategy", a.strategy,
                 "one (OneDeviceStrategy on CPU:0), mirrored (MirroredStrategy\non every GPU, else every logical CPU "
                 "device) or multiworker\n(MultiWorkerMirroredStrategy: start it with tandem-run, or set\nTF_CONFIG)")
      ->capture_default_str()
      ->check(CLI::IsMember({"one", "mirrored", "multiworker"}));
  app.add_option("--cpu-devices", a.cpu_devices,
                 fmt::format("logical CPU devices (default: MirroredStrategy's, one per usable\ncore, at most {}; "
                             "TANDEM_NUM_CPU_DEVICES also sets it)",
                             tandem::devices::kMaxDefaultCpuDevices))
      ->check(CLI::Range(1, static_cast<int>(tandem::env::kNumCpuDevices.max)));
  app.add_option("--dtype-policy", a.dtype_policy,
                 "float32, mixed_bfloat16 or mixed_float16 (compute in 16 bits,\nweights in float32; mixed_float16 "
                 "adds loss scaling)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](const std::string& name) -> std::string {
            try {
              tandem::keras::mixed_precision::Policy{name};
            } catch (const tandem::Error& e) {
              return e.what();
            }
            return {};
          },
          "POLICY"));
  app.add_option("--backup", a.backup_dir,
                 "back training up into DIR every epoch (keras::BackupAndRestore);\na run that starts with a backup "
                 "there resumes from it: run the\ncommand again, or let tandem-run --max_restarts restart it")
      ->type_name("DIR");
  app.add_option("--checkpoint", a.checkpoint_path,
                 "save the weights to PATH after every epoch (keras::ModelCheckpoint;\nPATH may hold fields such as "
                 "{epoch:02d})")
      ->type_name("PATH");
  app.add_option("--collective-timeout", a.collective_timeout,
                 "seconds a collective waits for the other replicas or workers before\nit fails naming them (default "
                 "300): multiworker's\nCommunicationOptions::timeout_seconds, mirrored's\n"
                 "DistributionOptions::collective_timeout; unused by one")
      ->type_name("SECONDS")
      ->check(CLI::PositiveNumber);
  app.add_option("--zero", a.zero,
                 "ZeRO stage of sharded data parallelism (DeepSpeed's zero_optimization.stage):\n0 none, 1 optimizer "
                 "slots, 2 slots and gradients, 3 also the weights\n(gathered layer by layer); for mirrored and "
                 "multiworker, a no-op with one")
      ->capture_default_str()
      ->check(CLI::Range(0, 3));
  app.add_option("--tensorboard", a.tensorboard_dir,
                 "write TensorBoard logs into DIR (keras::TensorBoard, histograms every\nepoch): tensorboard "
                 "--logdir DIR shows them")
      ->type_name("DIR");
  app.add_option("--export", a.export_path,
                 "after training, write the model as ONNX to PATH (Model::export_model;\nKeras's "
                 "model.export(path, format=\"onnx\")), for ONNX Runtime and the like")
      ->type_name("PATH");
  app.add_flag("--print-plan", a.print_plan,
               "print the model's plan (keras::distribution::plan: bytes per device,\ncollectives per step) "
               "before training, then train");
  app.add_option("--mesh", a.mesh,
                 "train under keras::distribution::ModelParallel on a device mesh of this\nshape (\"1x2\", \"2x2\"; "
                 "logical CPU devices unless --cpu-devices), its\nlayouts LayoutMap::megatron's over the axis "
                 "\"model\"; overrides\n--strategy")
      ->delimiter('x')
      ->check(CLI::Range(1, 4096))
      ->type_name("SHAPE");
  app.add_option("--axes", a.axes, "the --mesh axes' names, comma-separated; the first is the batch axis")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--pipeline-stages", a.pipeline_stages,
                 "cut the model into this many pipeline stages, one device each, along a\nmesh axis \"stage\" added "
                 "to --mesh (ModelParallel's PipelineOptions)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--microbatches", a.microbatches, "micro-batches per step of the pipeline (0: as many as stages)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--schedule", a.schedule, "the pipeline's schedule: gpipe, 1f1b or interleaved-1f1b")
      ->capture_default_str();
  app.add_option("--expect-accuracy", a.expect_accuracy,
                 "exit with status 3 when the final test accuracy is below this");
  if (add_options) add_options(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    a.exit_code = app.exit(e);
    return a;
  }
  tandem::keras::mixed_precision::set_global_policy(a.dtype_policy);
  return a;
}

// Prints the final test figures; returns the sample's exit status: 3 when the accuracy is below
// --expect-accuracy, else 0.
inline int report_test(double loss, double accuracy, const Args& a) {
  std::printf("test loss %.4f, test accuracy %.4f\n", loss, accuracy);
  if (accuracy < a.expect_accuracy) {
    std::printf("below the expected accuracy %.4f\n", a.expect_accuracy);
    return 3;
  }
  return 0;
}

// --mesh and --axes: ModelParallel over the mesh, with Megatron's layouts over the axis "model"
// when the mesh has one (a layout over a one-device axis splits nothing).
inline std::unique_ptr<tandem::Strategy> make_model_parallel(const Args& a) {
  namespace kd = tandem::keras::distribution;
  std::vector<std::int64_t> shape = a.mesh.empty() ? std::vector<std::int64_t>{1} : a.mesh;
  std::int64_t devices = 1;
  for (const auto n : shape) devices *= n;
  auto axes = a.axes;
  if (axes.size() > shape.size()) axes.resize(shape.size());  // --mesh 2 takes the first name ("batch")
  std::optional<kd::PipelineOptions> pipeline;
  if (a.pipeline_stages > 1) {
    shape.push_back(a.pipeline_stages);
    axes.push_back("stage");
    devices *= a.pipeline_stages;
    pipeline = kd::PipelineOptions{.microbatches = a.microbatches,
                                   .schedule = tandem::strategy::parse_pipeline_schedule(a.schedule)};
  }
  const int cpu_devices = a.cpu_devices > 0 ? a.cpu_devices : static_cast<int>(devices);
  tandem::devices::set_logical_device_configuration({.num_cpu_devices = cpu_devices});
  std::vector<std::string> names;
  for (std::int64_t d = 0; d < devices; ++d) names.push_back(fmt::format("CPU:{}", d));
  kd::DeviceMesh mesh(shape, axes, names);
  kd::LayoutMap map = mesh.has_axis("model") ? kd::LayoutMap::megatron(mesh, "model") : kd::LayoutMap(mesh);
  tandem::strategy::DistributionOptions options;
  options.zero = static_cast<tandem::strategy::ZeroStage>(a.zero);
  auto mp = std::make_unique<kd::ModelParallel>(
      std::move(map), kd::ModelParallelOptions{.pipeline = pipeline, .distribution = options});
  std::printf("ModelParallel on %s, %d replicas in sync along '%s'\n", mesh.to_string().c_str(),
              static_cast<int>(mesh.axis_size(mp->batch_dim_name())), mp->batch_dim_name().c_str());
  return mp;
}

// Compiles through `compile`. Under --print-plan, a compile that ModelParallel refuses because
// what it asks is not built (a pipeline of several stages) prints the plan of the refused
// distribution first, so that it can still be looked at.
inline void compile_model(const Args& a, const tandem::keras::Model& model, const std::function<void()>& compile,
                          std::int64_t rows_per_example = 1) {
  try {
    compile();
  } catch (const tandem::Unimplemented&) {
    if (a.print_plan) {
      tandem::keras::distribution::print_plan(model, std::cout, {.batch_rows = a.batch * rows_per_example});
    }
    throw;
  }
}

// The strategy --strategy names, on --cpu-devices logical CPU devices when given. The samples'
// code reads as if it had written one of these two lines itself:
//   tandem::OneDeviceStrategy strategy("CPU:0");
//   tandem::MirroredStrategy strategy;  // every GPU, else one logical CPU device per core
inline std::unique_ptr<tandem::Strategy> make_strategy(const Args& a) {
  if (!a.mesh.empty() || a.pipeline_stages > 1) return make_model_parallel(a);
  if (a.strategy == "multiworker") {
    // One replica per worker on CPU:0 (TF's choice), or --cpu-devices replicas per worker (the
    // all-reduce is then hierarchical). The worker's share of the cores is the strategy's call.
    tandem::strategy::MultiWorkerOptions options;
    options.communication_options.timeout_seconds = a.collective_timeout;
    options.distribution.zero = static_cast<tandem::strategy::ZeroStage>(a.zero);
    for (int d = 0; d < a.cpu_devices; ++d) options.local_devices.push_back(fmt::format("CPU:{}", d));
    auto multi = std::make_unique<tandem::MultiWorkerMirroredStrategy>(options);
    if (multi->should_log()) {
      std::printf("MultiWorkerMirroredStrategy: %d workers, %d replicas in sync (%s)\n", multi->num_workers(),
                  multi->num_replicas_in_sync(), std::string(multi->cluster_resolver().kind()).c_str());
    }
    return multi;
  }
  if (a.cpu_devices > 0) tandem::devices::set_logical_device_configuration({.num_cpu_devices = a.cpu_devices});
  if (a.strategy == "one") {
    // As DeepSpeed on one GPU: a ZeRO stage over one replica shards nothing, so it is accepted.
    if (a.zero > 0) std::printf("--zero %d with --strategy one: one replica, nothing to shard\n", a.zero);
    return std::make_unique<tandem::OneDeviceStrategy>("CPU:0");
  }
  tandem::strategy::MirroredOptions options;
  options.distribution.zero = static_cast<tandem::strategy::ZeroStage>(a.zero);
  if (a.collective_timeout > 0) {
    options.distribution.collective_timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(a.collective_timeout));
  }
  auto mirrored = std::make_unique<tandem::MirroredStrategy>(options);
  std::printf("MirroredStrategy on %d devices%s\n", mirrored->num_replicas_in_sync(),
              a.zero > 0 ? fmt::format(", ZeRO stage {}", a.zero).c_str() : "");
  return mirrored;
}

// --print-plan: the plan of the built model under its strategy, printed by the worker that logs.
// Training follows: the plan is computed from the model alone and costs nothing, so asking for it
// must not change the run (--epochs 0 / --steps 0 for the plan alone).
// rows_per_example: the rows a layer sees per example (a sequence's positions), for the plan's
// per-step totals of tensor-parallel and pipeline traffic.
inline void print_plan_if_asked(const Args& a, const tandem::keras::Model& model, std::int64_t rows_per_example = 1) {
  if (a.print_plan && model.distribute_strategy().should_log()) {
    tandem::keras::distribution::print_plan(model, std::cout, {.batch_rows = a.batch * rows_per_example});
  }
}

// --export PATH: the trained model as ONNX, written by the worker that logs.
inline void export_if_asked(const Args& a, const tandem::keras::Model& model) {
  if (a.export_path.empty() || !model.distribute_strategy().should_log()) return;
  model.export_model(a.export_path);
  std::printf("exported the model as ONNX to %s\n", a.export_path.c_str());
}

// The callbacks --backup, --checkpoint and --tensorboard ask for, for fit's list: Keras's BackupAndRestore (with
// a line saying where a run resumed from) and ModelCheckpoint. Every worker of a multi-worker run
// passes them; only the chief writes files and prints.
inline std::vector<tandem::keras::CallbackPtr> fit_callbacks(const Args& a, const tandem::Strategy& strategy) {
  namespace keras = tandem::keras;
  std::vector<keras::CallbackPtr> out;
  if (!a.backup_dir.empty()) {
    auto backup = std::make_shared<keras::BackupAndRestore>(a.backup_dir);
    out.push_back(backup);
    out.push_back(std::make_shared<keras::LambdaCallback>(
        keras::LambdaCallbackOptions{.on_train_begin = [backup, log = strategy.should_log()](keras::Logs&) {
          if (log && !backup->restored_from().empty()) {
            std::printf("BackupAndRestore: resuming from %s\n", backup->restored_from().c_str());
          }
        }}));
  }
  if (!a.checkpoint_path.empty()) out.push_back(std::make_shared<keras::ModelCheckpoint>(a.checkpoint_path));
  if (!a.tensorboard_dir.empty()) {
    out.push_back(std::make_shared<keras::TensorBoard>(a.tensorboard_dir, keras::TensorBoardOptions{.histogram_freq = 1}));
  }
  return out;
}

}  // namespace samples
