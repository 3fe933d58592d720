"""What crosses between the gateway and an ``LLMServer`` replica, typed: the request
(:class:`GenerateRequest`), the stream of records back (:class:`GenerationChunk`, with a typed
:class:`GenerationError` when a request cannot run), and the replica's facts
(:class:`ServerInfo`); the embedding and tokenizer calls' answers (:class:`EmbedResult`,
:class:`TokenizeResult`), an error again typed.

Plain dataclasses: they pickle cleanly over Ray and need neither torch nor the engine, so the
gateway, the replica and Python-handle callers all import them. A chunk's JSON form
(:meth:`GenerationChunk.to_dict` / :meth:`GenerationChunk.from_dict`) is the one encoding the
response cache stores too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.engine.sampling_params import SamplingParams

#: The most choices one request may ask for (``n``, ``best_of``).
MAX_N = 128  # OpenAI's limit
#: The most inputs of one embeddings request (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048

#: Error codes of :class:`GenerationError` and the HTTP status each maps to.
#: Request header that marks a request as cache warming's (``kvserve warm``; the gateway needs an
#: admin key with it): lowest priority, and sheddable on the replica (``GenerateRequest.sheddable``).
WARM_HEADER = "x-kvserve-warm"
#: With :data:`WARM_HEADER`: the name of the API key whose request warming replays; the replay
#: runs under that key's limits (and is its cache owner's), not the admin key's.
WARM_KEY_HEADER = "x-kvserve-warm-key"
#: Header that once marked a request as a batch job's; from a client it changes nothing (the Batch
#: API's runner marks its requests in-process, ``batch_lines.mark_batch``): those run at the lowest
#: priority as batch work on the replica (``GenerateRequest.batch``: a bounded share, preempted for
#: live requests, never stopped).
BATCH_HEADER = "x-kvserve-batch"

ERROR_STATUS = {
    "context_length_exceeded": 400,  # the prompt (plus one output token) does not fit max_model_len
    "invalid_value": 400,  # a value the engine cannot honour (the message names the field)
    "queue_full": 429,  # the replica is at capacity: retry after retry_after_s
    "too_large": 400,  # can never be admitted (more than a replica holds at once)
    "timeout": 504,  # ran past the server's request_timeout_s (aborted, blocks freed)
    "engine_dead": 503,  # the replica's engine stopped; Serve replaces the replica
    "internal": 500,  # a failure of the server itself (details in its log)
    "model_not_found": 404,  # a LoRA adapter the replica does not serve
    "warming_deferred": 429,  # a cache-warming request refused or stopped: live requests came first
}


@dataclass
class GenerationError:
    """Why a request could not run: ``code`` is a key of :data:`ERROR_STATUS`; ``param`` the
    request field it is about, when one is (OpenAI's error ``param``)."""

    code: str
    message: str
    retry_after_s: float | None = None  # for "queue_full": when a retry may succeed, seconds
    param: str | None = None

    @property
    def status(self) -> int:
        """The HTTP status of this error."""
        return ERROR_STATUS[self.code]


@dataclass
class TopLogprob:
    """One candidate token at a position: id, text, UTF-8 bytes, log-probability (natural log;
    None for the first prompt token of prompt logprobs, which has no context)."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None


@dataclass
class TokenLogprob(TopLogprob):
    """The sampled token at a position, with the ``logprobs`` most likely candidates."""

    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """What ``LLMServer.generate`` yields: one record per engine step that gives the request
    tokens (the contract between the LLM server and the ingress or any Python-handle caller;
    a plain dataclass, so it pickles cleanly over Ray and needs neither torch nor the engine).

    Attributes:
        text: the text new in this step (held back while it may be the start of a stop string).
        token_ids: the token ids new in this step.
        finished: the last record of the request.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` on the last record.
        stop_reason: the stop string or stop token id that ended it, if any.
        num_prompt_tokens, num_output_tokens, num_cached_tokens: tokens so far (cached: prompt
            tokens served from the prefix cache).
        logprobs: per new token (only when asked for).
        prompt_logprobs: per prompt token, the first None (asked for with ``prompt_logprobs``;
            sent once, on the first chunk).
        prompt_text: the prompt as text, on the first chunk (asked for with ``echo``).
        index: the choice this chunk belongs to (``n > 1`` interleaves the choices' chunks in
            one stream; each choice ends with its own ``finished`` chunk).
        error: set (and ``finished``) when the request could not run.
        replica: on a first chunk, the id of the replica that runs the request.
        via_channel: on a first chunk, the rest of the request's chunks come on the gateway's
            channel (:mod:`kvserve.deployments.replica.channels`), not on this stream.
        prompt_reasoning: on a request's first chunk, for a model with a reasoning parser:
            where the chat prompt leaves the model (``"open"`` in a reasoning block its template
            opened, ``"closed"`` after one it closed, ``""`` neither:
            :func:`kvserve.deployments.contract.reasoning.prompt_reasoning`).
        seq: the chunk's place in its request's stream (0, 1, 2, ... over all choices), set by
            the replica on every chunk it sends (:meth:`kvserve.deployments.replica.channels.GatewayChannels.route`),
            so the gateway puts chunks that came on two streams in order and knows when one is
            missing (:mod:`kvserve.deployments.gateway.streams`).
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_text: str | None = None
    index: int = 0
    error: GenerationError | None = None
    replica: str | None = None
    via_channel: bool = False
    prompt_reasoning: str = ""
    seq: int = 0

    def extend(self, chunk: "GenerationChunk") -> None:
        """Fold the request's next chunk into this one (the whole generation so far): text,
        token ids and logprobs are appended; status, counts and error are the newest."""
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.prompt_text is not None:
            self.prompt_text = chunk.prompt_text
        self.index = chunk.index
        self.finished, self.finish_reason, self.stop_reason = chunk.finished, chunk.finish_reason, chunk.stop_reason
        self.num_prompt_tokens, self.num_output_tokens = chunk.num_prompt_tokens, chunk.num_output_tokens
        self.num_cached_tokens, self.error = chunk.num_cached_tokens, chunk.error

    def to_dict(self) -> dict[str, Any]:
        """The chunk as JSON-ready data (fields at their defaults left out; ``error`` is never
        encoded: only finished, successful answers are stored; neither are ``replica`` and
        ``via_channel``). The one encoding of a chunk outside Ray's pickling: the response
        cache stores it."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_STORED and v != _CHUNK_DEFAULTS[k]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationChunk":
        """The inverse of :meth:`to_dict`."""
        c = cls(**{k: v for k, v in d.items() if k not in ("logprobs", "prompt_logprobs")})
        if d.get("logprobs") is not None:
            c.logprobs = [_logprob(e) for e in d["logprobs"]]
        if d.get("prompt_logprobs") is not None:
            c.prompt_logprobs = [_logprob(e) for e in d["prompt_logprobs"]]
        return c

    @classmethod
    def failed(cls, error: "GenerationError", index: int = 0) -> "GenerationChunk":
        """The last (and only) chunk of a request that could not run or stopped: ``error`` set."""
        return cls(finished=True, finish_reason="error", error=error, index=index)


def _logprob(d: dict | None) -> TokenLogprob | None:
    if d is None:
        return None
    tops = [TopLogprob(**t) for t in d.get("top_logprobs", [])]
    return TokenLogprob(d["token_id"], d["token"], d["bytes"], d["logprob"], tops)


#: Fields of a chunk that :meth:`GenerationChunk.to_dict` leaves out (how it travelled, not what it says).
_NOT_STORED = frozenset({"error", "replica", "via_channel"})
_CHUNK_DEFAULTS = {
    f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
    for f in dataclasses.fields(GenerationChunk)
}


# ---- gateway -> replica --------------------------------------------------------------------
@dataclass
class GenerateRequest:
    """One generation request as the replica takes it (``LLMServer.stream``).

    Attributes:
        prompt: text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``
            (ignored when ``messages`` is given).
        messages: a chat conversation (``[{"role", "content"}, ...]``, with ``tool_calls`` /
            ``tool`` messages as transformers' templates take them); the replica applies the
            tokenizer's chat template with the assistant generation prompt.
        tools: OpenAI function tools for the chat template.
        chat_template_kwargs: more variables for the chat template (vLLM's; e.g. Qwen3's
            ``enable_thinking``).
        sampling_params: the engine's :class:`engine.SamplingParams` (validated when built).
        n: choices: the replica runs ``n`` engine requests of the prompt (``1..MAX_N``).
        request_id: the engine's id (``<request_id>-<i>`` per choice when ``n > 1``).
        priority: lower runs first under ``scheduling_policy="priority"``.
        echo: the first chunk of each choice carries the prompt as text (``prompt_text``).
        lora_name: the LoRA adapter to run with (one of the replica's ``lora_modules``); None:
            the base model.
        shed_requests: requests the sending gateway refused for this model as full since its
            previous request (:mod:`kvserve.deployments.gateway.shedding`): the replica counts them as
            demand its queue refused, for the autoscaler.
        channel: ``(gateway id, key)``: the sending gateway replica's channel and this request's
            key on it (:mod:`kvserve.deployments.replica.channels`); None: the request streams on its own.
        trace_context: the W3C trace context (``traceparent``) of the gateway's span that sent
            it, when tracing is on (``kvserve/telemetry/tracing.py``): the replica's spans are its children.
        sheddable: a cache-warming request (``kvserve warm``): the replica refuses it while any
            live request is in flight and stops it when one arrives (``warming_deferred``), so
            it never shares a step with live traffic.
        batch: a Batch-API request (the gateway's batch runner, ``batch_lines.py``): the
            replica admits it within its batch share (``max_batch_requests``, and only while
            fewer than ``max_num_seqs`` requests are in flight there, else ``queue_full``) and
            never stops it for live traffic: at its (lowest) ``priority`` the engine preempts it
            by recompute for a live request, keeping its generated tokens, and it goes on when
            a slot is free again. Not a live request for warming (a warming request is not
            refused or stopped for it).
        cache_salt: vLLM's ``cache_salt`` (the gateway's per-API-key salt, with the client's):
            part of the first KV block's hash, so only requests with the same salt share cached
            prefixes; None: no salt.
        num_prompts: the prompts of the client's request this one belongs to (a completions
            batch is sent as one request per prompt): the replica refuses the batch as
            ``too_large`` when ``num_prompts * n`` requests could never be in flight on it at once.
    """

    prompt: str | list[int] | dict | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    request_id: str = ""
    priority: int = 0
    echo: bool = False
    lora_name: str | None = None
    shed_requests: int = 0
    num_prompts: int = 1
    cache_salt: str | None = None
    channel: tuple[str, str] | None = None
    trace_context: dict[str, str] | None = None
    sheddable: bool = False
    batch: bool = False

    @classmethod
    def of(
        cls,
        prompt: str | list[int] | dict | None = None,
        sampling_params: "SamplingParams | dict | None" = None,
        **kwargs: Any,
    ) -> "GenerateRequest":
        """A request from the Python-handle arguments (``sampling_params`` as a dict of
        :class:`engine.SamplingParams` fields plus ``n``, or the object itself).

        Raises:
            ValueError: a sampling value the engine cannot honour (``n`` and the prompt are
                checked where the request runs: :meth:`check`, by ``LLMServer.stream``).
        """
        n = kwargs.pop("n", 1)
        if isinstance(sampling_params, SamplingParams):
            sp = sampling_params
        else:
            d = dict(sampling_params or {})
            n = d.pop("n", n)
            try:
                sp = SamplingParams(**d)
            except TypeError as e:  # an unknown field
                raise ValueError(str(e)) from None
        return cls(prompt=prompt, sampling_params=sp, n=n, **kwargs)

    def check(self) -> None:
        """Raises ValueError: ``n`` outside ``1..MAX_N``, or neither ``prompt`` nor ``messages``."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.prompt is None and self.messages is None:
            raise ValueError("either prompt or messages is required")


@dataclass(frozen=True)
class ServerInfo:
    """What one model's replicas are (``LLMServer.server_info()``, for Python-handle callers and
    operators; the gateway does not call it: it has the models' cards from the application's
    build and what replicas publish when they load, :mod:`kvserve.deployments.contract.facts`).

    Attributes:
        name: the served model name.
        max_model_len: the context length in tokens (prompt plus output).
        tensor_parallel_size: ranks per pipeline stage.
        pipeline_parallel_size: stages per replica (each of ``tensor_parallel_size`` ranks).
        kv_cache_dtype: ``auto`` or ``fp8``.
        quantization: the weights' (None, ``int8``, ``fp8``, or a 4-bit checkpoint's ``awq``, ``gptq``,
            ``compressed-tensors``).
        speculative_config: None, or ``{"method", "num_speculative_tokens", ...}`` (no paths).
        max_waiting_requests, max_queued_prompt_tokens: a replica's admission bounds beyond the
            running batch (requests, prompt tokens); ``max_queued_requests`` is the old name of
            the first (read-only).
        max_in_flight_requests: the most requests a replica holds at once
            (``max_num_seqs + max_waiting_requests``): a request needing more can never run.
        tool_call_parser: the name of the parser of this model's tool calls.
        revision: the weights' revision (:func:`model_revision`), keys the response cache.
        workers: the worker actors' placement (several ranks per replica): the placement group
            and each rank's ``node_id``.
        lora_modules: the names of the LoRA adapters the replicas serve (paths stay private).
        task: ``generate`` (an ``LLMServer``: chat, completions, and embeddings by pooling) or
            ``embed`` (an ``EmbeddingServer``: embeddings only).
        embedding_dim: the length of this model's embeddings.
    """

    name: str
    max_model_len: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    speculative_config: dict | None = None
    max_waiting_requests: int = 0
    max_queued_prompt_tokens: int = 0
    max_in_flight_requests: int = 0
    tool_call_parser: str = "hermes"
    revision: str = ""
    lora_modules: list[str] = field(default_factory=list)
    workers: dict | None = None
    task: str = "generate"
    embedding_dim: int | None = None

    @property
    def max_queued_requests(self) -> int:
        """The old name of :attr:`max_waiting_requests`."""
        return self.max_waiting_requests


@dataclass
class EmbedResult:
    """A replica's answer to ``embed(inputs, dimensions)``: one vector per input, in order
    (float32 values), and the prompt tokens they took; or why the call could not run."""

    data: list[list[float]] = field(default_factory=list)
    prompt_tokens: int = 0
    error: GenerationError | None = None


@dataclass
class TokenizeResult:
    """A replica's answer to ``tokenize`` / ``detokenize`` (vLLM's ``/tokenize`` fields):
    ``tokens`` and their ``count``, the model's ``max_model_len``, each token's text when asked
    (``token_strs``), the text of ``detokenize`` (``prompt``); or ``error``."""

    tokens: list[int] = field(default_factory=list)
    count: int = 0
    max_model_len: int = 0
    token_strs: list[str] | None = None
    prompt: str | None = None
    error: GenerationError | None = None


def finish_reason(engine_reason: str | None) -> str | None:
    """Engine finish reasons -> OpenAI's (``stop``, ``length``; aborts count as ``stop``;
    the ingress turns ``stop`` into ``tool_calls`` when it parsed tool calls)."""
    if engine_reason is None:
        return None
    return "length" if engine_reason == "length" else "stop"


def model_revision(path: str | os.PathLike) -> str:
    """The weights revision of a model folder: the hub commit when it is a hub snapshot
    (``.../snapshots/<commit>``), else ``sha256:`` + the first 16 hex digits of a hash over
    ``config.json``'s bytes and the name, size and modification time of every file of the
    folder (weights, tokenizer, chat template). Copies of a folder on several nodes need the
    same mtimes (``rsync -t``, one image) to share cache entries; a mismatch only splits them."""
    p = Path(path)
    if p.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", p.name):
        return "hub:" + p.name
    h = hashlib.sha256()
    try:
        h.update((p / "config.json").read_bytes())
    except OSError:
        pass
    try:
        entries = sorted(os.scandir(p), key=lambda e: e.name)
    except OSError:
        entries = []
    for e in entries:
        if e.is_file():
            st = e.stat()
            h.update(f"{e.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return "sha256:" + h.hexdigest()[:16]


def public_speculative_config(spec: dict | None) -> dict | None:
    """The speculative config as clients see it: the method and draft length (a draft model's
    path stays private)."""
    if not spec:
        return None
    from kvserve.engine.spec_decode import SpeculativeConfig

    cfg = SpeculativeConfig.from_dict(spec)
    return {"method": cfg.method, "num_speculative_tokens": cfg.num_speculative_tokens}
