"""`prompt_cache_key` (OpenAI's chat and Responses APIs) as a hint to cache-aware routing: where the prefix index predicts
nothing cached for a request's own blocks, it goes where its API key's last request with the same prompt_cache_key
went, within the load balance (route reason `cache_key`); never by another key's. In-process: the route policy over
real PoolStates, and the real gateway app (chat, Responses, metrics) over the fake backend."""

from __future__ import annotations

import asyncio
import random

from harness import metric
from harness.gateway import InProcessGateway, platform_config
from harness.metrics import parse

from services.config import RoutingConfig
from services.gateway.routing import PoolState, RoutePolicy

BS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32_000) for _ in range(n)]


def pools(**work) -> dict[str, PoolState]:
    out = {name: PoolState(name, backend=None, served_model_name=f"m-{name}", ready=True) for name in ("swiftkv", "base")}
    for name, tokens_ in work.items():
        out[name].dispatched(tokens_)
    return out


def policy(**fields) -> RoutePolicy:
    return RoutePolicy(RoutingConfig(**{"prefix_min_distinct_tokens": 64, "prefix_block_size": BS} | fields))


# ---- the route policy --------------------------------------------------------------------------------------------
def test_a_cold_prompt_follows_its_keys_prompt_cache_key_within_the_balance():
    """Prompt-heavy (the ratio says swiftkv) and nothing of it cached: the pool that last served the key's
    prompt_cache_key (base) serves it, reason cache_key, unless base holds more work than swiftkv by more than
    balance_margin_tokens (2,048); a hint naming the ratio's own pool changes nothing."""
    p = policy()
    p.served_cache_key("key-a", "support-bot", "base", None)
    hint = p.cache_key_hint("key-a", "support-bot")
    assert hint == ("base", "base")
    prompt = tokens(2000, 1)
    d = p.decide(2000, 50, pools(), blocks=p.blocks(prompt), hint=hint)
    assert (d.pool, d.reason, d.mode) == ("base", "cache_key", "base")
    assert "reason=cache_key" in d.header(expose_reason=True) and d.header() == "pool=base"
    assert p.decide(2000, 50, pools(), blocks=p.blocks(prompt)).reason == "ratio"  # no hint: the ratio
    d = p.decide(2000, 50, pools(base=2048), blocks=p.blocks(prompt), hint=hint)
    assert (d.pool, d.reason) == ("base", "cache_key")  # at the margin
    d = p.decide(2000, 50, pools(base=2049), blocks=p.blocks(prompt), hint=hint)
    assert (d.pool, d.reason) == ("swiftkv", "ratio")  # beyond it: the load balance rules
    d = p.decide(2000, 50, pools(swiftkv=5000), blocks=p.blocks(prompt), hint=("swiftkv", "swiftkv"))
    assert (d.pool, d.reason) == ("base", "backlog")  # a hint to the ratio's pool does not hold it against the load
    unready = pools()
    unready["base"].ready = False
    assert p.decide(2000, 50, unready, blocks=p.blocks(prompt), hint=hint).pool == "swiftkv"  # never to a pool that is down


def test_on_dual_mode_pools_the_hint_names_the_pool_and_the_model():
    """Dual-mode pools: a hint to the other pool running the intended model moves the request there as that model; a
    hint naming the ratio's own pool and model leaves the load balance to decide (no margin between like engines)."""
    p = policy()
    dual = pools()
    dual["swiftkv"].dual_mode = dual["base"].dual_mode = True
    prompt = tokens(2000, 8)
    d = p.decide(2000, 50, dual, blocks=p.blocks(prompt), hint=("base", "swiftkv"))
    assert (d.pool, d.reason, d.mode) == ("base", "cache_key", "swiftkv")
    busy = pools(swiftkv=100)
    busy["swiftkv"].dual_mode = busy["base"].dual_mode = True
    d = p.decide(2000, 50, busy, blocks=p.blocks(prompt), hint=("swiftkv", "swiftkv"))
    assert (d.pool, d.reason, d.mode) == ("base", "backlog", "swiftkv")


def test_the_prefix_index_wins_over_the_hint():
    """Where a pool holds the prompt's history, the index decides (prefix, or the ratio where the ratio's pool holds it);
    the hint counts only where nothing is predicted cached beyond prefix_min_distinct_tokens."""
    p = policy()
    history = tokens(2000, 2)
    p.record("swiftkv", p.blocks(history))
    turn2 = history + tokens(100, 3)
    d = p.decide(len(turn2), 1000, pools(), blocks=p.blocks(turn2), hint=("base", "base"))
    assert (d.pool, d.reason) == ("swiftkv", "prefix")
    d = p.decide(len(turn2), 10, pools(), blocks=p.blocks(turn2), hint=("base", "base"))
    assert (d.pool, d.reason) == ("swiftkv", "ratio")  # cached where the ratio sends it: stays
    # a shared system prompt up to the distinctive minimum counts as nothing: the hint decides
    system = tokens(64, 4)
    p.record("swiftkv", p.blocks(system + tokens(500, 5)))
    mine = system + tokens(500, 6)
    d = p.decide(len(mine), 10, pools(), blocks=p.blocks(mine), hint=("base", "base"))
    assert (d.pool, d.reason) == ("base", "cache_key")


def test_hints_are_per_key_bounded_and_only_with_cache_aware_routing():
    p = policy()
    p.served_cache_key("key-a", "k", "base", None)
    assert p.cache_key_hint("key-b", "k") is None and p.cache_key_hint("key-a", "other") is None
    assert p.cache_key_hint("key-a", None) is None
    p.served_cache_key("key-a", "k", "swiftkv", None)  # the last pool to serve it
    assert p.cache_key_hint("key-a", "k") == ("swiftkv", "swiftkv")
    p.served_cache_key("key-a", "d", "base", "swiftkv")  # a dual-mode base pool running the SwiftKV model
    assert p.cache_key_hint("key-a", "d") == ("base", "swiftkv")
    p.CACHE_KEY_ENTRIES = 3
    for i in range(3):
        p.served_cache_key("key-c", f"k{i}", "base", None)
    p.served_cache_key("key-a", "d", "base", "swiftkv")  # served again: the most recent
    p.served_cache_key("key-c", "k3", "base", None)  # over the bound: the least recently served pairs go
    assert p.cache_key_hint("key-a", "k") is None and p.cache_key_hint("key-c", "k0") is None
    assert len(p._cache_keys) == 3 and p.cache_key_hint("key-a", "d") == ("base", "swiftkv")
    off = policy(cache_aware=False)
    off.served_cache_key("key-a", "k", "base", None)
    assert off.cache_key_hint("key-a", "k") is None and not off._cache_keys
    # a hint the pools cannot serve as recorded (a model the pool does not run) is not followed
    d = p.decide(2000, 50, pools(), blocks=p.blocks(tokens(2000, 7)), hint=("base", "swiftkv"))
    assert (d.pool, d.reason) == ("swiftkv", "ratio")


# ---- through the gateway -----------------------------------------------------------------------------------------
KEY_A, KEY_B = "sk-cache-key-a", "sk-cache-key-b"
QUESTION = "Which region grew the most?"


def document(topic: str) -> str:
    return f"The {topic} report says revenue grew in every region, and costs fell in most of them. " * 12


def test_the_gateway_routes_a_keys_requests_with_one_prompt_cache_key_together(tiny_base, tmp_path):
    """Key A's decode-heavy chat request with prompt_cache_key `support` goes to base (the ratio); its next requests
    with that key, prompt-heavy and with documents nothing holds (the ratio says swiftkv), follow it there, by chat
    and by /v1/responses (reason cache_key, counted in the route metrics); key B's request with the same
    prompt_cache_key, and A's without one, go where the ratio says. A document A's earlier request left cached is
    routed by the index. A prompt_cache_key over 64 characters is a 400 naming it."""
    routing = {"prefix_min_distinct_tokens": 32, "prefix_block_size": BS}
    cfg = platform_config(tiny_base, max_model_len=2048, routing=routing, data_dir=str(tmp_path))
    served = InProcessGateway(cfg, keys=(KEY_A, KEY_B), batch=False)

    def chat(content: str, max_tokens: int, **extra) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}

    async def run():
        async with served.client(KEY_A) as a, served.client(KEY_B) as b:
            before = parse((await a.get("/metrics")).text)

            async def route(client, path: str, body: dict) -> str:
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                header = r.headers["x-swiftkv-route"]
                return header.split("; ratio=")[0]

            assert await route(a, "/v1/chat/completions", chat(QUESTION, 400, prompt_cache_key="support")) == "pool=base; reason=ratio"
            assert await route(a, "/v1/chat/completions", chat(document("quarterly"), 5, prompt_cache_key="support")) == \
                "pool=base; reason=cache_key"
            assert await route(b, "/v1/chat/completions", chat(document("annual"), 5, prompt_cache_key="support")) == \
                "pool=swiftkv; reason=ratio"  # another key's prompt_cache_key is not A's
            assert await route(a, "/v1/chat/completions", chat(document("monthly"), 5)) == "pool=swiftkv; reason=ratio"
            r = await a.post("/v1/responses", json={"model": "m", "input": document("weekly"), "max_output_tokens": 5,
                                                    "prompt_cache_key": "support", "store": False})
            assert r.status_code == 200, r.text
            assert r.headers["x-swiftkv-route"].startswith("pool=base; reason=cache_key") and r.json()["prompt_cache_key"] == "support"
            # the monthly document is cached on swiftkv: a decode-heavy question about it stays there by the index
            assert await route(a, "/v1/chat/completions", chat(document("monthly") + QUESTION, 400, prompt_cache_key="support")) == \
                "pool=swiftkv; reason=prefix"
            # ... and the key's hint follows the pool that served it last
            assert await route(a, "/v1/chat/completions", chat(document("daily"), 400, prompt_cache_key="support")) == \
                "pool=swiftkv; reason=cache_key"
            after = parse((await a.get("/metrics")).text)
            assert metric(after, "swiftkv_route_decisions_total", pool="base", reason="cache_key", source="live") - \
                metric(before, "swiftkv_route_decisions_total", pool="base", reason="cache_key", source="live") == 2

            r = await a.post("/v1/chat/completions", json=chat(QUESTION, 5, prompt_cache_key="k" * 65))
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text

    asyncio.run(run())


def test_chat_accepts_prompt_cache_key_as_openais_client_sends_it():
    """The official client's chat.completions.create takes prompt_cache_key: the gateway's schema does too."""
    import inspect

    import openai

    from services.gateway.schemas import ChatCompletionRequest

    assert "prompt_cache_key" in inspect.signature(openai.resources.chat.Completions.create).parameters
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "prompt_cache_key": "tenant-docs"})
    assert req.prompt_cache_key == "tenant-docs"
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).prompt_cache_key is None
