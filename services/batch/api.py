"""OpenAI's Files and Batch routes, same shapes, so the official `openai` SDK works unchanged.

Every route authenticates like the rest of the gateway; a key sees only its own files and batches
(another key's ids answer 404). Bodies and query parameters are parsed here, so every refusal is a 4xx
in OpenAI's error envelope.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from sqlalchemy.exc import OperationalError
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse

from services.gateway.errors import APIError, bad_request

from .files import FileTooLarge
from .jsonl import ENDPOINTS
from .store import new_id

PURPOSES = ("batch", "fine-tune")
BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}



async def receive_upload(request: Request, who: str, purposes: tuple[str, ...], max_bytes: int, files, store, db, io) -> dict:
    """`POST /v1/files` (multipart `file` and `purpose`) for the Batch API and the trainer: the contents into the
    file store, then the record into the store; a refused or failed upload leaves neither. The File object."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes + (1 << 16):
        raise APIError(400, f"the upload is {declared} bytes; files are limited to {max_bytes} bytes",
                       param="file", code="file_too_large")
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose not in purposes:
            raise bad_request(f"purpose must be one of {', '.join(purposes)}", param="purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("a multipart field 'file' with the file's contents is required", param="file")
        file_id = new_id("file-")
        try:
            size = await db(files.save, file_id, upload.file, max_bytes)
        except FileTooLarge as e:
            raise APIError(400, f"{e}", param="file", code="file_too_large")
        record = {"id": file_id, "owner": who, "purpose": purpose, "filename": (upload.filename or "upload")[:512],
                  "bytes": size, "created_at": int(time.time())}
        try:
            await db(store.add_file, record)
        except BaseException:
            await io(files.delete, file_id)  # no record, no contents
            raise
    finally:
        await form.close()
    return file_object(record)

def openapi_operations(windows: list[str]) -> dict:
    """What the routes below accept, for the gateway's /openapi.json (they parse their own requests)."""
    from services.gateway.openapi import json_body, page_params, query, upload_body

    return {
        ("post", "/v1/files"): {"summary": "Upload a file", "requestBody": upload_body(list(PURPOSES))},
        ("get", "/v1/files"): {"summary": "List files", "parameters": [
            query("purpose", {"type": "string"}), query("order", {"type": "string", "enum": ["asc", "desc"]}), *page_params(10000)]},
        ("post", "/v1/batches"): {"summary": "Create a batch", "requestBody": json_body({
            "type": "object", "additionalProperties": False, "required": ["input_file_id", "endpoint", "completion_window"],
            "properties": {"input_file_id": {"type": "string", "minLength": 1}, "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
                           "completion_window": {"type": "string", "enum": windows},
                           "metadata": {"type": ["object", "null"], "maxProperties": 16, "propertyNames": {"maxLength": 64},
                                        "additionalProperties": {"type": "string", "maxLength": 512}}}})},
        ("get", "/v1/batches"): {"summary": "List batches", "parameters": page_params(100)},
    }


def file_object(f: dict) -> dict:
    return {"id": f["id"], "object": "file", "bytes": f["bytes"], "created_at": f["created_at"], "filename": f["filename"],
            "purpose": f["purpose"], "status": "processed", "expires_at": None, "status_details": None}


def batch_object(b: dict) -> dict:
    times = {f"{t}_at": b[f"{t}_at"] for t in ("created", "in_progress", "expires", "finalizing", "completed", "failed",
                                               "expired", "cancelling", "cancelled")}
    return {
        "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "errors": b["errors"], "input_file_id": b["input_file_id"],
        "completion_window": b["completion_window"], "status": b["status"], "output_file_id": b["output_file_id"],
        "error_file_id": b["error_file_id"], **times,
        "request_counts": {"total": b["total"], "completed": b["completed"], "failed": b["failed"]},
        "metadata": b["metadata"],
        "usage": {"input_tokens": b["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": b["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": b["prompt_tokens"] + b["completion_tokens"]},
    }


def page(objects: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": objects, "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None, "has_more": has_more}


def only_query(request: Request, *names: str) -> None:
    """Unknown query parameters are refused, like unknown body fields (a misspelt `limit` is not silently ignored)."""
    for name in request.query_params:
        if name not in names:
            raise bad_request(f"unsupported query parameter '{name}'; this route takes {', '.join(names)}", param=name)


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise bad_request(f"{name} must be an integer from {low} to {high}", param=name)
    return int(raw)


def not_found(kind: str, id_: str, param: str | None = None) -> APIError:
    return APIError(404, f"no such {kind}: {id_}", param=param, code=f"{kind}_not_found")


def build_router(service) -> APIRouter:
    store, files, cfg, gateway = service.store, service.files, service.cfg, service.gateway
    router = APIRouter()

    def owner(request: Request) -> str:
        return gateway.keys.identify(request.headers.get("authorization"))

    async def db(fn, *args):
        try:
            return await service.io(fn, *args)
        except OperationalError as e:  # the database is down or unreachable: the client may retry
            raise APIError(503, f"the batch store is unavailable: {type(e.orig).__name__ if e.orig else e}; try again shortly",
                           "server_error", code="unavailable")

    # ---- files -----------------------------------------------------------------------------------
    @router.post("/v1/files")
    async def upload(request: Request):
        return await receive_upload(request, owner(request), PURPOSES, cfg.max_file_bytes, files, store, db, service.io)

    @router.get("/v1/files")
    async def list_files(request: Request):
        who = owner(request)
        only_query(request, "purpose", "order", "after", "limit")
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", param="order")
        limit = int_param(request, "limit", 10000, 1, 10000)
        rows, more = await db(store.list_files, who, request.query_params.get("purpose"), request.query_params.get("after"),
                              limit, order == "desc")
        return page([file_object(f) for f in rows], more)

    async def own_file(request: Request, file_id: str) -> dict:
        f = await db(store.get_file, owner(request), file_id)
        if f is None:
            raise not_found("file", file_id)
        return f

    @router.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str):
        return file_object(await own_file(request, file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        f = await own_file(request, file_id)
        path = files.path(f["id"])
        if not path.exists():
            raise APIError(404, f"the contents of {file_id} are missing from the file store", code="file_not_found")
        return FileResponse(path, media_type="application/octet-stream", filename=f["filename"])

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        f = await own_file(request, file_id)
        if await db(store.file_in_use, f["id"]):
            raise APIError(409, f"{file_id} is the input of a batch that is still running; cancel the batch first",
                           param="file_id", code="file_in_use")
        if await db(store.delete_file, f["owner"], f["id"]):
            await db(files.delete, f["id"])
        return {"id": f["id"], "object": "file", "deleted": True}

    # ---- batches ---------------------------------------------------------------------------------
    @router.post("/v1/batches")
    async def create_batch(request: Request):
        who = owner(request)
        body = await gateway.read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        for name in body:
            if name not in BATCH_FIELDS:
                raise bad_request(f"unsupported field '{name}'", param=name)
        input_file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise bad_request("input_file_id is required", param="input_file_id")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if window not in cfg.completion_windows:
            raise bad_request(f"completion_window must be one of {', '.join(cfg.completion_windows)}", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
            raise bad_request("metadata must map at most 16 keys (up to 64 characters) to strings (up to 512)", param="metadata")
        f = await db(store.get_file, who, input_file_id)
        if f is None:
            raise not_found("file", input_file_id, "input_file_id")
        if f["purpose"] != "batch":
            raise bad_request(f"{input_file_id} was uploaded with purpose '{f['purpose']}'; a batch needs purpose 'batch'",
                              param="input_file_id")
        if f["bytes"] > cfg.max_file_bytes:
            raise bad_request(f"{input_file_id} has {f['bytes']} bytes; batch input files are limited to {cfg.max_file_bytes}",
                              param="input_file_id")
        now = time.time()
        record = {"id": new_id("batch_"), "owner": who, "endpoint": endpoint, "input_file_id": input_file_id,
                  "completion_window": window, "metadata": metadata, "status": "validating", "created_at": int(now),
                  "expires_at": int(now + cfg.completion_windows[window]), "total": 0, "completed": 0, "failed": 0,
                  "prompt_tokens": 0, "completion_tokens": 0}
        await db(store.add_batch, record)
        service.runner.wake.set()  # the line checks and the work happen in the runner, under the batch's lease
        return batch_object(await db(store.get_batch, who, record["id"]))

    @router.get("/v1/batches")
    async def list_batches(request: Request):
        who = owner(request)
        only_query(request, "after", "limit")
        rows, more = await db(store.list_batches, who, request.query_params.get("after"), int_param(request, "limit", 20, 1, 100))
        return page([batch_object(b) for b in rows], more)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str):
        b = await db(store.get_batch, owner(request), batch_id)
        if b is None:
            raise not_found("batch", batch_id)
        return batch_object(b)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        b = await db(store.request_cancel, owner(request), batch_id, int(time.time()))
        if b is None:
            raise not_found("batch", batch_id)
        if b["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"a batch that is {b['status']} cannot be cancelled", code="batch_not_cancellable")
        service.runner.cancel_requested(batch_id)
        service.runner.wake.set()  # a batch nobody holds is finished as cancelled by the next claim
        return batch_object(b)

    return router
