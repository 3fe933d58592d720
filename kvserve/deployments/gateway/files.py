"""OpenAI's Files API for the Batch API: ``POST /v1/files`` (``purpose: batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``; and the
batches' output and error files (``purpose: batch_output``). :class:`FileStore` keeps them.

A file's bytes are kept in parts of at most :data:`PART_BYTES` (entries ``d:<id>:<n>``), written
as they arrive (:class:`~kvserve.deployments.gateway.file_parts.FileWriter`): an upload is parsed as it streams in
(:func:`upload_stream`, python-multipart's push parser over ``request.stream()``) and refused
with a 413 the moment it crosses ``max_file_bytes`` or the key's bytes, never read whole into
memory first; a batch's output grows line by line. The file object (``m:<id>``, in the key's
index) is written last: a file is listed once it is whole.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.deployments.cache.owner_stores import OwnerStores
from kvserve.deployments.cache.settings import CacheSettings
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.file_parts import FILE_TTL_S, PART_BYTES, FileWriter, public
from kvserve.deployments.gateway.gate import key_name, request_policy

__all__ = [
    "FILE_TTL_S",
    "PART_BYTES",
    "FileStore",
    "FileWriter",
    "admit",
    "content_response",
    "public",
    "upload_stream",
]

#: Files one API key may keep (uploads and batch outputs); more: 400 ``quota_exceeded``.
DEFAULT_MAX_FILES_PER_KEY = 1000
#: Purposes a client may upload (the Batch API's input); ``batch_output`` is the server's.
UPLOAD_PURPOSES = ("batch",)
#: Bytes of an upload's form fields other than the file (``purpose``): more is a 400.
MAX_FIELD_BYTES = 4096


def _not_found(file_id: str) -> OpenAIError:
    return OpenAIError(f"no file with id '{file_id}' was found", 404, param="file_id", code="file_not_found")


class FileStore:
    """Files of each API key (by its stable owner id; another key's file is a 404), in the
    response cache's backend (this ingress replica's memory, or Redis so every ingress replica
    sees them: use Redis with more than one ingress replica), each at most ``max_file_bytes``,
    each key's together at most ``max_owner_bytes`` (its share of ``cache_max_bytes``: a 413
    beyond, never a silent eviction of an older file) and at most ``max_files`` of them (a
    400). Metadata and content are separate entries, so listing never reads content; content
    is kept in parts (see the module docstring). A backend that fails answers 503
    (:class:`~kvserve.deployments.cache.stores.StoreUnavailable`), never "no such file".

    Args:
        settings: the response cache's backend.
        max_file_bytes: the largest file.
        owners: how many API keys share ``settings.max_bytes`` (each key's bytes: an equal share).
        max_files: files one key may keep.
    """

    PREFIX = "kvserve:files:"
    META, DATA = "file-meta", "file-data"  # the stores' model tags; keys are "m:<id>" and "d:<id>:<n>"

    def __init__(
        self,
        settings: CacheSettings,
        max_file_bytes: int,
        *,
        owners: int = 1,
        max_files: int = DEFAULT_MAX_FILES_PER_KEY,
    ):
        # our own quotas bound the files; the store's entry bound must never evict a part
        self.owners = OwnerStores(settings, self.PREFIX, timeout_s=2.0, owners=owners, max_entries=1 << 30)
        self.max_file_bytes, self.max_owner_bytes, self.max_files = max_file_bytes, self.owners.owner_bytes, max_files
        self._writing: dict[str, int] = {}  # owner -> bytes of its files being written here (not yet listed)

    async def open(self, owner: str, filename: str, purpose: str) -> "FileWriter":
        """A :class:`FileWriter` of a new file of ``owner``.

        Raises:
            OpenAIError: 400 ``quota_exceeded`` when ``owner`` already keeps ``max_files``
                files; 503 when the backend does not answer.
        """
        metas = await self._metas(owner)
        if len(metas) >= self.max_files:
            raise OpenAIError(
                f"this key keeps {len(metas)} files; the limit is {self.max_files} "
                "(max_files_per_key; delete files first)",
                400,
                param="file",
                code="quota_exceeded",
            )
        return FileWriter(self, owner, filename, purpose, sum(f["bytes"] for f in metas))

    async def create(self, owner: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """Store ``data`` as a new file of ``owner``; returns OpenAI's file object.

        Raises:
            OpenAIError: 413 over the size bounds, 400 over the file count, 503 when the
                backend did not take it.
        """
        w = await self.open(owner, filename, purpose)
        try:
            await w.write(data)
            return await w.close()
        except BaseException:
            await w.abort()
            raise

    async def _meta(self, owner: str, file_id: str) -> dict[str, Any]:
        data = await self.owners.store_of(owner).get(self.META, "m:" + file_id)
        if not data:
            raise _not_found(file_id)
        return json.loads(data)

    async def meta(self, owner: str, file_id: str) -> dict[str, Any]:
        """OpenAI's file object of ``file_id``.

        Raises:
            OpenAIError: 404 when ``owner`` has no such file; 503 when the backend fails.
        """
        return public(await self._meta(owner, file_id))

    async def content(self, owner: str, file_id: str) -> bytes:
        """The bytes of ``file_id``.

        Raises:
            OpenAIError: 404 as :meth:`meta` (or a part that is gone); 503 as :meth:`meta`.
        """
        return b"".join([part async for part in self.parts(owner, file_id)])

    async def parts(self, owner: str, file_id: str):
        """The bytes of ``file_id`` part by part (an async iterator; checks the file first).

        Raises:
            OpenAIError: as :meth:`content`.
        """
        meta = await self._meta(owner, file_id)
        store = self.owners.store_of(owner)
        for key in self._part_keys(meta):
            data = await store.get(self.DATA, key)
            if data is None:
                raise _not_found(file_id)
            yield data

    @staticmethod
    def _part_keys(meta: dict[str, Any]) -> list[str]:
        """The entries of a file's bytes (one ``d:<id>`` for a file stored before parts)."""
        if "kvserve_parts" not in meta:
            return ["d:" + meta["id"]]
        return [f"d:{meta['id']}:{n}" for n in range(meta["kvserve_parts"])]

    async def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        """Forget ``file_id``: OpenAI's deletion object.

        Raises:
            OpenAIError: 404 as :meth:`meta`; 503 as :meth:`meta` (the file is then kept or
                half gone, and a retry finishes the deletion).
        """
        meta = await self._meta(owner, file_id)
        store = self.owners.store_of(owner)
        await store.delete(self.META, "m:" + file_id)
        for key in self._part_keys(meta):
            await store.delete(self.DATA, key)
        await self.owners.index_remove(owner, "files", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def list(
        self, owner: str, purpose: str | None = None, limit: int = 10000, after: str | None = None, order: str = "desc"
    ) -> dict[str, Any]:
        """OpenAI's list of ``owner``'s files (newest first unless ``order`` is ``asc``).

        Raises:
            OpenAIError: 503 when the backend fails (nothing leaves the index then).
        """
        files = [public(f) for f in await self._metas(owner) if purpose is None or f["purpose"] == purpose]
        if order == "asc":
            files.reverse()
        if after is not None:
            ids = [f["id"] for f in files]
            files = files[ids.index(after) + 1 :] if after in ids else []
        page = files[: max(1, min(limit, 10000))]
        return {
            "object": "list",
            "data": page,
            "has_more": len(files) > len(page),
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }

    async def _metas(self, owner: str) -> list[dict[str, Any]]:
        """``owner``'s files, newest first (expired or evicted ones leave the index here: only
        on an answer of "no such entry", never on a failed read, which raises 503)."""
        out = []
        for file_id in await self.owners.index(owner, "files"):
            data = await self.owners.store_of(owner).get(self.META, "m:" + file_id)
            if data:
                out.append(json.loads(data))
            else:
                await self.owners.index_remove(owner, "files", file_id)
        return out


def _check_purpose(purpose: str | None) -> None:
    if purpose not in UPLOAD_PURPOSES:
        raise OpenAIError(
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} (the Batch API's input), got {purpose!r}",
            400,
            param="purpose",
            code="invalid_value",
        )


async def upload_stream(store: FileStore, owner: str, request) -> dict[str, Any]:
    """``POST /v1/files``: the multipart form (``file``, ``purpose``) parsed as it arrives
    (python-multipart's push parser over ``request.stream()``), the file's bytes written in
    parts as they come: refused the moment they cross a bound, never held whole.

    Raises:
        OpenAIError: 400 for a body that is not such a form (no ``file``, a bad ``purpose``,
            fields over :data:`MAX_FIELD_BYTES`); 413 and 503 as :meth:`FileWriter.write`.
    """
    from python_multipart.multipart import MultipartParser, parse_options_header

    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise OpenAIError(
            "POST /v1/files takes multipart/form-data with the fields file and purpose",
            400,
            param="file",
            code="invalid_request",
        )
    events: list[tuple[str, Any]] = []  # what the parser saw, handled after each chunk
    part: dict[str, Any] = {}

    def on_part_begin():
        part.clear()
        part.update(headers={}, field=b"", value=b"")

    def on_header_field(data, start, end):
        part["field"] += data[start:end]

    def on_header_value(data, start, end):
        part["headers"][part["field"].lower()] = part["headers"].get(part["field"].lower(), b"") + data[start:end]

    def on_header_end():
        part["field"] = b""

    def on_headers_finished():
        _, disp = parse_options_header(part["headers"].get(b"content-disposition", b""))
        part["name"] = disp.get(b"name", b"").decode("utf-8", "replace")
        part["filename"] = disp.get(b"filename", b"").decode("utf-8", "replace") if b"filename" in disp else None
        if part["name"] == "file":
            events.append(("file", part["filename"] or "upload.jsonl"))

    def on_part_data(data, start, end):
        if part.get("name") == "file":
            events.append(("data", bytes(data[start:end])))
        else:
            part["value"] += data[start:end]
            if len(part["value"]) > MAX_FIELD_BYTES:
                raise OpenAIError(
                    f"the form field {part.get('name')!r} is over {MAX_FIELD_BYTES} bytes",
                    400,
                    param=part.get("name"),
                    code="invalid_request",
                )

    def on_part_end():
        if part.get("name") != "file":
            events.append(("field", (part.get("name"), part["value"].decode("utf-8", "replace"))))

    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    writer: FileWriter | None = None
    fields: dict[str, str] = {}
    try:
        async for chunk in request.stream():
            try:
                parser.write(chunk)
            except OpenAIError:
                raise
            except Exception as e:  # python-multipart's MultipartParseError and the like
                raise OpenAIError(
                    f"the multipart body does not parse: {e}", 400, param="file", code="invalid_request"
                ) from None
            for kind, value in events:
                if kind == "field":
                    fields[value[0]] = value[1]
                    if value[0] == "purpose":
                        _check_purpose(value[1])
                elif kind == "file":
                    if writer is not None:
                        raise OpenAIError("one file per upload", 400, param="file", code="invalid_request")
                    if "purpose" in fields:
                        _check_purpose(fields["purpose"])
                    writer = await store.open(owner, value, fields.get("purpose", "batch"))
                else:
                    await writer.write(value)
            events.clear()
        parser.finalize()
        if writer is None:
            raise OpenAIError("the form has no field 'file'", 400, param="file", code="missing_required_parameter")
        if "purpose" not in fields:
            raise OpenAIError(
                "the form has no field 'purpose'", 400, param="purpose", code="missing_required_parameter"
            )
        _check_purpose(fields["purpose"])
        writer.purpose = fields["purpose"]
        return await writer.close()
    except BaseException:
        if writer is not None:
            await writer.abort()
        raise


#: ``POST /v1/files``'s body in the OpenAPI schema (the route reads the stream itself).
UPLOAD_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


async def admit(keys, scope) -> None:
    """A Files or Batch API request against its key's rate limits (``rate_limit_rpm``: one
    request, no tokens), as a generating request is (``keys``: the gateway's
    :class:`~kvserve.deployments.limits.key_limits.KeyLimits`).

    Raises:
        OpenAIError: 429 ``rate_limit_exceeded`` with ``Retry-After``; 403 for a key that may
            send nothing.
    """
    path = scope.get("path", "")
    await keys.admit(request_policy(scope), key_name(scope), "", "batches" if "/batches" in path else "files", 0, 0, 0)


async def content_response(store: FileStore, owner: str, file_id: str):
    """``GET /v1/files/{id}/content``: the file's parts streamed as they are read (with its
    ``Content-Length``: a part gone mid-way breaks the response rather than truncating it).

    Raises:
        OpenAIError: 404 for no such file; 503 when the backend fails before the first byte.
    """
    from starlette.responses import StreamingResponse

    meta = await store._meta(owner, file_id)
    parts = store.parts(owner, file_id)
    first = await anext(parts, b"")

    async def body():
        yield first
        async for p in parts:
            yield p

    return StreamingResponse(body(), media_type="application/jsonl", headers={"content-length": str(meta["bytes"])})
