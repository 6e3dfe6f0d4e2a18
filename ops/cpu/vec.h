// tandem/ops/cpu/vec.h — the vector operations the register-tile kernels are written over
// (cpu/conv_direct.cc, cpu/gemm_tiles.cc), for the instruction-set level the including file is
// compiled for (cpu/isa.h): AVX-512 (16 float lanes, 32 registers) or AVX2 + FMA (8 lanes, 16
// registers). TANDEM_CPU_VECTORS is 1 there and 0 on the baseline level, which has no such
// kernels. Include it from the levels' sources only: every function here is compiled once per
// level, and the level's renaming keeps the copies apart.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TANDEM_CPU_VECTORS 1
#include <immintrin.h>

namespace tandem::ops::cpu::vec {

#if defined(__AVX512F__)
using Vec = __m512;
inline constexpr int kLanes = 16;
inline constexpr int kRegisters = 32;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// The first n lanes (0 < n < kLanes); the others are read as +0, or left alone in memory.
inline Vec vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline void vstore_n(float* p, Vec v, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
inline Vec vbroadcast(float x) { return _mm512_set1_ps(x); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vrelu(Vec z) { return _mm512_max_ps(_mm512_setzero_ps(), z); }  // z when z is NaN or -0, like Eigen's
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
// r[i] (row i of a kLanes x kLanes block) becomes column i: 32-bit, then 64-bit interleaves
// within 128-bit lanes, then two rounds of 128-bit lane shuffles.
inline void vtranspose(Vec r[kLanes]) {
  Vec t[kLanes];
  for (int i = 0; i < kLanes; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4q + s], 128-bit lane L: rows 4q..4q+3 at column 4L + s.
  const auto pd = [](Vec v) { return _mm512_castps_pd(v); };
  for (int q = 0; q < 4; ++q) {
    const Vec* u = t + 4 * q;
    r[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(u[0]), pd(u[2])));
    r[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(u[0]), pd(u[2])));
    r[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(u[1]), pd(u[3])));
    r[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(u[1]), pd(u[3])));
  }
  for (int s = 0; s < 4; ++s) {
    const Vec u = _mm512_shuffle_f32x4(r[s], r[4 + s], 0x88);       // groups 0, 1 at columns s, 8 + s
    const Vec v = _mm512_shuffle_f32x4(r[s], r[4 + s], 0xdd);       // ... at 4 + s, 12 + s
    const Vec w = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0x88);  // groups 2, 3 at s, 8 + s
    const Vec x = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0xdd);  // ... at 4 + s, 12 + s
    t[s] = _mm512_shuffle_f32x4(u, w, 0x88);
    t[8 + s] = _mm512_shuffle_f32x4(u, w, 0xdd);
    t[4 + s] = _mm512_shuffle_f32x4(v, x, 0x88);
    t[12 + s] = _mm512_shuffle_f32x4(v, x, 0xdd);
  }
  for (int i = 0; i < kLanes; ++i) r[i] = t[i];
}
#else
using Vec = __m256;
inline constexpr int kLanes = 8;
inline constexpr int kRegisters = 16;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline __m256i lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline Vec vload_n(const float* p, int n) { return _mm256_maskload_ps(p, lanes_below(n)); }
inline void vstore_n(float* p, Vec v, int n) { _mm256_maskstore_ps(p, lanes_below(n), v); }
inline Vec vbroadcast(float x) { return _mm256_set1_ps(x); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vrelu(Vec z) { return _mm256_max_ps(_mm256_setzero_ps(), z); }  // z when z is NaN or -0, like Eigen's
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// r[i] (row i of an 8 x 8 block) becomes column i.
inline void vtranspose(Vec r[kLanes]) {
  Vec t[kLanes], u[kLanes];
  for (int i = 0; i < kLanes; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int q = 0; q < 2; ++q) {
    const Vec* v = t + 4 * q;
    u[4 * q + 0] = _mm256_shuffle_ps(v[0], v[2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * q + 1] = _mm256_shuffle_ps(v[0], v[2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * q + 2] = _mm256_shuffle_ps(v[1], v[3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * q + 3] = _mm256_shuffle_ps(v[1], v[3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int s = 0; s < 4; ++s) {
    r[s] = _mm256_permute2f128_ps(u[s], u[4 + s], 0x20);
    r[4 + s] = _mm256_permute2f128_ps(u[s], u[4 + s], 0x31);
  }
}
#endif

}  // namespace tandem::ops::cpu::vec
#else
#define TANDEM_CPU_VECTORS 0
#endif
