// tandem/graph/attrs.h — named, typed attributes of a graph node (transpose flags, strides, ...).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "tandem/graph/tensor.h"

namespace tandem::graph {

using AttrValue =
    std::variant<bool, std::int64_t, double, std::string, DType, Shape, std::vector<std::int64_t>, Tensor>;

std::string attr_value_to_string(const AttrValue& value);

// A small ordered map. Lookups are linear: nodes have a handful of attributes.
class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<std::string, AttrValue>> values);

  // Integers of any width are stored as int64, floats as double, string literals as strings.
  template <class T>
  Attrs& set(std::string_view name, T value) {
    if constexpr (std::is_same_v<T, bool>) {
      set_value(name, AttrValue(value));
    } else if constexpr (std::is_integral_v<T>) {
      set_value(name, AttrValue(static_cast<std::int64_t>(value)));
    } else if constexpr (std::is_floating_point_v<T>) {
      set_value(name, AttrValue(static_cast<double>(value)));
    } else if constexpr (std::is_convertible_v<T, std::string_view>) {
      set_value(name, AttrValue(std::string(std::string_view(value))));
    } else {
      set_value(name, AttrValue(std::move(value)));
    }
    return *this;
  }

  bool has(std::string_view name) const { return find(name) != nullptr; }
  // Typed read; throws InvalidArgument naming the attribute when missing or of another type.
  template <class T>
  const T& get(std::string_view name) const {
    const AttrValue* v = find(name);
    if (v == nullptr) throw_missing(name);
    const T* typed = std::get_if<T>(v);
    if (typed == nullptr) throw_wrong_type(name, *v);
    return *typed;
  }
  template <class T>
  T get_or(std::string_view name, T fallback) const {
    const AttrValue* v = find(name);
    if (v == nullptr) return fallback;
    return get<T>(name);
  }
  std::int64_t get_int(std::string_view name) const { return get<std::int64_t>(name); }
  std::int64_t get_int_or(std::string_view name, std::int64_t fallback) const {
    return get_or<std::int64_t>(name, fallback);
  }
  double get_float_or(std::string_view name, double fallback) const { return get_or<double>(name, fallback); }
  bool get_bool_or(std::string_view name, bool fallback) const { return get_or<bool>(name, fallback); }

  const std::vector<std::pair<std::string, AttrValue>>& items() const { return values_; }
  std::string to_string() const;  // "{transpose_a=false, strides=[1, 2, 2, 1]}"

 private:
  void set_value(std::string_view name, AttrValue value);
  const AttrValue* find(std::string_view name) const;
  [[noreturn]] void throw_missing(std::string_view name) const;
  [[noreturn]] void throw_wrong_type(std::string_view name, const AttrValue& value) const;

  std::vector<std::pair<std::string, AttrValue>> values_;
};

}  // namespace tandem::graph
