"""The semantic level of the response cache: a vector index of prompt embeddings.

Texts are embedded by the project's one sentence encoder,
:class:`kvserve.deployments.contract.encoder.SentenceEncoder` (all-MiniLM-L6-v2, unit vectors of
:data:`EMBEDDING_DIM` floats, inputs truncated at its ``max_seq_length``).

:class:`SemanticIndex` keeps unit vectors per *scope* (a hash of everything but the embedded
text: model, revision, system prompt and earlier turns, tools, sampling fields), so requests
with different instructions never share answers, and finds the most similar entry by inner
product (= cosine similarity on unit vectors). Exact search over a numpy matrix on one BLAS
thread, chosen by measurement against faiss and more threads (``benchmarks/cache.py``, the
``index`` part of ``benchmarks/results/cache.json``): the search costs far less than the
embedding either way, and threads, not the library, decide its tail on a busy box, so the
ingress pins BLAS to one thread (``kvserve/deployments/cache/response_cache.py``). An approximate
index only pays off far beyond the entry bound used here. Entries have a TTL and one
least-recently-used bound over all scopes.

A hit also needs the same numbers in both texts (:func:`numbers_of`): "What is 12 times 12?"
and "What is 12 times 13?" embed close together, and no threshold that keeps real paraphrases
separates them.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

#: Embedding width of all-MiniLM-L6-v2.
EMBEDDING_DIM = 384

_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")


def numbers_of(text: str) -> tuple[str, ...]:
    """The numbers written in ``text`` with digits, in order (``"12 times 1,000"`` ->
    ``("12", "1,000")``): a semantic hit needs equal numbers."""
    return tuple(_NUMBER_RE.findall(text))


class _Scope:
    """The entries of one scope: rows of a growing matrix, swap-removed."""

    def __init__(self, dim: int):
        self.vecs = np.empty((8, dim), dtype=np.float32)
        self.expires = np.empty(8, dtype=np.float64)
        self.keys: list[str] = []
        self.numbers: list[tuple[str, ...]] = []
        self.row: dict[str, int] = {}

    def add(self, key: str, vec: np.ndarray, numbers: tuple[str, ...], expires: float) -> None:
        i = self.row.get(key)
        if i is None:
            i = len(self.keys)
            if i == len(self.vecs):
                self.vecs = np.concatenate([self.vecs, np.empty_like(self.vecs)])
                self.expires = np.concatenate([self.expires, np.empty_like(self.expires)])
            self.keys.append(key)
            self.numbers.append(numbers)
            self.row[key] = i
        self.vecs[i], self.expires[i], self.numbers[i] = vec, expires, numbers

    def remove(self, key: str) -> bool:
        i = self.row.pop(key, None)
        if i is None:
            return False
        last = len(self.keys) - 1
        if i != last:
            self.vecs[i], self.expires[i] = self.vecs[last], self.expires[last]
            self.keys[i], self.numbers[i] = self.keys[last], self.numbers[last]
            self.row[self.keys[i]] = i
        self.keys.pop()
        self.numbers.pop()
        return True


class SemanticIndex:
    """Unit vectors by scope, each pointing at an exact-cache key; thread-safe.

    Args:
        dim: vector width.
        max_entries: entries over all scopes; the least recently used go first.
        clock: monotonic seconds (tests inject a fake one).

    Raises:
        ValueError: ``max_entries`` < 1.
    """

    def __init__(
        self, dim: int = EMBEDDING_DIM, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic
    ):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.dim, self.max_entries, self._clock = dim, max_entries, clock
        self._scopes: dict[str, _Scope] = {}
        self._lru: OrderedDict[tuple[str, str], str] = OrderedDict()  # (scope, key) -> model
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def search(
        self, scope: str, vec: np.ndarray, threshold: float, numbers: tuple[str, ...] = ()
    ) -> tuple[str, float] | None:
        """The key of the live entry of ``scope`` most similar to ``vec`` (float32 ``[dim]``,
        unit length) if its cosine similarity is at least ``threshold`` and its text had the
        same ``numbers``; with the similarity. None otherwise."""
        with self._lock:
            s = self._scopes.get(scope)
            if s is None or not s.keys:
                return None
            n = len(s.keys)
            sims = s.vecs[:n] @ vec
            sims[s.expires[:n] <= self._clock()] = -np.inf
            i = int(np.argmax(sims))
            if sims[i] < threshold or s.numbers[i] != numbers:
                return None
            key = s.keys[i]
            self._lru.move_to_end((scope, key))
            return key, float(sims[i])

    def add(
        self, scope: str, model: str, key: str, vec: np.ndarray, ttl_s: float, numbers: tuple[str, ...] = ()
    ) -> None:
        """Add (or replace) the entry ``key`` of ``scope``, live for ``ttl_s`` seconds."""
        with self._lock:
            s = self._scopes.get(scope)
            if s is None:
                s = self._scopes[scope] = _Scope(self.dim)
            s.add(key, np.asarray(vec, dtype=np.float32), numbers, self._clock() + ttl_s)
            self._lru[(scope, key)] = model
            self._lru.move_to_end((scope, key))
            while len(self._lru) > self.max_entries:
                (old_scope, old_key), _ = self._lru.popitem(last=False)
                self._drop(old_scope, old_key)

    def discard(self, scope: str, key: str) -> None:
        """Remove one entry (its exact-cache answer is gone)."""
        with self._lock:
            if self._lru.pop((scope, key), None) is not None:
                self._drop(scope, key)

    def clear(self, model: str | None = None) -> int:
        """Remove every entry (``model`` None) or those of one served model; returns how many."""
        with self._lock:
            gone = [sk for sk, m in self._lru.items() if model is None or m == model]
            for scope, key in gone:
                del self._lru[(scope, key)]
                self._drop(scope, key)
            return len(gone)

    def _drop(self, scope: str, key: str) -> None:
        s = self._scopes.get(scope)
        if s is not None and s.remove(key) and not s.keys:
            del self._scopes[scope]
