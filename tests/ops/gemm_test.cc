// GEMM backends: both against a float64 triple loop, with transposes, strides, alpha/beta, and the
// threaded split on sizes that do not divide evenly.
#include <doctest/doctest.h>

#include <array>
#include <random>
#include <vector>

#include "tandem/devices/device.h"
#include "tandem/ops/cpu/gemm.h"

using namespace tandem;
using ops::cpu::GemmBackend;
using ops::cpu::GemmShape;

namespace {

template <class T>
void check_product(GemmBackend backend, bool threaded, GemmShape s, T alpha, T beta) {
  std::mt19937 rng(static_cast<unsigned>(s.m * 131 + s.n * 17 + s.k));
  std::uniform_real_distribution<T> dist(-1, 1);
  const auto a_rows = s.transpose_a ? s.k : s.m;
  const auto b_rows = s.transpose_b ? s.n : s.k;
  std::vector<T> a(static_cast<std::size_t>(a_rows * s.lda)), b(static_cast<std::size_t>(b_rows * s.ldb)),
      c(static_cast<std::size_t>(s.m * s.ldc));
  for (auto& v : a) v = dist(rng);
  for (auto& v : b) v = dist(rng);
  for (auto& v : c) v = dist(rng);
  std::vector<double> want(c.size());
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.ldc; ++j) {
      const auto ci = static_cast<std::size_t>(i * s.ldc + j);
      if (j >= s.n) {
        want[ci] = c[ci];  // outside C's columns: untouched
        continue;
      }
      double sum = 0;
      for (std::int64_t p = 0; p < s.k; ++p) {
        const double av =
            s.transpose_a ? a[static_cast<std::size_t>(p * s.lda + i)] : a[static_cast<std::size_t>(i * s.lda + p)];
        const double bv =
            s.transpose_b ? b[static_cast<std::size_t>(j * s.ldb + p)] : b[static_cast<std::size_t>(p * s.ldb + j)];
        sum += av * bv;
      }
      want[ci] = alpha * sum + beta * c[ci];
    }
  }
  if (threaded) {
    // gemm() picks the backend chosen at start-up; compare it as the kernels use it.
    ops::cpu::gemm<T>(devices::default_cpu_device(), s, alpha, a.data(), b.data(), beta, c.data());
  } else {
    ops::cpu::gemm_serial_with<T>(backend, s, alpha, a.data(), b.data(), beta, c.data());
  }
  const double tol = std::is_same_v<T, float> ? 1e-4 : 1e-11;
  int bad = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    if (std::abs(c[i] - want[i]) > tol * (1 + std::abs(want[i])) && bad++ < 3) {
      CHECK_MESSAGE(false, "element ", i, ": ", c[i], " vs ", want[i]);
    }
  }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("both GEMM backends match a float64 reference") {
  ops::cpu::init_gemm();
  MESSAGE("GEMM backend: ", ops::cpu::gemm_backend_description());
  std::vector<GemmBackend> backends{GemmBackend::kEigen};
  if (ops::cpu::openblas_available()) backends.push_back(GemmBackend::kOpenBLAS);
  for (const auto backend : backends) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (const auto& [m, n, k] : std::vector<std::array<std::int64_t, 3>>{{1, 1, 1}, {7, 5, 3}, {33, 70, 129}}) {
          CAPTURE(static_cast<int>(backend));
          CAPTURE(ta);
          CAPTURE(tb);
          CAPTURE(m);
          GemmShape s{ta, tb, m, n, k, ta ? m + 2 : k + 1, tb ? k + 3 : n + 1, n + 4};  // padded leading dimensions
          check_product<float>(backend, false, s, 1.0f, 0.0f);
          check_product<double>(backend, false, s, 0.5, 2.0);
        }
      }
    }
  }
}

TEST_CASE("the threaded split gives the same product on uneven sizes") {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (const auto& [m, n, k] :
           std::vector<std::array<std::int64_t, 3>>{{129, 1025, 77}, {1031, 17, 300}, {64, 64, 64}}) {
        GemmShape s{ta, tb, m, n, k, ta ? m : k, tb ? k : n, n};
        check_product<float>(ops::cpu::gemm_backend(), true, s, 1.0f, 0.0f);
        check_product<double>(ops::cpu::gemm_backend(), true, s, 1.0, 1.0);
      }
    }
  }
}
