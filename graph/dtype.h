// tandem/graph/dtype.h — element types, and the one place that turns a DType into a C++ type.
//
// Kernels never switch on DType themselves; they call dispatch<TypeList>(dtype, label, fn), which
// calls fn.template operator()<T>() for the matching T and otherwise throws InvalidArgument
// naming the op and the dtypes it accepts. Adding a dtype means adding it here and to the lists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "tandem/base/errors.h"

namespace tandem::graph {

enum class DType : std::uint8_t {
  kF32,
  kF64,
  kI32,
  kI64,
  kU8,    // also the storage of booleans (Equal's result)
  kF16,   // IEEE half: 10-bit mantissa, range +-65504 (needs loss scaling for gradients)
  kBF16,  // bfloat16: float32's range with an 8-bit mantissa
};

inline constexpr DType kFloat32 = DType::kF32;
inline constexpr DType kFloat64 = DType::kF64;
inline constexpr DType kInt32 = DType::kI32;
inline constexpr DType kInt64 = DType::kI64;
inline constexpr DType kUInt8 = DType::kU8;

std::string_view dtype_name(DType dtype);  // "float32", "int64", ... (TF's names)
std::size_t dtype_size(DType dtype);       // bytes per element
bool is_floating(DType dtype);             // gradients flow only through these
// float16 or bfloat16: the compute dtypes of mixed precision. CPU kernels without their own
// 16-bit code compute them in float32 and round each output once (see OpRegistry::add_kernel).
constexpr bool is_low_precision(DType dtype) { return dtype == DType::kF16 || dtype == DType::kBF16; }
// Parses TF's names ("float32", "float", "int64", "uint8", ...); throws InvalidArgument.
DType parse_dtype(std::string_view name);

// Converts n elements between float32 and float16/bfloat16 (round to nearest even; NaN stays
// NaN, overflow becomes inf). Host memory only. Throws InvalidArgument for other dtypes.
void widen_to_float32(DType from, const void* src, float* dst, std::int64_t n);
void narrow_from_float32(const float* src, DType to, void* dst, std::int64_t n);

// C++ types of the dtypes. float16 and bfloat16 map to Eigen::half and Eigen::bfloat16 in
// graph/detail/low_precision_types.h, which kernels and tests include (Eigen is not a public
// dependency).
template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::kF64;
};
template <>
struct DTypeOf<std::int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct DTypeOf<std::int64_t> {
  static constexpr DType value = DType::kI64;
};
template <>
struct DTypeOf<std::uint8_t> {
  static constexpr DType value = DType::kU8;
};
template <class T>
inline constexpr DType dtype_of = DTypeOf<std::remove_cv_t<T>>::value;

template <class... Ts>
struct TypeList {};
using FloatTypes = TypeList<float, double>;
using NumericTypes = TypeList<float, double, std::int32_t, std::int64_t>;
using IntegerTypes = TypeList<std::int32_t, std::int64_t, std::uint8_t>;
using IndexTypes = TypeList<std::int32_t, std::int64_t>;
using AllTypes = TypeList<float, double, std::int32_t, std::int64_t, std::uint8_t>;

namespace detail {
std::string type_list_names(std::initializer_list<DType> dtypes);
[[noreturn]] void throw_unsupported_dtype(std::string_view what, DType dtype, std::initializer_list<DType> accepted);

template <class... Ts, class F>
decltype(auto) dispatch_impl(TypeList<Ts...>, DType dtype, std::string_view what, F&& f) {
  using Result = decltype(f.template operator()<std::tuple_element_t<0, std::tuple<Ts...>>>());
  if constexpr (std::is_void_v<Result>) {
    const bool matched = ((dtype == dtype_of<Ts> ? (f.template operator()<Ts>(), true) : false) || ...);
    if (!matched) throw_unsupported_dtype(what, dtype, {dtype_of<Ts>...});
  } else {
    Result result{};
    const bool matched = ((dtype == dtype_of<Ts> ? (result = f.template operator()<Ts>(), true) : false) || ...);
    if (!matched) throw_unsupported_dtype(what, dtype, {dtype_of<Ts>...});
    return result;
  }
}
}  // namespace detail

// Calls f.template operator()<T>() for the T in List whose dtype is `dtype`; `what` names the op
// or function for the error ("MatMul \"dense/matmul\"").
template <class List, class F>
decltype(auto) dispatch(DType dtype, std::string_view what, F&& f) {
  return detail::dispatch_impl(List{}, dtype, what, std::forward<F>(f));
}

}  // namespace tandem::graph

template <>
struct fmt::formatter<tandem::graph::DType> : fmt::formatter<std::string_view> {
  auto format(tandem::graph::DType d, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(tandem::graph::dtype_name(d), ctx);
  }
};
