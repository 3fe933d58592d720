"""The gateway's model catalog: every name a client may send as ``model`` and what the gateway
knows of it, given at build time and never asked of a replica.

- generating models and embedding models: their :class:`~kvserve.deployments.contract.facts.ModelCard`,
  made by ``build_app`` from the configuration and given to the gateway's constructor;
- LoRA adapters of both kinds: configured ones (a card's ``lora_modules``) and those loaded at
  run time (the application's registry, through :class:`~kvserve.deployments.gateway.adapters.AdapterDirectory`);
- what replicas learn only when they load (``max_model_len`` left to the KV pool, the weights'
  revision): read from the application's :class:`~kvserve.deployments.contract.facts.FactsBoard`
  (Ray's GCS key-value store, where each replica publishes once it has loaded), re-read every
  :data:`REVISION_REFRESH_S` seconds in the background; no call goes through a model's
  bounded handle queue, so a burst cannot refuse it.

The ``GET /v1/models`` cards (vLLM's fields) are made here: :meth:`ModelCatalog.card`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvserve.deployments.contract.adapters import AdapterEntry
from kvserve.deployments.contract.routing_config import AUTO_MODEL
from kvserve.deployments.contract.facts import FactsBoard, LoadedFacts, ModelCard
from kvserve.deployments.gateway.adapters import AdapterDirectory
from kvserve.deployments.gateway.streams import background
from kvserve.deployments.gateway.tool_parsers import get_tool_parser

logger = logging.getLogger("ray.serve")

#: Seconds between re-reads of a model's published facts (the weights' revision keys the
#: response cache): a replica that publishes a new revision stops old cached answers within
#: this time.
REVISION_REFRESH_S = 10.0
#: Seconds before facts no replica had published yet are looked for again.
MISSING_RETRY_S = 1.0


class ModelCatalog:
    """The served names and their cards (see the module docstring).

    Args:
        models: the generating models' cards, the default model first.
        encoders: the embedding models' cards (``task="embed"``).
        board: where replicas publish what they learn at load; None (outside Serve): the cards
            alone (an unset ``max_model_len`` stays unknown, the revision empty).
        lora: the run-time adapters' view (default: this application's registry).

    Raises:
        ValueError: no generating model, a name served twice, a configured adapter named like
            a model, an unknown ``tool_call_parser``.
    """

    def __init__(
        self,
        models: list[ModelCard],
        encoders: list[ModelCard] | None = None,
        board: FactsBoard | None = None,
        lora: AdapterDirectory | None = None,
    ):
        if not models:
            raise ValueError("the gateway needs at least one model")
        self.models = {c.name: c for c in models}
        self.encoders = {c.name: c for c in encoders or []}
        if len(self.models) != len(models) or set(self.models) & set(self.encoders):
            raise ValueError(
                f"served model names must be unique, got {[c.name for c in models]} and embedding "
                f"models {sorted(self.encoders)}"
            )
        self.default_model = models[0].name
        self.adapters = {a: c.name for c in models for a in c.lora_modules}  # configured: {name: base model}
        for a in self.adapters:
            if a in self.models or a in self.encoders or a == AUTO_MODEL:
                raise ValueError(f"adapter {a!r}: the name is a served model's")
        for c in models:
            if c.tool_call_parser != "auto":
                get_tool_parser(c.tool_call_parser)
        self.board = board
        self.lora = lora if lora is not None else AdapterDirectory()
        self.created = int(time.time())
        self._facts: dict[str, tuple[float, LoadedFacts | None]] = {}  # name -> (monotonic read time, facts)

    def known(self) -> list[str]:
        """Every configured name (models and configured adapters), for error messages."""
        return [*self.models, *self.adapters]

    # ---- facts published at load ---------------------------------------------------------
    async def facts(self, name: str) -> LoadedFacts | None:
        """What ``name``'s replicas published when they loaded; None until one has (or without
        a board). Facts of another configuration (an older deployment's) are not taken."""
        if self.board is None:
            return None
        now = time.monotonic()
        read_at, facts = self._facts.get(name, (None, None))
        if read_at is None or (facts is None and now - read_at > MISSING_RETRY_S):
            return await self._read(name)
        if now - read_at > REVISION_REFRESH_S:
            self._facts[name] = (now, facts)
            background(self._read(name))
        return facts

    async def _read(self, name: str) -> LoadedFacts | None:
        old = self._facts.get(name, (None, None))[1]
        try:
            card = self.models.get(name) or self.encoders.get(name)
            facts = await asyncio.to_thread(self.board.get, (card.facts_key if card is not None else "") or name)
        except Exception as e:  # the GCS is briefly away: keep what was read before
            logger.info("model %s: reading its published facts failed (%s)", name, type(e).__name__)
            self._facts[name] = (time.monotonic(), old)
            return old
        card = self.models.get(name) or self.encoders.get(name)
        if facts is not None and card is not None and card.digest and facts.digest != card.digest:
            facts = None  # published by replicas of another configuration
        if old is not None and facts is not None and facts.revision != old.revision:
            logger.info(
                "model %s: weights revision is now %s (older cached answers are not served)", name, facts.revision
            )
        self._facts[name] = (time.monotonic(), facts)
        return facts

    async def max_model_len(self, name: str) -> int | None:
        """``name``'s context length: as its replicas published it, else as configured; None
        while neither knows."""
        facts = await self.facts(name)
        if facts is not None:
            return facts.max_model_len
        card = self.models.get(name) or self.encoders.get(name)
        return card.max_model_len if card is not None else None

    async def max_prompt_bytes(self, name: str) -> int | None:
        """Bytes of prompt text beyond which no prompt fits ``name``'s context, as its replicas
        published it (:meth:`LoadedFacts.max_prompt_bytes`); None while unknown or unbounded."""
        facts = await self.facts(name)
        return None if facts is None else facts.max_prompt_bytes()

    async def cost_per_million_tokens(self, name: str) -> float | None:
        """``name``'s measured cost per million output tokens, as its replicas last published it
        (None: no ``cost_per_replica_hour``, or nothing measured yet)."""
        facts = await self.facts(name)
        return None if facts is None else facts.cost_per_million_output_tokens

    async def dtype(self, name: str) -> str | None:
        """The dtype ``name``'s engine runs: as its replicas published it (what ``auto`` became
        there), else as configured; None for an encoder."""
        card = self.models.get(name)
        if card is None:
            return None
        facts = await self.facts(name)
        return facts.dtype if facts is not None and facts.dtype else card.dtype

    async def quantization(self, name: str) -> str | None:
        """The weights' quantization of ``name``: as its replicas published it (a 4-bit
        checkpoint's own format when none was configured), else as configured."""
        card = self.models.get(name)
        if card is None:
            return None
        facts = await self.facts(name)
        return facts.quantization if facts is not None and facts.quantization else card.quantization

    async def revision(self, name: str) -> str:
        """The weights' revision ``name``'s replicas published ("" while none has): the response
        cache's key."""
        facts = await self.facts(name)
        return facts.revision if facts is not None else ""

    async def tool_call_parser(self, name: str) -> str:
        """The name of the parser of ``name``'s tool calls: the configured one, or for ``auto``
        the one its replicas found in the chat template (``hermes`` until one has published)."""
        parser = self.models[name].tool_call_parser
        if parser != "auto":
            return parser
        facts = await self.facts(name)
        return facts.tool_call_parser if facts is not None and facts.tool_call_parser else "hermes"

    def reasoning_parser(self, name: str) -> str | None:
        """The reasoning parser of model ``name`` (None: its output is all content)."""
        return self.models[name].reasoning_parser

    # ---- adapters ------------------------------------------------------------------------
    async def adapter_base(self, name: str | None) -> tuple[str | None, AdapterEntry | None]:
        """``(base model, registry entry)`` of LoRA adapter ``name``: a configured adapter's
        base and None, a run-time adapter's base and its entry, ``(None, None)`` for a name that
        is no adapter (a model's, or unknown)."""
        if name is None or name in self.models:
            return None, None
        if name in self.adapters:
            return self.adapters[name], None
        entry = await self.lora.lookup(name)
        return (entry.base, entry) if entry is not None and entry.base in self.models else (None, None)

    # ---- cards ---------------------------------------------------------------------------
    async def card(self, name: str) -> dict:
        """OpenAI's ``Model`` for a served model or encoder, plus vLLM's ``max_model_len`` and
        ``root`` (the served name: paths of the server stay private), the ``dtype`` the engine
        runs (:meth:`dtype`: what ``auto`` became once a replica loaded; None for an encoder),
        the KV cache's dtype (``kv_cache_dtype``: ``auto`` or ``fp8``), the weights' ``quantization`` (None,
        ``int8``, ``fp8``, or a 4-bit checkpoint's ``awq``, ``gptq``, ``compressed-tensors``: as the
        replicas published it, else as configured) and ``speculative_config`` (None, or its ``method`` and
        ``num_speculative_tokens``), ``tensor_parallel_size`` and ``pipeline_parallel_size``."""
        c = self.models.get(name) or self.encoders[name]
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvserve",
            "root": name,
            "max_model_len": await self.max_model_len(name),
            "dtype": await self.dtype(name),
            "kv_cache_dtype": c.kv_cache_dtype,
            "quantization": await self.quantization(name),
            "speculative_config": c.speculative_config,
            "tensor_parallel_size": c.tensor_parallel_size,
            "pipeline_parallel_size": c.pipeline_parallel_size,
        }
