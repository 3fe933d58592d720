"""Helpers of the live KV tests (test_kv_router_live.py, test_kv_cluster_live.py)."""

import time


def wait_for_hub(app: str, replicas: int, tries: int = 600):
    """The KV event hub of Serve application ``app`` once ``replicas`` replicas publish to it (they
    start on their first health check), or whatever hub there is after ``tries`` tenths of a second
    (None: none was made)."""
    import ray

    from kvserve.deployments.contract.adapters import REGISTRY_NAMESPACE
    from kvserve.deployments.contract.kv_event_hub import hub_name

    hub = None
    for _ in range(tries):
        try:
            hub = ray.get_actor(hub_name(app), namespace=REGISTRY_NAMESPACE)
            if len(ray.get(hub.pull.remote(None, 0), timeout=30).loads) == replicas:
                break
        except ValueError:
            pass
        time.sleep(0.1)
    return hub
