"""The timings of a replica's recently finished requests (:class:`RecentRequests`), for its stats."""

from __future__ import annotations

from collections import OrderedDict


class RecentRequests:
    """Engine-side timings (``time.time()`` seconds) and token counts of the last ``limit``
    finished requests, by request id."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.by_id: OrderedDict[str, dict[str, float | None]] = OrderedDict()

    def add(self, out) -> None:
        """Record a finished ``engine.RequestOutput``."""
        m = out.metrics
        self.by_id[out.request_id] = {
            "arrival_time": m.arrival_time,
            "first_scheduled_time": m.first_scheduled_time,
            "first_token_time": m.first_token_time,
            "finished_time": m.finished_time,
            "engine_ttft_s": m.ttft,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_output_tokens": len(out.outputs[0].token_ids),
            "num_cached_tokens": m.num_cached_tokens,
        }
        while len(self.by_id) > self.limit:
            self.by_id.popitem(last=False)

    def get(self, request_ids: list[str] | None = None) -> dict[str, dict]:
        """Those of ``request_ids`` still held (all when None)."""
        if request_ids is None:
            return dict(self.by_id)
        return {r: self.by_id[r] for r in request_ids if r in self.by_id}
