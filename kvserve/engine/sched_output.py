"""What the scheduler hands the executor each step (vLLM V1's ``SchedulerOutput``): the requests scheduled for the first time (:class:`NewRequestData`), every scheduled request's tokens this step (:class:`ScheduledRequest`), and the step as a whole (:class:`SchedulerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.lora_adapter import LoRARequest
    from kvserve.engine.pooling import PoolingParams


@dataclass
class NewRequestData:
    """Sent to the model runner when a request is (re)scheduled from the waiting queue."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    computed_token_ids: list[int] = field(default_factory=list)  # tokens before ``start`` (prefix-cache hits)
    lora_request: "LoRARequest | None" = None  # kvserve.engine.lora.LoRARequest of the request, None: the base model
    pooling: "PoolingParams | None" = None  # kvserve.engine.pooling.PoolingParams of an embedding request


@dataclass
class ScheduledRequest:
    """One request's slice of a step: compute ``token_ids`` at positions ``start ..
    start + len(token_ids)``; ``sample`` when the slice ends at the request's last token.
    With ``spec_token_ids`` (speculative decoding) the slice is the last token followed by
    these drafts (the tail of ``token_ids``), and the runner verifies them."""

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    new: NewRequestData | None = None
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's work. ``grammar_bitmask`` (structured outputs, set by the engine after
    scheduling; see ``kvserve.engine.structured_output``): int32 CPU tensor ``[len(grammar_req_ids),
    ceil(vocab_size / 32)]``, row ``j`` the allowed next tokens of request
    ``grammar_req_ids[j]`` (a sampling request with a grammar), or, for an in-process
    executor, a ``concurrent.futures.Future`` of that tensor (filled while the model runs);
    None when no request of the step has a grammar."""

    requests: list[ScheduledRequest]
    finished_req_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    #: prompt tokens looked up in the prefix cache by the requests (re)scheduled in this step, and those found
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: "torch.Tensor | None" = None  # noqa: F821 (torch is not imported here)
    #: set by :meth:`Scheduler.update_from_output`: accepted drafts per request that verified drafts
    num_accepted: dict[str, int] = field(default_factory=dict)
    #: copies between the KV pool and the host tier to run before the forward
    #: (:class:`kvserve.engine.kv_offload.KVTransfer`), None: none
    kv_transfer: "KVTransfer | None" = None  # noqa: F821
    #: of ``prefix_cache_queries``, the tokens found in the host tier (loaded back, not recomputed)
    host_cache_hits: int = 0

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(r.spec_token_ids) for r in self.requests)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.kv_transfer
