// Internal to keras_like: what plan() needs of the layout checks (layout_check.cc).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "tandem/keras_like/distribution.h"

namespace tandem::keras::detail {
struct ModelState;
}

namespace tandem::keras::distribution::detail {

using keras::detail::LayerNode;
using keras::detail::ModelState;

// Megatron's pairs in a model's graph: a column-parallel Dense (splits: a layer's split name) whose
// output reaches a row-parallel Dense through elementwise layers only (LayerImpl::elementwise;
// each call's single consumer, none a model output), both called once. Returns the column layer
// -> row layer pairs. The other split layers gather their output (column) or split their input
// (row) on their own.
// `cuts` (pipelines): the first calls of the stages after the first; a pair split by one is none.
std::map<const LayerImpl*, const LayerImpl*> tensor_parallel_pairs(const ModelState& state,
                                                                   const std::map<const LayerImpl*, std::string>& splits,
                                                                   const std::vector<std::size_t>& cuts = {});

// The collectives tensor parallelism adds to a step of `model` laid out as `layouts`
// (check_layouts' result), per row of the local batch (PlannedCollective::per_row): Megatron's f
// and g operators for each split layer, bytes per device under the ring convention.
std::vector<PlannedCollective> tensor_parallel_collectives(const Model& model,
                                                           const std::vector<VariableLayout>& layouts);

}  // namespace tandem::keras::distribution::detail
