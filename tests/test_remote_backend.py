"""The remote backend against a real vLLM OpenAI server process on the tiny checkpoint (conftest's `vllm_server`, shared
by the run): token counts from the server's usage figures, its statuses and error events passed on faithfully. The
server streams three tokens per chunk (`--stream-interval 3`), allows one logprob (`--max-logprobs 1`) and wants a key."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from harness.engines import MAX_MODEL_LEN, UPSTREAM, UPSTREAM_KEY

from services.common.keys import KeyStore
from services.config import PlatformConfig
from services.gateway.app import Gateway, create_app
from services.gateway.prompts import Prompter
from services.serving.backend import GenerateRequest, SamplingOptions, UpstreamError
from services.serving.remote import RemoteBackend

pytestmark = pytest.mark.engine
NAME = UPSTREAM


def generate(base: str, request: GenerateRequest, model: str = NAME, key: str = UPSTREAM_KEY, start: bool = True):
    """(backend, outputs, error) of one request through a RemoteBackend (started: it has probed the server)."""

    async def run():
        backend = RemoteBackend("base", base, model, api_key=key)
        try:
            if start:
                await backend.start()
            outs, error = [], None
            try:
                async for out in backend.generate(request):
                    outs.append(out)
            except UpstreamError as e:
                error = e
            return backend, outs, error
        finally:
            await backend.stop()

    return asyncio.run(run())


def test_tokens_are_counted_from_the_servers_usage(vllm_server):
    backend, outs, error = generate(vllm_server, GenerateRequest("r1", [5, 6, 7, 8], SamplingOptions(max_tokens=10, ignore_eos=True)))
    assert error is None and backend.continuous_usage  # vLLM: usage on every chunk
    deltas = [c for o in outs for c in o.choices]
    assert sum(c.num_tokens for c in deltas) == 10
    assert any(c.num_tokens > 1 for c in deltas)  # several tokens per chunk (stream interval 3; more when the client lags), counted as several
    assert deltas[-1].finish_reason == "length"
    _, outs, error = generate(vllm_server, GenerateRequest("r2", [5, 6, 7, 8], SamplingOptions(max_tokens=7, n=2, ignore_eos=True)))
    per_choice = {0: 0, 1: 0}
    for c in (c for o in outs for c in o.choices):
        per_choice[c.index] += c.num_tokens
    assert error is None and per_choice == {0: 7, 1: 7}


def test_the_servers_statuses_and_errors_are_passed_on(vllm_server):
    ask = GenerateRequest("r3", [5, 6, 7, 8], SamplingOptions(max_tokens=2))
    _, _, error = generate(vllm_server, ask, key="sk-wrong", start=False)
    assert error.status == 401
    _, _, error = generate(vllm_server, ask, model="no-such-model")
    assert error.status == 404 and "no-such-model" in error.message
    _, _, error = generate(vllm_server, GenerateRequest("r4", [5] * (MAX_MODEL_LEN + 1), SamplingOptions(max_tokens=2)))
    assert error.status == 400 and error.type == "invalid_request_error" and str(MAX_MODEL_LEN) in error.message
    # refused by the engine after the stream began: vLLM sends an error event, not a status
    _, outs, error = generate(vllm_server, GenerateRequest("r5", [5, 6, 7, 8], SamplingOptions(max_tokens=2, logprobs=2)))
    assert error is not None and error.status == 400 and "logprobs" in error.message and not outs


def test_the_gateway_answers_with_the_servers_status(vllm_server, tiny_base):
    """Through the gateway (in this process, real HTTP to vLLM): the client sees vLLM's 400, streamed or not,
    and the usage vLLM counted."""
    cfg = PlatformConfig(model="m", pools={"base": {"backend": "remote", "url": f"{vllm_server}/v1", "model": str(tiny_base),
                                                    "served_model_name": NAME, "api_key": UPSTREAM_KEY,
                                                    "engine_args": {"max_model_len": MAX_MODEL_LEN}}})
    backends = {"base": RemoteBackend("base", cfg.pools["base"].url, NAME, UPSTREAM_KEY)}
    gateway = Gateway(cfg, backends, Prompter(str(tiny_base)), KeyStore({}))

    async def run():
        await backends["base"].start()
        gateway.pools["base"].ready = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw", timeout=60) as c:
            ok = {"model": "m", "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
            r = await c.post("/v1/completions", json=ok)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            for stream in (False, True):
                r = await c.post("/v1/completions", json={**ok, "logprobs": 2, "stream": stream})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["type"] == "invalid_request_error" and "logprobs" in r.json()["error"]["message"]
            assert gateway.pools["base"].ready  # one refused request does not take the pool down
        await backends["base"].stop()

    asyncio.run(run())


def test_a_keys_cache_salt_is_taken_by_the_server(vllm_server):
    """A request of a key whose prefix cache is its own carries vLLM's cache_salt in the body, which vLLM's server
    accepts (alone, and after the base mode's), answering as without it."""
    for mode in (None, "base"):  # the server is not dual-mode: a base-mode request's salt and extra args still parse
        request = GenerateRequest("r", [5, 6, 7, 8] * 40, SamplingOptions(max_tokens=3, ignore_eos=True), mode=mode,
                                  key_salt="0123456789abcdef")
        _, outs, error = generate(vllm_server, request)
        assert error is None and sum(c.num_tokens for o in outs for c in o.choices) == 3, (mode, error)


def test_vllms_extensions_reach_the_server(vllm_server):
    """Sampling extensions and a structured-output constraint go to the remote vLLM with vLLM's meaning."""
    choice = SamplingOptions(max_tokens=20, structured={"choice": ["yes", "no"]}, seed=1)
    _, outs, error = generate(vllm_server, GenerateRequest("r-ext1", [5, 6, 7, 8], choice))
    assert error is None and "".join(c.text for o in outs for c in o.choices) in ("yes", "no")
    forced = SamplingOptions(max_tokens=6, logit_bias={300: 100.0}, stop_token_ids=[300], min_tokens=3, ignore_eos=True)
    _, outs, error = generate(vllm_server, GenerateRequest("r-ext2", [5, 6, 7, 8], forced))
    deltas = [c for o in outs for c in o.choices]
    # token 300 is forced, but it is a stop token that min_tokens keeps out of the first 3
    assert error is None and sum(c.num_tokens for c in deltas) == 4 and deltas[-1].finish_reason == "stop"


def test_an_answer_holding_unicode_line_separators_comes_through_whole(vllm_server):
    """SSE lines end at CR or LF only: an answer holding U+2028, U+2029 or NEL (U+0085), which JSON leaves unescaped
    and `str.splitlines` would cut at, reaches the client whole (a structured choice makes vLLM answer with them)."""
    text = "a\u2028b\u2029c\x85d"
    ask = SamplingOptions(max_tokens=20, structured={"choice": [text]})
    _, outs, error = generate(vllm_server, GenerateRequest("r-sep", [5, 6, 7, 8], ask))
    assert error is None and "".join(c.text for o in outs for c in o.choices) == text
