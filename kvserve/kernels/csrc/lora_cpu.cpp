// Batched multi-LoRA on CPU (float32): the decode rows of a step, each with its own adapter, in one
// call per adapted layer (Punica's SGMV, Chen et al. 2023, sec. 4, for a CPU: segments of rows
// that share an adapter, shrink then expand, the adapter's A and B read once per segment).
//
//   lora_sgmv: for each group g (rows order[starts[g]:starts[g+1]], adapter slot slots[g]):
//                h = a[slot] @ x[row]                         ([in] -> [parts * rank])
//                y[row, off_p:off_p+n_p] += h[p*rank:(p+1)*rank] @ b_t[p][slot]   for each part p
//
// a [slots, parts * rank, in] stacks every part's A (one shrink for all parts), b_t[p]
// [slots, rank, n_p]. Rows of a group go 8 at a time: each A row (a dot product with each of the
// 8 x rows, held in L1) and each B row (added, scaled, into the 8 y rows) is loaded once per
// block, and the inner loops run over contiguous floats and vectorise. Groups
// are spread over ATen's thread pool; they write disjoint rows of y. A step of decode rows costs
// one call per layer instead of ~10 small ATen ops, whose fixed per-call cost dominated a decode
// step with many adapters (benchmarks/lora.py measures multi-adapter throughput).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 8;
constexpr int64_t kKB = 64;  // output columns per expand block (8 AVX2 / 4 AVX-512 registers)

void lora_sgmv(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, at::TensorList b_t,
               const at::Tensor& order, const at::Tensor& starts, const at::Tensor& slots) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat,
              "lora_sgmv: float32 tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1,
              "lora_sgmv: x and y must be [rows, n] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1), "lora_sgmv: a [slots, PR, in]");
  const int64_t in = x.size(1), pr = a.size(1), parts = static_cast<int64_t>(b_t.size());
  TORCH_CHECK(parts >= 1 && pr % parts == 0, "lora_sgmv: a's second dim must be parts * rank");
  const int64_t rank = pr / parts;
  std::vector<const float*> bp(parts);
  std::vector<int64_t> width(parts), offset(parts);
  int64_t off = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const auto& b = b_t[p];
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 3 && b.is_contiguous() && b.size(1) == rank &&
                    b.size(0) == a.size(0), "lora_sgmv: b_t[p] [slots, rank, n_p] float32 contiguous");
    bp[p] = b.data_ptr<float>();
    width[p] = b.size(2);
    offset[p] = off;
    off += width[p];
  }
  TORCH_CHECK(off == y.size(1), "lora_sgmv: the parts' widths must add up to y's columns");
  TORCH_CHECK(order.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "lora_sgmv: int64 index tensors expected");
  const int64_t groups = slots.numel();
  TORCH_CHECK(starts.numel() == groups + 1, "lora_sgmv: starts must have one more entry than slots");
  const int64_t* op = order.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(slp[g] >= 0 && slp[g] < a.size(0) && sp[g] <= sp[g + 1], "lora_sgmv: bad group ", g);
  for (int64_t i = 0; i < sp[groups]; ++i)
    TORCH_CHECK(op[i] >= 0 && op[i] < x.size(0) && op[i] < y.size(0), "lora_sgmv: row out of range");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);

  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> h(kRowBlock * pr);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t slot = slp[g];
      const float* a = ap + slot * in * pr;
      for (int64_t r0 = sp[g]; r0 < sp[g + 1]; r0 += kRowBlock) {
        const int64_t nr = std::min(kRowBlock, sp[g + 1] - r0);
        const float* xr[kRowBlock];
        float* yr[kRowBlock];
        for (int64_t r = 0; r < nr; ++r) {
          xr[r] = xp + op[r0 + r] * ldx;
          yr[r] = yp + op[r0 + r] * ldy;
        }
        for (int64_t j = 0; j < pr; ++j) {  // shrink: h[r][j] = A[j] . x[r]
          const float* aj = a + j * in;
          int64_t r = 0;
          for (; r + 4 <= nr; r += 4) {  // four rows at once: four independent sums per A load
            const float *x0 = xr[r], *x1 = xr[r + 1], *x2 = xr[r + 2], *x3 = xr[r + 3];
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < in; ++i) {
              const float av = aj[i];
              s0 += av * x0[i];
              s1 += av * x1[i];
              s2 += av * x2[i];
              s3 += av * x3[i];
            }
            h[r * pr + j] = s0;
            h[(r + 1) * pr + j] = s1;
            h[(r + 2) * pr + j] = s2;
            h[(r + 3) * pr + j] = s3;
          }
          for (; r < nr; ++r) {
            const float* x0 = xr[r];
            float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
            for (int64_t i = 0; i < in; ++i) s0 += aj[i] * x0[i];
            h[r * pr + j] = s0;
          }
        }
        for (int64_t p = 0; p < parts; ++p) {  // expand: y[r, part] += h[r, part] @ B_p
          const int64_t n = width[p];
          const float* b = bp[p] + slot * rank * n;
          // kKB columns at a time: the block's accumulator stays in registers over the rank
          // loop, so each y element is read and written once (not once per rank)
          for (int64_t k0 = 0; k0 < n; k0 += kKB) {
            const int64_t kn = std::min(kKB, n - k0);
            for (int64_t r = 0; r < nr; ++r) {
              const float* hr = h.data() + r * pr + p * rank;
              float* yo = yr[r] + offset[p] + k0;
              float acc[kKB];
              if (kn == kKB) {
#pragma omp simd
                for (int64_t k = 0; k < kKB; ++k) acc[k] = yo[k];
                for (int64_t j = 0; j < rank; ++j) {
                  const float hv = hr[j];
                  const float* bj = b + j * n + k0;
#pragma omp simd
                  for (int64_t k = 0; k < kKB; ++k) acc[k] += hv * bj[k];
                }
#pragma omp simd
                for (int64_t k = 0; k < kKB; ++k) yo[k] = acc[k];
              } else {
                for (int64_t j = 0; j < rank; ++j) {
                  const float hv = hr[j];
                  const float* bj = b + j * n + k0;
#pragma omp simd
                  for (int64_t k = 0; k < kn; ++k) yo[k] += hv * bj[k];
                }
              }
            }
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("lora_sgmv(Tensor x, Tensor(a!) y, Tensor a, Tensor[] b_t, Tensor order, Tensor starts, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("lora_sgmv", &lora_sgmv);
}
