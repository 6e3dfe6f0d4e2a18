// tandem/keras_like/mixed_precision.h — dtype policies: Keras's keras.mixed_precision.
//
//   keras::mixed_precision::set_global_policy("mixed_bfloat16");  // before the layers are made
//   model = keras::Sequential({...});                             // layers compute in bfloat16
//   model.compile("adam", ...);                                   // mixed_float16: loss scaling too
//
// A policy names the dtype a layer computes in and the dtype its variables are kept in:
//   "float32" (the default), "float64", "float16", "bfloat16": both the same;
//   "mixed_float16", "mixed_bfloat16": compute in the 16-bit type, variables in float32.
// Each layer takes the global policy when it is constructed (LayerImpl::dtype_policy();
// Layer::set_dtype_policy() changes one layer, e.g. a float32 output layer). Under a mixed policy:
//   - floating inputs of a layer are cast to its compute dtype, and its variables are read
//     through a cast (Keras's AutoCastVariable): the float32 variable is what the optimizer
//     updates, and its gradient is float32;
//   - BatchNormalization computes in float32 and casts its output back;
//   - softmax (as a Dense or Activation activation) computes and returns float32;
//   - a float32 layer after a 16-bit one casts its 16-bit inputs up;
//   - losses and metrics cast the model's outputs to float32, and predict() returns float32
//     (Keras returns the compute dtype; a float32 result is what a C++ caller can read);
//   - compile() wraps the optimizer in a LossScaleOptimizer under mixed_float16 (Keras 3), unless
//     it is one already. bfloat16 has float32's range and needs no loss scaling.
// Gradients are all-reduced in float32 (the variables' dtype) unless
// DistributionOptions::gradient_all_reduce_dtype asks for the compute dtype.
#pragma once

#include <string>
#include <string_view>

#include "tandem/graph/dtype.h"

namespace tandem::keras::mixed_precision {

class Policy {
 public:
  Policy() = default;  // float32
  // Throws InvalidArgument for an unknown name, listing the known ones.
  explicit Policy(std::string_view name);

  const std::string& name() const { return name_; }
  graph::DType compute_dtype() const { return compute_; }
  graph::DType variable_dtype() const { return variable_; }
  // compute_dtype differs from variable_dtype.
  bool is_mixed() const { return compute_ != variable_; }

  friend bool operator==(const Policy& a, const Policy& b) { return a.name_ == b.name_; }

 private:
  std::string name_ = "float32";
  graph::DType compute_ = graph::DType::kF32;
  graph::DType variable_ = graph::DType::kF32;
};

// The policy layers made from now on take. Process-wide; set it before building the model.
void set_global_policy(const Policy& policy);
void set_global_policy(std::string_view name);
Policy global_policy();

// Sets the global policy for a scope and restores the previous one on exit (tests, samples that
// build two models).
class PolicyScope {
 public:
  explicit PolicyScope(std::string_view name) : previous_(global_policy()) { set_global_policy(name); }
  ~PolicyScope() { set_global_policy(previous_); }
  PolicyScope(const PolicyScope&) = delete;
  PolicyScope& operator=(const PolicyScope&) = delete;

 private:
  Policy previous_;
};

}  // namespace tandem::keras::mixed_precision
