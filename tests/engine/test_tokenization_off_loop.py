"""Tokenization runs off the async engine's event loop: while a huge prompt is tokenized, the loop
keeps ticking and another stream keeps getting tokens (tiny Llama)."""
from __future__ import annotations

import asyncio

import pytest

from _hardening_helpers import PROMPTS, arun, collect
from kvserve.engine import SamplingParams
from kvserve.engine.llm_engine import chat_template_ids


def test_tokenization_does_not_stall_the_event_loop(tiny_llama_path):
    text = "The quick brown fox jumps over the lazy dog. " * 30000  # ~1.35 MB, ~300k tokens

    async def body(eng):
        loop = asyncio.get_running_loop()
        # another stream runs while the huge prompt is tokenized
        tokens_during = []
        big_running = asyncio.Event()

        async def streamer():
            async for o in eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True,
                                                                    detokenize=False), request_id="bg"):
                if big_running.is_set():
                    tokens_during.append(loop.time())
        bg = asyncio.create_task(streamer())
        while eng.engine.scheduler.requests.get("bg") is None:
            await asyncio.sleep(0.01)

        lag = {"max": 0.0}
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                t = loop.time()
                await asyncio.sleep(0.01)
                lag["max"] = max(lag["max"], loop.time() - t - 0.01)

        tick = asyncio.create_task(ticker())
        big_running.set()
        t0 = loop.time()
        with pytest.raises(ValueError, match="max_model_len"):  # too long, found after tokenizing it
            await collect(eng.generate(text, SamplingParams(max_tokens=1)))
        took = loop.time() - t0
        stop.set()
        await tick
        n_during = len(tokens_during)
        bg.cancel()
        msgs = [{"role": "user", "content": "hi there"}]
        ids = await eng.apply_chat_template(msgs)
        return took, lag["max"], n_during, ids, eng.tokenizer, msgs

    took, max_lag, n_during, ids, tok, msgs = arun(body, tiny_llama_path)
    assert took > 0.3, took  # tokenizing took long enough to matter
    assert max_lag < took / 4 and max_lag < 0.25, (max_lag, took)
    assert n_during >= 5  # the other stream kept getting tokens
    assert ids == chat_template_ids(tok, msgs)
