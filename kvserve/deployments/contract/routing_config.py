"""How requests pick a model, as configuration: ``model: "auto"`` rules (:class:`RouteRule`,
:class:`ModelRouting`), the upstream fallback (:class:`UpstreamArgs`) and the gateway's routing
section (:class:`RoutingArgs`)."""

import os
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Name clients send to let the model router choose (``model: "auto"``).
AUTO_MODEL = "auto"


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


class RoutingArgs(BaseModel):
    """The model routing section of :class:`AppArgs`: ``model: "auto"`` and the upstream."""

    model_config = ConfigDict(extra="forbid")

    model_routing: Optional[ModelRouting] = Field(
        None,
        description='rules of `model: "auto"` (first match wins; kvserve/deployments/routing/model_routing.py): '
        "{rules: [{model, name, max_prompt_tokens, max_tokens, keywords, exclude_keywords}], "
        "default}; unset: no `auto` model",
    )
    upstream: Optional[UpstreamArgs] = Field(
        None,
        description="OpenAI-compatible fallback for requests the local models cannot take (all replicas "
        "at capacity or failing): {base_url, api_key (default $KVSERVE_UPSTREAM_API_KEY), "
        "models: {local: upstream name}, timeout_s}",
    )

    @model_validator(mode="after")
    def _upstream_key_from_env(self):
        if self.upstream is not None and not self.upstream.api_key:
            self.upstream.api_key = os.environ.get("KVSERVE_UPSTREAM_API_KEY", "").strip() or None
        return self
