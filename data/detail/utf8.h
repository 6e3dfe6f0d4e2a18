// tandem/data/detail/utf8.h — UTF-8 decoding exactly as Python's
// bytes.decode("utf-8", errors="replace"), and encoding back (internal). Used by the character
// vocabulary (data/text.cc) and its fuzzing harness. Pure functions: nothing blocks, nothing
// throws except std::bad_alloc.
//
// A character vocabulary must give the same characters and ids as a Python program that builds it
// with sorted(set(raw.decode("utf-8", errors="replace"))), so invalid input is replaced the way
// CPython does it: Unicode's "maximal subpart" practice (The Unicode Standard, chapter 3, U+FFFD
// substitution). Each maximal prefix of a well-formed sequence that cannot be completed becomes
// one U+FFFD, and a byte that starts no well-formed sequence (80..BF, C0, C1, F5..FF) becomes one
// U+FFFD by itself. The well-formed sequences (Table 3-7) are:
//   00..7F
//   C2..DF  80..BF
//   E0      A0..BF  80..BF          (no overlong 3-byte forms)
//   E1..EC  80..BF  80..BF
//   ED      80..9F  80..BF          (no surrogates D800..DFFF)
//   EE..EF  80..BF  80..BF
//   F0      90..BF  80..BF  80..BF  (no overlong 4-byte forms)
//   F1..F3  80..BF  80..BF  80..BF
//   F4      80..8F  80..BF  80..BF  (nothing above U+10FFFF)
// So E0 80 is two U+FFFD (80 cannot follow E0), ED A0 80 (a surrogate) three, F0 90 80 at the end
// of the input one, and C0 80 (an overlong NUL) two.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::data::detail {

inline constexpr char32_t kReplacementCharacter = 0xFFFD;

// One decoding step at bytes[pos] (pos < bytes.size()).
struct Utf8Step {
  char32_t code_point;  // kReplacementCharacter when !valid
  std::uint32_t bytes;  // consumed: the sequence, or the maximal subpart it replaces (>= 1)
  bool valid;
};

inline Utf8Step decode_utf8_step(std::string_view text, std::size_t pos) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned first = byte(pos);
  if (first < 0x80) return {first, 1, true};
  std::uint32_t continuation = 0;    // bytes after the first
  unsigned low = 0x80, high = 0xBF;  // the second byte's range; later ones are always 80..BF
  char32_t code_point = 0;
  if (first >= 0xC2 && first <= 0xDF) {
    continuation = 1;
    code_point = first & 0x1F;
  } else if (first >= 0xE0 && first <= 0xEF) {
    continuation = 2;
    code_point = first & 0x0F;
    if (first == 0xE0) low = 0xA0;
    if (first == 0xED) high = 0x9F;
  } else if (first >= 0xF0 && first <= 0xF4) {
    continuation = 3;
    code_point = first & 0x07;
    if (first == 0xF0) low = 0x90;
    if (first == 0xF4) high = 0x8F;
  } else {
    return {kReplacementCharacter, 1, false};
  }
  for (std::uint32_t i = 1; i <= continuation; ++i) {
    // A sequence cut short by the end of the input, or by a byte that cannot come next: the bytes
    // so far are the maximal subpart.
    if (pos + i >= text.size()) return {kReplacementCharacter, i, false};
    const unsigned next = byte(pos + i);
    if (next < low || next > high) return {kReplacementCharacter, i, false};
    code_point = (code_point << 6) | (next & 0x3F);
    low = 0x80;
    high = 0xBF;
  }
  return {code_point, continuation + 1, true};
}

// The code points of text, invalid sequences replaced as above.
inline std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  for (std::size_t pos = 0; pos < text.size();) {
    const auto step = decode_utf8_step(text, pos);
    out.push_back(step.code_point);
    pos += step.bytes;
  }
  return out;
}

// Whether c is a Unicode scalar value: what UTF-8 can encode (no surrogates, at most U+10FFFF).
inline bool is_scalar_value(char32_t c) { return c <= 0x10FFFF && (c < 0xD800 || c > 0xDFFF); }

// Appends c (a scalar value) to out as UTF-8.
inline void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

}  // namespace tandem::data::detail
