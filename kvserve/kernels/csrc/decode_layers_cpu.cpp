// A decode step's Llama-family decoder layers in one call: the loop over layers in C++ instead of
// ~11 ops per layer dispatched from Python (each with its module call, checks and tensor
// wrappers: ~5 ms a step for SmolLM2's 30 layers on a 2-core EPYC, a sixth of the step).
//
// Per layer, the same kernels in the same order as engine/models/llama.py's modules run them,
// so the result is bit for bit the per-op path's:
//   x = add_rms_norm(h, residual)        (the first layer of the first stage: rms_norm(h))
//   qkv = gemv(x, W_qkv) + b_qkv;  [q, k = rms_norm per head (Qwen3)];  q, k rotated (RoPE) in place;
//   k, v stored at slot_mapping
//   a = paged_attention(q);  h = gemv(a, W_o)
//   x = add_rms_norm(h, residual);  h = gemv(silu_and_mul(gemv(x, W_gate_up)), W_down)
// Float32 tensors take f32_gemv, bfloat16 ones bf16_gemv (engine.layers.linear picks the same
// kernels for these shapes; the caller, kernels.cpu_backend.decode_layers, only comes here then).
// Buffers are allocated once per call and reused by every layer.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstring>

#include "cpu_ops.h"

namespace {

// Tensors per layer in `weights`: input norm, qkv weight, qkv bias (empty: none), o weight,
// post-attention norm, gate_up weight, down weight, q norm and k norm (empty: none; Qwen3's
// per-head RMSNorm of q and k before RoPE).
constexpr int64_t kPerLayer = 9;

// Rows m of src [M, >= row_elems] (strided rows, contiguous within) to cache slots slots[m]
// (-1: skipped) of cache [NB, BS, Hkv, D] (contiguous, src's dtype).
void store_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t M, int64_t row_elems) {
  const int64_t es = cache.element_size(), slots_total = cache.size(0) * cache.size(1);
  const char* s = static_cast<const char*>(src.data_ptr());
  char* c = static_cast<char*>(cache.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    const int64_t slot = slots[m];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots_total, "decode_layers (cpu): slot ", slot, " outside the cache");
    std::memcpy(c + slot * row_elems * es, s + m * src.stride(0) * es, row_elems * es);
  }
}

}  // namespace

namespace kvserve_ops {

// h [M, H]: the hidden states entering the first layer (read; M <= 8 decode rows, one per
// request); residual [M, H] (updated in place; with first_norm, h itself, normed for the first
// layer); out [M, H]: the last layer's MLP output. positions int64 [M]; weights: kPerLayer per
// layer; k_caches / v_caches one per layer [NB, BS, Hkv, D] of h's dtype; block_tables int32
// [M, W], seq_lens int32 [M], cu_seqlens_q int32 [M + 1], reqs int64 [M], slot_mapping int64 [M];
// cos / sin float32 [max_position, D].
void decode_layers(const at::Tensor& h, at::Tensor& residual, at::Tensor& out, const at::Tensor& positions,
                   at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                   const at::Tensor& reqs, const at::Tensor& slot_mapping, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                   double scale, bool first_norm) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kPerLayer && static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers (cpu): ", kPerLayer, " weights and one K and V cache per layer expected");
  const auto dt = h.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "decode_layers (cpu): float32 or bfloat16 expected");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && residual.sizes() == h.sizes() && residual.is_contiguous() &&
                  out.sizes() == h.sizes() && out.is_contiguous() && residual.scalar_type() == dt &&
                  out.scalar_type() == dt,
              "decode_layers (cpu): contiguous h, residual and out [M, H] of one dtype expected");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == h.size(0),
              "decode_layers (cpu): int64 slot_mapping [M] expected");
  const int64_t M = h.size(0), H = h.size(1);
  const int64_t Q = num_heads * head_dim, KV = num_kv_heads * head_dim;
  auto gemv = [&](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, at::Tensor& y) {
    if (dt == at::kFloat) f32_gemv(x, w, b, y);
    else bf16_gemv(x, w, b, y);
  };
  const auto opts = h.options();
  at::Tensor x = at::empty({M, H}, opts);
  at::Tensor qkv = at::empty({M, Q + 2 * KV}, opts);
  at::Tensor qc = at::empty({M, num_heads, head_dim}, opts);
  at::Tensor kn = at::empty({M, num_kv_heads, head_dim}, opts);  // k normed (q/k norm models)
  at::Tensor attn = at::empty({M, num_heads, head_dim}, opts);
  at::Tensor o = at::empty({M, H}, opts);
  at::Tensor gu, act;
  at::Tensor attn2 = attn.view({M, Q});
  at::Tensor q = qkv.narrow(1, 0, Q).view({M, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, Q, KV).view({M, num_kv_heads, head_dim});
  at::Tensor k_rows = qkv.narrow(1, Q, KV);
  at::Tensor v_rows = qkv.narrow(1, Q + KV, KV);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const c10::optional<at::Tensor> none;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = &weights[l * kPerLayer];
    if (l == 0 && first_norm) rms_norm(residual, w[0], x, eps, 0.0);
    else add_rms_norm(l == 0 ? h : out, residual, w[0], x, eps, 0.0);
    gemv(x, w[1], w[2].numel() ? c10::optional<at::Tensor>(w[2]) : none, qkv);
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    TORCH_CHECK(kc.scalar_type() == dt && vc.scalar_type() == dt && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.dim() == 4 && kc.size(2) * kc.size(3) == KV && vc.sizes() == kc.sizes(),
                "decode_layers (cpu): contiguous K/V caches [NB, BS, Hkv, D] of h's dtype expected");
    if (w[7].numel()) {  // q/k norm: on contiguous copies, normed in place (the modules norm reshaped copies)
      qc.copy_(q);
      kn.copy_(k);
      at::Tensor q2 = qc.view({M * num_heads, head_dim}), k2 = kn.view({M * num_kv_heads, head_dim});
      rms_norm(q2, w[7], q2, eps, 0.0);
      rms_norm(k2, w[8], k2, eps, 0.0);
      rotary(qc, kn, positions, cos, sin);
      store_rows(kn.view({M, KV}), kc, slots, M, KV);
    } else {
      rotary(q, k, positions, cos, sin);
      store_rows(k_rows, kc, slots, M, KV);
      qc.copy_(q);
    }
    store_rows(v_rows, vc, slots, M, KV);
    paged_attention(qc, kc, vc, block_tables, seq_lens, cu_seqlens_q, reqs, attn, scale, 0, 0.0, 1.0, 1.0);
    gemv(attn2, w[3], none, o);
    add_rms_norm(o, residual, w[4], x, eps, 0.0);
    const int64_t I2 = w[5].size(0);
    if (!gu.defined() || gu.size(1) != I2) {
      gu = at::empty({M, I2}, opts);
      act = at::empty({M, I2 / 2}, opts);
    }
    gemv(x, w[5], none, gu);
    silu_and_mul(gu, act);
    gemv(act, w[6], none, out);
  }
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("decode_layers(Tensor h, Tensor(a!) residual, Tensor(b!) out, Tensor positions, Tensor[] weights, "
        "Tensor[] k_caches, Tensor[] v_caches, Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, "
        "Tensor reqs, Tensor slot_mapping, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
        "int head_dim, float eps, float scale, bool first_norm) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("decode_layers", &kvserve_ops::decode_layers); }
