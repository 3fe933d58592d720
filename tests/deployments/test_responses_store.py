"""The Responses API's stored responses in-process: ``store``, ``previous_response_id``, ``GET`` and
``DELETE`` per key, shared by every ingress replica on one Redis, owned by the key itself (not its
name) with a bound per owner, in memory and on a real Redis (skips without redis-server). The
gateway over a fake replica (no Ray, no engine), driven by the openai SDK."""

import httpx
import openai
import pytest
from gateway_fakes import ScriptedReplica, _run, _sdk, make_gateway

from kvserve.deployments.gateway.api import build_api


def test_store_previous_response_id_get_and_delete_are_per_key():
    replica = ScriptedReplica()

    async def main():
        client, app = _sdk(replica, api_keys=["sk-a name=alice", "sk-b name=bob"])
        first = await client.responses.create(model="fake", input="My name is Ada.", instructions="Be kind.")
        second = await client.responses.create(model="fake", input="What is my name?", previous_response_id=first.id)
        got = await client.responses.retrieve(first.id)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
        other = await http.get(f"/v1/responses/{first.id}", headers={"Authorization": "Bearer sk-b"})
        other_prev = await http.post(
            "/v1/responses",
            headers={"Authorization": "Bearer sk-b"},
            json={"model": "fake", "input": "hi", "previous_response_id": first.id},
        )
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        return first, second, got, other, other_prev

    first, second, got, other, other_prev = _run(main())
    assert got.id == first.id and got.output_text == "Hello there"
    assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found"
    assert other_prev.status_code == 404 and other_prev.json()["error"]["param"] == "previous_response_id"
    assert second.previous_response_id == first.id
    # the second turn carries the first turn's input and output, not its instructions
    assert replica.requests[1].messages == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "What is my name?"},
    ]


def test_stored_responses_in_redis_are_seen_by_every_ingress_replica(redis_server):
    """Two gateways (two ingress replicas) on one Redis: a response stored through one is read,
    continued and deleted through the other."""
    replica = ScriptedReplica()
    settings = dict(redis_url=redis_server, cache_backend="redis")

    async def main():
        a, _ = _sdk(replica, **settings)
        b, _ = _sdk(replica, **settings)
        first = await a.responses.create(model="fake", input="Remember 42.")
        seen = await b.responses.retrieve(first.id)
        await b.responses.create(model="fake", input="What number?", previous_response_id=first.id, store=False)
        await b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(first.id)
        return first, seen

    first, seen = _run(main())
    assert seen.id == first.id and seen.output_text == "Hello there"
    assert replica.requests[1].messages[:2] == [
        {"role": "user", "content": "Remember 42."},
        {"role": "assistant", "content": "Hello there"},
    ]


# ---- owners: the key itself, each with its own bound ------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def store_backend(request):
    """The stored responses' backend (``cache`` settings): this replica's memory, or a real
    Redis (skips without redis-server)."""
    if request.param == "memory":
        return {}
    return {"redis_url": request.getfixturevalue("redis_server"), "cache_backend": "redis"}


def _as(gw, key):
    """The openai SDK on ``gw``'s app with API key ``key``."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw/v1")
    return openai.AsyncOpenAI(api_key=key, base_url="http://gw/v1", http_client=http, max_retries=0)


def test_a_key_reissued_under_an_old_name_does_not_inherit_its_responses(store_backend):
    """Stored responses belong to the key, not its display name: after ``alice``'s key is
    replaced (a new configuration, the same store), the new key gets 404 for the old key's
    response, as a read and as ``previous_response_id``."""
    replica = ScriptedReplica()
    old = make_gateway(replica, api_keys=["sk-old-alice-1 name=alice"], **store_backend)
    new = make_gateway(replica, api_keys=["sk-new-alice-1 name=alice"], **store_backend)
    if not store_backend:
        new.responses = old.responses  # memory: the one replica's store, across the key change (Redis: shared)

    async def main():
        first = await _as(old, "sk-old-alice-1").responses.create(model="fake", input="My secret is 7.")
        kept = await _as(old, "sk-old-alice-1").responses.retrieve(first.id)
        client = _as(new, "sk-new-alice-1")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as prev:
            await client.responses.create(model="fake", input="What is my secret?", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)
        return first, kept, prev.value

    first, kept, prev = _run(main())
    assert kept.id == first.id and prev.body["param"] == "previous_response_id"
    assert len(replica.requests) == 1  # the refused continuation never reached the replica


def test_one_owners_responses_never_evict_anothers(store_backend):
    """Each owner has its own bound (the cache's ``max_entries``, 3 here): key A storing six
    responses evicts only A's oldest, never B's one."""
    replica = ScriptedReplica()
    gw = make_gateway(
        replica, api_keys=["sk-tenant-a-2 name=a", "sk-tenant-b-2 name=b"], cache_max_entries=3, **store_backend
    )

    async def main():
        a, b = _as(gw, "sk-tenant-a-2"), _as(gw, "sk-tenant-b-2")
        mine = await b.responses.create(model="fake", input="B's only turn")
        flood = [await a.responses.create(model="fake", input=f"A's turn {i}") for i in range(6)]
        b_kept = await b.responses.retrieve(mine.id)
        a_kept = [(await a.responses.retrieve(r.id)).id for r in flood[-3:]]
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(flood[0].id)  # A's own oldest: A's bound is real
        return mine, b_kept, flood, a_kept

    mine, b_kept, flood, a_kept = _run(main())
    assert b_kept.id == mine.id
    assert a_kept == [r.id for r in flood[-3:]]


def test_owner_ids_follow_the_key_never_show_it():
    from kvserve.deployments.limits import KeyPolicy

    old, new = KeyPolicy("sk-old-alice-1", name="alice"), KeyPolicy("sk-new-alice-1", name="alice")
    assert old.owner_id != new.owner_id and old.owner_id == KeyPolicy("sk-old-alice-1", name="bob").owner_id
    assert old.owner_id.startswith("owner-") and "sk-old" not in old.owner_id and "alice" not in old.owner_id
