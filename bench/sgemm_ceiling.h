// bench/sgemm_ceiling.h — this machine's sgemm ceiling, measured the way bench_ops measures it,
// for every benchmark that states its GFLOP/s as a share of the machine's (bench_ops, bench_fit).
//
// The ceiling is the fastest of the single-precision GEMMs this process can call on a large
// square product at the device's thread count: OpenBLAS single-threaded calls split over the
// device's threads (what tandem's gemm() runs) and OpenBLAS's own thread pool; Eigen split the
// same way where OpenBLAS is missing (bench_ops times Eigen beside OpenBLAS too). OpenBLAS is the library tandem
// loaded, so its kernels are the ones OPENBLAS_CORETYPE selected (the environment's value, else tandem's loader picks
// the CPU's best).
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tandem/devices/device.h"
#include "tandem/ops/cpu/gemm.h"

namespace bench {

inline constexpr std::int64_t kCeilingSquare = 2048;

// tandem runs OpenBLAS single-threaded and splits products over its own threads. As an
// independent reference we also time OpenBLAS's own threading, on the library tandem loaded
// (so with the kernels OPENBLAS_CORETYPE selected): the same handle, with its thread count
// raised for those samples only.
struct OpenBlasThreads {
  using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                           int);
  SgemmFn sgemm = nullptr;
  void (*set_threads)(int) = nullptr;
  char* (*corename)() = nullptr;

  OpenBlasThreads() {
    void* handle = nullptr;
    for (const char* name : {"libopenblas.so.0", "libopenblas.so"}) {
      handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (handle != nullptr) break;
    }
    if (handle == nullptr) return;
    sgemm = reinterpret_cast<SgemmFn>(dlsym(handle, "cblas_sgemm"));
    set_threads = reinterpret_cast<void (*)(int)>(dlsym(handle, "openblas_set_num_threads"));
    corename = reinterpret_cast<char* (*)()>(dlsym(handle, "openblas_get_corename"));
    if (set_threads == nullptr) sgemm = nullptr;
  }
  bool available() const { return sgemm != nullptr; }
  void run(const tandem::ops::cpu::GemmShape& s, const float* a, const float* b, float* c) const {
    const auto i = [](std::int64_t v) { return static_cast<int>(v); };
    sgemm(101, s.transpose_a ? 112 : 111, s.transpose_b ? 112 : 111, i(s.m), i(s.n), i(s.k), 1.0f, a, i(s.lda), b,
          i(s.ldb), 0.0f, c, i(s.ldc));
  }
};

// gemm_serial_with(backend) split over the device's threads the way tandem's gemm() splits: the
// larger side of C in equal parts (columns in multiples of 16).
inline void split_gemm(tandem::devices::Device& device, tandem::ops::cpu::GemmBackend backend,
                       const tandem::ops::cpu::GemmShape& s, const float* a, const float* b, float* c) {
  const int threads = device.intra_op_threads();
  if (threads <= 1) {
    tandem::ops::cpu::gemm_serial_with(backend, s, 1.0f, a, b, 0.0f, c);
    return;
  }
  const bool columns = s.n >= s.m;
  const std::int64_t extent = columns ? s.n : s.m, align = columns ? 16 : 1;
  std::int64_t block = (extent + threads - 1) / threads;
  block = (block + align - 1) / align * align;
  const std::int64_t parts = (extent + block - 1) / block;
  device.parallel_for(parts, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t p = begin; p < end; ++p) {
      const std::int64_t lo = p * block, size = std::min(block, extent - lo);
      tandem::ops::cpu::GemmShape part = s;
      const float *pa = a, *pb = b;
      float* pc = c;
      if (columns) {
        part.n = size;
        pb = s.transpose_b ? b + lo * s.ldb : b + lo;
        pc = c + lo;
      } else {
        part.m = size;
        pa = s.transpose_a ? a + lo : a + lo * s.lda;
        pc = c + lo * s.ldc;
      }
      tandem::ops::cpu::gemm_serial_with(backend, part, 1.0f, pa, pb, 0.0f, pc);
    }
  });
}

// One measurement of the ceiling (bench_fit's; bench_ops times the same candidates inside its
// interleaved rounds instead).
struct SgemmCeiling {
  double gflops = 0;  // the fastest candidate
  std::string which;  // "OpenBLAS split", "OpenBLAS threads" or "Eigen split"
};

// Measures the ceiling, on operands made once: bench_fit measures before each of its runs.
class SgemmCeilingProbe {
 public:
  SgemmCeilingProbe() : a_(kElements), b_(kElements), c_(kElements) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : a_) x = u(rng);
    for (auto& x : b_) x = u(rng);
  }

  // Times each candidate on a kCeilingSquare^3 product: `samples` samples of calls lasting at
  // least `min_seconds`, the best sample counting. Takes about a second at 200 GFLOP/s and blocks
  // the device's threads meanwhile.
  SgemmCeiling measure(tandem::devices::Device& device, int samples = 3, double min_seconds = 0.1) {
    using tandem::ops::cpu::GemmBackend;
    constexpr std::int64_t n = kCeilingSquare;
    const tandem::ops::cpu::GemmShape s{
        .transpose_a = false, .transpose_b = false, .m = n, .n = n, .k = n, .lda = n, .ldb = n, .ldc = n};
    const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
    const float *a = a_.data(), *b = b_.data();
    float* c = c_.data();

    SgemmCeiling best;
    const auto time = [&](const std::string& which, auto&& call) {
      call();  // warm-up: packing buffers, page faults
      for (int sample = 0; sample < samples; ++sample) {
        int calls = 0;
        const auto start = std::chrono::steady_clock::now();
        double elapsed = 0;
        do {
          call();
          ++calls;
          elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        } while (elapsed < min_seconds);
        const double gflops = flops * calls / elapsed / 1e9;
        if (gflops > best.gflops) best = {gflops, which};
      }
    };
    if (openblas_) {
      time("OpenBLAS split", [&] { split_gemm(device, GemmBackend::kOpenBLAS, s, a, b, c); });
      if (own_.available() && device.intra_op_threads() > 1) {
        own_.set_threads(device.intra_op_threads());
        time("OpenBLAS threads", [&] { own_.run(s, a, b, c); });
        own_.set_threads(1);
      }
    }
    // Eigen reaches less than half of OpenBLAS here (bench_ops times both): timed only without it.
    if (best.gflops == 0) time("Eigen split", [&] { split_gemm(device, GemmBackend::kEigen, s, a, b, c); });
    // OpenBLAS's own threads poll for work for a while after their last call (THREAD_TIMEOUT,
    // 2^28 cycles by default) before they sleep: long enough to take a core from whatever is timed
    // next. Wait for them.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    return best;
  }

 private:
  static constexpr auto kElements = static_cast<std::size_t>(kCeilingSquare * kCeilingSquare);
  std::vector<float> a_, b_, c_;
  bool openblas_ = tandem::ops::cpu::openblas_available();  // loads OpenBLAS, which own_ then finds
  OpenBlasThreads own_;
};

}  // namespace bench
