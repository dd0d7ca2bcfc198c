"""Soak test: a long run of mixed streaming traffic at a steady rate, watching for leaks and drift.

One platform configuration is started through `swiftkv serve` (loadtest.platform_bench.started: the routed
configuration by default, SmolLM2 SwiftKV + base pools from models/, in-process engines), warmed up with a few
requests of their own, then sent real-text requests of the `mixed` workload (loadtest.workloads: 70% rag, 20%
chat, 10% gen) with the official openai client (async, streaming, usage in the last chunk, ignore_eos) as an
open-loop Poisson arrival process at --rate requests/s for --duration seconds (loadtest.platform_bench.drive).

Every --interval seconds it samples the gateway process (the `swiftkv serve` process) and each of its child
processes, found recursively with psutil (the engine cores): resident memory (RSS, MiB) and open file
descriptors; and the 1-minute load average. Per interval it also reports the TTFT p50/p99 of the requests whose
first token came in that interval, the requests that finished in it and the errors (an HTTP error status, an
exception, an error event in the stream, a stream without content or without a finish_reason).

At the end it writes --out (JSON: machine, command, settings, per-interval rows, totals, trend and verdict), a
PNG next to it (RSS, file descriptors and TTFT against minutes) and prints a markdown table of the rows. The
trend is the least-squares slope over the run, the first interval left out (warm-up), per 10 minutes, of the
gateway RSS, the engines' summed RSS and both file-descriptor counts; `no_growth` is true when every slope is
within its tolerance (RSS: the larger of --rss-tolerance-mib and --rss-tolerance-pct of its mean level; fds:
--fd-tolerance) and no request failed. The engines' RSS is summed per process, so pages they share (the model's
weights mapped from one file) count once per process.

With --target URL --target-model NAME nothing is started: the traffic goes to that server, and processes are
sampled only if --gateway-pid names its gateway (and its children) on this machine.

Ctrl-C stops the run: the platform's whole process group is stopped and what was measured so far is written.

    python -m loadtest.soak --rate 0.25 --out runs/soak/soak.json

Run it from the repository root (`-m`), as the other load-test tools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from loadtest.platform_bench import (
    CONFIGS,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    PUBLIC,
    PlatformBenchConfig,
    PlatformBenchError,
    Record,
    draws,
    drive,
    engine_args,
    existing,
    machine,
    model_names,
    pct,
    r4,
    started,
    warm_up,
)
from loadtest.workloads import WORKLOADS, WorkloadError, summary

MIB = 1 << 20
RATE_HELP = """Offered load, requests/s (Poisson arrivals). For "half the saturating rate": sweep the same
configuration and workload with `swiftkv bench platform --configs routed --workload mixed --max-model-len 4096
--duration 300 --count 1000 --rate 0.1 --rate 0.2 --rate 0.4 --rate 0.8 --out runs/soak/sweep.json` and take half
its `configs.routed.highest_sustained_rate` (the highest rate at which nothing failed and TTFT did not keep
growing)."""


@dataclass
class SoakOptions:
    rate: float
    duration_s: float = 1800.0
    interval_s: float = 60.0
    config: str = "routed"
    gateway_pid: int | None = None  # with a target: the gateway process to sample
    warmup: int = 2  # unmeasured requests per model name before the run
    rss_tolerance_mib: float = 5.0  # per 10 minutes
    rss_tolerance_pct: float = 0.5  # of the mean level, per 10 minutes
    fd_tolerance: float = 2.0  # per 10 minutes

    def check(self, target: str | None) -> None:
        if self.rate <= 0 or self.duration_s <= 0 or self.interval_s <= 0:
            raise PlatformBenchError("--rate, --duration and --interval must be positive")
        if self.interval_s > self.duration_s:
            raise PlatformBenchError(f"--interval ({self.interval_s:g} s) is longer than --duration ({self.duration_s:g} s)")
        if target is None and self.config not in CONFIGS:
            raise PlatformBenchError(f"--config: unknown {self.config!r}; choose from {', '.join(CONFIGS)}")
        if self.gateway_pid is not None and target is None:
            raise PlatformBenchError("--gateway-pid is for --target; the platform started here is sampled by itself")
        if self.warmup < 0 or min(self.rss_tolerance_mib, self.rss_tolerance_pct, self.fd_tolerance) < 0:
            raise PlatformBenchError("--warmup and the tolerances must not be negative")

    @property
    def intervals(self) -> int:
        return int(self.duration_s // self.interval_s)


# --------------------------------------------------------------------------------------------------
# Processes


def processes(pid: int) -> dict:
    """RSS (MiB) and open file descriptors of process `pid` and of each of its descendants."""
    import psutil

    def one(p) -> dict | None:
        try:
            with p.oneshot():
                return {"pid": p.pid, "name": p.name(), "rss_mib": round(p.memory_info().rss / MIB, 1), "fds": p.num_fds()}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return None

    try:
        root = psutil.Process(pid)
        gateway = one(root)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return {"gateway": None, "engines": []}
    return {"gateway": gateway, "engines": [e for e in map(one, children) if e is not None]}


def check_pid(pid: int) -> None:
    """A process this user can sample (memory and file descriptors), or a clear error."""
    import psutil

    try:
        if processes(pid)["gateway"] is None:
            raise PlatformBenchError(f"--gateway-pid: no process {pid} on this machine")
    except psutil.AccessDenied as e:
        raise PlatformBenchError(f"--gateway-pid: process {pid} cannot be sampled by this user ({e})") from e


def resources(pid: int | None) -> dict:
    """The sampled columns of one row (None where nothing is sampled)."""
    if pid is None:
        return {"gateway_rss_mib": None, "gateway_fds": None, "engine_rss_mib": None, "engine_fds": None, "engines": []}
    p = processes(pid)
    g, engines = p["gateway"], p["engines"]
    return {"gateway_rss_mib": g and g["rss_mib"], "gateway_fds": g and g["fds"],
            "engine_rss_mib": round(sum(e["rss_mib"] for e in engines), 1) if engines else None,
            "engine_fds": sum(e["fds"] for e in engines) if engines else None, "engines": engines}


# --------------------------------------------------------------------------------------------------
# The run


@dataclass
class Finished:
    record: Record
    at_s: float  # when its request ended, seconds after the start of the run


@dataclass
class SoakState:
    """What the run has measured so far (kept outside the event loop, so Ctrl-C does not lose it)."""
    finished: list[Finished] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # per interval: its end and the sampled resources
    sent: int = 0


def interval_figures(finished: list[Finished], lo: float, hi: float) -> dict:
    """TTFT of the requests whose first token came in [lo, hi); requests that ended in it, and errors."""
    ttft = [f.record.ttft_s for f in finished if f.record.ttft_s is not None and lo <= f.record.sent_s + f.record.ttft_s < hi]
    ended = [f.record for f in finished if lo <= f.at_s < hi]
    errors = [r for r in ended if r.error]
    return {"ttft_n": len(ttft), "ttft_p50_s": r4(pct(ttft, 50)), "ttft_p99_s": r4(pct(ttft, 99)),
            "done": len(ended) - len(errors), "errors": len(errors), "error_samples": sorted({r.error for r in errors})[:3]}


def progress_line(row: dict, opts: SoakOptions) -> str:
    mib = lambda x: "-" if x is None else f"{x:.0f} MiB"  # noqa: E731
    return (f"[{row['minute']:6.2f} min / {opts.duration_s / 60:g}] gateway {mib(row['gateway_rss_mib'])} {fmt(row['gateway_fds'])} fds, "
            f"engines {mib(row['engine_rss_mib'])} {fmt(row['engine_fds'])} fds, TTFT p50 {row['ttft_p50_s']} p99 {row['ttft_p99_s']} s "
            f"(n={row['ttft_n']}), done {row['done']}, errors {row['errors']}, load {row['load_1min']:.2f}")


async def soak(base: str, names: list[str], requests, pid: int | None, opts: SoakOptions, timeout: float, api_key: str,
               state: SoakState, log: Callable[[str], None]) -> None:
    """Drive `requests` and sample every interval; the rows' request figures are final once the run ends."""
    t0 = time.perf_counter()

    def done(rec: Record) -> None:
        state.finished.append(Finished(rec, time.perf_counter() - t0))

    async def sampler() -> None:
        for k in range(1, opts.intervals + 1):
            await asyncio.sleep(max(0.0, t0 + k * opts.interval_s - time.perf_counter()))
            sample = {"end_s": k * opts.interval_s, **resources(pid), "load_1min": round(os.getloadavg()[0], 2)}
            state.samples.append(sample)
            log(progress_line(row(sample, state.finished, k == opts.intervals, opts), opts))

    state.sent = len(requests)
    # Ctrl-C ends the run here, whatever the request tasks are awaiting: a cancellation that reaches the traffic
    # through asyncio.run's own handler can be absorbed inside a request, and the run then went on to its end.
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    sampling = asyncio.create_task(sampler())
    driving = asyncio.create_task(drive(base, names, requests, timeout, done, api_key))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({driving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            raise KeyboardInterrupt
        await driving
        await sampling
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        for task in (sampling, driving, stopping):
            task.cancel()


def row(sample: dict, finished: list[Finished], last: bool, opts: SoakOptions) -> dict:
    """One interval's row: its samples and the request figures of its window (the last window also takes the
    requests that ended after it, while the run drained)."""
    hi = math.inf if last else sample["end_s"]
    return {"minute": round(sample["end_s"] / 60, 2), **{k: v for k, v in sample.items() if k != "engines"},
            **interval_figures(finished, sample["end_s"] - opts.interval_s, hi), "engines": sample["engines"]}


def slope_per_10min(xs: list[float], ys: list[float | None]) -> float | None:
    """Least-squares slope of ys against xs (minutes), per 10 minutes; None with fewer than two points."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(10 * sum((x - mx) * (y - my) for x, y in pts) / sxx, 3) if sxx else None


def trend(rows: list[dict], errors: int, opts: SoakOptions) -> dict:
    """Slopes over the rows after the first (warm-up), their tolerances, and the verdict."""
    kept = rows[1:]
    xs = [r["end_s"] / 60 for r in kept]
    out: dict = {"excluded": "the first interval (warm-up)", "points": len(kept), "unit": "per 10 minutes", "slopes": {},
                 "tolerances": {}, "within": {}}
    for key in ("gateway_rss_mib", "engine_rss_mib", "gateway_fds", "engine_fds"):
        ys = [r[key] for r in kept]
        s = slope_per_10min(xs, ys)
        if s is None:
            continue
        present = [y for y in ys if y is not None]
        if key.endswith("rss_mib"):
            tol = max(opts.rss_tolerance_mib, opts.rss_tolerance_pct / 100 * sum(present) / len(present))
        else:
            tol = opts.fd_tolerance
        out["slopes"][key], out["tolerances"][key], out["within"][key] = s, round(tol, 3), abs(s) <= tol
    out["slopes"]["ttft_p99_s"] = slope_per_10min(xs, [r["ttft_p99_s"] for r in kept])  # shown, not judged
    out["tolerance_rule"] = (f"RSS: |slope| <= max({opts.rss_tolerance_mib:g} MiB, {opts.rss_tolerance_pct:g}% of the mean level) "
                             f"per 10 min; fds: |slope| <= {opts.fd_tolerance:g} per 10 min; and no request failed")
    out["no_growth"] = (all(out["within"].values()) and errors == 0) if out["within"] else None
    if not out["within"]:
        out["why_none"] = "no process was sampled, or fewer than two intervals after the first"
    return out


@contextmanager
def platform(cfg: PlatformBenchConfig, opts: SoakOptions, work: Path, log: Callable[[str], None]):
    """-> (base URL, the pid to sample or None, the model names the requests ask for in turn, the names to warm)."""
    if cfg.target is not None:
        with existing(cfg.target, cfg.target_model, cfg.api_key, 30) as base:
            yield base, opts.gateway_pid, [cfg.target_model], [cfg.target_model]
    else:
        with started(opts.config, cfg, work, log) as (base, proc):
            names = model_names(opts.config)
            yield base, proc.pid, names, [f"{PUBLIC}-swiftkv", f"{PUBLIC}-base", *names]


def run(cfg: PlatformBenchConfig, opts: SoakOptions, log: Callable[[str], None] = print) -> dict:
    opts.check(cfg.target)
    cfg.rates, cfg.duration_s, cfg.warmup_requests = [opts.rate], opts.duration_s, opts.warmup
    cfg.count = int(opts.rate * opts.duration_s * 2) + 100  # the duration bounds the arrivals, not the count
    cfg.check()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.base_model)
    try:
        _, workloads, warm = draws(cfg, cfg.rates, tokenizer)  # the bench's requests and warm-up, at one rate
        requests = workloads[opts.rate]
    except WorkloadError as e:
        raise PlatformBenchError(str(e)) from e
    report: dict = {
        "server": {"config": None if cfg.target else opts.config, "target": cfg.target, "target_model": cfg.target_model,
                   "models": None if cfg.target else {"base": cfg.base_model, "swiftkv": cfg.swiftkv_model},
                   "engine_args": None if cfg.target else engine_args(cfg), "gateway_pid": opts.gateway_pid},
        "traffic": {"workload": cfg.workload, "rate": opts.rate, "duration_s": opts.duration_s, "interval_s": opts.interval_s,
                    "seed": cfg.seed, "scale": cfg.scale, "warmup_requests": opts.warmup, "stream": True, "ignore_eos": True,
                    "workload_summary": summary(requests)},
        "machine": machine()}
    if opts.gateway_pid is not None:
        check_pid(opts.gateway_pid)
    state = SoakState()
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="swiftkv-soak-") as tmp:
        try:
            with platform(cfg, opts, Path(tmp), log) as (base, pid, names, warm_names):
                report["server"]["sampled_pid"] = pid
                if opts.warmup:
                    asyncio.run(warm_up(base, warm_names, warm, opts.warmup, cfg.request_timeout_s, cfg.api_key))
                if pid is None:
                    log("no gateway process to sample (--target without --gateway-pid): RSS and fds are not recorded")
                log(f"soak: {len(requests)} requests, {cfg.workload} at {opts.rate:g} req/s for {opts.duration_s:g} s, "
                    f"a row every {opts.interval_s:g} s")
                asyncio.run(soak(base, names, requests, pid, opts, cfg.request_timeout_s, cfg.api_key, state, log))
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: the platform is stopped; writing what was measured so far")
    rows = [row(s, state.finished, i == len(state.samples) - 1 and not interrupted, opts) for i, s in enumerate(state.samples)]
    records = [f.record for f in state.finished]
    errors = sum(1 for r in records if r.error)
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    report["interrupted"] = interrupted
    report["rows"] = rows
    report["totals"] = {"planned": state.sent, "finished": len(records),
                        "completed": len(records) - errors, "errors": errors,
                        "error_samples": sorted({r.error for r in records if r.error})[:5],
                        "ttft_p50_s": r4(pct(ttft, 50)), "ttft_p99_s": r4(pct(ttft, 99)),
                        "prompt_tokens": sum(r.prompt_tokens for r in records), "output_tokens": sum(r.output_tokens for r in records),
                        "pool_share": {p: round(sum(1 for r in records if (r.pool or "unknown") == p) / max(len(records), 1), 3)
                                       for p in sorted({r.pool or "unknown" for r in records})}}
    report["trend"] = trend(rows, errors, opts)
    report["load_average_after"] = list(os.getloadavg())
    return report


# --------------------------------------------------------------------------------------------------
# Output


def fmt(x, spec: str = "g") -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    head = "| minute | gateway RSS MiB | engine RSS MiB | fds gateway / engines | TTFT p50 s | TTFT p99 s | done | errors | load 1 min |"
    lines = [head, "|" + "---|" * 9]
    for r in report["rows"]:
        lines.append(f"| {r['minute']:g} | {fmt(r['gateway_rss_mib'], '.0f')} | {fmt(r['engine_rss_mib'], '.0f')} | "
                     f"{fmt(r['gateway_fds'])} / {fmt(r['engine_fds'])} | {fmt(r['ttft_p50_s'], '.3f')} | {fmt(r['ttft_p99_s'], '.3f')} | "
                     f"{r['done']} | {r['errors']} | {r['load_1min']:.2f} |")
    t = report["trend"]
    slopes = ", ".join(f"{k} {v:+g}" for k, v in t["slopes"].items() if v is not None)
    lines.append("")
    lines.append(f"Slopes per 10 min (first interval left out): {slopes or 'none'}. {t['tolerance_rule']}: "
                 f"**no_growth {t['no_growth']}**; {report['totals']['errors']} errors of {report['totals']['finished']} requests.")
    return "\n".join(lines)


def plot(report: dict, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    xs = [r["minute"] for r in rows]
    nan = lambda ys: [float("nan") if y is None else y for y in ys]  # noqa: E731
    fig, (mem, fds, lat) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    mem.plot(xs, nan([r["gateway_rss_mib"] for r in rows]), "-o", label="gateway")
    mem.plot(xs, nan([r["engine_rss_mib"] for r in rows]), "-s", label="engines (sum)")
    pids = sorted({e["pid"] for r in rows for e in r["engines"]})
    if 1 < len(pids) <= 8:
        for pid in pids:
            ys = [next((e["rss_mib"] for e in r["engines"] if e["pid"] == pid), None) for r in rows]
            mem.plot(xs, nan(ys), ":", linewidth=1, label=f"pid {pid}")
    mem.set(ylabel="RSS (MiB)")
    fds.plot(xs, nan([r["gateway_fds"] for r in rows]), "-o", label="gateway")
    fds.plot(xs, nan([r["engine_fds"] for r in rows]), "-s", label="engines (sum)")
    fds.set(ylabel="open file descriptors")
    lat.plot(xs, nan([r["ttft_p50_s"] for r in rows]), "-o", label="TTFT p50")
    lat.plot(xs, nan([r["ttft_p99_s"] for r in rows]), "--s", label="TTFT p99")
    lat.set(ylabel="TTFT (s)", xlabel="minutes into the run")
    for ax in (mem, fds, lat):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    s, t = report["server"], report["traffic"]
    who = s["config"] or f"{s['target_model']}@{s['target']}"
    fig.suptitle(f"Soak: {t['workload']} at {t['rate']:g} req/s on {who}, {report['machine']['cpu_model']}\n"
                 f"no_growth {report['trend']['no_growth']}, errors {report['totals']['errors']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0],
                                epilog="30-minute SmolLM2 soak: python -m loadtest.soak --rate R (R: half the saturating rate, see --rate)")
    p.add_argument("--rate", type=float, required=True, help=RATE_HELP)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals (default 1800)")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between samples, one row each (default 60)")
    p.add_argument("--config", default="routed", help=f"platform configuration to start: {', '.join(CONFIGS)} (default routed)")
    p.add_argument("--target", help="drive this running OpenAI-compatible server (base URL) instead of starting --config")
    p.add_argument("--target-model", help="with --target: the model every request asks for")
    p.add_argument("--gateway-pid", type=int, help="with --target: sample this local process (and its children)")
    p.add_argument("--api-key", default=os.environ.get("SWIFTKV_BENCH_API_KEY", "none"), help="bearer key (with --target)")
    p.add_argument("--workload", default="mixed", help=f"{', '.join(WORKLOADS)} (default mixed: 70%% rag, 20%% chat, 10%% gen)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (texts, lengths, arrivals)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length target (0.1 for tiny models)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per model name before the run")
    p.add_argument("--base-model", default="models/smollm2-135m-instruct")
    p.add_argument("--swiftkv-model", default="models/smollm2-135m-instruct-swiftkv")
    p.add_argument("--tokenizer", help="tokenizer the prompts are counted with (default: --base-model's)")
    p.add_argument("--text", default="data/mix/heldout.jsonl", help="corpus the prompts are cut from")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="engine max_model_len (default: the embedded platform's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-mib", type=int, default=DEFAULT_KV_CACHE_BYTES >> 20, help="KV-cache budget per engine, MiB (default: the embedded platform's)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--rss-tolerance-mib", type=float, default=5.0, help="RSS slope tolerance, MiB per 10 min (default 5)")
    p.add_argument("--rss-tolerance-pct", type=float, default=0.5, help="... or this %% of the mean RSS per 10 min if larger (default 0.5)")
    p.add_argument("--fd-tolerance", type=float, default=2.0, help="fd slope tolerance per 10 min (default 2)")
    p.add_argument("--check", action="store_true", help="exit 1 when no_growth is not true")
    p.add_argument("--out", type=Path, default=Path("runs/soak/soak.json"), help="JSON report; the PNG goes next to it")
    a = p.parse_args(argv)
    if a.target and not a.target_model:
        p.error("--target-model is required with --target")
    cfg = PlatformBenchConfig(base_model=a.base_model, swiftkv_model=a.swiftkv_model, tokenizer=a.tokenizer, text=a.text,
                              workload=a.workload, seed=a.seed, scale=a.scale, configs=[a.config], max_model_len=a.max_model_len,
                              dtype=a.dtype, kv_cache_bytes=a.kv_cache_mib << 20, request_timeout_s=a.request_timeout,
                              target=a.target, target_model=a.target_model, api_key=a.api_key, progress=False)
    opts = SoakOptions(rate=a.rate, duration_s=a.duration, interval_s=a.interval, config=a.config, gateway_pid=a.gateway_pid,
                       warmup=a.warmup, rss_tolerance_mib=a.rss_tolerance_mib, rss_tolerance_pct=a.rss_tolerance_pct,
                       fd_tolerance=a.fd_tolerance)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        report = run(cfg, opts, log)
    except PlatformBenchError as e:
        p.exit(2, f"error: {e}\n")
    report["command"] = "python -m loadtest.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = str(plot(report, a.out.with_suffix(".png")))
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    log(f"wrote {a.out} and {report['plot']}")
    if report["interrupted"]:
        sys.exit(130)
    if a.check and report["trend"]["no_growth"] is not True:
        sys.exit(1)


if __name__ == "__main__":
    main()
