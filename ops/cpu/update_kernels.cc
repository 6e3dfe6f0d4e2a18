// The optimizers' update loops on CPUs (keras_like/optimizers.cc calls them through the table of
// the instruction-set level this process runs, ops/cpu/isa.h): ops/detail/update_rules.h's element
// functions (shared with the CUDA kernel), with the option branches hoisted out of the loops so
// that they vectorise. Compiled once per level like the kernels.
#include <cstdint>

#include "tandem/ops/cpu/isa.h"
#include "tandem/ops/detail/update_rules.h"

namespace tandem::ops::cpu {
namespace {

using detail::AdamStep;
using detail::GradientTransform;
using detail::RmspropStep;
using detail::SgdStep;

template <class T>
void sgd_update(T* __restrict var, T* __restrict m, const T* __restrict g, std::int64_t b, std::int64_t e, SgdStep<T> s,
                GradientTransform<T> gt) {
  if (m == nullptr) {
    for (std::int64_t i = b; i < e; ++i) ops::detail::sgd_plain(var[i], gt(g[i]), s);
    return;
  }
  for (std::int64_t i = b; i < e; ++i) ops::detail::sgd_momentum(var[i], m[i], gt(g[i]), s);
}

template <class T>
void rmsprop_update(T* __restrict var, T* __restrict velocity, T* __restrict mom, T* __restrict average,
                    const T* __restrict g, std::int64_t b, std::int64_t e, RmspropStep<T> s, GradientTransform<T> gt) {
  for (std::int64_t i = b; i < e; ++i) {
    ops::detail::rmsprop_element(var[i], velocity[i], mom != nullptr ? mom + i : nullptr,
                                 average != nullptr ? average + i : nullptr, gt(g[i]), s);
  }
}

template <class T>
void adam_update(T* __restrict var, T* __restrict m, T* __restrict v, T* __restrict v_hat, const T* __restrict g,
                 std::int64_t b, std::int64_t e, AdamStep<T> s, GradientTransform<T> gt) {
  if (v_hat == nullptr && !gt.clip && s.decay == T(0)) {
    const T scale = gt.scale;
    for (std::int64_t i = b; i < e; ++i) ops::detail::adam_plain(var[i], m[i], v[i], g[i] * scale, s);
    return;
  }
  for (std::int64_t i = b; i < e; ++i)
    ops::detail::adam_general(var[i], m[i], v[i], v_hat != nullptr ? v_hat + i : nullptr, gt(g[i]), s);
}

}  // namespace

namespace TANDEM_CPU_ISA_NS {

template <class T>
UpdateLoops<T> update_loops() {
  return {.sgd = &sgd_update<T>, .rmsprop = &rmsprop_update<T>, .adam = &adam_update<T>};
}
template UpdateLoops<float> update_loops<float>();
template UpdateLoops<double> update_loops<double>();

}  // namespace TANDEM_CPU_ISA_NS
}  // namespace tandem::ops::cpu
