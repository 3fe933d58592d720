"""Per-request sampling parameters (the vLLM / OpenAI set)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) disables top-k, ``top_p == 1``
    and ``min_p == 0`` disable nucleus / min-p filtering. ``presence_penalty`` and
    ``frequency_penalty`` follow the OpenAI definition (subtracted from the logits of tokens
    already generated); ``repetition_penalty`` follows CTRL (Keskar et al. 2019, sec. 4.1) as
    in HF transformers (prompt and generated tokens). ``logprobs=k`` returns the top-k
    log-probabilities of every sampled position. ``seed`` gives the request its own
    ``torch.Generator``: same seed, same output, whatever the batch. ``detokenize=False``
    returns token ids only (benchmarks; no stop strings).

    Raises:
        ValueError: an out-of-range value; the message names the field.
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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.n != 1:
            bad("n", "must be 1 (parallel sampling is not supported)")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", "must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be a positive integer")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        if self.stop and not self.detokenize:
            bad("stop", "needs detokenize=True")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
