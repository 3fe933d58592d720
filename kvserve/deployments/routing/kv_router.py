"""KV-aware replica routing for ``LLMServer``: a Ray Serve ``RequestRouter`` that routes on what
each replica's KV cache holds, as its own events say (``kvserve/engine/kv_events.py``), instead of on
what this router remembers sending.

Where the knowledge comes from: replicas publish their KV event batches and load to the
application's hub (``kvserve/deployments/replica/kv_publisher.py``, ``kvserve/deployments/contract/kv_event_hub.py``);
this router pulls the hub's changes every ``pull_interval_s`` in the background into a local
:class:`~kvserve.deployments.contract.kv_index.KVBlockIndex`, so a routing decision is a local lookup.

The score (llm-d's precise prefix-cache scorer plus its load scorer, folded into one cost in
tokens; our code): for each candidate replica ``r``, with ``n`` blocks of ``block_size``
tokens in the request's hashed prefix, ``pool_r`` of them in ``r``'s KV pool and ``host_r`` more
in its host tier,

    cost_r = block_size * (n - pool_r - host_r - far_r)  prompt tokens r must compute
           + host_cost * block_size * host_r              loading from the host tier
           + cluster_cost * block_size * far_r            loading from the cluster tier (``far_r``
                                                          more blocks any replica of the model can
                                                          load: ``kvserve/deployments/replica/kv_cluster.py``)
           + waiting_tokens_r + running_request_tokens * running_r    r's published load
           + sent_r                                       what this router sent r since (the
                                                          tokens to compute, and running_request_tokens
                                                          per request)

and the request goes to the cheapest replica (ties: the less loaded, then at random). A long
cached prefix wins until the replica holding it is busier than recomputing elsewhere costs.
A prefix this router sent to a replica in the last :data:`PENDING_S` s counts as in that
replica's pool (its events show the blocks only once they are computed: a second request of a
new prefix follows the first instead of computing it again elsewhere).
Replicas with more than ``imbalance_margin`` ongoing requests above the least loaded one (Serve's
queue lengths, as the prefix router reads them) are left out first: admission bounds are in
requests, and a router that wins by refusing more does not win.
Everything else is :class:`~kvserve.deployments.routing.prefix_router.PrefixAwareRouter`'s: the
tokenizer and hashing, the LoRA multiplexing, the channels, the fallback to the prefix router
when the index is cold (no candidate replica has published) or the hub cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict

import ray
from ray.serve.request_router import PendingRequest, RunningReplica

from kvserve.deployments.contract.adapters import serve_app_name
from kvserve.deployments.contract.kv_cluster_directory import cluster_holder
from kvserve.deployments.contract.kv_event_hub import PullReply, get_hub
from kvserve.deployments.contract.kv_index import KVBlockIndex
from kvserve.deployments.routing.prefix_router import ROUTED_METHODS, PrefixAwareRouter, request_parts, request_salt

logger = logging.getLogger("ray.serve")

#: Seconds between two pulls from the hub.
PULL_INTERVAL_S = 0.05
#: Tokens of load each running request of a replica counts for (its decode steps slow a prefill).
RUNNING_REQUEST_TOKENS = 16
#: Cost of a block loaded from the host tier, as a fraction of recomputing it.
HOST_COST = 0.2
#: Cost of a block loaded from the cluster tier (fetched from Ray's object store, then loaded as
#: a host-tier block), as a fraction of recomputing it.
CLUSTER_COST = 0.3
#: Seconds a prefix this router just sent to a replica counts as held there (the replica's
#: events say so only once it has computed the blocks; until then a second request of the same
#: prefix should follow the first, not compute it again elsewhere).
PENDING_S = 10.0
#: Most pending block hashes remembered.
PENDING_SIZE = 16384
#: Deepest prefix this router hashes, tokens: a multi-turn conversation's cached context goes
#: far past a system prompt, and the index (unlike the prefix router's reports) costs nothing per
#: hashed block (tokenizing the longer text is cached by leading power-of-two characters).
KV_MAX_PREFIX_TOKENS = 4096
#: Seconds a router's first routing decision waits for its first pull from the hub (a new
#: router, e.g. a driver's handle, would otherwise route its first requests on a cold index).
FIRST_PULL_WAIT_S = 2.0


def replica_costs(
    match: dict[str, tuple[int, int, int]],
    num_blocks: int,
    block_size: int,
    load: dict[str, float],
    host_cost: float = HOST_COST,
    cluster_cost: float = CLUSTER_COST,
) -> dict[str, float]:
    """``cost_r`` of the module docstring for each replica of ``match`` (replica -> (pool
    blocks, host blocks, cluster blocks)), given each one's load in tokens (``load``)."""
    return {
        r: block_size * (num_blocks - pool - host - far)
        + host_cost * block_size * host
        + cluster_cost * block_size * far
        + load.get(r, 0.0)
        for r, (pool, host, far) in match.items()
    }


class KVAwareRouter(PrefixAwareRouter):
    """Serve ``RequestRouter`` for ``LLMServer`` on KV cache events (see the module docstring).

    ``request_router_kwargs`` (:meth:`initialize_state`): those of :class:`PrefixAwareRouter`
    (``max_prefix_tokens`` defaults to :data:`KV_MAX_PREFIX_TOKENS` here), plus ``app_name``
    (the Serve application whose hub to read; default: this replica's
    application), ``pull_interval_s``, ``running_request_tokens``, ``host_cost``, ``cluster_cost``.
    """

    def initialize_state(
        self,
        app_name: str | None = None,
        pull_interval_s: float = PULL_INTERVAL_S,
        running_request_tokens: float = RUNNING_REQUEST_TOKENS,
        host_cost: float = HOST_COST,
        cluster_cost: float = CLUSTER_COST,
        **prefix_kwargs,
    ) -> None:
        prefix_kwargs.setdefault("max_prefix_tokens", KV_MAX_PREFIX_TOKENS)
        super().initialize_state(**prefix_kwargs)
        # the application of the deployment this router routes to (also in a driver's handle)
        self.kv_app = app_name or getattr(getattr(self, "_deployment_id", None), "app_name", None) or serve_app_name()
        self.pull_interval_s, self.running_request_tokens, self.host_cost, self.cluster_cost = (
            pull_interval_s,
            running_request_tokens,
            host_cost,
            cluster_cost,
        )
        self.kv_index = KVBlockIndex()
        self.loads: dict = {}  # replica id -> ReplicaLoad (the hub's)
        self._hub = None
        self._hub_id: str | None = None
        self._cursor = 0
        self._puller: asyncio.Task | None = None
        self._first_pull: asyncio.Event | None = None
        self._sent: dict[str, list[tuple[float, float]]] = {}  # replica -> [(time.time(), tokens)] since its publish
        # prefixes this router sent in the last PENDING_S s: hash -> time.monotonic(), hash -> replica
        self._pending_at: OrderedDict[int, float] = OrderedDict()
        self._pending_to: dict[int, str] = {}
        self.num_kv_routed = 0  # decisions made on the index (not by the prefix router)

    # ---- the hub ------------------------------------------------------------------------
    def _ensure_puller(self) -> None:
        """Start pulling from the hub (in a process connected to Ray: never starts one)."""
        if self.kv_app and (self._puller is None or self._puller.done()) and ray.is_initialized():
            self._first_pull = asyncio.Event()
            self._puller = asyncio.get_running_loop().create_task(self._pull_loop(), name="kvserve-kv-router-pull")

    async def _pull_loop(self) -> None:
        failing = False
        while True:
            try:
                if self._hub is None:
                    self._hub = await asyncio.to_thread(get_hub, self.kv_app, False)
                if self._hub is not None:
                    self.apply(await self._hub.pull.remote(self._hub_id, self._cursor))
                    failing = False
                self._first_pull.set()
            except Exception as e:
                self._first_pull.set()
                self._hub = None
                if not failing:
                    logger.warning(
                        "KV-aware router: reading the KV event hub failed (%s: %s); routing on what it "
                        "had, then by prefix",
                        type(e).__name__,
                        e,
                    )
                    failing = True
            await asyncio.sleep(self.pull_interval_s)

    def apply(self, reply: PullReply) -> None:
        """Bring the local index up to date with one pull's reply."""
        if reply.dump is not None:
            self.kv_index = KVBlockIndex.load(reply.dump)
        else:
            for replica, kind, payload in reply.changes or ():
                if kind == "batch":
                    self.kv_index.apply(replica, payload)
                elif kind == "replace":
                    self.kv_index.replace(replica, payload)
                else:
                    self.kv_index.drop(replica)
        self._hub_id, self._cursor, self.loads = reply.hub_id, reply.cursor, reply.loads

    def load_tokens(self, replica: str) -> float:
        """``replica``'s load in tokens: what it published, plus what this router sent it since."""
        load = self.loads.get(replica)
        since = load.ts if load is not None else 0.0
        sent = self._sent.get(replica)
        if sent:
            sent[:] = [(t, n) for t, n in sent if t > since]
        own = sum(n for _, n in sent or ())
        if load is None:
            return own
        return load.waiting_tokens + self.running_request_tokens * load.running_requests + own

    # ---- routing ------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The cheapest replica by the KV index (module docstring), then two random others;
        :class:`PrefixAwareRouter`'s choice for the rest (channels, other methods, adapters
        loaded at run time, a cold index)."""
        self._ensure_puller()
        if self._first_pull is not None and not self._first_pull.is_set():
            try:
                await asyncio.wait_for(self._first_pull.wait(), FIRST_PULL_WAIT_S)
            except TimeoutError:
                pass
        pr = pending_request
        ids = [r.replica_id.unique_id for r in candidate_replicas]
        if (
            pr is None
            or len(candidate_replicas) < 2
            or pr.metadata.multiplexed_model_id
            or pr.metadata.call_method not in ROUTED_METHODS
            or not any(r in self.loads for r in ids)
        ):
            return await super().choose_replicas(candidate_replicas, pending_request)
        hashes = await self._kv_hashes(pr)
        if not hashes:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pr.routing_context.should_backoff = True
        task = asyncio.current_task()
        if task is not None:
            self._choosing_for[task] = pr
        # replicas more than imbalance_margin ongoing requests above the least loaded are not
        # candidates (Serve's queue lengths, as the prefix router reads them): a replica's admission
        # bounds are in requests, and a router that wins by refusing more does not win
        queue = await self._queue_lens(candidate_replicas)
        known = [q for q in queue.values() if q is not None]
        low = min(known, default=0)
        ids = [r for r in ids if queue.get(r) is not None and queue[r] - low <= self.imbalance_margin] or ids
        cluster = {r: cluster_holder(self.loads[r].layout) for r in ids if r in self.loads and self.loads[r].layout}
        match = self.kv_index.match(hashes, ids, self._pending_blocks(), cluster)
        load = {r: self.load_tokens(r) for r in ids}
        cost = replica_costs(match, len(hashes), self.block_size, load, self.host_cost, self.cluster_cost)
        best = min(ids, key=lambda r: (cost[r], load[r], random.random()))
        self._reserved[pr.future] = (best, time.monotonic())  # counted in the queue lengths until accepted
        pool, host, far = match[best]
        # what the request adds to best's load until its next publish: the tokens it computes,
        # and one more running request
        self._sent.setdefault(best, []).append(
            (time.time(), self.block_size * (len(hashes) - pool - host - far) + self.running_request_tokens)
        )
        now = time.monotonic()
        for h in hashes:
            self._pending_at[h] = now
            self._pending_at.move_to_end(h)
            self._pending_to[h] = best
        while len(self._pending_at) > PENDING_SIZE:
            self._pending_to.pop(self._pending_at.popitem(last=False)[0], None)
        self.num_kv_routed += 1
        first = [r for r in candidate_replicas if r.replica_id.unique_id == best]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != best]
        return [first, random.sample(rest, min(2, len(rest)))]

    def _pending_blocks(self) -> dict[int, str]:
        """hash -> replica of the prefixes this router sent in the last :data:`PENDING_S` s."""
        cutoff = time.monotonic() - PENDING_S
        while self._pending_at and next(iter(self._pending_at.values())) < cutoff:
            self._pending_to.pop(self._pending_at.popitem(last=False)[0], None)
        return self._pending_to

    async def _kv_hashes(self, pr: PendingRequest) -> list[int]:
        """The request's chained block hashes as the engine names its blocks (from the root the
        replicas report: a LoRA adapter's chain starts at its own, with its version; the
        request's ``cache_salt`` in the first block); ``[]`` before a replica reported its roots."""
        prompt, messages, tools, adapter = request_parts(pr)
        text = messages is not None or isinstance(prompt, (str, dict))
        root = (self._hash_roots or {}).get(adapter or "")
        if root is None or (text and not await self._tokenizer_ready()):
            return []
        return self.hasher.of_request(prompt, messages, tools, root, request_salt(pr))
