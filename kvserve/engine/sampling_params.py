"""Per-request sampling parameters (the vLLM / OpenAI set)."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field

from kvserve.engine.grammar_spec import validate_spec

# torch.Generator.manual_seed takes a uint64, or an int64 that it reads as two's complement
# (seed -1 is seed 2**64 - 1); anything outside raises inside the engine step.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def _limit(env: str, default: int) -> int:
    """A positive integer limit from the environment variable ``env`` (``default`` if unset).

    Raises:
        ValueError: the variable is set to something other than a positive integer.
    """
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{env} must be a positive integer, got {raw!r}")
    return int(raw)


# Per-request work limits: each stop string is searched for after every token, and the
# logit_bias is added to the logits at every step, so their sizes bound what one request makes
# every step of the batch cost. Defaults an OpenAI / vLLM client fits in: OpenAI takes up to 4
# stop sequences and documents no logit_bias count (values -100..100); vLLM bounds neither.
# Set the environment variables in the server's processes (gateway and replicas) to change them.
#: Most stop strings of one request (``KVSERVE_MAX_STOP_STRINGS``, default 64).
MAX_STOP_STRINGS = _limit("KVSERVE_MAX_STOP_STRINGS", 64)
#: Longest stop string, characters (``KVSERVE_MAX_STOP_STRING_CHARS``, default 256; the stream
#: holds back up to this many characters minus one until it knows no stop string starts there).
MAX_STOP_STRING_CHARS = _limit("KVSERVE_MAX_STOP_STRING_CHARS", 256)
#: Most ``logit_bias`` entries of one request (``KVSERVE_MAX_LOGIT_BIAS``, default 1024).
MAX_LOGIT_BIAS = _limit("KVSERVE_MAX_LOGIT_BIAS", 1024)
#: Most ``stop_token_ids`` of one request (``KVSERVE_MAX_STOP_TOKEN_IDS``, default 1024; a grammar's
#: step checks them against what it allows).
MAX_STOP_TOKEN_IDS = _limit("KVSERVE_MAX_STOP_TOKEN_IDS", 1024)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k`` -1 or 0 disables top-k; a ``top_k`` at or
    above the vocabulary size keeps every token (the sampler clamps it). ``top_p == 1`` and
    ``min_p == 0`` disable nucleus / min-p filtering; a ``top_p`` so small that it rounds to
    0 in float32 keeps the single most likely token. ``presence_penalty`` and
    ``frequency_penalty`` follow the OpenAI definition (subtracted from the logits of tokens
    already generated); ``repetition_penalty`` follows CTRL (Keskar et al. 2019, sec. 4.1) as
    in HF transformers (prompt and generated tokens). ``logprobs=k`` returns the top-k
    log-probabilities of every sampled position. ``seed`` (in ``[-2**63, 2**64 - 1]``, what
    ``torch.Generator.manual_seed`` takes; a negative seed ``s`` is the seed ``s + 2**64``)
    gives the request its own ``torch.Generator``: same seed, same output, whatever the
    batch. ``detokenize=False`` returns token ids only (benchmarks; no stop strings).

    ``max_tokens=0`` computes the prompt only (e.g. for ``prompt_logprobs``) and finishes with
    ``finish_reason="length"`` and no output token. ``logit_bias`` (OpenAI's): ``{token_id:
    bias}`` with biases in ``[-100, 100]`` added to the logits before sampling (after the
    penalties; returned logprobs stay the model's raw distribution), at most
    :data:`MAX_LOGIT_BIAS` entries. ``stop``: at most :data:`MAX_STOP_STRINGS` strings of at
    most :data:`MAX_STOP_STRING_CHARS` characters each. ``prompt_logprobs=k``
    (vLLM's; ``0..20``) returns, per prompt token, its log-probability given the tokens before
    it plus the top-k (``RequestOutput.prompt_logprobs``); such a request skips prefix-cache
    hits (it needs the logits of every prompt position).

    ``structured_outputs`` (vLLM 0.10's): constrain the output to a grammar, a dict with
    exactly one of ``json`` (a JSON schema, dict or string), ``json_object`` (True),
    ``regex``, ``choice`` (list of strings) or ``grammar`` (EBNF), see
    :func:`kvserve.engine.grammar_spec.validate_spec`. ``reasoning_end_token_ids``: the grammar applies
    only after these tokens appear in the output (a reasoning model's end of thinking, e.g.
    ``</think>``: what vLLM's reasoning parser tells its structured-output manager); the tokens
    before, the reasoning, are free. None: from the first token.

    Integer fields take ints only (not bool, not float); float fields take finite ints or
    floats (never NaN or inf, stored as float); flags take bools. Token ids are checked
    against the model's vocabulary by ``LLMEngine.make_request``.

    Raises:
        ValueError: a value the engine cannot honour; the message starts with the field name.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: dict | None = None
    reasoning_end_token_ids: list[int] | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str):
            try:
                got = repr(getattr(self, name))
            except ValueError:  # an int past Python's 4300-digit str limit
                got = "a huge integer"
            raise ValueError(f"{name} {why}, got {got if len(got) <= 60 else got[:57] + '...'}")

        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def real(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if (
                not isinstance(v, numbers.Real)
                or isinstance(v, bool)
                or not (isinstance(v, numbers.Integral) or math.isfinite(v))
            ):
                bad(name, "must be a finite number")
            if not (lo < v if lo_open else lo <= v) or not v <= hi:
                bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
            setattr(self, name, float(v))

        def integer(name: str, lo: int, hi: float, why: str, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if not is_int(v) or not lo <= v <= hi:
                bad(name, why)
            setattr(self, name, int(v))

        integer("n", 1, 1, "must be 1 (parallel sampling is not supported)")
        real("temperature", 0.0, 2.0)
        real("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", -1, math.inf, "must be -1 (disabled), 0 (disabled) or a positive integer")
        real("min_p", 0.0, 1.0)
        integer("max_tokens", 0, math.inf, "must be a non-negative integer", optional=True)
        integer("min_tokens", 0, math.inf, "must be in [0, max_tokens]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        real("repetition_penalty", 0.0, 10.0, lo_open=True)
        integer("logprobs", 0, 20, "must be in [0, 20]", optional=True)
        integer("prompt_logprobs", 0, 20, "must be in [0, 20]", optional=True)
        if self.logit_bias is not None:
            b = self.logit_bias
            if isinstance(b, dict) and len(b) > MAX_LOGIT_BIAS:  # before any per-entry work
                raise ValueError(
                    f"logit_bias has {len(b)} entries; at most {MAX_LOGIT_BIAS} are allowed (MAX_LOGIT_BIAS)"
                )
            if not isinstance(b, dict) or any(not is_int(t) or t < 0 for t in b):
                bad("logit_bias", "must be a dict of non-negative integer token ids to numbers")
            if any(not isinstance(v, numbers.Real) or isinstance(v, bool) or not -100 <= v <= 100 for v in b.values()):
                bad("logit_bias", "values must be numbers in [-100, 100]")
            self.logit_bias = {int(t): float(v) for t, v in b.items()} or None
        integer("seed", SEED_MIN, SEED_MAX, f"must be an integer in [{SEED_MIN}, {SEED_MAX}]", optional=True)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if not isinstance(self.extra, dict):
            bad("extra", "must be a dict")
        if self.structured_outputs is not None:  # its shape only; LLMEngine.make_request compiles it
            validate_spec(self.structured_outputs)
        r = self.reasoning_end_token_ids
        if r is not None and (not isinstance(r, (list, tuple)) or not r or any(not is_int(t) or t < 0 for t in r)):
            bad("reasoning_end_token_ids", "must be a non-empty list of non-negative integer token ids")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, (list, tuple)) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed (MAX_STOP_STRINGS)"
            )
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long "
                f"(MAX_STOP_STRING_CHARS), got one of {longest}"
            )
        self.stop = list(self.stop)
        if self.stop and not self.detokenize:
            bad("stop", "needs detokenize=True")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                "allowed (MAX_STOP_TOKEN_IDS)"
            )  # before any per-entry work
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
            not is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
