"""The gateway's HTTP behaviour above the engines: validation, errors, authentication and per-key limits, and a pool
that joins routing once its server answers. The real app (as `swiftkv serve` assembles it) runs in this process,
served by uvicorn in a thread for the official `openai` client, over the fake backend (harness.FakeBackend); the
same paths through real engines are in test_gateway.py."""

from __future__ import annotations

import httpx
import openai
import pytest
from harness import metric, scrape, served_gateway, swiftkv_serve, wait_until

KEY = "sk-test-main"
LIMITED_KEY = "sk-test-limited"  # 300 prompt tokens per minute
OUTPUT_LIMITED_KEY = "sk-test-output-limited"  # 300 output tokens per minute
MAX_MODEL_LEN = 512
PUBLIC = "tiny"


@pytest.fixture(scope="module")
def served(tiny_base, tmp_path_factory):
    """Two pools of fake engines that answer max_tokens tokens (as with ignore_eos), keys as a keys file gives them."""
    with served_gateway(tiny_base, tmp_path_factory.mktemp("gateway-api"), max_model_len=MAX_MODEL_LEN, fake={"tokens": None},
                        keys=(KEY, f"{LIMITED_KEY} prompt_tokens_per_minute=300", f"{OUTPUT_LIMITED_KEY} output_tokens_per_minute=300"),
                        model=PUBLIC, routing={"ratio_threshold": 4.0}, limits={"max_body_bytes": 200_000}) as server:
        yield server


@pytest.fixture(scope="module")
def server(served) -> str:
    return served.base


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client(KEY)


# ---- errors --------------------------------------------------------------------------------------
def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "gpt-nope" in e.value.body["message"]
    for old, new in (("prefill", "swiftkv"), ("decode", "base")):  # the pools' former names: a 404 naming the new one
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=f"{PUBLIC}-{old}", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["code"] == "model_not_found"
        assert f"'{PUBLIC}-{old}' was renamed to '{PUBLIC}-{new}'" in e.value.body["message"], e.value.body


def test_a_client_that_leaves_mid_stream_aborts_its_engine_request(served, server):
    """The client reads the first lines of a streamed answer and leaves: the gateway counts it gone and cancels the
    engine's request (the fake engine answers one token every 0.2 s: 100 tokens take 20 s, so the answer cannot be
    done first). The same with real engines, leaving before the first token: test_gateway.py."""
    engine = served.served.backends["base"]
    aborted, before = engine.aborted, scrape(server)
    engine.delay = 0.2
    try:
        with httpx.stream("POST", f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"model": f"{PUBLIC}-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100,
                                "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        wait_until(lambda: engine.aborted == aborted + 1, 10, "the engine's request cancelled")
    finally:
        engine.delay = 0.0
    m = scrape(server)
    gone = metric(m, "swiftkv_requests_total", pool="base", status="client_disconnect") - \
        metric(before, "swiftkv_requests_total", pool="base", status="client_disconnect")
    generated = metric(m, "swiftkv_generation_tokens_total", pool="base") - metric(before, "swiftkv_generation_tokens_total", pool="base")
    assert gone == 1 and generated < 100


def test_a_pools_own_model_name_pins_it(client):
    for pool in ("swiftkv", "base"):
        raw = client.chat.completions.with_raw_response.create(model=f"{PUBLIC}-{pool}", messages=[{"role": "user", "content": "hi"}],
                                                               max_tokens=1)
        assert raw.headers["x-swiftkv-route"].startswith(f"pool={pool}; reason=pinned"), raw.headers


def test_bad_fields_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], temperature=7)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=PUBLIC, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], extra_body={"frobnicate": 1})
    assert "unsupported field: frobnicate" in e.value.body["message"]


def test_values_of_the_wrong_type_and_refused_fields_are_400(server):
    h = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": PUBLIC, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in [("max_tokens", "16"), ("stream", "true"), ("n", True), ("temperature", "0.5"), ("seed", 1.5),
                         ("logprobs", 1), ("tools", {"type": "function", "function": {"name": "f"}}),
                         ("response_format", "json_object"), ("logit_bias", [5]), ("top_k", 1.0), ("priority", "1"),
                         ("functions", [{"name": "f"}])]:
        r = httpx.post(f"{server}/v1/chat/completions", json={**ok, field: value}, headers=h)
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server}/v1/completions", json={"model": PUBLIC, "prompt": "hi", "max_tokens": 2, "best_of": 2}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = httpx.post(f"{server}/v1/chat/completions", json={**ok, "user": "someone", "temperature": 0}, headers=h)
    assert r.status_code == 200  # `user` is accepted and ignored; an integer is a valid number


def test_prompt_too_long_says_the_limit(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=PUBLIC, prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    assert str(MAX_MODEL_LEN - 1) in e.value.body["message"] and str(MAX_MODEL_LEN + 10) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=PUBLIC, prompt="hello", max_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_tokens" and str(MAX_MODEL_LEN) in e.value.body["message"]


def test_malformed_json_and_oversized_body(server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{server}/v1/chat/completions", content=b'[1, 2]', headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    big = b'{"model": "tiny", "prompt": "' + b"a" * 300_000 + b'"}'
    r = httpx.post(f"{server}/v1/completions", content=big, headers=h)
    assert r.status_code == 413 and "200000 bytes" in r.json()["error"]["message"]
    r = httpx.get(f"{server}/v1/nothing-here", headers=h)
    assert r.status_code == 404 and "error" in r.json()


def test_auth(server):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": PUBLIC, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/metrics").status_code == 200  # open, as vLLM's: Prometheus sends no key
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200 and httpx.get(f"{server}/ready").status_code == 200
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # which keys file wins (flag over environment) is the command's: test_gateway.py::test_api_keys_file_flag_wins_over_the_environment


def test_rate_limit_answers_429_with_retry_after(server):
    limited = openai.OpenAI(base_url=f"{server}/v1", api_key=LIMITED_KEY, max_retries=0)
    prompt = [5] * 200  # 200 of the key's 300 prompt tokens per minute
    limited.completions.create(model=PUBLIC, prompt=prompt, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        limited.completions.create(model=PUBLIC, prompt=prompt, max_tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded" and "prompt tokens" in e.value.body["message"]
    retry_after = int(e.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60


def test_output_without_max_tokens_stops_where_the_keys_output_limit_does(server):
    """A request without max_tokens is reserved an estimate and settled as it streams: it runs on while the key's
    output bucket covers more, and ends with finish_reason `length` where it cannot (not at the end of the context,
    hundreds of tokens past the key's 300 per minute); the key's next request then waits."""
    limited = openai.OpenAI(base_url=f"{server}/v1", api_key=OUTPUT_LIMITED_KEY, max_retries=0, timeout=120)
    r = limited.chat.completions.create(model=f"{PUBLIC}-base", messages=[{"role": "user", "content": "go"}],
                                        extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens < MAX_MODEL_LEN - r.usage.prompt_tokens  # stopped before the context's end
    assert r.usage.completion_tokens <= 300 + 64, r.usage  # the key's 300, overspent by at most what one settlement step sees
    with pytest.raises(openai.RateLimitError) as e:  # what is left of the key's minute does not cover half of it
        limited.chat.completions.create(model=f"{PUBLIC}-base", messages=[{"role": "user", "content": "hi"}], max_tokens=150)
    assert "output tokens" in e.value.body["message"]


# ---- pool health -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_pool_down_at_start_joins_routing_once_it_answers(server, tiny_base, tmp_path):
    """Gateway A's only pool is a remote server that is not up yet: A is live (/health 200) but not ready (/ready
    503) until the server (gateway B, in front of this module's in-process gateway) comes up, then A's watcher brings
    the pool in. A and B are `swiftkv serve` processes without engines."""
    from harness import free_port

    b_port = free_port()
    a = swiftkv_serve(tmp_path / "a", {"model": "a", "data_dir": str(tmp_path / "a" / "data"),
                                       "health": {"period_seconds": 0.5, "max_backoff_seconds": 1.0},
                                       "pools": {"base": {"backend": "remote", "url": f"http://127.0.0.1:{b_port}/v1",
                                                          "model": str(tiny_base), "served_model_name": "b"}}}, "--engine", "inprocess")
    b = swiftkv_serve(tmp_path / "b", {"model": "b", "port": b_port, "data_dir": str(tmp_path / "b" / "data"),
                                       "pools": {"base": {"backend": "remote", "url": f"{server}/v1", "model": str(tiny_base),
                                                          "served_model_name": f"{PUBLIC}-base", "api_key": KEY}}}, "--engine", "inprocess")
    with a, b:
        a.start().wait(lambda: httpx.get(f"{a.base}/ready", timeout=2).json()["started"], 120, "started")
        assert httpx.get(f"{a.base}/ready").json() == {"ready": False, "started": True, "pools": {"base": False}}
        assert httpx.get(f"{a.base}/health").status_code == 200
        b.start().wait(timeout=120)
        a.wait(timeout=30, what="recovered")
        assert httpx.get(f"{a.base}/health").status_code == 200
        r = a.client().chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                               extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3


# ---- vLLM's request extensions ----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
                   "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def extensions(tiny_base, tmp_path_factory):
    """The shared platform's pools as the gateway sees them (base with vLLM's hermes tool parser), over fake engines."""
    with served_gateway(tiny_base, tmp_path_factory.mktemp("extensions"), pools={"swiftkv": {}, "base": {"tool_call_parser": "hermes"}},
                        max_model_len=MAX_MODEL_LEN, keys=(KEY,), batch=False, model=PUBLIC) as server:
        yield server


@pytest.mark.parametrize("body,param", [
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": "3"}, "top_k"),
    ({"min_tokens": 40}, "min_tokens"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"priority": 2**40}, "priority"),
    ({"best_of": 2}, "best_of"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"guided_json": {}}, "guided_json"),
])
def test_bad_values_of_vllms_extensions_are_400_naming_the_field(extensions, body, param):
    """vLLM's request extensions, refused by the gateway before any engine sees them (the same requests, valid, reach
    real engines in test_openai_compat.py)."""
    r = httpx.post(f"{extensions.base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
