"""The response caches through the live app over HTTP (the shared ``serve_app``: exact cache on,
semantic ``opt-in``, an admin key): a repeated deterministic request is answered from the
cache, streamed and not, with the answer and usage of the first; opt-outs; sampled requests
are never cached; ``DELETE /v1/cache`` needs the admin key; a paraphrase hits the semantic
level when the request asks for it. Prompts carry a random tag so no other test's entries
interfere."""

import time
import uuid

import httpx
import pytest
from helpers import HTTP, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = "tiny"  # the app's random-weight model: fast, and its text is as cacheable as any


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def _post(serve_app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return HTTP.post(f"{serve_app.base_url}{path}", json=body, headers=headers or {}, timeout=120)


def _status(r: httpx.Response) -> str | None:
    return r.headers.get("x-kvserve-cache")


def _counts(usage: dict) -> tuple:
    """Usage's numbers (a streamed usage leaves out the null fields a whole body carries)."""
    return (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["total_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    )


def test_repeated_greedy_chat_is_an_exact_hit_streamed_and_not(serve_app):
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": f"Name three colours. {_tag()}"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    first = _post(serve_app, "/chat/completions", body)
    assert first.status_code == 200, first.text
    assert _status(first) == "miss"
    again = _post(serve_app, "/chat/completions", {**body, "user": "someone else"})  # user is not in the key
    assert _status(again) == "exact"
    a, b = first.json(), again.json()
    assert b["choices"] == a["choices"] and b["usage"] == a["usage"] and b["model"] == a["model"]
    assert b["id"] != a["id"]  # a fresh response

    # streamed from the same entry: the chunks of a fresh stream, usage included
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with HTTP.stream("POST", f"{serve_app.base_url}/chat/completions", json=stream, timeout=120) as r:
        assert r.status_code == 200 and _status(r) == "exact"
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == a["choices"][0]["message"]["content"]
    assert len([e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]) > 1  # token by token
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]] == [
        a["choices"][0]["finish_reason"]
    ]
    assert events[-1]["choices"] == [] and _counts(events[-1]["usage"]) == _counts(a["usage"])
    assert len({e["id"] for e in events}) == 1 and events[0]["id"] != a["id"]


def test_a_streamed_miss_is_replayed_chunk_for_chunk(serve_app):
    body = {
        "model": TINY,
        "prompt": f"Once upon a time {_tag()}",
        "max_tokens": 10,
        "temperature": 0.9,
        "seed": 4,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def run():
        with HTTP.stream("POST", f"{serve_app.base_url}/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            return _status(r), sse_events(r)

    (s1, fresh), (s2, cached) = run(), run()
    assert (s1, s2) == ("miss", "exact")  # seeded, n = 2: choice i samples with seed + i, reproducible

    def shape(events):
        return [[(c["index"], c["text"], c["finish_reason"]) for c in e["choices"]] for e in events], events[-1][
            "usage"
        ]

    assert shape(cached) == shape(fresh)
    whole = _post(serve_app, "/completions", {**body, "stream": False, "stream_options": None})
    assert _status(whole) == "exact"
    for i in (0, 1):
        assert whole.json()["choices"][i]["text"] == "".join(
            c["text"] for e in fresh for c in e["choices"] if c["index"] == i
        )


def test_opt_outs_and_sampled_requests_bypass_the_cache(serve_app):
    body = {"model": TINY, "prompt": f"The weather today {_tag()}", "max_tokens": 6, "temperature": 0}
    off = _post(serve_app, "/completions", {**body, "cache": False})
    assert off.status_code == 200 and _status(off) == "bypass"
    assert _status(_post(serve_app, "/completions", body, {"Cache-Control": "no-store"})) == "bypass"
    assert _status(_post(serve_app, "/completions", body)) == "miss"  # neither of them stored anything
    assert _status(_post(serve_app, "/completions", body)) == "exact"
    # no-cache: not answered from the cache (a fresh generation), the fresh answer stored
    assert _status(_post(serve_app, "/completions", body, {"Cache-Control": "no-cache"})) == "bypass"
    assert _status(_post(serve_app, "/completions", body)) == "exact"
    sampled = {**body, "temperature": 0.8}
    assert [_status(_post(serve_app, "/completions", sampled)) for _ in range(2)] == ["bypass", "bypass"]
    bad = _post(serve_app, "/completions", {**body, "cache": {"semantik": True}})
    assert bad.status_code == 400 and "semantik" in bad.json()["error"]["message"]


def test_cached_answers_count_as_requests_without_tokens(serve_app):
    """A hit is one request of its API key (here the anonymous one) and no tokens: nothing was
    generated. Read from the app's /metrics."""

    def sample(name: str, kind: str | None = None) -> float:
        text = HTTP.get(f"{serve_app.root}/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if (
                line.startswith(name + "{")
                and 'api_key="anonymous"' in line
                and f'model_name="{TINY}"' in line
                and (kind is None or f'kind="{kind}"' in line)
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total

    body = {"model": TINY, "prompt": f"Count: {_tag()}", "max_tokens": 5, "temperature": 0}
    assert _status(_post(serve_app, "/completions", body)) == "miss"
    deadline = time.time() + 10
    tokens = sample("kvserve:api_key_tokens_total")
    while time.time() < deadline:  # the miss's tokens are settled in a task after the answer
        time.sleep(0.2)
        now = sample("kvserve:api_key_tokens_total")
        if now == tokens:
            break
        tokens = now
    requests = sample("kvserve:api_key_requests_total")
    assert _status(_post(serve_app, "/completions", body)) == "exact"
    time.sleep(0.5)
    assert sample("kvserve:api_key_requests_total") == requests + 1
    assert sample("kvserve:api_key_tokens_total") == tokens
    assert (
        'kvserve:response_cache_hits_total{level="exact",model_name="tiny",variant=""}'
        in HTTP.get(f"{serve_app.root}/metrics", timeout=30).text
    )


def test_delete_cache_needs_the_admin_key(serve_app):
    tag = _tag()
    tiny = {"model": TINY, "prompt": f"Clear me {tag}", "max_tokens": 4, "temperature": 0}
    smol = {"model": serve_app.model, "prompt": f"Keep me {tag}", "max_tokens": 2, "temperature": 0}
    for body in (tiny, smol):
        _post(serve_app, "/completions", body)
        assert _status(_post(serve_app, "/completions", body)) == "exact"
    url = f"{serve_app.base_url}/cache"
    r = HTTP.delete(url, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert HTTP.delete(url, headers={"Authorization": "Bearer not-the-admin-key"}, timeout=30).status_code == 401
    assert _status(_post(serve_app, "/completions", tiny)) == "exact"  # nothing was cleared
    admin = {"Authorization": f"Bearer {serve_app.admin_key}"}
    r = HTTP.delete(url, params={"model": TINY}, headers=admin, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "cache.cleared" and r.json()["model"] == TINY and r.json()["exact"] >= 1
    assert _status(_post(serve_app, "/completions", tiny)) == "miss"
    assert _status(_post(serve_app, "/completions", smol)) == "exact"  # another model's entries stay
    stats = HTTP.get(url, headers=admin, timeout=30).json()
    assert stats["exact"]["hits"] >= 1 and stats["semantic"]["mode"] == "opt-in"
    r = HTTP.delete(url, headers=admin, timeout=30)
    assert r.status_code == 200 and r.json()["exact"] >= 2
    assert _status(_post(serve_app, "/completions", smol)) == "miss"
    # the API-key app has no admin key: its API key may not clear anything
    r = HTTP.delete(
        f"{serve_app.auth_base_url}/cache", headers={"Authorization": f"Bearer {serve_app.api_key}"}, timeout=30
    )
    assert r.status_code == 403 and "no admin key is configured" in r.json()["error"]["message"]


def test_semantic_hit_for_a_paraphrase_when_asked(serve_app):
    from openai import OpenAI

    client = OpenAI(base_url=serve_app.base_url, api_key="unused")
    system = {"role": "system", "content": f"You answer in one short sentence. {_tag()}"}

    def ask(question: str, semantic: bool):
        extra = {"cache": {"semantic": True}} if semantic else None
        raw = client.chat.completions.with_raw_response.create(
            model=TINY,
            messages=[system, {"role": "user", "content": question}],
            max_tokens=8,
            temperature=0,
            extra_body=extra,
        )
        return raw.headers.get("x-kvserve-cache"), raw.parse()

    s1, first = ask("How many days are there in a leap year?", True)
    assert s1 == "miss"
    s2, para = ask("How many days does a leap year have?", True)
    assert s2 == "semantic"
    assert para.choices[0].message.content == first.choices[0].message.content and para.id != first.id
    assert para.usage == first.usage
    s3, _ = ask("How many days are in a leap year?", False)
    assert s3 == "miss"  # opt-in: a request that does not ask gets the exact level only
    s4, _ = ask("What is the capital of France?", True)
    assert s4 == "miss"


def test_new_weights_revision_never_gets_old_answers(serve_app, tiny_llama_path):
    """The replica reports its weights revision (names, sizes, mtimes of the model folder);
    the ingress re-reads it every REVISION_REFRESH_S: after the files change, the cached
    answer is not served any more. The request that starts the re-read runs beside it and
    answers (a server_info call in the request's context once left its generate call pending)."""
    import os

    from kvserve.deployments.gateway.catalog import REVISION_REFRESH_S

    body = {"model": TINY, "prompt": f"Revision {_tag()}", "max_tokens": 4, "temperature": 0}
    _post(serve_app, "/completions", body)
    assert _status(_post(serve_app, "/completions", body)) == "exact"
    for f in tiny_llama_path.glob("*.safetensors"):  # new weights on disk (as a redeploy would bring)
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    time.sleep(REVISION_REFRESH_S + 0.5)
    sampled = {**body, "temperature": 0.7, "max_tokens": 2}  # goes to the replica while the re-read runs
    assert _post(serve_app, "/completions", sampled).status_code == 200
    deadline = time.time() + 30
    while (status := _status(_post(serve_app, "/completions", body))) == "exact" and time.time() < deadline:
        time.sleep(0.2)
    assert status == "miss"
    assert _status(_post(serve_app, "/completions", body)) == "exact"  # stored under the new revision
