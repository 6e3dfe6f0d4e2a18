#include "tandem/keras_like/logs.h"

#include <fmt/format.h>

#include <algorithm>

#include "tandem/base/errors.h"

namespace tandem::keras {

void Logs::set(std::string_view key, double value) {
  for (auto& [k, v] : items_) {
    if (k == key) {
      v = value;
      return;
    }
  }
  items_.emplace_back(std::string(key), value);
}

std::optional<double> Logs::get(std::string_view key) const {
  for (const auto& [k, v] : items_) {
    if (k == key) return v;
  }
  return std::nullopt;
}

double Logs::at(std::string_view key) const {
  if (auto v = get(key)) return *v;
  std::string keys;
  for (const auto& [k, v] : items_) keys += fmt::format("{}{}", keys.empty() ? "" : ", ", k);
  throw NotFound(fmt::format("no \"{}\" in the logs (present: {})", key, keys.empty() ? "none" : keys));
}

void Logs::erase(std::string_view key) {
  items_.erase(std::remove_if(items_.begin(), items_.end(), [&](const auto& item) { return item.first == key; }),
               items_.end());
}

std::string Logs::to_string() const {
  std::string out;
  for (const auto& [k, v] : items_) {
    // Keras prints 4 decimals, switching to scientific notation for tiny values.
    const bool tiny = v != 0.0 && std::abs(v) < 1e-3;
    out += fmt::format("{}{}: {}", out.empty() ? "" : " - ", k,
                       tiny ? fmt::format("{:.4e}", v) : fmt::format("{:.4f}", v));
  }
  return out;
}

}  // namespace tandem::keras
