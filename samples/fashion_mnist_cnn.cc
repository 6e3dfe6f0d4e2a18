// A small CNN on Fashion-MNIST: Conv 32 3x3, max-pool, Conv 64 3x3, max-pool, Dense 128, Dense 10.
//
//   build/samples/fashion_mnist_cnn [--epochs 10] [--batch 64] [--seed 0] [--strategy one|mirrored|multiworker]
//       [--cpu-devices N] [--dtype-policy P] [--backup DIR] [--checkpoint PATH] [--collective-timeout S]
//       [--expect-accuracy A] [--export model.onnx] [--tensorboard DIR]
#include <tandem/keras_like/keras.h>

#include <cstdio>

#include "common/args.h"

int main(int argc, char** argv) try {
  using namespace tandem;
  // Batch 64: enough steps for about 0.91 after 10 epochs (at 128 it ends near 0.90).
  const auto args = samples::parse_args(argc, argv, {.epochs = 10, .batch = 64},
                                        "fashion_mnist_cnn: a two-convolution CNN on Fashion-MNIST");
  if (args.exit_code) return *args.exit_code;
  set_global_seed(args.seed);

  // The one line that moves this model from one device to all of them; --strategy picks between
  //   tandem::OneDeviceStrategy strategy("CPU:0");
  //   tandem::MirroredStrategy strategy;  // every GPU, else one logical CPU device per core (the default)
  auto strategy = samples::make_strategy(args);
  keras::Model model;
  {
    auto scope = strategy->scope();
    model = keras::Sequential({keras::Input({28, 28}), keras::Reshape({28, 28, 1}), keras::Conv2D(32, {3, 3}, "relu"),
                               keras::MaxPooling2D(), keras::Conv2D(64, {3, 3}, "relu"), keras::MaxPooling2D(),
                               keras::Flatten(), keras::Dense(128, "relu"), keras::Dense(10)});
    model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
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
  std::fprintf(stderr, "fashion_mnist_cnn: %s\n", e.what());
  return 1;
}
