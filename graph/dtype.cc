#include "tandem/graph/dtype.h"

#include "tandem/graph/detail/low_precision_types.h"

namespace tandem::graph {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kU8: return 1;
    case DType::kF16:
    case DType::kBF16: return 2;
  }
  return 0;
}

bool is_floating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kF16 || dtype == DType::kBF16;
}

void widen_to_float32(DType from, const void* src, float* dst, std::int64_t n) {
  dispatch<LowPrecisionTypes>(from, "widen_to_float32", [&]<class T>() {
    const T* in = static_cast<const T*>(src);
    for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(in[i]);
  });
}

void narrow_from_float32(const float* src, DType to, void* dst, std::int64_t n) {
  dispatch<LowPrecisionTypes>(to, "narrow_from_float32", [&]<class T>() {
    T* out = static_cast<T*>(dst);
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(src[i]);
  });
}

DType parse_dtype(std::string_view name) {
  if (name == "float32" || name == "float") return DType::kF32;
  if (name == "float64" || name == "double") return DType::kF64;
  if (name == "int32") return DType::kI32;
  if (name == "int64") return DType::kI64;
  if (name == "uint8" || name == "bool") return DType::kU8;
  if (name == "float16" || name == "half") return DType::kF16;
  if (name == "bfloat16") return DType::kBF16;
  throw InvalidArgument(fmt::format(
      "unknown dtype \"{}\"; expected one of float32, float64, int32, int64, uint8, float16, bfloat16", name));
}

namespace detail {
std::string type_list_names(std::initializer_list<DType> dtypes) {
  std::string out;
  for (auto d : dtypes) out += fmt::format("{}{}", out.empty() ? "" : ", ", dtype_name(d));
  return out;
}

void throw_unsupported_dtype(std::string_view what, DType dtype, std::initializer_list<DType> accepted) {
  throw InvalidArgument(fmt::format("{}: dtype {} is not supported; expected one of {}", what, dtype_name(dtype),
                                    type_list_names(accepted)));
}
}  // namespace detail

}  // namespace tandem::graph
