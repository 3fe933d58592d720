"""Quantized weights: which layers of a model get them, the checks, and their matmuls.

``EngineConfig.quantization`` (:func:`quantize_model`):

* ``"int8"``: weight-only int8 (W8A32) on CPU in float32: every linear layer and the LM head
  keep int8 rows with a float32 scale per row (``kvserve.kernels.cpu_backend.quantize_int8``) and
  multiply through the C++ kernels (``kvserve.kernels.cpu_backend.int8_linear``).
* ``"fp8"``: float8 e4m3 weights with per-row scales (:func:`quantize_fp8`) and dynamically
  quantized per-token activations (W8A8, :func:`fp8_linear`: ``torch._scaled_mm``) on CUDA in
  bfloat16, compute capability >= 8.9; a linear layer whose sizes are not multiples of 16 and
  the LM head stay in bfloat16 (as vLLM's FP8 does).

A layer takes part by having a ``quantize(method)`` method (the tensor-parallel linears and the
LM head, ``kvserve.engine.layers.linear`` and ``kvserve.engine.layers.embedding``); it keeps ``qweight`` and
``wscale`` and its forward calls :func:`quantized_linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.torch_backend import FP8, FP8_MAX  # the KV cache's float8 format too


def check_quantization(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Whether ``method`` runs for a model on ``device`` in ``dtype``.

    Raises:
        ValueError: an unknown method, or the device, dtype or GPU does not support it, or
            (int8) the CPU kernels cannot be built here.
    """
    if method == "int8":
        from kvserve.kernels import cpu_backend

        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"quantization='int8' runs on CPU in float32, not {device.type} {str(dtype).removeprefix('torch.')}"
            )
        if not cpu_backend.load_kernel():
            raise ValueError(f"quantization='int8' needs the CPU kernels: {cpu_backend.kernel_error()}")
    elif method == "fp8":
        if device.type != "cuda" or dtype != torch.bfloat16:
            raise ValueError(
                f"quantization='fp8' runs on CUDA in bfloat16 (torch._scaled_mm), not "
                f"{device.type} {str(dtype).removeprefix('torch.')}; on CPU use 'int8'"
            )
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(
                "quantization='fp8' needs compute capability >= 8.9 (Ada, Hopper), this GPU has "
                "%d.%d" % torch.cuda.get_device_capability(device)
            )
    elif method in ("awq", "gptq", "compressed-tensors"):  # a 4-bit checkpoint (kvserve.engine.layers.w4a16)
        if device.type not in ("cpu", "cuda") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"4-bit {method} weights run on CPU or CUDA in float32, bfloat16 or float16, not "
                f"{device.type} {str(dtype).removeprefix('torch.')}"
            )
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("4-bit weights on CPU run float32 or bfloat16 activations, not float16")
    else:
        raise ValueError(
            f"quantization must be None, 'int8', 'fp8', 'awq', 'gptq' or 'compressed-tensors', got {method!r}"
        )


def quantize_model(model: nn.Module, method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Quantize the loaded ``model`` (on ``device``, weights in ``dtype``) in place: every
    module with a ``quantize`` method (the linear layers and the LM head) gets ``method``
    (see the module docstring for what each method covers).

    Raises:
        ValueError: see :func:`check_quantization`.
    """
    check_quantization(method, device, dtype)
    for m in model.modules():
        if hasattr(m, "quantize"):
            m.quantize(method)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 weight with one float32 scale per output row (``max|row| / 448``).

    Args: ``weight`` ``[out, in]`` (any float dtype). Returns ``(qweight float8_e4m3fn [out,
    in], scale float32 [out])`` with ``weight ~= qweight * scale[:, None]``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 float8 matmul on CUDA (``torch._scaled_mm``, row-wise scales): the activations are
    quantized per token at run time (``max|row| / 448``), the product accumulates in float32
    and is scaled by ``a_scale[m] * w_scale[n]``, as vLLM's dynamic per-token FP8.

    Args: ``x`` ``[..., in]`` bfloat16; ``qweight`` float8 ``[out, in]`` and ``wscale`` float32
    ``[out]`` from :func:`quantize_fp8`; ``bias`` ``[out]`` bfloat16. Returns ``[..., out]`` in
    ``x.dtype``. Needs compute capability >= 8.9 and ``in``, ``out`` multiples of 16."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    a_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    a8 = (x2.float() / a_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(a8, qweight.t(), scale_a=a_scale, scale_b=wscale[None, :], bias=bias, out_dtype=x.dtype)
    return out.reshape(*shape[:-1], out.shape[-1])


def quantized_linear(
    x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The matmul of a quantized layer: float8 weights -> :func:`fp8_linear` (CUDA), int8 ->
    ``kvserve.kernels.cpu_backend.int8_linear`` (CPU)."""
    if qweight.dtype == FP8:
        return fp8_linear(x, qweight, wscale, bias)
    from kvserve.kernels.cpu_backend import int8_linear

    return int8_linear(x, qweight, wscale, bias)


def quantize_layer(layer: nn.Module, method: str) -> None:
    """Replace ``layer.weight`` by ``qweight`` + per-row ``wscale``: ``"int8"`` (weight-only,
    CPU) or ``"fp8"`` (W8A8, CUDA; a layer whose sizes are not multiples of 16 stays as is)."""
    if method == "fp8":
        if layer.weight.shape[0] % 16 or layer.weight.shape[1] % 16:
            return
        layer.qweight, layer.wscale = quantize_fp8(layer.weight)
    else:
        from kvserve.kernels import cpu_backend

        layer.qweight, layer.wscale = cpu_backend.quantize_int8(layer.weight)
    layer.weight = None
