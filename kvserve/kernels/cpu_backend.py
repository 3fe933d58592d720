"""The CPU attention backend: a C++ kernel that reads K/V in place through the block tables.

The torch backend gathers every decode row's K/V into a contiguous copy before SDPA; on CPU that
copy (``index_select``) cost as much as the attention itself. Here decode rows and short chunks
(query length <= :data:`MAX_KERNEL_QUERY_LEN`: decode, a chunked prefill's tail, speculative
verification) go to ``kvserve/kernels/csrc/paged_attention_cpu.cpp``: online softmax block by block
over the paged cache, the query heads of a KV head sharing each K/V read, (request, KV head)
pairs over ATen's thread pool. Longer prefill chunks keep the torch path, whose SDPA is a tiled
GEMM kernel that a per-query loop cannot beat. Sliding windows and logit soft-capping are
honoured by both.

The same library holds fused element-wise ops for the model's layers (:func:`rms_norm`,
:func:`add_rms_norm`, :func:`rotary`, :func:`silu_and_mul`; ``kvserve/kernels/csrc/fused_ops_cpu.cpp``),
which ``kvserve/engine/layers`` use on CPU in float32 and bfloat16 whenever the library loads
(:func:`use_fused_ops`). bfloat16 tensors are widened to float32 inside the kernels (scores,
softmax, accumulation, norms) and rounded once on store.

The kernels are compiled on first use (a one-time C++ build) with ``torch.utils.cpp_extension``
into ``$KVSERVE_CACHE/torch_extensions/<hash of source, torch version and CPU flags>`` and
loaded from there afterwards; ``make setup`` builds it (``python -m kvserve.kernels.cpu_backend``).
Without a C++ compiler, or if the build fails, the backend logs one warning and runs the torch
path for everything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from kvserve.kernels.backend import AttentionBackend, AttentionMetadata
from kvserve.kernels.torch_backend import FP8, paged_attention_torch, prefill_attention_torch, store_kv_torch

logger = logging.getLogger("kvserve.attention")

SOURCES = [
    Path(__file__).parent / "csrc" / n
    for n in (
        "paged_attention_cpu.cpp",
        "fused_ops_cpu.cpp",
        "int8_linear_cpu.cpp",
        "bf16_linear_cpu.cpp",
        "lora_cpu.cpp",
        "w4a16_linear_cpu.cpp",
        "f32_linear_cpu.cpp",
        "decode_layers_cpu.cpp",
    )
]
#: Compiler flags: -fno-trapping-math lets GCC vectorise loops with selects (``cpu_math.h``).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
#: Headers the sources include: part of the build folder's hash, so an edit rebuilds.
HEADERS = [Path(__file__).parent / "csrc" / n for n in ("cpu_math.h", "cpu_vec.h", "cpu_ops.h")]

#: Longest query slice the C++ kernel takes; longer prefill chunks run SDPA on gathered K/V.
MAX_KERNEL_QUERY_LEN = 16

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_load_error: str | None = None


def _cache_root() -> Path:
    """``kvserve.engine.model_loader.cache_dir()``'s rule (``kvserve/kernels/`` imports no engine code)."""
    env = os.environ.get("KVSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    """Where the compiled kernel lives: one folder per (source, torch version, CPU flags), since
    it is built with ``-march=native`` for this machine."""
    h = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode() + " ".join(CFLAGS).encode())
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    return _cache_root() / "torch_extensions" / f"kvserve_cpu_{h.hexdigest()[:16]}"


def _sources_in(build: Path) -> list[str]:
    """The sources as copies inside ``build`` (written once: the folder's name hashes their
    content), so every checkout of the same sources compiles the same paths: ninja rebuilds when
    a command line changes, and the paths of another clone's files would change it."""
    src = build / "src"
    src.mkdir(exist_ok=True)
    for p in SOURCES + HEADERS:
        dst = src / p.name
        if not dst.exists() or dst.read_bytes() != p.read_bytes():
            tmp = src / f".{p.name}.{os.getpid()}"
            tmp.write_bytes(p.read_bytes())
            os.replace(tmp, dst)
    return [str(src / p.name) for p in SOURCES]


LIBRARY = "kvserve_cpu_kernels"
#: Written in the build folder once a build there succeeded: its library is complete.
BUILT = "built"


def _load_built(build: Path) -> bool:
    """Load the library an earlier build left in ``build`` (True), without running
    ``torch.utils.cpp_extension.load``: that writes a ninja file naming this checkout's torch
    headers, so every clone (each with its own virtual environment) would compile again although
    the folder's name already pins the sources, flags, torch version and CPU. False when no
    complete build is there or it does not load (then it is built again)."""
    lib = build / f"{LIBRARY}.so"
    if not (build / BUILT).is_file() or not lib.is_file():
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError as exc:
        logger.info("cpu kernels in %s did not load (%s); building them again", build, exc)
        (build / BUILT).unlink(missing_ok=True)
        return False
    return True


def load_kernel() -> bool:
    """Compile (once per machine, cached) and load the C++ kernel into ``torch.ops.kvserve_cpu``.

    Returns True when the op is usable; False (after one warning, with the reason in
    :func:`kernel_error`) when there is no C++ compiler or the build fails. Thread-safe; across
    processes ``torch.utils.cpp_extension`` serialises builds of the same folder with a lock file.
    """
    global _loaded, _load_error
    with _lock:
        if _loaded is None:
            try:
                if shutil.which(os.environ.get("CXX", "c++")) is None:
                    raise RuntimeError("no C++ compiler (c++) on PATH")
                build = build_directory()
                if not _load_built(build):
                    from torch.utils.cpp_extension import load

                    build.mkdir(parents=True, exist_ok=True)
                    load(
                        name=LIBRARY,
                        sources=_sources_in(build),
                        build_directory=str(build),
                        extra_cflags=CFLAGS,
                        extra_ldflags=["-fopenmp"],
                        is_python_module=False,
                        verbose=False,
                    )
                    (build / BUILT).write_text(torch.__file__)
                _loaded = hasattr(torch.ops.kvserve_cpu, "paged_attention")
                if not _loaded:
                    raise RuntimeError("the library loaded but registered no kvserve_cpu.paged_attention op")
            except Exception as exc:  # noqa: BLE001 - any failure: fall back to the torch path
                _loaded, _load_error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                logger.warning("cpu attention kernel unavailable (%s); using the torch path", _load_error)
        return _loaded


#: Fused element-wise ops (``kvserve/kernels/csrc/fused_ops_cpu.cpp``) in the model's layers: on by
#: default where the kernels build; ``KVSERVE_CPU_FUSED_OPS=0`` keeps the ATen ops.
FUSED_OPS = os.environ.get("KVSERVE_CPU_FUSED_OPS", "1") != "0"


def kernels_ready() -> bool:
    """Whether the C++ library is loaded, building and loading it on the first call (see
    :func:`load_kernel`)."""
    return _loaded or (_loaded is None and load_kernel())


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether the layers should run :func:`rms_norm` & co. on ``x``: CPU float32 or bfloat16
    inference with the kernels built (the first call may build them, see :func:`load_kernel`)."""
    return (
        FUSED_OPS
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not torch.is_grad_enabled()
        and kernels_ready()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * (weight + offset)`` for float32 or bfloat16 ``x`` ``[N, H]`` and
    ``weight`` ``[H]`` in one pass (Zhang & Sennrich 2019); returns a new ``[N, H]`` tensor."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.kvserve_cpu.rms_norm(x, weight, out, eps, offset)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm decoder's fused add: ``residual += x`` **in place**, then
    ``(rms_norm(residual), residual)``; float32 or bfloat16 ``[N, H]`` (one dtype)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.kvserve_cpu.add_rms_norm(x, residual, weight, out, eps, offset)
    return out, residual


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ("rotate half" layout, Su et al. 2021) applied **in place** to float32 or bfloat16 ``q``
    ``[N, Hq, D]`` and ``k`` ``[N, Hk, D]`` (rows may be strided views) at int64 ``positions``
    ``[N]``, with float32 ``cos``/``sin`` caches ``[max_position, D]``; returns ``(q, k)``."""
    torch.ops.kvserve_cpu.rotary(q, k, positions, cos, sin)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(x[:, :I]) * x[:, I:]`` for float32 or bfloat16 ``x`` ``[N, 2I]`` -> ``[N, I]``
    (computed in float32, ``silu(g) = g / (1 + exp(-g))``, Elfwing et al. 2018)."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    torch.ops.kvserve_cpu.silu_and_mul(x, out)
    return out


#: The decode step's layer loop in C++ (:func:`decode_layers`): on by default where the kernels
#: build; ``KVSERVE_CPU_DECODE_LAYERS=0`` runs the layers op by op from Python (an A/B switch).
DECODE_LAYERS = os.environ.get("KVSERVE_CPU_DECODE_LAYERS", "1") != "0"
#: Most decode rows (requests) :func:`decode_layers` takes: its matmuls are the GEMVs' (8 rows).
DECODE_LAYERS_ROWS = 8


def use_decode_layers(h: torch.Tensor) -> bool:
    """Whether a decode step's hidden states ``h`` ``[M, H]`` may go through :func:`decode_layers`
    (the caller checks the model's side: plain weights, the CPU attention kernel): at most
    :data:`DECODE_LAYERS_ROWS` rows, bfloat16 at most :func:`bf16_gemv_rows`."""
    return (
        DECODE_LAYERS
        and h.dim() == 2
        and h.shape[0] <= DECODE_LAYERS_ROWS
        and use_fused_ops(h)
        and hasattr(torch.ops.kvserve_cpu, "decode_layers")
        and (h.dtype != torch.bfloat16 or h.shape[0] <= bf16_gemv_rows())
    )


def decode_layers(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    weights: list[torch.Tensor],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step through Llama-family decoder layers in one C++ call
    (``kvserve/kernels/csrc/decode_layers_cpu.cpp``): the same kernels, in the same order, as the layers'
    modules run them one by one (so the same bits), without ~11 Python-dispatched ops per layer.

    Args:
        h: float32 or bfloat16 ``[M, H]``, the hidden states entering the first layer, one row per
            request (``M <= DECODE_LAYERS_ROWS``; every query one token long).
        residual: ``[M, H]``, updated in place; None for the first stage's first layer (then
            ``h`` is the residual and is updated in place, as the modules do).
        positions: int64 ``[M]``.
        weights: per layer, in order: input norm ``[H]``, qkv weight ``[Q + 2 KV, H]``, qkv bias
            (an empty tensor: none), o weight ``[H, Q]``, post-attention norm ``[H]``, gate_up
            weight ``[2 I, H]``, down weight ``[H, I]``, q norm and k norm ``[head_dim]`` (empty
            tensors: none; Qwen3's per-head norms); all contiguous, ``h``'s dtype.
        k_caches, v_caches: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            ``h``'s dtype.
        meta: the step's metadata (``slot_mapping``, ``block_tables``, ``seq_lens``, ``cu_seqlens_q``).
        cos, sin: float32 ``[max_position, head_dim]`` RoPE tables.
        eps: the RMSNorm epsilon; scale: the attention's softmax scale.

    Returns:
        ``(out, residual)``: the last layer's MLP output ``[M, H]`` and the residual stream.

    Raises:
        RuntimeError: shapes, dtypes or slots the op's checks refuse.
    """
    first = residual is None
    if first:
        residual = h
    reqs = meta.__dict__.get("_cpu_all_reqs")
    if reqs is None:
        reqs = meta.__dict__["_cpu_all_reqs"] = torch.arange(meta.num_reqs, dtype=torch.long)
    out = torch.empty_like(h)
    torch.ops.kvserve_cpu.decode_layers(
        h,
        residual,
        out,
        positions,
        weights,
        k_caches,
        v_caches,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        reqs,
        meta.slot_mapping,
        cos,
        sin,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        scale,
        first,
    )
    return out, residual


#: Most activation rows the int8 GEMV kernel takes; larger batches dequantize the weight.
INT8_GEMV_ROWS = 8
#: float32 copies of a compressed (int8 or bf16) weight for large batches, one per shape, reused.
_weight_scratch: dict[tuple[int, int], torch.Tensor] = {}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., K]`` as ``[M, K]`` with contiguous rows (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _float32_weight_buffer(shape: torch.Size) -> torch.Tensor:
    """The reused float32 ``[N, K]`` buffer a compressed weight of ``shape`` is widened into."""
    w = _weight_scratch.get(tuple(shape))
    if w is None:
        w = _weight_scratch[tuple(shape)] = torch.empty(shape, dtype=torch.float32)
    return w


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only int8 linear (W8A32): ``x`` float32 ``[..., K]`` times ``qweight`` int8
    ``[N, K]`` scaled per row by ``scale`` float32 ``[N]``, plus ``bias`` -> float32 ``[..., N]``.
    Up to :data:`INT8_GEMV_ROWS` rows: the C++ GEMV that reads the int8 rows directly (decode is
    bound by weight bytes); more rows: the weight is dequantized into a reused float32 buffer and
    multiplied by oneDNN (compute-bound there). Needs the kernels (:func:`load_kernel`)."""
    x2, n = _rows(x), qweight.shape[0]
    if x2.shape[0] <= INT8_GEMV_ROWS:
        y = torch.empty((x2.shape[0], n), dtype=torch.float32)
        torch.ops.kvserve_cpu.int8_gemv(x2, qweight, scale, bias, y)
    else:
        w = _float32_weight_buffer(qweight.shape)
        torch.ops.kvserve_cpu.int8_dequant(qweight, scale, w)
        y = torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")
    return y.view(*x.shape[:-1], n)


#: Most activation rows the 4-bit GEMV takes; larger batches widen the weight to float32.
W4A16_GEMV_ROWS = 8


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """4-bit weight linear (``kvserve/kernels/csrc/w4a16_linear_cpu.cpp``): ``x`` ``[..., K]`` (float32 or
    bfloat16) times the weight ``w[n, k] = q[n, k] * scales[n, g] - szeros[n, g]`` (``qweight``
    uint8 ``[N, K/2]`` in ``kvserve.engine.layers.w4a16``'s layout, ``scales`` / ``szeros`` float32
    ``[N, K / group_size]``), plus ``bias`` -> ``[..., N]`` in ``x.dtype``, float32 arithmetic.
    Up to :data:`W4A16_GEMV_ROWS` rows: the GEMV that widens the nibbles as it reads them (decode is
    bound by weight bytes, an eighth of float32's); more rows: the weight is widened into a
    reused float32 buffer and multiplied by oneDNN (compute-bound there). Needs the kernels
    (:func:`load_kernel`)."""
    x2, n = _rows(x), qweight.shape[0]
    xf = x2 if x2.dtype == torch.float32 else x2.float()
    b = None if bias is None else bias.float()
    if xf.shape[0] <= W4A16_GEMV_ROWS:
        y = torch.empty((xf.shape[0], n), dtype=torch.float32)
        torch.ops.kvserve_cpu.w4a16_gemv(xf, qweight, scales, szeros, group_size, b, y)
    else:
        w = _float32_weight_buffer(torch.Size((n, qweight.shape[1] * 2)))
        torch.ops.kvserve_cpu.w4a16_dequant(qweight, scales, szeros, group_size, w)
        y = torch.ops.mkldnn._linear_pointwise(xf, w, b, "none", [], "")
    return y.to(x.dtype).view(*x.shape[:-1], n)


#: Most activation rows the float32 GEMV takes (larger batches are compute-bound: oneDNN).
F32_GEMV_ROWS = 8


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 for at most :data:`F32_GEMV_ROWS` rows of ``x``
    ``[..., K]`` (``weight`` contiguous ``[N, K]``, ``bias`` ``[N]``) -> ``[..., N]``: the C++
    GEMV (``kvserve/kernels/csrc/f32_linear_cpu.cpp``) that streams each weight row once for all rows,
    where a decode step is bound by reading the weights. Needs the kernels (:func:`load_kernel`).

    Raises:
        RuntimeError: more rows, or another dtype or layout (the op's checks).
    """
    x2, n = _rows(x), weight.shape[0]
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    torch.ops.kvserve_cpu.f32_gemv(x2, weight, bias, y)
    return y.view(*x.shape[:-1], n)


#: Most activation rows the bf16-weight GEMV takes; larger batches widen the weight to float32.
BF16_GEMV_ROWS = 8
_bf16_gemv_rows: int | None = None


def bf16_gemv_rows() -> int:
    """The most rows a bfloat16 matmul is given to the bf16 GEMV rather than to oneDNN (decided
    by the compiled kernel, ``bf16_linear_cpu.cpp``, which says why: :data:`BF16_GEMV_ROWS`, with or
    without native bf16); 0 where the kernels do not load."""
    global _bf16_gemv_rows
    if _bf16_gemv_rows is None:
        ok = load_kernel() and hasattr(torch.ops.kvserve_cpu, "bf16_gemv_rows")
        _bf16_gemv_rows = int(torch.ops.kvserve_cpu.bf16_gemv_rows()) if ok else 0
    return _bf16_gemv_rows


def bf16_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for bfloat16 ``x`` ``[..., K]``, ``weight`` ``[N, K]`` and
    ``bias`` ``[N]``: float32 accumulation of exact bf16 products, result rounded to bfloat16
    ``[..., N]``. Up to :data:`BF16_GEMV_ROWS` rows (decode, on any CPU): the C++ GEMV that reads
    each weight row once for all rows (small batches are bound by weight bytes, half float32's),
    with avx512_bf16's dot products where the CPU has them, else widening each weight vector to
    float32 as it reads it. More rows (a CPU without native bf16, where oneDNN refuses bf16 and
    ATen emulates it): the weight is widened into a reused float32 buffer and the matmul runs in
    oneDNN float32 (compute-bound there). Needs the kernels (:func:`load_kernel`)."""
    x2, n = _rows(x), weight.shape[0]
    if x2.shape[0] <= BF16_GEMV_ROWS:
        y = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
        torch.ops.kvserve_cpu.bf16_gemv(x2, weight, bias, y)
    else:
        w = _float32_weight_buffer(weight.shape)
        torch.ops.kvserve_cpu.bf16_widen(weight, w)
        b = None if bias is None else bias.float()
        y = torch.ops.mkldnn._linear_pointwise(x2.float(), w, b, "none", [], "").to(torch.bfloat16)
    return y.view(*x.shape[:-1], n)


def use_lora_kernel() -> bool:
    """Whether ``kvserve/kernels/csrc/lora_cpu.cpp`` (:func:`lora_sgmv`) is usable (:func:`kernels_ready`)."""
    return kernels_ready() and hasattr(torch.ops.kvserve_cpu, "lora_sgmv")


def lora_sgmv(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b_t: list[torch.Tensor],
    order: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Batched multi-LoRA, float32, in place (``kvserve/kernels/csrc/lora_cpu.cpp``): for each group
    ``g`` of rows ``order[starts[g]:starts[g + 1]]`` (int64) with adapter slot ``slots[g]``,
    ``y[row, part p] += (a[slot] @ x[row])[p * rank:(p + 1) * rank] @ b_t[p][slot]``.
    ``x`` ``[T, in]``, ``y`` ``[T, sum n_p]``, ``a`` ``[slots, parts * rank, in]``, ``b_t[p]``
    ``[slots, rank, n_p]``. Needs the kernels (:func:`use_lora_kernel`).

    Raises:
        RuntimeError: wrong dtypes, shapes or indices (the kernel's checks).
    """
    torch.ops.kvserve_cpu.lora_sgmv(_rows(x), y, a, b_t, order, starts, slots)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 quantization of ``weight`` ``[N, K]``: ``(q int8 [N, K],
    scale float32 [N])`` with ``scale = max|row| / 127`` and ``q = round(weight / scale)``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def kernel_error() -> str | None:
    """Why :func:`load_kernel` failed (None: it did not, or was not tried)."""
    return _load_error


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` float32 or bfloat16 ``[num_tokens, num_heads, head_dim]`` over
    the paged cache (``q``'s dtype, or float8 e4m3 read as ``value * k_scale`` / ``v_scale``; ``[num_blocks,
    block_size, num_kv_heads, head_dim]``): requests with a query
    length <= :data:`MAX_KERNEL_QUERY_LEN` in the C++ kernel, the rest through
    :func:`kvserve.kernels.torch_backend.paged_attention_torch`. Same contract as that function
    (``window``, ``softcap``, returns ``[num_tokens, num_heads, head_dim]``).

    With a float8 cache and ``key`` / ``value`` given (this step's K/V), every chunk of >= 2
    tokens takes the torch path, which attends to the chunk's own tokens through them (see
    :func:`kvserve.kernels.torch_backend.prefill_attention_torch`); the C++ kernel, which reads the
    cache only, then gets the decode rows alone.

    Raises:
        ValueError: a ``window`` < 1 or a ``softcap`` <= 0.
    """
    AttentionBackend.check_window_softcap(window, softcap)
    fresh = key is not None and value is not None and k_cache.dtype == FP8
    longest = 1 if fresh else MAX_KERNEL_QUERY_LEN  # longest query the C++ kernel takes
    plans = meta.__dict__.setdefault("_cpu_short", {})
    short = plans.get(longest)
    if short is None:  # computed once per step (every layer shares meta)
        idx = [i for i, n in enumerate(meta.query_lens_cpu) if n <= longest]
        short = plans[longest] = (torch.tensor(idx, dtype=torch.long), len(idx) == len(meta.query_lens_cpu))
    reqs, all_short = short
    q = q.contiguous()
    out = torch.empty_like(q)
    if not all_short:  # longer prefill chunks: SDPA over their gathered K/V
        prefill_attention_torch(
            q,
            k_cache,
            v_cache,
            meta,
            scale,
            window,
            softcap,
            out,
            min_query_len=longest + 1,
            k_scale=k_scale,
            v_scale=v_scale,
            key=key if fresh else None,
            value=value if fresh else None,
        )
    if reqs.numel():
        torch.ops.kvserve_cpu.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            reqs,
            out,
            scale,
            window or 0,
            float(softcap or 0.0),
            float(k_scale),
            float(v_scale),
        )
    return out


class CpuBackend(AttentionBackend):
    """:func:`paged_attention_cpu` and the torch ``store_kv`` (``index_copy_``), float32 or
    bfloat16 on CPU (a bfloat16 cache is half float32's bytes per block).
    Falls back to the torch path entirely when the kernel cannot be built (see the module
    docstring)."""

    name = "cpu"
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16)
    supports_fp8_kv = True
    exact_chunk_kv = True

    def __init__(self):
        self.kernel = load_kernel()

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.kernel:
            return paged_attention_torch(
                q, k_cache, v_cache, meta, scale, window, softcap, k_scale, v_scale, key=key, value=value
            )
        return paged_attention_cpu(
            q, k_cache, v_cache, meta, scale, window, softcap, k_scale, v_scale, key=key, value=value
        )


if __name__ == "__main__":  # `python -m kvserve.kernels.cpu_backend`: build (or find) the kernel now
    logging.basicConfig(level=logging.INFO)
    ok = load_kernel()
    print(
        f"cpu attention kernel: {'ready in ' + str(build_directory()) if ok else 'unavailable: ' + str(kernel_error())}"
    )
    raise SystemExit(0 if ok else 1)
