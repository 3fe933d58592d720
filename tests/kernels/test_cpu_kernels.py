"""The C++ CPU kernels (``kvserve/kernels/cpu_backend.py``, the ``cpu_kernel`` fixture of conftest.py): paged
attention against the float64 reference of attention_cases.py (``CPU_CASES``) in float32 and bfloat16,
the fused element-wise ops against ATen; and ``kvserve.engine.layers.linear`` on a prepacked (oneDNN) weight."""

from __future__ import annotations

import pytest
import torch
from attention_cases import CPU_CASES, DTYPES, _compare, _describe, _meta, make_problem, ref_attention


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernel(name, dtype, cpu_kernel):
    """The CPU kernel (and, for chunks longer than it takes, the SDPA path) against the float64
    reference over the same float32 or bfloat16 values; bfloat16 output is rounded once."""
    p = make_problem(dict(CPU_CASES[name], dtype=dtype))
    out = cpu_kernel.paged_attention_cpu(
        p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], p["window"], p["softcap"]
    )
    assert out.dtype == DTYPES[dtype]
    rec = _compare(out, ref_attention(p), dtype)  # seq_len-0 rows: the kernel writes zeros
    assert rec["ok"], f"{name}: {_describe(rec)}"


def test_cpu_fused_ops_match_aten(cpu_kernel):
    """The fused element-wise ops against the ATen formulas they replace (float64 reference),
    on strided row views as the model passes them, with row counts on both sides of the
    single-thread / thread-pool split."""
    from kvserve.engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(5)
    for rows in (1, 64, 700):
        H = 576
        x = torch.randn(rows, 2 * H, generator=g)[:, :H]  # strided rows
        res = torch.randn(rows, H, generator=g)
        w = torch.randn(H, generator=g)
        ref = lambda t, off=0.0: (  # noqa: E731
            (t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * (w.double() + off)
        )
        for off in (0.0, 1.0):
            out = cpu_kernel.rms_norm(x, w, 1e-5, off)
            assert (out.double() - ref(x, off)).abs().max() < 1e-5
        r0 = res.clone()
        out, r = cpu_kernel.add_rms_norm(x, res, w, 1e-5)
        assert r is res and torch.allclose(res, r0 + x, atol=0, rtol=0)  # residual updated in place
        assert (out.double() - ref(r0 + x)).abs().max() < 1e-5
        gu = torch.randn(rows, 2 * 1536, generator=g)
        ref_sm = torch.nn.functional.silu(gu[:, :1536].double()) * gu[:, 1536:].double()
        assert (cpu_kernel.silu_and_mul(gu).double() - ref_sm).abs().max() < 1e-5
        rope = RotaryEmbedding(64, 4096, 10000.0)
        qkv = torch.randn(rows, (9 + 3 + 3) * 64, generator=g)
        q, k = qkv[:, :576].reshape(rows, 9, 64), qkv[:, 576:768].reshape(rows, 3, 64)
        pos = torch.randint(0, 4096, (rows,), generator=g)
        cos, sin = rope.cos[pos][:, None].double(), rope.sin[pos][:, None].double()
        rot = lambda t: t * cos + torch.cat((-t[..., 32:], t[..., :32]), -1) * sin  # noqa: E731
        q_ref, k_ref, v_before = rot(q.double()), rot(k.double()), qkv[:, 768:].clone()
        q2, k2 = cpu_kernel.rotary(q, k, pos, rope.cos, rope.sin)
        assert q2.data_ptr() == q.data_ptr()  # in place, in the qkv buffer
        assert (q.double() - q_ref).abs().max() < 1e-5 and (k.double() - k_ref).abs().max() < 1e-5
        assert torch.equal(qkv[:, 768:], v_before)  # v untouched


def test_cpu_fused_ops_in_bfloat16(cpu_kernel):
    """bfloat16 inputs: each op equals the float64 formula over the same bfloat16 values,
    rounded once to bfloat16 (within one bfloat16 ulp, 2^-8 relative, plus a small absolute
    slack for outputs near zero); the residual add rounds like ATen's bfloat16 add."""
    from kvserve.engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(6)
    bf = torch.bfloat16

    def close(out, ref):
        assert out.dtype == bf
        err = (out.double() - ref).abs()
        assert (err <= 2**-8 * ref.abs() + 1e-3 * ref.abs().max()).all(), float(err.max())

    for rows in (1, 64, 300):
        H = 576
        x = torch.randn(rows, 2 * H, generator=g).to(bf)[:, :H]
        res = torch.randn(rows, H, generator=g).to(bf)
        w = torch.randn(H, generator=g).to(bf)
        ref = lambda t: (t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()  # noqa: E731
        close(cpu_kernel.rms_norm(x, w, 1e-5), ref(x))
        r0 = res.clone()
        out, r = cpu_kernel.add_rms_norm(x, res, w, 1e-5)
        assert r is res and torch.equal(res, r0 + x)
        close(out, ref(r0 + x))
        gu = torch.randn(rows, 2 * 1536, generator=g).to(bf)
        close(cpu_kernel.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :1536].double()) * gu[:, 1536:].double())
        rope = RotaryEmbedding(64, 4096, 10000.0)
        q = torch.randn(rows, 9, 64, generator=g).to(bf)
        k = torch.randn(rows, 3, 64, generator=g).to(bf)
        pos = torch.randint(0, 4096, (rows,), generator=g)
        cos, sin = rope.cos[pos][:, None].double(), rope.sin[pos][:, None].double()
        rot = lambda t: t * cos + torch.cat((-t[..., 32:], t[..., :32]), -1) * sin  # noqa: E731
        q_ref, k_ref = rot(q.double()), rot(k.double())
        cpu_kernel.rotary(q, k, pos, rope.cos, rope.sin)
        close(q, q_ref)
        close(k, k_ref)


def test_cpu_fused_ops_reject_mixed_dtypes(cpu_kernel):
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="same dtype"):
        cpu_kernel.add_rms_norm(x, torch.randn(4, 64).bfloat16(), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernel.silu_and_mul(torch.randn(4, 64).half())


@pytest.mark.parametrize("large_on_aten", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 600])
def test_linear_with_prepacked_weight_matches_float64(monkeypatch, rows, large_on_aten):
    """kvserve.engine.layers.linear.linear on a prepacked weight (oneDNN blocked layout) and on the
    ATen route for large batches: float32 results equal float64 within float32 rounding."""
    import kvserve.engine.layers.linear as L

    monkeypatch.setattr(L, "_LARGE_ON_ATEN", large_on_aten)
    monkeypatch.setattr(L, "CPU_LINEAR", "onednn")
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 200, generator=g) / 10, torch.randn(300, generator=g)
    x = torch.randn(rows, 400, generator=g)[:, :200].contiguous()
    packed = L.prepack_weight(w)
    assert packed is not None and packed.is_mkldnn
    ref = x.double() @ w.double().T + b.double()
    with torch.inference_mode():
        for y in (L.linear(x, w, b, packed), L.linear(x, w, b)):
            assert y.dtype == torch.float32 and y.shape == (rows, 300)
            assert (y.double() - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(300, 200), (7, 577), (130, 96), (1, 8)])
def test_f32_gemv_matches_float64(cpu_kernel, rows, n, k):
    """The float32 GEMV for decode-sized batches (kvserve/kernels/csrc/f32_linear_cpu.cpp): every row
    count it takes, N not a multiple of its 4-row unroll, K not a multiple of the vector width,
    strided activation rows, with and without bias: float64's result within float32 rounding."""
    from kvserve.kernels.cpu_backend import f32_linear

    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, b = torch.randn(n, k, generator=g) / 10, torch.randn(n, generator=g)
    x = torch.randn(rows, 2 * k, generator=g)[:, :k]  # rows 2k apart
    ref = x.double() @ w.double().T
    for bias, r in ((b, ref + b.double()), (None, ref)):
        y = f32_linear(x, w, bias)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert ((y.double() - r).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


def test_linear_takes_the_gemv_for_decode_sized_float32(cpu_kernel, monkeypatch):
    """kvserve.engine.layers.linear.linear runs the GEMV up to 8 rows of a float32 weight (what a decode
    step multiplies, a vocabulary-sized LM head included), oneDNN above 8 rows."""
    import kvserve.engine.layers.linear as L
    from kvserve.kernels import cpu_backend

    monkeypatch.setattr(L, "CPU_LINEAR", "onednn")
    calls = []
    real = cpu_backend.f32_linear
    monkeypatch.setattr(L, "_f32_gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(64, 32)
    with torch.inference_mode():
        for rows in (1, 8, 9):
            L.linear(torch.randn(rows, 32), w)
        L.linear(torch.randn(1, 1, 32), torch.empty(49152, 32))
        L.linear(torch.randn(9, 32), torch.empty(49152, 32))
    assert calls == [(1, 32), (8, 32), (1, 1, 32)]


def test_prepack_is_skipped_where_it_does_not_apply(monkeypatch):
    import kvserve.engine.layers.linear as L

    assert L.prepack_weight(torch.randn(8, 8).half()) is None
    monkeypatch.setattr(L, "CPU_LINEAR", "aten")
    assert L.prepack_weight(torch.randn(8, 8)) is None


def test_a_complete_build_is_loaded_without_compiling_again(cpu_kernel, tmp_path):
    """A second checkout (its own virtual environment: other torch header paths in the ninja
    file) loads the library an earlier build left in the cache folder, in a fresh process whose
    ``torch.utils.cpp_extension.load`` raises: it neither compiles nor runs ninja. A folder
    without the completion marker is not loaded (a build another process has not finished)."""
    import subprocess
    import sys
    from pathlib import Path

    from kvserve.kernels import cpu_backend

    build = cpu_backend.build_directory()
    assert (build / cpu_backend.BUILT).is_file(), "the build did not mark its folder complete"
    code = (
        "import torch.utils.cpp_extension as c\n"
        "def boom(*a, **k): raise AssertionError('compiled again')\n"
        "c.load = boom\n"
        "from kvserve.kernels import cpu_backend\n"
        "assert cpu_backend.load_kernel(), cpu_backend.kernel_error()\n"
        "import torch; print(hasattr(torch.ops.kvserve_cpu, 'paged_attention'))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(cpu_backend.__file__).parents[1],
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
    half = tmp_path / "half"
    half.mkdir()
    (half / f"{cpu_backend.LIBRARY}.so").write_bytes(b"not a library")
    assert cpu_backend._load_built(half) is False
    (half / cpu_backend.BUILT).write_text("x")  # marked, but it does not load: built again, marker gone
    assert cpu_backend._load_built(half) is False and not (half / cpu_backend.BUILT).exists()
