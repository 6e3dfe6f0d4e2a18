// multi_worker_trainer: the worker program of the multi-worker tests. It trains a small model on
// fixed synthetic data under the strategy it is told, and writes what the tests compare: the
// loss after every step (losses-<rank>.txt), every epoch's logs (epochs-<rank>.txt), the final weights
// (weights-<rank>.safetensors) and, under multiworker, the collectives issued on each cross-worker communicator so far,
// once before fit and after every step, with the bytes this worker sent on each (collectives-<rank>.txt: "iterations
// batch data control data_bytes control_bytes"), and the bytes of the model's trainable and non-trainable weights
// (weight-bytes-<rank>.txt: "trainable non_trainable").
//
//   multi_worker_trainer --out DIR [--strategy one|mirrored|multiworker|dataparallel] [--epochs 3] [--hidden 16]
//                        [--local-devices N] [--kill-at-step K | --stop-at-step K] [--victim R]
//                        [--backup DIR --save-freq N] [--timeout SECONDS] [--files 1] [--verbose 2]
//                        [--writers 1] [--implementation auto|ring|shm|nccl] [--seed S] [--step-times 1]
//                        [--batch 64] [--deterministic 0] [--batchnorm 1] [--accumulate N] [--validation 1]
//                        [--zero 0|1|2|3] [--reduce-bucket-bytes B]
//
// --strategy mirrored: MirroredStrategy on --local-devices logical CPU devices (the reference of
// the multi-worker runs; set TANDEM_NUM_CPU_DEVICES to at least that many). --strategy
// dataparallel: keras::distribution::DataParallel over every worker's CPU:0 (one local device).
// --batchnorm 1 puts a BatchNormalization layer after the hidden one (moving statistics to average
// every step); --accumulate N sets Adam's gradient_accumulation_steps; --validation 1 evaluates
// on two global batches of the training data after every epoch. --zero N: DistributionOptions::zero
// of mirrored and multiworker (ZeRO's sharded optimizer state and gradients); --reduce-bucket-bytes B
// its DistributionOptions::reduce_bucket_bytes (small: several buckets, so that stages 2 and 3 hand
// gradients off during backward). Losses are printed with 17 digits: bitwise.
// --kill-at-step K: this process SIGKILLs itself after global step K, on the first attempt only
// (TANDEM_RESTART_COUNT unset or 0), when its rank is --victim (default 1). --stop-at-step K
// freezes it (SIGSTOP) instead. Either first writes one line on stderr saying so, which the
// multi-host tests (tests/multihost/) take as the moment of the fault.
// --step-times 1: also writes the steady clock's seconds at the end of every step
// (step-times-<rank>.txt), from which the latency test takes the time per step.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <tandem/base/env.h>
#include <tandem/keras_like/keras.h>

namespace {

using namespace tandem;

struct Args {
  std::string out = ".";
  std::string strategy = "multiworker";
  int epochs = 3;
  int hidden = 16;
  std::int64_t batch = 64;  // the global batch
  int local_devices = 1;
  long kill_at_step = -1;
  long stop_at_step = -1;
  int victim = 1;
  std::string backup;
  long save_freq = 0;
  double timeout = 0;
  bool files = false;  // the data as 5 "files" (Dataset::from_files): the FILE auto-shard policy
  int verbose = 0;
  std::uint64_t seed = 42;              // the global seed (initializers)
  std::string implementation = "auto";  // auto, ring, shm, nccl
  bool writers = false;                 // a CSVLogger and a ModelCheckpoint, to files named after this worker's rank
  bool step_times = false;              // step-times-<rank>.txt: the steady clock at the end of every step
  bool deterministic = true;            // CommunicationOptions::deterministic
  bool batchnorm = false;
  int accumulate = 0;  // Adam's gradient_accumulation_steps (0: none)
  bool validation = false;
  int zero = 0;  // DistributionOptions::zero
  std::int64_t reduce_bucket_bytes = 0;  // DistributionOptions::reduce_bucket_bytes (0: its default)
};

// Parses the command line; CLI11 reports a bad one and exits (the tests pass only known flags).
Args parse(int argc, char** argv) {
  Args a;
  CLI::App app("multi_worker_trainer: the worker program of the multi-worker tests");
  app.add_option("--out", a.out, "folder for losses-<rank>.txt and weights-<rank>.safetensors");
  app.add_option("--strategy", a.strategy, "one, mirrored, multiworker or dataparallel");
  app.add_option("--epochs", a.epochs);
  app.add_option("--hidden", a.hidden, "units of the hidden layer");
  app.add_option("--batch", a.batch, "the global batch size (default 64)");
  app.add_option("--local-devices", a.local_devices, "replicas per worker (mirrored: replicas)");
  app.add_option("--kill-at-step", a.kill_at_step, "SIGKILL the victim after this global step (first attempt)");
  app.add_option("--stop-at-step", a.stop_at_step, "SIGSTOP the victim after this global step (first attempt)");
  app.add_option("--victim", a.victim, "the rank --kill-at-step kills or --stop-at-step freezes");
  app.add_option("--backup", a.backup, "BackupAndRestore's folder");
  app.add_option("--save-freq", a.save_freq, "BackupAndRestore's save_freq in batches");
  app.add_option("--timeout", a.timeout, "collective timeout in seconds");
  app.add_option("--files", a.files, "1: the data as 5 files (the FILE auto-shard policy)");
  app.add_option("--verbose", a.verbose);
  app.add_option("--seed", a.seed, "the global seed");
  app.add_option("--implementation", a.implementation, "auto, ring, shm or nccl");
  app.add_option("--writers", a.writers, "1: a CSVLogger and a ModelCheckpoint per worker");
  app.add_option("--step-times", a.step_times, "1: the steady clock's seconds after every step, one per line");
  app.add_option("--deterministic", a.deterministic, "CommunicationOptions::deterministic (default 1)");
  app.add_option("--batchnorm", a.batchnorm, "1: a BatchNormalization layer after the hidden one");
  app.add_option("--accumulate", a.accumulate, "Adam's gradient_accumulation_steps");
  app.add_option("--validation", a.validation, "1: validation data (two global batches)");
  app.add_option("--zero", a.zero, "ZeRO stage (DistributionOptions::zero) of mirrored and multiworker");
  app.add_option("--reduce-bucket-bytes", a.reduce_bucket_bytes,
                 "DistributionOptions::reduce_bucket_bytes of mirrored and multiworker (0: the default)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  return a;
}

// 610 examples of 10 features, 3 classes: the last global batch of 64 has 34 rows, which 3
// workers cannot split evenly.
data::Dataset make_data(bool files, std::int64_t batch) {
  constexpr std::int64_t kExamples = 610, kFeatures = 10;
  Tensor x = Tensor::empty({kExamples, kFeatures}, DType::kF32);
  Tensor y = Tensor::empty({kExamples}, DType::kI32);
  std::uint64_t state = 12345;
  const auto uniform = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((state >> 40) & 0xFFFFFF) / static_cast<float>(0x1000000) - 0.5f;
  };
  for (std::int64_t i = 0; i < kExamples; ++i) {
    float score = 0;
    for (std::int64_t j = 0; j < kFeatures; ++j) {
      const float v = uniform();
      x.data<float>()[i * kFeatures + j] = v;
      score += v * static_cast<float>(j % 3 - 1);
    }
    y.data<std::int32_t>()[i] = score > 0.2f ? 2 : score < -0.2f ? 0 : 1;
  }
  if (files) {
    // Five "files" of 122 examples: file k is rows [122 k, 122 (k + 1)).
    constexpr std::int64_t kPerFile = kExamples / 5;
    const auto rows = [](const Tensor& t, std::int64_t k) {
      Shape shape = t.shape();
      shape[0] = kPerFile;
      const std::size_t row_bytes = t.nbytes() / static_cast<std::size_t>(kExamples);
      return Tensor(shape, t.dtype(), t.buffer(), t.byte_offset() + static_cast<std::size_t>(k * kPerFile) * row_bytes);
    };
    return data::Dataset::from_files({"0", "1", "2", "3", "4"},
                                     [=](const std::string& path) {
                                       const std::int64_t k = std::stoll(path);
                                       return data::Dataset::from_tensor_slices({rows(x, k), rows(y, k)});
                                     })
        .batch(batch);
  }
  return data::Dataset::from_tensor_slices({x, y}).shuffle(kExamples, 7).batch(batch);
}

int run(const Args& a) {
  set_global_seed(a.seed);
  std::unique_ptr<Strategy> strategy;
  MultiWorkerMirroredStrategy* multi_worker = nullptr;
  int rank = 0;
  // --zero and --reduce-bucket-bytes, for mirrored and multiworker alike.
  strategy::DistributionOptions distribution{.zero = static_cast<strategy::ZeroStage>(a.zero)};
  if (a.reduce_bucket_bytes > 0) distribution.reduce_bucket_bytes = a.reduce_bucket_bytes;
  if (a.strategy == "one") {
    strategy = std::make_unique<OneDeviceStrategy>("CPU:0");
  } else if (a.strategy == "mirrored") {
    std::vector<std::string> devices;
    for (int d = 0; d < a.local_devices; ++d) devices.push_back(fmt::format("CPU:{}", d));
    strategy =
        std::make_unique<MirroredStrategy>(strategy::MirroredOptions{.devices = devices, .distribution = distribution});
  } else {
    strategy::MultiWorkerOptions options;
    options.communication_options.timeout_seconds = a.timeout;
    options.communication_options.deterministic = a.deterministic;
    options.distribution = distribution;
    using Impl = strategy::CommunicationImplementation;
    options.communication_options.implementation = a.implementation == "ring"   ? Impl::kRing
                                                   : a.implementation == "shm"  ? Impl::kSharedMemory
                                                   : a.implementation == "nccl" ? Impl::kNccl
                                                                                : Impl::kAuto;
    for (int d = 0; d < a.local_devices; ++d) options.local_devices.push_back(fmt::format("CPU:{}", d));
    std::unique_ptr<MultiWorkerMirroredStrategy> mw;
    if (a.strategy == "dataparallel") {
      // keras::distribution's DataParallel over the default global mesh (list_devices(): every
      // worker's CPU:0, named by rank), with the same communication options.
      namespace kd = keras::distribution;
      const auto devices = kd::list_devices();
      mw = std::make_unique<kd::DataParallel>(
          kd::DeviceMesh({static_cast<std::int64_t>(devices.size())}, {"batch"}, devices),
          kd::DataParallelOptions{.workers = {.communication_options = options.communication_options}});
    } else {
      mw = std::make_unique<MultiWorkerMirroredStrategy>(options);
    }
    rank = mw->worker_rank();
    multi_worker = mw.get();
    strategy = std::move(mw);
  }
  const bool first_attempt = env::get_int(env::kRestartCount) == 0;

  keras::Model model;
  {
    auto scope = strategy->scope();
    std::vector<keras::SequentialItem> layers{keras::Input({10}), keras::Dense(a.hidden, "relu")};
    if (a.batchnorm) layers.push_back(keras::BatchNormalization());
    layers.push_back(keras::Dense(3));
    model = keras::Sequential(layers);
    keras::Adam adam{.learning_rate = 0.01};
    if (a.accumulate > 0) adam.gradient_accumulation_steps = a.accumulate;
    model.compile(adam, keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
  }
  std::ofstream losses(fmt::format("{}/losses-{}.txt", a.out, rank));
  std::ofstream step_times;
  if (a.step_times) step_times.open(fmt::format("{}/step-times-{}.txt", a.out, rank));
  std::ofstream epochs(fmt::format("{}/epochs-{}.txt", a.out, rank));
  std::ofstream collectives;
  const auto count_collectives = [&](long iterations, long batch) {
    if (multi_worker == nullptr) return;
    const auto counts = multi_worker->collective_counts();
    const auto stats = multi_worker->cross_worker_stats_per_communicator();
    collectives << fmt::format("{} {} {} {} {} {}\n", iterations, batch, counts.data, counts.control,
                               stats.data.total().bytes_sent, stats.control.total().bytes_sent)
                << std::flush;
  };
  if (multi_worker != nullptr) {
    collectives.open(fmt::format("{}/collectives-{}.txt", a.out, rank));
    count_collectives(-1, -1);
    const auto bytes = [](const std::vector<keras::VariablePtr>& variables) {
      std::int64_t sum = 0;
      for (const auto& v : variables) sum += static_cast<std::int64_t>(v->shape().num_elements()) * 4;  // float32
      return sum;
    };
    std::ofstream(fmt::format("{}/weight-bytes-{}.txt", a.out, rank))
        << bytes(model.trainable_weights()) << " " << bytes(model.non_trainable_weights()) << "\n";
  }
  long step = 0;
  // The victim's fault, announced first so that a test can time what the others report from it.
  const auto fault = [&](long at_step, int sig) {
    if (at_step < 0 || step != at_step || !first_attempt || rank != a.victim) return;
    std::cerr << fmt::format("multi_worker_trainer: rank {} raises SIG{} after step {}\n", rank, sigabbrev_np(sig),
                             step)
              << std::flush;
    std::raise(sig);
  };
  keras::FitOptions fit{.epochs = a.epochs, .verbose = a.verbose};
  if (a.writers) {
    fit.callbacks.push_back(std::make_shared<keras::CSVLogger>(fmt::format("{}/log-of-{}.csv", a.out, rank)));
    fit.callbacks.push_back(
        std::make_shared<keras::ModelCheckpoint>(fmt::format("{}/checkpoint-of-{}.weights.safetensors", a.out, rank),
                                                 keras::ModelCheckpointOptions{.monitor = "loss"}));
  }
  fit.callbacks.push_back(std::make_shared<keras::LambdaCallback>(keras::LambdaCallbackOptions{
      .on_epoch_end =
          [&](int epoch, keras::Logs& logs) {
            epochs << epoch;
            for (const auto& [key, value] : logs) epochs << fmt::format(" {}={:.17g}", key, value);
            epochs << "\n" << std::flush;
          },
      .on_train_batch_end =
          [&](std::int64_t batch, keras::Logs& logs) {
            ++step;
            losses << fmt::format("{} {} {:.17g}\n", model.optimizer().iterations(), batch, *logs.get("loss"))
                   << std::flush;
            count_collectives(model.optimizer().iterations(), batch);
            if (step_times.is_open()) {
              step_times
                  << fmt::format(
                         "{:.6f}\n",
                         std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count())
                  << std::flush;
            }
            fault(a.kill_at_step, SIGKILL);
            fault(a.stop_at_step, SIGSTOP);
          }}));
  if (!a.backup.empty()) {
    fit.callbacks.push_back(
        std::make_shared<keras::BackupAndRestore>(a.backup, keras::BackupAndRestoreOptions{.save_freq = a.save_freq}));
  }
  if (a.validation) fit.validation_data = make_data(false, a.batch).take(2);
  model.fit(make_data(a.files, a.batch), fit);
  const auto weights_path = fmt::format("{}/weights-{}.safetensors", a.out, rank);
  if (a.zero == 3) {
    // Sharded weights: save_weights would write one sharded checkpoint together with the other
    // workers. Each worker writes its own file of the whole values (get_weights gathers them).
    keras::NamedTensors named;
    const auto values = model.get_weights();
    const auto weights = model.weights();
    for (std::size_t i = 0; i < weights.size(); ++i) named.emplace_back(weights[i]->name(), values[i]);
    keras::write_safetensors(weights_path, named);
  } else {
    model.save_weights(weights_path);
  }
  std::cout << "worker " << rank << " done\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "multi_worker_trainer: error: " << e.what() << "\n";
    return 1;
  }
}
