"""``dtype="auto"`` on a CPU with native bf16 dot products: float32 or bfloat16, whichever runs
this model's matmuls faster on this CPU, measured once and cached.

Native bf16 (``avx512_bf16``, AMX) halves the bytes a matmul reads, which wins where the weights'
bytes bound a step (decoding few sequences), but oneDNN's bf16 kernels do not run at twice
float32's rate on every such CPU, and on some a batched step is slower in bf16 than in float32:
the CPU's flags cannot tell which (``benchmarks/throughput.py --dtype`` measures both end to
end). So the engine measures, as vLLM's and SGLang's autotuners do for their kernels: the
model's two MLP matmuls (``hidden -> intermediate``, ``intermediate -> hidden``) through the
engine's own CPU linear (:func:`kvserve.engine.layers.linear.linear` on prepacked weights) at
:data:`PROBE_ROWS` rows (one sequence decoding, a batch decoding), each dtype on enough copies of
the weights to exceed the last-level cache (so they stream from memory as a model's do), the two
dtypes interleaved, :data:`PROBE_REPEATS` times; the median of each shape's times, summed over
the shapes, decides (with the threads of the engine that probes first). The verdict is cached
in ``<cache_dir>/dtype_probe.json`` by CPU model, flags, torch version and matrix shape: a probe
runs once per machine and model shape (about a second), and every engine of that model there
runs the same dtype.

``KVSERVE_DTYPE_PROBE=0`` turns the probe off: ``auto`` then follows the flags (bfloat16 with
native bf16).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.linear import linear, prepack_weight
from kvserve.engine.model_loader import cache_dir

logger = logging.getLogger("kvserve.engine")

#: Rows of the probed matmuls: one sequence decoding, and a batch of decoding sequences.
PROBE_ROWS = (1, 32)
#: Timed runs per dtype and shape (interleaved across dtypes); the median counts.
PROBE_REPEATS = 5
#: Bytes of float32 weights the probe cycles through at least (more when the last-level cache is
#: larger: twice its size), so that they are read from memory, not from cache.
MIN_PROBE_BYTES = 64 << 20
#: Most bytes of float32 weights the probe allocates.
MAX_PROBE_BYTES = 128 << 20
CACHE_FILE = "dtype_probe.json"


@dataclass(frozen=True)
class ProbeResult:
    """A probe's verdict: ``dtype`` (``"float32"`` or ``"bfloat16"``), the milliseconds each
    dtype took for one pass over the probed shapes (the sum over :data:`PROBE_ROWS` of each
    shape's median), and whether it came from the cache file ``path``."""

    dtype: str
    float32_ms: float
    bfloat16_ms: float
    cached: bool
    path: str

    def reason(self) -> str:
        """The sentence the engine logs for its choice."""
        word = "faster" if self.dtype == "bfloat16" else "not faster"
        return (
            f"{self.dtype}: bfloat16 measured {word} than float32 on this CPU for this model's MLP matmuls at "
            f"{' and '.join(map(str, PROBE_ROWS))} rows ({self.bfloat16_ms:.2f} vs {self.float32_ms:.2f} ms; "
            f"{'cached in' if self.cached else 'saved to'} {self.path}; KVSERVE_DTYPE_PROBE=0 turns the probe off)"
        )


def probe_enabled() -> bool:
    """Whether ``dtype="auto"`` may measure (``KVSERVE_DTYPE_PROBE`` is not ``0``)."""
    return os.environ.get("KVSERVE_DTYPE_PROBE", "1") != "0"


def _cpu_identity() -> str:
    """This CPU's model name and a hash of its flags, from ``/proc/cpuinfo`` (the platform's
    processor string where there is none)."""
    import platform

    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:12]
    return f"{info.get('model name') or platform.processor()}|flags {flags}"


def _llc_bytes() -> int:
    """The largest CPU cache's size in bytes (0 when the system does not say)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best


#: Part of the cache key: raised when the matmuls the probe times change (2: bfloat16 decode rows take
#: kvserve's bf16 GEMV on CPUs with native bf16 too), so no verdict about older kernels is reused.
PROBE_VERSION = 2


def probe_key(hidden_size: int, intermediate_size: int) -> str:
    """The cache key of a probe: CPU model and flags, torch version, :data:`PROBE_VERSION` and
    the model's shape (not the thread count: every engine of a model on a machine, each rank and
    each replica, runs the same dtype, whatever threads it was given)."""
    return f"{_cpu_identity()}|torch {torch.__version__}|probe {PROBE_VERSION}|{hidden_size}x{intermediate_size}"


def measure_ms(hidden_size: int, intermediate_size: int, repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Milliseconds of one pass over the probed shapes in each dtype: ``{"float32": ms,
    "bfloat16": ms}`` (see the module docstring for what is timed).

    Raises:
        RuntimeError: a matmul failed in either dtype.
    """
    pair = 2 * hidden_size * intermediate_size * 4  # float32 bytes of one up and one down matrix
    copies = max(1, min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, 2 * _llc_bytes())) // pair)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = []
        for _ in range(copies):
            for shape in ((intermediate_size, hidden_size), (hidden_size, intermediate_size)):
                w = (torch.randn(shape, generator=g) / hidden_size**0.5).to(dtype)
                ws.append((w, prepack_weight(w)))
        weights[dtype] = ws
    times = {(dtype, rows): [] for dtype in weights for rows in PROBE_ROWS}
    with torch.inference_mode():
        inputs = {
            (dtype, rows, w.shape[1]): torch.randn(rows, w.shape[1], generator=g).to(dtype)
            for dtype, ws in weights.items()
            for w, _ in ws[:2]
            for rows in PROBE_ROWS
        }
        for i in range(repeats + 1):  # the first round warms up (oneDNN builds its kernels)
            for rows in PROBE_ROWS:
                for dtype in weights if i % 2 else reversed(list(weights)):
                    t0 = time.perf_counter()
                    for w, packed in weights[dtype]:
                        linear(inputs[(dtype, rows, w.shape[1])], w, None, packed)
                    if i:
                        times[(dtype, rows)].append(time.perf_counter() - t0)
    per_pass = {
        dtype: sum(statistics.median(times[(dtype, rows)]) for rows in PROBE_ROWS) / copies * 1e3 for dtype in weights
    }
    return {str(dtype).removeprefix("torch."): ms for dtype, ms in per_pass.items()}


def _read_cache(path: Path) -> dict:
    """The verdicts saved in ``path`` by key; ``{}`` for a missing or damaged file."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def probe_cpu_dtype(hidden_size: int, intermediate_size: int) -> ProbeResult:
    """float32 or bfloat16 for a model of this shape on this CPU: the cached verdict, or a new
    measurement (:func:`measure_ms`) saved to the cache. Call it only on a CPU with native bf16
    dot products (elsewhere bfloat16 matmuls are emulated and float32 is known to be faster).

    Raises:
        RuntimeError: the measurement failed (the caller falls back to the flags' rule).
    """
    path = cache_dir() / CACHE_FILE
    key = probe_key(hidden_size, intermediate_size)
    hit = _read_cache(path).get(key)
    if (
        isinstance(hit, dict)
        and hit.get("dtype") in ("float32", "bfloat16")
        and all(isinstance(hit.get(k), (int, float)) for k in ("float32_ms", "bfloat16_ms"))
    ):
        return ProbeResult(hit["dtype"], float(hit["float32_ms"]), float(hit["bfloat16_ms"]), True, str(path))
    ms = measure_ms(hidden_size, intermediate_size)
    result = ProbeResult(
        "bfloat16" if ms["bfloat16"] < ms["float32"] else "float32", ms["float32"], ms["bfloat16"], False, str(path)
    )
    entry = {k: v for k, v in asdict(result).items() if k not in ("cached", "path")}
    try:  # another process may write beside us: read again, add ours, replace atomically
        cache = {**_read_cache(path), key: entry}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: the verdict holds for this process
        logger.info("dtype probe: could not save %s (%s)", path, e)
    return result


def auto_dtype(config: EngineConfig, hf_config: Any) -> tuple[torch.dtype, str]:
    """What ``dtype="auto"`` means for an engine of ``config`` running a model shaped as
    ``hf_config`` (its ``hidden_size`` and ``intermediate_size``), and why: the flags' rule
    (:meth:`EngineConfig.auto_dtype`), except on a CPU with native bf16, where the probe decides
    (:func:`probe_cpu_dtype`) unless it is off (``KVSERVE_DTYPE_PROBE=0``), the model's shape is
    unknown, or it fails (then bfloat16, the reason naming the failure)."""
    dtype, why = config.auto_dtype()
    shape = [getattr(hf_config, k, None) for k in ("hidden_size", "intermediate_size")]
    if (
        dtype != torch.bfloat16
        or config.torch_device.type != "cpu"
        or not probe_enabled()
        or not all(isinstance(v, int) and v > 0 for v in shape)
    ):
        return dtype, why
    try:
        result = probe_cpu_dtype(*shape)
    except Exception as e:  # noqa: BLE001 - the probe is an optimisation: the flags' rule decides
        return dtype, f"{why}; the dtype probe failed ({type(e).__name__}: {e})"
    return getattr(torch, result.dtype), result.reason()
