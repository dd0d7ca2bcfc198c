"""The gateway's pure parts: route policy, rate limits, keys, config. No engine needed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.gateway.auth import KeyStore, RateLimiter, digest, load_keys
from services.gateway.errors import APIError
from services.gateway.routing import NoPoolAvailable, PoolState, RoutePolicy
from services.serving.backend import BackendDown, BackendError, ChoiceDelta, Output
from services.serving.config import DEFAULT_CONFIG, PlatformConfig, RoutingConfig, load_config


def pools(prefill_ready=True, decode_ready=True):
    return {
        "prefill": PoolState("prefill", backend=None, served_model_name="m-prefill", ready=prefill_ready),
        "decode": PoolState("decode", backend=None, served_model_name="m-decode", ready=decode_ready),
    }


def test_ratio_picks_the_pool():
    policy = RoutePolicy(RoutingConfig(ratio_threshold=4))
    assert policy.decide(400, 10, pools()) .pool == "prefill"
    assert policy.decide(400, 100, pools()).pool == "prefill"  # exactly the threshold
    d = policy.decide(20, 200, pools())
    assert (d.pool, d.reason) == ("decode", "ratio")
    assert "pool=decode; reason=ratio" in d.header()


def test_backlog_overrides_the_ratio_only_when_much_worse():
    policy = RoutePolicy(RoutingConfig(ratio_threshold=4, backlog_factor=4, backlog_min_seconds=0.25))
    p = pools()
    p["prefill"].prefill_rate.value = p["decode"].prefill_rate.value = 1000.0
    p["prefill"].backlog_tokens = 2000  # 2 s of queued prefill
    p["decode"].backlog_tokens = 1000  # 1 s: not 4x better
    assert policy.decide(400, 10, p).reason == "ratio"
    p["decode"].backlog_tokens = 100  # 0.1 s
    d = policy.decide(400, 10, p)
    assert (d.pool, d.reason) == ("decode", "backlog")
    p["prefill"].backlog_tokens = 200  # 0.2 s: below the minimum wait worth acting on
    assert policy.decide(400, 10, p).reason == "ratio"


def test_fallback_pinned_and_single_pool():
    policy = RoutePolicy(RoutingConfig())
    d = policy.decide(400, 10, pools(prefill_ready=False))
    assert (d.pool, d.reason) == ("decode", "fallback")
    assert policy.decide(400, 10, pools(), pinned="decode").reason == "pinned"
    with pytest.raises(NoPoolAvailable):
        policy.decide(400, 10, pools(False, False))
    with pytest.raises(NoPoolAvailable):
        policy.decide(400, 10, pools(decode_ready=False), pinned="decode")
    only = {"decode": pools()["decode"]}
    assert policy.decide(400, 10, only).reason == "single"


def test_rate_limiter_counts_tokens_and_says_when_to_retry():
    limiter = RateLimiter(None, 600, None)  # 600 prompt tokens per minute = 10 per second
    limiter.acquire("k", 500, 10)
    with pytest.raises(APIError) as e:
        limiter.acquire("k", 200, 10)
    assert e.value.status == 429
    assert e.value.code == "rate_limit_exceeded"
    assert "prompt tokens" in e.value.message
    assert int(e.value.headers["Retry-After"]) == 10  # 100 tokens short at 10 tokens/s
    limiter.acquire("other", 500, 10)  # limits are per key


def test_output_tokens_are_reserved_then_settled():
    limiter = RateLimiter(None, None, 100)
    limiter.acquire("k", 1, 80)
    with pytest.raises(APIError):
        limiter.acquire("k", 1, 80)
    limiter.settle("k", reserved_output=80, actual_output=5)  # 75 given back
    limiter.acquire("k", 1, 80)
    limiter.settle("k", reserved_output=80, actual_output=230)  # 150 beyond the reservation are charged too
    with pytest.raises(APIError) as e:  # the bucket is below zero: even one token waits for the refill
        limiter.acquire("k", 1, 1)
    assert int(e.value.headers["Retry-After"]) >= 80  # 136 tokens short at 100 per minute: 82 s


def test_per_key_limits_and_hashed_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# tenants\nalpha\nsha256:{digest('beta')} requests_per_minute=1\n")
    keys = load_keys("gamma", f)
    assert set(keys) == {digest("alpha"), digest("beta"), digest("gamma")}
    assert "alpha" not in str(keys) and "beta" not in str(keys)  # only digests are kept
    store = KeyStore(keys)
    assert store.identify("Bearer beta") == digest("beta")
    for bad in (None, "Bearer nope", "Basic alpha"):
        with pytest.raises(APIError) as e:
            store.identify(bad)
        assert e.value.status == 401
    limiter = RateLimiter(None, None, None, keys)
    limiter.acquire(digest("beta"), 1, 1)
    with pytest.raises(APIError):
        limiter.acquire(digest("beta"), 1, 1)
    limiter.acquire(digest("alpha"), 1, 1)
    limiter.acquire(digest("alpha"), 1, 1)
    with pytest.raises(ValueError, match="bad key option"):
        load_keys("k rpm=1", None)


def test_default_config_serves_smollm2_on_localhost():
    cfg = load_config()
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8000)
    assert set(cfg.pools) == {"prefill", "decode"}
    assert "smollm2" in cfg.pools["decode"].model
    assert cfg.pools["prefill"].replicas.target_ongoing_requests > 0
    assert "swiftkv" in DEFAULT_CONFIG


def test_config_errors_are_clear(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("pools: {tiny: {model: x}}\n")
    with pytest.raises(ValueError, match="prefill"):
        load_config(bad)
    bad.write_text("pools: {decode: {model: x, replicas: {min: 3, max: 2}}}\n")
    with pytest.raises(ValueError, match="replicas.max"):
        load_config(bad)
    bad.write_text("pools: {decode: {model: x, typo: 1}}\n")
    with pytest.raises(ValueError, match="typo"):
        load_config(bad)


class ScriptedBackend:
    """A backend that answers one token, or raises the error it is given: the gateway's side of failures."""

    name = "decode"

    def __init__(self):
        self.error: Exception | None = None

    async def generate(self, request):
        if self.error is not None:
            raise self.error
        yield Output([ChoiceDelta(0, "x", 1, "length")])

    async def health(self) -> bool:
        return True


def test_a_failed_request_leaves_the_pool_in_routing_a_dead_pool_leaves_it(tiny_base):
    from services.gateway.app import Gateway, create_app
    from services.gateway.prompts import Prompter

    cfg = PlatformConfig(model="m", pools={"decode": {"model": str(tiny_base), "engine_args": {"max_model_len": 64}}})
    backend = ScriptedBackend()
    gateway = Gateway(cfg, {"decode": backend}, Prompter(str(tiny_base)), KeyStore({}))
    pool = gateway.pools["decode"]
    pool.ready = True
    body = {"model": "m", "prompt": "hello", "max_tokens": 1}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw") as c:
            backend.error = BackendError("pool decode: OverflowError: int too big to convert")  # one request's failure
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert pool.ready
            backend.error = None
            assert (await c.post("/v1/completions", json=body)).status_code == 200  # the next request is served
            backend.error = BackendDown("pool decode: EngineDeadError")
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert not pool.ready
            r = await c.post("/v1/completions", json=body)  # routed around: nothing reaches the dead engine
            assert r.status_code == 503 and "not available" in r.json()["error"]["message"]

    asyncio.run(run())
