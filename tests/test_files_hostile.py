"""Hostile input to the Files and Batch routes, in process (the gateway app over the fake backend, the store on the
real PostgreSQL): every wrongly typed field is a 400 naming it, an upload is capped while it streams, files expire
and are deleted, and each key's files have a storage quota that batch output counts against."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

import httpx
import openai
import pytest
from harness import FakeBackend
from harness.batch import PROMPT_HEAVY, until
from harness.gateway import InProcessGateway, platform_config
from sqlalchemy import select, text, update

from services.common.files import expiry

KEY_A, KEY_B = "sk-files-a", "sk-files-b"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
CAP = 100_000  # batch.max_file_bytes in these tests


def build(tiny_base, data_dir, database_url: str, **batch) -> InProcessGateway:
    """The gateway app with the Batch API over one pool whose fake engine answers at once; keys A and B."""
    cfg = platform_config(tiny_base, pools=("swiftkv",), max_model_len=64, data_dir=str(data_dir), database_url=database_url,
                          batch={"poll_seconds": 0.05, "max_file_bytes": CAP, **batch})
    return InProcessGateway(cfg, {"swiftkv": FakeBackend("swiftkv")}, keys=(KEY_A, KEY_B))


@pytest.fixture(scope="module")
def app(tiny_base, tmp_path_factory, pg_url):
    gw = build(tiny_base, tmp_path_factory.mktemp("files"), pg_url)
    service, app = gw.service, gw.app
    yield app
    service.io.close()
    service.store.close()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=A)


LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": PROMPT_HEAVY}).encode() + b"\n"


async def upload(c: httpx.AsyncClient, content: bytes = LINE, purpose: str = "batch", **fields) -> httpx.Response:
    return await c.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": purpose, **fields})


# ---- 1. every wrongly typed field of every route is a 400 naming it ------------------------------------------
BATCH = {"endpoint": "/v1/completions", "completion_window": "24h"}
WRONG = [{}, [], 1, 1.5, True, None, "nope"]
BODY_CASES = (
    [(field, {**BATCH, "input_file_id": "file-x", field: v}) for field in ("endpoint", "completion_window") for v in WRONG]
    + [("input_file_id", {**BATCH, "input_file_id": v}) for v in ({}, [], 1, True, None, "")]
    + [("metadata", {**BATCH, "input_file_id": "file-x", "metadata": v})
       for v in ([], "x", 1, True, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"})]
    + [("metadata.k", {**BATCH, "input_file_id": "file-x", "metadata": {"k": v}}) for v in (1, None, {}, [], True, "v" * 513)]
    + [("priority", {**BATCH, "input_file_id": "file-x", "priority": 1})]
)


@pytest.mark.parametrize("param,body", BODY_CASES, ids=[f"{p}={json.dumps(b.get(p))[:20]}" for p, b in BODY_CASES])
async def test_create_batch_refuses_each_wrongly_typed_field(app, param, body):
    async with client(app) as c:
        r = await c.post("/v1/batches", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if param in ("endpoint", "completion_window"):
        assert ("'24h'" if param == "completion_window" else "'/v1/completions'") in error["message"]  # what would be right


QUERY_CASES = [
    *[("/v1/files", "limit", v) for v in ("abc", "0", "10001", "-1", "1.5", "", "²", "9" * 5000)],
    *[("/v1/batches", "limit", v) for v in ("abc", "0", "101", "²", "9" * 5000)],
    *[(path, "after", v) for path in ("/v1/files", "/v1/batches") for v in ("\x00", "x" * 65, "a b", "")],
    *[("/v1/files", "purpose", v) for v in ("nope", "", "\x00")],
    ("/v1/files", "order", "up"), ("/v1/files", "limt", "5"), ("/v1/batches", "purpose", "batch"),
]


@pytest.mark.parametrize("path,param,value", QUERY_CASES, ids=[f"{p}?{n}={v[:8]!r}" for p, n, v in QUERY_CASES])
async def test_list_routes_refuse_each_wrong_query_parameter(app, path, param, value):
    async with client(app) as c:
        r = await c.get(path, params={param: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


FORM_CASES = [
    ("purpose", {"purpose": "assistants"}, None), ("purpose", {}, None),
    ("expires_after[anchor]", {"purpose": "batch", "expires_after[anchor]": "updated_at", "expires_after[seconds]": "3600"}, None),
    ("expires_after[anchor]", {"purpose": "batch", "expires_after[seconds]": "3600"}, None),
    *[("expires_after[seconds]", {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": v}, None)
      for v in ("abc", "3599", "2592001", "1e4", "", "²", "9" * 5000)],
    ("expires_after[seconds]", {"purpose": "batch", "expires_after[anchor]": "created_at"}, None),
    ("expires_after", {"purpose": "batch", "expires_after": "3600"}, None),
    ("file", {"purpose": "batch"}, {"file": (None, b"text, not a file")}), ("file", {"purpose": "batch"}, "no file"),
    ("purpose", {}, {"purpose": ("p.txt", b"batch")}),
    ("file", {"purpose": "batch"}, [("file", ("a.jsonl", LINE)), ("file", ("b.jsonl", LINE))]),
]


@pytest.mark.parametrize("param,data,files", FORM_CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(FORM_CASES)])
async def test_upload_refuses_each_wrong_form_field(app, param, data, files):
    files = {} if files == "no file" else files or {"file": ("in.jsonl", LINE)}
    async with client(app) as c:
        r = await c.post("/v1/files", data=data, files=files or None)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error


async def test_malformed_uploads_and_odd_ids_are_4xx(app):
    boundary = "b0undary"
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n' \
           f'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'.encode()
    multipart = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    async with client(app) as c:
        for body, headers in [(head + LINE, multipart),  # no closing boundary
                              (b"garbage", multipart), (b'{"purpose": "batch"}', {"Content-Type": "application/json"}),
                              (b"", {"Content-Type": "multipart/form-data"})]:
            r = await c.post("/v1/files", content=body, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["message"], r.text
        # a hostile filename is kept printable (NUL is refused by PostgreSQL text), without its path
        r = await c.post("/v1/files", content=head.replace(b"a.jsonl", b"../x\x00\x01.jsonl") + LINE + f"\r\n--{boundary}--\r\n".encode(),
                         headers=multipart)
        assert r.status_code == 200 and r.json()["filename"] == "x.jsonl", r.text
        for method, path in [("GET", "/v1/files/%00"), ("GET", "/v1/files/%00/content"), ("DELETE", "/v1/files/%00"),
                             ("GET", "/v1/files/" + "x" * 300), ("GET", "/v1/batches/%00"), ("POST", "/v1/batches/%00/cancel"),
                             ("GET", "/v1/batches/a%20b")]:
            r = await c.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["code"] in ("file_not_found", "batch_not_found"), (path, r.text)
        r = await c.post("/v1/batches", json={**BATCH, "input_file_id": "file-\x00"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id", r.text
        r = await c.get("/v1/files/%00", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401  # the key is checked before anything else


# ---- 2. an upload is capped while it streams -----------------------------------------------------------------
class Body:
    """A multipart body sent chunked (no Content-Length): the form's head, then 64 KiB chunks of file bytes up to
    `total`, then `epilogue` bytes after the closing boundary, counting what the server pulled; `each` runs before
    every chunk."""

    def __init__(self, total: int, epilogue: int = 0, each=None):
        self.boundary, self.total, self.epilogue, self.each = "c4p", total, epilogue, each
        self.sent = self.after = 0
        self.done = False

    async def __aiter__(self):
        yield (f'--{self.boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{self.boundary}\r\n'
               f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n').encode()
        while self.sent < self.total:
            if self.each:
                await self.each()
            self.sent += 65536
            yield b"x" * 65536
        yield f"\r\n--{self.boundary}--\r\n".encode()
        while self.after < self.epilogue:
            self.after += 65536
            yield b"z" * 65536
        self.done = True

    @property
    def headers(self) -> dict:
        return {"Content-Type": f"multipart/form-data; boundary={self.boundary}"}


async def test_a_chunked_upload_stops_at_the_cap_and_keeps_nothing(app):
    files_dir = app.state.gateway.cfg.data_dir + "/files"
    async with client(app) as c:
        body = Body(total=50 * CAP)
        r = await c.post("/v1/files", content=body, headers={"Content-Type": f"multipart/form-data; boundary={body.boundary}"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large" and f"{CAP} bytes" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"
        assert not body.done and body.sent <= CAP + 65536  # the reading stopped within a chunk of the cap
        assert not [p.name for p in Path(files_dir).iterdir() if p.name.startswith(".")]  # no part file left
        # declared too large: refused before a byte is read
        body = Body(total=50 * CAP)
        r = await c.post("/v1/files", content=body, headers={"Content-Type": f"multipart/form-data; boundary={body.boundary}",
                                                              "Content-Length": str(50 * CAP)})
        assert r.status_code == 413 and body.sent == 0
        # at the cap: accepted
        r = await upload(c, b"y" * CAP)
        assert r.status_code == 200 and r.json()["bytes"] == CAP


# ---- 3. expiry and quotas ------------------------------------------------------------------------------------
async def test_expires_after_then_404_and_the_sweep_deletes(tiny_base, tmp_path, pg_url):
    gw = build(tiny_base, tmp_path, pg_url, file_sweep_seconds=0.05)
    service, app = gw.service, gw.app
    try:
        async with client(app) as c:
            sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=KEY_A, http_client=c)
            f = await sdk.files.create(file=("in.jsonl", LINE), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
            assert f.expires_at == f.created_at + 3600 and (await sdk.files.retrieve(f.id)).expires_at == f.expires_at
            default = await sdk.files.create(file=("in.jsonl", LINE), purpose="batch")
            assert default.expires_at == default.created_at + 30 * 86400  # OpenAI's default for batch files
            tune = await sdk.files.create(file=("t.jsonl", LINE), purpose="fine-tune")
            assert tune.expires_at is None
            in_use = (await upload(c)).json()
            batch = (await c.post("/v1/batches", json={**BATCH, "input_file_id": in_use["id"]})).json()  # no runner: stays validating
            with service.store.engine.begin() as conn:  # an hour later
                conn.execute(update(expiry).where(expiry.c.file_id == f.id).values(expires_at=int(time.time()) - 1))
                conn.execute(text("INSERT INTO swiftkv_file_expiry VALUES (:id, :at)"), {"id": in_use["id"], "at": int(time.time()) - 1})
            for path in (f"/v1/files/{f.id}", f"/v1/files/{f.id}/content"):
                assert (await c.get(path)).status_code == 404
            r = await c.post("/v1/batches", json={**BATCH, "input_file_id": f.id})
            assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
            assert service.files.path(f.id).exists()
            sweeping = asyncio.create_task(service.sweep_expired())  # BatchService.start runs it beside the runner

            async def swept():
                return not service.files.path(f.id).exists()
            try:
                await until(swept)
            finally:
                sweeping.cancel()
            assert service.files.path(in_use["id"]).exists()  # the input of a running batch waits for the batch
            assert (await c.get(f"/v1/batches/{batch['id']}")).status_code == 200
            listed = [x["id"] for x in (await c.get("/v1/files")).json()["data"]]
            assert f.id not in listed and default.id in listed and tune.id in listed
    finally:
        service.io.close()
        service.store.close()


async def test_per_key_quota_while_streaming_and_batch_output_counts(tiny_base, tmp_path, pg_url):
    quota = 2 * CAP
    gw = build(tiny_base, tmp_path, pg_url, max_storage_bytes_per_key=quota)
    service = gw.service
    with service.store.engine.begin() as conn:  # a fresh key space: other tests of the module share the database
        conn.execute(text("TRUNCATE swiftkv_files, swiftkv_file_expiry"))
    try:
        async with gw.running() as c:
            c.headers.update(A)
            data = b"".join(LINE.replace(b'"a"', b'"l%d"' % i) for i in range(5))
            batch = (await c.post("/v1/batches", json={**BATCH, "input_file_id": (await upload(c, data)).json()["id"]})).json()

            async def completed():
                nonlocal batch
                batch = (await c.get(f"/v1/batches/{batch['id']}")).json()
                return batch["status"] == "completed"
            await until(completed)
            out = (await c.get(f"/v1/files/{batch['output_file_id']}")).json()
            assert out["purpose"] == "batch_output" and out["expires_at"] == out["created_at"] + 30 * 86400
            used = len(data) + out["bytes"]
            assert (await upload(c, b"z" * CAP)).status_code == 200
            used += CAP
            # the room left is quota - used: a chunked upload past it stops there and names the quota and the use
            body = Body(total=10 * CAP)
            r = await c.post("/v1/files", content=body, headers={"Content-Type": f"multipart/form-data; boundary={body.boundary}"})
            error = r.json()["error"]
            assert r.status_code == 413 and error["code"] == "storage_quota_exceeded", r.text
            assert f"hold {used} of its {quota} bytes" in error["message"] and "max_storage_bytes_per_key" in error["message"]
            assert not body.done and body.sent <= quota - used + 65536
            # the other key has its own quota; deleting a file frees room
            r = await c.post("/v1/files", files={"file": ("in.jsonl", b"z" * CAP)}, data={"purpose": "batch"}, headers=B)
            assert r.status_code == 200
            assert (await c.delete(f"/v1/files/{batch['output_file_id']}")).status_code == 200
            assert (await upload(c, b"z" * (quota - used + out["bytes"] - 1000))).status_code == 200
    finally:
        service.io.close()
        service.store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_records_refuse_past_the_quota_in_the_insert_and_sweep_abandoned_parts(backend, tmp_path, pg_url):
    """The quota is checked again in the transaction that adds the file (uploads of one key running at once),
    and a part file left by a process killed mid-upload is deleted once it is an hour old."""
    import os

    from services.batch.store import BatchStore
    from services.common.files import FileRecords, FileStore, QuotaExceeded

    store = BatchStore(f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else pg_url)
    owner = f"k-{secrets.token_hex(4)}"
    records = FileRecords(store, FileStore(tmp_path / "files"), {"batch": 3600})
    try:
        record = {"owner": owner, "purpose": "batch", "filename": "f", "bytes": 600, "created_at": int(time.time())}
        records.add(record | {"id": "file-1"}, None, 1000)
        with pytest.raises(QuotaExceeded) as e:
            records.add(record | {"id": "file-2"}, int(time.time()) + 7200, 1000)
        assert (e.value.used, e.value.quota) == (600, 1000)
        assert records.get(owner, "file-2") is None and records.used(owner) == 600  # nothing kept
        assert records.get(owner, "file-1")["expires_at"] == record["created_at"] + 3600
        part = tmp_path / "files" / ".file-3.part"
        part.write_bytes(b"partial")
        records.sweep()
        assert part.exists()  # still being written, maybe
        os.utime(part, (time.time() - 7200, time.time() - 7200))
        records.sweep()
        assert not part.exists()
    finally:
        records.remove(owner, "file-1")
        store.close()


# ---- 4. uploads of one key at once, slow bodies, bytes after the body ----------------------------------------
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_adds_of_one_key_never_pass_the_quota_together(backend, tmp_path, pg_url):
    """PostgreSQL's READ COMMITTED lets each of two transactions sum the key's bytes without the other's new row:
    the quota check and the insert hold a per-key lock. The window is widened to make the race certain."""
    import threading

    from sqlalchemy import event

    from services.batch.store import BatchStore
    from services.common.files import FileRecords, FileStore, QuotaExceeded

    store = BatchStore(f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else pg_url)
    records = FileRecords(store, FileStore(tmp_path / "files"), {})
    owner, n = f"k-{secrets.token_hex(4)}", 8

    def slow_insert(conn, cursor, statement, *_):
        if statement.startswith("INSERT INTO swiftkv_files "):
            time.sleep(0.2)

    event.listen(store.engine, "after_cursor_execute", slow_insert)
    added, refused, go = [], [], threading.Barrier(n)

    def add(i: int) -> None:
        go.wait()
        try:
            records.add({"id": f"file-c{i}", "owner": owner, "purpose": "batch", "filename": "f", "bytes": 600,
                         "created_at": int(time.time())}, None, 1000)
            added.append(i)
        except QuotaExceeded:
            refused.append(i)

    try:
        threads = [threading.Thread(target=add, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(added) == 1 and len(refused) == n - 1, (added, refused)
        assert records.used(owner) == 600
    finally:
        event.remove(store.engine, "after_cursor_execute", slow_insert)
        for i in added:
            records.remove(owner, f"file-c{i}")
        store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_streaming_upload_holds_its_bytes_against_the_quota(backend, tmp_path, pg_url):
    """The hold is a row in the database, so uploads in every process of the gateway share the key's room; a hold
    its process stopped refreshing no longer counts and is swept."""
    from services.batch.store import BatchStore
    from services.common.files import RESERVATION_SECONDS, FileRecords, FileStore, QuotaExceeded, reservations

    store = BatchStore(f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else pg_url)
    other = BatchStore(f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else pg_url)  # another process's
    records, elsewhere = (FileRecords(s, FileStore(tmp_path / "files"), {}) for s in (store, other))
    owner = f"k-{secrets.token_hex(4)}"
    record = {"id": "file-h2", "owner": owner, "purpose": "batch", "filename": "f", "bytes": 500, "created_at": int(time.time())}
    try:
        assert records.reserve("file-h1", owner, 600, 1000) == 0
        assert records.reserve("file-h1", owner, 700, 1000) == 0  # grown, not added to
        with pytest.raises(QuotaExceeded) as e:
            elsewhere.reserve("file-h2", owner, 400, 1000)
        assert e.value.used == 700 and records.used(owner) == 700  # the refused hold is not kept
        assert elsewhere.reserve("file-h2", owner, 300, 1000) == 700
        with pytest.raises(QuotaExceeded):  # adding a file counts the key's other uploads too
            elsewhere.add(record, None, 1000)
        records.release("file-h1")
        elsewhere.add(record, None, 1000)  # ends its own hold
        assert records.used(owner) == 500
        records.reserve("file-h3", owner, 500, 1000)
        with store.engine.begin() as conn:  # the upload's process died long ago
            conn.execute(update(reservations).where(reservations.c.file_id == "file-h3")
                         .values(updated_at=int(time.time()) - RESERVATION_SECONDS - 1))
        assert records.used(owner) == 500
        records.sweep()
        with store.engine.connect() as conn:
            assert not conn.execute(select(reservations).where(reservations.c.owner == owner)).all()
    finally:
        records.remove(owner, "file-h2")
        store.close()
        other.close()


async def test_concurrent_uploads_of_one_key_never_hold_more_than_the_quota(tiny_base, tmp_path):
    """On the default SQLite store: uploads of one key streaming at once hold what they write against the quota, so
    the file volume never holds more than the quota for the key, even for a moment; each refused upload stops."""
    from services.common.files import reservations

    size, quota, n = 3 << 20, 4 << 20, 6
    gw = build(tiny_base, tmp_path, None, max_file_bytes=size, max_storage_bytes_per_key=quota)
    service, app, volume = gw.service, gw.app, tmp_path / "files"
    peak = 0

    def size_of(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:  # a refused upload's part, removed meanwhile
            return 0

    async def measure():
        nonlocal peak
        await asyncio.sleep(0)  # let the uploads interleave
        peak = max(peak, sum(map(size_of, volume.iterdir())))

    try:
        async with client(app) as c:
            bodies = [Body(total=size - 65536, each=measure) for _ in range(n)]
            answers = await asyncio.gather(*(c.post("/v1/files", content=b, headers=b.headers) for b in bodies))
            ok = [r for r in answers if r.status_code == 200]
            assert len(ok) <= 1 and all(r.json()["error"]["code"] == "storage_quota_exceeded" for r in answers if r not in ok)
            assert peak <= quota, f"{peak} bytes in the volume at once; the quota is {quota}"
            assert not all(b.done for b in bodies)  # refused uploads stopped reading
            with service.store.engine.connect() as conn:  # no hold left behind, no part file, only the accepted file
                assert not conn.execute(select(reservations)).all()
            assert sorted(p.name for p in volume.iterdir()) == sorted(r.json()["id"] for r in ok)
            for r in ok:
                assert (await c.delete(f"/v1/files/{r.json()['id']}")).status_code == 200
            # with Content-Length (as the SDK sends), the first upload holds what it declared: the others stop at once
            answers = await asyncio.gather(*(upload(c, b"y" * (size - 65536)) for _ in range(n)))
            assert sorted(r.status_code for r in answers) == [200] + [413] * (n - 1)
    finally:
        service.io.close()
        service.store.close()


async def test_bytes_after_the_closing_boundary_are_not_read_on(app):
    """The epilogue after the closing boundary is ignored (RFC 2046, as python-multipart, Django and Werkzeug do),
    but only a little of it is read: more is a 400 that closes the connection instead of a body read forever."""
    async with client(app) as c:
        body = Body(total=65536, epilogue=20 << 20)
        r = await c.post("/v1/files", content=body, headers=body.headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "file" and "closing boundary" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close" and body.after <= 2 * 65536
        head, _ = b"".join([x async for x in Body(total=0)]).split(b"\r\n--c4p--")  # a trailing CRLF is what clients send
        r = await c.post("/v1/files", content=head + b"data\r\n--c4p--\r\n", headers=body.headers)
        assert r.status_code == 200 and r.json()["bytes"] == 4, r.text


async def test_an_upload_slower_than_its_deadline_is_a_408(tmp_path):
    """The whole body within body_timeout, plus a second per MIN_UPLOAD_RATE bytes received: a large file may take
    its time, a client dribbling bytes may not hold the connection."""
    from starlette.requests import Request

    from services.common.errors import APIError
    from services.common.files import FileStore, open_store
    from services.common.uploads import MIN_UPLOAD_RATE, receive_upload

    _, rows = open_store(f"sqlite:///{tmp_path / 'f.db'}")
    store = FileStore(tmp_path / "files")

    async def call(fn, *args):
        return fn(*args)

    def request(chunks: list[bytes], pause: float) -> Request:
        async def receive():
            await asyncio.sleep(pause)
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}
        return Request({"type": "http", "method": "POST", "headers": [(b"content-type", b"multipart/form-data; boundary=c4p")]},
                       receive)

    head, _ = b"".join([x async for x in Body(total=0)]).split(b"\r\n--c4p--")
    dribble = [head] + [b"x"] * 1000 + [b"\r\n--c4p--\r\n"]
    started = time.monotonic()
    with pytest.raises(APIError) as e:
        await receive_upload(request(dribble, 0.05), KEY_A, ("batch",), CAP, store, rows, call, call, body_timeout=0.5)
    assert e.value.status == 408 and e.value.headers["Connection"] == "close" and time.monotonic() - started < 2
    # slower than body_timeout in all, but faster than MIN_UPLOAD_RATE: accepted
    steady = [head] + [b"x" * (MIN_UPLOAD_RATE // 4)] * 4 + [b"\r\n--c4p--\r\n"]
    f = await receive_upload(request(steady, 0.15), KEY_A, ("batch",), CAP, store, rows, call, call, body_timeout=0.5)
    assert f["bytes"] == MIN_UPLOAD_RATE and not [p for p in (tmp_path / "files").iterdir() if p.name.startswith(".")]
