"""OpenAI API request bodies (pydantic) and the OpenAI error body. Response bodies are the
``openai`` package's own types (built by the gateway); what crosses to the replica is in
:mod:`kvserve.deployments.contract.types`.

Requests follow https://platform.openai.com/docs/api-reference (chat completions and legacy
completions): ``n``, ``logit_bias``, ``response_format`` (``json_object``, ``json_schema``),
``tools`` / ``tool_choice`` / ``parallel_tool_calls``, ``stream_options``
(``include_usage``, vLLM's ``continuous_usage_stats``), and on completions ``echo`` with
prompt logprobs, ``max_tokens: 0`` and ``best_of``; plus vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``chat_template_kwargs``) and structured
output fields (``structured_outputs`` as vLLM 0.10+ names it, and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``). Other fields
are accepted and ignored; :func:`unknown_fields` names them so the ingress can warn once per
field. ``suffix`` (insertion) is a 400: it would silently change the request's meaning.
kvserve's own ``cache`` field (``false`` or ``{"semantic": true|false}``) steers the ingress's
response caches (``kvserve/deployments/cache/``).

This module imports neither Ray nor the engine: it is shared by the ingress, the LLM server
and clients.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.openai_messages import ChatMessage, NamedToolChoice, ToolDef, reject_lone_surrogates
from kvserve.deployments.contract.types import MAX_N
from kvserve.engine.grammar_spec import check_limits
from kvserve.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams


# ---- shared request fields --------------------------------------------------------------------
#: Longest ``cache_salt`` a client may send, characters (the gateway adds the key's part).
MAX_CLIENT_CACHE_SALT = 512


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    #: vLLM's extension: every chunk carries the usage so far (guidellm sends it)
    continuous_usage_stats: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON schema (``strict`` is always honoured:
    the grammar enforces the schema whatever its value)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (default), ``json_object`` (any JSON object) or
    ``json_schema`` (output valid under the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


#: Keys of an engine ``structured_outputs`` spec (one per request).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class CacheOptions(BaseModel):
    """The ``cache`` object of a request (kvserve's extension; ``extra_body`` in the OpenAI
    SDK): ``semantic`` true asks for the semantic response cache (where the deployment runs
    it), false declines it; unset: the deployment's default (``kvserve/deployments/cache/``)."""

    model_config = ConfigDict(extra="forbid")
    semantic: bool | None = None


class _SamplingFields(BaseModel):
    """Sampling fields common to both endpoints (OpenAI names, then vLLM extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: the response caches: false = neither read nor write them; an object: see CacheOptions
    cache: bool | CacheOptions | None = None
    #: vLLM's prefix-cache salt: only requests with the same salt share cached prompt blocks (with
    #: API keys, within the key's own salt: kvserve.deployments.limits.KeyPolicy.cache_salt)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CLIENT_CACHE_SALT)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """A lone surrogate anywhere in the body (``"\\ud800"`` in the JSON) is a 400 naming the
        field, before any of it is encoded (tokenizers and UTF-8 writers reject such text)."""
        return reject_lone_surrogates(data)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        """Non-empty strings, at most ``MAX_STOP_STRINGS`` of at most ``MAX_STOP_STRING_CHARS``
        characters (the engine's limits, ``kvserve.engine.sampling_params``)."""
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed (MAX_STOP_STRINGS), got {len(items)}"
            )
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        longest = max(len(s) for s in items) if items else 0
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long "
                f"(MAX_STOP_STRING_CHARS), got one of {longest}"
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """OpenAI's map of token id (a decimal string) to a bias in [-100, 100], at most
        ``MAX_LOGIT_BIAS`` entries (whether the ids are in the vocabulary, the replica checks)."""
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed (MAX_LOGIT_BIAS), got {len(v)}")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ValueError(f"logit_bias keys are token ids (decimal strings), got {k[:20]!r}")
            if not (-100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {k}")
        return v

    @model_validator(mode="after")
    def _check_fields(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        self.structured_spec()  # at most one structured output constraint, well formed
        return self

    def structured_spec(self) -> dict[str, Any] | None:
        """The engine's ``structured_outputs`` spec (``{"json": schema}``, ``{"json_object":
        True}``, ``{"regex": ...}``, ``{"choice": [...]}`` or ``{"grammar": ...}``) from
        ``response_format``, ``structured_outputs`` or vLLM's ``guided_*`` fields; None for
        free text.

        Raises:
            ValueError: more than one constraint, a malformed one, or one over a size limit of
                :data:`~kvserve.engine.grammar_spec.DEFAULT_LIMITS` (the message names it).
        """
        specs = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            specs.append({"json_object": True})
        elif rf is not None and rf.type == "json_schema":
            specs.append({"json": rf.json_schema.json_schema})
        flexible = None
        if self.structured_outputs:
            so = {k: v for k, v in self.structured_outputs.items() if v is not None and v is not False}
            flexible = so.pop("whitespace_flexible", None)
            unknown = set(so) - set(STRUCTURED_KINDS)
            if unknown:
                raise ValueError(
                    f"structured_outputs: unknown key(s) {sorted(unknown)}; use one of {', '.join(STRUCTURED_KINDS)}"
                )
            specs.extend({k: v} for k, v in so.items())
        for field, kind in _GUIDED.items():
            v = getattr(self, field)
            if v is not None:
                specs.append({kind: v})
        if len(specs) > 1:
            raise ValueError(
                "give one structured output constraint (response_format, structured_outputs or "
                f"guided_*), got {len(specs)}"
            )
        if specs and "choice" in specs[0]:
            ch = specs[0]["choice"]
            if not isinstance(ch, list) or not ch or any(not isinstance(c, str) or not c for c in ch):
                raise ValueError("a choice constraint is a non-empty list of non-empty strings")
        if flexible and specs:  # any whitespace in JSON (the engine's default is compact JSON)
            specs[0]["whitespace_flexible"] = True
        if specs:  # sizes, before anything reaches a replica (the engine checks its own limits again)
            check_limits(specs[0])
        return specs[0] if specs else None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, **overrides: Any) -> SamplingParams:
        """The engine's :class:`~kvserve.engine.sampling_params.SamplingParams` of this request (as
        vLLM's ``to_sampling_params``); ``overrides`` replace fields (e.g. a tool grammar as
        ``structured_outputs``). ``n`` is not in it: the replica fans choices out.

        Raises:
            OpenAIError: 400 ``invalid_value`` for a value the engine cannot honour (the
                message names the field).
        """
        try:
            return SamplingParams(**{**self._sampling_fields(max_tokens, logprobs), **overrides})
        except ValueError as e:
            raise OpenAIError(str(e), 400, param=str(e).split(" ", 1)[0], code="invalid_value") from None

    def _sampling_fields(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
        }
        if self.top_k is not None:
            d["top_k"] = self.top_k
        if self.min_p is not None:
            d["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            d["repetition_penalty"] = self.repetition_penalty
        if self.logit_bias:
            d["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        spec = self.structured_spec()
        if spec is not None:
            d["structured_outputs"] = spec
        return d

    @property
    def include_usage(self) -> bool:
        return bool(
            self.stream_options and (self.stream_options.include_usage or self.stream_options.continuous_usage_stats)
        )

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def unknown_fields(body: BaseModel) -> list[str]:
    """Dotted names of the fields of a request body (and its messages) that no model
    declares: accepted and ignored (the ingress warns once per name)."""
    names = [k for k in (body.model_extra or {})]
    extra = body.model_extra or {}
    messages = getattr(body, "messages", None) if "messages" not in extra else None  # declared, not an extra field
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, BaseModel):
            names.extend(f"messages.{k}" for k in (m.model_extra or {}))
    options = getattr(body, "stream_options", None) if "stream_options" not in extra else None
    if isinstance(options, BaseModel):
        names.extend(f"stream_options.{k}" for k in (options.model_extra or {}))
    return sorted(set(names))


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    #: vLLM's: more variables for the chat template (e.g. ``{"enable_thinking": false}`` for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        taken = sorted(set(v or ()) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)} (the server sets them)")
        return v or None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools ({', '.join(names)})"
                )
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise ValueError("tools: function names must be unique")
        if self.forces_tool_call and self.structured_spec() is not None:
            raise ValueError(
                "tool_choice required / a named function cannot be combined with response_format "
                "or another structured output constraint"
            )
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``none`` without tools; else the request's choice (default ``auto``)."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    @property
    def forces_tool_call(self) -> bool:
        return self.effective_tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


#: Chat template variables the server sets itself: ``chat_template_kwargs`` may not name them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
        "tokenizer",
        "bos_token",
        "eos_token",
    }
)


# ---- completions ----------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    #: 0 with ``echo`` scores the prompt only (lm-evaluation-harness' loglikelihood requests)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token id prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best sequences are known only at the end)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo=true (scoring the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: a string, a token id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)
