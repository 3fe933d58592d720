// Weight-only int8 linear layers on CPU (W8A32): int8 weights with one float32 scale per output
// row, float32 activations and accumulation.
//
//   int8_gemv:    y [M, N] = x [M, K] @ (w [N, K] * scale [N, 1])^T (+ bias), for M <= kMaxRows.
//                 Decode-sized batches are bound by reading the weights, and int8 rows are a
//                 quarter of float32's bytes: each row is read once, widened 16 (AVX-512) or 8
//                 (AVX2) values at a time, and multiplied into the M activation rows (held in L1).
//   int8_dequant: out [N, K] = w * scale, for larger batches, whose matmul then runs in oneDNN on
//                 the float32 copy (compute-bound there, so the copy costs little).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu_vec.h"

namespace {

constexpr int64_t kMaxRows = 8;

#if defined(__AVX512F__)
#include <immintrin.h>
// 16 int8 weights widened to float32 (GCC 12 scalarises __builtin_convertvector here, one value
// at a time; vpmovsxbd + vcvtdq2ps keep the GEMV bound by memory).
inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// AVX2 (AMD EPYC Zen 2/3, older Xeons): 8 int8 weights widened to float32 per instruction pair.
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

template <int M>
void gemv_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, const float* bias, float* y,
               int64_t ldy, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    float sums[M];
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      const __m512 wf = widen16(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + m * ldx + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
      const __m256 wf = widen8(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + m * ldx + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) sums[m] = hsum8(acc[m]);
#else
    for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
    for (int m = 0; m < M; ++m) {
      float s = sums[m];
      for (int64_t kk = k; kk < K; ++kk) s += static_cast<float>(wn[kk]) * x[m * ldx + kk];
      y[m * ldy + n] = s * scale[n] + (bias ? bias[n] : 0.f);
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "int8 linear (cpu): float32 x [M, K] with contiguous rows expected");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "int8 linear (cpu): contiguous int8 weight [N, K] expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == w.size(0),
              "int8 linear (cpu): float32 scale [N] expected");
}

void int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
               at::Tensor& y) {
  check(x, w, scale);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= kMaxRows, "int8_gemv (cpu): at most ", kMaxRows, " rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == M && y.size(1) == N,
              "int8_gemv (cpu): float32 y [M, N] expected");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    kvserve_vec::by_rows(M, [&](auto m) { gemv_rows<decltype(m)::value>(xp, ldx, wp, sp, bp, yp, N, K, n0, n1); });
  });
}

void int8_dequant(const at::Tensor& w, const at::Tensor& scale, at::Tensor& out) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.is_contiguous() && out.sizes() == w.sizes() && scale.numel() == w.size(0),
              "int8_dequant (cpu): int8 w [N, K], float32 scale [N] and out [N, K] expected");
  const int64_t N = w.size(0), K = w.size(1);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float s = sp[n];
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) op[n * K + k] = static_cast<float>(wp[n * K + k]) * s;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("int8_dequant(Tensor w, Tensor scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_dequant", &int8_dequant);
}
