"""A/B tests in the gateway: which variant a request goes to, and what each variant's requests did.

:class:`Experiments` holds the application's experiments
(:class:`~kvserve.deployments.contract.experiments.ExperimentArgs`):

- **assignment** (:meth:`Experiments.assign`): a request for an experiment's model goes to one
  of its variants, drawn by the variants' weights. Sticky: the draw is a hash of the experiment's
  name and the request's sticky key (the session header, the ``user`` field or the API key's
  name, as the experiment's ``sticky`` says), so one conversation stays on one variant, and a
  change of weights moves only the share of keys it must (the variants own consecutive ranges
  of the hash, in the configured order). A request with no sticky key is drawn at random.
- **live weights**: the configured weights until an admin sets others
  (``POST /v1/experiments/{name}/weights``, ``kvserve experiment set-weights``); they are kept
  on the application's :class:`~kvserve.deployments.contract.experiments.WeightBoard` and every gateway
  replica reads them again every :data:`WEIGHTS_REFRESH_S` seconds, so no restart is needed.
- **samples** (:meth:`Experiments.record`): one record per finished request of an experiment,
  as the gateway saw it (time to first token, time per output token, tokens, the outcome,
  response cache level, prefix-cached prompt tokens, the replica), the last
  :data:`MAX_SAMPLES` per variant, which ``kvserve experiment report`` analyses
  (:mod:`kvserve.deployments.operator.experiment_report`). They are this gateway replica's: with several
  ingress replicas the report reads the one its request reaches.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import deque
from dataclasses import asdict, dataclass

from kvserve.deployments.contract.experiments import ExperimentArgs, WeightBoard, check_weights
from kvserve.deployments.gateway.streams import background

logger = logging.getLogger("ray.serve")

#: Seconds between a gateway replica's reads of the live weights.
WEIGHTS_REFRESH_S = 2.0
#: Finished requests kept per variant for the report.
MAX_SAMPLES = 20_000


@dataclass(frozen=True)
class Assignment:
    """The variant a request was assigned: its experiment, its name, the deployment it goes to
    (``target``: ``model@variant``) and the gateway's settings of that variant."""

    experiment: str
    variant: str
    target: str
    semantic_threshold: float | None = None

    def headers(self) -> dict[str, str]:
        """The response headers that report the assignment."""
        return {"x-kvserve-experiment": self.experiment, "x-kvserve-variant": self.variant}


@dataclass
class Sample:
    """What one request of a variant did, as the gateway saw it.

    Attributes:
        t: when it ended (Unix seconds).
        status: ``ok``, ``error`` (failed after it was admitted, or a 5xx), or ``refused`` (a 429
            or 503: rate limits, full queues, no replica).
        ttft_s: seconds from the gateway's receipt to the first chunk (None: refused).
        tpot_s: seconds per output token after the first (None: fewer than 2 tokens).
        prompt_tokens, output_tokens, cached_tokens: tokens (cached: prompt tokens the replica's
            prefix cache held).
        cache: ``exact`` or ``semantic`` when the response cache answered, else None.
        replica: the replica that answered (None: the cache or a refusal).
        e2e_s: seconds from the gateway's receipt to the end.
    """

    t: float
    status: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache: str | None = None
    replica: str | None = None


class Experiments:
    """The application's experiments in one gateway replica (see the module docstring).

    Args:
        experiments: the configured experiments.
        board: where live weights are kept (default: this Serve application's; None outside
            Serve: weights set here stay in this process).
        max_samples: finished requests kept per variant.
    """

    def __init__(
        self, experiments: list[ExperimentArgs], board: WeightBoard | None | str = "app", max_samples: int = MAX_SAMPLES
    ):
        self.by_name = {e.name: e for e in experiments}
        self.by_model = {e.model: e for e in experiments}
        self.weights = {e.name: e.weights() for e in experiments}
        self.samples = {e.name: {v.name: deque(maxlen=max_samples) for v in e.variants} for e in experiments}
        self.started = time.time()
        if board == "app":
            board = WeightBoard.of_this_app() if experiments else None
        self.board = board
        self._read_at: dict[str, float] = {}
        self._reading: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.by_name)

    # ---- assignment -----------------------------------------------------------------------
    def assign(self, model: str, headers, user: str | None, key: str | None) -> Assignment | None:
        """The variant of a request for ``model`` (None: no experiment splits it).

        Args:
            headers: the request's headers (a mapping with case-insensitive ``get``).
            user: the request body's ``user`` field.
            key: the API key's name (None or ``anonymous``: no key).
        """
        e = self.by_model.get(model)
        if e is None:
            return None
        self._refresh_soon(e.name)
        sticky = self.sticky_key(e, headers, user, key)
        u = _unit_hash(e.name, sticky) if sticky is not None else random.random()
        name = pick(self.weights[e.name], [v.name for v in e.variants], u)
        v = next(v for v in e.variants if v.name == name)
        return Assignment(e.name, name, f"{model}@{name}", v.gateway_settings().get("semantic_cache_threshold"))

    @staticmethod
    def sticky_key(e: ExperimentArgs, headers, user: str | None, key: str | None) -> str | None:
        """What a request of ``e`` is assigned by (see :class:`ExperimentArgs`'s ``sticky``);
        None: nothing, a random draw."""
        order = {
            "session": ("session", "user", "api_key"),
            "user": ("user", "api_key"),
            "api_key": ("api_key",),
            "request": (),
        }[e.sticky]
        for kind in order:
            if kind == "session":
                value = headers.get(e.session_header) if headers is not None else None
            elif kind == "user":
                value = user
            else:
                value = key if key and key != "anonymous" else None
            if value:
                return f"{kind}:{value}"
        return None

    # ---- live weights ---------------------------------------------------------------------
    async def set_weights(self, name: str, weights: dict[str, float]) -> dict[str, float]:
        """Set experiment ``name``'s weights for every gateway replica (this one at once, the
        others within :data:`WEIGHTS_REFRESH_S`); returns them as set.

        Raises:
            KeyError: no such experiment.
            ValueError: as :func:`~kvserve.deployments.contract.experiments.check_weights`.
            Exception: the board's failure (the GCS away).
        """
        e = self.by_name[name]
        checked = check_weights(weights, e)
        if self.board is not None:
            await asyncio.to_thread(self.board.put, name, checked)
        self.weights[name] = checked
        self._read_at[name] = time.monotonic()
        logger.info("experiment %s: weights now %s", name, checked)
        return checked

    def _refresh_soon(self, name: str) -> None:
        if self.board is None or name in self._reading:
            return
        if time.monotonic() - self._read_at.get(name, 0.0) < WEIGHTS_REFRESH_S:
            return
        self._reading.add(name)
        self._read_at[name] = time.monotonic()
        background(self._read(name))

    async def _read(self, name: str) -> None:
        try:
            w = await asyncio.to_thread(self.board.get, name)
            if w is not None:
                self.weights[name] = check_weights(w, self.by_name[name])
        except Exception as e:  # the GCS away, or weights of an older configuration: keep what we have
            logger.info("experiment %s: reading its weights failed (%s)", name, e)
        finally:
            self._reading.discard(name)

    # ---- samples --------------------------------------------------------------------------
    def record(self, a: Assignment, sample: Sample) -> None:
        """Keep one finished request of variant ``a``."""
        self.samples[a.experiment][a.variant].append(sample)

    def describe(self, name: str, since: float | None = None) -> dict:
        """Experiment ``name``'s configuration, live weights, differences between variants and,
        per variant, the samples that ended at or after ``since`` (Unix seconds; None: all kept).

        Raises:
            KeyError: no such experiment.
        """
        e = self.by_name[name]
        out = {
            "object": "experiment",
            "name": e.name,
            "model": e.model,
            "sticky": e.sticky,
            "weights": self.weights[name],
            "configured_weights": e.weights(),
            "variants": [{"name": v.name, "settings": v.settings} for v in e.variants],
            "differences": {k: {s: list(p) for s, p in d.items()} for k, d in e.differences().items()},
            "gateway_started": self.started,
            "samples": {
                v: [asdict(s) for s in q if since is None or s.t >= since] for v, q in self.samples[name].items()
            },
        }
        return out


def pick(weights: dict[str, float], order: list[str], u: float) -> str:
    """The variant that owns ``u`` in [0, 1): the variants, in ``order``, own consecutive ranges
    of [0, 1) as long as their shares of the weights' total."""
    total = sum(max(0.0, weights.get(v, 0.0)) for v in order)
    acc = 0.0
    last = None
    for v in order:
        w = max(0.0, weights.get(v, 0.0))
        if w <= 0:
            continue
        acc += w / total
        last = v
        if u < acc:
            return v
    return last


def _unit_hash(experiment: str, key: str) -> float:
    """A uniform number in [0, 1) from ``experiment`` and ``key`` (SHA-256: independent of the
    process, so every gateway replica assigns a key alike)."""
    h = hashlib.sha256(f"{experiment}\0{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64
