// float32 SIMD helpers shared by the CPU kernels (the GEMVs of f32_linear_cpu.cpp and
// bf16_linear_cpu.cpp, paged_attention_cpu.cpp): one vector type and its load / store / FMA / zero /
// broadcast / horizontal sum, AVX-512 or AVX2 + FMA as the build's -march=native allows; kLanes == 0
// when neither (the kernels' scalar loops then do all the work); kLanes horizontal sums at once
// (sum_lanes); the one-row GEMV's loop (row_by_row); and the row-count dispatch of every GEMV (by_rows).
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve_vec {

#if defined(__AVX512F__)
#define KVSERVE_VEC 1
constexpr int kLanes = 16;
using vec = __m512;
inline vec load_v(const float* p) { return _mm512_loadu_ps(p); }
inline vec fma_v(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec add_v(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec zero_v() { return _mm512_setzero_ps(); }
inline float sum_v(vec a) { return _mm512_reduce_add_ps(a); }
inline vec set1_v(float x) { return _mm512_set1_ps(x); }
inline void store_v(float* p, vec a) { _mm512_storeu_ps(p, a); }
// out[j] = the sum of v[j]'s lanes for j < 16: a transpose-and-add tree (halves, quarters, pairs,
// lanes) of 45 shuffles and adds where 16 horizontal sums take ~130, then one permute into order.
inline void sum_lanes(const vec* v, float* out) {
  vec c[8], d[4], e[2];
  for (int p = 0; p < 8; ++p)  // 256-bit halves: [v2p.lo + v2p.hi | v2p+1.lo + v2p+1.hi]
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int p = 0; p < 4; ++p)  // 128-bit lane k: 4 partial sums of v[4p + k]
    d[p] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // lane k: pairs of v[8p + k] and v[8p + 4 + k]
    e[p] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * p], d[2 * p + 1]), _mm512_unpackhi_ps(d[2 * p], d[2 * p + 1]));
  // lane 4k + s holds v[k], v[8 + k], v[4 + k], v[12 + k] for s = 0..3
  const vec f = _mm512_add_ps(_mm512_unpacklo_ps(e[0], e[1]), _mm512_unpackhi_ps(e[0], e[1]));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, f));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_VEC 1
constexpr int kLanes = 8;
using vec = __m256;
inline vec load_v(const float* p) { return _mm256_loadu_ps(p); }
inline vec fma_v(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec add_v(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec zero_v() { return _mm256_setzero_ps(); }
inline float sum_v(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline vec set1_v(float x) { return _mm256_set1_ps(x); }
inline void store_v(float* p, vec a) { _mm256_storeu_ps(p, a); }
// out[j] = the sum of v[j]'s lanes for j < 8: a transpose-and-add tree (halves, pairs, lanes), then
// one permute into order.
inline void sum_lanes(const vec* v, float* out) {
  vec c[4], d[2];
  for (int p = 0; p < 4; ++p)  // 128-bit lane k: 4 partial sums of v[2p + k]
    c[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  for (int p = 0; p < 2; ++p)  // lane k: pairs of v[4p + k] and v[4p + 2 + k]
    d[p] = _mm256_add_ps(_mm256_unpacklo_ps(c[2 * p], c[2 * p + 1]), _mm256_unpackhi_ps(c[2 * p], c[2 * p + 1]));
  // lane 4k + s holds v[k], v[4 + k], v[2 + k], v[6 + k] for s = 0..3
  const vec f = _mm256_add_ps(_mm256_unpacklo_ps(d[0], d[1]), _mm256_unpackhi_ps(d[0], d[1]));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7)));
}
#else
constexpr int kLanes = 0;
#endif

#if defined(KVSERVE_VEC)
// One activation row x [K] (float32) against weight rows [n0, n1) of w [N, K], one row after the
// other, kAcc independent accumulators along K (one would wait on the FMA latency), so the weights
// stream through memory in order: on the 2-core EPYC this read SmolLM2's layer weights cold at
// 28.7 GB/s in float32 and 21.9 in bf16, where four rows at a time (one accumulator each, bf16 with a
// prefetch of the next four) read 26.3 and 19.0 (a one-off probe, 12 interleaved repeats).
// widen(p): kLanes weights from p as a float32 vector. done(n, s): row n's sum over its first
// K - K % kLanes columns, for the caller to add the tail of K and the bias and store. A row's sum does
// not depend on [n0, n1): any split of the rows over threads gives the same bits.
template <int kAcc, typename T, typename Widen, typename Done>
inline void row_by_row(const float* x, const T* w, int64_t K, int64_t n0, int64_t n1, Widen widen, Done done) {
  const int64_t kv = K - K % kLanes;
  const int64_t kb = K - K % (kLanes * kAcc);
  for (int64_t n = n0; n < n1; ++n) {
    const T* wn = w + n * K;
    vec a[kAcc];
    for (int i = 0; i < kAcc; ++i) a[i] = zero_v();
    int64_t k = 0;
    for (; k < kb; k += kLanes * kAcc)
      for (int i = 0; i < kAcc; ++i) a[i] = fma_v(widen(wn + k + i * kLanes), load_v(x + k + i * kLanes), a[i]);
    for (; k < kv; k += kLanes) a[0] = fma_v(widen(wn + k), load_v(x + k), a[0]);
    for (int half = kAcc / 2; half > 0; half /= 2)
      for (int i = 0; i < half; ++i) a[i] = add_v(a[i], a[i + half]);
    done(n, sum_v(a[0]));
  }
}
#endif

// f(std::integral_constant<int, M>{}) for M in 1..8: a GEMV's activation row count (at most 8) as a
// template argument, so each kernel's per-row loops unroll; M outside 1..8 (0 rows) calls nothing.
template <typename F>
inline void by_rows(int64_t M, F f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: break;
  }
}

}  // namespace kvserve_vec
