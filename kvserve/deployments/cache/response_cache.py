"""The response caches of one ingress replica: :class:`ResponseCache` looks a request up in the
exact level, then the semantic level, and stores fresh answers; :class:`Lookup` is one
request's dealings with it.

**Per owner**: every key and semantic scope includes the owner of the request (the API key's
owner id, ``anonymous`` without keys), so one key's requests are answered only from its own
answers (``cache_shared_across_keys`` shares them: :class:`~kvserve.deployments.cache.settings.CacheSettings`).

**Exact** (level ``exact``, on by default): the request's key (:mod:`kvserve.deployments.cache.keys`)
names an entry (:mod:`kvserve.deployments.cache.entries`) in the backend
(:mod:`kvserve.deployments.cache.stores`: in-process or a shared Redis).

**Semantic** (level ``semantic``, off by default; :mod:`kvserve.deployments.cache.semantic`): the last
user message (or the single text prompt) is embedded with all-MiniLM-L6-v2 in a worker thread;
the request's scope is the hash of its payload with that text left out
(:func:`~kvserve.deployments.cache.keys.semantic_parts`), so system prompt, earlier turns, tools and
sampling fields must be equal. A hit (cosine similarity >= the threshold, default
:data:`~kvserve.deployments.cache.settings.DEFAULT_SEMANTIC_THRESHOLD`, and the same numbers) answers
with the exact-cache entry of the similar request. The vectors are per ingress replica; the
answers they point to are in the exact backend (so a ``DELETE /v1/cache`` on a shared Redis
reaches every replica's semantic level too: its vectors then point at nothing and are dropped).

The default threshold was chosen on the hand-written paraphrase and near-miss pairs (same
template, different answer) of ``benchmarks/cache.py`` (``benchmarks/results/cache.json``): a
lower one keeps more paraphrases but comes close to letting near misses through, and some near
misses (a direction swap, "Celsius to Fahrenheit" / "Fahrenheit to Celsius") no threshold
separates. A wrong answer costs more than a miss, and the semantic level is opt-in for that reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.deployments.cache.entries import complete, decode_entry_warmed, encode_entry
from kvserve.deployments.cache.keys import ANONYMOUS_OWNER, SHARED_OWNER, deterministic, exact_key, semantic_parts
from kvserve.deployments.cache.semantic import EMBEDDING_DIM, SemanticIndex, numbers_of
from kvserve.deployments.cache.settings import CacheSettings, RequestOptions
from kvserve.deployments.cache.stores import MemoryStore, RedisStore
from kvserve.deployments.contract.encoder import SentenceEncoder
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest
from kvserve.deployments.contract.types import GenerationChunk
from kvserve.telemetry.metrics import cache_hits, cache_lookup_seconds, cache_misses, cache_warmed_entries

logger = logging.getLogger("ray.serve")

#: The response header that says how the answer was found.
CACHE_HEADER = "x-kvserve-cache"


def _ingress_embedder():
    """The ingress's encoder: one torch thread and one BLAS thread for this process (the
    ingress does no other math, and more BLAS threads made the vector search's tail far worse on
    a busy box: see :mod:`kvserve.deployments.cache.semantic`)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
    return SentenceEncoder(num_threads=1)


@dataclass
class Lookup:
    """One request's dealings with the cache.

    Attributes:
        status: the :data:`CACHE_HEADER` value: ``exact``, ``semantic``, ``miss`` or ``bypass``.
        model: the served model name.
        streams: the cached answer (each prompt's chunks) on a hit.
        key: the exact key (None: not cacheable).
        store: store the fresh answer when it completes.
        semantic: ``(scope, vector, numbers)`` to add to the semantic index with the answer.
        warm: the request is cache warming's (its answer is stored as warmed; its lookup is not
            counted in the hit and miss metrics).
        warmed: on a hit, the entry was stored by cache warming.
    """

    status: str
    model: str = ""
    streams: list[list[GenerationChunk]] | None = None
    key: str | None = None
    store: bool = False
    semantic: tuple[str, Any, tuple[str, ...]] | None = None
    warm: bool = False
    warmed: bool = False

    @property
    def hit(self) -> bool:
        return self.streams is not None

    @property
    def headers(self) -> dict[str, str]:
        return {CACHE_HEADER: self.status} if self.status else {}


#: The lookup of a deployment whose cache is off: no header, nothing stored.
NO_CACHE = Lookup(status="")


class ResponseCache:
    """The exact and semantic levels of one ingress replica (see the module docstring).

    Args:
        settings: the deployment's :class:`CacheSettings`.
        embedder_factory: builds the :class:`~kvserve.deployments.contract.encoder.SentenceEncoder` (tests pass one
            in); default: all-MiniLM-L6-v2 on one torch thread. Built in a worker thread as
            soon as the semantic level is on; requests that want it wait for it.
        clock: monotonic seconds.
        metrics: record ``kvserve:response_cache_*`` (:mod:`kvserve.telemetry.metrics`).

    Raises:
        ValueError: bad settings (see :class:`CacheSettings`).
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        embedder_factory: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: bool = True,
    ):
        self.settings = settings
        if settings.backend == "redis":
            self.store_backend: MemoryStore | RedisStore = RedisStore(
                settings.redis_url, settings.max_entries, settings.max_bytes, clock=clock
            )
        else:
            self.store_backend = MemoryStore(settings.max_entries, settings.max_bytes, clock=clock)
        self.counts = {
            "exact": {"hits": 0, "misses": 0},
            "semantic": {"hits": 0, "misses": 0},
            "stores": 0,
            "warmed": {"exact": 0, "semantic": 0},
        }
        self._tasks: set[asyncio.Task] = set()
        self._metrics = None
        if metrics:
            self._metrics = (cache_hits(), cache_misses(), cache_lookup_seconds())
        self.index = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._embedder: concurrent.futures.Future | None = None
        if settings.semantic != "off":
            self.index = SemanticIndex(EMBEDDING_DIM, settings.semantic_max_entries, clock=clock)
            # one thread: embeddings and index searches run off the event loop, one at a time
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-embed")
            self._embedder = self._pool.submit(embedder_factory or _ingress_embedder)
            self._embedder.add_done_callback(self._embedder_loaded)

    @staticmethod
    def _embedder_loaded(f: concurrent.futures.Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            logger.error(
                "response cache: the semantic level is off, its embedding model failed to load: %s", f.exception()
            )

    def wants_semantic(self, opts: RequestOptions) -> bool:
        mode = self.settings.semantic
        return mode != "off" and (opts.semantic is True or (mode == "on" and opts.semantic is None))

    def _warmed(self, level: str, model: str) -> None:
        self.counts["warmed"][level] += 1
        if self._metrics is not None:
            try:
                cache_warmed_entries().inc({"level": level, "model_name": model})
            except Exception:  # metrics never fail a request
                pass

    def _observe(self, level: str, model: str, hit: bool, seconds: float, variant: str = "") -> None:
        self.counts[level]["hits" if hit else "misses"] += 1
        if self._metrics is not None:
            labels = {"level": level, "model_name": model, "variant": variant}
            try:
                (self._metrics[0] if hit else self._metrics[1]).inc(labels)
                self._metrics[2].observe(labels, seconds)
            except Exception:  # metrics never fail a request
                pass

    async def lookup(
        self,
        model: str,
        revision: str,
        endpoint: str,
        body: ChatCompletionRequest | CompletionRequest,
        opts: RequestOptions,
        *,
        owner: str = ANONYMOUS_OWNER,
        semantic_threshold: float | None = None,
        variant: str = "",
        warm: bool = False,
    ) -> Lookup:
        """Look the request up (``endpoint``: ``chat`` or ``completion``). Never raises: any
        failure of the cache is a miss (logged). ``owner``: the owner id of the request's API
        key (:func:`kvserve.deployments.gateway.gate.owner_id`): only its own answers are found,
        and a fresh answer is stored as its own, unless the deployment shares answers across
        keys (:attr:`CacheSettings.shared_across_keys`). ``semantic_threshold``: this request's
        similarity a semantic hit needs (an A/B test variant's; None: the configured one);
        ``variant``: the request's A/B test variant (its metrics' label); ``warm``: a cache
        warming request (see :class:`Lookup`)."""
        if not (opts.read or opts.write) or not deterministic(body):
            return Lookup("bypass", model)
        try:
            owner = SHARED_OWNER if self.settings.shared_across_keys else owner
            look = await self._lookup(model, revision, endpoint, body, opts, owner, semantic_threshold, variant, warm)
            look.warm = warm
            return look
        except Exception as e:  # noqa: BLE001 -- the cache must never fail a request
            logger.warning("response cache lookup failed (%s: %s); answering without it", type(e).__name__, e)
            return Lookup("bypass", model)

    async def _lookup(
        self, model, revision, endpoint, body, opts, owner, threshold=None, variant="", warm=False
    ) -> Lookup:
        key = exact_key(model, revision, endpoint, body, owner)
        look = Lookup("miss" if opts.read else "bypass", model, key=key, store=opts.write)
        if opts.read:
            t0 = time.perf_counter()
            data = await self.store_backend.get(model, key)
            streams, warmed = self._decode(data)
            if not warm:
                self._observe("exact", model, streams is not None, time.perf_counter() - t0, variant)
            if streams is not None:
                look.status, look.streams, look.store, look.warmed = "exact", streams, False, warmed
                return look
        parts = semantic_parts(model, revision, endpoint, body, owner) if self.wants_semantic(opts) else None
        if parts is None or not await self._embedder_ready():
            return look

        scope, text = parts
        numbers = numbers_of(text)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        vec, match = await loop.run_in_executor(
            self._pool, self._embed_and_search, scope, text, numbers, opts.read, threshold
        )
        look.semantic = (scope, vec, numbers)
        if opts.read:
            streams, warmed = None, False
            if match is not None:
                streams, warmed = self._decode(await self.store_backend.get(model, match))
                if streams is None:  # its answer expired or was evicted
                    self.index.discard(scope, match)
            if not warm:
                self._observe("semantic", model, streams is not None, time.perf_counter() - t0, variant)
            if streams is not None:
                look.status, look.streams, look.store, look.warmed = "semantic", streams, False, warmed
        return look

    def _embed_and_search(
        self, scope: str, text: str, numbers: tuple[str, ...], search: bool, threshold: float | None = None
    ):
        vec = self._embedder.result().embed([text])[0]
        threshold = self.settings.semantic_threshold if threshold is None else threshold
        match = self.index.search(scope, vec, threshold, numbers) if search else None
        return vec, (match[0] if match else None)

    async def _embedder_ready(self) -> bool:
        if self._embedder is None:
            return False
        try:
            await asyncio.wrap_future(self._embedder)
            return True
        except Exception:  # logged once by _embedder_loaded
            return False

    @staticmethod
    def _decode(data: bytes | None) -> tuple[list[list[GenerationChunk]] | None, bool]:
        """``(the entry's streams, stored by warming)``; ``(None, False)`` for none or a corrupt one."""
        if data is None:
            return None, False
        try:
            return decode_entry_warmed(data)
        except Exception as e:  # noqa: BLE001 -- a corrupt entry is a miss
            logger.warning("response cache: undecodable entry ignored (%s)", e)
            return None, False

    def store_soon(self, look: Lookup, streams: list[list[GenerationChunk]], n: int) -> None:
        """Store a fresh answer (each prompt's chunks, ``n`` choices each) in a task of its own
        if the lookup allows it and the answer is complete (:func:`complete`)."""
        if not look.store or look.key is None or not complete(streams, n):
            return
        task = asyncio.ensure_future(self._store(look, streams))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def store(self, look: Lookup, streams: list[list[GenerationChunk]], n: int) -> None:
        """:meth:`store_soon`, awaited: the gateway stores an answer before the response ends, so
        the client's next identical request finds it whatever the backend (a Redis write that
        would still be on its way otherwise). Never raises (a failure is logged); the write is
        shielded from the request's cancellation."""
        if not look.store or look.key is None or not complete(streams, n):
            return
        task = asyncio.ensure_future(self._store(look, streams))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def _store(self, look: Lookup, streams: list[list[GenerationChunk]]) -> None:
        look.store = False  # one answer, one write
        try:
            ok = await self.store_backend.put(
                look.model, look.key, encode_entry(streams, look.warm), self.settings.ttl_s
            )
            if ok:
                self.counts["stores"] += 1
                if look.warm:
                    self._warmed("exact", look.model)
            if ok and look.semantic is not None and self.index is not None:
                scope, vec, numbers = look.semantic
                self.index.add(scope, look.model, look.key, vec, self.settings.ttl_s, numbers)
                if look.warm:
                    self._warmed("semantic", look.model)
        except Exception as e:  # noqa: BLE001
            logger.warning("response cache: storing an answer failed (%s: %s)", type(e).__name__, e)

    async def clear(self, model: str | None = None) -> dict[str, int]:
        """Delete every entry (``model`` None) or one served model's: ``{"exact": n,
        "semantic": m}`` entries deleted (exact: the live ones)."""
        exact = await self.store_backend.clear(model)
        semantic = self.index.clear(model) if self.index is not None else 0
        return {"exact": exact, "semantic": semantic}

    async def stats(self) -> dict[str, Any]:
        """Counters since this replica started and the current sizes."""
        entries, nbytes = await self.store_backend.size()
        return {
            "backend": self.store_backend.name,
            "ttl_s": self.settings.ttl_s,
            "exact": {
                **self.counts["exact"],
                "entries": entries,
                "bytes": nbytes,
                "max_entries": self.settings.max_entries,
                "max_bytes": self.settings.max_bytes,
            },
            "semantic": {
                **self.counts["semantic"],
                "mode": self.settings.semantic,
                "threshold": self.settings.semantic_threshold,
                "entries": len(self.index) if self.index is not None else 0,
            },
            "stores": self.counts["stores"],
            "warmed": dict(self.counts["warmed"]),
        }

    async def close(self) -> None:
        await self.store_backend.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
