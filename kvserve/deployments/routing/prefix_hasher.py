"""The router side's prefix hashes: :class:`PrefixHasher` turns a request's prompt into the
chained block hashes the engine's prefix cache would compute for it
(:func:`kvserve.deployments.contract.prefix.block_hashes`), for the prefix-aware router
(:mod:`kvserve.deployments.routing.prefix_router`).

Text is tokenized with the model's own tokenizer, chat messages rendered with the model's chat
template as the engine renders them (``prepare_messages``, the generation prompt, no added
special tokens); token-id prompts are hashed as they are. :meth:`PrefixHasher.probe` gives the
tokenizer probe (:func:`kvserve.deployments.contract.prefix.tokenizer_probe`) that the router compares
with the replicas' report.

Cost per request: text is tokenized only up to a power-of-two number of characters
(:data:`_LEVEL0_CHARS` ... ``4 * max_prefix_tokens``), and the hashes of that leading text are
cached (LRU), so requests that share a system prompt tokenize nothing after the first; tokens
whose characters end within :data:`_CUT_MARGIN_CHARS` of the cut are dropped (a BPE merge
across the cut could change them). The cost, uncached and cached, is measured by
``benchmarks/routing.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from kvserve.deployments.contract.prefix import MAX_PREFIX_TOKENS, block_hashes, tokenizer_probe
from kvserve.engine.input_processor import chat_template_ids, encode_prompt, parse_prompt, render_chat_template

logger = logging.getLogger("ray.serve")

#: The smallest text prefix tokenized, characters; larger ones double up to ``4 * max_prefix_tokens``.
_LEVEL0_CHARS = 256
#: Tokens whose characters end this close to a cut are dropped (their merge could change).
_CUT_MARGIN_CHARS = 64


class PrefixHasher:
    """The chained block hashes of a request's prompt (see the module docstring), with an LRU
    cache of the hashes of leading text.

    Args:
        tokenizer: a transformers tokenizer of the served model, or None (token-id prompts only).
        block_size: the engine's tokens per KV block.
        max_tokens: deepest prefix hashed, tokens.
        cache_size: entries of the leading-text cache.
    """

    def __init__(self, tokenizer, block_size: int, max_tokens: int = MAX_PREFIX_TOKENS, cache_size: int = 1024):
        self.tokenizer, self.block_size = tokenizer, block_size
        self.max_blocks = max(1, max_tokens // block_size)
        self.levels = [_LEVEL0_CHARS]
        while self.levels[-1] * 2 <= 4 * max_tokens:
            self.levels.append(self.levels[-1] * 2)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[bool, str, int, str | None], list[int]] = OrderedDict()

    def of_request(
        self,
        prompt: Any,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        root: int = 0,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Hashes of a request's prompt (text, token ids or vLLM's dict) or chat ``messages``
        (with ``tools``), chained from ``root`` (the engine's root, or a LoRA adapter's as the
        engine chains its prompts), ``cache_salt`` in the first block; ``[]`` when there is
        nothing to hash (no tokenizer for text, a malformed prompt: the replica reports that
        error itself)."""
        try:
            if messages is not None:
                return self.of_messages(messages, tools, root, cache_salt)
            text, ids = parse_prompt(prompt)  # vLLM's forms, as the engine parses them
            if text is not None:
                return self.of_text(text, add_special_tokens=True, root=root, cache_salt=cache_salt)
            return block_hashes(ids, self.block_size, self.max_blocks, root, cache_salt)
        except Exception as e:  # a template error on odd messages, ...: route without affinity
            logger.debug("prefix router: no hashes for a request (%s)", e)
        return []

    def of_messages(
        self, messages: list[dict], tools: list[dict] | None = None, root: int = 0, cache_salt: str | None = None
    ) -> list[int]:
        """Hashes of a conversation rendered as the engine renders it (``prepare_messages``,
        the chat template with the generation prompt, ids without added special tokens)."""
        if self.tokenizer is None:
            return []
        text = render_chat_template(self.tokenizer, messages, tools)
        return self.of_text(text, add_special_tokens=False, root=root, cache_salt=cache_salt)

    def of_text(self, text: str, add_special_tokens: bool, root: int = 0, cache_salt: str | None = None) -> list[int]:
        """Hashes of the leading blocks of ``text``: all of a text shorter than the first level,
        else those of its longest leading power-of-two characters (cached)."""
        if self.tokenizer is None:
            return []
        if len(text) < self.levels[0]:
            return block_hashes(
                self.tokenizer.encode(text, add_special_tokens=add_special_tokens),
                self.block_size,
                self.max_blocks,
                root,
                cache_salt,
            )
        cut = max(lv for lv in self.levels if lv <= len(text))
        key = (add_special_tokens, text[:cut], root, cache_salt)
        hashes = self._cache.get(key)
        if hashes is not None:
            self._cache.move_to_end(key)
            return hashes
        enc = self.tokenizer(key[1], add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids = []
        for tid, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]):
            if end > cut - _CUT_MARGIN_CHARS:
                break
            ids.append(tid)
        hashes = block_hashes(ids, self.block_size, self.max_blocks, root, cache_salt)
        self._cache[key] = hashes
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return hashes

    def probe(self) -> list[int | None]:
        """:func:`tokenizer_probe` of this hasher's tokenization path."""
        tok = self.tokenizer
        return tokenizer_probe(lambda t: encode_prompt(tok, t), lambda m: chat_template_ids(tok, m))
