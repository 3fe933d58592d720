"""The deployment handles a gateway replica calls: each generating model's (``LLMServer``), streaming
and not, each embedding model's (``EmbeddingServer``), and a model's handle bound to a run-time
LoRA adapter (Serve's model multiplexing: the call goes to a replica that holds the adapter)."""
from __future__ import annotations

from ray.serve.handle import DeploymentHandle

from deployments.contract.adapters import AdapterEntry

#: Multiplexed handles kept (one per adapter load and streaming mode); past it the cache starts over.
MAX_MULTIPLEXED = 1024


class ModelHandles:
    """The handles of one gateway replica.

    Args:
        models: served model name -> ``LLMServer`` handle (the first is the default model).
        encoders: embedding model name -> ``EmbeddingServer`` handle.
    """

    def __init__(self, models: dict[str, DeploymentHandle], encoders: dict[str, DeploymentHandle] | None = None):
        self.models = dict(models)
        self.encoders = dict(encoders or {})
        self.streaming = {name: h.options(stream=True) for name, h in self.models.items()}
        self._multiplexed: dict[tuple[str, bool], DeploymentHandle] = {}  # (multiplexed id, streaming) -> handle

    def all(self) -> dict[str, DeploymentHandle]:
        """Every deployment's handle by served name: the generating models', then the encoders'."""
        return {**self.models, **self.encoders}

    def of(self, model: str, stream: bool, adapter: AdapterEntry | None = None) -> DeploymentHandle:
        """The handle of served model ``model`` (``stream``: its streaming handle), bound to the
        run-time ``adapter``'s load when one is given; an encoder's for an embedding model."""
        if model in self.encoders:
            return self.encoders[model]
        handle = self.streaming[model] if stream else self.models[model]
        if adapter is None:
            return handle
        key = (adapter.multiplexed_id, stream)
        if key not in self._multiplexed:
            if len(self._multiplexed) >= MAX_MULTIPLEXED:
                self._multiplexed.clear()
            self._multiplexed[key] = handle.options(multiplexed_model_id=adapter.multiplexed_id)
        return self._multiplexed[key]
