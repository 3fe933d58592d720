"""What the gateway knows of a served model, and when it learns it.

- :class:`ModelCard`: the facts of the configuration, known when the application is built
  (``kvserve.deployments.app.build_app`` makes one per model from its ``ModelArgs`` and gives them to the
  gateway's constructor, as Ray Serve LLM gives its ingress the models' configs): name, task,
  parallelism, dtypes, the tool-call parser, the configured LoRA adapters, and
  ``max_model_len`` when the configuration sets it.
- :class:`LoadedFacts`: what a replica learns only when it loads (``max_model_len`` when the
  configuration leaves it to the KV pool, the weights' revision). The replica publishes them
  on the :class:`FactsBoard` (Ray's GCS key-value store, beside the adapter registry of
  :mod:`kvserve.deployments.contract.adapters`) once it has loaded, and again when its model folder's
  revision changes; the gateway reads the board, never the replicas.

An entry on the board carries the digest of the configuration that published it
(:attr:`ModelCard.digest`): after ``serve deploy`` with another configuration, the gateway
ignores what the old replicas published until the new ones publish, and a replica restarted
with the same configuration publishes the same facts again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from kvserve.deployments.contract.adapters import REGISTRY_NAMESPACE, serve_app_name
from kvserve.deployments.contract.config import ModelArgs
from kvserve.deployments.contract.types import public_speculative_config

#: ``task`` of a card: a generating model (``LLMServer``: chat, completions, and embeddings by
#: pooling) or an encoder (``EmbeddingServer``: embeddings only).
TASKS = ("generate", "embed")


def _digest(payload: str) -> str:
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ModelCard:
    """A served model as its configuration describes it (no paths: the gateway shows cards to clients).

    Attributes:
        name: the served model name.
        task: ``generate`` or ``embed`` (:data:`TASKS`).
        max_model_len: the context length in tokens when the configuration sets it; None: the
            replica derives it from its KV pool when it loads (then :class:`LoadedFacts` has it).
        tensor_parallel_size, pipeline_parallel_size: ranks per stage, stages per replica.
        dtype: the weights' and activations' dtype as configured (``auto``, ``float32``,
            ``bfloat16``, ``float16``; what ``auto`` became is in :class:`LoadedFacts`).
        kv_cache_dtype: ``auto`` or ``fp8``; ``quantization``: as configured (None, ``int8``, ``fp8``,
            ``awq``, ``gptq``, ``compressed-tensors``; what a replica detected is in :class:`LoadedFacts`).
        speculative_config: None, or its ``method`` and ``num_speculative_tokens``.
        tool_call_parser: the name of the parser of this model's tool calls (``auto``: the one
            its replicas found in the chat template and published).
        reasoning_parser: how this model's output splits into reasoning and content (None:
            all content; :mod:`kvserve.deployments.contract.reasoning`).
        lora_modules: the names of the LoRA adapters configured with this model.
        digest: a hash of the configuration the card was made from: the served name and the
            engine's settings, what the published facts depend on (not the replica count, say:
            scaling a model keeps its facts; see the module docstring).
        facts_key: the key its replicas publish under (``ModelArgs.deployment_key``: the name,
            or ``name@variant`` for a variant of an A/B test); "" for the name.
    """

    name: str
    task: str = "generate"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    speculative_config: dict | None = None
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None
    lora_modules: tuple[str, ...] = ()
    digest: str = ""
    facts_key: str = ""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"a model card's task is one of {TASKS}, got {self.task!r}")

    @classmethod
    def of(cls, model: ModelArgs) -> "ModelCard":
        """The card of one generating model's configuration."""
        return cls(
            name=model.name,
            max_model_len=model.max_model_len,
            tensor_parallel_size=model.tensor_parallel_size,
            pipeline_parallel_size=model.pipeline_parallel_size,
            dtype=model.dtype,
            kv_cache_dtype=model.kv_cache_dtype,
            quantization=model.quantization,
            speculative_config=public_speculative_config(model.speculative_config),
            tool_call_parser=model.tool_call_parser,
            reasoning_parser=model.reasoning_parser,
            lora_modules=tuple(model.lora_modules or ()),
            digest=_digest(json.dumps({"name": model.name, **model.engine_args()}, sort_keys=True, default=str)),
            facts_key=model.deployment_key if model.variant is not None else "",
        )

    @classmethod
    def of_encoder(cls, model: str | None, served_name: str) -> "ModelCard":
        """The card of an embedding model (``EmbeddingServer``) served as ``served_name`` from
        ``model`` (a folder, ``bundled`` or None)."""
        return cls(name=served_name, task="embed", digest=_digest(json.dumps([model, served_name])))


@dataclass(frozen=True)
class LoadedFacts:
    """What a model's replica learned when it loaded.

    Attributes:
        max_model_len: the context length in tokens (prompt plus output).
        revision: the weights' revision (``kvserve.deployments.contract.types.model_revision``): it
            keys the response cache, so answers of other weights are never served.
        digest: :attr:`ModelCard.digest` of the configuration the replica runs.
        dtype: the dtype its engine runs (``float32``, ``bfloat16``, ``float16``: what
            ``auto`` became there); "" for an encoder.
        quantization: the weights' quantization its engine runs: the configured one, or a 4-bit
            checkpoint's own (``awq``, ``gptq``, ``compressed-tensors``) when none was configured.
        cost_per_million_output_tokens: the replica's measured cost per million output tokens
            (``kvserve.telemetry.cost_metrics.ReplicaCost``), republished as it moves; None without
            ``cost_per_replica_hour`` or before its first token.
        tool_call_parser: the tool-call parser the replica runs the model with: the configured
            one, or what ``auto`` found in the chat template; "" for an encoder.
        max_token_bytes: the most UTF-8 bytes one token of the model's tokenizer covers
            (``kvserve.engine.input_processor.max_token_bytes``), None where no sound bound
            exists: the gateway refuses a prompt of more than ``max_model_len *
            max_token_bytes`` bytes without sending it (:meth:`max_prompt_bytes`).
    """

    max_model_len: int
    revision: str = ""
    digest: str = ""
    dtype: str = ""
    quantization: str | None = None
    cost_per_million_output_tokens: float | None = None
    tool_call_parser: str = ""
    max_token_bytes: int | None = None

    def max_prompt_bytes(self) -> int | None:
        """Bytes of prompt text beyond which a prompt cannot fit ``max_model_len`` whatever its
        tokens (None: no sound bound)."""
        return None if self.max_token_bytes is None else self.max_model_len * self.max_token_bytes


class FactsBoard:
    """The :class:`LoadedFacts` of one Serve application's models in Ray's GCS key-value store
    (namespace :data:`~kvserve.deployments.contract.adapters.REGISTRY_NAMESPACE`, keys
    ``facts/<app>/<model>``): replicas write, gateways read. Calls block on the GCS (about a
    millisecond): call them from a thread in async code.

    Raises:
        RuntimeError: (constructor) not in a process connected to Ray.
    """

    def __init__(self, app_name: str):
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            raise RuntimeError("the facts board needs a process connected to a Ray cluster")
        self._kv = internal_kv
        self.prefix = f"facts/{app_name}/"

    @classmethod
    def of_this_app(cls) -> "FactsBoard | None":
        """The board of the Serve application this process serves; None outside a Serve replica."""
        app = serve_app_name()
        return cls(app) if app is not None else None

    def put(self, model: str, facts: LoadedFacts) -> None:
        """Publish ``model``'s facts (replacing what was there)."""
        self._kv._internal_kv_put(
            self.prefix + model, json.dumps(dataclasses.asdict(facts)), overwrite=True, namespace=REGISTRY_NAMESPACE
        )

    def get(self, model: str) -> LoadedFacts | None:
        """``model``'s published facts; None when no replica has published any."""
        raw = self._kv._internal_kv_get(self.prefix + model, namespace=REGISTRY_NAMESPACE)
        return None if raw is None else LoadedFacts(**json.loads(raw))
