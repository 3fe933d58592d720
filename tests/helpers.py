"""Helpers shared by the test folders: a free loopback port and the parsing of Server-Sent Events.

``tests/`` is on ``sys.path`` (tests/conftest.py is not in a package), so every test folder
imports them as ``from helpers import free_port, sse_events``.

SSE as the OpenAI API streams it: ``data: <json>`` events, one per line, separated by blank
lines, the last one ``data: [DONE]``. Parsed events are dicts, and the end marker is the string
:data:`DONE`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Any, AsyncIterator, Iterable, Iterator, Union

import httpx

DONE = "[DONE]"

#: The client of the tests' one-off HTTP calls: ``HTTP.get(url, timeout=...)`` where one would
#: write ``httpx.get(...)``, which builds a client, and with it an SSL context, on every call; in
#: polling loops that was most of a live test's CPU. No keep-alive, so every
#: request opens a connection of its own as ``httpx.get`` does (the servers here are killed and
#: restarted under the tests).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

#: The test profile: ``fast`` (the default, what ``make test`` runs) or ``thorough``
#: (``KVSERVE_TEST_PROFILE=thorough``, what ``make test-thorough`` runs: full fuzz sizes, request
#: counts and steps). A test whose time is its size asserts the same in both, at :func:`sized`'s size.
PROFILE = os.environ.get("KVSERVE_TEST_PROFILE", "fast")
if PROFILE not in ("fast", "thorough"):
    raise ValueError(f"KVSERVE_TEST_PROFILE={PROFILE!r}: fast or thorough")
THOROUGH = PROFILE == "thorough"


def sized(fast: int, thorough: int) -> int:
    """A size (examples, requests, steps) for the current :data:`PROFILE`."""
    return thorough if THOROUGH else fast


def cosine(a, b) -> float:
    """Cosine similarity of two vectors (lists or arrays), computed in float64."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


#: Property tests draw new examples each run when ``KVSERVE_FUZZ_RANDOM=1``; otherwise they are
#: derandomized (the same examples every run, so a red run is the code's doing, not the draw's).
FUZZ_RANDOM = os.environ.get("KVSERVE_FUZZ_RANDOM") == "1"

#: What the sync parsers read: a response (httpx or requests: anything with ``iter_lines()``,
#: streamed or not), a whole body (``str`` or ``bytes``), or lines.
SSESource = Union[str, bytes, Iterable[Union[str, bytes]], Any]


class FakeClock:
    """A clock the test sets (``t``, seconds) or moves (:meth:`advance`); call it for the time."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nothing listens on it once this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_event(line: Union[str, bytes]) -> Union[None, str, dict]:
    """One line of an SSE stream: None unless it is a ``data:`` line; :data:`DONE` for
    ``data: [DONE]``; otherwise the event's JSON (``json.loads``; raises on a malformed event)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.rstrip("\r")
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :]
    if data.startswith(" "):  # the SSE format: one optional space after the colon
        data = data[1:]
    return DONE if data == DONE else json.loads(data)


def _lines(source: SSESource) -> Iterable[Union[str, bytes]]:
    if isinstance(source, bytes):
        source = source.decode("utf-8", "replace")
    if isinstance(source, str):
        # SSE ends a line at CR, LF or CRLF only; str.splitlines also splits at U+2028, U+0085
        # and others, which JSON (and so an event's data) may hold unescaped
        return re.split(r"\r\n|\r|\n", source)
    iter_lines = getattr(source, "iter_lines", None)
    return iter_lines() if iter_lines is not None else source


def iter_sse(source: SSESource) -> Iterator[Union[str, dict]]:
    """The events of an SSE stream as they arrive, :data:`DONE` included (where the stream has
    it); an error event is a dict like any other."""
    for line in _lines(source):
        event = sse_event(line)
        if event is not None:
            yield event


async def aiter_sse(response) -> AsyncIterator[Union[str, dict]]:
    """:func:`iter_sse` for an httpx streamed response read asynchronously (``aiter_lines``)."""
    async for line in response.aiter_lines():
        event = sse_event(line)
        if event is not None:
            yield event


def sse_events(source: SSESource) -> list[dict]:
    """The JSON events of a whole SSE stream, which must end with ``data: [DONE]`` (asserted;
    the marker is not returned)."""
    events = list(iter_sse(source))
    assert events and events[-1] == DONE, f"stream does not end with [DONE]: last events {events[-3:]!r}"
    return events[:-1]


def spread_tp_llm(model_path, collective_timeout_s: float, num_kv_blocks: int = 32, tp: int = 2, pp: int = 1):
    """An offline ``LLM`` with ``tp`` tensor ranks in each of ``pp`` pipeline stages, whose ranks
    are Ray actors on as many nodes (``STRICT_SPREAD``); returns ``(llm, its RayWorkerGroup)``.
    float32, as the one-process reference it is compared with token for token (tensor ranks
    split the matmuls, so bfloat16 would round a near tie differently)."""
    from kvserve.cluster.worker_group import RayWorkerGroup
    from kvserve.engine import LLM

    groups = []

    def factory(config, path):
        groups.append(
            RayWorkerGroup(
                config,
                path,
                num_cpus=1,
                torch_num_threads=1,
                strategy="STRICT_SPREAD",
                timeout_s=120,
                collective_timeout_s=collective_timeout_s,
            )
        )
        return groups[-1]

    llm = LLM(
        str(model_path),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        executor_factory=factory,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=num_kv_blocks,
    )
    return llm, groups[0]


async def stream_completion(client, body: dict, started=None) -> dict:
    """One streamed ``POST /v1/completions`` of ``body`` (an httpx ``AsyncClient``): ``status``,
    ``request_id`` (the ``x-request-id`` header), the streamed ``text``, ``t_first``
    (``time.time()`` at the first token, None without one), the ``error`` of an error event (None
    without one) and whether it ended with ``[DONE]`` (``done``); ``started`` (a semaphore) is
    released at its first event."""
    out = {"status": None, "request_id": None, "text": "", "t_first": None, "error": None, "done": False}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        out["status"], out["request_id"] = r.status_code, r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if started is not None:
                started.release()
                started = None
            if line[6:] == "[DONE]":
                out["done"] = True
            elif "error" in (event := json.loads(line[6:])):
                out["error"] = event["error"]
            else:
                out["t_first"] = out["t_first"] or time.time()
                out["text"] += event["choices"][0]["text"]
    return out


def shutdown_ray_cluster(cluster) -> None:
    """Serve (if it runs), this driver's Ray connection, then ``cluster``'s processes
    (``ray.cluster_utils.Cluster`` or ``autoscaling_cluster.FakeAutoscalingCluster``)."""
    import ray

    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()
    cluster.shutdown()
