"""What an ``LLMServer`` replica reports to the prefix-aware router: the chained block hashes of
the prompts it admitted recently (:class:`RecentPrefixes`); the hashing both sides share is
:mod:`kvserve.deployments.contract.prefix`."""

from __future__ import annotations

from collections import OrderedDict

from kvserve.deployments.contract.prefix import MAX_PREFIX_TOKENS, REPORTED_HASHES, block_hashes, for_adapter


class RecentPrefixes:
    """A replica's recently served prompt prefixes: chained block hashes in an LRU of at most
    ``limit`` entries (the most recently used last). Not thread-safe: use it from one event loop.

    Args:
        block_size: the engine's tokens per KV block.
        limit: most hashes kept (and reported).
        max_tokens: deepest prefix recorded per prompt, tokens.
        root: the root of the engine's hash chains (``KVCacheManager.root``).

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(
        self, block_size: int, limit: int = REPORTED_HASHES, max_tokens: int = MAX_PREFIX_TOKENS, root: int = 0
    ):
        if min(block_size, limit, max_tokens) < 1:
            raise ValueError(f"block_size, limit and max_tokens must be >= 1, got {block_size}, {limit}, {max_tokens}")
        self.block_size, self.limit, self.max_blocks = block_size, limit, max(1, max_tokens // block_size)
        self.root = root
        self._lru: OrderedDict[int, None] = OrderedDict()

    def add(self, token_ids: list[int], adapter: str | None = None, cache_salt: str | None = None) -> None:
        """Record a prompt's leading block hashes (of LoRA ``adapter``'s, with ``cache_salt``)."""
        for h in for_adapter(block_hashes(token_ids, self.block_size, self.max_blocks, self.root, cache_salt), adapter):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.limit:
            self._lru.popitem(last=False)

    def report(self) -> list[int]:
        return list(self._lru)
