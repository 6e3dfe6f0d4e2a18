// tandem/ops/cpu/bias_activation.h — activation(x + bias) over rows: the epilogue that fused
// kernels (BiasActivation, FusedMatMul, FusedConv2D) apply while their output is in cache, and the
// activations' derivatives (the activation ops, GeluGrad, BiasActivationGrad). Nothing throws.
#pragma once

#include <unsupported/Eigen/SpecialFunctions>  // Eigen's vectorised erf (a rational approximation for float)

#include <numbers>
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
    case Activation::kGelu: f.template operator()<Activation::kGelu>(); return;
    case Activation::kGeluApproximate: f.template operator()<Activation::kGeluApproximate>(); return;
  }
}

// GELU's tanh form: 0.5 z (1 + tanh(kGeluK * (z + kGeluC * z^3))).
inline constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
inline constexpr double kGeluC = 0.044715;

// act(z) as an Eigen array expression. Sigmoid as 1 / (1 + exp(-z)): exp overflowing to inf for
// very negative z gives exactly 0, never NaN. Each transcendental function is evaluated once per
// element (z itself may be an expression such as in + bias: re-adding is cheaper than storing).
template <Activation A, class E>
auto activate(const E& z) {
  using T = typename E::Scalar;
  if constexpr (A == Activation::kLinear) {
    return z;
  } else if constexpr (A == Activation::kRelu) {
    return z.max(T(0));
  } else if constexpr (A == Activation::kSigmoid) {
    return (T(1) + (-z).exp()).inverse();
  } else if constexpr (A == Activation::kTanh) {
    return z.tanh();
  } else if constexpr (A == Activation::kGelu) {
    return T(0.5) * z * (T(1) + (z * T(std::numbers::sqrt2 / 2)).erf());
  } else {
    return T(0.5) * z * (T(1) + (T(kGeluK) * (z + T(kGeluC) * z.cube())).tanh());
  }
}

// dz = dy * act'(z) over n elements, from `saved`: the activation's output y for relu, sigmoid and
// tanh, its input z for GELU (activation_gradient_needs_input). dz must not alias dy or saved.
template <Activation A, class T>
void activation_backward(const T* dy, const T* saved, T* dz, std::int64_t n) {
  if constexpr (A == Activation::kGelu || A == Activation::kGeluApproximate) {
    const ConstArrayMap<T> g(dy, n), z(saved, n);
    ArrayMap<T> out(dz, n);
    // Two sweeps over a span that stays in L1, so that erf/exp (or tanh) run once per element:
    // first the transcendental part into out, then the derivative from it.
    if constexpr (A == Activation::kGelu) {
      // d/dz z Phi(z) = Phi(z) + z phi(z).
      const T inv_sqrt_2pi = T(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
      ArrayMap<T> pdf(dz, n);
      pdf = (T(-0.5) * z.square()).exp() * inv_sqrt_2pi;
      out = g * (T(0.5) * (T(1) + (z * T(std::numbers::sqrt2 / 2)).erf()) + z * pdf);
    } else {
      // t = tanh(u), u = k (z + c z^3): 0.5 (1 + t) + 0.5 z (1 - t^2) k (1 + 3 c z^2).
      out = (T(kGeluK) * (z + T(kGeluC) * z.cube())).tanh();
      out = g * (T(0.5) * (T(1) + out) +
                 T(0.5 * kGeluK) * z * (T(1) - out.square()) * (T(1) + T(3 * kGeluC) * z.square()));
    }
  } else {
    // Plain loops the compiler vectorises (relu's select included).
    for (std::int64_t i = 0; i < n; ++i) {
      const T g = dy[i], y = saved[i];
      if constexpr (A == Activation::kLinear) {
        dz[i] = g;
      } else if constexpr (A == Activation::kRelu) {
        dz[i] = y > T(0) ? g : T(0);
      } else if constexpr (A == Activation::kSigmoid) {
        dz[i] = g * y * (T(1) - y);
      } else {
        dz[i] = g * (T(1) - y * y);
      }
    }
  }
}

// x + b, then max(., 0) when kRelu, as std::max(z, 0) and Eigen's max are (NaN and -0 pass);
// the pointers restrict so that the loops vectorise without overlap checks (in place: one pointer).
template <bool kRelu, class T>
void bias_relu_row(const T* __restrict x, T* __restrict y, const T* __restrict b, std::int64_t n) {
  for (std::int64_t c = 0; c < n; ++c) {
    const T z = x[c] + b[c];
    y[c] = kRelu && z < T(0) ? T(0) : z;
  }
}
template <bool kRelu, class T>
void bias_relu_row(T* __restrict y, const T* __restrict b, std::int64_t n) {
  for (std::int64_t c = 0; c < n; ++c) {
    const T z = y[c] + b[c];
    y[c] = kRelu && z < T(0) ? T(0) : z;
  }
}

// out[r, c] = act(in[r, c] + bias[c]) for rows [r0, r1) and columns [c0, c1) of a row-major
// matrix with leading dimension ld (in may be out). When pre is not null it receives in + bias,
// the pre-activation GELU's gradient needs (same layout; pre may be in).
template <Activation A, class T>
void bias_activation_rows(const T* in, T* out, T* pre, std::int64_t ld, std::int64_t r0, std::int64_t r1,
                          std::int64_t c0, std::int64_t c1, const T* bias) {
  const std::int64_t n = c1 - c0;
  if constexpr (A == Activation::kLinear || A == Activation::kRelu) {
    if (pre == nullptr) {
      // Plain loops the compiler vectorises. The tiles hand over blocks one panel (32 or 16
      // columns) wide, where an Eigen map a row cost more than the row's arithmetic.
      for (std::int64_t r = r0; r < r1; ++r) {
        if (in == out) {
          bias_relu_row<A == Activation::kRelu>(out + r * ld + c0, bias + c0, n);
        } else {
          bias_relu_row<A == Activation::kRelu>(in + r * ld + c0, out + r * ld + c0, bias + c0, n);
        }
      }
      return;
    }
  }
  const ConstArrayMap<T> b(bias + c0, n);
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t o = r * ld + c0;
    if (pre != nullptr) {
      ArrayMap<T>(pre + o, n) = ConstArrayMap<T>(in + o, n) + b;
      ArrayMap<T>(out + o, n) = activate<A>(ConstArrayMap<T>(pre + o, n));
    } else {
      ArrayMap<T>(out + o, n) = activate<A>(ConstArrayMap<T>(in + o, n) + b);
    }
  }
}

template <Activation A, class T>
void bias_activation_rows(const T* in, T* out, std::int64_t ld, std::int64_t r0, std::int64_t r1, std::int64_t c0,
                          std::int64_t c1, const T* bias) {
  bias_activation_rows<A, T>(in, out, nullptr, ld, r0, r1, c0, c1, bias);
}

}  // namespace tandem::ops::cpu
