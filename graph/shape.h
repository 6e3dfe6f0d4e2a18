// tandem/graph/shape.h — tensor shapes, with unknown dimensions for graph construction.
//
// A graph is built before the batch size is known (Keras's `None`): such a dimension is
// Shape::kUnknown (-1) at construction and becomes concrete when the executor plans a run with
// real inputs. Shapes are small values (no heap allocation): at most kMaxRank dimensions.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include <fmt/format.h>

namespace tandem::graph {

class Shape {
 public:
  static constexpr int kMaxRank = 8;
  static constexpr std::int64_t kUnknown = -1;

  Shape() = default;  // a scalar
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(std::span<const std::int64_t> dims);

  int rank() const { return rank_; }
  std::int64_t operator[](int axis) const { return dims_[static_cast<std::size_t>(axis)]; }
  std::int64_t& operator[](int axis) { return dims_[static_cast<std::size_t>(axis)]; }
  // Python-style: dim(-1) is the last dimension. Throws InvalidArgument when out of range.
  std::int64_t dim(int axis) const;
  std::span<const std::int64_t> dims() const { return {dims_.data(), static_cast<std::size_t>(rank_)}; }

  void push_back(std::int64_t dim);
  Shape with_dim(int axis, std::int64_t dim) const;

  bool is_fully_defined() const;
  // The product of the dimensions; kUnknown when any dimension is unknown.
  std::int64_t num_elements() const;
  // True when the shapes could describe the same tensor (same rank, equal where both are known).
  bool compatible_with(const Shape& other) const;

  // Keras style: "(None, 28, 28)", "(128,)", "()".
  std::string to_string() const;

  bool operator==(const Shape& other) const;

 private:
  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

// Normalises a possibly negative axis against `rank`; throws InvalidArgument naming `what`.
int normalize_axis(int axis, int rank, std::string_view what);

}  // namespace tandem::graph

template <>
struct fmt::formatter<tandem::graph::Shape> : fmt::formatter<std::string> {
  auto format(const tandem::graph::Shape& s, format_context& ctx) const {
    return fmt::formatter<std::string>::format(s.to_string(), ctx);
  }
};
