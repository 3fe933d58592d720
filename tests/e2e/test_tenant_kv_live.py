"""No tenant sees another's cached prompt prefixes (``cache_salt`` per API key,
``kvserve/deployments/limits/policies.py`` ``KeyPolicy.cache_salt``), through the real server:
Ray Serve, the gateway, the tiny model's engine, the openai SDK.

Before: tenant B's first request with tenant A's long prompt reported A's prefix as cached
(``usage.prompt_tokens_details.cached_tokens``), telling B what A asked. Now each key's
requests carry its own salt in the first KV block's hash; keys of one ``prefix_cache_group``
share. One server start.
"""

from __future__ import annotations

import random

import pytest

from helpers import free_port

APP = "kvserve-tenant-kv"
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b", "c": "sk-tenant-c", "d": "sk-tenant-d"}
ENTRIES = [KEYS["a"], KEYS["b"], f"{KEYS['c']} prefix_cache_group=team", f"{KEYS['d']} prefix_cache_group=team"]


@pytest.fixture(scope="module")
def tenant_app(ray_session, tiny_llama_path):
    from ray import serve

    from kvserve.deployments.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # (a running Serve keeps its port)
    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-tenant",
            "num_replicas": 1,
            "max_num_seqs": 4,
            "max_model_len": 512,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.1,
            "api_keys": ENTRIES,
        }
    )
    serve.run(app, name=APP, route_prefix="/tenant")
    from ray.serve.context import _get_global_client

    port = _get_global_client().http_config.port  # Serve's port, whoever started it in this session
    yield f"http://127.0.0.1:{port}/tenant/v1"
    serve.delete(APP)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(300)]  # a long shared system prompt, as token ids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_tenants_prefixes_are_invisible_to_another(tenant_app):
    from openai import OpenAI

    clients = {k: OpenAI(base_url=tenant_app, api_key=v, max_retries=0, timeout=120) for k, v in KEYS.items()}
    system = _prompt(0)

    def cached(who: str, tail: int, **extra) -> int:
        r = clients[who].completions.create(
            model="tiny-tenant", prompt=system + [50, tail], max_tokens=1, temperature=0, extra_body=extra or None
        )
        details = r.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    assert cached("a", 1) == 0
    assert cached("a", 2) >= 256  # the cache works for A itself
    assert cached("b", 3) == 0  # B learns nothing of what A asked
    assert cached("a", 4, cache_salt="mine") == 0  # a client's own salt narrows its key's further
    assert cached("a", 5, cache_salt="mine") >= 256
    # keys that opted into one group share their prefixes, and only theirs
    assert cached("c", 6) == 0
    assert cached("d", 7) >= 256
    assert cached("b", 8) >= 256  # (B's own first request is cached for B)
