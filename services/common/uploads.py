"""`POST /v1/files` for every service that takes uploads: OpenAI's multipart form (`file`, `purpose`, and
`expires_after` where files expire), parsed as it arrives so the file's bytes go straight into the file store,
counted, and an upload past its bound stops at that byte with a 413; a body slower than its deadline is a 408."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from services.config import LimitsConfig

from .errors import APIError, bad_request
from .files import RESERVATION_SECONDS, FileRecords, FileRows, FileStore, QuotaExceeded, file_object
from .ids import new_id
from .validation import choice, describe

EXPIRY_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")  # OpenAI's `expires_after` as the SDK sends it
EXPIRY_SECONDS = (3600, 2_592_000)  # OpenAI's bounds: 1 hour to 30 days
UPLOAD_SLACK = 1 << 16  # multipart framing and the text fields around the file's own bytes
FIELD_BYTES = 1024  # a text field of the upload form (purpose, expires_after[...])
WRITE_BYTES = 1 << 20  # file bytes gathered before each write (one hop to the io threads)
EPILOGUE_BYTES = 1024  # read after the closing boundary (a client's trailing CRLF); more is a 400 that closes the connection
MIN_UPLOAD_RATE = 64 << 10  # bytes a second an upload must keep up, after its first body_timeout seconds (`arriving`)
BODY_TIMEOUT = LimitsConfig.model_fields["body_timeout_seconds"].default  # the gateway's limits.body_timeout_seconds
CLOSE = {"Connection": "close"}  # a refusal before the whole body was read: the rest is never read


def too_large(what: str, max_bytes: int) -> APIError:
    return APIError(413, f"{what}; files are limited to {max_bytes} bytes", param="file", code="file_too_large", headers=CLOSE)


QUOTA_SETTING = "batch.max_storage_bytes_per_key"  # the gateway's name of the quota; the trainer's is its own


def over_quota(what: str, used: int, quota: int, setting: str = QUOTA_SETTING) -> APIError:
    return APIError(413, f"{what}; this key's files and uploads in progress hold {used} of its {quota} bytes ({setting}): delete "
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


async def arriving(stream: AsyncIterator[bytes], seconds: float) -> AsyncIterator[bytes]:
    """The body's chunks while they keep up: the whole body within `seconds` plus one second per MIN_UPLOAD_RATE
    bytes received (Apache mod_reqtimeout's MinRate: a large file may take long, a client dribbling bytes may not).
    Later is a 408 that closes the connection."""
    loop = asyncio.get_running_loop()
    deadline, chunks = loop.time() + seconds, aiter(stream)
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise APIError(408, f"the upload arrived too slowly: the whole body is due within {seconds:g} s plus one second per "
                                f"{MIN_UPLOAD_RATE} bytes", code="request_timeout", headers=CLOSE) from None
        deadline += len(chunk) / MIN_UPLOAD_RATE
        yield chunk


async def receive_upload(request: Request, who: str, purposes: tuple[str, ...], max_bytes: int, files: FileStore, rows: FileRows,
                         db, io, records: FileRecords | None = None, quota: int | None = None,
                         body_timeout: float = BODY_TIMEOUT, quota_setting: str = QUOTA_SETTING) -> dict:
    """`POST /v1/files` (multipart `file` and `purpose`; with `records`, OpenAI's `expires_after` too), as the Files API
    (services.common.files_api) of the gateway and the trainer takes it. The body is parsed as it arrives (`arriving`: within `body_timeout`) and the file's bytes go
    straight into the file store, counted: past `max_bytes`, or past what is left of the key's `quota` (with
    `records`), the reading stops with a 413. While it streams, the upload holds the bytes it declared, or has
    written, against the quota (`FileRecords.reserve`), so uploads of a key running at once never hold more than the
    quota (named `quota_setting` in the 413) between them. Then the record into the file rows (`records` when given); a
    refused or failed upload leaves neither.
    `db` and `io` run a blocking call of the rows and of the file store. The File object."""
    file_id = new_id("file-")
    held = 0  # bytes of the key's files and its other uploads, as of the upload's last hold

    def room() -> int:
        return max_bytes if quota is None else min(max_bytes, quota - held)

    def refused(what: str) -> APIError:
        return too_large(what, max_bytes) if room() == max_bytes else over_quota(what, held, quota, quota_setting)

    async def hold(size: int) -> None:
        nonlocal held
        if quota is not None:
            try:
                held = await db(records.reserve, file_id, who, size, quota)
            except QuotaExceeded as e:  # uploads of the key running meanwhile took the room
                held = e.used
                raise refused(f"the file passed {room()} bytes" if size else "no room is left") from None

    declared = content_length(request)
    form = UploadForm(request.headers.get("content-type", ""), ("file", "purpose", *(EXPIRY_FIELDS if records else ())))
    part = None
    try:
        await hold(0)
        if room() <= 0 or (declared is not None and declared > room() + UPLOAD_SLACK):
            raise refused(f"the upload is {declared} bytes" if declared is not None else "no room is left")
        floor = min(declared or 0, room())  # held at once: of uploads racing for the room, the first gets it all
        if floor:
            await hold(floor)
        part = await io(files.receive, file_id)
        pending: list[bytes] = []
        received = epilogue = 0
        held_at = time.monotonic()
        try:
            async for chunk in arriving(request.stream(), body_timeout):
                if form.ended:  # after the closing boundary: ignored, as RFC 2046 has it, but only a little is read
                    epilogue += len(chunk)
                    if epilogue > EPILOGUE_BYTES:
                        raise APIError(400, f"more than {EPILOGUE_BYTES} bytes follow the multipart body's closing boundary",
                                       param="file", headers=CLOSE)
                    continue
                data = form.feed(chunk)
                received += sum(map(len, data))
                if received > room():  # stop reading here: the rest of the body never arrives
                    raise refused(f"the file passed {room()} bytes")
                pending += data
                if received - part.size >= WRITE_BYTES or time.monotonic() - held_at > RESERVATION_SECONDS / 4:
                    await hold(max(received, floor))  # before the bytes reach the volume
                    held_at = time.monotonic()
                    await io(part.write, b"".join(pending))
                    pending = []
        except ClientDisconnect:
            raise bad_request("the upload ended before the whole body arrived", param="file") from None
        if not form.ended:
            raise bad_request("the multipart body ended before its closing boundary", param="file")
        if form.filename is None:
            raise bad_request("a multipart field 'file' with the file's contents is required", param="file")
        purpose = choice(form.fields.get("purpose"), "purpose", purposes)
        seconds = expiry_seconds(form.fields)
        await hold(max(received, floor))
        await io(part.write, b"".join(pending))
        size = await io(part.commit)
        now = int(time.time())
        record = {"id": file_id, "owner": who, "purpose": purpose, "filename": form.filename, "bytes": size, "created_at": now}
        chosen = now + seconds if seconds else None
        try:
            if records is None:
                await db(rows.add, record)
            else:
                await db(records.add, record, chosen, quota)  # ends the hold
        except QuotaExceeded as e:  # batch output (never refused) took the room meanwhile
            raise over_quota(f"the file is {size} bytes", e.used, e.quota, quota_setting) from None
    except BaseException:  # no record, no contents, no hold
        if part is not None:
            await io(part.discard)
            await io(files.delete, file_id)
        if quota is not None:
            await db(records.release, file_id)
        raise
    return file_object(record | {"expires_at": chosen or (records.default_expiry(purpose, now) if records else None)})


def jsonl_lines(f, cap: int):
    """The lines of an uploaded JSONL file opened in binary (Batch input, training data): (number, offset, bytes) per
    line; bytes None for a line longer than `cap`, whose rest is skipped unread into memory (a 200 MB file may be
    one line)."""
    number = offset = 0
    while raw := f.readline(cap + 1):
        number += 1
        size = len(raw)
        if size > cap and not raw.endswith(b"\n"):
            while rest := f.readline(1 << 20):
                size += len(rest)
                if rest.endswith(b"\n"):
                    break
            raw = None
        yield number, offset, raw
        offset += size
