// tandem/ops/detail/gather_args.h — what Gather's and UnsortedSegmentSum's kernels share on every
// backend: the row an id selects, and the error for an id outside its range, in the same words
// whether a CPU kernel finds it before writing anything or a GPU kernel's deferred check finds it
// after the step (ops/cuda/kernel_util.h).
#pragma once

#include <cstdint>
#include <string_view>

#include "tandem/base/errors.h"
#include "tandem/graph/shape.h"

namespace tandem::ops::detail {

// The elements of one row an id selects: the product of `s`'s axes from `first` on (params' rows
// for Gather, first = 1; data's rows for UnsortedSegmentSum, first = the ids' rank).
inline std::int64_t row_elements(const graph::Shape& s, int first) {
  std::int64_t n = 1;
  for (int d = first; d < s.rank(); ++d) n *= s[d];
  return n;
}

// Ids must lie in [0, limit).
struct IdRange {
  std::string_view what;    // one id: "index"
  std::string_view tensor;  // the ids: "indices"
  std::string_view range;   // what limit counts: "rows of params"
  std::int64_t limit = 0;
};
inline IdRange gather_id_range(std::int64_t rows) { return {"index", "indices", "rows of params", rows}; }
inline IdRange segment_id_range(std::int64_t segments) { return {"segment id", "segment_ids", "segments", segments}; }

// `Gather "embedding/Gather": index 200 (element 17 of indices (32, 128)) is outside [0, 155), the
// rows of params`.
[[noreturn]] inline void throw_bad_id(std::string_view label, const IdRange& range, std::int64_t id,
                                      std::int64_t position, const graph::Shape& ids_shape) {
  throw InvalidArgument(fmt::format("{}: {} {} (element {} of {} {}) is outside [0, {}), the {}", label, range.what, id,
                                    position, range.tensor, ids_shape, range.limit, range.range));
}

}  // namespace tandem::ops::detail
