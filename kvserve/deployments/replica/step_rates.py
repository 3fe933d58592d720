"""A replica's step rates and capacities, the numbers the autoscaler reads: :class:`StepRateTracker`."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

#: Seconds of recent engine steps behind the ``*_tokens_per_s`` rates.
RATE_WINDOW_S = 10.0
#: Seconds of recent "full-ish" steps behind the capacity estimates.
CAPACITY_WINDOW_S = 30.0


@dataclass(frozen=True)
class StepRates:
    """A replica's token rates and capacities, tokens per second (0: not measured yet), and
    the mean prompt (tokens) of the requests that got their first token over the last
    :data:`CAPACITY_WINDOW_S` (0: none)."""

    generation_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_capacity_tokens_per_s: float
    prefill_capacity_tokens_per_s: float
    served_prompt_tokens: float = 0.0


class StepRateTracker:
    """Rates and capacities from the engine's per-step :class:`kvserve.engine.stats.IterationStats`
    (registered as a stat logger of the engine).

    For every step it records its end time, the wall time of its cycle (from the end of the
    previous step when the engine ran back to back, else the model call alone), prefill and
    decode tokens computed, tokens sampled, and whether the step was "full-ish": its batch
    was at least half of ``max_num_seqs`` / ``max_num_batched_tokens``, or requests were still
    waiting when it ran (the replica was saturated). Capacities are measured only on such
    steps: ``decode capacity`` = sampled tokens / cycle time over full-ish decode steps,
    ``prefill capacity`` = computed tokens / cycle time over full-ish prefill steps, both over
    the last :data:`CAPACITY_WINDOW_S` (the last value is kept when no such step is recent;
    0 means "not measured yet").
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # (end, cycle s, prefill tokens, decode tokens, sampled, full decode, full prefill,
        #  prompt tokens of the requests that got their first token, how many did)
        self.steps: deque[tuple[float, float, int, int, int, bool, bool, int, int]] = deque()
        self.lock = threading.Lock()
        self.last_end = 0.0
        self.decode_capacity = 0.0
        self.prefill_capacity = 0.0
        self.created = time.monotonic()
        self.busy_s = 0.0  # seconds the engine spent in steps since the replica started (cycle times)

    def record(self, m) -> None:
        """Add one step (a ``IterationStats``; called in the engine's step thread)."""
        t0, t1, n_prefill, n_decode, n_sampled = (
            m.start,
            m.end,
            m.num_prefill_tokens,
            m.num_decode_tokens,
            m.num_sampled,
        )
        batch, waiting = m.num_running, m.num_waiting
        exec_s = t1 - t0
        back_to_back = self.last_end and (t0 - self.last_end) < max(0.005, 0.25 * exec_s)
        cycle = (t1 - self.last_end) if back_to_back else exec_s
        self.last_end = t1
        full_decode = n_decode > 0 and n_prefill == 0 and (batch >= max(2, self.max_num_seqs // 2) or waiting > 0)
        full_prefill = n_prefill > 0 and (n_prefill >= self.max_num_batched_tokens // 2 or waiting > 0)
        with self.lock:
            self.busy_s += max(cycle, 1e-6)
            self.steps.append(
                (
                    t1,
                    max(cycle, 1e-6),
                    n_prefill,
                    n_decode,
                    n_sampled,
                    full_decode,
                    full_prefill,
                    m.num_prompt_tokens,
                    len(m.time_to_first_tokens),
                )
            )
            horizon = t1 - max(RATE_WINDOW_S, CAPACITY_WINDOW_S)
            while self.steps and self.steps[0][0] < horizon:
                self.steps.popleft()

    def snapshot(self) -> "StepRates":
        """The rates over the last :data:`RATE_WINDOW_S` and the capacities (see the class)."""
        now = time.monotonic()
        with self.lock:
            steps = list(self.steps)
        window = max(1e-3, min(RATE_WINDOW_S, now - self.created))
        recent = [s for s in steps if s[0] >= now - RATE_WINDOW_S]
        gen = sum(s[4] for s in recent) / window
        pre = sum(s[2] for s in recent) / window
        cap_from = now - CAPACITY_WINDOW_S
        dec = [s for s in steps if s[5] and s[0] >= cap_from]
        if dec:
            self.decode_capacity = sum(s[4] for s in dec) / sum(s[1] for s in dec)
        pf = [s for s in steps if s[6] and s[0] >= cap_from]
        if pf:
            self.prefill_capacity = sum(s[2] + s[3] for s in pf) / sum(s[1] for s in pf)
        firsts = sum(s[8] for s in steps if s[0] >= cap_from)
        served = sum(s[7] for s in steps if s[0] >= cap_from) / firsts if firsts else 0.0
        return StepRates(gen, pre, self.decode_capacity, self.prefill_capacity, served)
