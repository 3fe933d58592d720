"""LoRA adapters on the serving side: the gateway resolves an adapter named as ``model`` to its
base model's replicas (the typed request carries ``lora_name``; answers, the response cache and
``/v1/models`` use the adapter's name, with the base as ``parent``); the replica runs the adapter
(in-process ``LLMServer`` on a tiny model, its tokens equal to the engine's offline ``LLM`` with
the same adapter, which ``tests/engine/test_lora.py`` holds equal to HF with PEFT); flags and
config are checked."""
import asyncio

import httpx
import pytest

from deployments.args import ModelArgs
from deployments.cli import app_args_from_cli, build_parser
from deployments.gateway.api import build_api
from deployments.gateway.core import Gateway, GatewaySettings
from deployments.server_types import GenerateRequest
from tests.deployments.test_gateway import FakeReplica


def _client(replica, adapters):
    gw = Gateway({"fake": replica}, GatewaySettings(adapters=adapters))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw")


def test_gateway_sends_an_adapters_requests_to_its_base_model():
    replica = FakeReplica()

    async def main():
        async with _client(replica, {"sql-lora": "fake"}) as c:
            chat = await c.post("/v1/chat/completions", json={
                "model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            base = await c.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
            models = await c.get("/v1/models")
            one = await c.get("/v1/models/sql-lora")
            missing = await c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
            return chat, base, models, one, missing

    chat, base, models, one, missing = asyncio.run(main())
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "sql-lora"  # the answer carries the name the client sent
    assert [r.lora_name for r in replica.requests] == ["sql-lora", None]
    assert base.json()["model"] == "fake"
    cards = {m["id"]: m for m in models.json()["data"]}
    assert cards["sql-lora"]["parent"] == "fake" and cards["sql-lora"]["root"] == "sql-lora"
    assert cards["sql-lora"]["max_model_len"] == cards["fake"]["max_model_len"]
    assert one.status_code == 200 and one.json()["parent"] == "fake"
    assert missing.status_code == 404 and "sql-lora" in missing.json()["error"]["message"]


def test_gateway_refuses_adapters_of_unknown_models():
    with pytest.raises(ValueError, match="base model"):
        Gateway({"fake": FakeReplica()}, GatewaySettings(adapters={"a": "other"}))


def test_lora_modules_flag_takes_vllms_forms_and_needs_enable_lora(tmp_path):
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x/a",
                                      '{"name": "b", "path": "/x/b"}'])
    app = app_args_from_cli(args)
    assert app["lora_modules"] == {"a": "/x/a", "b": "/x/b"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "no-equals-sign"])
    with pytest.raises(ValueError, match="enable_lora"):
        ModelArgs(lora_modules={"a": "/x/a"})
    ModelArgs(enable_lora=True, lora_modules={"a": "/x/a"})


@pytest.mark.slow
def test_replica_runs_the_named_adapter(tmp_path):
    from engine import LLM, SamplingParams
    from engine.lora import LoRARequest
    from deployments.llm_server import LLMServer
    from tests.engine.test_lora import ADAPTERS, make_adapter
    from tests.tiny_models import make_tiny_model

    base = make_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    name, r, a, t, rs = ADAPTERS[0]
    path = make_adapter(base, tmp_path / name, r, a, t, rs, seed=0)
    prompt, sp = [1, 17, 300, 42, 9, 77], {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    offline = LLM(model=str(base), dtype="float32", enable_lora=True, max_lora_rank=16)
    want = offline.generate([prompt] * 2, SamplingParams(**sp), use_tqdm=False,
                            lora_request=[LoRARequest(name, 1, str(path)), None])
    offline.engine.shutdown()
    server = LLMServer.func_or_class({"model": str(base), "dtype": "float32", "enable_lora": True,
                                      "max_lora_rank": 16, "num_kv_blocks": 64}, "tiny", 1,
                                     lora_modules={name: str(path)})

    async def run(lora_name):
        chunks = [c async for c in server.stream(GenerateRequest.of(prompt, sp, lora_name=lora_name))]
        return chunks

    async def main():
        try:
            return await asyncio.gather(run(name), run(None), run("unknown"))
        finally:
            await server.engine.shutdown()

    with_adapter, plain, unknown = asyncio.run(main())
    assert [t for c in with_adapter for t in c.token_ids] == want[0].outputs[0].token_ids
    assert [t for c in plain for t in c.token_ids] == want[1].outputs[0].token_ids
    assert unknown[-1].error.code == "model_not_found" and unknown[-1].error.status == 404
    assert server.server_info().lora_modules == [name]
