#include "tandem/graph/shape.h"

#include <algorithm>

#include "tandem/base/errors.h"

namespace tandem::graph {

Shape::Shape(std::initializer_list<std::int64_t> dims)
    : Shape(std::span<const std::int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const std::int64_t> dims) {
  TANDEM_REQUIRE(dims.size() <= kMaxRank, InvalidArgument, "a shape has at most {} dimensions; got {}", kMaxRank,
                 dims.size());
  for (auto d : dims) push_back(d);
}

void Shape::push_back(std::int64_t dim) {
  TANDEM_REQUIRE(rank_ < kMaxRank, InvalidArgument, "a shape has at most {} dimensions; {} would have {}", kMaxRank,
                 to_string(), rank_ + 1);
  TANDEM_REQUIRE(dim >= kUnknown, InvalidArgument, "dimension {} is negative (use -1 for unknown)", dim);
  dims_[static_cast<std::size_t>(rank_++)] = dim;
}

std::int64_t Shape::dim(int axis) const {
  return dims_[static_cast<std::size_t>(normalize_axis(axis, rank_, fmt::format("shape {}", to_string())))];
}

Shape Shape::with_dim(int axis, std::int64_t dim) const {
  Shape out = *this;
  out.dims_[static_cast<std::size_t>(normalize_axis(axis, rank_, fmt::format("shape {}", to_string())))] = dim;
  return out;
}

bool Shape::is_fully_defined() const {
  return std::all_of(dims().begin(), dims().end(), [](std::int64_t d) { return d != kUnknown; });
}

std::int64_t Shape::num_elements() const {
  std::int64_t n = 1;
  for (auto d : dims()) {
    if (d == kUnknown) return kUnknown;
    n *= d;
  }
  return n;
}

bool Shape::compatible_with(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i) {
    if ((*this)[i] != kUnknown && other[i] != kUnknown && (*this)[i] != other[i]) return false;
  }
  return true;
}

std::string Shape::to_string() const {
  std::string out = "(";
  for (int i = 0; i < rank_; ++i) {
    if (i > 0) out += ", ";
    out += (*this)[i] == kUnknown ? std::string("None") : std::to_string((*this)[i]);
  }
  if (rank_ == 1) out += ",";
  return out + ")";
}

bool Shape::operator==(const Shape& other) const {
  return rank_ == other.rank_ && std::equal(dims().begin(), dims().end(), other.dims().begin());
}

int normalize_axis(int axis, int rank, std::string_view what) {
  TANDEM_REQUIRE(axis >= -rank && axis < rank, InvalidArgument,
                 "{}: axis {} is out of range for rank {} (expected {} to {})", what, axis, rank, -rank, rank - 1);
  return axis < 0 ? axis + rank : axis;
}

}  // namespace tandem::graph
