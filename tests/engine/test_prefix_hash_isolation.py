"""Prefix-cache block hashes that cannot be made to collide, and ``cache_salt``
(``kvserve/engine/kv_cache_manager.py``; vLLM's CVE-2025-25183 class of attack).

* The old adapter root was the hash of the token tuple ``"lora:" + name``: a base-model prompt
  that starts with those token ids chained into the adapter's hashes, so the adapter's requests
  reused base-model KV. It must not, and no two different (salt, tokens) may share a hash.
* ``cache_salt`` (vLLM's prompt key): a different salt gets nothing from the cache, the same
  salt gets its hit, on the real engine.
* An adapter loaded again under its name (a new ``lora_version``) never reuses the old load's KV.
* The router's and the cluster tier's hashes (``contract/prefix.py``, ``kv_index.py``) equal the
  engine's for salted and adapter requests.
"""

from __future__ import annotations

import random

import pytest

from _kv_cache_helpers import make_req
from kvserve.deployments.contract.kv_index import request_hashes
from kvserve.deployments.contract.prefix import block_hashes
from kvserve.engine.kv_cache_manager import (
    HASH_SEED_ENV,
    KVCacheManager,
    block_extra,
    chain_hashes,
    hash_block,
    request_root,
    root_hash,
)
from kvserve.engine.lora import LoRARequest

BS = 8


def cache(kv: KVCacheManager, req) -> list[int]:
    """Schedule ``req`` as the scheduler does, compute all its tokens, cache its blocks; its
    prefix-cache hits (pool blocks) at admission."""
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return hits


def test_a_base_prompt_of_the_adapters_tag_does_not_reach_the_adapters_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=BS, hash_seed="s")
    tail = list(range(100, 100 + 3 * BS + 1))
    # the old attack: one block of the bytes of "lora:sql" as token ids, then the adapter's prompt
    base = make_req("base", list(b"lora:sql") + tail)
    assert len(b"lora:sql") == BS
    cache(kv, base)
    adapter = make_req("lora", tail)
    adapter.lora_request = LoRARequest("sql", 1, "/nowhere")
    assert kv.get_computed_blocks(adapter) == []  # no base-model KV for the adapter
    assert not set(adapter.block_hashes) & set(base.block_hashes)
    # and the other way round: the adapter's cached blocks are not the base model's
    cache(kv, adapter)
    again = make_req("base2", list(b"lora:sql") + tail)
    assert kv.get_computed_blocks(again) == base.block_table[: len(kv.get_computed_blocks(again))]
    assert not set(kv.get_computed_blocks(again)) & set(adapter.block_table)


def test_different_salts_and_tokens_never_share_a_hash():
    root = root_hash("s")
    # inputs that naive concatenations would confuse: a salt that looks like token bytes, a
    # token moved into the salt, an empty salt and none, a longer salt of the same prefix
    cases = [
        (None, [1, 2]),
        ("", [1, 2]),
        ("a", [1, 2]),
        ("ab", [1, 2]),
        ("a", [98, 1, 2]),
        ("\x00\x00\x00\x01", [2]),
        (None, [1]),
        (None, [1, 2, 0]),
        ("a\x00", [1, 2]),
        ("s", [0, 0, 0, 1]),
        ("s\x00\x00\x00\x01", []),
    ]
    rng = random.Random(0)
    for _ in range(2000):
        salt = rng.choice([None, "".join(rng.choice("ab\x00") for _ in range(rng.randint(1, 4)))])
        cases.append((salt, [rng.randrange(4) for _ in range(rng.randint(0, 4))]))
    cases = list({(s or None, tuple(t)) for s, t in cases})  # "" is no salt, as the engine treats it
    hashes = {hash_block(root, list(t), block_extra(s)) for s, t in cases}
    assert len(hashes) == len(cases)
    # the same (salt, tokens) under another engine's seed is another name, too
    assert hash_block(root_hash("t"), [1, 2]) != hash_block(root, [1, 2])
    assert all(0 <= h < 1 << 128 for h in hashes)


def test_every_engine_gets_its_own_root_unless_a_seed_is_shared(monkeypatch):
    monkeypatch.delenv(HASH_SEED_ENV, raising=False)
    assert KVCacheManager(4, BS).root != KVCacheManager(4, BS).root
    assert KVCacheManager(4, BS, hash_seed="x").root == KVCacheManager(4, BS, hash_seed="x").root
    monkeypatch.setenv(HASH_SEED_ENV, "y")
    assert KVCacheManager(4, BS).root == root_hash("y")


def test_cache_salt_in_the_block_manager():
    kv = KVCacheManager(num_blocks=32, block_size=BS, hash_seed="s")
    prompt = list(range(200, 200 + 4 * BS + 1))
    a = make_req("a", prompt)
    a.cache_salt = "tenant-a"
    assert cache(kv, a) == []
    b = make_req("b", prompt)
    b.cache_salt = "tenant-b"
    assert kv.get_computed_blocks(b) == []
    unsalted = make_req("c", prompt)
    assert kv.get_computed_blocks(unsalted) == []
    a2 = make_req("a2", prompt)
    a2.cache_salt = "tenant-a"
    assert kv.get_computed_blocks(a2) == a.block_table[:4]


def test_an_adapter_loaded_again_gets_none_of_the_old_loads_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=BS, hash_seed="s")
    prompt = list(range(300, 300 + 3 * BS + 1))
    old = make_req("old", prompt)
    old.lora_request = LoRARequest("sql", 1, "/p", lora_version="v1")
    cache(kv, old)
    new = make_req("new", prompt)
    new.lora_request = LoRARequest("sql", 2, "/p", lora_version="v2")  # same name, new weights
    assert kv.get_computed_blocks(new) == []
    same = make_req("same", prompt)
    same.lora_request = LoRARequest("sql", 1, "/p", lora_version="v1")
    assert len(kv.get_computed_blocks(same)) == 3


def test_static_adapter_versions_follow_their_files(tmp_path):
    from kvserve.deployments.replica.lora import adapter_files_version

    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 100)
    v1 = adapter_files_version(str(tmp_path))
    assert adapter_files_version(str(tmp_path)) == v1  # every replica of the same files agrees
    (tmp_path / "adapter_model.safetensors").write_bytes(b"y" * 100)
    assert adapter_files_version(str(tmp_path)) != v1


def test_the_routers_and_the_tiers_hashes_are_the_engines():
    kv = KVCacheManager(num_blocks=64, block_size=16, hash_seed="s")
    ids = [random.Random(1).randrange(50000) for _ in range(100)]
    lora = LoRARequest("sql", 1, "/p", lora_version="v7")
    for salt in (None, "tenant"):
        for adapter in (None, lora):
            req = make_req("r", ids)
            req.cache_salt, req.lora_request = salt, adapter
            kv._update_hashes(req)
            root = request_root(kv.root, adapter)
            assert block_hashes(ids, 16, 64, root, salt) == req.block_hashes and len(req.block_hashes) == 6
            assert request_hashes(ids, 16, 64, root, salt) == req.block_hashes
            assert chain_hashes(ids, 16, 2, root, salt) == req.block_hashes[:2]


def test_cache_salt_on_the_real_engine(tiny_llama_path):
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=16)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    ids = list(range(1000, 1000 + 5 * 16 + 3))

    def cached(salt):
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        return llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0  # another salt: nothing of a's
    assert cached(None) == 0
    assert cached("a") == 5 * 16  # the same salt: a's prefix
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": ""}], sp, use_tqdm=False)
