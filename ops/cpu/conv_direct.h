// tandem/ops/cpu/conv_direct.h — direct float32 convolution kernels for AVX-512 and AVX2.
//
// im2col + GEMM copies every input value kh * kw times into a patch matrix, and a BLAS then packs
// that matrix again; with one input channel (patch rows of 9 values) the copying and packing
// cost more than the arithmetic. These kernels instead read the input in place ("implicit
// GEMM": patch element (kh, kw, c) of a pixel sits at a fixed offset from its window's corner)
// and keep a tile of the result in registers for the whole reduction, vectorised over output
// channels (AVX-512: 16 floats a register, tiles of 12 pixels x 32 channels or 6 x 64; AVX2: 8
// floats, tiles of 12 x 8 or 6 x 16). On the
// benchmark CNN they run at 75-100% of the core's FMA peak where im2col + OpenBLAS ran at 60%.
//   forward           any padding and stride; output channels a multiple of the lanes (16, 8);
//                     optionally max-pooled block by block (FusedConv2DMaxPool)
//   backprop filter   the same, reducing a tile of dW over the pixels in registers; dy read
//                     whole, or expanded chunk by chunk from FusedConv2DMaxPool's argmax, or
//                     (input channels a multiple of the lanes) reduced over the pool windows'
//                     winners alone, one output channel at a time
//   backprop input    1-4 input channels: a dot product per dx element; stride 1 with input
//                     channels a multiple of the lanes: the forward kernel over dy with the filter
//                     flipped and transposed, dy read whole; from FusedConv2DMaxPool's argmax,
//                     the winners' terms of the same sums (or, with one-cell windows or more
//                     input channels than a tile holds, dy expanded image by image)
//
// Each function returns false, doing nothing, when the geometry does not qualify or the level
// this copy is compiled for (ops/cpu/isa.h) has neither AVX-512 nor AVX2 (the baseline level); the
// caller then takes the im2col + GEMM path, which also serves float64.
#pragma once

#include <cstdint>

#include "tandem/devices/device.h"
#include "tandem/ops/cpu/conv_geometry.h"

namespace tandem::ops::cpu::direct {

// Patches up to this many values (kh * kw * in_channels: 3x3x512) take the direct kernels.
inline constexpr std::int64_t kMaxPatch = 4608;
// Backprop-input computes each dx element as one dot product up to this many input channels.
inline constexpr std::int64_t kMaxBackpropInputChannels = 4;

// What forward applies to each tile of y while it is still in registers: y = act(conv + bias),
// act relu or linear (FusedConv2D's other activations run as a pass over y afterwards).
struct ForwardEpilogue {
  const float* bias = nullptr;  // out_c values, or none
  bool relu = false;            // max(0, z) as Eigen's relu computes it (-0 and NaN kept)
};

// FusedConv2DMaxPool's pool, applied to each block of y's rows while forward's tiles have just
// written them to a small per-thread buffer: y itself is never stored. p is each window's maximum;
// argmax its first winning cell (row-major in the window, strict comparisons in scan order) or
// detail::kNoWinner when no cell won or, with the epilogue's relu, the maximum is not > 0.
struct ForwardMaxPool {
  detail::Window2DGeometry pool;  // over y; VALID windows that do not overlap, at most 254 cells
  float* p = nullptr;
  std::uint8_t* argmax = nullptr;
};

bool conv2d_forward(devices::Device& device, const detail::Window2DGeometry& g, const float* x, const float* w,
                    float* y, ForwardEpilogue epilogue = {});
bool conv2d_forward_max_pool(devices::Device& device, const detail::Window2DGeometry& g, const float* x, const float* w,
                             ForwardEpilogue epilogue, const ForwardMaxPool& pool);
bool conv2d_backprop_filter(devices::Device& device, const detail::Window2DGeometry& g, const float* x, const float* dy,
                            float* dw);
// Backprop-filter's dy where FusedConv2DMaxPool's gradient gives it: each chunk of dy is expanded
// from the argmax and dp into an L1-sized buffer as the kernel walks it (dp where the argmax names
// the cell, +0 elsewhere: the dz MaxPool2DBiasActivationGrad would find from y, never stored), so
// the result is bitwise conv2d_backprop_filter's of that dz. With input channels a multiple of
// the lanes, only the winners' terms are summed, in the same order; else a patch short enough
// for one register tile at least as wide as the chunked path's (a first layer's 3x3x1 with
// AVX-512) is expanded in registers, pixel by pixel, skipping pixels outside every window: the
// same sums either way (x * +0 added to a sum leaves it unchanged for finite x).
struct DyFromArgmax {
  detail::Window2DGeometry pool;  // over dy; VALID windows that do not overlap
  const std::uint8_t* argmax = nullptr;
  const float* dp = nullptr;
};
bool conv2d_backprop_filter_argmax(devices::Device& device, const detail::Window2DGeometry& g, const float* x,
                                   const DyFromArgmax& dy, float* dw);
bool conv2d_backprop_input(devices::Device& device, const detail::Window2DGeometry& g, const float* w, const float* dy,
                           float* dx);
// Backprop-input's dy from FusedConv2DMaxPool's argmax: the flipped forward's sums over the
// winners' terms alone (or, for one-cell windows or more input channels than a tile holds, each
// image of dy expanded into a per-thread buffer before the kernel reads it), so the result is
// bitwise conv2d_backprop_input's of that dy for finite w. Declines (false) where conv2d_backprop_input would not take
// the flipped forward: then the caller expands dy whole and calls conv2d_backprop_input.
bool conv2d_backprop_input_argmax(devices::Device& device, const detail::Window2DGeometry& g, const float* w,
                                  const DyFromArgmax& dy, float* dx);

}  // namespace tandem::ops::cpu::direct
