"""The Batch API. Its HTTP behaviour (files, batches, validation, pagination, cancel, expiry, ownership, preemption
for live traffic) runs against the real app in this process over the fake backend (harness.FakeBackend), served by
uvicorn in a thread for the official `openai` client; one batch runs through the real engines of the shared platform
(conftest's `platform`); the kill -9 tests run `swiftkv serve` processes (SQLite restart; two gateways on the real
PostgreSQL) whose pool is a remote server: an in-process gateway over the fake backend."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from harness import HTTP_TIMEOUT, FakeBackend, free_port, metric, scrape, swiftkv_serve
from harness.batch import (
    PROMPT_HEAVY,
    chat_line,
    every_line_once,
    finished,
    gated_gateway,
    jsonl,
    start_batch,
    submit,
    until,
    upload,
    wait_for,
)
from harness.engines import KEY
from harness.gateway import InProcessGateway, ThreadedServer, platform_config
from harness.postgres import fresh_postgres_database
from sqlalchemy import create_engine, text

from services.batch.runner import PoolSlots
from services.config import BatchConfig, RoutingConfig
from services.gateway.routing import PoolState, RoutePolicy

pytestmark = pytest.mark.shares("redis")

KEY_A, KEY_B = "sk-batch-a", "sk-batch-b"
PUBLIC = "tiny"
MAX_MODEL_LEN = 512
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # ~200 tokens: prompt-heavy with max_tokens 4
BATCH = {"completion_windows": {"24h": 86400, "5s": 5}, "max_in_flight": 4, "lease_seconds": 3, "poll_seconds": 0.2,
         "max_file_bytes": 8_000_000}


@pytest.fixture(scope="module")
def served(tiny_base, tmp_path_factory):
    """The gateway with the Batch API over two pools of fake engines that answer max_tokens tokens (as with
    ignore_eos), 50 every 0.2 s: a line of 400 tokens takes 1.6 s, so a batch of many is still running when cancelled
    or expired, whatever the machine."""
    cfg = platform_config(tiny_base, max_model_len=MAX_MODEL_LEN, model=PUBLIC, data_dir=str(tmp_path_factory.mktemp("batch")),
                          routing={"ratio_threshold": 4.0}, limits={"max_body_bytes": 200_000}, batch=BATCH)
    gw = InProcessGateway(cfg, {name: FakeBackend(name, tokens=None, chunk=50, delay=0.2) for name in cfg.pools}, keys=(KEY_A, KEY_B))
    with ThreadedServer(gw) as server:
        yield server


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client(KEY_A, timeout=120)


# ---- the API -----------------------------------------------------------------------------------------
@pytest.mark.engine
def test_batch_runs_every_line_through_the_gateway(platform):
    """Every line through the real engines (both pools, by ratio and pinned), the refused ones in the error file."""
    client = platform.client(KEY)
    before = scrape(platform.base)
    good = [chat_line(f"heavy-{i}", LONG, max_tokens=4) for i in range(5)] + \
           [chat_line(f"light-{i}", "Hi", max_tokens=24) for i in range(4)] + \
           [chat_line("pinned", "Hi", max_tokens=3, model=f"{PUBLIC}-base")]
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
    assert delta("swiftkv_route_decisions_total", source="batch", pool="swiftkv") >= 1
    assert delta("swiftkv_route_decisions_total", source="batch", pool="base", reason="pinned") == 1
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


def test_bad_requests_are_4xx(served, client):
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
        r = httpx.request(method, served.base + path, headers=auth, **kwargs)
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


# Batches that must still be running when cancelled or expired hold far more lines than the fake engines answer in a
# test's time (2,000 lines of 400 tokens, 1.6 s each, 8 at a time), so the outcome does not depend on the machine's speed.
LONG_LINES, LONG_TOKENS = 2000, 400


def test_cancel_stops_new_lines_and_keeps_partial_output(served, client):
    lines = [chat_line(f"c{i}", "Tell a long story.", max_tokens=LONG_TOKENS) for i in range(LONG_LINES)]
    b = submit(client, lines)
    wait_for(client, b.id, lambda x: x.request_counts.completed >= 2)
    # Lines of one batch start and finish together, so the gauge dips to 0 while they are recorded: sample
    # it until it shows work in flight, and check every sample against the bound.
    deadline = time.time() + 60
    while True:
        m = scrape(served.base)
        assert metric(m, "swiftkv_batch_requests_in_flight") <= 2 * BATCH["max_in_flight"]
        assert all(metric(m, "swiftkv_batch_requests_in_flight", pool=pool) <= BATCH["max_in_flight"] for pool in ("swiftkv", "base"))
        if metric(m, "swiftkv_batch_requests_in_flight") >= 1:
            break
        assert time.time() < deadline, "no batch request in flight while the batch runs"
        time.sleep(0.05)
    assert metric(m, "swiftkv_batch_in_flight_limit", pool="base") == BATCH["max_in_flight"]
    # the backlog gauge counts from this batch's created_at. It is refreshed every poll_seconds, later when the
    # two cores are busy with the engines, so only its upper bound is exact.
    age = metric(m, "swiftkv_batch_oldest_pending_age_seconds")
    assert 0 < age <= time.time() - b.created_at + 1, (age, time.time() - b.created_at)
    live = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})  # live traffic is served beside the batch
    assert live.usage.completion_tokens == 3
    assert metric(scrape(served.base), "swiftkv_requests_total", source="live", status="ok") >= 1
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
    while metric(scrape(served.base), "swiftkv_batch_oldest_pending_age_seconds") != 0:
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


def test_a_key_sees_only_its_own_files_and_batches(served, client):
    other = served.client(KEY_B)
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
        served.client("sk-wrong").files.list()
    assert httpx.get(f"{served.base}/v1/batches", timeout=HTTP_TIMEOUT).status_code == 401


def test_batch_work_yields_to_live_traffic_on_a_pool():
    """PoolSlots against the gateway's own pool state and route policy: the bound drops to min_in_flight on a
    live-busy pool, lines routed to a live-busy SwiftKV pool are steered to a quiet base-model pool (also while
    they wait for a slot), and the bound is back at max_in_flight once the pool has been quiet."""
    async def run():
        policy = RoutePolicy(RoutingConfig(ratio_threshold=4))
        pools = {name: PoolState(name, backend=None, served_model_name=f"m-{name}", ready=True) for name in ("swiftkv", "base")}
        slots = PoolSlots(BatchConfig(max_in_flight=3, min_in_flight=1, live_quiet_seconds=0.3), pools, policy)
        heavy, pinned = policy.decide(400, 10, pools), policy.decide(20, 200, pools, pinned="base")
        held = []

        async def enter(decision):
            cm = slots(decision)
            placed = await cm.__aenter__()
            held.append(cm)
            return placed

        for _ in range(3):
            assert (await enter(heavy)).pool == "swiftkv"
        assert slots.allowed("swiftkv") == 3
        pools["swiftkv"].live_started()  # a live request on the SwiftKV pool
        assert slots.allowed("swiftkv") == 1
        placed = await enter(heavy)
        assert (placed.pool, placed.reason) == ("base", "batch_steered")
        pools["base"].live_started()  # now on both: lines stay on their pool, which takes min_in_flight
        assert slots.allowed("base") == 1
        blocked = asyncio.create_task(enter(pinned))
        await asyncio.sleep(0.25)
        assert not blocked.done()  # the base-model pool has its one batch request in flight
        pools["base"].live_ended()
        await asyncio.sleep(0.1)
        assert not blocked.done()  # the quiet time after a live request ends still counts as live-busy
        assert (await asyncio.wait_for(blocked, 1)).pool == "base"
        waiting = asyncio.create_task(enter(heavy))  # swiftkv: 3 in flight, live-busy; base: 2 in flight, quiet
        assert (await asyncio.wait_for(waiting, 1)).reason == "batch_steered"
        for cm in held[:3]:
            await cm.__aexit__(None, None, None)
        pools["swiftkv"].live_ended()
        waiting = asyncio.create_task(enter(heavy))  # base is full; swiftkv takes it once it has been quiet 0.3 s
        placed = await asyncio.wait_for(waiting, 1)
        assert (placed.pool, placed.reason) == ("swiftkv", "ratio") and slots.allowed("swiftkv") == 3
        for cm in held[3:]:
            await cm.__aexit__(None, None, None)
        assert not any(slots.busy.values())
    asyncio.run(run())


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
        return batch_backends["swiftkv"].waiting == 3
    await until(prefilling)
    r = await live.post("/v1/completions", json=PROMPT_HEAVY)
    assert r.status_code == 200 and "pool=swiftkv" in r.headers["x-swiftkv-route"]

    async def moved():
        return batch_backends["base"].served == 2
    await until(moved)


def test_a_live_request_aborts_batch_prefills_on_its_pool_and_their_lines_run_again(tiny_base, tmp_path):
    """Three batch lines prefill on the SwiftKV pool; a live request arrives there: the two youngest are aborted
    (min_in_flight 1 stays), run again on the quiet base-model pool, and the batch completes with every line once."""
    from prometheus_client import REGISTRY

    backends, gw = gated_gateway(tiny_base, tmp_path)
    preempted = lambda: REGISTRY.get_sample_value("swiftkv_batch_requests_preempted_total", {"pool": "swiftkv"}) or 0.0  # noqa: E731

    def batch_requests(status: str) -> float:
        return sum(s.value for m in REGISTRY.collect() if m.name == "swiftkv_requests" for s in m.samples
                   if s.name == "swiftkv_requests_total" and s.labels["pool"] == "swiftkv"
                   and s.labels["source"] == "batch" and s.labels["status"] == status)

    async def run():
        before = preempted()
        aborted, disconnected = batch_requests("aborted"), batch_requests("client_disconnect")
        backends["base"].gate.set()
        async with gw.running() as c:
            batch = await start_batch(c)
            await live_request_moves_two_prefills(backends, c)
            assert (backends["swiftkv"].aborted, backends["swiftkv"].waiting, preempted()) == (2, 1, before + 2)
            # counted as aborted by the runner, not as clients that went away
            assert (batch_requests("aborted"), batch_requests("client_disconnect")) == (aborted + 2, disconnected)
            backends["swiftkv"].gate.set()
            await completes_every_line_once(c, batch)

    asyncio.run(run())


def test_batch_work_makes_way_for_live_traffic_at_another_gateway_process(tiny_base, tmp_path):
    """Two gateway processes sharing the Redis at 127.0.0.1:6379 (`swiftkv serve --workers 2`): batch lines prefill on
    gateway b's SwiftKV pool; a live request arrives at gateway a, on its SwiftKV pool: b aborts two of its prefills
    and runs those lines on its base-model pool, as it would for a live request of its own."""
    import redis

    from services.batch.live import CHANNEL

    channel = f"swiftkv:{CHANNEL}"  # under the default redis_prefix
    a_backends, a_gw = gated_gateway(tiny_base, tmp_path / "a", redis_url="redis://127.0.0.1:6379/0")
    b_backends, b_gw = gated_gateway(tiny_base, tmp_path / "b", redis_url="redis://127.0.0.1:6379/0")
    subscribers = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    listening = subscribers.pubsub_numsub(channel)[0][1]

    async def run():
        b_backends["base"].gate.set()
        async with a_gw.running(host="a") as a, b_gw.running(host="b") as b:
            async def subscribed():
                return subscribers.pubsub_numsub(channel)[0][1] >= listening + 2
            await until(subscribed)
            batch = await start_batch(b)
            await live_request_moves_two_prefills(b_backends, a)  # the live request at the other gateway
            assert (b_backends["swiftkv"].aborted, b_backends["swiftkv"].waiting) == (2, 1)
            b_backends["swiftkv"].gate.set()
            await completes_every_line_once(b, batch)

    asyncio.run(run())


def test_an_unreachable_redis_leaves_each_process_its_own_live_traffic(tiny_base, tmp_path):
    """redis_url pointing nowhere: the gateway still serves and preempts for its own live traffic, reports the
    sharing off (swiftkv_batch_live_traffic_shared 0) and stops cleanly."""
    from prometheus_client import REGISTRY

    backends, gw = gated_gateway(tiny_base, tmp_path, redis_url="redis://127.0.0.1:1/0")

    async def run():
        backends["base"].gate.set()
        async with gw.running() as c:
            batch = await start_batch(c)
            await live_request_moves_two_prefills(backends, c)
            assert REGISTRY.get_sample_value("swiftkv_batch_live_traffic_shared") == 0
            backends["swiftkv"].gate.set()
            await completes_every_line_once(c, batch)

    asyncio.run(run())


# ---- crashes ----------------------------------------------------------------------------------------
SLOW_BATCH = BATCH | {"max_in_flight": 2, "lease_seconds": 2}


@pytest.fixture(scope="module")
def upstream(tiny_base, tmp_path_factory):
    """The pool the crashing gateways send their lines to, as a remote OpenAI server: an in-process gateway over a fake
    engine that answers max_tokens tokens, 10 every 0.05 s (a line of 100 tokens takes half a second)."""
    cfg = platform_config(tiny_base, pools=("base",), max_model_len=MAX_MODEL_LEN, model="upstream",
                          data_dir=str(tmp_path_factory.mktemp("upstream")))
    with ThreadedServer(InProcessGateway(cfg, {"base": FakeBackend("base", tokens=None, chunk=10, delay=0.05)}, batch=False)) as server:
        yield server


def crash_platform(work: Path, name: str, upstream, tiny_base, data_dir: Path, database_url: str | None = None):
    """A `swiftkv serve` process with the Batch API and one pool, `upstream`, as a remote server (not started)."""
    (work / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    config = {"model": PUBLIC, "pools": {"base": {"backend": "remote", "url": f"{upstream.base}/v1", "model": str(tiny_base),
                                                  "served_model_name": "upstream", "engine_args": {"max_model_len": MAX_MODEL_LEN}}},
              "batch": SLOW_BATCH,
              # the keys share the prefix cache: per-key caches send vLLM's cache_salt, which the upstream gateway refuses
              "routing": {"share_prefix_cache": True}}
    args = ["--engine", "inprocess", "--api-keys-file", str(work / "keys"), "--data-dir", str(data_dir)]
    return swiftkv_serve(work, config, *args, *(["--database-url", database_url] if database_url else []), name=name)


def batch_lines(n: int) -> list[dict]:
    return [chat_line(f"k{i}", "Tell a long story.", max_tokens=100) for i in range(n)]


@pytest.mark.slow
def test_kill_9_mid_batch_then_restart_resumes_exactly_once(upstream, tiny_base, tmp_path):
    with crash_platform(tmp_path, "crash", upstream, tiny_base, tmp_path / "data") as p:
        p.start().wait(timeout=120)
        client = p.client(KEY_A)
        lines = batch_lines(40)  # 10 s of work (2 in flight, half a second each): the kill comes after 3
        b = submit(client, lines)
        wait_for(client, b.id, lambda x: x.request_counts.completed >= 3)
        p.kill9()
        db = create_engine(f"sqlite:///{tmp_path / 'data' / 'swiftkv.db'}")
        with db.connect() as conn:  # what the dead process committed; lines it had in flight are lost with it
            committed = conn.execute(text("SELECT count(*) FROM swiftkv_batch_results WHERE batch_id = :id"), {"id": b.id}).scalar_one()
        db.dispose()
        assert committed < len(lines), "the batch finished before the kill: give it more lines"
        p.start().wait(timeout=120)
        b = finished(client, b.id)
        assert b.status == "completed" and b.request_counts.completed == len(lines) and b.request_counts.failed == 0
        every_line_once(client, b, [x["custom_id"] for x in lines])
        # The restarted process served exactly what was not committed, once each: not the whole batch again.
        assert metric(scrape(p.base), "swiftkv_requests_total", source="batch", status="ok") == len(lines) - committed


@pytest.fixture
def pg_database():
    with fresh_postgres_database("swiftkv_batch") as url:
        yield url


@pytest.mark.slow
def test_two_gateways_on_postgres_share_work_and_take_over_from_a_dead_one(upstream, tiny_base, tmp_path, pg_database):
    data = tmp_path / "data"  # the shared file store (a PVC in a cluster)
    gateways = [crash_platform(tmp_path, f"gw{i}", upstream, tiny_base, data, pg_database) for i in range(2)]
    try:
        for g in gateways:
            g.start()
        for g in gateways:
            g.wait(timeout=120)
        client = gateways[0].client(KEY_A)
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
        b = finished(alive.client(KEY_A), b.id)  # the survivor takes the lapsed lease and finishes
        assert b.status == "completed" and b.request_counts.completed == 40 and b.request_counts.failed == 0
        every_line_once(alive.client(KEY_A), b, [x["custom_id"] for x in lines])
        assert metric(scrape(alive.base), "swiftkv_requests_total", source="batch", status="ok") >= 1
    finally:
        for g in gateways:
            g.stop()


# ---- settings ----------------------------------------------------------------------------------------
def test_store_settings_from_yaml_env_and_flags(tiny_base, tmp_path, monkeypatch):
    from services.config import load_config
    from services.serve import ServeSettings

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"pools": {"base": {"model": str(tiny_base)}}, "data_dir": "/srv/a",
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


@pytest.mark.slow
def test_serve_refuses_an_unreachable_database(tiny_base, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"port": free_port(), "pools": {"base": {"model": str(tiny_base)}}}))
    swiftkv = Path(sys.executable).parent / "swiftkv"
    r = subprocess.run([str(swiftkv), "serve", "--config", str(path), "--engine", "inprocess", "--data-dir", str(tmp_path / "d"),
                        "--database-url", "postgresql://postgres@127.0.0.1:1/nothing"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "batch store" in r.stderr + r.stdout, r.stderr[-2000:]
