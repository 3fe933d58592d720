"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches``, ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``. :class:`Batches` keeps the batch objects and runs them.

A batch runs in the ingress replica that accepted it, as a task beside live traffic: its
requests go through that replica's own HTTP app (:class:`~kvserve.deployments.gateway.batch_lines.BatchLineRunner`:
the creator's key, its limits, the caches, routing), at the lowest priority and sheddable, so
a replica refuses or stops batch work while live requests need it and the batch waits for idle
capacity. Its input is a file of the Files API (:class:`~kvserve.deployments.gateway.files.FileStore`);
its results become an output file (``2xx`` answers) and an error file (the rest), in input
order. Status: ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``; ``failed``
(an invalid input file: ``errors`` lists its lines), ``cancelling`` -> ``cancelled`` and
``expired`` (the completion window ended) keep the results so far.

The creator's credentials stay in the running task's memory, never in the store. A batch whose
ingress replica went away (no progress written for :data:`STALE_S`) reads as ``failed``.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from kvserve.deployments.cache.owner_stores import OwnerStores
from kvserve.deployments.cache.settings import CacheSettings
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.batch_lines import BATCH_ENDPOINTS, BatchLineRunner, parse_batch
from kvserve.deployments.gateway.files import FILE_TTL_S, FileStore
from kvserve.deployments.gateway.streams import background

logger = logging.getLogger("ray.serve")

#: Seconds between two writes of a running batch's progress (its heartbeat).
PROGRESS_S = 2.0
#: A running batch with no progress written for this long has lost its ingress replica.
STALE_S = 60.0
#: Longest completion window (OpenAI: ``24h``).
MAX_WINDOW_S = 24 * 3600
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def _not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(f"no batch with id '{batch_id}' was found", 404, param="batch_id", code="batch_not_found")


def window_seconds(window: str) -> int:
    """``"24h"`` (or fewer hours, ``"30m"``) in seconds.

    Raises:
        OpenAIError: 400 for another form or more than 24 hours.
    """
    m = re.fullmatch(r"(\d+)([hm])", str(window))
    seconds = int(m.group(1)) * (3600 if m.group(2) == "h" else 60) if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise OpenAIError(f"completion_window must be up to 24h (e.g. '24h'), got {window!r}", 400,
                          param="completion_window", code="invalid_value")
    return seconds


class Batches:
    """The batches of each API key (see the module docstring), kept in the response cache's
    backend beside the files.

    Args:
        settings: the cache backend.
        files: where input, output and error files live.
        concurrency: requests of one batch in flight at once.
    """

    PREFIX = "kvserve:batches:"
    MODEL = "batch"

    def __init__(self, settings: CacheSettings, files: FileStore, concurrency: int):
        self.owners = OwnerStores(settings, self.PREFIX)
        self.files, self.concurrency = files, concurrency
        self.app = None  # the gateway's HTTP app, bound by build_api
        self.running: dict[str, BatchLineRunner] = {}  # batch id -> its runner, in this replica

    async def create(self, owner: str, credentials: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        """A new batch over ``body["input_file_id"]`` (OpenAI's create request), started now.

        Raises:
            OpenAIError: 400 for a bad endpoint, window, metadata or input file purpose; 404
                for an input file ``owner`` does not have.
        """
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise OpenAIError(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}", 400,
                              param="endpoint", code="invalid_value")
        window = window_seconds(body.get("completion_window", "24h"))
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or any(
                not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
            raise OpenAIError("metadata: at most 16 string pairs (keys up to 64, values up to 512 characters)", 400,
                              param="metadata", code="invalid_value")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise OpenAIError("input_file_id is required", 400, param="input_file_id", code="invalid_value")
        meta = await self.files.meta(owner, file_id)
        if meta["purpose"] != "batch":
            raise OpenAIError(f"file {file_id} has purpose {meta['purpose']!r}, not 'batch'", 400,
                              param="input_file_id", code="invalid_value")
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": body.get("completion_window", "24h"),
                 "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
                 "in_progress_at": None, "expires_at": now + window, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 "model": None, "usage": None, "kvserve_progress_at": time.time()}
        await self._save(owner, batch)
        await self.owners.index_add(owner, "batches", batch["id"])
        runner = BatchLineRunner(self.app, credentials, self.concurrency, deadline=batch["expires_at"])
        self.running[batch["id"]] = runner
        background(self._run(owner, batch, runner))
        return self._public(batch)

    async def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        """The batch object of ``batch_id``.

        Raises:
            OpenAIError: 404 when ``owner`` has no such batch.
        """
        return self._public(await self._load(owner, batch_id))

    async def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        """Ask a running batch to stop: ``cancelling`` now (requests in flight end; the rest
        are not run), ``cancelled`` with the results so far when it stopped.

        Raises:
            OpenAIError: 404 as :meth:`get`; 409 for a batch that already ended.
        """
        batch = await self._load(owner, batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return self._public(batch)
        if batch["status"] not in ACTIVE:
            raise OpenAIError(f"batch {batch_id} is {batch['status']}: it cannot be cancelled", 409,
                              code="batch_not_cancellable")
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        runner = self.running.get(batch_id)
        if runner is not None:
            runner.stop_reason = "batch_cancelled"
        await self._save(owner, batch)  # another ingress replica's runner reads it with its progress
        return self._public(batch)

    async def list(self, owner: str, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """OpenAI's list of ``owner``'s batches, newest first."""
        ids = await self.owners.index(owner, "batches")
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        page = []
        for batch_id in ids:
            if len(page) > max(1, min(limit, 100)):
                break
            try:
                page.append(self._public(await self._load(owner, batch_id)))
            except OpenAIError:  # expired or evicted: it leaves the index
                await self.owners.index_remove(owner, "batches", batch_id)
        more, page = len(page) > max(1, min(limit, 100)), page[:max(1, min(limit, 100))]
        return {"object": "list", "data": page, "has_more": more,
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    # ---- the run --------------------------------------------------------------------------
    async def _run(self, owner: str, batch: dict[str, Any], runner: BatchLineRunner) -> None:
        try:
            await self._execute(owner, batch, runner)
        except Exception as e:  # never a silent death: the batch says it failed
            logger.exception("batch %s failed", batch["id"])
            batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [{
                "object": "error", "code": "server_error", "message": f"the batch failed: {type(e).__name__}",
                "line": None, "param": None}]})
            await self._save(owner, batch)
        finally:
            self.running.pop(batch["id"], None)

    async def _execute(self, owner: str, batch: dict[str, Any], runner: BatchLineRunner) -> None:
        try:
            requests = parse_batch(await self.files.content(owner, batch["input_file_id"]), batch["endpoint"])
        except OpenAIError as e:
            batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": getattr(
                e, "errors", [{"object": "error", "code": e.code, "message": e.message, "line": None, "param": None}])})
            await self._save(owner, batch)
            return
        models = {r["body"].get("model") for r in requests}
        batch.update(status="in_progress", in_progress_at=int(time.time()),
                     model=models.pop() if len(models) == 1 else None)
        batch["request_counts"]["total"] = len(requests)
        if runner.stop_reason is None:  # cancelled while validating: nothing runs
            await self._save(owner, batch)
        lines: list[tuple[dict, bool] | None] = [None] * len(requests)
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        last = [time.monotonic()]

        async def done(i: int, line: dict, ok: bool) -> None:
            lines[i] = (line, ok)
            batch["request_counts"]["completed" if ok else "failed"] += 1
            u = ((line.get("response") or {}).get("body") or {}).get("usage") if ok else None
            if isinstance(u, dict):
                usage["input_tokens"] += int(u.get("prompt_tokens", u.get("input_tokens", 0)) or 0)
                usage["output_tokens"] += int(u.get("completion_tokens", u.get("output_tokens", 0)) or 0)
                usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
            if time.monotonic() - last[0] >= PROGRESS_S:
                last[0] = time.monotonic()
                await self._progress(owner, batch, runner)

        await runner.run(requests, done)
        stopped = runner.stop_reason
        batch.update(status="finalizing", finalizing_at=int(time.time()), usage={
            **usage, "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}})
        if stopped != "batch_cancelled":
            await self._save(owner, batch)
        outputs = [json.dumps(line, ensure_ascii=False) for line, ok in filter(None, lines) if ok]
        errors = [json.dumps(line, ensure_ascii=False) for line, ok in filter(None, lines) if not ok]
        if outputs:
            batch["output_file_id"] = (await self.files.create(
                owner, f"{batch['id']}_output.jsonl", "batch_output", ("\n".join(outputs) + "\n").encode()))["id"]
        if errors:
            batch["error_file_id"] = (await self.files.create(
                owner, f"{batch['id']}_error.jsonl", "batch_output", ("\n".join(errors) + "\n").encode()))["id"]
        now = int(time.time())
        if stopped == "batch_cancelled":
            batch.update(status="cancelled", cancelled_at=now)
        elif stopped == "batch_expired":
            batch.update(status="expired", expired_at=now)
        else:
            batch.update(status="completed", completed_at=now)
        await self._save(owner, batch)

    async def _progress(self, owner: str, batch: dict[str, Any], runner: BatchLineRunner) -> None:
        """Write the counts (the heartbeat), and take a cancel another ingress replica wrote."""
        try:
            stored = await self._load(owner, batch["id"])
        except OpenAIError:
            stored = None
        if stored is not None and stored["status"] == "cancelling" and runner.stop_reason is None:
            runner.stop_reason = "batch_cancelled"
        if runner.stop_reason == "batch_cancelled":
            batch.update(status="cancelling", cancelling_at=batch["cancelling_at"] or int(time.time()))
        await self._save(owner, batch)

    # ---- the store --------------------------------------------------------------------------
    async def _save(self, owner: str, batch: dict[str, Any]) -> None:
        batch["kvserve_progress_at"] = time.time()
        data = json.dumps({"owner": owner, "batch": batch}).encode()
        await self.owners.store_of(owner).put(self.MODEL, "b:" + batch["id"], data, FILE_TTL_S)

    async def _load(self, owner: str, batch_id: str) -> dict[str, Any]:
        data = await self.owners.store_of(owner).get(self.MODEL, "b:" + batch_id)
        record = json.loads(data) if data else None
        if record is None or record.get("owner") != owner:
            raise _not_found(batch_id)
        batch = record["batch"]
        if batch["status"] in ACTIVE and batch_id not in self.running and (
                time.time() - batch.get("kvserve_progress_at", 0) > STALE_S):
            batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [{
                "object": "error", "code": "batch_lost", "message": "the ingress replica running this batch went "
                "away; create it again", "line": None, "param": None}]})
        return batch

    @staticmethod
    def _public(batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in batch.items() if not k.startswith("kvserve_")}
