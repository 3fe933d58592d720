"""Model weights on transparent huge pages (``kvserve/engine/huge_pages.py``): the weights a CPU decode step
streams are copied into 2 MiB-aligned memory marked ``madvise(MADV_HUGEPAGE)`` (the ``hg`` flag of
its mapping in ``/proc/self/smaps``), with values, ties and Parameter objects unchanged, and the
engine's output is bit for bit the same as with the weights where the loader left them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine import LLM, SamplingParams, huge_pages
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="no madvise(MADV_HUGEPAGE) on this OS")


def vm_flags(addr: int) -> set[str]:
    """The ``VmFlags`` of the mapping of this process that holds address ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not line.startswith("VmFlags"):
                try:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                except ValueError:
                    continue
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise LookupError(f"no mapping holds {addr:#x}")


@pytest.fixture
def arenas(monkeypatch):
    """The ``[start, end)`` address ranges of every arena :func:`huge_pages.huge_page_buffer` hands
    out while the test runs. Whether memory is *not* ours is judged by these ranges, not by a missing
    ``hg`` flag: other code of the process marks memory ``MADV_HUGEPAGE`` too (numpy does for arrays
    of 4 MiB and more, and the malloc heap pages it marked keep the flag after it frees them, so a
    tensor allocated there later has ``hg`` though nothing of ours moved it)."""
    ranges: list[tuple[int, int]] = []
    real = huge_pages.huge_page_buffer

    def spy(nbytes):
        buf = real(nbytes)
        ranges.append((buf.data_ptr(), buf.data_ptr() + nbytes))
        return buf

    monkeypatch.setattr(huge_pages, "huge_page_buffer", spy)
    return ranges


def in_arena(t: torch.Tensor, ranges) -> bool:
    """Whether all of ``t``'s bytes lie inside one of ``ranges``."""
    lo = t.data_ptr()
    return any(a <= lo and lo + t.numel() * t.element_size() <= b for a, b in ranges)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """A tiny Llama whose matmul weights are at least huge_pages.MIN_BYTES in float32, LM head tied."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_tied"),
        arch="llama",
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        tie_word_embeddings=True,
    )


def test_model_weights_move_with_values_and_ties_kept(tied_model, monkeypatch, arenas):
    monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", "0")
    plain = ModelRunner(EngineConfig(device="cpu", dtype="float32"), tied_model)
    assert arenas == []  # switched off: no arena made
    monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", "1")
    huge = ModelRunner(EngineConfig(device="cpu", dtype="float32"), tied_model)
    before = dict(plain.model.named_parameters())
    big = {n: p for n, p in huge.model.named_parameters() if p.numel() * p.element_size() >= huge_pages.MIN_BYTES}
    # the embedding (the LM head's too) and each layer's qkv, o, gate_up and down weights
    assert len(big) == 1 + 4 * len(huge.model.layers)
    assert arenas
    for name, p in big.items():
        assert in_arena(p, arenas) and "hg" in vm_flags(p.data_ptr()), name
        assert not in_arena(before[name], arenas), name
    small = [p for n, p in huge.model.named_parameters() if n not in big]
    assert small and not any(in_arena(p, arenas) for p in small)  # norms stay
    for name, p in huge.model.named_parameters():
        assert p.dtype == before[name].dtype and torch.equal(p, before[name]), name
    assert huge.model.lm_head.weight is huge.model.embed_tokens.weight


def test_generation_is_bit_for_bit_the_same(tied_model, monkeypatch):
    """Greedy tokens and their logprobs, float32 and bfloat16, with and without the move."""
    prompts = [[1, 400, 2000, 31, 7], [1, 99, 5, 6000, 42, 42, 17, 3]]
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for flag in ("0", "1"):
            monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", flag)
            llm = LLM(model=str(tied_model), dtype=dtype, enable_prefix_caching=False)
            res = llm.generate(
                prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1), use_tqdm=False
            )
            outs[flag] = [
                (o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in res
            ]
            del llm
        assert outs["0"] == outs["1"], dtype


def test_arenas_views_and_quantized_weights(monkeypatch, arenas):
    """Several arenas when the weights outgrow one; a weight that is a view of a larger storage
    stays; a ``qweight`` moves; tensors below MIN_BYTES stay."""
    monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "ARENA_BYTES", 1 << 20)
    torch.manual_seed(0)
    m = nn.Module()
    m.a, m.b, m.c = nn.Linear(256, 512), nn.Linear(512, 256), nn.Linear(256, 1024)  # 512 KiB, 512 KiB, 1 MiB
    m.tiny = nn.Linear(8, 8)
    shared = torch.randn(2, 300, 256)
    m.view_param = nn.Parameter(shared[0], requires_grad=False)
    q = nn.Module()
    q.qweight = torch.randint(-127, 127, (1024, 256), dtype=torch.int8)
    m.q = q
    values = {n: t.clone() for n, t in [*m.named_parameters(), ("q.qweight", q.qweight)]}
    moved = huge_pages.move_to_huge_pages(m)
    big = [m.a.weight, m.b.weight, m.c.weight, q.qweight]
    assert moved == sum(t.numel() * t.element_size() for t in big)
    for t in big:
        assert in_arena(t, arenas) and "hg" in vm_flags(t.data_ptr())
    assert len(arenas) >= 2  # 3 MiB of weights in arenas of at most 1 MiB (a larger tensor alone)
    for t in (m.tiny.weight, m.view_param, m.a.bias):
        assert not in_arena(t, arenas)
    assert m.view_param.data_ptr() == shared.data_ptr()
    for n, t in [*m.named_parameters(), ("q.qweight", q.qweight)]:
        assert torch.equal(t, values[n]), n
    monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", "0")
    assert huge_pages.move_to_huge_pages(nn.Linear(512, 512)) == 0


def test_a_refused_mapping_leaves_the_weights_where_they_were(monkeypatch):
    """A sandbox or kernel that refuses the mapping or the madvise: no error, nothing moved."""
    monkeypatch.setenv("KVSERVE_CPU_HUGE_PAGES", "1")

    def refuse(nbytes):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages, "huge_page_buffer", refuse)
    m = nn.Linear(512, 512)
    before, ptr = m.weight.detach().clone(), m.weight.data_ptr()
    assert huge_pages.move_to_huge_pages(m) == 0
    assert m.weight.data_ptr() == ptr and torch.equal(m.weight, before)
