"""Both engine fronts are an :class:`kvserve.engine.protocol.EngineClient`: the in-process
``AsyncLLMEngine`` and the engine core process's ``MPAsyncLLMEngine``, built on the tiny model."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.config import EngineConfig
from kvserve.engine.core_client import MPAsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.protocol import EngineClient

pytestmark = pytest.mark.slow

MEMBERS = sorted({n for n in dir(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__))


def _config(path):
    return EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=64)


def _check(front) -> None:
    assert isinstance(front, EngineClient)
    missing = [n for n in MEMBERS if not hasattr(front, n)]
    assert not missing, missing
    for name in MEMBERS:  # what the protocol calls awaitable is awaitable on the front
        attr = getattr(type(front), name, None)
        if name == "generate":
            assert inspect.isasyncgenfunction(attr), name
        elif name in (
            "embed",
            "encode",
            "apply_chat_template",
            "kv_cache_snapshot",
            "reset_prefix_cache",
            "export_kv_blocks",
            "import_kv_blocks",
            "check_health_async",
            "shutdown",
        ):
            assert inspect.iscoroutinefunction(attr), name
    assert front.hf_config.vocab_size > 0 and front.config.max_model_len == 64


def test_the_in_process_front_is_an_engine_client(tiny_llama_path):
    async def body():
        front = AsyncLLMEngine(LLMEngine(_config(tiny_llama_path)))
        try:
            _check(front)
        finally:
            await front.shutdown()

    asyncio.run(body())


def test_the_core_process_front_is_an_engine_client(tiny_llama_path):
    async def body():
        front = await asyncio.to_thread(MPAsyncLLMEngine.from_config, _config(tiny_llama_path), None, 1)
        try:
            _check(front)
        finally:
            await front.shutdown()

    asyncio.run(body())
