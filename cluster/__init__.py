"""Ray side of kvserve: tensor-parallel worker actors (``worker_group``), Ray token auth
(``ray_auth``), the ``ray up`` configs (``*.yaml``, checked by ``launcher_config``) and their
local smoke test (``smoke_local.sh``). This package module itself imports nothing heavy
(no Ray, no torch), so front ends can use :func:`reset_niceness`."""
import os


def reset_niceness() -> None:
    """Ray starts worker processes at niceness 15 (``RAY_worker_niceness``), which lets any
    other process on the node starve the engine; engine replicas, TP workers and the ingress
    are the node's main work, so they ask for normal priority (best effort: needs the
    permission to lower niceness). Niceness is per thread and inherited by new threads, so
    every thread that exists now is reset."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except (OSError, AttributeError):
            pass
