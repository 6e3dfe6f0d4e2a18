// Internal to keras_like: what plan() needs of the layout checks (layout_check.cc).
#pragma once

#include <vector>

#include "tandem/keras_like/distribution.h"

namespace tandem::keras::distribution::detail {

// The collectives tensor parallelism adds to a step of `model` laid out as `layouts`
// (check_layouts' result), per row of the local batch (PlannedCollective::per_row): Megatron's f
// and g operators for each split layer, bytes per device under the ring convention.
std::vector<PlannedCollective> tensor_parallel_collectives(const Model& model,
                                                           const std::vector<VariableLayout>& layouts);

}  // namespace tandem::keras::distribution::detail
