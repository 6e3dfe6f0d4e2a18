#include "tandem/graph/attrs.h"

namespace tandem::graph {
namespace {
constexpr std::string_view kTypeNames[] = {"bool", "int", "float", "string", "dtype", "shape", "int list", "tensor"};
}

std::string attr_value_to_string(const AttrValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, std::vector<std::int64_t>>) {
          return fmt::format("[{}]", fmt::join(v, ", "));
        } else if constexpr (std::is_same_v<V, Tensor>) {
          return v.defined() ? fmt::format("tensor{}", v.shape()) : std::string("tensor(undefined)");
        } else if constexpr (std::is_same_v<V, std::string>) {
          return fmt::format("\"{}\"", v);
        } else {
          return fmt::format("{}", v);
        }
      },
      value);
}

Attrs::Attrs(std::initializer_list<std::pair<std::string, AttrValue>> values) {
  for (const auto& [name, value] : values) set_value(name, value);
}

void Attrs::set_value(std::string_view name, AttrValue value) {
  for (auto& [n, v] : values_) {
    if (n == name) {
      v = std::move(value);
      return;
    }
  }
  values_.emplace_back(std::string(name), std::move(value));
}

const AttrValue* Attrs::find(std::string_view name) const {
  for (const auto& [n, v] : values_) {
    if (n == name) return &v;
  }
  return nullptr;
}

void Attrs::throw_missing(std::string_view name) const {
  throw InvalidArgument(fmt::format("missing attribute \"{}\" (attributes given: {})", name, to_string()));
}

void Attrs::throw_wrong_type(std::string_view name, const AttrValue& value) const {
  throw InvalidArgument(fmt::format("attribute \"{}\" is a {} ({}), which is not the type this op expects", name,
                                    kTypeNames[value.index()], attr_value_to_string(value)));
}

std::string Attrs::to_string() const {
  std::string out = "{";
  for (const auto& [n, v] : values_)
    out += fmt::format("{}{}={}", out.size() > 1 ? ", " : "", n, attr_value_to_string(v));
  return out + "}";
}

}  // namespace tandem::graph
