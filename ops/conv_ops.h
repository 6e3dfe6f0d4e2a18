// tandem/ops/conv_ops.h — 2-D convolution and pooling on NHWC tensors.
#pragma once

#include <array>
#include <cstdint>

#include "tandem/graph/graph.h"
#include "tandem/ops/nn_ops.h"

namespace tandem::ops {

using graph::Output;

// TF's padding: kValid uses only whole windows; kSame pads so that out = ceil(in / stride),
// putting the extra row/column of padding at the bottom/right.
enum class Padding { kValid, kSame };
Padding parse_padding(std::string_view name);  // "valid", "same" (any case)

struct Conv2DOptions {
  std::array<std::int64_t, 2> strides{1, 1};  // (height, width)
  Padding padding = Padding::kValid;
};
// x: [batch, height, width, in_channels]; filter: [kh, kw, in_channels, out_channels] (HWIO).
Output conv2d(Output x, Output filter, const Conv2DOptions& options = {});
// activation(conv2d(x, filter) + bias) in one kernel: the bias and activation are applied to a few
// images' output at a time while it is still in cache, instead of in another pass over memory.
Output fused_conv2d(Output x, Output filter, Output bias, Activation activation, const Conv2DOptions& options = {});

struct Pool2DOptions {
  std::array<std::int64_t, 2> pool_size{2, 2};
  std::array<std::int64_t, 2> strides{2, 2};
  Padding padding = Padding::kValid;
};
// A max pool of a FusedConv2D output that nothing else reads yet (relu or linear, float32 or
// float64, VALID windows that do not overlap, up to 254 cells: Keras' MaxPooling2D after a
// Conv2D) becomes one FusedConv2DMaxPool node: the convolution's output is pooled while it is in
// cache instead of being written out, read back by the pool and read again by the gradient. The
// FusedConv2D node stays, without consumers (executors prune it; a consumer added later makes it
// run too). Otherwise a MaxPool2D node.
Output max_pool2d(Output x, const Pool2DOptions& options = {});
// With kSame, padded positions are not counted in the average (TF semantics).
Output avg_pool2d(Output x, const Pool2DOptions& options = {});

}  // namespace tandem::ops
