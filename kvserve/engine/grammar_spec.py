"""The shape of a request's ``structured_outputs`` spec (vLLM 0.10's), checked without compiling;
its size against the engine's :class:`GrammarLimits`; a ``choice`` spec as a grammar.

Standard library only: :class:`kvserve.engine.sampling_params.SamplingParams` checks specs with
:func:`validate_spec` in processes that have neither torch nor xgrammar.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

#: The grammar kinds of a spec; exactly one per request.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: Options that may accompany a kind. ``whitespace_flexible`` (default False): JSON may carry
#: any whitespace between tokens (xgrammar's ``any_whitespace``); off, JSON is compact
#: (``{"a": 1, "b": [2, 3]}``), which keeps small models out of whitespace loops.
OPTIONS = ("whitespace_flexible",)


def validate_spec(spec) -> None:
    """Check the shape of ``SamplingParams.structured_outputs`` (no compilation).

    A dict with exactly one of: ``json`` (a JSON schema, dict or JSON string of an object),
    ``json_object`` (True: any JSON object), ``regex`` (a non-empty pattern string),
    ``choice`` (a non-empty list of non-empty strings), ``grammar`` (an EBNF / GBNF string,
    root rule ``root``); optionally ``whitespace_flexible`` (bool, JSON kinds only).

    Raises:
        ValueError: any other shape; the message starts with ``structured_outputs``.
    """
    if not isinstance(spec, dict):
        raise ValueError(
            f"structured_outputs must be a dict with one of the keys {', '.join(KINDS)}, got {type(spec).__name__}"
        )
    unknown = sorted(str(k) for k in spec if k not in KINDS + OPTIONS)
    if unknown:
        raise ValueError(f"structured_outputs has unknown key(s) {unknown}; allowed: {', '.join(KINDS + OPTIONS)}")
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs json must be a JSON schema object (a dict or a JSON string)")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs json is not JSON-serializable: {e}") from None
    elif kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs json_object must be True, got {value!r}")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs {kind} must be a non-empty string")
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or any(not isinstance(c, str) or not c for c in value):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
    ws = spec.get("whitespace_flexible", False)
    if not isinstance(ws, bool):
        raise ValueError(f"structured_outputs whitespace_flexible must be a bool, got {ws!r}")
    if ws and kind not in ("json", "json_object"):
        raise ValueError("structured_outputs whitespace_flexible applies to json and json_object only")


def choice_grammar(choices: list[str]) -> str:
    """EBNF (xgrammar / GBNF syntax) accepting exactly one of ``choices``. JSON string
    escapes are valid GBNF literal escapes (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a request's grammar and its compile (the engine config's
    ``structured_outputs_config`` keys; :meth:`from_dict`). Nothing bounds what a grammar costs
    to compile but its size, and not even that for a regex (a 4 KB regex of 200 alternatives of
    counted repeats takes xgrammar ~8 s): so the sizes are capped here, and the compile runs in a
    pool of its own under a deadline (:class:`kvserve.engine.bounded_pool.BoundedPool`).

    Attributes:
        max_choices: most strings in a ``choice`` list.
        max_choice_bytes: most UTF-8 bytes of a ``choice`` list's strings together.
        max_regex_bytes: longest ``regex``, UTF-8 bytes.
        max_grammar_bytes: longest ``grammar`` (EBNF / GBNF), UTF-8 bytes.
        max_json_schema_bytes: longest ``json`` schema, UTF-8 bytes of its JSON text.
        compile_timeout_s: a compile still running after this many seconds fails its request
            (400 naming the limit); xgrammar's C++ compile cannot be interrupted, so it runs on,
            its result ignored, in a thread outside the pool's count (at most
            ``compile_workers`` such threads at once).
        compile_workers: threads compiling at once.
        max_queued_compiles: compiles waiting for a thread; more are refused at once
            (:class:`kvserve.engine.bounded_pool.PoolFullError`, 429 through the server).
    """

    max_choices: int = 4096
    max_choice_bytes: int = 128 << 10
    max_regex_bytes: int = 16 << 10
    max_grammar_bytes: int = 128 << 10
    max_json_schema_bytes: int = 256 << 10
    compile_timeout_s: float = 10.0
    compile_workers: int = 2
    max_queued_compiles: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "compile_timeout_s":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
            else:
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
            if not ok:
                raise ValueError(
                    f"structured_outputs_config {f.name} must be a positive "
                    f"{'number of seconds' if f.name == 'compile_timeout_s' else 'integer'}, got {v!r}"
                )

    @classmethod
    def from_dict(cls, d: dict | None) -> "GrammarLimits":
        """The limits of an engine config's ``structured_outputs_config`` (None or ``{}``: the defaults).

        Raises:
            ValueError: an unknown key or a value out of range (the message names it).
        """
        if d is None:
            return cls()
        if isinstance(d, GrammarLimits):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs_config must be a dict, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unknown key(s) {unknown}; allowed: {', '.join(sorted(names))}"
            )
        return cls(**d)


#: The limits an engine without ``structured_outputs_config`` applies, and the gateway's.
DEFAULT_LIMITS = GrammarLimits()


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def check_limits(spec: dict, limits: GrammarLimits | None = None) -> None:
    """Check the size of a spec of :func:`validate_spec`'s shape against ``limits`` (default
    :data:`DEFAULT_LIMITS`), before anything is compiled.

    Raises:
        ValueError: over a limit; the message starts with ``structured_outputs`` and names the
            limit's key (e.g. ``max_choices``) and its value.
    """
    lim = limits or DEFAULT_LIMITS
    kind = next((k for k in KINDS if k in spec), None)
    value = spec.get(kind)

    def over(n: int, unit: str, key: str) -> None:
        cap = getattr(lim, key)
        if n > cap:
            raise ValueError(
                f"structured_outputs {kind} is too large: {n} {unit}, over the limit of {cap} "
                f"({key}, structured_outputs_config)"
            )

    if kind == "choice" and isinstance(value, (list, tuple)):
        over(len(value), "choices", "max_choices")
        over(sum(_utf8_len(c) for c in value if isinstance(c, str)), "bytes of choices", "max_choice_bytes")
    elif kind == "regex" and isinstance(value, str):
        over(_utf8_len(value), "bytes", "max_regex_bytes")
    elif kind == "grammar" and isinstance(value, str):
        over(_utf8_len(value), "bytes", "max_grammar_bytes")
    elif kind == "json" and value is not None:
        if isinstance(value, str):
            n = _utf8_len(value)
        else:
            try:
                n = _utf8_len(json.dumps(value))
            except (TypeError, ValueError):
                return  # validate_spec names that
        over(n, "bytes of schema", "max_json_schema_bytes")
