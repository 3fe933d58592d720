"""Cache entries: what is stored for an answer, and which answers are stored.

Stored is what the replica sent: each prompt's stream of
:class:`~kvserve.deployments.contract.types.GenerationChunk` (:func:`encode_entry`, JSON through
``GenerationChunk.to_dict``: never pickle, the Redis may be shared). A hit replays it through
the ingress's normal code, so a cached answer is the same SSE chunks (role delta, one content
delta per original engine step, finish chunk, usage chunk), the same tool-call parsing and the
same ``usage`` (prompt, completion and prefix-cached tokens of the run that produced it) as the
fresh one; ids and ``created`` are new.

An answer is stored only when it completed (:func:`complete`): every chunk the replica sent is
there (their ``seq`` numbers are 0, 1, 2, ... without a gap: a stream that lost a chunk on the
way is never stored) and every choice finished with ``stop`` or ``length`` (not an error, a
timeout or an abort, and not a stream whose client went away).
"""

from __future__ import annotations

import json

from kvserve.deployments.contract.types import GenerationChunk


def encode_entry(streams: list[list[GenerationChunk]], warmed: bool = False) -> bytes:
    """A cached answer: each prompt's chunks as the replica sent them (JSON bytes); ``warmed``:
    stored by cache warming (``kvserve warm``), not by a live request."""
    obj: dict = {"v": 1, "streams": [[c.to_dict() for c in s] for s in streams]}
    if warmed:
        obj["warmed"] = True
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def decode_entry(data: bytes) -> list[list[GenerationChunk]]:
    """The inverse of :func:`encode_entry`.

    Raises:
        ValueError: not an entry of this version.
    """
    return decode_entry_warmed(data)[0]


def decode_entry_warmed(data: bytes) -> tuple[list[list[GenerationChunk]], bool]:
    """:func:`decode_entry` and whether cache warming stored the entry.

    Raises:
        ValueError: not an entry of this version.
    """
    obj = json.loads(data)
    if not isinstance(obj, dict) or obj.get("v") != 1:
        raise ValueError("not a kvserve response cache entry (v1)")
    return [[GenerationChunk.from_dict(d) for d in s] for s in obj["streams"]], bool(obj.get("warmed"))


def complete(streams: list[list[GenerationChunk]], n: int) -> bool:
    """Whether every prompt's stream has all its chunks (``seq`` 0, 1, 2, ... in order: no
    hole) and its ``n`` choices finished with ``stop`` or ``length`` (nothing failed, timed out
    or was aborted): only such answers are stored."""
    if not streams:
        return False
    for s in streams:
        if any(c.seq != i for i, c in enumerate(s)):
            return False
        ends = {c.index: c for c in s if c.finished}
        if len(ends) != n or any(
            c.error is not None or c.finish_reason not in ("stop", "length") for c in ends.values()
        ):
            return False
    return True
