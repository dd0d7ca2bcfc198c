"""OpenAI's Files and Batch routes, same shapes, so the official `openai` SDK works unchanged.

Every route authenticates like the rest of the gateway; a key sees only its own files and batches
(another key's ids answer 404). Bodies and query parameters are parsed here, so every refusal is a 4xx
in OpenAI's error envelope naming the field (`param`) and what it takes.
"""

from __future__ import annotations

import logging
import re
import time

from fastapi import APIRouter, Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.exc import OperationalError
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse

from services.gateway.errors import APIError, bad_request

from .files import FileRecords, QuotaExceeded
from .jsonl import ENDPOINTS
from .store import new_id

log = logging.getLogger("swiftkv.batch")

PURPOSES = ("batch", "fine-tune")
LISTED_PURPOSES = (*PURPOSES, "batch_output", "fine-tune-results")  # uploads, and the files the services write
BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}
EXPIRY_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")  # OpenAI's `expires_after` as the SDK sends it
EXPIRY_SECONDS = (3600, 2_592_000)  # OpenAI's bounds: 1 hour to 30 days
UPLOAD_SLACK = 1 << 16  # multipart framing and the text fields around the file's own bytes
FIELD_BYTES = 1024  # a text field of the upload form (purpose, expires_after[...])
WRITE_BYTES = 1 << 20  # file bytes gathered before each write (one hop to the io threads)
CLOSE = {"Connection": "close"}  # a refusal before the whole body was read: the rest is never read
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # every id the services hand out; anything else names nothing


def describe(value: object) -> str:
    """What a client sent, for messages: the JSON type, or a short string."""
    if isinstance(value, str):
        return repr(value if len(value) <= 64 else value[:64] + "...")
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (dict, "an object"), (list, "an array")):
        if isinstance(value, kind):
            return name
    return "null"


def choice(value: object, name: str, allowed) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise bad_request(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {describe(value)}", param=name)
    return value


def check_metadata(metadata: object) -> dict | None:
    """OpenAI's metadata: at most 16 keys of up to 64 characters, each a string of up to 512 characters, or null."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        got = f"{len(metadata)} keys" if isinstance(metadata, dict) else describe(metadata)
        raise bad_request(f"metadata must be an object of at most 16 keys, or null; got {got}", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise bad_request(f"metadata keys are at most 64 characters; got {describe(key)}", param="metadata")
        if not isinstance(value, str) or len(value) > 512:
            raise bad_request(f"metadata values are strings of at most 512 characters; {key!r} is {describe(value)}",
                              param=f"metadata.{key}")
    return metadata


def too_large(what: str, max_bytes: int) -> APIError:
    return APIError(413, f"{what}; files are limited to {max_bytes} bytes", param="file", code="file_too_large", headers=CLOSE)


def over_quota(what: str, used: int, quota: int) -> APIError:
    return APIError(413, f"{what}; this key's files hold {used} of its {quota} bytes (batch.max_storage_bytes_per_key): delete "
                    "files or let them expire", param="file", code="storage_quota_exceeded", headers=CLOSE)


def content_length(request: Request) -> int | None:
    raw = request.headers.get("content-length", "")
    return int(raw) if raw.isascii() and raw.isdigit() else None


class UploadForm:
    """A multipart/form-data body parsed as it arrives (python-multipart, as Starlette does, without Starlette's
    spooling of the file to a temporary file first): text fields are kept, at most FIELD_BYTES each; the file part's
    bytes are handed back from each `feed`, so the caller writes them where they belong and can stop at any byte."""

    def __init__(self, content_type: str, fields: tuple[str, ...]):
        mime, options = parse_options_header(content_type)
        if mime != b"multipart/form-data" or not options.get(b"boundary"):
            raise bad_request(f"the body must be multipart/form-data (fields file and purpose); got {describe(content_type)}", param="file")
        self.allowed, self.fields, self.filename, self.ended = fields, {}, None, False
        self.data: list[bytes] = []
        self.name, self.value, self.disposition, self.header_name, self.header_value = "", bytearray(), b"", b"", b""
        self.parser = MultipartParser(options[b"boundary"], {
            "on_part_begin": self.part_begin, "on_header_field": self.header_field, "on_header_value": self.header_data,
            "on_header_end": self.header_end, "on_headers_finished": self.headers_finished, "on_part_data": self.part_data,
            "on_part_end": self.part_end, "on_end": self.end})

    def feed(self, chunk: bytes) -> list[bytes]:
        """Parse a chunk of the body; returns the file bytes in it."""
        try:
            self.parser.write(chunk)
        except FormParserError as e:
            raise bad_request(f"malformed multipart body: {e}", param="file") from None
        data, self.data = self.data, []
        return data

    def part_begin(self) -> None:
        self.name, self.value, self.disposition = "", bytearray(), b""

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def header_data(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def header_end(self) -> None:
        if self.header_name.lower() == b"content-disposition":
            self.disposition = self.header_value
        self.header_name = self.header_value = b""

    def headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name not in self.allowed:
            raise bad_request(f"unsupported form field {describe(name)}; this route takes {', '.join(self.allowed)}",
                              param=name or None)
        if name in self.fields or (name == "file" and self.filename is not None):
            raise bad_request(f"the form field {name} is given twice", param=name)
        is_file = b"filename" in options
        if name == "file" and not is_file:
            raise bad_request("file must be the file's contents: a form part with a filename", param="file")
        if name != "file" and is_file:
            raise bad_request(f"{name} must be a text field, not a file", param=name)
        if is_file:  # the name as the client had it, without path or control characters
            clean = "".join(c for c in options[b"filename"].decode("utf-8", "replace") if c.isprintable())
            self.filename = clean.replace("\\", "/").rsplit("/", 1)[-1][:512] or "upload"
        self.name = name

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.name == "file":
            self.data.append(data[start:end])
            return
        self.value += data[start:end]
        if len(self.value) > FIELD_BYTES:
            raise bad_request(f"{self.name} is longer than {FIELD_BYTES} bytes", param=self.name)

    def part_end(self) -> None:
        if self.name != "file":
            self.fields[self.name] = self.value.decode("utf-8", "replace")

    def end(self) -> None:
        self.ended = True


def expiry_seconds(fields: dict[str, str]) -> int | None:
    """OpenAI's `expires_after` (anchor `created_at`, seconds) from the form, or None when not given."""
    anchor, seconds = (fields.get(name) for name in EXPIRY_FIELDS)
    if anchor is None and seconds is None:
        return None
    low, high = EXPIRY_SECONDS
    if anchor != "created_at":
        raise bad_request(f"expires_after[anchor] must be 'created_at'; got {describe(anchor)}", param="expires_after[anchor]")
    if seconds is None or not (seconds.isascii() and seconds.isdigit() and low <= int(seconds) <= high):
        raise bad_request(f"expires_after[seconds] must be an integer from {low} (1 hour) to {high} (30 days); got {describe(seconds)}",
                          param="expires_after[seconds]")
    return int(seconds)


async def receive_upload(request: Request, who: str, purposes: tuple[str, ...], max_bytes: int, files, store, db, io,
                         records: FileRecords | None = None, quota: int | None = None) -> dict:
    """`POST /v1/files` (multipart `file` and `purpose`; with `records`, OpenAI's `expires_after` too) for the Batch
    API and the trainer. The body is parsed as it arrives and the file's bytes go straight into the file store,
    counted: past `max_bytes`, or past what is left of the key's `quota` (with `records`), the reading stops at once
    with a 413. Then the record into the store; a refused or failed upload leaves neither. The File object."""
    used = await db(records.used, who) if quota is not None else 0
    room = max_bytes if quota is None else min(max_bytes, quota - used)

    def refused(what: str) -> APIError:
        return too_large(what, max_bytes) if room == max_bytes else over_quota(what, used, quota)

    declared = content_length(request)
    if room <= 0 or (declared is not None and declared > room + UPLOAD_SLACK):
        raise refused(f"the upload is {declared} bytes" if declared is not None else "no room is left")
    form = UploadForm(request.headers.get("content-type", ""), ("file", "purpose", *(EXPIRY_FIELDS if records else ())))
    file_id = new_id("file-")
    part = await io(files.receive, file_id)
    try:
        pending: list[bytes] = []
        received = 0
        try:
            async for chunk in request.stream():
                data = form.feed(chunk)
                received += sum(map(len, data))
                if received > room:  # stop reading here: the rest of the body never arrives
                    raise refused(f"the file passed {room} bytes")
                pending += data
                if received - part.size >= WRITE_BYTES:
                    await io(part.write, b"".join(pending))
                    pending = []
        except ClientDisconnect:
            raise bad_request("the upload ended before the whole body arrived", param="file") from None
        await io(part.write, b"".join(pending))
        if not form.ended:
            raise bad_request("the multipart body ended before its closing boundary", param="file")
        if form.filename is None:
            raise bad_request("a multipart field 'file' with the file's contents is required", param="file")
        purpose = choice(form.fields.get("purpose"), "purpose", purposes)
        seconds = expiry_seconds(form.fields)
        size = await io(part.commit)
    finally:
        await io(part.discard)
    now = int(time.time())
    record = {"id": file_id, "owner": who, "purpose": purpose, "filename": form.filename, "bytes": size, "created_at": now}
    chosen = now + seconds if seconds else None
    try:
        if records is None:
            await db(store.add_file, record)
        else:
            await db(records.add, record, chosen, quota)
    except QuotaExceeded as e:  # uploads of the key that ran meanwhile took the room
        await io(files.delete, file_id)
        raise over_quota(f"the file is {size} bytes", e.used, e.quota)
    except BaseException:
        await io(files.delete, file_id)  # no record, no contents
        raise
    return file_object(record | {"expires_at": chosen or (records.default_expiry(purpose, now) if records else None)})


def openapi_operations(windows: list[str]) -> dict:
    """What the routes below accept, for the gateway's /openapi.json (they parse their own requests)."""
    from services.gateway.openapi import json_body, page_params, query, upload_body

    upload = upload_body(list(PURPOSES))
    form = upload["content"]["multipart/form-data"]["schema"]
    form["additionalProperties"] = False
    form["properties"] |= {"expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                           "expires_after[seconds]": {"type": "integer", "minimum": EXPIRY_SECONDS[0], "maximum": EXPIRY_SECONDS[1]}}
    form["dependentRequired"] = {EXPIRY_FIELDS[0]: [EXPIRY_FIELDS[1]], EXPIRY_FIELDS[1]: [EXPIRY_FIELDS[0]]}

    def pages(high: int) -> list[dict]:
        params = page_params(high)
        params[0]["schema"]["pattern"] = f"^{ID.pattern}$"  # `after`
        return params
    return {
        ("post", "/v1/files"): {"summary": "Upload a file", "requestBody": upload},
        ("get", "/v1/files"): {"summary": "List files", "parameters": [
            query("purpose", {"type": "string", "enum": list(LISTED_PURPOSES)}), query("order", {"type": "string", "enum": ["asc", "desc"]}),
            *pages(10000)]},
        ("post", "/v1/batches"): {"summary": "Create a batch", "requestBody": json_body({
            "type": "object", "additionalProperties": False, "required": ["input_file_id", "endpoint", "completion_window"],
            "properties": {"input_file_id": {"type": "string", "minLength": 1}, "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
                           "completion_window": {"type": "string", "enum": windows},
                           "metadata": {"type": ["object", "null"], "maxProperties": 16, "propertyNames": {"maxLength": 64},
                                        "additionalProperties": {"type": "string", "maxLength": 512}}}})},
        ("get", "/v1/batches"): {"summary": "List batches", "parameters": pages(100)},
    }


def file_object(f: dict) -> dict:
    return {"id": f["id"], "object": "file", "bytes": f["bytes"], "created_at": f["created_at"], "filename": f["filename"],
            "purpose": f["purpose"], "status": "processed", "expires_at": f.get("expires_at"), "status_details": None}


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
    # ASCII digits only: str.isdigit() also holds for '²', which int() refuses, and 5,000 digits are too many for int()
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9 and low <= int(raw) <= high):
        raise bad_request(f"{name} must be an integer from {low} to {high}; got {describe(raw)}", param=name)
    return int(raw)


def cursor(request: Request) -> str | None:
    """`after`: the last id of the previous page."""
    after = request.query_params.get("after")
    if after is not None and not ID.fullmatch(after):
        raise bad_request(f"after must be an id from the previous page (letters, digits, '-' and '_'); got {describe(after)}",
                          param="after")
    return after


def not_found(kind: str, id_: str, param: str | None = None) -> APIError:
    return APIError(404, f"no such {kind}: {id_[:64]}", param=param, code=f"{kind}_not_found")


def build_router(service) -> APIRouter:
    store, files, cfg, gateway = service.store, service.files, service.cfg, service.gateway
    records = service.records
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
        return await receive_upload(request, owner(request), PURPOSES, cfg.max_file_bytes, files, store, db, service.io,
                                    records, cfg.max_storage_bytes_per_key)

    @router.get("/v1/files")
    async def list_files(request: Request):
        who = owner(request)
        only_query(request, "purpose", "order", "after", "limit")
        purpose = request.query_params.get("purpose")
        if purpose is not None:
            choice(purpose, "purpose", LISTED_PURPOSES)
        order = choice(request.query_params.get("order", "desc"), "order", ("asc", "desc"))
        limit = int_param(request, "limit", 10000, 1, 10000)
        rows, more = await db(store.list_files, who, purpose, cursor(request), limit, order == "desc")
        return page([file_object(f) for f in await db(records.with_expiry, rows)], more)

    async def own_file(request: Request, file_id: str, param: str | None = None) -> dict:
        """The key's file, unless it has expired (the sweep may not have deleted it yet)."""
        who = owner(request)
        f = await db(records.get, who, file_id) if ID.fullmatch(file_id) else None
        if f is None:
            raise not_found("file", file_id, param)
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
        await db(records.remove, f["owner"], f["id"])
        return {"id": f["id"], "object": "file", "deleted": True}

    # ---- batches ---------------------------------------------------------------------------------
    @router.post("/v1/batches")
    async def create_batch(request: Request):
        who = owner(request)
        body = await gateway.read_json(request)
        if not isinstance(body, dict):
            raise bad_request(f"the body must be a JSON object; got {describe(body)}")
        for name in body:
            if name not in BATCH_FIELDS:
                raise bad_request(f"unsupported field '{name}'", param=name)
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise bad_request(f"input_file_id must be the id of a file uploaded with purpose 'batch'; got {describe(input_file_id)}",
                              param="input_file_id")
        endpoint = choice(body.get("endpoint"), "endpoint", ENDPOINTS)
        window = choice(body.get("completion_window"), "completion_window", cfg.completion_windows)
        metadata = check_metadata(body.get("metadata"))
        f = await own_file(request, input_file_id, "input_file_id")
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
        rows, more = await db(store.list_batches, who, cursor(request), int_param(request, "limit", 20, 1, 100))
        return page([batch_object(b) for b in rows], more)

    async def own_batch(request: Request, batch_id: str, fn, *args) -> dict:
        who = owner(request)
        b = await db(fn, who, batch_id, *args) if ID.fullmatch(batch_id) else None
        if b is None:
            raise not_found("batch", batch_id)
        return b

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str):
        return batch_object(await own_batch(request, batch_id, store.get_batch))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        b = await own_batch(request, batch_id, store.request_cancel, int(time.time()))
        if b["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"a batch that is {b['status']} cannot be cancelled", code="batch_not_cancellable")
        service.runner.cancel_requested(batch_id)
        service.runner.wake.set()  # a batch nobody holds is finished as cancelled by the next claim
        return batch_object(b)

    return router
