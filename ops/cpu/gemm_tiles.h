// tandem/ops/cpu/gemm_tiles.h — float32 matrix products in register tiles: tandem's own GEMM on
// the instruction-set levels with vectors (AVX-512, AVX2 + FMA), which gemm() (gemm.h) and
// FusedMatMul take before OpenBLAS or Eigen.
//
// Why: a dense layer's products have 128-ish rows (the batch) against 784-4096 of the others,
// where a library tuned for large squares loses to a kernel that only has to run those. On a
// 2-core Zen 4 the tiles trained mlp at a median of 318K samples/s against 227K with OpenBLAS, and
// wide at 15.4K against 14.5K (bench/README.md); and their bits depend on neither the thread count
// nor the level.
//
// C (m x n) = op(A) op(B), row-major, alpha 1 and beta 0. C is cut into panels of two registers of
// columns (32 with AVX-512, 16 with AVX2); a thread computes a whole panel (or, with fewer panels
// than threads, a part of its rows): op(B)'s columns are copied once into a contiguous panel
// (transposed in registers when B is), op(A) is read where it is (or first copied tile by tile,
// where its rows would collide in the L1 cache: gemm_tiles.cc's packs_a), and each tile of 12
// (AVX2: 6) rows x 2 registers sums its products over k in registers. Every element is one chain
// of FMAs over k in order, started from +0, whatever the thread count or the blocking (a long k is
// cut into blocks; the chain goes on from the value stored in C), so results are bitwise the same
// on any number of threads and run to run (not OpenBLAS's bits, which sum k in other orders).
//
// A GemmTriangle (gemm.h) leaves out the known-zero half: the k past a tile's last row (kLowerA)
// or before its first (kUpperA), with the diagonal block masked in a variant of the tile, or the
// tiles of C wholly above the diagonal (kLowerC), whose triangle is then cleared.
//
// Who calls: gemm() for every float32 product it is given (a dense layer's forward and gradients,
// the im2col convolutions); FusedMatMul with `done`, which applies bias and activation to each
// block of C as soon as it is complete, while it is still in cache. Blocks the caller until C is
// complete (the device's threads share the panels). Throws ResourceExhausted when scratch memory
// cannot be allocated.
#pragma once

#include <cstdint>

#include "tandem/base/function_ref.h"
#include "tandem/devices/device.h"
#include "tandem/ops/cpu/gemm.h"

namespace tandem::ops::cpu::tiles {

// Called once for each block of C when it is complete: rows [r0, r1), columns [c0, c1), on one
// of the device's threads, each block once. The blocks are whole rows (c0 = 0, c1 = n), handed
// over once every panel of a block of rows is done.
using BlockDone = FunctionRef<void(std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1)>;

// Returns false and does nothing when this level has no vectors (the baseline) or the product is
// too small to pay for copying its operands (under kMinMacs multiply-adds); the caller then uses
// the library GEMM.
inline constexpr std::int64_t kMinMacs = std::int64_t{1} << 15;
bool gemm(devices::Device& device, const GemmShape& shape, const float* a, const float* b, float* c,
          const BlockDone* done = nullptr);

// The same product on the calling thread alone (the same bits): gemm_serial() (gemm.h) calls it
// for products a caller already spreads over threads, such as BatchMatMul's batch of them.
bool gemm_serial(const GemmShape& shape, const float* a, const float* b, float* c);

}  // namespace tandem::ops::cpu::tiles
