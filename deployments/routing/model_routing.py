"""Model routing (``model: "auto"``) and the upstream fallback of the ingress.

``"auto"`` picks one of the application's models per request by a rule list: the first rule
whose conditions all hold names the model (conditions: estimated prompt tokens, the requested
``max_tokens``, keywords in the user's text), else ``default``. Rules, not a learned
classifier: they are explicit, cost microseconds and an operator can read why a request went
where it went (the ``x-kvserve-route`` response header names the rule).

The fallback sends a request to an OpenAI-compatible upstream (another kvserve, vLLM, OpenAI)
when the local model cannot take it: every local replica is at capacity (429 ``queue_full``)
or failing (503, 500) before the first token. Client errors (400, 404, a key's own rate limit)
are never forwarded. The upstream's answer (status, body, SSE stream) reaches the client
unchanged, with ``x-kvserve-route: fallback``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

logger = logging.getLogger("ray.serve")

#: Name clients send to let the router choose.
AUTO_MODEL = "auto"
#: Error codes of the local path that send a request upstream (see :meth:`Upstream.applies`).
FALLBACK_CODES = frozenset({"queue_full", "model_unavailable", "timeout"})
#: Response headers of the upstream never passed on (hop-by-hop, or recomputed by our server).
_DROP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                           "server", "date"})


class RouteRule(BaseModel):
    """One rule of ``model: "auto"``: every condition given must hold (an unset one holds).

    Attributes:
        model: the served model name (``served_model_name``) requests matching the rule go to.
        name: how ``x-kvserve-route`` and the metrics name the rule (default ``rule<i>``).
        max_prompt_tokens: the prompt's estimated tokens (about 4 UTF-8 bytes per token, plus
            4 per chat message) are at most this.
        max_tokens: the request asks for at most this many output tokens (a request without
            ``max_tokens`` does not match).
        keywords: at least one occurs in the user's text (case-insensitive substring).
        exclude_keywords: none occurs in the user's text.
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    name: Optional[str] = None
    max_prompt_tokens: Optional[int] = Field(None, ge=0)
    max_tokens: Optional[int] = Field(None, ge=0)
    keywords: Optional[list[str]] = None
    exclude_keywords: Optional[list[str]] = None

    @field_validator("keywords", "exclude_keywords")
    @classmethod
    def _lower(cls, v):
        return None if v is None else [k.lower() for k in v if k]

    def matches(self, prompt_tokens: int, max_tokens: int | None, text: str) -> bool:
        """Whether a request (``text`` lower-cased) satisfies every condition of this rule."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        if self.max_tokens is not None and (max_tokens is None or max_tokens > self.max_tokens):
            return False
        if self.keywords is not None and not any(k in text for k in self.keywords):
            return False
        return not (self.exclude_keywords and any(k in text for k in self.exclude_keywords))


class ModelRouting(BaseModel):
    """``model_routing`` of the app: the rules of ``model: "auto"`` (first match wins) and the
    model for requests no rule matches (default: the app's first model)."""

    model_config = ConfigDict(extra="forbid")

    rules: list[RouteRule] = Field(default_factory=list)
    default: Optional[str] = None

    def check(self, served: list[str]) -> None:
        """Raises:
            ValueError: a rule or the default names a model the app does not serve, or ``auto``.
        """
        for i, r in enumerate(self.rules):
            if r.model not in served:
                raise ValueError(f"model_routing.rules[{i}].model {r.model!r} is not served; served: {served}")
        if self.default is not None and self.default not in served:
            raise ValueError(f"model_routing.default {self.default!r} is not served; served: {served}")
        if AUTO_MODEL in served:
            raise ValueError(f"{AUTO_MODEL!r} is reserved for model routing; serve the model under another name")

    def choose(self, prompt_tokens: int, max_tokens: int | None, text: str, first_model: str) -> tuple[str, str]:
        """``(model, rule name)`` for one request; ``(default or first_model, "default")`` when no
        rule matches. ``text``: the user's text (any case)."""
        low = text.lower()
        for i, r in enumerate(self.rules):
            if r.matches(prompt_tokens, max_tokens, low):
                return r.model, r.name or f"rule{i}"
        return self.default or first_model, "default"


def user_text(messages: list[dict] | None = None, prompt: Any = None) -> str:
    """The text the keyword conditions look at: the user messages' text parts, or the prompt(s)
    of a completion (token-id prompts have none)."""
    out: list[str] = []
    for m in messages or ():
        if m.get("role") != "user":
            continue
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(p.get("text", "") for p in c if isinstance(p, dict))
    if prompt is not None:
        for p in prompt if isinstance(prompt, list) else [prompt]:
            if isinstance(p, str):
                out.append(p)
    return "\n".join(out)


class UpstreamArgs(BaseModel):
    """``upstream`` of the app: where requests go when the local model cannot take them.

    Attributes:
        base_url: the upstream's OpenAI base URL, e.g. ``https://api.example.com/v1``.
        api_key: its key; default ``$KVSERVE_UPSTREAM_API_KEY`` (keep keys out of config files).
        models: local served name -> upstream model name (default: the same name).
        timeout_s: seconds to connect and between two reads of the upstream's answer.
    """

    model_config = ConfigDict(extra="forbid")

    base_url: str
    api_key: Optional[str] = None
    models: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(120.0, gt=0)

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream.base_url must be an http(s) URL, got {v!r}")
        return v.rstrip("/")


class Upstream:
    """The fallback client (httpx, one connection pool per ingress replica).

    Args:
        args: :class:`UpstreamArgs`.
    """

    def __init__(self, args: UpstreamArgs):
        import httpx

        self.args = args
        self.api_key = args.api_key or os.environ.get("KVSERVE_UPSTREAM_API_KEY") or None  # resolved by AppArgs
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s), follow_redirects=False)

    @staticmethod
    def applies(status: int, code: str | None) -> bool:
        """Whether a local failure goes upstream: capacity (429 ``queue_full``) or the model
        being unavailable / failing (503, 5xx), never a client error or a key's own limit."""
        return code in FALLBACK_CODES or status >= 500

    async def forward(self, path: str, body: dict, model: str, request_id: str):
        """Send ``body`` (the client's JSON, ``model`` replaced by the upstream's name for
        ``model``) to ``base_url + path``; returns a Starlette response carrying the upstream's
        status, headers and body (an SSE stream passes through as it arrives).

        Raises:
            OSError-like ``httpx`` errors are turned into a 502 OpenAI error by the caller
            (:class:`UpstreamError`).
        """
        import httpx
        from starlette.responses import Response, StreamingResponse

        body = {**body, "model": self.args.models.get(model, model)}
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        req = self._client.build_request("POST", self.args.base_url + path, json=body, headers=headers)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise UpstreamError(f"the upstream could not be reached ({type(e).__name__})") from None
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}
        out_headers["x-kvserve-route"] = "fallback"
        if not body.get("stream"):
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                raise UpstreamError(f"the upstream's answer broke off ({type(e).__name__})") from None
            finally:
                await resp.aclose()
            return Response(content, status_code=resp.status_code, headers=out_headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                logger.warning("request %s: the upstream stream broke off (%s)", request_id, type(e).__name__)
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

    async def aclose(self) -> None:
        await self._client.aclose()


class UpstreamError(Exception):
    """The upstream could not be reached or broke off (the ingress answers 502)."""
