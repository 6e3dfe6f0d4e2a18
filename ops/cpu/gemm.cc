#include "tandem/ops/cpu/gemm.h"

#include <Eigen/Core>
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <vector>

#include "tandem/base/detail/shared_library.h"
#include "tandem/base/env.h"
#include "tandem/base/log.h"
#include "tandem/base/errors.h"
#include "tandem/base/cpu_isa.h"
#include "tandem/ops/cpu/isa.h"

namespace tandem::ops::cpu {
namespace {

// CBLAS enums, declared here so the build does not need OpenBLAS's headers.
constexpr int kCblasRowMajor = 101;
constexpr int kCblasNoTrans = 111;
constexpr int kCblasTrans = 112;
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
using DgemmFn = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double, double*,
                         int);
using CorenameFn = char* (*)();
using ConfigFn = char* (*)();
using SetThreadsFn = void (*)(int);

struct OpenBlas {
  SgemmFn sgemm = nullptr;
  DgemmFn dgemm = nullptr;
  std::string description;
};

struct State {
  GemmBackend backend = GemmBackend::kEigen;
  OpenBlas openblas;
  bool openblas_loaded = false;
  bool tiles = false;  // float32 products in the register tiles first (TANDEM_GEMM=auto)
  std::string description;
};

State& state() {
  static State s;
  return s;
}

// OpenBLAS's names for the fastest kernel set this CPU can run: the newest, except on AMD's family
// 19h (Zen 3, Zen 4), where it is the AVX2 one. Zen 4 runs AVX-512 on 256-bit units, and there
// OpenBLAS 0.3.21's Cooperlake kernels took 8.2-11.3 ms for wide's eight products in sequence
// against 6.6-7.6 ms for its Haswell kernels (4 interleaved runs each; bench/README.md).
const char* openblas_core_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_is("amdfam19h") && __builtin_cpu_supports("avx2")) return "Haswell";
  if (__builtin_cpu_supports("avx512f")) {
    return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2")) return "Haswell";
  return nullptr;
}

bool load_openblas(OpenBlas& out) {
  // OpenBLAS reads these when it loads. Set them only for the load, and only where the user has
  // not: they would otherwise leak into every child process of the program.
  std::vector<const char*> set_here;
  const auto set_for_load = [&](const char* name, const char* value) {
    if (std::getenv(name) == nullptr && setenv(name, value, /*overwrite=*/0) == 0) set_here.push_back(name);
  };
  if (const char* core = openblas_core_for_this_cpu()) set_for_load("OPENBLAS_CORETYPE", core);
  // We split products over the device's threads ourselves; OpenBLAS's own pool would compete.
  set_for_load("OPENBLAS_NUM_THREADS", "1");
  const auto library = tandem::detail::open_first_library({TANDEM_OPENBLAS_PATH, "libopenblas.so.0", "libopenblas.so"});
  for (const char* name : set_here) unsetenv(name);
  if (library.handle == nullptr) return false;
  CorenameFn corename = nullptr;
  ConfigFn config = nullptr;
  SetThreadsFn set_threads = nullptr;
  tandem::detail::load_symbol(library, out.sgemm, "cblas_sgemm");
  tandem::detail::load_symbol(library, out.dgemm, "cblas_dgemm");
  tandem::detail::load_symbol(library, corename, "openblas_get_corename");
  tandem::detail::load_symbol(library, config, "openblas_get_config");
  tandem::detail::load_symbol(library, set_threads, "openblas_set_num_threads");
  if (out.sgemm == nullptr || out.dgemm == nullptr) return false;
  if (set_threads != nullptr) set_threads(1);
  out.description = fmt::format("OpenBLAS ({}), {} kernels, single-threaded per call", config ? config() : "?",
                                corename ? corename() : "?");
  return true;
}

template <class T>
void eigen_gemm(const GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c) {
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  const Eigen::Index m = s.m, n = s.n, k = s.k;
  Eigen::Map<Matrix, Eigen::Unaligned, Stride> cm(c, m, n, Stride(s.ldc));
  const auto a_rows = s.transpose_a ? k : m, a_cols = s.transpose_a ? m : k;
  const auto b_rows = s.transpose_b ? n : k, b_cols = s.transpose_b ? k : n;
  Eigen::Map<const Matrix, Eigen::Unaligned, Stride> am(a, a_rows, a_cols, Stride(s.lda));
  Eigen::Map<const Matrix, Eigen::Unaligned, Stride> bm(b, b_rows, b_cols, Stride(s.ldb));
  if (beta == T(0)) {
    cm.setZero();
  } else if (beta != T(1)) {
    cm *= beta;
  }
  if (s.transpose_a && s.transpose_b) {
    cm.noalias() += alpha * (am.transpose() * bm.transpose());
  } else if (s.transpose_a) {
    cm.noalias() += alpha * (am.transpose() * bm);
  } else if (s.transpose_b) {
    cm.noalias() += alpha * (am * bm.transpose());
  } else {
    cm.noalias() += alpha * (am * bm);
  }
}

template <class T>
void openblas_gemm(const GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c) {
  const auto& ob = state().openblas;
  const int ta = s.transpose_a ? kCblasTrans : kCblasNoTrans;
  const int tb = s.transpose_b ? kCblasTrans : kCblasNoTrans;
  const auto i = [](std::int64_t v) { return static_cast<int>(v); };
  if constexpr (std::is_same_v<T, float>) {
    ob.sgemm(kCblasRowMajor, ta, tb, i(s.m), i(s.n), i(s.k), alpha, a, i(s.lda), b, i(s.ldb), beta, c, i(s.ldc));
  } else {
    ob.dgemm(kCblasRowMajor, ta, tb, i(s.m), i(s.n), i(s.k), alpha, a, i(s.lda), b, i(s.ldb), beta, c, i(s.ldc));
  }
}

}  // namespace

void init_gemm() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& s = state();
    const std::string choice = env::get_string(env::kGemm);
    if (choice != "eigen") s.openblas_loaded = load_openblas(s.openblas);
    TANDEM_REQUIRE(choice != "openblas" || s.openblas_loaded, FailedPrecondition,
                   "TANDEM_GEMM=openblas but libopenblas could not be loaded (install libopenblas0)");
    s.backend = s.openblas_loaded ? GemmBackend::kOpenBLAS : GemmBackend::kEigen;
    s.tiles = choice == "auto" && cpu_isa() != CpuIsa::kBaseline;
    s.description = s.openblas_loaded
                        ? s.openblas.description
                        : fmt::format("Eigen {}.{}.{}", EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION);
    if (s.tiles) {
      s.description = fmt::format("tandem's register tiles ({}) for float32, else {}", cpu_isa_name(cpu_isa()),
                                  s.description);
    }
    logging::debug("matrix products on CPUs: {} (TANDEM_GEMM={})", s.description, choice);
  });
}

GemmBackend gemm_backend() {
  init_gemm();
  return state().backend;
}

bool gemm_tiles_enabled() {
  init_gemm();
  return state().tiles;
}

std::string gemm_backend_description() {
  init_gemm();
  return state().description;
}

bool openblas_available() {
  init_gemm();
  return state().openblas_loaded;
}

template <class T>
void gemm_serial_with(GemmBackend backend, const GemmShape& shape, T alpha, const T* a, const T* b, T beta, T* c) {
  if (shape.m == 0 || shape.n == 0) return;
  if (backend == GemmBackend::kOpenBLAS) {
    TANDEM_ASSERT(state().openblas_loaded, "OpenBLAS requested but not loaded");
    openblas_gemm(shape, alpha, a, b, beta, c);
  } else {
    eigen_gemm(shape, alpha, a, b, beta, c);
  }
}

namespace {
// Whether a float32 product goes to the register tiles first: they compute C = op(A) op(B) only.
bool tiles_take(float alpha, float beta) { return alpha == 1.0f && beta == 0.0f && gemm_tiles_enabled(); }

// The libraries know no triangles. For them a triangular op(A) is copied with the other triangle
// zeroed (the product is then the same), and kLowerC's triangle is cleared after the whole product.
template <class T>
struct WholeProduct {
  GemmShape shape;
  const T* a;
  std::vector<T> masked_a;  // op(A), m x k, when it is triangular
};
template <class T>
WholeProduct<T> whole_product(const GemmShape& s, const T* a) {
  WholeProduct<T> w{s, a, {}};
  w.shape.triangle = GemmTriangle::kNone;
  if (s.triangle != GemmTriangle::kLowerA && s.triangle != GemmTriangle::kUpperA) return w;
  w.masked_a.assign(static_cast<std::size_t>(s.m * s.k), T(0));
  for (std::int64_t i = 0; i < s.m; ++i) {
    const bool lower = s.triangle == GemmTriangle::kLowerA;
    const std::int64_t lo = lower ? 0 : std::min(i, s.k), hi = lower ? std::min(i + 1, s.k) : s.k;
    for (std::int64_t k = lo; k < hi; ++k)
      w.masked_a[static_cast<std::size_t>(i * s.k + k)] = s.transpose_a ? a[k * s.lda + i] : a[i * s.lda + k];
  }
  w.shape.transpose_a = false;
  w.shape.lda = s.k;
  w.a = w.masked_a.data();
  return w;
}
template <class T>
void clear_lower_c_triangle(const GemmShape& s, T* c) {
  if (s.triangle != GemmTriangle::kLowerC) return;
  for (std::int64_t i = 0; i < s.m && i + 1 < s.n; ++i) std::fill(c + i * s.ldc + i + 1, c + i * s.ldc + s.n, T(0));
}
}  // namespace

template <class T>
void gemm_serial(const GemmShape& shape, T alpha, const T* a, const T* b, T beta, T* c) {
  // The tiles' bits do not depend on the thread count, so a caller that splits a batch of products
  // over threads (BatchMatMul) gets what gemm() gives it on one thread.
  if constexpr (std::is_same_v<T, float>) {
    if (tiles_take(alpha, beta) && current_isa_kernels().gemm_tiles_serial(shape, a, b, c)) return;
  }
  const WholeProduct<T> whole = whole_product(shape, a);
  gemm_serial_with(gemm_backend(), whole.shape, alpha, whole.a, b, beta, c);
  clear_lower_c_triangle(shape, c);
}

template <class T>
void gemm(devices::Device& device, const GemmShape& shape, T alpha, const T* a, const T* b, T beta, T* c) {
  if constexpr (std::is_same_v<T, float>) {
    if (tiles_take(alpha, beta) && current_isa_kernels().gemm_tiles(device, shape, a, b, c, nullptr)) return;
  }
  const int threads = device.intra_op_threads();
  if (threads <= 1 || shape.m * shape.n * shape.k < kParallelGemmMinMacs) {
    gemm_serial(shape, alpha, a, b, beta, c);
    return;
  }
  // The parts below are whole products of their own: the triangle is applied to A first and C last.
  const WholeProduct<T> whole = whole_product(shape, a);
  const GemmShape& s = whole.shape;
  a = whole.a;
  // Split the larger side of C so that each thread packs only its share of the other operand.
  const bool split_columns = s.n >= s.m;
  const std::int64_t extent = split_columns ? s.n : s.m;
  const std::int64_t align = split_columns ? kGemmColumnAlignment : 1;
  std::int64_t block = (extent + threads - 1) / threads;
  block = (block + align - 1) / align * align;
  const std::int64_t parts = (extent + block - 1) / block;
  device.parallel_for(parts, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t p = begin; p < end; ++p) {
      const std::int64_t lo = p * block;
      const std::int64_t size = std::min(block, extent - lo);
      GemmShape part = s;
      const T* pa = a;
      const T* pb = b;
      T* pc = c;
      if (split_columns) {
        part.n = size;
        pb = s.transpose_b ? b + lo * s.ldb : b + lo;  // columns of op(B): rows of B when transposed
        pc = c + lo;
      } else {
        part.m = size;
        pa = s.transpose_a ? a + lo : a + lo * s.lda;
        pc = c + lo * s.ldc;
      }
      gemm_serial(part, alpha, pa, pb, beta, pc);
    }
  });
  clear_lower_c_triangle(shape, c);
}

template void gemm_serial<float>(const GemmShape&, float, const float*, const float*, float, float*);
template void gemm_serial<double>(const GemmShape&, double, const double*, const double*, double, double*);
template void gemm<float>(devices::Device&, const GemmShape&, float, const float*, const float*, float, float*);
template void gemm<double>(devices::Device&, const GemmShape&, double, const double*, const double*, double, double*);
template void gemm_serial_with<float>(GemmBackend, const GemmShape&, float, const float*, const float*, float, float*);
template void gemm_serial_with<double>(GemmBackend, const GemmShape&, double, const double*, const double*, double,
                                       double*);

}  // namespace tandem::ops::cpu
