#!/usr/bin/env python
"""How much CPU an idle ``kvserve serve`` uses: the serving cluster on the default model, started
as ``make serve`` starts it, with no traffic.

Any CPU work beside an engine step stretches that step on a small box (the step's OpenMP threads
wait for each other at every op), so what the app burns while idle is a cost every request pays
later. The script starts ``kvserve serve`` on a free loopback port as the load test does
(``benchmarks/load_test.LocalServer``: a Ray token of its own; ``--serve-arg`` passes flags,
``--env KEY=VALUE`` sets variables for it, e.g. Serve's ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``),
waits until ``/ready`` answers 200 and ``--settle`` seconds more, then reads the CPU time (user +
system, from ``psutil``) of every process in its process tree (the CLI, Ray's GCS, raylet,
dashboard agent, log monitor, Serve's controller, proxy and replicas) over ``--repeats``
consecutive windows of ``--seconds`` each. Processes are grouped by their title (Ray names actor
processes ``ray::<Actor>``). It reports the median over the windows, as a percentage of one core,
in all and per group, against issue 41's target (at most 8 % of one core). Nothing outside the
tree is counted.

Results: ``benchmarks/results/idle_cpu.json`` (``--out``), written whole by
:class:`benchmarks.common.Results`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures  # noqa: E402

RESULT_KEYS = ("serve_command", "env", "ready_s", "settle_s", "window_s", "windows", "total_pct",
               "by_process", "target_pct")

#: Issue 41's bound on an idle app's CPU, in percent of one core.
TARGET_PCT = 8.0


def group_of(proc) -> str:
    """A process's group: its Ray actor title (``ray::ServeController``), else its executable's
    name and, for Python, the script or module it runs."""
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


def measure(args: argparse.Namespace) -> dict:
    """Start the app (``benchmarks.load_test.LocalServer``: its own Ray token, stopped with SIGINT
    and its whole process tree afterwards), measure ``args.repeats`` idle windows."""
    import psutil

    from benchmarks.load_test import LocalServer

    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    server = LocalServer(["--host", "127.0.0.1", *args.serve_arg], log_path=args.log,
                         ready_timeout=args.ready_timeout, env=env)
    t0 = time.monotonic()
    with server:
        ready_s = time.monotonic() - t0
        time.sleep(args.settle)
        root = psutil.Process(server.proc.pid)
        windows = []
        for _ in range(args.repeats):
            a, t0 = cpu_seconds(root), time.monotonic()
            time.sleep(args.seconds)
            b, elapsed = cpu_seconds(root), time.monotonic() - t0
            groups: dict[str, float] = {}
            for pid, (group, t) in b.items():  # a process started inside the window counts from 0
                groups[group] = groups.get(group, 0.0) + (t - a.get(pid, (group, 0.0))[1]) / elapsed * 100
            windows.append({"elapsed_s": elapsed, "total_pct": sum(groups.values()), "by_process": groups})
    names = sorted({g for w in windows for g in w["by_process"]})
    by_process = {g: statistics.median(w["by_process"].get(g, 0.0) for w in windows) for g in names}
    command = " ".join(server.args[1:]).replace(str(server.port), "<port>")
    return {"serve_command": command, "env": args.env, "ready_s": ready_s,
            "settle_s": args.settle, "window_s": args.seconds, "windows": windows,
            "total_pct": statistics.median(w["total_pct"] for w in windows),
            "by_process": dict(sorted(by_process.items(), key=lambda kv: -kv[1])), "target_pct": TARGET_PCT}


def figures(r: dict) -> Figures:
    """Summary: the median idle CPU against the target; tables: per process group, and each window."""
    f = Figures().summary("idle kvserve serve, CPU (median of windows)", r["total_pct"], "% of one core",
                          target=f"<= {r['target_pct']} %", met=r["total_pct"] <= r["target_pct"], headline=True)
    f.table("Idle CPU by process", ["process", "% of one core (median)"],
            [[g, v] for g, v in r["by_process"].items()],
            note=f"`{r['serve_command']}`" + (f" with {', '.join(r['env'])}" if r["env"] else "") +
            f"; {len(r['windows'])} windows of {r['window_s']} s after /ready and {r['settle_s']} s more.")
    f.table("Windows", ["window", "seconds", "total (% of one core)"],
            [[i + 1, w["elapsed_s"], w["total_pct"]] for i, w in enumerate(r["windows"])])
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="length of one window (s)")
    ap.add_argument("--repeats", type=int, default=3, help="consecutive windows")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after /ready before the first window")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--serve-arg", action="append", default=[], help="a flag for kvserve serve (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for kvserve serve")
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
    for g, v in list(result["by_process"].items())[:12]:
        print(f"  {v:5.1f}  {g}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
