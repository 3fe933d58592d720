"""A request's state inside the engine, and what the engine returns for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Request:
    """One generation request: prompt, outputs so far, and its place in the KV cache.

    ``all_token_ids`` is prompt + output; ``num_computed_tokens`` of them have K/V in
    the cache (blocks ``block_table``). After preemption by recompute,
    ``num_computed_tokens`` falls back to 0 (or the prefix-cache hit) and the outputs are
    recomputed as if they were prompt.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        max_model_len: int = 1 << 30,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.params = params
        self.priority = priority
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids or ())
        #: ``params.stop_token_ids`` as a set, built once (each step looks a token up in it)
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        #: vLLM's ``cache_salt``: part of the first block's hash, so only requests with the same
        #: salt share cached prefixes (None: no salt)
        self.cache_salt = cache_salt
        #: the request's LoRA adapter (kvserve.engine.lora.LoRARequest), None: the base model
        self.lora_request = None
        #: an embedding request (kvserve.engine.pooling.PoolingParams): its prompt is pooled, nothing generated
        self.pooling = None
        #: the pooled embedding (float32 values), set when its prompt is computed
        self.pooled: list[float] | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_output_tokens = min(max_tokens, max_model_len - self.num_prompt_tokens)
        self.logprobs: list[dict[int, float]] = []
        # with params.prompt_logprobs: entry q = {token_id: logprob} of prompt position q
        # (None until computed; entry 0 stays None: no context)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None
        )
        self.error: str | None = None
        # structured outputs: an kvserve.engine.structured_output.RequestGrammar (set by LLMEngine.make_request)
        self.grammar = None
        self.stop_reason: int | str | None = None
        #: speculative decoding: draft tokens proposed for the next step (not yet part of
        #: ``all_token_ids``; the scheduler verifies them with the request's last token)
        self.spec_token_ids: list[int] = []
        #: speculative decoding is off for this request (its proposer failed on it); it goes on
        #: without drafts
        self.spec_disabled = False
        #: the tokens the last step appended (several with speculative decoding)
        self.new_token_ids: list[int] = []

    # ---- token bookkeeping -------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def add_prompt_logprobs(self, entries: list[tuple[int, dict[int, float]]]) -> None:
        """Record ``(position, {token_id: logprob})`` pairs from the model runner; a position
        already filled keeps its first value (a recompute after preemption repeats positions)."""
        for pos, d in entries:
            if self.prompt_logprobs[pos] is None:
                self.prompt_logprobs[pos] = d

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt position but the first has its logprobs (False without prompt_logprobs)."""
        return self.prompt_logprobs is not None and all(d is not None for d in self.prompt_logprobs[1:])

    def check_stop_token(self) -> bool:
        """After appending a token: set a finished status if it ends the request."""
        tok = self.all_token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= self.params.min_tokens:
            if tok in self.eos_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if tok in self.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                return True
        if n_out >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    @property
    def finished(self) -> bool:
        return self.status.finished

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.metrics.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass
class CompletionOutput:
    """One generated sequence (``n`` is always 1). ``text`` is cumulative; ``delta_*`` hold
    what is new since the last output of a stream."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What the engine returns for a request (final, or an incremental stream update).

    ``pooled``: the embedding of a pooling request (``LLMEngine.add_request(pooling_params=)``),
    float32 values, on its final output.

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs=k``): one entry per prompt
    token, the first None (no context), each ``{token_id: logprob}`` (natural log of the raw
    float32 softmax) holding the actual prompt token and the top-k ids. Set once the prompt is
    fully computed, on the request's first output with a token and on its final output
    (None on the others, and on a final output of a request aborted before its prompt was done).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    #: an embedding request's vector (``kvserve.engine.pooling``), on its final output
    pooled: list[float] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
