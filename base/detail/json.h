// tandem/base/detail/json.h — JSON from outside (TF_CONFIG, safetensors headers) parsed so that
// no input can crash the reader, and shown short in messages. Called by
// strategy/cluster_resolver.cc and keras_like/safetensors.cc, which include <nlohmann/json.hpp>:
// the functions are templates over nlohmann's json types, so base itself needs no JSON library.
// Nothing blocks; nothing throws except std::bad_alloc.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/base/detail/text.h"

namespace tandem::detail {

// nlohmann's parser keeps its own stack, but copying, comparing or dump()ing a value recurses
// once per level of nesting: TF_CONFIG='[[[[...' 200,000 levels deep overflowed the stack while
// an error message dumped it. A real TF_CONFIG nests 3 or 4 levels, a safetensors header 3.
inline constexpr int kMaxJsonDepth = 32;

// Parses text into out. Returns why it cannot instead of throwing: nesting deeper than
// max_depth (refused as the parser meets it, before a deep value exists), a syntax error with
// its byte offset, a number beyond double's range ("1e999", nlohmann's out_of_range), or any other
// exception of the parser. The reason is short whatever the input (nlohmann quotes the token it
// stopped at, which can be the whole input).
template <class Json>
std::optional<std::string> parse_json(std::string_view text, Json& out, int max_depth = kMaxJsonDepth) {
  struct TooDeep {};
  const auto limit_depth = [max_depth](int depth, typename Json::parse_event_t event, Json&) {
    // depth counts the containers around the one that starts: 0 for the outermost.
    const bool opens = event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start;
    if (opens && depth >= max_depth) throw TooDeep{};
    return true;
  };
  try {
    out = Json::parse(text.begin(), text.end(), limit_depth);
  } catch (const TooDeep&) {
    return fmt::format("JSON nested deeper than {} levels", max_depth);
  } catch (const typename Json::parse_error& e) {
    return fmt::format("invalid JSON at byte {}: {}", e.byte, shorten(e.what(), 2 * kMaxQuotedChars));
  } catch (const typename Json::exception& e) {
    return fmt::format("invalid JSON: {}", shorten(e.what(), 2 * kMaxQuotedChars));
  }
  return std::nullopt;
}

// value as JSON text for a message ("localhost" keeps its quotes, 5 does not; JSON escapes control
// characters), cut to max_chars. Its recursion is bounded by parse_json's depth limit.
template <class Json>
std::string json_for_message(const Json& value, std::size_t max_chars = kMaxQuotedChars) {
  return shorten(value.dump(-1, ' ', false, Json::error_handler_t::replace), max_chars);
}

}  // namespace tandem::detail
