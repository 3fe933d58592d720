"""The cluster KV tier's bookkeeping without Ray: the directory (``kv_cluster_directory.py``:
LRU within the budget, layouts apart, entries dropped as lost or with their owner), the hub's
events of medium ``cluster`` in the routers' index, and the router's score, which lets any
replica of the layout count the cluster's blocks as loadable. The tier over real Ray objects and
two replicas: test_kv_cluster_live.py.
"""

from kvserve.deployments.contract.kv_cluster_directory import ClusterDirectory, cluster_holder, kv_layout
from kvserve.deployments.contract.kv_event_hub import KVEventHubCore, ReplicaLoad
from kvserve.deployments.contract.kv_index import KVBlockIndex, request_hashes
from kvserve.deployments.routing.kv_router import replica_costs
from kvserve.engine.kv_cache_manager import root_hash
from kvserve.engine.kv_events import MEDIUM_CLUSTER, BlockRemoved, BlockStored, KVEventBatch

L1, L2 = kv_layout("m1", "torch.float32", "auto", 16, 1, 1), kv_layout("m2", "torch.float32", "auto", 16, 1, 1)
HASHES = request_hashes(list(range(1000, 1200)), 16, 64, root_hash("kv-cluster-tests"))  # 12 blocks


def blocks(hashes, nbytes=100, tag="x"):
    return [(h, (None, [1] * 16, 16, None), nbytes, [f"{tag}{h}"]) for h in hashes]


def test_the_directory_keeps_the_budget_least_recently_used_first():
    d = ClusterDirectory()
    added, events = d.put("a", L1, 1200, blocks(HASHES[:8]))
    assert added == HASHES[:8] and d.nbytes == 800
    ((holder, batch),) = events.items()
    assert holder == cluster_holder(L1)
    assert [(type(e), e.medium) for e in batch.events] == [(BlockStored, MEDIUM_CLUSTER)] * 8
    assert [e[0] for e in d.lookup(L1, HASHES[:4])] == HASHES[:4]  # used: now the most recent
    added, events = d.put("b", L1, 1200, blocks(HASHES[4:12], tag="y"))  # 4..7 held already: kept as they were
    assert added == HASHES[8:12] and d.nbytes == 1200
    assert d.lookup(L1, [HASHES[4]])[0][2] == [f"x{HASHES[4]}"]
    # LRU order now: 0 1 2 3 (looked up), 5 6 7 (touched by b's put), 8 .. 11, 4 (looked up)
    d.lookup(L1, HASHES[2:4])  # -> 0 1 5 .. 11 4 2 3
    added, events = d.put("b", L1, 1200, blocks([7, 8]))  # room for 2 more: the 2 least recently used go
    removed = [e for e in events[cluster_holder(L1)].events if isinstance(e, BlockRemoved)]
    assert removed[0].block_hashes == HASHES[:2] and d.nbytes == 1200
    # the leading run only: a request whose first block is gone loads nothing
    assert d.lookup(L1, HASHES[:8]) == []
    assert [e[0] for e in d.lookup(L1, HASHES[2:12])] == HASHES[2:12]
    assert d.lookup(L2, HASHES[2:4]) == []  # another model's blocks are apart


def test_lost_objects_and_a_gone_owner_leave_the_directory():
    d = ClusterDirectory()
    d.put("a", L1, 10_000, blocks(HASHES[:6]))
    d.put("b", L1, 10_000, blocks(HASHES[6:]))
    events = d.drop(L1, [HASHES[2], 12345])
    assert events[cluster_holder(L1)].events[0].block_hashes == [HASHES[2]]
    assert [e[0] for e in d.lookup(L1, HASHES)] == HASHES[:2]
    d.drop(None, owner="b")  # b's objects died with b
    assert len(d) == 5 and d.nbytes == 500 and d.lookup(L1, HASHES[6:]) == []


def test_routers_see_the_cluster_tier_as_loadable_by_every_replica_of_the_layout():
    hub = KVEventHubCore()
    for r in ("a", "b"):
        hub.publish(r, 0, [], ReplicaLoad(layout=L1), snapshot=(0, KVEventBatch(0.0)))
    hub.publish("c", 0, [], ReplicaLoad(layout=L2), snapshot=(0, KVEventBatch(0.0)))
    hub.publish("a", 1, [KVEventBatch(0.0, [BlockStored(HASHES[:4], None, [], 16)])], ReplicaLoad(layout=L1))
    hub_id, added = hub.cluster_put("a", L1, 1 << 20, blocks(HASHES[:10]))
    assert hub_id == hub.hub_id and added == HASHES[:10]
    reply = hub.pull(None, 0)
    index = KVBlockIndex.load(reply.dump)
    cluster = {r: cluster_holder(load.layout) for r, load in reply.loads.items()}
    match = index.match(HASHES, ["a", "b", "c"], cluster=cluster)
    assert match == {"a": (4, 0, 6), "b": (0, 0, 10), "c": (0, 0, 0)}
    cost = replica_costs(match, len(HASHES), 16, {"a": 0, "b": 0, "c": 0}, host_cost=0.2, cluster_cost=0.3)
    assert cost["a"] < cost["b"] < cost["c"]
    # a gone owner takes its blocks along, and routers following the log see them go
    hub.forget("a")
    reply2 = hub.pull(reply.hub_id, reply.cursor)
    for r, kind, payload in reply2.changes:
        if kind == "batch":
            index.apply(r, payload)
        elif kind == "drop":
            index.drop(r)
    assert index.match(HASHES, ["b"], cluster={"b": cluster_holder(L1)}) == {"b": (0, 0, 0)}
    assert hub.cluster_stats()["blocks"] == 0 and hub.cluster_lookup(L1, HASHES) == []
