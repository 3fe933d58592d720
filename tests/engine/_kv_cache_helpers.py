"""What the KV cache and scheduler tests share (``test_kv_cache_manager.py``,
``test_scheduler.py``, ``test_scheduler_properties.py``): the EOS id and a request factory."""

from __future__ import annotations

from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams

EOS = 0


def make_req(rid, prompt, max_tokens=4, priority=0, arrival=None, max_model_len=1 << 30, **kw):
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **kw),
        eos_token_ids={EOS},
        priority=priority,
        arrival_time=arrival,
        max_model_len=max_model_len,
    )
