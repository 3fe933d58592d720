"""Structured outputs: grammar-constrained decoding with xgrammar.

Source: Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models" (a pushdown automaton over byte-level tokens; most of the vocabulary is
decided per automaton state at compile time, the adaptive token-mask cache, so a step's mask
costs microseconds). vLLM V1 wires it the same way (``StructuredOutputManager`` in the engine
core, the bitmask applied by the sampler).

A request's ``SamplingParams.structured_outputs`` (vLLM 0.10's shape, see :func:`validate_spec`)
flows like this::

    LLMEngine.make_request    StructuredOutputs.request_grammar(spec)   compile (cached) + matcher -> req.grammar
    LLMEngine.enqueue         StructuredOutputs.add_request(req)        the engine's grammar requests
    LLMEngine.step            StructuredOutputs.fill_bitmask(sched)     fill_bitmask in a worker thread
                                                                        -> SchedulerOutput.grammar_bitmask
                                                                           + SchedulerOutput.grammar_req_ids
    ModelRunner.execute_model bitmask_rows(...) -> Sampler(..., grammar) -> apply_token_bitmask (-inf)
    LLMEngine.step (after)    StructuredOutputs.fill_failures(...)      wait for the fill; matchers that raised
                              StructuredOutputs.advance(updated)        RequestGrammar.accept: advance the
                                                                        matchers; finish when complete

With an in-process executor the bitmask travels as a ``Future`` and is filled while the model's
forward runs (the sampler waits for it); a distributed executor gets the filled tensor.

A request whose matcher raises (in the fill or the advance), or whose grammar rejects its token,
fails alone: these methods return it with the exception and the engine finishes it with an error.

Matchers stay in the engine process (with tensor parallelism the runners are other processes);
only the bitmask travels. A bitmask is ``int32 [rows, ceil(vocab_size / 32)]``: bit ``t % 32``
of word ``t // 32`` set means token ``t`` is allowed (xgrammar's layout).

xgrammar and torch are imported lazily: :class:`engine.sampling_params.SamplingParams` checks
specs with :func:`validate_spec` in processes that need neither, and an engine without xgrammar
serves every request that does not ask for structured outputs.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: The grammar kinds of a spec; exactly one per request.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: Options that may accompany a kind. ``whitespace_flexible`` (default False): JSON may carry
#: any whitespace between tokens (xgrammar's ``any_whitespace``); off, JSON is compact
#: (``{"a": 1, "b": [2, 3]}``), which keeps small models out of whitespace loops.
OPTIONS = ("whitespace_flexible",)
#: Native threads of one bitmask fill (xgrammar ``BatchGrammarMatcher``). On the 2-core CPU box
#: two threads beside the model's forward beat one (benchmarks/structured_output.py).
FILL_THREADS = min(8, os.cpu_count() or 1)
#: Memory cap of the per-engine compiled-grammar cache (bytes; least recently used evicted).
CACHE_LIMIT_BYTES = 256 << 20

_XGRAMMAR_MISSING = "structured_outputs needs xgrammar: pip install xgrammar"


def validate_spec(spec) -> None:
    """Check the shape of ``SamplingParams.structured_outputs`` (no compilation).

    A dict with exactly one of: ``json`` (a JSON schema, dict or JSON string of an object),
    ``json_object`` (True: any JSON object), ``regex`` (a non-empty pattern string),
    ``choice`` (a non-empty list of non-empty strings), ``grammar`` (an EBNF / GBNF string,
    root rule ``root``); optionally ``whitespace_flexible`` (bool, JSON kinds only).

    Raises:
        ValueError: any other shape; the message starts with ``structured_outputs``.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be a dict with one of the keys {', '.join(KINDS)}, "
                         f"got {type(spec).__name__}")
    unknown = sorted(str(k) for k in spec if k not in KINDS + OPTIONS)
    if unknown:
        raise ValueError(f"structured_outputs has unknown key(s) {unknown}; "
                         f"allowed: {', '.join(KINDS + OPTIONS)}")
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs json must be a JSON schema object (a dict or a JSON string)")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs json is not JSON-serializable: {e}") from None
    elif kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs json_object must be True, got {value!r}")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs {kind} must be a non-empty string")
    elif kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or any(not isinstance(c, str) or not c for c in value)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
    ws = spec.get("whitespace_flexible", False)
    if not isinstance(ws, bool):
        raise ValueError(f"structured_outputs whitespace_flexible must be a bool, got {ws!r}")
    if ws and kind not in ("json", "json_object"):
        raise ValueError("structured_outputs whitespace_flexible applies to json and json_object only")


def choice_grammar(choices: list[str]) -> str:
    """EBNF (xgrammar / GBNF syntax) accepting exactly one of ``choices``. JSON string
    escapes are valid GBNF literal escapes (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _short_error(e: BaseException) -> str:
    """xgrammar's C++ error text without its ``[time] file.cc:line:`` prefix, one line."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    msg = re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg[:300]


def _clear_bit(words, token_id: int) -> None:
    """Clear token ``token_id``'s bit in an int32 bitmask row ``words`` (in place)."""
    mask = ~(1 << (token_id % 32))
    words[token_id // 32] &= mask if mask >= -(1 << 31) else mask + (1 << 32)  # bit 31: the sign bit


class RequestGrammar:
    """One request's grammar state: an xgrammar ``GrammarMatcher`` (the pushdown automaton of
    Dong et al. 2024, sec. 3) and how many of the request's output tokens it has accepted (so a
    token is never accepted twice, e.g. after a preemption by recompute, which keeps the outputs)."""

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_accepted = 0

    def accept(self, token_ids: list[int], num_prompt_tokens: int) -> int | None:
        """Feed the output tokens (``token_ids[num_prompt_tokens:]``, the request's
        ``all_token_ids``) that the matcher has not accepted yet.

        Returns:
            None if all were accepted, else the first rejected token id (the matcher then
            stays before it).
        """
        for i in range(num_prompt_tokens + self.num_accepted, len(token_ids)):
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
            _clear_bit(row, t)
        return not bool(row.any())


class StructuredOutputs:
    """The engine's grammar compiler: one xgrammar ``GrammarCompiler`` (Dong et al. 2024: the
    grammar's pushdown automaton plus its adaptive token-mask cache, built per vocabulary) over
    the engine's tokenizer, built on first use; compiled grammars are cached by xgrammar, keyed by
    the grammar text (at most :data:`CACHE_LIMIT_BYTES`), so a repeated spec costs ~10
    microseconds instead of a compile (5-80 ms for the schemas of benchmarks/structured_output.py).

    It also keeps the engine's requests that have a grammar (:attr:`requests`; vLLM V1's
    ``StructuredOutputManager``) and does their per-step work: :meth:`fill_bitmask`,
    :meth:`fill_failures`, :meth:`advance`.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (``hf_config.vocab_size``, the logits' width;
            may exceed the tokenizer's, the extra ids are never allowed).
        stop_token_ids: ids that end the output once the grammar is complete (the engine's EOS
            ids); a matcher accepts one of them after a complete match and then terminates.
        max_threads: compiler threads (default: the CPU count, at most 8).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_threads: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_threads = max_threads or min(8, os.cpu_count() or 1)
        self._compiler = None
        self._and_mask = None  # special_token_mask(), built with the compiler
        self._batch_matcher = None  # xgrammar BatchGrammarMatcher, built with the compiler
        self._pool: ThreadPoolExecutor | None = None  # bitmask_async's worker thread
        self._lock = threading.Lock()
        #: The engine's requests (``engine.request.Request``) that have a grammar, by id (empty:
        #: a step does no grammar work).
        self.requests: dict = {}

    def compiler(self):
        """The xgrammar ``GrammarCompiler`` (built on the first call, ~0.1 s for a 49k vocab).

        Raises:
            ValueError: xgrammar is not installed.
        """
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ValueError(_XGRAMMAR_MISSING) from None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._and_mask = self.special_token_mask()
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def bitmask(self, grammars: list[RequestGrammar], errors: dict | None = None):
        """int32 ``[len(grammars), ceil(vocab_size / 32)]``: each grammar's allowed next tokens,
        special tokens other than stop tokens cleared; see :func:`fill_bitmask` (``errors``)."""
        return fill_bitmask(grammars, self.vocab_size, self._and_mask, errors, self._batch_matcher)

    def bitmask_async(self, grammars: list[RequestGrammar], errors: dict):
        """:meth:`bitmask` in this object's worker thread, so that the engine can run the
        model's forward meanwhile (the mask is needed only at sampling). Returns a
        ``concurrent.futures.Future`` of the bitmask; ``errors`` is filled before it resolves.
        The caller must wait for it before it touches the matchers again (accept)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
        return self._pool.submit(self.bitmask, grammars, errors)

    def close(self) -> None:
        """Stop the worker thread (pending fills finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- the engine's grammar requests -------------------------------------------------
    def add_request(self, req) -> None:
        """Keep ``req`` (an ``engine.request.Request`` entering the engine) if it has a grammar
        (``req.grammar``, from :meth:`request_grammar`)."""
        if req.grammar is not None:
            self.requests[req.request_id] = req

    def release(self, req) -> None:
        """``req`` has left the engine: forget it and free its matcher."""
        self.requests.pop(req.request_id, None)
        req.grammar = None

    def fill_bitmask(self, sched, in_process: bool):
        """Set ``sched.grammar_req_ids`` and ``sched.grammar_bitmask`` (int32 ``[k, ceil(vocab /
        32)]``) of a ``SchedulerOutput`` for the ``k`` requests of the step that sample and have a
        grammar. With an in-process executor (``in_process``) the bitmask is a ``Future``, filled
        in this object's worker thread while the model's forward runs (the sampler waits for it);
        else it is filled here. The step's finished requests (``sched.finished_req_ids``) are
        forgotten first.

        Returns:
            None (no grammar request in the step), or the pending fill for :meth:`fill_failures`.
        """
        if not self.requests:
            return None
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        reqs = [self.requests[sr.request_id] for sr in sched.requests
                if sr.sample and sr.request_id in self.requests]
        if not reqs:
            return None
        errors: dict[int, Exception] = {}
        grammars = [r.grammar for r in reqs]
        sched.grammar_req_ids = [r.request_id for r in reqs]
        if in_process:
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
                        req.num_output_tokens < req.params.min_tokens and not req.params.ignore_eos
                        and g.only_stop_allowed(self.stop_token_ids, self.vocab_size)):
                    req.stop_reason = None
                    finish_stopped(req)
            except Exception as e:  # one bad request must not take the batch down
                failed.append((req, e))
        return failed

    def compile(self, spec: dict):
        """Compile a spec (checked by :func:`validate_spec`) into an xgrammar ``CompiledGrammar``.

        Raises:
            ValueError: xgrammar missing, or a schema / regex / grammar xgrammar rejects
                (``"structured_outputs <kind> is invalid: <xgrammar's reason>"``).
        """
        validate_spec(spec)
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

    def request_grammar(self, spec: dict) -> RequestGrammar:
        """A fresh matcher over the compiled ``spec`` (see :meth:`compile` for errors)."""
        compiled = self.compile(spec)  # first: raises the ValueError when xgrammar is missing
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled))

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
            _clear_bit(words, t)
        return words


def fill_bitmask(grammars: list[RequestGrammar], vocab_size: int, and_mask=None, errors: dict | None = None,
                 batch_matcher=None):
    """The next-token bitmask of each grammar, one row each (xgrammar's
    ``fill_next_token_bitmask``, Dong et al. 2024 sec. 3.1: context-independent tokens from the
    compile-time cache, the rest checked against the parser's stack: ~1 us per row where its token-mask cache decides the
    vocabulary, up to ~2 ms per row inside e.g. a ``maxLength`` string of an array item).

    Args:
        grammars: matchers, in row order.
        vocab_size: the model's vocabulary size.
        and_mask: optional int32 ``[ceil(vocab_size / 32)]`` ANDed into every row
            (:meth:`StructuredOutputs.special_token_mask`).
        errors: optional dict that gets ``{row: exception}`` of the matchers that raised (e.g.
            one already terminated; their rows are left undefined); without it, errors raise.
        batch_matcher: optional xgrammar ``BatchGrammarMatcher``: all rows in one native call
            (the GIL is taken once, not once per row; rows in parallel with ``max_threads > 1``).
            On an error the rows are redone one by one to find the failing ones.

    Returns:
        int32 CPU tensor ``[len(grammars), ceil(vocab_size / 32)]``.
    """
    import torch

    bitmask = torch.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    done = False
    if batch_matcher is not None:
        try:
            batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
            done = True
        except Exception:
            pass  # redo row by row: which matcher failed?
    if not done:
        for i, g in enumerate(grammars):
            try:
                g.matcher.fill_next_token_bitmask(bitmask, i)
            except Exception as e:  # one broken matcher must not take the batch down
                if errors is None:
                    raise
                errors[i] = e
                bitmask[i] = -1  # a harmless row: its token is dropped
    if and_mask is not None:
        bitmask &= and_mask
    return bitmask


def bitmask_rows(bitmask, grammar_req_ids: list[str], sample_req_ids: list[str]):
    """``bitmask`` may be a ``concurrent.futures.Future`` of it (an in-process executor: the
    engine fills it while the model runs); it is waited for here.

    Match a step's bitmask rows (``grammar_req_ids[j]`` owns row ``j``) to the sampler's
    rows (``sample_req_ids[i]`` owns logits row ``i``); requests of the bitmask that do not
    sample in this call (e.g. a sub-batch of failure isolation) are skipped.

    Returns:
        ``(bitmask_rows int32 [k, words], logits_rows list[int] of length k)``, or None if no
        sampling row has a grammar.
    """
    if hasattr(bitmask, "result"):
        bitmask = bitmask.result()
    pos = {rid: i for i, rid in enumerate(sample_req_ids)}
    pairs = [(j, pos[rid]) for j, rid in enumerate(grammar_req_ids) if rid in pos]
    if not pairs:
        return None
    js = [j for j, _ in pairs]
    sub = bitmask if js == list(range(bitmask.shape[0])) else bitmask[js]
    return sub, [i for _, i in pairs]


def apply_token_bitmask(logits, bitmask, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place: xgrammar's
    ``apply_token_bitmask_inplace`` (a native CPU loop, or its CUDA / Triton kernel), or the
    same in torch where the runner's process has no xgrammar (:func:`_apply_torch`). On a
    2-core CPU at 32 rows x 49152 tokens xgrammar's takes ~1-4 ms, the torch one ~10x more.

    Args:
        logits: float ``[n, vocab]`` (any device).
        bitmask: int32 ``[k, ceil(vocab / 32)]`` (CPU or ``logits``' device).
        rows: ``k`` row indices of ``logits``, row ``j`` of ``bitmask`` masks ``logits[rows[j]]``.
    """
    import torch

    n = logits.shape[0]
    partial = len(rows) != n or rows != list(range(n))
    xgr = _xgrammar()
    if xgr is None:
        return _apply_torch(logits, bitmask.to(logits.device, non_blocking=True), rows)
    if partial:  # xgrammar indexes bitmask rows like logits rows
        full = torch.full((n, bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        full[rows] = bitmask
        bitmask = full
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=rows if partial else None)


def _xgrammar():
    """The xgrammar module, or None when it is not installed (imported once)."""
    global _XGR
    if _XGR is False:
        try:
            import xgrammar
        except ImportError:
            xgrammar = None
        _XGR = xgrammar
    return _XGR


_XGR = False  # not tried yet


def _apply_torch(logits, bitmask, rows: list[int]) -> None:
    """:func:`apply_token_bitmask` in torch: unpack the bits (``[k, words, 32]``), -inf where 0;
    a token past ``32 * words`` is disallowed."""
    import torch

    k, vocab = len(rows), logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(k, -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab], float("-inf"))
