"""LoRA adapters on the serving side: the gateway resolves an adapter named as ``model`` to its
base model's replicas (the typed request carries ``lora_name``; answers, the response cache and
``/v1/models`` use the adapter's name, with the base as ``parent``); the replica runs the adapter
(in-process ``LLMServer`` on a tiny model, its tokens equal to the engine's offline ``LLM`` with
the same adapter, which ``tests/engine/test_lora.py`` holds equal to HF with PEFT); flags and
config are checked."""

import asyncio
import os
import re
from types import SimpleNamespace

import httpx
import pytest

from kvserve.deployments.args import ModelArgs
from kvserve.deployments.cli import app_args_from_cli, build_parser
from kvserve.deployments.contract.facts import ModelCard
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.contract.types import GenerateRequest
from tests.deployments.gateway_fakes import FakeReplica, _Remote, make_gateway


def _client(replica, adapters):
    gw = make_gateway(replica, cards=[ModelCard("fake", max_model_len=128, lora_modules=tuple(adapters))])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw")


def test_gateway_sends_an_adapters_requests_to_its_base_model():
    replica = FakeReplica()

    async def main():
        async with _client(replica, {"sql-lora": "fake"}) as c:
            chat = await c.post(
                "/v1/chat/completions",
                json={"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
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
        Gateway({"fake": FakeReplica()}, [ModelCard("fake"), ModelCard("other", lora_modules=("a",))])


def test_lora_modules_flag_takes_vllms_forms_and_needs_enable_lora(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--enable-lora", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}']
    )
    app = app_args_from_cli(args)
    assert app["lora_modules"] == {"a": "/x/a", "b": "/x/b"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "no-equals-sign"])
    with pytest.raises(ValueError, match="enable_lora"):
        ModelArgs(lora_modules={"a": "/x/a"})
    ModelArgs(enable_lora=True, lora_modules={"a": "/x/a"})


@pytest.mark.slow
def test_replica_runs_the_named_adapter(tmp_path):
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.lora import LoRARequest
    from kvserve.deployments.replica.llm_server import LLMServer
    from tests.engine.test_lora import ADAPTERS, make_adapter
    from tests.tiny_models import make_tiny_model

    base = make_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    name, r, a, t, rs = ADAPTERS[0]
    path = make_adapter(base, tmp_path / name, r, a, t, rs, seed=0)
    prompt, sp = [1, 17, 300, 42, 9, 77], {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    offline = LLM(model=str(base), dtype="float32", enable_lora=True, max_lora_rank=16)
    want = offline.generate(
        [prompt] * 2, SamplingParams(**sp), use_tqdm=False, lora_request=[LoRARequest(name, 1, str(path)), None]
    )
    offline.engine.shutdown()
    server = LLMServer.func_or_class(
        ModelArgs(
            model=str(base),
            dtype="float32",
            enable_lora=True,
            max_lora_rank=16,
            num_kv_blocks=64,
            served_model_name="tiny",
            torch_num_threads=1,
            lora_modules={name: str(path)},
        )
    )

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


# ---- adapters loaded at run time: only under the allowed roots --------------------------------
def _tree(tmp_path):
    """``root/`` with a complete folder ``good`` and folders escaping it; ``outside/`` with a
    complete folder ``a``. Returns ``(root, outside, paths by case)``."""
    root, outside = tmp_path / "root", tmp_path / "outside"

    def folder(where, files=("adapter_config.json", "adapter_model.safetensors")):
        where.mkdir(parents=True)
        for f in files:
            (where / f).write_text("{}")
        return where

    folder(root / "good")
    folder(outside / "a")
    folder(tmp_path / "root-sibling" / "a")  # shares the root's name as a prefix
    (root / "link").symlink_to(outside / "a", target_is_directory=True)
    (root / "alias").symlink_to(root / "good", target_is_directory=True)
    folder(root / "half", ["adapter_config.json"])
    (root / "half" / "adapter_model.safetensors").symlink_to(outside / "a" / "adapter_model.safetensors")
    folder(root / "dir-not-file", ["adapter_config.json"])
    (root / "dir-not-file" / "adapter_model.safetensors").mkdir()
    refused = {
        "missing": root / "missing",
        "symlink escape": root / "link",
        "dotdot escape": f"{root}/../outside/a",
        "outside": outside / "a",
        "prefix sibling": tmp_path / "root-sibling" / "a",
        "file symlinked out": root / "half",
        "not a file": root / "dir-not-file",
        "nul byte": f"{root}/good\0x",
        "the root's parent": tmp_path,
    }
    return root, outside, {k: str(v) for k, v in refused.items()}


def test_adapter_paths_resolve_under_the_allowed_roots_only(tmp_path):
    from kvserve.deployments.replica.lora import UNREADABLE_ADAPTER, AdapterPathError, resolve_adapter_path

    root, outside, refused = _tree(tmp_path)
    assert resolve_adapter_path(str(root / "good"), [str(root)]) == str((root / "good").resolve())
    assert resolve_adapter_path(str(root / "alias"), [str(root)]) == str((root / "good").resolve())  # inside
    (tmp_path / "root-link").symlink_to(root, target_is_directory=True)  # a root that is itself a link
    assert resolve_adapter_path(str(root / "good"), [str(tmp_path / "root-link")]) == str((root / "good").resolve())
    assert resolve_adapter_path(str(outside / "a"), [str(root), str(outside)]) == str((outside / "a").resolve())
    messages = {}
    for case, path in refused.items():
        with pytest.raises(AdapterPathError) as e:
            resolve_adapter_path(path, [str(root)])
        messages[case] = str(e.value)
    with pytest.raises(AdapterPathError) as e:
        resolve_adapter_path(str(root / "good"), [])  # no root: nothing may be read
    messages["no roots"] = str(e.value)
    assert set(messages.values()) == {UNREADABLE_ADAPTER}, messages  # missing or forbidden: one answer
    assert str(tmp_path) not in UNREADABLE_ADAPTER


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_adapter_file_gets_the_same_answer(tmp_path):
    from kvserve.deployments.replica.lora import UNREADABLE_ADAPTER, AdapterPathError, resolve_adapter_path

    root, _, _ = _tree(tmp_path)
    (root / "good" / "adapter_model.safetensors").chmod(0)
    with pytest.raises(AdapterPathError, match=re.escape(UNREADABLE_ADAPTER)):
        resolve_adapter_path(str(root / "good"), [str(root)])


class _Registry:
    """The GCS adapter registry's in-memory stand-in (:class:`kvserve.deployments.contract.adapters.AdapterRegistry`)."""

    def __init__(self):
        self.by_name = {}

    def put(self, entry, replace=False):
        if entry.name in self.by_name and not replace:
            return False
        self.by_name[entry.name] = entry
        return True

    def get(self, name):
        return self.by_name.get(name)

    def delete(self, name):
        return self.by_name.pop(name, None) is not None

    def entries(self):
        return dict(self.by_name)


def _lora_gateway(hf_config, roots):
    """A gateway whose replica checks adapters with the real :func:`kvserve.deployments.replica.lora.check_adapter`
    (an engine stand-in with the tiny model's config), and an in-memory registry."""
    from kvserve.deployments.replica.lora import check_adapter

    engine = SimpleNamespace(config=SimpleNamespace(enable_lora=True, max_lora_rank=16), hf_config=hf_config)
    replica = FakeReplica()

    async def check(name, path, allowed_roots):
        return check_adapter(engine, name, path, allowed_roots)

    replica.check_lora_adapter = _Remote(check)
    gw = make_gateway(replica, api_keys=["sk-lora-user"], admin_api_keys=[ADMIN], lora_allowed_roots=roots)
    gw.lora.registry = _Registry()
    return gw


ADMIN = "sk-lora-admin-key"


def test_load_lora_adapter_reads_only_under_the_allowed_roots(tmp_path, tiny_llama_path):
    """Run-time loading is off without a root (403, saying so); with one, an adapter under it
    loads (its resolved path registered), and every path that is missing, escapes (symlink,
    ``..``), lies outside or is unreadable gets one and the same 400 naming no path."""
    from transformers import AutoConfig

    from tests.engine.test_lora import ADAPTERS, make_adapter

    root, outside, refused = _tree(tmp_path)
    name, r, a, t, rs = ADAPTERS[1]
    real = make_adapter(tiny_llama_path, root / "real", r, a, t, rs, seed=3)
    (root / "real-alias").symlink_to(real, target_is_directory=True)
    cfg = AutoConfig.from_pretrained(tiny_llama_path)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def load(gw, body, headers=admin):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            return await c.post("/v1/load_lora_adapter", json=body, headers=headers)

    off = _lora_gateway(cfg, None)
    disabled = asyncio.run(load(off, {"lora_name": "x", "lora_path": str(real)}))
    assert disabled.status_code == 403 and disabled.json()["error"]["code"] == "runtime_lora_disabled"
    assert "--lora-allowed-root" in disabled.json()["error"]["message"] and not off.lora.registry.by_name

    gw = _lora_gateway(cfg, [str(root)])
    user = asyncio.run(load(gw, {"lora_name": "x", "lora_path": str(real)}, {"Authorization": "Bearer sk-lora-user"}))
    assert user.status_code == 403  # an API key that is not an admin's
    ok = asyncio.run(load(gw, {"lora_name": "ok", "lora_path": str(root / "real-alias")}))
    assert ok.status_code == 200, ok.text
    assert gw.lora.registry.get("ok").path == str(real.resolve())  # the resolved path is registered
    answers = {
        case: asyncio.run(load(gw, {"lora_name": "refused", "lora_path": path})) for case, path in refused.items()
    }
    bodies = {
        case: (r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]) for case, r in answers.items()
    }
    assert len(set(bodies.values())) == 1, bodies  # missing, forbidden, unreadable: one answer
    status, code, message = next(iter(bodies.values()))
    assert status == 400 and code == "invalid_adapter" and str(tmp_path) not in message
    assert set(gw.lora.registry.by_name) == {"ok"}
    bad = asyncio.run(load(gw, {"lora_name": "big", "lora_path": str(root / "good")}))  # "{}": no rank
    assert bad.status_code == 400 and str(tmp_path) not in bad.json()["error"]["message"]
    assert "rank" in bad.json()["error"]["message"]


def test_lora_allowed_root_flag_and_config(tmp_path):
    from kvserve.deployments.app import gateway_options
    from kvserve.deployments.args import AppArgs

    args = build_parser().parse_args(
        ["serve", "--lora-allowed-root", "/srv/adapters", "--lora-allowed-root", "rel/adapters"]
    )
    app = app_args_from_cli(args)
    assert app["lora_allowed_roots"] == ["/srv/adapters", os.path.abspath("rel/adapters")]
    assert gateway_options(AppArgs.model_validate(app))["gateway"].lora_allowed_roots == app["lora_allowed_roots"]
    assert gateway_options(AppArgs.model_validate({}))["gateway"].lora_allowed_roots is None  # default: off
    with pytest.raises(ValueError, match="absolute"):
        AppArgs.model_validate({"lora_allowed_roots": ["adapters"]})
