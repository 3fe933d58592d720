"""Structured outputs: per-output-token cost of a JSON-schema grammar (xgrammar) against none.

What it measures
----------------
SmolLM2-135M-Instruct in float32 on this machine's CPU, greedy, chat prompts asking for JSON.
For each schema and each batch size (1: requests one at a time; 32: all admitted together):

1. the grammar run: the prompts with ``structured_outputs={"json": schema}``; each request's
   output length is recorded;
2. the plain run: the same prompts without a grammar, ``ignore_eos`` and ``min_tokens =
   max_tokens =`` that request's length, so both runs compute the same tokens per request in
   the same steps at the same batch sizes.

Time is the wall time of ``LLMEngine.step()`` calls without prefill tokens (decode steps), so
``ms_per_token = sum(decode step seconds) / decode tokens``; both runs are repeated ``--reps``
times alternating (grammar, plain, grammar, ...) after a warm-up pair; the medians give
``slowdown``, the fastest runs ``slowdown_best_of_reps`` (less sensitive to other jobs on the CPU). The grammar's parts per decode step are timed too (see ``PARTS``): with the default
in-process executor the bitmask is filled in a worker thread while the model's forward runs
(``fill``, xgrammar's ``BatchGrammarMatcher``), and the sampler only ``wait``s for what is left
of it; ``--sync-fill`` fills it before the forward instead, as for a distributed executor.

Schemas: ``person`` (string / integer / enum / array fields, no length bounds) and
``person_bounded`` (the same with ``maxLength`` / ``maxItems`` / integer range, the schema of
tests/engine/test_structured_output.py): bounded strings cost xgrammar far more per mask row (its
token-mask cache covers less), which is why both are shown.

Compile times: a fresh compiler (xgrammar ``TokenizerInfo`` over the 49k vocabulary), the first
compile of each schema, and a repeated compile of the same schema (xgrammar's cache).

Target (issue): at most 10 % slower per output token with a grammar.

Usage::

    python benchmarks/structured_output.py          # writes benchmarks/results/structured_output.json
    python benchmarks/structured_output.py --reps 1 --batch-sizes 1 --out /tmp/so.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Figures, Results, add_model_arg, load_average  # noqa: E402
from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine import model_runner as runner_mod  # noqa: E402
from kvserve.engine.layers import sampler as sampler_mod  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.engine.model_loader import resolve_model  # noqa: E402
from kvserve.engine import grammar_bitmask  # noqa: E402
from kvserve.engine import structured_output as so_mod  # noqa: E402
from kvserve.engine.structured_output import StructuredOutputs  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}
PERSON_BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
SCHEMAS = {"person": PERSON, "person_bounded": PERSON_BOUNDED}
SUBJECTS = [
    "a chef",
    "a pilot",
    "an astronaut",
    "a teacher",
    "a painter",
    "a farmer",
    "a doctor",
    "a poet",
    "a sailor",
    "a baker",
    "a musician",
    "a gardener",
    "a detective",
    "a librarian",
    "a carpenter",
    "a nurse",
    "a scientist",
    "a dancer",
    "a firefighter",
    "a photographer",
    "a lawyer",
    "a miner",
    "a tailor",
    "a fisherman",
    "a judge",
    "a singer",
    "a blacksmith",
    "a clown",
    "a student",
    "a programmer",
    "a knight",
    "a wizard",
]


#: Grammar work per decode step: the engine's part of the fill (all of it with --sync-fill),
#: the fill itself (xgrammar, in the worker thread when overlapped), the sampler's wait for it,
#: the mask on the logits, the matchers' accept after the step.
#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("model", "dtype", "device", "threads", "max_tokens", "fill", "fill_threads", "compile", "runs", "note")
PARTS = ("engine_fill", "fill", "wait", "apply", "accept")


class Timers:
    """Wall time of the engine's steps (decode-only ones apart) and of the grammar's parts."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.reset()
        self._wrap(so_mod.StructuredOutputs, "fill_bitmask", "engine_fill")
        self._wrap(so_mod.StructuredOutputs, "bitmask", "fill")
        self._wrap(runner_mod, "bitmask_rows", "wait")
        self._wrap(so_mod.StructuredOutputs, "advance", "accept")
        self._wrap(sampler_mod, "apply_token_bitmask", "apply")
        engine.stat_loggers.append(self._on_step)

    def reset(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.decode_s = self.decode_tokens = self.decode_steps = 0
        self._last_prefill = 0

    def _wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.parts[key] += time.perf_counter() - t

        setattr(owner, name, timed)

    def _on_step(self, m) -> None:
        self._last_prefill = m.num_prefill_tokens
        self._last_sampled = m.num_sampled

    def run(self, prompts, params) -> list:
        """Add all requests, step to the end; time decode-only steps."""
        eng, outs = self.engine, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{time.monotonic_ns()}-{i}", p, sp)
        while eng.has_unfinished_requests():
            self._last_prefill, self._last_sampled = -1, 0
            t = time.perf_counter()
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            dt = time.perf_counter() - t
            if self._last_prefill == 0:
                self.decode_s += dt
                self.decode_tokens += self._last_sampled
                self.decode_steps += 1
        return [outs[k] for k in sorted(outs, key=lambda r: int(r.rsplit("-", 1)[1]))]


def measure(llm: LLM, timers: Timers, prompts, schema, batch: int, reps: int, max_tokens: int) -> dict:
    """Grammar and plain runs of ``prompts`` in groups of ``batch``, alternating; medians."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    def one(kind: str, lengths: list[int] | None):
        timers.reset()
        outs = []
        for g, group in enumerate(groups):
            if kind == "grammar":
                params = [
                    SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"json": schema})
                ] * len(group)
            else:
                lens = lengths[g * batch : g * batch + len(group)]
                params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lens]
            outs += timers.run(group, params)
        return {
            "ms_per_token": 1e3 * timers.decode_s / timers.decode_tokens,
            "decode_tokens": timers.decode_tokens,
            "decode_steps": timers.decode_steps,
            "parts_ms_per_step": {k: 1e3 * v / max(1, timers.decode_steps) for k, v in timers.parts.items()},
            "outputs": outs,
        }

    warm = one("grammar", None)  # warm-up pair (first-call allocations; xgrammar's mask caches)
    lengths = [len(o.outputs[0].token_ids) for o in warm["outputs"]]
    one("plain", lengths)
    runs = {"grammar": [], "plain": []}
    load = [load_average()]
    for _ in range(reps):
        g = one("grammar", None)
        assert [len(o.outputs[0].token_ids) for o in g["outputs"]] == lengths  # greedy: same outputs
        runs["grammar"].append(g)
        runs["plain"].append(one("plain", lengths))
        load.append(load_average())
    texts = [o.outputs[0].text for o in runs["grammar"][-1]["outputs"]]
    valid = sum(_is_json_object(t) for t in texts)
    med = {k: statistics.median(r["ms_per_token"] for r in v) for k, v in runs.items()}
    best = {k: min(r["ms_per_token"] for r in v) for k, v in runs.items()}
    parts = {p: statistics.median(r["parts_ms_per_step"][p] for r in runs["grammar"]) for p in PARTS}
    return {
        "batch": batch,
        "requests": len(prompts),
        "reps": reps,
        "grammar_ms_per_token": round(med["grammar"], 3),
        "plain_ms_per_token": round(med["plain"], 3),
        "slowdown": round(med["grammar"] / med["plain"] - 1, 4),
        "slowdown_best_of_reps": round(best["grammar"] / best["plain"] - 1, 4),
        "grammar_ms_per_token_runs": [round(r["ms_per_token"], 3) for r in runs["grammar"]],
        "plain_ms_per_token_runs": [round(r["ms_per_token"], 3) for r in runs["plain"]],
        "grammar_parts_ms_per_decode_step": {k: round(v, 3) for k, v in parts.items()},
        "decode_tokens": runs["grammar"][-1]["decode_tokens"],
        "decode_steps": runs["grammar"][-1]["decode_steps"],
        "output_tokens_mean": round(statistics.mean(lengths), 1),
        "finish_stop": sum(o.outputs[0].finish_reason == "stop" for o in runs["grammar"][-1]["outputs"]),
        "valid_json_objects": valid,
        "example": texts[0],
        "load_average": load,
    }


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def compile_times(tokenizer, vocab: int, eos: set[int]) -> dict:
    """Seconds: compiler construction, first compile per schema, repeated compile (cache hit)."""
    so = StructuredOutputs(tokenizer, vocab, eos)
    t = time.perf_counter()
    so.compiler()
    out = {"compiler_init_s": round(time.perf_counter() - t, 4)}
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        so.compile({"json": schema})
        first = time.perf_counter() - t
        cached = []
        for _ in range(20):
            t = time.perf_counter()
            so.compile({"json": schema})
            cached.append(time.perf_counter() - t)
        t = time.perf_counter()
        so.request_grammar({"json": schema})
        with_matcher = time.perf_counter() - t
        out[name] = {
            "first_compile_ms": round(1e3 * first, 3),
            "cached_compile_ms": round(1e3 * statistics.median(cached), 4),
            "cached_compile_plus_matcher_ms": round(1e3 * with_matcher, 4),
        }
    return out


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    for name, x in r["runs"].items():
        f.summary(f"grammar slowdown, {name}", x["slowdown"] * 100, "%")
    f.table(
        "Runs",
        [
            "schema / batch",
            "batch",
            "grammar ms/token",
            "plain ms/token",
            "slowdown (%)",
            "slowdown, best of reps (%)",
            "bitmask fill per step (ms)",
            "valid JSON objects",
        ],
        [
            [
                name,
                x["batch"],
                x["grammar_ms_per_token"],
                x["plain_ms_per_token"],
                x["slowdown"] * 100,
                x["slowdown_best_of_reps"] * 100,
                x["grammar_parts_ms_per_decode_step"].get("fill"),
                x.get("valid_json_objects"),
            ]
            for name, x in r["runs"].items()
        ],
        note=f"{r['dtype']} on {r['device']}, {r['threads']} threads, bitmask fill: {r['fill']}; median of the "
        "reps. `person`: a schema without length bounds; `person_bounded`: with `maxLength` / `maxItems`. "
        + r.get("note", ""),
    )
    f.table(
        "Grammar compile",
        ["schema", "first (ms)", "cached (ms)"],
        [[k, v["first_compile_ms"], v["cached_compile_ms"]] for k, v in r["compile"].items() if isinstance(v, dict)],
    )
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--requests-b1", type=int, default=4, help="requests of the batch-1 runs (one at a time)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--schemas", default=",".join(SCHEMAS))
    ap.add_argument(
        "--fill-threads",
        type=int,
        default=grammar_bitmask.FILL_THREADS,
        help="native threads of one bitmask fill (xgrammar BatchGrammarMatcher)",
    )
    ap.add_argument(
        "--sync-fill",
        action="store_true",
        help="fill the bitmask before the forward (as for a distributed executor), not beside it",
    )
    ap.add_argument("--out", default="benchmarks/results/structured_output.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    grammar_bitmask.FILL_THREADS = args.fill_threads  # read when the engine's first fill builds its matcher

    model = str(resolve_model(args.model))
    llm = LLM(model=model, max_num_seqs=32, max_num_batched_tokens=2048, enable_prefix_caching=False)
    eng = llm.engine
    if args.sync_fill:
        eng.executor.in_process = False
    result = {
        "model": model,
        "dtype": "float32",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "fill": "sync" if args.sync_fill else "overlapped with the forward",
        "fill_threads": args.fill_threads,
    }
    result["compile"] = compile_times(eng.tokenizer, eng.hf_config.vocab_size, eng.eos_token_ids)
    timers = Timers(eng)
    prompts = [
        eng.apply_chat_template([{"role": "user", "content": f"Describe {s} as a JSON object."}]) for s in SUBJECTS
    ]
    result["runs"] = {}
    for name in args.schemas.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            ps = prompts[: args.requests_b1] if b == 1 else prompts[:b]
            r = measure(llm, timers, ps, SCHEMAS[name], b, args.reps, args.max_tokens)
            result["runs"][f"{name}/batch{b}"] = r
            print(
                f"{name} batch {b}: grammar {r['grammar_ms_per_token']} ms/token, plain "
                f"{r['plain_ms_per_token']} ms/token, slowdown {100 * r['slowdown']:+.1f} % (best of reps "
                f"{100 * r['slowdown_best_of_reps']:+.1f} %), parts/step "
                f"{r['grammar_parts_ms_per_decode_step']} ms, load {r['load_average'][-1]}",
                flush=True,
            )
    loads = [la[0] for r in result["runs"].values() for la in r["load_average"] if la]
    result["note"] = (
        "2-core CPU; the benchmark itself keeps ~2 threads busy (torch) plus the fill thread, so a "
        "1-min load average above ~2.5 means another job shared the CPU"
        + (f" (max 1-min load seen: {max(loads)})" if loads else "")
    )
    prov.write(args.out, result)
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
