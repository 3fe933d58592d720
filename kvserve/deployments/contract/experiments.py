"""A/B tests of configurations, as configuration: an experiment splits one served model's traffic
between two or more *variants*, each its own ``LLMServer`` deployment whose settings differ from
the model's in what the variant names (:class:`ExperimentArgs`, :class:`VariantArgs`), and the
live traffic weights every gateway reads (:class:`WeightBoard`, in Ray's GCS key-value store,
so a change needs no restart).

The design's rule, "test one variable at a time": a variant names only what it changes, and
:meth:`ExperimentArgs.differences` lists, per variant, the settings that differ from the first
variant (the control), which ``kvserve experiment report`` prints and warns on.

This module imports neither Ray (except the board, lazily) nor torch.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.deployments.contract.adapters import REGISTRY_NAMESPACE, serve_app_name

#: Settings a variant may change that are the gateway's, not the replica's (the rest are the
#: model's own settings, ``ModelArgs`` fields).
GATEWAY_VARIANT_SETTINGS = ("semantic_cache_threshold",)

#: Model settings a variant may not change: what names the model and the variant themselves.
FIXED_MODEL_SETTINGS = ("served_model_name", "variant")

#: How a variant's name may be spelled (it becomes part of a deployment's name and a metric label).
VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")

#: Request header that carries the session id a ``session`` sticky experiment assigns by.
DEFAULT_SESSION_HEADER = "x-session-id"


class VariantArgs(BaseModel):
    """One variant of an experiment.

    Attributes:
        name: the variant's label (``x-kvserve-variant``, the ``variant`` metric label).
        weight: its share of the traffic, relative to the other variants' (0: none; changed at
            run time with ``kvserve experiment set-weights``).
        settings: what this variant changes: model settings (any ``ModelArgs`` field but
            :data:`FIXED_MODEL_SETTINGS`, e.g. ``max_num_seqs``, ``stream_interval``,
            ``speculative_config``) and the gateway's :data:`GATEWAY_VARIANT_SETTINGS`.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    weight: float = Field(1.0, ge=0)
    settings: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not VARIANT_NAME.match(v):
            raise ValueError(
                f"a variant's name is 1-48 letters, digits, '_', '.' or '-' (starting with a letter "
                f"or digit), got {v!r}"
            )
        return v

    def model_settings(self) -> dict[str, Any]:
        """The settings of the variant that go to its ``LLMServer`` deployment."""
        return {k: v for k, v in self.settings.items() if k not in GATEWAY_VARIANT_SETTINGS}

    def gateway_settings(self) -> dict[str, Any]:
        """The settings of the variant the gateway applies to its requests."""
        return {k: v for k, v in self.settings.items() if k in GATEWAY_VARIANT_SETTINGS}


class ExperimentArgs(BaseModel):
    """An A/B test of one served model's configuration (``experiments`` in the app's args).

    Attributes:
        name: the experiment's name (``x-kvserve-experiment``, ``kvserve experiment report NAME``).
        model: the served model name whose requests are split (its adapters' requests too).
        variants: two or more; the first is the control the others are compared with.
        sticky: what keeps one client on one variant: ``session`` (the ``session_header``,
            falling back to ``user`` and then the API key), ``user`` (the request's ``user``
            field, falling back to the API key), ``api_key`` (the key's name) or ``request``
            (none: every request drawn anew). A request with none of its keys is drawn at random.
        session_header: the header a ``session`` experiment reads.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    model: str
    variants: list[VariantArgs]
    sticky: Literal["session", "user", "api_key", "request"] = "session"
    session_header: str = DEFAULT_SESSION_HEADER

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not VARIANT_NAME.match(v):
            raise ValueError(f"an experiment's name is 1-48 letters, digits, '_', '.' or '-', got {v!r}")
        return v

    @field_validator("session_header")
    @classmethod
    def _header(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9-]{1,64}$", v):
            raise ValueError(f"session_header: a header name (letters, digits, '-'), got {v!r}")
        return v.lower()

    @model_validator(mode="after")
    def _check(self):
        names = [v.name for v in self.variants]
        if len(names) < 2:
            raise ValueError(f"experiment {self.name!r}: an experiment needs at least two variants")
        if len(set(names)) != len(names):
            raise ValueError(f"experiment {self.name!r}: variant names must be unique, got {names}")
        if not any(v.weight > 0 for v in self.variants):
            raise ValueError(f"experiment {self.name!r}: at least one variant needs a weight above 0")
        for v in self.variants:
            fixed = [k for k in v.settings if k in FIXED_MODEL_SETTINGS]
            if fixed:
                raise ValueError(
                    f"experiment {self.name!r}, variant {v.name!r}: {fixed[0]} cannot differ between variants"
                )
        return self

    def weights(self) -> dict[str, float]:
        """The configured weights, by variant name."""
        return {v.name: v.weight for v in self.variants}

    def differences(self) -> dict[str, dict[str, tuple[Any, Any]]]:
        """Per variant after the first: ``{setting: (control's value, variant's value)}`` of the
        settings where the two differ (a setting only one of them names counts as given by the
        other as ``None``: the model's own value)."""
        control = self.variants[0].settings
        out = {}
        for v in self.variants[1:]:
            keys = sorted(set(control) | set(v.settings))
            out[v.name] = {k: (control.get(k), v.settings.get(k)) for k in keys if control.get(k) != v.settings.get(k)}
        return out


def check_weights(weights: dict[str, float], experiment: ExperimentArgs) -> dict[str, float]:
    """``weights`` for ``experiment``'s variants, checked: every name a variant's, each >= 0, one
    above 0; a variant not named keeps weight 0.

    Raises:
        ValueError: an unknown variant, a negative or non-finite weight, all weights 0.
    """
    known = {v.name for v in experiment.variants}
    out = dict.fromkeys(known, 0.0)
    for name, w in weights.items():
        if name not in known:
            raise ValueError(f"experiment {experiment.name!r} has no variant {name!r} (it has {sorted(known)})")
        try:
            w = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"variant {name!r}: a weight is a number, got {w!r}") from None
        if not (w >= 0.0) or w == float("inf"):
            raise ValueError(f"variant {name!r}: a weight is a finite number >= 0, got {w!r}")
        out[name] = w
    if not any(w > 0 for w in out.values()):
        raise ValueError("at least one variant needs a weight above 0")
    return out


class WeightBoard:
    """The experiments' live traffic weights of one Serve application in Ray's GCS key-value
    store (namespace ``kvserve``, keys ``experiments/<app>/<experiment>``, a JSON object
    ``{variant: weight}``): the admin endpoint writes, every gateway replica reads. Calls block on
    the GCS (about a millisecond): call them from a thread in async code.

    Raises:
        RuntimeError: (constructor) not in a process connected to Ray.
    """

    def __init__(self, app_name: str):
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            raise RuntimeError("the experiments' weights need a process connected to a Ray cluster")
        self._kv, self._ns = internal_kv, REGISTRY_NAMESPACE
        self.prefix = f"experiments/{app_name}/"

    @classmethod
    def of_this_app(cls) -> Optional["WeightBoard"]:
        """The board of the Serve application this process serves; None outside a Serve replica."""
        app = serve_app_name()
        return cls(app) if app is not None else None

    def put(self, experiment: str, weights: dict[str, float]) -> None:
        """Publish ``experiment``'s weights (replacing what was there)."""
        self._kv._internal_kv_put(self.prefix + experiment, json.dumps(weights), overwrite=True, namespace=self._ns)

    def get(self, experiment: str) -> dict[str, float] | None:
        """``experiment``'s published weights; None when none were set at run time."""
        raw = self._kv._internal_kv_get(self.prefix + experiment, namespace=self._ns)
        return None if raw is None else {str(k): float(v) for k, v in json.loads(raw).items()}
