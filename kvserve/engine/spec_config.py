"""``speculative_config``: which proposer drafts, how many tokens, and its checks (vLLM's keys)."""

from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """``speculative_config`` of ``LLM(...)`` / ``kvserve serve --speculative-config JSON``
    (vLLM's keys).

    Attributes:
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"`` (``model`` drafts).
        num_speculative_tokens: most draft tokens per request per step (``k``, >= 1).
        prompt_lookup_max, prompt_lookup_min: n-gram sizes tried, longest first (tokens).
        model: the draft model (local folder or hub id) for ``draft_model``; it must share the
            target's vocabulary.
        draft_tensor_parallel_size: must be 1 (the draft runs in the engine's process).
        adaptive: choose each request's draft length by measured acceptance and cost (False:
            always draft ``num_speculative_tokens`` when a proposal exists).

    Raises:
        ValueError: unknown keys, a bad method or value (the message names the key).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    adaptive: bool = True

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        if "method" not in d:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if d["method"] == "ngram" and "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
            d["prompt_lookup_min"] = min(cls.prompt_lookup_min, d["prompt_lookup_max"])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > 32:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be <= 32, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a local folder or hub id)")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(
                "speculative_config draft_tensor_parallel_size must be 1 (the draft runs in the engine's process)"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
