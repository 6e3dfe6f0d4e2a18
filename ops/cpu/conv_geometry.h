// tandem/ops/cpu/conv_geometry.h — the index arithmetic of 2-D windows (convolution, pooling).
//
// Shared by the op definitions (shape functions) and the kernels, so that both agree on output
// sizes and padding. Nothing here is CPU-specific; it lives next to the CPU kernels because they
// are its only users besides conv_ops.cc.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/graph/attrs.h"
#include "tandem/graph/shape.h"
#include "tandem/ops/conv_ops.h"

namespace tandem::ops::detail {

// Attribute names, shared by builders, shape functions and kernels.
inline constexpr std::string_view kStridesAttr = "strides";
inline constexpr std::string_view kPaddingAttr = "padding";
inline constexpr std::string_view kPoolSizeAttr = "pool_size";
// FusedConv2DMaxPool keeps the convolution's strides and padding under the names above and its
// pool's under these (with kPoolSizeAttr).
inline constexpr std::string_view kPoolStridesAttr = "pool_strides";
inline constexpr std::string_view kPoolPaddingAttr = "pool_padding";
// FusedConv2DMaxPool's argmax of a window no cell won: relu's derivative is 0 at its maximum (the
// maximum is <= 0), or every cell is NaN. Other values are the winning cell, row-major in the window.
inline constexpr std::uint8_t kNoWinner = 255;
// The largest pool window FusedConv2DMaxPool takes (its argmax is one byte).
inline constexpr std::int64_t kMaxFusedPoolCells = 254;

inline std::string_view padding_name(Padding padding) { return padding == Padding::kSame ? "SAME" : "VALID"; }

// Output extent of one spatial dimension (TF): VALID ceil((in - k + 1) / s), SAME ceil(in / s).
// Unknown (-1) when `in` is unknown. Callers check in >= k for VALID first.
inline std::int64_t window_output_size(std::int64_t in, std::int64_t k, std::int64_t stride, Padding padding) {
  if (in < 0) return graph::Shape::kUnknown;
  return padding == Padding::kValid ? (in - k + stride) / stride : (in + stride - 1) / stride;
}

// The padding cells `out` windows need on one axis, both sides together (0 when the windows do
// not reach past the end, as under VALID).
inline std::int64_t window_pad_total(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t out) {
  return std::max<std::int64_t>((out - 1) * stride + k - in, 0);
}

// Padding before the first element (top or left). TF puts the odd cell of SAME padding after.
inline std::int64_t window_pad_before(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t out,
                                      Padding padding) {
  if (padding == Padding::kValid) return 0;
  return window_pad_total(in, k, stride, out) / 2;
}

// Padding after the last element (bottom or right), given what is before: the rest of the total.
inline std::int64_t window_pad_after(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t out,
                                     std::int64_t pad_before) {
  return window_pad_total(in, k, stride, out) - pad_before;
}

// Everything a kernel needs to walk a 2-D window over an NHWC tensor. For pooling, in_c == out_c
// and the "filter" is the pool window.
struct Window2DGeometry {
  std::int64_t batch = 0, in_h = 0, in_w = 0, in_c = 0;
  std::int64_t k_h = 0, k_w = 0, out_c = 0;
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t out_h = 0, out_w = 0;
  std::int64_t pad_top = 0, pad_left = 0;

  std::int64_t patch_size() const { return k_h * k_w * in_c; }  // one im2col row
  std::int64_t out_pixels() const { return batch * out_h * out_w; }
  bool is_pointwise() const {  // 1x1, stride 1, no padding: the convolution is one GEMM
    return k_h == 1 && k_w == 1 && stride_h == 1 && stride_w == 1 && pad_top == 0 && pad_left == 0;
  }
};

// The window attributes of a node, as stored by the builders.
struct WindowAttrs {
  std::array<std::int64_t, 2> strides{1, 1};
  std::array<std::int64_t, 2> pool_size{0, 0};  // pooling only
  Padding padding = Padding::kValid;
};

inline std::array<std::int64_t, 2> pair_attr(const graph::Attrs& attrs, std::string_view name) {
  const auto& v = attrs.get<std::vector<std::int64_t>>(name);
  if (v.size() != 2) return {0, 0};  // rejected by the shape function as non-positive
  return {v[0], v[1]};
}

inline WindowAttrs read_window_attrs(const graph::Attrs& attrs, bool pooling) {
  WindowAttrs w;
  w.strides = pair_attr(attrs, kStridesAttr);
  if (pooling) w.pool_size = pair_attr(attrs, kPoolSizeAttr);
  w.padding = parse_padding(attrs.get<std::string>(kPaddingAttr));
  return w;
}

// Geometry for concrete shapes (kernels). x is NHWC; (k_h, k_w, out_c) from the filter or pool.
inline Window2DGeometry make_window_geometry(const graph::Shape& x, std::int64_t k_h, std::int64_t k_w,
                                             std::int64_t out_c, const WindowAttrs& attrs) {
  Window2DGeometry g;
  g.batch = x[0];
  g.in_h = x[1];
  g.in_w = x[2];
  g.in_c = x[3];
  g.k_h = k_h;
  g.k_w = k_w;
  g.out_c = out_c;
  g.stride_h = attrs.strides[0];
  g.stride_w = attrs.strides[1];
  g.out_h = window_output_size(g.in_h, k_h, g.stride_h, attrs.padding);
  g.out_w = window_output_size(g.in_w, k_w, g.stride_w, attrs.padding);
  g.pad_top = window_pad_before(g.in_h, k_h, g.stride_h, g.out_h, attrs.padding);
  g.pad_left = window_pad_before(g.in_w, k_w, g.stride_w, g.out_w, attrs.padding);
  return g;
}

// A convolution node's geometry: x NHWC, filter HWIO, the node's strides and padding.
inline Window2DGeometry conv_geometry(const graph::Attrs& attrs, const graph::Shape& x, const graph::Shape& filter) {
  return make_window_geometry(x, filter[0], filter[1], filter[3], read_window_attrs(attrs, false));
}
// A pooling node's geometry (out_c = in_c).
inline Window2DGeometry pool_geometry(const graph::Attrs& attrs, const graph::Shape& x) {
  const WindowAttrs window = read_window_attrs(attrs, true);
  return make_window_geometry(x, window.pool_size[0], window.pool_size[1], x[3], window);
}

// FusedConv2DMaxPool's pool attributes (kPoolSizeAttr, kPoolStridesAttr, kPoolPaddingAttr).
inline WindowAttrs read_fused_pool_attrs(const graph::Attrs& attrs) {
  WindowAttrs w;
  w.strides = pair_attr(attrs, kPoolStridesAttr);
  w.pool_size = pair_attr(attrs, kPoolSizeAttr);
  w.padding = parse_padding(attrs.get<std::string>(kPoolPaddingAttr));
  return w;
}
// FusedConv2DMaxPool: the geometry of its pool over the convolution's output `conv` (out_c = in_c).
inline Window2DGeometry fused_pool_geometry(const graph::Attrs& attrs, const Window2DGeometry& conv) {
  const WindowAttrs window = read_fused_pool_attrs(attrs);
  return make_window_geometry(graph::Shape{conv.batch, conv.out_h, conv.out_w, conv.out_c}, window.pool_size[0],
                              window.pool_size[1], conv.out_c, window);
}

}  // namespace tandem::ops::detail
