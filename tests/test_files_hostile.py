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
from sqlalchemy import text, update

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
    `total`, counting what the server pulled."""

    def __init__(self, total: int):
        self.boundary, self.total, self.sent, self.done = "c4p", total, 0, False

    async def __aiter__(self):
        yield (f'--{self.boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{self.boundary}\r\n'
               f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n').encode()
        while self.sent < self.total:
            self.sent += 65536
            yield b"x" * 65536
        yield f"\r\n--{self.boundary}--\r\n".encode()
        self.done = True


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
