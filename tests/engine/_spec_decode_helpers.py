"""What the speculative decoding tests share (``test_spec_decode_equals_hf.py``,
``test_spec_decode_outputs.py``): the n-gram configuration, prompts whose continuations copy from
the prompt, a deterministic step-cost clock and greedy outputs of a speculating engine."""

from __future__ import annotations

from kvserve.engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
#: prompts whose continuations copy from the prompt (drafts hit) next to ones that do not
COPY_PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,",
]


class StepCostClock:
    """A deterministic clock for the adaptive draft-length policy: each reading advances by
    ``a + b * rows`` seconds, ``rows`` being the query rows of the engine's running requests
    (their last token plus their drafts), so the step time the engine measures (two readings
    around the model call) follows a linear cost model whatever the host is doing. With real
    time, a test's draft counts depend on the machine and its load."""

    def __init__(self, engine, a: float = 0.010, b: float = 0.0005):
        self.engine, self.a, self.b, self.t = engine, a, b, 0.0

    def __call__(self) -> float:
        rows = sum(1 + len(r.spec_token_ids) for r in self.engine.scheduler.running)
        self.t += self.a + self.b * rows
        return self.t


def spec_greedy(path, ids, new_tokens, spec, **kw):
    """Greedy outputs of an engine with speculation ``spec``, in float32 unless ``kw`` says
    otherwise: they are compared token for token with float32 references (HF, or the engine
    without speculation), and verifying k drafted tokens in one step changes the matmul shapes,
    so bfloat16 (``dtype="auto"`` on a CPU with native bf16) may round a near tie either way."""
    kw.setdefault("dtype", "float32")
    llm = LLM(model=str(path), speculative_config=spec, **kw)
    llm.engine.clock = StepCostClock(llm.engine)
    outs = llm.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    llm.engine.scheduler.kv.pool.check()
    return [o.outputs[0].token_ids for o in outs], stats, llm
