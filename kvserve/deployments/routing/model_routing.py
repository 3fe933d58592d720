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

The rules and the upstream's settings are configuration (:class:`ModelRouting`,
:class:`UpstreamArgs`, in :mod:`kvserve.deployments.contract.routing_config`); this
module applies them.
"""

from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator

from kvserve.deployments.contract.routing_config import AUTO_MODEL, ModelRouting, RouteRule, UpstreamArgs

logger = logging.getLogger("ray.serve")

__all__ = [
    "AUTO_MODEL",
    "FALLBACK_CODES",
    "ModelRouting",
    "RouteRule",
    "Upstream",
    "UpstreamArgs",
    "UpstreamError",
    "user_text",
]

#: Error codes of the local path that send a request upstream (see :meth:`Upstream.applies`).
FALLBACK_CODES = frozenset({"queue_full", "model_unavailable", "timeout"})
#: Response headers of the upstream never passed on (hop-by-hop, or recomputed by our server).
_DROP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "server", "date"}
)


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
