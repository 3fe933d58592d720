"""Structured outputs: grammar-constrained decoding with xgrammar.

Source: Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models" (a pushdown automaton over byte-level tokens; most of the vocabulary is
decided per automaton state at compile time, the adaptive token-mask cache, so most of a step's
mask is a lookup). vLLM V1 wires it the same way (``StructuredOutputManager`` in the engine
core, the bitmask applied by the sampler).

A request's ``SamplingParams.structured_outputs`` (vLLM 0.10's shape, see :func:`validate_spec`;
its size bounded by :class:`GrammarLimits`, the engine config's ``structured_outputs_config``)
flows like this::

    LLMEngine.make_request    StructuredOutputs.request_grammar(spec)   compile (cached, in the compile pool,
                              (the engine core: submit_request_grammar)  under a deadline) + matcher -> req.grammar
    LLMEngine.enqueue         StructuredOutputs.add_request(req)        the engine's grammar requests
    LLMEngine.step            StructuredOutputs.fill_bitmask(sched)     fill_bitmask in a worker thread
                                                                        -> SchedulerOutput.grammar_bitmask
                                                                           + SchedulerOutput.grammar_req_ids
    ModelRunner.execute_model bitmask_rows(...) -> Sampler(..., grammar) -> apply_token_bitmask (-inf)
    LLMEngine.step (after)    StructuredOutputs.fill_failures(...)      wait for the fill; matchers that raised
                              StructuredOutputs.advance(updated)        RequestGrammar.accept: advance the
                                                                        matchers; finish when complete

With an in-process executor and at least :data:`ASYNC_FILL_MIN_ROWS` grammar rows the bitmask
travels as a ``Future`` and is filled while the model's forward runs (the sampler waits for it);
fewer rows are filled in the step's thread before the forward, and a distributed executor gets
the filled tensor.

A request whose matcher raises (in the fill or the advance), or whose grammar rejects its token,
fails alone: these methods return it with the exception and the engine finishes it with an error.

Matchers stay in the engine process (with tensor parallelism the runners are other processes);
only the bitmask travels. A bitmask is ``int32 [rows, ceil(vocab_size / 32)]``: bit ``t % 32``
of word ``t // 32`` set means token ``t`` is allowed (xgrammar's layout).

xgrammar and torch are imported lazily: :class:`kvserve.engine.sampling_params.SamplingParams` checks
specs with :func:`validate_spec` in processes that need neither, and an engine without xgrammar
serves every request that does not ask for structured outputs.

Modules: :mod:`kvserve.engine.grammar_spec` (the spec's shape, :func:`validate_spec`),
:mod:`kvserve.engine.xgrammar_backend` (compiling and caching grammars, a request's
:class:`RequestGrammar`), :mod:`kvserve.engine.grammar_bitmask` (filling, matching and applying the
bitmask), and this one: :class:`StructuredOutputs`, the engine's grammar requests and their
per-step work (it re-exports the other modules' names).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvserve.engine.grammar_bitmask import (
    ASYNC_FILL_MIN_ROWS,
    FILL_THREADS,
    _apply_torch,
    apply_token_bitmask,
    bitmask_rows,
    clear_token_bit,
    fill_bitmask,
    new_batch_matcher,
)
from kvserve.engine.grammar_spec import (
    DEFAULT_LIMITS,
    KINDS,
    OPTIONS,
    GrammarLimits,
    check_limits,
    choice_grammar,
    validate_spec,
)
from kvserve.engine.xgrammar_backend import CACHE_LIMIT_BYTES, RequestGrammar, XgrammarBackend

__all__ = [
    "CACHE_LIMIT_BYTES",
    "DEFAULT_LIMITS",
    "ASYNC_FILL_MIN_ROWS",
    "FILL_THREADS",
    "GrammarLimits",
    "KINDS",
    "OPTIONS",
    "RequestGrammar",
    "StructuredOutputs",
    "XgrammarBackend",
    "_apply_torch",
    "apply_token_bitmask",
    "bitmask_rows",
    "check_limits",
    "choice_grammar",
    "clear_token_bit",
    "fill_bitmask",
    "validate_spec",
]


class StructuredOutputs(XgrammarBackend):
    """The engine's structured outputs (vLLM V1's ``StructuredOutputManager``): the grammar
    compiler (:class:`~kvserve.engine.xgrammar_backend.XgrammarBackend`, same arguments), the engine's
    requests that have a grammar (:attr:`requests`), and their per-step work:
    :meth:`fill_bitmask`, :meth:`fill_failures`, :meth:`advance`.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids,
        max_threads: int | None = None,
        limits: GrammarLimits | None = None,
    ):
        super().__init__(tokenizer, vocab_size, stop_token_ids, max_threads, limits)
        self._batch_matcher = None  # xgrammar BatchGrammarMatcher, built with the first fill
        self._pool: ThreadPoolExecutor | None = None  # bitmask_async's worker thread
        #: The engine's requests (``kvserve.engine.request.Request``) that have a grammar, by id (empty:
        #: a step does no grammar work).
        self.requests: dict = {}

    def bitmask(self, grammars: list[RequestGrammar], errors: dict | None = None):
        """int32 ``[len(grammars), ceil(vocab_size / 32)]``: each grammar's allowed next tokens,
        special tokens other than stop tokens cleared; see :func:`fill_bitmask` (``errors``)."""
        batch = None
        if len(grammars) >= ASYNC_FILL_MIN_ROWS:  # one native call over the rows, in parallel
            if self._batch_matcher is None:
                self._batch_matcher = new_batch_matcher()
            batch = self._batch_matcher
        return fill_bitmask(grammars, self.vocab_size, self._and_mask, errors, batch)

    def bitmask_async(self, grammars: list[RequestGrammar], errors: dict):
        """:meth:`bitmask` in this object's worker thread, so that the engine can run the
        model's forward meanwhile (the mask is needed only at sampling). Returns a
        ``concurrent.futures.Future`` of the bitmask; ``errors`` is filled before it resolves.
        The caller must wait for it before it touches the matchers again (accept)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
        return self._pool.submit(self.bitmask, grammars, errors)

    def close(self) -> None:
        """Stop the worker thread (pending fills finish first) and the compile pool."""
        self.close_pool()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- the engine's grammar requests -------------------------------------------------
    def add_request(self, req) -> None:
        """Keep ``req`` (an ``kvserve.engine.request.Request`` entering the engine) if it has a grammar
        (``req.grammar``, from :meth:`~kvserve.engine.xgrammar_backend.XgrammarBackend.request_grammar`)."""
        if req.grammar is not None:
            self.requests[req.request_id] = req

    def release(self, req) -> None:
        """``req`` has left the engine: forget it and free its matcher."""
        self.requests.pop(req.request_id, None)
        req.grammar = None

    def fill_bitmask(self, sched, in_process: bool):
        """Set ``sched.grammar_req_ids`` and ``sched.grammar_bitmask`` (int32 ``[k, ceil(vocab /
        32)]``) of a ``SchedulerOutput`` for the ``k`` requests of the step that sample and have a
        grammar that constrains now (not while the output reasons). With an in-process executor
        (``in_process``) and at least :data:`ASYNC_FILL_MIN_ROWS` rows the bitmask is a ``Future``,
        filled in this object's worker thread while the model's forward runs (the sampler waits
        for it); else it is filled here. The step's finished requests (``sched.finished_req_ids``) are
        forgotten first.

        Returns:
            None (no grammar request in the step), or the pending fill for :meth:`fill_failures`.
        """
        if not self.requests:
            return None
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        reqs = [
            self.requests[sr.request_id]
            for sr in sched.requests
            if sr.sample and sr.request_id in self.requests and self.requests[sr.request_id].grammar.constraining
        ]
        if not reqs:
            return None
        errors: dict[int, Exception] = {}
        grammars = [r.grammar for r in reqs]
        sched.grammar_req_ids = [r.request_id for r in reqs]
        if in_process and len(grammars) >= ASYNC_FILL_MIN_ROWS:
            sched.grammar_bitmask = self.bitmask_async(grammars, errors)
        else:
            sched.grammar_bitmask = self.bitmask(grammars, errors)
        return reqs, errors, sched.grammar_bitmask

    def fill_failures(self, pending) -> list:
        """After the step: wait for the fill (:meth:`fill_bitmask`'s ``pending``; the matchers are
        free again). Returns ``[(request, exception)]`` of the unfinished requests whose matcher
        raised in it (should not happen; if the fill itself broke, every row is suspect), each
        with ``request.error`` set (``"structured_outputs: ..."``): the caller fails them alone
        (their sampled tokens are dropped)."""
        if pending is None:
            return []
        reqs, errors, fill = pending
        if hasattr(fill, "result"):  # a Future
            try:
                fill.result()
            except Exception as e:  # the fill itself broke (not one matcher): every row is suspect
                errors.update({i: e for i in range(len(reqs)) if i not in errors})
        failed = []
        for i, e in errors.items():
            req = reqs[i]
            if req.finished:
                continue
            req.error = f"structured_outputs: {type(e).__name__}: {e}"
            failed.append((req, e))
        return failed

    def advance(self, updated: list, finish_stopped: Callable) -> list:
        """After the update: feed each unfinished grammar request of ``updated`` (requests that
        got tokens) its new tokens. A complete grammar finishes the request through
        ``finish_stopped(request)`` (finish reason ``stop``, ``stop_reason`` None): when the
        matcher terminated (it accepted a stop token the request itself does not stop on, e.g.
        with ``ignore_eos``), or when only a stop token may follow while ``min_tokens`` forbids it.

        Returns:
            ``[(request, exception)]`` of the requests whose token the grammar rejected or whose
            matcher raised: the caller fails them alone.
        """
        if not self.requests:
            return []
        failed = []
        for req in updated:
            g = req.grammar
            if g is None or req.finished:
                continue
            try:
                rejected = g.accept(req.all_token_ids, req.num_prompt_tokens)
                if rejected is not None:
                    raise RuntimeError(f"structured_outputs: the grammar rejected token {rejected}")
                if g.is_terminated() or (
                    req.num_output_tokens < req.params.min_tokens
                    and not req.params.ignore_eos
                    and g.only_stop_allowed(self.stop_token_ids, self.vocab_size)
                ):
                    req.stop_reason = None
                    finish_stopped(req)
            except Exception as e:  # one bad request must not take the batch down
                failed.append((req, e))
        return failed
