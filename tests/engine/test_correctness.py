"""Greedy outputs equal Hugging Face transformers ``generate`` token for token.

The reference runs each prompt alone (no padding); kvserve runs all prompts in one
``generate`` call, so the engine batches them (flattened varlen batch, paged KV cache).
Variants: prefix caching off, chunked prefill forced by a tiny token budget, and a KV
pool so small that requests are preempted and recomputed. Each runs on the default CPU path
(our C++ attention kernel and fused element-wise ops, oneDNN linears) and on the plain one
(torch attention backend, ATen ops, ``F.linear``: ``KVSERVE_CPU_LINEAR=aten``,
``KVSERVE_CPU_FUSED_OPS=0``).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model_loader import load_tokenizer
from helpers import THOROUGH
from tiny_models import make_tiny_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "Water boils at",
    "The quick brown fox",
    "In 1492, Columbus",
    "Translate to French: Hello, how are you?",
]
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Give me three tips for learning Python."}],
    [{"role": "user", "content": "What is 12 times 12?"}],
]
NEW_TOKENS = 48
#: The SmolLM2 comparisons' size: the first text prompts and chats of PROMPTS and CHAT, and the
#: tokens compared. The fast test profile (``tests/helpers.py``) runs 4 text prompts and 2 chats
#: (sharing the template's prefix) for 16 tokens, the thorough one all 12 for NEW_TOKENS.
SMOLLM2_TEXTS, SMOLLM2_CHATS, SMOLLM2_TOKENS = (len(PROMPTS), len(CHAT), NEW_TOKENS) if THOROUGH else (4, 2, 16)
#: The length of HF's SmolLM2 references: what test_spec_decode_equals_hf.py compares (these prompts
#: and more; :func:`hf_greedy` computes each prompt once), cut to SMOLLM2_TOKENS here.
SMOLLM2_REF_TOKENS = NEW_TOKENS if THOROUGH else 24


#: HF's greedy continuations already computed in this process: (model folder, prompt ids,
#: new tokens) -> token ids. Each prompt runs alone, so a prompt's reference is the same whatever
#: it is batched with: test_spec_decode_equals_hf.py's SmolLM2 case (these prompts and more, the same
#: length) computes only the prompts not seen here.
_HF_GREEDY: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation (float32, ``new_tokens`` tokens, EOS ignored) of
    each prompt, run alone; remembered per prompt for the rest of the session."""
    keys = [(str(path), tuple(ids), new_tokens) for ids in prompt_ids]
    missing = [k for k in dict.fromkeys(keys) if k not in _HF_GREEDY]
    if missing:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        with torch.inference_mode():
            for key in missing:
                x = torch.tensor([list(key[1])])
                y = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                _HF_GREEDY[key] = y[0, x.shape[1] :].tolist()
    return [list(_HF_GREEDY[k]) for k in keys]


def prompt_ids(path) -> list[list[int]]:
    tok = load_tokenizer(path)
    ids = [tok.encode(p) for p in PROMPTS]
    for msgs in CHAT:  # chat prompts share the template's system prefix: prefix-cache hits
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids.append(tok.encode(text, add_special_tokens=False))
    return ids


def smollm2_prompt_ids(path) -> list[list[int]]:
    """The SmolLM2 comparisons' prompts at this profile's size: the first SMOLLM2_TEXTS of PROMPTS
    and SMOLLM2_CHATS of CHAT (here and in test_spec_decode_equals_hf.py, which share HF's
    reference through :func:`hf_greedy`)."""
    ids = prompt_ids(path)
    return [ids[i] for i in [*range(SMOLLM2_TEXTS), *range(len(PROMPTS), len(PROMPTS) + SMOLLM2_CHATS)]]


#: (attention_backend, KVSERVE_CPU_LINEAR) pairs every HF comparison runs on.
CPU_PATHS = [("cpu", "onednn"), ("torch", "aten")]


@pytest.fixture(params=CPU_PATHS, ids=lambda p: f"{p[0]}-{p[1]}")
def cpu_path(request, monkeypatch):
    """Runs the test on one CPU path; yields the ``attention_backend`` to pass to ``LLM``."""
    import kvserve.engine.layers.linear as linear
    from kvserve.kernels import cpu_backend

    backend, matmul = request.param
    monkeypatch.setattr(linear, "CPU_LINEAR", matmul)
    monkeypatch.setattr(cpu_backend, "FUSED_OPS", backend == "cpu")
    return backend


def engine_greedy(path, ids, new_tokens, **kw):
    llm = LLM(model=str(path), **{"dtype": "float32", **kw})  # the reference is HF in float32
    outs = llm.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats


def assert_same(ref, got):
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g == r, f"prompt {i} diverges at token {next(j for j, (a, b) in enumerate(zip(r, g)) if a != b)}"


@pytest.mark.slow
class TestSmolLM2:
    @pytest.fixture(scope="class")
    def case(self, smollm2_path):
        """(path, prompts, HF's greedy tokens, their number) at this profile's size. HF's
        reference is computed at SMOLLM2_REF_TOKENS, as test_spec_decode_equals_hf.py's SmolLM2 case
        asks for the same prompts (:func:`hf_greedy` computes each once), then cut to the size: greedy
        decoding's first tokens do not depend on how many follow."""
        ids = smollm2_prompt_ids(smollm2_path)
        ref = hf_greedy(smollm2_path, ids, SMOLLM2_REF_TOKENS)
        return smollm2_path, ids, [r[:SMOLLM2_TOKENS] for r in ref], SMOLLM2_TOKENS

    def test_batched_equals_hf(self, case, cpu_path):
        path, ids, ref, new_tokens = case
        llm = LLM(model=str(path), dtype="float32", attention_backend=cpu_path)
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
        assert llm.get_stats()["max_running_batch"] == len(ids)
        assert_same(ref, got)
        # Again, now that the prompts' full blocks are cached: same tokens from shared blocks.
        again = llm.generate(ids, params, use_tqdm=False)
        assert all(o.num_cached_tokens > 0 for o, i in zip(again, ids) if len(i) > 16)
        assert_same(ref, [o.outputs[0].token_ids for o in again])
        stats = llm.get_stats()
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]

    def test_prefix_caching_off_chunked_prefill(self, case, cpu_path):
        path, ids, ref, new_tokens = case
        got, stats = engine_greedy(
            path, ids, new_tokens, enable_prefix_caching=False, max_num_batched_tokens=24, attention_backend=cpu_path
        )
        assert stats["prefix_cache_hit_rate"] == 0
        assert stats["num_steps"] > new_tokens + sum(len(i) for i in ids) // 24 - 1  # prompts were chunked
        assert_same(ref, got)

    def test_preemption_recompute(self, case, cpu_path):
        path, ids, ref, new_tokens = case
        # 12 requests of up to ~100 tokens each need ~80 blocks of 8 (the fast profile's 6 of up
        # to ~70, ~40): 24 blocks force preemption.
        got, stats = engine_greedy(path, ids, new_tokens, num_kv_blocks=24, block_size=8, attention_backend=cpu_path)
        assert stats["num_preemptions"] > 0
        assert_same(ref, got)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        (
            "llama",
            {
                "tie_word_embeddings": True,
                "num_attention_heads": 8,
                "num_key_value_heads": 1,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        ("qwen3", {}),
        ("qwen2", {}),
    ],
)
def test_tiny_models_equal_hf(tmp_path, arch, overrides, cpu_path):
    # A larger init than HF's 0.02 makes logits peaked, so argmax is not decided by float noise.
    path = make_tiny_model(tmp_path / arch, arch=arch, initializer_range=0.2, num_hidden_layers=3, **overrides)
    tok = load_tokenizer(path)
    ids = [tok.encode(p) for p in PROMPTS[:6]] + [list(range(100, 180))]  # one prompt spans 5+ blocks
    ref = hf_greedy(path, ids, 24)
    for kw in (
        {},
        {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
        {"num_kv_blocks": 40, "block_size": 4},
    ):
        got, stats = engine_greedy(path, ids, 24, attention_backend=cpu_path, **kw)
        assert_same(ref, got)
        if "num_kv_blocks" in kw:
            assert stats["num_preemptions"] > 0
