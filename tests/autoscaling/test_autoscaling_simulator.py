"""The autoscaling simulator (``benchmarks/autoscaling_sim.py``): the Ray Serve functions it calls are pinned,
Serve's delay and scaling-factor logic on simulated time, a small trace through every policy, and the
replica numbers it reads from measured results."""

import dataclasses
import hashlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest

SIMULATOR = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscaling_sim.py"


def simulator():
    """The simulator module, ``benchmarks/autoscaling_sim.py`` (a benchmark script: benchmarks/
    is not a package on sys.path, so it is loaded from its file, once per session)."""
    mod = sys.modules.get("autoscaling_sim")
    if mod is None:
        spec = importlib.util.spec_from_file_location("autoscaling_sim", SIMULATOR)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["autoscaling_sim"] = mod  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules["autoscaling_sim"]
            raise
    return mod


#: sha256 of ``inspect.getsource()`` of the Ray Serve 2.60.0 functions benchmarks/autoscaling_sim.py calls.
RAY_SERVE_WRAPPER_SHA256 = {
    "_apply_scaling_factors": "a4259fcb2aa69aba5c7b1bc31707ce758e759e6e62f6699376854b0e8b40457c",
    "_apply_delay_logic": "beb02da8cc3b4014b070db6e9fe741544e78cd2d5c39dc9d58fda8de953eaf28",
}


def test_ray_serve_wrapper_is_pinned():
    # The simulator applies Serve's own (private) scaling-factor and delay functions to every
    # decision; the committed simulator results rest on them, so a Ray upgrade that changes
    # them must be looked at before the hashes are updated.
    rap = pytest.importorskip("ray.serve.autoscaling_policy")
    import ray

    got = {
        name: hashlib.sha256(inspect.getsource(getattr(rap, name)).encode()).hexdigest()
        for name in RAY_SERVE_WRAPPER_SHA256
    }
    assert got == RAY_SERVE_WRAPPER_SHA256, (
        f"Ray {ray.__version__} changed Serve's scaling-factor/delay logic: check serve_wrap in "
        "benchmarks/autoscaling_sim.py and test_simulator_serve_wrap_on_simulated_time, then update the hashes"
    )


def test_simulator_serve_wrap_on_simulated_time():
    S = simulator()

    t = S.ServeTiming(
        upscale_delay_s=2.0,
        downscale_delay_s=10.0,
        look_back_period_s=30.0,
        metrics_interval_s=10.0,
        min_replicas=1,
        max_replicas=8,
    )
    # an upscale must be asked for continuously for upscale_delay_s of simulated time
    state = {}
    assert [S.serve_wrap(5, 3, 3, t, state, now) for now in (100.0, 101.0, 102.0)] == [3, 3, 5]
    # a downscale waits downscale_delay_s; asking for the current target resets the wait
    state = {}
    asks = ((2, 200.0, 5), (5, 205.0, 5), (2, 206.0, 5), (2, 215.0, 5), (2, 216.0, 2))
    for desired, now, want in asks:
        assert S.serve_wrap(desired, 5, 5, t, state, now) == want, (desired, now)
    # from zero replicas there is no delay; max_replicas bounds the result
    assert S.serve_wrap(20, 0, 0, t, {}, 0.0) == 8
    # scaling factors act on the difference to the current replicas: 3 + 0.5 * (7 - 3)
    half = dataclasses.replace(t, upscale_delay_s=0.0, upscaling_factor=0.5)
    assert S.serve_wrap(7, 3, 3, half, {}, 0.0) == 5


# --------------------------------------------------------------------------------------
# simulator smoke test (small trace)
# --------------------------------------------------------------------------------------
def test_simulator_smoke(tmp_path):
    S = simulator()

    spec = S.TraceSpec(
        duration_s=400.0,
        base_load_replicas=2.0,
        spike_start_s=100.0,
        spike_duration_s=60.0,
        long_start_s=250.0,
        long_duration_s=100.0,
    )
    rep = S.run_all(S.CPU_PROFILE, spec, dt=0.5, max_replicas=12, knobs={}, seeds=[0], equal_cost_utilization=None)
    names = [r["policy"] for r in rep["results"]]
    assert names == ["fixed_peak", "request_default", "request_fast", "kvserve"]
    for r in rep["results"]:
        assert r["overall"]["requests"] == rep["requests"] > 0
        assert 0.0 <= r["overall"]["slo_attainment"] <= 1.0
        assert r["replica_seconds"] > 0
    table = S.markdown_table(rep)
    assert table.count("\n| ") == 1 + len(names)  # header + one row per policy
    S.plot(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_simulator_reads_measured_replica_numbers(tmp_path):
    S = simulator()

    path = tmp_path / "throughput.json"
    path.write_text(
        json.dumps(
            {
                "systems": [
                    {"system": "hf_generate_static_bs16", "output_tok_per_s": 90.0},
                    {"system": "kvserve", "output_tok_per_s": 310.0, "max_running_batch": 48},
                ]
            }
        )
    )
    prof = S.load_profile(str(path), S.CPU_PROFILE)
    assert (prof.decode_tokens_per_s, prof.max_num_seqs, prof.max_ongoing_requests) == (310.0, 48, 96)
    assert prof.prefill_tokens_per_s == S.CPU_PROFILE.prefill_tokens_per_s
    path.write_text(json.dumps({"replica_profile": {"prefill_tokens_per_s": 1500, "startup_s": 12}}))
    prof = S.load_profile(str(path), S.CPU_PROFILE)
    assert (prof.prefill_tokens_per_s, prof.startup_s) == (1500.0, 12.0)
    assert S.load_profile(str(tmp_path / "missing.json"), S.CPU_PROFILE) is S.CPU_PROFILE
