"""Gateway overhead: what the gateway adds on top of a trivially fast backend.

Four servers run side by side on the same HTTP stack (uvicorn, one process each):
  baseline  a bare ASGI app answering every POST with a canned chat completion (no logic at all);
  shell     the gateway's framework (FastAPI, one route reading the body) answering the same;
  gateway   the real SwiftKV gateway (validation, chat template + tokenization, rate limits, routing, metrics), whose
            two pools are the fake backend (services.serving.fake) answering at once, in two configurations
            (loadtest/gateway_cost.py): open (no API keys, global limits) and keys (API keys with per-key limits and
            per-key prefix caches, as a shared deployment runs).
A client in another process measures, for each configuration
  added latency  p50/p99 of gateway minus baseline, sequential requests (one in flight), interleaved;
  max req/s      routed requests per second through the gateway at high concurrency.

    .venv/bin/python -m loadtest.gateway_overhead [--requests 3000] [--seconds 10] [--concurrency 64]
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

from loadtest.gateway_cost import CONFIGS, KEYS, LONG, SHORT, tokenizer_dir
from loadtest.platform_bench import free_port, pct

CANNED = {
    "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok ok"}, "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
}
# a 1,400-character prompt (~500 tokens with the tiny tokenizer): shows what token counting costs
HUGE = {"model": "bench", "messages": [{"role": "user", "content": "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 30}],
        "max_tokens": 8}


# ---- servers ---------------------------------------------------------------------------------------
def serve_gateway(port: int, tokenizer_dir: str, config: str) -> None:
    """The real gateway over two pools of the fake backend answering at once (loadtest.gateway_cost's, `config`: open or
    keys), served as `swiftkv serve` serves it (uvicorn with the edge protocol)."""
    import uvicorn

    from loadtest.gateway_cost import build_gateway
    from services.gateway.app import create_app
    from services.gateway.http_limits import edge_protocol

    cfg, gateway = build_gateway(tokenizer_dir, config, port)
    uvicorn.run(create_app(gateway), host="127.0.0.1", port=port, log_level="warning", access_log=False, http=edge_protocol(cfg.limits))


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
class Target:
    """A server's chat route and the headers of its i-th request (the keys configuration rotates over its keys)."""

    def __init__(self, port: int, keyed: bool = False):
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        base = {"Content-Type": "application/json"}
        self.headers = [base | {"Authorization": f"Bearer {k}"} for k in KEYS] if keyed else [base]

    def headers_for(self, i: int) -> dict:
        return self.headers[i % len(self.headers)]


async def wait_up(session, target: Target, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            async with session.post(target.url, json=SHORT, headers=target.headers_for(0)) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{target.url} did not come up")


async def sequential(session, target: Target, body: dict, n: int) -> list[float]:
    payload = json.dumps(body).encode()
    out = []
    for i in range(n):
        t = time.perf_counter()
        async with session.post(target.url, data=payload, headers=target.headers_for(i)) as r:
            await r.read()
            assert r.status == 200, r.status
        out.append(time.perf_counter() - t)
    return out


async def saturate(session, target: Target, seconds: float, concurrency: int) -> tuple[float, dict[str, int]]:
    payloads = [json.dumps(SHORT).encode(), json.dumps(LONG).encode()]
    stop = time.perf_counter() + seconds
    done = 0
    routes: dict[str, int] = {}

    async def worker(i: int) -> None:
        nonlocal done
        k = i
        while time.perf_counter() < stop:
            async with session.post(target.url, data=payloads[k % 2], headers=target.headers_for(k)) as r:
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


async def throughput(session, target: Target, pid: int, seconds: float, concurrency: int) -> tuple[float, float, dict]:
    """Requests/s at saturation and the server's CPU time per request."""
    c0 = cpu_seconds(pid)
    rps, routes = await saturate(session, target, seconds, concurrency)
    return rps, (cpu_seconds(pid) - c0) / (rps * seconds), routes


async def measure(args, ports: dict[str, int], pids: dict[str, int]) -> dict:
    import aiohttp

    targets = {name: Target(port, keyed=name == "keys") for name, port in ports.items()}
    base = targets["baseline"]
    conn = aiohttp.TCPConnector(limit=0)
    result: dict = {"concurrency": args.concurrency}
    async with aiohttp.ClientSession(connector=conn) as session:
        for target in targets.values():
            await wait_up(session, target)
        for name in (*CONFIGS, "baseline"):  # warm (chat template compiled, connection pool)
            await sequential(session, targets[name], SHORT, 200)
        times: dict[str, list[float]] = {name: [] for name in (*CONFIGS, "baseline")}
        huge: dict[str, list[float]] = {name: [] for name in (*CONFIGS, "baseline")}
        batch = min(250, args.requests)
        for i in range(args.requests // batch):  # interleaved, so drift hits every server alike
            body = SHORT if i % 2 == 0 else LONG
            for name in times:
                times[name] += await sequential(session, targets[name], body, batch)
        for _ in range(2):
            for name in huge:
                huge[name] += await sequential(session, targets[name], HUGE, 250)
        b, bh = times["baseline"], huge["baseline"]
        result |= {"requests_each": len(b), "baseline_p50_ms": pct(b, 50) * 1e3, "baseline_p99_ms": pct(b, 99) * 1e3}
        for name in CONFIGS:
            g, gh = times[name], huge[name]
            rps, cpu, routes = await throughput(session, targets[name], pids[name], args.seconds, args.concurrency)
            result[name] = {
                "gateway_p50_ms": pct(g, 50) * 1e3, "gateway_p99_ms": pct(g, 99) * 1e3,
                "added_p50_ms": (pct(g, 50) - pct(b, 50)) * 1e3, "added_p99_ms": (pct(g, 99) - pct(b, 99)) * 1e3,
                "added_mean_ms": (statistics.mean(g) - statistics.mean(b)) * 1e3,
                "added_p50_ms_500_token_prompt": (pct(gh, 50) - pct(bh, 50)) * 1e3,
                "max_rps": rps, "cpu_us_per_request": cpu * 1e6, "rps_per_busy_core": 1 / cpu, "routes": routes,
            }
        result["baseline_max_rps"], base_cpu, _ = await throughput(session, base, pids["baseline"], min(args.seconds, 5), args.concurrency)
        result["fastapi_shell_max_rps"], shell_cpu, _ = await throughput(session, targets["shell"], pids["shell"], min(args.seconds, 5),
                                                                         args.concurrency)
        result["baseline_cpu_us_per_request"], result["fastapi_shell_cpu_us_per_request"] = base_cpu * 1e6, shell_cpu * 1e6
    return result


# The target on a quiet AVX-512 machine, for both configurations.
TARGET_P50_MS, TARGET_RPS = 0.45, 2600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="sequential requests per server for latency")
    ap.add_argument("--seconds", type=float, default=10, help="duration of each gateway's throughput run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--_serve", choices=["gateway", "baseline", "shell"], help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--_config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._serve == "gateway":
        return serve_gateway(args._port, args._tokenizer, args._config)
    if args._serve == "baseline":
        return serve_baseline(args._port)
    if args._serve == "shell":
        return serve_shell(args._port)

    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir(tmp)
        ports = {name: free_port() for name in (*CONFIGS, "baseline", "shell")}
        me = [sys.executable, "-m", "loadtest.gateway_overhead"]
        procs = {name: subprocess.Popen(me + ["--_serve", "gateway", "--_port", str(ports[name]), "--_tokenizer", tmp, "--_config", name])
                 for name in CONFIGS}
        procs |= {name: subprocess.Popen(me + ["--_serve", name, "--_port", str(ports[name])]) for name in ("baseline", "shell")}
        try:
            result = asyncio.run(measure(args, ports, {name: p.pid for name, p in procs.items()}))
        finally:
            for p in procs.values():
                p.terminate()
                p.wait(10)
    result["machine"] = f"{os.cpu_count()} CPU cores, {cpu_model()}, Python {platform.python_version()}"
    result["load_average_1m"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    for name in CONFIGS:
        r = result[name]
        ok = r["added_p50_ms"] <= TARGET_P50_MS and r["max_rps"] >= TARGET_RPS
        print(f"{name}: added p50 {r['added_p50_ms']:.3f} ms, p99 {r['added_p99_ms']:.3f} ms; max {r['max_rps']:.0f} routed req/s, "
              f"{r['cpu_us_per_request']:.0f} us CPU per request -> {'meets' if ok else 'misses'} the target "
              f"(<= {TARGET_P50_MS} ms p50, >= {TARGET_RPS} req/s on a quiet AVX-512 machine)")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
