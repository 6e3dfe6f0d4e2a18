// tandem/graph/autodiff.h — reverse-mode automatic differentiation on the graph.
//
// gradients(ys, xs) adds to the graph the nodes that compute d(sum of ys)/d(x) for each x, and
// returns their outputs (like tf.gradients). It visits only nodes on a path from some x to some
// y, in reverse order, asking each op's gradient function for its input gradients and summing
// contributions where a value feeds several consumers (AddN). Gradients flow only through
// floating-point values and through ops that have a gradient function.
//
// The new nodes are named "<name_scope>/<forward node name>/...". Needs the ops AddN, OnesLike
// and ZerosLike from tandem::ops (the ops' builders register them).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "tandem/graph/graph.h"

namespace tandem::graph {

// What to return for an x that no y depends on (TF's unconnected_gradients).
enum class UnconnectedGradients {
  kNone,  // an undefined Output
  kZero,  // zeros shaped like x
};

struct GradientOptions {
  UnconnectedGradients unconnected = UnconnectedGradients::kNone;
  std::string name_scope = "gradients";
};

// ys: the values to differentiate (their sum is differentiated when several or non-scalar).
// xs: the values to differentiate with respect to (often Variables; any output works).
// grad_ys: optional seeds, one per y with y's dtype and shape (default: ones).
std::vector<Output> gradients(std::span<const Output> ys, std::span<const Output> xs,
                              std::span<const Output> grad_ys = {}, const GradientOptions& options = {});

}  // namespace tandem::graph
