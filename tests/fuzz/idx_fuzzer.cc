// Fuzzing harness: read_idx (data/readers.cc), the reader of IDX files (MNIST's format), plain or
// gzip-compressed. Whatever the file holds, read_idx must return a tensor or throw one of tandem's
// errors (DataLoss, Unimplemented, ...), and a plain file must never cost more memory than its
// data widened to int32 (the header's sizes are checked against the file before allocating):
// anything else, a crash, a sanitizer report or an allocation past libFuzzer's limit, is a finding.
#include <cstdint>
#include <cstring>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/data/readers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& path = tandem::fuzz::input_file(data, size);
  try {
    const tandem::Tensor tensor = tandem::data::read_idx(path);
    TANDEM_FUZZ_CHECK(tensor.shape().num_elements() >= 0);
    const bool gzip = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
    // int8 widens to int32: at most 4 bytes in memory per byte of the file.
    if (!gzip) TANDEM_FUZZ_CHECK(tensor.nbytes() <= 4 * size);
  } catch (const tandem::Error&) {
    // Every corrupt file is one of tandem's errors.
  }
  return 0;
}
