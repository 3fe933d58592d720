"""What the engine's fault-injection and fuzz tests share (``test_fault_injection.py``,
``test_engine_fuzz.py``): the bounds of a comparison with the reference engine, the tiny model's
length and the float32 dtype, the reference engines (:class:`Reference`), the idle-engine check
and the run's counters (:data:`TOTALS`, :data:`ARMED`, :data:`FIRED`)."""

from __future__ import annotations

import json
import math
from collections import Counter

from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pooling import PoolingParams
from faults import Faults

#: How far below the reference's best log-probability a greedy token may be where it parts
#: from the reference (a near tie), by KV cache dtype: float32 rounding differs with batch
#: composition, chunking and attention backend. None: not compared token for token. With fp8,
#: a chunk attends to its own tokens' exact K/V and to earlier chunks' (and prefix-cache hits')
#: float8 K/V, so where a prompt was cut (which depends on what else is scheduled) moves the
#: logits by float8's noise, and the random tiny model's distributions are so flat that such
#: noise reorders its top-5 (seen: a first token outside the one-chunk reference's top-5).
#: float8 accuracy is checked where the schedule is known: tests/engine/test_kv_fp8.py (HF
#: replaying the engine's schedule with float8 rounding, token for token; SmolLM2's answers and
#: perplexity; an adapter's K/V not clamped).
TIE = {"auto": 1e-4, "fp8": None}
#: The same bound for a float8 request whose schedule was the reference's: its whole prompt in
#: one step from position 0 (no prefix-cache hit, no chunking), then one token per step (no
#: drafts, no preemption), so both attend to the same K/V read back from float8, and only batch
#: composition's float32 rounding differs (:func:`one_chunk_schedule`).
TIE_FP8_SAME_SCHEDULE = 1e-4
#: Least cosine similarity of an embedding to the reference engine's (float32; chunked prefill,
#: prefix-cache hits and batch composition round differently), by KV cache dtype: with fp8, a
#: prompt prefilled in chunks attends to its earlier chunks' float8 K/V, where the reference's
#: one-chunk prefill attends to them unquantized, and where a prompt is cut depends on what
#: else is scheduled (on timing, in the async engine). With random LoRA adapters (deltas of the
#: order of the weights, far from a trained adapter's) at 1- to 4-token chunks it fell to 0.967,
#: so for fp8 this only catches gross faults (another request's rows or adapter: cosine near
#: 0); float8 accuracy is test_kv_fp8's (an adapter's embedding at 4-token chunks >= 0.999).
POOL_COS = {"auto": 0.9999, "fp8": 0.9}
#: What :func:`greedy_verdict` may say of a fuzzed request.
OK_VERDICTS = ("equal", "tie", "not compared")
MAX_MODEL_LEN = 64
#: Every test here compares with a float32 reference: ``dtype="auto"`` would pick bfloat16 on a
#: CPU with native bf16.
DTYPE = "float32"
#: Adapters of the LoRA configurations (``tests/engine/test_lora.py``'s three, at most rank 16).
NUM_ADAPTERS = 3

STRUCTURED = [{"json_object": True}, {"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-z]{1,8}( [a-z]{1,8}){0,4}"}]


TOTALS = Counter()
ARMED = Counter()  # hook -> faults armed
FIRED = Counter()  # hook -> faults that raised (distinct requests; per configuration for the stat logger)


def count_fired(faults: Faults) -> None:
    """Add what ``faults`` raised to :data:`FIRED`: once per (hook, request)."""
    for hook, _ in set(faults.fired):
        FIRED[hook] += 1


def greedy_verdict(
    got: list[int], ref: list[int], ref_logprobs: list[dict[int, float]], tie: float | None = TIE["auto"]
) -> str:
    """Compare a greedy request's tokens with the reference's: ``"equal"`` (``got`` is a
    prefix of ``ref``), ``"tie"`` (they part where ``got``'s token is among the reference's
    top-5 there and its log-probability is within ``tie`` of the reference's best, :data:`TIE`),
    ``"not compared"`` (``tie`` None), or a description of the first real difference."""
    if tie is None:
        return "not compared"
    for i, t in enumerate(got):
        if i >= len(ref):
            return f"longer than the reference ({len(got)} > {len(ref)} tokens)"
        if t != ref[i]:
            lp = ref_logprobs[i]
            gap = max(lp.values()) - lp[t] if t in lp else math.inf
            if gap < tie:
                TOTALS["largest tie gap"] = max(TOTALS["largest tie gap"], gap)
                return "tie"
            return f"token {i}: {t} != reference {ref[i]} (log-probability {gap:.3g} below the reference's best)"
    return "equal"


def one_chunk_schedule(steps: list[tuple[int, int]] | None, prompt_len: int) -> bool:
    """Whether a request's steps ``[(start, tokens), ...]`` (the scheduler's slices of it, in
    order) are the reference engine's: the whole prompt in the first step from 0, then one token
    per step, each right after the last."""
    if not steps or steps[0] != (0, prompt_len):
        return False
    return all(step == (prompt_len + i, 1) for i, step in enumerate(steps[1:]))


def cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0


def check_against_reference(
    rid: str, cfg: dict, out, pooling: str | None, ref, detail: str = "", same_schedule: bool = False
) -> None:
    """One fuzzed request's output ``out`` against the reference's ``ref`` (its pooled vector
    when ``pooling`` is set, else its greedy ``(token_ids, logprobs)``), under the bounds of
    ``cfg``'s KV dtype (:data:`POOL_COS`, :data:`TIE`; a float8 request whose steps were the
    reference's, ``same_schedule`` (:func:`one_chunk_schedule`), under
    :data:`TIE_FP8_SAME_SCHEDULE`), counted in :data:`TOTALS` (with the least embedding cosine
    per KV dtype); ``detail`` is added to a failure's message."""
    kv = cfg["kv_cache_dtype"]
    if pooling is not None:
        cos = cosine(out.pooled, ref)
        key = f"least embedding cosine ({kv} KV)"
        TOTALS[key] = min(TOTALS.get(key, 1.0), cos)
        TOTALS["embeddings equal (cosine)"] += 1
        assert cos >= POOL_COS[kv], f"{rid} ({cfg}): embedding cosine {cos} to the reference's{detail}"
        return
    tie = TIE_FP8_SAME_SCHEDULE if kv == "fp8" and same_schedule else TIE[kv]
    verdict = greedy_verdict(out.outputs[0].token_ids, *ref, tie=tie)
    TOTALS[f"greedy {verdict if verdict in OK_VERDICTS else 'different'}"] += 1
    if kv == "fp8" and verdict != "not compared":
        TOTALS["fp8 greedy compared (same schedule as the reference)"] += 1
    assert verdict in OK_VERDICTS, f"{rid} ({cfg}): {verdict}{detail}"


def reference_params(p: SamplingParams) -> SamplingParams:
    """What the reference runs for a greedy request: the same tokens-shaping fields, top-5
    logprobs (:func:`greedy_verdict`), no stop strings (those only cut the output), no detokenization."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=5,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        structured_outputs=p.structured_outputs,
        detokenize=False,
    )


class Reference:
    """Reference engines (one per quantization x KV dtype x LoRA on/off), each a roomy float32
    configuration with no speculation and no prefix caching and a slot for every adapter;
    results cached by prompt, adapter and parameters (or pooling type)."""

    def __init__(self, model: str):
        self.model, self.engines, self.cache = model, {}, {}

    def _engine(self, setup: tuple) -> LLMEngine:
        if setup not in self.engines:
            quantization, kv_cache_dtype, lora = setup
            self.engines[setup] = LLMEngine(
                EngineConfig(
                    model=self.model,
                    dtype=DTYPE,
                    block_size=16,
                    max_num_seqs=32,
                    max_num_batched_tokens=1024,
                    num_kv_blocks=160,
                    max_model_len=MAX_MODEL_LEN,
                    enable_prefix_caching=False,
                    quantization=quantization,
                    kv_cache_dtype=kv_cache_dtype,
                    **({"enable_lora": True, "max_loras": NUM_ADAPTERS, "max_lora_rank": 16} if lora else {}),
                )
            )
        return self.engines[setup]

    @staticmethod
    def setup_of(cfg: dict) -> tuple:
        """The reference engine a fuzzed configuration is compared with: ``(quantization,
        kv_cache_dtype, LoRA enabled)``."""
        return cfg["quantization"], cfg["kv_cache_dtype"], bool(cfg.get("enable_lora"))

    @staticmethod
    def key(prompt_ids, p: SamplingParams | None, lora=None, pooling: str | None = None) -> tuple:
        adapter = lora.lora_name if lora is not None else None
        if pooling is not None:
            return (tuple(prompt_ids), adapter, "pooling", pooling)
        r = reference_params(p)
        return (
            tuple(prompt_ids),
            adapter,
            r.max_tokens,
            r.min_tokens,
            tuple(r.stop_token_ids),
            r.ignore_eos,
            r.presence_penalty,
            r.frequency_penalty,
            r.repetition_penalty,
            json.dumps(r.structured_outputs, sort_keys=True),
        )

    def run(self, setup: tuple, wanted: list[tuple]) -> list:
        """For each ``(prompt_ids, params, lora_request, pooling_type)`` of ``wanted``: the
        reference's ``(token_ids, logprobs)`` (greedy generation) or pooled vector (a pooling
        type given) under ``setup`` = ``(quantization, kv_cache_dtype, lora enabled)``."""
        eng = self._engine(setup)
        todo = {}
        for ids, p, lora, pooling in wanted:
            k = setup + self.key(ids, p, lora, pooling)
            if k not in self.cache and k not in todo:
                rid = f"ref{len(self.cache) + len(todo)}"
                todo[k] = eng.add_request(
                    rid,
                    list(ids),
                    None if pooling else reference_params(p),
                    lora_request=lora,
                    pooling_params=PoolingParams(pooling) if pooling else None,
                )
        ids_of = {req.request_id: k for k, req in todo.items()}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    assert out.error is None, out.error
                    c = out.outputs[0]
                    self.cache[ids_of[out.request_id]] = (
                        out.pooled if out.pooled is not None else (list(c.token_ids), list(c.logprobs))
                    )
        return [self.cache[setup + self.key(ids, p, lora, pooling)] for ids, p, lora, pooling in wanted]

    def close(self):
        for e in self.engines.values():
            e.shutdown()


def assert_idle(engine: LLMEngine):
    assert engine.scheduler.requests == {} and not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    kv.check([])
    assert kv.pool.num_free_blocks == kv.num_blocks
