// Fuzzing harness: Vocabulary::load (data/text.cc), the reader of vocabulary files (JSON, plain
// or gzip). Whatever the file holds, load must return a vocabulary or throw one of tandem's errors
// (DataLoss, ...); a vocabulary it returns must save and load back equal, and encode and decode
// its own characters. Anything else, a crash or a sanitizer report, is a finding.
#include <cstdint>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/data/detail/utf8.h"
#include "tandem/data/text.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace text = tandem::data;
  const auto& path = tandem::fuzz::input_file(data, size);
  text::Vocabulary vocabulary;
  try {
    vocabulary = text::Vocabulary::load(path);
  } catch (const tandem::Error&) {
    return 0;  // every malformed file is one of tandem's errors
  }
  const auto copy = (tandem::fuzz::scratch_folder() / "vocabulary.json").string();
  vocabulary.save(copy);
  TANDEM_FUZZ_CHECK(text::Vocabulary::load(copy) == vocabulary);
  std::string all;
  for (const char32_t c : vocabulary.characters()) text::detail::append_utf8(all, c);
  const auto ids = vocabulary.encode(all);
  TANDEM_FUZZ_CHECK(ids.num_elements() == static_cast<std::int64_t>(vocabulary.characters().size()));
  const auto* p = ids.data<std::int32_t>();
  for (std::int64_t i = 0; i < ids.num_elements(); ++i) TANDEM_FUZZ_CHECK(p[i] == i + vocabulary.num_oov_indices());
  TANDEM_FUZZ_CHECK(vocabulary.decode(ids) == all);
  return 0;
}
