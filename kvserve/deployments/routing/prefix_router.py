"""Prefix-aware replica routing for ``LLMServer``: a Ray Serve ``RequestRouter`` that runs on the
caller side (in the gateway's deployment handles, and in any driver handle).

Each request goes to the replica that most recently served the longest prefix of its prompt,
unless that replica is busier than the least-loaded one by more than a margin; then, and for
prompts no replica has seen, Serve's power of two choices on queue length decides
(Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001).

What is hashed, and where
-------------------------
A prefix is identified exactly as the engine's prefix cache identifies it: the chained block
hashes of :func:`kvserve.deployments.contract.prefix.block_hashes` (vLLM's automatic prefix caching's
``hash_block`` over the prompt's token ids), up to ``max_prefix_tokens``.

* Replica side (:mod:`kvserve.deployments.contract.prefix`): each replica reports the hashes of the
  prompts it served recently, its model folder and a tokenizer probe; Serve's controller
  broadcasts the reports to every router.
* Router side (:class:`PrefixAwareRouter`): a request's prompt is tokenized with the model's
  own tokenizer (loaded once per router, off the event loop, from the folder the replicas
  report or the ``tokenizer`` kwarg), chat messages rendered with the model's chat template as
  the engine renders them, and hashed the same way
  (:class:`~kvserve.deployments.routing.prefix_hasher.PrefixHasher`). A tokenizer probe
  (:data:`~kvserve.deployments.contract.prefix.PROBE_TEXT`, :data:`~kvserve.deployments.contract.prefix.PROBE_MESSAGES`)
  checks that router and engine get the same ids; if not, text prompts fall back to power of
  two choices (a warning says so). Token-id prompts need no tokenizer. The router also keeps
  its own recent history (hash -> replica it routed to), which covers the seconds before the
  replicas' next report.

Scoring: :mod:`kvserve.deployments.routing.prefix_scoring`. Cost per request: see :mod:`kvserve.deployments.routing.prefix_hasher` (tokenization is bounded and its
hashes cached, so a prompt whose leading text was seen before costs a lookup).

Compared with Ray's ``PrefixCacheAffinityRouter`` (``ray.serve.llm``): that router keeps a
character-level prefix tree of prompt text in one detached actor, queried with a blocking
``ray.get`` per routing decision and per routed request, and reads ``.prompt`` /
``.messages`` attributes of Ray LLM's request objects (ours: :func:`request_parts`). This router keeps its state local, learns from the replicas themselves, and
hashes what the engine caches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import Any

from ray.serve.request_router import MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from kvserve.deployments.contract.prefix import MAX_PREFIX_TOKENS, for_adapter
from kvserve.deployments.contract.types import GenerateRequest
from kvserve.deployments.routing.prefix_hasher import PrefixHasher
from kvserve.deployments.routing.prefix_scoring import least_cached, longest_match, match_depths, preferred_replicas

logger = logging.getLogger("ray.serve")

#: ``LLMServer`` methods whose requests carry a prompt to route by: ``stream`` (the gateway's,
#: a :class:`~kvserve.deployments.contract.types.GenerateRequest`), ``generate`` and ``complete``
#: (Python-handle callers: the prompt, then keyword arguments).
ROUTED_METHODS = ("stream", "generate", "complete")


def request_parts(pr: PendingRequest) -> tuple[Any, list[dict] | None, list[dict] | None, str | None]:
    """``(prompt, messages, tools, LoRA adapter name)`` of a pending ``LLMServer`` call."""
    args, kwargs = pr.args or (), pr.kwargs or {}
    first = args[0] if args else kwargs.get("request", kwargs.get("prompt"))
    if isinstance(first, GenerateRequest):
        return first.prompt, first.messages, first.tools, first.lora_name
    return first, kwargs.get("messages"), kwargs.get("tools"), kwargs.get("lora_name")


def request_salt(pr: PendingRequest) -> str | None:
    """The ``cache_salt`` of a pending ``LLMServer`` call (the gateway's per-key salt, or the
    one of a Python-handle call's dict prompt): part of the engine's first block hash."""
    args, kwargs = pr.args or (), pr.kwargs or {}
    first = args[0] if args else kwargs.get("request", kwargs.get("prompt"))
    if isinstance(first, GenerateRequest):
        return first.cache_salt
    if isinstance(first, dict) and isinstance(first.get("cache_salt"), str):
        return first["cache_salt"]
    return None


#: Seconds a routing decision waits for the router's tokenizer to finish loading (the first
#: text request of a router only); past it, the request is routed without affinity.
TOKENIZER_WAIT_S = 10.0
#: Seconds an affinity choice counts as one more ongoing request on its replica, unless the
#: replica's acceptance (Serve's queue-length cache then counts the request) comes first.
RESERVATION_S = 2.0
#: Seconds a new prefix this router placed on a replica counts in that replica's footprint
#: (until its report, every ``request_routing_stats_period_s``, includes it).
PLACED_S = 3.0


class PrefixAwareRouter(MultiplexMixin, RequestRouter):
    """Serve ``RequestRouter`` for ``LLMServer`` (see the module docstring).

    ``request_router_kwargs`` (:meth:`initialize_state`): ``block_size`` (the engine's),
    ``imbalance_margin`` (ongoing requests), ``min_gain_tokens``, ``max_prefix_tokens``,
    ``tokenizer`` (a model folder; default: the one the replicas report), ``history_size``.
    Requests of other methods (``server_info``, ``get_stats``, ...) and requests without a
    match are routed by power of two choices. Not FIFO: each routing decision serves the
    request it was made for (Serve's ``FIFOMixin`` would hand the chosen replica to the oldest
    pending request instead).

    Per-request state is keyed by the request's future, not by its ``internal_request_id``:
    Serve 2.60 gives every handle call made while a replica serves one request that request's
    id, so the ingress's concurrent calls for one HTTP request (several prompts, ``n`` > 1)
    share it. For the same reason :meth:`_fulfill_next_pending_request` hands the replica to the
    request this routing task chose it for; Serve's base router matches by that id, finds one
    of the calls and leaves the others pending forever.
    """

    def initialize_state(
        self,
        block_size: int = 16,
        imbalance_margin: int = 8,
        min_gain_tokens: int = 64,
        max_prefix_tokens: int = MAX_PREFIX_TOKENS,
        tokenizer: str | None = None,
        history_size: int = 16384,
    ) -> None:
        """Raises:
        ValueError: a size below 1 or a negative margin / gain.
        """
        if min(block_size, max_prefix_tokens, history_size) < 1 or min(imbalance_margin, min_gain_tokens) < 0:
            raise ValueError(
                "prefix router: block_size, max_prefix_tokens and history_size must be >= 1, "
                "imbalance_margin and min_gain_tokens >= 0"
            )
        self.block_size, self.imbalance_margin = block_size, imbalance_margin
        self.min_gain_blocks = -(-min_gain_tokens // block_size)
        self.max_prefix_tokens, self.history_size = max_prefix_tokens, history_size
        self.hasher = PrefixHasher(None, block_size, max_prefix_tokens)
        self._history: OrderedDict[int, str] = OrderedDict()  # hash -> replica id this router last sent it to
        self._reported: dict[int, tuple[str, ...]] = {}  # hash -> replica ids that report it
        self._replica_probe: list | None = None
        #: the replicas' hash roots (``prefix_hash_roots``: "" -> the base model's, adapter name
        #: -> its chain's root), None until one reports: nothing is hashed before
        self._hash_roots: dict[str, int] | None = None
        self._probe_ok: bool | None = None  # this router's tokenizer probe equals the replicas'
        self._tokenizer: concurrent.futures.Future | None = None
        # keyed by the pending request's future (see the class docstring)
        self._routed: OrderedDict[asyncio.Future, list[int]] = OrderedDict()  # request -> hashes
        # request -> (replica id, time.monotonic()) of affinity choices not yet accepted
        self._reserved: OrderedDict[asyncio.Future, tuple[str, float]] = OrderedDict()
        # routing task -> the request it is choosing a replica for
        self._choosing_for: weakref.WeakKeyDictionary[asyncio.Task, PendingRequest] = weakref.WeakKeyDictionary()
        self._reported_sizes: dict[str, int] = {}  # replica id -> prefix hashes it reports
        self._placed: deque[tuple[float, str, int]] = deque()  # (time, replica id, blocks) of new prefixes
        if tokenizer and os.path.isdir(tokenizer):
            self._load_tokenizer(tokenizer)

    # ---- state from the replicas --------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        index: dict[int, list[str]] = {}
        self._reported_sizes = {}
        for r in replicas:
            stats = r.routing_stats or {}
            self._reported_sizes[r.replica_id.unique_id] = len(stats.get("prefix_hashes", ()))
            for h in stats.get("prefix_hashes", ()):
                index.setdefault(h, []).append(r.replica_id.unique_id)
            if stats.get("tokenizer_probe") is not None:
                self._replica_probe = stats["tokenizer_probe"]
            if stats.get("prefix_hash_roots"):
                self._hash_roots = dict(stats["prefix_hash_roots"])
            path = stats.get("model_path")
            if self._tokenizer is None and path and os.path.isdir(path):
                self._load_tokenizer(path)
        self._reported = {h: tuple(v) for h, v in index.items()}

    def _load_tokenizer(self, path: str) -> None:
        """Load the tokenizer of model folder ``path`` in a thread (transformers' tokenizers
        backend, without torch; ``AutoTokenizer`` for a folder without ``tokenizer.json``)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._tokenizer = fut

        def load():
            try:
                try:
                    from transformers import PreTrainedTokenizerFast

                    tok = PreTrainedTokenizerFast.from_pretrained(path)
                except Exception:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(path)
                fut.set_result(tok)
            except BaseException as e:
                logger.warning(
                    "prefix router: cannot load the tokenizer of %s (%s); text prompts are routed "
                    "without prefix affinity",
                    path,
                    e,
                )
                fut.set_exception(e)

        threading.Thread(target=load, name="kvserve-router-tokenizer", daemon=True).start()

    async def _tokenizer_ready(self) -> bool:
        """Whether text can be hashed: the tokenizer loaded (waiting up to
        :data:`TOKENIZER_WAIT_S`) and its probe matches the replicas' (checked once)."""
        fut = self._tokenizer
        if fut is None:
            return False
        if self.hasher.tokenizer is None:
            try:
                tok = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), TOKENIZER_WAIT_S)
            except Exception:  # failed (warned) or still loading
                return False
            if self.hasher.tokenizer is None:
                self.hasher = PrefixHasher(tok, self.block_size, self.max_prefix_tokens)
        if self._probe_ok is None and self._replica_probe is not None:
            self._probe_ok = list(self.hasher.probe()) == list(self._replica_probe)
            if not self._probe_ok:
                logger.warning(
                    "prefix router: this router's tokenizer gives other token ids than the replicas' "
                    "engine; text prompts are routed without prefix affinity"
                )
        return self._probe_ok is not False

    # ---- routing ------------------------------------------------------------------------
    async def _hashes(self, pr: PendingRequest) -> list[int]:
        rid = pr.future
        if rid in self._routed:
            return self._routed[rid]
        if pr.metadata.call_method not in ROUTED_METHODS:
            return []
        prompt, messages, tools, adapter = request_parts(pr)
        text = messages is not None or isinstance(prompt, str) or isinstance(prompt, dict)
        root = (self._hash_roots or {}).get("")
        if root is None or (text and not await self._tokenizer_ready()):
            return []
        hashes = for_adapter(self.hasher.of_request(prompt, messages, tools, root, request_salt(pr)), adapter)
        self._routed[rid] = hashes
        while len(self._routed) > 4096:  # requests cancelled before they were routed
            self._routed.popitem(last=False)
        return hashes

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Ongoing requests per replica as this router sees them: Serve's queue-length cache
        (probing the replicas missing from it; None: no answer within the probe deadline) plus
        this router's affinity choices of the last :data:`RESERVATION_S` s that no replica has
        confirmed yet (Serve decides a burst of requests before it sends any of them, so
        without these a burst would see the same counts and pile onto one replica)."""
        now = time.monotonic()
        while self._reserved and next(iter(self._reserved.values()))[1] < now - RESERVATION_S:
            self._reserved.popitem(last=False)
        out: dict[str, int | None] = {}
        missing = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                out[r.replica_id.unique_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                out[r.replica_id.unique_id] = q
        for rid, _ in self._reserved.values():
            if out.get(rid) is not None:
                out[rid] += 1
        return out

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas for one request (Serve sends it to the first replica, in rank
        order, that accepts it): one chosen replica, then two random others.

        With this router's queue view (:meth:`_queue_lens`), the chosen replica is the least
        loaded of the preferred ones (:func:`preferred_replicas`); over the margin, the less
        loaded of two random replicas (power of two choices); for a prompt no replica has
        served, the one of two random replicas with the smaller cache footprint
        (:func:`least_cached`). Requests without a prompt to hash (other methods, text before
        the tokenizer loaded): two random replicas, Serve's own power of two choices.
        """
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            # a LoRA adapter loaded at run time: the replicas holding it, then those holding the
            # fewest, then all (Serve's multiplexing order, over its matching timeout)
            held = self.apply_multiplex_routing(pending_request)
            candidate_replicas = [r for r in candidate_replicas if r.replica_id in held]
        if not candidate_replicas:
            return []
        if pending_request is not None and pending_request.metadata.call_method == "channel":
            # a gateway's channel to one replica (kvserve/deployments/replica/channels.py): that replica; if it
            # is gone (or stopping), any other (the gateway sees where it landed and does not reopen it),
            # so a channel call never waits for a replica that will not come back
            args = pending_request.args or ()
            target = args[1] if len(args) > 1 else (pending_request.kwargs or {}).get("replica_id")
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target] or candidate_replicas]
        if pending_request is not None:  # Serve sleeps (backs off) between rounds of rejections, not a tight loop
            pending_request.routing_context.should_backoff = True
            task = asyncio.current_task()
            if task is not None:
                self._choosing_for[task] = pending_request
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if pending_request is None or len(candidate_replicas) < 2:
            return [two]
        rid = pending_request.future
        self._reserved.pop(rid, None)  # a retry after a rejection: choose afresh
        hashes = await self._hashes(pending_request)
        if not hashes:
            return [two]
        ids = [r.replica_id.unique_id for r in candidate_replicas]
        depths = match_depths(hashes, ids, self._reported, self._history)
        queue = await self._queue_lens(candidate_replicas)

        def load(r: str) -> int:
            return queue[r] if queue.get(r) is not None else 1 << 30

        two_ids = [r.replica_id.unique_id for r in two]
        pref = preferred_replicas(depths, queue, margin=self.imbalance_margin, min_gain_blocks=self.min_gain_blocks)
        if pref:
            best = min(pref, key=load)
        elif longest_match(depths, self.min_gain_blocks):  # over the margin
            best = min(two_ids, key=load)
        else:  # a new prefix
            best = least_cached(two_ids, queue, self._footprint(), margin=self.imbalance_margin)
            self._placed.append((time.monotonic(), best, len(hashes)))
        self._reserved[rid] = (best, time.monotonic())
        first = [r for r in candidate_replicas if r.replica_id.unique_id == best]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != best]
        return [first, random.sample(rest, min(2, len(rest)))]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Give ``replica`` to the request this routing task chose it for (Serve calls this
        from the task that ran :meth:`choose_replicas`); Serve's own matching when there is none."""
        task = asyncio.current_task()
        pr = self._choosing_for.pop(task, None) if task is not None else None
        if pr is None or pr.future.done():
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        self._record_queue_wait_time(pr)
        pr.future.set_result(replica)
        if self._pending_requests_by_id.get(pr.metadata.internal_request_id) is pr:
            self._remove_pending_request_from_indices(pr)

    def _footprint(self) -> dict[str, int]:
        """Prefix blocks per replica: what it reports, plus the new prefixes this router placed
        on it in the last :data:`PLACED_S` s (not in a report yet)."""
        now = time.monotonic()
        while self._placed and self._placed[0][0] < now - PLACED_S:
            self._placed.popleft()
        out = dict(self._reported_sizes)
        for _, r, n in self._placed:
            out[r] = out.get(r, 0) + n
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """A replica accepted the request (Serve's queue-length cache now counts it): release
        its reservation and remember where its prefix went (this router's own history)."""
        rid = pending_request.future
        self._reserved.pop(rid, None)
        hashes = self._routed.pop(rid, None)
        if not hashes:
            return
        for h in hashes:
            self._history[h] = replica_id.unique_id
            self._history.move_to_end(h)
        while len(self._history) > self.history_size:
            self._history.popitem(last=False)


_SERIALIZE_LOCK = threading.Lock()


def _serialize_router_cls_under_a_lock() -> None:
    """Make Serve 2.60's ``RequestRouterConfig`` construction thread-safe in this process.

    Each construction (``.options(request_router_config=...)``, and every config update a
    handle's long-poll thread decodes) runs ``cloudpickle.register_pickle_by_value(module)``,
    ``dumps``, ``unregister_pickle_by_value(module)`` on the router's module: two threads doing
    it at once make the second ``unregister`` raise ``ValueError("<module ...> is not registered
    for pickle by value")``, which fails that ``serve.run`` (seen in CI: a redeploy from a
    thread while the driver's handle decoded an update). One lock around it (idempotent).
    """
    from ray.serve.config import RequestRouterConfig

    orig = RequestRouterConfig._serialize_request_router_cls
    if getattr(orig, "_kvserve_locked", False):
        return

    def locked(self) -> None:
        with _SERIALIZE_LOCK:
            orig(self)

    locked._kvserve_locked = True
    RequestRouterConfig._serialize_request_router_cls = locked


_serialize_router_cls_under_a_lock()


def router_config(
    block_size: int,
    imbalance_margin: int,
    tokenizer: str | None = None,
    stats_period_s: float = 1.0,
    kv_events: bool = False,
) -> dict[str, Any]:
    """The ``request_router_config`` of an ``LLMServer`` deployment routed by
    :class:`PrefixAwareRouter` (replicas report their prefixes every ``stats_period_s`` s), or,
    with ``kv_events``, by :class:`~kvserve.deployments.routing.kv_router.KVAwareRouter` on the KV
    events of the deployment's application."""
    kwargs: dict[str, Any] = {"block_size": block_size, "imbalance_margin": imbalance_margin}
    if tokenizer:
        kwargs["tokenizer"] = tokenizer
    cls = "kvserve.deployments.routing.prefix_router:PrefixAwareRouter"
    if kv_events:
        cls = "kvserve.deployments.routing.kv_router:KVAwareRouter"
    return {
        "request_router_class": cls,
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": stats_period_s,
    }
