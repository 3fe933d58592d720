"""Real 4-bit checkpoints of the bundled SmolLM2, made here with ``llmcompressor``, and Hugging Face's
outputs on them: the fixture of the W4A16 tests and of ``benchmarks/quantization.py``.

``llmcompressor`` (vLLM's quantization tool) is never a project dependency: it pins an older
transformers. :func:`ensure_venv` creates (once, cached under
``$KVSERVE_CACHE/peers/llmcompressor-<version>``) a virtual environment with ``torch==2.13.0``
(CPU) and ``llmcompressor``; :func:`checkpoint` runs this file there as a worker that quantizes
the float32 SmolLM2 folder (``kvserve.engine.model_loader.resolve_model``) on CPU with one of
:data:`RECIPES` (calibration: 32 windows of 256 tokens, 16 for AWQ, of ``benchmarks/data/calibration.txt``,
the project's own prose, not the perplexity text), saves it as compressed-tensors
``pack-quantized`` (what vLLM loads from llmcompressor), and then loads the saved folder with
**Hugging Face transformers** (compressed-tensors decompresses it on CPU) to write
``reference.json``: greedy tokens and top-5 candidates per step for :data:`PROMPTS`, and the
perplexity over ``benchmarks/data/public_domain.txt``. The checkpoints land under
``$KVSERVE_CACHE/models/w4a16/<name>-<key>`` (the key hashes the recipe, the texts, the prompts and
the versions: :func:`_key`), so a second call returns at once.

Two recipes are also written in the classic layouts that older checkpoints use, since
llmcompressor writes compressed-tensors only: ``gptq`` (AutoGPTQ's ``qweight`` / ``qzeros`` /
``scales`` / ``g_idx``, zero points stored minus one as ``checkpoint_format: gptq``, scales in
float16) from the GPTQ run, and ``awq`` (AutoAWQ's GEMM layout, nibbles in the order 0, 2, 4, 6,
1, 3, 5, 7, float16 scales) from the AWQ run. llmcompressor 0.14 no longer makes act-order
(``actorder: group``) GPTQ checkpoints ("Only 'weight' and 'static' are supported"), so
``gptq-classic-actorder`` is the GPTQ run with its groups relabelled (``desc_act: true``, a
``g_idx`` that is a permutation of the group numbers, the scale rows permuted to match): the
same weights in the layout an act-order checkpoint has, which the loader must sort back. The integers are
llmcompressor's; the conversion only moves bits (scales rounded to float16, as those formats
store them). Their ``reference.json`` is the source run's, HF's outputs on llmcompressor's
checkpoint.

Usage::

    python benchmarks/quant_checkpoints.py                 # make every checkpoint, print the folders
    python benchmarks/quant_checkpoints.py gptq-g64        # one
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

LLMCOMPRESSOR_VERSION = "0.14.0.1"
TORCH_VERSION = "2.13.0"
HERE = Path(__file__).resolve()
CALIBRATION = HERE.parent / "data" / "calibration.txt"
PERPLEXITY_TEXT = HERE.parent / "data" / "public_domain.txt"

#: name -> how llmcompressor quantizes (``modifier``: GPTQ or AWQ; the weights' compressed-tensors
#: quantization args). SmolLM2's hidden size 576 is not a multiple of 128, so groups are 64 or 32
#: values; ``*-channel`` is one scale per output row. ``lm_head`` stays float (llmcompressor's
#: examples do). The bundled SmolLM2 is itself dequantized from a Q4_1 GGUF (4 bits, asymmetric
#: groups of 32), so asymmetric groups of 32 (``*-g32``) can hold its weights almost exactly, and
#: are the quality checkpoints; the symmetric ones of 64 lose more (a coarser grid than the one the
#: weights came from).
RECIPES: dict[str, dict] = {
    "gptq-g64": {
        "modifier": "GPTQ",
        "actorder": "static",
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
    },
    "gptq-channel": {
        "modifier": "GPTQ",
        "actorder": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
    },
    "gptq-g32": {
        "modifier": "GPTQ",
        "actorder": "static",
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
    },
    "awq-g32": {
        "modifier": "AWQ",
        "samples": 16,  # AWQ's scale search is ~5x GPTQ's time on CPU
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
    },
}
#: classic-layout checkpoints: name -> (format, source recipe)
CONVERTED: dict[str, tuple[str, str]] = {
    "gptq-classic-actorder": ("gptq-actorder", "gptq-g64"),
    "gptq-classic": ("gptq", "gptq-g64"),
    "awq-classic": ("awq", "awq-g32"),
}
#: Plain prompts of the reference's greedy runs.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "In 1492, Columbus",
    "The best way to learn a language is",
]
NEW_TOKENS = 24
TOP_K = 5
CALIBRATION_SAMPLES = 32
CALIBRATION_TOKENS = 256


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve").expanduser()


def venv_dir() -> Path:
    return cache_root() / "peers" / f"llmcompressor-{LLMCOMPRESSOR_VERSION}"


def ensure_venv() -> Path:
    """The python of the cached ``llmcompressor`` environment, created on first use (minutes,
    about 1.5 GB of wheels from PyPI).

    Raises:
        RuntimeError: pip failed (its last lines are in the message).
    """
    d = venv_dir()
    py, ok = d / "bin" / "python", d / ".complete"
    if ok.exists() and py.exists():
        return py

    def pip(*args: str) -> None:
        r = subprocess.run(
            [str(py), "-m", "pip", "--disable-pip-version-check", "install", "-q", *args],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise RuntimeError(
                f"pip install {' '.join(args)} failed in {d}:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-15:])
            )

    print(f"[quant_checkpoints] creating {d}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(d)], check=True)
    pip(f"torch=={TORCH_VERSION}")  # the CPU wheel first, or pip pulls CUDA wheels
    pip(f"llmcompressor=={LLMCOMPRESSOR_VERSION}")
    ok.write_text(LLMCOMPRESSOR_VERSION)
    return py


#: Bump when the worker's output changes for the same inputs (part of every checkpoint's key).
WORKER_VERSION = 1
#: Likewise for the conversion to the classic layouts (part of the converted checkpoints' keys).
CONVERTER_VERSION = 2


def _key(name: str) -> str:
    """What a checkpoint depends on, hashed: its recipe (and a converted one's source), the
    calibration and perplexity texts, the reference's prompts and lengths, the tool's and the
    worker's versions."""
    spec = RECIPES.get(name) or {
        "convert": CONVERTED[name],
        "source": _key(CONVERTED[name][1]),
        "converter": CONVERTER_VERSION,
    }
    h = hashlib.sha256(
        CALIBRATION.read_bytes()
        + PERPLEXITY_TEXT.read_bytes()
        + json.dumps(
            [
                spec,
                PROMPTS,
                NEW_TOKENS,
                TOP_K,
                CALIBRATION_SAMPLES,
                CALIBRATION_TOKENS,
                LLMCOMPRESSOR_VERSION,
                WORKER_VERSION,
            ],
            sort_keys=True,
        ).encode()
    )
    return h.hexdigest()[:10]


def folder(name: str) -> Path:
    return cache_root() / "models" / "w4a16" / f"{name}-{_key(name)}"


def checkpoint(name: str) -> Path:
    """The folder of checkpoint ``name`` (a key of :data:`RECIPES` or :data:`CONVERTED`), made on
    first use (about a minute per recipe on 2 cores, plus the environment the first time).

    Raises:
        KeyError: an unknown name.
        RuntimeError: the worker failed (its output is in the message).
    """
    if name not in RECIPES and name not in CONVERTED:
        raise KeyError(f"unknown checkpoint {name!r}; known: {sorted(RECIPES) + sorted(CONVERTED)}")
    out = folder(name)
    if (out / "reference.json").exists():
        return out
    if name in CONVERTED:
        fmt, source = CONVERTED[name]
        src = checkpoint(source)
        job = {"convert": fmt, "source": str(src), "out": str(out)}
    else:
        sys.path.insert(0, str(HERE.parents[1]))
        from kvserve.engine.model_loader import resolve_model

        job = {
            "recipe": RECIPES[name],
            "model": str(resolve_model(None)),
            "out": str(out),
            "calibration": str(CALIBRATION),
            "text": str(PERPLEXITY_TEXT),
            "prompts": PROMPTS,
            "new_tokens": NEW_TOKENS,
            "top_k": TOP_K,
        }
    py = ensure_venv()
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    job["out"] = str(tmp)
    print(f"[quant_checkpoints] making {out.name}", file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRANSFORMERS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    r = subprocess.run([str(py), str(HERE), "--worker", json.dumps(job)], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"making {name} failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-30:]))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ---- the worker (runs in the llmcompressor environment; imports nothing from kvserve) -------------


def _calibration_set(tok, path: str, samples: int):
    from datasets import Dataset

    ids = tok(Path(path).read_text())["input_ids"]
    windows = [ids[i : i + CALIBRATION_TOKENS] for i in range(0, len(ids) - CALIBRATION_TOKENS, CALIBRATION_TOKENS)]
    windows = windows[:samples]
    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})


def _quantize(job: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot

    torch.manual_seed(0)
    recipe = job["recipe"]
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    groups = {"group_0": {"targets": ["Linear"], "weights": dict(recipe["weights"])}}
    if recipe["modifier"] == "GPTQ":
        from llmcompressor.modifiers.quantization import GPTQModifier

        mod = GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=recipe["actorder"])
    else:
        from llmcompressor.modifiers.awq import AWQModifier

        mod = AWQModifier(config_groups=groups, ignore=["lm_head"])
        if not torch.cuda.is_available():  # llmcompressor 0.14's AWQ pins its cached activations, which
            torch.Tensor.pin_memory = lambda self, *a, **k: self  # needs an accelerator: on CPU, keep them as they are
    ds = _calibration_set(tok, job["calibration"], recipe.get("samples", CALIBRATION_SAMPLES))
    oneshot(model=model, dataset=ds, recipe=[mod], max_seq_length=CALIBRATION_TOKENS, num_calibration_samples=len(ds))
    model.save_pretrained(job["out"], save_compressed=True)
    tok.save_pretrained(job["out"])
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (Path(job["model"]) / extra).exists() and not (Path(job["out"]) / extra).exists():
            shutil.copy(Path(job["model"]) / extra, Path(job["out"]) / extra)
    del model
    _reference(job)


def _reference(job: dict) -> None:
    """HF transformers on the saved folder: greedy tokens, top-k per step, perplexity."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job["out"])
    hf = AutoModelForCausalLM.from_pretrained(job["out"], dtype=torch.float32).eval()
    greedy = []
    for p in job["prompts"]:
        ids = tok(p)["input_ids"]
        x = torch.tensor([ids])
        with torch.inference_mode():
            g = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=job["new_tokens"],
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        greedy.append(
            {
                "prompt": p,
                "prompt_ids": ids,
                "tokens": g.sequences[0, len(ids) :].tolist(),
                "top": [s[0].float().topk(job["top_k"]).indices.tolist() for s in g.scores],
            }
        )
    nll = []
    for para in [q.strip() for q in Path(job["text"]).read_text().split("\n\n") if q.strip()]:
        ids = torch.tensor([tok(para)["input_ids"]])
        with torch.inference_mode():
            logits = hf(ids).logits[0, :-1].float()
        nll += (-torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]).tolist()
    ref = {
        "greedy": greedy,
        "perplexity": math.exp(sum(nll) / len(nll)),
        "perplexity_tokens": len(nll),
        "transformers": __import__("transformers").__version__,
        "compressed_tensors": __import__("compressed_tensors").__version__,
        "llmcompressor": __import__("llmcompressor").__version__,
    }
    (Path(job["out"]) / "reference.json").write_text(json.dumps(ref, indent=1))


def _unpack_rows(packed, n_values: int):
    """compressed-tensors' dense int32 packing along the last dim -> uint8 values (0..15)."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    v = (packed[..., None] >> shifts) & 0xF
    return v.reshape(*packed.shape[:-1], -1)[..., :n_values].to(torch.uint8)


def _pack_int32(values, order=(0, 1, 2, 3, 4, 5, 6, 7)):
    """uint8 values (0..15) ``[..., 8 m]`` -> int32 ``[..., m]``, value ``8 j + order[i]`` in nibble i of word j."""
    import torch

    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)[..., list(order)]
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(8):
        word |= v[..., i] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement into int32


def _convert(job: dict) -> None:
    """compressed-tensors pack-quantized -> AutoGPTQ (v1) or AutoAWQ GEMM tensors; other tensors as they are."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out, fmt = Path(job["source"]), Path(job["out"]), job["convert"]
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    qargs = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    gs = qargs["group_size"]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    result = {}
    for name, t in tensors.items():
        if not name.endswith(".weight_packed"):
            if not name.endswith((".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")):
                result[name] = t
            continue
        base = name[: -len(".weight_packed")]
        n, k = tensors[base + ".weight_shape"].tolist()
        q = _unpack_rows(t, k)  # [N, K], stored value = int4 + 8
        scale = tensors[base + ".weight_scale"].float()  # [N, G]
        if base + ".weight_zero_point" in tensors:
            zp = _unpack_rows(tensors[base + ".weight_zero_point"].t().contiguous(), n).t()  # [N, G], zp + 8
        else:
            zp = torch.full_like(scale, 8, dtype=torch.uint8)
        g_idx = tensors.get(base + ".weight_g_idx")
        g_idx = torch.arange(k, dtype=torch.int32) // gs if g_idx is None else g_idx.to(torch.int32)
        if fmt.startswith("gptq"):
            if fmt == "gptq-actorder":  # relabel the groups: group g is stored as sigma[g]
                sigma = torch.randperm(scale.shape[1], generator=torch.Generator().manual_seed(0))
                g_idx = sigma[g_idx.long()].to(torch.int32)
                inv = torch.argsort(sigma)
                scale, zp = scale[:, inv], zp[:, inv]  # column sigma[g] holds group g's
            if bool((zp == 0).any()):
                raise ValueError(f"{base}: a zero point of 0 has no GPTQ v1 encoding (stored minus one)")
            result[base + ".qweight"] = _pack_int32(q.t().reshape(k // 8, 8, n).permute(0, 2, 1))[..., 0]  # [K/8, N]
            result[base + ".qzeros"] = _pack_int32((zp - 1).t().contiguous())  # [G, N/8]
            result[base + ".scales"] = scale.t().contiguous().half()  # [G, N]
            result[base + ".g_idx"] = g_idx
        else:
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            result[base + ".qweight"] = _pack_int32(q.t().contiguous(), order)  # [K, N/8]
            result[base + ".qzeros"] = _pack_int32(zp.t().contiguous(), order)  # [G, N/8]
            result[base + ".scales"] = scale.t().contiguous().half()  # [G, N]
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    if fmt.startswith("gptq"):
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": gs,
            "desc_act": fmt == "gptq-actorder",
            "sym": qargs["symmetric"],
            "checkpoint_format": "gptq",
            "lm_head": False,
        }
    else:
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": gs,
            "zero_point": not qargs["symmetric"],
            "version": "gemm",
        }
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "recipe.yaml"):
            shutil.copy(f, out / f.name)
    meta = json.loads((out / "reference.json").read_text())
    meta["converted_from"] = src.name
    (out / "reference.json").write_text(json.dumps(meta, indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="checkpoints to make (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        job = json.loads(a.worker)
        (_convert if "convert" in job else _quantize)(job)
        return
    for name in a.names or [*RECIPES, *CONVERTED]:
        print(name, checkpoint(name))


if __name__ == "__main__":
    main()
