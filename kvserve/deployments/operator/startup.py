"""``kvserve serve``'s start: deploy the application and wait until every deployment runs, or
fail loudly with the replica's own error.

Serve's ``serve.run`` waits for the application without a deadline and, when a replica's
constructor keeps failing (a model folder that cannot load, an adapter that is missing), gives
up only after ``RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT`` tries per replica with a message about
its own internals ("Failed to update the deployments ['LLMServer']") and a traceback through
Serve's client. Meanwhile the ingress already answers ``/v1/models`` with 200 (and ``/ready``
with 503). :func:`deploy_and_wait` runs ``serve.run`` in a thread and watches
``serve.status()``: the application running returns; a deployment that failed, or the deadline
passing first, raises :class:`StartupFailed` naming the deployment and the first lines of the
exception its replica raised (no traceback frames: they are in the replica's log).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Optional

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Lines of a replica's exception kept in :class:`StartupFailed`'s message.
ERROR_LINES = 3


class StartupFailed(RuntimeError):
    """The application did not start: a deployment failed, or the deadline passed first.
    The message names each deployment that is not running and its replica's error."""


def replica_error(message: str, max_lines: int = ERROR_LINES) -> str:
    """The exception a replica raised, from a Serve deployment status message: the lines after
    the last traceback frame (``RuntimeError: Error while deserializing header ...``), at most
    ``max_lines``; the message's first lines where it holds no traceback. Terminal colour codes
    are dropped."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in (message or "").splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith('File "')]
    if frames:
        # after the last frame: its indented source lines ("    x = f()", "    ^^^^"), then the exception
        rest = lines[frames[-1] + 1 :]
        while rest and (not rest[0].strip() or rest[0].startswith(" ")):
            rest = rest[1:]
        kept = [ln for ln in rest if ln.strip()]
    else:
        kept = [ln for ln in lines if ln.strip()]
    return "\n".join(kept[:max_lines]) or "(no error message)"


def _status(obj: Any) -> str:
    """A Serve status enum (or its string) as its name: ``HEALTHY``, ``DEPLOY_FAILED`` ..."""
    return str(getattr(obj.status, "value", obj.status))


def _app_status(name: str) -> Any:
    """The application's ``serve.status()`` entry; None before it exists or when the controller
    does not answer."""
    from ray import serve

    try:
        return serve.status().applications.get(name)
    except Exception:
        return None


def _describe(name: str, app_status: Any, why: str) -> str:
    """``application 'name' <why>:`` and, per deployment that is not healthy, its replica's error."""
    if app_status is None:
        return f"application {name!r} {why}"
    parts = []
    for dep_name, dep in sorted((app_status.deployments or {}).items()):
        if _status(dep) != "HEALTHY":
            err = replica_error(dep.message) if dep.message else "(no replica has reported yet)"
            parts.append(f"{dep_name} ({_status(dep)}): {err}")
    parts = parts or [replica_error(app_status.message)]
    return f"application {name!r} {why}:\n  " + "\n  ".join(p.replace("\n", "\n    ") for p in parts)


def deploy_and_wait(app: Any, name: str, route_prefix: Optional[str], timeout_s: float, poll_s: float = 1.0) -> None:
    """Deploy ``app`` (a bound Serve application) as ``name`` and return once it runs.

    Args:
        timeout_s: seconds to wait for every deployment to run (model loading included);
            0 or less waits as long as Serve retries.
        poll_s: seconds between looks at ``serve.status()``.

    Raises:
        StartupFailed: a deployment failed to start (Serve gave up retrying its replica's
            constructor) or the application was not running after ``timeout_s``.
    """
    from ray import serve

    done = threading.Event()
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
        except BaseException as e:  # DEPLOY_FAILED comes back as Serve's RuntimeError
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="kvserve-deploy", daemon=True).start()
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    while not done.wait(poll_s):
        app_status = _app_status(name)
        if app_status is not None and _status(app_status) == "DEPLOY_FAILED":
            raise StartupFailed(_describe(name, app_status, "failed to start"))
        if deadline is not None and time.monotonic() > deadline:
            raise StartupFailed(
                _describe(name, app_status, f"was not running after {timeout_s:g} s (--deploy-timeout-s)")
            )
    if "error" in result:
        raise StartupFailed(_describe(name, _app_status(name), "failed to start")) from result["error"]
