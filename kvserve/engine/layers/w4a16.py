"""4-bit weight checkpoints (W4A16): GPTQ, AWQ and compressed-tensors ``pack-quantized``, read as
they are stored and kept 4-bit in memory.

Formats (detected from ``config.json``'s ``quantization_config``, as vLLM does; :func:`w4a16_config`):

* ``compressed-tensors`` with ``format: pack-quantized`` (what llmcompressor writes for its GPTQ
  and AWQ W4A16 recipes): ``weight_packed`` int32 ``[N, K/8]`` (value ``k`` in bits ``4 (k % 8)``
  of word ``k // 8``, stored as ``int4 + 8``), ``weight_scale`` ``[N, G]``, ``weight_shape``,
  ``weight_zero_point`` ``[N/8, G]`` packed along the rows (asymmetric), ``weight_g_idx`` ``[K]``
  (``actorder: group``); group or channel strategy. ``w = (q - z) * s``.
* ``gptq`` (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K/8, N]`` packed along K, ``qzeros``
  int32 ``[G, N/8]`` packed along N (stored minus one unless ``checkpoint_format: gptq_v2``),
  ``scales`` ``[G, N]``, ``g_idx`` ``[K]`` (the group of each input column; act-order,
  ``desc_act``, when it is not ``k // group_size``).
* ``awq`` (AutoAWQ, ``version: gemm``): ``qweight`` int32 ``[K, N/8]`` packed along N with the
  nibbles of a word in the order 0, 2, 4, 6, 1, 3, 5, 7, ``qzeros`` ``[G, N/8]`` likewise,
  ``scales`` ``[G, N]``.

Every format becomes one layout (:class:`W4Weight`, what the kernels read): ``qweight`` uint8
``[N, K/2]`` in blocks of 32 values per 16 bytes (byte ``b`` holds value ``b`` in its low nibble and
``16 + b`` in its high one), ``scales`` and ``szeros = scale * zero`` float32 ``[N, K/gs]``; an
act-order checkpoint's columns are sorted by group at load (``perm``; the activations are gathered
to match, as vLLM's exllama/Marlin shuffle does). The matmuls: ``kvserve/kernels/csrc/w4a16_linear_cpu.cpp``
on CPU (GEMV up to 8 rows that widens nibbles in its inner loop; larger batches widen the weight
into a reused float32 buffer for oneDNN), ``kvserve/kernels/triton_w4a16.py`` on CUDA, and
:func:`w4a16_reference` (torch) where neither runs.

Tensor parallelism: column-parallel layers take their rows; row-parallel layers take their input
columns, which must fall on 32-value blocks; where a rank's share does not fall on group
boundaries (SmolLM2's 576 inputs over 2 ranks with groups of 64), the scales are repeated per
32-value block first, so every rank still reads 4 bits per weight. An act-order checkpoint's
row-parallel layers cannot be split (their groups are scattered over the input columns) and are
refused with tensor_parallel_size > 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

#: Values per packed block (16 bytes); group sizes and K must be multiples of it.
BLOCK = 32
#: ``EngineConfig.quantization`` names of the 4-bit checkpoint formats (vLLM's).
W4_METHODS = ("awq", "gptq", "compressed-tensors")
#: Checkpoint tensor names a 4-bit linear layer receives, per format.
W4_PARAMS = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
#: Every format's names: what a linear layer keeps for :func:`decode_checkpoint_tensors`.
W4_TENSORS = frozenset(name for names in W4_PARAMS.values() for name in names)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class W4A16Config:
    """A 4-bit checkpoint's quantization, from its ``quantization_config``.

    Attributes:
        method: ``"compressed-tensors"``, ``"gptq"`` or ``"awq"``.
        group_size: input columns per scale; None: one scale per output row (channel).
        symmetric: zero point fixed at 8 (no zero-point tensor).
        act_order: the checkpoint has a ``g_idx`` that is not ``k // group_size`` (GPTQ
            ``desc_act``, compressed-tensors ``actorder: group``); decided per layer at load.
        zeros_minus_one: GPTQ v1's ``qzeros`` are stored minus one.
        ignore: module names (Hugging Face, e.g. ``lm_head``) that stay float.
    """

    method: str
    group_size: int | None
    symmetric: bool
    act_order: bool
    zeros_minus_one: bool = False
    ignore: tuple[str, ...] = ()


def checkpoint_quantization(hf_config) -> str | None:
    """The ``quant_method`` of a Hugging Face config (``"gptq"``, ``"awq"``,
    ``"compressed-tensors"``, or another method's name), or None for a float checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return str(qc.get("quant_method", "unknown")).replace("_", "-")


def resolve_quantization(requested: str | None, hf_config) -> str | None:
    """The quantization an engine runs for ``EngineConfig.quantization = requested`` on a
    checkpoint with ``hf_config``: the checkpoint's own method when one is stored (checked with
    :func:`w4a16_config`) and ``requested`` is None or names it, as vLLM auto-detects;
    ``requested`` for a float checkpoint.

    Raises:
        ValueError: ``requested`` differs from the checkpoint's method (int8/fp8 on an already
            quantized checkpoint, or another 4-bit format), a 4-bit method for a float
            checkpoint, or a stored method kvserve does not run.
    """
    stored = checkpoint_quantization(hf_config)
    if stored is None:
        if requested in W4_METHODS:
            raise ValueError(
                f"quantization={requested!r} needs a {requested} checkpoint, and this model has no "
                "quantization_config: kvserve reads 4-bit checkpoints, it does not make them "
                "(llmcompressor does; benchmarks/quant_checkpoints.py shows how)"
            )
        return requested
    w4a16_config(hf_config)  # raises for what is not supported
    if requested is not None and requested != stored:
        raise ValueError(
            f"quantization={requested!r} does not match the checkpoint's quantization_config "
            f"({stored!r}); leave it unset to use the checkpoint's"
        )
    return stored


def prepare_w4a16(model: torch.nn.Module, cfg: W4A16Config, act_dtype: torch.dtype) -> None:
    """Tell every linear layer of ``model`` (those with ``w4_config``) that the checkpoint is 4-bit
    (``cfg``) and what dtype its activations have; layers whose checkpoint tensors arrive
    float (the format's ignore list) stay float."""
    for m in model.modules():
        if hasattr(m, "w4_config"):
            m.w4_config, m.act_dtype = cfg, act_dtype


def w4a16_config(hf_config) -> W4A16Config:
    """Parse and check a 4-bit checkpoint's ``quantization_config``.

    Raises:
        ValueError: what kvserve does not run, named: another bit width, quantized
            activations (W4A8, W8A8), a compressed-tensors format other than
            ``pack-quantized``, a strategy other than group or channel, a group size that is not
            a multiple of 32, a quantized LM head, AWQ layouts other than GEMM.
    """
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = checkpoint_quantization(hf_config)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(
                f"compressed-tensors checkpoint with {len(groups)} config groups: one group "
                "(the same scheme for every linear layer) is supported"
            )
        (group,) = groups.values()
        w, acts = group.get("weights") or {}, group.get("input_activations")
        fmt = group.get("format") or qc.get("format")
        if acts:
            raise ValueError(
                "compressed-tensors checkpoint quantizes activations too "
                f"({acts.get('num_bits')}-bit); kvserve runs weight-only W4A16"
            )
        if fmt != "pack-quantized":
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported: kvserve loads pack-quantized "
                "(llmcompressor's W4A16 GPTQ/AWQ output)"
            )
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            raise ValueError(
                f"compressed-tensors weights of {w.get('num_bits')} bits ({w.get('type')}): "
                "kvserve loads 4-bit integer weights"
            )
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors strategy {strategy!r}: group and channel are supported")
        if "lm_head" not in (qc.get("ignore") or []) and "Linear" in (group.get("targets") or []):
            raise ValueError("a 4-bit LM head is not supported: quantize with ignore=['lm_head']")
        gs = w.get("group_size") if strategy == "group" else None
        return _checked(
            W4A16Config(
                "compressed-tensors",
                gs,
                bool(w.get("symmetric", True)),
                w.get("actorder") == "group",
                ignore=tuple(qc.get("ignore") or ()),
            )
        )
    if method == "gptq":
        if qc.get("bits") != 4:
            raise ValueError(f"GPTQ checkpoint of {qc.get('bits')} bits: kvserve loads 4-bit GPTQ")
        if qc.get("lm_head"):
            raise ValueError("GPTQ checkpoint with a quantized LM head (lm_head: true) is not supported")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r}: gptq and gptq_v2 are supported")
        gs = qc.get("group_size", 128)
        return _checked(
            W4A16Config(
                "gptq",
                None if gs in (-1, None) else gs,
                bool(qc.get("sym", True)),
                bool(qc.get("desc_act", False)),
                zeros_minus_one=fmt == "gptq",
            )
        )
    if method == "awq":
        if qc.get("bits", qc.get("w_bit")) != 4:
            raise ValueError(f"AWQ checkpoint of {qc.get('bits', qc.get('w_bit'))} bits: kvserve loads 4-bit AWQ")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version!r}: the GEMM layout is supported (GEMV, Marlin and exllama layouts are not)"
            )
        gs = qc.get("group_size", qc.get("q_group_size", 128))
        return _checked(
            W4A16Config(
                "awq",
                None if gs in (-1, None) else gs,
                not qc.get("zero_point", True),
                False,
                ignore=tuple(qc.get("modules_to_not_convert") or ()),
            )
        )
    raise ValueError(
        f"quantization method {method!r} in the checkpoint is not supported: kvserve loads "
        f"{', '.join(W4_METHODS)} (4-bit weights) and quantizes float checkpoints with int8 / fp8"
    )


def _checked(cfg: W4A16Config) -> W4A16Config:
    if cfg.group_size is not None and (cfg.group_size <= 0 or cfg.group_size % BLOCK):
        raise ValueError(f"group size {cfg.group_size}: kvserve's 4-bit kernels need a multiple of {BLOCK}")
    return cfg


@dataclass
class W4Weight:
    """One layer's (one rank's) 4-bit weight in the kernels' layout (module docstring).

    Attributes:
        qweight: uint8 ``[N, K/2]``.
        scales: float32 ``[N, K/group_size]``.
        szeros: float32 ``[N, K/group_size]``, scale times zero point.
        group_size: input columns per scale (a multiple of 32 dividing K).
        perm: int64 ``[K]`` or None: the input columns in the order the weight's columns were
            sorted into (act-order); ``x[..., perm]`` is what multiplies the weight.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    szeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight it stands for."""
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def nbytes(self) -> int:
        """Bytes held (weights, scales, zero points, permutation)."""
        return sum(
            t.numel() * t.element_size() for t in (self.qweight, self.scales, self.szeros, self.perm) if t is not None
        )

    def to(self, device: torch.device) -> "W4Weight":
        return W4Weight(
            *(t.to(device) if t is not None else None for t in (self.qweight, self.scales, self.szeros)),
            self.group_size,
            None if self.perm is None else self.perm.to(device),
        )


def pack_w4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 ``[N, K]`` (K a multiple of 32) -> the kernels' uint8 ``[N, K/2]``."""
    n, k = codes.shape
    blocks = codes.reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_w4`: uint8 ``[N, K/2]`` -> uint8 values ``[N, K]``."""
    n, half = qweight.shape
    b = qweight.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


def w4a16_reference(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The 4-bit matmul in plain torch (float32 arithmetic): ``x`` ``[..., K]`` -> ``[..., N]`` in
    ``x.dtype``. Widens the whole weight per call: the fallback where no kernel runs, and the
    tests' reference."""
    n, k = w.shape
    q = unpack_w4(w.qweight).float().reshape(n, -1, w.group_size)
    dense = (q * w.scales[..., None] - w.szeros[..., None]).reshape(n, k)
    xf = x.float() if w.perm is None else x.float()[..., w.perm]
    y = xf @ dense.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- reading the checkpoint formats -------------------------------------------------------------


def _unpack_int32(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 ``[..., m]`` -> uint8 ``[..., 8 m]``: value ``8 j + order[i]`` from nibble ``i`` of word ``j``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = ((packed.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.uint8)  # [..., m, 8]: nibble i
    inv = [order.index(v) for v in range(8)]
    return nib[..., inv].reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def decode_checkpoint_tensors(
    cfg: W4A16Config, t: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One linear layer's full checkpoint tensors -> ``(codes uint8 [N, K] 0..15, scales float32
    [N, G], zeros float32 [N, G], g_idx int64 [K] or None)`` with ``w = (codes - zeros) * scales``
    (``N``, ``K`` read from the tensors; ``g_idx`` None unless the columns are act-ordered).

    Raises:
        ValueError: a tensor is missing or the shapes do not fit together.
    """
    need = {
        "compressed-tensors": ("weight_packed", "weight_scale"),
        "gptq": ("qweight", "qzeros", "scales"),
        "awq": ("qweight", "qzeros", "scales"),
    }[cfg.method]
    missing = [p for p in need if p not in t]
    if missing:
        raise ValueError(f"4-bit layer without {', '.join(missing)} in the checkpoint")
    if cfg.method == "compressed-tensors":
        packed = t["weight_packed"]
        n, k = (
            [int(v) for v in t["weight_shape"].tolist()]
            if "weight_shape" in t
            else (packed.shape[0], packed.shape[1] * 8)
        )
        codes = _unpack_int32(t["weight_packed"])[:, :k]
        scales = t["weight_scale"].float().reshape(n, -1)
        if "weight_zero_point" in t:
            zp = t["weight_zero_point"]
            zeros = (
                _unpack_int32(zp.t().contiguous())[:, :n].t().float() if zp.dtype == torch.int32 else zp.float() + 8
            )  # an unpacked (int8) zero point is signed
        else:
            zeros = torch.full_like(scales, 8.0)
        g_idx = t.get("weight_g_idx")
    elif cfg.method == "gptq":
        k, n = t["qweight"].shape[0] * 8, t["qweight"].shape[1]
        codes = _unpack_int32(t["qweight"].t().contiguous()).reshape(n, k)  # [N, K/8] words -> [N, K]
        scales = t["scales"].float().t().contiguous()
        zeros = _unpack_int32(t["qzeros"])[:, :n].t().float() + (1 if cfg.zeros_minus_one else 0)
        g_idx = t.get("g_idx")
    else:
        k, n = t["qweight"].shape[0], t["qweight"].shape[1] * 8
        codes = _unpack_int32(t["qweight"], _AWQ_ORDER)[:, :n].t().contiguous()  # [K, N] -> [N, K]
        scales = t["scales"].float().t().contiguous()
        zeros = _unpack_int32(t["qzeros"], _AWQ_ORDER)[:, :n].t().float()
        g_idx = None
    if codes.shape != (n, k):
        raise ValueError(f"4-bit weight of shape {tuple(codes.shape)} != ({n}, {k})")
    if scales.shape[0] != n or zeros.shape != scales.shape or k % scales.shape[1]:
        raise ValueError(
            f"4-bit scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit a [{n}, {k}] weight"
        )
    gs = k // scales.shape[1]
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if torch.equal(g_idx, torch.arange(k) // gs):
            g_idx = None  # not act-order after all
    return codes.to(torch.uint8), scales, zeros, g_idx


def build_w4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    cols: tuple[int, int] | None = None,
) -> W4Weight:
    """The kernels' :class:`W4Weight` from decoded ``codes`` ``[N, K]``, ``scales`` / ``zeros``
    ``[N, G]`` and an act-order ``g_idx`` ``[K]``, keeping input columns ``cols = [start, end)``
    (a row-parallel rank's share; None: all).

    Raises:
        ValueError: K or the share is not on 32-value blocks; an act-order layer split by columns;
            an act-order ``g_idx`` whose groups are not all ``group_size`` columns.
    """
    n, k = codes.shape
    gs = k // scales.shape[1]
    perm = None
    if g_idx is not None:
        if cols is not None and cols != (0, k):
            raise ValueError(
                "an act-order (desc_act / actorder=group) checkpoint's row-parallel layers cannot be "
                "split over tensor-parallel ranks: use tensor_parallel_size 1 or a static-order "
                "checkpoint"
            )
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(k) // gs):
            raise ValueError("act-order g_idx whose groups are not all group_size columns")
        codes = codes[:, perm]
    if cols is not None and cols != (0, k):
        s, e = cols
        if s % BLOCK or e % BLOCK:
            raise ValueError(f"input columns [{s}, {e}) of a 4-bit layer are not on {BLOCK}-value blocks")
        if s % gs or e % gs:  # the share cuts groups: one scale per 32-value block
            scales, zeros = (t.repeat_interleave(gs // BLOCK, dim=1) for t in (scales, zeros))
            gs = BLOCK
        codes, scales, zeros = codes[:, s:e], scales[:, s // gs : e // gs], zeros[:, s // gs : e // gs]
        k = e - s
    if k % BLOCK or gs % BLOCK:
        raise ValueError(f"a 4-bit layer of {k} input columns in groups of {gs}: both must be multiples of {BLOCK}")
    scales = scales.contiguous().float()
    return W4Weight(pack_w4(codes.contiguous()), scales, (scales * zeros.float()).contiguous(), gs, perm)


def w4a16_linear(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for a 4-bit ``w``: ``x`` ``[..., K]`` (float32, bfloat16 or float16) ->
    ``[..., N]`` in ``x.dtype``, float32 accumulation. CPU: the C++ kernels
    (``kvserve.kernels.cpu_backend.w4a16_linear``); CUDA: Triton (``kvserve.kernels.triton_w4a16``); else, or
    without them, :func:`w4a16_reference`."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    if x.device.type == "cpu":
        from kvserve.kernels import cpu_backend

        if cpu_backend.kernels_ready():  # no lock once loaded: this runs per layer per step
            return cpu_backend.w4a16_linear(x, w.qweight, w.scales, w.szeros, w.group_size, bias)
    elif x.device.type == "cuda":
        from kvserve.kernels import triton_w4a16

        if triton_w4a16.available():
            return triton_w4a16.w4a16_matmul(x, w.qweight, w.scales, w.szeros, w.group_size, bias)
    return w4a16_reference(x, dataclasses.replace(w, perm=None), bias)  # x is gathered already
