"""LoRA adapters on the served base model, many in one batch.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") adds
``scaling * B @ A`` to a linear layer's weight: ``A`` ``[r, in]``, ``B`` ``[out, r]``, ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023). kvserve never merges
an adapter into the weights: every layer computes ``y = x W^T + scaling * (x A^T) B^T`` per row,
each row with its own request's adapter, so one step mixes requests of different adapters and of
the base model, as Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving", SGMV) and
S-LoRA (Sheng et al. 2023) do: decode rows go through one padded batched matmul per layer for
all adapters at once (shrink to ``r``, expand back), a prefill chunk through two thin matmuls of
its own on its row slice.

Modules:

* :mod:`kvserve.engine.lora_adapter`: :class:`LoRARequest` (vLLM's shape: ``lora_name``,
  ``lora_int_id``, ``lora_path``, a Hugging Face PEFT folder) and :class:`LoRAWeights` (one
  adapter read from its folder and checked against the base model; ``scaling`` folded into ``B``).
* :mod:`kvserve.engine.lora_slots`: :class:`LoRASlots` (``max_loras`` device slots per adapted layer,
  filled least-recently-used first, plus a host cache of up to ``max_cpu_loras`` loaded adapters;
  :meth:`LoRASlots.prepare` maps a step's rows to slots) and :class:`LoRALayer` (one layer's slots
  and its matmuls).

Adapters cover q/k/v/o and the MLP's gate/up/down projections of Llama-family models, with tensor
parallelism too (each slot holds this rank's shard). This module re-exports both modules' names.
"""

from kvserve.engine.lora_adapter import TARGETS, LoRARequest, LoRAWeights
from kvserve.engine.lora_slots import LONG_SPAN, LoRALayer, LoRASlots

__all__ = ["LONG_SPAN", "TARGETS", "LoRALayer", "LoRARequest", "LoRASlots", "LoRAWeights"]
