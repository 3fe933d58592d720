"""The cluster tier: KV blocks in Ray's object store, so that one replica loads a prefix another
replica computed, on the same node or another (Ray moves the object; it spills it to disk when
its memory is short). Our code on the idea of LMCache's shared store and vLLM's KV connectors;
the engine's seam is ``kvserve/engine/kv_connector.py``.

One :class:`ClusterKVConnector` per ``LLMServer`` replica (``--kv-cluster-tier-size``):

* **Saves (write-through).** The replica's KV events (taken by its publisher,
  ``kv_publisher.py``, and shown here) name the blocks its pool just cached. Every
  ``interval_s`` the connector copies the new ones out of the engine
  (``export_kv_blocks``: each rank's bytes, between two steps), puts each in the object store
  (``ray.put``: this replica owns the object) and registers it with the application's hub
  (``cluster_put``), which keeps the directory within the budget (LRU) and tells routers
  (events of medium ``cluster``). Blocks the cluster holds already are not put again.
* **Loads.** Before a new request is queued (:meth:`before_add`), the connector walks its
  prompt's chained block hashes: the leading run this replica's pool and host tier hold (from
  the same events) needs nothing; if blocks are missing past it, the hub says which of them the
  cluster holds (one Ray call, only for such requests), the connector fetches them and puts them
  into the engine's host tier (``import_kv_blocks``), and the scheduler loads them as any
  host-tier block: bit-identical bytes, so outputs equal recomputing.
* **Verify.** Each block travels with the SHA-256 of its bytes, taken when it was exported; an
  importer checks it (and that the block's recorded tokens are the request's) before loading:
  a block that fails is not loaded but recomputed, dropped from the directory, and counted
  (``kv_cluster_load_fallbacks{reason="digest_mismatch"}``). Blocks move only within one KV
  layout (``kv_cluster_directory.kv_layout``: model, weights revision, quantization, A/B
  variant, dtypes, block size, parallel layout), and a block's hash names its adapter and
  version and its ``cache_salt``.
* **Fall back to recompute.** The fetch and import are bounded by the time computing those
  blocks would take (this replica's measured prefill seconds per token, :attr:`s_per_token`);
  past it, or when an object is lost (its owner died: ``OwnerDiedError``, ``ObjectLostError``),
  the request goes on without them and computes them; lost blocks are dropped from the
  directory. Nothing here raises into the request.

Needs the host tier (``kv_offloading_size``), prefix caching and KV events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from kvserve.deployments.contract.kv_event_hub import get_hub
from kvserve.deployments.contract.kv_index import KVBlockIndex, request_hashes
from kvserve.deployments.replica.background import BackgroundLoop
from kvserve.engine.kv_connector import KVConnector
from kvserve.engine.kv_events import MEDIUM_POOL, BlockStored
from kvserve.engine.kv_cache_manager import request_root
from kvserve.engine.kv_offload import KVBlockCopy, block_digest

logger = logging.getLogger("ray.serve")

#: Seconds between two rounds of saves.
SAVE_INTERVAL_S = 0.05
#: Prefill seconds per token assumed until the replica has measured one (a step that computed at
#: least :data:`MIN_PREFILL_TOKENS` prompt tokens).
DEFAULT_S_PER_TOKEN = 0.002
#: Prompt tokens a step must compute for its time to count in :attr:`ClusterKVConnector.s_per_token`.
MIN_PREFILL_TOKENS = 64
#: Weight of the newest step in the running mean of seconds per prefill token.
EMA_WEIGHT = 0.2
#: Most block hashes a replica remembers as being in the cluster (not put again).
EXPORTED_SIZE = 65536
#: Most blocks waiting to be saved (older ones are skipped when saves fall behind).
MAX_PENDING_SAVES = 4096
#: Deepest prefix looked up, tokens (as the KV-aware router's).
MAX_PREFIX_TOKENS = 4096
_SELF = "self"


class ClusterKVConnector(KVConnector, BackgroundLoop):
    """One replica's side of the cluster tier (see the module docstring); :meth:`start` and
    :meth:`stop` run the saves.

    Args:
        engine: the replica's async front (``export_kv_blocks``, ``import_kv_blocks``,
            ``add_stat_logger``).
        replica_id: this replica's Serve id (owner of the objects it puts).
        app: the Serve application (its hub).
        layout: the KV layout (``kv_cluster_directory.kv_layout``).
        budget_bytes: the cluster tier's size, bytes (shared by the application's replicas).
        block_size: tokens per KV block.
        max_import_blocks: most blocks one request imports (the host tier's slots).
        metrics: where the counters also go (``kvserve.telemetry.engine_metrics.ClusterTierMetrics``), or None.
        hub: a hub (tests); default: the application's, looked up or created.
        hash_root: the root of the engine's block-hash chains (``KVCacheManager.root``: the
            application's seed), to name a request's blocks as the engine does.
    """

    task_name = "kvserve-kv-cluster-save"

    def __init__(
        self,
        engine,
        replica_id: str,
        app: str,
        layout: str,
        budget_bytes: int,
        block_size: int,
        max_import_blocks: int,
        metrics=None,
        hub=None,
        interval_s: float = SAVE_INTERVAL_S,
        hash_root: int = 0,
    ):
        self.engine, self.replica_id, self.app, self.layout = engine, replica_id, app, layout
        self.budget_bytes, self.block_size, self.max_import_blocks = budget_bytes, block_size, max_import_blocks
        self.hub, self.interval_s, self.metrics = hub, interval_s, metrics
        self.hash_root = hash_root
        self.local = KVBlockIndex()  # what this replica's pool and host tier hold (its own events)
        self._to_save: OrderedDict[int, None] = OrderedDict()
        self._exported: OrderedDict[int, None] = OrderedDict()  # hashes known to be in the cluster
        self._hub_id: str | None = None
        self._failing = False
        #: measured prefill seconds per token (running mean): the bound on a load's wait
        self.s_per_token = DEFAULT_S_PER_TOKEN
        self._measured = False
        #: counters: blocks put / fetched and imported; bytes put / fetched; seconds requests
        #: waited on loads; loads given up (timeout, lost objects)
        self.num_saved_blocks = self.num_loaded_blocks = 0
        self.saved_bytes = self.loaded_bytes = 0
        self.load_seconds = 0.0
        self.num_timeouts = self.num_lost = 0
        #: fetched blocks whose bytes did not match their digest (or whose tokens not the
        #: request's): not loaded, dropped from the tier, recomputed
        self.num_digest_mismatches = 0
        engine.add_stat_logger(self._on_step)

    # ---- what the replica tells it ------------------------------------------------------
    def _on_step(self, m) -> None:
        """A step's :class:`~kvserve.engine.stats.IterationStats`: update the seconds per prefill token."""
        tokens = m.num_prefill_tokens + m.num_decode_tokens
        if m.num_prefill_tokens >= MIN_PREFILL_TOKENS and m.end > m.start:
            s = (m.end - m.start) / tokens
            self.s_per_token = s if not self._measured else (1 - EMA_WEIGHT) * self.s_per_token + EMA_WEIGHT * s
            self._measured = True

    def on_batches(self, batches: list) -> None:
        """The engine's KV event batches, as the publisher took them (in order)."""
        for batch in batches:
            self.local.apply(_SELF, batch)
            for e in batch.events:
                if isinstance(e, BlockStored) and e.medium == MEDIUM_POOL:
                    for h in e.block_hashes:
                        if h not in self._exported:
                            self._to_save[h] = None
        while len(self._to_save) > MAX_PENDING_SAVES:
            self._to_save.popitem(last=False)

    def on_snapshot(self, snapshot) -> None:
        """A snapshot of the pool and host tier (the publisher resynced): start the local view over."""
        self.local.replace(_SELF, snapshot)

    # ---- saves --------------------------------------------------------------------------
    async def _hub(self):
        if self.hub is None:
            self.hub = await asyncio.to_thread(get_hub, self.app)
        return self.hub

    async def save_once(self) -> int:
        """Put the blocks cached since the last round into the cluster tier. Returns how many
        the hub added."""
        import ray

        if not self._to_save:
            return 0
        hashes = list(self._to_save)
        self._to_save.clear()
        copies = await self.engine.export_kv_blocks(hashes)  # those still in the pool
        if not copies:
            return 0

        def put():  # the digest travels with the block: importers check the bytes they fetch
            return [(c.block_hash, c.meta, c.nbytes, [ray.put(c.shards)], block_digest(c.shards)) for c in copies]

        blocks = await asyncio.to_thread(put)
        hub = await self._hub()
        hub_id, added = await hub.cluster_put.remote(self.replica_id, self.layout, self.budget_bytes, blocks)
        if hub_id != self._hub_id:  # a new hub: what the old one held is gone
            self._exported.clear()
            self._hub_id = hub_id
        for h, *_ in blocks:
            self._exported[h] = None
            self._exported.move_to_end(h)
        while len(self._exported) > EXPORTED_SIZE:
            self._exported.popitem(last=False)
        self.num_saved_blocks += len(added)
        new = set(added)
        nbytes = sum(b[2] for b in blocks if b[0] in new)
        self.saved_bytes += nbytes
        if self.metrics is not None and nbytes:
            self.metrics.saved(nbytes)
        return len(added)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.save_once()
                if self._failing:
                    logger.info("KV cluster tier of replica %s: saving again", self.replica_id)
                    self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.hub = None
                if not self._failing:
                    logger.warning(
                        "KV cluster tier of replica %s: saving failed (%s: %s); retrying",
                        self.replica_id,
                        type(e).__name__,
                        e,
                    )
                    self._failing = True

    # ---- loads --------------------------------------------------------------------------
    async def before_add(self, request) -> None:
        """Load the blocks of ``request``'s prefix that the cluster holds and this replica does
        not, within the time computing them would take (module docstring). Never raises."""
        hashes = request_hashes(
            request.prompt_token_ids,
            self.block_size,
            MAX_PREFIX_TOKENS // self.block_size,
            request_root(self.hash_root, request.lora_request),
            request.cache_salt,
        )
        pool, host, _ = self.local.match(hashes, [_SELF])[_SELF]
        missing = hashes[pool + host :][: self.max_import_blocks]
        if not missing:
            return
        budget_s = len(missing) * self.block_size * self.s_per_token
        t0 = time.perf_counter()
        found, nbytes, fallback = 0, 0, None
        tokens = request.prompt_token_ids[(pool + host) * self.block_size :]
        try:
            found, nbytes = await asyncio.wait_for(self._load(missing, tokens), budget_s)
        except TimeoutError:
            self.num_timeouts += 1
            fallback = "timeout"
        except Exception as e:  # a lost object, the hub gone: compute instead
            fallback = "error"
            if _lost_object(e):  # (_load dropped the lost blocks from the directory)
                self.num_lost += 1
                fallback = "lost"
            else:
                self.hub = None
                logger.warning(
                    "KV cluster tier of replica %s: a load failed (%s: %s); computing instead",
                    self.replica_id,
                    type(e).__name__,
                    e,
                )
        waited = time.perf_counter() - t0
        self.load_seconds += waited
        self.num_loaded_blocks += found
        self.loaded_bytes += nbytes
        if self.metrics is not None:
            if fallback is not None:
                self.metrics.fallback(fallback, waited)
            elif found:
                self.metrics.loaded(found * self.block_size, nbytes, waited)

    async def _load(self, missing: list[int], tokens: list[int]) -> tuple[int, int]:
        """Fetch the leading run of ``missing`` the cluster holds, check it (:meth:`_verified`)
        and import the leading run that passes; the blocks imported and the bytes fetched.
        ``tokens``: the request's prompt tokens from the first missing block on."""
        hub = await self._hub()
        found = await hub.cluster_lookup.remote(self.layout, missing)
        if not found:
            return 0, 0
        try:
            shards = await asyncio.gather(*(f[2][0] for f in found))
        except Exception as e:
            if _lost_object(e):  # their owner is gone: no replica will load them
                await self._drop_lost([f[0] for f in found])
            raise
        copies = [KVBlockCopy(f[0], f[1], list(s), f[3] if len(f) > 3 else None) for f, s in zip(found, shards)]
        fetched = sum(c.nbytes for c in copies)
        good = await asyncio.to_thread(self._verified, copies, tokens)
        if good < len(copies):  # corrupted or foreign bytes: recompute from there, and nobody loads them again
            self.num_digest_mismatches += len(copies) - good
            if self.metrics is not None:
                self.metrics.fallback("digest_mismatch", 0.0)
            logger.warning(
                "KV cluster tier of replica %s: %d fetched block(s) failed their digest check; computing them instead",
                self.replica_id,
                len(copies) - good,
            )
            await self._drop_lost([c.block_hash for c in copies[good : good + 1]])
            copies = copies[:good]
        if not copies:
            return 0, fetched
        return await self.engine.import_kv_blocks(copies), fetched

    def _verified(self, copies: list[KVBlockCopy], tokens: list[int]) -> int:
        """How many of ``copies`` (consecutive blocks of the request) may be loaded: the leading
        run whose bytes match the digest they were exported with (``KVBlockCopy.verified``) and
        whose recorded tokens are the request's own (``meta``'s token ids)."""
        bs = self.block_size
        for i, c in enumerate(copies):
            if not c.verified() or list(c.meta[1]) != list(tokens[i * bs : (i + 1) * bs]):
                return i
        return len(copies)

    async def _drop_lost(self, hashes: list[int]) -> None:
        try:
            hub = await self._hub()
            await hub.cluster_drop.remote(self.layout, hashes)
        except Exception:  # the hub is gone too: a new one starts empty
            self.hub = None

    def stats(self) -> dict[str, float]:
        """The replica's cluster-tier counters (``kv_cluster_*``)."""
        return {
            "kv_cluster_saved_blocks": self.num_saved_blocks,
            "kv_cluster_loaded_blocks": self.num_loaded_blocks,
            "kv_cluster_hit_tokens": self.num_loaded_blocks * self.block_size,
            "kv_cluster_saved_bytes": self.saved_bytes,
            "kv_cluster_loaded_bytes": self.loaded_bytes,
            "kv_cluster_load_seconds": self.load_seconds,
            "kv_cluster_load_timeouts": self.num_timeouts,
            "kv_cluster_lost_loads": self.num_lost,
            "kv_cluster_digest_mismatches": self.num_digest_mismatches,
            "kv_cluster_s_per_token": self.s_per_token,
        }


def _lost_object(e: BaseException) -> bool:
    """Whether ``e`` says an object of the tier is gone (its owner died, or it was evicted)."""
    try:
        from ray.exceptions import ObjectLostError, OwnerDiedError, ReferenceCountingAssertionError
    except ImportError:  # pragma: no cover (Ray is there on the serving side)
        return False
    return isinstance(e, (ObjectLostError, OwnerDiedError, ReferenceCountingAssertionError))
