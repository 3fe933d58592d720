"""Draft-model proposer for speculative decoding (``speculative_config={"method": "draft_model"}``).

A smaller model of the same vocabulary runs in the engine's process on the engine's device, with
its own :class:`kvserve.engine.model_runner.ModelRunner` and its own paged KV pool (same block size and
block-table scheme, its own :class:`kvserve.engine.kv_cache_manager.KVCacheManager`, as many blocks as
the target's pool so every running request fits). Each target request has a shadow
:class:`kvserve.engine.request.Request` here whose tokens mirror the target's.

One :meth:`DraftModelProposer.propose` call drafts greedily (the draft's argmax, so the draft
distribution is one-hot and rejection sampling in the target's sampler stays exact):

* round 0 feeds every token the draft has not computed yet (the whole prompt the first time,
  then the target's tokens since the last call) and takes the argmax after the last one;
* rounds ``1 .. k - 1`` feed the previous draft token, one query row per request.

The shadow's computed count then stays at the target's token count: draft K/V written for draft
positions is scratch, overwritten next call (the runner rewinds its token history to each
slice's ``start``), so rejected drafts need no rollback here.
"""

from __future__ import annotations

import dataclasses

from kvserve.engine.config import EngineConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.model_loader import load_config, resolve_model
from kvserve.engine.layers.w4a16 import W4_METHODS
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.engine.spec_config import SpeculativeConfig

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, detokenize=False)


class DraftModelProposer:
    """Drafts tokens with a small model (see the module docstring).

    Args:
        spec: the speculative config (``model``: the draft's folder or hub id).
        config: the target engine's config (device, dtype, block size, attention backend,
            quantization and KV cache dtype are shared).
        vocab_size: the target's vocabulary size; the draft's must be equal.
        num_blocks: KV blocks of the draft's pool (the target's count).

    Raises:
        ValueError: a draft with another vocabulary size, or ``tensor_parallel_size > 1`` (the
            draft runs in the engine's process, which a distributed executor leaves without the
            model's device).
    """

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, vocab_size: int, num_blocks: int):
        if config.tensor_parallel_size != 1:
            raise ValueError(
                "speculative_config method 'draft_model' needs tensor_parallel_size 1 "
                "(use method 'ngram' with tensor parallelism)"
            )
        path = str(resolve_model(spec.model))
        draft_vocab = load_config(path).vocab_size
        if draft_vocab != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
                f"({vocab_size}); speculative decoding needs the same tokenizer"
            )
        dcfg = dataclasses.replace(
            config,
            model=path,
            speculative_config=None,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=False,
            tensor_parallel_size=1,
            kv_offloading_size=None,
            enable_kv_cache_events=False,  # the target's pool alone has a tier and events
            # a 4-bit target's format is its checkpoint's: the draft's is read from its own
            quantization=None if config.quantization in W4_METHODS else config.quantization,
        )
        self.runner = ModelRunner(dcfg, path)
        self.runner.init_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Request] = {}
        self._finished: list[str] = []

    def forget(self, request_id: str) -> None:
        """The target request left the engine: free its draft blocks and runner state."""
        sh = self.shadows.pop(request_id, None)
        if sh is not None:
            self.kv.free(sh)
            self._finished.append(request_id)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Draft ``k`` tokens for each ``(target request, k)``; a request whose tokens do not
        fit the draft pool gets none (and its draft state is dropped). Returns
        ``{request_id: drafts}``."""
        first, states = [], []
        for req, k in wanted:
            sh = self.shadows.get(req.request_id)
            new = sh is None
            if new:
                sh = self.shadows[req.request_id] = Request(req.request_id, req.prompt_token_ids, _GREEDY)
            sh.all_token_ids = list(req.all_token_ids)
            start = min(sh.num_computed_tokens, len(sh.all_token_ids) - 1)
            sh.num_computed_tokens = start
            n = len(sh.all_token_ids) - start
            if not self.kv.allocate_slots(sh, n + k - 1):
                self.forget(req.request_id)
                continue
            first.append(
                ScheduledRequest(
                    req.request_id,
                    sh.all_token_ids[start:],
                    start,
                    list(sh.block_table),
                    sample=True,
                    new=NewRequestData(req.request_id, req.prompt_token_ids, _GREEDY, sh.all_token_ids[:start])
                    if new
                    else None,
                )
            )
            states.append((sh, k))
        drafts: dict[str, list[int]] = {}
        if not first:
            return drafts
        finished, self._finished = self._finished, []
        out = self.runner.execute_model(SchedulerOutput(first, finished))
        for sh, _ in states:
            drafts[sh.request_id] = [out.sampled[sh.request_id]]
            sh.num_computed_tokens = len(sh.all_token_ids)
        for j in range(1, max(k for _, k in states)):
            batch = [
                ScheduledRequest(
                    sh.request_id, [drafts[sh.request_id][-1]], sh.num_tokens + j - 1, list(sh.block_table), sample=True
                )
                for sh, k in states
                if k > j
            ]
            out = self.runner.execute_model(SchedulerOutput(batch))
            for sr in batch:
                drafts[sr.request_id].append(out.sampled[sr.request_id])
        return drafts
