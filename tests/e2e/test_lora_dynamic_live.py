"""LoRA adapters loaded and unloaded at run time (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``), live: an app of its own with two replicas of the tiny model and
no configured adapter. An adapter loaded through one endpoint call is served by both replicas
(Serve's multiplexing sends its requests to a replica that holds it, and to the other when that
one is full), with the same greedy tokens as the offline engine with the same adapter (held equal
to HF + PEFT by ``tests/engine/test_lora.py``); an unloaded name is a 404 everywhere, and a name
loaded again from other files serves the new weights. Bad loads are refused with the reason;
adapters are read only under the app's allowed root (``lora_allowed_roots``)."""

import asyncio
import os
import re
import time

from helpers import HTTP
import pytest

pytestmark = pytest.mark.slow

ADMIN = "sk-kvserve-lora-admin"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lora_app(serve_app, tiny_llama_path, tmp_path_factory):
    from ray import serve

    from kvserve.deployments.app import build_app
    from tests.engine.test_lora import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("dyn_adapters")
    paths = {}
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS[:2]):
        paths[name] = make_adapter(tiny_llama_path, root / name, rank, alpha, targets, rslora, seed=10 + i)
    # rank 32 > max_lora_rank 16: refused at load
    name, _, alpha, targets, rslora = ADAPTERS[0]
    paths["too-big"] = make_adapter(tiny_llama_path, root / "too-big", 32, alpha, targets, rslora, seed=20)
    # a good adapter outside the allowed root: never loaded
    paths["outside"] = make_adapter(
        tiny_llama_path, tmp_path_factory.mktemp("not_allowed") / "escaped", 8, alpha, targets, rslora, seed=21
    )
    # float32 here and in offline(): served text is compared with the offline engine's token for token
    app = build_app(
        {
            "model": str(tiny_llama_path),
            "dtype": "float32",
            "served_model_name": "tiny-dyn",
            "num_replicas": 2,
            "max_num_seqs": 2,
            "max_ongoing_requests": 2,
            "max_queued_requests": 16,
            "max_model_len": 256,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.25,
            "enable_lora": True,
            "max_lora_rank": 16,
            "max_loras": 2,
            "admin_api_keys": [ADMIN],
            "lora_allowed_roots": [str(root)],
        }
    )
    serve.run(app, name="kvserve-lora", route_prefix="/lora")
    yield {"base": f"{serve_app.root}/lora", "paths": paths}
    serve.delete("kvserve-lora")


def offline(tiny_llama_path, adapters):
    """The offline engine's greedy text of PROMPT under each of ``adapters`` (paths; None: base)."""
    import torch

    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.lora import LoRARequest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the served replicas: the same summation order
    llm = LLM(
        model=str(tiny_llama_path), dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=16, max_loras=2
    )
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [None if p is None else LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    out = [o.outputs[0].text for o in llm.generate([PROMPT] * len(reqs), sp, lora_request=reqs, use_tqdm=False)]
    llm.engine.shutdown()
    torch.set_num_threads(threads)
    return out


def test_load_serve_on_both_replicas_unload_and_reload(lora_app, tiny_llama_path):
    from openai import AsyncOpenAI, NotFoundError, OpenAI

    base, paths = lora_app["base"], lora_app["paths"]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    want_a, want_b, want_base = offline(tiny_llama_path, [paths["all-r8"], paths["qv-r4"], None])
    assert len({want_a, want_b, want_base}) == 3

    def load(body, headers=admin):
        return HTTP.post(f"{base}/v1/load_lora_adapter", json=body, headers=headers, timeout=60)

    # refused: no key, a bad rank (the replica's reason), a folder that is not there
    assert load({"lora_name": "cust-a", "lora_path": str(paths["all-r8"])}, headers={}).status_code == 401
    r = load({"lora_name": "big", "lora_path": str(paths["too-big"])})
    assert r.status_code == 400 and "rank" in r.json()["error"]["message"], r.text
    r = load({"lora_name": "gone", "lora_path": str(paths["all-r8"]) + "-missing"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
    # a good adapter outside the allowed root, reached by a `..` escape: the same answer as a missing one
    root = paths["all-r8"].parent
    outside = load({"lora_name": "gone", "lora_path": f"{root}/{os.path.relpath(paths['outside'], root)}"})
    assert outside.status_code == 400 and outside.json()["error"] == r.json()["error"], outside.text
    r = load({"lora_name": "tiny-dyn", "lora_path": str(paths["all-r8"])})
    assert r.status_code == 400  # the base model's name

    r = load({"lora_name": "cust-a", "lora_path": str(paths["all-r8"])})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert load({"lora_name": "cust-a", "lora_path": str(paths["all-r8"])}).status_code == 400  # loaded already

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    cards = {m.id: m for m in client.models.list().data}
    assert cards["cust-a"].model_extra["parent"] == "tiny-dyn"

    def complete(c, model, fresh=False):  # fresh: past the response cache (Cache-Control: no-store)
        return c.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"Cache-Control": "no-store"} if fresh else None,
        )

    first = complete(client, "cust-a")
    assert first.model == "cust-a" and first.choices[0].text == want_a
    assert complete(client, "tiny-dyn").choices[0].text == want_base

    # 8 at once: the replica holding the adapter takes 2 (max_ongoing_requests), Serve then
    # sends the rest to the other, which loads it too
    async def burst():
        ac = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        return await asyncio.gather(*(complete(ac, "cust-a", fresh=True) for _ in range(8)))

    outs = asyncio.run(burst())
    assert [o.choices[0].text for o in outs] == [want_a] * 8
    metrics = HTTP.get(f"{base}/metrics", timeout=30).text
    replicas = {
        dict(re.findall(r'(\w+)="([^"]*)"', labels))["replica"]
        for labels in re.findall(r"kvserve:lora_requests_info\{([^}]*)\}", metrics)
        if 'model_name="tiny-dyn"' in labels and 'running_lora_adapters="cust-a"' in labels
    }
    assert len(replicas) == 2, [
        ln for ln in metrics.splitlines() if "lora_requests_info{" in ln or "request_success" in ln
    ]

    # unloaded: a 404 in OpenAI's shape, gone from /v1/models; a second unload is a 404 too
    r = HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "cust-a"}, headers=admin, timeout=30)
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(NotFoundError) as e:
        complete(client, "cust-a")
    assert e.value.body["code"] == "model_not_found"
    assert "cust-a" not in {m.id for m in client.models.list().data}
    r = HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "cust-a"}, headers=admin, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    # the same name from other files: the new adapter's tokens on every replica (no old weights reused)
    time.sleep(1.5)  # the replicas' registry refresh frees the old load
    assert load({"lora_name": "cust-a", "lora_path": str(paths["qv-r4"])}).status_code == 200

    assert complete(client, "cust-a").choices[0].text == want_b  # not the first load's cached answer

    async def burst_b():
        ac = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        return await asyncio.gather(*(complete(ac, "cust-a", fresh=True) for _ in range(6)))

    assert [o.choices[0].text for o in asyncio.run(burst_b())] == [want_b] * 6
    r = load({"lora_name": "cust-a", "lora_path": str(paths["all-r8"]), "load_inplace": True})
    assert r.status_code == 200
    assert complete(client, "cust-a").choices[0].text == want_a
    HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "cust-a"}, headers=admin, timeout=30)
