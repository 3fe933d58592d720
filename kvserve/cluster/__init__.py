"""Ray side of kvserve: tensor-parallel worker actors (``worker_group``), Ray token auth
(``ray_auth``), the ``ray up`` configs (``*.yaml``, checked by ``launcher_config``) and their
local smoke test (``smoke_local.sh``). This package module itself imports nothing heavy
(no Ray, no torch), so front ends can use :func:`reset_niceness` and :func:`set_local_ray_env`."""

import os
from collections.abc import MutableMapping

#: The environment a Ray instance that kvserve starts for serving gets (each value kept where the
#: environment already sets it): Ray's processes read it when they start, and inherit it from the
#: process that starts Ray.
LOCAL_RAY_ENV = {
    # Ray starts worker processes at niceness 15; on a serving node they are the main work
    "RAY_worker_niceness": "0",
    # Serve's controller runs its control loop (deployment states, autoscaling decisions, routes)
    # every 0.1 s by default, most of an idle app's CPU; kvserve's autoscaling policy decides on
    # windows of seconds, so 0.5 s costs it nothing
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # replicas and handles flush their cached metrics to Ray's every 0.1 s by default; Ray's
    # metrics agent exports every 10 s (metrics_report_interval_ms)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # Serve's HTTP proxy is uvicorn, which by default believes X-Forwarded-For from 127.0.0.1 and
    # rewrites the client's address: kvserve's gate decides whom to believe (forwarded_allow_ips)
    "FORWARDED_ALLOW_IPS": "",
}


def set_local_ray_env(env: MutableMapping[str, str] | None = None) -> None:
    """Put :data:`LOCAL_RAY_ENV` into ``env`` (default ``os.environ``) where it is not set. Call it
    before ``ray.init`` starts a local instance (``kvserve serve``, the tests' and benchmarks'
    Ray): Serve reads its settings when imported, in each of the instance's processes."""
    env = os.environ if env is None else env
    for k, v in LOCAL_RAY_ENV.items():
        env.setdefault(k, v)


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
