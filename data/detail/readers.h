// tandem/data/detail/readers.h — reader entry points for the ready-made datasets and the text
// reader (internal; data/readers.cc implements them).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "tandem/graph/tensor.h"

namespace tandem::data::detail {

// read_idx, with `not_found_hint` appended to the NotFound message ("<path>: no such file" +
// hint), so a dataset loader can say where the file comes from. Blocks while it reads.
Tensor read_idx(const std::string& path, std::string_view not_found_hint);

// The whole content of a file, plain or gzip (decided by the first bytes, as zlib's gzread does:
// the gzip magic 1f 8b, not the name), decompressed. Blocks while it reads. NotFound for a missing
// file ("<path>: no such file" + not_found_hint); DataLoss naming the file for a corrupt gzip
// stream, one cut short, or content over max_bytes (checked as it arrives: memory grows only with
// what is read, up to the limit).
std::string read_file(const std::string& path, std::string_view not_found_hint,
                      std::uint64_t max_bytes = std::numeric_limits<std::uint64_t>::max());

}  // namespace tandem::data::detail
