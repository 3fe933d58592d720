"""How the prefix-aware router scores replicas, as pure functions of what it knows: each replica's
cached prefix depth for a request (:func:`match_depths`), the replicas worth preferring
(:func:`longest_match`, :func:`preferred_replicas`) and the fallback by least cached footprint
(:func:`least_cached`)."""

from __future__ import annotations


def match_depths(
    hashes: list[int], replica_ids: list[str], reported: dict[int, tuple[str, ...]], history: dict[int, str]
) -> dict[str, int]:
    """For each of ``replica_ids``, the number of leading blocks of ``hashes`` it has served:
    the deepest ``hashes[i]`` that it reported (``reported``: hash -> replica ids) or that this
    router last sent to it (``history``: hash -> replica id), plus one; 0 for none. Chained
    hashes make a match at depth ``i`` a match of the whole prefix up to ``i``."""
    depth = dict.fromkeys(replica_ids, 0)
    for i, h in enumerate(hashes, 1):
        for r in reported.get(h, ()):
            if r in depth:
                depth[r] = i
        r = history.get(h)
        if r in depth:
            depth[r] = i
    return depth


def longest_match(depths: dict[str, int], min_gain_blocks: int) -> list[str]:
    """The replicas with the longest matched prefix (``depths``: replica id -> blocks), if it
    is at least ``min_gain_blocks`` longer than every other replica's; else ``[]`` (a prefix
    every replica has, e.g. a chat template's default system prompt, is no reason to
    concentrate load)."""
    best = max(depths.values(), default=0)
    others = [d for d in depths.values() if d != best]
    if best == 0 or not others or best - max(others) < min_gain_blocks:
        return []
    return [r for r, d in depths.items() if d == best]


def preferred_replicas(
    depths: dict[str, int], queue_lens: dict[str, int | None], *, margin: int, min_gain_blocks: int
) -> list[str]:
    """The replicas a request should go to, ``[]`` for none: those of :func:`longest_match`,
    provided the least loaded of them has at most ``margin`` more ongoing requests
    (``queue_lens``; None: unknown) than the least-loaded replica of all."""
    pref = longest_match(depths, min_gain_blocks)
    known = {r: q for r, q in queue_lens.items() if q is not None}
    pref_q = [known[r] for r in pref if r in known]
    if not pref_q:
        return []  # no match, or the preferred replicas did not answer a queue-length probe
    if min(pref_q) - min(known.values()) > margin:
        return []
    return pref


def least_cached(
    replica_ids: list[str], queue_lens: dict[str, int | None], footprint: dict[str, int], *, margin: int
) -> str:
    """Where a prompt no replica has served goes: of ``replica_ids``, those within ``margin``
    ongoing requests of the least loaded; of them the one with the smallest prefix-cache
    footprint (``footprint``: blocks), then the least loaded. Distinct prefixes spread evenly, so
    each replica's share of them fits its cache (as the "smallest tenant" of Ray's
    ``PrefixCacheAffinityRouter`` and the smallest tree of SGLang's cache-aware router)."""

    def load(r: str) -> int:
        q = queue_lens.get(r)
        return q if q is not None else 1 << 30

    low = min(load(r) for r in replica_ids)
    return min((r for r in replica_ids if load(r) <= low + margin), key=lambda r: (footprint.get(r, 0), load(r)))
