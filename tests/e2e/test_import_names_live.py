"""One import root inside a Ray Serve replica (issue 62): a replica's worker process starts in the
driver's working directory, the repository root, where a top-level ``kernels/`` folder used to
shadow Hugging Face's ``kernels`` and failed every model load in ``LLMServer``. Here a
deployment's replica imports both, loads a model through transformers (hub kernels at its
default) and through kvserve, and reports where each name came from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from import_probe import check_probe, probe_function

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_replica_imports_hf_kernels_and_kvserve(serve_app, tiny_llama_path):
    """(``serve_app``: Serve started as the session's apps need it, so this app only joins it.)"""
    from ray import serve

    assert Path(os.getcwd()).resolve() == ROOT  # the driver (and so its workers) at the repository root
    # a function deployment: its replica calls probe(model) (shipped by value: __main__ code)
    app = serve.deployment(probe_function(), name="ImportProbe", ray_actor_options={"num_cpus": 0}).bind()
    handle = serve.run(app, name="import-probe", route_prefix=None)
    try:
        got = handle.remote(str(tiny_llama_path)).result(timeout_s=300)
    finally:
        serve.delete("import-probe")
    assert Path(got["cwd"]).resolve() == ROOT, got
    check_probe(got, ROOT)
