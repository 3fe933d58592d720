"""Property-based fuzzing of the live kvserve app from its own ``/openapi.json`` (schemathesis 4).

Every operation of the schema gets generated requests, valid and invalid ones (schemathesis's
``positive`` and ``negative`` modes, its examples and, in the long run, its coverage phase of
boundary values), sent over real HTTP to the ``serve_app`` fixture's Serve app. Each response
must:

* not be a server error (``not_a_server_error``: no 5xx; a 429 / 503 would also show up here,
  as none is expected on an idle test app);
* arrive within ``KVSERVE_FUZZ_TIMEOUT_S`` seconds, all of it (no hung connection: no gap
  between bytes longer than that, and the whole exchange checked against it afterwards), with
  no connection reset or cut-short body;
* for a 4xx, carry OpenAI's error body ``{"error": {"message": str, ...}}``;
* for a 200 SSE stream, be ``data:`` events of JSON ending in ``data: [DONE]``, with no error
  event (after the first chunk, an error event is a server failure sent as a 200).

Generation is kept short (the server runs real models on 2 CPUs): whole-number ``max_tokens`` /
``max_completion_tokens`` / ``min_tokens`` above 4 are lowered to 4 and a missing or null
``max_tokens`` is set to 4; two thirds of the generated model names that are not served are
replaced by the tiny random-weight model's ("tiny") or dropped (the default model), and so are
two thirds of the ``model_id`` path parameters, so that most requests reach a model instead of
ending in a 404. Half of the generation requests are also brought within what kvserve supports
beyond its schema (``_repair``: small ``n``, ``logit_bias`` ids in the vocabulary, text content parts, non-empty
prompts, token ids in the vocabulary, ...), so that the generated sampling parameters reach the
engine; the other half are sent as generated. ``test_fuzz_reached_the_engines`` checks that
both generation endpoints answered 200 to some of them.

``KVSERVE_FUZZ_EXAMPLES`` (default 20) sets the examples per operation of the fuzzing phase;
``KVSERVE_FUZZ_COVERAGE=1`` adds schemathesis's coverage phase (many more requests);
``KVSERVE_FUZZ_SEED`` (default 0) picks another deterministic run; ``KVSERVE_FUZZ_SHRINK=1``
lets hypothesis minimise a failing request (each step is a real request). For a long run::

    KVSERVE_FUZZ_EXAMPLES=500 KVSERVE_FUZZ_COVERAGE=1 KVSERVE_FUZZ_TIMEOUT_S=120 \\
        .venv/bin/python -m pytest -q tests/e2e/test_schemathesis.py
"""

import json
import os
import time
import zlib
from collections import Counter

import pytest
from helpers import iter_sse, sse_events

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "20"))
COVERAGE = os.environ.get("KVSERVE_FUZZ_COVERAGE", "0") not in ("", "0", "false", "no")
TIMEOUT_S = float(os.environ.get("KVSERVE_FUZZ_TIMEOUT_S", "60"))
SHRINK = os.environ.get("KVSERVE_FUZZ_SHRINK", "0") not in ("", "0", "false", "no")
MAX_GEN_TOKENS = 4
VOCAB = 49152  # SmolLM2's, also the tiny model's
SERVED = ("HuggingFaceTB/SmolLM2-135M-Instruct", "tiny")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600 + 60 * EXAMPLES)]

# (operation, status) -> responses, over the whole module: the last test checks that the
# fuzzing reached the engines (not only validation errors) and prints the tally
SEEN: Counter = Counter()


@pytest.fixture(scope="module")
def api_schema(serve_app):
    config = schemathesis.Config.from_dict(
        {
            # no shrinking by default: every shrink step is a real request (KVSERVE_FUZZ_SHRINK=1 to
            # minimise a failure); no example database: runs with one seed are the same run
            "generation": {"max-examples": EXAMPLES, "mode": "all", "no-shrink": not SHRINK, "database": "none"},
            "phases": {"coverage": {"enabled": COVERAGE}, "stateful": {"enabled": False}},
            "seed": int(os.environ.get("KVSERVE_FUZZ_SEED", "0")),
        }
    )
    return schemathesis.openapi.from_url(f"{serve_app.root}/openapi.json", config=config, timeout=30)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request):
    """schemathesis 4.32's ``from_fixture`` reads and rewrites ``item._nodeid`` (to name each
    operation's subtest), an attribute pytest 9 no longer has (``nodeid`` is derived from
    ``_id``): give the item one, or the test dies with AttributeError before any request."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def _shorten(case) -> None:
    """Keep generation short and most requests on a served model (see the module docstring)."""
    params = case.path_parameters
    if isinstance(params, dict) and isinstance(params.get("model_id"), str) and params["model_id"] not in SERVED:
        pick = _bucket(params["model_id"], 3)
        if pick:
            params["model_id"] = SERVED[pick - 1]
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        v = body.get(key)
        # 6663443483.0 is an int to pydantic: it would run to the end of the context
        whole = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
        if whole and v > MAX_GEN_TOKENS:
            body[key] = MAX_GEN_TOKENS
    if case.path == "/v1/responses":
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_GEN_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_GEN_TOKENS
    model = body.get("model")
    if isinstance(model, str) and model not in SERVED:
        pick = _bucket(model, 3)
        if pick == 1:
            body["model"] = "tiny"
        elif pick == 2:
            del body["model"]


def _bucket(obj, n: int) -> int:
    """A stable bucket in ``range(n)`` for a generated value (``hash`` is salted per process)."""
    return zlib.crc32(json.dumps(obj, sort_keys=True, default=repr).encode("utf-8", "surrogatepass")) % n


def _repair(body: dict, path: str) -> None:
    """Bring a generated body within what kvserve supports beyond the schema (small ``n``
    and ``best_of``, ``logit_bias`` and token ids in the vocabulary, text content parts,
    non-empty prompts and stop strings, ``stream_options`` only with ``stream``, one of
    ``prompt`` and ``messages`` for ``/tokenize``), keeping every other field as generated,
    so the sampling parameters reach the engine."""
    int_ = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if path == "/tokenize":  # the schema has both optional; exactly one is allowed
        if body.get("prompt") is not None or body.get("messages") is None:
            body["prompt"] = body["prompt"] if isinstance(body.get("prompt"), str) and body["prompt"] else "hello"
            body.pop("messages", None)
    if int_(body.get("n")):
        body["n"] = 1 + abs(body["n"]) % 3  # a few choices: the run stays short on 2 CPUs
    if int_(body.get("best_of")):
        body["best_of"] = (body.get("n") if int_(body.get("n")) else 1) + abs(body["best_of"]) % 2
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {
            str(abs(zlib.crc32(str(k).encode("utf-8", "surrogatepass"))) % VOCAB): v
            for k, v in body["logit_bias"].items()
        }
    if not body.get("stream"):
        body.pop("stream_options", None)
    if isinstance(body.get("stop"), list):
        body["stop"] = [x for x in body["stop"] if isinstance(x, str) and x] or None
    elif body.get("stop") == "":
        body["stop"] = None
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = [abs(x) % VOCAB for x in body["stop_token_ids"] if int_(x)]
    if int_(body.get("min_tokens")):
        caps = [
            int(body[k])
            for k in ("max_tokens", "max_completion_tokens")
            if int_(body.get(k)) or (isinstance(body.get(k), float) and body[k].is_integer())
        ]
        body["min_tokens"] = max(0, min(body["min_tokens"], *caps, MAX_GEN_TOKENS))
    if "prompt" in body:
        p = body["prompt"]
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            p = [[abs(t) % VOCAB for t in x if int_(t)] or [1] for x in p][:4]
        elif isinstance(p, list) and p and all(int_(x) for x in p):
            p = [abs(t) % VOCAB for t in p]
        elif isinstance(p, list):
            p = [x for x in p if isinstance(x, str) and x][:4] or "hello"
        elif not isinstance(p, str) or not p:
            p = "hello"
        body["prompt"] = p
    if "input" in body:  # /v1/responses (a string, or message items) and /v1/embeddings (texts or token ids)
        v = body["input"]
        if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
            v = [[abs(t) % VOCAB for t in x if int_(t)][:64] or [1] for x in v][:4]
        elif isinstance(v, list) and v and all(int_(x) for x in v):
            v = [abs(t) % VOCAB for t in v][:64]
        elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            v = [x[:200] or "hi" for x in v][:4]
        elif not isinstance(v, str) or not v:
            v = "hello"
        body["input"] = v[:200] if isinstance(v, str) else v
        for key in (
            "tools",
            "background",
            "truncation",
            "reasoning",
            "conversation",
            "prompt",
            "top_logprobs",
            "max_tool_calls",
            "previous_response_id",
            "dimensions",
        ):
            body.pop(key, None)
    if isinstance(body.get("messages"), list):
        for m in body["messages"]:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m["content"] = [
                    {"type": "text", "text": str(part.get("text") or "hi")}
                    for part in m["content"]
                    if isinstance(part, dict)
                ] or "hi"


def openai_error_body(ctx, response, case):
    """A 4xx carries OpenAI's error object."""
    if 400 <= response.status_code < 500:
        try:
            body = json.loads(response.content)
        except ValueError:
            raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from None
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and isinstance(err.get("message"), str), (
            f"{response.status_code} body is not OpenAI's error shape: {response.content[:300]!r}"
        )


def sse_well_formed(ctx, response, case):
    """A 200 event stream: JSON ``data:`` events, no error event, ``data: [DONE]`` last; a
    Responses API stream instead: typed events numbered from 0, ``response.completed`` or
    ``response.incomplete`` last (no ``[DONE]``, as OpenAI's); a Messages API stream:
    ``message_start`` first, ``message_stop`` last, no ``error`` event (Anthropic's)."""
    ctype = (response.headers.get("content-type") or [""])[0]
    if response.status_code != 200 or not ctype.startswith("text/event-stream"):
        return
    if case.path == "/v1/messages":  # Anthropic's stream: typed events, message_start first, message_stop last
        events = list(iter_sse(response.content))
        assert events and all(isinstance(e, dict) and e.get("type") != "error" for e in events), events[-3:]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", events[-3:]
        return
    if case.path == "/v1/responses":
        events = list(iter_sse(response.content))
        assert events and all(isinstance(e, dict) and "error" not in e for e in events), events[-3:]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        return
    for obj in sse_events(response.content):  # asserts data: [DONE] last
        assert "error" not in obj, f"error event in a 200 stream: {json.dumps(obj)[:300]}"


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_openapi_fuzz(case, serve_app):
    import requests

    _shorten(case)
    if case.method.upper() == "POST" and isinstance(case.body, dict) and _bucket(case.body, 2) == 0:
        _repair(case.body, case.path)
    t0 = time.perf_counter()
    try:
        response = case.call(base_url=serve_app.root, timeout=TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no full response within {TIMEOUT_S} s (hung connection):\n{case.as_curl_command()}")
    except requests.RequestException as e:  # reset, refused, body cut short
        pytest.fail(f"{type(e).__name__}: {e}\n{case.as_curl_command()}")
    took = time.perf_counter() - t0
    SEEN[(f"{case.method.upper()} {case.path}", response.status_code)] += 1
    assert took <= TIMEOUT_S, f"response took {took:.1f} s > {TIMEOUT_S} s:\n{case.as_curl_command()}"
    case.validate_response(response, checks=[not_a_server_error, openai_error_body, sse_well_formed])


def test_fuzz_reached_the_engines():
    """The generated requests were not all turned away before an engine: the generation,
    embedding and tokenize endpoints answered 200 to some of them (runs after test_openapi_fuzz)."""
    if not SEEN:
        pytest.skip("test_openapi_fuzz did not run")
    print(
        "\nresponses per operation and status: " + ", ".join(f"{op} {st}: {n}" for (op, st), n in sorted(SEEN.items()))
    )
    for op in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/responses",
        "POST /v1/embeddings",
        "POST /tokenize",
    ):
        assert SEEN[(op, 200)] > 0, f"no 200 from {op}: {dict(SEEN)}"
