// bfloat16 weights for decode-sized matmuls on any CPU, and on a CPU without native bf16 dot products
// (no avx512_bf16 / AMX), where oneDNN refuses bf16 and ATen emulates it far slower than float32
// (benchmarks/cpu_linear.py), for every matmul: the weights stay bfloat16 (half float32's bytes).
//
//   bf16_gemv:    y [M, N] = x [M, K] @ w [N, K]^T (+ bias) for M <= 8, x and y bfloat16.
//                 Small batches are bound by reading the weights: each weight row is read once for all
//                 M activation rows; accumulation in float32, y rounded once to bfloat16. Built with
//                 avx512_bf16 (-march=native on such a CPU): VDPBF16PS on the bf16 values as they are
//                 (dp_rows). Otherwise each weight vector is widened bf16 -> fp32 exactly (a 16-bit
//                 shift; AVX2 or AVX-512) and x once per call into a float32 buffer; one row: row after
//                 row, four FMA chains along K.
//   bf16_widen:   out [N, K] float32 = w [N, K], for larger batches on a CPU without native bf16,
//                 whose matmul then runs in float32 (compute-bound there, so the copy costs little).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "cpu_vec.h"

#include "cpu_ops.h"


namespace {

using namespace kvserve_vec;
constexpr int64_t kMaxRows = 8;

// bf16 bits -> float32 (exact): c10's conversion, on the raw bits the vector loads also read
inline float widen(uint16_t b) { return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits())); }

#if defined(__AVX512F__)
inline vec widen_v(const uint16_t* p) {  // 16 bf16 -> fp32: zero-extend, shift into the high half
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#elif defined(KVSERVE_VEC)
inline vec widen_v(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

// Rows n0..n1 of y for M activation rows xf [M, K] (float32): each weight row is read once and
// multiplied into all M rows (M accumulators per vector of K).
template <int M>
void gemv_rows(const float* xf, const uint16_t* w, const uint16_t* bias, c10::BFloat16* y, int64_t N, int64_t K,
               int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wn = w + n * K;
    float sums[M];
    int64_t k = 0;
#if defined(KVSERVE_VEC)
    vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero_v();
    for (; k + kLanes <= K; k += kLanes) {
      const vec wf = widen_v(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = fma_v(wf, load_v(xf + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) sums[m] = sum_v(acc[m]);
#else
    for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
    for (int m = 0; m < M; ++m) {
      float s = sums[m];
      for (int64_t kk = k; kk < K; ++kk) s += widen(wn[kk]) * xf[m * K + kk];
      y[m * N + n] = c10::BFloat16(s + (bias ? widen(bias[n]) : 0.f));
    }
  }
}

// One activation row (float32 xf [K]), weight rows n0..n1 one after the other with four
// accumulators along K (kvserve_vec::row_by_row: the weights stream in order; four rows at a time
// with a prefetch of the next four read them slower).
void rows_m1(const float* xf, const uint16_t* w, const uint16_t* bias, c10::BFloat16* y, int64_t N, int64_t K,
             int64_t n0, int64_t n1) {
#if defined(KVSERVE_VEC)
  const int64_t kv = K - K % kLanes;
  row_by_row<4>(xf, w, K, n0, n1, [](const uint16_t* p) { return widen_v(p); }, [&](int64_t n, float s) {
    const uint16_t* wn = w + n * K;
    for (int64_t k = kv; k < K; ++k) s += widen(wn[k]) * xf[k];
    y[n] = c10::BFloat16(s + (bias ? widen(bias[n]) : 0.f));
  });
#else
  gemv_rows<1>(xf, w, bias, y, N, K, n0, n1);
#endif
}

#if defined(__AVX512BF16__)
// Native bf16 dot products (avx512_bf16's VDPBF16PS: 32 bf16 pairs multiplied exactly and added in
// pairs into 16 float32 lanes, denormals flushed): x stays bfloat16, so a vector step reads 32
// weights and 32 activations with one instruction per row, half the loads and none of the widening
// of the float32-math loops above. Rows n0..n1 for M rows of x (row stride sx elements); one row:
// four accumulators along K, the weights streaming in order as in row_by_row.
constexpr int64_t kPairLanes = 32;

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int M>
void dp_rows(const uint16_t* x, int64_t sx, const uint16_t* w, const uint16_t* bias, c10::BFloat16* y, int64_t N,
             int64_t K, int64_t n0, int64_t n1) {
  constexpr int kAcc = M == 1 ? 4 : 1;
  const int64_t kv = K - K % kPairLanes;
  const int64_t kb = K - K % (kPairLanes * kAcc);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wn = w + n * K;
    __m512 acc[M][kAcc];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < kAcc; ++i) acc[m][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < kb; k += kPairLanes * kAcc)
      for (int i = 0; i < kAcc; ++i) {
        const __m512bh wv = load_bh(wn + k + i * kPairLanes);
        for (int m = 0; m < M; ++m)
          acc[m][i] = _mm512_dpbf16_ps(acc[m][i], wv, load_bh(x + m * sx + k + i * kPairLanes));
      }
    for (; k < kv; k += kPairLanes) {
      const __m512bh wv = load_bh(wn + k);
      for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load_bh(x + m * sx + k));
    }
    for (int m = 0; m < M; ++m) {
      for (int half = kAcc / 2; half > 0; half /= 2)
        for (int i = 0; i < half; ++i) acc[m][i] = _mm512_add_ps(acc[m][i], acc[m][i + half]);
      float s = _mm512_reduce_add_ps(acc[m][0]);
      for (int64_t kk = kv; kk < K; ++kk) s += widen(wn[kk]) * widen(x[m * sx + kk]);
      y[m * N + n] = c10::BFloat16(s + (bias ? widen(bias[n]) : 0.f));
    }
  }
}
#endif

}  // namespace

namespace kvserve_ops {

void bf16_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "bf16_gemv (cpu): bfloat16 x [M, K] with contiguous rows expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "bf16_gemv (cpu): contiguous bfloat16 weight [N, K] expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= kMaxRows, "bf16_gemv (cpu): at most ", kMaxRows, " rows");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous() && y.size(0) == M && y.size(1) == N,
              "bf16_gemv (cpu): bfloat16 y [M, N] expected");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N),
              "bf16_gemv (cpu): bfloat16 bias [N] expected");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
#if defined(__AVX512BF16__)
  const int64_t sx = x.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    by_rows(M, [&](auto m) { dp_rows<decltype(m)::value>(xp, sx, wp, bp, yp, N, K, n0, n1); });
  });
#else
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = widen(xp[m * x.stride(0) + k]);
  const float* xq = xf.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    by_rows(M, [&](auto m) {
      if constexpr (decltype(m)::value == 1) rows_m1(xq, wp, bp, yp, N, K, n0, n1);
      else gemv_rows<decltype(m)::value>(xq, wp, bp, yp, N, K, n0, n1);
    });
  });
#endif
}

// The most rows engine.layers.linear (and the C++ decode loop) gives bf16_gemv: kMaxRows, with or
// without native bf16. Without it oneDNN refuses bf16. With avx512_bf16, on a 2-core Zen 4 EPYC,
// SmolLM2 decoding 64 tokens for 5, 6 and 8 requests took 1.41, 1.60 and 1.98 s with the GEMV (and so
// the C++ layer loop) against 1.97, 2.03 and 2.45 s when the limit was 4 and those steps ran op by op
// on oneDNN's native bf16 matmul; op by op on both sides (KVSERVE_CPU_DECODE_LAYERS=0), 6 and 8
// requests took 1.84 and 2.28 s with the GEMV against 2.05 and 2.45 on oneDNN (one-off probes, three
// interleaved repeats, medians). oneDNN alone is faster on these shapes from 4 rows when the weights
// sit in cache (benchmarks/cpu_linear.py); a decode step reads them from memory.
int64_t bf16_gemv_rows() { return kMaxRows; }

void bf16_widen(const at::Tensor& w, at::Tensor& out) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.is_contiguous() && out.sizes() == w.sizes(),
              "bf16_widen (cpu): bfloat16 w and float32 out of one shape expected");
  const int64_t n = w.numel();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
#pragma omp simd
    for (int64_t i = a; i < b; ++i) op[i] = widen(wp[i]);
  });
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("bf16_gemv(Tensor x, Tensor w, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("bf16_widen(Tensor w, Tensor(a!) out) -> ()");
  m.def("bf16_gemv_rows() -> int", &kvserve_ops::bf16_gemv_rows);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("bf16_gemv", &kvserve_ops::bf16_gemv);
  m.impl("bf16_widen", &kvserve_ops::bf16_widen);
}
