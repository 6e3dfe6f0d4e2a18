// tandem/base/detail/text.h — small text helpers shared by the modules that read text from
// outside (environment variables, launchers' variables, file headers). Pure functions: nothing
// blocks, and nothing throws except std::bad_alloc.
#pragma once

#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>

namespace tandem::detail {

// text without the blanks (spaces, tabs, newlines) at either end.
inline std::string_view trim(std::string_view text) {
  const auto blank = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!text.empty() && blank(text.front())) text.remove_prefix(1);
  while (!text.empty() && blank(text.back())) text.remove_suffix(1);
  return text;
}

// How much of a value from outside an error message quotes: enough to recognise it, while a
// megabyte of input still makes a one-line message.
inline constexpr std::size_t kMaxQuotedChars = 200;

// text cut to max_chars, with "..." when something was cut.
inline std::string shorten(std::string text, std::size_t max_chars = kMaxQuotedChars) {
  if (text.size() > max_chars) {
    text.resize(max_chars);
    text += "...";
  }
  return text;
}

// One byte as a message shows it: itself when printable ASCII, else \xNN (so that an escape
// sequence or a stray byte in a value cannot rewrite the user's terminal or log line).
inline std::string escape_char(char c) {
  const auto byte = static_cast<unsigned char>(c);
  if (byte >= 0x20 && byte < 0x7f) return std::string(1, c);
  constexpr char kHex[] = "0123456789abcdef";
  return {'\\', 'x', kHex[byte >> 4], kHex[byte & 0xf]};
}

// text with its control characters, double quotes and backslashes escaped (\n, \x1b, \", \\),
// as fmt's "{:?}" does; bytes from 0x80 up are kept, so UTF-8 names read as they are. Unlike
// "{:?}" (fmt 9 aborts the process on a byte that is not UTF-8), any bytes are safe.
inline std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (byte < 0x20 || byte == 0x7f) {
      out += escape_char(c);
    } else {
      out += c;
    }
  }
  return out;
}

// A value from outside, for an error message: escaped, in double quotes, cut to max_chars.
inline std::string quote_value(std::string_view text, std::size_t max_chars = kMaxQuotedChars) {
  return '"' + shorten(escape(text.substr(0, max_chars + 1)), max_chars) + '"';
}

}  // namespace tandem::detail
