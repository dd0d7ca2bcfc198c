"""Cache-aware routing: the gateway's prefix-cache index (block hashes as vLLM computes them, an LRU per pool) and the
route policy's cost choice over it (routing.cache_aware). In-process: the policy over real PoolStates, and the real
gateway app over the fake backend."""

from __future__ import annotations

import asyncio
import gc
import random
import threading

import pytest
from harness import FakeBackend, metric
from harness.gateway import InProcessGateway, platform_config
from harness.metrics import parse

from services.common.keys import digest
from services.common.prefix_index import PrefixIndex, block_hashes
from services.config import RoutingConfig
from services.gateway.routing import PoolState, RoutePolicy
from services.serving.backend import BackendDown

BS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32_000) for _ in range(n)]


# ---- hashes: vLLM's own ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [None, "0", "1234"])
def test_block_hashes_are_the_ones_vllm_computes(seed, monkeypatch):
    """With the same seed (PYTHONHASHSEED, else vLLM's fixed one for sha256), the index hashes a prompt as vLLM's
    engine does: its chained `hash_block_tokens` and a vLLM Request's own block hashes; a partial last block has none."""
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kv
    from vllm.v1.request import Request

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    saved = {name: getattr(kv, name) for name in ("NONE_HASH", "_NONE_HASH_SEED") if hasattr(kv, name)}
    sha256 = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    try:
        kv.init_none_hash(sha256)  # as the engine core does at start
        for block_size in (BS, 128):
            index = PrefixIndex(capacity_blocks=64, block_size=block_size)
            for blocks, extra in ((0, 0), (0, block_size - 1), (1, 0), (2, 5), (7, block_size - 1)):
                ids = tokens(blocks * block_size + extra, seed=blocks)
                ours = index.hashes(ids)
                parent, chain = None, []
                for i in range(blocks):
                    parent = kv.hash_block_tokens(sha256, parent, ids[i * block_size:(i + 1) * block_size])
                    chain.append(parent)
                assert ours == chain and len(ours) == blocks
                request = Request("r", ids, SamplingParams(max_tokens=1), None,
                                  block_hasher=kv.get_request_block_hasher(block_size, sha256))
                assert ours == list(request.block_hashes)
        other = PrefixIndex(capacity_blocks=64, seed="another")  # another NONE_HASH: other hashes
        assert other.hashes(tokens(BS, 1)) != PrefixIndex(capacity_blocks=64).hashes(tokens(BS, 1))
    finally:
        for name, value in saved.items():
            setattr(kv, name, value)


def test_hashes_chain_on_the_whole_prefix():
    a, b = tokens(3 * BS, 1), tokens(3 * BS, 2)
    ha = block_hashes(a)
    assert block_hashes(a + b)[:3] == ha  # an extended prompt shares its prefix's hashes
    hb = block_hashes(b[:BS] + a[BS:])  # same 2nd and 3rd blocks after another 1st: different hashes throughout
    assert not set(ha) & set(hb)


# ---- the index ---------------------------------------------------------------------------------------------------
def test_the_index_forgets_least_recently_used_chains_at_capacity():
    index = PrefixIndex(capacity_blocks=4, block_size=BS)
    a, b, c = (index.hashes(tokens(2 * BS, s)) for s in (1, 2, 3))
    index.record("p", a)
    index.record("p", b)
    assert index.cached_tokens("p", a) == index.cached_tokens("p", b) == 2 * BS
    assert index.cached_tokens("d", a) == 0  # per target
    index.record("p", a)  # touched: now more recent than b
    index.record("p", c)  # full: b goes
    assert index.blocks("p") == 4
    assert (index.cached_tokens("p", a), index.cached_tokens("p", b), index.cached_tokens("p", c)) == (2 * BS, 0, 2 * BS)
    # a longer prompt over a cached one: the cached prefix counts, up to the first block not held
    longer = index.hashes(tokens(2 * BS, 1) + tokens(3 * BS, 9))
    assert longer[:2] == a and index.cached_tokens("p", longer) == 2 * BS
    # over capacity by one block: a chain loses its tail first, so its head still counts
    index.record("p", index.hashes(tokens(3 * BS, 4)))  # 3 new blocks: a's 2 and c's tail go (a is older)
    assert index.cached_tokens("p", c) == BS and index.cached_tokens("p", a) == 0
    index.forget("p")
    assert index.cached_tokens("p", c) == 0 and index.blocks("p") == 0
    with pytest.raises(ValueError):
        PrefixIndex(capacity_blocks=0)


def test_the_index_is_safe_across_threads():
    index = PrefixIndex(capacity_blocks=50, block_size=BS)
    chains = [index.hashes(tokens(4 * BS, s)) for s in range(40)]
    errors = []

    def work(k: int) -> None:
        try:
            rng = random.Random(k)
            for _ in range(3000):
                chain = rng.choice(chains)
                if rng.random() < 0.5:
                    index.record(f"t{k % 2}", chain)
                else:
                    assert index.cached_tokens(f"t{k % 2}", chain) % BS == 0
        except Exception as e:  # noqa: BLE001 - reported below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert index.blocks("t0") <= 50 and index.blocks("t1") <= 50


# ---- the cost choice ---------------------------------------------------------------------------------------------
def pools(**work) -> dict[str, PoolState]:
    """Both pools ready; `swiftkv=5000` puts 5,000 prompt tokens of work in flight on it."""
    out = {name: PoolState(name, backend=None, served_model_name=f"m-{name}", ready=True) for name in ("swiftkv", "base")}
    for name, tokens_ in work.items():
        out[name].dispatched(tokens_)
    return out


def cache_aware(**fields) -> RoutePolicy:
    return RoutePolicy(RoutingConfig(**{"prefix_min_distinct_tokens": 64, "prefix_block_size": BS} | fields))


def test_cache_aware_routing_is_on_by_default_and_replaced_settings_are_refused():
    policy = RoutePolicy(RoutingConfig())
    assert policy.cfg.cache_aware and policy.cfg.balance
    assert (policy.index.block_size, policy.index.capacity_blocks) == (16, 16_384 // 16)  # until an engine reports its own
    assert RoutePolicy(RoutingConfig(cache_aware=False)).index is None
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        RoutingConfig(prefix_cache_tokens=8, prefix_block_size=16)
    for old, new in (("backlog_factor", "balance_margin_tokens"), ("backlog_min_seconds", "balance_margin_tokens"),
                     ("prefix_load_factor", "predicted work")):
        with pytest.raises(ValueError, match=f"routing.{old} is no longer a setting; use .*{new}"):
            RoutingConfig(**{old: 2.0})
    with pytest.raises(ValueError):
        RoutingConfig(prefix_min_distinct_tokens=-1)
    policy = cache_aware(prefix_cache_tokens=1000)
    assert (policy.index.capacity_blocks, policy.index.block_size) == (62, BS)


def test_the_index_follows_the_engines_block_size_and_capacity_unless_the_config_fixes_them():
    policy = RoutePolicy(RoutingConfig())
    policy.adopt_engine_cache("swiftkv", 128, 128 * 10)
    policy.adopt_engine_cache("base", 128, 128 * 20)
    assert policy.index.block_size == 128
    chain = policy.blocks(tokens(128 * 30, 1))
    assert len(chain) == 30
    policy.index.record("swiftkv", chain)
    policy.index.record("base", chain)
    assert (policy.index.blocks("swiftkv"), policy.index.blocks("base")) == (10, 20)  # each engine's own capacity
    fixed = cache_aware(prefix_cache_tokens=BS * 4)
    fixed.adopt_engine_cache("swiftkv", 128, 128 * 10)
    assert fixed.index.block_size == BS
    fixed.index.record("swiftkv", fixed.blocks(tokens(BS * 9, 2)))
    assert fixed.index.blocks("swiftkv") == 4


def test_a_second_turn_stays_where_its_history_is_cached():
    """Turn 1 is prompt-heavy (the ratio picks swiftkv); turn 2 adds a question and asks for a long answer (the ratio
    picks base) but swiftkv holds its 2,000-token history: counting base's cold prefill, swiftkv has less work."""
    policy = cache_aware()
    history = tokens(2000, 1)
    first = policy.decide(2000, 50, pools(), blocks=policy.blocks(history))
    assert (first.pool, first.reason) == ("swiftkv", "ratio")
    p = pools()
    policy.index.record(first.pool, first.blocks)
    turn2 = history + tokens(100, 2)
    d = policy.decide(2100, 1000, p, blocks=policy.blocks(turn2))
    assert (d.pool, d.reason) == ("swiftkv", "prefix")
    assert "reason=prefix" in d.header(expose_reason=True)
    assert RoutePolicy(RoutingConfig()).decide(2100, 1000, p).pool == "base"  # the ratio alone: base
    # and the other way: a history on base keeps a prompt-heavy next turn there
    policy.index.forget("swiftkv")
    policy.index.record("base", first.blocks)
    d = policy.decide(2100, 10, p, blocks=policy.blocks(turn2))
    assert (d.pool, d.reason) == ("base", "prefix")


def test_a_cold_prompt_goes_where_the_ratio_says():
    policy = cache_aware()
    policy.index.record("swiftkv", policy.blocks(tokens(3000, 7)))  # another conversation
    d = policy.decide(3000, 1000, pools(), blocks=policy.blocks(tokens(3000, 8)))
    assert (d.pool, d.reason) == ("base", "ratio")


def test_a_shared_system_prompt_up_to_the_distinctive_minimum_does_not_pin_traffic():
    """64 cached tokens count for nothing (prefix_min_distinct_tokens 64): a system prompt of up to 64 tokens cached
    on swiftkv leaves decode-heavy requests on base; 32 more cached tokens (a conversation of its own) count."""
    policy = cache_aware()
    system = tokens(64, 3)
    policy.index.record("swiftkv", policy.blocks(system + tokens(500, 4)))  # someone else's request, same system prompt
    mine = system + tokens(500, 5)
    d = policy.decide(len(mine), 400, pools(), blocks=policy.blocks(mine))
    assert (d.pool, d.reason) == ("base", "ratio")
    assert policy.cached_tokens("swiftkv", len(mine), d.blocks) == 64  # cached indeed, at the minimum
    policy.index.record("swiftkv", policy.blocks(mine[:96]))  # 32 distinctive tokens beyond it
    d = policy.decide(len(mine), 400, pools(), blocks=policy.blocks(mine))
    assert (d.pool, d.reason) == ("swiftkv", "prefix")


def test_a_pool_loaded_beyond_what_its_cache_saves_does_not_win_on_it():
    """The swiftkv pool holds 4,000 of the 4,100 prompt tokens (3,936 beyond the minimum): it wins the next turn while the
    work in flight there exceeds base's by less than that, and loses it beyond (no hotspot on a cached document)."""
    policy = cache_aware()
    history = tokens(4000, 6)
    policy.index.record("swiftkv", policy.blocks(history))
    turn2 = history + tokens(100, 7)
    blocks = policy.blocks(turn2)
    d = policy.decide(len(turn2), 2000, pools(swiftkv=3900), blocks=blocks)
    assert (d.pool, d.reason) == ("swiftkv", "prefix")
    d = policy.decide(len(turn2), 2000, pools(swiftkv=4000), blocks=blocks)
    assert (d.pool, d.reason) == ("base", "ratio")
    d = policy.decide(len(turn2), 2000, pools(swiftkv=9000, base=5000), blocks=blocks)  # the difference counts
    assert (d.pool, d.reason) == ("base", "ratio")
    d = policy.decide(len(turn2), 2000, pools(swiftkv=8000, base=5000), blocks=blocks)
    assert (d.pool, d.reason) == ("swiftkv", "prefix")


def test_the_backlog_override_counts_what_is_cached():
    """The ratio's pool holds 4,500 tokens more work than the other (over the 2,048 margin), which moves a cold
    prompt, not one whose history that pool holds: its 3,936 cached tokens bring the difference under the margin."""
    policy = cache_aware()
    history = tokens(4000, 8)
    turn2 = history + tokens(100, 9)
    d = policy.decide(len(turn2), 10, pools(swiftkv=5000, base=500), blocks=policy.blocks(turn2))
    assert (d.pool, d.reason) == ("base", "backlog")
    policy.index.record("swiftkv", policy.blocks(history))
    d = policy.decide(len(turn2), 10, pools(swiftkv=5000, base=500), blocks=policy.blocks(turn2))
    assert (d.pool, d.reason) == ("swiftkv", "ratio")


def test_dual_mode_pools_keep_each_models_cached_blocks_apart():
    """A dual-mode engine never shares a prefix between its two models: it salts the base model's blocks (swiftkv_core's
    `cache_salt`), and the index hashes them with the same salt (`PromptBlocks.for_mode`) in the pool's one entry.
    A history the base pool holds as SwiftKV draws the next prompt-heavy turn there as SwiftKV (reason prefix), and
    counts for nothing as the base model; a pool going down forgets both models' blocks."""
    policy = cache_aware()
    history = tokens(2000, 11)
    policy.record("base", policy.blocks(history), "swiftkv")
    turn2 = history + tokens(100, 12)
    blocks = policy.blocks(turn2)
    assert not set(blocks) & set(blocks.for_mode("base"))  # the base model's chain: another from its first block on
    p = pools()
    p["swiftkv"].dual_mode = p["base"].dual_mode = True
    d = policy.decide(len(turn2), 10, p, blocks=blocks)
    assert (d.pool, d.reason, d.mode) == ("base", "prefix", "swiftkv")
    assert policy.cached_tokens("base", len(turn2), blocks, "swiftkv") == 2000 // BS * BS
    assert policy.cached_tokens("base", len(turn2), blocks, "base") == 0  # as the base model: cold

    # A history answered by the base model on a dual-mode pool keeps the next (prompt-heavy) turn there, as the base
    # model: the prefix override may switch the model, as it does between two single-model pools.
    answered = tokens(1500, 13)
    policy.record("base", policy.blocks(answered), "base")
    turn = answered + tokens(100, 14)
    d = policy.decide(len(turn), 10, p, blocks=policy.blocks(turn))
    assert (d.pool, d.reason, d.mode) == ("base", "prefix", "base")
    assert d.header(expose_reason=True).endswith("reason=prefix; ratio=160.00")  # the pool's own model: no mode in the header
    assert policy.cached_tokens("base", len(turn), tuple(d.blocks), "base") == 0  # plain hashes cannot be salted: none

    policy.forget("base")
    assert policy.index.blocks("base") == 0
    assert policy.cached_tokens("base", len(turn), policy.blocks(turn), "base") == 0


def test_a_dual_mode_engines_two_models_share_its_one_kv_capacity():
    """The engine's one KV cache holds both models' blocks: the index bounds a dual-mode pool's blocks of both models by
    that one capacity (not each model by all of it), the least recently used block of either model going first. Fill it
    as SwiftKV, then send the base model a prompt: the SwiftKV prompt's oldest blocks (its tail) are predicted evicted."""
    policy = cache_aware()
    policy.adopt_engine_cache("base", BS, BS * 10)  # the engine's KV cache: 10 blocks
    first, second = tokens(8 * BS + 1, 21), tokens(6 * BS + 1, 22)
    a, b = policy.blocks(first), policy.blocks(second)
    policy.record("base", a, "swiftkv")
    assert policy.cached_tokens("base", len(first), a, "swiftkv") == 8 * BS
    policy.record("base", b, "base")
    assert policy.cached_tokens("base", len(second), b, "base") == 6 * BS
    assert policy.cached_tokens("base", len(first), a, "swiftkv") == 4 * BS  # 4 of its 8 blocks gone for the base model's 6
    assert policy.index.blocks("base") == 10
    policy.record("base", a, "swiftkv")  # used again: the base model's blocks are now the least recently used
    assert policy.cached_tokens("base", len(first), a, "swiftkv") == 8 * BS
    assert policy.cached_tokens("base", len(second), b, "base") == 2 * BS


# ---- through the gateway -----------------------------------------------------------------------------------------
def test_the_gateway_records_the_serving_pool_and_routes_the_next_turn_there(tiny_base):
    """Through the app: turn 1 (prompt-heavy) is served by swiftkv and entered in the index at dispatch; turn 2
    (decode-heavy by ratio) goes to swiftkv with reason `prefix`, in the route header and the route metrics, with the
    prediction metrics. A pool that fails before its first token is forgotten; the pool that served is recorded."""
    routing = {"prefix_min_distinct_tokens": 32, "prefix_block_size": BS}
    cfg = platform_config(tiny_base, max_model_len=2048, routing=routing)
    backends = {"swiftkv": FakeBackend("swiftkv"), "base": FakeBackend("base")}
    served = InProcessGateway(cfg, backends, batch=False)
    index = served.gateway.policy.index
    history = "The quarterly report says revenue grew in every region. " * 20

    async def run():
        async with served.client() as c:
            before = parse((await c.get("/metrics")).text)
            r = await c.post("/v1/completions", json={"model": "m", "prompt": history, "max_tokens": 5})
            assert r.status_code == 200, r.text
            assert "pool=swiftkv; reason=ratio" in r.headers["x-swiftkv-route"]
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            assert index.blocks("swiftkv") == prompt_tokens // BS and index.blocks("base") == 0
            turn2 = {"model": "m", "prompt": history + " Summarize it in detail.", "max_tokens": 400}
            r = await c.post("/v1/completions", json=turn2)
            assert r.status_code == 200, r.text
            route = r.headers["x-swiftkv-route"]
            assert "pool=swiftkv; reason=prefix" in route and float(route.rsplit("ratio=", 1)[1]) < 4
            after = parse((await c.get("/metrics")).text)
            delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
            assert delta("swiftkv_route_decisions_total", pool="swiftkv", reason="prefix") == 1
            assert delta("swiftkv_route_predicted_ttft_seconds_count", pool="swiftkv") == 2
            assert delta("swiftkv_route_prefix_cached_tokens_total", pool="swiftkv") >= prompt_tokens - BS

            # swiftkv goes down before its first token: the retry on base is the one recorded, swiftkv is forgotten
            backends["swiftkv"].error = BackendDown("pool swiftkv: engines restarting")
            r = await c.post("/v1/completions", json=turn2)
            assert r.status_code == 200, r.text
            assert index.blocks("swiftkv") == 0 and index.blocks("base") > 0
            assert len(backends["base"].requests) == 1

    asyncio.run(run())


def test_a_pool_counts_only_the_uncached_prompt_as_work_and_measures_prefill_past_the_queue(tiny_base):
    """Through the app, over a fake engine whose one output comes 1 s after dispatch and says 0.95 s of it was queue:
    the pool's prefill-rate sample is the prompt over the rest (not over the whole time to first token). A second
    request whose prompt the pool holds cached, held before its first token, counts only its uncached tokens in the
    pool's work in flight."""
    from services.serving.backend import ChoiceDelta, Output

    def script(request):
        yield Output([ChoiceDelta(0, "x", 1, "length")], queue_seconds=0.95)

    gate = asyncio.Event()
    gate.set()
    routing = {"prefix_min_distinct_tokens": 32, "prefix_block_size": BS}
    cfg = platform_config(tiny_base, max_model_len=2048, routing=routing)
    backends = {"swiftkv": FakeBackend("swiftkv", script=script, delay=1.0, gate=gate), "base": FakeBackend("base")}
    served = InProcessGateway(cfg, backends, batch=False)
    pool = served.gateway.pools["swiftkv"]
    history = "The quarterly report says revenue grew in every region. " * 20

    async def run():
        async with served.client() as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": history, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert "pool=swiftkv" in r.headers["x-swiftkv-route"]
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            sample = 5000 + (pool.prefill_rate.value - 5000) / pool.prefill_rate.alpha  # the one update from its start
            assert sample > prompt_tokens / 1.0, sample  # over ~0.05 s of prefill, not the 1 s to the first token

            gate.clear()
            second = asyncio.create_task(c.post("/v1/completions", json={"model": "m", "prompt": history + " And costs?",
                                                                         "max_tokens": 1}))
            while backends["swiftkv"].waiting == 0:
                await asyncio.sleep(0.01)
            cached = prompt_tokens // BS * BS
            assert 0 < pool.backlog_tokens < prompt_tokens - cached + 2 * BS, (pool.backlog_tokens, prompt_tokens)
            gate.set()
            assert (await second).status_code == 200
            assert pool.backlog_tokens == 0

    asyncio.run(run())


def test_the_gateway_takes_the_engines_cache_layout_and_returns_the_work_it_counted(tiny_base):
    """Pools whose engines report their KV cache (block size 128, as vLLM's CPU backend) set the index's blocks and each
    pool's capacity; every request's work in flight, answered or failed, leaves the pool's count when it ends."""
    cfg = platform_config(tiny_base, max_model_len=2048)
    backends = {"swiftkv": FakeBackend("swiftkv", cache=(128, 128 * 40)), "base": FakeBackend("base", cache=(128, 128 * 80))}
    served = InProcessGateway(cfg, backends, batch=False)
    policy = served.gateway.policy

    async def run():
        await served.gateway.start()  # the lifespan's part: start each pool and hear its engine's cache layout
        async with served.client() as c:
            assert policy.index.block_size == 128
            prompt = "The quarterly report says revenue grew in every region. " * 30
            for max_tokens in (5, 300):
                r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens})
                assert r.status_code == 200, r.text
            for backend in backends.values():  # the first choice fails before its first token, and so does the retry
                backend.error = BackendDown(f"pool {backend.name}: engines restarting")
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 50})
            assert r.status_code == 503, r.text
            for pool in served.gateway.pools.values():
                assert (pool.backlog_tokens, pool.decode_tokens) == (0, 0), pool.name
        await served.gateway.stop()

    try:
        asyncio.run(run())
    finally:
        gc.unfreeze()  # start froze what was loaded (as `swiftkv serve` does)
    assert policy.index.capacity_blocks == 16_384 // 16 * 16 // 128  # the default, rescaled; each pool has its own:
    policy.index.record("swiftkv", policy.blocks(list(range(128 * 50))))
    assert policy.index.blocks("swiftkv") == 40


def test_the_blocks_an_answer_fills_are_recorded_for_the_next_turn(tiny_base):
    """A backend that reports its answer's token ids (in-process engines do): the pool that answered holds the blocks
    of prompt and answer but the last sampled token (whose KV vLLM has not computed), so the next turn, the history
    with the answer in it, is predicted cached up to there. A backend that reports no ids records the prompt alone."""
    routing = {"prefix_min_distinct_tokens": 32, "prefix_block_size": BS}
    cfg = platform_config(tiny_base, max_model_len=2048, routing=routing)
    answer_id = 7
    backends = {"swiftkv": FakeBackend("swiftkv", tokens=50, token_id=answer_id), "base": FakeBackend("base", tokens=50)}
    served = InProcessGateway(cfg, backends, batch=False)
    index = served.gateway.policy.index
    history = [t % 500 + 1 for t in tokens(200, 1)]  # prompt-heavy: the swiftkv pool by ratio (ids of the tiny vocabulary)

    async def run():
        async with served.client() as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": history, "max_tokens": 50})
            assert r.status_code == 200 and "pool=swiftkv" in r.headers["x-swiftkv-route"], r.text
            assert index.blocks("swiftkv") == (200 + 50 - 1) // BS  # 15 blocks: 12 of the prompt, 3 the answer filled
            turn2 = history + [answer_id] * 50 + [t % 500 + 1 for t in tokens(30, 2)]
            assert served.gateway.policy.cached_tokens("swiftkv", len(turn2), index.hashes(turn2)) == (200 + 50 - 1) // BS * BS

            served.gateway.policy.forget("swiftkv")
            backends["swiftkv"].token_id = None  # a remote server: text only
            r = await c.post("/v1/completions", json={"model": "m", "prompt": history, "max_tokens": 50})
            assert r.status_code == 200, r.text
            assert index.blocks("swiftkv") == 200 // BS

    asyncio.run(run())


# ---- vLLM's KV-cache events (routing.kv_events) ---------------------------------------------------------------------
class Publisher:
    """vLLM's own KV-cache event publisher (ZmqEventPublisher, as an engine runs it) on `endpoint`."""

    def __init__(self, endpoint: str):
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.pub = ZmqEventPublisher(0, endpoint=endpoint)

    def send(self, *events) -> None:
        import time

        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def until(self, condition, *events) -> None:
        """Publish `events` until `condition()` holds: a subscriber that just connected misses what came before its
        subscription reached the publisher (ZMQ's slow joiner)."""
        import time

        deadline = time.time() + 10
        while not condition():
            assert time.time() < deadline, "the events never arrived"
            self.send(*events)
            time.sleep(0.05)


def stored(hashes, medium="GPU"):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes], parent_block_hash=None, token_ids=[],
                       block_size=BS, lora_id=None, medium=medium, lora_name=None)


def removed(hashes):
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in hashes], medium="GPU")


def test_the_engines_kv_cache_events_correct_the_index(tmp_path):
    """vLLM's publisher, its events as an engine sends them (integer block hashes, vLLM's default): blocks stored enter
    the index, blocks removed leave it, a cleared cache empties it; an offloading tier's events (medium CPU) do not count."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared

    from services.common.kv_events import KVEventFeed

    index = PrefixIndex(capacity_blocks=64, block_size=BS)
    chain, other = index.hashes(tokens(4 * BS, 1)), index.hashes(tokens(2 * BS, 2))
    pub = Publisher(f"ipc://{tmp_path}/kv-events")
    feed = KVEventFeed(pub.pub.get_publisher_config().endpoint, lambda h: index.record("p", h), lambda h: index.removed("p", h),
                       lambda: index.forget("p"))
    feed.start()
    try:
        pub.until(lambda: index.cached_tokens("p", chain) == 4 * BS, stored(chain))
        pub.until(lambda: index.cached_tokens("p", chain) == 2 * BS, removed(chain[2:3]))  # the chain holds up to the gap
        n = feed.batches
        pub.send(stored(other, medium="CPU"), stored(chain[2:3]))
        pub.until(lambda: feed.batches > n)
        assert index.cached_tokens("p", other) == 0 and index.cached_tokens("p", chain) == 4 * BS
        pub.until(lambda: index.blocks("p") == 0, AllBlocksCleared())
    finally:
        feed.stop()
        pub.pub.shutdown()


def test_a_pool_of_several_engines_keeps_a_block_while_any_of_them_holds_it(tmp_path):
    """routing.kv_events over a pool of two servers (a remote pool of several URLs): one server's eviction, or its
    cleared cache, takes a block out of the pool's index only once the other does not hold it either (a pool of one
    engine that clears its cache forgets everything: above)."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared

    from services.config import RoutingConfig
    from services.gateway.routing import RoutePolicy

    policy = RoutePolicy(RoutingConfig(cache_aware=True, kv_events=True, prefix_block_size=BS))
    index = policy.index
    shared, only_a = index.hashes(tokens(2 * BS, 3)), index.hashes(tokens(2 * BS, 4))
    a, b = Publisher(f"ipc://{tmp_path}/a"), Publisher(f"ipc://{tmp_path}/b")
    feed_a, feed_b = (policy.follow_kv_events("base", p.pub.get_publisher_config().endpoint) for p in (a, b))

    def held(hashes) -> int:
        return index.cached_tokens("base", hashes)

    def sent(pub, feed, *events) -> None:
        n = feed.batches
        pub.send(*events)
        pub.until(lambda: feed.batches > n)

    try:
        a.until(lambda: held(shared) == held(only_a) == 2 * BS, stored(shared), stored(only_a))
        b.until(lambda: feed_b.batches > 0, stored(shared))
        sent(a, feed_a, removed(shared))
        assert held(shared) == 2 * BS  # b still holds it
        sent(b, feed_b, removed(shared))
        assert held(shared) == 0  # neither does
        b.until(lambda: held(shared) == 2 * BS, stored(shared))
        sent(a, feed_a, AllBlocksCleared())
        assert held(only_a) == 0 and held(shared) == 2 * BS  # a's own blocks went with its cache; b's stay
    finally:
        for feed in (feed_a, feed_b):
            feed.stop()
        a.pub.shutdown()
        b.pub.shutdown()


def engine_block_hashes(ids: list[int], cache_salt: str | None) -> list[bytes]:
    """The block hashes a vLLM engine computes for a request of `ids` with this `cache_salt` (its own Request and block
    hasher, sha256, NONE_HASH from the same seed as the index's)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kv
    from vllm.v1.request import Request

    saved = {name: getattr(kv, name) for name in ("NONE_HASH", "_NONE_HASH_SEED") if hasattr(kv, name)}
    sha256 = get_hash_fn_by_name("sha256")
    try:
        kv.init_none_hash(sha256)
        request = Request("r", ids, SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                          block_hasher=kv.get_request_block_hasher(BS, sha256))
        return list(request.block_hashes)
    finally:
        for name, value in saved.items():
            setattr(kv, name, value)


@pytest.mark.parametrize("share", [False, True])
def test_a_dual_mode_engines_base_mode_events_land_under_the_base_model(share, tmp_path):
    """routing.kv_events with a dual-mode pool: the engine salts its base-mode requests' blocks with the mode's salt (joined
    to the key's where keys' caches are apart: swiftkv_core.dual_mode.cache_salt) and its events name the salted hashes
    (computed here by vLLM's own Request block hasher). The index hashes the base model's blocks the same way, so the
    events, fed to the pool's feed (its batches applied in-process), land under the base model's entries: the prompt is
    found cached as the base model and not as SwiftKV, and draws the next prompt-heavy turn to the base model there;
    the SwiftKV mode's events land under its own; an eviction of base-mode blocks leaves the SwiftKV ones."""
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from swiftkv_core.dual_mode import cache_salt

    policy = RoutePolicy(RoutingConfig(cache_aware=True, kv_events=True, prefix_block_size=BS,
                                       prefix_min_distinct_tokens=64), per_key=not share)
    key = policy.key_salt("team-a")
    assert (key is None) == share
    feed = policy.follow_kv_events("base", f"ipc://{tmp_path}/kv-events")  # nothing publishes: batches applied below
    encode = msgspec.msgpack.Encoder().encode

    def send(*events) -> None:
        feed.apply(encode(KVEventBatch(ts=0.0, events=list(events))))

    try:
        history = tokens(2000, 31)
        turn2 = history + tokens(100, 32)
        base_blocks, swiftkv_blocks = (engine_block_hashes(history, cache_salt(mode, key)) for mode in ("base", "swiftkv"))
        prompt = policy.blocks(turn2, key)
        assert list(prompt.for_mode("base")[:125]) == base_blocks and list(prompt[:125]) == swiftkv_blocks
        send(stored(base_blocks))
        assert policy.cached_tokens("base", len(turn2), prompt, "base") == 2000 // BS * BS
        assert policy.cached_tokens("base", len(turn2), prompt, "swiftkv") == 0
        p = pools()
        p["base"].dual_mode = True
        d = policy.decide(len(turn2), 10, p, blocks=prompt)  # prompt-heavy: swiftkv by ratio; its history is on base
        assert (d.pool, d.reason, d.mode) == ("base", "prefix", "base")
        send(stored(swiftkv_blocks))
        assert policy.cached_tokens("base", len(turn2), prompt, "swiftkv") == 2000 // BS * BS
        send(removed(base_blocks[60:]))
        assert policy.cached_tokens("base", len(turn2), prompt, "base") == 60 * BS
        assert policy.cached_tokens("base", len(turn2), prompt, "swiftkv") == 2000 // BS * BS
        assert feed.batches == 3
    finally:
        feed.stop()


def test_the_gateway_follows_each_pools_kv_cache_events(tiny_base, tmp_path):
    """routing.kv_events through the app: the gateway subscribes to each pool's engines' events when it starts. The
    SwiftKV engine evicts the history turn 1 left there: turn 2 goes where the ratio says, not to the evicted cache;
    the engine stores it again and the base engine clears its cache: turn 2 follows the history to swiftkv."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared

    ends = {name: f"ipc://{tmp_path}/{name}.kv-events" for name in ("swiftkv", "base")}
    cfg = platform_config(tiny_base, max_model_len=2048, routing={"prefix_min_distinct_tokens": 32, "prefix_block_size": BS,
                                                                  "kv_events": True})
    backends = {name: FakeBackend(name, kv_events=[ends[name]]) for name in ends}
    served = InProcessGateway(cfg, backends, batch=False)
    index = served.gateway.policy.index
    pubs = {name: Publisher(end) for name, end in ends.items()}
    history = "The quarterly report says revenue grew in every region. " * 20
    turn2 = {"model": "m", "prompt": history + " Summarize it in detail.", "max_tokens": 400}

    async def run():
        await served.gateway.start()
        assert len(served.gateway.kv_feeds) == 2
        async with served.client() as c:
            before = parse((await c.get("/metrics")).text)
            r = await c.post("/v1/completions", json={"model": "m", "prompt": history, "max_tokens": 5})
            assert "pool=swiftkv; reason=ratio" in r.headers["x-swiftkv-route"], r.text
            blocks = index.hashes(backends["swiftkv"].requests[-1].prompt_token_ids)
            await asyncio.to_thread(pubs["swiftkv"].until, lambda: index.blocks("swiftkv") == 0, removed(blocks))
            r = await c.post("/v1/completions", json=turn2)
            assert "pool=base; reason=ratio" in r.headers["x-swiftkv-route"], r.text
            await asyncio.to_thread(pubs["base"].until, lambda: index.blocks("base") == 0, AllBlocksCleared())
            await asyncio.to_thread(pubs["swiftkv"].until, lambda: index.blocks("swiftkv") == len(blocks), stored(blocks))
            r = await c.post("/v1/completions", json=turn2)
            assert "pool=swiftkv; reason=prefix" in r.headers["x-swiftkv-route"], r.text
            after = parse((await c.get("/metrics")).text)
        await served.gateway.stop()
        return before, after, len(blocks)

    try:
        before, after, n = asyncio.run(run())
    finally:
        gc.unfreeze()
        for pub in pubs.values():
            pub.pub.shutdown()
    delta = lambda **labels: metric(after, "swiftkv_kv_cache_events_blocks_total", **labels) - \
        metric(before, "swiftkv_kv_cache_events_blocks_total", **labels)  # noqa: E731
    assert delta(pool="swiftkv", event="removed") >= n and delta(pool="swiftkv", event="stored") >= n
    assert delta(pool="base", event="cleared") >= 1
    assert not any(feed.running for feed in served.gateway.kv_feeds)


@pytest.mark.engine
def test_a_vllm_engine_publishes_the_blocks_the_gateway_hashes(tiny_base, tmp_path, offline_engines):
    """A real engine with kv_events_config as the gateway sets it for an in-process pool (services/serving/pools.py):
    the blocks it stores for a prompt are those the gateway's index computes, so the events land on the index's own
    keys: the prompt's full blocks, predicted cached, and nothing of a prompt it never saw."""
    from harness.engines import BLOCK, generate, prompt

    from services.common.kv_events import KVEventFeed

    endpoint = f"ipc://{tmp_path}/engine.kv-events"
    index = PrefixIndex(capacity_blocks=64, block_size=BLOCK)
    feed = KVEventFeed(endpoint, lambda h: index.record("e", h), lambda h: index.removed("e", h), lambda: index.forget("e"))
    feed.start()
    # through the run's shared engines (closed at the end): an in-process engine's shutdown tears down vLLM's
    # process-wide state, which an engine another module left running would still need
    llm = offline_engines.get(tiny_base, kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})
    try:
        import time

        deadline = time.time() + 30
        warm = 0
        while feed.batches == 0:  # until the subscription reached the engine's publisher (ZMQ's slow joiner)
            assert time.time() < deadline, "no KV-cache events from the engine"
            warm += 1
            generate(llm, [prompt(2 * BLOCK, seed=100 + warm)], max_tokens=1, logprobs=None)
            time.sleep(0.1)
        ids = prompt(3 * BLOCK + 5, seed=1)
        n = feed.batches
        generate(llm, [ids], max_tokens=1, logprobs=None)
        while feed.batches == n:
            assert time.time() < deadline, "no events for the prompt"
            time.sleep(0.05)
        time.sleep(0.2)  # the step's batch and any after it
        assert index.cached_tokens("e", index.hashes(ids)) == 3 * BLOCK
        assert index.cached_tokens("e", index.hashes(prompt(3 * BLOCK, seed=2))) == 0
        # a key's salted prompt (per-key prefix caches): its events name the blocks the index salts alike
        from vllm import SamplingParams

        salted = prompt(3 * BLOCK + 5, seed=3)
        n = feed.batches
        llm.generate([{"prompt_token_ids": salted, "cache_salt": "0123456789abcdef"}], SamplingParams(max_tokens=1), use_tqdm=False)
        while feed.batches == n:
            assert time.time() < deadline, "no events for the salted prompt"
            time.sleep(0.05)
        time.sleep(0.2)
        assert index.cached_tokens("e", index.hashes(salted, salt="0123456789abcdef")) == 3 * BLOCK
        assert index.cached_tokens("e", index.hashes(salted)) == 0
        # a dual-mode base-mode request's salt (the mode's joined to the key's, as the backends send it): its events
        # name the blocks of the index's base-mode chain, not the key's own
        from services.gateway.routing import PromptBlocks
        from swiftkv_core.dual_mode import with_cache_salt

        based = prompt(3 * BLOCK + 5, seed=4)
        n = feed.batches
        llm.generate([with_cache_salt({"prompt_token_ids": based}, "base", "0123456789abcdef")], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        while feed.batches == n:
            assert time.time() < deadline, "no events for the base-mode prompt"
            time.sleep(0.05)
        time.sleep(0.2)
        blocks = PromptBlocks(index, based, "0123456789abcdef")
        assert index.cached_tokens("e", blocks.for_mode("base")) == 3 * BLOCK
        assert index.cached_tokens("e", blocks) == 0
    finally:
        offline_engines.close()
        feed.stop()


def test_where_each_pool_publishes_its_kv_cache_events(tiny_base):
    """routing.kv_events: an in-process engine publishes on an IPC socket of the gateway's process (a kv_events_config
    of the pool's own is kept); a remote pool's servers where kv_events_endpoint says, one per url; off: nowhere."""
    from services.config import PoolConfig
    from services.serving.engine import InProcessBackend
    from services.serving.pools import engine_args_with_kv_events, remote_pool

    cfg = platform_config(tiny_base, routing={"kv_events": True})
    args = engine_args_with_kv_events("base", cfg.pools["base"], cfg)
    events = args["kv_events_config"]
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq" and events["endpoint"].startswith("ipc://")
    assert InProcessBackend("base", "m", "m-base", args).kv_event_endpoints() == [events["endpoint"]]
    own = {"enable_kv_cache_events": True}  # vLLM's defaults: zmq, bound on tcp://*:5557
    cfg.pools["base"].engine_args["kv_events_config"] = own
    assert engine_args_with_kv_events("base", cfg.pools["base"], cfg)["kv_events_config"] == own
    assert InProcessBackend("base", "m", "m-base", {"kv_events_config": own}).kv_event_endpoints() == ["tcp://127.0.0.1:5557"]
    assert InProcessBackend("base", "m", "m-base", {"kv_events_config": {**own, "publisher": "null"}}).kv_event_endpoints() == []
    off = platform_config(tiny_base)
    assert "kv_events_config" not in engine_args_with_kv_events("base", off.pools["base"], off)
    assert InProcessBackend("base", "m", "m-base", {}).kv_event_endpoints() == []

    remote = PoolConfig(model="m", backend="remote", url=["http://a:8000", "http://b:8000"],
                        kv_events_endpoint=["tcp://a:5557", "tcp://b:5557"])
    assert remote_pool("base", remote, cfg).kv_event_endpoints() == ["tcp://a:5557", "tcp://b:5557"]
    assert remote_pool("base", remote, off).kv_event_endpoints() == []  # routing.kv_events off: not read
    with pytest.raises(ValueError, match="one per url"):
        PoolConfig(model="m", backend="remote", url=["http://a:8000", "http://b:8000"], kv_events_endpoint="tcp://a:5557")
    with pytest.raises(ValueError, match="for remote pools"):
        PoolConfig(model="m", kv_events_endpoint="tcp://a:5557")
    with pytest.raises(ValueError, match="not a ZMQ endpoint: tcp://host:port"):
        PoolConfig(model="m", backend="remote", url="http://a:8000", kv_events_endpoint="a:5557")


# ---- tenancy: each key's prefix cache is its own ------------------------------------------------------------------
def test_salted_block_hashes_are_the_ones_vllm_computes():
    """A request's cache_salt (an API key's, where keys' caches are apart) is hashed into its first block as vLLM
    hashes it, so the engines' KV-cache events still land on the index's keys; two salts, or none, never meet."""
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kv
    from vllm.v1.request import Request

    saved = {name: getattr(kv, name) for name in ("NONE_HASH", "_NONE_HASH_SEED") if hasattr(kv, name)}
    sha256 = get_hash_fn_by_name("sha256")
    try:
        kv.init_none_hash(sha256)
        index = PrefixIndex(capacity_blocks=64, block_size=BS)
        ids = tokens(3 * BS + 5, seed=7)
        for salt in ("0123456789abcdef", "swiftkv-base-mode:0123456789abcdef"):
            request = Request("r", ids, SamplingParams(max_tokens=1), None, cache_salt=salt,
                              block_hasher=kv.get_request_block_hasher(BS, sha256))
            assert index.hashes(ids, salt=salt) == list(request.block_hashes)
        salted = index.hashes(ids, salt="a")
        assert not set(salted) & set(index.hashes(ids)) and not set(salted) & set(index.hashes(ids, salt="b"))
        # a chain continued after a parent (an answer's blocks) is not salted again: vLLM salts the first block only
        assert index.hashes(ids[BS:], parent=salted[0], salt="a") == salted[1:]
    finally:
        for name, value in saved.items():
            setattr(kv, name, value)


KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


def two_keys_send_one_document(tiny_base, caplog, **routing) -> tuple[InProcessGateway, list[str], float]:
    """Key A sends a long document (prompt-heavy: the swiftkv pool), then key B the same document with a decode-heavy
    question (the ratio says base). (the gateway, B's x-swiftkv-route header, B's requests routed by `prefix`)."""
    import logging

    cfg = platform_config(tiny_base, max_model_len=2048,
                          routing={"prefix_min_distinct_tokens": 32, "prefix_block_size": BS, "expose_reason": False} | routing)
    served = InProcessGateway(cfg, keys=(KEY_A, KEY_B), batch=False)
    document = "The quarterly report says revenue grew in every region. " * 20
    routes = []

    async def run():
        async with served.client(KEY_A) as a, served.client(KEY_B) as b:
            r = await a.post("/v1/completions", json={"model": "m", "prompt": document, "max_tokens": 5})
            assert r.status_code == 200, r.text
            before = parse((await a.get("/metrics")).text)
            r = await b.post("/v1/completions", json={"model": "m", "prompt": document + " Summarize it.", "max_tokens": 400})
            assert r.status_code == 200, r.text
            routes.append(r.headers["x-swiftkv-route"])
            after = parse((await a.get("/metrics")).text)
            return sum(metric(after, "swiftkv_route_decisions_total", pool=p, reason="prefix", source="live") -
                       metric(before, "swiftkv_route_decisions_total", pool=p, reason="prefix", source="live") for p in ("swiftkv", "base"))

    with caplog.at_level(logging.DEBUG, logger="swiftkv.gateway"):
        by_prefix = asyncio.run(run())
    return served, routes, by_prefix


def test_another_keys_request_is_not_routed_to_a_keys_cached_document(tiny_base, caplog):
    """Two keys, the same long prompt: B's request is not routed by prefix to where A's is cached (its reason, in
    the metrics and the log, is the ratio's) and the engines get a different salt per key (a digest, not the key), so
    the engine's cache keeps them apart too; A's own next turn still follows its cache. The header names the pool only."""
    served, routes, by_prefix = two_keys_send_one_document(tiny_base, caplog)
    backends = served.backends
    assert by_prefix == 0 and routes == ["pool=base"]
    assert any("reason=ratio" in m and "pool=base" in m for m in caplog.messages if "routed:" in m)
    (a,), (b,) = backends["swiftkv"].requests, backends["base"].requests
    assert a.key_salt and b.key_salt and a.key_salt != b.key_salt
    assert not any(k in s or digest(k) in s for k in (KEY_A, KEY_B) for s in (a.key_salt, b.key_salt))

    async def again():  # A's own follow-up finds A's blocks
        async with served.client(KEY_A) as c:
            document = "The quarterly report says revenue grew in every region. " * 20
            r = await c.post("/v1/completions", json={"model": "m", "prompt": document + " Summarize it.", "max_tokens": 400})
            assert r.status_code == 200 and r.headers["x-swiftkv-route"] == "pool=swiftkv", r.headers

    asyncio.run(again())
    assert backends["swiftkv"].requests[-1].key_salt == a.key_salt


def test_share_prefix_cache_lets_keys_share_and_one_tenant_is_not_salted(tiny_base, caplog):
    """routing.share_prefix_cache: B's request goes where A's document is cached (reason prefix, shown with
    expose_reason), unsalted; without keys nothing is salted either."""
    served, routes, by_prefix = two_keys_send_one_document(tiny_base, caplog, share_prefix_cache=True, expose_reason=True)
    assert by_prefix == 1 and routes[0].startswith("pool=swiftkv; reason=prefix; ratio=")
    assert all(r.key_salt is None for b in served.backends.values() for r in b.requests)

    cfg = platform_config(tiny_base, max_model_len=2048)
    alone = InProcessGateway(cfg, batch=False)

    async def run():
        async with alone.client() as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello " * 50, "max_tokens": 1})
            assert r.status_code == 200, r.text

    asyncio.run(run())
    assert [r.key_salt for b in alone.backends.values() for r in b.requests] == [None]


def test_the_route_header_names_the_pool_only_unless_the_operator_exposes_the_reason(tiny_base):
    """routing.expose_reason off (its default): `x-swiftkv-route: pool=...` (and `; mode=...` on a dual-mode pool running
    the other model); on: the reason and ratio too."""
    from services.gateway.routing import Decision

    assert RoutingConfig().expose_reason is False and RoutingConfig().share_prefix_cache is False
    assert Decision("swiftkv", "prefix", 2.5).header() == "pool=swiftkv"
    assert Decision("base", "backlog", 12.5, mode="swiftkv").header() == "pool=base; mode=swiftkv"
    assert Decision("base", "backlog", 12.5, mode="swiftkv").header(True) == "pool=base; reason=backlog; ratio=12.50; mode=swiftkv"
    for expose, header in ((False, "pool=base"), (True, "pool=base; reason=ratio; ratio=")):
        cfg = platform_config(tiny_base, routing={"expose_reason": expose})
        served = InProcessGateway(cfg, batch=False)

        async def run(served: InProcessGateway) -> str:
            async with served.client() as c:
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 50})
                assert r.status_code == 200, r.text
                return r.headers["x-swiftkv-route"]

        got = asyncio.run(run(served))
        assert got == header if not expose else got.startswith(header), got
    assert all(RoutingConfig.model_fields[f].description for f in ("expose_reason", "share_prefix_cache"))
