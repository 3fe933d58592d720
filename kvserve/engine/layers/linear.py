"""Tensor-parallel linear layers (Megatron-LM column/row parallelism).

Weights follow ``torch.nn.Linear``: ``[out_features, in_features]``. Each layer keeps only
its rank's shard and knows how to cut a full Hugging Face tensor into it (``load``).

Every matmul of the model goes through :func:`linear`. On CPU (inference, float32 or
bfloat16) the layers' weights are also **prepacked** once at load (:meth:`ColumnParallelLinear.prepack`:
oneDNN's blocked layout for a 64-row batch, ``torch.ops.mkldnn._reorder_linear_weight``), so a
step's matmuls do not re-layout the weight on every call, as vLLM's CPU path and inductor's
frozen linears do. Which library runs a CPU matmul is what ``benchmarks/cpu_linear.py``
measures per shape (GFLOP/s of each library at 1 to 2,048 rows):

* float32, up to :data:`F32_GEMV_ROWS` rows (decode), the LM head included: kvserve's GEMV
  (``kvserve.kernels.cpu_backend.f32_linear``), which streams each weight row once; oneDNN's prepacked
  layout suits 64-row batches and read SmolLM2's weights at 11-21 GB/s of ~28 at batch 1
  (``benchmarks/batch1.py`` measures the decode). The LM head went to oneDNN until the weights
  moved to huge pages (``kvserve/engine/huge_pages.py``), which oneDNN's own copy is not on: SmolLM2's
  float32 decode then ran 54 tok/s with its LM head on oneDNN and 63 on the GEMV (a one-off
  probe on a 2-core Zen 4 EPYC, 8 interleaved repeats, medians);
* up to :data:`ATEN_MIN_ROWS` - 1 rows (decode, short chunks): oneDNN with the prepacked weight,
  ahead of plain oneDNN and of ATen at these sizes;
* from :data:`ATEN_MIN_ROWS` rows (prefill chunks): on a CPU without AVX-512, ATen's
  ``F.linear`` (MKL sgemm, as wide as oneDNN there; the two are level within run-to-run noise at
  these sizes); with AVX-512, oneDNN's prepacked weight (MKL takes an AVX2 path on AMD CPUs,
  while oneDNN uses AVX-512).

float32 results are IEEE float32 either way (they differ only in summation order).
bfloat16, up to ``kvserve.kernels.cpu_backend.bf16_gemv_rows()`` rows (decode; 8, with or without native
bf16: ``kvserve/kernels/csrc/bf16_linear_cpu.cpp`` has the probe), on any CPU: kvserve's bf16 GEMV
(``kvserve.kernels.cpu_backend.bf16_weight_linear``; avx512_bf16 dot products where the CPU has them, else
float32 math on weights widened as they are read).
bfloat16 prepacking needs native bf16 (``avx512_bf16``/AMX, or ``avx_ne_convert``): larger bf16
batches run oneDNN's bf16 matmul there. On a CPU without it (oneDNN refuses bf16 there and ATen
emulates it, far slower than float32), bfloat16 weights stay bfloat16 and the arithmetic is
float32 (the weight widened into a float32 buffer for oneDNN above 8 rows), so
``dtype="bfloat16"`` there halves the weight and KV bytes and costs float32's matmul rate.
``KVSERVE_CPU_LINEAR=aten`` turns prepacking and oneDNN off (ATen everywhere).

Quantized weights (int8, float8) and their matmuls are in ``kvserve.engine.layers.quantization``; 4-bit
checkpoints (GPTQ, AWQ, compressed-tensors) in ``kvserve.engine.layers.w4a16``: a layer given
``w4_config`` (:func:`kvserve.engine.layers.w4a16.prepare_w4a16`) takes the checkpoint's packed tensors in
``load`` and builds its 4-bit weight in ``finish_load``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.config import cpu_native_bf16
from kvserve.engine.distributed import all_reduce
from kvserve.engine.layers.quantization import quantize_layer, quantized_linear
from kvserve.engine.layers.w4a16 import (
    W4_TENSORS,
    W4A16Config,
    W4Weight,
    build_w4,
    decode_checkpoint_tensors,
    w4a16_linear,
)

#: ``"onednn"`` (default where torch has oneDNN) or ``"aten"``: how CPU float32 matmuls run.
CPU_LINEAR = os.environ.get("KVSERVE_CPU_LINEAR") or ("onednn" if torch.backends.mkldnn.is_available() else "aten")
if CPU_LINEAR not in ("onednn", "aten"):
    raise ValueError(f"KVSERVE_CPU_LINEAR must be 'onednn' or 'aten', got {CPU_LINEAR!r}")


#: Rows from which a CPU matmul leaves the prepacked weight for ATen (MKL) on CPUs without
#: AVX-512 (see the module docstring).
ATEN_MIN_ROWS = 512
#: Whether large CPU matmuls go to ATen: this CPU has no AVX-512, so MKL's AVX2 sgemm is as
#: wide as oneDNN's and faster on large shapes.
_LARGE_ON_ATEN = not torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))
#: Batch size the weights are prepacked for (the blocked layout suits 16-256 rows best).
PREPACK_ROWS = 64

_prepack_refusal_logged: set[torch.dtype] = set()
_bf16_storage_only: bool | None = None  # None: not decided yet


#: Decode-sized float32 matmuls (kvserve.kernels.cpu_backend.f32_linear): at most this many rows (the kernels'
#: F32_GEMV_ROWS; kept here so that this module loads no kernel code until a matmul needs it).
F32_GEMV_ROWS = 8
_f32_gemv = None  # kvserve.kernels.cpu_backend.f32_linear once it loaded, False where it cannot; None: not decided yet


def _f32_gemv_op():
    """The float32 GEMV (``kvserve.kernels.cpu_backend.f32_linear``), or None where its kernel does not
    load (decided once per process, so a decode step's matmuls import nothing)."""
    global _f32_gemv
    if _f32_gemv is None:
        from kvserve.kernels import cpu_backend

        ok = cpu_backend.load_kernel() and hasattr(torch.ops.kvserve_cpu, "f32_gemv")
        _f32_gemv = cpu_backend.f32_linear if ok else False
    return _f32_gemv or None


#: Decode-sized bfloat16 matmuls (kvserve.kernels.cpu_backend.bf16_weight_linear's GEMV, on any CPU): at most
#: ``kvserve.kernels.cpu_backend.bf16_gemv_rows()`` rows (8); None: not decided yet.
_bf16_gemv: tuple | None = None


def _bf16_gemv_op() -> tuple:
    """``(kvserve.kernels.cpu_backend.bf16_weight_linear, most rows)``, or ``(None, 0)`` where the
    kernel does not load (decided once per process)."""
    global _bf16_gemv
    if _bf16_gemv is None:
        from kvserve.kernels import cpu_backend

        rows = cpu_backend.bf16_gemv_rows()
        _bf16_gemv = (cpu_backend.bf16_weight_linear, rows) if rows else (None, 0)
    return _bf16_gemv


def _bf16_weights_in_float32_math() -> bool:
    """Whether bfloat16 CPU matmuls run :func:`kvserve.kernels.cpu_backend.bf16_weight_linear`: the CPU
    has no native bf16 dot products and the C++ kernels load (decided once per process)."""
    global _bf16_storage_only
    if _bf16_storage_only is None:
        from kvserve.kernels import cpu_backend

        _bf16_storage_only = not cpu_native_bf16()[0] and cpu_backend.load_kernel()
    return _bf16_storage_only


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias``: ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]``
    -> ``[..., out]`` in ``x.dtype``. ``packed``: the same weight in oneDNN's layout
    (:func:`prepack_weight`), used for the shapes where it is fastest; CPU float32 without
    one runs oneDNN on the plain weight, CPU bfloat16 without native bf16 the float32-math
    kernel, everything else ``F.linear`` (module docstring)."""
    if x.device.type == "cpu" and not torch.is_grad_enabled() and CPU_LINEAR == "onednn":
        if (
            x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.numel() <= F32_GEMV_ROWS * x.shape[-1]
            and weight.is_contiguous()
            and (gemv := _f32_gemv_op()) is not None
        ):
            return gemv(x, weight, bias)
        if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
            gemv, rows = _bf16_gemv_op()
            if gemv is not None and x.numel() <= rows * x.shape[-1] and weight.is_contiguous():
                return gemv(x, weight, bias)
        large = _LARGE_ON_ATEN and x.numel() >= ATEN_MIN_ROWS * x.shape[-1]
        if packed is not None and not large and x.dtype == weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if not large and x.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        if (
            packed is None
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and _bf16_weights_in_float32_math()
        ):
            from kvserve.kernels.cpu_backend import bf16_weight_linear

            return bf16_weight_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def decode_gemv_weight(mod: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight of ``mod`` (a :class:`ColumnParallelLinear` or :class:`RowParallelLinear`) when
    :func:`linear` runs its matmul for up to :data:`F32_GEMV_ROWS` rows of ``dtype`` in a C++ GEMV
    (``kvserve_cpu.f32_gemv`` or ``bf16_gemv``), which a C++ layer loop may then call itself with
    the same result (``kvserve.kernels.cpu_backend.decode_layers``); None for any other path (quantized or
    4-bit weights, a LoRA, oneDNN, ATen, another device)."""
    w = getattr(mod, "weight", None)
    if (
        w is None
        or mod.qweight is not None
        or mod.w4 is not None
        or mod.lora is not None
        or CPU_LINEAR != "onednn"
        or w.device.type != "cpu"
        or w.dtype != dtype
        or not w.is_contiguous()
    ):
        return None
    if dtype == torch.float32:
        return w if _f32_gemv_op() is not None else None
    if dtype == torch.bfloat16:
        return w if _bf16_gemv_op()[0] is not None else None  # contiguous: checked above
    return None


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` (CPU float32 or bfloat16) as a oneDNN tensor in the blocked
    layout for :data:`PREPACK_ROWS`-row batches, or None where this does not apply: not on CPU,
    another dtype, ``KVSERVE_CPU_LINEAR=aten``, or oneDNN refuses the dtype on this CPU
    (bfloat16 without native bf16 instructions; logged once per dtype). The copy holds as many
    bytes as the weight."""
    if weight.device.type != "cpu" or CPU_LINEAR != "onednn" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_ROWS)
    except RuntimeError as e:
        if weight.dtype not in _prepack_refusal_logged:
            _prepack_refusal_logged.add(weight.dtype)
            import logging

            logging.getLogger("kvserve.engine").info(
                "CPU %s weights are not prepacked (%s): matmuls run ATen's F.linear",
                str(weight.dtype).removeprefix("torch."),
                str(e).splitlines()[0][:160],
            )
        return None


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with the output features split across ranks.

    Args:
        in_features: input size.
        out_ranges: the global ``[start, end)`` output rows this rank holds, one range per
            fused sub-matrix (e.g. q, k, v or gate, up), concatenated in that order.
        bias: whether the (sharded) bias exists.
    """

    def __init__(self, in_features: int, out_ranges: list[tuple[int, int]], bias: bool = False):
        super().__init__()
        self.out_ranges = out_ranges
        self.sizes = [e - s for s, e in out_ranges]
        out = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.register_buffer("qweight", None)  # int8 / float8 weight [out, in] and its row scales after quantize()
        self.register_buffer("wscale", None)
        self.packed = None  # the weight in oneDNN's layout after prepack() (CPU)
        self.lora = None  # an kvserve.engine.lora.LoRALayer when adapters are enabled
        self.w4_config: W4A16Config | None = None  # a 4-bit checkpoint's format (prepare_w4a16)
        self.w4: W4Weight | None = None  # this rank's 4-bit weight after finish_load()
        self.act_dtype = self.weight.dtype  # the activations' dtype (the model's)
        self._w4_tensors: dict[int, dict[str, torch.Tensor]] = {}

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Copy this rank's rows of sub-matrix ``part`` from the full ``tensor``
        (``[out, in]`` weight or ``[out]`` bias); a 4-bit checkpoint's tensors are kept whole
        until :meth:`finish_load`.

        Raises:
            ValueError: a 4-bit tensor for a layer that is not 4-bit (no ``w4_config``).
        """
        if name in W4_TENSORS:
            self._keep_w4(name, tensor, part)
            return
        s, e = self.out_ranges[part]
        off = sum(self.sizes[:part])
        getattr(self, name).data[off : off + e - s].copy_(tensor[s:e])

    def _keep_w4(self, name: str, tensor: torch.Tensor, part: int) -> None:
        if self.w4_config is None:
            raise ValueError(
                f"4-bit tensor {name!r} for a layer the checkpoint's quantization_config does not name as quantized"
            )
        self._w4_tensors.setdefault(part, {})[name] = tensor

    def finish_load(self) -> None:
        """Build the 4-bit weight from the checkpoint tensors ``load`` kept (every part's rows
        of this rank, parts concatenated; ``kvserve.engine.layers.w4a16.build_w4``) and drop the float
        weight. Nothing for a float layer.

        Raises:
            ValueError: a part's tensors are missing or do not fit, or the fused parts of an
                act-order checkpoint order their input columns differently.
        """
        if not self._w4_tensors:
            return
        if len(self._w4_tensors) != len(self.out_ranges):
            raise ValueError(f"4-bit tensors for {len(self._w4_tensors)} of {len(self.out_ranges)} fused parts")
        codes, scales, zeros, g_idx = [], [], [], None
        for part, (s, e) in enumerate(self.out_ranges):
            c, sc, z, g = decode_checkpoint_tensors(self.w4_config, self._w4_tensors[part])
            if c.shape[1] != self.weight.shape[1]:
                raise ValueError(f"4-bit weight of {c.shape[1]} input columns for a layer of {self.weight.shape[1]}")
            if part and ((g is None) != (g_idx is None) or (g is not None and not torch.equal(g, g_idx))):
                raise ValueError(
                    "the fused parts of an act-order layer (q/k/v or gate/up) order their input columns differently"
                )
            g_idx = g
            codes.append(c[s:e])
            scales.append(sc[s:e])
            zeros.append(z[s:e])
        self._set_w4(build_w4(torch.cat(codes), torch.cat(scales), torch.cat(zeros), g_idx))

    def _set_w4(self, w: W4Weight) -> None:
        self.w4 = w = w.to(self.weight.device)
        for name in ("qweight", "scales", "szeros", "perm"):  # buffers: state_dict() and .to() see them
            self.register_buffer(f"w4_{name}", getattr(w, name))
        self.weight = None
        self._w4_tensors = {}

    def weight_geometry(self) -> tuple[int, int, torch.dtype, torch.device]:
        """``(out, in, dtype, device)`` of this rank's weight as the activations see it (the
        activations' dtype for a quantized weight)."""
        if self.w4 is not None:
            return *self.w4.shape, self.act_dtype, self.w4.qweight.device
        w = self.weight if self.qweight is None else self.qweight
        dtype = w.dtype if w.is_floating_point() and w.element_size() >= 2 else torch.float32
        return w.shape[0], w.shape[1], dtype, w.device

    def quantize(self, method: str = "int8") -> None:
        """``EngineConfig.quantization``: the float weight is replaced by int8 or float8 rows and
        per-row scales (``kvserve.engine.layers.quantization.quantize_layer``).

        Raises:
            ValueError: the layer is already 4-bit (a 4-bit checkpoint is not quantized again).
        """
        if self.w4 is not None:
            raise ValueError(f"quantization={method!r} on a 4-bit checkpoint: its weights are already quantized")
        quantize_layer(self, method)

    def prepack(self) -> None:
        """Keep a oneDNN-layout copy of the weight for CPU matmuls (:func:`prepack_weight`;
        nothing for a quantized layer or where it does not apply). Call after the weights are
        loaded: the copy does not follow later changes of ``weight``."""
        if self.qweight is None and self.weight is not None:
            self.packed = prepack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4 is not None:
            y = w4a16_linear(x, self.w4, self.bias)
        elif self.qweight is not None:
            y = quantized_linear(x, self.qweight, self.wscale, self.bias)
        else:
            y = linear(x, self.weight, self.bias, self.packed)
        if self.lora is not None and self.lora.owner.active:
            self.lora.apply(x, y)
        return y


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with the input features split across ranks; partial sums are
    all-reduced. ``in_range`` is this rank's global ``[start, end)`` of input features."""

    def __init__(self, in_range: tuple[int, int], out_features: int):
        super().__init__()
        self.in_range = in_range
        self.weight = nn.Parameter(torch.empty(out_features, in_range[1] - in_range[0]), requires_grad=False)
        self.register_buffer("qweight", None)
        self.register_buffer("wscale", None)
        self.packed = None
        self.lora = None
        self.w4_config: W4A16Config | None = None
        self.w4: W4Weight | None = None
        self.act_dtype = self.weight.dtype
        self._w4_tensors: dict[int, dict[str, torch.Tensor]] = {}

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Copy this rank's input columns of the full ``[out, in]`` ``tensor``; a 4-bit
        checkpoint's tensors are kept whole until :meth:`finish_load`."""
        if name in W4_TENSORS:
            self._keep_w4(name, tensor, part)
            return
        self.weight.data.copy_(tensor[:, self.in_range[0] : self.in_range[1]])

    def finish_load(self) -> None:
        """Build this rank's 4-bit weight (its input columns; ``kvserve.engine.layers.w4a16.build_w4``)
        from the checkpoint tensors ``load`` kept, and drop the float weight. Nothing for a
        float layer.

        Raises:
            ValueError: missing tensors, or input columns that cannot be split here.
        """
        if not self._w4_tensors:
            return
        codes, scales, zeros, g_idx = decode_checkpoint_tensors(self.w4_config, self._w4_tensors[0])
        if codes.shape[0] != self.weight.shape[0]:
            raise ValueError(f"4-bit weight of {codes.shape[0]} rows for a layer of {self.weight.shape[0]}")
        self._set_w4(build_w4(codes, scales, zeros, g_idx, cols=self.in_range))

    _keep_w4 = ColumnParallelLinear._keep_w4
    _set_w4 = ColumnParallelLinear._set_w4
    weight_geometry = ColumnParallelLinear.weight_geometry
    quantize = ColumnParallelLinear.quantize
    prepack = ColumnParallelLinear.prepack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4 is not None:
            y = w4a16_linear(x, self.w4)
        elif self.qweight is not None:
            y = quantized_linear(x, self.qweight, self.wscale)
        else:
            y = linear(x, self.weight, None, self.packed)
        if self.lora is not None and self.lora.owner.active:
            self.lora.apply(x, y)  # this rank's partial x A^T B^T: summed by the all-reduce
        return all_reduce(y)
