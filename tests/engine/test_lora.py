"""LoRA adapters (``kvserve/engine/lora.py``) against the reference: Hugging Face transformers with the
PEFT adapter applied, greedy, token for token in float32.

Adapters are made with ``peft`` on a tiny random-weight model: three adapters of different
ranks, target modules and scalings (one rsLoRA), their weights random (``init_lora_weights=False``)
and scaled up so that each visibly changes the model's output. One ``generate`` call mixes
requests of the base model and of the three adapters, with the same prompt under several
adapters (their KV blocks must never be shared through the prefix cache); variants force
chunked prefill, preemption and slot eviction (more adapters than ``max_loras``).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.lora import LoRARequest
from tiny_models import make_tiny_model

peft = pytest.importorskip("peft")

NEW_TOKENS = 16
PROMPTS = [
    [1, 17, 300, 42, 9, 77, 1000, 5],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [400, 401, 402, 403],
]
#: (name, rank, alpha, target modules, rsLoRA)
ADAPTERS = [
    ("all-r8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    ("qv-r4", 4, 8, ["q_proj", "v_proj"], True),
    ("mlp-r16", 16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_lora"), num_hidden_layers=2)


def make_adapter(base, out, rank, alpha, targets, rslora, seed):
    """A PEFT LoRA adapter of ``base`` saved to ``out`` with random A and B (B scaled so the
    delta is of the order of the weights)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0
    )
    pm = peft.get_peft_model(model, cfg)
    pm.save_pretrained(out)
    st = out / "adapter_model.safetensors"
    w = {k: (v * 4.0 if "lora_B" in k else v) for k, v in load_file(st).items()}
    save_file(w, st)
    return out


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny, root / name, r, a, t, rs, seed=i) for i, (name, r, a, t, rs) in enumerate(ADAPTERS)
    }


def hf_greedy(base, adapter, prompts, device="cpu"):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.to(device).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(y[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(tiny, adapters):
    ref = {None: hf_greedy(tiny, None, PROMPTS)}
    for name, path in adapters.items():
        ref[name] = hf_greedy(tiny, path, PROMPTS)
    for name in adapters:  # each adapter must change the output, or the test could not fail
        assert ref[name] != ref[None], f"adapter {name} does not change the greedy output"
    return ref


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


#: (prompt index, adapter) rows skewed to one adapter: a prefill chunk as its own row slice, the
#: many decode rows of one adapter gathered, the few of the others batched (LoRASlots.prepare's paths)
SKEW = [(p, "all-r8") for p in range(len(PROMPTS))] * 4 + [(0, "qv-r4"), (1, "mlp-r16"), (2, None)]


def _generate_and_check(llm, rows, loras, reference) -> dict:
    """Greedy ``NEW_TOKENS`` for each ``(prompt index, adapter name)`` row under its ``loras``
    request: each equals ``reference[name][prompt]``, and no KV block leaks; returns the stats."""
    outs = llm.generate(
        [PROMPTS[p] for p, _ in rows],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
        lora_request=loras,
        use_tqdm=False,
    )
    for (p, name), o in zip(rows, outs):
        assert o.outputs[0].token_ids == reference[name][p], (name, p)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    return stats


def _mixed_batch(adapters):
    """Every prompt under the base model and under each adapter, interleaved: the ``(prompt
    index, adapter name)`` rows and each row's ``LoRARequest`` (None: the base model)."""
    reqs = _requests(adapters)
    rows = [(p, name) for p in range(len(PROMPTS)) for name in [None, *adapters]]
    return rows, [reqs[n] if n else None for _, n in rows]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill, several steps per prompt
        {"num_kv_blocks": 12, "block_size": 4},  # preemption and recompute (one request fits)
        {"max_loras": 1},  # one slot: adapters wait and take turns
    ],
    ids=["mixed", "chunked", "preempt", "one-slot"],
)
def test_mixed_batch_equals_hf_with_peft(tiny, adapters, reference, kw):
    rows, loras = _mixed_batch(adapters)
    preempt = "num_kv_blocks" in kw
    llm = LLM(
        model=str(tiny), dtype="float32", enable_lora=True, max_loras=kw.pop("max_loras", 3), max_lora_rank=16, **kw
    )
    stats = _generate_and_check(llm, rows, loras, reference)
    if preempt:
        assert stats["num_preemptions"] > 0  # the variant did preempt


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp-kernel", "torch-path"])
def test_every_row_path_equals_hf(tiny, adapters, reference, monkeypatch, kernel):
    """A skewed batch (one adapter with most of the rows) takes every path of
    ``LoRASlots.prepare``: a prefill chunk as its own row slice, the many decode rows of one
    adapter gathered, the few of the others batched (the C++ kernel on a CPU in float32, or
    the padded bmm): each request still gets its adapter's HF + PEFT tokens."""
    import kvserve.kernels.cpu_backend as cpu
    from kvserve.engine.lora import LoRASlots

    if kernel and not cpu.use_lora_kernel():
        pytest.skip(f"the C++ kernels do not build here: {cpu.kernel_error()}")
    if not kernel:
        monkeypatch.setattr(cpu, "use_lora_kernel", lambda: False)
    seen = set()
    prepare = LoRASlots.prepare

    def spy(self, spans, device):
        prepare(self, spans, device)
        seen.update(k for k in ("spans", "gathered", "batch", "sgmv") if getattr(self, k))

    monkeypatch.setattr(LoRASlots, "prepare", spy)
    reqs = _requests(adapters)
    llm = LLM(model=str(tiny), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    assert llm.engine.executor.runner.lora.kernel is kernel
    _generate_and_check(llm, SKEW, [reqs[n] if n else None for _, n in SKEW], reference)
    assert seen == ({"spans", "sgmv"} if kernel else {"spans", "gathered", "batch"}), seen


def test_adapters_never_share_prefix_cache_blocks(tiny, adapters, reference):
    """The same prompt first under one adapter, then (in a later call, its blocks cached)
    under another and the base model: each answer is its own adapter's."""
    reqs = _requests(adapters)
    llm = LLM(
        model=str(tiny),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        enable_prefix_caching=True,
        block_size=4,
    )
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    first = llm.generate([PROMPTS[1]], sp, lora_request=reqs["all-r8"], use_tqdm=False)
    assert first[0].outputs[0].token_ids == reference["all-r8"][1]
    later = llm.generate([PROMPTS[1]] * 3, sp, lora_request=[reqs["qv-r4"], None, reqs["all-r8"]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in later] == [
        reference["qv-r4"][1],
        reference[None][1],
        reference["all-r8"][1],
    ]
    assert later[2].num_cached_tokens > 0  # the same adapter does reuse its own blocks


def test_bad_adapters_fail_their_own_request_with_the_reason(tiny, adapters, tmp_path):
    llm = LLM(model=str(tiny), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match="exceeds max_lora_rank 8"):
        llm.engine.add_lora(LoRARequest("big", 3, str(adapters["mlp-r16"])))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((adapters["qv-r4"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="cannot read"):
        llm.engine.add_lora(LoRARequest("corrupt", 4, str(corrupt)))
    other = tmp_path / "other-base"  # an adapter of a wider model
    other.mkdir()
    cfg = json.loads((adapters["qv-r4"] / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 128),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
        },
        other / "adapter_model.safetensors",
    )
    with pytest.raises(ValueError, match="another base model"):
        llm.engine.add_lora(LoRARequest("other", 5, str(other)))
    # the engine is unharmed: a good adapter and the base model still run
    ok = llm.generate(
        [PROMPTS[0]] * 2, sp, lora_request=[LoRARequest("qv", 6, str(adapters["qv-r4"])), None], use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in ok)


def test_lora_config_is_checked(tiny):
    with pytest.raises(ValueError, match="max_loras"):
        LLM(model=str(tiny), dtype="float32", enable_lora=True, max_loras=0)
    llm = LLM(model=str(tiny), dtype="float32")  # LoRA off: a request naming an adapter is refused
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(
            [PROMPTS[0]], SamplingParams(max_tokens=2), lora_request=LoRARequest("x", 1, "/nonexistent"), use_tqdm=False
        )


def test_async_engine_streams_an_adapters_tokens(tiny, adapters, reference):
    import asyncio

    from kvserve.engine import AsyncLLMEngine, EngineConfig

    async def main():
        eng = AsyncLLMEngine.from_config(
            EngineConfig(model=str(tiny), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
        )
        try:
            sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

            async def one(lora):
                last = None
                async for out in eng.generate(PROMPTS[0], sp, lora_request=lora):
                    last = out
                return last.outputs[0].token_ids

            reqs = _requests(adapters)
            return await asyncio.gather(one(reqs["all-r8"]), one(None), one(reqs["qv-r4"]))
        finally:
            await eng.shutdown()

    assert asyncio.run(main()) == [reference["all-r8"][0], reference[None][0], reference["qv-r4"][0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}], ids=["mixed", "chunked"])
def test_cuda_adapters_equal_hf_with_peft(tiny, adapters, kw):
    """On CUDA (float32, torch attention: the LoRA slots and the padded-bmm SGMV path on the
    GPU, eager since LoRA steps never replay graphs) the mixed batch, plus a skewed batch that
    takes every row path, gives HF + PEFT's greedy tokens on the same GPU."""
    from kvserve.engine.lora import LoRASlots

    ref = {name: hf_greedy(tiny, path, PROMPTS, device="cuda") for name, path in [(None, None), *adapters.items()]}
    rows, loras = _mixed_batch(adapters)
    reqs = _requests(adapters)
    llm = LLM(
        model=str(tiny),
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        kv_cache_memory_bytes=1 << 28,
        **kw,
    )
    assert isinstance(llm.engine.executor.runner.lora, LoRASlots) and not llm.engine.executor.runner.lora.kernel
    _generate_and_check(llm, rows + SKEW, loras + [reqs[n] if n else None for _, n in SKEW], ref)
