"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches``, ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``. :class:`Batches` keeps the batch objects and runs them.

A batch runs in one ingress replica at a time, as a task beside live traffic: its requests go
through that replica's own HTTP app (:class:`~kvserve.deployments.gateway.batch_lines.BatchLineRunner`:
the creator's key, its limits, the caches, routing), at the lowest priority as batch work
(``GenerateRequest.batch``): a replica runs it within a bounded share of its slots
(``max_batch_requests``) beside live traffic, the engine preempts it (keeping its tokens) when a
live request needs its slot, and the batch retries what a full share refused. Its input is a
file of the Files API (:class:`~kvserve.deployments.gateway.files.FileStore`), parsed off the
event loop; its results go, in input order and as they come, into an output
file (``2xx`` answers) and an error file (the rest), written in parts
(:class:`~kvserve.deployments.gateway.files.FileWriter`): an answer that no longer fits the output
file's bounds (``max_file_bytes``, the key's bytes) becomes an error line
``batch_output_too_large``, and every answer written before it stays. Status: ``validating`` ->
``in_progress`` -> ``finalizing`` -> ``completed``; ``failed`` (an invalid input file:
``errors`` lists its lines), ``cancelling`` -> ``cancelled`` and ``expired`` (the completion
window ended) keep the results so far. The final status is written with retries: a batch
reads as ``completed`` only once that is stored.

Durable (Redis, ``cache_backend: redis``): the batch object holds its progress (the lines
written, the output and error files' parts so far), rewritten every :data:`PROGRESS_S`; a
lease (``SET NX PX``, renewed every :data:`LEASE_S` / 3) says which ingress replica runs it.
From its first Batch API call on, every ingress replica sweeps the active batches every
:data:`SWEEP_S`: a batch whose lease ran out (its replica was redeployed or died) is claimed by one of
them and goes on from its last progress (lines written once: by input index). The creator's
credentials are never stored: the replica that resumes a batch runs it as the configured API
key whose owner id the batch records (a key removed from the configuration fails its batches).
With the memory backend a batch lives in its replica only: one whose replica went away (no
progress for :data:`STALE_S`) reads as ``failed``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any

from kvserve.deployments.cache.owner_stores import OwnerStores
from kvserve.deployments.cache.settings import CacheSettings
from kvserve.deployments.cache.stores import StoreUnavailable
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.batch_lines import BATCH_ENDPOINTS, BatchLineRunner, parse_batch, result_line
from kvserve.deployments.gateway.file_parts import FILE_TTL_S, FileWriter
from kvserve.deployments.gateway.files import FileStore
from kvserve.deployments.gateway.streams import background

logger = logging.getLogger("ray.serve")

#: Seconds between two writes of a running batch's progress (its heartbeat).
PROGRESS_S = 2.0
#: A memory-backend batch with no progress written for this long has lost its ingress replica.
STALE_S = 60.0
#: Seconds a lease on a running batch lasts unless renewed (renewed every third of it).
LEASE_S = 30.0
#: Seconds between two sweeps for batches whose lease ran out (Redis backend).
SWEEP_S = 10.0
#: Seconds the final status (and the output files) are retried before the batch gives up.
FINAL_RETRY_S = 300.0
#: Longest completion window (OpenAI: ``24h``).
MAX_WINDOW_S = 24 * 3600
#: Batches one key may have active at once by default (``max_active_batches_per_key``).
DEFAULT_MAX_ACTIVE_BATCHES_PER_KEY = 4
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

# KEYS[1]: the lease. ARGV: holder, ms. Renew only our own lease; 1 if it is ours.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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
        raise OpenAIError(
            f"completion_window must be up to 24h (e.g. '24h'), got {window!r}",
            400,
            param="completion_window",
            code="invalid_value",
        )
    return seconds


def _error_list(code: str, message: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "error", "code": code, "message": message, "line": None, "param": None}],
    }


class Batches:
    """The batches of each API key (see the module docstring), kept in the response cache's
    backend beside the files.

    Args:
        settings: the cache backend.
        files: where input, output and error files live.
        concurrency: requests of one batch in flight at once.
        owners: how many API keys share the backend's bytes (see :class:`OwnerStores`).
        max_active: batches one key may have active at once (more: 429).
        keys: the configured API keys (:class:`~kvserve.deployments.limits.KeyPolicy`): a
            resumed batch runs as the one whose ``owner_id`` made it (none: ``anonymous``).
    """

    PREFIX = "kvserve:batches:"
    MODEL = "batch"

    def __init__(
        self,
        settings: CacheSettings,
        files: FileStore,
        concurrency: int,
        *,
        owners: int = 1,
        max_active: int = DEFAULT_MAX_ACTIVE_BATCHES_PER_KEY,
        keys=(),
    ):
        self.owners = OwnerStores(settings, self.PREFIX, owners=owners)
        self.files, self.concurrency, self.max_active = files, concurrency, max_active
        self.redis_backend = settings.backend == "redis"
        self._keys = {p.owner_id: p.key for p in keys}
        self.app = None  # the gateway's HTTP app, bound by build_api
        self.running: dict[str, BatchLineRunner] = {}  # batch id -> its runner, in this replica
        self.holder = f"ingress-{uuid.uuid4().hex}"  # this replica's name on its leases
        self._active_mem: dict[str, str] = {}  # memory backend: batch id -> owner of its active batches
        self._leases_mem: dict[str, tuple[str, float]] = {}  # memory backend: batch id -> (holder, until)
        self._last_sweep = -float("inf")
        self._sweeping = False
        self.sweep_s, self.lease_s = SWEEP_S, LEASE_S

    def credentials_of(self, owner: str) -> dict[str, str] | None:
        """The headers a resumed batch of ``owner`` runs with (its configured key), None when
        that key is no longer configured."""
        if not self._keys:
            return {} if owner == "anonymous" else None
        key = self._keys.get(owner)
        return None if key is None else {"authorization": f"Bearer {key}"}

    async def create(self, owner: str, credentials: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        """A new batch over ``body["input_file_id"]`` (OpenAI's create request), started now.

        Raises:
            OpenAIError: 400 for a bad endpoint, window, metadata or input file purpose; 404
                for an input file ``owner`` does not have; 429 ``too_many_active_batches``
                when ``owner`` has ``max_active`` batches active; 503 when the store fails.
        """
        self.sweep_soon()
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise OpenAIError(
                f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}",
                400,
                param="endpoint",
                code="invalid_value",
            )
        window = window_seconds(body.get("completion_window", "24h"))
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > 16
            or any(not isinstance(v, str) or len(k) > 64 or len(v) > 512 for k, v in metadata.items())
        ):
            raise OpenAIError(
                "metadata: at most 16 string pairs (keys up to 64, values up to 512 characters)",
                400,
                param="metadata",
                code="invalid_value",
            )
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise OpenAIError("input_file_id is required", 400, param="input_file_id", code="invalid_value")
        meta = await self.files.meta(owner, file_id)
        if meta["purpose"] != "batch":
            raise OpenAIError(
                f"file {file_id} has purpose {meta['purpose']!r}, not 'batch'",
                400,
                param="input_file_id",
                code="invalid_value",
            )
        active = await self._active_of(owner)
        if len(active) >= self.max_active:
            raise OpenAIError(
                f"this key has {len(active)} batches active; the limit is {self.max_active} "
                "(max_active_batches_per_key): wait for one to end",
                429,
                "rate_limit_error",
                code="too_many_active_batches",
                retry_after_s=PROGRESS_S,
            )
        now = int(time.time())
        batch = {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": body.get("completion_window", "24h"),
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + window,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
            "model": None,
            "usage": None,
            "kvserve_progress_at": time.time(),
            "kvserve_next": 0,
            "kvserve_out": None,
            "kvserve_err": None,
            "kvserve_usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
        }
        if not await self._claim(batch["id"]):  # a fresh id: only fails when the store does
            raise StoreUnavailable("a batch lease")
        await self._save(owner, batch)
        await self.owners.index_add(owner, "batches", batch["id"])
        await self._activate(owner, batch["id"])
        self._start(owner, batch, credentials)
        return self._public(batch)

    def _start(self, owner: str, batch: dict[str, Any], credentials: dict[str, str]) -> None:
        runner = BatchLineRunner(self.app, credentials, self.concurrency, deadline=batch["expires_at"])
        self.running[batch["id"]] = runner
        background(self._run(owner, batch, runner))

    async def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        """The batch object of ``batch_id``.

        Raises:
            OpenAIError: 404 when ``owner`` has no such batch; 503 when the store fails.
        """
        self.sweep_soon()
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
            raise OpenAIError(
                f"batch {batch_id} is {batch['status']}: it cannot be cancelled", 409, code="batch_not_cancellable"
            )
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        runner = self.running.get(batch_id)
        if runner is not None:
            runner.stop_reason = "batch_cancelled"
        await self._save(owner, batch)  # another ingress replica's runner reads it with its progress
        return self._public(batch)

    async def list(self, owner: str, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """OpenAI's list of ``owner``'s batches, newest first.

        Raises:
            OpenAIError: 503 when the store fails (no batch leaves the index then).
        """
        self.sweep_soon()
        ids = await self.owners.index(owner, "batches")
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = []
        for batch_id in ids:
            if len(page) > max(1, min(limit, 100)):
                break
            try:
                page.append(self._public(await self._load(owner, batch_id)))
            except StoreUnavailable:
                raise
            except OpenAIError:  # expired or evicted (the store answered "none"): it leaves the index
                await self.owners.index_remove(owner, "batches", batch_id)
        more, page = len(page) > max(1, min(limit, 100)), page[: max(1, min(limit, 100))]
        return {
            "object": "list",
            "data": page,
            "has_more": more,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }

    # ---- the run --------------------------------------------------------------------------
    async def _run(self, owner: str, batch: dict[str, Any], runner: BatchLineRunner) -> None:
        renew = asyncio.get_running_loop().create_task(self._keep_lease(batch["id"], runner))
        try:
            await self._execute(owner, batch, runner)
        except Exception as e:  # never a silent death: the batch says it failed
            logger.exception("batch %s failed", batch["id"])
            batch.update(
                status="failed",
                failed_at=int(time.time()),
                errors=_error_list("server_error", f"the batch failed: {type(e).__name__}: {e}"),
            )
            try:
                await self._retrying(lambda: self._finish(owner, batch), f"batch {batch['id']}: the failed status")
            except Exception:  # noqa: BLE001 -- logged; another replica may take it when its lease runs out
                logger.exception("batch %s: its failure could not be stored", batch["id"])
        finally:
            renew.cancel()
            self.running.pop(batch["id"], None)
            if runner.stop_reason != "lease_lost":
                try:
                    await self._release(batch["id"])
                except Exception:  # noqa: BLE001 -- the lease expires by itself
                    pass

    async def _execute(self, owner: str, batch: dict[str, Any], runner: BatchLineRunner) -> None:
        try:
            content = await self.files.content(owner, batch["input_file_id"])
            requests = await asyncio.to_thread(parse_batch, content, batch["endpoint"])  # off the event loop
        except StoreUnavailable:
            raise
        except OpenAIError as e:
            batch.update(
                status="failed",
                failed_at=int(time.time()),
                errors={
                    "object": "list",
                    "data": getattr(
                        e,
                        "errors",
                        [{"object": "error", "code": e.code, "message": e.message, "line": None, "param": None}],
                    ),
                },
            )
            await self._retrying(lambda: self._finish(owner, batch), f"batch {batch['id']}: the failed status")
            return
        models = {r["body"].get("model") for r in requests}
        if batch["status"] == "validating":
            batch.update(
                status="in_progress", in_progress_at=int(time.time()), model=models.pop() if len(models) == 1 else None
            )
        batch["request_counts"]["total"] = len(requests)
        if batch["status"] == "cancelling" and runner.stop_reason is None:
            runner.stop_reason = "batch_cancelled"
        if runner.stop_reason is None:  # cancelled while validating: nothing runs
            await self._save(owner, batch)
        out = _Output(self, owner, batch)
        await out.resume()
        start = batch["kvserve_next"]
        last = [time.monotonic()]

        async def done(i: int, line: dict, ok: bool) -> None:
            if runner.stop_reason == "lease_lost":  # another replica runs (and writes) it now
                return
            await out.add(start + i, line, ok)
            if time.monotonic() - last[0] >= PROGRESS_S:
                last[0] = time.monotonic()
                await self._progress(owner, batch, runner, out)

        await runner.run(requests[start:], done)
        if runner.stop_reason == "lease_lost":  # another replica runs it now: it finishes it
            return
        stopped = runner.stop_reason
        batch.update(status="finalizing", finalizing_at=batch.get("finalizing_at") or int(time.time()))
        if stopped != "batch_cancelled":
            try:
                await self._save(owner, batch)
            except StoreUnavailable:  # the final write below retries
                pass
        now = int(time.time())
        if stopped == "batch_cancelled":
            batch.update(status="cancelled", cancelled_at=now)
        elif stopped == "batch_expired":
            batch.update(status="expired", expired_at=now)
        else:
            batch.update(status="completed", completed_at=now)

        async def final():
            await out.close()
            await self._finish(owner, batch)

        await self._retrying(final, f"batch {batch['id']}: its output files and final status")

    async def _finish(self, owner: str, batch: dict[str, Any]) -> None:
        """Store the ended batch and take it off the active ones (raises on a store failure)."""
        await self._save(owner, batch)
        await self._deactivate(batch["id"])

    @staticmethod
    async def _retrying(fn, what: str) -> None:
        """``await fn()`` until it does not raise :class:`StoreUnavailable` (a pause that
        doubles from 0.25 s to 5 s between tries), for :data:`FINAL_RETRY_S` at most.

        Raises:
            StoreUnavailable: still failing after that.
        """
        deadline, pause, warned = time.monotonic() + FINAL_RETRY_S, 0.25, False
        while True:
            try:
                return await fn()
            except StoreUnavailable as e:
                if time.monotonic() + pause > deadline:
                    raise
                if not warned:
                    warned = True
                    logger.warning("%s: the store failed (%s); retrying", what, e)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)

    async def _progress(self, owner: str, batch: dict[str, Any], runner: BatchLineRunner, out: "_Output") -> None:
        """Write the results so far and the counts (the heartbeat), and take a cancel another
        ingress replica wrote. A store failure skips this heartbeat (the next one retries)."""
        if runner.stop_reason == "lease_lost":
            return
        try:
            stored = await self._load(owner, batch["id"])
        except OpenAIError:
            stored = None
        if stored is not None and stored["status"] == "cancelling" and runner.stop_reason is None:
            runner.stop_reason = "batch_cancelled"
        if runner.stop_reason == "batch_cancelled":
            batch.update(status="cancelling", cancelling_at=batch["cancelling_at"] or int(time.time()))
        try:
            async with out.lock:  # the files' parts, then the object that records them: no write between
                await out.flush()
                await self._save(owner, batch)
        except OpenAIError as e:
            logger.warning("batch %s: progress not written (%s); retried at the next heartbeat", batch["id"], e)

    async def _keep_lease(self, batch_id: str, runner: BatchLineRunner) -> None:
        """Renew this replica's lease on a running batch every third of :data:`LEASE_S`; a
        lease another replica holds now stops the runner (``lease_lost``) without finishing."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                ours = await self._renew(batch_id)
            except Exception as e:  # noqa: BLE001 -- the store blinked: try again at the next renewal
                logger.warning("batch %s: lease not renewed (%s)", batch_id, e)
                continue
            if not ours:
                logger.warning("batch %s: another ingress replica holds its lease now; stopping here", batch_id)
                runner.stop_reason = "lease_lost"
                return

    # ---- leases and the active batches ---------------------------------------------------------
    def _lease_key(self, batch_id: str) -> str:
        return f"{self.PREFIX}lease:{batch_id}"

    async def _claim(self, batch_id: str) -> bool:
        """Take the lease on ``batch_id`` if nobody holds it (True: this replica runs it)."""
        ms = int(self.lease_s * 1000)
        if self.redis_backend:
            try:
                return bool(await self.owners.redis.set(self._lease_key(batch_id), self.holder, nx=True, px=ms))
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("a batch lease", e) from None
        holder, until = self._leases_mem.get(batch_id, ("", 0.0))
        if holder and holder != self.holder and until > time.monotonic():
            return False
        self._leases_mem[batch_id] = (self.holder, time.monotonic() + self.lease_s)
        return True

    async def _renew(self, batch_id: str) -> bool:
        if self.redis_backend:
            return bool(
                await self.owners.redis.eval(
                    _RENEW_LUA, 1, self._lease_key(batch_id), self.holder, int(self.lease_s * 1000)
                )
            )
        holder, _ = self._leases_mem.get(batch_id, ("", 0.0))
        if holder != self.holder:
            return False
        self._leases_mem[batch_id] = (self.holder, time.monotonic() + self.lease_s)
        return True

    async def _release(self, batch_id: str) -> None:
        if self.redis_backend:
            await self.owners.redis.eval(_RELEASE_LUA, 1, self._lease_key(batch_id), self.holder)
        elif self._leases_mem.get(batch_id, ("",))[0] == self.holder:
            del self._leases_mem[batch_id]

    async def _activate(self, owner: str, batch_id: str) -> None:
        if self.redis_backend:
            try:
                await self.owners.redis.hset(self.PREFIX + "active", batch_id, owner)
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("the active batches", e) from None
        else:
            self._active_mem[batch_id] = owner

    async def _deactivate(self, batch_id: str) -> None:
        if self.redis_backend:
            try:
                await self.owners.redis.hdel(self.PREFIX + "active", batch_id)
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("the active batches", e) from None
        else:
            self._active_mem.pop(batch_id, None)

    async def _active(self) -> dict[str, str]:
        """Every active batch: id -> owner."""
        if self.redis_backend:
            try:
                raw = await self.owners.redis.hgetall(self.PREFIX + "active")
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("the active batches", e) from None
            return {
                (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()
            }
        return dict(self._active_mem)

    async def _active_of(self, owner: str) -> list[str]:
        """``owner``'s active batches (ones whose record is gone leave the set)."""
        ids = [b for b, o in (await self._active()).items() if o == owner]
        out = []
        for batch_id in ids:
            try:
                if (await self._load(owner, batch_id))["status"] in ACTIVE:
                    out.append(batch_id)
                    continue
            except StoreUnavailable:
                raise
            except OpenAIError:
                pass
            if batch_id not in self.running:
                await self._deactivate(batch_id)
        return out

    def sweep_soon(self) -> None:
        """Start a sweep (:meth:`sweep`) in the background if none ran for :attr:`sweep_s`."""
        if self._sweeping or time.monotonic() - self._last_sweep < self.sweep_s or self.app is None:
            return
        self._sweeping = True
        self._last_sweep = time.monotonic()

        async def go():
            try:
                await self.sweep()
            except Exception as e:  # noqa: BLE001 -- the next sweep tries again
                logger.warning("batch sweep failed: %s", e)
            finally:
                self._sweeping = False
                if self.redis_backend:  # keep sweeping while this replica lives
                    asyncio.get_running_loop().call_later(self.sweep_s, self.sweep_soon)

        background(go())

    async def sweep(self) -> list[str]:
        """Claim and resume every active batch that no replica holds a lease on (Redis): the
        ids resumed here.

        Raises:
            StoreUnavailable: the store failed (nothing was changed).
        """
        resumed = []
        if not self.redis_backend:
            return resumed
        for batch_id, owner in (await self._active()).items():
            if batch_id in self.running or not await self._claim(batch_id):
                continue
            try:
                batch = await self._load(owner, batch_id)
            except StoreUnavailable:
                await self._release(batch_id)
                raise
            except OpenAIError:  # its record is gone
                await self._deactivate(batch_id)
                await self._release(batch_id)
                continue
            if batch["status"] not in ACTIVE:
                await self._deactivate(batch_id)
                await self._release(batch_id)
                continue
            credentials = self.credentials_of(owner)
            if credentials is None:
                batch.update(
                    status="failed",
                    failed_at=int(time.time()),
                    errors=_error_list(
                        "batch_key_removed", "the API key that created this batch is no longer configured"
                    ),
                )
                await self._finish(owner, batch)
                await self._release(batch_id)
                continue
            logger.info("batch %s: resumed here from line %d", batch_id, batch.get("kvserve_next", 0))
            self._start(owner, batch, credentials)
            resumed.append(batch_id)
        return resumed

    # ---- the store --------------------------------------------------------------------------
    async def _save(self, owner: str, batch: dict[str, Any]) -> None:
        """Write the batch object.

        Raises:
            StoreUnavailable: the store did not take it.
        """
        batch["kvserve_progress_at"] = time.time()
        data = json.dumps({"owner": owner, "batch": batch}).encode()
        if not await self.owners.store_of(owner).put(self.MODEL, "b:" + batch["id"], data, FILE_TTL_S):
            raise StoreUnavailable("a batch's write")

    async def _load(self, owner: str, batch_id: str) -> dict[str, Any]:
        data = await self.owners.store_of(owner).get(self.MODEL, "b:" + batch_id)
        record = json.loads(data) if data else None
        if record is None or record.get("owner") != owner:
            raise _not_found(batch_id)
        batch = record["batch"]
        if (
            not self.redis_backend
            and batch["status"] in ACTIVE
            and batch_id not in self.running
            and (time.time() - batch.get("kvserve_progress_at", 0) > STALE_S)
        ):
            batch.update(
                status="failed",
                failed_at=int(time.time()),
                errors=_error_list("batch_lost", "the ingress replica running this batch went away; create it again"),
            )
        return batch

    @staticmethod
    def _public(batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in batch.items() if not k.startswith("kvserve_")}


class _Output:
    """A running batch's results as they end: written in input order (each line once: the
    lines ended out of order wait here for the ones before them) into its output and error
    files (:class:`FileWriter`), with the counts and usage of what was written. An answer
    that does not fit the output file's bounds becomes an error line."""

    def __init__(self, batches: Batches, owner: str, batch: dict[str, Any]):
        self.batches, self.owner, self.batch = batches, owner, batch
        self.pending: dict[int, tuple[dict, bool]] = {}
        self.writers: dict[str, FileWriter | None] = {"out": None, "err": None}
        self.lock = asyncio.Lock()  # one writer at a time (the batch's requests end concurrently)

    async def resume(self) -> None:
        """Take up the files a previous run of this batch left (its progress)."""
        for kind in ("out", "err"):
            state = self.batch.get(f"kvserve_{kind}")
            if state is not None:
                self.writers[kind] = await FileWriter.resume(self.batches.files, self.owner, state)

    async def _writer(self, kind: str) -> FileWriter:
        w = self.writers[kind]
        if w is None:
            name = f"{self.batch['id']}_{'output' if kind == 'out' else 'error'}.jsonl"
            metas = await self.batches.files._metas(self.owner)
            w = self.writers[kind] = FileWriter(
                self.batches.files, self.owner, name, "batch_output", sum(f["bytes"] for f in metas)
            )
        return w

    async def add(self, i: int, line: dict[str, Any], ok: bool) -> None:
        """Line ``i`` ended; write it and the ones after it that ended already."""
        self.pending[i] = (line, ok)
        async with self.lock:
            while self.batch["kvserve_next"] in self.pending:
                line, ok = self.pending[self.batch["kvserve_next"]]
                await Batches._retrying(lambda: self._write(line, ok), f"batch {self.batch['id']}: a result")
                del self.pending[self.batch["kvserve_next"]]
                self.batch["kvserve_next"] += 1

    async def _write(self, line: dict[str, Any], ok: bool) -> None:
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
        counts, usage = self.batch["request_counts"], self.batch["kvserve_usage"]
        if ok:
            w = await self._writer("out")
            if len(data) <= w.room():
                await w.write(data)
                counts["completed"] += 1
                u = ((line.get("response") or {}).get("body") or {}).get("usage")
                if isinstance(u, dict):
                    usage["input_tokens"] += int(u.get("prompt_tokens", u.get("input_tokens", 0)) or 0)
                    usage["output_tokens"] += int(u.get("completion_tokens", u.get("output_tokens", 0)) or 0)
                    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
                self._sync()
                return
            files = self.batches.files
            line = result_line(
                line["custom_id"],
                None,
                None,
                (line.get("response") or {}).get("request_id"),
                {
                    "code": "batch_output_too_large",
                    "message": f"the answer ({len(data)} bytes) did not fit the output file (max_file_bytes "
                    f"{files.max_file_bytes}; this key's files: {files.max_owner_bytes})",
                },
            )
            data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
        w = await self._writer("err")
        if len(data) <= w.room():
            await w.write(data)  # (raises before counting: a retry counts once)
        else:
            logger.warning(
                "batch %s: the error file is full; the error of %s is not kept", self.batch["id"], line.get("custom_id")
            )
        counts["failed"] += 1
        self._sync()

    def _sync(self) -> None:
        u = self.batch["kvserve_usage"]
        self.batch["usage"] = {
            **u,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        for kind in ("out", "err"):
            w = self.writers[kind]
            self.batch[f"kvserve_{kind}"] = None if w is None else w.state

    async def flush(self) -> None:
        """Write the files' open parts (before the batch object that records them)."""
        for w in self.writers.values():
            if w is not None:
                await w.flush()
        self._sync()

    async def close(self) -> None:
        """List the output and error files (retry-safe: a second call after a failure goes on)."""
        for kind, field in (("out", "output_file_id"), ("err", "error_file_id")):
            w = self.writers[kind]
            if w is not None and w.bytes:
                await w.close()
                self.batch[field] = w.id
        self.batch["usage"] = self.batch.get("usage") or {
            **self.batch["kvserve_usage"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
