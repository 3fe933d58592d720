"""LoRA adapters on the served base model, many in one batch.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") adds
``scaling * B @ A`` to a linear layer's weight: ``A`` ``[r, in]``, ``B`` ``[out, r]``, ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023). kvserve never merges
an adapter into the weights: every layer computes ``y = x W^T + scaling * (x A^T) B^T`` per row,
each row with its own request's adapter, so one step mixes requests of different adapters and of
the base model, as Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving", SGMV) and
S-LoRA (Sheng et al. 2023) do. The rows of one adapter form a segment; each segment costs two
thin matmuls per adapted layer (shrink to ``r``, expand back).

Pieces:

* :class:`LoRARequest`: vLLM's shape (``lora_name``, ``lora_int_id``, ``lora_path``): a Hugging
  Face PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).
* :class:`LoRAWeights`: one adapter read from its folder and checked against the base model
  (ranks, target modules, shapes); ``scaling`` folded into ``B``.
* :class:`LoRASlots`: ``max_loras`` device slots per adapted layer (``A``/``B`` stacked, ranks
  zero-padded to ``max_lora_rank``), filled least-recently-used first, plus a host cache of up to
  ``max_cpu_loras`` loaded adapters; :meth:`LoRASlots.prepare` maps a step's rows to slots.

Adapters cover q/k/v/o and the MLP's gate/up/down projections of Llama-family models; with
tensor parallelism each slot holds this rank's shard, cut like its base layer (column-parallel
layers split ``B``'s rows, row-parallel layers split ``A``'s columns and add their partial
``x A^T B^T`` before the layer's all-reduce, which sums it like the base output).
"""
from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

#: PEFT's module names -> (the fused layer of :mod:`engine.models.llama`, the part in it).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0)}


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter (vLLM's ``LoRARequest``).

    Attributes:
        lora_name: the adapter's name (what clients send as ``model``).
        lora_int_id: a positive integer id, unique per adapter in the engine.
        lora_path: a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


@dataclass
class LoRAWeights:
    """One adapter on the host: ``weights[(layer, module)] = (A [r, in], B [out, r] * scaling)``,
    float32, unsharded, for the PEFT module names of :data:`TARGETS`."""

    name: str
    lora_id: int
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def load(cls, request: LoRARequest, cfg, max_rank: int) -> "LoRAWeights":
        """Read and check ``request.lora_path`` against the base model's Hugging Face ``cfg``.

        Raises:
            ValueError: the folder is not a PEFT LoRA adapter, its rank exceeds ``max_rank``,
                it adapts a module kvserve does not (embeddings, LM head, ``modules_to_save``),
                has biases or DoRA, or a tensor does not fit the base model's shapes (another
                base model); the message names the file and field.
        """
        path = request.lora_path
        cfg_path = os.path.join(path, "adapter_config.json")
        try:
            with open(cfg_path) as f:
                ac = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter '{request.lora_name}': cannot read {cfg_path}: {e}") from None
        where = f"LoRA adapter '{request.lora_name}'"
        if str(ac.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{where}: peft_type {ac.get('peft_type')!r} is not LORA")
        rank, alpha = int(ac.get("r", 0)), float(ac.get("lora_alpha", ac.get("r", 0)))
        if rank < 1:
            raise ValueError(f"{where}: rank r={rank} must be positive")
        if rank > max_rank:
            raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
        for key, bad in (("bias", lambda v: v not in (None, "none")), ("use_dora", bool),
                         ("modules_to_save", bool), ("fan_in_fan_out", bool),
                         ("rank_pattern", bool), ("alpha_pattern", bool), ("layers_to_transform", bool)):
            if bad(ac.get(key)):
                raise ValueError(f"{where}: {key}={ac.get(key)!r} is not supported")
        scaling = alpha / math.sqrt(rank) if ac.get("use_rslora") else alpha / rank
        tensors = _read_tensors(path, where)
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                  "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            layer, module, which = _parse_key(name, where)
            if module not in TARGETS:
                raise ValueError(f"{where}: module {module!r} ({name}) is not supported; kvserve adapts "
                                 f"{', '.join(TARGETS)}")
            if not 0 <= layer < cfg.num_hidden_layers:
                raise ValueError(f"{where}: {name} names layer {layer}; the base model has "
                                 f"{cfg.num_hidden_layers}")
            pairs.setdefault((layer, module), {})[which] = t
        out = cls(request.lora_name, request.lora_int_id, rank)
        for (layer, module), ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
            a, b = ab["A"].float(), ab["B"].float()
            n_in, n_out = shapes[module]
            if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
                raise ValueError(f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                                 f"{tuple(b.shape)} do not fit the base model ([{rank}, {n_in}] / "
                                 f"[{n_out}, {rank}]): an adapter of another base model?")
            out.weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        if not out.weights:
            raise ValueError(f"{where}: no LoRA weights in {path}")
        return out


def _read_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        try:
            return load_file(st)
        except Exception as e:  # a corrupt file fails this load alone
            raise ValueError(f"{where}: cannot read {st}: {str(e).splitlines()[0][:200]}") from None
    raise ValueError(f"{where}: {st} not found (only safetensors adapters are read)")


def _parse_key(name: str, where: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> ``(3, "q_proj", "A")``."""
    parts = name.split(".")
    try:
        i = parts.index("layers")
        which = next(p for p in parts if p in ("lora_A", "lora_B"))
        module = parts[parts.index(which) - 1]
        return int(parts[i + 1]), module, which[-1]
    except (ValueError, StopIteration, IndexError):
        raise ValueError(f"{where}: unexpected tensor {name!r} (not a per-layer lora_A / lora_B weight)") from None


class LoRALayer:
    """The slots of one adapted linear layer: per part, ``a[p]`` ``[max_loras, max_rank, in]``
    and ``b[p]`` ``[max_loras, out_p, max_rank]`` (this rank's shard, the layer's dtype) and
    which slot holds that part (an adapter may leave a module out)."""

    def __init__(self, linear, max_loras: int, max_rank: int, owner: "LoRASlots"):
        w = linear.weight if linear.qweight is None else linear.qweight
        dtype = w.dtype if w.is_floating_point() and w.element_size() >= 2 else torch.float32
        self.linear, self.row, self.owner = linear, hasattr(linear, "in_range"), owner
        n_in = w.shape[1]
        self.sizes = [w.shape[0]] if self.row else list(linear.sizes)
        self.a = [torch.zeros(max_loras, max_rank, n_in, dtype=dtype, device=w.device) for _ in self.sizes]
        self.b = [torch.zeros(max_loras, n, max_rank, dtype=dtype, device=w.device) for n in self.sizes]
        self.has = [[False] * len(self.sizes) for _ in range(max_loras)]  # [slot][part]: read every step

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Fill ``slot``'s ``part`` from the full (unsharded) ``a`` ``[r, in]`` and ``b``
        ``[out, r]`` (None: the adapter leaves this module out)."""
        self.a[part][slot].zero_()
        self.b[part][slot].zero_()
        self.has[slot][part] = a is not None
        if a is None:
            return
        r = a.shape[0]
        if self.row:
            s, e = self.linear.in_range
            a = a[:, s:e]
        else:
            s, e = self.linear.out_ranges[part]
            b = b[s:e]
        self.a[part][slot, :r].copy_(a)
        self.b[part][slot, :, :r].copy_(b)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows, part] += (x[rows] A^T) B^T`` for each of this step's segments (the owner's
        ``(slot, rows)``), in place: ``x`` ``[T, in]``, ``y`` ``[T, out]`` (for a row-parallel
        layer, the partial sum before its all-reduce). A segment covering every row (a step of
        one adapter) skips the gather and scatter."""
        for slot, rows, whole in self.owner.segments:
            xs = (x if whole else x.index_select(0, rows)).to(self.a[0].dtype)
            off = 0
            for p, n in enumerate(self.sizes):
                if self.has[slot][p]:
                    d = (xs @ self.a[p][slot].T) @ self.b[p][slot].T
                    if whole:
                        y[:, off:off + n] += d.to(y.dtype)
                    else:
                        y[:, off:off + n].index_add_(0, rows, d.to(y.dtype))
                off += n


class LoRASlots:
    """The engine's adapters: ``max_loras`` device slots in every adapted layer of ``model``
    and a host cache of up to ``max_cpu_loras`` loaded adapters (both least recently used
    first out).

    Raises:
        ValueError: a bound below 1, or ``max_cpu_loras < max_loras``.
    """

    def __init__(self, model, cfg, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None):
        max_cpu_loras = max_cpu_loras or max_loras
        if min(max_loras, max_lora_rank) < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"need max_loras >= 1, max_lora_rank >= 1 and max_cpu_loras >= max_loras; got "
                             f"{max_loras}, {max_lora_rank}, {max_cpu_loras}")
        self.cfg, self.max_loras, self.max_rank, self.max_cpu = cfg, max_loras, max_lora_rank, max_cpu_loras
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        self.num_layers = len(model.layers)
        for i, layer in enumerate(model.layers):
            for path in dict.fromkeys(p for p, _ in TARGETS.values()):
                mod = layer
                for attr in path.split("."):
                    mod = getattr(mod, attr)
                ll = LoRALayer(mod, max_loras, max_lora_rank, self)
                mod.lora = ll
                self.layers[(i, path)] = ll
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # lora_int_id -> weights
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.segments: list[tuple[int, torch.Tensor, bool]] = []  # this step's (slot, rows, all rows)
        # add() runs on the caller's thread (a request being made) while a step may run prepare()
        self.lock = threading.RLock()

    def add(self, request: LoRARequest) -> LoRAWeights:
        """Load ``request``'s adapter into the host cache (a no-op when it is there).

        Raises:
            ValueError: the adapter does not load (see :meth:`LoRAWeights.load`).
        """
        with self.lock:
            w = self.host.get(request.lora_int_id)
        if w is not None and w.name != request.lora_name:
            raise ValueError(f"lora_int_id {request.lora_int_id} is adapter '{w.name}', not '{request.lora_name}'")
        if w is None:
            w = LoRAWeights.load(request, self.cfg, self.max_rank)  # file reads outside the lock
        with self.lock:
            self.host[request.lora_int_id] = self.host.get(request.lora_int_id, w)
            self.host.move_to_end(request.lora_int_id)
            while len(self.host) > self.max_cpu:
                old = next((k for k in self.host if k not in self.slots and k != request.lora_int_id), None)
                if old is None:
                    break
                del self.host[old]
            return self.host[request.lora_int_id]

    def remove(self, lora_id: int) -> bool:
        """Drop an adapter from the host cache and its slot (False: it was not loaded)."""
        with self.lock:
            self.slots.pop(lora_id, None)
            return self.host.pop(lora_id, None) is not None

    def slot_of(self, request: LoRARequest) -> int:
        """The slot holding ``request``'s adapter, filled now if need be (the least recently
        used slot is reused; the caller keeps a step's adapters within ``max_loras``)."""
        lid = request.lora_int_id
        if lid in self.slots:
            self.slots.move_to_end(lid)
            return self.slots[lid]
        w = self.add(request)
        used = set(self.slots.values())
        if len(self.slots) < self.max_loras:
            slot = next(s for s in range(self.max_loras) if s not in used)
        else:
            _, slot = self.slots.popitem(last=False)
        for i in range(self.num_layers):
            for module, (path, part) in TARGETS.items():
                self.layers[(i, path)].set_slot(slot, part, *w.weights.get((i, module), (None, None)))
        self.slots[lid] = slot
        return slot

    def prepare(self, spans: list[tuple[LoRARequest | None, int]], device) -> None:
        """Map this step's rows to slots: ``spans`` gives, in row order, each request's adapter
        (None: the base model) and its number of rows. Sets :attr:`segments` for the layers.

        Raises:
            RuntimeError: the step names more than ``max_loras`` adapters (a scheduler bug).
        """
        by_id: dict[int, list[int]] = {}
        reqs: dict[int, LoRARequest] = {}
        row = 0
        for r, n in spans:
            if r is not None:
                by_id.setdefault(r.lora_int_id, []).extend(range(row, row + n))
                reqs[r.lora_int_id] = r
            row += n
        if len(by_id) > self.max_loras:
            raise RuntimeError(f"a step with {len(by_id)} adapters; max_loras is {self.max_loras}")
        with self.lock:
            # adapters of this step first, so filling a slot never evicts one of them
            for lid in by_id:
                if lid in self.slots:
                    self.slots.move_to_end(lid)
            self.segments = [(self.slot_of(reqs[lid]), torch.tensor(rows, dtype=torch.long, device=device),
                              len(rows) == row) for lid, rows in by_id.items()]
