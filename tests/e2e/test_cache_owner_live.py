"""Issue 63, the response caches live on Serve (beside the shared ``serve_app``, in its Serve
instance): two apps of the tiny model on the shared Redis backend (a real redis-server), one
with two API keys and one without keys. Key B's identical request after key A's answer is a
miss (A's answer is A's own), and B's next one hits B's own; without keys, an identical greedy
request sent the moment the first answer returned is an exact hit (the entry is written before
the response ends), its saved tokens counted in ``kvserve:cache_saved_tokens_total``."""

import re
import time
import uuid

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEYED, OPEN, MODEL = "kvserve-owners", "kvserve-owners-open", "tiny-owners"
KEY_A, KEY_B = "sk-owner-a-live-0001", "sk-owner-b-live-0002"


@pytest.fixture(scope="module")
def owner_apps(ray_session, serve_app, tiny_llama_path, redis_server):
    from ray import serve

    from kvserve.deployments.app import build_app

    common = {
        "model": str(tiny_llama_path),
        "served_model_name": MODEL,
        "num_replicas": 1,
        "max_model_len": 256,
        "torch_num_threads": 1,
        "replica_cpus": 0.2,
        "ingress_cpus": 0.1,
        "cache_backend": "redis",
        "redis_url": redis_server,
    }
    serve.run(build_app({**common, "api_keys": [KEY_A, KEY_B]}), name=KEYED, route_prefix="/owners", blocking=False)
    serve.run(build_app(common), name=OPEN, route_prefix="/owners-open")
    deadline = time.time() + 300
    while serve.status().applications[KEYED].status != "RUNNING":
        assert time.time() < deadline, serve.status().applications[KEYED]
        time.sleep(0.5)
    yield f"{serve_app.root}/owners/v1", f"{serve_app.root}/owners-open/v1", serve_app.root + "/owners-open"
    serve.delete(KEYED)
    serve.delete(OPEN)


def _post(c: httpx.Client, url: str, body: dict, key: str | None = None) -> httpx.Response:
    r = c.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    return r


def _body(text: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{text} {uuid.uuid4().hex[:8]}"}],
        "max_tokens": 6,
        "temperature": 0,
    }


def _saved(text: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^kvserve:cache_saved_tokens_total\{(.*)\} (\S+)$", line)
        if m and f'model_name="{MODEL}"' in m.group(1) and 'level="exact"' in m.group(1):
            total += float(m.group(2))
    return total


def test_key_b_never_gets_key_a_answer_and_an_identical_request_right_after_hits(owner_apps):
    keyed, open_, open_root = owner_apps
    with httpx.Client(timeout=120) as c:
        body = _body("Name a colour.")
        statuses = [_post(c, keyed, body, key).headers.get("x-kvserve-cache") for key in (KEY_A, KEY_A, KEY_B, KEY_B)]
        assert statuses == ["miss", "exact", "miss", "exact"]

        before = _saved(c.get(f"{open_root}/metrics").text)
        body = _body("Name a fruit.")
        first = _post(c, open_, body)
        again = _post(c, open_, body)  # sent the moment the first answer returned
        assert (first.headers["x-kvserve-cache"], again.headers["x-kvserve-cache"]) == ("miss", "exact")
        assert again.json()["choices"] == first.json()["choices"]
        tokens = first.json()["usage"]["completion_tokens"]
        deadline = time.time() + 30  # counted in a task after the hit's answer, scraped from the replicas' files
        while _saved(c.get(f"{open_root}/metrics").text) < before + tokens and time.time() < deadline:
            time.sleep(0.2)
        assert _saved(c.get(f"{open_root}/metrics").text) >= before + tokens
