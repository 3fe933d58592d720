// Fused element-wise ops of the decoder layer on CPU (float32 or bfloat16 tensors, float32 math):
// each replaces 3-8 ATen ops (and as many passes over memory and thread-pool barriers) with one
// pass over the rows. bfloat16 outputs are rounded once, from the float32 result.
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

#include "cpu_math.h"

#include "cpu_ops.h"

namespace {

using kvserve::from_float;
using kvserve::to_float;

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

// Runs f.template operator()<T>() with T = float or c10::BFloat16 for t's dtype.
template <typename F>
void dispatch(const at::Tensor& t, const char* name, const F& f) {
  if (t.scalar_type() == at::kFloat) f(float{});
  else if (t.scalar_type() == at::kBFloat16) f(c10::BFloat16{});
  else TORCH_CHECK(false, name, ": float32 or bfloat16 expected, got ", t.scalar_type());
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, ": every tensor must have the same dtype");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a [rows, n] tensor with contiguous rows expected");
}

template <typename T>
inline void norm_row(const T* x, const T* w, T* o, int64_t n, float eps, float offset) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += to_float(x[j]) * to_float(x[j]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = from_float<T>((to_float(w[j]) + offset) * (to_float(x[j]) * r));
}

}  // namespace

namespace kvserve_ops {

// x [N, H] -> out [N, H]
void rms_norm(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps, double offset) {
  check_rows(x, x, "rms_norm x");
  check_rows(out, x, "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight [H] of x's dtype expected");
  const int64_t n = x.size(1);
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.data_ptr<T>();
    for_rows(x.size(0), n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        norm_row(x.data_ptr<T>() + i * x.stride(0), w, out.data_ptr<T>() + i * out.stride(0), n,
                 static_cast<float>(eps), static_cast<float>(offset));
    });
  });
}

// residual [N, H] += x [N, H]; out [N, H] = rms_norm(residual)
void add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
                  double eps, double offset) {
  check_rows(x, x, "add_rms_norm x");
  check_rows(residual, x, "add_rms_norm residual");
  check_rows(out, x, "add_rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight [H] of x's dtype expected");
  const int64_t n = x.size(1);
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.data_ptr<T>();
    for_rows(x.size(0), n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* xi = x.data_ptr<T>() + i * x.stride(0);
        T* ri = residual.data_ptr<T>() + i * residual.stride(0);
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) ri[j] = from_float<T>(to_float(ri[j]) + to_float(xi[j]));
        norm_row(ri, w, out.data_ptr<T>() + i * out.stride(0), n, static_cast<float>(eps),
                 static_cast<float>(offset));
      }
    });
  });
}

// q [N, Hq, D], k [N, Hk, D] (rows may be strided, heads and dims contiguous) rotated in place
// at positions [N] with cos/sin caches [max_position, D].
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k})
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "rotary: q and k [N, heads, D] of one dtype with contiguous heads expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary: int64 positions expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat,
              "rotary: float32 contiguous cos/sin expected");
  const int64_t D = q.size(2), half = D / 2, N = q.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t heads = q.size(1) + k.size(1);
  dispatch(q, "rotary", [&](auto tag) {
    using T = decltype(tag);
    for_rows(N, heads * D, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* c = cp + pos[i] * D;
        const float* s = sp + pos[i] * D;
        for (at::Tensor* t : {&q, &k}) {
          T* base = t->data_ptr<T>() + i * t->stride(0);
          for (int64_t h = 0; h < t->size(1); ++h) {
            T* x = base + h * D;
#pragma omp simd
            for (int64_t j = 0; j < half; ++j) {
              const float a = to_float(x[j]), bb = to_float(x[j + half]);
              x[j] = from_float<T>(a * c[j] - bb * s[j]);
              x[j + half] = from_float<T>(bb * c[j + half] + a * s[j + half]);
            }
          }
        }
      }
    });
  });
}

// x [N, 2I] -> out [N, I]
void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, x, "silu_and_mul x");
  check_rows(out, x, "silu_and_mul out");
  const int64_t I = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * I && x.size(0) == out.size(0), "silu_and_mul: x [N, 2I], out [N, I] expected");
  dispatch(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    for_rows(x.size(0), 2 * I, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* g = x.data_ptr<T>() + i * x.stride(0);
        const T* u = g + I;
        T* o = out.data_ptr<T>() + i * out.stride(0);
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) o[j] = from_float<T>(kvserve::silu(to_float(g[j])) * to_float(u[j]));
      }
    });
  });
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, Tensor(a!) out, float eps, float offset) -> ()");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, Tensor(b!) out, float eps, float offset) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("rms_norm", &kvserve_ops::rms_norm);
  m.impl("add_rms_norm", &kvserve_ops::add_rms_norm);
  m.impl("rotary", &kvserve_ops::rotary);
  m.impl("silu_and_mul", &kvserve_ops::silu_and_mul);
}
