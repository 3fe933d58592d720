"""The xgrammar backend: specs compiled (and cached) into grammars, and each request's matcher.

Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models": a grammar is a pushdown automaton over byte-level tokens, and most of the
vocabulary is decided per automaton state at compile time (the adaptive token-mask cache).
:class:`XgrammarBackend` holds one xgrammar ``GrammarCompiler`` over the engine's tokenizer,
built on first use, whose cache (keyed by the grammar text, at most :data:`CACHE_LIMIT_BYTES`)
makes a repeated spec a lookup instead of a compile; :class:`RequestGrammar` is one request's
``GrammarMatcher``. vLLM V1 names the same pieces ``XgrammarBackend`` and ``XgrammarGrammar``.

Compiles run in a :class:`~kvserve.engine.bounded_pool.BoundedPool` of their own, never in the
caller's thread: sizes are checked first (:func:`~kvserve.engine.grammar_spec.check_limits`), the
queue is bounded (:class:`~kvserve.engine.bounded_pool.PoolFullError` when full) and a compile
past ``compile_timeout_s`` fails its request alone (a ``ValueError`` naming the limit) while its
thread, which xgrammar's C++ cannot be told to stop, runs on outside the pool's count.
"""

from __future__ import annotations

import json
import os
import re
import threading

from kvserve.engine.bounded_pool import BoundedPool
from kvserve.engine.grammar_bitmask import clear_token_bit, fill_bitmask
from kvserve.engine.grammar_spec import (
    DEFAULT_LIMITS,
    KINDS,
    GrammarLimits,
    check_limits,
    choice_grammar,
    validate_spec,
)

#: Memory cap of the per-engine compiled-grammar cache (bytes; least recently used evicted).
CACHE_LIMIT_BYTES = 256 << 20

_XGRAMMAR_MISSING = "structured_outputs needs xgrammar: pip install xgrammar"


def _short_error(e: BaseException) -> str:
    """xgrammar's C++ error text without its ``[time] file.cc:line:`` prefix, one line."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    msg = re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg[:300]


class RequestGrammar:
    """One request's grammar state: an xgrammar ``GrammarMatcher`` (the pushdown automaton of
    Dong et al. 2024, sec. 3) and how many of the request's output tokens it has accepted (so a
    token is never accepted twice, e.g. after a preemption by recompute, which keeps the outputs).

    ``reasoning_end`` (token ids; None: the grammar holds from the first output token): the
    grammar starts after the output's first occurrence of this sequence (a reasoning model's
    ``</think>``); until then the request is unconstrained (:attr:`constraining` is False)."""

    __slots__ = ("matcher", "num_accepted", "reasoning_end", "start", "scanned")

    def __init__(self, matcher, reasoning_end: list[int] | None = None):
        self.matcher = matcher
        self.num_accepted = 0
        self.reasoning_end = list(reasoning_end) if reasoning_end else None
        self.start = None if self.reasoning_end else 0  # output index where the grammar starts
        self.scanned = 0  # output tokens searched for reasoning_end so far

    @property
    def constraining(self) -> bool:
        """Whether the grammar constrains the next token (False while the output reasons)."""
        return self.start is not None

    def _find_start(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        end, n = self.reasoning_end, len(self.reasoning_end)
        out = token_ids[num_prompt_tokens:]
        for i in range(max(0, self.scanned - n + 1), len(out) - n + 1):
            if out[i : i + n] == end:
                self.start = i + n
                return
        self.scanned = len(out)

    def accept(self, token_ids: list[int], num_prompt_tokens: int) -> int | None:
        """Feed the output tokens (``token_ids[num_prompt_tokens:]``, the request's
        ``all_token_ids``; after the reasoning's end when there is one) that the matcher has not
        accepted yet.

        Returns:
            None if all were accepted, else the first rejected token id (the matcher then
            stays before it).
        """
        if self.start is None:
            self._find_start(token_ids, num_prompt_tokens)
            if self.start is None:
                return None
        for i in range(num_prompt_tokens + self.start + self.num_accepted, len(token_ids)):
            if not self.matcher.accept_token(token_ids[i]):
                return token_ids[i]
            self.num_accepted += 1
        return None

    def is_terminated(self) -> bool:
        """The matcher accepted a stop token after a complete match: nothing may follow."""
        return self.matcher.is_terminated()

    def only_stop_allowed(self, stop_token_ids: list[int], vocab_size: int) -> bool:
        """The grammar is complete and allows nothing but a stop token next (fills one bitmask
        row: call it only on that rare path, e.g. under ``min_tokens``, which forbids stops)."""
        if not self.matcher.is_completed():
            return False
        row = fill_bitmask([self], vocab_size)[0]
        for t in stop_token_ids:
            clear_token_bit(row, t)
        return not bool(row.any())


class XgrammarBackend:
    """The engine's grammar compiler: one xgrammar ``GrammarCompiler`` (the grammar's pushdown
    automaton plus its adaptive token-mask cache, built per vocabulary) over the engine's
    tokenizer, built on first use; compiled grammars are cached by xgrammar, keyed by the
    grammar text (at most :data:`CACHE_LIMIT_BYTES`), so a repeated spec is not compiled again
    (``benchmarks/structured_output.py`` measures compile times).

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (``hf_config.vocab_size``, the logits' width;
            may exceed the tokenizer's, the extra ids are never allowed).
        stop_token_ids: ids that end the output once the grammar is complete (the engine's EOS
            ids); a matcher accepts one of them after a complete match and then terminates.
        max_threads: compiler threads (default: the CPU count, at most 8).
        limits: sizes, compile deadline and compile pool (:class:`~kvserve.engine.grammar_spec.GrammarLimits`;
            default :data:`~kvserve.engine.grammar_spec.DEFAULT_LIMITS`).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids,
        max_threads: int | None = None,
        limits: GrammarLimits | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_threads = max_threads or min(8, os.cpu_count() or 1)
        self.limits = limits or DEFAULT_LIMITS
        self._compiler = None
        self._and_mask = None  # special_token_mask(), built with the compiler
        self._lock = threading.Lock()
        #: the compile threads (:class:`~kvserve.engine.bounded_pool.BoundedPool`), started on first use
        self.compile_pool = BoundedPool(
            "grammar compile",
            self.limits.compile_workers,
            self.limits.max_queued_compiles,
            limit_name="max_queued_compiles",
        )
        #: test hook: called in the compile thread before each compile (e.g. to hold it on an event)
        self.before_compile = None

    def compiler(self):
        """The xgrammar ``GrammarCompiler`` (built on the first call: it preprocesses the whole
        vocabulary, which an engine that never sees a grammar never pays for).

        Raises:
            ValueError: xgrammar is not installed.
        """
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ValueError(_XGRAMMAR_MISSING) from None
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._and_mask = self.special_token_mask()
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.max_threads, cache_limit_bytes=CACHE_LIMIT_BYTES
                )
            return self._compiler

    def compile(self, spec: dict):
        """Compile a spec (checked by :func:`validate_spec`) into an xgrammar ``CompiledGrammar``.

        Raises:
            ValueError: xgrammar missing, a spec over a size limit (:func:`check_limits`), or a
                schema / regex / grammar xgrammar rejects
                (``"structured_outputs <kind> is invalid: <xgrammar's reason>"``).
        """
        validate_spec(spec)
        check_limits(spec, self.limits)
        comp = self.compiler()
        kind = next(k for k in KINDS if k in spec)
        ws = spec.get("whitespace_flexible", False)
        try:
            if kind == "json":
                schema = spec["json"] if isinstance(spec["json"], str) else json.dumps(spec["json"])
                return comp.compile_json_schema(schema, any_whitespace=ws)
            if kind == "json_object":
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=ws)
            if kind == "regex":
                return comp.compile_regex(spec["regex"])
            if kind == "choice":
                return comp.compile_grammar(choice_grammar(list(spec["choice"])))
            return comp.compile_grammar(spec["grammar"])
        except Exception as e:  # xgrammar raises RuntimeError (and its own types) with C++ text
            raise ValueError(f"structured_outputs {kind} is invalid: {_short_error(e)}") from None

    def _request_grammar_now(self, spec: dict, reasoning_end: list[int] | None) -> RequestGrammar:
        if self.before_compile is not None:
            self.before_compile(spec)
        compiled = self.compile(spec)  # first: raises the ValueError when xgrammar is missing
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), reasoning_end)

    def submit_request_grammar(self, spec: dict, reasoning_end: list[int] | None = None):
        """Start compiling ``spec`` in the compile pool; never blocks. Returns a
        ``concurrent.futures.Future`` of its :class:`RequestGrammar` (a fresh matcher, applied
        after ``reasoning_end`` when given), which raises what :meth:`compile` raises or, past
        ``compile_timeout_s``, a ``ValueError`` naming the limit (stop waiting for it with
        ``compile_pool.cancel(future)``).

        Raises:
            ValueError: a malformed spec, or one over a size limit (``check_limits``: the
                message names the limit), at once.
            PoolFullError: ``max_queued_compiles`` compiles are waiting already.
        """
        validate_spec(spec)
        check_limits(spec, self.limits)
        t = self.limits.compile_timeout_s
        kind = next(k for k in KINDS if k in spec)
        return self.compile_pool.submit(
            self._request_grammar_now,
            spec,
            reasoning_end,
            deadline_s=t,
            deadline_message=f"structured_outputs {kind} took longer than the limit of {t:g} s to compile "
            f"(compile_timeout_s, structured_outputs_config)",
        )

    def request_grammar(self, spec: dict, reasoning_end: list[int] | None = None) -> RequestGrammar:
        """A fresh matcher over the compiled ``spec``, applied after ``reasoning_end`` when given
        (:class:`RequestGrammar`): :meth:`submit_request_grammar`, waited for (blocking, at
        most ``compile_timeout_s`` once a thread took it).

        Raises:
            ValueError: see :meth:`compile`, a size limit, or the compile deadline (each names its limit).
            PoolFullError: the compile queue is full.
        """
        return self.submit_request_grammar(spec, reasoning_end).result()

    def close_pool(self) -> None:
        """Stop the compile pool (queued compiles are cancelled)."""
        self.compile_pool.shutdown()

    def special_token_mask(self):
        """int32 ``[ceil(vocab_size / 32)]`` with the bits of the tokenizer's special tokens that
        are not stop tokens cleared (``<|im_start|>`` has text that a JSON string would accept;
        the detokenizer would then drop it), or None when there are none."""
        import torch

        ids = sorted(set(getattr(self.tokenizer, "all_special_ids", ())) - set(self.stop_token_ids))
        ids = [t for t in ids if 0 <= t < self.vocab_size]
        if not ids:
            return None
        words = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)
        for t in ids:
            clear_token_bit(words, t)
        return words
