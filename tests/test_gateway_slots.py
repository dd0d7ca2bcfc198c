"""Request slots (services/gateway/slots.py) and the output of a request without max_tokens (dispatch.tracked), in-process
over the fake backend: per-key counts from arrival, the shared slot taken once the body is in, the bounded fair wait
before a 503, a client leaving while it waits; a request without max_tokens settled as it streams."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from harness import FakeBackend

from services.common.keys import KeyStore, digest
from services.config import PlatformConfig
from services.gateway import metrics
from services.gateway.app import Gateway, create_app
from services.gateway.prompts import Prompter

A, B = "sk-slots-a", "sk-slots-b"


def gateway(tiny_base, backend=None, keys=(), key_settings=None, estimate=256, **limits) -> tuple[Gateway, FakeBackend]:
    backend = backend or FakeBackend(tokens=2)
    pool = {"model": str(tiny_base), "engine_args": {"max_model_len": 8192}}
    cfg = PlatformConfig(model="m", pools={"base": pool}, limits=limits, routing={"default_output_estimate": estimate})
    table = {digest(k): (key_settings or {}).get(k, {}) for k in keys}
    gw = Gateway(cfg, {"base": backend}, Prompter(str(tiny_base)), KeyStore(table))
    gw.pools["base"].ready = True
    return gw, backend


def client(app, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=headers, timeout=60)


def body(prompt: str = "hi", **fields) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 2} | fields


class SlowBody:
    """A request body that sends its first bytes, then the rest only once `done` is set (a client dribbling its body)."""

    def __init__(self, data: dict):
        self.raw = json.dumps(data).encode()
        self.done = asyncio.Event()
        self.started = asyncio.Event()

    async def __aiter__(self):
        yield self.raw[:5]
        self.started.set()
        await self.done.wait()
        yield self.raw[5:]


async def until(condition, timeout: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


def wait_count(outcome: str) -> float:
    return metrics.slot_wait.labels(outcome)._sum.get(), sum(b.get() for b in metrics.slot_wait.labels(outcome)._buckets)


# ---- per key, from arrival --------------------------------------------------------------------------------------
async def test_slow_bodies_of_one_key_hold_only_its_share_never_other_keys_slots(tiny_base):
    """Key A dribbles three bodies into a gateway of two shared slots: they count against A's share (3) from arrival,
    but take no shared slot, so key B is served at once; A's fourth request is a 429 naming the setting, before its
    body is read. Before, each body held one of the process's slots from its headers on: B got a 503, nothing was
    charged, and A had no bound of its own."""
    gw, backend = gateway(tiny_base, keys=(A, B), max_concurrent_requests=2, max_concurrent_requests_per_key=3)
    app = create_app(gw)
    async with client(app, A) as ca, client(app, B) as cb:
        slow = [SlowBody(body(f"slow {i}")) for i in range(3)]
        held = [asyncio.create_task(ca.post("/v1/completions", content=s, headers={"content-type": "application/json"}))
                for s in slow]
        for s in slow:
            await asyncio.wait_for(s.started.wait(), 5)
        assert gw.slots.held[digest(A)] == 3 and gw.slots.active == 0
        r = await cb.post("/v1/completions", json=body())
        assert r.status_code == 200, r.text
        r = await ca.post("/v1/completions", json=body())
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        e = r.json()["error"]
        assert e["code"] == "rate_limit_exceeded" and "limits.max_concurrent_requests_per_key" in e["message"]
        assert len(backend.requests) == 1  # the refused body was never read, let alone admitted
        for s in slow:
            s.done.set()
        assert [(await t).status_code for t in held] == [200, 200, 200]
    assert gw.slots.held == {} and gw.slots.active == 0


async def test_a_keys_own_share_in_the_keys_file_overrides_the_config(tiny_base):
    backend = FakeBackend(tokens=2, gate=asyncio.Event())
    gw, _ = gateway(tiny_base, backend, keys=(A, B), key_settings={A: {"max_concurrent_requests": 1}},
                    max_concurrent_requests_per_key=5)
    app = create_app(gw)
    async with client(app, A) as ca, client(app, B) as cb:
        first = asyncio.create_task(ca.post("/v1/completions", json=body()))
        await until(lambda: backend.waiting == 1)
        r = await ca.post("/tokenize", json={"prompt": "hello"})  # every capped route counts
        assert r.status_code == 429 and "max_concurrent_requests in the keys file" in r.json()["error"]["message"]
        others = [asyncio.create_task(cb.post("/v1/completions", json=body())) for _ in range(2)]
        await until(lambda: backend.waiting == 3)  # B's share is the config's
        backend.gate.set()
        assert [(await t).status_code for t in (first, *others)] == [200, 200, 200]


def test_the_keys_file_takes_a_share_and_refuses_a_bad_one():
    assert KeyStore({digest(A): {"max_concurrent_requests": 2}}).table[digest(A)].max_concurrent_requests == 2
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        KeyStore({digest(A): {"max_concurrent_requests": 0}})


# ---- the shared slots, once the body is in ----------------------------------------------------------------------
async def test_a_request_waits_for_a_slot_and_is_served_when_one_frees(tiny_base):
    backend = FakeBackend(tokens=2, gate=asyncio.Event())
    gw, _ = gateway(tiny_base, backend, max_concurrent_requests=1, slot_wait_seconds=10)
    served_before = wait_count("served")[1]
    async with client(create_app(gw)) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body()))
        await until(lambda: backend.waiting == 1)
        second = asyncio.create_task(c.post("/v1/completions", json=body("second")))
        await until(lambda: gw.slots.waiting == 1)
        assert metrics.requests_waiting._value.get() == 1 and len(backend.requests) == 1
        await asyncio.sleep(0.1)
        backend.gate.set()
        assert (await first).status_code == 200 and (await second).status_code == 200
    assert gw.slots.waiting == 0 and gw.slots.active == 0 and wait_count("served")[1] == served_before + 1


async def test_waiting_past_the_bound_is_a_503_with_retry_after(tiny_base):
    backend = FakeBackend(tokens=2, gate=asyncio.Event())
    gw, _ = gateway(tiny_base, backend, max_concurrent_requests=1, slot_wait_seconds=0.2)
    timeouts = wait_count("timeout")[1]
    async with client(create_app(gw)) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body()))
        await until(lambda: backend.waiting == 1)
        t0 = asyncio.get_running_loop().time()
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert asyncio.get_running_loop().time() - t0 >= 0.2
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        e = r.json()["error"]
        assert e["code"] == "overloaded" and e["message"] == ("this gateway is at its limit of 1 concurrent requests "
                                                              "(limits.max_concurrent_requests); retry after 1 s")
        for route, data in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
            assert (await c.post(route, json=data)).status_code == 503
        backend.gate.set()
        assert (await first).status_code == 200
    assert wait_count("timeout")[1] == timeouts + 3 and gw.slots.queues == {} and gw.slots.active == 0


async def test_no_wait_is_the_503_at_once_and_the_queue_is_bounded(tiny_base):
    backend = FakeBackend(tokens=2, gate=asyncio.Event())
    gw, _ = gateway(tiny_base, backend, max_concurrent_requests=1, slot_wait_seconds=30)
    async with client(create_app(gw)) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body()))
        await until(lambda: backend.waiting == 1)
        waiter = asyncio.create_task(c.post("/v1/completions", json=body()))
        await until(lambda: gw.slots.waiting == 1)
        r = await asyncio.wait_for(c.post("/v1/completions", json=body()), 2)  # the queue holds as many as the slots
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        backend.gate.set()
        assert (await first).status_code == 200 and (await waiter).status_code == 200
    gw, _ = gateway(tiny_base, FakeBackend(tokens=2, gate=asyncio.Event()), max_concurrent_requests=1, slot_wait_seconds=0)
    async with client(create_app(gw)) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body()))
        await until(lambda: gw.slots.active == 1)
        r = await asyncio.wait_for(c.post("/v1/completions", json=body()), 2)
        assert r.status_code == 503
        first.cancel()


async def test_a_freed_slot_goes_to_keys_in_turn(tiny_base):
    """Three slots held (A); A queues two more, then B one: as the slots free, B's request is served second, between
    A's, not after all of A's (round-robin across keys, FIFO within a key)."""
    backend = FakeBackend(tokens=2, gate=asyncio.Event())
    gw, _ = gateway(tiny_base, backend, keys=(A, B), max_concurrent_requests=3, slot_wait_seconds=10)
    app = create_app(gw)
    async with client(app, A) as ca, client(app, B) as cb:
        held = [asyncio.create_task(ca.post("/v1/completions", json=body(f"held {i}"))) for i in range(3)]
        await until(lambda: backend.waiting == 3)
        waiters = []
        for c, prompt in ((ca, "a1"), (ca, "a2"), (cb, "b1")):
            waiters.append(asyncio.create_task(c.post("/v1/completions", json=body(prompt))))
            await until(lambda n=len(waiters): gw.slots.waiting == n)
        backend.gate.set()
        assert [(await t).status_code for t in (*held, *waiters)] == [200] * 6
    order = [Prompter(str(tiny_base)).decode(r.prompt_token_ids) for r in backend.requests[3:]]
    assert [p.strip()[-2:] for p in order] == ["a1", "b1", "a2"]


async def test_a_client_that_leaves_while_waiting_frees_its_place(tiny_base):
    """A request waiting for a slot whose client disconnects is answered 499 and leaves the queue at once: the next
    request queues in its place (the queue holds one here) and gets the slot when it frees; the engine never saw the
    one that left."""
    backend = FakeBackend(tokens=2, gate=asyncio.Event())
    gw, _ = gateway(tiny_base, backend, max_concurrent_requests=1, slot_wait_seconds=30)
    app = create_app(gw)
    gone = wait_count("client_gone")[1]
    async with client(app) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body()))
        await until(lambda: backend.waiting == 1)
        leave, sent = asyncio.Event(), []
        raw = json.dumps(body("leaver")).encode()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"gw"), (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("gw", 80)}
        leaver = asyncio.create_task(app(scope, receive, send))
        await until(lambda: gw.slots.waiting == 1)
        leave.set()
        await asyncio.wait_for(leaver, 2)
        assert sent[0]["status"] == 499 and gw.slots.waiting == 0 and gw.slots.queues == {}
        after = asyncio.create_task(c.post("/v1/completions", json=body("after")))
        await until(lambda: gw.slots.waiting == 1)  # queued in the freed place, not refused
        backend.gate.set()
        assert (await first).status_code == 200 and (await after).status_code == 200
    assert len(backend.requests) == 2 and wait_count("client_gone")[1] == gone + 1
    assert gw.slots.active == 0 and gw.slots.held == {}


# ---- a request without max_tokens -------------------------------------------------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens (a completion's default is 16)


def choice_of(r: httpx.Response) -> tuple[int, str]:
    """(completion tokens, finish_reason) of a streamed or whole answer."""
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        return events[-1]["usage"]["completion_tokens"], finish[-1]
    answer = r.json()
    return answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_without_max_tokens_is_settled_as_it_streams(tiny_base, stream):
    """A key of 50 output tokens a minute, a request without max_tokens (10 expected, reserved) whose answer would run
    to 1000 tokens: past its reservation each further 10 are taken as it streams, and when the bucket cannot cover
    more the answer ends there with finish_reason length (the engine request aborted). Before, it reserved 10 and
    generated all 1000: 950 past the key's limit."""
    gw, backend = gateway(tiny_base, FakeBackend(tokens=1000), estimate=10, output_tokens_per_minute=50)
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    async with client(create_app(gw)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT | extra)
        await asyncio.gather(*gw.limiter._settling)
    assert r.status_code == 200, r.text
    tokens, finish = choice_of(r)
    assert 50 <= tokens <= 51 and finish == "length"
    assert backend.aborted == 1
    assert gw.limiter.buckets["anonymous"]["output_tokens"].level >= -1.5  # charged what it generated, no more
    async with client(create_app(gw)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 429  # the bucket is spent


async def test_a_request_without_max_tokens_within_the_budget_runs_to_its_end_and_is_charged_all(tiny_base):
    gw, backend = gateway(tiny_base, FakeBackend(tokens=300, chunk=7), estimate=10, output_tokens_per_minute=10_000)
    async with client(create_app(gw)) as c:
        r = await c.post("/v1/chat/completions", json=CHAT | {"n": 2})
        await asyncio.gather(*gw.limiter._settling)
    assert r.status_code == 200 and choice_of(r) == (600, "length") and backend.aborted == 0
    level = gw.limiter.buckets["anonymous"]["output_tokens"].level
    assert 10_000 - 600 <= level <= 10_000 - 600 + 5  # (plus the refill meanwhile)
