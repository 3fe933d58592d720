// float32 SIMD helpers shared by the CPU GEMVs (f32_linear_cpu.cpp, bf16_linear_cpu.cpp): one
// vector type and its load / FMA / zero / horizontal sum, AVX-512 or AVX2 + FMA as the build's
// -march=native allows; kLanes == 0 when neither (the kernels' scalar loops then do all of K).
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

}  // namespace kvserve_vec
