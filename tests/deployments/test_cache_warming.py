"""Cache warming (kvserve/deployments/gateway/request_log.py, kvserve/deployments/operator/warm.py, the sheddable requests of
kvserve/deployments/replica/request_runner.py): the request log's privacy modes and bounds, the plan,
warming through a live gateway over a real engine (answers stored as warmed, hits on them
counted), and the rule that warming never shares an engine step with live traffic."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from kvserve.deployments.gateway.request_log import RequestLog, fingerprint
from kvserve.deployments.operator.warm import plan, read_log, replay

ADMIN = "sk-kvserve-warm-admin"


# ---- the log ---------------------------------------------------------------------------------
def _chat(content: str, system: str | None = None, **kw) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": "m", "messages": msgs, "temperature": 0.0, **kw}


def test_hash_mode_keeps_no_prompt_and_store_mode_keeps_it(tmp_path):
    for mode in ("hash", "store"):
        log = RequestLog(str(tmp_path / mode), mode, name="g1")
        log.record("m", "chat", _chat("secret question", "be brief", stream=True, user="alice"), True)
        log.close()
        (line,) = read_log(str(tmp_path / mode))
        text = (tmp_path / mode / "requests-g1.jsonl").read_text()
        assert line["fingerprint"] == fingerprint("m", "chat", _chat("secret question", "be brief"))
        assert line["system_fingerprint"] and line["cacheable"] is True
        if mode == "hash":
            assert "secret" not in text and "brief" not in text and "alice" not in text and "body" not in line
        else:
            assert line["body"]["messages"][1]["content"] == "secret question" and line["system"] == "be brief"
            assert "stream" not in line["body"] and "user" not in line["body"]  # how, and who, are not kept
        assert (tmp_path / mode).stat().st_mode & 0o777 == 0o700
        assert (tmp_path / mode / "requests-g1.jsonl").stat().st_mode & 0o777 == 0o600


def test_the_log_rotates_within_its_bound(tmp_path):
    log = RequestLog(str(tmp_path), "store", max_bytes=2000, backups=2, name="g1")
    for i in range(200):
        log.record("m", "chat", _chat(f"question number {i} " + "x" * 50), True)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["requests-g1.jsonl", "requests-g1.jsonl.1", "requests-g1.jsonl.2"]
    assert sum((tmp_path / f).stat().st_size for f in files) <= 3 * 2000
    lines = read_log(str(tmp_path))
    assert lines and lines[-1]["body"]["messages"][0]["content"].startswith("question number 199")


def test_plan_takes_the_most_frequent_cacheable_requests_and_shared_system_prompts(tmp_path):
    log = RequestLog(str(tmp_path), "store", name="g1")
    for i, n in enumerate((5, 3, 1)):  # prompt i asked n times
        for _ in range(n):
            log.record("m", "chat", _chat(f"q{i}", "shared system"), True)
    for _ in range(4):
        log.record("m", "chat", {**_chat("sampled"), "temperature": 0.9}, False)  # not cacheable
    log.record("other", "completion", {"model": "other", "prompt": "p", "temperature": 0}, True)
    log.close()
    p = plan(read_log(str(tmp_path)), top=10, min_count=2)
    assert [b["messages"][1]["content"] for _, b in p.requests] == ["q0", "q1"]
    assert p.prefixes == [("m", "shared system")] and p.lines == 14 and p.distinct == 5
    assert plan(read_log(str(tmp_path)), top=1, min_count=2).requests[0][1]["messages"][1]["content"] == "q0"
    assert plan(read_log(str(tmp_path)), models={"other"}, min_count=1).requests[0][0] == "completion"
    assert read_log(str(tmp_path), since=time.time() + 60) == []
    with pytest.raises(FileNotFoundError):
        read_log(str(tmp_path / "none"))


# ---- live ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def warm_app(tiny_llama_path, tmp_path_factory):
    """The tiny model behind a gateway with the request log on (prompts stored) and an admin key;
    the engine steps in the replica's process, so a test can watch its steps."""
    from local_app import LocalApp

    log_dir = tmp_path_factory.mktemp("request-log")
    app = LocalApp(
        {
            "/": {
                "model": str(tiny_llama_path),
                "served_model_name": "tiny",
                "max_model_len": 512,
                "torch_num_threads": 1,
                "engine_core_process": False,
                "admin_api_keys": [ADMIN],
                "request_log_dir": str(log_dir),
                "request_log_prompts": "store",
            }
        }
    ).start()
    try:
        yield app.namespace(log_dir=str(log_dir), server=app.servers["tiny"], handle=app.handles["tiny"])
    finally:
        app.stop()


def _post(base_url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{base_url}/chat/completions", json={"model": "tiny", **body}, headers=headers or {}, timeout=120
    )


def test_warming_fills_the_cache_and_live_hits_on_it_are_counted(warm_app):
    questions = [f"what is item {i}?" for i in range(4)]
    for q in questions[:3]:  # yesterday's traffic: three questions asked twice, one once
        for _ in range(2):
            assert (
                _post(
                    warm_app.base_url,
                    {"messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0.0},
                ).status_code
                == 200
            )
    _post(
        warm_app.base_url,
        {"messages": [{"role": "user", "content": questions[3]}], "max_tokens": 6, "temperature": 0.0},
    )
    # a new day: the cache starts empty
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.delete(f"{warm_app.root}/v1/cache", headers=auth).status_code == 200
    p = plan(read_log(warm_app.log_dir), min_count=2)
    assert len(p.requests) == 3
    out = asyncio.run(replay(p, warm_app.root, ADMIN, rate=50))
    assert out["warmed"] == 3 and out["failed"] == 0 and out["deferred"] == 0, out
    # warming's own requests are not logged as traffic
    assert len(read_log(warm_app.log_dir)) == 7
    stats = httpx.get(f"{warm_app.root}/v1/cache", headers=auth).json()
    assert stats["warmed"]["exact"] == 3
    # live requests for warmed questions are hits on warmed entries; the unwarmed one is a miss
    from kvserve.telemetry.metrics import cache_warmed_hits

    counter = cache_warmed_hits().prom.labels(level="exact", model_name="tiny", variant="")
    before = counter._value.get()
    for q in questions[:3]:
        r = _post(
            warm_app.base_url, {"messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0.0}
        )
        assert r.headers["x-kvserve-cache"] == "exact"
    assert (
        _post(
            warm_app.base_url,
            {"messages": [{"role": "user", "content": questions[3]}], "max_tokens": 6, "temperature": 0.0},
        ).headers["x-kvserve-cache"]
        == "miss"
    )
    assert counter._value.get() - before == 3
    # a second run finds them cached
    assert asyncio.run(replay(p, warm_app.root, ADMIN, rate=50))["already"] == 3


def test_the_warm_header_needs_an_admin_key(warm_app):
    r = _post(
        warm_app.base_url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, {"x-kvserve-warm": "1"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"


def test_warming_never_shares_a_step_with_live_traffic(warm_app):
    """A long warming request runs while the replica is idle; a live request arrives: the warming
    request is stopped (429 ``warming_deferred``) before the step that takes the live one, and no
    engine step ever holds both. While the live request runs, a warming request is refused at once."""
    steps, lock = [], threading.Lock()
    watching = threading.Event()

    def on_step(m):
        if watching.is_set():
            with lock:
                steps.append(m.num_running)

    warm_app.server.engine.add_stat_logger(on_step)
    warm_headers = {"Authorization": f"Bearer {ADMIN}", "x-kvserve-warm": "1"}
    long_body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    results = {}

    def warm_request():
        results["warm"] = _post(
            warm_app.base_url, {"messages": [{"role": "user", "content": "warm me up"}], **long_body}, warm_headers
        )

    t = threading.Thread(target=warm_request)
    t.start()
    deadline = time.time() + 60
    while warm_app.handle.get_stats.remote().result(30)["num_warm_requests"] < 1:  # it is in the engine
        assert time.time() < deadline and t.is_alive()
        time.sleep(0.01)
    watching.set()
    with httpx.Client(timeout=120) as c:
        with c.stream(
            "POST",
            f"{warm_app.base_url}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "live one"}], "stream": True, **long_body},
        ) as live:
            assert live.status_code == 200
            lines = live.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # the live request's first token
            assert warm_app.handle.get_stats.remote().result(30)["num_warm_requests"] == 0
            # while it runs, warming is refused at once
            r = _post(
                warm_app.base_url, {"messages": [{"role": "user", "content": "warm again"}], **long_body}, warm_headers
            )
            assert r.status_code == 429 and r.json()["error"]["code"] == "warming_deferred"
            assert "retry-after" in {k.lower() for k in r.headers}
            body = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    watching.clear()
    t.join(60)
    assert results["warm"].status_code == 429 and results["warm"].json()["error"]["code"] == "warming_deferred"
    assert sum(len(c["choices"]) and 1 for c in body if c.get("choices")) > 0
    with lock:
        assert steps and max(steps) == 1, steps  # one request per step: the warm one or the live one
