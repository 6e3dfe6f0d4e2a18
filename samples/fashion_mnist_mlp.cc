// The Keras "basic classification" tutorial in tandem: Fashion-MNIST with a one-hidden-layer MLP.
//
//   build/samples/fashion_mnist_mlp [--epochs 10] [--batch 32] [--seed 0] [--strategy one|mirrored|multiworker]
//       [--cpu-devices N] [--dtype-policy P] [--backup DIR] [--checkpoint PATH] [--collective-timeout S]
//       [--expect-accuracy A] [--export model.onnx] [--tensorboard DIR]
//
// Reads Debian's dataset-fashion-mnist package (/usr/share/datasets/fashion-mnist).
#include <tandem/keras_like/keras.h>

#include <cstdio>

#include "common/args.h"

int main(int argc, char** argv) try {
  using namespace tandem;
  // Batch 32: Keras's default batch size, as the tutorial trains: about 0.88 after 10 epochs.
  const auto args = samples::parse_args(argc, argv, {.epochs = 10, .batch = 32},
                                        "fashion_mnist_mlp: Flatten, Dense 128 relu, Dense 10 on Fashion-MNIST");
  if (args.exit_code) return *args.exit_code;
  set_global_seed(args.seed);

  // The one line that moves this model from one device to all of them; --strategy picks between
  //   tandem::OneDeviceStrategy strategy("CPU:0");
  //   tandem::MirroredStrategy strategy;  // every GPU, else one logical CPU device per core (the default)
  auto strategy = samples::make_strategy(args);
  keras::Model model;
  {
    auto scope = strategy->scope();
    model = keras::Sequential({keras::Input({28, 28}), keras::Flatten(), keras::Dense(128, "relu"), keras::Dense(10)});
    samples::compile_model(args, model, [&] {  // --print-plan shows a --mesh layout compile refuses
      model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
    });
  }
  model.summary();
  samples::print_plan_if_asked(args, model);  // --print-plan

  auto data = data::fashion_mnist();
  model.fit(data.train.shuffle(60000).batch(args.batch),
            {.epochs = args.epochs,
             .verbose = args.verbose,
             .callbacks = samples::fit_callbacks(args, *strategy),  // --backup, --checkpoint, --tensorboard
             .validation_data = data.test.batch(1000)});
  const auto test = model.evaluate(data.test.batch(1000), {.verbose = 0});
  samples::export_if_asked(args, model);  // --export model.onnx
  return samples::report_test(test.at("loss"), test.at("accuracy"), args);
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "fashion_mnist_mlp: %s\n", e.what());
  return 1;
}
