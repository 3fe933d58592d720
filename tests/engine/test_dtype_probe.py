"""``dtype="auto"`` on a CPU with native bf16 dot products measures which of float32 and bfloat16
runs the model's matmuls faster here (kvserve/engine/dtype_probe.py): the faster one is chosen, the
verdict is cached per CPU and model shape, every rank of an engine runs the one its driver
chose, and the reason is logged. The probe's timings are faked where a verdict is asserted (which
dtype is faster is the CPU's business); the real measurement runs once, small, on this CPU."""

import json
import logging
import math

import pytest
import torch

import kvserve.engine.config as config
from kvserve.engine import LLM, SamplingParams, dtype_probe
from kvserve.engine.config import EngineConfig


class _Shape:
    hidden_size, intermediate_size = 64, 128


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private kvserve cache folder; yields the probe's cache file."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("KVSERVE_DTYPE_PROBE", raising=False)
    return tmp_path / dtype_probe.CACHE_FILE


def _fake_timings(monkeypatch, float32_ms: float, bfloat16_ms: float) -> list:
    calls = []

    def measure(hidden, intermediate, repeats=dtype_probe.PROBE_REPEATS):
        calls.append((hidden, intermediate))
        return {"float32": float32_ms, "bfloat16": bfloat16_ms}

    monkeypatch.setattr(dtype_probe, "measure_ms", measure)
    return calls


@pytest.mark.parametrize("float32_ms, bfloat16_ms, expected", [(2.0, 1.0, "bfloat16"), (1.0, 2.0, "float32")])
def test_the_faster_dtype_is_chosen_and_cached(cache, monkeypatch, float32_ms, bfloat16_ms, expected):
    calls = _fake_timings(monkeypatch, float32_ms, bfloat16_ms)
    first = dtype_probe.probe_cpu_dtype(64, 128)
    assert first.dtype == expected and not first.cached and calls == [(64, 128)]
    again = dtype_probe.probe_cpu_dtype(64, 128)  # from the file: no second measurement
    assert again.dtype == expected and again.cached and len(calls) == 1
    assert (again.float32_ms, again.bfloat16_ms) == (float32_ms, bfloat16_ms)
    saved, key = json.loads(cache.read_text()), dtype_probe.probe_key(64, 128)
    assert list(saved) == [key] and saved[key]["dtype"] == expected
    dtype_probe.probe_cpu_dtype(64, 256)  # another model shape is measured, and kept beside the first
    assert len(calls) == 2 and len(json.loads(cache.read_text())) == 2
    assert expected in again.reason() and f"{bfloat16_ms:.2f} vs {float32_ms:.2f} ms" in again.reason()


def test_a_damaged_cache_file_is_measured_again(cache, monkeypatch):
    calls = _fake_timings(monkeypatch, 1.0, 2.0)
    cache.write_text("{not json")
    assert dtype_probe.probe_cpu_dtype(64, 128).dtype == "float32" and len(calls) == 1
    cache.write_text(json.dumps({dtype_probe.probe_key(64, 128): {"dtype": "float64"}}))  # not a verdict
    assert dtype_probe.probe_cpu_dtype(64, 128).dtype == "float32" and len(calls) == 2
    cache.write_text(json.dumps({dtype_probe.probe_key(64, 128): {"dtype": "bfloat16"}}))  # no times
    assert dtype_probe.probe_cpu_dtype(64, 128).dtype == "float32" and len(calls) == 3
    assert json.loads(cache.read_text())[dtype_probe.probe_key(64, 128)]["dtype"] == "float32"


def test_auto_follows_the_probe_where_bf16_is_native(cache, monkeypatch):
    monkeypatch.setattr(config, "cpu_native_bf16", lambda: (True, "avx512_bf16"))
    cfg = EngineConfig(device="cpu")
    _fake_timings(monkeypatch, 1.0, 2.0)
    dtype, why = dtype_probe.auto_dtype(cfg, _Shape())
    assert dtype == torch.float32 and "measured not faster" in why
    assert dtype_probe.auto_dtype(cfg, None)[0] == torch.bfloat16  # no model shape: the flags' rule
    monkeypatch.setenv("KVSERVE_DTYPE_PROBE", "0")
    assert dtype_probe.auto_dtype(cfg, _Shape()) == (
        torch.bfloat16,
        "bfloat16: this CPU has native bf16 dot products (avx512_bf16)",
    )
    monkeypatch.delenv("KVSERVE_DTYPE_PROBE")

    def broken(*a, **k):
        raise RuntimeError("no oneDNN")

    monkeypatch.setattr(dtype_probe, "probe_cpu_dtype", broken)
    dtype, why = dtype_probe.auto_dtype(cfg, _Shape())
    assert dtype == torch.bfloat16 and "probe failed (RuntimeError: no oneDNN)" in why
    # no native bf16: float32 without measuring; int8: float32 activations
    monkeypatch.setattr(config, "cpu_native_bf16", lambda: (False, "no avx512_bf16 or amx_bf16"))
    assert dtype_probe.auto_dtype(cfg, _Shape())[0] == torch.float32
    assert dtype_probe.auto_dtype(EngineConfig(device="cpu", quantization="int8"), _Shape())[0] == torch.float32


def test_the_engine_decides_once_and_logs_why(cache, tiny_llama_path, monkeypatch, caplog):
    """The engine resolves ``auto`` before its executor starts: the model runs the probe's dtype and
    the engine's config names it (a tensor-parallel rank is given that dtype, not ``auto``)."""
    monkeypatch.setattr(config, "cpu_native_bf16", lambda: (True, "avx512_bf16"))
    calls = _fake_timings(monkeypatch, 1.0, 2.0)
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        llm = LLM(model=str(tiny_llama_path), device="cpu", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.config.dtype == "float32" and llm.engine.executor.runner.dtype == torch.float32
    assert len(calls) == 1
    assert sum("dtype auto -> float32: bfloat16 measured not faster" in r.getMessage() for r in caplog.records) == 1
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_measurement_runs_here(monkeypatch):
    """The real probe on this CPU, on a small shape and few weight bytes: both dtypes timed."""
    monkeypatch.setattr(dtype_probe, "MIN_PROBE_BYTES", 4 << 20)
    monkeypatch.setattr(dtype_probe, "MAX_PROBE_BYTES", 4 << 20)
    ms = dtype_probe.measure_ms(64, 128, repeats=2)
    assert set(ms) == {"float32", "bfloat16"} and all(math.isfinite(v) and v > 0 for v in ms.values()), ms
