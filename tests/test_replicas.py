"""Replica choice inside a pool of several servers (services/serving/replicas.py): prefix affinity by rendezvous hashing
of the distinctive prefix, bounded by load; a replica down is left out. The chooser alone, then a ReplicaSet of real
RemoteBackends over two real HTTP servers (the gateway's app over the fake backend, as OpenAI-compatible upstreams),
and what a remote pool's servers are sent for a dual-mode engine's base-mode request (a recording HTTP server)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from harness.gateway import PUBLIC, platform_config, served_gateway

from services.serving.backend import BackendDown, GenerateRequest, SamplingOptions
from services.serving.pools import remote_pool
from services.serving.remote import RemoteBackend
from services.serving.replicas import AFFINITY, LEAST_LOADED, SPILL, ReplicaChooser, ReplicaSet, rendezvous

BS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def request(prompt: list[int], max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(f"r{random.random()}", prompt, SamplingOptions(max_tokens=max_tokens))


def chooser(replicas=("a", "b"), **fields) -> ReplicaChooser:
    return ReplicaChooser(list(replicas), **({"block_size": BS, "min_distinct_tokens": 64, "load_margin_tokens": 1000} | fields))


def test_a_conversations_turns_keep_to_one_replica_and_conversations_spread():
    c = chooser()
    homes = []
    for conversation in range(200):
        history = tokens(100, conversation)
        turns = [c.choose(request(history + tokens(20 * k, 1000 + k))) for k in range(1, 4)]
        assert len({replica for replica, _ in turns}) == 1 and {reason for _, reason in turns} == {AFFINITY}
        homes.append(turns[0][0])
    assert 70 <= Counter(homes)["a"] <= 130  # rendezvous hashing: an even spread, not one replica


def test_a_shared_system_prompt_shorter_than_the_distinctive_minimum_spreads():
    c = chooser()
    system = tokens(60, 1)  # under 64 tokens + one block: the key includes each user's own tokens
    homes = Counter(c.choose(request(system + tokens(50, u)))[0] for u in range(100))
    assert min(homes.values()) >= 30


def test_affinity_is_the_same_in_every_gateway_process_and_moves_little_when_a_replica_goes():
    one, two = chooser(("a", "b", "c")), chooser(("a", "b", "c"))
    prompts = [tokens(200, s) for s in range(60)]
    assert [one.choose(request(p)) for p in prompts] == [two.choose(request(p)) for p in prompts]
    before = {i: one.choose(request(p))[0] for i, p in enumerate(prompts)}
    one.up["c"] = False
    after = {i: one.choose(request(p))[0] for i, p in enumerate(prompts)}
    assert {i for i in before if before[i] != after[i]} == {i for i in before if before[i] == "c"}
    assert rendezvous(b"k", ["a", "b", "c"]) == rendezvous(b"k", ["c", "b", "a"])


def test_a_popular_prefix_spills_to_the_next_replica_beyond_the_load_margin():
    c = chooser()
    document = tokens(300, 5)
    first, reason = c.choose(request(document + tokens(10, 1)))
    assert reason == AFFINITY
    other = "b" if first == "a" else "a"
    c.work[first] = 1000  # within the margin of the idle replica: the cache still wins
    assert c.choose(request(document + tokens(10, 2))) == (first, AFFINITY)
    c.work[first] = 1001
    assert c.choose(request(document + tokens(10, 3))) == (other, SPILL)


def test_each_keys_copy_of_a_prefix_is_ranked_on_its_own_salt():
    """A key whose prefix cache is its own (a salt) finds its prefix's replica by the salted block, as the engine caches
    it: its turns keep to one replica, and another key's copy of the same document is ranked apart (not drawn to
    the replica that holds the first key's)."""
    document = tokens(300, 5)
    assert chooser().key(document, "k1") != chooser().key(document) and chooser().key(document, "k1") != chooser().key(document, "k2")

    def salted(salt: str, seed: int) -> GenerateRequest:
        r = request(document + tokens(10, seed))
        r.key_salt = salt
        return r

    c = chooser(tuple("abcdefgh"))
    assert len({c.choose(salted("k1", s))[0] for s in range(4)}) == 1
    assert len({c.choose(salted(f"k{i}", 0))[0] for i in range(8)}) > 1  # 8 keys on 8 replicas: not one replica


def test_short_prompts_go_to_the_least_loaded_in_turn():
    c = chooser()
    assert c.key(tokens(79, 1)) is None and c.key(tokens(80, 1)) is not None  # 64 tokens + the block past them
    picks = [c.choose(request(tokens(10, s)))[0] for s in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]
    c.work["a"] = 5
    assert c.choose(request(tokens(10, 9))) == ("b", LEAST_LOADED)
    c.up["b"] = False
    assert c.choose(request(tokens(10, 9)))[0] == "a"
    c.up["a"] = False
    with pytest.raises(BackendDown):
        c.choose(request(tokens(10, 9)))


def test_a_remote_pool_of_several_urls_is_a_replica_set(tiny_base):
    one = platform_config(tiny_base, {"base": {"backend": "remote", "url": "http://h1:8000"}})
    assert isinstance(remote_pool("base", one.pools["base"], one), RemoteBackend)
    cfg = platform_config(tiny_base, {"base": {"backend": "remote", "url": ["http://h1:8000", "http://h2:8000/v1"]}},
                          routing={"prefix_block_size": 32, "prefix_min_distinct_tokens": 100})
    pool = remote_pool("base", cfg.pools["base"], cfg)
    assert isinstance(pool, ReplicaSet) and list(pool.replicas) == ["h1:8000", "h2:8000"]
    assert (pool.chooser.block_size, pool.chooser.min_distinct_tokens) == (32, 100)
    with pytest.raises(ValueError, match="lists a server twice"):
        platform_config(tiny_base, {"base": {"backend": "remote", "url": ["http://h1:8000", "http://h1:8000"]}})


def test_replicas_over_http_keep_affinity_and_route_around_a_replica_that_is_down(tiny_base, tmp_path):
    """Two real upstream servers: a conversation's turns all reach one; when that one stops answering, the next turn
    reaches the other and the pool keeps serving; with both gone the pool is down."""
    with served_gateway(tiny_base, tmp_path / "u1", batch=False) as u1, served_gateway(tiny_base, tmp_path / "u2", batch=False) as u2:
        upstreams = {f"127.0.0.1:{u1.port}": u1, f"127.0.0.1:{u2.port}": u2}
        replicas = {name: RemoteBackend("up", f"http://{name}", PUBLIC) for name in upstreams}
        pool = ReplicaSet("up", replicas, chooser(tuple(replicas)))

        def served_by() -> dict[str, int]:
            return {name: sum(len(b.requests) for b in u.served.backends.values()) for name, u in upstreams.items()}

        async def turn(prompt: list[int]) -> int:
            n = 0
            async for out in pool.generate(request(prompt, max_tokens=3)):
                n += sum(c.num_tokens for c in out.choices)
            return n

        async def run():
            await pool.start()
            history = tokens(120, 7)
            for k in range(3):
                assert await turn(history + tokens(10 * (k + 1), k)) == 1  # the fake answers one token
            counts = served_by()
            home = max(counts, key=counts.get)
            assert counts[home] == 3 and sum(counts.values()) == 3
            await asyncio.to_thread(upstreams[home].__exit__, None, None, None)  # that server goes away
            assert await turn(history + tokens(40, 9)) == 1
            other = next(name for name in upstreams if name != home)
            assert served_by()[other] == 1 and not pool.chooser.up[home]
            assert await pool.health()  # the pool serves on
            await asyncio.to_thread(upstreams[other].__exit__, None, None, None)
            with pytest.raises(BackendDown):
                await turn(history + tokens(50, 10))
            assert not await pool.health()
            await pool.stop()

        asyncio.run(run())


class RecordingUpstream:
    """A real HTTP server standing in for a vLLM OpenAI server: it keeps each /v1/completions body it receives and
    streams a one-token answer."""

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}
                payload = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_base_mode_request_asks_a_dual_mode_server_for_the_base_model():
    """Over real HTTP, a RemoteBackend alone and a ReplicaSet of them (which passes the request on as it came): a
    base-mode request carries vLLM's vllm_xargs {"swiftkv_mode": "base"} and the base mode's cache_salt; a request
    without a mode or in SwiftKV mode carries neither (other servers never see the fields)."""
    upstreams = [RecordingUpstream(), RecordingUpstream()]

    async def send(backend, mode) -> dict:
        outs = [out async for out in backend.generate(GenerateRequest("r", tokens(30, 1), SamplingOptions(max_tokens=1), mode=mode))]
        assert sum(c.num_tokens for o in outs for c in o.choices) == 1
        return next(u.bodies.pop() for u in upstreams if u.bodies)

    async def run():
        single = RemoteBackend("base", upstreams[0].url, "m")
        replicas = {str(i): RemoteBackend("base", u.url, "m") for i, u in enumerate(upstreams)}
        pool = ReplicaSet("base", replicas, chooser(tuple(replicas)))
        try:
            for backend in (single, pool):
                body = await send(backend, "base")
                assert (body["vllm_xargs"], body["cache_salt"]) == ({"swiftkv_mode": "base"}, "swiftkv-base-mode")
                assert body["model"] == "m" and body["prompt"] == tokens(30, 1)
                for mode in (None, "swiftkv"):
                    body = await send(backend, mode)
                    assert "vllm_xargs" not in body and "cache_salt" not in body, mode
        finally:
            await single.stop()
            await pool.stop()

    try:
        asyncio.run(run())
    finally:
        for u in upstreams:
            u.close()


def test_the_ray_serve_router_ranks_the_prefixs_replica_first_within_the_load_bound():
    """Ray Serve's router (services/serving/ray_router.py) ranks candidates as the remote pools choose: the prefix's
    rendezvous order, one replica per rank, those loaded beyond `max_imbalance` requests last; no prefix: one rank."""
    from types import SimpleNamespace

    from services.serving.ray_router import rank

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("r1", "r2", "r3")]
    pending = lambda prompt: SimpleNamespace(args=[request(prompt)])  # noqa: E731 - Ray's PendingRequest: args, kwargs
    queue = dict.fromkeys(("r1", "r2", "r3"), 0)
    ranked = rank(replicas, pending(tokens(300, 1)), 16, 64, 4, lambda r: queue[r.replica_id.unique_id])
    order = [r.replica_id.unique_id for (r,) in ranked]
    assert order == rendezvous(ReplicaChooser(["x"], BS, 64).key(tokens(300, 1)), ["r1", "r2", "r3"])
    assert order == [r.replica_id.unique_id for (r,) in rank(replicas, pending(tokens(300, 1) + tokens(50, 2)), 16, 64, 4,
                                                            lambda r: queue[r.replica_id.unique_id])]  # a later turn
    queue[order[0]] = 5  # 5 beyond the least loaded: past the bound
    again = rank(replicas, pending(tokens(300, 1)), 16, 64, 4, lambda r: queue[r.replica_id.unique_id])
    assert [r.replica_id.unique_id for r in again[-1]] == [order[0]] and len(again) == 3
    assert rank(replicas, pending(tokens(20, 1)), 16, 64, 4, lambda r: 0) == [replicas]  # too short: Ray's own choice
    assert rank(replicas, SimpleNamespace(args=[]), 16, 64, 4, lambda r: 0) == [replicas]


def test_the_ray_serve_router_reads_the_prefix_as_the_platforms_routing_config_says():
    """The Ray pool's router settings come from the platform config: the routing block size, else the pool's engine
    block_size, else vLLM's GPU default; the distinctive minimum as the gateway's."""
    pytest.importorskip("ray.serve")
    from services.config import PoolConfig, RoutingConfig
    from services.serving.ray_backend import router_kwargs

    pool = PoolConfig(model="m")
    assert router_kwargs(pool, None) == {"block_size": 16, "min_distinct_tokens": 256}
    engine_128 = PoolConfig(model="m", engine_args={"block_size": 128})
    assert router_kwargs(engine_128, RoutingConfig(prefix_min_distinct_tokens=512)) == {"block_size": 128, "min_distinct_tokens": 512}
    assert router_kwargs(engine_128, RoutingConfig(prefix_block_size=32)) == {"block_size": 32, "min_distinct_tokens": 256}


@pytest.mark.engine
def test_two_real_engines_keep_a_conversation_on_the_one_holding_its_history_and_spread_a_shared_system_prompt(
        tiny_base, tmp_path, vllm_server, platform):
    """A pool of two real vLLM engines on the tiny base model, through the whole gateway (the app served over HTTP, the
    official client, the pool built from config as `swiftkv serve` builds it): vLLM's own OpenAI server and the shared
    platform's base pool (its engine behind its gateway). A conversation's three turns all reach one engine, whose
    prefix-cache hit counter rises by its history's blocks at each later turn while the other engine serves nothing;
    sixteen users behind one shared system prompt (shorter than the distinctive minimum) are served by both."""
    from harness import metric, scrape
    from harness.engines import KEY
    from harness.engines import PUBLIC as PLATFORM_PUBLIC
    from harness.gateway import InProcessGateway, ThreadedServer
    from harness.gateway import platform_config as gateway_config

    from services.serving.pools import build_backends

    served = f"{PLATFORM_PUBLIC}-base"  # the platform's base pool by name; vLLM's server answers to it too
    engines = {"vllm": (vllm_server, "upstream"), "platform": (platform.base, served)}
    cfg = gateway_config(tiny_base, {"base": {"backend": "remote", "url": [f"{vllm_server}/v1", f"{platform.base}/v1"],
                                              "served_model_name": served, "api_key": KEY}},
                         routing={"prefix_block_size": 128, "prefix_min_distinct_tokens": 128}, data_dir=str(tmp_path))

    def counts() -> dict[str, tuple[float, float]]:
        """engine -> (requests finished, prompt tokens found in its prefix cache), from its own vLLM metrics"""
        out = {}
        for name, (base, model) in engines.items():
            m = scrape(base)
            out[name] = (metric(m, "vllm:request_success_total", model_name=model), metric(m, "vllm:prefix_cache_hits_total", model_name=model))
        return out

    def delta(before, after, i: int) -> dict[str, float]:
        return {name: after[name][i] - before[name][i] for name in after}

    rng = random.Random(3)
    words = ["river", "town", "ledger", "harbor", "quarry", "lantern", "meadow", "copper", "signal", "orchard"]
    with ThreadedServer(InProcessGateway(cfg, build_backends(cfg, "inprocess"), batch=False)) as gw:
        client = gw.client()
        messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(60)) + ". What is this about?"}]
        before = counts()
        hits = []
        for _ in range(3):
            mark = counts()
            answer = client.chat.completions.create(model="m", messages=messages, max_tokens=4, extra_body={"ignore_eos": True})
            hits.append(delta(mark, counts(), 1))
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": f"And then, in {rng.choice(words)}?"}]
        served_by = delta(before, counts(), 0)
        home = max(served_by, key=served_by.get)
        other = next(name for name in engines if name != home)
        assert served_by == {home: 3, other: 0}, served_by
        assert all(h[home] >= 2 * 128 and h[other] == 0 for h in hits[1:]), hits  # the history's two full blocks at least

        system = {"role": "system", "content": "You answer questions about towns, briefly."}  # ~12 tokens: shared by all
        before = counts()
        for user in range(16):
            question = " ".join(rng.choice(words) for _ in range(60))
            client.chat.completions.create(model="m", messages=[system, {"role": "user", "content": f"User {user}: {question}?"}], max_tokens=2)
        spread = delta(before, counts(), 0)
        assert sum(spread.values()) == 16 and min(spread.values()) >= 1, spread
        print(f"conversation: 3 turns on {home}, cache hits {[h[home] for h in hits]}; 16 users spread {spread}")
