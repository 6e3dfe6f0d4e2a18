// Fuzzing harness: read_safetensors (keras_like/safetensors.cc), the reader of weight files and
// training checkpoints. Whatever the file holds, it must return the tensors or throw one of
// tandem's errors, never allocating more than the file holds. What it returns must write back
// (write_safetensors, through the atomic writer) and read again to the same names, dtypes, shapes,
// bytes and metadata. Anything else, a crash or a sanitizer report, is a finding.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/keras_like/saving.h"

namespace {

bool same_tensors(const tandem::keras::NamedTensors& a, const tandem::keras::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto& [name_a, ta] = a[i];
    const auto& [name_b, tb] = b[i];
    if (name_a != name_b || ta.dtype() != tb.dtype() || !(ta.shape() == tb.shape()) || ta.nbytes() != tb.nbytes()) {
      return false;
    }
    if (ta.nbytes() > 0 && std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes()) != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& path = tandem::fuzz::input_file(data, size);
  tandem::keras::SafetensorsContent content;
  try {
    content = tandem::keras::read_safetensors(path);
  } catch (const tandem::Error&) {
    return 0;  // every corrupt file is one of tandem's errors
  }
  std::size_t bytes = 0;
  for (const auto& [name, tensor] : content.tensors) bytes += tensor.nbytes();
  TANDEM_FUZZ_CHECK(bytes <= size);

  // Round trip. The writer recomputes the checksum. Of what the reader accepts, it refuses only a
  // tensor named "" (a JSON key the reader takes).
  const std::string copy = (tandem::fuzz::scratch_folder() / "copy.safetensors").string();
  try {
    tandem::keras::write_safetensors(copy, content.tensors, content.metadata);
  } catch (const tandem::InvalidArgument&) {
    TANDEM_FUZZ_CHECK(std::any_of(content.tensors.begin(), content.tensors.end(),
                                  [](const auto& named) { return named.first.empty(); }));
    return 0;
  }
  const auto again = tandem::keras::read_safetensors(copy);
  TANDEM_FUZZ_CHECK(same_tensors(content.tensors, again.tensors));
  auto expected = content.metadata;
  expected.erase("checksum");
  auto actual = again.metadata;
  actual.erase("checksum");
  TANDEM_FUZZ_CHECK(expected == actual);
  return 0;
}
