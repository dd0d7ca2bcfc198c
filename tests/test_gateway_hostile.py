"""Hostile inputs against the gateway in-process (the real app and Gateway, the fake backend, no engine): CPU work
kept off the event loop and charged before it runs, /tokenize and /detokenize under the same cap and limits, the
per-key limits in the real Redis at 127.0.0.1:6379 without blocking the loop, the bound on a non-streamed answer,
small inputs that used to escape validation, structured-output constraints checked at the edge, and OpenAI's
response shapes."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from threading import current_thread
from types import SimpleNamespace as NS

import httpx
import pytest
from harness import FakeBackend

from services.common import bodies
from services.common.errors import APIError
from services.common.keys import KeyStore, digest
from services.config import PlatformConfig
from services.gateway import admission
from services.gateway import app as app_module
from services.gateway.app import Gateway, create_app
from services.gateway.prompts import Prompter
from services.gateway.rate_limits import RedisRateLimiter
from services.serving.backend import BackendError, GenerateRequest, SamplingOptions
from services.serving.engine import VLLMEngine, _logprobs

pytestmark = pytest.mark.shares("redis")

REDIS = "redis://127.0.0.1:6379/0"
HI = [{"role": "user", "content": "hi"}]


def gateway(tiny_base, backend=None, keys=(), redis_url=None, **limits) -> tuple[Gateway, FakeBackend]:
    backend = backend or FakeBackend(tokens=2)
    pool = {"model": str(tiny_base), "engine_args": {"max_model_len": 4_000_000}}
    cfg = PlatformConfig(model="m", pools={"base": pool}, limits=limits, redis_url=redis_url)
    gw = Gateway(cfg, {"base": backend}, Prompter(str(tiny_base)), KeyStore({digest(k): {} for k in keys}))
    gw.pools["base"].ready = True
    return gw, backend


def client(gw: Gateway, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gw)), base_url="http://gw", headers=headers, timeout=60)


class Ticker:
    """The event loop's longest stall while it runs: a task that sleeps 5 ms at a time and keeps the longest gap."""

    async def __aenter__(self):
        self.gap, self.running = 0.0, True

        async def tick():
            last = time.perf_counter()
            while self.running:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                self.gap, last = max(self.gap, now - last), now

        self.task = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc):
        self.running = False
        await self.task


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- the event loop ---------------------------------------------------------------------------------------------
async def test_a_huge_prompt_is_templated_and_tokenized_off_the_event_loop(tiny_base):
    """A 0.5 MB chat prompt keeps the tokenizer busy for a while (1.5 s on 2 busy cores); meanwhile the loop keeps
    serving: /health answers and a ticker is never held for long. Before, the loop was held for the whole of it
    (the tokenizer's single-text encode holds the GIL, so even a thread of its own would have stalled the loop).
    Generous bounds: the machine's other work delays the loop too."""
    gw, backend = gateway(tiny_base)
    prompt = "the quick brown fox jumps over the lazy dog, " * 12_000
    async with client(gw) as c, Ticker() as ticker:
        t0 = time.perf_counter()
        big = asyncio.create_task(c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": prompt}],
                                                                       "max_tokens": 2}))
        await asyncio.sleep(0.05)
        health = await c.get("/health")
        health_took = time.perf_counter() - t0
        r = await big
        took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    assert len(backend.requests[0].prompt_token_ids) > 50_000
    assert health.status_code == 200 and health_took < took
    print(f"\n0.5 MB prompt: {took:.2f} s; /health after {health_took:.3f} s; longest loop stall {ticker.gap * 1000:.0f} ms")
    assert ticker.gap < min(0.5, took / 3), f"the event loop stalled {ticker.gap:.2f} s of {took:.2f} s"


async def test_the_key_is_charged_before_the_prompt_is_templated(tiny_base):
    gw, _ = gateway(tiny_base, requests_per_minute=1)
    calls = []
    chat = gw.prompter.chat
    gw.prompter.chat = lambda req: calls.append(1) or chat(req)
    async with client(gw) as c:
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2})).status_code == 200
        big = [{"role": "user", "content": "x " * 200_000}]
        e = error(await c.post("/v1/chat/completions", json={"model": "m", "messages": big}), 429)
    assert e["code"] == "rate_limit_exceeded"
    assert len(calls) == 1  # the refused request was never templated


# 1,330 messages of 26 small text parts: 970 kB, an object to validate per part (~140 ms of CPU on the loop before)
PARTS = json.dumps({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "h"}] * 26}] * 1330},
                   separators=(",", ":"))


def decoding_threads(monkeypatch) -> list[str]:
    """The thread each JSON decoding and each schema validation of a body ran on, in order."""
    threads: list[str] = []
    loads, parse = json.loads, admission.parse
    monkeypatch.setattr(bodies, "json", NS(loads=lambda *a: threads.append(current_thread().name) or loads(*a),
                                           detect_encoding=json.detect_encoding))
    monkeypatch.setattr(admission, "parse", lambda *a: threads.append(current_thread().name) or parse(*a))
    return threads


async def test_an_over_limit_key_is_refused_before_its_body_is_decoded(tiny_base, monkeypatch):
    """The request and its bytes are charged as soon as the body is read, so a key past its limits gets its 429 at
    no decoding or validation cost; its output is reserved once the body is parsed, without counting the request
    twice (one request a minute is served). Before, a body was decoded and validated, on the loop, before the charge."""
    gw, _ = gateway(tiny_base, requests_per_minute=1, output_tokens_per_minute=1000)
    decoded = decoding_threads(monkeypatch)
    async with client(gw) as c:
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2})).status_code == 200
        before = len(decoded)
        e = error(await c.post("/v1/chat/completions", content=PARTS), 429)
    assert e["code"] == "rate_limit_exceeded" and "requests" in e["message"]
    assert before == 2 and len(decoded) == before  # decoded and validated once: the refused body never


async def test_a_refused_body_stays_charged(tiny_base):
    """The charge, taken before the body is decoded, stays when the body is refused: a key pays for the bodies it
    makes the gateway decode, valid or not. Before, a malformed or invalid body cost its key nothing."""
    gw, _ = gateway(tiny_base, requests_per_minute=2)
    async with client(gw) as c:
        assert error(await c.post("/v1/chat/completions", content=b'{"model": "m", "messages": [}'))["code"] == "invalid_json"
        assert error(await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "bogus": 1}))["param"] == "bogus"
        e = error(await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2}), 429)
    assert e["code"] == "rate_limit_exceeded"


async def test_a_large_body_is_decoded_and_validated_off_the_event_loop(tiny_base, monkeypatch):
    """A body above 16 kB is decoded and validated on the CPU pool; a small one stays on the loop (cheaper than the
    hop). Before, every body was decoded and validated on the event loop, stalling every stream of the process."""
    gw, backend = gateway(tiny_base)
    threads = decoding_threads(monkeypatch)
    async with client(gw) as c:
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2})).status_code == 200
        small = threads[:]
        messages = [{"role": "user", "content": [{"type": "text", "text": "hello world " * 100}] * 200}]  # 250 kB
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})).status_code == 200
    assert small == [current_thread().name] * 2
    assert len(threads) == 4 and all(t.startswith("swiftkv-cpu") for t in threads[2:]), threads
    assert len(backend.requests) == 2


async def test_content_parts_past_the_bound_are_a_400_before_validation(tiny_base, monkeypatch):
    """limits.max_content_parts bounds the content parts and tool calls of a chat request's messages together, so
    what one body costs to validate is bounded whatever its bytes (validation holds the GIL wherever it runs): past
    it, a 400 naming `messages` and the setting, before the schema is validated. Before, there was no such bound."""
    gw, backend = gateway(tiny_base, max_content_parts=50)
    threads = decoding_threads(monkeypatch)
    part = {"type": "text", "text": "a"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    async with client(gw) as c:
        for messages, have in (([{"role": "user", "content": [part] * 26}] * 2, 52),
                               ([{"role": "user", "content": [part] * 40}, {"role": "assistant", "tool_calls": [call] * 11}], 51)):
            e = error(await c.post("/v1/chat/completions", json={"model": "m", "messages": messages}))
            assert e["param"] == "messages" and e["code"] == "array_above_max_length", e
            assert f"{have} content parts and tool calls" in e["message"] and "limits.max_content_parts" in e["message"]
        assert len(threads) == 2  # each decoded (json.loads), neither validated (parse)
        messages = [{"role": "user", "content": [part] * 25}] * 2  # at the bound
        assert (await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})).status_code == 200
        default, _ = gateway(tiny_base)  # the default bound (4096) refuses the 970 kB body of 34,580 parts
        async with client(default) as d:
            e = error(await d.post("/v1/chat/completions", content=PARTS))
        assert e["param"] == "messages" and "34580 content parts" in e["message"]
    assert len(backend.requests) == 1


async def test_prompt_tokens_are_charged_by_bytes_then_settled_to_the_count(tiny_base):
    gw, backend = gateway(tiny_base, prompt_tokens_per_minute=100_000)
    body = {"model": "m", "prompt": "hello world " * 2000, "max_tokens": 2}  # 24 KB, fewer tokens
    async with client(gw) as c:
        assert (await c.post("/v1/completions", json=body)).status_code == 200
    bucket = gw.limiter.buckets["anonymous"]["prompt_tokens"]
    used = len(backend.requests[0].prompt_token_ids)
    assert used < len(json.dumps(body)) and 100_000 - bucket.level == pytest.approx(used, abs=5)


async def test_tokenize_and_detokenize_are_capped_and_rate_limited(tiny_base):
    gw, backend = gateway(tiny_base, requests_per_minute=3, max_concurrent_requests=1, slot_wait_seconds=0.1)
    backend.gate = asyncio.Event()
    async with client(gw) as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}))
        await asyncio.sleep(0.2)
        # the slot is taken: a 503 after the wait, charged (its body was read before the shared slot is taken)
        e = error(await c.post("/tokenize", json={"prompt": "hello"}), 503)
        assert e["code"] == "overloaded"
        backend.gate.set()
        assert (await held).status_code == 200
        r = await c.post("/tokenize", json={"prompt": "hello"})
        assert r.status_code == 200 and r.json()["count"] > 0
        e = error(await c.post("/detokenize", json={"tokens": [1, 2]}), 429)  # the fourth request of the minute
        assert e["code"] == "rate_limit_exceeded"


async def test_an_over_limit_keys_tokenize_is_refused_before_its_body_is_decoded(tiny_base, monkeypatch):
    """/tokenize and /detokenize charge the request and the body's bytes as soon as the body is read, as generation
    does: a key past its limits gets its 429 with the body neither decoded nor validated, and a served request is
    counted once (two a minute: both routes are served). Before, the body was decoded and validated, on the loop,
    before the charge."""
    gw, _ = gateway(tiny_base, requests_per_minute=2)
    decoded = decoding_threads(monkeypatch)
    parse = app_module.parse
    monkeypatch.setattr(app_module, "parse", lambda *a: decoded.append(current_thread().name) or parse(*a))
    async with client(gw) as c:
        assert (await c.post("/tokenize", json={"prompt": "hello"})).status_code == 200
        assert (await c.post("/detokenize", json={"tokens": [1, 2]})).status_code == 200
        before = len(decoded)
        for route, body in (("/tokenize", {"prompt": "hello " * 5000}), ("/detokenize", {"tokens": [1] * 10_000})):
            assert error(await c.post(route, json=body), 429)["code"] == "rate_limit_exceeded"
    assert before == 4 and len(decoded) == before  # the refused bodies were never decoded


async def test_a_streamed_body_to_run_request_is_refused_before_the_key_is_charged(tiny_base):
    """run_request (the Batch API's lines) refuses `stream` before the key is charged: its one request of the minute
    and its output tokens stay for the next. Before, the body was admitted (charged the request and a 30-token output
    reservation, never given back) and then refused."""
    gw, _ = gateway(tiny_base, requests_per_minute=1, output_tokens_per_minute=40)
    body = {"model": "m", "prompt": "hello", "max_tokens": 30}
    status, answer = await gw.run_request(body | {"stream": True}, "completion", "anonymous")
    assert (status, answer["error"]["param"]) == (400, "stream")
    assert "anonymous" not in gw.limiter.buckets  # nothing taken
    status, answer = await gw.run_request(body, "completion", "anonymous")
    assert status == 200, answer


# ---- Redis --------------------------------------------------------------------------------------------------------
async def test_redis_limits_are_shared_by_gateways_and_awaited(tiny_base):
    key = f"sk-{secrets.token_hex(8)}"
    a, _ = gateway(tiny_base, keys=[key], redis_url=REDIS, requests_per_minute=3, output_tokens_per_minute=60)
    b, _ = gateway(tiny_base, keys=[key], redis_url=REDIS, requests_per_minute=3, output_tokens_per_minute=60)
    assert isinstance(a.limiter, RedisRateLimiter)
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    async with client(a, key) as ca, client(b, key) as cb:
        statuses = [(await c.post("/v1/completions", json=body)).status_code for c in (ca, cb, ca, cb)]
        await asyncio.gather(*a.limiter._settling, *b.limiter._settling)  # reservations are settled in tasks of their own
    assert statuses == [200, 200, 200, 429]
    assert a.limiter.down_since is None and b.limiter.down_since is None  # Redis answered every call
    import redis

    r = redis.Redis.from_url(REDIS)
    level = float(r.hget(f"{RedisRateLimiter.PREFIX}{digest(key)}:output_tokens", "level"))
    # 3 requests reserved 4 tokens each and generated 2: settled, 6 were taken (plus 1 a second back by the refill);
    # unsettled, the bucket would hold 48 plus the refill
    assert level >= 53.5


async def test_a_debt_in_redis_is_kept_until_it_is_repaid():
    """A key 118,000 output tokens over its 10,000 a minute is told to come back in 709 s: its buckets outlive that
    (and the refill to full after it), so the debt is still there when it does. Before, every bucket expired 120 s
    after its last use, and the key came back to a full bucket after 2 minutes."""
    import redis

    limiter = RedisRateLimiter(REDIS, None, None, 10_000)
    key = f"debtor-{secrets.token_hex(4)}"
    await limiter.acquire(key, 1, 10_000)
    await limiter.settle(key, 10_000, 128_000)  # ran 118,000 tokens past a reservation of the whole bucket
    with pytest.raises(APIError) as e:
        await limiter.acquire(key, 1, 1)
    assert 700 <= int(e.value.headers["Retry-After"]) <= 710
    ttl = redis.Redis.from_url(REDIS).ttl(f"{RedisRateLimiter.PREFIX}{key}:output_tokens")
    assert ttl > (118_000 + 10_000) * 60 / 10_000, ttl  # past the refill to full: 768 s
    await limiter.acquire("fresh-" + key, 1, 1)
    assert redis.Redis.from_url(REDIS).ttl(f"{RedisRateLimiter.PREFIX}fresh-{key}:output_tokens") >= 120  # never less than before


async def test_redis_reserves_the_output_of_a_request_already_counted():
    """As in-process: requests=0 takes the output reservation of a request counted when its body was read."""
    limiter = RedisRateLimiter(REDIS, 1, None, 100)
    key = f"counted-{secrets.token_hex(4)}"
    await limiter.acquire(key, 500, 0)
    await limiter.acquire(key, 0, 80, requests=0)  # one request a minute: not counted again
    with pytest.raises(APIError) as e:
        await limiter.acquire(key, 0, 80, requests=0)
    assert "output tokens" in e.value.message and limiter.down_since is None


async def test_a_request_without_max_tokens_is_settled_as_it_streams_in_redis(tiny_base):
    """As in-process (test_gateway_slots.py), with the limits in Redis: a key of 1000 output tokens a minute, a streamed
    request without max_tokens (256 expected, reserved) whose answer would run to 5000 tokens takes 256 more at a time
    as it streams, and ends with finish_reason length once Redis' bucket cannot cover the next (768 tokens: 232 were
    left); the bucket holds what it did not spend. Before, all 5000 were generated (4000 past the limit)."""
    import redis

    key = f"sk-{secrets.token_hex(8)}"
    gw, backend = gateway(tiny_base, FakeBackend(tokens=5000), keys=[key], redis_url=REDIS, output_tokens_per_minute=1000)
    async with client(gw, key) as c:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        await asyncio.gather(*gw.limiter._settling)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    finish = [ch["finish_reason"] for e in events for ch in e["choices"] if ch.get("finish_reason")]
    assert events[-1]["usage"]["completion_tokens"] == 768 and finish == ["length"]
    assert backend.aborted == 1 and gw.limiter.down_since is None
    level = float(redis.Redis.from_url(REDIS).hget(f"{RedisRateLimiter.PREFIX}{digest(key)}:output_tokens", "level"))
    assert 232 <= level <= 240  # 1000 less the 768 generated (plus the refill meanwhile)


async def test_a_silent_redis_holds_no_other_request(tiny_base):
    """A Redis that accepts connections and never answers: each limiter call waits its socket timeout (0.5 s),
    then the gateway serves on its own buckets. The loop is never held meanwhile."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the kernel's backlog; nothing reads them
    try:
        gw, _ = gateway(tiny_base, redis_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0", requests_per_minute=100)
        async with client(gw) as c, Ticker() as ticker:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    finally:
        silent.close()
    assert r.status_code == 200 and gw.limiter.down_since is not None
    assert ticker.gap < 0.25, f"the event loop stalled {ticker.gap:.2f} s on Redis"


# ---- what one answer may hold -------------------------------------------------------------------------------------
async def test_a_non_streamed_answer_is_bounded(tiny_base):
    gw, backend = gateway(tiny_base)
    many = {"model": "m", "messages": HI, "n": 16, "max_tokens": 4000, "logprobs": True, "top_logprobs": 20}
    async with client(gw) as c:
        e = error(await c.post("/v1/chat/completions", json=many))
        assert e["param"] == "max_tokens" and e["code"] == "response_too_large"
        assert "1344000" in e["message"] and "limits.max_unstreamed_tokens" in e["message"] and "stream" in e["message"]
        unset = {"model": "m", "messages": HI, "n": 16, "logprobs": True, "top_logprobs": 20}
        assert "max_tokens unset" in error(await c.post("/v1/chat/completions", json=unset))["message"]
        assert not backend.requests
        r = await c.post("/v1/chat/completions", json=many | {"stream": True})  # streamed: nothing is held
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        r = await c.post("/v1/chat/completions", json=many | {"max_tokens": 390})  # 16 x 390 x 21 = 131,040: at the bound
        assert r.status_code == 200 and len(r.json()["choices"]) == 16


# ---- small hostile inputs -----------------------------------------------------------------------------------------
NESTED = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
     "messages.0.content.0.text"),
    ("/v1/completions", {"prompt": "\udc00"}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u0661": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"x": json.loads("[" * 500 + "]" * 500)}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "structured_outputs": {"json_object": False}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": HI, "structured_outputs": {"grammar": "  "}}, "structured_outputs"),
])
async def test_small_hostile_inputs_are_400_naming_the_field(tiny_base, route, body, param):
    gw, backend = gateway(tiny_base)
    async with client(gw) as c:
        body = ({"model": "m"} if route.startswith("/v1") else {}) | body
        e = error(await c.post(route, content=json.dumps(body)))  # ASCII JSON: a surrogate stays a \\u escape
    assert e["param"] == param, e
    assert not backend.requests


async def test_a_body_nested_past_the_parser_is_a_400(tiny_base):
    gw, _ = gateway(tiny_base)
    async with client(gw) as c:
        for route in ("/v1/chat/completions", "/tokenize"):
            e = error(await c.post(route, content=b'{"model": "m", "messages": ' + NESTED.encode() + b"}"))
            assert e["code"] == "invalid_json" and "too deeply" in e["message"]
        # a surrogate pair is one character (U+1F600), not a lone surrogate
        r = await c.post("/v1/completions", content=b'{"model": "m", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 1}')
        assert r.status_code == 200, r.text


# ---- structured output at the edge ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"grammar": 'root ::= "a"\nroot ::= "b"'}}, "structured_outputs"),  # vLLM #43920's
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a\x00b"}}, "structured_outputs"),
    ({"structured_outputs": {"json": NESTED}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"}, "tools"),
])
async def test_a_malformed_constraint_never_reaches_the_engine(tiny_base, fields, param):
    gw, backend = gateway(tiny_base)
    async with client(gw) as c:
        for stream in (False, True):
            e = error(await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "stream": stream} | fields))
            assert e["param"] == param and "xgrammar" in e["message"], e
    assert not backend.requests


async def test_a_valid_constraint_is_forwarded(tiny_base):
    gw, backend = gateway(tiny_base)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    async with client(gw) as c:
        for fields in ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
                       {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
                       {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}):
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2} | fields)
            assert r.status_code == 200, r.text
    assert [sorted(q.sampling.structured) for q in backend.requests] == [["regex"], ["choice"], ["grammar"], ["json"]]


async def test_an_engine_that_fails_a_request_is_a_500_not_a_finish_reason():
    """vLLM ends a request it failed in the engine core (a grammar that did not compile there, #43920) with
    finish_reason "error"; its own server answers 500. So does the backend here; logprobs of -inf are floored."""
    class LLM:
        async def generate(self, prompt, params, request_id, priority=0):
            yield NS(outputs=[NS(index=0, text="", token_ids=[], finish_reason="error", logprobs=None)], metrics=None, num_cached_tokens=0)

    engine = VLLMEngine("base", "m", "m", {}, warmup=False)
    engine.llm = LLM()
    with pytest.raises(BackendError, match="failed request r1"):
        async for _ in engine.generate(GenerateRequest("r1", [1, 2], SamplingOptions(max_tokens=2))):
            pass
    entry = {5: NS(logprob=float("-inf"), decoded_token="a", rank=1)}
    assert _logprobs([5], [entry], 1)[0].logprob == -9999.0


# ---- OpenAI's shapes ---------------------------------------------------------------------------------------------
async def test_chat_answers_carry_openais_required_refusal_fields(tiny_base):
    gw, _ = gateway(tiny_base)
    body = {"model": "m", "messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    async with client(gw) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        events = (await c.post("/v1/chat/completions", json=body | {"stream": True})).text.split("\n\n")
    assert whole["message"] == {"role": "assistant", "content": "xx", "refusal": None}
    assert whole["logprobs"]["refusal"] is None and len(whole["logprobs"]["content"]) == 2
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(c["choices"][0]["logprobs"]["refusal"] is None for c in chunks[1:])
