"""An A/B test of a configuration, end to end: the example ``kvserve experiment report`` of the docs.

A kvserve app (local Ray with token auth, the default model) whose model is split by an
experiment into two variants, each its own ``LLMServer`` deployment of one replica:
``control`` (``max_num_seqs`` 4) and ``batch16`` (``max_num_seqs`` 16); both let 64 requests
wait, so the difference shows as waiting rather than as refusals. ``--clients`` clients send
``--requests`` chat requests each, one after the other, every request with a prompt of its own
(no prefix cache or response cache reuse) and ``--max-tokens`` greedy output tokens, each
assigned a variant anew (sticky ``request``; weights 50 / 50). Then the gateway's samples
(``GET /v1/experiments/batch``) go through the report (:func:`kvserve.deployments.operator.experiment_report.analyse`)
as the command runs it, and its text is written with the file.

A second experiment in the same app, ``same``, splits another served name of the same model
between two identical variants under the same load: its report is the false-positive check.

Usage::

    python benchmarks/ab_experiment.py        # writes benchmarks/results/ab_experiment.json

Results: ``benchmarks/results/ab_experiment.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import Figures, Results, local_serve  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("benchmark", "workload", "experiments", "started")

APP = "kvserve-ab-bench"
ADMIN = "bench-ab-admin"
WORDS = (
    "river stone cloud lamp paper orbit violet maple harbor meadow copper lantern signal garden "
    "winter needle canyon pepper marble thunder"
).split()


async def load(url: str, model: str, clients: int, per_client: int, max_tokens: int, seed: int) -> int:
    """``clients`` concurrent clients, each sending ``per_client`` requests one after the other;
    returns how many were answered 200."""
    import httpx

    rng = random.Random(seed)
    ok = 0

    async def client(c: int, http):
        nonlocal ok
        for i in range(per_client):
            prompt = "Write a line about " + " ".join(rng.choice(WORDS) for _ in range(8)) + f" ({seed}.{c}.{i})"
            r = await http.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "cache": False,
                },
            )
            ok += r.status_code == 200

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(c, http) for c in range(clients)))
    return ok


def figures(r: dict) -> Figures:
    """The file's summary and tables, from its measured values."""
    f = Figures()
    for name, e in r.get("experiments", {}).items():
        rep = e["report"]
        comps = rep["comparisons"]
        sig = [c for c in comps if c["significant"]]
        f.summary(f"{name}: measures with a significant difference", len(sig), None, headline=name == "batch")
        for c in comps:
            if c["measure"] in ("ttft_p50", "ttft_p95", "tpot_p50", "output_tps_per_replica"):
                f.summary(f"{name}: {c['variant']} vs control, {c['label']}", c["estimate"] * 100, c["unit"])
        variants = list(rep["variants"])
        rows = []
        for key in (
            "ttft_p50",
            "ttft_p95",
            "tpot_p50",
            "tpot_p95",
            "output_tps_per_replica",
            "error_rate",
            "refusal_rate",
        ):
            row = [key]
            for v in variants:
                m = rep["variants"][v].get(key)
                row.append(None if m is None else m["value"])
            rows.append(row)
        f.table(
            f"Experiment {name}: per variant",
            ["measure"] + variants,
            rows,
            note=f"{rep['variants'][variants[0]]['requests']} / {rep['variants'][variants[1]]['requests']} "
            f"requests; verdicts: {'; '.join(rep['summary'])}",
        )
    return f


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default SmolLM2-135M-Instruct)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ab_experiment.json"))
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    from kvserve.deployments.operator.experiment_report import analyse, render

    base = {"model": args.model, "num_replicas": 1, "max_waiting_requests": 64, "enable_prefix_caching": False}
    result: dict = {
        "benchmark": "an A/B test of max_num_seqs, through kvserve experiment report",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workload": {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens},
        "experiments": {},
    }
    with local_serve(max(os.cpu_count() or 1, 6)) as port:
        import httpx
        from ray import serve

        from kvserve.deployments.app import build_app

        serve.run(
            build_app(
                {
                    "models": [
                        {**base, "served_model_name": "smol-batch"},
                        {**base, "served_model_name": "smol-same", "max_num_seqs": 8},
                    ],
                    "admin_api_keys": [ADMIN],
                    "response_cache": False,
                    "experiments": [
                        {
                            "name": "batch",
                            "model": "smol-batch",
                            "sticky": "request",
                            "variants": [
                                {"name": "control", "settings": {"max_num_seqs": 4}},
                                {"name": "batch16", "settings": {"max_num_seqs": 16}},
                            ],
                        },
                        {
                            "name": "same",
                            "model": "smol-same",
                            "sticky": "request",
                            "variants": [{"name": "A"}, {"name": "B"}],
                        },
                    ],
                }
            ),
            name=APP,
            route_prefix="/",
        )
        url = f"http://127.0.0.1:{port}"
        for name, model, seed in (("batch", "smol-batch", 1), ("same", "smol-same", 2)):
            asyncio.run(load(url, model, 2, 1, 4, seed + 100))  # the variants' first steps, not measured
            since = time.time()
            ok = asyncio.run(load(url, model, args.clients, args.requests, args.max_tokens, seed))
            data = httpx.get(
                f"{url}/v1/experiments/{name}",
                params={"since": since},
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=60,
            ).json()
            report = analyse(data)
            text = render(report)
            print(text, flush=True)
            result["experiments"][name] = {"answered": ok, "report": report, "text": text.splitlines()}
        serve.delete(APP)
    return prov.write(Path(args.out), result)


if __name__ == "__main__":
    main()
