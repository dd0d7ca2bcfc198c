"""The batch store on an SQLite file and on the real PostgreSQL (127.0.0.1:5432, a database created and
dropped per module), the file store, and the input file parser."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import tracemalloc

import pytest
from sqlalchemy import text

from services.batch.batch_input import Line, parse_input, read_body
from services.batch.runner import Job
from services.batch.store import BatchStore, TooManyActive
from services.common.files import FileStore, FileTooLarge
from services.common.ids import new_id


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
        store.files.add({"id": ids[-1], "owner": "alice", "purpose": "batch" if i % 2 == 0 else "fine-tune",
                        "filename": f"f{i}.jsonl", "bytes": i, "created_at": 0})
    store.files.add({"id": new_id("file-"), "owner": "bob", "purpose": "batch", "filename": "b", "bytes": 1, "created_at": 0})
    page, more = store.files.list_page("alice", None, None, 2, descending=True)
    assert [f["id"] for f in page] == ids[::-1][:2] and more
    page, more = store.files.list_page("alice", None, page[-1]["id"], 10, descending=True)
    assert [f["id"] for f in page] == ids[::-1][2:] and not more
    assert [f["id"] for f in store.files.list_page("alice", "batch", None, 10, descending=False)[0]] == ids[::2]
    assert store.files.get("bob", ids[0]) is None and store.files.get("alice", ids[0])["filename"] == "f0.jsonl"
    assert not store.files.delete("bob", ids[0])
    assert store.files.delete("alice", ids[0]) and store.files.get("alice", ids[0]) is None


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
    rows = [*store.results(batch_id, ok=True), *store.results(batch_id, ok=False)]
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
    assert store.files.get("alice", "file-out")["purpose"] == "batch_output"
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
    lines, errors = parse_input(p, "/v1/chat/completions", 10, 4096)
    assert errors == [] and [(l.number, l.custom_id) for l in lines] == [(1, "a"), (3, "b")]

    p.write_bytes(jsonl(req("a"), b"{not json", req("a"), req("c", "/v1/completions"), {"custom_id": "d", "method": "POST",
                        "url": "/v1/chat/completions", "body": []}, [1]))
    lines, errors = parse_input(p, "/v1/chat/completions", 10, 4096)
    assert lines == []
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"),
                                                        (5, "missing_required_parameter"), (6, "invalid_json_line")]
    assert "line 1" in errors[1]["message"]

    p.write_bytes(jsonl(*(req(str(i)) for i in range(4))))
    assert parse_input(p, "/v1/chat/completions", 3, 4096)[1][0]["code"] == "too_many_requests"
    p.write_bytes(b"\n\n")
    assert parse_input(p, "/v1/chat/completions", 3, 4096)[1][0]["code"] == "empty_file"
    p.write_bytes(b"\xff\xfe\n")
    assert parse_input(p, "/v1/chat/completions", 3, 4096)[1][0]["code"] == "invalid_json_line"


def test_claims_go_to_the_key_with_the_fewest_batches_being_worked(store):
    """Alice's three batches came first; Bob's comes second to a worker anyway, once one of Alice's is being worked."""
    alice = [add_batch(store) for _ in range(3)]
    bob = add_batch(store, owner="bob")
    assert [store.claim(w, 30)["id"] for w in ("A", "B", "C", "D")] == [alice[0], bob, alice[1], alice[2]]
    add_batch(store, owner="carol")
    dave = add_batch(store, owner="dave")
    assert store.claim("E", 30, skip_owners=["carol"])["id"] == dave
    assert store.claim("E", 30, skip_owners=["carol"]) is None


def test_statuses_move_only_from_their_own(store):
    """A cancel that lands after the last line is not overwritten: finalizing (and completed) need in_progress."""
    batch_id = add_batch(store)
    store.claim("A", 30)
    assert store.request_cancel("alice", batch_id, 5)["status"] == "cancelling"
    assert not store.update_held(batch_id, "A", ("in_progress",), status="finalizing")
    assert not store.finish(batch_id, "A", {"status": "completed"}, [], ("finalizing",))
    assert store.get_batch("alice", batch_id)["status"] == "cancelling"
    assert store.finish(batch_id, "A", {"status": "cancelled"}, [], ("cancelling",))
    assert not store.update_held(batch_id, "A", status="in_progress")  # a final status stays (and the lease is gone)


def test_failed_attempts_fail_the_batch_unless_lines_finish_between_them(store):
    batch_id = add_batch(store)
    reason = [{"code": "batch_processing_failed", "message": "boom", "param": None, "line": None}]
    store.claim("A", 30)
    assert not store.fail_attempt(batch_id, "A", 3, reason)
    assert store.claim("A", 30)["attempts"] == 1  # released for the retry
    store.record(batch_id, 1, "a", 200, "r1", {})  # progress: the count starts again
    assert not store.fail_attempt(batch_id, "A", 3, reason)
    for _ in range(2):
        store.claim("A", 30)
        failed = store.fail_attempt(batch_id, "A", 3, reason)
    b = store.get_batch("alice", batch_id)
    assert failed and (b["status"], b["attempts"], b["errors"]["data"], b["lease_owner"]) == ("failed", 3, reason, None)
    assert store.claim("A", 30) is None


def test_a_database_from_before_a_column_gains_it(store):
    """Columns added since a database was created (here `attempts`) are added when the store opens it."""
    batch_id = add_batch(store)
    with store.engine.begin() as conn:
        conn.execute(text("ALTER TABLE swiftkv_batches DROP COLUMN attempts"))
    again = BatchStore(str(store.engine.url.render_as_string(hide_password=False)))
    try:
        assert again.get_batch("alice", batch_id)["attempts"] == 0
        assert again.claim("A", 30)["id"] == batch_id and not again.fail_attempt(batch_id, "A", 3, [])
    finally:
        again.close()


def test_parse_input_takes_any_unparseable_line_as_the_lines_error(tmp_path):
    """A line nested deeper than Python's recursion limit (json raises RecursionError) and a line over
    max_line_bytes are errors naming the line, like bad JSON; the lines after them are still checked."""
    p = tmp_path / "in.jsonl"
    nested = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"x": ' + b"[" * 1500 + b"]" * 1500 + b"}}"
    long = json.dumps(req("long") | {"pad": "x" * 5000}).encode()
    p.write_bytes(jsonl(req("a"), nested, long, req("a")))
    lines, errors = parse_input(p, "/v1/chat/completions", 10, 4096)
    assert lines == []
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line"), (3, "line_too_large"), (4, "duplicate_custom_id")]
    assert "4096 bytes (batch.max_line_bytes)" in errors[1]["message"]
    p.write_bytes(jsonl(req("a")) + json.dumps(req("b")).encode())  # the last line without its newline
    assert [(l.number, l.custom_id) for l in parse_input(p, "/v1/chat/completions", 10, 4096)[0]] == [(1, "a"), (2, "b")]


def test_a_line_nesting_past_the_bound_is_its_error_whatever_the_recursion_limit(tmp_path):
    """The bound is the gateway's (a body may nest MAX_JSON_DEPTH levels, its line one more), not json's RecursionError:
    a line 150 levels deep parses under any recursion limit, and libraries in the same process raise the limit (torch,
    hypothesis), under which 1,500 levels parse too. Brackets inside strings do not count."""
    import sys

    from services.common.validation import MAX_JSON_DEPTH, too_deep

    def line(custom_id: str, depth: int) -> bytes:
        return (b'{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", "body": {"x": ' % custom_id.encode()
                + b"[" * depth + b"]" * depth + b"}}")

    ok = req("brackets") | {"body": {"messages": [{"role": "user", "content": "[" * 500}]}}
    p = tmp_path / "in.jsonl"
    p.write_bytes(jsonl(line("fits", MAX_JSON_DEPTH - 2), ok))
    assert [(l.number, l.custom_id) for l in parse_input(p, "/v1/chat/completions", 10, 1 << 20)[0]] == [(1, "fits"), (2, "brackets")]
    p.write_bytes(jsonl(ok, line("deep", 150)))
    errors = parse_input(p, "/v1/chat/completions", 10, 1 << 20)[1]
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line")]
    assert f"more than {MAX_JSON_DEPTH + 1} levels deep" in errors[0]["message"]
    p.write_bytes(jsonl(line("deeper", 1500)))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        assert [(e["line"], e["code"]) for e in parse_input(p, "/v1/chat/completions", 10, 1 << 20)[1]] == [(1, "invalid_json_line")]
    finally:
        sys.setrecursionlimit(limit)
    assert not too_deep({"a": "[" * 500}, '{"a": "' + "[" * 500 + '"}') and too_deep([[[]]], "[[[]]]", 2)


def test_validation_holds_no_request_bodies(tmp_path):
    """Checking a file keeps where each line is, not its body: bodies of many small objects take ~25 times their
    bytes as Python objects (a 200 MB file would need ~5 GB). The peak while checking 100 lines of 4,000 empty
    objects (~30 MB as objects) stays near one line's; each body is read back when its line runs."""
    p = tmp_path / "in.jsonl"
    body = {"model": "m", "messages": [], "metadata": [{}] * 4000}
    p.write_bytes(jsonl(*({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(100))))
    tracemalloc.start()
    try:
        lines, errors = parse_input(p, "/v1/chat/completions", 1000, 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert errors == [] and len(lines) == 100
    assert peak < 3_000_000, f"{peak} bytes at the peak"
    assert read_body(p, lines[57]) == body


def test_workers_dying_on_a_batch_fail_it_after_max_attempts(store):
    """A process killed while holding a batch (out of memory on a hostile file) never releases its lease: each
    lapsed lease counts as an attempt, so the next processes do not die on it forever."""
    batch_id = add_batch(store)
    for worker in ("A", "B", "C"):
        assert store.claim(worker, 0.05, max_attempts=3)["id"] == batch_id
        time.sleep(0.1)  # killed: the lease lapses, never released
    assert store.claim("D", 30, max_attempts=3) is None  # the third lapse fails it instead of handing it on
    b = store.get_batch("alice", batch_id)
    assert b["status"] == "failed" and b["lease_owner"] is None
    assert b["errors"]["data"][0]["code"] == "batch_processing_failed"
    released = add_batch(store)
    for _ in range(4):  # a lease handed back (a clean stop) is no failure
        assert store.claim("A", 30, max_attempts=3)["id"] == released
        store.release(released, "A")
    assert store.get_batch("alice", released)["status"] == "in_progress"


def test_finish_publishes_only_under_the_lease_and_drops_the_results(store):
    """The files move into place inside finish(), after the compare-and-set on the lease holder and before the commit:
    a worker whose lease lapsed and was taken over publishes nothing. The final batch's line results go (its files
    hold them; they used to stay forever), and a late line from the lapsed worker neither comes back nor counts."""
    batch_id = add_batch(store, status="finalizing")
    for n in (1, 2):
        assert store.record(batch_id, n, f"c{n}", 200, f"r{n}", {"id": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    assert store.claim("A", 0.05)["id"] == batch_id
    time.sleep(0.1)  # A's lease lapses during its finalize
    assert store.claim("B", 30)["lease_owner"] == "B"
    published = []
    assert not store.finish(batch_id, "A", {"status": "completed"}, [], ("finalizing",), lambda: published.append("A"))
    assert published == [] and store.done_lines(batch_id) == {1, 2}

    out = {"id": "file-out", "owner": "alice", "purpose": "batch_output", "filename": "o", "bytes": 1, "created_at": 0}

    def fails() -> None:
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):  # publishing failed: nothing of the finish is kept, the results included
        store.finish(batch_id, "B", {"status": "completed", "output_file_id": "file-out"}, [out], ("finalizing",), fails)
    b = store.get_batch("alice", batch_id)
    assert (b["status"], b["lease_owner"], store.files.get("alice", "file-out")) == ("finalizing", "B", None)
    assert store.done_lines(batch_id) == {1, 2}

    assert store.finish(batch_id, "B", {"status": "completed", "output_file_id": "file-out"}, [out], ("finalizing",),
                        lambda: published.append("B"))
    assert published == ["B"] and store.files.get("alice", "file-out") is not None
    assert store.done_lines(batch_id) == set() and list(store.results(batch_id, ok=True)) == []
    assert not store.record(batch_id, 1, "c1", 200, "r9", {"id": "x", "usage": {"prompt_tokens": 5, "completion_tokens": 5}})
    b = store.get_batch("alice", batch_id)
    assert (b["completed"], b["prompt_tokens"], store.done_lines(batch_id)) == (2, 2, set())


def test_a_batch_failed_after_its_attempts_keeps_no_results(store):
    batch_id = add_batch(store)
    assert store.record(batch_id, 1, "c1", 200, "r1", {"id": "x"})
    assert store.claim("A", 30)["id"] == batch_id
    assert store.fail_attempt(batch_id, "A", 1, [{"code": "batch_processing_failed", "message": "x", "param": None, "line": None}])
    assert store.get_batch("alice", batch_id)["status"] == "failed" and store.done_lines(batch_id) == set()


def test_a_key_may_have_only_max_active_batches_at_once(store):
    """Checked in the insert's transaction (one key's creates serialized on PostgreSQL): eight concurrent creates at a
    cap of 3 leave exactly 3; final and cancelling batches and other keys' do not count."""
    add_batch(store, status="completed")
    add_batch(store, status="cancelling")
    add_batch(store, owner="bob")
    outcomes: list[str] = []

    def create() -> None:
        record = {"id": new_id("batch_"), "owner": "alice", "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
                  "completion_window": "24h", "status": "validating", "created_at": 0, "expires_at": 60}
        try:
            store.add_batch(record, max_active=3)
            outcomes.append("ok")
        except TooManyActive as e:
            assert (e.active, e.limit) == (3, 3)
            outcomes.append("refused")

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["ok"] * 3 + ["refused"] * 5
    assert sum(b["status"] == "validating" for b in store.list_batches("alice", None, 100)[0]) == 3


class _Runner:
    """What a Job uses of its Runner: the store, the file store, the worker's name, a thread to run store calls in."""

    def __init__(self, store, files: FileStore, worker: str):
        self.store, self.files, self.worker = store, files, worker

    async def io(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)


class _PausedStore:
    """The store, but its result rows stop after the first until `go` (a worker stalled mid-write, e.g. a GC pause)."""

    def __init__(self, store: BatchStore):
        self.store, self.reached, self.go = store, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def results(self, batch_id: str, ok: bool):
        for i, row in enumerate(self.store.results(batch_id, ok)):
            if i == 1:
                self.reached.set()
                self.go.wait(10)
            yield row


def test_a_worker_whose_lease_lapsed_mid_finalize_leaves_the_new_holders_files_alone(store, tmp_path):
    """A stalls while writing the output file, its lease lapses and B finalizes the batch. A then finishes writing: it
    wrote into a part file of its own (both used to write `.file-…-output.part`: B moved it into place under A's
    feet and A's commit raised FileNotFoundError) and, no longer holding the lease, moves nothing into place."""
    files = FileStore(tmp_path / "files")
    batch_id = add_batch(store, status="finalizing")
    lines = [Line(n, 0, 0, f"c{n}") for n in (1, 2, 3)]
    for line in lines:
        assert store.record(batch_id, line.number, line.custom_id, 200, f"r{line.number}", {"id": "x", "n": line.number})
    paused = _PausedStore(store)
    job_a = Job(_Runner(paused, files, "A"), store.claim("A", 0.2))

    async def run():
        a = asyncio.create_task(job_a.finalize(lines, "completed"))
        await asyncio.to_thread(paused.reached.wait, 10)
        await asyncio.sleep(0.3)  # A's lease lapses while it writes
        job_b = Job(_Runner(store, files, "B"), store.claim("B", 30))
        await job_b.finalize(lines, "completed")
        b = store.get_batch("alice", batch_id)
        target = files.path(b["output_file_id"])
        written = (target.stat().st_ino, target.read_bytes())
        paused.go.set()
        await a  # raised FileNotFoundError before
        assert (target.stat().st_ino, target.read_bytes()) == written
        assert [json.loads(x)["custom_id"] for x in written[1].splitlines()] == ["c1", "c2", "c3"]
        assert (b["status"], store.files.get("alice", b["output_file_id"])["bytes"]) == ("completed", len(written[1]))
        assert [p.name for p in files.root.iterdir() if p.name.endswith(".part")] == []  # A's part removed

    asyncio.run(run())


def test_results_of_batches_finished_earlier_are_pruned(store):
    """Batches that ended before finish() dropped their results (an older database) lose them to the sweep; a running
    batch keeps its own."""
    running, old = add_batch(store), add_batch(store)
    for batch_id in (running, old):
        assert store.record(batch_id, 1, "c1", 200, "r1", {"id": "x"})
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE swiftkv_batches SET status = 'completed' WHERE id = :id"), {"id": old})
    assert store.prune_results() == 1 and store.prune_results() == 0
    assert store.done_lines(old) == set() and store.done_lines(running) == {1}
