// Fuzzing harness: parse_checkpoint_index (keras_like/checkpoint_index.cc), the reader of a
// sharded checkpoint's index.json. Whatever the text holds, it must return an index or throw one
// of tandem's errors. What it returns must hold the invariants the loader relies on (each
// tensor's chunks tile its elements in order, byte lengths match, one checksum per block, file
// names are plain names listed in the index), and write back (checkpoint_index_json) to text that
// parses to the same index. Anything else, a crash or a sanitizer report, is a finding.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/keras_like/sharded_checkpoint.h"

namespace {

using tandem::keras::CheckpointIndex;

bool same_index(const CheckpointIndex& a, const CheckpointIndex& b) {
  if (a.num_shards != b.num_shards || a.num_workers != b.num_workers ||
      a.checksum_block_bytes != b.checksum_block_bytes || a.files != b.files || a.metadata != b.metadata ||
      a.tensors.size() != b.tensors.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& x = a.tensors[i];
    const auto& y = b.tensors[i];
    if (x.name != y.name || x.dtype != y.dtype || !(x.shape == y.shape) || x.num_shards != y.num_shards ||
        x.chunks.size() != y.chunks.size()) {
      return false;
    }
    for (std::size_t k = 0; k < x.chunks.size(); ++k) {
      const auto& c = x.chunks[k];
      const auto& d = y.chunks[k];
      if (c.file != d.file || c.key != d.key || c.begin != d.begin || c.end != d.end ||
          c.byte_offset != d.byte_offset || c.byte_length != d.byte_length || c.crc32 != d.crc32) {
        return false;
      }
    }
  }
  return true;
}

void check_invariants(const CheckpointIndex& index) {
  for (const auto& t : index.tensors) {
    std::int64_t covered = 0;
    for (const auto& c : t.chunks) {
      TANDEM_FUZZ_CHECK(c.begin == covered && c.end > c.begin);
      TANDEM_FUZZ_CHECK(c.byte_length ==
                        static_cast<std::uint64_t>(c.end - c.begin) * tandem::graph::dtype_size(t.dtype));
      TANDEM_FUZZ_CHECK(c.crc32.size() ==
                        (c.byte_length + index.checksum_block_bytes - 1) / index.checksum_block_bytes);
      TANDEM_FUZZ_CHECK(c.file.find('/') == std::string::npos && c.file != ".." && !c.file.empty());
      covered = c.end;
    }
    TANDEM_FUZZ_CHECK(covered == t.shape.num_elements());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  CheckpointIndex index;
  try {
    index = tandem::keras::parse_checkpoint_index(text, "index.json");
  } catch (const tandem::Error&) {
    return 0;  // every malformed index is one of tandem's errors
  }
  check_invariants(index);
  std::string again;
  try {
    again = tandem::keras::checkpoint_index_json(index);
  } catch (const tandem::InvalidArgument&) {
    return 0;  // a name that is not UTF-8 (the parser keeps nlohmann's bytes as they are)
  }
  TANDEM_FUZZ_CHECK(same_index(index, tandem::keras::parse_checkpoint_index(again, "index.json")));
  return 0;
}
