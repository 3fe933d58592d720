// float32 SIMD helpers shared by the CPU GEMVs (f32_linear_cpu.cpp, bf16_linear_cpu.cpp): one
// vector type and its load / FMA / zero / horizontal sum, AVX-512 or AVX2 + FMA as the build's
// -march=native allows; kLanes == 0 when neither (the kernels' scalar loops then do all of K); and
// the one-row GEMV's four-rows-at-a-time loop both use (four_rows).
#pragma once

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
inline vec zero_v() { return _mm512_setzero_ps(); }
inline float sum_v(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_VEC 1
constexpr int kLanes = 8;
using vec = __m256;
inline vec load_v(const float* p) { return _mm256_loadu_ps(p); }
inline vec fma_v(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec zero_v() { return _mm256_setzero_ps(); }
inline float sum_v(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#else
constexpr int kLanes = 0;
#endif

#if defined(KVSERVE_VEC)
// One activation row x [K] (float32) against weight rows [n0, n1) of w [N, K], four rows at a time:
// four independent FMA chains (one accumulator per row would wait on the FMA latency).
// widen(p): kLanes weights from p as a float32 vector. done(n, s): rows n..n+3's sums s[4] over the
// first K - K % kLanes columns, for the caller to add the tail of K and the bias and store.
// kPrefetch: while reading four rows, one 64-byte line of each of the next four (when they are in
// [n0, n1)) every 64 bytes of a row; rows of 16-bit weights are too short for the hardware
// prefetcher to ramp up on (float32 rows gained nothing from it). Returns the first row not done.
template <bool kPrefetch, typename T, typename Widen, typename Done>
inline int64_t four_rows(const float* x, const T* w, int64_t K, int64_t n0, int64_t n1, Widen widen, Done done) {
  const int64_t kv = K - K % kLanes;
  constexpr int64_t kLine = 64 / sizeof(T);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const T* w0 = w + n * K;
    const T* w1 = w0 + K;
    const T* w2 = w1 + K;
    const T* w3 = w2 + K;
    vec a0 = zero_v(), a1 = zero_v(), a2 = zero_v(), a3 = zero_v();
    const bool ahead = kPrefetch && n + 8 <= n1;
    for (int64_t k = 0; k < kv; k += kLanes) {
      if (ahead && k % kLine == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + 4 * K + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + 4 * K + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w2 + 4 * K + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w3 + 4 * K + k), _MM_HINT_T0);
      }
      const vec xv = load_v(x + k);
      a0 = fma_v(widen(w0 + k), xv, a0);
      a1 = fma_v(widen(w1 + k), xv, a1);
      a2 = fma_v(widen(w2 + k), xv, a2);
      a3 = fma_v(widen(w3 + k), xv, a3);
    }
    float s[4] = {sum_v(a0), sum_v(a1), sum_v(a2), sum_v(a3)};
    done(n, s);
  }
  return n;
}
#endif

}  // namespace kvserve_vec
