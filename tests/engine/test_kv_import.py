"""KV blocks out of one engine and into another (``LLMEngine.export_kv_blocks`` /
``import_kv_blocks``, the engine's half of the cluster tier, ``kvserve/engine/kv_connector.py``).

The reference is an engine without prefix caching (every token computed): an engine that
loads a prompt's blocks computed by another engine must answer the same greedy tokens, hold
the same bytes in its pool as the engine that computed them, and must have loaded them (the
imported hit counter), or the test could pass with the import doing nothing.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from test_kv_offload import (
    BS,
    PROMPTS,
    ROOT,
    _shared_hash_seed,  # noqa: F401  (the fixture)
    assert_no_leak,
    chain,
    lora_setup,  # noqa: F401
    run_rounds,
    tier_engine,
)

ONE = SamplingParams(max_tokens=1, temperature=0)


def reference(path, **kw):
    return run_rounds(
        LLM(
            model=str(path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            block_size=BS,
            enable_prefix_caching=False,
            **kw,
        ),
        PROMPTS[:2],
        rounds=1,
    )[0]


def pool_bytes(llm, hashes):
    kv, runner = llm.engine.scheduler.kv, llm.engine.executor.runner
    return [[(k[kv.pool.lookup(h)].clone(), v[kv.pool.lookup(h)].clone()) for k, v in runner.kv_caches] for h in hashes]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_blocks_another_engine_computed_load_bit_identical(tiny_llama_path, kv_dtype):
    kw = dict(kv_cache_dtype="fp8", attention_backend="torch") if kv_dtype == "fp8" else {}
    ref = reference(tiny_llama_path, **kw)
    a, b = tier_engine(tiny_llama_path, **kw), tier_engine(tiny_llama_path, **kw)
    a.generate(PROMPTS[:2], ONE, use_tqdm=False)
    hashes = chain(PROMPTS[0])[:6] + chain(PROMPTS[1])[:6]  # the blocks a request reuses (one token left)
    copies = a.engine.export_kv_blocks(hashes + [12345])  # an unknown hash is skipped
    assert [c.block_hash for c in copies] == hashes
    assert all(c.nbytes == a.engine.kv_block_bytes for c in copies)
    assert b.engine.import_kv_blocks(copies) == 12
    assert b.engine.import_kv_blocks(copies) == 0  # held already
    assert run_rounds(b, PROMPTS[:2], rounds=1)[0] == ref
    stats = b.engine.get_stats()
    assert stats["kv_offload_imported_blocks"] == 12 and stats["kv_offload_imported_hit_tokens"] == 12 * BS
    assert stats["num_prompt_tokens"] - stats["kv_offload_hit_tokens"] == 2 * 2  # 2 computed tokens per prompt
    for (ka, va), (kb, vb) in zip(sum(pool_bytes(a, hashes), []), sum(pool_bytes(b, hashes), [])):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert_no_leak(b)


def test_imports_keep_the_adapters_chain_apart(tmp_path_factory):
    from kvserve.engine.kv_cache_manager import request_root

    base, adapter, kw, plain = lora_setup(tmp_path_factory, "import_lora")
    ref_lora = run_rounds(plain, PROMPTS[:1], rounds=1, lora=adapter)[0]
    ref_base = run_rounds(plain, PROMPTS[:1], rounds=1)[0]
    assert ref_lora != ref_base
    a, b = tier_engine(base, **kw), tier_engine(base, **kw)
    a.generate(PROMPTS[:1], ONE, use_tqdm=False, lora_request=adapter)
    copies = a.engine.export_kv_blocks(chain(PROMPTS[0], root=request_root(ROOT, adapter))[:6])
    assert len(copies) == 6 and copies[0].meta[3] == 1  # LoRA id in the block's metadata
    assert b.engine.import_kv_blocks(copies) == 6
    assert run_rounds(b, PROMPTS[:1], rounds=1)[0] == ref_base  # the base model does not take the adapter's KV
    assert b.engine.get_stats()["kv_offload_imported_hit_tokens"] == 0
    assert run_rounds(b, PROMPTS[:1], rounds=1, lora=adapter)[0] == ref_lora
    assert b.engine.get_stats()["kv_offload_imported_hit_tokens"] == 6 * BS
    assert_no_leak(b)


def test_blocks_of_another_layout_or_without_a_tier_are_refused(tiny_llama_path, tmp_path_factory):
    from tiny_models import make_tiny_model

    a = tier_engine(tiny_llama_path)
    a.generate(PROMPTS[:1], ONE, use_tqdm=False)
    copies = a.engine.export_kv_blocks(chain(PROMPTS[0])[:6])
    no_tier = LLM(model=str(tiny_llama_path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=BS)
    with pytest.raises(ValueError, match="host tier"):
        no_tier.engine.import_kv_blocks(copies)
    other = tier_engine(make_tiny_model(tmp_path_factory.mktemp("import_other"), num_hidden_layers=1))
    with pytest.raises(ValueError, match="another size"):
        other.engine.import_kv_blocks(copies)
    tier = other.engine.scheduler.kv.host_tier
    assert len(tier) == 0 and not tier.imported  # nothing changed
    tier.check()


def test_tensor_parallel_ranks_export_and_import_their_shares(tmp_path_factory):
    from tiny_models import SMOLLM2_HEADS, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("import_tp"), **SMOLLM2_HEADS)
    ref = reference(path)
    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    a, b = tier_engine(path, **tp), tier_engine(path, **tp)
    try:
        a.generate(PROMPTS[:2], ONE, use_tqdm=False)
        copies = a.engine.export_kv_blocks(chain(PROMPTS[0])[:6] + chain(PROMPTS[1])[:6])
        assert len(copies) == 12 and all(len(c.shards) == 2 for c in copies)
        assert copies[0].nbytes == a.engine.kv_block_bytes  # each rank's KV heads (3 over 2 ranks: 2 and 1)
        assert copies[0].shards[0].nbytes != copies[0].shards[1].nbytes
        single = tier_engine(path)
        with pytest.raises(ValueError, match="parallel layout"):
            single.engine.import_kv_blocks(copies)
        assert b.engine.import_kv_blocks(copies) == 12
        assert run_rounds(b, PROMPTS[:2], rounds=1)[0] == ref
        assert b.engine.get_stats()["kv_offload_imported_hit_tokens"] == 12 * BS
        assert_no_leak(b)
    finally:
        a.engine.shutdown()
        b.engine.shutdown()


def test_the_core_process_front_exports_and_imports(tiny_llama_path):
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.core_client import MPAsyncLLMEngine

    ref = reference(tiny_llama_path)
    cfg = EngineConfig(
        model=str(tiny_llama_path),
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        block_size=BS,
        kv_offloading_size=0.01,
    )
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def body():
        a, b = await asyncio.gather(
            asyncio.to_thread(MPAsyncLLMEngine.from_config, cfg), asyncio.to_thread(MPAsyncLLMEngine.from_config, cfg)
        )
        try:
            async for _ in a.generate(PROMPTS[0], ONE, request_id="a"):
                pass
            copies = await a.export_kv_blocks(chain(PROMPTS[0])[:6])
            assert await b.import_kv_blocks(copies) == 6
            out = None
            async for o in b.generate(PROMPTS[0], sp, request_id="b"):
                out = o
            assert list(out.outputs[0].token_ids) == list(ref[0])
            assert b.get_stats()["kv_offload_imported_hit_tokens"] == 6 * BS
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())

    asyncio.run(body())
