"""The engine never dies from a request, a timing or a setting: property-based fuzzing (tiny
random-weight Llama, float32).

1. Fault injection into each per-request hook, one request of a batch at a time:
   ``test_fault_injection.py``. (The strategies and state machine of 2. are ``_fuzz_machine.py``;
   the reference engines and counters both files use, ``_robustness_helpers.py``.)
2. Property-based fuzzing (hypothesis, stateful): random engine configurations (block size,
   ``max_num_seqs``, token budget, KV pools small enough to preempt, prefix caching, mixed-step
   caps, n-gram speculation adaptive or not, fp8 KV cache, int8 weights, attention backend,
   scheduling policy, LoRA with one or two adapter slots for three PEFT adapters) x random
   request streams (arrivals, aborts mid-flight, priorities, stop strings and stop ids,
   ``max_tokens`` 0/1/large/None, ``min_tokens``, logprobs, prompt logprobs, seeds, penalties,
   structured outputs, repetitive n-gram-friendly and shared-prefix prompts, LoRA adapters,
   embedding (pooling) requests, faults injected into a random request's hook) x a fake clock
   that feeds noise (jumps back, stalls, NaN) to every timing-driven policy. Each configuration
   also starts with one short request per per-request hook it has (the drafting hooks only with
   speculation), its parameters made to reach that hook (a grammar for the grammar hooks,
   logprobs, prompt logprobs, detokenization, no grammar for the drafting hooks) and its fault
   armed after 0-2 good calls; those requests are never aborted, so the hook is reached.
   After every step: ``step()`` raised nothing, the engine's requests are exactly those not yet
   ended, block reference counts equal the block tables' references. At the end: every request
   ended exactly once, the pool is whole, only requests whose fault fired failed, each greedy
   request's tokens equal those of a reference engine (no speculation, no prefix caching, one
   roomy configuration, same weights, adapters and KV dtype, float32), up to a near-tie in the
   reference's logits (top-2 log-probability gap below :data:`TIE`, by KV dtype) where batching may round
   either way (a float8 request is compared so where its steps were the reference's: its prompt in
   one step from 0, then one token per step, :data:`TIE_FP8_SAME_SCHEDULE`; a chunked or
   prefix-hit prompt reads other K/V from float8 than the reference does), and each embedding
   equals the reference engine's (cosine at least :data:`POOL_COS`).
   Across the run every fault kind of :data:`faults.HOOKS` must have fired at least once, or
   the test fails (a fuzzer whose faults never fire checks nothing).
3. The same request streams through :class:`kvserve.engine.async_engine.AsyncLLMEngine` (a smaller
   hypothesis test): concurrent streams read to the end, cancelled by the client after their
   first output, aborted by the server after their first output, or embedding requests, some
   with a fault armed. Every stream's deltas add up to its tokens and it ends once (an
   ``abort`` output, a ``RuntimeError`` for a fired fault and only then); greedy tokens and
   embeddings equal the reference's; afterwards the engine is idle with every block back.
4. Tensor and pipeline parallelism (Ray actors, gloo): the fuzzer of 2. over TP=2 / PP=2
   configurations, opt-in (``KVSERVE_FUZZ_PARALLEL=1``; skipped otherwise: it starts Ray and
   takes minutes).

Budget: ``KVSERVE_FUZZ_EXAMPLES`` engine configurations (default 10 in the fast test profile,
20 in the thorough one, ``tests/helpers.py``; derandomized: the same examples every run) of
``KVSERVE_FUZZ_STEPS`` rules each (default 25); the async test ``KVSERVE_FUZZ_ASYNC_EXAMPLES``
(default 3, thorough 6); the parallel one ``KVSERVE_FUZZ_PARALLEL_EXAMPLES`` (default 4). A
longer, randomized run:
``KVSERVE_FUZZ_EXAMPLES=400 KVSERVE_FUZZ_RANDOM=1 make test PYTEST_ARGS=tests/engine/test_engine_fuzz.py``
(``KVSERVE_FUZZ_SHRINK=1`` shrinks a failure to a minimal example).
The totals (with each hook's armed and fired counts) are printed (``-s``) and written to
``$KVSERVE_FUZZ_REPORT`` when set, with their provenance (``benchmarks.common.Results``: commit,
machine, command, load average before and after).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from _fuzz_machine import EngineMachine, adapters, configs, prompts, reaching, sampling_params
from _robustness_helpers import (
    ARMED,
    DTYPE,
    FIRED,
    MAX_MODEL_LEN,
    NUM_ADAPTERS,
    TOTALS,
    Reference,
    assert_idle,
    check_against_reference,
    count_fired,
    one_chunk_schedule,
)
from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pooling import PoolingParams
from faults import FAILING_HOOKS, HOOKS, Faults
from helpers import FUZZ_RANDOM, sized
from tiny_models import run_async_engine

EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", sized(10, 20)))
STEPS = int(os.environ.get("KVSERVE_FUZZ_STEPS", "25"))
ASYNC_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_ASYNC_EXAMPLES", sized(3, 6)))
PARALLEL = os.environ.get("KVSERVE_FUZZ_PARALLEL") == "1"
PARALLEL_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_PARALLEL_EXAMPLES", "4"))
#: Shrink a failing example (minutes; off by default so a failing CI run ends quickly).
SHRINK = os.environ.get("KVSERVE_FUZZ_SHRINK") == "1"


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    ref = Reference(str(tiny_llama_path))
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def lora_requests(tiny_llama_path, tmp_path_factory):
    """Three PEFT adapters of the tiny model (``tests/engine/test_lora.py``'s: ranks 8, 4 and
    16, different target modules, one rsLoRA), as ``LoRARequest`` objects."""
    from kvserve.engine.lora import LoRARequest
    from tests.engine.test_lora import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("fuzz_adapters")
    out = [
        LoRARequest(name, i + 1, str(make_adapter(tiny_llama_path, root / name, r, a, t, rs, seed=i)))
        for i, (name, r, a, t, rs) in enumerate(ADAPTERS)
    ]
    assert len(out) == NUM_ADAPTERS
    return out


# ------------------------------------------------------------------------------ 2. fuzzing
def _report(suffix: str, prov, extra: dict | None = None) -> dict:
    """The run's totals and each hook's armed and fired counts, printed, and written with their
    provenance (``prov``: a ``benchmarks.common.Results``, whose ``stamp`` adds the commit, the
    machine, the command and the load average before and after) to ``$KVSERVE_FUZZ_REPORT`` when
    that is set (``suffix``: appended to the file's stem, for the async and parallel tests)."""
    report = {
        "budget": {
            "examples": EXAMPLES,
            "steps": STEPS,
            "async_examples": ASYNC_EXAMPLES,
            "parallel_examples": PARALLEL_EXAMPLES,
            "randomized": FUZZ_RANDOM,
        },
        "totals": dict(sorted(TOTALS.items())),
        "faults armed": {h: ARMED[h] for h in HOOKS},
        "faults fired": {h: FIRED[h] for h in HOOKS},
        **(extra or {}),
    }
    print(f"\nengine fuzz{suffix}:", json.dumps(report, indent=1))
    if os.environ.get("KVSERVE_FUZZ_REPORT"):
        path = Path(os.environ["KVSERVE_FUZZ_REPORT"])
        path = path.with_name(path.stem + suffix + path.suffix)
        path.write_text(json.dumps(prov.stamp(report), indent=1) + "\n")
    return report


def _provenance():
    """A ``benchmarks.common.Results`` of this file, made when a test starts: the commit, the
    exact command (with the ``KVSERVE_FUZZ_*`` variables it ran under) and the load average."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.common import Results

    prov = Results(__file__, ())
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KVSERVE_FUZZ_"))
    prov.command = f"{env} {prov.command}".strip()
    return prov


def _run_fuzzer(machine, examples: int, model_path, reference, lora_requests, suffix: str) -> None:
    """Run the state machine ``machine`` (on ``model_path``, compared with ``reference``, with
    ``lora_requests``) for ``examples`` configurations of :data:`STEPS` rules from fresh totals,
    then print and write its report (``suffix``: see :func:`_report`)."""
    machine.model_path, machine.reference, machine.lora_requests = str(model_path), reference, lora_requests
    prov = _provenance()
    for c in (TOTALS, ARMED, FIRED):
        c.clear()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=not FUZZ_RANDOM,
            database=None,
            phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK else ()),
            suppress_health_check=list(HealthCheck),
        ),
    )
    _report(suffix, prov)


def _check_coverage() -> None:
    """Fail when a fault kind never fired in the run: the fuzzer would have checked nothing
    about it."""
    never = [h for h in HOOKS if FIRED[h] == 0]
    assert not never, (
        f"fault kinds that never fired in {TOTALS['configurations']} configurations: {never} (armed: {dict(ARMED)})"
    )


def test_one_chunk_schedule_is_the_references():
    """Which float8 requests are compared token for token: the whole prompt in one step from 0,
    then one token per step (what the reference engine runs), and nothing else."""
    assert one_chunk_schedule([(0, 5), (5, 1), (6, 1)], 5)
    assert one_chunk_schedule([(0, 5)], 5)  # one token asked for
    assert not one_chunk_schedule([(0, 3), (3, 2), (5, 1)], 5)  # chunked prefill
    assert not one_chunk_schedule([(2, 3), (5, 1)], 5)  # a prefix-cache hit
    assert not one_chunk_schedule([(0, 5), (5, 1), (0, 7)], 5)  # recomputed after preemption
    assert not one_chunk_schedule([(0, 5), (5, 3)], 5)  # drafts verified
    assert not one_chunk_schedule(None, 5) and not one_chunk_schedule([], 5)


def test_fuzz_engine(tiny_llama_path, reference, lora_requests):
    """The stateful fuzzer (module docstring, 2.): besides each example's checks, every fault
    kind fired, LoRA and embedding requests ran and were compared with the reference."""
    _run_fuzzer(EngineMachine, EXAMPLES, tiny_llama_path, reference, lora_requests, "")
    _check_coverage()
    assert TOTALS["configurations"] >= min(EXAMPLES, 10) and TOTALS["greedy equal"] > 0
    assert TOTALS["LoRA configurations"] > 0 and TOTALS["LoRA requests"] > 0
    assert TOTALS["embeddings equal (cosine)"] > 0


# ------------------------------------------------------------------------------ 3. the async engine
#: What a stream does: read to its end, be cancelled by its client after its first output, be
#: aborted by the server (``AsyncLLMEngine.abort``) after its first output, or embed its prompt.
KINDS = ["read", "read", "cancel", "abort", "embed"]
_fault = st.tuples(st.sampled_from(FAILING_HOOKS), st.integers(0, 2))


def _client(kind, fault=st.one_of(st.none(), _fault)):
    """One client: ``(prompt, params, kind, adapter, pooling, fault, delay)``."""
    return st.tuples(
        prompts, sampling_params(), kind, adapters, st.sampled_from(["last", "mean"]), fault, st.integers(0, 3)
    )


#: An example's clients in a drawn order: up to four of any kind, and one of each kind the run
#: must cover (a cancel, an abort, an embedding and a read with a fault), so that a run of a few
#: examples covers them whatever the draws (with three, CI once drew no cancel at all).
streams = st.builds(
    lambda drawn, covering: drawn + list(covering),
    st.lists(_client(st.sampled_from(KINDS)), max_size=4),
    st.tuples(
        _client(st.just("cancel")),
        _client(st.just("abort")),
        _client(st.just("embed")),
        _client(st.just("read"), _fault),
    ),
).flatmap(st.permutations)


def _outlasting(p: SamplingParams, max_tokens: int) -> SamplingParams:
    """``p`` made to give more than one output: no EOS, stop or grammar ends it before
    ``max_tokens`` tokens (the drafting hooks' :func:`reaching` does just that)."""
    return reaching("propose", p, max_tokens - 4)


async def _stream(eng, rid: str, prompt, params, kind: str, lora, pooling: str, delay: int) -> tuple:
    """One client of ``eng``: ``(outputs, exception)``; ``exception`` is the RuntimeError the
    stream ended with (a failed request), or the ValueError that refused it."""
    await asyncio.sleep(0.002 * delay)
    outs = []
    try:
        if kind == "embed":
            return [await eng.embed(prompt, PoolingParams(pooling), request_id=rid, lora_request=lora)], None
        stream = eng.generate(prompt, params, request_id=rid, lora_request=lora)
        try:
            async for out in stream:
                outs.append(out)
                if len(outs) == 1 and not out.finished and kind == "cancel":
                    break  # the client goes away: closing the stream aborts the request
                if len(outs) == 1 and not out.finished and kind == "abort":
                    eng.abort(rid)
        finally:
            await stream.aclose()
    except (RuntimeError, ValueError) as e:
        return outs, e
    return outs, None


async def _until_idle(eng, timeout_s: float = 60.0) -> None:
    """Until every stream's abort is applied and the engine holds no request."""
    deadline = time.monotonic() + timeout_s
    while eng.get_stats()["num_pending_requests"] or eng.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the async engine never became idle"
        await asyncio.sleep(0.01)


def _check_async_example(cfg: dict, wanted: list, results: list, faults: Faults, reference: Reference) -> None:
    """The checks of one async example (module docstring, 3.)."""
    fired = {rid for _, rid in faults.fired}
    compare = []
    for (rid, prompt, params, kind, lora, pooling, fault), (outs, error) in zip(wanted, results):
        TOTALS[f"streams: {kind}"] += 1
        if isinstance(error, ValueError):  # refused before anything was queued (e.g. a prompt too long)
            assert not outs, rid
            TOTALS["streams refused (ValueError)"] += 1
            continue
        if error is not None:
            assert fault is not None and rid in fired and "injected fault" in str(error), (rid, fault, error)
            TOTALS["streams failed by their fault"] += 1
            continue
        assert outs and all(not o.finished for o in outs[:-1]), f"{rid}: output after the final one"
        last = outs[-1]
        assert last.error is None, (rid, last.error)
        if kind == "embed":
            assert last.finished and len(last.pooled) == 64, rid
            compare.append((rid, last, pooling))
            continue
        c = last.outputs[0]
        deltas = [t for o in outs for t in o.outputs[0].delta_token_ids]
        assert deltas == c.token_ids, f"{rid}: the stream's deltas {deltas} do not add up to {c.token_ids}"
        if kind == "cancel":
            assert not last.finished, rid  # cancelled after its first output, before its end
            TOTALS["streams cancelled mid-stream"] += 1
        else:
            assert last.finished, rid
            TOTALS["streams aborted mid-stream"] += c.finish_reason == "abort"
        if params.temperature == 0.0:
            compare.append((rid, last, None))
    by_id = {w[0]: w for w in wanted}
    refs = reference.run(
        Reference.setup_of(cfg),
        [(out.prompt_token_ids, by_id[rid][2], by_id[rid][4], pooling) for rid, out, pooling in compare],
    )
    for (rid, out, pooling), ref in zip(compare, refs):
        check_against_reference(rid, cfg, out, pooling, ref)


def test_fuzz_async_engine(tiny_llama_path, reference, lora_requests):
    """The fuzzer's configurations and requests through ``AsyncLLMEngine`` (module docstring,
    3.); across the run some stream was cancelled and some aborted mid-stream, some failed by
    its fault, some embedded and some greedy one equalled the reference."""
    prov = _provenance()
    for c in (TOTALS, ARMED, FIRED):
        c.clear()

    @settings(
        max_examples=ASYNC_EXAMPLES,
        deadline=None,
        derandomize=not FUZZ_RANDOM,
        database=None,
        phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK else ()),
        suppress_health_check=list(HealthCheck),
    )
    @given(cfg=configs(), drawn=streams)
    def run(cfg, drawn):
        cfg = {k: v for k, v in cfg.items() if k not in ("focus", "sentinels", "broken_loggers", "spare_blocks")}
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_path),
                dtype=DTYPE,
                max_model_len=MAX_MODEL_LEN,
                num_kv_blocks=-(-MAX_MODEL_LEN // cfg["block_size"]) + 8,
                **cfg,
            )
        )
        faults = Faults(engine)
        wanted = []
        for i, (prompt, params, kind, adapter, pooling, fault, delay) in enumerate(drawn):
            rid = f"a{i}"
            lora = lora_requests[adapter] if adapter is not None and cfg.get("enable_lora") else None
            if kind in ("cancel", "abort"):
                params, fault = _outlasting(params, 8 if kind == "cancel" else 16), None
            elif kind == "embed":
                fault = None
            elif fault is not None:
                hook = fault[0]
                after = 0 if hook.startswith("grammar") or hook == "prompt_logprobs" else fault[1]
                params, fault = reaching(hook, params, after), (hook, after)
                faults.arm_future(hook, lambda r, rid=rid: r.request_id == rid, after)
                ARMED[fault[0]] += 1
            wanted.append((rid, prompt, params, kind, lora, pooling, fault))
            TOTALS["LoRA requests"] += lora is not None

        async def drive(eng):
            results = await asyncio.gather(
                *(
                    _stream(eng, rid, prompt, params, kind, lora, pooling, delay)
                    for (rid, prompt, params, kind, lora, pooling, _), (*_, delay) in zip(wanted, drawn)
                )
            )
            await _until_idle(eng)
            assert_idle(eng.engine)
            return results

        TOTALS["configurations"] += 1
        results = run_async_engine(drive, engine, timeout_s=300)
        count_fired(faults)
        _check_async_example(cfg, wanted, results, faults, reference)

    run()
    _report("_async", prov)
    for what in (
        "streams cancelled mid-stream",
        "streams aborted mid-stream",
        "streams failed by their fault",
        "embeddings equal (cosine)",
        "greedy equal",
        "LoRA requests",
    ):
        assert TOTALS[what] > 0, f"no {what} in {TOTALS['configurations']} async examples: {dict(TOTALS)}"


# ------------------------------------------------------------------------------ 4. TP / PP (opt-in)
@pytest.fixture(scope="module")
def ray_for_parallel(tmp_path_factory):
    """A local Ray (8 logical CPUs, token auth with a token of this run only), or the one this
    session already runs; skips unless ``KVSERVE_FUZZ_PARALLEL=1``."""
    if not PARALLEL:
        pytest.skip(
            "tensor/pipeline-parallel fuzzing is opt-in (KVSERVE_FUZZ_PARALLEL=1): it starts Ray actors "
            "and takes minutes"
        )
    if "RAY_AUTH_TOKEN_PATH" not in os.environ:
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(tmp_path_factory.mktemp("ray_auth") / "auth_token")
    from kvserve.cluster.ray_auth import ensure_local_auth

    ensure_local_auth()
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


class ParallelEngineMachine(EngineMachine):
    """:class:`EngineMachine` over TP=2, PP=2 or both: each rank a Ray actor (gloo)."""

    @initialize(cfg=configs(parallel=True), clock_seed=st.integers(0, 2**32))
    def build(self, cfg, clock_seed):
        self._build(cfg, clock_seed)

    @staticmethod
    def executor_factory(config, model_path):
        from kvserve.cluster.worker_group import RayWorkerGroup

        return RayWorkerGroup(
            config, model_path, num_cpus=1, torch_num_threads=1, timeout_s=120, collective_timeout_s=120
        )


def test_fuzz_engine_parallel(ray_for_parallel, tiny_llama_path, reference, lora_requests):
    """The stateful fuzzer over tensor- and pipeline-parallel configurations (module
    docstring, 4.): the same checks, against the same single-process reference; some fault
    fired and some greedy request equalled the reference."""
    _run_fuzzer(ParallelEngineMachine, PARALLEL_EXAMPLES, tiny_llama_path, reference, lora_requests, "_parallel")
    assert TOTALS["configurations"] == PARALLEL_EXAMPLES and TOTALS["greedy equal"] > 0
    assert sum(FIRED.values()) > 0, f"no fault fired (armed: {dict(ARMED)})"
