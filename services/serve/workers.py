"""`swiftkv serve --workers N`: N gateway processes accepting connections on one listening socket.

The parent binds the port once and hands the socket to each worker (a `spawn`ed process that builds its own
gateway and serves with uvicorn), as uvicorn's and vLLM's multi-process servers do: the kernel gives each
new connection to whichever worker accepts first, and while one worker is down the others keep accepting
from the same queue (no connection waiting there is lost). The parent only supervises:

- a worker that dies (crash, OOM kill, `kill -9`) is started again, at once, or after a backoff doubling
  up to 30 s while replacements keep dying within 10 s of their start;
- SIGTERM or SIGINT: every worker gets SIGTERM and drains (stops accepting, finishes its requests within
  `health.shutdown_grace_seconds`); the parent exits 0 once all of them exited 0;
- a worker whose parent is gone (killed without a chance to forward the signal) drains and exits on its own;
- SIGHUP is forwarded to every worker, each of which reloads its API keys file.

Workers run in their own process group, so a Ctrl-C in a terminal reaches only the parent, which forwards
one SIGTERM (a second signal would make uvicorn drop the requests it is draining).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from typing import Any, Callable

log = logging.getLogger("swiftkv.workers")

RESTART_MIN_UPTIME = 10.0  # a replacement that dies sooner than this backs off before the next one
RESTART_MAX_DELAY = 30.0


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket every worker accepts on (bound before any worker starts: a port in use fails here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Runs `target(index, sock, *args)` in `workers` processes and keeps that many alive until told to stop."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], workers: int, sock: socket.socket, grace_seconds: float):
        self.target = target
        self.args = args
        self.count = workers
        self.sock = sock
        self.grace = grace_seconds
        self.ctx = multiprocessing.get_context("spawn")  # no engine, thread or event loop state crosses a fork
        self.procs: list[multiprocessing.process.BaseProcess | None] = [None] * workers
        self.started_at = [0.0] * workers
        self.delay = [0.0] * workers
        self.restart_at: list[float | None] = [None] * workers
        self.restarts = 0
        self.stopping = threading.Event()

    def _spawn(self, i: int) -> None:
        p = self.ctx.Process(target=_worker_main, args=(self.target, i, self.sock, os.getpid(), self.args),
                             name=f"swiftkv-gateway-{i}", daemon=False)
        p.start()
        self.procs[i] = p
        self.started_at[i] = time.monotonic()
        self.restart_at[i] = None
        log.info("worker %d started (pid %d)", i, p.pid)

    def _check(self) -> None:
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p is None or p.is_alive():
                continue
            if self.restart_at[i] is None:
                lived = now - self.started_at[i]
                self.delay[i] = 0.0 if lived >= RESTART_MIN_UPTIME else min(max(self.delay[i] * 2, 1.0), RESTART_MAX_DELAY)
                self.restart_at[i] = now + self.delay[i]
                log.warning("worker %d (pid %d) exited with code %s after %.0f s; starting a new one%s", i, p.pid, p.exitcode,
                            lived, f" in {self.delay[i]:.0f} s" if self.delay[i] else "")
            if now >= self.restart_at[i]:
                self.restarts += 1
                self._spawn(i)

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT, then drain every worker; -> the exit code (0: all drained cleanly)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        signal.signal(signal.SIGHUP, lambda *_: self.forward(signal.SIGHUP))  # each worker reloads its API keys
        for i in range(self.count):
            self._spawn(i)
        while not self.stopping.wait(0.5):
            self._check()
        return self.drain()

    def forward(self, sig: int) -> None:
        """Send `sig` to every live worker (they are in their own process groups: a signal to the parent reaches them
        only this way)."""
        for p in self.procs:
            if p is not None and p.pid is not None and p.is_alive():
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def drain(self) -> int:
        alive = [p for p in self.procs if p is not None and p.is_alive()]
        log.info("stopping: draining %d workers", len(alive))
        for p in alive:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace + 30  # the grace period, then the lifespan shutdown (engines, batch leases)
        code = 0
        for p in self.procs:
            if p is None:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("worker pid %d did not stop in time: killed", p.pid)
                p.kill()
                p.join()
                code = 1
            elif p in alive and p.exitcode != 0:
                log.warning("worker pid %d exited with code %s while draining", p.pid, p.exitcode)
                code = 1
        self.sock.close()
        return code


def _worker_main(target: Callable[..., None], index: int, sock: socket.socket, parent: int, args: tuple[Any, ...]) -> None:
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the parent only, which forwards one SIGTERM
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a forwarded SIGHUP before the app takes it is not a stop

    def orphaned() -> None:  # the parent was killed outright: drain like on SIGTERM rather than serve unsupervised
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=orphaned, daemon=True, name="parent-watch").start()
    target(index, sock, *args)
