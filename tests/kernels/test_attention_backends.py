"""Attention backend selection (``kvserve/kernels/selector.py``) and the CUDA-graph condition, on CPU.

CUDA and flash-attn are absent here, so their capabilities are faked: a ``torch.device("cuda")``
object needs no GPU, and whether flash-attn / Triton import is monkeypatched on the backend
classes (``import_error``). Nothing here builds a GPU backend or imports a kernel module.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import flash_attn_backend as fab
from kvserve.kernels.backend import AttentionBackend
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.flash_attn_backend import FlashAttnBackend
from kvserve.kernels.selector import BACKENDS, select_attention_backend
from kvserve.kernels.torch_backend import TorchBackend
from kvserve.kernels.triton_backend import TritonBackend

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVSERVE_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def importable(monkeypatch):
    """flash-attn (>= 2.6) and Triton both import."""
    monkeypatch.setattr(FlashAttnBackend, "import_error", classmethod(lambda cls: None))
    monkeypatch.setattr(TritonBackend, "import_error", classmethod(lambda cls: None))


def _select(caplog, *args, **kw):
    """``select_attention_backend(*args)`` and its one INFO log line."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve.attention"):
        cls = select_attention_backend(*args, **kw)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.attention"]
    assert len(lines) == 1 and caplog.records[-1].levelno == logging.INFO, lines
    return cls, lines[0]


def test_cuda_flash_attn_with_default_block_size_picks_triton(importable, caplog):
    """The bug this replaces: flash-attn importable + block_size 16 chose flash_attn, which then
    fell back to Triton on every call (and turned CUDA graphs off). Now Triton, with the reason."""
    cls, line = _select(caplog, CUDA, BF16, 16, 64)
    assert cls is TritonBackend
    assert line.startswith("attention backend: triton (")
    assert "flash_attn skipped: block_size 16 is not a multiple of 256" in line


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_flash_attn_with_block_size_256_picks_flash_attn(importable, caplog, dtype):
    cls, line = _select(caplog, CUDA, dtype, 256, 128)
    assert cls is FlashAttnBackend and line.startswith("attention backend: flash_attn (")


@pytest.mark.parametrize(
    "dtype, block_size, head_dim, why",
    [
        (FP32, 256, 64, "not float32"),  # flash-attn has no fp32 kernels
        (BF16, 256, 512, "head_dim 512 exceeds 256"),
        (BF16, 128, 64, "block_size 128 is not a multiple of 256"),
    ],
)
def test_flash_attn_passed_over_for_what_it_does_not_support(importable, caplog, dtype, block_size, head_dim, why):
    cls, line = _select(caplog, CUDA, dtype, block_size, head_dim)
    assert cls is TritonBackend and "flash_attn skipped: " in line and why in line, line


def test_flash_attn_not_installed_picks_triton(monkeypatch, caplog):
    """The real import check (flash-attn cannot be installed here)."""
    monkeypatch.setattr(TritonBackend, "import_error", classmethod(lambda cls: None))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    monkeypatch.setattr(fab, "_funcs", None)
    cls, line = _select(caplog, CUDA, BF16, 256, 64)
    assert cls is TritonBackend and "flash_attn skipped: flash-attn does not import" in line


def test_old_flash_attn_without_paged_varlen_is_passed_over(monkeypatch, caplog):
    """flash-attn < 2.6: ``flash_attn_varlen_func`` has no ``block_table``."""
    monkeypatch.setattr(TritonBackend, "import_error", classmethod(lambda cls: None))
    old = types.SimpleNamespace(
        flash_attn_varlen_func=lambda q, k, v, cu_seqlens_q: q, flash_attn_with_kvcache=lambda *a, **kw: None
    )
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    monkeypatch.setattr(fab, "_funcs", None)
    cls, line = _select(caplog, CUDA, BF16, 256, 64)
    assert cls is TritonBackend and "flash-attn < 2.6" in line


def test_cuda_without_triton_picks_torch(monkeypatch, caplog):
    monkeypatch.setattr(FlashAttnBackend, "import_error", classmethod(lambda cls: "not installed"))
    monkeypatch.setitem(sys.modules, "triton", None)
    cls, line = _select(caplog, CUDA, BF16, 16, 64)
    assert cls is TorchBackend and "triton skipped: triton cannot be imported" in line


@pytest.mark.parametrize("interpret", [False, True])
def test_cpu_picks_the_cpu_kernel_for_float32_and_bfloat16(importable, monkeypatch, caplog, interpret):
    """On CPU: our C++ kernel for float32 and bfloat16, torch for float16, even with the Triton
    interpreter on (never chosen automatically)."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cls, line = _select(caplog, CPU, FP32, 16, 64)
    assert cls is CpuBackend
    assert "flash_attn skipped: needs a cuda device, got cpu" in line
    assert "triton skipped: needs a cuda device, got cpu" in line
    cls, line = _select(caplog, CPU, BF16, 16, 64)
    assert cls is CpuBackend
    cls, line = _select(caplog, CPU, torch.float16, 16, 64)
    assert cls is TorchBackend and "cpu skipped: supports float32, bfloat16, not float16" in line


def test_cpu_backend_without_a_compiler_falls_back_to_torch(monkeypatch, caplog):
    """No C++ compiler: one warning naming why, then the torch path computes the same output."""
    from kvserve.kernels import cpu_backend
    from tests.kernels.attention_cases import _meta, make_problem

    monkeypatch.setattr(cpu_backend, "_loaded", None)
    monkeypatch.setattr(cpu_backend, "_load_error", None)
    monkeypatch.setenv("CXX", "no-such-compiler-kvserve")
    with caplog.at_level(logging.WARNING, logger="kvserve.attention"):
        backend = CpuBackend()
        CpuBackend()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "torch path" in warnings[0]
    assert backend.kernel is False
    p = make_problem(dict(H=4, Hkv=2, D=64, bs=16, dtype="float32", qlens=[1, 9, 1], seqlens=[30, 9, 70], seed=3))
    out = backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"])
    ref = TorchBackend().forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"])
    assert torch.equal(out, ref)


def test_requested_flash_attn_with_block_size_16_is_a_value_error(importable):
    with pytest.raises(ValueError, match=r"'flash_attn' cannot run here: block_size 16 is not a multiple of 256"):
        select_attention_backend(CUDA, BF16, 16, 64, "flash_attn")


@pytest.mark.parametrize(
    "name, device, dtype, match",
    [
        ("flash_attn", CPU, BF16, "needs a cuda device, got cpu"),
        ("flash_attn", CUDA, FP32, "not float32"),
        ("triton", CPU, FP32, r"needs a cuda device, got cpu \(or TRITON_INTERPRET=1"),
        ("flash", CUDA, BF16, "must be one of"),
    ],
)
def test_requested_backend_that_cannot_run_is_a_value_error(importable, name, device, dtype, match):
    with pytest.raises(ValueError, match=match):
        select_attention_backend(device, dtype, 256, 64, name)


def test_requested_backend_is_used_and_logged(importable, caplog):
    cls, line = _select(caplog, CUDA, BF16, 16, 64, "torch")
    assert cls is TorchBackend and line == "attention backend: torch (requested)"
    cls, line = _select(caplog, CUDA, BF16, 512, 64, "flash_attn")
    assert cls is FlashAttnBackend


def test_requested_triton_on_cpu_runs_under_the_interpreter(importable, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cls, _ = _select(caplog, CPU, FP32, 16, 64, "triton")
    assert cls is TritonBackend


def test_environment_variable_requests_a_backend(importable, monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    cls, line = _select(caplog, CUDA, BF16, 256, 64)
    assert cls is TorchBackend and "KVSERVE_ATTENTION_BACKEND" in line
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "flash_attn")
    with pytest.raises(ValueError, match="block_size 16"):
        select_attention_backend(CUDA, BF16, 16, 64)


def test_every_backend_declares_its_capabilities():
    assert list(BACKENDS) == ["flash_attn", "triton", "cpu", "torch"]  # automatic preference
    for name, cls in BACKENDS.items():
        assert issubclass(cls, AttentionBackend) and cls.name == name and cls.devices
    assert FlashAttnBackend.supports_cuda_graphs and TritonBackend.supports_cuda_graphs
    assert not TorchBackend.supports_cuda_graphs
    # with a float8 cache, a chunk's attention over itself uses the step's exact K/V where the
    # backend takes them (torch, cpu); the GPU kernels read everything from the cache
    assert [n for n, cls in BACKENDS.items() if cls.exact_chunk_kv] == ["cpu", "torch"]


@pytest.mark.parametrize(
    "backend, device, enforce_eager, graphs",
    [
        (TritonBackend, CUDA, False, True),
        (FlashAttnBackend, CUDA, False, True),  # flash-attn no longer turns graphs off
        (TorchBackend, CUDA, False, False),  # host-side decode planning: not capturable
        (TritonBackend, CUDA, True, False),  # enforce_eager
        (TritonBackend, CPU, False, False),  # no CUDA
    ],
)
def test_cuda_graphs_follow_the_backend_capability(backend, device, enforce_eager, graphs):
    """The model runner's capture condition reads ``supports_cuda_graphs``, not a name."""
    from kvserve.engine.config import EngineConfig

    runner = types.SimpleNamespace(
        device=device, backend=backend, config=EngineConfig(device=device.type, enforce_eager=enforce_eager)
    )
    assert ModelRunner.use_cuda_graphs.fget(runner) is graphs
    fake = type("FakeBackend", (TorchBackend,), {"name": "fake", "supports_cuda_graphs": True})
    runner.backend = fake
    assert ModelRunner.use_cuda_graphs.fget(runner) is (device == CUDA and not enforce_eager)


def test_model_runner_selects_once_from_its_config(tiny_llama_path, caplog, monkeypatch):
    """A real CPU runner: one selection from (device, dtype, block_size, head_dim), logged once;
    an impossible request fails at construction with the reason; no graphs on CPU."""
    from kvserve.engine.config import EngineConfig

    captured = []
    monkeypatch.setattr(ModelRunner, "capture_cudagraphs", lambda self: captured.append(self))
    with caplog.at_level(logging.INFO, logger="kvserve.attention"):
        runner = ModelRunner(EngineConfig(device="cpu", block_size=16), tiny_llama_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.attention"]
    assert len(lines) == 1 and lines[0].startswith("attention backend: cpu (")
    assert isinstance(runner.backend, CpuBackend)
    assert all(layer.self_attn.backend is runner.backend for layer in runner.model.layers)
    runner.init_kv_cache(4)
    assert not runner.use_cuda_graphs and not captured
    with pytest.raises(ValueError, match="flash_attn.*needs a cuda device"):
        ModelRunner(EngineConfig(device="cpu", attention_backend="flash_attn"), tiny_llama_path)
