// 4-bit weights, float32 activations and accumulation on CPU (W4A16 checkpoints: GPTQ, AWQ,
// compressed-tensors pack-quantized), in the layout engine/layers/w4a16.py packs them into:
//
//   qweight uint8 [N, K/2]: per output row, K in blocks of 32 values held in 16 bytes, byte b of a
//                           block carrying value b in its low nibble and value 16 + b in its high one
//                           (so one 16-byte load widens into 32 consecutive values without shuffles);
//   scales  float32 [N, G]: one scale per row and group of `group_size` values (a multiple of 32);
//   szeros  float32 [N, G]: scale * zero point, so w[n, k] = q[n, k] * scale[n, g] - szeros[n, g].
//
//   w4a16_gemv:    y [M, N] = x [M, K] @ w^T (+ bias), for M <= kMaxRows. Decode-sized batches are bound
//                  by reading the weights, an eighth of float32's bytes here: each row is read once and its
//                  nibbles widened inside the inner loop, never stored wide. Per group the products
//                  q * x accumulate unscaled, then scale once: y = sum_g s_g (sum_k q_k x_k) - sum_g sz_g X_g,
//                  with X_g the group's sum of x (computed once per call).
//   w4a16_dequant: out [N, K] float32 = w, for larger batches, whose matmul then runs in oneDNN on the
//                  float32 copy (compute-bound there, so the copy costs little), as the int8 path does.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kBlock = 32;  // values per 16-byte block of a packed row

#if defined(__AVX512F__)
// One block: 16 bytes -> the 32 values as float32, low nibbles first (values 0-15), then high (16-31).
struct Block {
  __m512 v[2];
};
inline Block widen_block(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return {{_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))}};
}
constexpr int kVecs = 2;  // vectors per block
using vec = __m512;
inline vec load_v(const float* p) { return _mm512_loadu_ps(p); }
inline vec fma_v(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec add_v(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec zero_v() { return _mm512_setzero_ps(); }
inline vec set1_v(float s) { return _mm512_set1_ps(s); }
inline float sum_v(vec a) { return _mm512_reduce_add_ps(a); }
constexpr int kLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
struct Block {
  __m256 v[4];
};
inline Block widen_block(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return {{_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))}};
}
constexpr int kVecs = 4;
using vec = __m256;
inline vec load_v(const float* p) { return _mm256_loadu_ps(p); }
inline vec fma_v(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec add_v(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec zero_v() { return _mm256_setzero_ps(); }
inline vec set1_v(float s) { return _mm256_set1_ps(s); }
inline float sum_v(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
constexpr int kLanes = 8;
#else
constexpr int kLanes = 0;  // no vector path: the scalar loop below
#endif

// The value at position k (0..31) of a packed block.
inline float nibble(const uint8_t* block, int k) {
  return static_cast<float>(k < 16 ? (block[k] & 0x0F) : (block[k - 16] >> 4));
}

// Rows n0..n1 of y for M activation rows x [M, K] (row stride ldx); xsum [M, G] holds each group's
// sum of x.
template <int M>
void gemv_rows(const float* x, int64_t ldx, const uint8_t* w, const float* scales, const float* szeros,
               const float* xsum, const float* bias, float* y, int64_t N, int64_t K, int64_t gs, int64_t n0,
               int64_t n1) {
  const int64_t G = K / gs, blocks_per_group = gs / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * (K / 2);
    const float* sn = scales + n * G;
    float sums[M];
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    // Independent accumulator chains: one per vector of a block for a single row (else each FMA
    // waits for the last, latency-bound), one per row for several rows (the rows are the chains).
    constexpr int V = M == 1 ? kVecs : 1;
    vec acc[M][V];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = zero_v();
    for (int64_t g = 0; g < G; ++g) {
      vec part[M][V];
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < V; ++v) part[m][v] = zero_v();
      for (int64_t b = 0; b < blocks_per_group; ++b) {
        const int64_t k = (g * blocks_per_group + b) * kBlock;
        const Block wb = widen_block(wn + k / 2);
        for (int m = 0; m < M; ++m)
          for (int v = 0; v < kVecs; ++v)
            part[m][v % V] = fma_v(wb.v[v], load_v(x + m * ldx + k + v * kLanes), part[m][v % V]);
      }
      const vec s = set1_v(sn[g]);
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = fma_v(part[m][v], s, acc[m][v]);
    }
    for (int m = 0; m < M; ++m) {
      vec t = acc[m][0];
      for (int v = 1; v < V; ++v) t = add_v(t, acc[m][v]);
      sums[m] = sum_v(t);
    }
#else
    for (int m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float part = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k)
          part += nibble(wn + (k / kBlock) * (kBlock / 2), static_cast<int>(k % kBlock)) * x[m * ldx + k];
        total += part * sn[g];
      }
      sums[m] = total;
    }
#endif
    const float* zn = szeros + n * G;
    for (int m = 0; m < M; ++m) {
      float z = 0.f;  // the zero points' term, a dot product of length G (vectorised, in any order)
      const float* xs = xsum + m * G;
#pragma omp simd reduction(+ : z)
      for (int64_t g = 0; g < G; ++g) z += zn[g] * xs[g];
      y[m * N + n] = sums[m] - z + (bias ? bias[n] : 0.f);
    }
  }
}

void check(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& szeros, int64_t gs) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "w4a16 (cpu): contiguous uint8 qweight [N, K/2] expected");
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(gs > 0 && gs % kBlock == 0 && K % gs == 0, "w4a16 (cpu): group size ", gs,
              " must be a multiple of 32 dividing K = ", K);
  const int64_t G = K / gs;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == G,
              "w4a16 (cpu): float32 scales [N, K / group_size] expected");
  TORCH_CHECK(szeros.scalar_type() == at::kFloat && szeros.is_contiguous() && szeros.sizes() == scales.sizes(),
              "w4a16 (cpu): float32 szeros of the scales' shape expected");
}

void w4a16_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& szeros,
                int64_t gs, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  check(w, scales, szeros, gs);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == w.size(1) * 2,
              "w4a16_gemv (cpu): float32 x [M, K] with contiguous rows expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / gs;
  TORCH_CHECK(M <= kMaxRows, "w4a16_gemv (cpu): at most ", kMaxRows, " rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == M && y.size(1) == N,
              "w4a16_gemv (cpu): float32 y [M, N] expected");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "w4a16_gemv (cpu): float32 bias [N] expected");
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += xp[m * ldx + k];
      xsum[m * G + g] = s;
    }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = szeros.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* xs = xsum.data();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: gemv_rows<1>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 2: gemv_rows<2>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 3: gemv_rows<3>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 4: gemv_rows<4>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 5: gemv_rows<5>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 6: gemv_rows<6>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 7: gemv_rows<7>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      case 8: gemv_rows<8>(xp, ldx, wp, sp, zp, xs, bp, yp, N, K, gs, n0, n1); break;
      default: break;  // M == 0
    }
  });
}

void w4a16_dequant(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& szeros, int64_t gs,
                   at::Tensor& out) {
  check(w, scales, szeros, gs);
  const int64_t N = w.size(0), K = w.size(1) * 2, G = K / gs;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                  out.size(1) == K,
              "w4a16_dequant (cpu): float32 out [N, K] expected");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = szeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wn = wp + n * (K / 2);
      float* on = op + n * K;
      for (int64_t blk = 0; blk < K / kBlock; ++blk) {
        const int64_t g = blk * kBlock / gs;
        const float s = sp[n * G + g], z = zp[n * G + g];
        const uint8_t* b = wn + blk * (kBlock / 2);
        float* o = on + blk * kBlock;
#pragma omp simd
        for (int i = 0; i < 16; ++i) {
          o[i] = static_cast<float>(b[i] & 0x0F) * s - z;
          o[16 + i] = static_cast<float>(b[i] >> 4) * s - z;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("w4a16_gemv(Tensor x, Tensor w, Tensor scales, Tensor szeros, int group_size, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("w4a16_dequant(Tensor w, Tensor scales, Tensor szeros, int group_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("w4a16_gemv", &w4a16_gemv);
  m.impl("w4a16_dequant", &w4a16_dequant);
}
