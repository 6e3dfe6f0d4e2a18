// Fuzzing harness: the UTF-8 decoder behind character vocabularies (data/detail/utf8.h), which
// must replace invalid input exactly as Python's bytes.decode("utf-8", errors="replace") does, and
// Vocabulary::from_text / encode / decode (data/text.cc) over the same bytes. The decoder is checked
// against an oracle derived here from the definitions rather than from its table: a sequence is
// well-formed when its bit pattern decodes to a scalar value in the shortest form; an ill-formed
// one is replaced by one U+FFFD per maximal subpart, the longest prefix that some well-formed
// sequence starts with (at least one byte). Anything else, a crash or a sanitizer report, is a
// finding.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/data/detail/utf8.h"
#include "tandem/data/text.h"

namespace {

using tandem::data::detail::kReplacementCharacter;

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// The length a lead byte announces by its bit pattern; 0 for a continuation byte or 11111xxx.
std::size_t announced_length(unsigned char b) {
  if (b < 0x80) return 1;
  if ((b & 0xE0) == 0xC0) return 2;
  if ((b & 0xF0) == 0xE0) return 3;
  if ((b & 0xF8) == 0xF0) return 4;
  return 0;
}

// Whether seq (its announced length, continuations after the lead) is well-formed: a scalar value
// that needs exactly this many bytes.
bool well_formed(const std::string& seq, char32_t* out = nullptr) {
  const auto lead = static_cast<unsigned char>(seq[0]);
  const std::size_t length = seq.size();
  char32_t c = length == 1 ? lead : (lead & (0x7F >> length));
  for (std::size_t i = 1; i < length; ++i) {
    const auto b = static_cast<unsigned char>(seq[i]);
    if (!is_continuation(b)) return false;
    c = (c << 6) | (b & 0x3F);
  }
  constexpr char32_t kShortest[] = {0, 0, 0x80, 0x800, 0x10000};
  if (c < kShortest[length] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return false;
  if (out) *out = c;
  return true;
}

// Whether some well-formed sequence of `length` bytes starts with prefix. Only the lead and the
// second byte constrain the value's range, so a prefix of two or more bytes completes with 80s
// if it completes at all; a lead byte alone needs some second byte.
bool completable(const std::string& prefix, std::size_t length) {
  std::string seq = prefix;
  if (prefix.size() >= 2 || length == 1) {
    seq.resize(length, static_cast<char>(0x80));
    return well_formed(seq);
  }
  for (int second = 0x80; second <= 0xBF; ++second) {
    seq = prefix;
    seq += static_cast<char>(second);
    seq.resize(length, static_cast<char>(0x80));
    if (well_formed(seq)) return true;
  }
  return false;
}

std::u32string oracle_decode(std::string_view text) {
  std::u32string out;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t length = announced_length(static_cast<unsigned char>(text[pos]));
    std::size_t subpart = 0;  // the longest completable prefix
    for (std::size_t k = 1; length != 0 && k <= length && pos + k <= text.size(); ++k) {
      if (k > 1 && !is_continuation(static_cast<unsigned char>(text[pos + k - 1]))) break;
      if (!completable(std::string(text.substr(pos, k)), length)) break;
      subpart = k;
    }
    char32_t c = 0;
    if (subpart == length && length != 0 && well_formed(std::string(text.substr(pos, length)), &c)) {
      out.push_back(c);
      pos += length;
    } else {
      out.push_back(kReplacementCharacter);
      pos += subpart == 0 ? 1 : subpart;
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace text = tandem::data;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::u32string decoded = text::detail::decode_utf8(input);
  TANDEM_FUZZ_CHECK(decoded == oracle_decode(input));
  // Re-encoding gives valid UTF-8 that decodes to the same characters; valid input comes back whole.
  std::string reencoded;
  bool replaced = false;
  for (const char32_t c : decoded) {
    TANDEM_FUZZ_CHECK(text::detail::is_scalar_value(c));
    text::detail::append_utf8(reencoded, c);
  }
  for (std::size_t pos = 0; pos < input.size();) {
    const auto step = text::detail::decode_utf8_step(input, pos);
    replaced = replaced || !step.valid;
    pos += step.bytes;
  }
  TANDEM_FUZZ_CHECK(text::detail::decode_utf8(reencoded) == decoded);
  if (!replaced) TANDEM_FUZZ_CHECK(reencoded == input);

  // The vocabulary of the input encodes it and decodes it back to the replaced text.
  const auto vocabulary = text::Vocabulary::from_text(input);
  TANDEM_FUZZ_CHECK(vocabulary.size() <= static_cast<std::int64_t>(decoded.size()));
  const auto ids = vocabulary.encode(input);
  TANDEM_FUZZ_CHECK(ids.num_elements() == static_cast<std::int64_t>(decoded.size()));
  TANDEM_FUZZ_CHECK(vocabulary.decode(ids) == reencoded);
  const auto bytes = text::Vocabulary::bytes();
  TANDEM_FUZZ_CHECK(bytes.decode(bytes.encode(input)) == input);
  return 0;
}
