"""A file of the Files API written part by part as its bytes come: :class:`FileWriter` (made by
:meth:`kvserve.deployments.gateway.files.FileStore.open`, or taken up again after a restart with
:meth:`FileWriter.resume`). Parts are entries ``d:<id>:<n>`` of at most :data:`PART_BYTES`; the
file object ``m:<id>`` is written last."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvserve.deployments.contract.openai_errors import OpenAIError

#: Bytes of one stored part of a file.
PART_BYTES = 1 << 20
#: Seconds a file lives (OpenAI keeps batch files until deleted; a cache backend is not a disk).
FILE_TTL_S = 30 * 86400.0


def public(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's file object of a stored one (without kvserve's own ``kvserve_*`` fields)."""
    return {k: v for k, v in meta.items() if not k.startswith("kvserve_")}


class FileWriter:
    """One new file of ``files`` (a :class:`~kvserve.deployments.gateway.files.FileStore`),
    written part by part as its bytes come: each
    :meth:`write` is refused (413) the moment the file would pass ``max_file_bytes`` or its
    key's bytes (counting the key's other files being written in this replica); :meth:`close`
    writes the file object and lists it; :meth:`abort` deletes what was written.

    :meth:`flush` writes the open part as it is (rewritten as it grows), so what was written
    survives this process (a batch's output: :attr:`state` records the parts so far).
    """

    def __init__(
        self,
        files,
        owner: str,
        filename: str,
        purpose: str,
        used: int,
        file_id: str | None = None,
        parts: int = 0,
        size: int = 0,
    ):
        self.files, self.owner, self.filename, self.purpose, self.used = files, owner, filename, purpose, used
        self.id = file_id or f"file-{uuid.uuid4().hex}"
        self.parts, self.size = parts, size  # parts whole in the store; bytes in them
        self._open = bytearray()  # the part being filled
        self._reserved = 0  # bytes counted in files._writing for this writer
        self._reserve(size)

    def _reserve(self, n: int) -> None:
        self.files._writing[self.owner] = self.files._writing.get(self.owner, 0) + n
        self._reserved += n

    def _release(self) -> None:
        left = self.files._writing.get(self.owner, 0) - self._reserved
        if left > 0:
            self.files._writing[self.owner] = left
        else:
            self.files._writing.pop(self.owner, None)
        self._reserved = 0

    @property
    def bytes(self) -> int:
        """Bytes written so far."""
        return self.size + len(self._open)

    def room(self) -> int:
        """Bytes this file may still take (its own bound and its key's, whichever is less)."""
        others = self.files._writing.get(self.owner, 0) - self._reserved
        return max(
            0, min(self.files.max_file_bytes - self.bytes, self.files.max_owner_bytes - self.used - others - self.bytes)
        )

    async def write(self, data: bytes) -> None:
        """Append ``data`` (full parts go to the store at once).

        Raises:
            OpenAIError: 413 ``file_too_large`` past ``max_file_bytes``, 413 ``quota_exceeded``
                past the key's bytes (nothing of ``data`` is written then); 503 when the
                backend does not take a part (nothing changed: the same call may be retried).
        """
        total = self.bytes + len(data)
        if total > self.files.max_file_bytes:
            raise OpenAIError(
                f"the file is over {self.files.max_file_bytes} bytes (at least {total}); the limit is "
                f"{self.files.max_file_bytes} (max_file_bytes)",
                413,
                param="file",
                code="file_too_large",
            )
        if len(data) > self.room():
            others = self.files._writing.get(self.owner, 0) - self._reserved
            raise OpenAIError(
                f"this key's files would take {self.used + others + total} bytes; the limit is "
                f"{self.files.max_owner_bytes} (its share of cache_max_bytes; delete files first)",
                413,
                param="file",
                code="quota_exceeded",
            )
        buf, parts, size = self._open + data, self.parts, self.size
        while len(buf) >= PART_BYTES:  # a failure here changes nothing: a retry rewrites the same parts
            await self._put(parts, bytes(buf[:PART_BYTES]))
            buf, parts, size = buf[PART_BYTES:], parts + 1, size + PART_BYTES
        self._reserve(len(data))
        self._open, self.parts, self.size = buf, parts, size

    async def flush(self) -> None:
        """Write the open part as it is now (it is rewritten as it grows)."""
        if self._open:
            await self._put(self.parts, bytes(self._open))

    @property
    def state(self) -> dict[str, Any]:
        """What a later writer needs to go on with this file after :meth:`flush` (see :meth:`resume`)."""
        return {
            "id": self.id,
            "filename": self.filename,
            "purpose": self.purpose,
            "parts": self.parts,
            "size": self.size,
            "open": len(self._open),
        }

    @classmethod
    async def resume(cls, files, owner: str, state: dict[str, Any]) -> "FileWriter":
        """The writer of a file another process left at ``state`` (:attr:`state` after a
        :meth:`flush`): whole parts kept, the open part read back.

        Raises:
            OpenAIError: 503 when the backend does not answer.
        """
        used = sum(f["bytes"] for f in await files._metas(owner))
        w = cls(files, owner, state["filename"], state["purpose"], used, state["id"], state["parts"], state["size"])
        if state.get("open"):
            data = await files.owners.store_of(owner).get(files.DATA, f"d:{w.id}:{w.parts}")
            if data is not None:
                w._open += data[: state["open"]]
                w._reserve(len(w._open))
        return w

    async def _put(self, n: int, data: bytes) -> None:
        if not await self.files.owners.store_of(self.owner).put(self.files.DATA, f"d:{self.id}:{n}", data, FILE_TTL_S):
            raise OpenAIError(
                "the file store did not take the file; retry later", 503, "server_error", code="file_store_unavailable"
            )

    async def close(self) -> dict[str, Any]:
        """Write the last part and the file object, list the file: OpenAI's file object.

        Raises:
            OpenAIError: 503 when the backend does not take it (the caller may retry or :meth:`abort`).
        """
        if self._open:
            part = bytes(self._open)
            await self._put(self.parts, part)
            self.parts, self.size, self._open = self.parts + 1, self.size + len(part), bytearray()
        now = int(time.time())
        meta = {
            "id": self.id,
            "object": "file",
            "bytes": self.size,
            "created_at": now,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": now + int(FILE_TTL_S),
            "kvserve_parts": self.parts,
        }
        store = self.files.owners.store_of(self.owner)
        if not await store.put(self.files.META, "m:" + self.id, json.dumps(meta).encode(), FILE_TTL_S):
            raise OpenAIError(
                "the file store did not take the file; retry later", 503, "server_error", code="file_store_unavailable"
            )
        await self.files.owners.index_add(self.owner, "files", self.id)
        self._release()
        return public(meta)

    async def abort(self) -> None:
        """Delete the parts written (best effort: a backend that fails leaves them to expire)."""
        self._release()
        store = self.files.owners.store_of(self.owner)
        try:
            for n in range(self.parts + 1):
                await store.delete(self.files.DATA, f"d:{self.id}:{n}")
        except Exception:  # noqa: BLE001 -- the error that made us abort is the one to report
            pass
