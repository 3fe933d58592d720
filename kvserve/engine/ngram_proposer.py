"""The n-gram proposer of speculative decoding: prompt lookup decoding (Saxena 2023).

The request's own text is the draft model: the continuation of the latest earlier occurrence of
its last ``n`` tokens is proposed as the next tokens.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Prompt lookup decoding: find the latest earlier occurrence of the last ``n`` tokens
    (``n`` from ``max_n`` down to ``min_n``) in the request's prompt + output, and propose the
    tokens that followed it (up to ``k``). Vectorised with numpy (one sliding-window compare per
    ``n``), so a step's lookups stay off the critical path."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens for the sequence ``token_ids`` (empty: no match)."""
        L = len(token_ids)
        if k <= 0 or L < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0..L-1-n
            hits = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence; its continuation
                return arr[start : start + k].tolist()
        return []
