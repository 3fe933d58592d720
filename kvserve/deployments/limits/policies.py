"""API key policies: :class:`KeyPolicy` -- one API key and its limits, read from a key file
(:func:`load_key_file`) or from ``--api-key`` / ``KVSERVE_API_KEYS`` entries
(:func:`policies_from_keys`); :func:`find_policy` finds a request's key in constant time.

Key file format, one key per line::

    # comment; blank lines are ignored
    sk-plain-key                                  # the old format: a key alone
    sk-team-a  name=team-a  rpm=60  tpm=20000  priority=-1
    sk-batch   name=batch   rpm=inf  priority=5   # inf: no limit even when a default is set
    sk-app-1   name=app-1   prefix_cache_group=app  # keys of one group share cached prefixes

``rpm`` / ``tpm``: requests / tokens per minute (numbers >= 0; ``0``: none at all; absent: the
server's default). ``priority``: an integer for the engine scheduler, lower runs first (vLLM's
convention). ``name``: the label for metrics and logs, by default
``"key-" + sha256(key).hexdigest()[:8]``. ``prefix_cache_group``: keys naming the same group
share the engine's cached prompt prefixes (and see each other's hits in ``cached_tokens``);
by default each key's prefixes are its own (:meth:`KeyPolicy.cache_salt`). Errors name the
line, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,63}")
_ATTRS = ("name", "rpm", "tpm", "priority", "prefix_cache_group")
_ATTR_PREFIX = re.compile(r"(?:name|rpm|tpm|priority|prefix_cache_group)=")


def key_name(key: str) -> str:
    """The default label of a key: ``"key-" + sha256(key).hexdigest()[:8]`` (safe to log)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class KeyPolicy:
    """One API key and its limits.

    ``requests_per_minute`` / ``tokens_per_minute``: ``None`` takes the limiter's default
    (itself possibly ``None``: no limit); ``math.inf``: no limit for this key; ``0``: nothing
    passes. ``priority``: the engine scheduler's priority, lower runs first.

    Raises:
        ValueError: a negative or NaN limit, or a name that is not 1-64 characters of
            ``[A-Za-z0-9._:@/+-]`` starting with a letter or digit.
    """

    key: str = field(repr=False)  # the secret: never in repr, logs or error messages
    name: str = ""  # empty: derived from the key with key_name()
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    priority: int = 0
    #: keys of one group share cached prompt prefixes; None: this key's are its own
    prefix_cache_group: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", key_name(self.key))
        elif not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"invalid key name {self.name!r}: use 1-64 characters of [A-Za-z0-9._:@/+-]")
        if self.prefix_cache_group is not None and not _NAME_RE.fullmatch(self.prefix_cache_group):
            raise ValueError("prefix_cache_group must be 1-64 characters of [A-Za-z0-9._:@/+-]")
        for attr in ("requests_per_minute", "tokens_per_minute"):
            v = getattr(self, attr)
            if v is not None and not v >= 0:  # `not >=` also catches NaN
                raise ValueError(f"{attr} must be >= 0 or None, got {v!r}")

    @property
    def owner_id(self) -> str:
        """The stable id of what this key stores (stored responses): ``"owner-"`` + 32 hex
        digits of SHA-256 over the key's bytes (domain-separated), never the key itself. It
        follows the key, not its ``name``: a new key under an old name is another owner."""
        return "owner-" + hashlib.sha256(b"kvserve-owner\0" + self.key.encode()).hexdigest()[:32]

    def cache_salt(self, client_salt: str | None = None) -> str:
        """The engine's ``cache_salt`` for this key's requests (part of the first KV block's
        hash: only requests with equal salts share cached prefixes): ``"group:<group>"`` for a
        key of a :attr:`prefix_cache_group`, else the key's :attr:`owner_id`, so no tenant's
        prefixes are visible to another (vLLM's ``cache_salt``, set per tenant). A client's own
        ``cache_salt`` narrows it further (``<that>#<client salt>``; neither part contains ``#``
        before the first one, so two pairs never give one string)."""
        scope = f"group:{self.prefix_cache_group}" if self.prefix_cache_group else self.owner_id
        return scope if client_salt is None else f"{scope}#{client_salt}"


def _parse_entries(entries: Iterable[tuple[int, str]], where: str) -> list[KeyPolicy]:
    """Parse numbered ``key [attr=value ...]`` entries; errors say ``"{where} {n}"``, never the key."""
    policies: list[KeyPolicy] = []
    key_at: dict[str, int] = {}
    name_at: dict[str, int] = {}
    for n, raw in entries:
        words = raw.split()
        for i, w in enumerate(words):  # a word starting with '#' begins a comment
            if w.startswith("#"):
                words = words[:i]
                break
        if not words:
            continue
        at = f"{where} {n}"
        key, attrs = words[0], words[1:]
        if _ATTR_PREFIX.match(key):
            raise ValueError(f"{at}: the key must come first, before name=, rpm=, tpm=, priority=, prefix_cache_group=")
        values: dict[str, str] = {}
        for w in attrs:
            # Never echo the word: a key with a space in it would end up here.
            attr, eq, value = w.partition("=")
            if not eq or attr not in _ATTRS:
                raise ValueError(
                    f"{at}: unknown attribute after the key (expected name=, rpm=, tpm=, priority=, "
                    "prefix_cache_group=)"
                )
            if attr in values:
                raise ValueError(f"{at}: {attr}= given twice")
            values[attr] = value
        kwargs: dict = {}
        for attr, field_name in (("rpm", "requests_per_minute"), ("tpm", "tokens_per_minute")):
            if attr in values:
                try:
                    v = float(values[attr])
                except ValueError:
                    v = math.nan
                if not v >= 0:
                    raise ValueError(f"{at}: {attr}= must be a number >= 0 (or inf for no limit)")
                kwargs[field_name] = v
        if "priority" in values:
            try:
                kwargs["priority"] = int(values["priority"])
            except ValueError:
                raise ValueError(f"{at}: priority= must be an integer") from None
        if "prefix_cache_group" in values:
            if not _NAME_RE.fullmatch(values["prefix_cache_group"]):
                raise ValueError(f"{at}: prefix_cache_group= must be 1-64 characters of [A-Za-z0-9._:@/+-]")
            kwargs["prefix_cache_group"] = values["prefix_cache_group"]
        if "name" in values:
            if not _NAME_RE.fullmatch(values["name"]):
                raise ValueError(f"{at}: name= must be 1-64 characters of [A-Za-z0-9._:@/+-]")
            kwargs["name"] = values["name"]
        policy = KeyPolicy(key=key, **kwargs)
        if key in key_at:
            raise ValueError(f"{at}: duplicate key (same as {where} {key_at[key]})")
        if policy.name in name_at:
            raise ValueError(f"{at}: duplicate name {policy.name!r} (also {where} {name_at[policy.name]})")
        key_at[key] = name_at[policy.name] = n
        policies.append(policy)
    return policies


def parse_key_lines(lines: Iterable[str]) -> list[KeyPolicy]:
    """Parse key-file lines (format in the module docstring); lines are numbered from 1.

    Raises:
        ValueError: an unknown attribute, a bad number or name, a duplicate key or name;
            the message names the line number and never contains the key.
    """
    return _parse_entries(enumerate(lines, 1), "line")


def load_key_file(path: str | Path) -> list[KeyPolicy]:
    """Read a key file (UTF-8, format in the module docstring).

    Raises:
        ValueError: the file cannot be read, is not UTF-8, holds no key, or has a bad line
            (the message starts with the path and names the line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"API key file {path} is not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"cannot read API key file {path}: {e.strerror or e}") from None
    try:
        policies = parse_key_lines(text.splitlines())
    except ValueError as e:
        raise ValueError(f"API key file {path}: {e}") from None
    if not policies:
        raise ValueError(f"API key file {path} holds no keys")
    return policies


def policies_from_keys(keys: Iterable[str]) -> list[KeyPolicy]:
    """Policies from a list of keys (``--api-key``, or ``KVSERVE_API_KEYS=k1,k2`` split at
    commas); each entry may carry attributes after the key: ``"k1 name=ci rpm=60"``. Blank
    entries are skipped; no entries give ``[]``.

    Raises:
        ValueError: as :func:`parse_key_lines`, naming the entry number (from 1).
    """
    return _parse_entries(enumerate(keys, 1), "API key entry")


def find_policy(header_token: bytes | str, policies: Iterable[KeyPolicy]) -> KeyPolicy | None:
    """The policy whose key equals ``header_token`` (the bytes after ``Bearer ``), else None.

    Constant time over the keys: every key is compared (``hmac.compare_digest`` on the UTF-8
    bytes), no early exit, so timing does not tell which key, or how much of one, matched.
    Any bytes (non-ASCII included) are fine; an empty key never matches.
    """
    token = header_token.encode() if isinstance(header_token, str) else bytes(header_token)
    found = None
    for p in policies:
        key = p.key.encode()
        if hmac.compare_digest(token, key) and key:
            found = p
    return found
