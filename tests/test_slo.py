"""The pools' SLO and capacity (docs/operations/slo.md), in-process over the fake backend: the TTFT prediction follows the
decode rate measured per batch size and the pool's replicas, the capacity gauges (predicted TTFT, replicas, desired
replicas) read at /metrics, SLO attainment counted per pool, and a request shed with a 429 `overloaded` when the pool's
predicted TTFT exceeds its slo.max_queue_seconds."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from harness import FakeBackend

from services.config import PlatformConfig
from services.gateway import metrics
from services.gateway.app import Gateway, create_app
from services.gateway.capacity import Capacity
from services.gateway.pool_lifecycle import count_replicas
from services.gateway.prompts import Prompter
from services.gateway.routing import batch_bucket


def gateway(tiny_base, backend: FakeBackend, slo: dict | None = None, name: str = "base") -> Gateway:
    pool = {"model": str(tiny_base), "engine_args": {"max_model_len": 8192}} | ({"slo": slo} if slo else {})
    cfg = PlatformConfig(model="m", pools={name: pool})
    gw = Gateway(cfg, {name: backend}, Prompter(str(tiny_base)), _no_keys())
    gw.pools[name].ready = True
    count_replicas(gw.pools[name])
    return gw


def _no_keys():
    from services.common.keys import KeyStore

    return KeyStore({})


def client(gw: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gw)), base_url="http://gw", timeout=60)


def body(prompt: str = "hi", max_tokens: int = 2, **fields) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens} | fields


async def until(condition, timeout: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


def gauge(text: str, name: str, pool: str) -> float:
    line = next(li for li in text.splitlines() if li.startswith(f'{name}{{pool="{pool}"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (0, 1, 1.5, 2, 3, 4, 7, 8, 127, 128, 10_000)] == [0, 0, 0, 1, 1, 2, 2, 3, 6, 7, 7]


async def test_the_prediction_follows_the_measured_decode_rate(tiny_base):
    """Until measured, a decode step of the batch costs decode_token_cost prompt tokens' prefill per sequence (the prior);
    requests whose outputs come 50 ms apart measure the batch's decode rate, and the TTFT predicted for a request arriving
    while one is in flight includes that step; routing prices an output token at the measured rate too."""
    gate = asyncio.Event()
    backend = FakeBackend(tokens=4, delay=0.05, gate=gate, hold=lambda r: r.request_id.endswith("held"))
    gw = gateway(tiny_base, backend)
    pool = gw.pools["base"]
    rate = pool.prefill_rate.value
    assert pool.decode_step_seconds(1) == pytest.approx(4.0 / rate)  # routing.decode_token_cost, at the prefill rate
    assert pool.decode_cost(4.0) == 4.0
    async with client(gw) as c:
        for _ in range(3):
            r = await c.post("/v1/completions", json=body(max_tokens=4))
            assert r.status_code == 200
        measured = pool.decode_rate[0]
        assert measured is not None and 5 < measured < 25  # about 1/0.05 s per token, on a busy machine somewhat less
        assert pool.decode_rate[1:] == [None] * 7  # one sequence at a time: only the first bucket
        assert pool.running == 0 and pool.ttft_seconds(100) == pytest.approx(100 / rate)  # nothing decoding: no step
        backend.hold = lambda r: True
        held = asyncio.create_task(c.post("/v1/completions", json=body(max_tokens=4)))
        await until(lambda: backend.waiting == 1)
        assert pool.running == 1
        # the prefill in line and its own, and the decode step in progress
        assert pool.ttft_seconds(100) == pytest.approx((pool.backlog_tokens + 100) / rate + 1 / measured)
        assert pool.decode_cost(4.0) == pytest.approx(rate / measured)  # an output token costs that much prefill work
        metrics_text = (await c.get("/metrics")).text
        assert gauge(metrics_text, "swiftkv_pool_decode_rate_tokens_per_second", "base") == pytest.approx(measured)
        gate.set()
        assert (await held).status_code == 200


async def test_the_backlog_is_spread_over_the_pools_replicas(tiny_base):
    """Prefills in line divide over the engines serving the pool: the backend's replica count, which the health watcher
    reads, and which /metrics shows beside the predicted TTFT of a request arriving now."""
    gate = asyncio.Event()
    backend = FakeBackend(tokens=1, gate=gate)
    gw = gateway(tiny_base, backend)
    pool = gw.pools["base"]
    async with client(gw) as c:
        tasks = [asyncio.create_task(c.post("/v1/completions", json=body("word " * 200, max_tokens=1))) for _ in range(3)]
        await until(lambda: backend.waiting == 3)
        backlog = pool.backlog_tokens
        assert backlog >= 600
        step = pool.decode_step_seconds()
        one = pool.ttft_seconds(50)
        assert one == pytest.approx((backlog + 50) / pool.prefill_rate.value + step)
        text = (await c.get("/metrics")).text
        assert gauge(text, "swiftkv_pool_replicas", "base") == 1
        predicted_one = gauge(text, "swiftkv_pool_predicted_ttft_seconds", "base")
        backend.replicas = 3  # two more engines came up: the health watcher counts them
        count_replicas(pool)
        assert pool.replicas == 3
        assert pool.ttft_seconds(50) == pytest.approx((backlog / 3 + 50) / pool.prefill_rate.value + pool.decode_step_seconds())
        assert pool.ttft_seconds(50) < one
        text = (await c.get("/metrics")).text
        assert gauge(text, "swiftkv_pool_replicas", "base") == 3
        assert gauge(text, "swiftkv_pool_predicted_ttft_seconds", "base") < predicted_one
        gate.set()
        assert [(await t).status_code for t in tasks] == [200] * 3
    assert pool.backlog_tokens == 0 and pool.running == 0


def test_desired_replicas_follow_the_arrival_rate_mix_and_slo(tiny_base):
    """docs/operations/slo.md's method: engine time the arrivals need over the utilization at which the queue keeps the
    TTFT within the SLO; the backlog drained within it; 0 when idle (before clamping to replicas.min/max)."""
    gw = gateway(tiny_base, FakeBackend(), slo={"ttft_seconds": 1.0})
    pool = gw.pools["base"]
    pool.prefill_rate.value = 1000.0  # as measured
    pool.decode_rate[0] = 1e9  # a decode step takes no time: the arithmetic below is prefill alone
    capacity = Capacity(gw.pools)
    capacity.refresh(capacity.last + 10)
    assert capacity.desired(pool) == 0  # idle
    for _ in range(10):  # 10 requests of 500 uncached prompt tokens in one second: 5 replica-seconds of prefill a second
        pool.dispatched(500, 0)
        pool.first_token(500, 0.0)
        pool.ended(0)
    capacity.refresh(capacity.last + 1.0)
    assert capacity.arrival_rate["base"] == 10 and capacity.mean_prefill["base"] == 500
    # each prefill takes 0.5 s of the 1 s SLO: a replica's queue keeps it only up to 50% busy -> 5 / 0.5
    assert capacity.desired(pool) == 10
    pool.slo = pool.slo.model_copy(update={"ttft_seconds": None})
    assert capacity.desired(pool) == 7  # no TTFT objective: up to 80% busy -> ceil(5 / 0.8)
    pool.slo = pool.slo.model_copy(update={"ttft_seconds": 1.0})
    capacity.refresh(capacity.last + 1.0)  # nothing arrived since
    pool.dispatched(6000, 0)  # 6000 prompt tokens in line: 6 s of prefill, to drain within 1 s
    assert capacity.desired(pool) == 6
    capacity.refresh(capacity.last + 0.5)  # read again within a second: the last arrival rate stands
    text = metrics_text()
    assert gauge(text, "swiftkv_pool_desired_replicas", "base") == 6
    # a request arriving now, with the mean uncached prompt (500 tokens), behind the 6000 in line
    assert gauge(text, "swiftkv_pool_predicted_ttft_seconds", "base") == pytest.approx((6000 + 500) / 1000, rel=0.01)


def test_desired_replicas_keep_the_tpot_slo(tiny_base):
    """Sequences in flight over the largest batch per replica whose measured time per output token is within
    slo.tpot_seconds."""
    gw = gateway(tiny_base, FakeBackend(), slo={"tpot_seconds": 0.05})
    pool = gw.pools["base"]
    for bucket, tpot in enumerate((0.01, 0.015, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6)):  # batches 1, 2, 4, ..., 128
        pool.decode_rate[bucket] = 1 / tpot
    for _ in range(40):
        pool.dispatched(0, 10)
    capacity = Capacity(gw.pools)
    assert capacity.desired(pool) == 5  # at most 8 sequences per replica within 50 ms a token: 40 / 8


def metrics_text() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def slo_count(pool: str, outcome: str) -> float:
    return metrics.slo_ttft.labels(pool, outcome)._value.get()


async def test_slo_attainment_counts_live_requests_within_and_over_the_ttft_slo(tiny_base):
    backend = FakeBackend(tokens=1)
    gw = gateway(tiny_base, backend, slo={"ttft_seconds": 0.2}, name="swiftkv")
    within, over = slo_count("swiftkv", "within"), slo_count("swiftkv", "over")
    async with client(gw) as c:
        assert (await c.post("/v1/completions", json=body())).status_code == 200
        backend.delay = 0.3  # its first token after 0.3 s: over the 0.2 s SLO
        assert (await c.post("/v1/completions", json=body())).status_code == 200
    assert (slo_count("swiftkv", "within") - within, slo_count("swiftkv", "over") - over) == (1, 1)


async def test_a_request_predicted_past_max_queue_seconds_is_shed_with_a_429_overloaded(tiny_base):
    """With slo.max_queue_seconds, a live request whose predicted TTFT on its pool exceeds it is refused at once: a 429
    with code `overloaded` (not a key's `rate_limit_exceeded`) and Retry-After; counted as shed. Without it (the default),
    nothing is shed."""
    gate = asyncio.Event()
    backend = FakeBackend(tokens=1, gate=gate)
    gw = gateway(tiny_base, backend, slo={"ttft_seconds": 1.0, "max_queue_seconds": 1.0})
    pool = gw.pools["base"]
    shed, rejected = slo_count("base", "shed"), metrics.rejections.labels("overloaded", "live")._value.get()
    prompt = "word " * 150
    async with client(gw) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body(prompt)))
        await until(lambda: backend.waiting == 1)
        pool.prefill_rate.value = pool.backlog_tokens * 1.5  # as measured: one such prompt in 0.67 s, two in 1.33 s
        assert pool.ttft_seconds(pool.backlog_tokens) > 1.0  # a second like it would wait past the limit
        r = await c.post("/v1/completions", json=body("other " * 150))  # nothing of it cached
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "overloaded" and "slo.max_queue_seconds" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert backend.waiting == 1 and len(backend.requests) == 1  # never reached the pool
        assert slo_count("base", "shed") - shed == 1
        assert metrics.rejections.labels("overloaded", "live")._value.get() - rejected == 1
        small = asyncio.create_task(c.post("/v1/completions", json=body("hi")))  # predicted within the limit: queued
        await until(lambda: backend.waiting == 2)
        gate.set()
        assert (await first).status_code == 200 and (await small).status_code == 200


async def test_without_max_queue_seconds_nothing_is_shed(tiny_base):
    gate = asyncio.Event()
    backend = FakeBackend(tokens=1, gate=gate)
    gw = gateway(tiny_base, backend, slo={"ttft_seconds": 0.1})
    gw.pools["base"].prefill_rate.value = 10.0
    async with client(gw) as c:
        tasks = [asyncio.create_task(c.post("/v1/completions", json=body("word " * 150))) for _ in range(3)]
        await until(lambda: backend.waiting == 3)
        gate.set()
        assert [(await t).status_code for t in tasks] == [200] * 3


def test_a_bad_slo_is_refused_naming_its_field(tiny_base):
    for slo, field in (({"ttft_seconds": 0}, "slo.ttft_seconds"), ({"objective": 1.5}, "slo.objective"),
                       ({"max_queue": 1}, "slo.max_queue")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            PlatformConfig(model="m", pools={"base": {"model": str(tiny_base), "slo": slo}})
