"""The deployment handles a gateway replica calls: each generating model's (``LLMServer``), streaming
and not, each embedding model's (``EmbeddingServer``), and a model's handle bound to a run-time
LoRA adapter (Serve's model multiplexing: the call goes to a replica that holds the adapter)."""

from __future__ import annotations

from ray.serve.handle import DeploymentHandle

from kvserve.deployments.contract.adapters import AdapterEntry

#: Multiplexed handles kept (one per adapter load and streaming mode); past it the cache starts over.
MAX_MULTIPLEXED = 1024


class ModelHandles:
    """The handles of one gateway replica.

    Args:
        models: served model name -> ``LLMServer`` handle (the first is the default model).
        encoders: embedding model name -> ``EmbeddingServer`` handle.
        variants: served model name -> {variant name -> its ``LLMServer`` handle}, for a model
            split by an A/B test; each variant's handle is there under ``model@variant``, the
            call's ``target``.
    """

    def __init__(
        self,
        models: dict[str, DeploymentHandle],
        encoders: dict[str, DeploymentHandle] | None = None,
        variants: dict[str, dict[str, DeploymentHandle]] | None = None,
    ):
        self.models = dict(models)
        self.encoders = dict(encoders or {})
        #: deployment key (a model's name, or model@variant) -> handle
        self.targets = dict(self.models)
        for model, by_variant in (variants or {}).items():
            if model not in self.models:
                raise ValueError(f"variants of {model!r}, which is not served")
            self.targets.update({f"{model}@{v}": h for v, h in by_variant.items()})
        self.streaming = {name: h.options(stream=True) for name, h in self.targets.items()}
        self._multiplexed: dict[tuple[str, str, bool], DeploymentHandle] = {}  # (target, multiplexed id, streaming)

    def all(self) -> dict[str, DeploymentHandle]:
        """Every deployment's handle: the generating models' by served name (each variant of an
        A/B test as ``model@variant``), then the encoders'."""
        return {**self.targets, **self.encoders}

    def of(self, model: str, stream: bool, adapter: AdapterEntry | None = None) -> DeploymentHandle:
        """The handle of served model ``model`` or of a variant's deployment (``model@variant``)
        (``stream``: its streaming handle), bound to the run-time ``adapter``'s load when one is
        given; an encoder's for an embedding model."""
        if model in self.encoders:
            return self.encoders[model]
        handle = self.streaming[model] if stream else self.targets[model]
        if adapter is None:
            return handle
        key = (model, adapter.multiplexed_id, stream)
        if key not in self._multiplexed:
            if len(self._multiplexed) >= MAX_MULTIPLEXED:
                self._multiplexed.clear()
            self._multiplexed[key] = handle.options(multiplexed_model_id=adapter.multiplexed_id)
        return self._multiplexed[key]
