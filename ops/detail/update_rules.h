// tandem/ops/detail/update_rules.h — the optimizers' update rules, one element at a time.
//
// Shared by the CPU loops (keras_like/optimizers.cc, which hoist the option branches out of the
// loops so they vectorise) and the fused CUDA update kernel (ops/cuda/kernels.cu), so that both
// devices apply exactly the same formulas (Keras 3's). Scalars come by value: a captured
// reference would be reloaded after every store.
#pragma once

#if !defined(__CUDACC__)
#include <cmath>
#endif

#include "tandem/ops/detail/host_device.h"

namespace tandem::ops::detail {

template <class T>
TANDEM_HOST_DEVICE inline T rule_sqrt(T x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// Norm clipping's factor (or 1) times the mean/unscale factor, then value clipping.
template <class T>
struct GradientTransform {
  T scale;       // 1, or the norm clipping factor
  T clip_value;  // used when clip is set
  bool clip;
  TANDEM_HOST_DEVICE T operator()(T g) const {
    g *= scale;
    if (!clip) return g;
    return g < -clip_value ? -clip_value : (g > clip_value ? clip_value : g);
  }
};

template <class T>
struct SgdStep {
  T rate, momentum;
  bool nesterov;
};
template <class T>
TANDEM_HOST_DEVICE inline void sgd_plain(T& var, T gi, SgdStep<T> s) {
  var -= s.rate * gi;
}
template <class T>
TANDEM_HOST_DEVICE inline void sgd_momentum(T& var, T& m, T gi, SgdStep<T> s) {
  m = s.momentum * m - s.rate * gi;
  var += s.nesterov ? s.momentum * m - s.rate * gi : m;
}

template <class T>
struct RmspropStep {
  T rate, rho, momentum, epsilon;
};
// mom and average are null when momentum is 0 / the rule is not centered.
template <class T>
TANDEM_HOST_DEVICE inline void rmsprop_element(T& var, T& velocity, T* mom, T* average, T gi, RmspropStep<T> s) {
  velocity = s.rho * velocity + (T(1) - s.rho) * gi * gi;
  T denominator = velocity + s.epsilon;
  if (average != nullptr) {
    *average = s.rho * *average + (T(1) - s.rho) * gi;
    denominator = velocity - *average * *average + s.epsilon;
  }
  const T increment = s.rate * gi / rule_sqrt(denominator);
  if (mom != nullptr) {
    *mom = s.momentum * *mom + increment;
    var -= *mom;
  } else {
    var -= increment;
  }
}

template <class T>
struct AdamStep {
  T alpha, one_minus_beta_1, one_minus_beta_2, epsilon, decay;
};
// Adam without AMSGrad, clipping or decay: the common case, branch-free.
template <class T>
TANDEM_HOST_DEVICE inline void adam_plain(T& var, T& m, T& v, T gi, AdamStep<T> s) {
  m += (gi - m) * s.one_minus_beta_1;
  v += (gi * gi - v) * s.one_minus_beta_2;
  var -= m * s.alpha / (rule_sqrt(v) + s.epsilon);
}
// AdamW's decay first (w -= w * weight_decay * lr), then Adam; v_hat (AMSGrad) may be null.
template <class T>
TANDEM_HOST_DEVICE inline void adam_general(T& var, T& m, T& v, T* v_hat, T gi, AdamStep<T> s) {
  var -= var * s.decay;
  m += (gi - m) * s.one_minus_beta_1;
  v += (gi * gi - v) * s.one_minus_beta_2;
  T second_moment = v;
  if (v_hat != nullptr) {
    *v_hat = *v_hat < v ? v : *v_hat;
    second_moment = *v_hat;
  }
  var -= m * s.alpha / (rule_sqrt(second_moment) + s.epsilon);
}

// One optimizer step for many tensors of device memory in one launch (the fused GPU update):
// what ops/cuda/kernels.cu takes and ops/detail/device_update.h passes along.
inline constexpr int kMaxUpdateTensors = 64;
struct UpdateTensor {
  void* var = nullptr;
  void* slots[3] = {};  // SGD {momentum}, RMSprop {velocity, momentum, average}, Adam {m, v, v_hat}; null when off
  const void* grad = nullptr;
  long long elements = 0;
  bool weight_decay = true;  // UpdateParams::decay applies (false: excluded from weight decay)
};
enum class UpdateRule : unsigned char { kSgd, kRmsprop, kAdam };
struct UpdateParams {
  UpdateRule rule = UpdateRule::kSgd;
  double rate = 0, momentum = 0, rho = 0, epsilon = 0, beta_1_complement = 0, beta_2_complement = 0, decay = 0;
  bool nesterov = false;
  double gradient_scale = 1, clip_value = 0;  // GradientTransform
  bool clip = false;
};

}  // namespace tandem::ops::detail
