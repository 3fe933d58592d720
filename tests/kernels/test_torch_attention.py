"""The torch backend's paged attention (``kvserve/kernels/torch_backend.py``, ``paged_attention_torch``), in-process,
against the float64 reference of attention_cases.py (``TORCH_CASES``), its decode-row buckets and its
argument checks."""

from __future__ import annotations

import pytest
import torch
from attention_cases import TORCH_CASES, _compare, _describe, _meta, make_problem, ref_attention


def test_decode_buckets_split_at_long_rows():
    """A decode row more than twice as long as its bucket's first row opens a new bucket."""
    from kvserve.kernels.torch_backend import _decode_plan

    p = make_problem(TORCH_CASES["torch_decode_long_outlier"])
    plan = _decode_plan(_meta(p), p["k_cache"])
    sizes = [len(rows) for rows, _gather, _mask in plan]
    assert sizes == [8, 1], sizes
    widths = [mask.shape[-1] for _rows, _gather, mask in plan]
    assert widths[0] <= 60 and widths[1] == 1500
    # with a window of 64 every row reads at most 64 keys: one bucket, 64 wide
    plan = _decode_plan(_meta(p), p["k_cache"], 64)
    assert [len(rows) for rows, _g, _m in plan] == [9] and plan[0][2].shape[-1] == 64


@pytest.mark.parametrize(
    "window,softcap",
    [(0, None), (-3, None), (2.5, None), (True, None), (None, 0.0), (None, -1.0), (None, float("inf"))],
)
def test_bad_window_or_softcap_raises(window, softcap):
    from kvserve.kernels.torch_backend import paged_attention_torch

    p = make_problem(dict(H=2, Hkv=1, D=16, bs=4, dtype="float32", qlens=[3], seqlens=[5], seed=1))
    with pytest.raises(ValueError, match="window|softcap"):
        paged_attention_torch(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], window, softcap)


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_reference_path(name):
    from kvserve.kernels.torch_backend import paged_attention_torch

    spec = TORCH_CASES[name]
    p = make_problem(spec)
    out = paged_attention_torch(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], p["window"], p["softcap"])
    if 0 in p["seqlens"]:  # the torch path leaves seq_len-0 padding rows unspecified
        keep = torch.tensor([s > 0 for s in p["seqlens"]])
        rows = torch.repeat_interleave(keep, torch.tensor(p["qlens"]))
        out, ref = out[rows], ref_attention(p)[rows]
    else:
        ref = ref_attention(p)
    rec = _compare(out, ref, spec["dtype"])
    assert rec["ok"], f"{name}: {_describe(rec)}"
