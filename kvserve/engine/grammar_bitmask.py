"""The grammar's token bitmask: filling it from the matchers, matching its rows to logits rows, applying it.

A bitmask is ``int32 [rows, ceil(vocab_size / 32)]``: bit ``t % 32`` of word ``t // 32`` set
means token ``t`` is allowed (xgrammar's layout). It is filled in the engine process (where the
matchers are) and applied by the sampler, in whatever process runs the model; there xgrammar is
optional (a torch fallback applies it).
"""

from __future__ import annotations

import os

#: Native threads of one bitmask fill (xgrammar ``BatchGrammarMatcher``), beside the model's
#: forward; ``benchmarks/structured_output.py --fill-threads`` compares thread counts.
FILL_THREADS = min(8, os.cpu_count() or 1)
#: Grammar rows from which a step's fill is worth a thread beside the forward pass and
#: xgrammar's batch matcher; below it the rows are filled one by one, in the step's own thread,
#: before the forward: a fill of a few rows takes microseconds (the mask cache decides most
#: tokens), less than handing it to a thread that then competes with the model's threads for
#: the cores (on a 2-core box that cost a neighbour's stream more than the fill itself).
ASYNC_FILL_MIN_ROWS = 4


def new_batch_matcher():
    """An xgrammar ``BatchGrammarMatcher`` of :data:`FILL_THREADS` threads (xgrammar must be
    installed: a caller has compiled grammars)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)


def clear_token_bit(words, token_id: int) -> None:
    """Clear token ``token_id``'s bit in an int32 bitmask row ``words`` (in place)."""
    mask = ~(1 << (token_id % 32))
    words[token_id // 32] &= mask if mask >= -(1 << 31) else mask + (1 << 32)  # bit 31: the sign bit


def fill_bitmask(grammars: list, vocab_size: int, and_mask=None, errors: dict | None = None, batch_matcher=None):
    """The next-token bitmask of each grammar, one row each (xgrammar's
    ``fill_next_token_bitmask``, Dong et al. 2024 sec. 3.1: context-independent tokens from the
    compile-time cache, the rest checked against the parser's stack; cheap where the token-mask
    cache decides the vocabulary, far costlier per row inside e.g. a ``maxLength`` string of an
    array item: ``benchmarks/structured_output.py`` measures the fill per schema).

    Args:
        grammars: :class:`kvserve.engine.xgrammar_backend.RequestGrammar` objects, in row order.
        vocab_size: the model's vocabulary size.
        and_mask: optional int32 ``[ceil(vocab_size / 32)]`` ANDed into every row
            (:meth:`kvserve.engine.xgrammar_backend.XgrammarBackend.special_token_mask`).
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
    """Set the logits of disallowed tokens to -inf, in place: on CPU, and on any device whose
    process has no xgrammar, in torch row by row (:func:`_apply_torch`; on CPU ~4x faster than
    xgrammar's scalar loop over a 49k-token vocabulary, which also needs a full-batch bitmask for
    a partial one); elsewhere xgrammar's ``apply_token_bitmask_inplace`` (its CUDA / Triton
    kernel). ``benchmarks/structured_output.py`` times the apply step.

    Args:
        logits: float ``[n, vocab]`` (any device).
        bitmask: int32 ``[k, ceil(vocab / 32)]`` (CPU or ``logits``' device).
        rows: ``k`` row indices of ``logits``, row ``j`` of ``bitmask`` masks ``logits[rows[j]]``.
    """
    import torch

    if logits.device.type == "cpu":
        return _apply_torch(logits, bitmask, rows)
    n = logits.shape[0]
    partial = len(rows) != n or rows != list(range(n))
    xgr = _xgrammar()
    if xgr is None:
        return _apply_torch(logits, bitmask.to(logits.device, non_blocking=True), rows)
    if partial:  # xgrammar indexes bitmask rows like logits rows
        full = torch.full((n, bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        full[rows] = bitmask
        bitmask = full
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows if partial else None
    )


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
    """:func:`apply_token_bitmask` in torch (the CPU path, and any device without xgrammar): the
    bits unpacked by shifts (int32 ``[k, 32 * words]``), then each row of ``logits`` masked in
    place (a token past ``32 * words`` is disallowed)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)
    vocab = logits.shape[1]
    width = min(vocab, bits.shape[1])
    for j, r in enumerate(rows):
        row = logits[r]
        row[:width].masked_fill_(bits[j, :width] == 0, float("-inf"))
        if width < vocab:
            row[width:] = float("-inf")
