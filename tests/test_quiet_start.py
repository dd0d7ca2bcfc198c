"""The first minutes: `swiftkv serve` starts with a screenful of its own lines (engine and library logs go to a log
file it names) and stops cleanly on SIGTERM under load; `swiftkv trainer serve` stops with exit status 0; engine
processes started by the platform never get a terminal's Ctrl-C themselves.

The fast tests run the logging setup in a subprocess of its own (it takes over file descriptors 1 and 2). The
engine tests share one `swiftkv serve --engine inprocess` with two tiny engines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import free_port
from harness.engines import KEY, engine_log

SWIFTKV = str(Path(sys.executable).parent / "swiftkv")
ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "leaked", "Exception ignored")

LOGGING_SCRIPT = '''
import logging, multiprocessing, os, subprocess, sys, warnings
from pathlib import Path

from services.logs import Logs


def worker(logs):
    logs.configure(worker=1)
    logging.getLogger("swiftkv.gateway").info("a line from worker 1")
    logging.getLogger("httpx").info("a library line from worker 1")


if __name__ == "__main__":
    logs = Logs.start("info", sys.argv[2])
    logging.getLogger("swiftkv.serve").info("before the capture")
    logs.capture(Path(sys.argv[1]))
    logging.getLogger("swiftkv.pools").info("pool base: a platform line")
    logging.getLogger("vllm.engine").warning("an engine warning")
    warnings.warn("a library warning")
    os.write(2, b"bare bytes on fd 2\\n")
    print("a print", flush=True)
    subprocess.run([sys.executable, "-c", "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"])
    logging.getLogger("uvicorn.error").info("uvicorn chatter")
    logging.getLogger("uvicorn.error").error("the port is taken")
    p = multiprocessing.get_context("spawn").Process(target=worker, args=(logs,))
    p.start()
    p.join()
'''


def run_logging_script(tmp_path: Path, fmt: str) -> tuple[list[str], str]:
    """-> (console lines: stdout and stderr, the log file's text)."""
    script = tmp_path / "logging_script.py"
    script.write_text(LOGGING_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "logs" / "serve.log"), fmt], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    return (out.stdout + out.stderr).splitlines(), (tmp_path / "logs" / "serve.log").read_text()


def test_console_shows_the_platform_and_the_file_takes_the_rest(tmp_path):
    console, logfile = run_logging_script(tmp_path, "text")
    messages = [re.sub(r"^(\[worker \d\] )?\d\d:\d\d:\d\d ", r"\1", line) for line in console]
    assert messages == ["before the capture", f"engine and library logs: {tmp_path / 'logs' / 'serve.log'} (--log-level debug shows them here)",
                        "pool base: a platform line", "ERROR the port is taken", "[worker 1] a line from worker 1"], console
    for text in ("an engine warning", "a library warning", "bare bytes on fd 2", "a print", "child stdout", "child stderr",
                 "uvicorn chatter", "pool base: a platform line", "a library line from worker 1", "swiftkv.gateway [worker 1]"):
        assert text in logfile, text


def test_json_console_is_one_object_per_line(tmp_path):
    console, _ = run_logging_script(tmp_path, "json")
    entries = [json.loads(line) for line in console]
    assert [(e["level"], e["logger"], e["message"]) for e in entries][2:4] == [
        ("info", "swiftkv.pools", "pool base: a platform line"), ("error", "uvicorn.error", "the port is taken")]
    assert entries[-1]["worker"] == 1 and all(e["time"].endswith("Z") for e in entries)


def test_a_bad_log_option_is_refused():
    for flag, value in (("--log-level", "loud"), ("--log-format", "xml")):
        out = subprocess.run([SWIFTKV, "serve", flag, value], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and f"{flag}" in out.stderr and value in out.stderr, out.stderr


def test_engine_processes_do_not_get_ctrl_c(tmp_path):
    """Processes started inside shield_children() start with SIGINT blocked, the first one too (starting
    multiprocessing's resource tracker unblocks SIGINT in the calling thread), and the caller gets its Ctrl-C back."""
    script = tmp_path / "shield.py"
    script.write_text('''
import multiprocessing, signal, time
from swiftkv_core.interrupts import shield_children

def sigint_blocked(pid):
    status = open(f"/proc/{pid}/status").read()
    mask = int(status.split("SigBlk:")[1].split()[0], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))

if __name__ == "__main__":
    with shield_children():
        p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(30,))
        p.start()
    print(sigint_blocked(p.pid), sigint_blocked("self"))
    p.kill()
''')
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["True", "False"], out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_trainer_stops_with_status_0(tmp_path, sig):
    port = free_port()
    with open(tmp_path / "trainer.log", "w") as log:
        proc = subprocess.Popen([SWIFTKV, "trainer", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
                                 "--models-dir", str(tmp_path / "models")], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "SWIFTKV_API_KEYS": "", "SWIFTKV_API_KEYS_FILE": ""})
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "trainer.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        proc.send_signal(sig)
        assert proc.wait(30) == 0, (tmp_path / "trainer.log").read_text()
        assert not any(word in (tmp_path / "trainer.log").read_text() for word in NOISE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the shared platform: one real `swiftkv serve` with two engines, started at the default log level ---------------
GRACE_SECONDS = 30  # the platform's health.shutdown_grace_seconds (harness.engines.platform_config)


@pytest.fixture(scope="module")
def quiet_platform(platform):
    """(process, base URL, work folder, console lines from start to ready) of conftest's shared platform."""
    return platform.proc, platform.base, platform.work, platform.console_at_ready


@pytest.mark.engine
def test_start_is_a_screenful_of_platform_lines(quiet_platform):
    _, base, _, lines = quiet_platform
    assert len(lines) <= 40, "\n".join(lines)
    assert len(set(lines)) == len(lines), "\n".join(lines)  # nothing said twice
    own = re.compile(r"\d\d:\d\d:\d\d |Try:$|  curl -s |    -d ")
    assert all(own.match(line) for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    for said in ("engine and library logs: ", "pool swiftkv: starting the engine", "pool base: engine for", "KV cache: ",
                 f"SwiftKV is serving tiny (pools: swiftkv, base) at {base}/v1"):
        assert said in text, text


@pytest.mark.engine
def test_log_file_holds_the_engine_logs(quiet_platform):
    _, _, work, lines = quiet_platform
    (named,) = [line.split("engine and library logs: ")[1].split(" (")[0] for line in lines if "engine and library logs: " in line]
    assert Path(named) == work / "data" / "logs" / "serve.log"
    logfile = Path(named).read_text()
    for engine_line in (r"\(EngineCore pid=\d+\) INFO", r"\(Worker pid=\d+\) INFO", "Loading safetensors checkpoint shards",
                        "Maximum concurrency for 512 tokens"):
        assert len(re.findall(engine_line, logfile)) >= 2, engine_line  # both engines'


def descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.engine
@pytest.mark.last(2)
def test_sigterm_under_load_drains_and_stops_cleanly(platform):
    """The last test of the run: it stops the shared platform. Streams and non-streamed requests in flight when SIGTERM
    arrives finish whole; the listener closes at once (new connections are refused, so readiness fails); the process
    exits 0 within the drain timeout with nothing alarming on the console or in the log file from the signal on, and
    leaves no process or shared-memory segment behind."""
    import psutil

    proc, base = platform.proc, platform.base
    client = platform.client(KEY, timeout=120)
    console_path, logfile_path = platform.log_path, engine_log(platform)
    console_from, logfile_from = console_path.stat().st_size, logfile_path.stat().st_size  # an earlier test killed an engine
    children = descendants(proc.pid)
    assert sum("EngineCor" in p.name() for p in children) == 2
    segments = {line.split()[-1] for p in children for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines() if "/dev/shm/" in line}
    results: dict[int, tuple[int, str]] = {}
    completed: list = []
    started = threading.Barrier(5)
    auth = {"Authorization": f"Bearer {KEY}"}

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=auth, timeout=120) as r:
            chunks = r.iter_lines()
            first = next(chunks)
            started.wait(60)
            results[i] = (r.status_code, first + "\n".join(chunks))

    def complete(i: int) -> None:
        r = client.completions.create(model="tiny", prompt=f"whole {i}", max_tokens=120, extra_body={"ignore_eos": True})
        completed.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first chunk: all four are in flight, and the two non-streamed requests
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # the listener is closed: readiness fails, new connections go elsewhere
        httpx.get(f"{base}/ready", timeout=2)
    code = proc.wait(GRACE_SECONDS + 60)  # the drain, then two engines stopping
    took = time.time() - t0
    for t in threads:
        t.join(10)
    console = console_path.read_bytes()[console_from:].decode(errors="replace")
    assert code == 0, console
    assert took < GRACE_SECONDS + 40, took
    assert sorted(results) == [0, 1, 2, 3] and all(status == 200 and "[DONE]" in text for status, text in results.values()), results
    assert completed == [120, 120]
    logfile = logfile_path.read_bytes()[logfile_from:].decode(errors="replace")
    # An engine core killed with SIGKILL earlier in the run (test_reliability) never released its shared memory: the
    # gateway's resource tracker removes those segments at exit and says how many; nothing else may be left.
    leaked = re.compile(r"[^\n]*resource_tracker: There appear to be (\d+) leaked shared_memory objects[^\n]*\n\s*warnings\.warn\([^\n]*\n?")
    assert sum(int(n) for n in leaked.findall(logfile)) <= platform.killed_engines, logfile[-4000:]
    logfile = leaked.sub("", logfile)
    for word in NOISE:
        assert word not in console, console
        assert word not in logfile, logfile[logfile.find(word) - 2000:logfile.find(word) + 2000]
    assert console.rstrip().endswith("stopped"), console
    deadline = time.time() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children) and time.time() < deadline:
        time.sleep(0.5)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert segments and not [s for s in segments if Path(s).exists()]
    print(f"\nSIGTERM with 4 streams and 2 whole answers in flight: all finished, exit 0 after {took:.1f} s")
