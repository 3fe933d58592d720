"""kvserve: an LLM serving cluster on Ray Serve with its own continuous-batching engine.

One import root (``kvserve.*``) so that no folder of the project shadows a package of PyPI's
(Hugging Face's ``kernels``, which transformers >= 5.25 imports, and PyPI's ``cluster`` and
``telemetry``) or is shadowed by one. The rooms, lowest floor first (docs/architecture.md):

* :mod:`kvserve.kernels`: attention over the paged KV cache and the CPU linears (torch, Triton, C++);
* :mod:`kvserve.telemetry`: metrics and traces for every process;
* :mod:`kvserve.engine`: the continuous-batching engine (``from kvserve.engine import LLM``), no Ray;
* :mod:`kvserve.cluster`: Ray actors for tensor/pipeline-parallel ranks, ``ray up`` configs;
* :mod:`kvserve.autoscaling`: the Serve autoscaling policy, pure functions of numbers;
* :mod:`kvserve.deployments`: Ray Serve (gateway, replicas, app builder, the ``kvserve`` CLI).

Importing this package imports none of them (nor torch or Ray).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvserve")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
