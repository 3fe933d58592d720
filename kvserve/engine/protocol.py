"""What the serving layer may use of an engine: :class:`EngineClient` (vLLM's
``vllm/engine/protocol.py`` ``EngineClient``: the one interface its API server holds, whichever
process the engine core runs in).

Both engine fronts satisfy it: :class:`kvserve.engine.async_engine.AsyncLLMEngine` (the engine in
this process, stepped in a thread of its own) and :class:`kvserve.engine.core_client.MPAsyncLLMEngine`
(the engine core in a child process). A Serve replica (``kvserve/deployments/replica/``) holds one
as ``self.engine`` and uses nothing else of it; ``tests/test_architecture.py`` checks that every
``<replica>.engine.<name>`` it reads is a member here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the serving layer sees it: facts, requests, adapters, KV, stats, health.

    Attributes:
        tokenizer: the front's own tokenizer (the event loop's: decoding, probes).
        input_processor: prompt parsing, chat templates and validation
            (:class:`kvserve.engine.input_processor.InputProcessor`).
        kv_connector: a KV tier outside the engine (``kvserve.engine.kv_connector.KVConnector``)
            shown each new request before it is queued; None: none. Assignable.
        errored: the ``EngineDeadError`` that killed the engine, or None while it is usable.
    """

    tokenizer: Any
    input_processor: Any
    kv_connector: Any
    errored: Any

    # ---- facts ---------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        """The :class:`kvserve.engine.config.EngineConfig` the engine runs (resolved: dtype, quantization)."""

    @property
    def hf_config(self) -> Any:
        """The model's Hugging Face config."""

    @property
    def model_path(self) -> str:
        """The model folder."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, tokens."""

    @property
    def executor(self) -> Any:
        """The executor (its placement, for a replica of several ranks)."""

    # ---- requests ------------------------------------------------------------------------
    def generate(
        self, prompt: Any, sampling_params: Any = None, request_id: str | None = None, *args, **kwargs
    ) -> AsyncIterator[Any]:
        """Stream the :class:`kvserve.engine.request.RequestOutput` of one request."""

    def embed(self, prompt: Any, *args, **kwargs) -> Any:
        """The pooled hidden state of one prompt (an awaitable)."""

    def abort(self, request_id: str) -> None:
        """End a request (its stream ends, its KV blocks go back to the pool)."""

    def tokenize(self, prompt: Any) -> list[int]:
        """Token ids of a prompt (in the caller's thread)."""

    def encode(self, prompt: Any) -> Any:
        """Token ids of a prompt, in the tokenizer pool (an awaitable)."""

    def apply_chat_template(self, messages: list[dict], *args, **kwargs) -> Any:
        """The chat template's token ids for ``messages`` (an awaitable)."""

    # ---- adapters ------------------------------------------------------------------------
    def add_lora(self, lora_request: Any) -> None:
        """Load a LoRA adapter (blocking)."""

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter (blocking)."""

    # ---- KV ------------------------------------------------------------------------------
    def take_kv_events(self) -> tuple[int, list]:
        """The KV cache event batches since the last call, with the number of the last."""

    def kv_cache_snapshot(self) -> Any:
        """Every cached block as one event batch (an awaitable)."""

    def reset_prefix_cache(self) -> Any:
        """Drop the prefix cache (an awaitable of whether it could)."""

    def export_kv_blocks(self, block_hashes: list[int]) -> Any:
        """Copies of cached blocks (an awaitable)."""

    def import_kv_blocks(self, blocks: list) -> Any:
        """Cached blocks from elsewhere, into the host tier (an awaitable of how many)."""

    # ---- stats and health ----------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """The scheduler's and KV pool's gauges after the latest step."""

    def add_stat_logger(self, log: Callable | None, on_finished: Callable | None = None) -> None:
        """Call ``log`` after every step and ``on_finished`` for every request that leaves."""

    def check_health(self) -> None:
        """Cheap liveness (raises ``EngineDeadError``)."""

    def check_health_async(self, timeout_s: float = 30.0) -> Any:
        """Liveness with the executor's own probe (an awaitable)."""

    def shutdown(self) -> Any:
        """Stop the engine (an awaitable)."""
