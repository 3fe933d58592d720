// Paged attention on CPU that reads K/V in place through the block tables (no gather copy).
//
// FlashAttention-style online softmax (Dao et al. 2022, alg. 1; Milakov & Gimelshein 2018) over
// one KV block at a time: per block the scores of every query that shares the KV head, one
// max-rescale of the running output, then the weighted V rows. Work items are (request, KV head)
// pairs spread over ATen's intra-op thread pool; the query heads of a KV head (GQA) and the
// query rows of a short chunk share each K/V row read. Built by kernels/cpu_backend.py with
// torch.utils.cpp_extension (-O3 -march=native); the layout contract is kernels/backend.py's.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_math.h"

#include "cpu_ops.h"

namespace {

constexpr int64_t kMaxBlock = 256;  // largest block_size the per-block score buffer holds
constexpr int64_t kMaxHeadDim = 512;  // largest head_dim a bfloat16 or float8 cache's row buffer holds

using kvserve::exp_nonpos;

// float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no inf, 0x7f/0xff NaN)
// to float: a 256-entry table built once.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
      float x;
      if (exp == 15 && man == 7) x = std::numeric_limits<float>::quiet_NaN();
      else if (exp == 0) x = std::ldexp(static_cast<float>(man) / 8.f, -6);
      else x = std::ldexp(1.f + static_cast<float>(man) / 8.f, exp - 7);
      v[b] = sign ? -x : x;
    }
  }
};
const Fp8Table kFp8;

// One (request, KV head) work item for a compile-time head_dim D (0: runtime `dim`) over a cache
// of CacheT: float, c10::BFloat16 (widened into a row buffer), or uint8_t holding float8 e4m3fn
// values (dequantized as value * k_scale / v_scale into a row buffer before use). Queries and
// outputs are QT (float or c10::BFloat16); scores, softmax and accumulation are float32.
template <int64_t D, typename CacheT = float, typename QT = float>
struct Item {
  int64_t dim;
  float ks = 1.f, vs = 1.f;
  int64_t hd() const { return D > 0 ? D : dim; }
  const CacheT* cache_type_tag() const { return nullptr; }
  const QT* q_type_tag() const { return nullptr; }

  // row of the cache as floats: the row itself for a float cache, else dequantized into buf
  const float* row(const CacheT* r, float scale, float* buf) const {
    if constexpr (std::is_same_v<CacheT, float>) {
      return r;
    } else if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
      const int64_t d_ = hd();
#pragma omp simd
      for (int64_t d = 0; d < d_; ++d) buf[d] = static_cast<float>(r[d]);
      return buf;
    } else {
      const int64_t d_ = hd();
      for (int64_t d = 0; d < d_; ++d) buf[d] = kFp8.v[r[d]] * scale;
      return buf;
    }
  }

  // scores s[i * BS + (j - a)] for queries i of keys j in [j0, j1) of one block, then per query
  // the online-softmax update of (m, l, acc) with that block's keys.
  void run(const QT* qp, const CacheT* kp, const CacheT* vp, QT* op, const int32_t* table,
           int64_t q0, int64_t qlen, int64_t slen, int64_t h, int64_t H, int64_t G, int64_t Hkv,
           int64_t BS, float scale, float cap, int64_t window, std::vector<float>& m,
           std::vector<float>& l, std::vector<float>& acc, std::vector<float>& s, std::vector<float>& qs,
           std::vector<int64_t>& lo_q, std::vector<int64_t>& hi_q) const {
    const int64_t d_ = hd(), nq = qlen * G, ctx = slen - qlen;
    const float ninf = -std::numeric_limits<float>::infinity();
    m.assign(nq, ninf);
    l.assign(nq, 0.f);
    acc.assign(nq * d_, 0.f);
    s.resize(nq * BS);
    lo_q.resize(nq);
    hi_q.resize(nq);
    qs.resize(nq * d_);
    for (int64_t i = 0; i < nq; ++i) {  // query i = (row t = i / G, head g = i % G)
      const int64_t p = ctx + i / G;    // it sees keys lo..p
      hi_q[i] = p;
      lo_q[i] = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      const QT* src = qp + ((q0 + i / G) * H + h * G + i % G) * d_;
      for (int64_t d = 0; d < d_; ++d) qs[i * d_ + d] = kvserve::to_float(src[d]);
    }
    const int64_t first = lo_q[0], last = slen - 1;  // keys any query of the item sees
    float rowbuf[kMaxHeadDim];
    for (int64_t b = first / BS; b <= last / BS; ++b) {
      const int64_t j0 = std::max(first, b * BS), j1 = std::min(last + 1, (b + 1) * BS);
      const CacheT* kb = kp + (static_cast<int64_t>(table[b]) * BS * Hkv + h) * d_;
      const CacheT* vb = vp + (static_cast<int64_t>(table[b]) * BS * Hkv + h) * d_;
      // scores: each key row is read once for all nq queries
      for (int64_t j = j0; j < j1; ++j) {
        const float* kj = row(kb + (j - b * BS) * Hkv * d_, ks, rowbuf);
        for (int64_t i = 0; i < nq; ++i) {
          const float* qi = qs.data() + i * d_;
          float x = 0.f;
#pragma omp simd reduction(+ : x)
          for (int64_t d = 0; d < d_; ++d) x += qi[d] * kj[d];
          x *= scale;
          if (cap > 0.f) x = cap * std::tanh(x / cap);
          s[i * BS + (j - j0)] = (j >= lo_q[i] && j <= hi_q[i]) ? x : ninf;
        }
      }
      const int64_t n = j1 - j0;
      for (int64_t i = 0; i < nq; ++i) {
        float* si = s.data() + i * BS;
        float mb = ninf;
        for (int64_t j = 0; j < n; ++j) mb = std::max(mb, si[j]);
        if (mb == ninf) {  // no key of this block is visible to query i
          std::fill(si, si + n, 0.f);
          continue;
        }
        const float mn = std::max(m[i], mb);
        float* o = acc.data() + i * d_;
        if (m[i] != ninf && mn > m[i]) {
          const float alpha = exp_nonpos(m[i] - mn);
          l[i] *= alpha;
#pragma omp simd
          for (int64_t d = 0; d < d_; ++d) o[d] *= alpha;
        }
        m[i] = mn;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          const float e = si[j] == ninf ? 0.f : exp_nonpos(si[j] - mn);
          si[j] = e;
          sum += e;
        }
        l[i] += sum;
      }
      // weighted V rows: each value row is read once for all nq queries
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = row(vb + (j0 - b * BS + j) * Hkv * d_, vs, rowbuf);
        for (int64_t i = 0; i < nq; ++i) {
          const float pj = s[i * BS + j];
          if (pj == 0.f) continue;
          float* o = acc.data() + i * d_;
#pragma omp simd
          for (int64_t d = 0; d < d_; ++d) o[d] += pj * vj[d];
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      QT* dst = op + ((q0 + i / G) * H + h * G + i % G) * d_;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      const float* o = acc.data() + i * d_;
#pragma omp simd
      for (int64_t d = 0; d < d_; ++d) dst[d] = kvserve::from_float<QT>(o[d] * inv);
    }
  }
};

}  // namespace

namespace kvserve_ops {

// q [T, H, D]; k_cache/v_cache [NB, BS, Hkv, D]; block_tables int32 [R, W]; seq_lens int32 [R];
// cu_seqlens_q int32 [R + 1]; reqs int64 [n]: the requests this call attends (their rows of
// `out` [T, H, D] are written, others are left alone). window 0 = none; softcap 0 = none.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& reqs, at::Tensor& out,
                     double scale, int64_t window, double softcap, double k_scale, double v_scale) {
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  const bool fp8 = ct == at::kFloat8_e4m3fn;
  TORCH_CHECK((qt == at::kFloat || qt == at::kBFloat16) && out.scalar_type() == qt &&
                  (ct == qt || fp8) && v_cache.scalar_type() == ct,
              "paged_attention (cpu): q and out float32 or bfloat16, caches of q's dtype or float8_e4m3fn expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention (cpu): contiguous tensors expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_seqlens_q.scalar_type() == at::kInt && reqs.scalar_type() == at::kLong,
              "paged_attention (cpu): int32 block_tables/seq_lens/cu_seqlens_q, int64 reqs expected");
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "paged_attention (cpu): shape mismatch");
  TORCH_CHECK(BS <= kMaxBlock, "paged_attention (cpu): block_size above ", kMaxBlock);
  TORCH_CHECK(ct == at::kFloat || D <= kMaxHeadDim, "paged_attention (cpu): head_dim above ", kMaxHeadDim,
              " with a bfloat16 or float8 cache");
  const int64_t G = H / Hkv, W = block_tables.size(1), n = reqs.numel();
  const void* qp = q.data_ptr();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  void* op = out.data_ptr();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int64_t* rq = reqs.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  auto body = [&](auto item) {
    using C = std::remove_cv_t<std::remove_pointer_t<decltype(item.cache_type_tag())>>;
    using Q = std::remove_cv_t<std::remove_pointer_t<decltype(item.q_type_tag())>>;
    at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> m, l, acc, s, qs;
      std::vector<int64_t> lo_q, hi_q;
      for (int64_t w = begin; w < end; ++w) {
        const int64_t r = rq[w / Hkv], h = w % Hkv;
        const int64_t q0 = cu[r], qlen = cu[r + 1] - q0;
        if (qlen <= 0) continue;
        item.run(static_cast<const Q*>(qp), static_cast<const C*>(kp), static_cast<const C*>(vp),
                 static_cast<Q*>(op), bt + r * W, q0, qlen, sl[r], h, H, G, Hkv, BS, fscale, cap,
                 window, m, l, acc, s, qs, lo_q, hi_q);
      }
    });
  };
  // head_dim 64, 128 and 256 get compile-time loops; any other runs the generic one
  auto by_dim = [&](auto c_tag, auto q_tag, float ks, float vs) {
    using C = decltype(c_tag);
    using Q = decltype(q_tag);
    if (D == 64) body(Item<64, C, Q>{64, ks, vs});
    else if (D == 128) body(Item<128, C, Q>{128, ks, vs});
    else if (D == 256) body(Item<256, C, Q>{256, ks, vs});
    else body(Item<0, C, Q>{D, ks, vs});
  };
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  if (qt == at::kFloat) {
    if (fp8) by_dim(uint8_t{}, float{}, ks, vs);
    else by_dim(float{}, float{}, 1.f, 1.f);
  } else {
    if (fp8) by_dim(uint8_t{}, c10::BFloat16{}, ks, vs);
    else by_dim(c10::BFloat16{}, c10::BFloat16{}, 1.f, 1.f);
  }
}

}  // namespace kvserve_ops

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor cu_seqlens_q, Tensor reqs, Tensor(a!) out, float scale, int window, float softcap, "
        "float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("paged_attention", &kvserve_ops::paged_attention); }
