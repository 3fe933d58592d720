"""Ray token authentication (and loopback binding) for the Ray instances kvserve starts or joins.

Ray's control plane (GCS, raylet, object manager, core-worker and Serve-replica gRPC servers,
dashboard agent) runs code for whoever talks to it. With ``RAY_AUTH_MODE=token`` (Ray >= 2.52)
every one of those gRPC and HTTP entry points requires ``authorization: Bearer <token>``;
Ray reads the token from, in order, ``RAY_AUTH_TOKEN``, the file named by
``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``, in every Ray process (they inherit the
environment of the process that starts Ray).

Ray itself writes ``~/.ray/auth_token`` with the process umask (0644, directory 0755, seen with
Ray 2.60): readable by every local user. kvserve writes the token file itself, owner-only.

Nothing here imports ray at module level: these functions set environment variables that Ray
reads when it is imported (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) or initialised.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, MutableMapping

AUTH_MODE_VAR = "RAY_AUTH_MODE"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for "local-only" instances (its default on macOS / Windows): when it is false,
# Ray takes 127.0.0.1 as the node IP, and the GCS, raylet, object manager, core-worker gRPC
# servers, dashboard agent, runtime-env agent and metrics ports bind to 127.0.0.1. Read once,
# when `ray` is imported.
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

TOKEN_HELP = (
    "Ray looks for the cluster's token in RAY_AUTH_TOKEN (the token itself), then the file named by "
    "RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token; on the head node `ray get-auth-token` prints it "
    "(`ray get-auth-token --generate` creates one)."
)


@dataclass
class AuthSetup:
    """What :func:`ensure_local_auth` / :func:`ensure_join_auth` settled on."""

    mode: str  # "token" or "disabled"
    token_source: str | None  # "RAY_AUTH_TOKEN" (env) or the token file's path; None when disabled
    created: bool = False  # a new token file was written
    loopback: bool = False  # a local instance binds its ports to 127.0.0.1

    def describe(self) -> str:
        if self.mode != "token":
            return "token authentication OFF (RAY_AUTH_MODE=disabled)"
        where = "the RAY_AUTH_TOKEN variable" if self.token_source == TOKEN_VAR else self.token_source
        return f"token authentication on (token: {where}{', new' if self.created else ''})"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _home(env: MutableMapping[str, str]) -> Path:
    return Path(env["HOME"]) if env.get("HOME") else Path.home()


def default_token_path(env: MutableMapping[str, str] | None = None) -> Path:
    """``~/.ray/auth_token`` (of ``env["HOME"]`` where given), where Ray looks last."""
    return _home(os.environ if env is None else env) / ".ray" / "auth_token"


def token_path(env: MutableMapping[str, str] | None = None) -> Path:
    """The token file Ray reads: ``RAY_AUTH_TOKEN_PATH`` if set, else ``~/.ray/auth_token``."""
    env = os.environ if env is None else env
    p = env.get(TOKEN_PATH_VAR)
    return Path(p).expanduser() if p else default_token_path(env)


def read_token(env: MutableMapping[str, str] | None = None) -> str | None:
    """The token Ray would use (``RAY_AUTH_TOKEN``, then the token file), or None."""
    env = os.environ if env is None else env
    if env.get(TOKEN_VAR, "").strip():
        return env[TOKEN_VAR].strip()
    try:
        tok = token_path(env).read_text().strip()
    except OSError:
        return None
    return tok or None


def _mkdirs_private(d: Path) -> None:
    """Create ``d`` (and missing parents) with mode 0700; existing directories are left alone."""
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for q in reversed(missing):
        try:
            q.mkdir(mode=0o700)
        except FileExistsError:
            pass
        os.chmod(q, 0o700)  # mkdir's mode is masked by the umask


def _make_private(path: Path, *, warn: Callable[[str], None]) -> None:
    """chmod 0600 a token file we own that others can read (e.g. one `ray get-auth-token
    --generate` wrote with 0644); warn about one we cannot fix."""
    st = path.stat()
    if not (st.st_mode & 0o077):
        return
    if st.st_uid == os.getuid():
        os.chmod(path, 0o600)
    else:
        warn(
            f"kvserve: WARNING: the Ray token file {path} is readable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}) and not yours to chmod: anyone who reads it can run code "
            f"on the cluster."
        )


def write_token_file(path: Path) -> bool:
    """Write a new random token (256 bits, as Ray's own generator) to ``path`` with mode 0600,
    creating missing directories with 0700. An existing non-empty file is kept (False). The
    file appears whole (a private temp file, then a hard link), so two kvserve processes
    starting at once agree on one token."""
    _mkdirs_private(path.parent)
    if path.exists() and path.read_text().strip():
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            if path.read_text().strip():
                return False  # another process got there first
            os.replace(tmp, path)  # an empty file: Ray would refuse it
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _refresh_imported_ray(env: MutableMapping[str, str], loopback: bool) -> None:
    """Ray reads RAY_AUTH_MODE into its config and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into a
    constant when it is imported; when something imported it before us, re-read them (as Ray's
    own ``_enable_token_auth`` does) so this process agrees with the Ray processes it starts."""
    if env is not os.environ:
        return
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None and loopback:
        consts.ENABLE_RAY_CLUSTER = False  # services.get_node_ip_address() reads it at call time
    if "ray._raylet" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def disabled_warning() -> str:
    try:
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        user = os.environ.get("USER") or str(os.getuid())
    bar = "!" * 100
    return (
        f"{bar}\n"
        f"kvserve: WARNING: RAY_AUTH_MODE=disabled is set: Ray's token authentication is OFF.\n"
        f"  Anyone who can reach this machine's Ray ports (GCS, raylet, object manager, worker and\n"
        f"  Serve-replica gRPC servers, dashboard agent) can join the cluster, run arbitrary code as\n"
        f"  user {user!r} and call the model deployments directly, without an API key.\n"
        f"  Unset RAY_AUTH_MODE (kvserve's default is token) unless this machine is unreachable.\n"
        f"{bar}"
    )


def _begin(
    env: MutableMapping[str, str], want_loopback: bool, warn: Callable[[str], None]
) -> tuple[AuthSetup | None, bool]:
    """What starting and joining share: bind to loopback when wanted (unless the user set
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``), then the auth mode: a user's explicit "disabled"
    is kept with a loud warning (returns its :class:`AuthSetup`); otherwise token mode is set
    (Ray enables it for an explicit address only when told to). Returns ``(setup if auth is
    disabled else None, loopback)``.

    Raises:
        SystemExit: ``RAY_AUTH_MODE`` is neither "token" nor "disabled".
    """
    loopback = False
    if want_loopback:
        env.setdefault(LOOPBACK_VAR, "0")
        loopback = env[LOOPBACK_VAR].strip().lower() in ("0", "false", "no", "off")
    mode = env.get(AUTH_MODE_VAR, "").strip().lower()
    if mode == "disabled":
        warn(disabled_warning())
        _refresh_imported_ray(env, loopback)
        return AuthSetup("disabled", None, loopback=loopback), loopback
    if mode not in ("", "token"):
        raise SystemExit(f"kvserve: RAY_AUTH_MODE={env[AUTH_MODE_VAR]!r}: expected 'token' (default) or 'disabled'")
    env[AUTH_MODE_VAR] = "token"
    return None, loopback


def ensure_local_auth(
    env: MutableMapping[str, str] | None = None, *, loopback: bool = True, warn: Callable[[str], None] = _stderr
) -> AuthSetup:
    """Environment for a Ray instance kvserve starts itself (``kvserve serve`` without ``--address``).

    Call it before ``import ray``. Turns on token auth (``RAY_AUTH_MODE=token``) unless the
    user explicitly set ``RAY_AUTH_MODE=disabled`` (then a loud warning), makes sure a token
    exists (``RAY_AUTH_TOKEN``, else the file at ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``,
    created with mode 0600, its directory 0700) and makes an existing token file owner-only.
    With ``loopback`` (the default) the instance's ports bind to 127.0.0.1 (``RAY_ENABLE_WINDOWS_
    OR_OSX_CLUSTER=0``, unless the user set that variable); the Serve replicas' own gRPC servers
    still listen on all interfaces (Ray binds them to ``[::]``) and rely on the token.
    """
    env = os.environ if env is None else env
    disabled, use_loopback = _begin(env, loopback, warn)
    if disabled is not None:
        return disabled
    if env.get(TOKEN_VAR, "").strip():
        setup = AuthSetup("token", TOKEN_VAR, loopback=use_loopback)
    else:
        path = token_path(env)
        created = write_token_file(path)
        _make_private(path, warn=warn)
        if path == default_token_path(env) and path.parent.stat().st_uid == os.getuid():
            os.chmod(path.parent, 0o700)  # ~/.ray: Ray creates it 0755
        setup = AuthSetup("token", str(path), created=created, loopback=use_loopback)
    _refresh_imported_ray(env, use_loopback)
    return setup


def is_loopback_address(address: str | None) -> bool:
    """``127.x.y.z:port`` / ``localhost:port`` (also with a ``ray://`` scheme)."""
    if not address:
        return False
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def ensure_join_auth(
    env: MutableMapping[str, str] | None = None, address: str | None = None, *, warn: Callable[[str], None] = _stderr
) -> AuthSetup:
    """Environment for a driver joining a running cluster (``kvserve serve --address ...``).

    Call it before ``import ray``. Token mode by default: the driver must hold the cluster's
    token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), else SystemExit
    with what to do. ``RAY_AUTH_MODE=disabled`` (for a cluster without token auth) is kept, with
    a loud warning. A loopback ``address`` (an instance bound to 127.0.0.1) also sets
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: otherwise Ray rewrites 127.0.0.1 to this machine's
    network address and never reaches it.
    """
    env = os.environ if env is None else env
    disabled, loopback = _begin(env, is_loopback_address(address), warn)
    if disabled is not None:
        return disabled
    if env.get(TOKEN_VAR, "").strip():
        setup = AuthSetup("token", TOKEN_VAR, loopback=loopback)
    else:
        path = token_path(env)
        if read_token(env) is None:
            raise SystemExit(
                f"kvserve serve --address: Ray token authentication is on (the default) and no token was found "
                f"({TOKEN_VAR} is unset and {path} is missing or empty).\n  {TOKEN_HELP}\n"
                f"  Copy the head node's token here, owner-only, e.g. `mkdir -p -m 700 ~/.ray && "
                f"(umask 077; ssh <head> ray get-auth-token > ~/.ray/auth_token)`,\n"
                f"  or run with RAY_AUTH_TOKEN_PATH=/path/to/token. "
                f"Only for a cluster that runs without token auth: RAY_AUTH_MODE=disabled."
            )
        _make_private(path, warn=warn)
        setup = AuthSetup("token", str(path), loopback=loopback)
    _refresh_imported_ray(env, loopback)
    return setup


def join_failure_message(address: str | None, setup: AuthSetup, exc: BaseException) -> str:
    """A clear message for a failed ``ray.init(address=...)`` of ``kvserve serve --address``."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [f"kvserve serve: could not join the Ray cluster at {address!r}: {text.splitlines()[0][:300]}"]
    if setup.mode == "token":
        lines.append(
            f"  This driver authenticates with the token from {setup.token_source}. If the cluster's GCS "
            f"logged 'Unauthenticated' / 'InvalidAuthToken', the token differs from the cluster's: "
            f"{TOKEN_HELP}"
        )
        lines.append("  If the cluster runs without token auth, join with RAY_AUTH_MODE=disabled (not recommended).")
    else:
        lines.append(
            "  RAY_AUTH_MODE=disabled: if the cluster uses token auth (Ray >= 2.52 enables it for new "
            "local clusters), unset RAY_AUTH_MODE and provide its token. " + TOKEN_HELP
        )
    lines.append(
        "  For a single-node instance bound to 127.0.0.1 (one that `kvserve serve` started), set "
        f"{LOOPBACK_VAR}=0 in this environment too: without it Ray rewrites 127.0.0.1 to this "
        "machine's network address."
    )
    return "\n".join(lines)


def main() -> int:
    """``python -m kvserve.cluster.ray_auth``: make sure this machine holds a Ray token for a cluster it
    launches (``ray up kvserve/cluster/*.yaml`` copies it to every node), owner-only, and print its path.

    The token is ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``: an existing one is kept (and
    made 0600 when others could read it), a missing one is written (256 random bits, mode 0600,
    directory 0700). It never belongs in the repository."""
    path = token_path()
    created = write_token_file(path)
    _make_private(path, warn=_stderr)
    if path == default_token_path() and path.parent.stat().st_uid == os.getuid():
        os.chmod(path.parent, 0o700)
    print(f"{'created' if created else 'kept'} the Ray token {path} (mode 0600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
