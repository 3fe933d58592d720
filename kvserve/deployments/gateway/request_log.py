"""The opt-in request log that cache warming reads (``kvserve warm``, :mod:`kvserve.deployments.operator.warm`).

One JSON line per generating request a gateway replica admitted (its key's limits passed and a
replica took it, or the response cache answered it; refused requests, warming's and batch jobs'
own are not logged), in ``<request_log_dir>/requests-<gateway id>.jsonl`` (one file per gateway replica, so
replicas never share a file), rotated by the standard library's ``RotatingFileHandler`` at
``request_log_max_bytes`` with ``request_log_backups`` old files kept: the log never holds more
than ``max_bytes * (backups + 1)`` bytes per gateway replica. Lines are written by a
``QueueListener`` thread: a request never waits on the disk. The directory is made owner-only
(0700) and every file, the current one and each made at a rotation, is created owner-only
(0600) whatever the process's umask (:class:`_PrivateRotatingFileHandler`; rotation renames
files, so the old ones keep that mode).

A line: ``{"t": Unix seconds, "model": served name, "endpoint": "chat" | "completion",
"fingerprint": hash of the request, "cacheable": the response cache could store its answer,
"system_fingerprint": hash of the chat's system prompt or null, "admitted": true, "key": the
name of its API key (its ``name=``, never the key; ``anonymous`` without keys)}``, and, only with
``request_log_prompts: store``, ``"body"`` (the request as the client sent it, without
``stream``, ``stream_options`` and ``user``) and ``"system"`` (the system prompt's text). With the
default ``hash``, the log says which requests recur and how often, never what they said, and
cannot be replayed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import os
import queue
import time

#: Body fields left out of the log and of the fingerprint (how an answer is delivered, who asked).
VOLATILE_FIELDS = ("stream", "stream_options", "user", "metadata", "store")

#: ``request_log_prompts`` values.
PROMPT_MODES = ("hash", "store")


def fingerprint(model: str, endpoint: str, body: dict) -> str:
    """A stable hash of a request (model, endpoint and body without :data:`VOLATILE_FIELDS`):
    equal for requests the response cache could answer alike."""
    payload = json.dumps(
        [model, endpoint, {k: v for k, v in body.items() if k not in VOLATILE_FIELDS}],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def system_prompt(body: dict) -> str | None:
    """The text of a chat request's leading system (or developer) message, if any."""
    messages = body.get("messages") or []
    if not messages or not isinstance(messages[0], dict) or messages[0].get("role") not in ("system", "developer"):
        return None
    content = messages[0].get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) and content else None


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """The standard library's ``RotatingFileHandler`` whose files are created 0600 (owner read
    and write only), never with the umask's mode: it opens each file itself, the first and the
    one a rotation starts, with ``os.open(..., 0o600)``, and sets that mode on a file that was
    there already."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)
        except BaseException:
            os.close(fd)
            raise


class RequestLog:
    """One gateway replica's request log (see the module docstring).

    Args:
        directory: where the files go (made, owner-only, if missing).
        prompts: ``hash`` (fingerprints only) or ``store`` (the requests themselves too).
        max_bytes: bytes of a file before it is rotated.
        backups: rotated files kept.
        name: this gateway replica's part of the file name.

    Raises:
        ValueError: an unknown ``prompts`` mode, a bound below 1.
        OSError: the directory cannot be made or written.
    """

    def __init__(
        self,
        directory: str,
        prompts: str = "hash",
        max_bytes: int = 64 << 20,
        backups: int = 4,
        name: str | None = None,
    ):
        if prompts not in PROMPT_MODES:
            raise ValueError(f"request_log_prompts must be one of {PROMPT_MODES}, got {prompts!r}")
        if max_bytes < 1 or backups < 0:
            raise ValueError("request_log_max_bytes must be >= 1 and request_log_backups >= 0")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.path = os.path.join(directory, f"requests-{name or f'{os.getpid()}-{os.urandom(3).hex()}'}.jsonl")
        self.prompts = prompts
        handler = _PrivateRotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._logger = logging.getLogger(f"kvserve.request_log.{id(self)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(logging.handlers.QueueHandler(self._queue))
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        self._listener.start()
        self._handler = handler

    def record(self, model: str, endpoint: str, body: dict, cacheable: bool, key: str = "anonymous") -> None:
        """Log one admitted request (``body``: as the client sent it, a dict; ``key``: its API
        key's name, under whose limits warming replays it)."""
        system = system_prompt(body)
        line = {
            "t": round(time.time(), 3),
            "model": model,
            "endpoint": endpoint,
            "fingerprint": fingerprint(model, endpoint, body),
            "cacheable": bool(cacheable),
            "system_fingerprint": None if system is None else hashlib.sha256(system.encode()).hexdigest()[:32],
            "admitted": True,
            "key": key,
        }
        if self.prompts == "store":
            line["body"] = {k: v for k, v in body.items() if k not in VOLATILE_FIELDS}
            line["system"] = system
        self._logger.info(json.dumps(line, separators=(",", ":"), ensure_ascii=False, default=str))

    def close(self) -> None:
        """Write what is queued and close the file."""
        self._listener.stop()
        self._handler.close()
