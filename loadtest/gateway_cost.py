"""The gateway's own work per request, counted where a busy machine cannot blur it.

The gateway of `gateway_overhead.py` (two pools of the fake backend answering at once, the tiny tokenizer) runs in
this process; a fixed mix of chat requests (short ones routed to base, prompt-heavy ones to swiftkv, half streamed)
goes straight into its ASGI app, one at a time, with no HTTP server or client around it. Two configurations:
  open   no API keys, global limits (generous: their bookkeeping is measured, never a refusal);
  keys   API keys with per-key limits and per-key prefix caches, as a shared deployment runs.

  --profile        cProfile of the mix, top functions by own time
  --instructions   instructions per request (valgrind's callgrind, only the measured requests instrumented),
                   compared with the budget in loadtest/gateway_budget.json: exit 1 when one grew more than
                   `tolerance` over it (a slowdown CI catches on any machine, loaded or not)

    .venv/bin/python -m loadtest.gateway_cost [--requests 200] [--profile | --instructions [--record]]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUDGET = ROOT / "loadtest" / "gateway_budget.json"
CONFIGS = ("open", "keys")
KEYS = [f"sk-cost-{i}" for i in range(4)]
SHORT = {"model": "bench", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64}
LONG = {"model": "bench", "messages": [{"role": "user", "content": "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 6}],
        "max_tokens": 8}
MIX = [SHORT, LONG, SHORT | {"stream": True}, LONG | {"stream": True}]  # one in four of each, in this order


def instant_answer(request):
    """The engines' outputs at once (one output of two tokens per choice): only the gateway's own work is left."""
    from services.serving.backend import ChoiceDelta, Output

    return [Output([ChoiceDelta(i, "ok ok", 2, "length") for i in range(request.sampling.n)], 0.0)]


def build_gateway(tokenizer_dir: str, config: str, port: int = 0):
    """(PlatformConfig, Gateway) of the measured gateway; `config` is open or keys."""
    from services.common.keys import KeyStore
    from services.config import PlatformConfig
    from services.gateway.app import Gateway
    from services.gateway.prompts import Prompter
    from services.serving.fake import FakeBackend

    limits = {"requests_per_minute": 10**9, "prompt_tokens_per_minute": 10**12, "output_tokens_per_minute": 10**12}
    cfg = PlatformConfig.model_validate({
        "model": "bench", "port": port,
        "pools": {p: {"model": tokenizer_dir, "engine_args": {"max_model_len": 4096}} for p in ("swiftkv", "base")},
        "limits": limits,
    })
    if config == "keys":  # each key with limits of its own (the configuration a shared deployment runs)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            json.dump({"keys": [{"key": key, "name": f"team-{i}", "limits": limits} for i, key in enumerate(KEYS)]}, f)
            f.flush()
            keys = KeyStore.from_env(f.name)
    else:
        keys = KeyStore({})
    backends = {p: FakeBackend(p, script=instant_answer, record=False) for p in cfg.pools}
    return cfg, Gateway(cfg, backends, Prompter(tokenizer_dir), keys)


class Driver:
    """Sends requests straight into an ASGI app and reads the whole answer."""

    def __init__(self, app, config: str):
        self.app, self.config = app, config
        self.bodies = [json.dumps(body).encode() for body in MIX]

    def scope(self, i: int) -> dict:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.bodies[i % len(MIX)])).encode())]
        if self.config == "keys":
            headers.append((b"authorization", f"Bearer {KEYS[i % len(KEYS)]}".encode()))
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {}}

    async def one(self, i: int) -> None:
        body, sent = self.bodies[i % len(MIX)], []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # no disconnect while the answer is sent

        async def send(message):
            sent.append(message)

        await self.app(self.scope(i), receive, send)
        status = sent[0]["status"]
        if status != 200:
            raise RuntimeError(f"request {i} answered {status}: {b''.join(m.get('body', b'') for m in sent[1:])[:300]!r}")

    async def run(self, count: int, start: int = 0) -> None:
        for i in range(start, start + count):
            await self.one(i)


def tokenizer_dir(path: str) -> str:
    """The tiny test tokenizer saved at `path` (made in the parent process: the measured one never imports torch)."""
    from swiftkv_core.tiny import train_tokenizer

    train_tokenizer().save_pretrained(path)
    return path


async def prepared(config: str, tokenizer: str):
    """A started gateway app and its driver, warmed (chat template compiled, prefix index and estimates filled)."""
    from services.gateway.app import create_app

    _, gateway = build_gateway(tokenizer, config)
    await gateway.start()
    driver = Driver(create_app(gateway), config)
    await driver.run(2 * len(MIX) * len(KEYS))
    return gateway, driver


def plant_slowdown() -> None:
    """A slowdown planted in the gateway's path, for the test that shows the budget catches one: every request's bounds
    check does about a quarter more work than a whole request."""
    from services.gateway.admission import Admission

    check_bounds = Admission.check_bounds

    def slower(self, req) -> None:
        sum(range(2_000))
        check_bounds(self, req)

    Admission.check_bounds = slower


# ---- callgrind -------------------------------------------------------------------------------------
TOGGLES = r"""
#include <valgrind/callgrind.h>
void measure_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void measure_stop(const char *name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""


def toggles() -> ctypes.CDLL:
    """Callgrind's client requests (no-ops outside valgrind), compiled once into a tiny library."""
    out = Path(tempfile.gettempdir()) / f"swiftkv-callgrind-toggles-{os.getuid()}.so"
    if not out.exists():
        src = out.with_suffix(".c")
        src.write_text(TOGGLES)
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return ctypes.CDLL(str(out))


async def instrumented(count: int, tokenizer: str, planted: bool) -> None:
    """Run under callgrind: each configuration's `count` requests instrumented, dumped under its name; with `planted`,
    then the keys configuration again with a slowdown planted (dumped as `planted`)."""
    lib = toggles()
    for phase in (*CONFIGS, "planted") if planted else CONFIGS:
        if phase == "planted":
            plant_slowdown()
        gateway, driver = await prepared("keys" if phase == "planted" else phase, tokenizer)
        lib.measure_start()
        await driver.run(count, start=1)
        lib.measure_stop(phase.encode())
        await gateway.stop()


def count_instructions(count: int, planted: bool = False) -> dict[str, float]:
    """Instructions per request for each configuration (and `planted`), from a callgrind run of this script."""
    phases = {*CONFIGS, "planted"} if planted else set(CONFIGS)
    with tempfile.TemporaryDirectory() as out:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
               sys.executable, "-m", "loadtest.gateway_cost", "--_instrumented", tokenizer_dir(f"{out}/tokenizer"), "--requests", str(count)]
        env = os.environ | {"PYTHONHASHSEED": "0", "PYTHONMALLOC": "malloc"}  # the same hashing and allocator every run
        done = subprocess.run(cmd + (["--_planted"] if planted else []), env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"callgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        per_request = {}
        for dump in Path(out).glob("cg.*"):
            text = dump.read_text(errors="replace")
            trigger = re.search(r"^desc: Trigger: Client Request: (\w+)", text, re.M)
            total = re.search(r"^totals: (\d+)", text, re.M)
            if trigger and total and trigger.group(1) in phases:
                per_request[trigger.group(1)] = int(total.group(1)) / count
        if set(per_request) != phases:
            raise RuntimeError(f"callgrind wrote no dump for {phases - set(per_request)}:\n{done.stderr[-3000:]}")
        return per_request


def check(measured: dict[str, float], budget: dict) -> list[str]:
    """The configurations whose instructions per request grew more than the budget's tolerance."""
    limit = 1 + budget["tolerance"]
    return [f"{config}: {measured[config]:,.0f} instructions per request, over {limit:.2f} x the budget's "
            f"{budget['per_request'][config]:,.0f}" for config in CONFIGS if measured[config] > limit * budget["per_request"][config]]


# ---- profile ---------------------------------------------------------------------------------------
async def profile(count: int, config: str, tokenizer: str) -> None:
    gateway, driver = await prepared(config, tokenizer)
    profiler = cProfile.Profile()
    profiler.enable()
    await driver.run(count, start=1)
    profiler.disable()
    await gateway.stop()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)


async def cpu_time(count: int, tokenizer: str) -> None:
    for config in CONFIGS:
        gateway, driver = await prepared(config, tokenizer)
        t = time.process_time()
        await driver.run(count, start=1)
        print(f"{config}: {(time.process_time() - t) / count * 1e6:.0f} us of CPU per request (load {os.getloadavg()[0]:.2f})")
        await gateway.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="measured requests per configuration")
    ap.add_argument("--config", choices=CONFIGS, default="keys", help="the configuration --profile runs")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--profile", action="store_true")
    mode.add_argument("--instructions", action="store_true")
    mode.add_argument("--cpu", action="store_true", help="CPU time per request (every thread of the process): a quick reading")
    ap.add_argument("--record", action="store_true", help="with --instructions: write the measured figures as the new budget")
    ap.add_argument("--_instrumented", metavar="TOKENIZER", help=argparse.SUPPRESS)
    ap.add_argument("--_planted", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._instrumented:
        return asyncio.run(instrumented(args.requests, args._instrumented, args._planted))
    if args.profile or args.cpu:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = tokenizer_dir(tmp)
            return asyncio.run(profile(args.requests, args.config, tokenizer) if args.profile else cpu_time(args.requests, tokenizer))
    measured = count_instructions(args.requests)
    budget = json.loads(BUDGET.read_text())
    print(json.dumps({"instructions_per_request": {k: round(v) for k, v in measured.items()}, "budget": budget["per_request"]}, indent=2))
    if args.record:
        budget["per_request"] = {k: round(v) for k, v in measured.items()}
        BUDGET.write_text(json.dumps(budget, indent=2) + "\n")
        return
    over = check(measured, budget)
    for line in over:
        print(line, file=sys.stderr)
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
