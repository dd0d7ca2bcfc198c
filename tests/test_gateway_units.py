"""The gateway's pure parts: route policy, rate limits, keys, config. No engine needed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from harness import FakeBackend

from services.common.errors import APIError
from services.common.keys import KeyStore, digest, load_keys
from services.config import DEFAULT_CONFIG, PlatformConfig, RoutingConfig, load_config
from services.gateway.rate_limits import RateLimiter
from services.gateway.routing import NoPoolAvailable, PoolState, RoutePolicy
from services.serving.backend import BackendDown, BackendError

HI = [{"role": "user", "content": "hi"}]


def pools(swiftkv_ready=True, base_ready=True):
    return {
        "swiftkv": PoolState("swiftkv", backend=None, served_model_name="m-swiftkv", ready=swiftkv_ready),
        "base": PoolState("base", backend=None, served_model_name="m-base", ready=base_ready),
    }


def test_ratio_picks_the_pool():
    policy = RoutePolicy(RoutingConfig(ratio_threshold=4))
    assert policy.decide(400, 10, pools()) .pool == "swiftkv"
    assert policy.decide(400, 100, pools()).pool == "swiftkv"  # exactly the threshold
    d = policy.decide(20, 200, pools())
    assert (d.pool, d.reason) == ("base", "ratio")
    assert "pool=base; reason=ratio" in d.header(expose_reason=True)


def test_balance_overrides_the_ratio_when_the_other_pool_has_much_less_work():
    """Predicted work: prompt tokens not yet prefilled + decode_token_cost (4) per expected output token, in flight and
    this request's. The ratio's pool must hold more than balance_margin_tokens (2,048) more than the other."""
    policy = RoutePolicy(RoutingConfig(ratio_threshold=4, cache_aware=False))
    p = pools()
    p["swiftkv"].dispatched(1000, 250)  # 1,000 + 4 * 250 = 2,000 tokens of work
    assert p["swiftkv"].work(4.0) == 2000
    assert policy.decide(400, 10, p).reason == "ratio"  # 2,000 more than base: within the margin
    p["swiftkv"].dispatched(49, 0)
    d = policy.decide(400, 10, p)
    assert (d.pool, d.reason) == ("base", "backlog")
    assert RoutePolicy(RoutingConfig(balance=False, cache_aware=False)).decide(400, 10, p).reason == "ratio"
    p["base"].dispatched(0, 100)  # base's own work in flight counts against it
    assert policy.decide(400, 10, p).reason == "ratio"
    p["swiftkv"].first_token(1049, 1.0)  # prefilled: only its decode is left there (1,000 against 400)
    p["swiftkv"].ended(250)
    assert p["swiftkv"].work(4.0) == 0
    d = policy.decide(20, 200, p)  # decode-heavy, and base holds 400 more: within the margin
    assert (d.pool, d.reason) == ("base", "ratio")


def test_a_burst_shares_both_pools_and_a_trickle_keeps_to_the_ratio():
    """16 rag-like requests (1,500 prompt, 150 output tokens) at once: balance spreads them over both pools; the same
    requests one after another (each ended before the next) all go where the ratio says."""
    policy = RoutePolicy(RoutingConfig(cache_aware=False))
    p = pools()
    served = {"swiftkv": 0, "base": 0}
    for _ in range(16):
        d = policy.decide(1500, 150, p)
        p[d.pool].dispatched(1500, 150)
        served[d.pool] += 1
    assert served == {"swiftkv": 8, "base": 8}
    p = pools()
    for _ in range(16):
        d = policy.decide(1500, 150, p)
        assert (d.pool, d.reason) == ("swiftkv", "ratio")
        p[d.pool].dispatched(1500, 150)
        p[d.pool].first_token(1500, 0.5)
        p[d.pool].ended(150)


def test_fallback_pinned_and_single_pool():
    policy = RoutePolicy(RoutingConfig())
    d = policy.decide(400, 10, pools(swiftkv_ready=False))
    assert (d.pool, d.reason) == ("base", "fallback")
    assert policy.decide(400, 10, pools(), pinned="base").reason == "pinned"
    with pytest.raises(NoPoolAvailable):
        policy.decide(400, 10, pools(False, False))
    with pytest.raises(NoPoolAvailable):
        policy.decide(400, 10, pools(base_ready=False), pinned="base")
    only = {"base": pools()["base"]}
    assert policy.decide(400, 10, only).reason == "single"


def test_dual_mode_pools_keep_the_intended_model_where_the_request_moves():
    """The ratio (or a pinned name) fixes the model; backlog, fallback and batch steering may move the request to the
    other pool, where a dual-mode pool runs it as that model (`mode`, added to the route header) and any other pool as
    its own, as before. Only the destination's dual_mode counts."""
    policy = RoutePolicy(RoutingConfig(cache_aware=False))

    def dual(swiftkv_dual: bool, base_dual: bool, **work) -> dict[str, PoolState]:
        p = pools()
        p["swiftkv"].dual_mode, p["base"].dual_mode = swiftkv_dual, base_dual
        for name, tokens in work.items():
            p[name].dispatched(tokens)
        return p

    d = policy.decide(400, 10, dual(True, True, swiftkv=5000))  # prompt-heavy at capacity: SwiftKV on the base pool
    assert (d.pool, d.reason, d.mode) == ("base", "backlog", "swiftkv")
    assert d.header(expose_reason=True) == "pool=base; reason=backlog; ratio=40.00; mode=swiftkv"
    d = policy.decide(400, 10, dual(False, False, swiftkv=5000))  # two models: the base pool's own, as before
    assert (d.pool, d.reason, d.mode) == ("base", "backlog", "base")
    assert d.header(expose_reason=True) == "pool=base; reason=backlog; ratio=40.00"
    d = policy.decide(20, 200, dual(True, False, base=5000))  # decode-heavy moved to a dual-mode SwiftKV pool
    assert (d.pool, d.reason, d.mode) == ("swiftkv", "backlog", "base") and d.header().endswith("; mode=base")
    assert policy.decide(400, 10, dual(True, False, swiftkv=5000)).mode == "base"  # the base pool is not dual-mode
    d = policy.decide(400, 10, dual(True, True))  # no override: the pool's own model, nothing added to the header
    assert (d.pool, d.reason, d.mode) == ("swiftkv", "ratio", "swiftkv") and "mode=" not in d.header()
    # Both engines would run the same model: the less loaded one serves, with no margin (two models: the margin
    # keeps the intended model).
    d = policy.decide(400, 10, dual(True, True, swiftkv=100))
    assert (d.pool, d.reason, d.mode) == ("base", "backlog", "swiftkv")
    assert policy.decide(400, 10, dual(False, False, swiftkv=100)).reason == "ratio"
    assert policy.decide(400, 10, dual(True, True, swiftkv=100, base=100)).reason == "ratio"  # a tie: the intent's pool
    p = dual(True, True)
    p["swiftkv"].ready = False
    d = policy.decide(400, 10, p)
    assert (d.pool, d.reason, d.mode) == ("base", "fallback", "swiftkv")
    assert policy.decide(400, 10, dual(True, True), pinned="base").mode == "base"  # the client named the base model
    for both, mode in ((True, "swiftkv"), (False, "base")):  # a batch line leaving the live-busy SwiftKV pool
        p = dual(both, both)
        d = policy.steer_batch(policy.decide(400, 10, p), p, lambda pool: pool == "swiftkv")
        assert (d.pool, d.reason, d.mode) == ("base", "batch_steered", mode)


@pytest.mark.parametrize("dual", [True, False], ids=["dual-mode", "two-models"])
def test_at_capacity_a_prompt_heavy_request_runs_as_swiftkv_on_a_dual_mode_base_pool(tiny_base, dual):
    """Through the app over the fake engines, the SwiftKV pool backlogged: a prompt-heavy request goes to the base pool
    (reason backlog); with both pools dual-mode it runs there as the SwiftKV model (the engine is asked for it, the
    header says so, the prefix-cache index keeps its blocks as the base pool's SwiftKV ones), else as the base model
    with nothing added. A decode-heavy request on a dual-mode base pool asks for the base model (the engine's own is
    its SwiftKV checkpoint's); a retry on the other pool keeps the model too."""
    import re

    from harness.gateway import InProcessGateway, platform_config

    cfg = platform_config(tiny_base, {"swiftkv": {"dual_mode": dual}, "base": {"dual_mode": dual}})
    served = InProcessGateway(cfg, batch=False)
    backends, pools_, index = served.backends, served.gateway.pools, served.gateway.policy.index
    assert pools_["base"].dual_mode == dual
    pools_["swiftkv"].dispatched(10_000)  # its engines' queue: 10,000 prompt tokens not yet prefilled

    async def run():
        async with served.client() as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello " * 100, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert re.fullmatch(r"pool=base; reason=backlog; ratio=[0-9.]+" + ("; mode=swiftkv" if dual else ""),
                                r.headers["x-swiftkv-route"]), r.headers["x-swiftkv-route"]
            assert [q.mode for q in backends["base"].requests] == ["swiftkv" if dual else None] and not backends["swiftkv"].requests
            policy, sent = served.gateway.policy, backends["base"].requests[0].prompt_token_ids
            chain = policy.blocks(sent)  # the pool's one entry: the SwiftKV model's blocks there, unsalted as the engine's
            assert index.blocks("base") == len(chain) > 0
            assert policy.cached_tokens("base", len(sent) + 1, chain, "swiftkv" if dual else None) == len(chain) * index.block_size
            if dual:  # as the base model there (salted as the engine salts it): cold
                assert policy.cached_tokens("base", len(sent) + 1, chain, "base") == 0

            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 100})
            assert r.status_code == 200 and r.headers["x-swiftkv-route"].startswith("pool=base; reason=ratio")
            assert "mode=" not in r.headers["x-swiftkv-route"]
            assert backends["base"].requests[-1].mode == ("base" if dual else None)

            pools_["swiftkv"].backlog_tokens = 0  # the queue drained; then the SwiftKV pool fails before its first token
            backends["swiftkv"].error = BackendDown("pool swiftkv: engines restarting")
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "world " * 100, "max_tokens": 1})  # not cached
            assert r.status_code == 200 and r.headers["x-swiftkv-route"].startswith("pool=swiftkv; reason=ratio"), r.text
            retry = backends["base"].requests[-1]
            assert retry.request_id.endswith("-r") and retry.mode == ("swiftkv" if dual else None)

    asyncio.run(run())


def test_the_embedded_default_runs_dual_mode_on_a_cpu_where_the_swiftkv_checkpoint_can(tiny_base, tiny_swiftkv, tiny_swiftkv_across,
                                                                                       monkeypatch):
    """`swiftkv serve` / `swiftkv demo` without a config: on a CPU both pools run the SwiftKV checkpoint dual-mode (the base
    pool's requests as its base model); on a GPU, or where the checkpoint cannot serve its base model (AcrossKV, not a
    SwiftKV checkpoint), each pool keeps its one model."""
    import swiftkv_core.hardware as hardware
    from services.config import load_config
    from services.serve import default_dual_mode

    def default(swiftkv_model, on_cpu: bool = True):
        cfg = load_config(None)
        cfg.pools["swiftkv"].model, cfg.pools["base"].model = str(swiftkv_model), str(tiny_base)
        monkeypatch.setattr(hardware, "vllm_on_cpu", lambda: on_cpu)  # the machine's kind, not the code under test
        default_dual_mode(cfg)
        return {name: (p.model, p.dual_mode) for name, p in cfg.pools.items()}

    assert default(tiny_swiftkv) == {"swiftkv": (str(tiny_swiftkv), True), "base": (str(tiny_swiftkv), True)}
    one_model_each = {"swiftkv": (str(tiny_swiftkv), False), "base": (str(tiny_base), False)}
    assert default(tiny_swiftkv, on_cpu=False) == one_model_each
    assert default(tiny_swiftkv_across)["base"] == (str(tiny_base), False)
    assert default(tiny_base)["base"] == (str(tiny_base), False)


def test_a_dual_mode_pool_starts_dual_mode_engines_and_is_refused_where_it_cannot_work(tiny_base, tmp_path):
    """dual_mode: the pool's engines start with the override beside its own hf_overrides (the pool's engine_args left
    as written), with routing.kv_events too (the index hashes base-mode blocks as the engine salts them); refused by
    `swiftkv serve` for a local model that is not a SwiftKV checkpoint."""
    import json

    from services.config import PoolConfig
    from services.serve import Refusal, check_models, dual_mode_refusal
    from services.serving.pools import engine_args_with_kv_events

    own = {"max_model_len": 512, "hf_overrides": {"rope_theta": 1e6}}
    pool = PoolConfig(model="m", dual_mode=True, engine_args=own, speculative={"method": "ngram", "num_speculative_tokens": 2})
    args = pool.vllm_engine_args()
    assert args["hf_overrides"] == {"rope_theta": 1e6, "swiftkv_dual_mode": True}
    assert args["max_model_len"] == 512 and args["speculative_config"]["method"] == "ngram"
    assert pool.engine_args["hf_overrides"] == {"rope_theta": 1e6}
    assert PoolConfig(model="m", dual_mode=True).vllm_engine_args() == {"hf_overrides": {"swiftkv_dual_mode": True}}
    assert PoolConfig(model="m", engine_args=own).vllm_engine_args() == own  # not dual-mode: as before
    cfg = PlatformConfig(model="m", pools={"swiftkv": {"model": "m", "dual_mode": True}, "base": {"model": "m"}})
    assert engine_args_with_kv_events("swiftkv", cfg.pools["swiftkv"], cfg)["hf_overrides"] == {"swiftkv_dual_mode": True}
    assert "hf_overrides" not in engine_args_with_kv_events("base", cfg.pools["base"], cfg)

    events = PlatformConfig(model="m", pools={"swiftkv": {"model": "m", "dual_mode": True}}, routing={"kv_events": True})
    assert events.pools["swiftkv"].dual_mode and events.routing.kv_events
    assert engine_args_with_kv_events("swiftkv", events.pools["swiftkv"], events)["hf_overrides"] == {"swiftkv_dual_mode": True}

    swiftkv = tmp_path / "swiftkv"
    swiftkv.mkdir()
    layout = {"architectures": ["LlamaSwiftKVForCausalLM"], "num_hidden_layers": 8, "num_key_value_layers": 4}
    (swiftkv / "config.json").write_text(json.dumps(layout))
    across = tmp_path / "across"
    across.mkdir()
    (across / "config.json").write_text(json.dumps({**layout, "key_value_group_size": 2}))
    refusal = dual_mode_refusal("swiftkv", PoolConfig(model=str(across), dual_mode=True))  # refused before any engine starts
    assert refusal is not None and "key_value_group_size 1" in refusal
    for model, refused in ((str(tiny_base), True), (str(swiftkv), False)):
        cfg = PlatformConfig(model="m", pools={"swiftkv": {"model": model, "dual_mode": True}})
        refusal = dual_mode_refusal("swiftkv", cfg.pools["swiftkv"])
        assert (refusal is not None) == refused, refusal
        if refused:
            assert "pools.swiftkv.dual_mode: " in refusal and "needs a SwiftKV checkpoint" in refusal and "LlamaForCausalLM" in refusal
            with pytest.raises(Refusal, match="needs a SwiftKV checkpoint"):
                check_models(cfg)
        else:
            check_models(cfg)
    assert dual_mode_refusal("base", PoolConfig(model=str(tiny_base))) is None  # not dual-mode
    remote = PoolConfig(model=str(tiny_base), backend="remote", url="http://a:8000", dual_mode=True)
    assert dual_mode_refusal("base", remote) is None  # the server's checkpoint is not ours to read


def test_live_busy_from_dispatch_to_the_end_and_a_quiet_time_after():
    pool = pools()["swiftkv"]
    assert not pool.live_busy(2.0)
    pool.live_started()
    assert pool.live_busy(0.0)  # busy past its first token, until the response ends
    pool.live_ended()
    assert pool.live_busy(2.0) and not pool.live_busy(0.0)
    pool.live_ended_at -= 2.0  # ended 2 s ago
    assert not pool.live_busy(2.0) and pool.live_busy(3.0)


def test_batch_lines_leave_a_live_busy_pool_only_for_equal_or_better_quality():
    policy = RoutePolicy(RoutingConfig(ratio_threshold=4))
    p = pools()
    busy: set[str] = set()
    steer = lambda d: policy.steer_batch(d, p, lambda pool: pool in busy)  # noqa: E731
    heavy, light = policy.decide(400, 10, p), policy.decide(20, 200, p)
    assert steer(heavy) == heavy and steer(light) == light  # no live traffic: routed as live requests are
    busy.add("swiftkv")
    d = steer(heavy)
    assert (d.pool, d.reason, d.ratio) == ("base", "batch_steered", heavy.ratio)  # SwiftKV -> base model
    assert steer(policy.decide(400, 10, p, pinned="swiftkv")).pool == "swiftkv"  # pinned stays
    busy = {"base"}
    assert steer(light) == light  # never base model -> SwiftKV: that would lower the line's quality
    busy = {"swiftkv", "base"}
    assert steer(heavy) == heavy  # nowhere quieter to go
    busy = {"swiftkv"}
    p["base"].ready = False
    assert steer(heavy) == heavy  # the base-model pool is down
    only = {"swiftkv": p["swiftkv"]}
    single = policy.decide(400, 10, only)
    assert policy.steer_batch(single, only, lambda pool: True) == single


def test_rate_limiter_counts_tokens_and_says_when_to_retry():
    limiter = RateLimiter(None, 600, None)  # 600 prompt tokens per minute = 10 per second

    async def run():
        await limiter.acquire("k", 500, 10)
        with pytest.raises(APIError) as e:
            await limiter.acquire("k", 200, 10)
        assert e.value.status == 429
        assert e.value.code == "rate_limit_exceeded"
        assert "prompt tokens" in e.value.message
        assert int(e.value.headers["Retry-After"]) == 10  # 100 tokens short at 10 tokens/s
        await limiter.acquire("other", 500, 10)  # limits are per key

    asyncio.run(run())


def test_output_tokens_are_reserved_then_settled():
    limiter = RateLimiter(None, None, 100)

    async def run():
        await limiter.acquire("k", 1, 80)
        with pytest.raises(APIError):
            await limiter.acquire("k", 1, 80)
        await limiter.settle("k", reserved=80, actual=5)  # 75 given back
        await limiter.acquire("k", 1, 80)
        await limiter.settle("k", reserved=80, actual=230)  # 150 beyond the reservation are charged too
        with pytest.raises(APIError) as e:  # the bucket is below zero: even one token waits for the refill
            await limiter.acquire("k", 1, 1)
        assert int(e.value.headers["Retry-After"]) >= 80  # 136 tokens short at 100 per minute: 82 s

    asyncio.run(run())


def test_a_request_charged_before_its_body_was_parsed_reserves_only_its_output():
    """The gateway charges the request and its bytes before it decodes the body, then reserves the output once
    parsed (requests=0): the request is counted once, and the reservation is checked against the output limit."""
    limiter = RateLimiter(1, None, 100)

    async def run():
        await limiter.acquire("k", 500, 0)  # the request and its bytes
        await limiter.acquire("k", 0, 80, requests=0)  # its output, not a second request (1 a minute)
        with pytest.raises(APIError) as e:
            await limiter.acquire("k", 0, 80, requests=0)
        assert "output tokens" in e.value.message
        with pytest.raises(APIError) as e:
            await limiter.acquire("k", 1, 0)
        assert "requests" in e.value.message

    asyncio.run(run())


def test_an_overage_settled_without_a_local_bucket_is_kept():
    """An overage settled here for a key with no bucket here yet (its request was admitted through Redis, which went
    away before the answer ended) makes one and is charged to it: the key waits as it would have in Redis. Before,
    the overage was dropped."""
    limiter = RateLimiter(None, None, 100)

    async def run():
        await limiter.settle("k", reserved=10, actual=250)
        with pytest.raises(APIError) as e:
            await limiter.acquire("k", 1, 1)
        assert int(e.value.headers["Retry-After"]) >= 80

    asyncio.run(run())


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

    async def run():
        await limiter.acquire(digest("beta"), 1, 1)
        with pytest.raises(APIError):
            await limiter.acquire(digest("beta"), 1, 1)
        await limiter.acquire(digest("alpha"), 1, 1)
        await limiter.acquire(digest("alpha"), 1, 1)

    asyncio.run(run())
    with pytest.raises(ValueError, match="bad key option"):
        load_keys("k rpm=1", None)
    with pytest.raises(ValueError, match="bad key option"):  # a digit that int() refuses
        load_keys("k requests_per_minute=\u00b2", None)
    assert KeyStore(load_keys("k min_priority=-10", None)).min_priority(digest("k")) == -10
    assert store.min_priority(digest("alpha")) == 0
    for bad in ("k min_priority=1", "k min_priority=-", "k min_priority=--1", f"k min_priority=-{2**31 + 1}"):
        with pytest.raises(ValueError, match="bad key option"):
            load_keys(bad, None)


def test_default_config_serves_smollm2_on_localhost():
    cfg = load_config()
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8000)
    assert set(cfg.pools) == {"swiftkv", "base"}
    assert "smollm2" in cfg.pools["base"].model
    assert cfg.pools["swiftkv"].replicas.target_ongoing_requests > 0
    assert "swiftkv" in DEFAULT_CONFIG


def test_config_errors_are_clear(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("pools: {tiny: {model: x}}\n")
    with pytest.raises(ValueError, match="swiftkv"):
        load_config(bad)
    for old in ("prefill", "decode"):  # the pools' former names: refused, naming the new ones
        bad.write_text(f"pools: {{{old}: {{model: x}}}}\n")
        with pytest.raises(ValueError, match=rf"pools\.{old}: the pools are named swiftkv \(the SwiftKV model\) and base "
                                             r"\(the base model\); rename prefill -> swiftkv and decode -> base"):
            load_config(bad)
    bad.write_text("pools: {base: {model: x, replicas: {min: 3, max: 2}}}\n")
    with pytest.raises(ValueError, match="replicas.max"):
        load_config(bad)
    bad.write_text("pools: {base: {model: x, typo: 1}}\n")
    with pytest.raises(ValueError, match="typo"):
        load_config(bad)


def test_a_failed_request_leaves_the_pool_in_routing_a_dead_pool_leaves_it(tiny_base):
    from services.gateway.app import Gateway, create_app
    from services.gateway.prompts import Prompter

    cfg = PlatformConfig(model="m", pools={"base": {"model": str(tiny_base), "engine_args": {"max_model_len": 64}}})
    backend = FakeBackend()
    gateway = Gateway(cfg, {"base": backend}, Prompter(str(tiny_base)), KeyStore({}))
    pool = gateway.pools["base"]
    pool.ready = True
    body = {"model": "m", "prompt": "hello", "max_tokens": 1}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw") as c:
            backend.error = BackendError("pool base: OverflowError: int too big to convert")  # one request's failure
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert pool.ready
            backend.error = None
            assert (await c.post("/v1/completions", json=body)).status_code == 200  # the next request is served
            backend.error = BackendDown("pool base: EngineDeadError")
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert not pool.ready
            r = await c.post("/v1/completions", json=body)  # routed around: nothing reaches the dead engine
            assert r.status_code == 503 and "not available" in r.json()["error"]["message"]

    asyncio.run(run())
    assert pool.live_in_flight == 0 and pool.live_busy(60.0)  # every live request ended, failures included


def test_a_batch_line_leaves_the_swiftkv_pool_to_live_traffic(tiny_base):
    """A prompt-heavy batch line runs on the SwiftKV pool while it has no live traffic, and on the base-model
    pool (route reason batch_steered, counted as source=batch) while a live request is on it or just ended."""
    from prometheus_client import REGISTRY

    from services.batch.runner import PoolSlots
    from services.gateway.app import Gateway, create_app
    from services.gateway.prompts import Prompter

    pool_cfg = {"model": str(tiny_base), "engine_args": {"max_model_len": 64}}
    cfg = PlatformConfig(model="m", pools={"swiftkv": pool_cfg, "base": pool_cfg}, batch={"live_quiet_seconds": 60})
    backends = {"swiftkv": FakeBackend("swiftkv"), "base": FakeBackend("base")}
    gateway = Gateway(cfg, backends, Prompter(str(tiny_base)), KeyStore({}))
    for pool in gateway.pools.values():
        pool.ready = True
    slots = PoolSlots(cfg.batch, gateway.pools, gateway.policy)
    body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 1}  # prompt-heavy: the ratio picks swiftkv
    decisions = lambda pool, reason: REGISTRY.get_sample_value(  # noqa: E731
        "swiftkv_route_decisions_total", {"pool": pool, "reason": reason, "source": "batch"}) or 0.0

    async def batch_line():
        status, answer = await gateway.run_request(body, "completion", "owner", source="batch", priority=10, slot=slots)
        assert status == 200, answer

    async def run():
        before = decisions("base", "batch_steered"), decisions("swiftkv", "ratio")
        await batch_line()
        assert (backends["swiftkv"].served, backends["base"].served) == (1, 0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw") as c:
            r = await c.post("/v1/completions", json=body)  # live, on swiftkv; it has ended when the answer is back
            assert r.status_code == 200 and "pool=swiftkv" in r.headers["x-swiftkv-route"]
        await batch_line()
        assert (backends["swiftkv"].served, backends["base"].served) == (2, 1)
        assert (decisions("base", "batch_steered"), decisions("swiftkv", "ratio")) == (before[0] + 1, before[1] + 1)

    asyncio.run(run())


def test_a_retry_routes_on_the_expected_output_of_the_first_choice(tiny_base):
    """A request without max_tokens expects the output estimate (256 tokens to begin with), not all the room left in
    the context: when its pool goes down before the first token, the retry is routed on that same expected output."""
    from harness import FakeBackend
    from harness.gateway import InProcessGateway, platform_config

    cfg = platform_config(tiny_base, max_model_len=8192)
    backends = {"swiftkv": FakeBackend("swiftkv"), "base": FakeBackend("base")}
    backends["swiftkv"].error = BackendDown("pool swiftkv: engines restarting")
    served = InProcessGateway(cfg, backends, batch=False)
    policy = served.gateway.policy
    decide, routed = policy.decide, []

    def recorded(prompt_tokens, expected_output, *args, **kwargs):
        routed.append((prompt_tokens, expected_output))
        return decide(prompt_tokens, expected_output, *args, **kwargs)

    policy.decide = recorded

    async def run():
        async with served.client() as c:
            body = {"model": "m", "prompt": "hello " * 1500, "max_tokens": None}  # prompt-heavy: the ratio picks swiftkv
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert "pool=swiftkv; reason=ratio" in r.headers["x-swiftkv-route"]

    asyncio.run(run())
    assert len(backends["swiftkv"].requests) == len(backends["base"].requests) == 1
    (first, retry) = routed
    assert first[1] == cfg.routing.default_output_estimate < 8192 - first[0]  # less than the room left
    assert retry == first


def test_a_keys_answers_move_only_its_own_output_estimate(tiny_base):
    """Key A's one-token answers (no max_tokens) bring what A expects of the public model down to a token; key B's
    reservation and expected output (what routing weighs), and A's on a pool's own name, stay at
    routing.default_output_estimate. Before, one estimate served the whole gateway: A set every key's."""
    from harness.gateway import InProcessGateway, platform_config

    cfg = platform_config(tiny_base, max_model_len=8192)
    served = InProcessGateway(cfg, keys=("sk-a", "sk-b output_tokens_per_minute=100000"), batch=False)  # 1-token answers
    admission, default = served.gateway.admission, cfg.routing.default_output_estimate

    async def run():
        async with served.client("sk-a") as a:
            for _ in range(25):
                assert (await a.post("/v1/chat/completions", json={"model": "m", "messages": HI})).status_code == 200
        own, other, pool = [await admission.admit({"model": model, "messages": HI}, "chat", digest(key))
                            for model, key in (("m", "sk-a"), ("m", "sk-b"), ("m-base", "sk-a"))]
        return own, other, pool

    own, other, pool = asyncio.run(run())
    assert own.expected_output <= 2
    assert other.expected_output == other.reserved == default
    assert pool.expected_output == default


def test_output_estimates_are_bounded_and_clamped():
    """At most `size` (key, model) estimates are kept, the least recently used forgotten (back to the default); an
    answer counts for no more than its request could have generated, and for at least one token."""
    from services.gateway.admission import OutputEstimates

    estimates = OutputEstimates(256, size=3)
    for i in range(10):
        estimates.update(f"key{i}", "m", 8, max_output=100)
    assert len(estimates) == 3
    assert estimates.get("key0", "m") == 256 and estimates.get("key9", "m") < 256
    for _ in range(50):
        estimates.update("big", "m", 10**9, max_output=100)
        estimates.update("none", "m", 0, max_output=100)
    assert estimates.get("big", "m") == pytest.approx(100, abs=0.1) and estimates.get("none", "m") == pytest.approx(1, abs=0.1)


def test_a_request_may_lower_its_priority_never_raise_it(tiny_base):
    """priority below 0 (ahead of live traffic) is a 400 naming the field, unless the key's min_priority (keys file)
    allows it; a larger number (later) is anyone's. A batch line runs at the batch priority or its own, whichever is
    later."""
    from harness.gateway import InProcessGateway, platform_config

    served = InProcessGateway(platform_config(tiny_base), keys=("sk-plain", "sk-trusted min_priority=-10"), batch=False)
    backend = served.backends["base"]
    body = {"model": "m-base", "prompt": "hi", "max_tokens": 1}

    async def run():
        async with served.client("sk-plain") as plain, served.client("sk-trusted") as trusted:
            r = await plain.post("/v1/completions", json=body | {"priority": -1})
            assert r.status_code == 400, r.text
            e = r.json()["error"]
            assert e["param"] == "priority" and e["type"] == "invalid_request_error"
            assert "0" in e["message"] and "2147483647" in e["message"]
            r = await plain.post("/v1/completions", json=body | {"priority": -(2**31)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
            assert (await plain.post("/v1/completions", json=body | {"priority": 5})).status_code == 200
            assert (await trusted.post("/v1/completions", json=body | {"priority": -1})).status_code == 200
            r = await trusted.post("/v1/completions", json=body | {"priority": -11})
            assert r.status_code == 400 and "-10" in r.json()["error"]["message"]
        gw = served.gateway
        lines = [await gw.run_request(body | extra, "completion", digest("sk-plain"), priority=10)
                 for extra in ({}, {"priority": 20}, {"priority": -1})]
        return lines

    lines = asyncio.run(run())
    assert [r.priority for r in backend.requests] == [5, -1, 10, 20]
    assert [status for status, _ in lines] == [200, 200, 400]


def test_requests_convert_themselves_to_sampling_options():
    """Fields of SamplingOptions' names are the request's own; the others are converted or the gateway's to decide."""
    from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
    from services.serving.backend import SamplingOptions

    same = {"n": 2, "temperature": 0.5, "top_p": 0.9, "seed": 7, "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "ignore_eos": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 1,
            "skip_special_tokens": False, "include_stop_str_in_output": True}
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "logprobs": 2, "stop": "\n", "stop_token_ids": [3],
                                    "logit_bias": {"4": 1.5}, **same})
    assert req.to_sampling_options(9, {"regex": "a+"}) == SamplingOptions(
        max_tokens=9, stop=["\n"], logprobs=2, stop_token_ids=[3], logit_bias={4: 1.5}, structured={"regex": "a+"}, **same)
    chat = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    options = chat.to_sampling_options(4, skip_special_tokens=False)  # what a tool-call parser asks for
    assert options == SamplingOptions(max_tokens=4, logprobs=0, skip_special_tokens=False)


def test_a_remote_server_gets_openai_fields_unless_unset_and_vllm_extensions_off_their_defaults():
    from services.serving.backend import SamplingOptions
    from services.serving.remote import request_fields

    assert request_fields(SamplingOptions(max_tokens=5)) == {
        "max_tokens": 5, "n": 1, "temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    options = SamplingOptions(max_tokens=5, temperature=0.0, seed=1, stop=["x"], logprobs=0, ignore_eos=True, top_k=-1,
                              min_p=0.1, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[7], skip_special_tokens=False,
                              include_stop_str_in_output=True, logit_bias={3: -1.0}, structured={"choice": ["a", "b"]})
    assert request_fields(options) == {
        "max_tokens": 5, "n": 1, "temperature": 0.0, "top_p": 1.0, "seed": 1, "stop": ["x"], "logprobs": 0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": True, "top_k": -1, "min_p": 0.1,
        "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [7], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "logit_bias": {3: -1.0}, "structured_outputs": {"choice": ["a", "b"]}}


def test_vllm_gets_every_sampling_option():
    """Every SamplingOptions field reaches vLLM's SamplingParams under its own name (empty lists as None)."""
    pytest.importorskip("vllm")
    from services.serving.backend import SamplingOptions
    from services.serving.engine import to_sampling_params

    options = SamplingOptions(max_tokens=5, n=2, temperature=0.5, top_p=0.9, seed=1, stop=["x"], logprobs=1,
                              presence_penalty=0.1, frequency_penalty=0.2, ignore_eos=True, top_k=5, min_p=0.1,
                              repetition_penalty=1.2, min_tokens=2, stop_token_ids=[7], skip_special_tokens=False,
                              include_stop_str_in_output=True, logit_bias={3: -1.0}, structured={"choice": ["a", "b"]})
    params = to_sampling_params(options)
    for name in ("max_tokens", "n", "temperature", "top_p", "seed", "stop", "logprobs", "presence_penalty", "frequency_penalty",
                 "ignore_eos", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "skip_special_tokens",
                 "include_stop_str_in_output", "logit_bias"):
        assert getattr(params, name) == getattr(options, name), name
    assert params.structured_outputs.choice == ["a", "b"]
    bare = to_sampling_params(SamplingOptions(max_tokens=3))
    assert bare.stop == [] and bare.stop_token_ids == [] and bare.logit_bias is None and bare.structured_outputs is None


def test_a_base_mode_request_asks_the_in_process_engine_for_the_base_model():
    """The prompt and SamplingParams an in-process (or Ray replica's) engine gets: a base-mode request carries the mode
    in extra_args and the base mode's prefix-cache salt (swiftkv_core/dual_mode.py); a SwiftKV-mode request and one
    without a mode carry neither, as before."""
    pytest.importorskip("vllm")
    from services.serving.backend import GenerateRequest, SamplingOptions
    from services.serving.engine import engine_inputs

    def inputs(mode):
        return engine_inputs(GenerateRequest("r", [5, 6, 7], SamplingOptions(max_tokens=3, seed=1), mode=mode))

    prompt, params = inputs("base")
    assert prompt == {"prompt_token_ids": [5, 6, 7], "cache_salt": "swiftkv-base-mode"}
    assert params.extra_args == {"swiftkv_mode": "base"} and (params.max_tokens, params.seed) == (3, 1)
    for mode in (None, "swiftkv"):
        prompt, params = inputs(mode)
        assert prompt == {"prompt_token_ids": [5, 6, 7]} and params.extra_args is None, mode
    with pytest.raises(ValueError, match="unknown SwiftKV engine mode"):
        inputs("fast")


def test_a_keys_request_carries_its_cache_salt_joined_to_the_modes():
    """A key whose prefix cache is its own: the engine's prompt (in-process, Ray) and a remote server's body carry
    vLLM's cache_salt, the key's salt alone or after the base mode's (`<mode salt>:<key salt>`, one salt per request)."""
    pytest.importorskip("vllm")
    from services.serving.backend import GenerateRequest, SamplingOptions
    from services.serving.engine import engine_inputs
    from services.serving.remote import mode_fields
    from swiftkv_core.dual_mode import cache_salt

    def prompt(mode):
        return engine_inputs(GenerateRequest("r", [5, 6], SamplingOptions(max_tokens=1), mode=mode, key_salt="k1"))[0]

    assert prompt("base") == {"prompt_token_ids": [5, 6], "cache_salt": "swiftkv-base-mode:k1"}
    assert prompt(None) == prompt("swiftkv") == {"prompt_token_ids": [5, 6], "cache_salt": "k1"}
    assert mode_fields(None, "k1") == {"cache_salt": "k1"}
    assert mode_fields("base", "k1") == {"vllm_xargs": {"swiftkv_mode": "base"}, "cache_salt": "swiftkv-base-mode:k1"}
    assert (cache_salt(None), cache_salt("base"), mode_fields(None)) == (None, "swiftkv-base-mode", {})


@pytest.mark.parametrize("choice,parallel", [("required", None), ("required", False), ({"type": "function", "function": {"name": "g"}}, None)])
def test_tool_schemas_are_the_ones_vllm_derives(choice, parallel):
    """The constraint for tool_choice required or a named function, derived here without vLLM, is vLLM's own."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    from services.gateway.schemas import ChatCompletionRequest, parse
    from services.gateway.tools import tools_json_schema

    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/item"}},
                                                                          "$defs": {"item": item}}}},
             {"type": "function", "function": {"name": "g"}},
             {"type": "function", "function": {"name": "h", "parameters": {"type": "object", "$defs": {"item": item}}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    ours = parse(ChatCompletionRequest, body)
    theirs = VllmChatRequest.model_validate(body)
    assert tools_json_schema(ours) == get_json_schema_from_tools(theirs.tool_choice, theirs.tools, theirs.parallel_tool_calls)
    assert ours.tools[0].function.parameters["$defs"] == {"item": item}  # the request's own tools are left as they were


class SlowStart(FakeBackend):
    """A fake engine whose start takes `seconds` and records when it ran."""

    def __init__(self, name: str, seconds: float, alongside: bool):
        super().__init__(name)
        self.seconds, self.starts_alongside, self.ran = seconds, alongside, (0.0, 0.0)

    async def start(self) -> None:
        began = asyncio.get_running_loop().time()
        await asyncio.sleep(self.seconds)
        self.ran = (began, asyncio.get_running_loop().time())


@pytest.mark.parametrize("alongside, together", [((True, True), True), ((True, False), False), ((False, False), False)])
def test_pools_start_together_only_where_no_start_competes_with_another(tiny_base, alongside, together):
    """In-process engines on CPU cores of their own start at once; anything else (one GPU, shared cores, Ray,
    remote servers) one by one, as before."""
    from services.gateway.pool_lifecycle import PoolLifecycle

    cfg = PlatformConfig(model="m", pools={name: {"model": str(tiny_base), "engine_args": {"max_model_len": 64}} for name in ("swiftkv", "base")})
    backends = {"swiftkv": SlowStart("swiftkv", 0.3, alongside[0]), "base": SlowStart("base", 0.3, alongside[1])}
    lifecycle = PoolLifecycle(cfg, backends)

    async def run():
        await lifecycle.start()
        await lifecycle.stop()

    asyncio.run(run())
    assert lifecycle.ready
    first_ready, second_began = backends["swiftkv"].ran[1], backends["base"].ran[0]
    assert (second_began < first_ready) == together  # overlapping, or the second after the first


def test_the_cpu_binding_holds_only_until_the_engine_core_process_exists():
    """The engine core takes VLLM_CPU_OMP_THREADS_BIND from the environment it is spawned with: the variable is set
    for that spawn (a real child process named as vLLM names it) and restored as soon as the child exists, while the
    engine is still starting, so a second engine's start can set its own value without waiting for the first."""
    import multiprocessing
    import os
    import threading
    import time
    from pathlib import Path

    from services.serving.engine import cpu_binding
    from swiftkv_core.hardware import BIND_ENV

    def spawned_env(proc) -> dict[str, str]:
        # between fork and exec /proc shows the environment the parent started with, not the one the child is given
        deadline = time.monotonic() + 10
        while b"spawn_main" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    before = os.environ.get(BIND_ENV)
    context = multiprocessing.get_context("spawn")
    first = context.Process(target=time.sleep, args=(30,), name="EngineCore")
    second = context.Process(target=time.sleep, args=(30,), name="EngineCore")
    second_entered = threading.Event()

    def start_second() -> None:
        with cpu_binding("1"):
            second_entered.set()
            second.start()

    try:
        with cpu_binding("0"):
            assert os.environ[BIND_ENV] == "0"
            waiter = threading.Thread(target=start_second)
            waiter.start()
            assert not second_entered.wait(0.3)  # the value is held for the first engine's spawn
            first.start()
            assert second_entered.wait(10), "the binding was not released once the engine core existed"
            waiter.join(10)
            # the first engine is still starting (inside its binding); both cores got their own value
            assert spawned_env(first)[BIND_ENV] == "0" and spawned_env(second)[BIND_ENV] == "1"
        assert os.environ.get(BIND_ENV) == before
    finally:
        for proc in (first, second):
            if proc.pid is not None:
                proc.kill()
                proc.join(10)
