"""One request's fault stays with that request, through a real Serve app.

An app on the tiny model runs n-gram speculation (``speculative_config``, drafting every
step) and takes structured outputs. Its ``LLMServer`` replica is the shipped class with faults
armed (``tests/faults.py``) for the first request whose prompt carries a marker word: the
proposer or the draft-length policy raises on one request, the grammar fill or the grammar
matcher on another (at its first step), the detokenizer on a third (mid-stream). Beside them,
eight ordinary streams (half with a JSON schema) run on the same replica. The ordinary streams
all complete (every token, a finish_reason, ``[DONE]``); a request whose proposer failed
completes with the text it has without the fault; a request that failed before its first token
gets a 500 with OpenAI's error body, one that failed mid-stream an error event then ``[DONE]``;
and the replica stays ready and serves again.
"""

import asyncio
import json

import httpx
import pytest
from _faults_helpers import StreamResult, _wait_ready, _app_args, _assert_completed, _assert_no_internals, _stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MARKERS = {
    "propose": "Zebraprop",
    "draft_length": "Zebrapolicy",
    "grammar_fill": "Zebrafill",
    "grammar_accept": "Zebraaccept",
    "detokenize": "Zebradetok",
}
#: Good calls before a hook raises: the detokenizer fails mid-stream (after its 12th step),
#: the others at the request's first step (before its first token).
AFTER = {"detokenize": 12}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
TOKENS = 48


def _faulty_server():
    """The shipped LLMServer class, with faults armed in its engine after start-up. Ray pickles
    this class (and ``faults``) by value, so the replica needs no test code on its path. The
    faults are armed on an engine in the replica's process, so the app runs with
    ``engine_core_process: false``; in a core process the same ``LLMEngine.step`` isolates the
    same faults (tests/engine/test_fault_injection.py), and tests/engine/test_engine_core_proc.py
    checks that what a step reports reaches each stream."""
    import faults
    import ray.cloudpickle
    from kvserve.deployments.replica.llm_server import LLMServer

    ray.cloudpickle.register_pickle_by_value(faults)
    base = LLMServer.func_or_class
    markers, after = dict(MARKERS), dict(AFTER)

    class FaultyLLMServer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            eng = self.engine.engine
            armed, seen = faults.Faults(eng), set()

            def first_with(word):  # the first request that carries the word (a second one runs clean)
                def pred(req):
                    if word in seen or word not in eng.tokenizer.decode(req.prompt_token_ids):
                        return False
                    seen.add(word)
                    return True

                return pred

            for hook, word in markers.items():
                armed.arm_future(hook, first_with(word), after.get(hook, 0))

    FaultyLLMServer.__name__ = FaultyLLMServer.__qualname__ = "LLMServer"
    return FaultyLLMServer


def _deploy_faulty(args: dict, name: str, route: str) -> None:
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(args)
    models = app._bound_deployment.init_args[0]  # OpenAIIngress(models={name: LLMServer app}, ...)
    ((served, child),) = models.items()
    dep = child._bound_deployment
    models[served] = dep.options(func_or_class=_faulty_server()).bind(*dep.init_args, **dep.init_kwargs)
    serve.run(app, name=name, route_prefix=route, blocking=False)


def _body(prompt: str, grammar: bool) -> dict:
    body = {
        "model": "tiny-iso",
        "prompt": prompt,
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    if grammar:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    return body


def _text(res: StreamResult) -> str:
    return "".join(c.get("text") or "" for e in res.data for c in e.get("choices", []))


def _assert_failed_alone(res: StreamResult) -> None:
    """A request that failed inside the engine: a 500 with OpenAI's error body if it failed
    before its first token (the stream had not started), else one error event then ``[DONE]``;
    nothing internal in either."""
    assert res.exception is None, repr(res.exception)
    if res.status != 200:
        assert res.status == 500, (res.status, res.body)
        err = json.loads(res.body)["error"]
        assert err["type"] == "server_error" and "request id" in err["message"], err
        _assert_no_internals(res.body)
        return
    assert res.done, f"no [DONE]: {res.events[-3:]}"
    assert not res.finish_reasons and len(res.errors) == 1 and res.events[-2] is res.errors[0], res.events[-3:]
    err = res.errors[0]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    _assert_no_internals(json.dumps(res.errors[0]))


def test_a_fault_in_one_request_leaves_the_replica_and_its_other_streams_whole(serve_app, tiny_llama_path):
    from ray import serve

    name, route = "kvserve-iso", "/iso"
    args = _app_args(
        tiny_llama_path,
        "tiny-iso",
        num_replicas=1,
        max_num_seqs=16,
        max_queued_requests=32,
        stream_interval=0,  # a chunk per token: the detokenizer's fault must come mid-stream
        engine_core_process=False,  # the faults are armed in the replica's process (_faulty_server)
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    )
    base = f"{serve_app.root}{route}"
    _deploy_faulty(args, name, route)
    try:
        _wait_ready(base)
        repetitive = "one two three one two three one two three one two three"
        ordinary = [(f"{repetitive} {i}", i % 2 == 1) for i in range(8)]
        poisoned = {hook: (f"{word} {repetitive}", hook.startswith("grammar")) for hook, word in MARKERS.items()}

        async def run_all(bodies: dict) -> dict:
            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                res = {k: StreamResult() for k in bodies}
                await asyncio.gather(
                    *(_stream(client, f"{base}/v1/completions", _body(*bodies[k]), res[k]) for k in bodies)
                )
                return res

        got = asyncio.run(
            run_all({**{f"ok{i}": b for i, b in enumerate(ordinary)}, **{f"bad-{h}": b for h, b in poisoned.items()}})
        )
        for i, (_, grammar) in enumerate(ordinary):
            r = got[f"ok{i}"]
            if grammar:  # a complete JSON object may end before max_tokens
                assert r.exception is None and r.status == 200 and not r.errors and r.done, (r.errors, r.body)
                assert r.finish_reasons in (["stop"], ["length"]), r.finish_reasons
            else:
                _assert_completed(r, TOKENS)
        for hook in ("propose", "draft_length"):  # drafting off for that request: it completes
            _assert_completed(got[f"bad-{hook}"], TOKENS)
        for hook in ("grammar_fill", "grammar_accept", "detokenize"):
            r = got[f"bad-{hook}"]
            print(f"\n{hook} fault: HTTP {r.status}, {r.tokens} text chunks, then {r.errors or r.body}")
            _assert_failed_alone(r)
            if hook == "detokenize":
                assert r.status == 200 and r.tokens >= 5, "the detokenizer's fault was meant to come mid-stream"
        # the same prompts again: the faults are spent, so this is the text without them; the
        # requests whose proposer failed must have produced exactly that (drafting off changes
        # nothing in a greedy output), and every fault stayed with its own request
        again = asyncio.run(run_all({h: poisoned[h] for h in ("propose", "draft_length", "detokenize")}))
        for hook in ("propose", "draft_length"):
            _assert_completed(again[hook], TOKENS)
            assert _text(got[f"bad-{hook}"]) == _text(again[hook])
        _assert_completed(again["detokenize"], TOKENS)
        with httpx.Client(timeout=60) as c:
            assert c.get(f"{base}/ready").status_code == 200
            r = c.post(f"{base}/v1/completions", json={"model": "tiny-iso", "prompt": repetitive, "max_tokens": 8})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    finally:
        serve.delete(name)
