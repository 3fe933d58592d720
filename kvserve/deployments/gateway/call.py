"""What goes into the gateway's pipeline and what it hands back: the typed specs an endpoint
builds (:class:`GenerateSpec` for chat, completions and Responses; :class:`UnarySpec` for the
one-answer replica methods: embeddings, tokenize) and the :class:`Call`, one request on its
way through (model, ids, the key's admission, the cache's verdict, the replica streams).
Data only: the pipeline is :class:`~kvserve.deployments.gateway.core.Gateway`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import Request
from pydantic import BaseModel
from ray.serve.handle import DeploymentHandle

from kvserve.deployments.cache import NO_CACHE, Lookup
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest
from kvserve.deployments.contract.types import GenerationChunk
from kvserve.deployments.gateway.experiments import Assignment
from kvserve.deployments.gateway.streams import ChunkStream
from kvserve.deployments.limits.key_limits import KeyUse
from kvserve.engine.sampling_params import SamplingParams


def estimate_prompt_tokens(prompt) -> int:
    """A prompt's token count before the replica tokenizes it, for reserving a key's token
    budget (settled with the real count afterwards) and for the routing rules: exact for token
    ids, about 4 UTF-8 bytes per token for text (BPE tokenizers on English), plus a few tokens
    of template per message."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):  # chat messages
        return sum(
            4
            + estimate_prompt_tokens(
                json.dumps(m.get("content"), ensure_ascii=False)
                if not isinstance(m.get("content"), str)
                else m["content"]
            )
            for m in prompt
        )
    return len(str(prompt).encode()) // 4 + 1


@dataclass
class GenerateSpec:
    """A generating request as an endpoint hands it to the pipeline
    (:meth:`~kvserve.deployments.gateway.core.Gateway.run`): what to generate, validated; the pipeline
    picks the model, consults the cache, admits the key, opens the replica streams and settles.

    Attributes:
        request: the HTTP request (headers, the key's policy, the body for the upstream).
        body: the validated OpenAI body: its ``model``, ``priority`` and unknown fields, and
            the response cache's key.
        endpoint: ``chat`` or ``completion`` (the cache's key and the upstream's path).
        id_prefix: the response id's prefix (``chatcmpl``, ``cmpl``, ``resp``).
        params: the engine's sampling parameters (``max_tokens`` None: up to the context).
        n: sequences generated per prompt (``best_of`` for completions).
        messages, tools: a chat (one request), or ``prompts``: one request per prompt;
            ``chat_template_kwargs`` more variables for a chat's template.
        echo: each choice's first chunk carries its prompt's text.
        fallback: a refusal by every replica may go to the upstream (when one is configured).
    """

    request: Request
    body: ChatCompletionRequest | CompletionRequest
    endpoint: str
    id_prefix: str
    params: SamplingParams
    n: int = 1
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    prompts: list | None = None
    echo: bool = False
    fallback: bool = True

    def prompt_bytes(self) -> tuple[int, str]:
        """A lower bound of the longest single prompt text the replica will tokenize, in UTF-8
        bytes, and the parameter it came from (``prompt`` or ``messages``): a completion's
        longest text prompt as sent; for a chat, its longest user message's text, stripped
        (chat templates may trim, or drop other roles' content, such as an assistant turn's
        reasoning, but they render each user message's text). Token-id prompts count 0."""
        if self.messages is not None:
            best = 0
            for m in self.messages:
                if m.get("role") != "user":
                    continue
                c = m.get("content")
                parts = [c] if isinstance(c, str) else [p.get("text") for p in c or [] if isinstance(p, dict)]
                best = max(
                    best, sum(len(t.strip().encode("utf-8", "surrogatepass")) for t in parts if isinstance(t, str))
                )
            return best, "messages"
        return max(
            (len(p.encode("utf-8", "surrogatepass")) for p in self.prompts or [] if isinstance(p, str)), default=0
        ), "prompt"

    def prompt_tokens(self) -> int:
        """The prompts' estimated tokens (:func:`estimate_prompt_tokens`)."""
        if self.messages is not None:
            return estimate_prompt_tokens(self.messages)
        return sum(estimate_prompt_tokens(p) for p in self.prompts or [])

    def reserve_tokens(self) -> int | None:
        """Output tokens to reserve for the key's budget: ``max_tokens`` of every sequence; None
        when ``max_tokens`` is not set (up to the model's context)."""
        m = self.params.max_tokens
        return None if m is None else m * self.n * (1 if self.messages is not None else len(self.prompts or []))


@dataclass
class UnarySpec:
    """A one-answer replica call (``embed``, ``tokenize``, ``detokenize``) as an endpoint hands
    it to the pipeline (:meth:`~kvserve.deployments.gateway.core.Gateway.run_unary`).

    Attributes:
        request: the HTTP request.
        model: the requested model: a generating model (None: the default), one of its LoRA
            adapters, or an embedding model.
        id_prefix: the response id's prefix.
        method, args, kwargs: the replica method and its arguments.
        body: the validated body, whose unknown fields are logged (once per name).
        prompt_tokens: the inputs' estimated tokens (the key's token budget; no output reserved).
        priority: the request's priority (raised to the key's).
        call_context: the method also takes the call's ``lora_name``, ``priority`` and
            ``request_id`` (``embed``).
        tokens_used: the prompt tokens the answer used, to settle the key (default 0).
    """

    request: Request
    model: str | None
    id_prefix: str
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    body: BaseModel | None = None
    prompt_tokens: int = 0
    priority: int = 0
    call_context: bool = False
    tokens_used: Callable[[Any], int] | None = None


@dataclass
class Call:
    """One request on its way through the pipeline.

    Attributes:
        request: the HTTP request.
        http_id: ``X-Request-ID`` (or a random id): in the logs and in error messages.
        response_id: the response's id (``chatcmpl-...``, ``cmpl-...``), also the stem of the
            engine's request ids.
        model: the served (base) model's name; ``handle`` the handle the call uses.
        headers: response headers of the pipeline's verdicts (route, cache).
        created: the response's ``created`` (Unix seconds).
        use: the API key's admission; ``look`` the response cache's verdict.
        streams: one per prompt, each with the prompt's ``n`` choices.
        n: choices generated per prompt.
        lasts: the newest chunk of every choice seen so far, keyed ``(prompt index, choice
            index)``: the usage a streaming response reports, and what the key is settled with.
        adapter: the LoRA adapter the client named as its model (None: the base model);
            ``adapter_version`` a run-time adapter's load (its cached answers are this load's).
        assignment: the A/B test variant the request was assigned (None: no experiment);
            ``target`` the deployment it goes to (the model's name, or ``model@variant``).
        started, first_at: ``time.monotonic()`` when the gateway got the request and when its
            first chunk arrived (None before).
        span: the request's OpenTelemetry span while it runs (None: tracing off, or ended).
        warm: a cache-warming request (``x-kvserve-warm: 1`` with an admin key): lowest
            priority, sheddable on the replica, not logged, not counted as live traffic.
        batch: a batch job's request (marked in-process by the Batch API's runner,
            :func:`~kvserve.deployments.gateway.batch_lines.mark_batch`): lowest priority, batch
            work on the replica (``GenerateRequest.batch``: a bounded share, preempted for live
            requests, never stopped for them), not logged, not counted as live traffic.
    """

    request: Request
    http_id: str
    response_id: str
    model: str
    handle: DeploymentHandle
    headers: dict[str, str]
    created: int
    use: KeyUse | None = None
    look: Lookup = field(default_factory=lambda: NO_CACHE)
    streams: list[ChunkStream] = field(default_factory=list)
    n: int = 1
    lasts: dict[tuple[int, int], GenerationChunk] = field(default_factory=dict)
    adapter: str | None = None
    adapter_version: str | None = None
    assignment: Assignment | None = None
    target: str = ""
    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    span: Any = None
    warm: bool = False
    batch: bool = False

    @property
    def variant(self) -> str:
        """The ``variant`` label of the request's metrics ("" outside an experiment)."""
        return self.assignment.variant if self.assignment is not None else ""

    @property
    def served(self) -> str:
        """The name the client asked for (an adapter's, or the model's): answers carry it."""
        return self.adapter or self.model

    def cancel(self) -> None:
        """Stop every stream of the call."""
        for s in self.streams:
            s.cancel()
