"""Cross-check of the platform load test's client (loadtest.platform_bench) against guidellm, the benchmark client
vLLM's docs recommend: both drive the same running server, one after the other, with the same traffic.

One platform configuration is started through `swiftkv serve` (loadtest.platform_bench.serve; or, with --target,
a server already running is used), warmed up with requests of the run's shape, then sent

  (a) our driver's fixed-length workload (loadtest.workloads.fixed): N requests, each exactly P prompt tokens
      of real corpus text (no instruction) and M output tokens (max_tokens with ignore_eos);
  (b) guidellm's synthetic_text data with prompt_tokens=P, output_tokens=M (it sends max_completion_tokens=M,
      ignore_eos and stop=None on /v1/chat/completions, streaming with usage), the same N and the same rate,
      constant or Poisson (guidellm's constant profile sends request i at (i + 1) / rate, as ours does).

Printed (and written with --out): one JSON with each tool's TTFT p50/p99, output tokens/s and requests/s (its
own figures; guidellm's recomputed from its per-request records the way we compute ours next to them), the
mean prompt and output tokens each tool's requests came to (the server's usage) and ours/guidellm ratios.

    python -m loadtest.crosscheck --config routed --rate 0.25 --count 40 --prompt-tokens 1000 --output-tokens 100

Run it from the repository root (`-m`: this package's platform.py would shadow the standard library's module
if run as a script path). guidellm comes from its own venv, .tools/guidellm (`make setup`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from loadtest.platform_bench import (
    CONFIGS,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    PUBLIC,
    ROOT,
    PlatformBenchConfig,
    PlatformBenchError,
    drive,
    engine_args,
    existing,
    figures,
    machine,
    pct,
    r4,
    serve,
    warm_up,
)
from loadtest.workloads import ARRIVALS, WorkloadError, fixed

GUIDELLM = ROOT / ".tools" / "guidellm" / "bin" / "guidellm"
COMPARED = ("ttft_p50_s", "ttft_p99_s", "output_tok_s", "requests_per_s")


def guidellm_command(guidellm: Path, base: str, model: str, api_key: str, tokenizer: str, profile: str, rate: float,
                     count: int, prompt_tokens: int, output_tokens: int, seed: int, report: Path) -> list[str]:
    return [str(guidellm), "run",
            "--backend", f"kind=openai_http,target={base},model={model},api_key={api_key},request_format=/v1/chat/completions",
            "--profile", f"kind={profile},rate={rate}", "--constraint", f"kind=max_requests,count={count}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={Path(tokenizer).resolve()}", "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={report}", "--disable-console"]


def run_guidellm(cmd: list[str], cwd: Path, timeout: float) -> dict:
    """guidellm's JSON report. Offline (the tokenizer is a local folder), one worker process rather than its
    default of ten (they would take the cores from the engines), nothing of this venv on its Python path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    report = Path(cmd[cmd.index("--output") + 1].split("path=", 1)[1])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0 or not report.exists():
        raise PlatformBenchError(f"guidellm failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(report.read_text())


def guidellm_figures(report: dict) -> dict:
    """guidellm's own figures (its TTFT percentiles, the lowest record whose cumulative share reaches the percentile,
    where ours interpolate between records; its rates, a time-weighted mean over the measured window, which is
    total / window), and the same recomputed from its per-request records our way (pct, totals / span), with the
    records' TTFTs themselves."""
    (b,) = report["benchmarks"]
    m = b["metrics"]
    ok = b["requests"]["successful"]
    ttft = m["time_to_first_token_ms"]["successful"]
    ttfts = [r["time_to_first_token_ms"] / 1000 for r in ok if r.get("time_to_first_token_ms") is not None]
    span = b["duration"]
    mean = lambda key: r4(statistics.fmean(r[key] or 0 for r in ok)) if ok else None  # noqa: E731
    return {
        "requests": m["request_totals"]["total"], "completed": m["request_totals"]["successful"],
        "errors": m["request_totals"]["errored"] + m["request_totals"]["incomplete"], "span_s": round(span, 3),
        "ttft_p50_s": r4(ttft["median"] / 1000), "ttft_p99_s": r4(ttft["percentiles"]["p99"] / 1000),
        "output_tok_s": round(m["output_tokens_per_second"]["successful"]["mean"], 1),
        "requests_per_s": r4(m["requests_per_second"]["successful"]["mean"]),
        "tpot_p50_s": r4(m["time_per_output_token_ms"]["successful"]["median"] / 1000),
        "prompt_tokens_mean": mean("prompt_tokens"), "output_tokens_mean": mean("output_tokens"),
        "recomputed": {"ttft_p50_s": r4(pct(ttfts, 50)), "ttft_p99_s": r4(pct(ttfts, 99)),
                       "output_tok_s": round(sum(r["output_tokens"] or 0 for r in ok) / span, 1),
                       "requests_per_s": r4(len(ok) / span), "ttft_s": sorted(r4(t) for t in ttfts)},
    }


def ours_figures(records, span: float, rate: float, cfg: PlatformBenchConfig) -> dict:
    f = figures(records, span, rate, cfg)
    ok = [r for r in records if r.error is None]
    keep = ("requests", "completed", "errors", "error_samples", "span_s", "ttft_p50_s", "ttft_p99_s", "output_tok_s",
            "requests_per_s", "tpot_p50_s", "pool_share")
    return {k: f[k] for k in keep} | {
        "prompt_tokens_mean": r4(statistics.fmean(r.prompt_tokens for r in ok)) if ok else None,
        "output_tokens_mean": r4(statistics.fmean(r.output_tokens for r in ok)) if ok else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run(cfg: PlatformBenchConfig, config: str, model: str, profile: str, rate: float, count: int, prompt_tokens: int,
        output_tokens: int, warmup: int = 4, guidellm: Path = GUIDELLM, log: Callable[[str], None] = print) -> dict:
    if profile not in ARRIVALS:
        raise PlatformBenchError(f"--profile: unknown {profile!r}; choose one of {', '.join(ARRIVALS)}")
    if rate <= 0 or count < 1 or prompt_tokens < 1 or output_tokens < 1 or warmup < 0:
        raise PlatformBenchError("--rate, --count, --prompt-tokens and --output-tokens must be positive, --warmup not negative")
    if cfg.target is None and config not in CONFIGS:
        raise PlatformBenchError(f"--config: unknown {config!r}; choose from {', '.join(CONFIGS)}")
    if not guidellm.exists():
        raise PlatformBenchError(f"guidellm is not installed at {guidellm}: run `make setup` (builds .tools/guidellm)")
    cfg.check()
    from transformers import AutoTokenizer

    tokenizer_path = cfg.tokenizer or cfg.base_model
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    try:
        requests = fixed(cfg.text, tokenizer, rate, count, prompt_tokens, output_tokens, cfg.seed, profile)
        # warm-up texts of their own: a prompt already in the prefix cache would flatter our run
        warm = fixed(cfg.text, tokenizer, rate, max(warmup, 1), prompt_tokens, output_tokens, cfg.seed + 1000, profile)[:warmup]
    except WorkloadError as e:
        raise PlatformBenchError(str(e)) from e
    report = {"server": {"config": None if cfg.target else config, "target": cfg.target, "model": model,
                         "engine_args": None if cfg.target else engine_args(cfg)},
              "traffic": {"profile": profile, "rate": rate, "count": count, "prompt_tokens": prompt_tokens,
                          "output_tokens": output_tokens, "endpoint": "/v1/chat/completions", "warmup_requests": warmup},
              "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="swiftkv-crosscheck-") as tmp:
        server = existing(cfg.target, model, cfg.api_key, 30) if cfg.target else serve(config, cfg, Path(tmp), log)
        with server as base:
            if warm:
                asyncio.run(warm_up(base, [model], warm, len(warm), cfg.request_timeout_s, cfg.api_key))
            log(f"ours: {count} requests, {profile} {rate:g} req/s, {prompt_tokens} prompt / {output_tokens} output tokens")
            records, span = asyncio.run(drive(base, [model], requests, cfg.request_timeout_s, lambda rec: None, cfg.api_key))
            ours = ours_figures(records, span, rate, cfg)
            log(f"ours: {json.dumps({k: ours[k] for k in COMPARED})}")
            cmd = guidellm_command(guidellm, base, model, cfg.api_key, tokenizer_path, profile, rate, count, prompt_tokens,
                                   output_tokens, cfg.seed, Path(tmp) / "guidellm.json")
            log("guidellm: " + " ".join(cmd[1:]))
            theirs = guidellm_figures(run_guidellm(cmd, Path(tmp), cfg.request_timeout_s + count / rate))
            log(f"guidellm: {json.dumps({k: theirs[k] for k in COMPARED})}")
            if theirs["requests"] != count:
                log(f"guidellm recorded {theirs['requests']} of its {count} requests: the two sides differ in count")
    report["ours"], report["guidellm"] = ours, theirs
    report["ratios_ours_over_guidellm"] = {k: ratio(ours[k], theirs[k]) for k in COMPARED}
    report["within_10_percent"] = all(r is not None and abs(r - 1) <= 0.10 for r in report["ratios_ours_over_guidellm"].values())
    report["load_average_after"] = list(os.getloadavg())
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.crosscheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="routed", help=f"platform configuration to start: {', '.join(CONFIGS)}")
    p.add_argument("--model", help=f"model the requests ask for (default: {PUBLIC}, the routed name; or --target-model)")
    p.add_argument("--target", help="use this running server (base URL) instead of starting --config")
    p.add_argument("--target-model", help="with --target: the model the requests ask for")
    p.add_argument("--api-key", default=os.environ.get("SWIFTKV_BENCH_API_KEY", "none"), help="bearer key (with --target)")
    p.add_argument("--profile", default="constant", help="arrivals: constant or poisson")
    p.add_argument("--rate", type=float, default=0.25, help="requests/s")
    p.add_argument("--count", type=int, default=40, help="requests per tool")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests before the two runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-model", default="models/smollm2-135m-instruct")
    p.add_argument("--swiftkv-model", default="models/smollm2-135m-instruct-swiftkv")
    p.add_argument("--tokenizer", help="default: --base-model's (guidellm counts its synthetic prompts with it too)")
    p.add_argument("--text", default="data/mix/heldout.jsonl", help="corpus our prompts are cut from")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="engine max_model_len (default: the embedded platform's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-mib", type=int, default=DEFAULT_KV_CACHE_BYTES >> 20, help="KV-cache budget per engine, MiB (default: the embedded platform's)")
    p.add_argument("--guidellm", type=Path, default=GUIDELLM)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.target and not a.target_model:
        p.error("--target-model is required with --target")
    cfg = PlatformBenchConfig(base_model=a.base_model, swiftkv_model=a.swiftkv_model, tokenizer=a.tokenizer, text=a.text,
                              seed=a.seed, configs=[a.config], max_model_len=a.max_model_len, dtype=a.dtype,
                              kv_cache_bytes=a.kv_cache_mib << 20, target=a.target, target_model=a.target_model,
                              api_key=a.api_key, progress=False)
    try:
        report = run(cfg, a.config, a.target_model or a.model or PUBLIC, a.profile, a.rate, a.count, a.prompt_tokens,
                     a.output_tokens, a.warmup, a.guidellm, log=lambda m: print(m, file=sys.stderr, flush=True))
    except PlatformBenchError as e:
        p.exit(2, f"error: {e}\n")
    report["command"] = "python -m loadtest.crosscheck " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(report, indent=2)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
