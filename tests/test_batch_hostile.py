"""The Batch API runner against hostile input and races, in process: the gateway and its Batch API over
the fake backend (harness.FakeBackend, gated), the real SQLite store and file store, the app through httpx."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
from harness.batch import PROMPT_HEAVY, gated_gateway, until

from services.batch import runner as runner_module
from services.gateway import admission

KEY_A, KEY_B = "sk-hostile-a", "sk-hostile-b"


def line(custom_id: str, body: dict | None = None) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body or PROMPT_HEAVY}).encode()


async def submit(c: httpx.AsyncClient, lines: list[bytes], key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    f = await c.post("/v1/files", files={"file": ("in.jsonl", b"\n".join(lines) + b"\n")}, data={"purpose": "batch"}, headers=headers)
    assert f.status_code == 200, f.text
    b = await c.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
                     headers=headers)
    assert b.status_code == 200, b.text
    return b.json()


async def get(c: httpx.AsyncClient, batch: dict, key: str | None = None) -> dict:
    return (await c.get(f"/v1/batches/{batch['id']}", headers={"Authorization": f"Bearer {key}"} if key else {})).json()


async def status_becomes(c: httpx.AsyncClient, batch: dict, *statuses: str, key: str | None = None, timeout: float = 10) -> dict:
    seen = {}

    async def reached():
        seen.update(await get(c, batch, key))
        return seen["status"] in statuses
    await until(reached, timeout)
    return seen


async def contents(c: httpx.AsyncClient, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in (await c.get(f"/v1/files/{file_id}/content")).text.splitlines()] if file_id else []


def test_a_line_nested_too_deep_fails_its_batch_and_the_runner_goes_on(tiny_base, tmp_path):
    """A line nested 1,500 levels deep is a line error (it used to raise RecursionError in the runner, which took
    the same batch again every second, forever, holding a slot): its batch fails naming the line, and a batch
    submitted after it completes."""
    backends, gw = gated_gateway(tiny_base, tmp_path, batch={"max_active_batches": 1})
    nested = b'{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"x": ' + b"[" * 1500 + b"]" * 1500 + b"}}"

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            bad = await submit(c, [line("a"), nested])
            good = await submit(c, [line("b")])
            bad = await status_becomes(c, bad, "failed", "completed")
            assert bad["status"] == "failed"
            assert [(e["line"], e["code"]) for e in bad["errors"]["data"]] == [(2, "invalid_json_line")]
            assert "line 2" in bad["errors"]["data"][0]["message"]
            assert (await status_becomes(c, good, "completed", "failed"))["status"] == "completed"

    asyncio.run(run())


def test_a_batch_whose_processing_keeps_failing_ends_failed_after_max_attempts(tiny_base, tmp_path, monkeypatch):
    """Any unexpected error in a job (here: reading its input raises each time) is retried, but the
    batch.max_attempts-th failure in a row ends the batch `failed` with the reason, freeing its slot."""
    backends, gw = gated_gateway(tiny_base, tmp_path, batch={"max_active_batches": 1, "max_attempts": 3})
    calls = []
    real = runner_module.Job.read_input

    def read_input(job):
        if job.batch["input_file_id"] == poisoned:
            calls.append(job.id)
            raise RuntimeError("the disk said no")
        return real(job)
    monkeypatch.setattr(runner_module.Job, "read_input", read_input)

    async def run():
        nonlocal poisoned
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            bad = await submit(c, [line("a")])
            poisoned = bad["input_file_id"]
            good = await submit(c, [line("b")])
            bad = await status_becomes(c, bad, "failed", "completed")
            assert len(calls) == 3
            [reason] = bad["errors"]["data"]
            assert reason["code"] == "batch_processing_failed"
            assert "3 times" in reason["message"] and "RuntimeError: the disk said no" in reason["message"]
            assert (await status_becomes(c, good, "completed", "failed"))["status"] == "completed"

    poisoned = None
    asyncio.run(run())


def test_batch_lines_are_charged_to_the_key_and_wait_while_it_is_over_its_limit(tiny_base, tmp_path):
    """requests_per_minute 2: two lines run, the third waits (it neither fails nor runs) and the key's live
    requests get 429 meanwhile; once the bucket has refilled the line runs. A cancel while lines wait on the limit
    ends the batch `cancelled`, the lines done in the output file and the others in the error file in input order."""
    backends, gw = gated_gateway(tiny_base, tmp_path, limits={"requests_per_minute": 2})
    bucket = lambda: gw.gateway.limiter.buckets["anonymous"]["requests"]  # noqa: E731

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await submit(c, [line(f"x{i}") for i in range(3)])

            async def two_done():
                return (await get(c, batch))["request_counts"]["completed"] == 2
            await until(two_done)
            await asyncio.sleep(1.0)
            b = await get(c, batch)
            assert (b["status"], b["request_counts"]) == ("in_progress", {"total": 3, "completed": 2, "failed": 0})
            live = await c.post("/v1/completions", json=PROMPT_HEAVY)
            assert live.status_code == 429 and live.json()["error"]["code"] == "rate_limit_exceeded"
            bucket().level = 1.0  # a minute has passed, as far as the limiter knows
            b = await status_becomes(c, batch, "completed", "failed")
            assert b["request_counts"] == {"total": 3, "completed": 3, "failed": 0}

            batch = await submit(c, [line(f"y{i}") for i in range(4)])
            bucket().level = 1.0

            async def one_done():
                return (await get(c, batch))["request_counts"]["completed"] == 1
            await until(one_done)
            assert (await c.post(f"/v1/batches/{batch['id']}/cancel")).status_code == 200
            b = await status_becomes(c, batch, "cancelled", "completed")
            assert b["status"] == "cancelled" and b["request_counts"]["completed"] == 1
            done = [x["custom_id"] for x in await contents(c, b["output_file_id"])]
            cancelled = [(x["custom_id"], x["error"]["code"]) for x in await contents(c, b["error_file_id"])]
            assert len(done) == 1 and cancelled == [(f"y{i}", "batch_cancelled") for i in range(4) if f"y{i}" not in done]

    asyncio.run(run())


def test_a_cancel_after_the_last_line_is_not_overwritten_by_completion(tiny_base, tmp_path, monkeypatch):
    """The cancel arrives after every line finished, before the runner moves the batch to finalizing: the batch
    ends `cancelled` (never `completed`), with every result kept, as OpenAI keeps a cancelled batch's results."""
    backends, gw = gated_gateway(tiny_base, tmp_path)
    real = runner_module.Job.finalize

    async def finalize(job, lines, final):
        await job.runner.io(gw.service.store.request_cancel, job.batch["owner"], job.id, int(time.time()))  # the race, made certain
        await real(job, lines, final)
    monkeypatch.setattr(runner_module.Job, "finalize", finalize)

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await status_becomes(c, await submit(c, [line(f"l{i}") for i in range(3)]), "cancelled", "completed")
            assert batch["status"] == "cancelled" and batch["cancelled_at"] and batch["completed_at"] is None
            assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
            assert sorted(x["custom_id"] for x in await contents(c, batch["output_file_id"])) == ["l0", "l1", "l2"]
            assert batch["error_file_id"] is None

    asyncio.run(run())


def test_a_cancel_while_finalizing_is_refused_and_the_batch_completes(tiny_base, tmp_path, monkeypatch):
    """Once the batch is finalizing, a cancel answers 409 and the batch ends `completed`: the answer matches the end."""
    backends, gw = gated_gateway(tiny_base, tmp_path)
    writing, release = threading.Event(), threading.Event()
    real = runner_module.Job.write_outputs

    def write_outputs(job, lines, final):
        writing.set()
        release.wait(10)
        return real(job, lines, final)
    monkeypatch.setattr(runner_module.Job, "write_outputs", write_outputs)

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await submit(c, [line("l0")])

            async def finalizing():
                return writing.is_set()
            await until(finalizing)
            r = await c.post(f"/v1/batches/{batch['id']}/cancel")
            assert r.status_code == 409 and r.json()["error"]["code"] == "batch_not_cancellable"
            release.set()
            assert (await status_becomes(c, batch, "completed", "cancelled"))["status"] == "completed"

    asyncio.run(run())


def test_one_keys_batches_never_take_every_runner_slot(tiny_base, tmp_path):
    """max_active_batches 2, key A's two batches hang on the engine: A's second waits and key B's batch, sent
    after it, takes the last slot (claims used to be global FIFO, so A's batches held every slot)."""
    backends, gw = gated_gateway(tiny_base, tmp_path, batch={"max_active_batches": 2}, keys=(KEY_A, KEY_B))

    async def run():
        async with gw.running() as c:
            a1 = await submit(c, [line("a1")], KEY_A)
            await status_becomes(c, a1, "in_progress", key=KEY_A)
            a2 = await submit(c, [line("a2")], KEY_A)
            b1 = await submit(c, [line("b1")], KEY_B)
            await status_becomes(c, b1, "in_progress", key=KEY_B)
            await asyncio.sleep(0.5)
            assert (await get(c, a2, KEY_A))["status"] == "validating"
            for b in backends.values():
                b.gate.set()
            for batch, key in ((a1, KEY_A), (a2, KEY_A), (b1, KEY_B)):
                assert (await status_becomes(c, batch, "completed", "failed", key=key))["status"] == "completed"

    asyncio.run(run())


def test_a_batch_whose_files_failed_once_to_be_written_completes_on_the_next_attempt(tiny_base, tmp_path, monkeypatch):
    """Writing the output files fails once, with the batch already `finalizing`: the retry finishes it (a
    finalizing batch taken again is finalized again, not left stuck)."""
    backends, gw = gated_gateway(tiny_base, tmp_path)
    real, failures = runner_module.Job.write_outputs, []

    def write_outputs(job, lines, final):
        if not failures:
            failures.append(final)
            raise OSError(28, "No space left on device")
        return real(job, lines, final)
    monkeypatch.setattr(runner_module.Job, "write_outputs", write_outputs)

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await status_becomes(c, await submit(c, [line("l0"), line("l1")]), "completed", "failed")
            assert batch["status"] == "completed" and failures == ["completed"]
            assert sorted(x["custom_id"] for x in await contents(c, batch["output_file_id"])) == ["l0", "l1"]

    asyncio.run(run())


def test_an_expired_batch_lists_every_line_not_run_in_input_order(tiny_base, tmp_path):
    """The window ends while the engine holds every line: `expired`, each line in the error file once, in order."""
    backends, gw = gated_gateway(tiny_base, tmp_path, batch={"completion_windows": {"1s": 1}})

    async def run():
        async with gw.running() as c:
            f = await c.post("/v1/files", files={"file": ("in.jsonl", b"\n".join(line(f"l{i}") for i in range(4)))},
                             data={"purpose": "batch"})
            batch = (await c.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                                       "completion_window": "1s"})).json()
            batch = await status_becomes(c, batch, "expired", "completed", "failed")
            assert batch["status"] == "expired" and batch["output_file_id"] is None
            assert [(x["custom_id"], x["error"]["code"]) for x in await contents(c, batch["error_file_id"])] == [
                (f"l{i}", "batch_expired") for i in range(4)]

    asyncio.run(run())


def test_a_line_retried_after_a_429_is_validated_once(tiny_base, tmp_path, monkeypatch):
    """A line refused for its key's per-minute limit is retried with the request validated the first time: each
    retry costs only the limiter call. Before, the line's tree was walked (on the loop) and validated again on
    every retry."""
    backends, gw = gated_gateway(tiny_base, tmp_path, limits={"requests_per_minute": 1})
    limiter = gw.gateway.limiter
    parsed, acquired = [], []
    parse, acquire = admission.parse, limiter.acquire
    monkeypatch.setattr(admission, "parse", lambda *a: parsed.append(a) or parse(*a))
    monkeypatch.setattr(limiter, "acquire", lambda *a, **k: acquired.append(a) or acquire(*a, **k))

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await submit(c, [line("a"), line("b")])

            async def retried():
                return len(acquired) >= 5  # line a's request, line b's first try and three retries
            await until(retried)
            limiter.buckets["anonymous"]["requests"].level = 1.0  # a minute has passed, as far as the limiter knows
            b = await status_becomes(c, batch, "completed", "failed")
            assert b["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        assert len(parsed) == 2, len(parsed)  # one validation per line

    asyncio.run(run())


def test_a_streamed_line_is_refused_before_the_key_is_charged(tiny_base, tmp_path):
    """A line with stream true is a 400 naming `stream` in the error file, refused before the gateway charges the key:
    it used to be refused after admission, its 30-token output reservation never given back, so the key's live
    request for 30 tokens right after got a 429."""
    backends, gw = gated_gateway(tiny_base, tmp_path, limits={"output_tokens_per_minute": 40})
    streamed = {"model": "m", "prompt": "hello", "max_tokens": 30, "stream": True}

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await status_becomes(c, await submit(c, [line("s", streamed)]), "completed", "failed")
            assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
            [err] = await contents(c, batch["error_file_id"])
            assert (err["response"]["status_code"], err["response"]["body"]["error"]["param"]) == (400, "stream")
            live = await c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 30})
            assert live.status_code == 200, live.text

    asyncio.run(run())


def test_a_key_may_have_only_max_active_per_key_batches_from_one_file(tiny_base, tmp_path):
    """One input file used to back any number of batches: past batch.max_active_per_key active ones the key gets a 429
    too_many_active_batches naming the limit; another key is not affected, and a cancelled batch frees its place."""
    backends, gw = gated_gateway(tiny_base, tmp_path, batch={"max_active_per_key": 2}, keys=(KEY_A, KEY_B))

    async def run():
        async with gw.running() as c:
            a, b = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
            first = await submit(c, [line("x")], KEY_A)  # held on the engine: it stays in progress
            again = {"input_file_id": first["input_file_id"], "endpoint": "/v1/completions", "completion_window": "24h"}
            assert (await c.post("/v1/batches", json=again, headers=a)).status_code == 200
            refused = await c.post("/v1/batches", json=again, headers=a)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "too_many_active_batches" and "batch.max_active_per_key" in error["message"]
            assert (await submit(c, [line("y")], KEY_B))["status"] == "validating"
            assert (await c.post(f"/v1/batches/{first['id']}/cancel", headers=a)).status_code == 200
            assert (await c.post("/v1/batches", json=again, headers=a)).status_code == 200
            for backend in backends.values():
                backend.gate.set()

    asyncio.run(run())


def test_batch_output_counts_against_the_keys_storage_quota(tiny_base, tmp_path):
    """The output is written whatever the quota (OpenAI still produces it) and counted: past the quota the key can
    upload nothing until it deletes the output. The batch's line results are dropped once its files are written."""
    backends, gw = gated_gateway(tiny_base, tmp_path, batch={"max_storage_bytes_per_key": 2048})

    async def run():
        for b in backends.values():
            b.gate.set()
        async with gw.running() as c:
            batch = await status_becomes(c, await submit(c, [line(f"l{i}") for i in range(6)]), "completed", "failed")
            assert batch["status"] == "completed" and len(await contents(c, batch["output_file_id"])) == 6
            used = sum(f["bytes"] for f in (await c.get("/v1/files")).json()["data"])
            assert used > 2048
            small = {"file": ("in.jsonl", line("z") + b"\n")}
            refused = await c.post("/v1/files", files=small, data={"purpose": "batch"})
            assert refused.status_code == 413 and refused.json()["error"]["code"] == "storage_quota_exceeded"
            assert gw.service.store.done_lines(batch["id"]) == set()
            assert (await c.delete(f"/v1/files/{batch['output_file_id']}")).status_code == 200
            assert (await c.post("/v1/files", files=small, data={"purpose": "batch"})).status_code == 200

    asyncio.run(run())


def test_the_gateway_stops_when_its_batch_runner_is_woken_in_the_same_moment(tiny_base, tmp_path):
    """A batch submitted just before shutdown wakes the runner as it is cancelled: the runner still stops (its timed
    wait used to drop that cancel on Python 3.11, and the gateway's shutdown waited for it forever)."""
    _, gw = gated_gateway(tiny_base, tmp_path)

    async def serve_then_stop():
        async with gw.running():
            await asyncio.sleep(0.05)  # the runner is waiting for work
            gw.service.runner.wake.set()
            await asyncio.sleep(0)  # the event's waiter is done; the runner has not resumed yet

    async def run():
        stopping = asyncio.create_task(serve_then_stop())
        done, _ = await asyncio.wait({stopping}, timeout=5)
        for task in gw.service._tasks:  # whatever happened, end the loops before the next test
            task.cancel()
        assert done, "the gateway's shutdown waits for a batch runner that lost its cancel"
        stopping.result()

    asyncio.run(run())
