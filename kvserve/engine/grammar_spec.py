"""The shape of a request's ``structured_outputs`` spec (vLLM 0.10's), checked without compiling;
a ``choice`` spec as a grammar.

Standard library only: :class:`kvserve.engine.sampling_params.SamplingParams` checks specs with
:func:`validate_spec` in processes that have neither torch nor xgrammar.
"""
from __future__ import annotations

import json

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
        raise ValueError(f"structured_outputs must be a dict with one of the keys {', '.join(KINDS)}, "
                         f"got {type(spec).__name__}")
    unknown = sorted(str(k) for k in spec if k not in KINDS + OPTIONS)
    if unknown:
        raise ValueError(f"structured_outputs has unknown key(s) {unknown}; "
                         f"allowed: {', '.join(KINDS + OPTIONS)}")
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
        if (not isinstance(value, (list, tuple)) or not value
                or any(not isinstance(c, str) or not c for c in value)):
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
