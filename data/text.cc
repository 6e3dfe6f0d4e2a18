// Text files and vocabularies (data/text.h). The windows dataset is in windows.cc; this file needs
// only base/, graph/ and data/readers.cc, so the fuzzing harness of the vocabulary loader
// (tests/fuzz/vocabulary_fuzzer.cc) builds it without the dataset pipeline.
#include "tandem/data/text.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

#include "tandem/base/detail/atomic_file.h"
#include "tandem/base/detail/json.h"
#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"
#include "tandem/data/detail/readers.h"
#include "tandem/data/detail/utf8.h"

namespace tandem::data {
namespace {

using Json = nlohmann::ordered_json;  // keeps the file's fields in the order written
using detail::append_utf8;
using detail::decode_utf8_step;

constexpr std::string_view kFormat = "tandem.vocabulary";
constexpr int kVersion = 1;
// A vocabulary file is a few KB (every Unicode character would be about 10 MB); more is not one.
constexpr std::uint64_t kMaxVocabularyFileBytes = std::uint64_t{64} << 20;
// An OOV token is a word like "[UNK]"; a longer one in a file is corruption.
constexpr std::size_t kMaxOovTokenBytes = 1024;
constexpr std::int32_t kAbsent = -1;

// A character for a message: U+00E9 "é" (control characters escaped, so a message stays one line).
std::string show_character(char32_t c) {
  std::string utf8;
  if (detail::is_scalar_value(c)) append_utf8(utf8, c);
  return utf8.empty() ? fmt::format("U+{:04X}", static_cast<std::uint32_t>(c))
                      : fmt::format("U+{:04X} {}", static_cast<std::uint32_t>(c), tandem::detail::quote_value(utf8));
}

void check_options(const VocabularyOptions& options, std::string_view where) {
  TANDEM_REQUIRE(options.num_oov_indices == 0 || options.num_oov_indices == 1, InvalidArgument,
                 "{}: num_oov_indices is {}; expected 0 (unknown characters are an error) or 1 (they encode as id 0)",
                 where, options.num_oov_indices);
}

}  // namespace

std::string read_text_file(const std::string& path) { return detail::read_file(path, ""); }

// ---------------------------------------------------------------------------------------------
// Vocabulary

Vocabulary::Vocabulary() = default;

Vocabulary Vocabulary::bytes() { return Vocabulary(); }

Vocabulary Vocabulary::from_text(std::string_view text, VocabularyOptions options) {
  // Which of the 0x110000 code points occur (a bitmap of 136 KB), then those in order: the sorted
  // set without sorting 1.6 million characters, and reading the bitmap a word at a time skips
  // the empty stretches of Unicode.
  std::vector<std::uint64_t> seen(0x110000 / 64, 0);
  for (std::size_t pos = 0; pos < text.size();) {
    const auto step = decode_utf8_step(text, pos);
    seen[step.code_point / 64] |= std::uint64_t{1} << (step.code_point % 64);
    pos += step.bytes;
  }
  std::u32string characters;
  for (std::size_t word = 0; word < seen.size(); ++word) {
    for (std::uint64_t bits = seen[word]; bits != 0; bits &= bits - 1) {
      characters.push_back(static_cast<char32_t>(word * 64 + static_cast<std::size_t>(std::countr_zero(bits))));
    }
  }
  return from_characters(std::move(characters), std::move(options));
}

Vocabulary Vocabulary::from_characters(std::u32string characters, VocabularyOptions options) {
  check_options(options, "Vocabulary::from_characters");
  Vocabulary v;
  v.kind_ = Kind::kCharacters;
  v.options_ = std::move(options);
  v.ascii_ids_.assign(128, kAbsent);
  const auto first_id = static_cast<std::int32_t>(v.options_.num_oov_indices);
  TANDEM_REQUIRE(characters.size() <= 0x110000, InvalidArgument,
                 "Vocabulary::from_characters: {} characters; Unicode has at most 1114112", characters.size());
  v.sorted_.reserve(characters.size());
  for (std::size_t i = 0; i < characters.size(); ++i) {
    const char32_t c = characters[i];
    TANDEM_REQUIRE(detail::is_scalar_value(c), InvalidArgument,
                   "Vocabulary::from_characters: character {} is {}, which is not a Unicode scalar value "
                   "(a surrogate, or past U+10FFFF)",
                   i, show_character(c));
    v.sorted_.emplace_back(c, first_id + static_cast<std::int32_t>(i));
  }
  std::sort(v.sorted_.begin(), v.sorted_.end());
  const auto duplicate =
      std::adjacent_find(v.sorted_.begin(), v.sorted_.end(), [](auto& a, auto& b) { return a.first == b.first; });
  TANDEM_REQUIRE(duplicate == v.sorted_.end(), InvalidArgument,
                 "Vocabulary::from_characters: {} appears twice (characters {} and {})",
                 show_character(duplicate->first), duplicate->second - first_id, (duplicate + 1)->second - first_id);
  for (const auto& [c, id] : v.sorted_) {
    if (c < 128) v.ascii_ids_[c] = id;
  }
  v.characters_ = std::move(characters);
  return v;
}

std::int64_t Vocabulary::size() const {
  if (kind_ == Kind::kBytes) return 256;
  return static_cast<std::int64_t>(characters_.size()) + options_.num_oov_indices;
}

std::vector<std::string> Vocabulary::get_vocabulary() const {
  std::vector<std::string> tokens;
  tokens.reserve(static_cast<std::size_t>(size()));
  if (kind_ == Kind::kBytes) {
    for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
    return tokens;
  }
  if (options_.num_oov_indices == 1) tokens.push_back(options_.oov_token);
  for (const char32_t c : characters_) {
    std::string utf8;
    append_utf8(utf8, c);
    tokens.push_back(std::move(utf8));
  }
  return tokens;
}

std::int32_t Vocabulary::id_of(char32_t c) const {
  if (c < 128) return ascii_ids_[c];
  const auto it = std::lower_bound(sorted_.begin(), sorted_.end(), std::pair<char32_t, std::int32_t>(c, 0));
  return it != sorted_.end() && it->first == c ? it->second : kAbsent;
}

Tensor Vocabulary::encode(std::string_view text) const {
  if (kind_ == Kind::kBytes) {
    Tensor out = Tensor::empty({static_cast<std::int64_t>(text.size())}, DType::kI32);
    auto* ids = out.data<std::int32_t>();
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return out;
  }
  std::vector<std::int32_t> ids;
  ids.reserve(text.size());
  for (std::size_t pos = 0; pos < text.size();) {
    const auto step = decode_utf8_step(text, pos);
    std::int32_t id = id_of(step.code_point);
    if (id == kAbsent) {
      TANDEM_REQUIRE(options_.num_oov_indices == 1, InvalidArgument,
                     "Vocabulary::encode: the character {}{} at character {} (byte offset {}) of the text is not in "
                     "the vocabulary of {} characters; build the vocabulary from text that holds it, or pass "
                     "VocabularyOptions{{.num_oov_indices = 1}} to encode unknown characters as id 0 ({})",
                     show_character(step.code_point), step.valid ? "" : " (replacing invalid UTF-8)", ids.size(), pos,
                     characters_.size(), tandem::detail::quote_value(options_.oov_token));
      id = 0;
    }
    ids.push_back(id);
    pos += step.bytes;
  }
  return Tensor::from_vector(ids, {static_cast<std::int64_t>(ids.size())});
}

std::string Vocabulary::decode(std::span<const std::int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  const auto n = size();
  const auto first_id = options_.num_oov_indices;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    TANDEM_REQUIRE(id >= 0 && id < n, InvalidArgument,
                   "Vocabulary::decode: id {} at index {} is outside the vocabulary's ids 0 to {}", id, i, n - 1);
    if (kind_ == Kind::kBytes) {
      text += static_cast<char>(id);
    } else if (id < first_id) {
      text += options_.oov_token;
    } else {
      append_utf8(text, characters_[static_cast<std::size_t>(id - first_id)]);
    }
  }
  return text;
}

std::string Vocabulary::decode(const Tensor& ids) const {
  TANDEM_REQUIRE(ids.defined(), InvalidArgument, "Vocabulary::decode: the ids tensor is undefined");
  const Tensor host = ids.to(devices::default_cpu_device());
  if (host.dtype() == DType::kI32) {
    return decode(
        std::span<const std::int32_t>(host.data<std::int32_t>(), static_cast<std::size_t>(host.num_elements())));
  }
  TANDEM_REQUIRE(host.dtype() == DType::kI64, InvalidArgument,
                 "Vocabulary::decode: ids are {} {}; expected int32 or int64", host.dtype(), host.shape());
  const auto* wide = host.data<std::int64_t>();
  std::vector<std::int32_t> narrow(static_cast<std::size_t>(host.num_elements()));
  for (std::size_t i = 0; i < narrow.size(); ++i) {
    // An id past int32 is out of range either way; clamp it so that the message names it as -1.
    const bool fits = wide[i] >= 0 && wide[i] <= std::numeric_limits<std::int32_t>::max();
    TANDEM_REQUIRE(fits, InvalidArgument,
                   "Vocabulary::decode: id {} at index {} is outside the vocabulary's ids 0 to {}", wide[i], i,
                   size() - 1);
    narrow[i] = static_cast<std::int32_t>(wide[i]);
  }
  return decode(narrow);
}

// ---------------------------------------------------------------------------------------------
// Saving and loading

void Vocabulary::save(const std::string& path) const {
  Json file;
  file["format"] = kFormat;
  file["version"] = kVersion;
  file["kind"] = kind_ == Kind::kBytes ? "bytes" : "characters";
  if (kind_ == Kind::kCharacters) {
    file["num_oov_indices"] = options_.num_oov_indices;
    file["oov_token"] = options_.oov_token;
    Json tokens = Json::array();
    for (const char32_t c : characters_) {
      std::string utf8;
      append_utf8(utf8, c);
      tokens.push_back(std::move(utf8));
    }
    file["tokens"] = std::move(tokens);
  }
  std::string text;
  try {
    // One token a line: a vocabulary of a few hundred characters reads, and diffs, easily.
    text = file.dump(1, ' ', false, Json::error_handler_t::strict) + "\n";
  } catch (const Json::exception& e) {
    throw InvalidArgument(fmt::format("Vocabulary::save \"{}\": the OOV token is not valid UTF-8 ({})", path,
                                      tandem::detail::shorten(e.what())));
  }
  tandem::detail::AtomicFile out(path);
  out.write(text.data(), text.size());
  out.commit();
}

namespace {

// The loader's checks, each naming the file and the field.
class VocabularyFileReader {
 public:
  VocabularyFileReader(std::string path, const Json& file) : path_(std::move(path)), file_(file) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw DataLoss(fmt::format("\"{}\": not a vocabulary file: {}", path_, what));
  }

  const Json& field(std::string_view name) const {
    const auto it = file_.find(name);
    if (it == file_.end()) fail(fmt::format("the field \"{}\" is missing", name));
    return *it;
  }
  std::string string_field(std::string_view name, std::size_t max_bytes) const {
    const Json& value = field(name);
    if (!value.is_string()) fail(fmt::format("\"{}\" is {}; expected a string", name, show(value)));
    const auto& text = value.get_ref<const std::string&>();
    if (text.size() > max_bytes)
      fail(fmt::format("\"{}\" is {} bytes long; expected at most {}", name, text.size(), max_bytes));
    return text;
  }
  std::int64_t integer_field(std::string_view name) const {
    const Json& value = field(name);
    if (!value.is_number_integer()) fail(fmt::format("\"{}\" is {}; expected an integer", name, show(value)));
    return value.get<std::int64_t>();
  }
  void check_fields(std::initializer_list<std::string_view> allowed) const {
    for (const auto& [key, value] : file_.items()) {
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        fail(fmt::format("unexpected field {}", tandem::detail::quote_value(key)));
      }
    }
  }

  // The one character of tokens[index].
  char32_t character(const Json& token, std::size_t index) const {
    if (!token.is_string())
      fail(fmt::format("tokens[{}] is {}; expected a string of one character", index, show(token)));
    const auto& text = token.get_ref<const std::string&>();
    // nlohmann's parser admits only valid UTF-8, but the check is cheap and keeps this reader's
    // correctness independent of that.
    const auto step = text.empty() ? detail::Utf8Step{0, 0, false} : decode_utf8_step(text, 0);
    if (!step.valid || step.bytes != text.size()) {
      fail(fmt::format("tokens[{}] is {}; expected one character", index, show(token)));
    }
    return step.code_point;
  }

 private:
  static std::string show(const Json& value) { return tandem::detail::json_for_message(value); }

  std::string path_;
  const Json& file_;
};

}  // namespace

Vocabulary Vocabulary::load(const std::string& path) {
  const std::string text = detail::read_file(path, "", kMaxVocabularyFileBytes);
  Json file;
  if (auto problem = tandem::detail::parse_json(text, file)) {
    throw DataLoss(fmt::format("\"{}\": not a vocabulary file: {}", path, *problem));
  }
  const VocabularyFileReader reader(path, file);
  if (!file.is_object()) reader.fail("expected a JSON object");
  if (const auto format = reader.string_field("format", kMaxOovTokenBytes); format != kFormat) {
    reader.fail(fmt::format("\"format\" is {}; expected \"{}\"", tandem::detail::quote_value(format), kFormat));
  }
  if (const auto version = reader.integer_field("version"); version != kVersion) {
    reader.fail(fmt::format("\"version\" is {}; this tandem reads version {}", version, kVersion));
  }
  const auto kind = reader.string_field("kind", kMaxOovTokenBytes);
  if (kind == "bytes") {
    reader.check_fields({"format", "version", "kind"});
    return bytes();
  }
  if (kind != "characters") {
    reader.fail(fmt::format("\"kind\" is {}; expected \"bytes\" or \"characters\"", tandem::detail::quote_value(kind)));
  }
  reader.check_fields({"format", "version", "kind", "num_oov_indices", "oov_token", "tokens"});
  VocabularyOptions options;
  const auto oov = reader.integer_field("num_oov_indices");
  if (oov != 0 && oov != 1) reader.fail(fmt::format("\"num_oov_indices\" is {}; expected 0 or 1", oov));
  options.num_oov_indices = static_cast<int>(oov);
  options.oov_token = reader.string_field("oov_token", kMaxOovTokenBytes);
  const Json& tokens = reader.field("tokens");
  if (!tokens.is_array()) reader.fail("\"tokens\" is not an array");
  std::u32string characters;
  characters.reserve(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) characters.push_back(reader.character(tokens[i], i));
  try {
    return from_characters(std::move(characters), std::move(options));
  } catch (const InvalidArgument& e) {
    reader.fail(fmt::format("\"tokens\": {}", e.what()));  // a duplicate
  }
}

}  // namespace tandem::data
