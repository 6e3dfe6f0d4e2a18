// tandem/ops/ops.h — every op tandem ships, as graph-building functions.
//
// Each function adds one node (sometimes a few) to the graph its inputs belong to and returns
// the output(s). Shapes are checked when the node is added: a mismatch throws InvalidArgument
// naming the node and both shapes. The ops register themselves on first use; a program that
// builds graphs by op name (Graph::add) calls register_all() first.
//
//   Graph g;
//   auto x = g.placeholder(kFloat32, {-1, 784}, "x");
//   auto w = g.variable(kFloat32, {784, 10}, "w");
//   auto logits = ops::matmul(x, w);
//   auto loss = ops::reduce_mean(ops::sparse_softmax_cross_entropy_with_logits(logits, labels));
//   auto grads = graph::gradients({&loss, 1}, {&w, 1});
#pragma once

#include "tandem/ops/array_ops.h"
#include "tandem/ops/conv_ops.h"
#include "tandem/ops/math_ops.h"
#include "tandem/ops/nn_ops.h"

namespace tandem::ops {

// Registers every op's definition and CPU kernels (and CUDA kernels when built with CUDA).
// Idempotent and thread-safe; the builder functions call it themselves.
void register_all();

}  // namespace tandem::ops
