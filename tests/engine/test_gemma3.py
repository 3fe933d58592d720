"""Gemma 3 (``kvserve/engine/models/gemma3.py``): greedy outputs equal Hugging Face transformers token for
token, with sliding-window (local) layers.

The reference is HF's ``Gemma3ForCausalLM`` loaded from the same folder in float32 with eager
attention, each prompt run alone (no padding); kvserve runs all prompts in one ``generate``
call (flattened varlen batch, paged KV cache).

* A tiny random-weight Gemma 3 (``tests/tiny_models.py``: 3 layers local / global / local,
  ``sliding_window`` 16) covers what needs prompts longer than the window: batched prefill,
  decode past the window, chunked prefill with chunks smaller than the window, prefix-cache hits
  on a prefix longer than the window, preemption by recompute, and the Triton kernels (under the
  interpreter, in a subprocess) on the same model.
* The real Gemma 3 270M (bundled, ``@pytest.mark.slow``) covers the converted folder, a few short
  prompts and the chat template; its window (512) is longer than these prompts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.llm_engine import chat_template_ids
from kvserve.engine.model_loader import (
    GEMMA3_270M,
    iter_safetensors,
    load_config,
    load_tokenizer,
    resolve_model,
)

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 16
NEW_TOKENS = 24


def hf_greedy(path, prompts: list[list[int]], new_tokens: int, logprobs: bool = False):
    """HF eager float32 greedy continuation of each prompt alone; with ``logprobs`` also the
    log-softmax of each step's logits (``[new_tokens, vocab]`` per prompt)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out, lps = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append(y.sequences[0, len(ids) :].tolist())
            lps.append(torch.cat(y.logits).float().log_softmax(-1))
    return (out, lps) if logprobs else out


def engine_greedy(llm: LLM, prompts, new_tokens: int = NEW_TOKENS, **params):
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, **params), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs], outs


def assert_same(ref, got):
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g == r, f"prompt {i} diverges at token {next(j for j, (a, b) in enumerate(zip(r, g)) if a != b)}"


def assert_no_leak(llm: LLM):
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    return stats


# ------------------------------------------------------------------------ tiny Gemma 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny Gemma 3 (sliding window 16, layers local/global/local), its prompts and HF's
    greedy continuations. Two prompts (60 and 45 tokens) are longer than the window, so their
    local layers must drop the oldest keys in prefill and in every decode step."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny_gemma3"),
        arch="gemma3",
        initializer_range=0.1,
        num_hidden_layers=3,
        sliding_window=WINDOW,
    )
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "List three colors:")]
    prompts += [list(range(100, 160)), list(range(3000, 3090, 2))]
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def test_tiny_config_is_gemma3_with_local_and_global_layers(tiny):
    path, prompts, ref = tiny
    cfg = load_config(path)
    assert cfg.architectures == ["Gemma3ForCausalLM"] and cfg.sliding_window == WINDOW
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert max(map(len, prompts)) + NEW_TOKENS > 4 * WINDOW
    # the window matters: full attention in every layer continues the long prompts differently
    full = make_tiny_model(
        path.parent / "full",
        arch="gemma3",
        initializer_range=0.1,
        num_hidden_layers=3,
        layer_types=["full_attention"] * 3,
    )
    assert hf_greedy(full, prompts[3:], NEW_TOKENS) != ref[3:]
    model = LLM(model=str(path), dtype="float32").engine.executor.runner.model
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, None, WINDOW]


def test_tiny_batched_equals_hf_then_prefix_hits(tiny):
    path, prompts, ref = tiny
    llm = LLM(model=str(path), dtype="float32")
    got, _ = engine_greedy(llm, prompts)
    assert llm.get_stats()["max_running_batch"] == len(prompts)
    assert_same(ref, got)
    # Again: the long prompts' full blocks (48 and 32 tokens, longer than the window) come
    # from the prefix cache; the local layers read them through the window all the same.
    got, outs = engine_greedy(llm, prompts)
    assert [o.num_cached_tokens for o in outs[3:]] == [48, 32]
    assert_same(ref, got)
    assert_no_leak(llm)


def test_tiny_prefix_hit_on_shared_prefix_longer_than_window(tiny):
    """A second request shares a 50-token prefix with the first (run before it): 48 tokens come
    from the cache, and the rest of its prompt attends to them through the window."""
    path, _, _ = tiny
    shared = list(range(500, 550))
    a, b = shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]
    ref = hf_greedy(path, [b], NEW_TOKENS)
    llm = LLM(model=str(path), dtype="float32")
    engine_greedy(llm, [a])
    got, outs = engine_greedy(llm, [b])
    assert outs[0].num_cached_tokens == 48
    assert_same(ref, got)
    assert_no_leak(llm)


def test_tiny_chunked_prefill_equals_hf(tiny):
    """Chunks of 7 tokens (smaller than the window, starting mid-block) with decodes between."""
    path, prompts, ref = tiny
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False)
    got, _ = engine_greedy(llm, prompts)
    stats = assert_no_leak(llm)
    assert stats["num_steps"] > NEW_TOKENS + sum(map(len, prompts)) // 7 - 1  # prompts were chunked
    assert_same(ref, got)


def test_tiny_preemption_recompute_equals_hf(tiny):
    path, prompts, ref = tiny
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=30, block_size=4)
    got, _ = engine_greedy(llm, prompts)
    assert assert_no_leak(llm)["num_preemptions"] > 0
    assert_same(ref, got)


def test_tiny_final_logit_softcapping_matches_hf_logprobs(tmp_path, tiny):
    """``final_logit_softcapping`` 2.0 squeezes logits of magnitude ~5 (greedy tokens stay, as
    tanh is monotonic): the returned logprobs must be those of the capped logits. The config's
    ``attn_logit_softcapping`` is ignored as by HF's Gemma 3, so outputs still match HF."""
    _, prompts, _ = tiny
    path = make_tiny_model(
        tmp_path / "capped",
        arch="gemma3",
        initializer_range=0.1,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        final_logit_softcapping=2.0,
        attn_logit_softcapping=0.5,
    )
    ref, ref_lp = hf_greedy(path, prompts[3:], 8, logprobs=True)
    llm = LLM(model=str(path), dtype="float32")
    got, outs = engine_greedy(llm, prompts[3:], 8, logprobs=3)
    assert_same(ref, got)
    worst = 0.0
    for out, lp in zip(outs, ref_lp):
        for step, d in enumerate(out.outputs[0].logprobs):
            assert len(d) >= 3
            worst = max(worst, max(abs(v - lp[step, t].item()) for t, v in d.items()))
    assert worst < 1e-4, worst
    uncapped = max(lp.exp().max().item() for lp in hf_greedy(tiny[0], prompts[3:], 8, logprobs=True)[1])
    assert max(lp.exp().max().item() for lp in ref_lp) < uncapped  # the cap flattened the distribution


_TRITON_CHILD = r"""
import json, sys
from kvserve.engine import LLM, SamplingParams
path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=path, dtype="float32", attention_backend="triton", max_num_batched_tokens=32)  # vs HF float32
outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
stats = llm.get_stats()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "leak": stats["free_kv_blocks"] != stats["num_kv_blocks"]}))
"""


@pytest.mark.timeout(300)
def test_tiny_triton_backend_equals_hf(tiny):
    """The same model through the Triton kernels (interpreter, own process: the variable must be
    set before any kernel is decorated, and a bad load can crash it): windowed prefill, chunked
    prefill (32-token budget) and windowed split-K decode."""
    path, prompts, ref = tiny
    n = 12
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="2",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_CHILD, str(path), json.dumps(prompts), str(n)],
        check=False,
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not res["leak"]
    assert_same([r[:n] for r in ref], res["tokens"])


# ------------------------------------------------------------------ real Gemma 3 270M


@pytest.fixture(scope="module")
def gemma_path():
    """Gemma 3 270M (base) as float32 safetensors, converted once from the bundled GGUF (~50 s
    the first time, instant afterwards)."""
    return resolve_model(GEMMA3_270M)


@pytest.mark.slow
def test_gemma_270m_converted_folder(gemma_path):
    assert resolve_model("google/gemma-3-270m") == gemma_path
    cfg = load_config(gemma_path)
    assert cfg.architectures == ["Gemma3ForCausalLM"] and cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (18, 640, 256, 262144)
    assert cfg.sliding_window == 512 and cfg.tie_word_embeddings is True
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert not hasattr(cfg, "quantization_config")
    names = {name for name, _ in iter_safetensors(gemma_path)}
    assert "lm_head.weight" not in names and "model.layers.17.post_feedforward_layernorm.weight" in names
    gen = json.loads((gemma_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]
    tok = load_tokenizer(gemma_path)
    assert tok.convert_ids_to_tokens([1, 2, 106]) == ["<eos>", "<bos>", "<end_of_turn>"]


@pytest.mark.slow
def test_gemma_270m_equals_hf_with_chat_template(gemma_path):
    tok = load_tokenizer(gemma_path)
    chat = chat_template_ids(
        tok,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    )
    assert tok.decode(chat) == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?"
        "<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ValueError, match="alternate"):
        chat_template_ids(tok, [{"role": "assistant", "content": "Hi"}])
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):"), chat]
    ref = hf_greedy(gemma_path, prompts, 16)
    llm = LLM(model=GEMMA3_270M, dtype="float32")  # vs HF float32, token for token
    assert {1, 106} <= llm.engine.eos_token_ids
    got, _ = engine_greedy(llm, prompts, 16)
    assert_same(ref, got)
    assert "return" in tok.decode(got[1])  # sane weights: the base model continues code as code
    assert_no_leak(llm)
