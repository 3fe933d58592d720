// float32 linear layers for decode-sized batches on CPU: y [M, N] = x [M, K] @ w [N, K]^T (+ bias),
// M <= 8, float32 throughout.
//
// A batch-1 decode step reads every weight once and is bound by memory. oneDNN's matmul on the
// prepacked weight reached 11-21 GB/s on SmolLM2's layer shapes streamed from memory on a 2-core
// EPYC (benchmarks/batch1.py's machine; read bandwidth ~28 GB/s): its blocked layout is for
// 64-row batches. This GEMV streams each weight row once, contiguous, for all M activation rows
// (held in L1): for M == 1 one row after the other with four accumulators along K (independent FMA
// chains; the weights stream in order), one row and M accumulators otherwise; AVX-512 or AVX2 + FMA,
// picked at build from the CPU's flags, a scalar loop for the tail of K. Rows are split over the
// threads in chunks of 64.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"

#include "cpu_ops.h"

namespace {

using namespace kvserve_vec;
constexpr int64_t kMaxRows = 8;

// One activation row, weight rows n0..n1 (kvserve_vec::row_by_row, four accumulators).
void rows_m1(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t n0, int64_t n1) {
#if defined(KVSERVE_VEC)
  const int64_t kv = K - K % kLanes;
  row_by_row<4>(x, w, K, n0, n1, [](const float* p) { return load_v(p); }, [&](int64_t n, float s) {
    const float* wn = w + n * K;
    for (int64_t k = kv; k < K; ++k) s += wn[k] * x[k];
    y[n] = s + (bias ? bias[n] : 0.f);
  });
#else
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += wn[k] * x[k];
    y[n] = s + (bias ? bias[n] : 0.f);
  }
#endif
}

// M activation rows (ldx apart), weight rows n0..n1 one at a time, M accumulators.
template <int M>
void rows_m(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t N, int64_t K,
            int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    float sums[M];
    int64_t k = 0;
#if defined(KVSERVE_VEC)
    vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero_v();
    for (; k + kLanes <= K; k += kLanes) {
      const vec wv = load_v(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = fma_v(wv, load_v(x + m * ldx + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) sums[m] = sum_v(acc[m]);
#else
    for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
    for (int m = 0; m < M; ++m) {
      float s = sums[m];
      for (int64_t kk = k; kk < K; ++kk) s += wn[kk] * x[m * ldx + kk];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
  }
}

}  // namespace

namespace kvserve_ops {

void f32_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "f32_gemv (cpu): float32 x [M, K] with contiguous rows expected");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "f32_gemv (cpu): contiguous float32 weight [N, K] expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= kMaxRows, "f32_gemv (cpu): at most ", kMaxRows, " rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == M && y.size(1) == N,
              "f32_gemv (cpu): float32 y [M, N] expected");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "f32_gemv (cpu): float32 bias [N] expected");
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    by_rows(M, [&](auto m) {
      if constexpr (decltype(m)::value == 1) rows_m1(xp, wp, bp, yp, K, n0, n1);
      else rows_m<decltype(m)::value>(xp, ldx, wp, bp, yp, N, K, n0, n1);
    });
  });
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("f32_gemv(Tensor x, Tensor w, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("f32_gemv", &kvserve_ops::f32_gemv);
}
