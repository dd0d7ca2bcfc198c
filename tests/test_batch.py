"""The Batch API end to end, with the official `openai` client against real `swiftkv serve --engine inprocess`
processes on the tiny fixture models: one shared platform (two pools, SQLite store) for the API tests, and
its own processes for the kill -9 tests (SQLite restart; two gateways on the real PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from conftest import fresh_postgres_database
from sqlalchemy import create_engine, text

from services.batch.runner import PoolSlots
from services.gateway.routing import PoolState, RoutePolicy
from services.serving.config import BatchConfig, RoutingConfig

KEY_A, KEY_B = "sk-batch-a", "sk-batch-b"
PUBLIC = "tiny"
MAX_MODEL_LEN = 512
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # ~200 tokens: prompt-heavy with max_tokens 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_args() -> dict:
    return {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 32 << 20,
            "scheduling_policy": "priority"}


class Platform:
    """One `swiftkv serve --engine inprocess` process."""

    def __init__(self, work: Path, name: str, pools: dict, batch: dict, data_dir: Path, database_url: str | None = None):
        self.work, self.name, self.port = work, name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = {"model": PUBLIC, "port": self.port, "pools": pools, "routing": {"ratio_threshold": 4.0},
                  "limits": {"max_body_bytes": 200_000}, "batch": batch}
        (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
        (work / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
        self.args = [str(Path(sys.executable).parent / "swiftkv"), "serve", "--config", str(work / f"{name}.yaml"),
                     "--engine", "inprocess", "--api-keys-file", str(work / "keys"), "--data-dir", str(data_dir)]
        if database_url:
            self.args += ["--database-url", database_url]
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.work / f"{self.name}-{self.starts}.log"

    def start(self) -> "Platform":
        self.starts += 1
        with open(self.log_path, "w") as log:
            # Its own process group: a kill -9 takes the engine processes with it, as a container's would.
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SWIFTKV_API_KEYS": ""},
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 420) -> "Platform":
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"swiftkv serve exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.base}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"not ready after {timeout} s:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.5)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the group (engine processes)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=120)


BATCH = {"completion_windows": {"24h": 86400, "5s": 5}, "max_in_flight": 4, "lease_seconds": 3, "poll_seconds": 0.2,
         "max_file_bytes": 8_000_000}


@pytest.fixture(scope="module")
def platform(tiny_base, tiny_swiftkv, tmp_path_factory):
    work = tmp_path_factory.mktemp("batch")
    pools = {"prefill": {"model": str(tiny_swiftkv), "engine_args": engine_args()},
             "decode": {"model": str(tiny_base), "engine_args": engine_args()}}
    p = Platform(work, "shared", pools, BATCH, work / "data").start()
    try:
        yield p.wait_ready()
    finally:
        p.stop()


@pytest.fixture(scope="module")
def client(platform) -> openai.OpenAI:
    return platform.client()


# ---- helpers -----------------------------------------------------------------------------------------
def jsonl(items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def chat_line(custom_id: str, content: str = "Say something.", max_tokens: int = 8, **extra) -> dict:
    body = {"model": PUBLIC, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True} | extra
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(client: openai.OpenAI, items, purpose: str = "batch") -> str:
    return client.files.create(file=("requests.jsonl", jsonl(items)), purpose=purpose).id


def submit(client: openai.OpenAI, items, window: str = "24h", endpoint: str = "/v1/chat/completions", **kw):
    return client.batches.create(input_file_id=upload(client, items), endpoint=endpoint, completion_window=window, **kw)


def wait_for(client: openai.OpenAI, batch_id: str, until, timeout: float = 300):
    deadline = time.time() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.time() < deadline, f"batch {batch_id} still {b.status} ({b.request_counts})"
        time.sleep(0.2)


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 300):
    return wait_for(client, batch_id, lambda b: b.status in ("completed", "failed", "expired", "cancelled"), timeout)


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def every_line_once(client: openai.OpenAI, b, custom_ids: list[str]) -> tuple[dict, dict]:
    """Output and error files by custom_id; each input custom_id appears exactly once across both."""
    out, err = read_jsonl(client, b.output_file_id), read_jsonl(client, b.error_file_id)
    seen = [line["custom_id"] for line in out + err]
    assert sorted(seen) == sorted(custom_ids), "every custom_id exactly once"
    return {line["custom_id"]: line for line in out}, {line["custom_id"]: line for line in err}


def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the series of `name` carrying these labels."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for series, value in samples.items():
        m = re.match(r"([^{]+)(?:\{(.*)\})?$", series)
        if m.group(1) == name and want <= set(re.findall(r'\w+="[^"]*"', m.group(2) or "")):
            total += value
    return total


# ---- the API -----------------------------------------------------------------------------------------
def test_batch_runs_every_line_through_the_gateway(platform, client):
    before = scrape(platform.base)
    good = [chat_line(f"heavy-{i}", LONG, max_tokens=4) for i in range(5)] + \
           [chat_line(f"light-{i}", "Hi", max_tokens=24) for i in range(4)] + \
           [chat_line("pinned", "Hi", max_tokens=3, model=f"{PUBLIC}-decode")]
    bad = [chat_line("unknown-model", model="no-such-model"), chat_line("bad-field", n=0),
           chat_line("too-long", " ".join(["word"] * 1000)), chat_line("streamed", stream=True)]
    b = submit(client, good + bad, metadata={"job": "nightly"})
    assert b.status in ("validating", "in_progress") and b.endpoint == "/v1/chat/completions" and b.metadata == {"job": "nightly"}
    assert b.expires_at - b.created_at == 86400
    b = finished(client, b.id)
    assert b.status == "completed", b
    assert b.request_counts.total == 14 and b.request_counts.completed == 10 and b.request_counts.failed == 4
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.created_at <= b.in_progress_at <= b.completed_at
    out, err = every_line_once(client, b, [x["custom_id"] for x in good + bad])
    assert set(out) == {x["custom_id"] for x in good} and set(err) == {x["custom_id"] for x in bad}
    for item in good:
        line = out[item["custom_id"]]
        resp = line["response"]
        assert line["error"] is None and line["id"].startswith("batch_req_") and resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == item["body"]["max_tokens"]  # ignore_eos: exactly max_tokens
        assert body["model"] == item["body"]["model"]
    expected = {"unknown-model": (404, "model_not_found"), "bad-field": (400, None), "too-long": (400, "context_length_exceeded"),
                "streamed": (400, None)}
    for custom_id, (status, code) in expected.items():
        resp = err[custom_id]["response"]
        assert resp["status_code"] == status and resp["body"]["error"]["message"], resp
        assert code is None or resp["body"]["error"]["code"] == code
    assert err["bad-field"]["response"]["body"]["error"]["param"] == "n"
    assert err["streamed"]["response"]["body"]["error"]["param"] == "stream"
    usage = b.usage
    assert usage.output_tokens == sum(x["body"]["max_tokens"] for x in good) and usage.input_tokens > 5 * 150

    # The gateway's own metrics saw the lines, labelled source="batch", routed like live traffic.
    after = scrape(platform.base)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert delta("swiftkv_requests_total", source="batch", status="ok") == 10
    assert delta("swiftkv_requests_total", source="live") == 0
    assert delta("swiftkv_route_decisions_total", source="batch", pool="prefill") >= 1
    assert delta("swiftkv_route_decisions_total", source="batch", pool="decode", reason="pinned") == 1
    assert delta("swiftkv_route_decisions_total", source="batch") == 10
    assert delta("swiftkv_requests_rejected_total", source="batch", reason="unknown_model") == 1
    assert delta("swiftkv_batches_finished_total", status="completed") == 1
    assert metric(after, "swiftkv_batch_requests_in_flight") == 0

    # The output is a file of the owner's, listed as such.
    f = client.files.retrieve(b.output_file_id)
    assert f.purpose == "batch_output" and f.bytes == len(client.files.content(b.output_file_id).content)


def test_completions_endpoint(client):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": PUBLIC, "prompt": f"Item {i}:", "max_tokens": 5, "ignore_eos": True}} for i in range(3)]
    b = finished(client, submit(client, lines, endpoint="/v1/completions").id)
    assert b.status == "completed" and b.request_counts.completed == 3
    out, err = every_line_once(client, b, ["c0", "c1", "c2"])
    assert not err and all(line["response"]["body"]["object"] == "text_completion" for line in out.values())
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 5 for line in out.values())


def failed_with(client: openai.OpenAI, content: bytes) -> list:
    file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
    b = finished(client, client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    return b.errors.data


def test_malformed_files_fail_the_batch_naming_the_lines(client):
    errors = failed_with(client, b"hello world\nnot json either\n")
    assert [(e.line, e.code) for e in errors] == [(1, "invalid_json_line"), (2, "invalid_json_line")]
    errors = failed_with(client, jsonl([chat_line("a"), chat_line("b"), chat_line("a")]))
    assert [(e.line, e.code) for e in errors] == [(3, "duplicate_custom_id")] and "line 1" in errors[0].message
    errors = failed_with(client, jsonl([chat_line("a"), chat_line("b") | {"url": "/v1/completions"}]))
    assert [(e.line, e.code, e.param) for e in errors] == [(2, "mismatched_url", "url")]
    errors = failed_with(client, jsonl([{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}]))
    assert errors[0].param == "method"
    errors = failed_with(client, b"\n")
    assert errors[0].code == "empty_file"
    many = b"".join(b'{"custom_id":"%d","method":"POST","url":"/v1/chat/completions","body":{}}\n' % i for i in range(50_001))
    errors = failed_with(client, many)
    assert [(e.line, e.code) for e in errors] == [(50_001, "too_many_requests")] and "50000" in errors[0].message


def test_bad_requests_are_4xx(platform, client):
    with pytest.raises(openai.APIStatusError, match="limited to 8000000 bytes"):
        client.files.create(file=("big.jsonl", b"x" * 8_100_000), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="assistants")
    file_id = upload(client, [chat_line("a")])
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="48h")
    with pytest.raises(openai.BadRequestError, match="unsupported field 'priority'"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", extra_body={"priority": 1})
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": 1})
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    tune = upload(client, [chat_line("a")], purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=tune, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    auth = {"Authorization": f"Bearer {KEY_A}"}
    for method, path, kwargs in [("POST", "/v1/batches", {"content": b"{not json"}), ("POST", "/v1/batches", {"json": [1]}),
                                 ("POST", "/v1/files", {"data": {"purpose": "batch"}}), ("POST", "/v1/files", {"json": {"purpose": "batch"}}),
                                 ("GET", "/v1/batches?limit=0", {}), ("GET", "/v1/batches?limit=abc", {}), ("GET", "/v1/files?order=up", {})]:
        r = httpx.request(method, platform.base + path, headers=auth, **kwargs)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, r.status_code, r.text)


def test_files_and_batches_list_with_pagination(client):
    ids = [upload(client, [chat_line("a")]) for _ in range(3)]
    listed = [f.id for f in client.files.list(purpose="batch", limit=2)]  # the SDK follows `after` across pages
    assert listed[:3] == ids[::-1]
    assert client.files.retrieve(ids[0]).filename == "requests.jsonl"
    assert client.files.delete(ids[0]).deleted and ids[0] not in [f.id for f in client.files.list()]
    batches = [client.batches.create(input_file_id=i, endpoint="/v1/chat/completions", completion_window="24h").id for i in ids[1:]]
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [batches[-1]] and first.has_more
    assert [b.id for b in client.batches.list(limit=1, after=batches[-1]).data] == [batches[0]]
    for b in batches:
        finished(client, b)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batches[0])  # completed: nothing to cancel


# Batches that must still be running when cancelled or expired hold far more tokens than any CPU decodes
# in a test's time (2,000 lines of 400 tokens), so the outcome does not depend on the machine's speed.
LONG_LINES, LONG_TOKENS = 2000, 400


def test_cancel_stops_new_lines_and_keeps_partial_output(platform, client):
    lines = [chat_line(f"c{i}", "Tell a long story.", max_tokens=LONG_TOKENS) for i in range(LONG_LINES)]
    b = submit(client, lines)
    wait_for(client, b.id, lambda x: x.request_counts.completed >= 2)
    # Lines of one batch start and finish together, so the gauge dips to 0 while they are recorded: sample
    # it until it shows work in flight, and check every sample against the bound.
    deadline = time.time() + 60
    while True:
        m = scrape(platform.base)
        assert metric(m, "swiftkv_batch_requests_in_flight") <= 2 * BATCH["max_in_flight"]
        assert all(metric(m, "swiftkv_batch_requests_in_flight", pool=pool) <= BATCH["max_in_flight"] for pool in ("prefill", "decode"))
        if metric(m, "swiftkv_batch_requests_in_flight") >= 1:
            break
        assert time.time() < deadline, "no batch request in flight while the batch runs"
        time.sleep(0.05)
    assert metric(m, "swiftkv_batch_in_flight_limit", pool="decode") == BATCH["max_in_flight"]
    # the backlog gauge counts from this batch's created_at. It is refreshed every poll_seconds, later when the
    # two cores are busy with the engines, so only its upper bound is exact.
    age = metric(m, "swiftkv_batch_oldest_pending_age_seconds")
    assert 0 < age <= time.time() - b.created_at + 1, (age, time.time() - b.created_at)
    live = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})  # live traffic is served beside the batch
    assert live.usage.completion_tokens == 3
    assert metric(scrape(platform.base), "swiftkv_requests_total", source="live", status="ok") >= 1
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at
    b = finished(client, b.id, timeout=60)
    assert b.status == "cancelled" and b.cancelled_at
    assert 2 <= b.request_counts.completed < LONG_LINES and b.request_counts.failed == 0
    out, err = every_line_once(client, b, [x["custom_id"] for x in lines])
    assert len(out) == b.request_counts.completed
    assert {e["error"]["code"] for e in err.values()} == {"batch_cancelled"} and all(e["response"] is None for e in err.values())
    assert client.batches.cancel(b.id).status == "cancelled"  # cancelling again is harmless
    deadline = time.time() + 10  # nothing left to run: the backlog gauge falls back to 0
    while metric(scrape(platform.base), "swiftkv_batch_oldest_pending_age_seconds") != 0:
        assert time.time() < deadline, "the backlog gauge stays above 0 with no batch pending"
        time.sleep(0.2)


def test_expired_batch_keeps_the_lines_done(client):
    # The first lines are short, so some are done well inside the window even on a busy machine.
    lines = [chat_line(f"e{i}", "Tell a long story.", max_tokens=2 if i < 4 else LONG_TOKENS) for i in range(LONG_LINES)]
    b = submit(client, lines, window="5s")
    assert b.completion_window == "5s" and b.expires_at - b.created_at == 5
    b = finished(client, b.id, timeout=120)
    assert b.status == "expired" and b.expired_at >= b.expires_at
    assert 1 <= b.request_counts.completed < LONG_LINES
    out, err = every_line_once(client, b, [x["custom_id"] for x in lines])
    assert len(out) == b.request_counts.completed
    assert {e["error"]["code"] for e in err.values()} == {"batch_expired"}


def test_a_key_sees_only_its_own_files_and_batches(platform, client):
    other = platform.client(KEY_B)
    mine = submit(client, [chat_line("a", max_tokens=2)])
    file_id = mine.input_file_id
    for call in (lambda: other.files.retrieve(file_id), lambda: other.files.content(file_id), lambda: other.files.delete(file_id),
                 lambda: other.batches.retrieve(mine.id), lambda: other.batches.cancel(mine.id),
                 lambda: other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in other.files.list()] and mine.id not in [b.id for b in other.batches.list()]
    theirs = submit(other, [chat_line("b", max_tokens=2)])
    assert [b.id for b in other.batches.list()] == [theirs.id]
    done = finished(client, mine.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert finished(other, theirs.id).status == "completed"
    with pytest.raises(openai.AuthenticationError):
        platform.client("sk-wrong").files.list()
    assert httpx.get(f"{platform.base}/v1/batches").status_code == 401


def test_batch_work_yields_to_live_traffic_on_a_pool():
    """PoolSlots against the gateway's own pool state and route policy: the bound drops to min_in_flight on a
    live-busy pool, lines routed to a live-busy SwiftKV pool are steered to a quiet base-model pool (also while
    they wait for a slot), and the bound is back at max_in_flight once the pool has been quiet."""
    async def run():
        policy = RoutePolicy(RoutingConfig(ratio_threshold=4))
        pools = {name: PoolState(name, backend=None, served_model_name=f"m-{name}", ready=True) for name in ("prefill", "decode")}
        slots = PoolSlots(BatchConfig(max_in_flight=3, min_in_flight=1, live_quiet_seconds=0.3), pools, policy)
        heavy, pinned = policy.decide(400, 10, pools), policy.decide(20, 200, pools, pinned="decode")
        held = []

        async def enter(decision):
            cm = slots(decision)
            placed = await cm.__aenter__()
            held.append(cm)
            return placed

        for _ in range(3):
            assert (await enter(heavy)).pool == "prefill"
        assert slots.allowed("prefill") == 3
        pools["prefill"].live_started()  # a live request on the SwiftKV pool
        assert slots.allowed("prefill") == 1
        placed = await enter(heavy)
        assert (placed.pool, placed.reason) == ("decode", "batch_steered")
        pools["decode"].live_started()  # now on both: lines stay on their pool, which takes min_in_flight
        assert slots.allowed("decode") == 1
        blocked = asyncio.create_task(enter(pinned))
        await asyncio.sleep(0.25)
        assert not blocked.done()  # the base-model pool has its one batch request in flight
        pools["decode"].live_ended()
        await asyncio.sleep(0.1)
        assert not blocked.done()  # the quiet time after a live request ends still counts as live-busy
        assert (await asyncio.wait_for(blocked, 1)).pool == "decode"
        waiting = asyncio.create_task(enter(heavy))  # prefill: 3 in flight, live-busy; decode: 2 in flight, quiet
        assert (await asyncio.wait_for(waiting, 1)).reason == "batch_steered"
        for cm in held[:3]:
            await cm.__aexit__(None, None, None)
        pools["prefill"].live_ended()
        waiting = asyncio.create_task(enter(heavy))  # decode is full; prefill takes it once it has been quiet 0.3 s
        placed = await asyncio.wait_for(waiting, 1)
        assert (placed.pool, placed.reason) == ("prefill", "ratio") and slots.allowed("prefill") == 3
        for cm in held[3:]:
            await cm.__aexit__(None, None, None)
        assert not any(slots.busy.values())
    asyncio.run(run())


class GatedBackend:
    """An engine stand-in for the runner's side of preemption: batch requests (priority > 0) wait before their
    first token until `gate` opens, live ones answer at once; it counts the requests aborted while waiting."""

    def __init__(self, name: str):
        self.name = name
        self.gate = asyncio.Event()
        self.waiting = self.aborted = self.served = 0

    async def generate(self, request):
        from services.serving.backend import ChoiceDelta, Output

        if request.priority > 0:
            self.waiting += 1
            try:
                await self.gate.wait()
            except (asyncio.CancelledError, GeneratorExit):
                self.aborted += 1
                raise
            finally:
                self.waiting -= 1
        self.served += 1
        yield Output([ChoiceDelta(0, "x", 1, "length")])

    async def health(self) -> bool:
        return True


def gated_gateway(tiny_base, data_dir, batch: dict | None = None, keys: tuple[str, ...] = (), **platform):
    """A gateway with the Batch API over a SwiftKV pool ("prefill") and a base pool ("decode") of GatedBackends;
    `batch` overrides batch settings, `keys` are the API keys (none: no key needed)."""
    from services.batch.service import BatchService
    from services.gateway.app import Gateway, create_app
    from services.gateway.auth import KeyStore, load_keys
    from services.gateway.prompts import Prompter
    from services.serving.config import PlatformConfig

    pool_cfg = {"model": str(tiny_base), "engine_args": {"max_model_len": 64}}
    cfg = PlatformConfig(model="m", data_dir=str(data_dir), pools={"prefill": pool_cfg, "decode": pool_cfg},
                         batch={"max_in_flight": 3, "min_in_flight": 1, "live_quiet_seconds": 60, "poll_seconds": 0.1} | (batch or {}),
                         **platform)
    backends = {"prefill": GatedBackend("prefill"), "decode": GatedBackend("decode")}
    gateway = Gateway(cfg, backends, Prompter(str(tiny_base)), KeyStore(load_keys(",".join(keys), None)))
    for pool in gateway.pools.values():
        pool.ready = True
    service = BatchService(cfg)
    service.attach(gateway)
    return backends, service, create_app(gateway, [service])


PROMPT_HEAVY = {"model": "m", "prompt": "hello " * 20, "max_tokens": 1}  # the ratio picks the SwiftKV pool ("prefill")


@contextlib.asynccontextmanager
async def running(service, app, host: str = "gw"):
    """The batch service started, and a client of its gateway app; the service stopped after."""
    await service.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}") as c:
            yield c
    finally:
        await service.stop()


async def until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def start_batch(c: httpx.AsyncClient, lines: int = 3) -> dict:
    data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": PROMPT_HEAVY}) + "\n"
                   for i in range(lines))
    f = (await c.post("/v1/files", files={"file": ("in.jsonl", data.encode())}, data={"purpose": "batch"})).json()
    return (await c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"})).json()


async def completes_every_line_once(c: httpx.AsyncClient, batch: dict) -> None:
    async def completed():
        nonlocal batch
        batch = (await c.get(f"/v1/batches/{batch['id']}")).json()
        return batch["status"] == "completed"
    await until(completed)
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = (await c.get(f"/v1/files/{batch['output_file_id']}/content")).text
    assert sorted(json.loads(x)["custom_id"] for x in out.splitlines()) == ["l0", "l1", "l2"]


async def live_request_moves_two_prefills(batch_backends: dict, live: httpx.AsyncClient) -> None:
    """Once the 3 batch lines wait on the SwiftKV pool (`batch_backends`), a live prompt-heavy request (sent through
    `live`, this gateway or another) is routed there, and the batch runner moves two of its lines to the base pool."""
    async def prefilling():
        return batch_backends["prefill"].waiting == 3
    await until(prefilling)
    r = await live.post("/v1/completions", json=PROMPT_HEAVY)
    assert r.status_code == 200 and "pool=prefill" in r.headers["x-swiftkv-route"]

    async def moved():
        return batch_backends["decode"].served == 2
    await until(moved)


def test_a_live_request_aborts_batch_prefills_on_its_pool_and_their_lines_run_again(tiny_base, tmp_path):
    """Three batch lines prefill on the SwiftKV pool; a live request arrives there: the two youngest are aborted
    (min_in_flight 1 stays), run again on the quiet base-model pool, and the batch completes with every line once."""
    from prometheus_client import REGISTRY

    backends, service, app = gated_gateway(tiny_base, tmp_path)
    preempted = lambda: REGISTRY.get_sample_value("swiftkv_batch_requests_preempted_total", {"pool": "prefill"}) or 0.0  # noqa: E731

    def batch_requests(status: str) -> float:
        return sum(s.value for m in REGISTRY.collect() if m.name == "swiftkv_requests" for s in m.samples
                   if s.name == "swiftkv_requests_total" and s.labels["pool"] == "prefill"
                   and s.labels["source"] == "batch" and s.labels["status"] == status)

    async def run():
        before = preempted()
        aborted, disconnected = batch_requests("aborted"), batch_requests("client_disconnect")
        backends["decode"].gate.set()
        async with running(service, app) as c:
            batch = await start_batch(c)
            await live_request_moves_two_prefills(backends, c)
            assert (backends["prefill"].aborted, backends["prefill"].waiting, preempted()) == (2, 1, before + 2)
            # counted as aborted by the runner, not as clients that went away
            assert (batch_requests("aborted"), batch_requests("client_disconnect")) == (aborted + 2, disconnected)
            backends["prefill"].gate.set()
            await completes_every_line_once(c, batch)

    asyncio.run(run())


def test_batch_work_makes_way_for_live_traffic_at_another_gateway_process(tiny_base, tmp_path):
    """Two gateway processes sharing the Redis at 127.0.0.1:6379 (`swiftkv serve --workers 2`): batch lines prefill on
    gateway b's SwiftKV pool; a live request arrives at gateway a, on its SwiftKV pool: b aborts two of its prefills
    and runs those lines on its base-model pool, as it would for a live request of its own."""
    import redis

    from services.batch.live import CHANNEL

    a_backends, a_service, a_app = gated_gateway(tiny_base, tmp_path / "a", redis_url="redis://127.0.0.1:6379/0")
    b_backends, b_service, b_app = gated_gateway(tiny_base, tmp_path / "b", redis_url="redis://127.0.0.1:6379/0")
    subscribers = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    listening = subscribers.pubsub_numsub(CHANNEL)[0][1]

    async def run():
        b_backends["decode"].gate.set()
        async with running(a_service, a_app, "a") as a, running(b_service, b_app, "b") as b:
            async def subscribed():
                return subscribers.pubsub_numsub(CHANNEL)[0][1] >= listening + 2
            await until(subscribed)
            batch = await start_batch(b)
            await live_request_moves_two_prefills(b_backends, a)  # the live request at the other gateway
            assert (b_backends["prefill"].aborted, b_backends["prefill"].waiting) == (2, 1)
            b_backends["prefill"].gate.set()
            await completes_every_line_once(b, batch)

    asyncio.run(run())


def test_an_unreachable_redis_leaves_each_process_its_own_live_traffic(tiny_base, tmp_path):
    """redis_url pointing nowhere: the gateway still serves and preempts for its own live traffic, reports the
    sharing off (swiftkv_batch_live_traffic_shared 0) and stops cleanly."""
    from prometheus_client import REGISTRY

    backends, service, app = gated_gateway(tiny_base, tmp_path, redis_url="redis://127.0.0.1:1/0")

    async def run():
        backends["decode"].gate.set()
        async with running(service, app) as c:
            batch = await start_batch(c)
            await live_request_moves_two_prefills(backends, c)
            assert REGISTRY.get_sample_value("swiftkv_batch_live_traffic_shared") == 0
            backends["prefill"].gate.set()
            await completes_every_line_once(c, batch)

    asyncio.run(run())


# ---- crashes -----------------------------------------------------------------------------------------
SLOW_BATCH = BATCH | {"max_in_flight": 2, "lease_seconds": 2}


def decode_only(tiny_base) -> dict:
    return {"decode": {"model": str(tiny_base), "engine_args": engine_args()}}


def batch_lines(n: int) -> list[dict]:
    return [chat_line(f"k{i}", "Tell a long story.", max_tokens=100) for i in range(n)]


@pytest.mark.slow
def test_kill_9_mid_batch_then_restart_resumes_exactly_once(tiny_base, tmp_path):
    p = Platform(tmp_path, "crash", decode_only(tiny_base), SLOW_BATCH, tmp_path / "data").start().wait_ready()
    try:
        client = p.client()
        lines = batch_lines(80)
        b = submit(client, lines)
        wait_for(client, b.id, lambda x: x.request_counts.completed >= 3)
        p.kill9()
        db = create_engine(f"sqlite:///{tmp_path / 'data' / 'swiftkv.db'}")
        with db.connect() as conn:  # what the dead process committed; lines it had in flight are lost with it
            committed = conn.execute(text("SELECT count(*) FROM swiftkv_batch_results WHERE batch_id = :id"), {"id": b.id}).scalar_one()
        db.dispose()
        assert committed < len(lines), "the batch finished before the kill: give it more lines"
        p.start().wait_ready()
        b = finished(client, b.id)
        assert b.status == "completed" and b.request_counts.completed == len(lines) and b.request_counts.failed == 0
        every_line_once(client, b, [x["custom_id"] for x in lines])
        # The restarted process served exactly what was not committed, once each: not the whole batch again.
        assert metric(scrape(p.base), "swiftkv_requests_total", source="batch", status="ok") == len(lines) - committed
    finally:
        p.stop()


@pytest.fixture
def pg_database():
    with fresh_postgres_database("swiftkv_batch") as url:
        yield url


@pytest.mark.slow
def test_two_gateways_on_postgres_share_work_and_take_over_from_a_dead_one(tiny_base, tmp_path, pg_database):
    data = tmp_path / "data"  # the shared file store (a PVC in a cluster)
    gateways = [Platform(tmp_path, f"gw{i}", decode_only(tiny_base), SLOW_BATCH, data, pg_database) for i in range(2)]
    try:
        for g in gateways:  # one at a time: engines compete for the same cores while they start
            g.start().wait_ready()
        client = gateways[0].client()
        lines = batch_lines(40)
        b = submit(client, lines)
        b = wait_for(client, b.id, lambda x: x.request_counts.completed >= 6)
        db = create_engine(pg_database.replace("postgresql://", "postgresql+psycopg://"))
        with db.connect() as conn:
            holder = conn.execute(text("SELECT lease_owner FROM swiftkv_batches WHERE id = :id"), {"id": b.id}).scalar_one()
        db.dispose()
        pids = [g.proc.pid for g in gateways]
        holder_pid = int(holder.split(":")[1])
        assert holder_pid in pids
        dead, alive = (gateways[0], gateways[1]) if holder_pid == pids[0] else (gateways[1], gateways[0])
        dead.kill9()
        b = finished(alive.client(), b.id)  # the survivor takes the lapsed lease and finishes
        assert b.status == "completed" and b.request_counts.completed == 40 and b.request_counts.failed == 0
        every_line_once(alive.client(), b, [x["custom_id"] for x in lines])
        assert metric(scrape(alive.base), "swiftkv_requests_total", source="batch", status="ok") >= 1
    finally:
        for g in gateways:
            g.stop()


# ---- settings ----------------------------------------------------------------------------------------
def test_store_settings_from_yaml_env_and_flags(tiny_base, tmp_path, monkeypatch):
    from services.serve import ServeSettings
    from services.serving.config import load_config

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"pools": {"decode": {"model": str(tiny_base)}}, "data_dir": "/srv/a",
                                    "batch": {"max_in_flight": 2, "priority": 5, "completion_windows": {"24h": 60}}}))
    cfg = load_config(path)
    assert (cfg.data_dir, cfg.database_url, cfg.batch.max_in_flight, cfg.batch.priority) == ("/srv/a", None, 2, 5)
    assert load_config(path, {"data_dir": "/srv/b", "database_url": "postgresql://h/db"}).database_url == "postgresql://h/db"
    monkeypatch.setenv("SWIFTKV_DATA_DIR", "/srv/c")
    monkeypatch.setenv("SWIFTKV_DATABASE_URL", "postgresql://h/env")
    settings = ServeSettings()
    assert (settings.data_dir, settings.database_url) == ("/srv/c", "postgresql://h/env")
    with pytest.raises(ValueError, match="min_in_flight"):
        BatchConfig(max_in_flight=1, min_in_flight=2)


def test_serve_refuses_an_unreachable_database(tiny_base, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"port": free_port(), "pools": {"decode": {"model": str(tiny_base)}}}))
    swiftkv = Path(sys.executable).parent / "swiftkv"
    r = subprocess.run([str(swiftkv), "serve", "--config", str(path), "--engine", "inprocess", "--data-dir", str(tmp_path / "d"),
                        "--database-url", "postgresql://postgres@127.0.0.1:1/nothing"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "batch store" in r.stderr + r.stdout, r.stderr[-2000:]
