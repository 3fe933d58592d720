// Paged attention on CPU that reads K/V in place through the block tables (no gather copy).
//
// FlashAttention-style online softmax (Dao et al. 2022, alg. 1; Milakov & Gimelshein 2018) over
// one KV block at a time: per block the scores of every query that shares the KV head, one
// max-rescale of the running output, then the weighted V rows. ATen's intra-op threads pull work
// units from one counter: a request when there are at least two requests per thread (each block
// read once, all its KV heads worked on before the next block, which is prefetched into L2 as one
// contiguous range meanwhile), else a (request, KV head) pair. The query heads of a KV head (GQA)
// and the query rows of a chunk share each K/V block read. A bfloat16 or float8 block's rows are
// widened to float32 once per block for all those queries. Scores go kLanes keys at a time: each key's
// products summed along head_dim in one vector, then the kLanes vectors reduced together
// (kvserve_vec::sum_lanes) instead of one horizontal sum per key; the weighted V rows accumulate
// in registers, four vectors of the output at a time, across the block's rows. Keys a query
// cannot see (later than its position, outside its window) get no score or V work when a whole
// block is hidden from it. Built by kernels/cpu_backend.py with torch.utils.cpp_extension
// (-O3 -march=native); the layout contract is kernels/backend.py's.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_math.h"
#include "cpu_vec.h"

#include "cpu_ops.h"

namespace {

constexpr int64_t kMaxBlock = 256;  // largest block_size the per-block score buffer holds

using kvserve::exp_nonpos;
using namespace kvserve_vec;

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

  // rows [0, n) of a cache block (row r at src + r * stride) as float32: the cache itself for a
  // float cache (*rs = stride), else widened or dequantized (value * scale) into buf (*rs = head_dim)
  const float* block_rows(const CacheT* src, int64_t n, int64_t stride, float scale, float* buf, int64_t* rs) const {
    const int64_t d_ = hd();
    if constexpr (std::is_same_v<CacheT, float>) {
      *rs = stride;
      return src;
    } else {
      *rs = d_;
      for (int64_t r = 0; r < n; ++r) {
        const CacheT* x = src + r * stride;
        float* o = buf + r * d_;
        if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
#pragma omp simd
          for (int64_t d = 0; d < d_; ++d) o[d] = static_cast<float>(x[d]);
        } else {
          for (int64_t d = 0; d < d_; ++d) o[d] = kFp8.v[x[d]] * scale;
        }
      }
      return buf;
    }
  }

  // out[j] = q . k_j for the n rows k_j = k + j * ks: kLanes keys at a time, each key's products
  // summed along head_dim in one vector, the kLanes vectors then reduced together (sum_lanes)
  void dots(const float* q, const float* k, int64_t ks, int64_t n, float* out) const {
    const int64_t d_ = hd();
#if defined(KVSERVE_VEC)
    if (d_ % kLanes == 0) {
      vec part[kLanes];
      float tail[kLanes];
      for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
        const int64_t w = std::min<int64_t>(kLanes, n - j0);
        for (int64_t t = 0; t < kLanes; ++t) {
          vec a = zero_v();
          if (t < w) {
            const float* kj = k + (j0 + t) * ks;
            for (int64_t d = 0; d < d_; d += kLanes) a = fma_v(load_v(q + d), load_v(kj + d), a);
          }
          part[t] = a;
        }
        if (w == kLanes) {
          sum_lanes(part, out + j0);
        } else {
          sum_lanes(part, tail);
          std::copy(tail, tail + w, out + j0);
        }
      }
      return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + j * ks;
      float x = 0.f;
#pragma omp simd reduction(+ : x)
      for (int64_t d = 0; d < d_; ++d) x += q[d] * kj[d];
      out[j] = x;
    }
  }

  // o[d] += sum_j p[j] * v_j[d] over the n rows v_j = v + j * vs: up to four vectors of o held
  // in registers across all n rows
  void weighted_rows(const float* p, const float* v, int64_t vs, int64_t n, float* o) const {
    const int64_t d_ = hd();
#if defined(KVSERVE_VEC)
    if (d_ % kLanes == 0) {
      for (int64_t d0 = 0; d0 < d_; d0 += 4 * kLanes) {
        const int64_t nv = std::min<int64_t>(4, (d_ - d0) / kLanes);
        vec a[4];
        for (int64_t u = 0; u < 4; ++u) a[u] = u < nv ? load_v(o + d0 + u * kLanes) : zero_v();
        if (nv == 4) {
          for (int64_t j = 0; j < n; ++j) {
            const vec pj = set1_v(p[j]);
            const float* vj = v + j * vs + d0;
            for (int64_t u = 0; u < 4; ++u) a[u] = fma_v(pj, load_v(vj + u * kLanes), a[u]);
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            const vec pj = set1_v(p[j]);
            const float* vj = v + j * vs + d0;
            for (int64_t u = 0; u < nv; ++u) a[u] = fma_v(pj, load_v(vj + u * kLanes), a[u]);
          }
        }
        for (int64_t u = 0; u < nv; ++u) store_v(o + d0 + u * kLanes, a[u]);
      }
      return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j];
      const float* vj = v + j * vs;
#pragma omp simd
      for (int64_t d = 0; d < d_; ++d) o[d] += pj * vj[d];
    }
  }

  // KV heads [h0, h0 + nh) of one request: block by block, for each of those heads in turn, the
  // scores s[i * BS + (j - j0)] of its queries i for the block's keys j in [j0, j1), their online-softmax
  // update of (m, l, acc), then the weighted V rows. Query i is (head h0 + i / nqh, row (i % nqh) / G,
  // query head (i % nqh) % G) with nqh = qlen * G. All heads of a block before the next block: while
  // they are worked on, the next block's rows (prefetched to L2) stream in.
  void run(const QT* qp, const CacheT* kp, const CacheT* vp, QT* op, const int32_t* table,
           int64_t q0, int64_t qlen, int64_t slen, int64_t h0, int64_t nh, int64_t H, int64_t G, int64_t Hkv,
           int64_t BS, float scale, float cap, int64_t window, std::vector<float>& m,
           std::vector<float>& l, std::vector<float>& acc, std::vector<float>& s, std::vector<float>& qs,
           std::vector<int64_t>& lo_q, std::vector<int64_t>& hi_q, std::vector<float>& kvbuf) const {
    const int64_t d_ = hd(), nqh = qlen * G, nq = nqh * nh, ctx = slen - qlen;
    const float ninf = -std::numeric_limits<float>::infinity();
    m.assign(nq, ninf);
    l.assign(nq, 0.f);
    acc.assign(nq * d_, 0.f);
    s.resize(nq * BS);
    lo_q.resize(nqh);
    hi_q.resize(nqh);
    qs.resize(nq * d_);
    if (!std::is_same_v<CacheT, float>) kvbuf.resize(2 * BS * d_);
    for (int64_t i = 0; i < nqh; ++i) {  // query row t = i / G sees keys lo..p
      const int64_t p = ctx + i / G;
      hi_q[i] = p;
      lo_q[i] = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t hh = h0 + i / nqh, r = i % nqh;
      const QT* src = qp + ((q0 + r / G) * H + hh * G + r % G) * d_;
      for (int64_t d = 0; d < d_; ++d) qs[i * d_ + d] = kvserve::to_float(src[d]);
    }
    const int64_t first = lo_q[0], last = slen - 1;  // keys any query of the item sees
    const int64_t stride = Hkv * d_;                 // elements between a block's rows of one head
    // bytes of a block row to prefetch: every head's (contiguous) for a whole request, else head h0's
    // (the callers give nh == 1 or nh == Hkv)
    const int64_t span = (nh == Hkv ? Hkv : 1) * d_ * static_cast<int64_t>(sizeof(CacheT));
    for (int64_t b = first / BS; b <= last / BS; ++b) {
      const int64_t j0 = std::max(first, b * BS), j1 = std::min(last + 1, (b + 1) * BS), n = j1 - j0;
      const int64_t base = static_cast<int64_t>(table[b]) * BS * Hkv * d_ + (j0 - b * BS) * stride;
      if (b + 1 <= last / BS) {  // the next block into L2 while this one is worked on
        const int64_t next = static_cast<int64_t>(table[b + 1]) * BS * Hkv * d_ + (nh == Hkv ? 0 : h0 * d_);
        for (int64_t r = 0; r < BS; ++r) {
          const char* nk = reinterpret_cast<const char*>(kp + next + r * stride);
          const char* nv = reinterpret_cast<const char*>(vp + next + r * stride);
          for (int64_t c = 0; c < span; c += 64) {
            __builtin_prefetch(nk + c, 0, 2);
            __builtin_prefetch(nv + c, 0, 2);
          }
        }
      }
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t off = base + (h0 + hh) * d_, i0 = hh * nqh, i1 = i0 + nqh;
        int64_t krs, vrs;
        // scores: the block's key rows of this head (widened once for its nqh queries), kLanes keys per reduction
        const float* kr = block_rows(kp + off, n, stride, ks, kvbuf.data(), &krs);
        for (int64_t i = i0; i < i1; ++i) {
          float* si = s.data() + i * BS;
          const int64_t lo = lo_q[i - i0] - j0, hi = hi_q[i - i0] - j0;  // visible keys of the block: lo..hi
          if (hi < 0 || lo >= n) {  // none (a chunk's earlier rows, before a later block)
            std::fill(si, si + n, ninf);
            continue;
          }
          dots(qs.data() + i * d_, kr, krs, n, si);
          if (cap > 0.f) {
            for (int64_t j = 0; j < n; ++j) si[j] = cap * std::tanh(si[j] * scale / cap);
          } else {
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) si[j] *= scale;
          }
          for (int64_t j = 0; j < std::min(n, lo); ++j) si[j] = ninf;
          for (int64_t j = std::max<int64_t>(hi + 1, 0); j < n; ++j) si[j] = ninf;
        }
        for (int64_t i = i0; i < i1; ++i) {
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
        // weighted V rows: the block's value rows of this head widened once for its nqh queries
        const float* vr = block_rows(vp + off, n, stride, vs, kvbuf.data() + BS * d_, &vrs);
        for (int64_t i = i0; i < i1; ++i)
          if (hi_q[i - i0] >= j0 && lo_q[i - i0] < j1)
            weighted_rows(s.data() + i * BS, vr, vrs, n, acc.data() + i * d_);
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t hh = h0 + i / nqh, r = i % nqh;
      QT* dst = op + ((q0 + r / G) * H + hh * G + r % G) * d_;
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
    // Work units pulled by each thread in turn (one atomic counter: a long request's unit does not
    // hold up a thread that a static split gave more of them): with at least two requests per thread,
    // a request (its KV heads one after the other on one core, so each block's other heads come from
    // that core's cache), else a (request, KV head) pair.
    const int64_t threads = at::get_num_threads();
    const bool all_heads = n >= 2 * threads;
    const int64_t per = all_heads ? Hkv : 1, units = n * Hkv / per;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> m, l, acc, s, qs, kvbuf;
      std::vector<int64_t> lo_q, hi_q;
      for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
        const int64_t r = rq[u * per / Hkv], h0 = u * per % Hkv;
        const int64_t q0 = cu[r], qlen = cu[r + 1] - q0;
        if (qlen <= 0) continue;
        item.run(static_cast<const Q*>(qp), static_cast<const C*>(kp), static_cast<const C*>(vp),
                 static_cast<Q*>(op), bt + r * W, q0, qlen, sl[r], h0, per, H, G, Hkv, BS, fscale, cap,
                 window, m, l, acc, s, qs, lo_q, hi_q, kvbuf);
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
