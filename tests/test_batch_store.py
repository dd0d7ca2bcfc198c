"""The batch store on an SQLite file and on the real PostgreSQL (127.0.0.1:5432, a database created and
dropped per module), the file store, and the input file parser."""

from __future__ import annotations

import io
import json
import secrets
import threading
import time

import pytest
from sqlalchemy import create_engine, text

from services.batch.files import FileStore, FileTooLarge
from services.batch.jsonl import parse_input
from services.batch.store import BatchStore, new_id

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="module")
def pg_url():
    """A fresh PostgreSQL database for this module, dropped afterwards."""
    name = f"swiftkv_store_{secrets.token_hex(4)}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'batch.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    s = BatchStore(url)
    yield s
    if request.param == "postgresql":  # the module shares one database: start each test empty
        with s.engine.begin() as conn:
            conn.execute(text("TRUNCATE swiftkv_files, swiftkv_batches, swiftkv_batch_results"))
    s.close()


def add_batch(store: BatchStore, owner: str = "alice", status: str = "in_progress") -> str:
    batch_id = new_id("batch_")
    store.add_batch({"id": batch_id, "owner": owner, "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
                     "completion_window": "24h", "metadata": {"k": "v"}, "status": status, "created_at": int(time.time()),
                     "expires_at": int(time.time()) + 60, "total": 3})
    return batch_id


def test_files_are_per_owner_and_paginate(store):
    ids = []
    for i in range(5):
        ids.append(new_id("file-"))
        store.add_file({"id": ids[-1], "owner": "alice", "purpose": "batch" if i % 2 == 0 else "fine-tune",
                        "filename": f"f{i}.jsonl", "bytes": i, "created_at": 0})
    store.add_file({"id": new_id("file-"), "owner": "bob", "purpose": "batch", "filename": "b", "bytes": 1, "created_at": 0})
    page, more = store.list_files("alice", None, None, 2, descending=True)
    assert [f["id"] for f in page] == ids[::-1][:2] and more
    page, more = store.list_files("alice", None, page[-1]["id"], 10, descending=True)
    assert [f["id"] for f in page] == ids[::-1][2:] and not more
    assert [f["id"] for f in store.list_files("alice", "batch", None, 10, descending=False)[0]] == ids[::2]
    assert store.get_file("bob", ids[0]) is None and store.get_file("alice", ids[0])["filename"] == "f0.jsonl"
    assert not store.delete_file("bob", ids[0])
    assert store.delete_file("alice", ids[0]) and store.get_file("alice", ids[0]) is None


def test_batches_list_newest_first_per_owner(store):
    ids = [add_batch(store) for _ in range(3)]
    add_batch(store, owner="bob")
    page, more = store.list_batches("alice", None, 2)
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.list_batches("alice", ids[1], 2)
    assert [b["id"] for b in page] == [ids[0]] and not more
    assert store.get_batch("bob", ids[0]) is None
    assert store.get_batch("alice", ids[0])["metadata"] == {"k": "v"}


def test_a_line_counts_once(store):
    batch_id = add_batch(store)
    body = {"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    assert store.record(batch_id, 1, "a", 200, "r1", body)
    assert not store.record(batch_id, 1, "a", 200, "r2", body)  # a second worker finishing the same line
    assert store.record(batch_id, 2, "b", 400, "r3", {"error": {"message": "bad"}})
    b = store.get_batch("alice", batch_id)
    assert (b["completed"], b["failed"], b["prompt_tokens"], b["completion_tokens"]) == (1, 1, 7, 3)
    assert store.done_lines(batch_id) == {1, 2}
    rows = list(store.results(batch_id))
    assert [(r["line"], r["ok"], r["request_id"]) for r in rows] == [(1, True, "r1"), (2, False, "r3")]


def test_lease_is_exclusive_and_taken_over_when_it_lapses(store):
    batch_id = add_batch(store)
    add_batch(store, status="completed")  # final: never claimed
    assert store.claim("A", 0.5)["id"] == batch_id
    assert store.claim("B", 0.5) is None
    assert store.renew(batch_id, "A", 0.5) is not None
    time.sleep(0.6)  # A stopped renewing (killed, or late)
    assert store.claim("A", 30, running=[batch_id]) is None  # a worker never takes a second lease on its own job
    assert store.claim("B", 30)["lease_owner"] == "B"
    assert store.renew(batch_id, "A", 30) is None
    assert not store.update_held(batch_id, "A", status="completed")
    assert not store.finish(batch_id, "A", {"status": "completed"}, [])
    out = {"id": "file-out", "owner": "alice", "purpose": "batch_output", "filename": "o", "bytes": 1, "created_at": 0}
    assert store.finish(batch_id, "B", {"status": "completed", "output_file_id": "file-out"}, [out])
    assert store.finish(batch_id, "B", {}, [out]) is False  # the lease is released with the final status
    b = store.get_batch("alice", batch_id)
    assert (b["status"], b["lease_owner"], b["output_file_id"]) == ("completed", None, "file-out")
    assert store.get_file("alice", "file-out")["purpose"] == "batch_output"
    assert store.claim("C", 30) is None


def test_concurrent_claims_take_each_batch_once(store):
    ids = {add_batch(store) for _ in range(12)}
    claimed: list[tuple[str, str]] = []

    def worker(name: str) -> None:
        while (b := store.claim(name, 60)) is not None:
            claimed.append((b["id"], name))

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(b for b, _ in claimed) == sorted(ids)
    assert all(store.get_batch(None, b)["lease_owner"] == w for b, w in claimed)


def test_cancel_moves_only_running_batches(store):
    running, done = add_batch(store), add_batch(store, status="completed")
    assert store.request_cancel("alice", running, 5)["status"] == "cancelling"
    assert store.request_cancel("alice", done, 5)["status"] == "completed"
    assert store.request_cancel("bob", running, 5) is None


def test_file_store_is_atomic_and_bounded(tmp_path):
    fs = FileStore(tmp_path / "files")
    assert fs.save("file-a", io.BytesIO(b"x" * 3000), 4096) == 3000
    with pytest.raises(FileTooLarge):
        fs.save("file-b", io.BytesIO(b"x" * 5000), 4096)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["file-a"]  # nothing partial left
    with pytest.raises(ValueError):
        fs.path("../etc/passwd")


def jsonl(*items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def req(custom_id: str, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", "messages": []}}


def test_parse_input_names_bad_lines(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(jsonl(req("a"), b"", req("b")))
    lines, errors = parse_input(p, "/v1/chat/completions", 10)
    assert errors == [] and [(l.number, l.custom_id) for l in lines] == [(1, "a"), (3, "b")]

    p.write_bytes(jsonl(req("a"), b"{not json", req("a"), req("c", "/v1/completions"), {"custom_id": "d", "method": "POST",
                        "url": "/v1/chat/completions", "body": []}, [1]))
    lines, errors = parse_input(p, "/v1/chat/completions", 10)
    assert lines == []
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"),
                                                        (5, "missing_required_parameter"), (6, "invalid_json_line")]
    assert "line 1" in errors[1]["message"]

    p.write_bytes(jsonl(*(req(str(i)) for i in range(4))))
    assert parse_input(p, "/v1/chat/completions", 3)[1][0]["code"] == "too_many_requests"
    p.write_bytes(b"\n\n")
    assert parse_input(p, "/v1/chat/completions", 3)[1][0]["code"] == "empty_file"
    p.write_bytes(b"\xff\xfe\n")
    assert parse_input(p, "/v1/chat/completions", 3)[1][0]["code"] == "invalid_json_line"
