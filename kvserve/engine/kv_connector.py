"""The seam for a KV tier outside the engine (vLLM's KV connector idea, our code, reduced to what
kvserve's tiers need).

The engine knows two tiers of its own: the KV pool and the host tier below it
(``kvserve/engine/kv_offload.py``). A tier that lives elsewhere (the serving layer's cluster tier in Ray's
object store, ``kvserve/deployments/replica/kv_cluster.py``) plugs in through the async front:

* **loads**: the front shows every new request, once tokenized, to :meth:`KVConnector.before_add`
  before queueing it; the connector may fetch blocks of the request's prefix that the engine
  lacks and put them into the host tier (``AsyncLLMEngine.import_kv_blocks``), from where the
  scheduler loads them as any host-tier block. The connector bounds its own wait: a request
  never waits on a load longer than computing the blocks would take.
* **saves**: the connector reads the engine's KV events (which blocks the pool now holds) and
  copies the ones it wants out with ``AsyncLLMEngine.export_kv_blocks``.

The engine imports nothing of a connector; it runs without one, and without Ray.
"""

from __future__ import annotations

from kvserve.engine.request import Request


class KVConnector:
    """What the async front calls (``AsyncLLMEngine.kv_connector``)."""

    async def before_add(self, request: Request) -> None:
        """Called once per new generation request (``request.prompt_token_ids`` tokenized,
        ``request.lora_request`` set), before it is queued. Must not raise, and must bound its
        wait (the request waits on it)."""
