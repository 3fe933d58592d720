// Fused element-wise ops of the decoder layer on CPU (float32): each replaces 3-8 ATen ops (and
// as many passes over memory and thread-pool barriers) with one pass over the rows.
//
//   rms_norm:       out = x * rsqrt(mean(x^2) + eps) * (weight + offset)     (Zhang & Sennrich 2019)
//   add_rms_norm:   residual += x (in place); out = rms_norm(residual)        (pre-norm decoder's add)
//   rotary:         q, k rotated in place, "rotate half" layout              (Su et al. 2021, sec. 3.4)
//   silu_and_mul:   out = silu(x[:, :I]) * x[:, I:]                          (SwiGLU, Shazeer 2020)
//
// Rows are spread over ATen's thread pool only when a call has more than kParallelElems
// elements: a decode step's [64, 576] tensors run on the calling thread, so the step's thread
// pool synchronises only in matmuls and attention (a barrier is where a core taken by another
// process stalls the whole team).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kParallelElems = 1 << 17;

template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, row_elems));
  if (rows <= grain) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, grain, f);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": float32 expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a [rows, n] tensor with contiguous rows expected");
}

inline void norm_row(const float* x, const float* w, float* o, int64_t n, float eps, float offset) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = (w[j] + offset) * (x[j] * r);
}

// x [N, H] -> out [N, H]
void rms_norm(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps, double offset) {
  check_rows(x, "rms_norm x");
  check_rows(out, "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight [H] expected");
  const int64_t n = x.size(1);
  const float* w = weight.data_ptr<float>();
  for_rows(x.size(0), n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      norm_row(x.data_ptr<float>() + i * x.stride(0), w, out.data_ptr<float>() + i * out.stride(0), n,
               static_cast<float>(eps), static_cast<float>(offset));
  });
}

// residual [N, H] += x [N, H]; out [N, H] = rms_norm(residual)
void add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
                  double eps, double offset) {
  check_rows(x, "add_rms_norm x");
  check_rows(residual, "add_rms_norm residual");
  check_rows(out, "add_rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight [H] expected");
  const int64_t n = x.size(1);
  const float* w = weight.data_ptr<float>();
  for_rows(x.size(0), n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* xi = x.data_ptr<float>() + i * x.stride(0);
      float* ri = residual.data_ptr<float>() + i * residual.stride(0);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) ri[j] += xi[j];
      norm_row(ri, w, out.data_ptr<float>() + i * out.stride(0), n, static_cast<float>(eps),
               static_cast<float>(offset));
    }
  });
}

// q [N, Hq, D], k [N, Hk, D] (rows may be strided, heads and dims contiguous) rotated in place
// at positions [N] with cos/sin caches [max_position, D].
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "rotary: float32 [N, heads, D] with contiguous heads expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary: int64 positions expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat,
              "rotary: float32 contiguous cos/sin expected");
  const int64_t D = q.size(2), half = D / 2, N = q.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t heads = q.size(1) + k.size(1);
  for_rows(N, heads * D, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = cp + pos[i] * D;
      const float* s = sp + pos[i] * D;
      for (at::Tensor* t : {&q, &k}) {
        float* base = t->data_ptr<float>() + i * t->stride(0);
        for (int64_t h = 0; h < t->size(1); ++h) {
          float* x = base + h * D;
#pragma omp simd
          for (int64_t j = 0; j < half; ++j) {
            const float a = x[j], bb = x[j + half];
            x[j] = a * c[j] - bb * s[j];
            x[j + half] = bb * c[j + half] + a * s[j + half];
          }
        }
      }
    }
  });
}

// x [N, 2I] -> out [N, I]
void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, "silu_and_mul x");
  check_rows(out, "silu_and_mul out");
  const int64_t I = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * I && x.size(0) == out.size(0), "silu_and_mul: x [N, 2I], out [N, I] expected");
  for_rows(x.size(0), 2 * I, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = x.data_ptr<float>() + i * x.stride(0);
      const float* u = g + I;
      float* o = out.data_ptr<float>() + i * out.stride(0);
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, Tensor(a!) out, float eps, float offset) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, Tensor(b!) out, float eps, float offset) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
