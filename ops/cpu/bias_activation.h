// tandem/ops/cpu/bias_activation.h — activation(x + bias) over rows: the epilogue that fused
// kernels (BiasActivation, FusedMatMul, FusedConv2D) apply while their output is in cache.
#pragma once

#include <string>

#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/nn_ops.h"

namespace tandem::ops::cpu {

inline Activation activation_of(const KernelContext& ctx) {
  return parse_activation(ctx.attrs().get<std::string>("activation"));
}

// Calls f.template operator()<A>() for the runtime activation, so loops specialise on it.
template <class F>
void with_activation(Activation activation, F&& f) {
  switch (activation) {
    case Activation::kLinear: f.template operator()<Activation::kLinear>(); return;
    case Activation::kRelu: f.template operator()<Activation::kRelu>(); return;
    case Activation::kSigmoid: f.template operator()<Activation::kSigmoid>(); return;
    case Activation::kTanh: f.template operator()<Activation::kTanh>(); return;
  }
}

// act(z) as an Eigen array expression. Sigmoid as 1 / (1 + exp(-z)): exp overflowing to inf for
// very negative z gives exactly 0, never NaN.
template <Activation A, class E>
auto activate(const E& z) {
  using T = typename E::Scalar;
  if constexpr (A == Activation::kLinear) {
    return z;
  } else if constexpr (A == Activation::kRelu) {
    return z.max(T(0));
  } else if constexpr (A == Activation::kSigmoid) {
    return (T(1) + (-z).exp()).inverse();
  } else {
    return z.tanh();
  }
}

// out[r, c] = act(in[r, c] + bias[c]) for rows [r0, r1) and columns [c0, c1) of a row-major
// matrix with leading dimension ld (in may be out).
template <Activation A, class T>
void bias_activation_rows(const T* in, T* out, std::int64_t ld, std::int64_t r0, std::int64_t r1, std::int64_t c0,
                          std::int64_t c1, const T* bias) {
  const ConstArrayMap<T> b(bias + c0, c1 - c0);
  for (std::int64_t r = r0; r < r1; ++r) {
    ArrayMap<T>(out + r * ld + c0, c1 - c0) = activate<A>(ConstArrayMap<T>(in + r * ld + c0, c1 - c0) + b);
  }
}

}  // namespace tandem::ops::cpu
