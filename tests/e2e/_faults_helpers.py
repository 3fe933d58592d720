"""Helpers of test_faults.py (and test_isolation_live.py): deploy a small kvserve app of a
test's own, find its replica actors, stream long completions into :class:`StreamResult`, kill a
process mid-stream or scale an app down mid-stream, and check that each client saw a complete
answer or a clean OpenAI error with nothing internal in it.
"""

import asyncio
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field

import httpx
from helpers import DONE, HTTP, aiter_sse

#: Seconds an in-flight client may take, after a kill, to see the end of its response.
CLIENT_END_LIMIT_S = 60.0
#: Seconds from a tensor-parallel worker's kill until the replica's ``/health`` says 503 (it
#: notices the dead engine at once, not at Serve's periodic health check).
HEALTH_DOWN_LIMIT_S = 5.0
#: Longest one ``/health`` answer may take while Serve replaces the replica (it never blocks).
HEALTH_ANSWER_LIMIT_S = 10.0

#: A tiny replica's share of the session's 8 logical CPUs (beside the fixture's apps). Its streams
#: send 8 tokens a chunk: these tests are about drains, kills and recovery, not chunking, and a
#: chunk per token made the serving path most of their CPU time.
TINY = {
    "max_num_seqs": 8,
    "max_model_len": 2048,
    "torch_num_threads": 1,
    "replica_cpus": 0.25,
    "worker_cpus": 0.25,
    "ingress_cpus": 0.1,
    "stream_interval": 8,
}
#: Tokens of each long stream: seconds of decoding for 6-8 concurrent streams of the tiny model
#: (prompt + tokens within TINY's max_model_len).
LONG_TOKENS = 1900

#: Text that must never reach a client: Ray's and Python's internals.
INTERNALS = (
    "Traceback",
    'File "',
    "Actor",
    "actor",
    "ray::",
    "ray.exceptions",
    "RayTaskError",
    "Worker",
    "worker_id",
    "/tmp/",
    "/work/",
    "/root/",
    "127.0.0.1",
    "pid",
)


# ---- helpers ------------------------------------------------------------------------------------
def _app_args(tiny_llama_path, name: str, **extra) -> dict:
    return {"model": str(tiny_llama_path), "served_model_name": name, **TINY, **extra}


def _pin_version(app, version: str):
    """Give every deployment of a built kvserve app a fixed version. ``serve.run`` otherwise
    gives each deployment a random version on every call, so re-running an app with another
    ``num_replicas`` is a rolling restart of all its replicas (the ingress too), not a
    scale-down; with the versions unchanged Serve applies it as a lightweight update and
    stops just the surplus replica. (Serve has no public way to set a version here.)"""
    app._bound_deployment._version = version
    for child in app._bound_deployment.init_args[0].values():  # OpenAIIngress(models={name: LLMServer app})
        child._bound_deployment._version = version
    return app


def _deploy(app_args: dict, name: str, route: str, *, pin: str | None = None) -> None:
    """Deploy (or update) a kvserve app; returns once Serve reports it running."""
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(app_args)
    if pin is not None:
        _pin_version(app, pin)
    serve.run(app, name=name, route_prefix=route, blocking=False)


def _replica_actors(app_name: str) -> list[dict]:
    """The Serve replica actors of an application, alive or dead: ``deployment``, ``replica``
    (Serve's replica id, the ``replica`` metrics label), ``state``, ``pid``. From the GCS's
    actor table: ``ray.util.state`` needs the dashboard, which the session runs without."""
    from ray._private.state import state

    out = []
    for a in state.actor_table(None).values():
        cls = a.get("ActorClassName") or ""
        if cls.startswith(f"ServeReplica:{app_name}:"):
            out.append(
                {
                    "deployment": cls.rsplit(":", 1)[1],
                    "replica": (a.get("Name") or "").rsplit("#", 1)[-1],
                    "actor_id": a["ActorID"],
                    "state": a["State"],
                    "pid": a.get("Pid"),
                }
            )
    return out


def _alive_llm_replicas(app_name: str) -> list[dict]:
    return [a for a in _replica_actors(app_name) if a["deployment"] == "LLMServer" and a["state"] == "ALIVE"]


def _assert_no_internals(text: str, *pids: int) -> None:
    for bad in INTERNALS:
        assert bad not in text, f"{bad!r} reached a client: {text[:500]}"
    for pid in pids:  # a process id as a number of its own (not inside a hex request id)
        assert not re.search(rf"(?<![0-9a-fA-F]){pid}(?![0-9a-fA-F])", text), f"pid {pid} reached a client: {text}"


def _assert_openai_error(obj: dict, *pids: int) -> dict:
    """``obj`` is exactly OpenAI's error body, with nothing internal in it; returns ``obj["error"]``."""
    assert set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    _assert_no_internals(json.dumps(obj), *pids)
    return err


@dataclass
class StreamResult:
    status: int | None = None
    events: list = field(default_factory=list)  # parsed JSON events, DONE ("[DONE]") as a string
    body: str = ""  # the whole body of a non-200 answer
    tokens: int = 0  # text chunks received
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    t_end: float | None = None
    exception: BaseException | None = None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == DONE

    @property
    def data(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict)]

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.data if "error" in e]

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.data for c in e.get("choices", []) if c.get("finish_reason")]

    @property
    def usage(self) -> dict | None:
        return next((e["usage"] for e in reversed(self.data) if e.get("usage")), None)


async def _stream(client: httpx.AsyncClient, url: str, body: dict, res: StreamResult, started_after: int = 10):
    """Run one streaming request into ``res``; ``res.first_token`` is set once ``started_after``
    text chunks arrived (the stream is then mid-way)."""
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.body = (await r.aread()).decode()
                return
            async for ev in aiter_sse(r):
                res.events.append(ev)
                if isinstance(ev, dict) and any(c.get("text") for c in ev.get("choices", [])):
                    res.tokens += 1
                    if res.tokens >= started_after:
                        res.first_token.set()
    except Exception as e:  # a hang shows up as httpx's read timeout here
        res.exception = e
    finally:
        res.t_end = time.monotonic()
        res.first_token.set()


def _long_body(n: int = LONG_TOKENS) -> dict:
    """A long greedy stream, never answered from the gateway's response cache (the tests that
    share an app send the same prompt: a cached answer would end at once)."""
    return {
        "prompt": "Count: one, two, three,",
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        "cache": False,
    }


def _assert_completed(res: StreamResult, n: int = LONG_TOKENS) -> None:
    assert res.exception is None, repr(res.exception)
    assert res.status == 200, res.body
    assert not res.errors, res.errors
    assert res.done, f"no [DONE]: {res.events[-2:]}"
    assert res.finish_reasons == ["length"], res.finish_reasons
    assert res.usage is not None and res.usage["completion_tokens"] == n, res.usage


def _assert_failed_cleanly(res: StreamResult, t_kill: float, *pids: int) -> str:
    """An in-flight request whose server died: an SSE error event then ``[DONE]``, or a clean
    5xx; it ended within :data:`CLIENT_END_LIMIT_S` of the kill. Returns the error code."""
    assert res.exception is None, f"the client saw no end of its response: {res.exception!r}"
    assert res.t_end - t_kill < CLIENT_END_LIMIT_S, f"response ended {res.t_end - t_kill:.1f} s after the kill"
    if res.status != 200:
        assert 500 <= res.status < 600, (res.status, res.body)
        return _assert_openai_error(json.loads(res.body), *pids)["code"]
    assert res.done, f"stream cut without [DONE]: last events {res.events[-3:]}"
    assert not res.finish_reasons, f"a stream cut by the kill ended as if complete: {res.finish_reasons}"
    assert len(res.errors) == 1, f"expected one error event before [DONE], got {res.errors} / {res.events[-3:]}"
    assert res.events[-2] is res.errors[0], f"the error event is not the last before [DONE]: {res.events[-3:]}"
    err = _assert_openai_error(res.errors[0], *pids)
    assert err["type"] == "server_error", err
    return err["code"]


async def _wait_recovered(client: httpx.AsyncClient, base: str, t_kill: float, limit_s: float, *pids: int) -> dict:
    """Poll ``/ready`` and a 1-token completion until both answer 200; seconds since the kill
    for each. Every other answer on the way must be a clean OpenAI error (503, 429)."""
    out: dict = {"ready_s": None, "completion_s": None, "answers": []}
    deadline = t_kill + limit_s + 60  # keep measuring past the limit, to report the real time

    async def ready():
        while out["ready_s"] is None and time.monotonic() < deadline:
            try:
                r = await client.get(f"{base}/ready", timeout=15)
            except httpx.TimeoutException:
                out["answers"].append((round(time.monotonic() - t_kill, 1), "ready", "timeout"))
                continue
            if r.status_code == 200:
                out["ready_s"] = time.monotonic() - t_kill
                return
            assert r.status_code == 503, r.text
            err = _assert_openai_error(r.json(), *pids)
            out["answers"].append((round(time.monotonic() - t_kill, 1), "ready", r.status_code, err["message"]))
            await asyncio.sleep(0.25)

    async def completion():
        while out["completion_s"] is None and time.monotonic() < deadline:
            try:
                r = await client.post(
                    f"{base}/v1/completions", timeout=30, json={"prompt": "hello", "max_tokens": 1, "temperature": 0}
                )
            except httpx.TimeoutException:
                out["answers"].append((round(time.monotonic() - t_kill, 1), "completion", "timeout"))
                continue
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 1, r.text
                out["completion_s"] = time.monotonic() - t_kill
                return
            assert r.status_code in (429, 500, 502, 503, 504), r.text
            err = _assert_openai_error(r.json(), *pids)
            out["answers"].append((round(time.monotonic() - t_kill, 1), "completion", r.status_code, err["code"]))
            await asyncio.sleep(0.25)

    await asyncio.gather(ready(), completion())
    return out


async def _watch_health(client: httpx.AsyncClient, base: str, t_kill: float, *pids: int) -> dict:
    """After a kill that leaves the replica's engine dead: ``/health`` turns 503 ``unhealthy``
    within :data:`HEALTH_DOWN_LIMIT_S` (the replica notices at once, not at Serve's next
    periodic check), a completion sent then succeeds or gets a clean 503, neither with anything
    internal in it; while Serve replaces the replica ``/health`` never blocks (each answer within
    :data:`HEALTH_ANSWER_LIMIT_S`) until it is 200 again. Returns what was seen."""
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    out: dict = {"down_s": None, "up_s": None, "completion": None}
    while True:
        r = await client.get(f"{base}/health", timeout=30)
        if r.status_code == 503:
            out["down_s"] = time.monotonic() - t_kill
            break
        assert time.monotonic() - t_kill < HEALTH_DOWN_LIMIT_S, (
            f"health still {r.status_code} {HEALTH_DOWN_LIMIT_S:.0f} s after the engine died"
        )
        await asyncio.sleep(0.2)
    assert _assert_openai_error(r.json(), *pids)["code"] == "unhealthy", r.text
    r = await client.post(f"{base}/v1/completions", json=body, timeout=60)
    out["completion"] = r.status_code
    if r.status_code != 200:  # the replica may already be replaced; if not, a clean 503
        assert r.status_code == 503, r.text
        assert _assert_openai_error(r.json(), *pids)["code"] in ("engine_dead", "model_unavailable", "unhealthy")
    deadline = time.monotonic() + 180
    while True:  # Serve replaces the unhealthy replica
        t1 = time.monotonic()
        h = await client.get(f"{base}/health", timeout=30)
        assert time.monotonic() - t1 < HEALTH_ANSWER_LIMIT_S, "health blocked while the replica restarts"
        if h.status_code == 200:
            out["up_s"] = time.monotonic() - t_kill
            return out
        assert time.monotonic() < deadline, h.text
        await asyncio.sleep(1)


async def _kill_mid_stream(
    base: str,
    pid: int,
    limit_s: float,
    n_streams: int = 6,
    *,
    watch_health: bool = False,
    other_pids: tuple[int, ...] = (),
) -> tuple[list[StreamResult], dict, float, float]:
    """Start ``n_streams`` long streams, SIGKILL ``pid`` once each is mid-way, wait for every
    client to see its end and for the service to recover (with ``watch_health``, also
    :func:`_watch_health` from the kill on, its result in the recovery's ``health``). Returns the
    streams, the recovery times, the kill's ``time.monotonic()`` and the seconds from the kill
    until the last in-flight client had seen the end of its response."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        results = [StreamResult() for _ in range(n_streams)]
        tasks = [asyncio.create_task(_stream(client, f"{base}/v1/completions", _long_body(), r)) for r in results]
        await asyncio.wait_for(asyncio.gather(*(r.first_token.wait() for r in results)), 120)
        assert all(r.status == 200 and not r.done for r in results), [
            (r.status, r.body, r.events[-1:]) for r in results
        ]  # every stream is mid-way
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        health = asyncio.create_task(_watch_health(client, base, t_kill, pid, *other_pids)) if watch_health else None
        done, pending = await asyncio.wait(tasks, timeout=CLIENT_END_LIMIT_S + 30)
        for t in pending:
            t.cancel()
        assert not pending, f"{len(pending)} of {n_streams} in-flight clients hang after the kill"
        clients_end_s = max(r.t_end for r in results) - t_kill
        recovery = await _wait_recovered(client, base, t_kill, limit_s, pid)
        if health is not None:
            recovery["health"] = await asyncio.wait_for(health, 240)
    return results, recovery, t_kill, clients_end_s


# ---- graceful drain -----------------------------------------------------------------------------
def _finished_by_replica(base: str, served: str) -> dict[str, dict[str, float]]:
    """``kvserve:request_success_total`` of one model from the app's ``/metrics``, by replica
    and finish reason (the counters of exited replicas stay in the node's metrics files)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(HTTP.get(f"{base}/metrics", timeout=30).text):
        if fam.name == "kvserve:request_success":
            for s in fam.samples:
                if s.name.endswith("_total") and s.labels.get("model_name") == served:
                    by = out.setdefault(s.labels["replica"], {})
                    by[s.labels["finished_reason"]] = by.get(s.labels["finished_reason"], 0) + s.value
    return out


def _scale_down_mid_stream(base: str, name: str, route: str, args: dict, pin: str, n_streams: int = 8) -> dict:
    """With ``n_streams`` long streams mid-way on a 2-replica app, update the app to
    ``num_replicas: 1`` (same versions: a scale-down), and send new requests while the
    surplus replica is STOPPING. Returns the streams (all mid-way when the update was sent),
    when STOPPING was seen and how many streams were still running then, the new requests'
    results and the stopped replica's id."""
    from ray import serve

    before = {a["replica"]: a for a in _replica_actors(name) if a["state"] == "ALIVE"}
    assert sorted(a["deployment"] for a in before.values()) == ["LLMServer", "LLMServer", "OpenAIIngress"]

    def llm_states() -> dict:
        return dict(serve.status().applications[name].deployments["LLMServer"].replica_states)

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10)) as client:
            longs = [StreamResult() for _ in range(n_streams)]
            tasks = []
            for r in longs:  # one at a time: the router then sees each replica's load and splits them
                # (a burst can land on one replica, and Serve then stops the idle one)
                tasks.append(asyncio.create_task(_stream(client, f"{base}/v1/completions", _long_body(), r)))
                await asyncio.wait_for(r.first_token.wait(), 120)
            assert all(r.status == 200 and not r.done for r in longs), [(r.status, r.body) for r in longs]
            # the scale-down (serve.run returns once the app is running at its new size)
            redeploy = asyncio.create_task(
                asyncio.to_thread(_deploy, {**args, "num_replicas": 1}, name, route, pin=pin)
            )
            t0 = time.monotonic()
            # stopping has begun when a replica is STOPPING, or already gone (a short drain can
            # end between two polls: serve.status() takes up to seconds on a loaded box)
            while "STOPPING" not in (states := await asyncio.to_thread(llm_states)) and states.get("RUNNING", 0) > 1:
                assert time.monotonic() - t0 < 60, f"no replica is stopping: {states}"
                assert not redeploy.done() or redeploy.exception() is None, redeploy.exception()
                await asyncio.sleep(0.1)
            t_stopping = time.monotonic()
            in_flight = sum(not r.done for r in longs)
            # new requests while a replica drains: a stream, completions and /ready
            new_stream = StreamResult()
            new_task = asyncio.create_task(
                _stream(client, f"{base}/v1/completions", _long_body(16), new_stream, started_after=1)
            )
            t_new = time.monotonic()
            answers = await asyncio.gather(
                *(
                    client.post(f"{base}/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 8, "temperature": 0})
                    for i in range(3)
                ),
                client.get(f"{base}/ready"),
            )
            new_s = time.monotonic() - t_new
            still_stopping = "STOPPING" in await asyncio.to_thread(llm_states)
            await asyncio.wait_for(asyncio.gather(*tasks, new_task), 240)
            await asyncio.wait_for(redeploy, 240)
            return {
                "longs": longs,
                "t_stopping": t_stopping,
                "in_flight": in_flight,
                "new_stream": new_stream,
                "answers": answers,
                "new_s": new_s,
                "still_stopping": still_stopping,
            }

    out = asyncio.run(run())
    after = {a["replica"]: a for a in _replica_actors(name) if a["state"] == "ALIVE"}
    assert set(after) < set(before), "the update replaced replicas instead of stopping one (not a scale-down)"
    stopped = [r for r, a in before.items() if a["deployment"] == "LLMServer" and r not in after]
    assert len(stopped) == 1 and len(_alive_llm_replicas(name)) == 1, (before, after)
    out["stopped"] = stopped[0]
    _assert_completed(out["new_stream"], 16)
    for r in out["answers"]:
        assert r.status_code == 200, r.text
    return out


def _wait_ready(base: str, tries: int = 600) -> None:
    """Poll ``{base}/ready`` every 0.5 s until it answers 200 (``tries`` times at most).

    Raises:
        AssertionError: it never did.
    """
    with httpx.Client(timeout=60) as c:
        for _ in range(tries):
            try:
                if c.get(f"{base}/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise AssertionError("the app never became ready")
