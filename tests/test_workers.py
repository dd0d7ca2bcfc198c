"""`swiftkv serve --workers N`: several gateway processes on one port in front of a real vLLM OpenAI server (the
conftest's `vllm_server`, shared by the run), per-key limits shared through the Redis at 127.0.0.1:6379, one worker
killed with SIGKILL under traffic and replaced, SIGTERM draining every worker; and the refusal of in-process
engines with several workers."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from harness import free_port, metric, scrape, swiftkv_serve, wait_until
from harness.engines import MAX_MODEL_LEN, UPSTREAM, UPSTREAM_KEY

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.shares("redis")]

REDIS_URL = "redis://127.0.0.1:6379/0"


def remote_config(work: Path, url: str, tiny_base, **extra) -> dict:
    return {"model": "m", "port": free_port(), "data_dir": str(work / "data"), "health": {"period_seconds": 1.0, "shutdown_grace_seconds": 20.0},
            "pools": {"base": {"backend": "remote", "url": url, "model": str(tiny_base), "served_model_name": UPSTREAM,
                               "api_key": UPSTREAM_KEY, "engine_args": {"max_model_len": MAX_MODEL_LEN}}}, **extra}


@pytest.fixture(scope="module")
def workers(vllm_server, tiny_base, tmp_path_factory):
    """(base URL, parent process, work dir, limited key) of `swiftkv serve --workers 2` whose pool is the vLLM server."""
    work = tmp_path_factory.mktemp("serve-workers")
    limited = f"sk-workers-{secrets.token_hex(6)}"  # fresh buckets in Redis for this run
    (work / "keys").write_text(f"sk-workers-main\n{limited} requests_per_minute=6\n")
    config = remote_config(work, f"{vllm_server}/v1", tiny_base, redis_url=REDIS_URL)
    server = swiftkv_serve(work, config, "--engine", "inprocess", "--workers", "2", "--api-keys-file", str(work / "keys"))
    with server:
        server.start().wait(timeout=300)
        yield server.base, server.proc, work, limited


def ask(base: str, key: str = "sk-workers-main", tokens: int = 8, timeout: float = 60) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "ignore_eos": True}
    # a new connection per request: the kernel hands each to whichever worker accepts it
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def answered_by(base: str, pids: set[int], n: int, most: int = 400) -> list[tuple[int, str | None]]:
    """At least n requests, 4 at a time, and more (up to `most`) until every worker in `pids` has answered one ->
    (status, worker pid header) of each. The workers share one listening socket and the kernel wakes whichever waits
    in accept: on an idle machine one worker can take a few dozen short requests in a row, so a fixed count would
    make "both answered" a matter of chance."""
    out: list = []

    def run() -> None:
        while len(out) < n or (len(out) < most and not pids <= {int(p) for _, p in out if p}):
            r = ask(base)
            out.append((r.status_code, r.headers.get("x-swiftkv-worker")))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def worker_pids(proc: subprocess.Popen) -> set[int]:
    """The gateway workers among the parent's children (not multiprocessing's resource tracker)."""
    out = set()
    for p in psutil.Process(proc.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_both_workers_answer_and_share_the_key_limits_through_redis(workers):
    base, proc, work, limited = workers
    pids = worker_pids(proc)
    assert len(pids) == 2
    seen = answered_by(base, pids, 24)
    assert all(status == 200 for status, _ in seen), seen
    assert {int(pid) for _, pid in seen} == pids  # every answer names its worker, and both answered
    r = ask(base)
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["model"] == "m"
    # 6 requests per minute for the key, whichever worker takes each request: Redis holds one bucket
    t0 = time.time()
    statuses, by = [], set()
    for _ in range(12):
        r = ask(base, limited, tokens=1)
        statuses.append(r.status_code)
        by.add(r.headers.get("x-swiftkv-worker"))
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429} and 6 <= admitted <= 6 + (time.time() - t0) * 6 / 60 + 1, statuses
    print(f"\n2 workers: {len(seen)} requests answered, {sum(1 for _, p in seen if int(p) == min(pids))} by one worker and "
          f"{sum(1 for _, p in seen if int(p) == max(pids))} by the other; limited key: {admitted} of 12 admitted "
          f"({len(by)} workers answered)")


def test_kill_9_of_a_worker_the_other_answers_and_it_is_replaced(workers):
    base, proc, work, _ = workers
    victim, survivor = sorted(worker_pids(proc))
    results: list = []
    stop_at = time.time() + 60
    replaced_after = None

    def load() -> None:
        while time.time() < stop_at and replaced_after is None:
            sent = time.time()
            try:
                r = ask(base, timeout=30)
                results.append((sent, r.status_code, r.headers.get("x-swiftkv-worker")))
            except httpx.HTTPError as e:
                results.append((sent, type(e).__name__, None))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    while not {str(victim), str(survivor)} <= {pid for _, _, pid in results}:  # the load reaches both workers
        assert time.time() < stop_at, results
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    while replaced_after is None:
        new = worker_pids(proc) - {victim, survivor}
        if new and any(pid == str(next(iter(new))) for _, _, pid in results):
            replaced_after = time.time() - killed_at  # the replacement has answered a request
            break
        assert time.time() < stop_at, "the killed worker was not replaced"
        time.sleep(0.2)
    for t in threads:
        t.join(60)
    after = [r for r in results if r[0] > killed_at]  # sent after the kill (the kill cuts requests the victim held)
    failed = [r for r in results if r[1] != 200]
    assert after and all(status == 200 for _, status, _ in after), failed
    assert {pid for _, _, pid in after} >= {str(survivor)}
    assert proc.poll() is None and len(worker_pids(proc)) == 2
    assert "worker 0 (pid %d) exited with code -9" % victim in (work / "serve.log").read_text() or \
        "worker 1 (pid %d) exited with code -9" % victim in (work / "serve.log").read_text()
    print(f"\nkill -9 of one of 2 workers under 3 clients: {len(results)} requests, {len(failed)} failed "
          f"({[r[1] for r in failed]}), {len(after)} sent after the kill all 200; replacement answering "
          f"{replaced_after:.1f} s after the kill")


def test_sigterm_drains_every_worker_and_exits_0(workers, vllm_server):
    """Last in this module: it stops the module's server. The signal comes once all 6 requests have reached the
    engine behind the workers (vLLM's own counters), so each one is in flight, not still connecting: a connection
    the kernel queued after the signal finds no worker accepting, which is the documented end of a drain."""
    base, proc, work, _ = workers
    pids = worker_pids(proc)
    results: list = []

    def one() -> None:
        try:
            results.append(ask(base, tokens=200, timeout=60).status_code)
        except httpx.HTTPError as e:
            results.append(type(e).__name__)

    def arrived() -> float:  # requests the engine has been sent: a finishing one moves from running to finished
        samples = scrape(vllm_server)
        return sum(metric(samples, name) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success_total"))

    before = arrived()
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: arrived() - before >= 6, 30, "6 requests at the engine", every=0.02)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0
    took = time.time() - t0
    assert results == [200] * 6
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    print(f"\nSIGTERM to the parent of 2 workers with 6 requests in flight: all 200, exit 0 after {took:.1f} s")


def test_in_process_engines_are_refused_with_several_workers(tiny_base, tmp_path):
    config = {"model": "m", "port": free_port(), "data_dir": str(tmp_path / "data"),
              "pools": {"base": {"model": str(tiny_base)}}}
    server = swiftkv_serve(tmp_path, config, "--engine", "inprocess", "--workers", "2").start()
    proc = server.proc
    assert proc.wait(60) != 0
    log = (tmp_path / "serve.log").read_text()
    assert "--workers 2 with in-process engines (pools.base)" in log and "--engine ray" in log and "backend: remote" in log


def test_several_workers_without_redis_warn_that_limits_are_per_worker(tiny_base, tmp_path):
    # the pool's server is not there: the workers start (the pool joins once it answers), which is all this looks at
    config = remote_config(tmp_path, f"http://127.0.0.1:{free_port()}/v1", tiny_base, workers=2)
    server = swiftkv_serve(tmp_path, config, "--engine", "inprocess").start()
    proc, base = server.proc, server.base
    try:
        server.wait(lambda: len({httpx.get(f"{base}/health", timeout=2).headers.get("x-swiftkv-worker") for _ in range(20)}) == 2,
                    120, "answered by 2 workers")
        assert "2 workers without redis_url: per-key rate limits are kept by each worker on its own" in (tmp_path / "serve.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        server.stop()
