// tandem/data/detail/readers.h — reader entry points for the ready-made datasets (internal).
#pragma once

#include <string>
#include <string_view>

#include "tandem/graph/tensor.h"

namespace tandem::data::detail {

// read_idx, with `not_found_hint` appended to the NotFound message ("<path>: no such file" +
// hint), so a dataset loader can say where the file comes from. Blocks while it reads.
Tensor read_idx(const std::string& path, std::string_view not_found_hint);

}  // namespace tandem::data::detail
