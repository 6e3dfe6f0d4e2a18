// CPU kernels of the array family: transpose, cast, argmax, equal, one-hot, fills.
#include <algorithm>
#include <cstring>

#include "tandem/graph/detail/low_precision_types.h"
#include "tandem/ops/cpu/broadcast.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/detail/registration.h"

namespace tandem::ops::cpu {
namespace {

using graph::AllTypes;
using graph::IndexTypes;
using graph::Shape;

void transpose_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const auto& perm = ctx.attrs().get<std::vector<std::int64_t>>("perm");
  const Shape& in = x.shape();
  // The output walks the input with strides permuted; reuse the broadcast iterator with one
  // operand whose strides are the input's strides in output order.
  BroadcastLayout layout;
  layout.operands = 1;
  std::array<std::int64_t, Shape::kMaxRank> in_strides{};
  std::int64_t stride = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    in_strides[static_cast<std::size_t>(d)] = stride;
    stride *= in[d];
  }
  layout.rank = y.shape().rank();
  for (int d = 0; d < layout.rank; ++d) {
    layout.dims[static_cast<std::size_t>(d)] = y.shape()[d];
    layout.strides[0][static_cast<std::size_t>(d)] =
        in_strides[static_cast<std::size_t>(perm[static_cast<std::size_t>(d)])];
  }
  if (layout.rank == 0 || y.num_elements() == 0) {
    if (y.num_elements() == 1) std::memcpy(y.raw_data(), x.raw_data(), y.nbytes());
    return;
  }
  graph::dispatch<AllTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    const T* px = static_cast<const T*>(x.raw_data());
    T* py = static_cast<T*>(y.raw_data());
    parallel_elements(ctx, y.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
        const T* src = px + off[0];
        for (std::int64_t i = 0; i < n; ++i) py[o + i] = src[i * inner[0]];
      });
    });
  });
}

void copy_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  auto* dst = static_cast<char*>(ctx.output(0).raw_data());
  const auto* src = static_cast<const char*>(x.raw_data());
  ctx.device().parallel_for(
      static_cast<std::int64_t>(x.nbytes()), kElementwiseGrain * 4,
      [&](std::int64_t b, std::int64_t e) { std::memcpy(dst + b, src + b, static_cast<std::size_t>(e - b)); });
}

void cast_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  // Every pair of dtypes, 16-bit ones included; those convert through float (one rounding, since
  // float holds every float16 and bfloat16 value exactly).
  graph::dispatch<graph::EveryType>(x.dtype(), ctx.label(), [&]<class From>() {
    graph::dispatch<graph::EveryType>(y.dtype(), ctx.label(), [&]<class To>() {
      const From* px = static_cast<const From*>(x.raw_data());
      To* py = static_cast<To*>(y.raw_data());
      using Via = std::conditional_t<std::is_floating_point_v<From> || std::is_integral_v<From>, From, float>;
      parallel_elements(ctx, x.num_elements(), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) py[i] = static_cast<To>(static_cast<Via>(px[i]));
      });
    });
  });
}

void argmax_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Shape& in = x.shape();
  const int axis = static_cast<int>(ctx.attrs().get_int("axis") < 0 ? ctx.attrs().get_int("axis") + in.rank()
                                                                    : ctx.attrs().get_int("axis"));
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= in[d];
  for (int d = axis + 1; d < in.rank(); ++d) inner *= in[d];
  const std::int64_t size = in[axis];
  TANDEM_REQUIRE(size > 0 || outer * inner == 0, InvalidArgument, "{}: argmax over an empty axis of {}", ctx.label(),
                 in);
  auto* out = out_ptr<std::int64_t>(ctx, 0);
  graph::dispatch<graph::NumericTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    const T* px = static_cast<const T*>(x.raw_data());
    ctx.device().parallel_for(outer * inner, row_grain(size), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t p = begin; p < end; ++p) {
        const std::int64_t o = p / inner, i = p % inner;
        const T* base = px + o * size * inner + i;
        std::int64_t best = 0;
        for (std::int64_t k = 1; k < size; ++k) {
          if (base[k * inner] > base[best * inner]) best = k;
        }
        out[p] = best;
      }
    });
  });
}

void equal_kernel(KernelContext& ctx) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& y = ctx.output(0);
  const auto layout = make_broadcast_layout(y.shape(), {&a.shape(), &b.shape()});
  auto* py = out_ptr<std::uint8_t>(ctx, 0);
  graph::dispatch<AllTypes>(a.dtype(), ctx.label(), [&]<class T>() {
    const T* pa = static_cast<const T*>(a.raw_data());
    const T* pb = static_cast<const T*>(b.raw_data());
    parallel_elements(ctx, y.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
        for (std::int64_t i = 0; i < n; ++i) py[o + i] = pa[off[0] + i * inner[0]] == pb[off[1] + i * inner[1]];
      });
    });
  });
}

void one_hot_kernel(KernelContext& ctx) {
  const Tensor& indices = ctx.input(0);
  const std::int64_t depth = ctx.attrs().get_int("depth");
  const auto on = static_cast<float>(ctx.attrs().get_float_or("on_value", 1.0));
  const auto off = static_cast<float>(ctx.attrs().get_float_or("off_value", 0.0));
  float* out = out_ptr<float>(ctx, 0);
  graph::dispatch<graph::IntegerTypes>(indices.dtype(), ctx.label(), [&]<class I>() {
    const I* pi = static_cast<const I*>(indices.raw_data());
    ctx.device().parallel_for(indices.num_elements(), row_grain(depth), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        float* row = out + r * depth;
        std::fill(row, row + depth, off);
        const auto k = static_cast<std::int64_t>(pi[r]);
        if (k >= 0 && k < depth) row[k] = on;  // out of range: an all-`off` row, as in TF
      }
    });
  });
}

template <class T>
void fill_value(KernelContext& ctx, Tensor& y, T value) {
  T* p = static_cast<T*>(y.raw_data());
  parallel_elements(ctx, y.num_elements(),
                    [&](std::int64_t begin, std::int64_t end) { std::fill(p + begin, p + end, value); });
}

void fill_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  const double value = ctx.attrs().get_float_or("value", 0.0);
  graph::dispatch<AllTypes>(y.dtype(), ctx.label(), [&]<class T>() { fill_value<T>(ctx, y, static_cast<T>(value)); });
}

template <int kValue>
void fill_like_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  graph::dispatch<AllTypes>(y.dtype(), ctx.label(), [&]<class T>() { fill_value<T>(ctx, y, static_cast<T>(kValue)); });
}

}  // namespace
}  // namespace tandem::ops::cpu

namespace tandem::ops::detail {
void register_array_cpu_kernels() {
  using namespace tandem::ops::cpu;
  using devices::DeviceType;
  auto& r = graph::OpRegistry::global();
  r.add_kernel("Transpose", DeviceType::kCPU, transpose_kernel);
  r.add_kernel("Copy", DeviceType::kCPU, copy_kernel, {.low_precision = graph::LowPrecision::kNative});  // bytes
  r.add_kernel("Cast", DeviceType::kCPU, cast_kernel, {.low_precision = graph::LowPrecision::kNative});
  r.add_kernel("ArgMax", DeviceType::kCPU, argmax_kernel);
  r.add_kernel("Equal", DeviceType::kCPU, equal_kernel);
  r.add_kernel("OneHot", DeviceType::kCPU, one_hot_kernel);
  r.add_kernel("Fill", DeviceType::kCPU, fill_kernel);
  r.add_kernel("ZerosLike", DeviceType::kCPU, fill_like_kernel<0>);
  r.add_kernel("OnesLike", DeviceType::kCPU, fill_like_kernel<1>);
}
}  // namespace tandem::ops::detail
