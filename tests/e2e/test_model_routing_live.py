"""Model routing (``model: "auto"``) and the upstream fallback, live: a Serve app with two
models and rules, whose fallback upstream is another kvserve behind its own API key: the
session's ``kvserve-auth`` app (its own ingress and key, reached over HTTP like any
OpenAI-compatible server; ``kvserve serve`` in a process of its own is
``tests/e2e/test_ray_auth.py``'s, which needs no second copy here)."""

import asyncio

import httpx
import pytest
from helpers import HTTP, iter_sse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

APP = "kvserve-routing"
SMALL, LARGE = "tiny-small", "tiny-large"
#: The upstream's name for the model (the session's second app, ``tests/e2e/conftest.py``).
UPSTREAM_MODEL = "tiny-tp2"


@pytest.fixture(scope="module")
def upstream(serve_app):
    """The upstream: the session's ``kvserve-auth`` app (tiny model served as ``tiny-tp2``,
    API key :data:`serve_app.api_key`); yields its OpenAI base URL and key."""
    return serve_app.auth_base_url, serve_app.api_key


@pytest.fixture(scope="module")
def routing_app(ray_session, serve_app, tiny_llama_path, upstream):
    """Two models behind one ingress (route ``/routing``): ``tiny-small`` with room for one
    running and one queued request (so a burst overflows), ``tiny-large``; ``auto`` rules;
    the upstream kvserve as the fallback of ``tiny-small``."""
    from ray import serve

    from kvserve.deployments.app import build_app

    tiny = {
        "model": str(tiny_llama_path),
        "num_replicas": 1,
        "max_model_len": 1024,
        "torch_num_threads": 1,
        "replica_cpus": 0.25,
    }
    app = build_app(
        {
            "models": [
                {**tiny, "served_model_name": SMALL, "max_num_seqs": 1, "max_queued_requests": 1},
                {**tiny, "served_model_name": LARGE, "max_num_seqs": 8},
            ],
            "model_routing": {
                "rules": [
                    {"name": "code", "model": LARGE, "keywords": ["python", "function"]},
                    {"name": "short", "model": SMALL, "max_prompt_tokens": 64, "max_tokens": 16},
                ],
                "default": LARGE,
            },
            "upstream": {"base_url": upstream[0], "api_key": upstream[1], "models": {SMALL: UPSTREAM_MODEL}},
            "response_cache": False,
            "ingress_cpus": 0.1,
        }
    )
    serve.run(app, name=APP, route_prefix="/routing")
    yield f"{serve_app.root}/routing/v1"
    serve.delete(APP)


def test_auto_routes_by_rule(routing_app):
    with httpx.Client(timeout=120) as c:
        ids = [m["id"] for m in c.get(f"{routing_app}/models").json()["data"]]
        assert ids == [SMALL, LARGE, "auto"]
        cases = [
            ({"messages": [{"role": "user", "content": "Write a Python function"}], "max_tokens": 4}, LARGE, "code"),
            ({"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 4}, SMALL, "short"),
            ({"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 40}, LARGE, "default"),
            (
                {"messages": [{"role": "user", "content": "Capital of France? " * 40}], "max_tokens": 4},
                LARGE,
                "default",
            ),
        ]
        for body, model, rule in cases:
            r = c.post(f"{routing_app}/chat/completions", json={"model": "auto", **body})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model and r.headers["x-kvserve-route"] == f"auto:{rule}", (body, r.headers)
            # streamed: every chunk names the model that answered
            with c.stream(
                "POST", f"{routing_app}/chat/completions", json={"model": "auto", "stream": True, **body}
            ) as s:
                assert s.headers["x-kvserve-route"] == f"auto:{rule}"
                chunks = [e for e in iter_sse(s) if isinstance(e, dict)]
            assert chunks and all(e.get("model") == model for e in chunks), chunks[:3]
        r = c.post(f"{routing_app}/completions", json={"model": "auto", "prompt": "def f(): # python", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == LARGE
        # a request naming a model is not routed
        r = c.post(f"{routing_app}/completions", json={"model": SMALL, "prompt": "python", "max_tokens": 3})
        assert r.json()["model"] == SMALL and "x-kvserve-route" not in r.headers


def test_overflow_goes_upstream_and_client_errors_do_not(routing_app):
    """6 long streams at once to tiny-small (1 running + 1 queued locally): the 4 the replica
    refuses with 429 go to the upstream kvserve and stream from there, complete; none fails."""
    body = {
        "model": SMALL,
        "prompt": "Tell me a story",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def one(client):
        async with client.stream("POST", f"{routing_app}/completions", json=body) as r:
            text = "".join([t async for t in r.aiter_text()])
            return r.status_code, r.headers.get("x-kvserve-route"), text

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client) for _ in range(6)))

    results = asyncio.run(burst())
    assert all(code == 200 for code, _, _ in results), results
    fallback = [t for _, route, t in results if route == "fallback"]
    local = [t for _, route, t in results if route is None]
    assert len(fallback) >= 3 and len(local) >= 1, [r[1] for r in results]
    for text in fallback:  # the upstream's stream, unchanged: its model name, all 120 tokens, [DONE]
        events = list(iter_sse(text.splitlines()))
        assert events[-1] == "[DONE]", text[-300:]
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks and all(e["model"] == UPSTREAM_MODEL for e in chunks), chunks[:2]
        # (the upstream drafts tokens, so a chunk may carry several: the usage counts them)
        assert chunks[-1]["usage"]["completion_tokens"] == 120, chunks[-1]
        assert sum(bool(c.get("text")) for e in chunks for c in e["choices"]) >= 1
    # a client error is answered here, never forwarded
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{routing_app}/completions", json={**body, "stream": False, "max_tokens": 5000})
        assert r.status_code == 400 and "x-kvserve-route" not in r.headers


def test_fallback_counts_in_metrics(routing_app, serve_app):
    text = HTTP.get(f"{serve_app.root}/metrics", timeout=30).text
    assert any(
        ln.startswith("kvserve:upstream_fallbacks_total{")
        and f'model_name="{SMALL}"' in ln
        and not ln.rstrip().endswith(" 0.0")
        for ln in text.splitlines()
    ), text[:2000]
    assert any(ln.startswith("kvserve:model_routes_total{") and 'route="short"' in ln for ln in text.splitlines())
