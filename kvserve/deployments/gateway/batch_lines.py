"""A batch input file's requests, run through the gateway's own HTTP app: :func:`parse_batch`
checks an input file (OpenAI's batch JSONL), :class:`BatchLineRunner` runs its requests. Used by
the Batch API (:mod:`kvserve.deployments.gateway.batches`) and by ``kvserve run-batch`` (offline, as
vLLM's ``run-batch``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvserve.deployments.contract.openai_errors import OpenAIError

#: What a batch may call (OpenAI's Batch API endpoints that kvserve serves).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: Most requests in one input file (OpenAI's limit).
MAX_BATCH_REQUESTS = 50_000
#: Refusals a batch request waits out and retries: a replica's full batch share
#: (``max_batch_requests``) or a full replica, a key's rate limits, a replica that is not up yet.
RETRYABLE = (429, 503)
#: Longest wait between two tries of one request (seconds).
MAX_RETRY_WAIT_S = 5.0
#: The ASGI scope key that marks a request as the batch runner's own (set in this process
#: only, by :func:`mark_batch`: no header or other client input can set it).
BATCH_SCOPE_KEY = "kvserve_batch_runner"


def mark_batch(app):
    """``app`` with every request it gets marked as batch work (:data:`BATCH_SCOPE_KEY` in its
    ASGI scope): what :class:`BatchLineRunner` calls, so the gateway runs those requests at
    the lowest priority, as batch work on the replica (``GenerateRequest.batch``), never
    upstream, and out of the request log. A client's request through
    the HTTP server never carries the mark (a header such as ``x-kvserve-batch`` does nothing)."""

    async def marked(scope, receive, send):
        if scope.get("type") == "http":
            scope = {**scope, BATCH_SCOPE_KEY: True}
        await app(scope, receive, send)

    return marked


def is_batch(scope) -> bool:
    """Whether a request is the batch runner's own (see :func:`mark_batch`)."""
    return scope.get(BATCH_SCOPE_KEY) is True


def parse_batch(data: bytes, endpoint: str | None = None) -> list[dict[str, Any]]:
    """The requests of an input file: one JSON object per line with ``custom_id`` (unique),
    ``method`` ``POST``, ``url`` (``endpoint`` when given, else one of :data:`BATCH_ENDPOINTS`,
    the same on every line) and ``body`` (an object; ``stream`` is dropped: a batch answers
    whole). Blank lines are skipped.

    Raises:
        OpenAIError: 400 listing the lines that are not so (at most 20), ``errors`` holding
            OpenAI's ``{"code", "message", "line"}`` records.
    """
    errors, out, seen = [], [], set()

    def bad(line: int, code: str, message: str) -> None:
        errors.append({"object": "error", "code": code, "message": message, "line": line, "param": None})

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid(
            [
                {
                    "object": "error",
                    "code": "invalid_file",
                    "message": "the file is not UTF-8 text",
                    "line": None,
                    "param": None,
                }
            ]
        ) from None
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as e:
            bad(n, "invalid_json_line", f"not a JSON object: {e}")
            continue
        if not isinstance(item, dict):
            bad(n, "invalid_json_line", "not a JSON object")
            continue
        cid, url, body = item.get("custom_id"), item.get("url"), item.get("body")
        if not isinstance(cid, str) or not cid:
            bad(n, "missing_required_parameter", "custom_id must be a non-empty string")
        elif cid in seen:
            bad(n, "duplicate_custom_id", f"custom_id {cid!r} appears twice")
        if str(item.get("method", "")).upper() != "POST":
            bad(n, "invalid_method", "method must be POST")
        want = endpoint or (out[0]["url"] if out else None)
        if url not in BATCH_ENDPOINTS:
            bad(n, "invalid_url", f"url must be one of {', '.join(BATCH_ENDPOINTS)}, got {url!r}")
        elif want is not None and url != want:
            bad(n, "mismatched_url", f"url {url!r} differs from the batch's endpoint {want!r}")
        if not isinstance(body, dict):
            bad(n, "invalid_body", "body must be a JSON object")
        if errors and errors[-1]["line"] == n:
            continue
        seen.add(cid)
        out.append({"custom_id": cid, "url": url, "body": {k: v for k, v in body.items() if k != "stream"}})
    if not out and not errors:
        bad(None, "empty_file", "the file holds no request")
    if len(out) > MAX_BATCH_REQUESTS:
        bad(None, "too_many_requests", f"{len(out)} requests; a batch takes at most {MAX_BATCH_REQUESTS}")
    if errors:
        raise _invalid(errors)
    return out


def _invalid(errors: list[dict]) -> OpenAIError:
    e = OpenAIError(
        f"the input file is not a valid batch: {errors[0]['message']}"
        + (f" (line {errors[0]['line']})" if errors[0]["line"] else "")
        + (f", and {len(errors) - 1} more" if len(errors) > 1 else ""),
        400,
        code="invalid_batch_file",
    )
    e.errors = errors[:20]
    return e


def result_line(
    custom_id: str, status: int | None, body: Any, request_id: str | None, error: dict | None = None
) -> dict[str, Any]:
    """One line of a batch's output or error file (OpenAI's shape)."""
    response = None if status is None else {"status_code": status, "request_id": request_id or "", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


class BatchLineRunner:
    """Runs a batch's requests through an ASGI app (the gateway's own, in this process: keys,
    limits, caches, routing and replicas as for any request), at most ``concurrency`` at once,
    each marked in its ASGI scope as batch work (:func:`mark_batch`: lowest priority; a
    replica runs it within its batch share and the engine preempts it for live requests,
    keeping its tokens, but never stops it). A refusal to wait out (429, 503: a full batch
    share or replica, a key's rate limit, a replica not up yet) is retried after its
    ``Retry-After`` (at most :data:`MAX_RETRY_WAIT_S`) until ``deadline``.

    Args:
        app: the ASGI app.
        headers: the requests' credentials (the batch's creator's ``Authorization`` or
            ``x-api-key``; held in memory only, never stored).
        concurrency: requests in flight at once.
        deadline: ``time.time()`` after which nothing is retried or started (None: none).
    """

    def __init__(self, app, headers: dict[str, str], concurrency: int, deadline: float | None = None):
        self.app, self.headers, self.concurrency, self.deadline = app, dict(headers), concurrency, deadline
        self.stop_reason: str | None = None  # set to stop: "batch_cancelled" or "batch_expired"

    async def run(
        self, requests: list[dict[str, Any]], done: Callable[[int, dict[str, Any], bool], Awaitable[None] | None]
    ) -> None:
        """Run ``requests`` (:func:`parse_batch`'s); ``done(index, line, ok)`` gets each one's
        output line (``ok``: a 2xx answer) as it ends. Requests not started when the runner
        stops (:attr:`stop_reason`, or the deadline) end with that error code."""
        queue: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(requests):
            queue.put_nowait((i, r))
        transport = httpx.ASGITransport(app=mark_batch(self.app))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve-batch", timeout=None) as http:

            async def worker():
                while not queue.empty():
                    i, r = queue.get_nowait()
                    line, ok = await self._one(http, r)
                    out = done(i, line, ok)
                    if asyncio.iscoroutine(out):
                        await out

            await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(requests)) or 1)))

    def _stopped(self) -> str | None:
        if self.stop_reason is None and self.deadline is not None and time.time() >= self.deadline:
            self.stop_reason = "batch_expired"
        return self.stop_reason

    async def _one(self, http: httpx.AsyncClient, r: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        request_id = f"batch_req_{uuid.uuid4().hex[:24]}"
        wait = 0.25
        while True:
            reason = self._stopped()
            if reason is not None:
                return result_line(
                    r["custom_id"],
                    None,
                    None,
                    None,
                    {
                        "code": reason,
                        "message": "the batch was cancelled"
                        if reason == "batch_cancelled"
                        else "the batch's completion window ended before this request ran",
                    },
                ), False
            try:
                resp = await http.post(r["url"], json=r["body"], headers={**self.headers, "x-request-id": request_id})
            except Exception as e:  # the app itself failed (it answers errors as responses otherwise)
                return result_line(
                    r["custom_id"],
                    None,
                    None,
                    request_id,
                    {"code": "server_error", "message": f"the request failed: {type(e).__name__}"},
                ), False
            try:
                body = resp.json()
            except ValueError:
                body = {"error": {"message": resp.text[:1000], "type": "server_error"}}
            if resp.status_code in RETRYABLE and self._stopped() is None:
                after = resp.headers.get("retry-after")
                try:
                    pause = float(after) if after else wait
                except ValueError:
                    pause = wait
                pause = min(max(pause, 0.05), MAX_RETRY_WAIT_S)
                if self.deadline is None or time.time() + pause < self.deadline:
                    await asyncio.sleep(pause)
                    wait = min(wait * 2, MAX_RETRY_WAIT_S)
                    continue
            ok = 200 <= resp.status_code < 300
            return result_line(r["custom_id"], resp.status_code, body, resp.headers.get("x-request-id", request_id)), ok
