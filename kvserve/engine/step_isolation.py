"""When a step fails: find the request(s) that make it fail by re-running the step in parts
(:func:`isolate_failing_requests`), so one bad request is finished with an error instead of
taking the batch (or the engine) down; :class:`StepFailedError` when no request is to blame."""

from __future__ import annotations

import logging

from kvserve.engine.executor import Executor
from kvserve.engine.model_runner import ModelRunnerOutput
from kvserve.engine.sched_output import SchedulerOutput

logger = logging.getLogger("kvserve.engine")


class StepFailedError(RuntimeError):
    """The model step failed for every request in it, each one alone too, so the failure
    cannot be pinned on a request (a broken executor or device, an engine bug). The requests
    are still in the engine; the caller decides (the async engine checks the executor's
    health, then fails them or declares the engine dead). ``__cause__`` is the first error.

    Attributes:
        request_ids: the requests of the failed step.
    """

    def __init__(self, request_ids: list[str], error: BaseException):
        super().__init__(
            f"engine step failed for all {len(request_ids)} request(s) in it: {type(error).__name__}: {error}"
        )
        self.request_ids = request_ids


def isolate_failing_requests(
    executor: Executor, sched: SchedulerOutput, error: Exception
) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
    """After ``executor.execute_model(sched)`` raised ``error``: find the request(s) that make it fail.

    Bisection: re-run the step's requests in halves (smaller ``SchedulerOutput`` objects), splitting
    every half that fails again, down to single requests. Re-running is safe: the K/V of
    the same tokens is written to the same slots, the runner's per-request state update
    is idempotent and the sampler restores seeded generators when it raises;
    ``finished_req_ids`` go with the first sub-call (dropping runner state twice is
    harmless). Costs at most ``2 * f * log2(n)`` extra calls for ``f`` failing requests
    among ``n``.

    Returns:
        The merged output of the requests that ran, and ``{request_id: exception}`` of
        those that fail alone.

    Raises:
        StepFailedError: every request fails alone (or the step has one request), so
            the failure is not attributable to a request.
    """
    reqs = sched.requests
    if len(reqs) < 2:
        raise StepFailedError([sr.request_id for sr in reqs], error) from error
    logger.warning(
        "step of %d requests failed (%s: %s); isolating the failing request(s)", len(reqs), type(error).__name__, error
    )
    sampled, logprobs, prompt_logprobs, pooled, failed = {}, {}, {}, {}, {}

    def run(part, finished_ids):
        try:
            out = executor.execute_model(
                SchedulerOutput(
                    part, finished_ids, grammar_req_ids=sched.grammar_req_ids, grammar_bitmask=sched.grammar_bitmask
                )
            )
        except Exception as e:
            if len(part) == 1:
                failed[part[0].request_id] = e
                return
            mid = len(part) // 2
            run(part[:mid], finished_ids)
            run(part[mid:], [])
            return
        sampled.update(out.sampled)
        logprobs.update(out.logprobs or {})
        prompt_logprobs.update(out.prompt_logprobs or {})
        pooled.update(out.pooled or {})

    mid = len(reqs) // 2
    run(reqs[:mid], sched.finished_req_ids)
    run(reqs[mid:], [])
    if len(failed) == len(reqs):
        raise StepFailedError([sr.request_id for sr in reqs], error) from error
    for rid, e in failed.items():
        logger.error("request %s failed alone and is finished with an error: %s: %s", rid, type(e).__name__, e)
    return ModelRunnerOutput(sampled, logprobs or None, prompt_logprobs or None, pooled or None), failed
