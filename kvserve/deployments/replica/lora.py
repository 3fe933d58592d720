"""LoRA adapters on the serving side: the ``--lora-modules`` flag (vLLM's ``name=path`` form or
its JSON form), its check in the Serve config, the registry of adapters loaded at run time
(:class:`AdapterRegistry`, vLLM's ``/v1/load_lora_adapter``) and each replica's adapters
(:class:`ReplicaAdapters`). The endpoints and ``/v1/models`` cards are in
:mod:`kvserve.deployments.gateway.adapters`; the engine side (batched multi-adapter layers, slots) is
:mod:`kvserve.engine.lora`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

from kvserve.deployments.contract.adapters import REGISTRY_REFRESH_S, AdapterEntry, AdapterRegistry, serve_app_name

logger = logging.getLogger("ray.serve")


class UnknownAdapterError(ValueError):
    """A request names an adapter this replica does not serve (code ``model_not_found``, 404)."""


def adapter_files_version(path: str) -> str:
    """The version of the PEFT folder ``path`` as it is now: ``"files-"`` + 32 hex digits of
    SHA-256 over its :data:`ADAPTER_FILES` (name, size, bytes; a missing one counts as empty),
    so replicas that load the same files agree (their KV blocks are shared) and a changed file
    under the same name gets other KV block hashes (no replica reuses the old adapter's KV)."""
    import hashlib

    h = hashlib.sha256(b"kvserve-adapter-files\0")
    for name in ADAPTER_FILES:
        h.update(name.encode() + b"\0")
        try:
            with open(os.path.join(path, name), "rb") as f:
                h.update(os.fstat(f.fileno()).st_size.to_bytes(8, "big"))
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError:
            h.update(b"\xff" * 8)  # missing or unreadable: the load itself reports it
    return "files-" + h.hexdigest()[:32]


def load_adapters(engine, modules: dict[str, str] | None) -> dict:
    """Load a replica's configured adapters into its engine (the replica's front, an ``AsyncLLMEngine``) at start-up,
    so a bad one fails the replica's start with the reason. Returns ``{name:
    kvserve.engine.lora.LoRARequest}`` (ids 1, 2, ... in the given order, the engine's own, never seen by
    clients; paths made absolute).

    Raises:
        ValueError: an adapter does not load or fit the model (see ``kvserve.engine.lora.LoRAWeights.load``).
    """
    from kvserve.engine.lora import LoRARequest

    table = {}
    for i, (name, path) in enumerate((modules or {}).items()):
        path = os.path.abspath(os.path.expanduser(path))
        table[name] = LoRARequest(name, i + 1, path, lora_version=adapter_files_version(path))
    for r in table.values():
        engine.add_lora(r)
    return table


# ---- adapters loaded at run time ---------------------------------------------------------


def _multiplexed_id() -> str:
    """The Serve multiplexed model id of the request being served ("" for none)."""
    try:
        from ray import serve

        return serve.get_multiplexed_model_id()
    except Exception:
        return ""


class _Loaded:
    """A run-time adapter held by a replica: Serve's multiplexing LRU calls ``__del__`` when it
    evicts it (and Python when it is collected), which frees the engine's copy (a second
    removal, after an unload freed it, is a no-op)."""

    def __init__(self, request, engine):
        self.request, self._engine = request, engine

    def __del__(self):
        try:
            self._engine.remove_lora(self.request.lora_int_id)
        except Exception:  # a replica shutting down
            pass


class ReplicaAdapters:
    """The adapters one ``LLMServer`` replica serves: those of its config (``lora_modules``,
    loaded at start, on every replica) and those loaded at run time (the registry's, loaded on
    a replica's first request for them through Serve's model multiplexing, which keeps at most
    ``max_dynamic`` per replica, least recently used out, and tells the routers which replica
    holds which, so requests for an adapter go to a replica that has it). ``max_cpu_loras``: the
    engine's host cache (``max_cpu_loras or max_loras``).

    Raises:
        ValueError: (constructor) a configured adapter does not load or fit the model.
    """

    def __init__(self, engine, modules: dict[str, str] | None, model_name: str, enable_lora: bool, max_cpu_loras: int):
        self.engine, self.model_name = engine, model_name
        self.static = load_adapters(engine, modules)
        self._ids = itertools.count(len(self.static) + 1)
        app = serve_app_name() if enable_lora else None
        self.registry = AdapterRegistry(app) if app is not None else None
        self.entries: dict[str, AdapterEntry] = {}  # the registry's adapters of this model (refreshed)
        self.held: dict[str, int] = {}  # multiplexed id -> lora_int_id of the adapters this replica loaded
        self._watch: asyncio.Task | None = None
        if self.registry is not None:
            from ray import serve

            max_dynamic = max(1, max_cpu_loras - len(self.static))  # the rest of the host cache

            async def load(multiplexed_id: str) -> _Loaded:  # a function: Serve keeps its LRU on it
                return await self._load(multiplexed_id)

            self._multiplexed = serve.multiplexed(max_num_models_per_replica=max_dynamic)(load)

    def hash_roots(self, root: int) -> dict[str, int]:
        """The roots of the KV block-hash chains this replica's engine starts from (``root``:
        the engine's): ``{"": root}`` for the base model, plus each configured adapter's
        (``kvserve.engine.kv_cache_manager.request_root``, name and version), which the KV-aware
        router needs to hash as the engine does."""
        from kvserve.engine.kv_cache_manager import request_root

        return {"": root, **{name: request_root(root, r) for name, r in self.static.items()}}

    async def resolve(self, name: str | None):
        """The ``kvserve.engine.lora.LoRARequest`` of adapter ``name`` (None: the base model), loading
        a run-time adapter on this replica first if need be.

        Raises:
            UnknownAdapterError: no adapter of that name serves this model.
            ValueError: the adapter's files no longer load.
        """
        if name is None or name in self.static:
            return self.static.get(name) if name else None
        entry = self.entries.get(name)
        sent = _multiplexed_id()  # the gateway's view of the adapter's current load, if it sent one
        if self.registry is not None and (entry is None or sent and sent != entry.multiplexed_id):
            entry = await asyncio.to_thread(self.registry.get, name)  # (re)loaded since the last refresh
        if entry is None or entry.base != self.model_name:
            raise UnknownAdapterError(f"the model '{name}' does not exist on this server")
        self.entries[name] = entry
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._refresh_loop())
        return (await self._multiplexed(entry.multiplexed_id)).request

    async def _load(self, multiplexed_id: str) -> _Loaded:
        from kvserve.engine.lora import LoRARequest

        entry = next(e for e in self.entries.values() if e.multiplexed_id == multiplexed_id)
        # the registry's version changes on every load of the name: its prompts' KV block hashes
        # start from a new root, so a re-load never reuses the old adapter's KV (here or in the tier)
        request = LoRARequest(entry.name, next(self._ids), entry.path, lora_version=entry.version)
        await asyncio.to_thread(self.engine.add_lora, request)
        self.held[multiplexed_id] = request.lora_int_id
        logger.info("adapter %s loaded (lora_int_id %d)", entry.name, request.lora_int_id)
        return _Loaded(request, self.engine)

    async def _refresh_loop(self) -> None:
        """Re-read the registry every :data:`REGISTRY_REFRESH_S` s; free what was unloaded."""
        while True:
            await asyncio.sleep(REGISTRY_REFRESH_S)
            try:
                entries = await asyncio.to_thread(self.registry.entries)
            except Exception as e:  # the GCS is briefly away: keep the last view
                logger.warning("adapter registry unreadable (%s)", type(e).__name__)
                continue
            self.entries = {n: e for n, e in entries.items() if e.base == self.model_name}
            live = {e.multiplexed_id for e in self.entries.values()}
            for mid in [m for m in self.held if m not in live]:
                self.engine.remove_lora(self.held.pop(mid))  # running requests of it reload it; new ones: 404
                logger.info("adapter %s unloaded", mid)


# ---- where run-time adapters may be read from ---------------------------------------------

#: The files of a PEFT folder that an adapter load reads (``kvserve.engine.lora.LoRAWeights.load``).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
#: The one answer for a path that is missing, outside the allowed roots, or unreadable: it
#: never tells which (a client must not probe the server's files with it).
UNREADABLE_ADAPTER = (
    "lora_path is not a readable adapter folder under an allowed root (--lora-allowed-root): "
    "a PEFT folder with adapter_config.json and adapter_model.safetensors"
)


class AdapterPathError(ValueError):
    """A run-time adapter's path that may not be read; the message is :data:`UNREADABLE_ADAPTER`
    whatever the cause (missing, outside the roots, unreadable)."""

    def __init__(self):
        super().__init__(UNREADABLE_ADAPTER)


def _under(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` (a real path) or inside it."""
    return os.path.commonpath([path, root]) == root


def resolve_adapter_path(path: str, roots: list[str] | tuple[str, ...]) -> str:
    """The real path (symlinks and ``..`` resolved) of the PEFT folder ``path``, which must lie
    under one of ``roots`` (themselves resolved), with its :data:`ADAPTER_FILES` regular,
    readable files whose own real paths lie under a root too (a file symlinked out of the
    roots is refused).

    Raises:
        AdapterPathError: no roots, or the folder or a file is missing, outside the roots or
            unreadable: one message for all of them.
    """
    try:
        real_roots = [os.path.realpath(r) for r in roots if r]
        folder = os.path.realpath(path)
        files = [os.path.realpath(os.path.join(folder, name)) for name in ADAPTER_FILES]
        ok = (
            any(_under(folder, r) for r in real_roots)
            and os.path.isdir(folder)
            and all(
                any(_under(f, r) for r in real_roots) and os.path.isfile(f) and os.access(f, os.R_OK) for f in files
            )
        )
    except (OSError, ValueError):  # a NUL byte, a path too long
        ok = False
    if not ok:
        raise AdapterPathError()
    return folder


def check_adapter(
    engine, name: str, path: str, allowed_roots: list[str] | tuple[str, ...] = ()
) -> tuple[str | None, str | None]:
    """Whether the PEFT folder ``path`` may serve as run-time adapter ``name`` of
    ``engine``'s model: ``(its real path, None)`` when it may, ``(None, why not)`` when
    not: outside ``allowed_roots`` or unreadable (:data:`UNREADABLE_ADAPTER`, whichever it
    is; no roots: nothing may be read), or its rank, modules, shapes, files (the reason names
    the path as the client sent it, never the resolved one). Reads the files; loads nothing."""
    from kvserve.engine.lora import LoRARequest, LoRAWeights

    cfg = engine.config
    if not cfg.enable_lora:
        return None, "this model serves no LoRA adapters: start it with --enable-lora"
    try:
        real = resolve_adapter_path(path, allowed_roots)
    except AdapterPathError as e:
        return None, str(e)
    try:
        LoRAWeights.load(LoRARequest(name, 1 << 30, real), engine.hf_config, cfg.max_lora_rank)
    except ValueError as e:
        return None, str(e).replace(real, path)
    return real, None
