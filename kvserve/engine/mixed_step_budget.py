"""How many prefill tokens may ride along with a step's decodes: :class:`MixedStepBudget`, an online estimate of the prefill cost per token from the engine's own step times, capped so a mixed step stays within a slowdown of a pure decode step."""

from __future__ import annotations

import math
import statistics
from collections import deque


class MixedStepBudget:
    """Sizes the prefill tokens of a step that also carries decodes from measured step times,
    so that it takes at most ``slowdown`` x a decode-only step (the token budget of
    Sarathi-Serve's stall-free batching, Agrawal et al. 2024, sec. 4.3, measured online
    instead of profiled).

    Cost model: ``t = D + n_prefill * b`` seconds, with ``D`` the median of the last
    :attr:`DECODE_WINDOW` decode-only step times (a median, so a few slow steps from a busy
    host do not inflate the target) and ``b`` (seconds per prefill token) a ratio of decayed sums over
    steps with prefill: ``sum(t - D [if the step had decodes]) / sum(n_prefill)``, so large
    chunks weigh most and the attention cost of long contexts is tracked as it grows. A
    prefill-only step counts its whole time (a slight overestimate of ``b``: conservative).
    Then ``tokens = (slowdown - 1) * D / b``, clamped to ``[min_tokens, max_tokens]``. If
    mixed steps carry a fixed overhead ``E`` (e.g. eager mode beside CUDA-graph decodes), the
    iteration still converges to steps of ``slowdown * D``. Until both ``D`` and ``b`` have
    been measured the budget is ``initial_tokens``.

    Args:
        slowdown: target ratio (> 1) of a mixed step's time to a decode-only step's.
        max_tokens: upper clamp (the step budget, ``max_num_batched_tokens``).
        min_tokens: lower clamp, so prefills always progress (tokens). Small: deep into a long
            prompt a chunk's attention over the whole context costs far more per token than at
            its start (``benchmarks/long_prefill.py``), so the target may need small chunks.
        initial_tokens: budget before measurements (tokens).
        alpha: weight of the newest step in the averages.
    """

    #: Decode-only steps behind the median ``D``.
    DECODE_WINDOW = 32

    @classmethod
    def for_config(cls, config) -> "MixedStepBudget | None":
        """The automatic cap an :class:`kvserve.engine.config.EngineConfig` asks for, or None (no budget).

        None where ``mixed_step_prefill_tokens`` is set, and where CUDA graphs are asked for
        (``config.cuda_graphs``): there decode-only steps replay graphs while a mixed step runs
        eagerly, so the mixed step's launch overhead (many times a replayed decode step's) would
        be read as prefill cost and the cap would fall to ``min_tokens``: long prompts would then
        prefill ``min_tokens`` per step (seen on a lent GPU, ``benchmarks/gpu.py``). There
        chunks are bounded by ``max_num_batched_tokens`` alone, as in vLLM by default.
        """
        if config.mixed_step_prefill_tokens is not None or config.cuda_graphs:
            return None
        return cls(config.mixed_step_slowdown, config.max_num_batched_tokens)

    def __init__(
        self, slowdown: float, max_tokens: int, min_tokens: int = 8, initial_tokens: int = 256, alpha: float = 0.2
    ):
        self.slowdown, self.alpha = slowdown, alpha
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.initial_tokens = min(initial_tokens, max_tokens)
        self._decode_times: deque[float] = deque(maxlen=self.DECODE_WINDOW)
        self._prefill_s = 0.0  # decayed sum of prefill seconds
        self._prefill_n = 0.0  # decayed sum of prefill tokens

    def record(self, seconds: float, num_prefill_tokens: int, num_decodes: int) -> None:
        """Add one step's wall time (seconds) and its token counts. A time that is not finite
        or is negative (a clock that jumped) is ignored."""
        if not (isinstance(seconds, (int, float)) and 0.0 <= seconds < math.inf):
            return
        a = self.alpha
        if num_prefill_tokens == 0:
            if num_decodes:
                self._decode_times.append(seconds)
            return
        if num_decodes and self.decode_s is None:
            return  # cannot split a mixed step's time yet
        prefill_s = max(seconds - (self.decode_s if num_decodes else 0.0), 0.0)
        self._prefill_s = (1 - a) * self._prefill_s + a * prefill_s
        self._prefill_n = (1 - a) * self._prefill_n + a * num_prefill_tokens

    @property
    def decode_s(self) -> float | None:
        """``D``: median seconds of the recent decode-only steps (None before the first)."""
        return statistics.median(self._decode_times) if self._decode_times else None

    @property
    def seconds_per_prefill_token(self) -> float | None:
        return self._prefill_s / self._prefill_n if self._prefill_n else None

    @property
    def tokens(self) -> int:
        """Prefill tokens allowed in the next step that carries decodes: an integer in
        ``[min_tokens, max_tokens]`` whatever the recorded times were."""
        b = self.seconds_per_prefill_token
        if self.decode_s is None or b is None:
            return self.initial_tokens
        if b <= 0:
            return self.max_tokens
        tokens = (self.slowdown - 1) * self.decode_s / b
        if not math.isfinite(tokens):  # b underflowed to a denormal: prefill is free
            return self.max_tokens
        return int(max(self.min_tokens, min(self.max_tokens, tokens)))
