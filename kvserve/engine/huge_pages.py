"""Model weights on transparent huge pages (CPU).

A CPU decode step reads every weight once from memory (``kvserve/kernels/csrc/*_linear_cpu.cpp``'s GEMVs), so
its speed is the rate at which the weights stream. On the default 4 KiB pages a sweep over
SmolLM2-135M's 270 MB of bfloat16 weights crosses some 66,000 pages: each is a TLB miss (a page walk)
and a page edge, where the hardware prefetchers' streams stop and start again. On 2 MiB pages the
same sweep crosses 135. On a 2-core Zen 4 EPYC the bf16 GEMVs of SmolLM2's decode step read the
same weights at about 29 GB/s on 2 MiB pages where they read 23 on 4 KiB ones (a one-off probe,
interleaved; ``benchmarks/batch1.py`` measures the decode both ways).

:func:`move_to_huge_pages` copies a model's weights into anonymous memory mapped for the purpose,
aligned to 2 MiB and marked ``madvise(MADV_HUGEPAGE)`` (``kvserve.engine.model_runner`` calls it before
loading, so the loader writes into that memory, or after quantizing): the kernel backs it with huge pages where
transparent huge pages are ``always`` or ``madvise`` (the common default) and it finds free 2 MiB
pages; where it does not, the memory is plain memory and nothing else changes. PyTorch's own
``THP_MEM_ALLOC_ENABLE`` does the same for every allocation, but it is read once, when torch makes
its first allocation, and would also cover activations and the KV cache, whose reads gained
nothing from it.

``KVSERVE_CPU_HUGE_PAGES=0`` turns the copy off.
"""

from __future__ import annotations

import mmap
import os

import torch
from torch import nn

#: The huge page size the arenas are aligned to (x86-64 and arm64 with 4 KiB base pages).
HUGE_PAGE = 2 << 20
#: Tensors smaller than this stay where they are (norm weights, biases): they are read from cache.
MIN_BYTES = 1 << 16
#: The most bytes copied into one arena at a time: the copy holds one arena beside the tensors it
#: replaces, not the whole model twice.
ARENA_BYTES = 256 << 20
#: Each tensor's offset in an arena is a multiple of this (a cache line; every dtype's alignment).
ALIGN = 64


def enabled() -> bool:
    """Whether :func:`move_to_huge_pages` copies anything: Linux with transparent huge pages built
    in (``madvise(MADV_HUGEPAGE)``, ``/sys/kernel/mm/transparent_hugepage``) and
    ``KVSERVE_CPU_HUGE_PAGES`` not ``0``."""
    return (
        hasattr(mmap, "MADV_HUGEPAGE")
        and os.environ.get("KVSERVE_CPU_HUGE_PAGES", "1") != "0"
        and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    )


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor ``[nbytes]`` on anonymous memory whose start is 2 MiB-aligned and that is
    marked ``MADV_HUGEPAGE`` (its pages are allocated when first written). The mapping lives as long
    as a tensor viewing it.

    Raises:
        OSError: the mapping or the madvise failed.
    """
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds a reference to m
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _slots(module: nn.Module):
    """``(owner, kind, name, tensor)`` for every weight of ``module`` worth moving: parameters and
    quantized weights (``qweight``) that are the whole of their storage, each storage once (a tied
    weight is one parameter; views sharing a storage are left where they are: copying them apart
    would multiply their bytes). Buffers (rotary tables and the like) stay: a step reads a few of
    their rows, not all of them."""
    seen: set[int] = set()
    for mod in module.modules():
        tensors = [("param", n, p) for n, p in mod._parameters.items() if p is not None]
        q = mod.__dict__.get("qweight")
        if isinstance(q, torch.Tensor):
            tensors.append(("attr", "qweight", q))
        for kind, name, t in tensors:
            if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
                continue
            nbytes, storage = t.numel() * t.element_size(), t.untyped_storage()
            if nbytes < MIN_BYTES or storage.nbytes() != nbytes or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            yield mod, kind, name, t


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy ``module``'s large CPU weights (parameters and ``qweight``; at least
    :data:`MIN_BYTES`, contiguous, each the whole of its storage) into :func:`huge_page_buffer` arenas of up to
    :data:`ARENA_BYTES` each; the tensors keep their values, dtypes, shapes and Parameter objects
    (``.data`` is swapped), so tied weights stay tied. Call it before anything caches a tensor of
    the module. Returns the bytes moved (0 when :func:`enabled` is false).

    A mapping or ``madvise`` the OS refuses (a sandbox, no memory left for it) ends the moving: the
    tensors not yet moved stay where they were, and the refusal is logged once.
    """
    if not enabled():
        return 0
    slots = list(_slots(module))
    moved, i = 0, 0
    while i < len(slots):
        group, size = [], 0
        while i < len(slots):
            nbytes = slots[i][3].numel() * slots[i][3].element_size()
            if group and size + nbytes > ARENA_BYTES:
                break
            group.append((slots[i], size))
            size += -(-nbytes // ALIGN) * ALIGN
            i += 1
        try:
            arena = huge_page_buffer(size)
        except OSError as e:
            _log_refusal(e)
            break
        for (mod, kind, name, t), off in group:
            nbytes = t.numel() * t.element_size()
            new = arena[off : off + nbytes].view(t.dtype).view(t.shape)
            new.copy_(t)
            if kind == "param":
                mod._parameters[name].data = new
            else:
                setattr(mod, name, new)
            moved += nbytes
    _trim_heap()
    return moved


_refusal_logged = False


def _log_refusal(e: OSError) -> None:
    global _refusal_logged
    if not _refusal_logged:
        _refusal_logged = True
        import logging

        logging.getLogger("kvserve.engine").info(
            "weights stay on small pages: the OS refused a huge-page mapping (%s)", e
        )


def _trim_heap() -> None:
    """Give the heap's free memory back to the OS (glibc's ``malloc_trim``): the tensors replaced
    were freed into malloc's heap, which would otherwise keep their pages resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
