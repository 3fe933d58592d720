"""Caller-side routing: which replica (``prefix_router``, a Ray Serve ``RequestRouter`` that runs
in the caller's process, with ``prefix_hasher``) and which model (``model_routing``: ``model:
"auto"`` and the upstream fallback) a request goes to.

Rule (tests/test_architecture.py): routing/ imports only :mod:`kvserve.deployments.contract` of
kvserve/deployments/ (it runs in gateways and driver handles, never loads a replica). Nothing is
imported here.
"""
