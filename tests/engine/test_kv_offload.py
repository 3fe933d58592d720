"""The host tier below the KV pool (``kvserve/engine/kv_offload.py``) and KV cache events
(``kvserve/engine/kv_events.py``).

Bookkeeping tests drive :class:`KVCacheManager` without a model. Engine tests run a tiny model
with a pool too small for its prompts, so cached prefixes are evicted and come back: greedy
outputs with the tier must equal an engine without any prefix caching (nothing reused, every
token computed), a block loaded back must hold the bytes it held when it was evicted, and the
tier must have been used (hits counted), or the test could pass with the tier doing nothing.
Variants: float8 KV, LoRA-keyed blocks, preemption, tensor parallelism, the ``mmap`` backend.
"""

from __future__ import annotations

import pytest
import torch

from _kv_cache_helpers import make_req
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.kv_cache_manager import (
    HASH_SEED_ENV,
    KVCacheManager,
    chain_hashes,
    hash_block,
    lora_root_hash,
    root_hash,
)
from kvserve.engine.kv_events import (
    MEDIUM_HOST,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
)
from kvserve.engine.kv_offload import HostKVTier, KVTransfer

BS = 4
#: every engine and manager of these tests hashes from this seed (the autouse fixture below)
SEED = "kv-offload-tests"
ROOT = root_hash(SEED)


@pytest.fixture(autouse=True)
def _shared_hash_seed(monkeypatch):
    monkeypatch.setenv(HASH_SEED_ENV, SEED)


def computed(kv: KVCacheManager, req, n=None):
    """Schedule ``req`` as the scheduler does and mark ``n`` (default all) tokens computed."""
    hits = kv.get_computed_blocks(req)
    loads = kv.get_offloaded_blocks(req, len(hits))
    assert kv.allocate_slots(req, req.num_tokens - (len(hits) + len(loads)) * BS, hits, loads)
    req.num_computed_tokens = req.num_tokens if n is None else n
    kv.cache_blocks(req)
    return hits, loads


def chain(tokens, bs=BS, root=ROOT):
    return chain_hashes(tokens, bs, len(tokens) // bs, root)


# --------------------------------------------------------------------------- bookkeeping


def test_an_evicted_block_is_saved_and_a_later_hit_loads_it_back():
    events = KVEventRecorder()
    kv = KVCacheManager(num_blocks=4, block_size=BS, events=events, host_tier=HostKVTier(8, events))
    a = make_req("a", range(1, 14))  # 3 full blocks + 1 token
    computed(kv, a)
    hashes = chain(list(range(1, 14)))
    a_blocks = a.block_table[:3]
    kv.free(a)
    assert kv.take_transfer() is None  # nothing evicted yet
    b = make_req("b", range(100, 113))
    computed(kv, b)  # needs all 4 blocks: evicts a's 3 cached blocks
    t = kv.take_transfer()
    assert sorted(blk for blk, _ in t.saves) == sorted(a_blocks) and not t.loads
    assert all(h in kv.host_tier for h in hashes)
    kv.free(b)
    a2 = make_req("a2", range(1, 14))
    hits, loads = computed(kv, a2)
    assert hits == [] and loads == hashes  # the pool lost them, the tier has them
    t = kv.take_transfer()
    assert [kv.host_tier.lru[h] for h in hashes] == [s for s, _ in t.loads]
    assert [blk for _, blk in t.loads] == a2.block_table[:3]
    assert kv.host_hits == 12 and a2.metrics.num_cached_tokens == 12
    assert [kv.pool.lookup(h) for h in hashes] == a2.block_table[:3]  # cached in the pool again
    # b's blocks went to the tier when a2 took them; a2's loads were pinned against those saves
    assert set(t.saves) and {s for _, s in t.saves}.isdisjoint({s for s, _ in t.loads})
    kv.check([a2])


def test_saves_never_overwrite_a_slot_the_same_step_loads_from():
    tier = HostKVTier(3)
    kv = KVCacheManager(num_blocks=3, block_size=BS, host_tier=tier)
    a = make_req("a", range(1, 10))  # 2 full blocks
    computed(kv, a)
    kv.free(a)
    b = make_req("b", range(50, 59))
    computed(kv, b)  # evicts both of a's blocks into slots
    kv.free(b)
    kv.take_transfer()
    c = make_req("c", range(70, 75))  # evicts a block of b: the tier holds a, a, b -> full
    computed(kv, c)
    kv.free(c)
    kv.take_transfer()
    assert len(tier) == 3
    a2 = make_req("a2", range(1, 10))
    hits, loads = computed(kv, a2)
    t = kv.take_transfer()
    loaded = {s for s, _ in t.loads}
    assert len(loads) == 2 and not loaded & {s for _, s in t.saves}
    tier.check()


def test_the_tier_evicts_least_recently_used_and_says_so():
    events = KVEventRecorder()
    tier = HostKVTier(2, events)
    for i, h in enumerate((11, 12, 13)):
        tier.save(i, h, (None, [i] * BS, BS, None))
    assert list(tier.lru) == [12, 13]
    batch = events.take(0.0)
    assert [type(e) for e in batch.events] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert batch.events[2] == BlockRemoved([11], MEDIUM_HOST)
    assert all(e.medium == MEDIUM_HOST for e in batch.events)
    assert tier.take() == KVTransfer(saves=[(0, 0), (1, 1), (2, 0)])


def test_blocks_inserted_from_outside_and_discarded_leave_no_trace():
    """An import whose bytes could not be written is undone (``LLMEngine.import_kv_blocks``):
    the slots are free again, and the events say the blocks left."""
    events = KVEventRecorder()
    tier = HostKVTier(3, events)
    tier.save(0, 11, (None, [0] * BS, BS, None))
    slots = [tier.insert(h, (None, [h] * BS, BS, None)) for h in (21, 22)]
    assert None not in slots and tier.insert(21, (None, [], BS, None)) is None  # held already
    assert tier.imported == {21, 22} and tier.num_imported == 2
    tier.discard([21, 22, 99])
    assert list(tier.lru) == [11] and not tier.imported
    tier.check()
    assert events.take(0.0).events[-1] == BlockRemoved([21, 22], MEDIUM_HOST)
    assert tier.insert(23, (None, [], BS, None)) in slots  # a freed slot is used again


def test_events_name_blocks_as_the_engine_and_the_router_hash_them():
    events = KVEventRecorder()
    kv = KVCacheManager(num_blocks=8, block_size=BS, events=events)
    toks = list(range(1, 11))  # 2 full blocks
    a = make_req("a", toks)
    computed(kv, a, n=4)  # the first block computed
    a.num_computed_tokens = 10  # then the rest
    kv.cache_blocks(a)
    batch = events.take(1.0)
    h = chain(toks)
    assert batch.ts == 1.0 and batch.events == [
        BlockStored([h[0]], None, toks[:4], BS, None, MEDIUM_POOL),
        BlockStored([h[1]], h[0], toks[4:8], BS, None, MEDIUM_POOL),
    ]
    kv.free(a)
    kv.reset_prefix_cache()
    assert events.take(2.0).events == [AllBlocksCleared()]
    assert kv.snapshot(3.0).events == []


def test_lora_blocks_chain_from_the_adapters_root():
    from kvserve.engine.lora import LoRARequest

    events = KVEventRecorder()
    kv = KVCacheManager(num_blocks=8, block_size=BS, events=events)
    a = make_req("a", range(1, 10))
    a.lora_request = LoRARequest("sql", 3, "/nowhere")
    computed(kv, a)
    (stored,) = events.take(0.0).events
    root = lora_root_hash(ROOT, "sql")
    assert stored.parent_block_hash == root and stored.lora_id == 3
    assert stored.block_hashes == chain(list(range(1, 9)), root=root)
    assert root != lora_root_hash(ROOT, "other") and root != hash_block(ROOT, tuple(b"lora:sql"))


def test_a_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(8, BS, enable_prefix_caching=False, host_tier=HostKVTier(2))
    with pytest.raises(ValueError, match="at least one slot"):
        HostKVTier(0)


# --------------------------------------------------------------------------- the engine

NEW_TOKENS = 6
#: 6 prompts of 6 blocks of 4 tokens (+2), distinct from their first token: 7 blocks each in a
#: pool of 16 blocks, so running them one after the other evicts the earlier ones
PROMPTS = [[1000 + 97 * p + 13 * i for i in range(26)] for p in range(6)]


def run_rounds(llm, prompts, rounds=2, together=False, lora=None, new_tokens=NEW_TOKENS):
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = []
    for _ in range(rounds):
        if together:
            res = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora)
        else:
            res = [llm.generate([p], sp, use_tqdm=False, lora_request=lora)[0] for p in prompts]
        out.append([r.outputs[0].token_ids for r in res])
    return out


def tier_engine(path, **kw):
    return LLM(
        model=str(path),
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        block_size=BS,
        kv_offloading_size=kw.pop("size", 0.01),
        **kw,
    )


def assert_no_leak(llm):
    kv = llm.engine.scheduler.kv
    kv.check(list(llm.engine.scheduler.requests.values()))
    assert kv.pool.num_free_blocks == kv.num_blocks  # every request left


@pytest.mark.parametrize("backend", ["native", "mmap"])
def test_outputs_with_the_tier_equal_computing_everything(tiny_llama_path, backend, tmp_path):
    ref = run_rounds(
        LLM(
            model=str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            block_size=BS,
            enable_prefix_caching=False,
        ),
        PROMPTS,
    )
    llm = tier_engine(tiny_llama_path, kv_offloading_backend=backend, kv_offloading_path=str(tmp_path))
    assert run_rounds(llm, PROMPTS) == ref
    stats = llm.engine.get_stats()
    # the second round found its prompts in the tier (the pool holds 2 of 6), and loaded them
    assert stats["kv_offload_hit_tokens"] >= 4 * 24 and stats["kv_offload_loaded_bytes"] > 0
    assert llm.engine.executor.runner.host_store.bytes_loaded == stats["kv_offload_loaded_bytes"]
    assert_no_leak(llm)


def test_a_block_loaded_back_holds_the_bytes_it_was_evicted_with(tiny_llama_path):
    llm = tier_engine(tiny_llama_path)
    runner, kv = llm.engine.executor.runner, llm.engine.scheduler.kv
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    hashes = chain(PROMPTS[0])
    saved = {
        h: [(k[kv.pool.lookup(h)].clone(), v[kv.pool.lookup(h)].clone()) for k, v in runner.kv_caches] for h in hashes
    }
    llm.generate(PROMPTS[1:4], sp, use_tqdm=False)  # evicts prompt 0's blocks
    assert all(kv.pool.lookup(h) is None and h in kv.host_tier for h in hashes)
    llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    for h in hashes:
        b = kv.pool.lookup(h)
        assert b is not None
        for (k, v), (k0, v0) in zip(runner.kv_caches, saved[h]):
            assert torch.equal(k[b], k0) and torch.equal(v[b], v0)
    assert_no_leak(llm)


def test_float8_kv_blocks_come_back_equal(tiny_llama_path):
    kw = dict(kv_cache_dtype="fp8", attention_backend="torch")
    ref = run_rounds(
        LLM(
            model=str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            block_size=BS,
            enable_prefix_caching=False,
            **kw,
        ),
        PROMPTS,
    )
    llm = tier_engine(tiny_llama_path, **kw)
    assert run_rounds(llm, PROMPTS) == ref
    assert llm.engine.get_stats()["kv_offload_hit_tokens"] > 0
    assert_no_leak(llm)


def test_preempted_requests_and_the_tier(tiny_llama_path):
    """All prompts at once in a pool that holds two prompts but not their outputs (26 + 16
    tokens: 11 blocks each): requests are preempted and recomputed, their blocks evicted to the
    tier and loaded back."""
    ref = run_rounds(
        LLM(
            model=str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            block_size=BS,
            enable_prefix_caching=False,
        ),
        PROMPTS,
        together=True,
        new_tokens=16,
    )
    llm = tier_engine(tiny_llama_path)
    assert run_rounds(llm, PROMPTS, together=True, new_tokens=16) == ref
    assert llm.engine.get_stats()["num_preemptions"] > 0 and llm.engine.get_stats()["kv_offload_hit_tokens"] > 0
    assert_no_leak(llm)


def lora_setup(tmp_path_factory, tag: str):
    """A tiny base model, a LoRA adapter of it (``LoRARequest`` id 1), the engine keywords that
    serve it, and an engine of them that caches nothing (the reference)."""
    pytest.importorskip("peft")
    from kvserve.engine.lora import LoRARequest
    from test_lora import ADAPTERS, make_adapter
    from tiny_models import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp(f"{tag}_model"), num_hidden_layers=2)
    name, r, a, t, rs = ADAPTERS[0]
    adapter = LoRARequest(name, 1, str(make_adapter(base, tmp_path_factory.mktemp(f"{tag}_adapter"), r, a, t, rs, 0)))
    kw = dict(enable_lora=True, max_lora_rank=16)
    plain = LLM(
        model=str(base),
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        block_size=BS,
        enable_prefix_caching=False,
        **kw,
    )
    return base, adapter, kw, plain


def test_lora_keyed_blocks_come_back_for_their_adapter_only(tmp_path_factory):
    base, adapter, kw, plain = lora_setup(tmp_path_factory, "tier_lora")
    ref_lora, ref_base = run_rounds(plain, PROMPTS[:4], lora=adapter), run_rounds(plain, PROMPTS[:4])
    assert ref_lora != ref_base  # the adapter changes the output, or the test could not fail
    llm = tier_engine(base, **kw)
    assert run_rounds(llm, PROMPTS[:4], lora=adapter) == ref_lora
    assert run_rounds(llm, PROMPTS[:4]) == ref_base  # same tokens, the base model's blocks
    assert llm.engine.get_stats()["kv_offload_hit_tokens"] > 0
    assert_no_leak(llm)


def test_tensor_parallel_ranks_each_keep_their_share(tmp_path_factory):
    from tiny_models import SMOLLM2_HEADS, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tier_tp"), **SMOLLM2_HEADS)
    ref = run_rounds(
        LLM(
            model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=BS, enable_prefix_caching=False
        ),
        PROMPTS,
    )
    llm = tier_engine(path, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert run_rounds(llm, PROMPTS) == ref
        assert llm.engine.get_stats()["kv_offload_hit_tokens"] > 0
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


def test_events_replayed_equal_what_the_pool_and_tier_hold(tiny_llama_path):
    llm = tier_engine(tiny_llama_path, enable_kv_cache_events=True)
    engine = llm.engine
    held: dict[int, set[str]] = {}
    last = 0

    def replay():
        nonlocal last
        seq, batches = engine.take_kv_events()
        assert seq - len(batches) == last  # nothing dropped
        last = seq
        for batch in batches:
            for e in batch.events:
                if isinstance(e, BlockStored):
                    for h in e.block_hashes:
                        held.setdefault(h, set()).add(e.medium)
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        held[h].discard(e.medium)
                else:
                    held.clear()

    for p in PROMPTS + PROMPTS[:3]:
        llm.generate([p], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        replay()
        kv = engine.scheduler.kv
        truth = {(h, MEDIUM_POOL) for h in kv.pool.cached} | {(h, MEDIUM_HOST) for h in kv.host_tier.lru}
        assert {(h, m) for h, ms in held.items() for m in ms} == truth
        _, snap = engine.kv_cache_snapshot()
        assert {(e.block_hashes[0], e.medium) for e in snap.events} == truth
    assert engine.reset_prefix_cache()
    replay()
    assert not held and not engine.kv_cache_snapshot()[1].events


@pytest.mark.parametrize("front", ["in_process", "core_process"])
def test_both_fronts_deliver_every_batch_and_a_snapshot_that_agrees(tiny_llama_path, front):
    """The serving side reads events through the async front: batches numbered without gaps,
    and a snapshot (taken between two steps) equal to the replay of the batches up to its seq."""
    import asyncio

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.core_client import MPAsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(tiny_llama_path),
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        block_size=BS,
        kv_offloading_size=0.01,
        enable_kv_cache_events=True,
    )

    async def body():
        eng = (
            AsyncLLMEngine(LLMEngine(cfg))
            if front == "in_process"
            else await asyncio.to_thread(MPAsyncLLMEngine.from_config, cfg)
        )
        batches: dict[int, object] = {}

        def take():
            seq, got = eng.take_kv_events()
            for i, b in enumerate(got, seq - len(got) + 1):
                assert i not in batches
                batches[i] = b

        async def until(seq):
            for _ in range(1000):
                take()
                if max(batches, default=0) >= seq:
                    return
                await asyncio.sleep(0.01)

        try:
            for i, p in enumerate(PROMPTS + PROMPTS[:2]):
                async for _ in eng.generate(p, SamplingParams(temperature=0, max_tokens=3), request_id=f"r{i}"):
                    pass
                take()
            seq, snap = await eng.kv_cache_snapshot()
            await until(seq)  # the core process's batches up to seq may still be on their way
            assert sorted(batches) == list(range(1, seq + 1))  # every batch, numbered without gaps
            held: dict[tuple[int, str], None] = {}
            for i in range(1, seq + 1):
                for e in batches[i].events:
                    if isinstance(e, BlockStored):
                        held.update(dict.fromkeys((h, e.medium) for h in e.block_hashes))
                    elif isinstance(e, BlockRemoved):
                        for h in e.block_hashes:
                            held.pop((h, e.medium), None)
            assert set(held) == {(e.block_hashes[0], e.medium) for e in snap.events}
            assert {m for _, m in held} == {MEDIUM_POOL, MEDIUM_HOST}
            assert await eng.reset_prefix_cache()
            await until(seq + 1)
            assert isinstance(batches[max(batches)].events[-1], AllBlocksCleared)
            assert (await eng.kv_cache_snapshot())[1].events == []
        finally:
            await eng.shutdown()

    asyncio.run(body())


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_the_tier(tiny_llama_path, method):
    """Drafts are verified against blocks loaded back from the tier as against computed ones (the
    draft model keeps its own pool, without a tier)."""
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        if method == "ngram"
        else {"method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 3}
    )
    ref = run_rounds(
        LLM(
            model=str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            block_size=BS,
            enable_prefix_caching=False,
        ),
        PROMPTS,
    )
    llm = tier_engine(tiny_llama_path, speculative_config=spec)
    assert run_rounds(llm, PROMPTS) == ref
    stats = llm.engine.get_stats()
    assert stats["kv_offload_hit_tokens"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    assert_no_leak(llm)
