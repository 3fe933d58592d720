"""bfloat16 on CPU: what ``dtype="auto"`` picks, and the bf16 engine's quality against Hugging Face
transformers in bf16 and against our own float32.

bf16 outputs cannot equal float32 token for token, and two bf16 implementations round at
different places, so the comparison is vLLM's ``check_logprobs_close`` idea: walking each greedy
output, the two sides agree token by token until the first position where they differ; there
each side's token must be among the other side's top-k candidates (a near tie, not a bug), and
the rest of that output is not compared (the contexts differ from there on). Plus the answers
that matter (Paris) and perplexity on the shipped text within 1 % of float32.

These run on any CPU: without native bf16 (AVX2) the matmuls are emulated and slower, not wrong.
"""

import logging
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvserve.engine.config as config
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_loader import load_tokenizer
from helpers import sized
from test_correctness import PROMPTS as CORRECTNESS_PROMPTS

PROMPTS = CORRECTNESS_PROMPTS[:5] + CORRECTNESS_PROMPTS[6:7]  # "In 1492, Columbus"
NEW_TOKENS = 24
TOP_K = 5
TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "public_domain.txt"


@pytest.mark.parametrize(
    "native, quantization, expected",
    [(True, None, torch.bfloat16), (False, None, torch.float32), (True, "int8", torch.float32)],
)
def test_auto_dtype_follows_the_cpu(monkeypatch, native, quantization, expected):
    monkeypatch.setattr(config, "cpu_native_bf16", lambda: (native, "avx512_bf16" if native else "none"))
    cfg = EngineConfig(device="cpu", quantization=quantization)
    dtype, why = cfg.auto_dtype()
    assert cfg.torch_dtype == dtype == expected
    assert str(expected).removeprefix("torch.") in why
    assert EngineConfig(device="cpu", dtype="float32").torch_dtype == torch.float32  # asked for: kept
    assert EngineConfig(device="cuda").auto_dtype()[0] == torch.bfloat16


def test_cpu_native_bf16_reads_the_flags():
    native, flags = config.cpu_native_bf16()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_bf16" in cpuinfo.split() or "amx_bf16" in cpuinfo.split():
        assert native and ("avx512_bf16" in flags or "amx_bf16" in flags)
    elif cpuinfo:
        assert not native and flags == "no avx512_bf16 or amx_bf16"


def test_auto_dtype_is_logged_with_its_reason(tiny_llama_path, monkeypatch, caplog):
    monkeypatch.setattr(config, "cpu_native_bf16", lambda: (True, "avx512_bf16"))
    monkeypatch.setenv("KVSERVE_DTYPE_PROBE", "0")  # the flags' rule (the probe: test_dtype_probe.py)
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        llm = LLM(model=str(tiny_llama_path), device="cpu")
    assert llm.engine.executor.runner.dtype == torch.bfloat16
    assert any(
        "dtype auto -> bfloat16: this CPU has native bf16 dot products (avx512_bf16)" in r.getMessage()
        for r in caplog.records
    )
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64])
def test_bf16_weight_linear_matches_float64(rows):
    """bfloat16 storage, float32 math (CPUs without native bf16): the GEMV (<= 8 rows) and the
    widen-then-oneDNN path equal float64 over the same bf16 values, rounded once to bf16."""
    from kvserve.kernels import cpu_backend

    if not cpu_backend.load_kernel():
        pytest.skip(f"CPU kernels cannot be built here: {cpu_backend.kernel_error()}")
    g = torch.Generator().manual_seed(rows)
    for n, k in ((300, 200), (301, 203)):  # K not a multiple of the vector width: the scalar tail; N odd
        w = (torch.randn(n, k, generator=g) / 10).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        x = torch.randn(rows, 2 * k, generator=g).bfloat16()[:, :k]  # strided rows
        ref = x.double() @ w.double().T + b.double()
        for bias in (b, None):
            y = cpu_backend.bf16_weight_linear(x, w, bias)
            r = ref if bias is not None else ref - b.double()
            assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
            assert ((y.double() - r).abs() <= 2**-8 * r.abs() + 1e-4).all()


def test_decode_rows_take_the_bf16_gemv_on_every_cpu():
    """``kvserve.engine.layers.linear.linear`` gives bfloat16 matmuls of up to ``bf16_gemv_rows()`` rows to
    the bf16 GEMV whether or not the CPU has native bf16 (with a prepacked weight too), and larger
    ones to oneDNN / the widening path: the same bits as the GEMV up to the limit, within bf16
    rounding of float64 everywhere."""
    from kvserve.engine.layers.linear import linear, prepack_weight
    from kvserve.kernels import cpu_backend

    if not cpu_backend.load_kernel():
        pytest.skip(f"CPU kernels cannot be built here: {cpu_backend.kernel_error()}")
    limit = cpu_backend.bf16_gemv_rows()
    assert limit == 8
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(384, 256, generator=g) / 10).bfloat16()
    packed = prepack_weight(w)
    for rows in (1, limit, limit + 1, 16):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        with torch.inference_mode():
            y = linear(x, w, None, packed)
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-4).all()
        if rows <= limit:
            gemv = torch.empty(rows, 384, dtype=torch.bfloat16)
            torch.ops.kvserve_cpu.bf16_gemv(x, w, None, gemv)
            assert torch.equal(y, gemv)


def first_divergence_is_a_near_tie(
    ours: list[int], ours_top: list[dict[int, float]], ref: list[int], ref_top: list[set[int]]
) -> tuple[bool, int]:
    """vLLM's ``check_logprobs_close`` rule on one greedy output: equal until the first
    difference, where each token is in the other's top-k. Returns (ok, tokens compared)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return a in ref_top[i] and b in ours_top[i], i
    return True, len(ref)


@pytest.fixture(scope="module")
def bf16_llm(smollm2_path):
    return LLM(model=str(smollm2_path), dtype="bfloat16", device="cpu")


@pytest.mark.slow
def test_bf16_logprobs_close_to_hf_bf16(smollm2_path, bf16_llm):
    tok = load_tokenizer(smollm2_path)
    ids = [tok.encode(p) for p in PROMPTS]
    outs = bf16_llm.generate(
        ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_K), use_tqdm=False
    )
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.bfloat16).eval()
    compared = 0
    for p, o in zip(ids, outs):
        x = torch.tensor([p])
        with torch.inference_mode():
            g = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        ref = g.sequences[0, len(p) :].tolist()
        ref_top = [set(s[0].float().topk(TOP_K).indices.tolist()) for s in g.scores]
        ours = o.outputs[0].token_ids
        ours_top = o.outputs[0].logprobs
        assert all(len(d) >= TOP_K for d in ours_top)
        ok, n = first_divergence_is_a_near_tie(ours, [set(d) for d in ours_top], ref, ref_top)
        assert ok, f"{tok.decode(p)!r}: at token {n} ours {ours[n]} / HF {ref[n]} is not a near tie"
        compared += n
    assert compared >= len(PROMPTS) * NEW_TOKENS // 2  # mostly equal, not diverged at once


@pytest.mark.slow
def test_bf16_answers_paris_and_keeps_perplexity(smollm2_path, bf16_llm):
    out = bf16_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text

    def perplexity(llm) -> float:
        paragraphs = [p.strip() for p in TEXT.read_text().split("\n\n") if p.strip()]
        outs = llm.generate(paragraphs, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
        nll = [-next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]]
        return math.exp(sum(nll) / len(nll))

    ppl_bf16 = perplexity(bf16_llm)
    ppl_f32 = perplexity(LLM(model=str(smollm2_path), dtype="float32", device="cpu"))
    assert abs(ppl_bf16 / ppl_f32 - 1) <= 0.01, (ppl_bf16, ppl_f32)


#: Chat questions whose greedy answers are compared in a batch and one at a time (the e2e
#: streaming test's questions; "What is the capital of Italy?" starts on a near tie: HF
#: float32's top-2 gap is about 0.12, so bfloat16 may answer either way).
BATCH_QUESTIONS = [
    a.format(t)
    for a in ("What is the capital of {}?", "Describe {} in one sentence.")
    for t in ("France", "Japan", "Italy", "Spain", "Egypt", "Canada", "Brazil", "India")
]
#: How many of BATCH_QUESTIONS the batch comparison decodes: all 16 in the thorough profile, every
#: other one (8, both phrasings) in the fast one; HF's two dtypes then score half the sequences.
BATCH_SIZE = sized(8, 16)


@pytest.mark.slow
def test_bf16_error_against_float32_is_hf_bf16s_in_a_batch_and_alone(smollm2_path, bf16_llm):
    """Is a bf16 answer that differs from float32 a near tie or a defect of the native bf16 path
    at some batch shape? Teacher-forced on the engine's own greedy tokens (16 chats, 16 tokens,
    decoded as one batch and one request at a time), each token's log-probability is
    compared with HF transformers' float32 on the same sequence: the engine's mean error must
    be within 1.5x of HF bf16's own error on the same tokens, in both batch shapes. A kernel that
    accumulated in bf16, or mixed up rows of a batch, is several times HF bf16's error. (The fast
    profile decodes :data:`BATCH_SIZE` of the chats.)"""
    tok = bf16_llm.engine.tokenizer
    questions = BATCH_QUESTIONS[:: len(BATCH_QUESTIONS) // BATCH_SIZE]
    ids = [bf16_llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    runs = {
        "batch": bf16_llm.generate(ids, params, use_tqdm=False),
        "alone": [bf16_llm.generate([p], params, use_tqdm=False)[0] for p in ids],
    }
    hf = {
        d: AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=d).eval()
        for d in (torch.bfloat16, torch.float32)
    }
    for shape, outs in runs.items():
        ours_err, hf_err = [], []
        for p, o in zip(ids, outs):
            toks = o.outputs[0].token_ids
            ours = [d[t] for d, t in zip(o.outputs[0].logprobs, toks)]
            with torch.inference_mode():
                lp = {
                    d: m(torch.tensor([p + toks])).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
                    for d, m in hf.items()
                }
            for j, t in enumerate(toks):
                ref = float(lp[torch.float32][j, t])
                ours_err.append(abs(ours[j] - ref))
                hf_err.append(abs(float(lp[torch.bfloat16][j, t]) - ref))
        mean_ours, mean_hf = sum(ours_err) / len(ours_err), sum(hf_err) / len(hf_err)
        assert mean_ours <= 1.5 * mean_hf + 1e-3, (
            shape,
            mean_ours,
            mean_hf,
            tok.decode(runs[shape][2].outputs[0].token_ids),
        )
