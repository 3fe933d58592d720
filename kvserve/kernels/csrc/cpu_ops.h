// The CPU ops other sources call directly (decode_layers_cpu.cpp's layer loop): the same
// functions the kvserve_cpu library registers with torch, by their C++ names. Shapes, dtypes and
// checks are each op's, in its source file.
#pragma once

#include <ATen/ATen.h>

namespace kvserve_ops {

// f32_linear_cpu.cpp: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), float32, M <= 8.
void f32_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y);
// bf16_linear_cpu.cpp: the same for bfloat16 tensors, float32 arithmetic.
void bf16_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y);
void bf16_widen(const at::Tensor& w, at::Tensor& out);

// fused_ops_cpu.cpp: the decoder layer's element-wise ops.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps, double offset);
void add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
                  double eps, double offset);
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin);
void silu_and_mul(const at::Tensor& x, at::Tensor& out);

// paged_attention_cpu.cpp: causal attention over the paged KV cache.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& reqs, at::Tensor& out,
                     double scale, int64_t window, double softcap, double k_scale, double v_scale);

}  // namespace kvserve_ops
