"""The flash-attn backend (``kvserve/kernels/flash_attn_backend.py``) with a fake ``flash_attn`` module: what it
passes to flash-attn's functions and to the Triton scatter."""

from __future__ import annotations

import sys

import torch
from attention_cases import _meta, make_problem


def test_flash_attn_backend_calls(monkeypatch):
    """flash-attn cannot be installed here: a fake module checks what the backend passes
    (decode-only batch -> ``flash_attn_with_kvcache``, anything else -> paged varlen)."""
    import types
    from kvserve.kernels import flash_attn_backend as fab

    calls = []

    def varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        calls.append(
            (
                "varlen",
                dict(
                    q=q,
                    k=k,
                    cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k,
                    scale=softmax_scale,
                    causal=causal,
                    block_table=block_table,
                    window_size=window_size,
                    softcap=softcap,
                ),
            )
        )
        return torch.zeros_like(q)

    def with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        **kw,
    ):
        calls.append(
            (
                "kvcache",
                dict(
                    q=q,
                    cache_seqlens=cache_seqlens,
                    block_table=block_table,
                    scale=softmax_scale,
                    causal=causal,
                    window_size=kw.get("window_size"),
                    softcap=kw.get("softcap"),
                ),
            )
        )
        return torch.zeros_like(q)

    def store_kv(*args):
        calls.append(("store", args))

    fake = types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    # the Triton scatter, faked: importing the kernel module here would compile-mode it
    monkeypatch.setitem(sys.modules, "kvserve.kernels.triton_attention", types.SimpleNamespace(store_kv=store_kv))
    monkeypatch.setattr(fab, "_funcs", None)
    assert fab.FlashAttnBackend.import_error() is None
    backend = fab.FlashAttnBackend()
    spec = dict(H=4, Hkv=2, D=64, bs=256, dtype="float16", seed=5)
    p = make_problem(dict(spec, qlens=[3, 1, 40], seqlens=[300, 20, 40]))
    out = backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125)
    name, kw = calls[-1]
    assert name == "varlen" and kw["causal"] and kw["scale"] == 0.125 and out.shape == p["q"].shape
    assert kw["cu_seqlens_k"].tolist() == [0, 300, 320, 360]
    assert kw["cu_seqlens_k"].dtype == torch.int32 and kw["block_table"] is p["block_tables"]
    assert kw["k"] is p["k_cache"] and (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (40, 300)
    assert kw["window_size"] == (-1, -1) and kw["softcap"] == 0.0  # full attention, no capping
    backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125, window=16, softcap=30.0)
    assert calls[-1][1]["window_size"] == (15, 0) and calls[-1][1]["softcap"] == 30.0
    p = make_problem(dict(spec, qlens=[1, 1], seqlens=[300, 7]))
    out = backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125)
    name, kw = calls[-1]
    assert name == "kvcache" and kw["q"].shape == (2, 1, 4, 64) and out.shape == (2, 4, 64)
    assert kw["cache_seqlens"] is p["seq_lens"] and kw["block_table"] is p["block_tables"]
    backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125, window=512)
    assert calls[-1][0] == "kvcache" and calls[-1][1]["window_size"] == (511, 0)
    slots = torch.tensor([3, -1])
    backend.store_kv(p["q"], p["q"], p["k_cache"], p["v_cache"], slots)
    assert calls[-1][0] == "store" and calls[-1][1][4] is slots
