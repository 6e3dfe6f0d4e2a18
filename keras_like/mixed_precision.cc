#include "tandem/keras_like/mixed_precision.h"

#include <mutex>

#include "tandem/base/errors.h"

namespace tandem::keras::mixed_precision {
namespace {

std::mutex policy_mutex;
Policy& global() {
  static Policy policy;
  return policy;
}

}  // namespace

Policy::Policy(std::string_view name) : name_(name) {
  using graph::DType;
  if (name == "mixed_float16") {
    compute_ = DType::kF16;
    variable_ = DType::kF32;
  } else if (name == "mixed_bfloat16") {
    compute_ = DType::kBF16;
    variable_ = DType::kF32;
  } else if (name == "float32" || name == "float64" || name == "float16" || name == "bfloat16") {
    compute_ = variable_ = graph::parse_dtype(name);
  } else {
    throw InvalidArgument(fmt::format(
        "unknown dtype policy \"{}\"; expected one of float32, mixed_float16, mixed_bfloat16, float16, bfloat16, "
        "float64",
        name));
  }
}

void set_global_policy(const Policy& policy) {
  std::lock_guard lock(policy_mutex);
  global() = policy;
}

void set_global_policy(std::string_view name) { set_global_policy(Policy(name)); }

Policy global_policy() {
  std::lock_guard lock(policy_mutex);
  return global();
}

}  // namespace tandem::keras::mixed_precision
