"""`swiftkv bench engine`: a SwiftKV engine against its base model, side by side in one run.

Both vLLM engines are started in this process tree with the same settings and the same KV-cache
memory budget, then measured in alternating rounds (base, SwiftKV, SwiftKV, base, ...) so that drift in
machine load hits both alike; each figure is the best of its rounds (load only ever adds time), and
every raw measurement is kept in the report. Ratios are what this measures; absolute numbers depend on
the machine and on what else runs on it.

- prefill_speedup   prompt tokens/s with max_tokens=1 (prompt-only), SwiftKV / base
- combined_speedup  (prompt + output) tokens/s on a 10:1 workload (e.g. 2000 prompt / 200 output)
- ttft_ratio        time to first token of one request at a time (low load), SwiftKV / base
- kv_capacity_ratio KV-cache tokens the engines report for the same memory budget, SwiftKV / base;
                    the budget is rounded so the exact L / (l + (L - l) / g) is representable
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated

import typer


@dataclass
class EngineBenchConfig:
    model: str
    baseline: str
    prompt_tokens: int = 2000
    output_tokens: int = 200
    prefill_requests: int = 8
    combined_requests: int = 8
    ttft_requests: int = 3
    rounds: int = 2
    dtype: str = "auto"  # resolved for the machine (swiftkv_core.hardware) before the engines start
    kv_cache_dtype: str = "auto"
    kv_cache_gib: float = 1.0
    block_size: int = 128
    max_num_batched_tokens: int = 4096
    enforce_eager: bool = True
    seed: int = 0
    engine_args: dict = field(default_factory=dict)


class BenchError(RuntimeError):
    pass


def _kv_layout(path: str) -> tuple[int, int, int]:
    """(L, distinct KV caches, bytes per token per cache at 1 byte per element) from a checkpoint."""
    from transformers import AutoConfig

    from ..config import LlamaSwiftKVConfig

    config = AutoConfig.from_pretrained(path)
    L = config.num_hidden_layers
    caches = config.num_kv_caches if isinstance(config, LlamaSwiftKVConfig) else L
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return L, caches, 2 * config.num_key_value_heads * head_dim


def _kv_budget_bytes(cfg: EngineBenchConfig, caches: list[int], per_token: int) -> int:
    """The budget rounded down so every engine's block count is an exact share of it."""
    element = 1 if cfg.kv_cache_dtype.startswith("fp8") else {"float32": 4}.get(cfg.dtype, 2)
    unit = cfg.block_size * per_token * element * math.lcm(*caches)
    budget = int(cfg.kv_cache_gib * (1 << 30)) // unit * unit
    if budget == 0:
        raise BenchError(f"--kv-cache-gib {cfg.kv_cache_gib} is below one block per layer ({unit} bytes)")
    return budget


def _machine() -> dict:
    import torch
    import vllm

    from ..hardware import cpu_info

    return {
        **cpu_info().as_dict(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "vllm": vllm.__version__,
        "torch": torch.__version__,
    }


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """Random token prompts, distinct across calls (no prefix-cache hits across rounds)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(10, vocab - 10, (length,), generator=g).tolist()} for _ in range(n)]


class _Engine:
    def __init__(self, name: str, path: str, cfg: EngineBenchConfig, kv_bytes: int):
        from vllm import LLM

        from ..interrupts import shield_children

        self.name, self.path = name, path
        start = time.perf_counter()
        with shield_children():  # a Ctrl-C stops the benchmark, which then stops its engines
            self.llm = LLM(
                model=path,
                dtype=cfg.dtype,
                kv_cache_dtype=cfg.kv_cache_dtype,
                kv_cache_memory_bytes=kv_bytes,
                block_size=cfg.block_size,
                max_model_len=cfg.prompt_tokens + cfg.output_tokens + 16,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_prefix_caching=False,  # every prompt must really be prefilled
                enforce_eager=cfg.enforce_eager,
                seed=cfg.seed,
                **cfg.engine_args,
            )
        self.startup_s = time.perf_counter() - start
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_tokens = cache.num_gpu_blocks * cache.block_size
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()

    def run(self, prompts: list[dict], max_tokens: int) -> float:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
            raise BenchError(f"{self.name}: an engine returned fewer than {max_tokens} tokens")
        return elapsed

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def run_engine_bench(cfg: EngineBenchConfig, log=print) -> dict:
    from ..hardware import UnsupportedSetting, engine_args_for_machine, vllm_on_cpu

    try:
        machine_args = engine_args_for_machine({"dtype": cfg.dtype, "kv_cache_dtype": cfg.kv_cache_dtype}, vllm_on_cpu(), "bench")
    except UnsupportedSetting as e:
        raise BenchError(str(e)) from None
    cfg = replace(cfg, dtype=machine_args["dtype"])
    L_base, caches_base, per_token = _kv_layout(cfg.baseline)
    L_swift, caches_swift, per_token_swift = _kv_layout(cfg.model)
    if (L_base, per_token) != (L_swift, per_token_swift):
        raise BenchError(f"{cfg.model} and {cfg.baseline} differ in layers or KV shape: not a SwiftKV model of that base")
    kv_bytes = _kv_budget_bytes(cfg, [caches_base, caches_swift], per_token)
    machine = _machine()
    log(f"machine: {machine['cpu_model']} [{' '.join(machine['cpu_flags'])}], {machine['cpus']} CPUs, "
        f"load {machine['load_average_1m']:.2f}; dtype {cfg.dtype}")

    engines: list[_Engine] = []
    try:
        for name, path in (("base", cfg.baseline), ("swiftkv", cfg.model)):
            log(f"starting {name} engine: {path}")
            engines.append(_Engine(name, path, cfg, kv_bytes))
        base, swift = engines
        P, O = cfg.prompt_tokens, cfg.output_tokens
        for engine in engines:  # warm-up: first-call allocations, thread pools
            engine.run(_prompts(2, P, engine.vocab, seed=10_000), 2)

        raw: dict[str, dict[str, list[float]]] = {e.name: {"prefill_s": [], "combined_s": [], "ttft_s": []} for e in engines}
        seed = cfg.seed
        for r in range(cfg.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for engine in order:
                seed += 1
                prompts = _prompts(cfg.prefill_requests, P, engine.vocab, seed)
                raw[engine.name]["prefill_s"].append(engine.run(prompts, 1))
                prompts = _prompts(cfg.combined_requests, P, engine.vocab, seed + 5000)
                raw[engine.name]["combined_s"].append(engine.run(prompts, O))
                for prompt in _prompts(cfg.ttft_requests, P, engine.vocab, seed + 9000):
                    raw[engine.name]["ttft_s"].append(engine.run([prompt], 1))
                log(
                    f"round {r + 1}/{cfg.rounds} {engine.name}: prefill {raw[engine.name]['prefill_s'][-1]:.2f}s, "
                    f"combined {raw[engine.name]['combined_s'][-1]:.2f}s, ttft {raw[engine.name]['ttft_s'][-1]:.3f}s"
                )

        def figures(e: _Engine) -> dict:
            m = raw[e.name]
            return {
                "prefill_tokens_per_s": cfg.prefill_requests * P / min(m["prefill_s"]),
                "combined_tokens_per_s": cfg.combined_requests * (P + O) / min(m["combined_s"]),
                "ttft_s": min(m["ttft_s"]),
                "ttft_median_s": statistics.median(m["ttft_s"]),
                "kv_cache_tokens": e.kv_tokens,
                "startup_s": e.startup_s,
                "raw": m,
            }

        b, s = figures(base), figures(swift)
        return {
            "prefill_speedup": s["prefill_tokens_per_s"] / b["prefill_tokens_per_s"],
            "combined_speedup": s["combined_tokens_per_s"] / b["combined_tokens_per_s"],
            "ttft_ratio": s["ttft_s"] / b["ttft_s"],
            "kv_capacity_ratio": s["kv_cache_tokens"] / b["kv_cache_tokens"],
            "expected_kv_capacity_ratio": caches_base / caches_swift,
            "base": b,
            "swiftkv": s,
            "workload": {
                "prompt_tokens": P,
                "output_tokens": O,
                "prefill_requests": cfg.prefill_requests,
                "combined_requests": cfg.combined_requests,
                "ttft_requests_per_round": cfg.ttft_requests,
                "rounds": cfg.rounds,
            },
            "engine": {
                "dtype": cfg.dtype,
                "kv_cache_dtype": cfg.kv_cache_dtype,
                "kv_cache_memory_bytes": kv_bytes,
                "block_size": cfg.block_size,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "enforce_eager": cfg.enforce_eager,
                "layers": L_base,
                "kv_caches": {"base": caches_base, "swiftkv": caches_swift},
            },
            "config": {k: v for k, v in asdict(cfg).items() if k in ("model", "baseline")},
            "machine": {**machine, "load_average_1m_end": os.getloadavg()[0]},
        }
    finally:
        for engine in engines:
            engine.close()


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks measured side by side in one run.")


@bench_app.command("engine")
def bench_engine_command(
    model: Annotated[str, typer.Option(help="SwiftKV checkpoint folder")],
    baseline: Annotated[str, typer.Option(help="Its base Llama checkpoint folder")],
    prompt_tokens: Annotated[int, typer.Option(help="Tokens per prompt")] = 2000,
    output_tokens: Annotated[int, typer.Option(help="Output tokens per request in the combined workload")] = 200,
    prefill_requests: Annotated[int, typer.Option(help="Requests in the prompt-only batch")] = 8,
    combined_requests: Annotated[int, typer.Option(help="Requests in the combined batch")] = 8,
    ttft_requests: Annotated[int, typer.Option(help="Single requests timed per round for TTFT")] = 3,
    rounds: Annotated[int, typer.Option(help="Alternating measurement rounds per engine")] = 2,
    dtype: Annotated[str, typer.Option(help="Engine dtype; auto: bfloat16 only on CPUs with native bf16, else float32")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto | fp8 | ...")] = "auto",
    kv_cache_gib: Annotated[float, typer.Option(help="KV-cache memory budget per engine (GiB)")] = 1.0,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Tokens per engine step")] = 4096,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="torch.compile both engines (slow start-up)")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
) -> None:
    """Prefill, combined and TTFT speed-ups and KV capacity of a SwiftKV model against its base."""
    import json as jsonlib

    for path in (model, baseline):
        if not Path(path).is_dir():
            typer.secho(f"error: {path} is not a checkpoint folder", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
    cfg = EngineBenchConfig(
        model=model,
        baseline=baseline,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        prefill_requests=prefill_requests,
        combined_requests=combined_requests,
        ttft_requests=ttft_requests,
        rounds=rounds,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_gib=kv_cache_gib,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=not compile,
    )
    if json:  # stdout carries only the report; vLLM (and its engine processes) log to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    log = (lambda m: typer.echo(m, err=True)) if json else typer.echo
    try:
        report = run_engine_bench(cfg, log=log)
    except BenchError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    if json:
        typer.echo(jsonlib.dumps(report, indent=2))
        return
    for key in ("prefill_speedup", "combined_speedup", "ttft_ratio", "kv_capacity_ratio", "expected_kv_capacity_ratio"):
        typer.echo(f"{key:28s} {report[key]:.3f}")
    for name in ("base", "swiftkv"):
        f = report[name]
        typer.echo(
            f"{name:8s} prefill {f['prefill_tokens_per_s']:.0f} tok/s, combined {f['combined_tokens_per_s']:.0f} tok/s, "
            f"ttft {f['ttft_s']:.3f} s, kv {f['kv_cache_tokens']} tokens"
        )
