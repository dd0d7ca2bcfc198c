"""logit_bias and min_p under speculative decoding: vLLM refuses both on an engine that speculates, so the embedded
default speculates on its base pool only and such requests go to the pool that does not (route reason
`no_speculation`, as the intended model where that pool is dual-mode); where no pool they may go to can serve them,
a 400 names the field. In-process over the fake engines (which refuse them where they speculate, as vLLM does), then
on real engines in the embedded default's layout, where a huge logit bias forces its token."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from harness.gateway import InProcessGateway, platform_config
from harness.openai_schema import assert_openai_shape
from openai.types import Completion
from openai.types.chat import ChatCompletion

from services.config import RoutingConfig, load_config
from services.gateway.routing import NoPoolAvailable, PoolState, RoutePolicy, speculation_excluded
from services.serving.backend import BadRequest, SamplingOptions
from services.serving.fake import FakeBackend

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def refuses_under_speculation(request) -> None:
    """vLLM's own check on an engine that speculates (SamplingParams._validate_spec_decode)."""
    if request.sampling.logit_bias or request.sampling.min_p > 1e-5:
        raise BadRequest("The min_p and logit_bias sampling parameters are not yet supported with speculative decoding.")


def gateway(tiny_base, swiftkv: dict | None = None, base: dict | None = None) -> InProcessGateway:
    cfg = platform_config(tiny_base, {"swiftkv": swiftkv or {}, "base": base if base is not None else {"speculative": NGRAM}})
    backends = {name: FakeBackend(name, check=refuses_under_speculation if cfg.pools[name].speculation else None) for name in cfg.pools}
    return InProcessGateway(cfg, backends, batch=False)


def route(r) -> dict:
    return dict(part.strip().split("=") for part in r.headers["x-swiftkv-route"].split(";"))


def test_what_speculation_excludes():
    assert speculation_excluded(SamplingOptions(max_tokens=1, logit_bias={3: 1.0})) == "logit_bias"
    assert speculation_excluded(SamplingOptions(max_tokens=1, min_p=0.1)) == "min_p"
    assert speculation_excluded(SamplingOptions(max_tokens=1, min_p=1e-6, logit_bias={})) is None  # vLLM's epsilon
    assert speculation_excluded(SamplingOptions(max_tokens=1, top_k=5, temperature=0.5)) is None


def test_the_embedded_default_leaves_one_pool_without_speculation():
    cfg = load_config(None)
    assert cfg.pools["base"].speculation == NGRAM and cfg.pools["swiftkv"].speculation is None


def test_the_policy_sends_them_to_the_pool_without_speculation_whatever_its_load():
    policy = RoutePolicy(RoutingConfig(cache_aware=False))

    def pools(dual: bool = True) -> dict[str, PoolState]:
        p = {name: PoolState(name, FakeBackend(name), f"m-{name}", ready=True, dual_mode=dual, speculative=name == "base")
             for name in ("swiftkv", "base")}
        p["swiftkv"].dispatched(50_000)  # backlogged: the balance would move anything else to base
        return p

    d = policy.decide(20, 200, pools(), unspeculated=True)  # decode-heavy: intended for base, as the base model
    assert (d.pool, d.reason, d.mode) == ("swiftkv", "no_speculation", "base")
    assert d.header(expose_reason=True) == "pool=swiftkv; reason=no_speculation; ratio=0.10; mode=base"
    d = policy.decide(400, 10, pools(), unspeculated=True)
    assert (d.pool, d.reason, d.mode) == ("swiftkv", "no_speculation", "swiftkv")
    assert policy.decide(20, 200, pools(dual=False), unspeculated=True).mode == "swiftkv"  # its own model: it has no other
    assert policy.decide(400, 10, pools()).pool == "base"  # the others: the usual overrides (backlog)
    down = pools()
    down["swiftkv"].ready = False
    with pytest.raises(NoPoolAvailable, match="the one without speculative decoding"):
        policy.decide(400, 10, down, unspeculated=True)
    assert policy.decide(400, 10, down).reason == "fallback"
    both = pools()
    both["swiftkv"].speculative = True  # every pool speculates: admission refused it; the policy does not choose
    assert policy.decide(400, 10, both, unspeculated=True).reason in ("ratio", "backlog")
    d = policy.decide(400, 10, pools(), unspeculated=True)  # a batch line stays where it can be served
    assert policy.steer_batch(d, pools(), lambda pool: pool == "swiftkv") == d


def test_logit_bias_and_min_p_are_served_by_the_pool_that_does_not_speculate(tiny_base):
    served = gateway(tiny_base, {"dual_mode": True}, {"dual_mode": True, "speculative": NGRAM})
    backends = served.backends

    async def run():
        async with served.client() as c:
            for extra in ({"logit_bias": {"300": 100}}, {"min_p": 0.2}):
                r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 50} | extra)
                assert r.status_code == 200, r.text
                assert_openai_shape(r.json(), ChatCompletion)
                assert route(r) == {"pool": "swiftkv", "reason": "no_speculation", "ratio": route(r)["ratio"], "mode": "base"}, r.headers
                assert backends["swiftkv"].requests[-1].mode == "base"  # the model the ratio intended
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 50})
            assert r.status_code == 200 and route(r)["pool"] == "base"  # the rest as before: decode-heavy to base
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 50, "logit_bias": {"5": -100}})
            assert r.status_code == 200 and route(r)["pool"] == "swiftkv", r.text
            assert_openai_shape(r.json(), Completion)

    asyncio.run(run())
    assert not any(q.sampling.logit_bias or q.sampling.min_p for q in backends["base"].requests)


def test_where_no_pool_may_serve_them_a_400_names_the_field(tiny_base):
    async def run():
        served = gateway(tiny_base)
        async with served.client() as c:  # pinned to the speculating pool by its own model name
            r = await c.post("/v1/completions", json={"model": "m-base", "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 3}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "logit_bias" and "model 'm-base' runs speculative decoding" in err["message"]
            assert "'m'" in err["message"] and "'m-swiftkv'" in err["message"], err
            r = await c.post("/v1/completions", json={"model": "m-swiftkv", "prompt": "hi", "max_tokens": 2, "min_p": 0.5})
            assert r.status_code == 200, r.text
        served = gateway(tiny_base, {"speculative": NGRAM})  # every pool speculates
        async with served.client() as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2, "min_p": 0.5})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
            assert "every pool here runs speculative decoding" in r.json()["error"]["message"]
            assert "speculative: {method: none}" in r.json()["error"]["message"]
            assert not any(b.requests for b in served.backends.values())
        served = gateway(tiny_base)
        served.gateway.pools["swiftkv"].ready = False  # the pool without speculation is down: not sent where it fails
        async with served.client() as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 3}})
            assert r.status_code == 503 and "without speculative decoding" in r.json()["error"]["message"], r.text
            assert not served.backends["base"].requests

    asyncio.run(run())


# ---- real engines in the embedded default's layout ----------------------------------------------------------------
TOKEN_A = 300  # a token id of the tiny vocabulary (512)


@pytest.fixture(scope="module")
def default_layout(tiny_base, tiny_swiftkv, tmp_path_factory):
    """`swiftkv serve` with the embedded default's pools as this machine runs them (speculation, dual mode: the
    functions `swiftkv serve` applies to it without --config), on the tiny checkpoints and the tests' engine sizes."""
    import yaml
    from harness.engines import engine_args, every_pool_ready
    from harness.processes import swiftkv_serve

    from services.serve import default_dual_mode, default_speculation

    cfg = load_config(None)
    cfg.pools["swiftkv"].model, cfg.pools["base"].model = str(tiny_swiftkv), str(tiny_base)
    for pool in cfg.pools.values():
        pool.engine_args = engine_args(scheduling_policy="priority")
    default_dual_mode(cfg)
    default_speculation(cfg)
    work = tmp_path_factory.mktemp("default-layout")
    config = yaml.safe_load(json.dumps(cfg.model_dump(mode="json", exclude_unset=True)))
    config |= {"model": "dflt", "data_dir": str(work / "data"), "routing": {"expose_reason": True}}
    config.pop("port", None), config.pop("host", None)
    assert config["pools"]["base"]["speculative"]["method"] == "ngram" and "speculative" not in config["pools"]["swiftkv"]
    server = swiftkv_serve(work, config, "--engine", "inprocess", env={"VLLM_CPU_OMP_THREADS_BIND": ""})
    server.start().wait(lambda: every_pool_ready(server.base))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.engine
def test_a_logit_bias_request_is_served_in_the_default_layout_and_the_bias_takes_effect(default_layout):
    from harness.metrics import scrape

    client = default_layout.client()
    forced = {str(TOKEN_A): 100.0}
    raw = client.completions.with_raw_response.create(model="dflt", prompt="The quick brown fox", max_tokens=8, logprobs=1,
                                                      extra_body={"logit_bias": forced, "ignore_eos": True}, temperature=1.0)
    r = raw.parse()
    assert raw.headers["x-swiftkv-route"].startswith("pool=swiftkv; reason=no_speculation"), raw.headers["x-swiftkv-route"]
    assert_openai_shape(json.loads(raw.http_response.content), Completion)
    piece = httpx.post(f"{default_layout.base}/detokenize", json={"model": "dflt", "tokens": [TOKEN_A]}, timeout=60).json()["prompt"]
    assert r.choices[0].logprobs.tokens == [piece] * 8, (piece, r.choices[0].logprobs.tokens)  # every token the biased one
    without = client.completions.create(model="dflt", prompt="The quick brown fox", max_tokens=8, temperature=1.0,
                                        extra_body={"ignore_eos": True})
    assert without.choices[0].text != r.choices[0].text
    chat = client.chat.completions.with_raw_response.create(model="dflt", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                                            extra_body={"logit_bias": forced, "ignore_eos": True, "min_p": 0.1})
    assert chat.headers["x-swiftkv-route"].startswith("pool=swiftkv; reason=no_speculation")
    assert_openai_shape(json.loads(chat.http_response.content), ChatCompletion)
    # the same bias sent to the speculating pool by its own name: vLLM would refuse it, the gateway names the field
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dflt-base", prompt="hi", max_tokens=2, extra_body={"logit_bias": forced})
    assert e.value.body["param"] == "logit_bias"
    # the base pool does speculate: vLLM's speculative-decoding counters exist for it only
    samples = scrape(default_layout.base)
    assert any(k.startswith("vllm:spec_decode_num_drafts_total") and 'model_name="dflt-base"' in k for k in samples)
    assert not any(k.startswith("vllm:spec_decode") and 'model_name="dflt-swiftkv"' in k for k in samples)
