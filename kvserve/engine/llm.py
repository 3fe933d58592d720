"""Offline batch inference, shaped like vLLM's ``LLM`` class."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pooling import PoolingParams
from kvserve.engine.request import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.lora_adapter import LoRARequest


class LLM:
    """Generate for a list of prompts with continuous batching.

    Args: see :class:`kvserve.engine.config.EngineConfig` (``model=None`` is SmolLM2-135M-Instruct).
    With ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 the engine runs the ranks
    on the executor ``distributed_executor_backend`` names (default: Ray actors where Ray is
    installed, starting a local Ray when none is connected; else local processes, ``"mp"``), as
    vLLM's ``LLM(model, tensor_parallel_size=2)``; ``executor_factory``
    (``(config, model_path) -> Executor``) injects one of the caller's own instead.

    Example::

        llm = LLM()
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
        print(out[0].outputs[0].text)

    Raises:
        ValueError: a bad setting (see :class:`EngineConfig`, :class:`LLMEngine`).
        ImportError: the chosen executor backend is not installed (``"ray"``).
    """

    def __init__(self, model: str | None = None, *, executor_factory: Callable | None = None, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config, executor_factory)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: "LoRARequest | Sequence[LoRARequest | None] | None" = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in prompt order.

        Args:
            prompts: a prompt or a list of prompts; a prompt is a string, a token id list,
                ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (vLLM's forms).
            sampling_params: one for all prompts or one per prompt (default: SamplingParams()).
            use_tqdm: show a progress bar over finished requests.
            priority: per-prompt priority (lower first) for ``scheduling_policy="priority"``.
            lora_request: a LoRA adapter (:class:`kvserve.engine.lora.LoRARequest`) for all prompts, or one
                per prompt (None: the base model); needs ``enable_lora=True``.

        A request that fails alone inside the engine comes back finished with
        ``finish_reason == "error"`` and ``error`` set; the others are unaffected.

        Raises:
            ValueError: a bad prompt or sampling parameters (see ``LLMEngine.make_request``) or
                mismatched list lengths.
            StepFailedError: a model step failed for all its requests (see ``LLMEngine.step``).
            Nothing of the call is left in the engine when it raises.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        if lora_request is None or not isinstance(lora_request, Sequence):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} lora_request entries for {len(prompts)} prompts")
        return self._submit(
            [
                dict(prompt=p, params=sp, priority=priority[i] if priority else 0, lora_request=lora_request[i])
                for i, (p, sp) in enumerate(zip(prompts, sampling_params))
            ],
            use_tqdm,
        )

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Like :meth:`generate` for conversations (``[{"role", "content"}, ...]`` each), with
        the tokenizer's chat template and the assistant generation prompt applied."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.engine.apply_chat_template(m) for m in messages]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        pooling_type: str = "last",
        normalize: bool = True,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """Embeddings of ``prompts`` (the forms of :meth:`generate`): the final hidden states
        pooled (``last`` token or ``mean``; :mod:`kvserve.engine.pooling`), L2-normalised unless
        ``normalize=False``; one list of ``hidden_size`` float32 values per prompt, in order.

        Raises:
            ValueError: a bad prompt (longer than ``max_model_len``, ids out of the vocabulary)
                or pooling type. Nothing of the call is left in the engine when it raises.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = PoolingParams(pooling_type, normalize)
        outs = self._submit([dict(prompt=p, pooling_params=params) for p in prompts], use_tqdm)
        failed = [o for o in outs if o.pooled is None]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [o.pooled for o in outs]

    def _submit(self, requests: list[dict], use_tqdm: bool) -> list[RequestOutput]:
        """Add each request (``LLMEngine.add_request`` keyword arguments), run them all to the
        end; on an error nothing of the call is left in the engine."""
        ids = []
        try:
            for kw in requests:
                rid = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, **kw)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        finally:
            for rid in ids:
                self.engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        wanted = set(ids)
        while wanted - done.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    def get_stats(self) -> dict:
        return self.engine.get_stats()
