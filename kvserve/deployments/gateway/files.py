"""OpenAI's Files API for the Batch API: ``POST /v1/files`` (``purpose: batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``; and the
batches' output and error files (``purpose: batch_output``). :class:`FileStore` keeps them."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvserve.deployments.cache.owner_stores import OwnerStores
from kvserve.deployments.cache.settings import CacheSettings
from kvserve.deployments.contract.openai_errors import OpenAIError

#: Seconds a file lives (OpenAI keeps batch files until deleted; a cache backend is not a disk).
FILE_TTL_S = 30 * 86400.0
#: Purposes a client may upload (the Batch API's input); ``batch_output`` is the server's.
UPLOAD_PURPOSES = ("batch",)


def _not_found(file_id: str) -> OpenAIError:
    return OpenAIError(f"no file with id '{file_id}' was found", 404, param="file_id", code="file_not_found")


class FileStore:
    """Files of each API key (by its stable owner id; another key's file is a 404), in the
    response cache's backend (this ingress replica's memory, or Redis so every ingress replica
    sees them: use Redis with more than one ingress replica), each at most ``max_file_bytes``
    and each key's together at most ``max_owner_bytes`` (a 413 beyond, never a silent
    eviction of an older file). Metadata and content are separate entries, so listing never
    reads content.

    Args:
        settings: the response cache's backend (``max_bytes`` bounds each key's files).
        max_file_bytes: the largest file.
    """

    PREFIX = "kvserve:files:"
    META, DATA = "file-meta", "file-data"  # the stores' model tags; keys are "m:<id>" and "d:<id>"

    def __init__(self, settings: CacheSettings, max_file_bytes: int):
        self.owners = OwnerStores(settings, self.PREFIX, timeout_s=10.0)
        self.max_file_bytes, self.max_owner_bytes = max_file_bytes, settings.max_bytes

    async def create(self, owner: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """Store ``data`` as a new file of ``owner``; returns OpenAI's file object.

        Raises:
            OpenAIError: 413 over the size bounds, 503 when the backend did not take it.
        """
        if len(data) > self.max_file_bytes:
            raise OpenAIError(f"the file is {len(data)} bytes; the limit is {self.max_file_bytes}", 413,
                              param="file", code="file_too_large")
        used = sum(f["bytes"] for f in await self._metas(owner))
        if used + len(data) > self.max_owner_bytes:
            raise OpenAIError(f"this key's files would take {used + len(data)} bytes; the limit is "
                              f"{self.max_owner_bytes} (delete files first)", 413, param="file", code="quota_exceeded")
        now = int(time.time())
        meta = {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": len(data), "created_at": now,
                "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
                "expires_at": now + int(FILE_TTL_S)}
        store = self.owners.store_of(owner)
        if not await store.put(self.DATA, "d:" + meta["id"], data, FILE_TTL_S) or not await store.put(
                self.META, "m:" + meta["id"], json.dumps(meta).encode(), FILE_TTL_S):
            await store.delete(self.DATA, "d:" + meta["id"])
            raise OpenAIError("the file store did not take the file; retry later", 503, "server_error",
                              code="file_store_unavailable")
        await self.owners.index_add(owner, "files", meta["id"])
        return meta

    async def meta(self, owner: str, file_id: str) -> dict[str, Any]:
        """OpenAI's file object of ``file_id``.

        Raises:
            OpenAIError: 404 when ``owner`` has no such file.
        """
        data = await self.owners.store_of(owner).get(self.META, "m:" + file_id)
        if not data:
            raise _not_found(file_id)
        return json.loads(data)

    async def content(self, owner: str, file_id: str) -> bytes:
        """The bytes of ``file_id``.

        Raises:
            OpenAIError: 404 as :meth:`meta`.
        """
        await self.meta(owner, file_id)
        data = await self.owners.store_of(owner).get(self.DATA, "d:" + file_id)
        if data is None:
            raise _not_found(file_id)
        return data

    async def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        """Forget ``file_id``: OpenAI's deletion object.

        Raises:
            OpenAIError: 404 as :meth:`meta`.
        """
        await self.meta(owner, file_id)
        store = self.owners.store_of(owner)
        await store.delete(self.META, "m:" + file_id)
        await store.delete(self.DATA, "d:" + file_id)
        await self.owners.index_remove(owner, "files", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def list(self, owner: str, purpose: str | None = None, limit: int = 10000, after: str | None = None,
                   order: str = "desc") -> dict[str, Any]:
        """OpenAI's list of ``owner``'s files (newest first unless ``order`` is ``asc``)."""
        files = [f for f in await self._metas(owner) if purpose is None or f["purpose"] == purpose]
        if order == "asc":
            files.reverse()
        if after is not None:
            ids = [f["id"] for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        page = files[:max(1, min(limit, 10000))]
        return {"object": "list", "data": page, "has_more": len(files) > len(page),
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    async def _metas(self, owner: str) -> list[dict[str, Any]]:
        """``owner``'s files, newest first (expired or evicted ones leave the index here)."""
        out = []
        for file_id in await self.owners.index(owner, "files"):
            data = await self.owners.store_of(owner).get(self.META, "m:" + file_id)
            if data:
                out.append(json.loads(data))
            else:
                await self.owners.index_remove(owner, "files", file_id)
        return out


async def upload(store: FileStore, owner: str, file, purpose: str) -> dict[str, Any]:
    """``POST /v1/files``: ``file`` (a Starlette ``UploadFile``) as a file of ``owner``.

    Raises:
        OpenAIError: 400 for a purpose other than ``batch``; see :meth:`FileStore.create`.
    """
    if purpose not in UPLOAD_PURPOSES:
        raise OpenAIError(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} (the Batch API's input), got "
                          f"{purpose!r}", 400, param="purpose", code="invalid_value")
    data = await file.read(store.max_file_bytes + 1)
    return await store.create(owner, file.filename or "upload.jsonl", purpose, data)
