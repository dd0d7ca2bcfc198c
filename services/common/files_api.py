"""OpenAI's Files API, one for the platform: the gateway (beside its Batch API) and the trainer mount the same routes
over the same file table (one database) and the same store of bytes (one directory: in a cluster, the gateway's files
volume, which the trainer's pod mounts too). A file uploaded to either service, or written by either (batch output,
a fine-tuning job's results), is listed, retrieved, downloaded and deleted through either, counts against its key's one
storage quota, and expires and is swept, its row and its bytes together, by whichever service's sweep finds it first.

Every route authenticates as the service does (`identify`); a key sees only its own files (another key's ids answer
404). Bodies and query parameters are parsed here, so every refusal is a 4xx in OpenAI's error envelope naming the field
(`param`) and what it takes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from sqlalchemy.exc import OperationalError
from starlette.responses import FileResponse

from .errors import APIError, not_found
from .files import FileHolder, FileRecords, FileStore, file_object
from .ids import ID
from .pagination import cursor, int_param, only_query, page
from .uploads import BODY_TIMEOUT, EXPIRY_FIELDS, EXPIRY_SECONDS, QUOTA_SETTING, receive_upload
from .validation import choice

log = logging.getLogger("swiftkv.files")

PURPOSES = ("batch", "fine-tune")  # what a client uploads
LISTED_PURPOSES = (*PURPOSES, "batch_output", "fine-tune-results")  # uploads, and the files the services write
EXPIRING = ("batch", "batch_output")  # purposes that expire after `expiry_seconds` when uploaded without expires_after


class FilesService:
    """One service's mount of the Files API: the file rows of its store (`holder`, on the shared database), the bytes
    in `root` (the shared directory), the key's quota and the default expiry. `io` runs a blocking call (the
    service's store threads). Every service on one database must be given the same `quota` and `expiry_seconds`:
    both are read at each use, not stored with the files."""

    def __init__(self, holder: FileHolder, root: str | Path, io: Callable[..., Awaitable], *, max_file_bytes: int,
                 quota: int | None, expiry_seconds: int | None, quota_setting: str = QUOTA_SETTING,
                 body_timeout: float = BODY_TIMEOUT, what: str = "the file store"):
        self.holder, self.rows, self.io = holder, holder.files, io
        self.contents = FileStore(root)
        self.records = FileRecords(holder, self.contents, {p: expiry_seconds for p in EXPIRING} if expiry_seconds else {})
        self.max_file_bytes, self.quota, self.quota_setting = max_file_bytes, quota, quota_setting
        self.body_timeout, self.what = body_timeout, what

    async def db(self, fn, *args):
        """A blocking call of the store, on `io`; the database down or unreachable is a 503 the client may retry (the
        details, host and SQL, for the operator's log only)."""
        try:
            return await self.io(fn, *args)
        except OperationalError:
            log.warning("%s is unavailable", self.what, exc_info=True)
            raise APIError(503, f"{self.what} is unavailable; try again shortly", "server_error", code="unavailable") from None

    async def own(self, who: str, file_id: str, param: str | None = None) -> dict:
        """The key's file, unless it has expired (the sweep may not have removed it yet); else a 404 as if it did not
        exist, naming `param` when the id came in a body field."""
        f = await self.db(self.records.get, who, file_id) if ID.fullmatch(file_id) else None  # an id no service hands out names nothing
        if f is None:
            raise not_found("file", file_id, param)
        return f

    def path(self, file_id: str) -> Path:
        return self.contents.path(file_id)

    async def sweep(self) -> int:
        """Expired files (rows and bytes), abandoned part files and holds: how many files went."""
        return await self.db(self.records.sweep)

    async def sweep_forever(self, seconds: float) -> None:
        while True:
            try:
                if removed := await self.sweep():
                    log.info("deleted %d expired files", removed)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the database is away: try again next time
                log.warning("deleting expired files: %s", e)
            await asyncio.sleep(seconds)

    def router(self, identify: Callable[[Request], str]) -> APIRouter:
        """POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content; `identify` is the caller's key
        digest, or a 401."""
        router = APIRouter()

        @router.post("/v1/files")
        async def upload(request: Request):
            return await receive_upload(request, identify(request), PURPOSES, self.max_file_bytes, self.contents, self.rows,
                                        self.db, self.io, self.records, self.quota, self.body_timeout, self.quota_setting)

        @router.get("/v1/files")
        async def list_files(request: Request):
            who = identify(request)
            only_query(request, "purpose", "order", "after", "limit")
            purpose = request.query_params.get("purpose")
            if purpose is not None:
                choice(purpose, "purpose", LISTED_PURPOSES)
            order = choice(request.query_params.get("order", "desc"), "order", ("asc", "desc"))
            limit = int_param(request, "limit", 10000, 1, 10000)
            rows, more = await self.db(self.records.list_page, who, purpose, cursor(request), limit, order == "desc")
            return page([file_object(f) for f in rows], more)  # an expired file is listed no more, swept or not

        @router.get("/v1/files/{file_id}")
        async def get_file(request: Request, file_id: str):
            return file_object(await self.own(identify(request), file_id))

        @router.get("/v1/files/{file_id}/content")
        async def file_content(request: Request, file_id: str):
            f = await self.own(identify(request), file_id)
            path = self.path(f["id"])
            if not await self.io(path.is_file):
                raise APIError(404, f"the contents of {file_id} are missing from the file store", code="file_not_found")
            return FileResponse(path, media_type="application/octet-stream", filename=f["filename"])

        @router.delete("/v1/files/{file_id}")
        async def delete_file(request: Request, file_id: str):
            f = await self.own(identify(request), file_id)
            if await self.db(self.records.in_use, f["id"]):
                raise APIError(409, f"{file_id} is the input of a batch that is still running; cancel the batch first",
                               param="file_id", code="file_in_use")
            await self.db(self.records.remove, f["owner"], f["id"])
            return {"id": f["id"], "object": "file", "deleted": True}

        return router


def openapi_operations() -> dict:
    """What the routes accept, for a service's /openapi.json (they parse their own requests)."""
    from .openapi import page_params, query, upload_body

    upload = upload_body(list(PURPOSES))
    form = upload["content"]["multipart/form-data"]["schema"]
    form["additionalProperties"] = False
    form["properties"] |= {"expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                           "expires_after[seconds]": {"type": "integer", "minimum": EXPIRY_SECONDS[0], "maximum": EXPIRY_SECONDS[1]}}
    form["dependentRequired"] = {EXPIRY_FIELDS[0]: [EXPIRY_FIELDS[1]], EXPIRY_FIELDS[1]: [EXPIRY_FIELDS[0]]}
    params = page_params(10000)
    params[0]["schema"]["pattern"] = f"^{ID.pattern}$"  # `after`
    return {
        ("post", "/v1/files"): {"summary": "Upload a file", "requestBody": upload},
        ("get", "/v1/files"): {"summary": "List files", "parameters": [
            query("purpose", {"type": "string", "enum": list(LISTED_PURPOSES)}), query("order", {"type": "string", "enum": ["asc", "desc"]}),
            *params]},
    }
