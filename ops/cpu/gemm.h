// tandem/ops/cpu/gemm.h — dense matrix products for the CPU kernels (MatMul, convolution).
//
// Two backends, measured against each other by bench/bench_ops on every machine:
//   OpenBLAS  loaded at run time (dlopen), so tandem can pick its kernel set first. Debian's
//             OpenBLAS 0.3.21 does not recognise recent Xeons and falls back to SSE3 kernels,
//             about 7x slower than its AVX-512 ones; we set OPENBLAS_CORETYPE from CPUID before
//             loading it (unless the user set it) and run it single-threaded, partitioning the
//             product over the device's own threads.
//   Eigen     always available; within ~10% of OpenBLAS here.
// TANDEM_GEMM=eigen|openblas forces one (tests run both). With the default, float32 products of
// gemm() go to tandem's own register tiles first (gemm_tiles.h) on CPUs with AVX2 or AVX-512.
#pragma once

#include <cstdint>
#include <string>

#include "tandem/devices/device.h"

namespace tandem::ops::cpu {

enum class GemmBackend { kEigen, kOpenBLAS };

// A product smaller than this many multiply-adds runs on one thread: splitting it costs more
// than it saves. Kernels that split a product themselves (FusedMatMul) use the same rule.
inline constexpr std::int64_t kParallelGemmMinMacs = std::int64_t{1} << 18;
// Column blocks handed to threads are multiples of this (an AVX-512 register of floats).
inline constexpr std::int64_t kGemmColumnAlignment = 16;

// Chooses and loads the backend (idempotent; register_all calls it).
void init_gemm();
// The library that gemm_serial() and gemm() call for what the tiles leave.
GemmBackend gemm_backend();
// Whether gemm() computes float32 products in tandem's register tiles (gemm_tiles.h) where they
// apply: TANDEM_GEMM=auto on a CPU level with vectors (AVX2 or AVX-512).
bool gemm_tiles_enabled();
// "OpenBLAS 0.3.21, SkylakeX kernels, 1 thread per call" or "Eigen 3.4.0".
std::string gemm_backend_description();

// A triangle of a product known to be zero (causal attention's products and their gradients,
// BatchMatMul's a_lower_triangular and output_lower_triangular):
//   kLowerA  op(A)(i, k) counts as 0 for k > i, whatever is stored: row i's sum stops at k = i.
//   kUpperA  op(A)(i, k) counts as 0 for k < i, whatever is stored: row i's sum starts at k = i.
//   kLowerC  C(i, j) for j > i is set to 0 instead of computed.
// The register tiles skip the zero half (masking the diagonal block); the libraries compute the
// whole product of a copy of op(A) with the triangle zeroed (and then clear kLowerC's). Where the
// skipped entries are stored as 0, the bits equal the plain product's: each element of a tile is
// a chain of FMAs from +0, and fma(0, x, acc) = acc for finite x.
enum class GemmTriangle : unsigned char { kNone, kLowerA, kUpperA, kLowerC };

struct GemmShape {
  bool transpose_a = false;
  bool transpose_b = false;
  std::int64_t m = 0, n = 0, k = 0;        // C is m x n; op(A) is m x k; op(B) is k x n
  std::int64_t lda = 0, ldb = 0, ldc = 0;  // row-major leading dimensions
  GemmTriangle triangle = GemmTriangle::kNone;
};

// C = alpha * op(A) * op(B) + beta * C on the calling thread only (row-major): in the register
// tiles where gemm() would use them (float32, alpha 1, beta 0, gemm_tiles_enabled; the same bits
// as gemm() on any thread count), else with the library.
template <class T>
void gemm_serial(const GemmShape& shape, T alpha, const T* a, const T* b, T beta, T* c);
// The same product split over the device's intra-op threads: in the register tiles for float32
// with alpha 1 and beta 0 (gemm_tiles_enabled), else the library's calls on blocks of columns (or
// rows) of C. Either way bitwise the same on any number of threads.
template <class T>
void gemm(devices::Device& device, const GemmShape& shape, T alpha, const T* a, const T* b, T beta, T* c);

// Runs gemm_serial on a specific backend (benchmarks and tests); the whole product (no triangle).
template <class T>
void gemm_serial_with(GemmBackend backend, const GemmShape& shape, T alpha, const T* a, const T* b, T beta, T* c);
bool openblas_available();

}  // namespace tandem::ops::cpu
