"""Fault injection into a live :class:`kvserve.engine.llm_engine.LLMEngine`: make one of its per-request
hooks raise for the requests a predicate picks, and nothing else (the test engine, the fuzzer
and a live Serve replica use the same wrappers).

Hooks (:data:`HOOKS`) and what the engine promises when one raises on a request:

* ``propose`` (the n-gram or draft-model proposer) and ``draft_length`` (the draft-length
  policy): drafting is turned off for that request; it goes on and its output is unchanged.
* ``grammar_fill`` (the bitmask of allowed tokens), ``grammar_accept`` (advancing the matcher),
  ``detokenize`` (incremental detokenization and stop strings), ``logprobs`` (recording a
  sampled token's logprobs), ``prompt_logprobs`` (recording prompt logprobs) and ``output``
  (assembling the output's text delta): that request ends with ``finish_reason "error"``;
  every other request of the engine is untouched.
* ``stat_logger`` and ``request_logger`` (engine-wide, not per request): nobody is affected.

Wrappers stand in for the engine's own objects (the proposer, the policy, a request's grammar
matcher, detokenizer and logprob list), so the engine code under test is the shipped code.
"""

from __future__ import annotations

from collections.abc import Callable

#: Per-request hooks after which the request must fail alone.
FAILING_HOOKS = ("grammar_fill", "grammar_accept", "detokenize", "logprobs", "prompt_logprobs", "output")
#: Per-request hooks after which the request goes on without drafts.
DRAFTING_HOOKS = ("propose", "draft_length")
#: Engine-wide side paths that must affect nobody.
LOGGER_HOOKS = ("stat_logger", "request_logger")
HOOKS = FAILING_HOOKS + DRAFTING_HOOKS + LOGGER_HOOKS


class InjectedFault(RuntimeError):
    """What every injected hook raises."""


def _raise(hook: str, request_id: str):
    raise InjectedFault(f"injected fault in {hook} for request {request_id}")


class _Proxy:
    """Stands in for a request's grammar matcher or detokenizer: ``method`` goes through
    :meth:`Faults._check` (which raises once the hook's good calls are used up), the rest is
    delegated."""

    def __init__(self, inner, method: str, hook: str, request_id: str, faults: "Faults"):
        self._inner, self._method, self._hook, self._rid, self._faults = inner, method, hook, request_id, faults

    def __getattr__(self, name):
        if name == self._method:

            def call(*a, **k):
                self._faults._check(self._hook, self._rid)
                return getattr(self._inner, name)(*a, **k)

            return call
        if name == "_handle" and self._hook == "grammar_fill":
            # xgrammar's batch fill reads each matcher's native handle, past the wrapper:
            # fail it, so the engine fills row by row (through ``call``)
            _raise("grammar batch fill", self._rid)
        return getattr(self._inner, name)


class Faults:
    """Installs fault wrappers on one engine.

    ``poison(req, hook)`` arms ``hook`` for a request already in the engine;
    ``arm_future(hook, predicate)`` arms it for every request enqueued later for which
    ``predicate(request)`` holds (e.g. its prompt carries a marker). Engine-wide hooks are
    armed with :meth:`break_loggers`. :attr:`fired` records ``(hook, request_id)`` of every
    fault that actually raised.
    """

    def __init__(self, engine):
        self.engine = engine
        self.fired: list[tuple[str, str]] = []
        self._armed: dict[tuple[str, str], int] = {}  # (hook, request id) -> good calls left
        self._future: list[tuple[str, Callable]] = []
        if engine.speculator is not None:  # the proposer and draft-length policy are the speculator's
            self._wrap_proposer()
            self._wrap_policy()
        enqueue = engine.enqueue

        def enqueue_and_arm(req):
            enqueue(req)
            for hook, pred, after in self._future:
                if pred(req):
                    self.poison(req, hook, after)

        engine.enqueue = enqueue_and_arm

    def _fire(self, hook: str, rid: str):
        self.fired.append((hook, rid))
        _raise(hook, rid)

    def _check(self, hook: str, rid: str) -> None:
        """Raise if ``hook`` is armed for ``rid`` and its good calls are used up."""
        left = self._armed.get((hook, rid))
        if left is None:
            return
        if left > 0:
            self._armed[(hook, rid)] = left - 1
            return
        self._fire(hook, rid)

    # ---- engine-wide wrappers ------------------------------------------------------------
    def _wrap_proposer(self):
        eng, faults = self.engine, self
        base = type(eng.speculator.proposer)

        class FaultyProposer(base):  # a subclass, so the engine's isinstance checks still hold
            def __init__(self, inner):
                self.__dict__.update(inner.__dict__)  # takes over the proposer's state

            def propose(self, *args):
                if len(args) == 2:  # n-gram: (token_ids, k); find the request by its token list
                    for req in eng.scheduler.running:
                        if req.all_token_ids is args[0]:
                            faults._check("propose", req.request_id)
                else:  # draft model: [(request, k)]
                    for req, _ in args[0]:
                        faults._check("propose", req.request_id)
                return base.propose(self, *args)

        eng.speculator.proposer = FaultyProposer(eng.speculator.proposer)

    def _wrap_policy(self):
        policy, faults = self.engine.speculator.policy, self
        draft_length = policy.draft_length

        def faulty(request_id, available, batch):
            faults._check("draft_length", request_id)
            return draft_length(request_id, available, batch)

        policy.draft_length = faulty

    def break_loggers(self) -> None:
        """Add a stat logger and a request logger that always raise."""

        def stat(m):
            self._fire("stat_logger", "-")

        def finished(s):
            self._fire("request_logger", s.request_id)

        self.engine.stat_loggers.append(stat)
        self.engine.request_loggers.append(finished)

    # ---- per request ----------------------------------------------------------------------
    def arm_future(self, hook: str, predicate: Callable, after: int = 0) -> None:
        self._future.append((hook, predicate, after))

    def poison(self, req, hook: str, after: int = 0) -> bool:
        """Arm ``hook`` for ``req`` (in the engine): it raises after ``after`` good calls
        (e.g. mid-stream). Returns False when the request has no such hook (no grammar, no
        detokenizer, no logprobs, no speculation)."""
        rid, eng = req.request_id, self.engine
        if hook in ("propose", "draft_length", "logprobs", "prompt_logprobs"):
            if (
                hook in DRAFTING_HOOKS
                and eng.speculator is None
                or hook == "logprobs"
                and req.params.logprobs is None
                or hook == "prompt_logprobs"
                and req.params.prompt_logprobs is None
            ):
                return False
            self._armed[(hook, rid)] = after
            if hook == "logprobs":
                faults = self

                class FaultyList(list):
                    def append(self, item):
                        faults._check("logprobs", rid)
                        super().append(item)

                req.logprobs = FaultyList(req.logprobs)
            elif hook == "prompt_logprobs":
                add = req.add_prompt_logprobs

                def faulty(entries):
                    self._check("prompt_logprobs", rid)
                    add(entries)

                req.add_prompt_logprobs = faulty
        elif hook in ("grammar_fill", "grammar_accept"):
            if req.grammar is None:
                return False
            method = "fill_next_token_bitmask" if hook == "grammar_fill" else "accept_token"
            req.grammar.matcher = _Proxy(req.grammar.matcher, method, hook, rid, self)
            self._armed[(hook, rid)] = after
        elif hook in ("detokenize", "output"):
            detokenizers = eng.output_processor.detokenizers
            detok = detokenizers.get(rid)
            if detok is None:
                return False
            detokenizers[rid] = _Proxy(detok, "update" if hook == "detokenize" else "delta", hook, rid, self)
            self._armed[(hook, rid)] = after
        else:
            raise ValueError(f"unknown hook {hook!r}; one of {HOOKS}")
        return True
