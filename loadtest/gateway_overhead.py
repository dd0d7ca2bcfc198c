"""Gateway overhead: what the gateway adds on top of a trivially fast backend.

Three servers run side by side on the same HTTP stack (uvicorn, one process each):
  baseline  a bare ASGI app answering every POST with a canned chat completion (no logic at all);
  shell     the gateway's framework (FastAPI, one route reading the body) answering the same;
  gateway   the real SwiftKV gateway (validation, auth, chat template + tokenization, rate limits,
            routing, metrics), whose two pools are the fake backend (services.serving.fake) answering at once.
A client in a third process measures
  added latency  p50/p99 of gateway minus baseline, sequential requests (one in flight), interleaved;
  max req/s      routed requests per second through the gateway at high concurrency.

    .venv/bin/python loadtest/gateway_overhead.py [--requests 3000] [--seconds 10] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.platform_bench import free_port, pct  # noqa: E402

CANNED = {
    "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok ok"}, "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
}
SHORT = {"model": "bench", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64}
# ~100 prompt tokens and 8 output tokens: ratio >= 4, routed to the swiftkv pool (SHORT goes to base)
LONG = {"model": "bench", "messages": [{"role": "user", "content": "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 6}],
        "max_tokens": 8}
# a 1,400-character prompt (~500 tokens with the tiny tokenizer): shows what token counting costs
HUGE = {"model": "bench", "messages": [{"role": "user", "content": "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 30}],
        "max_tokens": 8}


# ---- servers ---------------------------------------------------------------------------------------
def instant_answer(request):
    """The canned answer as the engines' outputs, at once (one output, two tokens): it isolates the gateway's own cost."""
    from services.serving.backend import ChoiceDelta, Output

    return [Output([ChoiceDelta(i, "ok ok", 2, "length") for i in range(request.sampling.n)], 0.0)]


def serve_gateway(port: int, tokenizer_dir: str) -> None:
    import uvicorn

    from services.common.keys import KeyStore
    from services.config import PlatformConfig
    from services.gateway.app import Gateway, create_app
    from services.gateway.prompts import Prompter
    from services.serving.fake import FakeBackend

    cfg = PlatformConfig.model_validate({
        "model": "bench", "port": port,
        "pools": {p: {"model": tokenizer_dir, "engine_args": {"max_model_len": 4096}} for p in ("swiftkv", "base")},
        # limits on, generous: their bookkeeping is part of the measured path
        "limits": {"requests_per_minute": 10**9, "prompt_tokens_per_minute": 10**12, "output_tokens_per_minute": 10**12},
    })
    keys = KeyStore({})
    backends = {p: FakeBackend(p, script=instant_answer, record=False) for p in cfg.pools}
    gateway = Gateway(cfg, backends, Prompter(tokenizer_dir), keys)
    uvicorn.run(create_app(gateway), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_shell(port: int) -> None:
    """The gateway's framework without its logic: a FastAPI app whose route reads the body and answers."""
    import uvicorn
    from fastapi import FastAPI, Request
    from starlette.responses import Response

    body = json.dumps(CANNED).encode()
    app = FastAPI()

    async def endpoint(request: Request) -> Response:
        await request.body()
        return Response(body, media_type="application/json")

    app.router.add_route("/v1/chat/completions", endpoint, methods=["POST"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_baseline(port: int) -> None:
    import uvicorn

    body = json.dumps(CANNED).encode()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---- client ----------------------------------------------------------------------------------------
async def wait_up(session, url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            async with session.post(url, json=SHORT) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} did not come up")


async def sequential(session, url: str, body: dict, n: int) -> list[float]:
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    out = []
    for _ in range(n):
        t = time.perf_counter()
        async with session.post(url, data=payload, headers=headers) as r:
            await r.read()
            assert r.status == 200, r.status
        out.append(time.perf_counter() - t)
    return out


async def saturate(session, url: str, seconds: float, concurrency: int) -> tuple[int, dict[str, int]]:
    payloads = [json.dumps(SHORT).encode(), json.dumps(LONG).encode()]
    headers = {"Content-Type": "application/json"}
    stop = time.perf_counter() + seconds
    done = 0
    routes: dict[str, int] = {}

    async def worker(i: int) -> None:
        nonlocal done
        k = i
        while time.perf_counter() < stop:
            async with session.post(url, data=payloads[k % 2], headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
                pool = r.headers.get("x-swiftkv-route", "pool=none").split(";")[0]
                routes[pool] = routes.get(pool, 0) + 1
            done += 1
            k += 1

    t = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done / (time.perf_counter() - t), routes


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux), to report cost per request independent of contention."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(session, url: str, pid: int, seconds: float, concurrency: int) -> tuple[float, float, dict]:
    """Requests/s at saturation and the server's CPU time per request."""
    c0 = cpu_seconds(pid)
    rps, routes = await saturate(session, url, seconds, concurrency)
    return rps, (cpu_seconds(pid) - c0) / (rps * seconds), routes


async def measure(args, gw_port: int, base_port: int, shell_port: int, gw_pid: int, base_pid: int, shell_pid: int) -> dict:
    import aiohttp

    gw = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    base = f"http://127.0.0.1:{base_port}/v1/chat/completions"
    shell = f"http://127.0.0.1:{shell_port}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await wait_up(session, gw)
        await wait_up(session, base)
        await wait_up(session, shell)
        for url in (gw, base):  # warm both (chat template compile, connection pool)
            await sequential(session, url, SHORT, 200)
        g, b, gh, bh = [], [], [], []
        batch = 250
        for i in range(args.requests // batch):  # interleave so drift hits both equally
            body = SHORT if i % 2 == 0 else LONG
            g += await sequential(session, gw, body, batch)
            b += await sequential(session, base, body, batch)
        for _ in range(2):
            gh += await sequential(session, gw, HUGE, 250)
            bh += await sequential(session, base, HUGE, 250)
        rps, gw_cpu_per_req, routes = await throughput(session, gw, gw_pid, args.seconds, args.concurrency)
        base_rps, base_cpu_per_req, _ = await throughput(session, base, base_pid, min(args.seconds, 5), args.concurrency)
        shell_rps, shell_cpu_per_req, _ = await throughput(session, shell, shell_pid, min(args.seconds, 5), args.concurrency)
    return {
        "requests_each": len(g),
        "baseline_p50_ms": pct(b, 50) * 1e3, "baseline_p99_ms": pct(b, 99) * 1e3,
        "gateway_p50_ms": pct(g, 50) * 1e3, "gateway_p99_ms": pct(g, 99) * 1e3,
        "added_p50_ms": (pct(g, 50) - pct(b, 50)) * 1e3, "added_p99_ms": (pct(g, 99) - pct(b, 99)) * 1e3,
        "added_mean_ms": (statistics.mean(g) - statistics.mean(b)) * 1e3,
        "added_p50_ms_500_token_prompt": (pct(gh, 50) - pct(bh, 50)) * 1e3,
        "gateway_max_rps": rps, "baseline_max_rps": base_rps, "routes": routes, "concurrency": args.concurrency,
        "fastapi_shell_max_rps": shell_rps, "fastapi_shell_cpu_us_per_request": shell_cpu_per_req * 1e6,
        "gateway_cpu_us_per_request": gw_cpu_per_req * 1e6, "baseline_cpu_us_per_request": base_cpu_per_req * 1e6,
        "gateway_rps_per_busy_core": 1 / gw_cpu_per_req,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="sequential requests per server for latency")
    ap.add_argument("--seconds", type=float, default=10, help="duration of the throughput run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--_serve", choices=["gateway", "baseline", "shell"], help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_tokenizer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._serve == "gateway":
        return serve_gateway(args._port, args._tokenizer)
    if args._serve == "baseline":
        return serve_baseline(args._port)
    if args._serve == "shell":
        return serve_shell(args._port)

    from swiftkv_core.tiny import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer().save_pretrained(tmp)
        gw_port, base_port, shell_port = free_port(), free_port(), free_port()
        me = [sys.executable, __file__]
        procs = [
            subprocess.Popen(me + ["--_serve", "gateway", "--_port", str(gw_port), "--_tokenizer", tmp]),
            subprocess.Popen(me + ["--_serve", "baseline", "--_port", str(base_port)]),
            subprocess.Popen(me + ["--_serve", "shell", "--_port", str(shell_port)]),
        ]
        try:
            result = asyncio.run(measure(args, gw_port, base_port, shell_port, *(p.pid for p in procs)))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    result["machine"] = f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    result["load_average_1m_at_end"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = result["added_p50_ms"] <= 1.0 and result["gateway_max_rps"] >= 2000
    print(f"added p50 {result['added_p50_ms']:.3f} ms, p99 {result['added_p99_ms']:.3f} ms; "
          f"max {result['gateway_max_rps']:.0f} routed req/s -> {'meets' if ok else 'misses'} the target (<= 1 ms p50, >= 2000 req/s)")


if __name__ == "__main__":
    main()
