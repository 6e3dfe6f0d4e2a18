// tandem/base/detail/text.h — small text helpers shared by the modules that read text from
// outside (environment variables, launchers' variables). Pure functions: nothing blocks or throws.
#pragma once

#include <cctype>
#include <string_view>

namespace tandem::detail {

// text without the blanks (spaces, tabs, newlines) at either end.
inline std::string_view trim(std::string_view text) {
  const auto blank = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!text.empty() && blank(text.front())) text.remove_prefix(1);
  while (!text.empty() && blank(text.back())) text.remove_suffix(1);
  return text;
}

}  // namespace tandem::detail
