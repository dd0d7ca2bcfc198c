"""Faults under load against real engines: an engine core of the shared platform (conftest's `platform`) killed with
SIGKILL while streaming and non-streaming requests run. Requests whose pool dies before their first token are retried
on the other pool; a stream cut mid-way ends with an OpenAI-shaped error event and `data: [DONE]`; nothing hangs; the
pool leaves routing, the engine is restarted and the pool comes back. And per-key limits shared by `swiftkv serve`
processes (no engines) through Redis. The drain on SIGTERM is test_quiet_start.py::test_sigterm_under_load_drains_and_stops_cleanly."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from harness import HTTP_TIMEOUT, free_port, metric, scrape, swiftkv_serve
from harness.engines import KEY, PUBLIC, engine_cores, every_pool_ready

pytestmark = pytest.mark.shares("redis")

# ~410 prompt tokens for 60 output tokens: a prompt/output ratio that routes to the swiftkv pool
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 25)
OUT = 60


def stream_once(base: str, results: list, tag: str) -> None:
    """One streamed chat request read raw: records (tag, status, saw_content, ended_with_done, error_event)."""
    body = {"model": PUBLIC, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": OUT, "stream": True,
            "ignore_eos": True}
    saw, done, error = False, False, None
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=90,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            status = r.status_code
            if status == 200:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                    elif any(c["delta"].get("content") for c in event["choices"]):
                        saw = True
            else:
                r.read()
    except httpx.TimeoutException:
        status = "timeout"
    results.append((tag, status, saw, done, error))


def complete_once(client: openai.OpenAI, results: list, tag: str) -> None:
    try:
        r = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": PROMPT}], max_tokens=OUT,
                                           extra_body={"ignore_eos": True})
        results.append((tag, 200, r.usage.completion_tokens))
    except openai.APIStatusError as e:
        results.append((tag, e.status_code, e.body))
    except openai.APITimeoutError:
        results.append((tag, "timeout", None))


@pytest.mark.engine
@pytest.mark.last(1)
def test_kill_9_of_an_engine_under_load(platform, capsys):
    """Also: the dead engine's pool leaves routing while the other serves every request (the process stays alive),
    the engine is restarted inside the gateway process, and its metrics replace the dead one's."""
    base = platform.base
    client = platform.client(KEY, timeout=90)
    cores = engine_cores(platform)
    assert sorted(cores) == ["base", "swiftkv"]
    victim = cores["swiftkv"]  # the pool the load goes to by ratio

    before, after = [], []
    threads = [threading.Thread(target=stream_once, args=(base, before, "stream")) for _ in range(6)]
    threads += [threading.Thread(target=complete_once, args=(client, before, "complete")) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the load is running on the swiftkv engine
    victim.kill()
    platform.killed_engines += 1  # its shared memory outlives it: see test_quiet_start's stop
    killed_at = time.time()
    # Sent right after the kill, before the health watcher notices: they reach the dead engine first.
    late = [threading.Thread(target=stream_once, args=(base, after, "stream")) for _ in range(3)]
    late += [threading.Thread(target=complete_once, args=(client, after, "complete")) for _ in range(3)]
    for t in late:
        t.start()
    for t in threads + late:
        t.join(120)
        assert not t.is_alive(), "a request hung"

    # Nothing hung; every stream that started ended with [DONE]; a cut stream carries an OpenAI error event.
    assert all(r[1] != "timeout" for r in before + after)
    for tag, status, *rest in before + after:
        if tag == "stream" and status == 200:
            saw, done, error = rest
            assert done, "a stream ended without [DONE]"
            if error is not None:
                assert set(error) >= {"message", "type", "code"} and error["type"] == "server_error"
    # Requests sent after the kill had no token out when their pool failed: all of them succeed.
    for tag, status, *rest in after:
        assert status == 200, (tag, status, rest)
        if tag == "stream":
            assert rest[2] is None and rest[1]
    failed_before = [r for r in before if r[1] != 200 or (r[0] == "stream" and r[4] is not None)]

    deadline = time.time() + 30
    while all((pools := httpx.get(f"{base}/ready", timeout=HTTP_TIMEOUT).json()["pools"]).values()):
        assert time.time() < deadline, "the dead engine's pool stayed in routing"
        time.sleep(0.2)
    assert pools == {"swiftkv": False, "base": True}
    assert httpx.get(f"{base}/health", timeout=HTTP_TIMEOUT).status_code == 200  # the other pool still serves
    for prompt, max_tokens in ((PROMPT, 2), ("hi", 64)):  # routed to either pool by ratio: the live one answers
        raw = client.chat.completions.with_raw_response.create(model=PUBLIC, messages=[{"role": "user", "content": prompt}],
                                                               max_tokens=max_tokens, extra_body={"ignore_eos": True})
        assert raw.status_code == 200 and "pool=base;" in raw.headers["x-swiftkv-route"]
    deadline = time.time() + 300
    while not every_pool_ready(base):
        assert time.time() < deadline, "the killed engine was not restarted"
        time.sleep(0.5)
    ready_after = time.time() - killed_at
    retries = sum(v for k, v in scrape(base).items() if k.startswith("swiftkv_request_retries_total"))
    with capsys.disabled():
        print(f"\nkill -9 under load: {len(before)} in flight, {len(failed_before)} failed "
              f"(statuses {[r[1] for r in failed_before]}); {len(after)} sent after the kill, all 200; "
              f"retries on the other pool {retries:g}; /ready again after {ready_after:.1f} s")
    r = client.chat.completions.create(model=f"{PUBLIC}-swiftkv", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    text = httpx.get(f"{base}/metrics", timeout=HTTP_TIMEOUT).text
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{") and f'"{PUBLIC}-swiftkv"' in line]
    assert len(running) == 1  # the restarted engine's metrics replaced the dead one's


# ---- per-key limits shared through Redis ----------------------------------------------------------------
REDIS_URL = "redis://127.0.0.1:6379/0"


def limited_gateway(tmp_path: Path, name: str, tiny_base, key_line: str, redis_url: str, via_env: bool = False):
    """A `swiftkv serve` whose only pool is a remote server that is not there: each request the limits admit is
    answered 503 by routing, each one they refuse 429; that is all these tests look at."""
    work = tmp_path / name
    work.mkdir()
    (work / "keys").write_text(key_line + "\n")
    config = {"model": "m", "data_dir": str(work / "data"), "redis_url": None if via_env else redis_url,
              "health": {"period_seconds": 30.0},
              "pools": {"base": {"backend": "remote", "url": f"http://127.0.0.1:{free_port()}/v1", "model": str(tiny_base)}}}
    server = swiftkv_serve(work, config, "--engine", "inprocess", "--api-keys-file", str(work / "keys"),
                           env={"SWIFTKV_REDIS_URL": redis_url if via_env else ""})
    return server.start()


def started(server):
    return server.wait(lambda: httpx.get(f"{server.base}/health", timeout=2).status_code in (200, 503), 120, "started")


def send(base: str, key: str, n: int) -> list[int]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code
            for _ in range(n)]


@pytest.mark.slow
def test_two_gateways_share_one_per_key_limit_through_redis(tiny_base, tmp_path):
    import secrets

    key = f"sk-shared-{secrets.token_hex(8)}"  # fresh buckets in Redis for this run
    with limited_gateway(tmp_path, "a", tiny_base, f"{key} requests_per_minute=10", REDIS_URL) as a, \
            limited_gateway(tmp_path, "b", tiny_base, f"{key} requests_per_minute=10", REDIS_URL, via_env=True) as b:
        # b as the Helm chart configures it: SWIFTKV_REDIS_URL in the environment
        a_base, b_base = started(a).base, started(b).base
        t0 = time.time()
        statuses = []
        for _ in range(8):  # interleaved: each gateway alone would admit 10
            statuses += send(a_base, key, 2) + send(b_base, key, 2)
        elapsed = time.time() - t0
        admitted = sum(s != 429 for s in statuses)
        refill = elapsed * 10 / 60
        assert set(statuses) <= {429, 503}
        assert 10 <= admitted <= 10 + refill + 1, (admitted, statuses)
        assert metric(scrape(a_base), "swiftkv_rate_limits_shared") == 1
        assert metric(scrape(b_base), "swiftkv_rate_limits_shared") == 1
        print(f"\ntwo gateways, one Redis, 10 requests/min: {admitted} of {len(statuses)} admitted in {elapsed:.1f} s")


@pytest.mark.slow
def test_redis_unreachable_falls_back_to_local_limits(tiny_base, tmp_path):
    key = "sk-local-fallback"
    with limited_gateway(tmp_path, "a", tiny_base, f"{key} requests_per_minute=10", f"redis://127.0.0.1:{free_port()}/0") as server:
        statuses = send(started(server).base, key, 14)
        assert statuses[:10] == [503] * 10 and statuses[10:] == [429] * 4  # served (routing), then this process's limit
        assert metric(scrape(server.base), "swiftkv_rate_limits_shared") == 0
