"""Cache keys: which requests are cacheable, and when two requests are the same request.

**Exact key** (:func:`exact_key`): a SHA-256 over the owner of the answer (the API key's
:attr:`~kvserve.deployments.limits.KeyPolicy.owner_id`, ``anonymous`` without keys, or
:data:`SHARED_OWNER` where the deployment shares its caches across keys:
``cache_shared_across_keys``), the served model name and its weights
revision (``LLMServer.server_info().revision``,
:func:`~kvserve.deployments.contract.types.model_revision`), the endpoint, and the request's normalised
fields (:func:`request_payload`): every declared field of
:class:`~kvserve.deployments.contract.openai_requests.ChatCompletionRequest` / :class:`~kvserve.deployments.contract.openai_requests.CompletionRequest`
except :data:`NON_OUTPUT_FIELDS` (``stream``, ``stream_options``, ``user``, ``priority``, ``cache``,
and ``model``, replaced by the served name), so a field added to the protocol later is part of
the key unless someone decides it cannot change the output. Unknown fields (ignored by the
server) are not part of it. Normalised: messages as the chat template takes them (content parts
joined, tool-call arguments as objects), ``max_completion_tokens`` folded into ``max_tokens``,
one structured-output spec whichever field gave it, unset ``temperature`` / ``top_p`` as the 1.0
they mean, a string ``stop`` or ``prompt`` as a one-item list, canonical JSON (sorted keys).

Only deterministic requests are cached (:func:`deterministic`): ``temperature`` 0 (greedy; ``n``
greedy choices are equal), or a ``seed`` (the server gives choice ``i`` the seed ``seed + i``, so
``n > 1`` with a seed is reproducible too). Outputs of one request are then a function of the
key, up to floating-point differences between batch compositions, which every serving engine
has.

**Semantic scope** (:func:`semantic_parts`): the hash of the same owner and payload with the
text to embed (the last user message, or the single text prompt) left out, so owner, system
prompt, earlier turns, tools and sampling fields must be equal for a semantic hit
(:mod:`kvserve.deployments.cache.semantic`).

The owner is part of both, so one tenant's request never gets another's answer (its text, or
the fact that someone asked it: the ``x-kvserve-cache`` header), nor one it planted.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvserve.deployments.contract.openai_messages import NamedToolChoice
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest

#: Request fields that never change the generated text: left out of the key. Every other
#: declared field of the request models is part of it.
NON_OUTPUT_FIELDS = frozenset({"model", "stream", "stream_options", "user", "priority", "cache"})
#: Fields whose spellings are folded into ``structured`` (one spec, whichever field gave it).
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
#: v2: the owner is part of every key (v1 keys, shared by every key, are never looked up).
_KEY_VERSION = b"kvserve-response-cache-v2\0"
#: The owner part of the keys of a deployment that shares its caches across API keys.
SHARED_OWNER = "*shared*"
#: The owner of requests to a deployment without API keys (:func:`kvserve.deployments.gateway.gate.owner_id`).
ANONYMOUS_OWNER = "anonymous"


def deterministic(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the request's output is a function of its fields: greedy (``temperature`` 0)
    or seeded."""
    return body.temperature == 0 or body.seed is not None


def _plain(v: Any) -> Any:
    if hasattr(v, "model_dump"):
        return v.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def request_payload(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The request's output-relevant fields, normalised (see the module docstring): equal for
    requests that ask the model the same thing the same way."""
    d = {name: _plain(getattr(body, name)) for name in type(body).model_fields if name not in NON_OUTPUT_FIELDS}
    for f in _STRUCTURED_FIELDS:
        d.pop(f, None)
    d["structured"] = body.structured_spec()
    d["temperature"] = 1.0 if body.temperature is None else float(body.temperature)
    d["top_p"] = 1.0 if body.top_p is None else float(body.top_p)
    if isinstance(body.stop, str):
        d["stop"] = [body.stop]
    if isinstance(body, ChatCompletionRequest):
        d["messages"] = [m.to_template() for m in body.messages]
        d["max_tokens"] = body.effective_max_tokens
        d.pop("max_completion_tokens", None)
        d["tools"] = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        d["tool_choice"] = (
            body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        )
    else:
        d["prompt"] = body.prompts()
    return d


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: one byte string per value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _digest(owner: str, model: str, revision: str, endpoint: str, payload: Any) -> str:
    h = hashlib.sha256(_KEY_VERSION)
    for part in (owner, model, revision, endpoint):
        h.update(part.encode() + b"\0")
    h.update(canonical_json(payload))
    return h.hexdigest()


def exact_key(
    model: str,
    revision: str,
    endpoint: str,
    body: ChatCompletionRequest | CompletionRequest,
    owner: str = ANONYMOUS_OWNER,
) -> str:
    """The exact-cache key (64 hex digits) of ``owner``'s request (an owner id, or
    :data:`SHARED_OWNER`) to ``model`` at ``revision`` on ``endpoint`` (``chat`` or
    ``completion``)."""
    return _digest(owner, model, revision, endpoint, request_payload(body))


def semantic_parts(
    model: str,
    revision: str,
    endpoint: str,
    body: ChatCompletionRequest | CompletionRequest,
    owner: str = ANONYMOUS_OWNER,
) -> tuple[str, str] | None:
    """``(scope, text)`` for the semantic level: the text to embed (the last message, if it is
    a user message with text, or the single text prompt) and the hash of everything else,
    ``owner`` included (as in :func:`exact_key`). None when the request has no such text (a
    conversation ending with a tool result, token id prompts, several prompts)."""
    payload = request_payload(body)
    if isinstance(body, ChatCompletionRequest):
        last = payload["messages"][-1]
        if last["role"] != "user" or not last["content"].strip():
            return None
        text, last["content"] = last["content"], None
    else:
        if not isinstance(body.prompt, str) or not body.prompt.strip():
            return None
        text, payload["prompt"] = body.prompt, None
    return _digest(owner, model, revision, endpoint, payload), text
