// tandem/ops/detail/dropout_attrs.h — a Dropout node's attributes, read and checked the same way by
// the CPU and GPU kernels (the mask itself: dropout_hash.h).
#pragma once

#include <cstdint>

#include "tandem/graph/op_registry.h"
#include "tandem/ops/detail/dropout_hash.h"

namespace tandem::ops::detail {

struct DropoutRun {
  double rate = 0.5;
  bool active = true;           // training with a positive rate: a mask is drawn
  std::uint64_t key = 0;        // dropout_key of this node and step
  std::uint64_t threshold = 0;  // dropout_threshold(rate)
};

// Throws InvalidArgument naming the node when the rate is outside [0, 1).
inline DropoutRun read_dropout(const graph::KernelContext& ctx) {
  DropoutRun run;
  run.rate = ctx.attrs().get_float_or("rate", 0.5);
  const auto seed = static_cast<std::uint64_t>(ctx.attrs().get_int_or("seed", 0));
  TANDEM_REQUIRE(run.rate >= 0.0 && run.rate < 1.0, InvalidArgument, "{}: rate is {}; expected a fraction in [0, 1)",
                 ctx.label(), run.rate);
  run.active = ctx.attrs().get_bool_or("training", true) && run.rate != 0.0;
  run.key = dropout_key(ctx.random_seed(), seed);
  run.threshold = dropout_threshold(run.rate);
  return run;
}

}  // namespace tandem::ops::detail
