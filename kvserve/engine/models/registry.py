"""Which model class runs a checkpoint: picked from ``config.architectures`` (Hugging Face's name)."""

from __future__ import annotations

from kvserve.engine.models import gemma3, llama

#: Hugging Face architecture name -> kvserve model class.
MODEL_CLASSES = {
    **{arch: llama.LlamaForCausalLM for arch in llama.SUPPORTED_ARCHITECTURES},
    **{arch: gemma3.Gemma3ForCausalLM for arch in gemma3.SUPPORTED_ARCHITECTURES},
}


def model_class(hf_config) -> type:
    """The model class for a Hugging Face config (``architectures[0]``; a config without
    ``architectures`` is taken for Llama, as before).

    Raises:
        ValueError: an architecture kvserve does not run (the message lists those it does).
    """
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in MODEL_CLASSES:
        raise ValueError(f"architecture {arch!r} is not supported; kvserve runs {tuple(MODEL_CLASSES)}")
    return MODEL_CLASSES[arch]
