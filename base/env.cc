#include "tandem/base/env.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <system_error>

#include <fmt/format.h>

#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"

namespace tandem::env {
namespace {

using detail::trim;

constexpr std::string_view kTrueWords[] = {"1", "true", "yes", "on"};
constexpr std::string_view kFalseWords[] = {"0", "false", "no", "off"};

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); });
  return out;
}

// "a, b or c"
std::string words(std::span<const std::string_view> list) {
  std::string out;
  for (std::size_t i = 0; i < list.size(); ++i) {
    out += i == 0 ? "" : (i + 1 == list.size() ? " or " : ", ");
    out += list[i];
  }
  return out;
}

[[noreturn]] void bad_value(const Variable& variable, std::string_view text) {
  throw InvalidArgument(fmt::format("environment variable {}={}: expected {}", variable.name, detail::quote_value(text),
                                    expected_values(variable)));
}

void require_type(const Variable& variable, Type type, const char* accessor) {
  TANDEM_ASSERT(variable.type == type, "env::{} of {}, which has another type", accessor, variable.name);
}

// The variable's trimmed text; empty when unset or blank.
std::string read_variable(const Variable& variable) {
  const char* text = std::getenv(std::string(variable.name).c_str());
  return text == nullptr ? std::string() : std::string(trim(text));
}

// The set text, else the default; Internal when neither exists (the caller should have used
// find_int or is_set).
std::string text_or_default(const Variable& variable, const char* accessor) {
  std::string text = read_variable(variable);
  if (!text.empty()) return text;
  TANDEM_ASSERT(!variable.default_value.empty(), "env::{} of {}, which has no default: use find_int or is_set",
                accessor, variable.name);
  return std::string(variable.default_value);
}

}  // namespace

std::string expected_values(const Variable& variable) {
  switch (variable.type) {
    case Type::kBool: {
      std::string out;
      for (auto word : kTrueWords) out += fmt::format("{}, ", word);
      return out + words(kFalseWords);
    }
    case Type::kInt:
      if (variable.max == kMaxInt && variable.min == 0) return "a non-negative integer";
      if (variable.max == kMaxInt && variable.min == 1) return "a positive integer";
      return fmt::format("an integer from {} to {}", variable.min, variable.max);
    case Type::kSeconds: return "a positive number of seconds";
    case Type::kString: return "any text";
    case Type::kChoice: return words(variable.choices);
  }
  return {};
}

bool parse_bool(const Variable& variable, std::string_view text) {
  require_type(variable, Type::kBool, "parse_bool");
  const std::string word = lower(trim(text));
  if (std::find(std::begin(kTrueWords), std::end(kTrueWords), word) != std::end(kTrueWords)) return true;
  if (std::find(std::begin(kFalseWords), std::end(kFalseWords), word) != std::end(kFalseWords)) return false;
  bad_value(variable, text);
}

std::int64_t parse_int(const Variable& variable, std::string_view text) {
  require_type(variable, Type::kInt, "parse_int");
  const std::string_view digits = trim(text);
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size() || value < variable.min ||
      value > variable.max) {
    bad_value(variable, text);
  }
  return value;
}

std::chrono::milliseconds parse_seconds(const Variable& variable, std::string_view text) {
  require_type(variable, Type::kSeconds, "parse_seconds");
  const std::string_view number = trim(text);
  double seconds = 0;
  const auto [end, error] = std::from_chars(number.data(), number.data() + number.size(), seconds);
  // A day of milliseconds times 10^6 still fits; beyond that a timeout means "never" anyway.
  constexpr double kMaxSeconds = 1e11;
  if (number.empty() || error != std::errc() || end != number.data() + number.size() || !std::isfinite(seconds) ||
      seconds <= 0 || seconds > kMaxSeconds) {
    bad_value(variable, text);
  }
  // At least a millisecond: a positive timeout never becomes "no time at all".
  return std::chrono::milliseconds(std::max<std::int64_t>(1, std::llround(seconds * 1000.0)));
}

std::string parse_choice(const Variable& variable, std::string_view text) {
  require_type(variable, Type::kChoice, "parse_choice");
  const std::string word = lower(trim(text));
  if (std::find(variable.choices.begin(), variable.choices.end(), word) == variable.choices.end()) {
    bad_value(variable, text);
  }
  return word;
}

bool is_set(const Variable& variable) { return !read_variable(variable).empty(); }

bool get_bool(const Variable& variable) { return parse_bool(variable, text_or_default(variable, "get_bool")); }

std::int64_t get_int(const Variable& variable) { return parse_int(variable, text_or_default(variable, "get_int")); }

std::optional<std::int64_t> find_int(const Variable& variable) {
  const std::string text = read_variable(variable);
  if (text.empty()) return std::nullopt;
  return parse_int(variable, text);
}

std::chrono::milliseconds get_seconds(const Variable& variable) {
  return parse_seconds(variable, text_or_default(variable, "get_seconds"));
}

std::string get_string(const Variable& variable) {
  if (variable.type == Type::kChoice) return parse_choice(variable, text_or_default(variable, "get_string"));
  require_type(variable, Type::kString, "get_string");
  const std::string text = read_variable(variable);
  return text.empty() ? std::string(variable.default_value) : text;
}

}  // namespace tandem::env
