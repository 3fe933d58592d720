"""Structured outputs (grammar-constrained decoding, xgrammar): JSON schema, json_object, regex,
choice and EBNF grammar requests on the real SmolLM2, batched with unconstrained requests; and on
the tiny random-weight Llama (whose free text is gibberish, so any valid output is the grammar's
doing) through chunked prefill, prefix caching, preemption, min_tokens / ignore_eos and streaming.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import re
import sys

import jsonschema
import pytest
import torch
from tiny_models import run_async_engine

from kvserve.engine import LLM, EngineConfig, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.structured_output import (
    ASYNC_FILL_MIN_ROWS,
    StructuredOutputs,
    _apply_torch,
    apply_token_bitmask,
    bitmask_rows,
    choice_grammar,
)

import xgrammar as xgr  # noqa: E402  (a dependency: a missing install must fail here, not skip)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
JSON_QUESTIONS = [
    "Describe a person named Alice as JSON.",
    "Give me a JSON record for a pet owner.",
    "Make up a character for a fantasy novel, as JSON.",
    "Who is your favourite scientist? Answer in JSON.",
    "Create a JSON profile of a chef.",
    "Invent a superhero and give their details in JSON.",
    "Describe your best friend as a JSON object.",
    "Return a JSON user record for a teenager.",
    "JSON for a retired pilot, please.",
    "Describe an astronaut in JSON.",
]
FREE_QUESTIONS = ["What is the capital of France?", "Tell me a joke.", "Name three colors."]
DATE = r"\d{4}-\d{2}-\d{2}"
_ids = itertools.count()


def chat(llm: LLM, question: str) -> dict:
    return {"prompt_token_ids": llm.engine.apply_chat_template([{"role": "user", "content": question}])}


def assert_idle(engine: LLMEngine) -> None:
    """Every request left the engine, every KV block is back, no matcher is held."""
    s = engine.get_stats()
    assert not engine.scheduler.requests and not engine.structured_outputs.requests
    assert s["free_kv_blocks"] == s["num_kv_blocks"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    # float32: grammar requests and free ones share batches, and free outputs are compared token for
    # token with those of a batch without grammars (bfloat16 may round a near tie either way)
    llm = LLM(
        model=str(smollm2_path),
        dtype="float32",
        block_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        num_kv_blocks=256,
        max_model_len=1024,
    )
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def free_reference(llm):
    """Greedy outputs of the unconstrained prompts, run without any grammar request."""
    outs = llm.generate(
        [chat(llm, q) for q in FREE_QUESTIONS], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )
    assert llm.engine.structured_outputs._compiler is None  # no grammar request: xgrammar untouched
    return [o.outputs[0].token_ids for o in outs]


def json_params(i: int, **kw) -> SamplingParams:
    """Even i greedy, odd i sampled with a seed."""
    sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.95, seed=1000 + i)
    return SamplingParams(max_tokens=96, structured_outputs={"json": SCHEMA}, **sampling, **kw)


def test_json_schema_batched_with_unconstrained(llm, free_reference):
    seen, async_rows = [], set()
    run = llm.engine.executor.execute_model

    def spy(sched):  # what the runner is sent: bitmask rows only for sampling grammar requests
        if sched.grammar_bitmask is not None:
            sampling = {sr.request_id for sr in sched.requests if sr.sample}
            assert set(sched.grammar_req_ids) <= sampling
            bm = sched.grammar_bitmask
            # in-process executor: a Future filled while the model runs from ASYNC_FILL_MIN_ROWS rows, else filled
            assert hasattr(bm, "result") == (len(sched.grammar_req_ids) >= ASYNC_FILL_MIN_ROWS)
            bm = bm.result() if hasattr(bm, "result") else bm
            async_rows.add(hasattr(sched.grammar_bitmask, "result"))
            assert bm.shape == (len(sched.grammar_req_ids), (49152 + 31) // 32) and bm.dtype == torch.int32
        seen.append((len(sched.requests), len(sched.grammar_req_ids)))
        return run(sched)

    llm.engine.executor.execute_model = spy
    try:
        prompts = [chat(llm, q) for q in JSON_QUESTIONS + FREE_QUESTIONS]
        params = [json_params(i) for i in range(len(JSON_QUESTIONS))]
        params += [SamplingParams(temperature=0, max_tokens=24)] * len(FREE_QUESTIONS)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.executor.execute_model
    assert (13, 10) in seen  # grammar and free requests shared steps
    assert async_rows == {True, False}  # both fills ran: in a thread beside the model (10 rows), in the step (1)
    for o in outs[: len(JSON_QUESTIONS)]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # unconstrained requests are untouched by the grammar rows beside them
    assert [o.outputs[0].token_ids for o in outs[len(JSON_QUESTIONS) :]] == free_reference
    free_texts = [o.outputs[0].text for o in outs[len(JSON_QUESTIONS) :]]
    assert not any(t.lstrip().startswith("{") for t in free_texts)
    # a seeded grammar request draws the same alone as in the batch
    alone = llm.generate([prompts[1]], json_params(1), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert_idle(llm.engine)


def test_other_kinds(llm):
    moon = chat(llm, "When did the first person walk on the moon?")
    ebnf = 'root ::= "Answer: " ("yes" | "no") " because " [a-z ]+ "."'
    year = json.dumps({"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]})
    cases = [
        (moon, {"regex": DATE}),
        (moon, {"choice": ["yes", "no", "maybe so"]}),
        (chat(llm, "Return a JSON object with your name and age."), {"json_object": True}),
        (moon, {"grammar": ebnf}),
        (moon, {"json": year}),
    ]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=s) for _, s in cases]
    params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=8, structured_outputs=cases[1][1]))
    outs = [o.outputs[0] for o in llm.generate([p for p, _ in cases] + [moon], params, use_tqdm=False)]
    assert all(c.finish_reason == "stop" for c in outs), outs
    assert re.fullmatch(DATE, outs[0].text)
    assert outs[1].text in ("yes", "no", "maybe so") and outs[5].text in ("yes", "no", "maybe so")
    assert isinstance(json.loads(outs[2].text), dict)
    assert re.fullmatch(r"Answer: (yes|no) because [a-z ]+\.", outs[3].text)
    assert isinstance(json.loads(outs[4].text)["year"], int)
    assert_idle(llm.engine)


def test_max_tokens_cuts_json(llm):
    out = llm.generate(
        [chat(llm, JSON_QUESTIONS[0])],
        SamplingParams(temperature=0, max_tokens=5, structured_outputs={"json": SCHEMA}),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"name": "')
    with pytest.raises(ValueError):
        json.loads(out.text)
    assert_idle(llm.engine)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json": {"type": "objec"}}, "json is invalid"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "JSON schema object"),
        ({"regex": "(ab"}, "regex is invalid"),
        ({"grammar": "root ::= foo"}, "grammar is invalid"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", ""]}, "choice"),
        ({"json_object": False}, "json_object"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"regexp": "a"}, "unknown key"),
        ({"regex": "a", "whitespace_flexible": True}, "whitespace_flexible"),
        ("not a dict", "must be a dict"),
    ],
)
def test_invalid_specs_raise(llm, spec, words):
    with pytest.raises(ValueError, match="^structured_outputs") as e:
        llm.engine.add_request(f"bad-{next(_ids)}", "hi", SamplingParams(structured_outputs=spec))
    assert words in str(e.value) and "/project/" not in str(e.value)
    assert_idle(llm.engine)


def test_repeated_schema_is_not_recompiled(llm):
    so = llm.engine.structured_outputs
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]{3}$"}}}
    so.compile({"json": schema})
    size = so.compiler().get_cache_size_bytes()
    so.compile({"json": json.dumps(schema)})  # the same text: a cache hit, nothing added
    assert so.compiler().get_cache_size_bytes() == size
    schema["properties"]["k"]["pattern"] = "^[a-z]{4}$"
    so.compile({"json": schema})  # a new schema is compiled and cached
    assert so.compiler().get_cache_size_bytes() > size


# ---- tiny random-weight model: cheap engine paths ---------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    def make(**kw):
        cfg = dict(
            model=str(tiny_llama_path),
            dtype="float32",
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_kv_blocks=256,
            max_model_len=256,
            enable_prefix_caching=True,
        )
        cfg.update(kw)
        return LLM(**cfg)

    return make


LONG = "The history of the city goes back many centuries, with markets, walls and rivers " * 3


def test_chunked_prefill_prefix_cache_and_preemption(tiny):
    specs = [{"regex": DATE}, {"choice": ["alpha", "beta", "gamma delta"]}, {"regex": r"[a-z]{30}"}] * 2
    # ~100-token prompts (chunked: 64-token budget); three share a prefix (prefix-cache hits)
    prompts = [LONG * 2 + str(i) if i < 3 else str(i) + LONG * 2 for i in range(len(specs))]
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=40, structured_outputs=s)
        for i, s in enumerate(specs)
    ]
    roomy = tiny()
    ref = [o.outputs[0] for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert_idle(roomy.engine)
    tight = tiny(num_kv_blocks=48, max_model_len=192)  # ~35 blocks a request: preemption by recompute
    got = [o.outputs[0] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert roomy.engine.scheduler.kv.hit_rate() > 0
    assert_idle(tight.engine)
    for a, b, s in zip(ref, got, specs):
        assert a.finish_reason == "stop" and a.token_ids == b.token_ids, (a, b)
        assert re.fullmatch(s["regex"], a.text) if "regex" in s else a.text in s["choice"]
    roomy.engine.shutdown()
    tight.engine.shutdown()


def test_free_text_of_tiny_model_is_not_json(tiny):
    """The control: without the grammar the tiny model's output is far from any of the specs."""
    llm = tiny()
    out = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert not re.fullmatch(DATE, out.text) and out.text not in ("alpha", "beta", "gamma delta")
    llm.engine.shutdown()


def test_grammar_starts_after_the_reasoning_end(tiny):
    """A reasoning model's structured output (``reasoning_end_token_ids``): its tokens run free
    until the end marker (here two tokens of the tiny model's own greedy free text), the grammar
    holds after it; a marker that never comes leaves the whole output free."""
    llm = tiny()
    free = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    end = free.token_ids[2:4]
    start = next(i + 2 for i in range(len(free.token_ids)) if free.token_ids[i : i + 2] == end)
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs={"regex": DATE}, reasoning_end_token_ids=end
    )
    out = llm.generate([LONG], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:start] == free.token_ids[:start]  # the reasoning: the free text, untouched
    answer = llm.engine.tokenizer.decode(out.token_ids[start:], skip_special_tokens=True)
    assert re.fullmatch(DATE, answer) and out.finish_reason == "stop", (out, answer)
    never = next(t for t in range(100, 300) if t not in free.token_ids)
    out = llm.generate(
        [LONG],
        SamplingParams(
            temperature=0, max_tokens=8, structured_outputs={"regex": DATE}, reasoning_end_token_ids=[never]
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free.token_ids and out.finish_reason == "length"
    assert_idle(llm.engine)
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        SamplingParams(reasoning_end_token_ids=[])
    llm.engine.shutdown()


def test_grammar_completion_finishes_despite_ignore_eos_and_min_tokens(tiny):
    llm = tiny()
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, structured_outputs={"regex": DATE}),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, structured_outputs={"regex": DATE}),
        SamplingParams(
            temperature=0, max_tokens=40, min_tokens=30, ignore_eos=True, structured_outputs={"choice": ["ok"]}
        ),
    ]
    outs = [o.outputs[0] for o in llm.generate(["Today is"] * 3, params, use_tqdm=False)]
    for c in outs:
        assert c.finish_reason == "stop" and len(c.token_ids) < 30, c
    assert re.fullmatch(DATE, outs[0].text) and re.fullmatch(DATE, outs[1].text) and outs[2].text == "ok"
    assert outs[0].token_ids[-1] in llm.engine.eos_token_ids  # ignore_eos: ended by the grammar on EOS
    assert_idle(llm.engine)
    llm.engine.shutdown()


def test_broken_matcher_fails_its_request_alone(tiny):
    engine = tiny().engine
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": DATE})
    for rid, p in [("a", params), ("b", params), ("free", SamplingParams(temperature=0, max_tokens=6))]:
        engine.add_request(rid, "Today is", p)
    done = {o.request_id: o for o in engine.step() if o.finished}

    class Broken:
        def fill_next_token_bitmask(self, *a):
            raise RuntimeError("boom")

    engine.scheduler.requests["a"].grammar.matcher = Broken()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done["a"].outputs[0].finish_reason == "error" and "boom" in done["a"].error
    assert done["a"].error.startswith("structured_outputs")
    assert re.fullmatch(DATE, done["b"].outputs[0].text) and done["b"].outputs[0].finish_reason == "stop"
    assert len(done["free"].outputs[0].token_ids) == 6
    assert_idle(engine)
    engine.shutdown()


def test_out_of_process_executor_gets_a_picklable_tensor(tiny):
    """A distributed executor (Ray workers) is sent a plain tensor, filled before the step."""
    llm = tiny()
    engine, sent = llm.engine, []
    engine.executor.in_process = False
    run = engine.executor.execute_model

    def spy(sched):
        if sched.grammar_bitmask is not None:
            assert isinstance(sched.grammar_bitmask, torch.Tensor)
            sent.append(pickle.loads(pickle.dumps(sched)).grammar_bitmask)
        return run(sched)

    engine.executor.execute_model = spy
    params = [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": DATE}),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    outs = [o.outputs[0] for o in llm.generate(["Today is"] * 2, params, use_tqdm=False)]
    assert sent and all(b.shape[0] == 1 for b in sent)
    assert re.fullmatch(DATE, outs[0].text) and len(outs[1].token_ids) == 8
    assert_idle(engine)
    engine.shutdown()


def test_streaming_async_engine(tiny_llama_path):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_path),
            block_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            num_kv_blocks=64,
            max_model_len=256,
        )
    )

    async def go(eng):
        async def one(spec, seed):
            deltas, final = [], None
            params = SamplingParams(temperature=0.7, seed=seed, max_tokens=40, structured_outputs=spec)
            async for out in eng.generate("Once upon a time", params):
                deltas.append(out.outputs[0].delta_text)
                final = out
            return "".join(deltas), final.outputs[0]

        return await asyncio.gather(
            one({"regex": DATE}, 1), one({"choice": ["north", "south"]}, 2), one({"regex": r"(ab|cd){3}"}, 3)
        )

    results = run_async_engine(go, engine, 60)
    for (streamed, c), pattern in zip(results, [DATE, "north|south", r"(ab|cd){3}"]):
        assert streamed == c.text and c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), c.text


# ---- units ----------------------------------------------------------------------------------


def test_apply_token_bitmask_matches_xgrammar():
    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32
    bitmask = torch.randint(-(1 << 31), 1 << 31, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    logits = torch.randn(5, vocab, generator=g)
    want = logits.clone()
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[[4, 0, 2]] = bitmask
    xgr.apply_token_bitmask_inplace(want, full, indices=[4, 0, 2])
    for apply in (apply_token_bitmask, _apply_torch):  # the dispatcher and the torch path, against xgrammar's kernel
        got = logits.clone()
        apply(got, bitmask, [4, 0, 2])
        assert torch.equal(got, want)
        assert torch.equal(got[[1, 3]], logits[[1, 3]]) and torch.isinf(got[4]).sum() > 100
    got = logits[:3].clone()  # all rows, in order
    apply_token_bitmask(got, bitmask, [0, 1, 2])
    assert torch.equal(got.isinf(), _unpacked(bitmask, vocab).logical_not())
    for dtype in (torch.bfloat16, torch.float16):  # the logits' dtype as the runner has them
        got = logits[:3].to(dtype)
        apply_token_bitmask(got, bitmask, [2, 0, 1])
        assert torch.equal(got.isinf(), _unpacked(bitmask, vocab)[[1, 2, 0]].logical_not())
    wide = torch.randn(2, vocab + 40, generator=g)  # logits wider than the bitmask: the tail is disallowed
    apply_token_bitmask(wide, bitmask[:1], [1])
    assert torch.isinf(wide[1, bitmask.shape[1] * 32 :]).all() and not torch.isinf(wide[0]).any()


def _unpacked(bitmask, vocab):
    """Reference: bit t % 32 of word t // 32, one token at a time."""
    words = bitmask.tolist()
    return torch.tensor([[(row[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in words])


def test_bitmask_rows_follow_request_ids():
    bm = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    sub, rows = bitmask_rows(bm, ["a", "b", "c"], ["x", "c", "a"])
    assert rows == [2, 1] and sub.tolist() == [[0, 1], [4, 5]]
    assert bitmask_rows(bm, ["a"], ["x"]) is None


def test_choice_grammar_escapes(smollm2_path):
    from kvserve.engine.model_loader import load_tokenizer

    so = StructuredOutputs(load_tokenizer(smollm2_path), 49152, [2])
    choices = ['say "hi"', "back\\slash", "new\nline", "héllo"]
    cg = so.compile({"choice": choices})
    assert choice_grammar(choices).startswith("root ::= ")
    for c in choices + ["nope"]:
        m = xgr.GrammarMatcher(cg)
        assert (m.accept_string(c) and m.is_completed()) == (c != "nope")


def test_engine_without_xgrammar(tiny, monkeypatch):
    """No xgrammar installed: plain requests run; a grammar request is a clear ValueError."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    llm = tiny()
    out = llm.generate(["Today is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"^structured_outputs needs xgrammar: pip install xgrammar"):
        llm.generate(["Today is"], SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
    assert_idle(llm.engine)
    llm.engine.shutdown()


def test_without_xgrammar(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    so = StructuredOutputs(tokenizer=None, vocab_size=100, stop_token_ids=[0])
    with pytest.raises(ValueError, match=r"^structured_outputs needs xgrammar: pip install xgrammar"):
        so.compile({"regex": "a+"})
    SamplingParams(structured_outputs={"regex": "a+"})  # the shape check needs no xgrammar
