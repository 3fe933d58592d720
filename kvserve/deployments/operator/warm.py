"""``kvserve warm``: graduated cache warming from the request log.

The design's recipe: "identify frequently occurring prompts from historical data, compute
responses in large batches during off-peak hours, and populate your cache". From the opt-in
request log (:mod:`kvserve.deployments.gateway.request_log`, ``request_log_prompts: store``):

1. :func:`plan`: the admitted requests of the last ``window_s`` seconds (lines without
   ``"admitted": true``, from logs of older versions that logged refused requests too, are
   skipped), grouped by fingerprint; the
   ``top`` most frequent cacheable ones seen at least ``min_count`` times are replayed (their
   answers fill the exact and semantic response caches), and the ``top_system`` most frequent
   system prompts shared by at least ``min_count`` requests are prefilled once (a one-token
   request that does not touch the response cache), so a replica's prefix cache holds them
   and the prefix-aware router sends their conversations there.
2. :func:`replay`: sends the plan to the gateway at no more than ``rate`` requests per second,
   ``concurrency`` at a time, each marked ``x-kvserve-warm: 1`` with an admin key and, naming
   the API key that sent it first, ``x-kvserve-warm-key``: the gateway admits the replay under
   that key's limits (a 429 of them is tried again after its Retry-After, as a deferral is), never
   the admin key's. The gateway
   runs them at the lowest priority as *sheddable*: a replica refuses one while any live request
   is in flight there and stops those running when a live request arrives (``warming_deferred``,
   429), so warming never shares an engine step with live traffic. A deferred request is tried
   again after its Retry-After, up to ``retries`` times.

``--schedule`` (the autoscaling schedule's syntax) runs it in the schedule's low-traffic
windows (:func:`kvserve.autoscaling.schedule.low_traffic_now`), once per window, until stopped.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from kvserve.deployments.contract.types import WARM_HEADER, WARM_KEY_HEADER


@dataclass
class WarmPlan:
    """What to warm: ``requests`` (``(endpoint, body)``, most frequent first) with ``keys`` (the
    name of the API key each was first sent with, None: unknown), ``prefixes`` (``(model,
    system prompt)``), and what the log held."""

    requests: list[tuple[str, dict]] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    prefixes: list[tuple[str, str]] = field(default_factory=list)
    lines: int = 0
    distinct: int = 0
    stored: bool = False


def read_log(directory: str, since: float | None = None) -> list[dict]:
    """Every line of the request log files in ``directory`` (rotated ones too, oldest first) that
    was written at or after ``since`` (Unix seconds; None: all). Unreadable lines are skipped.

    Raises:
        FileNotFoundError: ``directory`` holds no request log.
    """

    def age(path: str) -> tuple[int, str]:  # rotated files first, oldest (highest suffix) first
        tail = path.rsplit(".jsonl", 1)[1].lstrip(".")
        return (-int(tail) if tail.isdigit() else 0, path)

    paths = sorted(glob.glob(os.path.join(directory, "requests-*.jsonl*")), key=age)
    if not paths:
        raise FileNotFoundError(f"no request log (requests-*.jsonl) in {directory!r}: set request_log_dir")
    out = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if isinstance(d, dict) and (since is None or d.get("t", 0) >= since):
                    out.append(d)
    return out


def plan(
    lines: list[dict], top: int = 100, min_count: int = 2, top_system: int = 10, models: set[str] | None = None
) -> WarmPlan:
    """The warming plan of request log ``lines`` (see the module docstring); ``models``: only
    these served models (None: all)."""
    lines = [d for d in lines if d.get("admitted") is True and (models is None or d.get("model") in models)]
    counts = Counter(d["fingerprint"] for d in lines if d.get("fingerprint"))
    first: dict[str, dict] = {}
    for d in lines:
        if d.get("fingerprint") and d.get("body") is not None:
            first.setdefault(d["fingerprint"], d)
    p = WarmPlan(lines=len(lines), distinct=len(counts), stored=any(d.get("body") is not None for d in lines))
    for fp, n in counts.most_common():
        if len(p.requests) >= top or n < min_count:
            break
        d = first.get(fp)
        if d is not None and d.get("cacheable"):
            p.requests.append((d["endpoint"], d["body"]))
            p.keys.append(d.get("key") if isinstance(d.get("key"), str) else None)
    sys_counts = Counter((d["model"], d["system_fingerprint"]) for d in lines if d.get("system_fingerprint"))
    texts = {(d["model"], d["system_fingerprint"]): d.get("system") for d in lines if d.get("system")}
    for key, n in sys_counts.most_common(top_system):
        if n >= min_count and texts.get(key):
            p.prefixes.append((key[0], texts[key]))
    return p


async def replay(
    p: WarmPlan,
    url: str,
    admin_key: str,
    rate: float = 2.0,
    concurrency: int = 1,
    retries: int = 5,
    timeout_s: float = 300.0,
    transport=None,
) -> dict:
    """Send plan ``p`` to the gateway at ``url`` (see the module docstring); ``transport``: an
    ``httpx`` transport to send through (None: the network).

    Returns:
        ``{"sent", "warmed" (answers stored), "already" (the cache had them), "prefixes"
        (system prompts prefilled), "deferred" (gave way to live traffic ``retries`` times),
        "failed", "seconds"}``.
    """
    import httpx

    keys = list(p.keys) + [None] * (len(p.requests) - len(p.keys))
    jobs = [
        ("/v1/chat/completions" if ep == "chat" else "/v1/completions", body, False, key)
        for (ep, body), key in zip(p.requests, keys)
    ]
    jobs += [
        (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "system", "content": text}, {"role": "user", "content": "."}],
                "max_tokens": 1,
                "temperature": 0.0,
                "cache": False,
            },
            True,
            None,
        )
        for model, text in p.prefixes
    ]
    counts = Counter()
    gap = 1.0 / rate if rate > 0 else 0.0
    lock = asyncio.Lock()
    next_at = [time.monotonic()]
    headers = {"Authorization": f"Bearer {admin_key}", WARM_HEADER: "1"}
    t0 = time.monotonic()

    async def pace():
        async with lock:
            wait = next_at[0] - time.monotonic()
            next_at[0] = max(next_at[0], time.monotonic()) + gap
        if wait > 0:
            await asyncio.sleep(wait)

    async def one(http, path, body, prefix, key):
        hdrs = {**headers, WARM_KEY_HEADER: key} if key and key != "anonymous" else headers
        for attempt in range(retries + 1):
            await pace()
            counts["sent"] += 1
            try:
                r = await http.post(url.rstrip("/") + path, json={**body, "stream": False}, headers=hdrs)
            except httpx.HTTPError:
                counts["failed"] += 1
                return
            if r.status_code == 200:
                counts[
                    "prefixes"
                    if prefix
                    else "already"
                    if r.headers.get("x-kvserve-cache") in ("exact", "semantic")
                    else "warmed"
                ] += 1
                return
            code = _code(r)
            if r.status_code == 429 and attempt < retries:  # live traffic (or the key's limit) first: later
                await asyncio.sleep(float(r.headers.get("retry-after") or 1.0))
                continue
            counts["deferred" if code == "warming_deferred" else "failed"] += 1
            return

    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)

    async def worker(http):
        while not queue.empty():
            await one(http, *queue.get_nowait())

    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as http:
        await asyncio.gather(*(worker(http) for _ in range(max(1, concurrency))))
    return {k: counts.get(k, 0) for k in ("sent", "warmed", "already", "prefixes", "deferred", "failed")} | {
        "seconds": round(time.monotonic() - t0, 3)
    }


def _code(r) -> str | None:
    try:
        return r.json()["error"]["code"]
    except Exception:
        return None
