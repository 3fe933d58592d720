"""LoRA adapters on the device: per-layer slots and the step's rows mapped to them.

:class:`LoRASlots` keeps ``max_loras`` device slots in every adapted linear layer (``A``/``B``
stacked, ranks zero-padded to ``max_lora_rank``), filled least-recently-used first from a host
cache of up to ``max_cpu_loras`` loaded adapters (:class:`kvserve.engine.lora_adapter.LoRAWeights`);
:meth:`LoRASlots.prepare` maps a step's rows to slots, and each layer's :class:`LoRALayer` adds
``(x A^T) B^T`` for them (Punica's SGMV as a padded ``bmm`` for decode rows, a row slice of its
own for a prefill chunk, ``kvserve/kernels/csrc/lora_cpu.cpp`` on a CPU in float32).

With tensor parallelism each slot holds this rank's shard, cut like its base layer
(column-parallel layers split ``B``'s rows, row-parallel layers split ``A``'s columns and add
their partial ``x A^T B^T`` before the layer's all-reduce, which sums it like the base output).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvserve.engine.lora_adapter import TARGETS, LoRARequest, LoRAWeights

#: Rows of one request from which its adapter's rows are a slice of their own (a prefill chunk)
#: rather than part of the step's batched matmul (:meth:`LoRASlots.prepare`).
LONG_SPAN = 16


class LoRALayer:
    """The slots of one adapted linear layer (this rank's shard, the layer's dtype):
    ``a`` ``[max_loras, parts * max_rank, in]`` (every part's ``A`` stacked, so one matmul
    shrinks a row for all parts) and per part ``b_t[p]`` ``[max_loras, max_rank, out_p]``;
    ``has[slot][part]``: which parts the slot's adapter covers (an adapter may leave a module out;
    its ``A`` and ``B`` there stay zero)."""

    def __init__(self, linear, max_loras: int, max_rank: int, owner: "LoRASlots"):
        n_out, n_in, dtype, device = linear.weight_geometry()  # a quantized weight: the activations' dtype
        self.linear, self.row, self.owner, self.rank = linear, hasattr(linear, "in_range"), owner, max_rank
        self.sizes = [n_out] if self.row else list(linear.sizes)
        self.a = torch.zeros(max_loras, len(self.sizes) * max_rank, n_in, dtype=dtype, device=device)
        self.b_t = [torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device) for n in self.sizes]
        self.has = [[False] * len(self.sizes) for _ in range(max_loras)]  # [slot][part]

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Fill ``slot``'s ``part`` from the full (unsharded) ``a`` ``[r, in]`` and ``b``
        ``[out, r]`` (None: the adapter leaves this module out)."""
        self.a[slot, part * self.rank : (part + 1) * self.rank].zero_()
        self.b_t[part][slot].zero_()
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
        self.a[slot, part * self.rank : part * self.rank + r].copy_(a)
        self.b_t[part][slot, :r].copy_(b.T)

    def _expand(self, h: torch.Tensor, slot: int, y: torch.Tensor) -> None:
        """``y[:, part] += h[:, part's rank columns] B_part^T`` of one slot (``y`` a row slice)."""
        off = 0
        for p, n in enumerate(self.sizes):
            if self.has[slot][p]:
                hp, out = h[:, p * self.rank : (p + 1) * self.rank], y[:, off : off + n]
                if out.dtype == hp.dtype:
                    out.addmm_(hp, self.b_t[p][slot])
                else:
                    out += (hp @ self.b_t[p][slot]).to(out.dtype)
            off += n

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows, part] += (x[rows] A^T) B^T`` for each adapter of the step, in place: ``x``
        ``[T, in]``, ``y`` ``[T, out]`` (for a row-parallel layer, the partial sum before its
        all-reduce). The paths of :meth:`LoRASlots.prepare`: a long run of one request's rows
        (a prefill chunk, or a whole step of one adapter) is a row slice with two matmuls of its
        own; the short ones (decode rows) go through batched matmuls for every adapter at once
        (Punica's SGMV as a padded ``bmm``: each slot's rows gathered into ``[slots, L, in]``,
        shrink, expand per part, one scatter-add; padding rows are zeroed after the shrink);
        a slot with many more short rows than the others is gathered on its own. On a CPU in
        float32 the short rows go to ``kvserve/kernels/csrc/lora_cpu.cpp`` instead, one call per layer."""
        own = self.owner
        dtype = self.a.dtype
        if own.sgmv is not None:
            from kvserve.kernels.cpu_backend import lora_sgmv

            lora_sgmv(x, y, self.a, self.b_t, *own.sgmv)
        for slot, s, e in own.spans:
            self._expand(x[s:e].to(dtype) @ self.a[slot].T, slot, y[s:e])
        for slot, rows in own.gathered:
            d = torch.zeros(len(rows), y.shape[1], dtype=y.dtype, device=y.device)
            self._expand(x.index_select(0, rows).to(dtype) @ self.a[slot].T, slot, d)
            y.index_add_(0, rows, d)
        if own.batch is None:
            return
        n_slots, length, idx, pad = own.batch
        h = torch.bmm(x.index_select(0, idx).to(dtype).view(n_slots, length, -1), self.a[:n_slots].mT)
        h.mul_(pad)  # [slots, L, parts * rank]; padding rows (gathered from row 0) to zero
        d = [
            torch.bmm(h[:, :, p * self.rank : (p + 1) * self.rank], self.b_t[p][:n_slots])
            for p in range(len(self.sizes))
        ]  # [slots, L, out_p] each
        d = d[0] if len(d) == 1 else torch.cat(d, dim=-1)
        y.index_add_(0, idx, d.view(n_slots * length, -1).to(y.dtype))  # padding rows add zeros


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
            raise ValueError(
                f"need max_loras >= 1, max_lora_rank >= 1 and max_cpu_loras >= max_loras; got "
                f"{max_loras}, {max_lora_rank}, {max_cpu_loras}"
            )
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
        # the C++ kernel for decode rows: CPU, float32 slots, kernels built
        self.kernel = all(ll.a.device.type == "cpu" and ll.a.dtype == torch.float32 for ll in self.layers.values())
        if self.kernel:
            from kvserve.kernels.cpu_backend import use_lora_kernel

            self.kernel = use_lora_kernel()
        # this step's rows by slot (see prepare())
        self.sgmv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.spans: list[tuple[int, int, int]] = []
        self.gathered: list[tuple[int, torch.Tensor]] = []
        self.batch: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
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
        (None: the base model) and its number of rows. Sets what the layers read
        (:meth:`LoRALayer.apply`):

        * :attr:`spans`: ``(slot, start, end)`` of each request with at least
          :data:`LONG_SPAN` rows (a prefill chunk), and of a step all of one adapter (with the
          kernel, only one of more than ``4 * LONG_SPAN`` rows);
        * :attr:`batch`: the other rows, by slot, padded to ``L`` rows per slot for slots
          ``0..n_slots-1``: ``(n_slots, L, idx, pad)``, ``idx`` the row of each place (0 for
          padding) and ``pad`` ``[n_slots, L, 1]`` (1 for a row, 0 for padding);
        * :attr:`gathered`: ``(slot, rows)`` of a slot whose short rows number more than
          ``max(8, 2 * mean)`` over the slots (padding every slot to it would waste more than
          it saves);
        * :attr:`sgmv` instead of the last two when the C++ kernel runs them (CPU, float32):
          ``(order, starts, slots)``, the short rows grouped by slot.

        Raises:
            RuntimeError: the step names more than ``max_loras`` adapters (a scheduler bug).
        """
        reqs = {r.lora_int_id: r for r, _ in spans if r is not None}
        if len(reqs) > self.max_loras:
            raise RuntimeError(f"a step with {len(reqs)} adapters; max_loras is {self.max_loras}")
        self.clear()
        if not reqs:
            return
        with self.lock:
            # adapters of this step first, so filling a slot never evicts one of them
            for lid in reqs:
                if lid in self.slots:
                    self.slots.move_to_end(lid)
            slot = {lid: self.slot_of(r) for lid, r in reqs.items()}
        total = sum(n for _, n in spans)
        if len(reqs) == 1 and all(r is not None for r, _ in spans) and (not self.kernel or total > 4 * LONG_SPAN):
            self.spans = [(next(iter(slot.values())), 0, total)]  # (decode rows stay with the kernel)
            return
        short: dict[int, list[int]] = {}
        row = 0
        for r, n in spans:
            if r is not None:
                if n >= LONG_SPAN:
                    self.spans.append((slot[r.lora_int_id], row, row + n))
                else:
                    short.setdefault(slot[r.lora_int_id], []).extend(range(row, row + n))
            row += n
        if not short:
            return
        if self.kernel:
            order = [r for rows in short.values() for r in rows]
            starts = [0]
            for rows in short.values():
                starts.append(starts[-1] + len(rows))
            self.sgmv = tuple(torch.tensor(v, dtype=torch.long) for v in (order, starts, list(short)))
            return
        cap = max(8, 2 * sum(len(r) for r in short.values()) // len(short))
        for s in [s for s, rows in short.items() if len(rows) > cap]:
            self.gathered.append((s, torch.tensor(short.pop(s), dtype=torch.long, device=device)))
        if short:
            n_slots, length = max(short) + 1, max(len(r) for r in short.values())
            idx = torch.zeros((n_slots, length), dtype=torch.long)
            pad = torch.zeros((n_slots, length, 1))
            for s, rows in short.items():
                idx[s, : len(rows)] = torch.tensor(rows)
                pad[s, : len(rows)] = 1
            self.batch = (n_slots, length, idx.view(-1).to(device), pad.to(device))

    @property
    def active(self) -> bool:
        """Whether this step has rows of any adapter."""
        return bool(self.spans or self.gathered) or self.batch is not None or self.sgmv is not None

    def clear(self) -> None:
        """No adapter rows (a step of the base model only)."""
        self.spans, self.gathered, self.batch, self.sgmv = [], [], None, None
