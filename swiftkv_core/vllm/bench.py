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

With `--dual-mode` a third engine runs the SwiftKV checkpoint as a dual-mode engine (swiftkv_core/dual_mode.py) and is
measured in the same alternating rounds twice, its requests as the SwiftKV model and as the base model: what serving
both models from one engine costs each of them (`dual_swiftkv_ratio` against the SwiftKV engine, `dual_base_ratio`
against the base engine; prefill and combined tokens/s, TTFT).

With `--speculative` (e.g. `none,ngram`) a second phase measures speculative decoding without a draft model
(vLLM's `speculative_config`: ngram prompt lookup, or suffix decoding) on both models: per model, one engine per
method, measured in alternating rounds like the first phase, at batch 1 and at `--spec-batch`, on two prompt
kinds (swiftkv_core.bench_prompts): `quote`, a document and a question whose answer quotes it (much to copy), and
`chat`, an open question (little to copy). Each row: decode TPOT (per request, first to last output token, from
vLLM's request stats), output tokens/s, and what the proposer drafted and the model accepted (vLLM's
`vllm:spec_decode_*` counters of that engine): acceptance rate and mean accepted length (1 + accepted / drafts,
vLLM's convention). A combination the engine refuses (a SwiftKV model speculating on a GPU) is a row with the
refusal, not the end of the run.
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
    # speculative decoding phase: methods measured (none = without), their settings, the larger batch
    speculative: list[str] = field(default_factory=list)
    spec_tokens: int = 4
    spec_lookup_min: int = 2
    spec_lookup_max: int = 4
    spec_batch: int = 8
    text: str | None = None  # quote documents cut from this text (load_records) instead of generated catalogues
    speculation_only: bool = False  # skip the prefill / combined / TTFT phase
    dual_mode: bool = False  # also the SwiftKV checkpoint as a dual-mode engine, measured in each of its two modes


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------
# Speculative decoding: options, vLLM's counters, rows

SPEC_METHODS = ("none", "ngram", "suffix")
# vLLM's counters (vllm/v1/spec_decode/metrics.py), as `llm.get_metrics()` names them
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def parse_speculative(values: list[str]) -> list[str]:
    """`--speculative` values, each one method or a comma-separated list -> the methods in order, once each."""
    methods: list[str] = []
    for value in values:
        for method in (m.strip().lower() for m in value.split(",")):
            if not method:
                continue
            if method not in SPEC_METHODS:
                raise BenchError(f"--speculative: unknown method {method!r}; choose from {', '.join(SPEC_METHODS)}")
            if method not in methods:
                methods.append(method)
    if values and not methods:
        raise BenchError(f"--speculative: no method given; choose from {', '.join(SPEC_METHODS)}")
    return methods


def speculative_config(method: str, tokens: int, lookup_min: int, lookup_max: int) -> dict | None:
    """vLLM's `speculative_config` for `method` (None: none): `tokens` proposed per step at most; the prompt-lookup
    n-gram sizes apply to ngram only (suffix decoding sizes its drafts itself, up to `tokens`)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": tokens, "prompt_lookup_min": lookup_min,
                "prompt_lookup_max": lookup_max}
    return {"method": method, "num_speculative_tokens": tokens}


def check_speculation(cfg: EngineBenchConfig) -> None:
    """Refuse speculation settings no engine could start with, before any engine starts."""
    import importlib.util

    if not cfg.speculative:
        if cfg.speculation_only:
            raise BenchError("--speculation-only measures the --speculative methods: name them, e.g. --speculative none,ngram")
        return
    bad = [m for m in cfg.speculative if m not in SPEC_METHODS]
    if bad:
        raise BenchError(f"--speculative: unknown method {bad[0]!r}; choose from {', '.join(SPEC_METHODS)}")
    if cfg.spec_tokens < 1:
        raise BenchError(f"--spec-tokens must be at least 1, got {cfg.spec_tokens}")
    if cfg.spec_batch < 1:
        raise BenchError(f"--spec-batch must be at least 1, got {cfg.spec_batch}")
    if cfg.rounds < 1:
        raise BenchError(f"--rounds must be at least 1, got {cfg.rounds}")
    if "ngram" in cfg.speculative and not 1 <= cfg.spec_lookup_min <= cfg.spec_lookup_max:
        raise BenchError(f"--spec-lookup-min ({cfg.spec_lookup_min}) and --spec-lookup-max ({cfg.spec_lookup_max}): "
                         "need 1 <= min <= max (the n-gram sizes looked up in the prompt)")
    if "suffix" in cfg.speculative and importlib.util.find_spec("arctic_inference") is None:
        raise BenchError("--speculative suffix runs Arctic Inference's suffix decoding, and the arctic_inference package "
                         "is not installed here (`pip install arctic-inference`); or measure ngram")
    if cfg.text is not None and not Path(cfg.text).exists():
        raise BenchError(f"--text: {cfg.text} does not exist")


def spec_counts(metrics) -> dict[str, int]:
    """Drafts, draft tokens and accepted tokens from vLLM's metrics (the Counter objects `llm.get_metrics()`
    returns, or `_EngineMetrics.snapshot()`), summed over engines; 0 for a counter absent (no speculation)."""
    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for m in metrics:
        key = SPEC_COUNTERS.get(m.name)
        if key is not None and hasattr(m, "value"):
            counts[key] += int(m.value)
    return counts


def acceptance(counts: dict[str, int]) -> dict:
    """vLLM's figures: acceptance rate = accepted / drafted tokens; mean accepted length = 1 + accepted / drafts
    (the token the model adds to every verified draft counts). None where nothing was drafted."""
    drafts, tokens, accepted = counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"]
    return {"acceptance_rate": round(accepted / tokens, 4) if tokens else None,
            "mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else None}


def spec_row(model: str, method: str, kind: str, batch: int, output_tokens: int, rounds: list[dict]) -> dict:
    """One row of the speculation phase from its rounds, each {"elapsed_s": the batch's wall time, "tpot_s": each
    request's decode TPOT, "counts": the engine's counters over the batch (spec_counts after - before)}. Timings:
    the best round (load only ever adds time); counts: summed over the rounds."""
    totals = {k: sum(r["counts"][k] for r in rounds) for k in SPEC_COUNTERS.values()}
    tpots = [statistics.fmean(r["tpot_s"]) for r in rounds if r["tpot_s"]]
    return {"model": model, "speculative": method, "prompts": kind, "batch": batch, "refused": None,
            "tpot_s": round(min(tpots), 6) if tpots else None,
            "output_tokens_per_s": round(batch * output_tokens / min(r["elapsed_s"] for r in rounds), 2),
            **totals, **acceptance(totals),
            "raw": {"elapsed_s": [round(r["elapsed_s"], 6) for r in rounds], "tpot_s": [round(t, 6) for t in tpots]}}


def refused_row(model: str, method: str, kind: str, batch: int, reason: str) -> dict:
    return {"model": model, "speculative": method, "prompts": kind, "batch": batch, "refused": reason, "tpot_s": None,
            "output_tokens_per_s": None, **dict.fromkeys(SPEC_COUNTERS.values(), 0), "acceptance_rate": None,
            "mean_accepted_length": None, "raw": None}


def against_none(rows: list[dict]) -> list[dict]:
    """Each row with its speed-ups over the row without speculation of the same model, prompts and batch:
    tpot_speedup = TPOT without / TPOT with, throughput_speedup = output tokens/s with / without (None where either
    is missing)."""
    plain = {(r["model"], r["prompts"], r["batch"]): r for r in rows if r["speculative"] == "none" and not r["refused"]}
    out = []
    for r in rows:
        p = plain.get((r["model"], r["prompts"], r["batch"]))
        ok = p is not None and not r["refused"]
        out.append({**r, "tpot_speedup": round(p["tpot_s"] / r["tpot_s"], 4) if ok and p["tpot_s"] and r["tpot_s"] else None,
                    "throughput_speedup": round(r["output_tokens_per_s"] / p["output_tokens_per_s"], 4) if ok else None})
    return out


def decode_tpots(outputs) -> list[float]:
    """Per request, seconds per output token after the first (vLLM's request stats: engine-core timestamps of its
    first and last tokens); requests without stats or with one token are left out."""
    tpots = []
    for o in outputs:
        stats, n = getattr(o, "metrics", None), len(o.outputs[0].token_ids)
        if stats is not None and n > 1 and getattr(stats, "last_token_ts", 0) > getattr(stats, "first_token_ts", 0) > 0:
            tpots.append((stats.last_token_ts - stats.first_token_ts) / (n - 1))
    return tpots


class _EngineMetrics:
    """One engine's `vllm:` collectors. vLLM registers them in the global registry and removes any earlier engine's
    when the next starts in the same process (so `llm.get_metrics()` reads the newest engine's only): taken from the
    global registry right after the engine starts, they stay this engine's."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        for collector in list(REGISTRY._collector_to_names):
            if getattr(collector, "_name", "").startswith("vllm:"):
                REGISTRY.unregister(collector)
                self.registry.register(collector)

    def snapshot(self) -> list:
        """Its counters as `llm.get_metrics()` gives them (vLLM's reader Counter: name without `_total`)."""
        from vllm.v1.metrics.reader import Counter

        return [Counter(name=family.name, labels=s.labels, value=int(s.value))
                for family in self.registry.collect() if family.type == "counter"
                for s in family.samples if s.name == family.name + "_total"]


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
    def __init__(self, name: str, path: str, cfg: EngineBenchConfig, kv_bytes: int, speculative: dict | None = None,
                 stats: bool = False, gpu_share: float | None = None, dual_mode: bool = False):
        """`stats`: keep vLLM's metrics and request stats (speculation counters, token timestamps); `gpu_share`: on
        a GPU, the fraction of its memory this engine may count on at start, where several engines share it."""
        from vllm import LLM

        from ..interrupts import shield_children

        self.name, self.path = name, path
        extra = dict(cfg.engine_args)
        if dual_mode:
            from ..dual_mode import with_dual_mode

            extra = with_dual_mode(extra)
        if speculative is not None:
            extra["speculative_config"] = speculative
        if stats:
            extra["disable_log_stats"] = False
        if gpu_share is not None:
            # vLLM refuses to start where less than gpu_memory_utilization of the GPU is free, which the engines
            # started before this one hold; the KV cache is sized by kv_cache_memory_bytes either way
            extra.setdefault("gpu_memory_utilization", gpu_share)
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
                **extra,
            )
        self.metrics = _EngineMetrics() if stats else None
        self.startup_s = time.perf_counter() - start
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_tokens = cache.num_gpu_blocks * cache.block_size
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()

    def generate(self, prompts: list[dict], max_tokens: int, mode: str | None = None) -> tuple[float, list]:
        """(wall seconds, vLLM's RequestOutputs) of one batch, every request generating exactly `max_tokens`; `mode`: the
        model a dual-mode engine runs them as."""
        from vllm import SamplingParams

        from ..dual_mode import extra_args, with_cache_salt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args(mode))
        prompts = [with_cache_salt(p, mode) for p in prompts]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
            raise BenchError(f"{self.name}: an engine returned fewer than {max_tokens} tokens")
        return elapsed, outputs

    def run(self, prompts: list[dict], max_tokens: int, mode: str | None = None) -> float:
        return self.generate(prompts, max_tokens, mode)[0]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _gpu_share(on_cpu: bool, engines: int) -> float | None:
    return None if on_cpu else round(0.9 / engines, 3)


def run_engine_bench(cfg: EngineBenchConfig, log=print) -> dict:
    from ..hardware import UnsupportedSetting, engine_args_for_machine, vllm_on_cpu

    check_speculation(cfg)
    on_cpu = vllm_on_cpu()
    try:
        machine_args = engine_args_for_machine({"dtype": cfg.dtype, "kv_cache_dtype": cfg.kv_cache_dtype}, on_cpu, "bench")
    except UnsupportedSetting as e:
        raise BenchError(str(e)) from None
    cfg = replace(cfg, dtype=machine_args["dtype"])
    L_base, caches_base, per_token = _kv_layout(cfg.baseline)
    L_swift, caches_swift, per_token_swift = _kv_layout(cfg.model)
    if (L_base, per_token) != (L_swift, per_token_swift):
        raise BenchError(f"{cfg.model} and {cfg.baseline} differ in layers or KV shape: not a SwiftKV model of that base")
    if cfg.dual_mode and caches_swift != L_swift:
        raise BenchError(f"--dual-mode: {cfg.model} shares KV caches between later layers (AcrossKV), which a dual-mode engine "
                         "cannot (the base model's layers each need their own); use a checkpoint with key_value_group_size 1")
    kv_bytes = _kv_budget_bytes(cfg, [caches_base, caches_swift], per_token)
    machine = _machine()
    log(f"machine: {machine['cpu_model']} [{' '.join(machine['cpu_flags'])}], {machine['cpus']} CPUs, "
        f"load {machine['load_average_1m']:.2f}; dtype {cfg.dtype}")
    engine = {
        "dtype": cfg.dtype,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "kv_cache_memory_bytes": kv_bytes,
        "block_size": cfg.block_size,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enforce_eager": cfg.enforce_eager,
        "layers": L_base,
        "kv_caches": {"base": caches_base, "swiftkv": caches_swift},
    }
    report: dict = {}
    if not cfg.speculation_only:
        report |= _side_by_side(cfg, kv_bytes, on_cpu, log) | {"expected_kv_capacity_ratio": caches_base / caches_swift}
    report["engine"] = engine
    if cfg.speculative:
        report["speculation"] = _speculation(cfg, kv_bytes, on_cpu, log)
    report["config"] = {k: v for k, v in asdict(cfg).items() if k in ("model", "baseline")}
    report["machine"] = {**machine, "load_average_1m_end": os.getloadavg()[0]}
    return report


def _side_by_side(cfg: EngineBenchConfig, kv_bytes: int, on_cpu: bool, log) -> dict:
    """The prefill, combined and TTFT figures of both engines, measured in alternating rounds."""
    engines: list[_Engine] = []
    try:
        kinds = [("base", cfg.baseline, False), ("swiftkv", cfg.model, False)] + ([("dual", cfg.model, True)] if cfg.dual_mode else [])
        for name, path, dual in kinds:
            log(f"starting {name} engine: {path}")
            engines.append(_Engine(name, path, cfg, kv_bytes, gpu_share=_gpu_share(on_cpu, len(kinds)), dual_mode=dual))
        base, swift = engines[:2]
        # what is measured: (name, engine, mode); the dual-mode engine once per mode
        targets = [("base", base, None), ("swiftkv", swift, None)]
        if cfg.dual_mode:
            targets += [("dual_swiftkv", engines[2], "swiftkv"), ("dual_base", engines[2], "base")]
        P, O = cfg.prompt_tokens, cfg.output_tokens
        for engine in engines:  # warm-up: first-call allocations, thread pools
            engine.run(_prompts(2, P, engine.vocab, seed=10_000), 2)

        raw: dict[str, dict[str, list[float]]] = {t[0]: {"prefill_s": [], "combined_s": [], "ttft_s": []} for t in targets}
        seed = cfg.seed
        for r in range(cfg.rounds):
            order = targets if r % 2 == 0 else targets[::-1]
            for name, engine, mode in order:
                seed += 1
                prompts = _prompts(cfg.prefill_requests, P, engine.vocab, seed)
                raw[name]["prefill_s"].append(engine.run(prompts, 1, mode))
                prompts = _prompts(cfg.combined_requests, P, engine.vocab, seed + 5000)
                raw[name]["combined_s"].append(engine.run(prompts, O, mode))
                for prompt in _prompts(cfg.ttft_requests, P, engine.vocab, seed + 9000):
                    raw[name]["ttft_s"].append(engine.run([prompt], 1, mode))
                log(
                    f"round {r + 1}/{cfg.rounds} {name}: prefill {raw[name]['prefill_s'][-1]:.2f}s, "
                    f"combined {raw[name]['combined_s'][-1]:.2f}s, ttft {raw[name]['ttft_s'][-1]:.3f}s"
                )

        def figures(name: str, e: _Engine) -> dict:
            m = raw[name]
            return {
                "prefill_tokens_per_s": cfg.prefill_requests * P / min(m["prefill_s"]),
                "combined_tokens_per_s": cfg.combined_requests * (P + O) / min(m["combined_s"]),
                "ttft_s": min(m["ttft_s"]),
                "ttft_median_s": statistics.median(m["ttft_s"]),
                "kv_cache_tokens": e.kv_tokens,
                "startup_s": e.startup_s,
                "raw": m,
            }

        b, s = figures("base", base), figures("swiftkv", swift)
        dual = {}
        if cfg.dual_mode:
            for name, against in (("dual_swiftkv", s), ("dual_base", b)):
                f = dual[name] = figures(name, engines[2])
                dual[f"{name}_ratio"] = {"prefill": f["prefill_tokens_per_s"] / against["prefill_tokens_per_s"],
                                         "combined": f["combined_tokens_per_s"] / against["combined_tokens_per_s"],
                                         "ttft": f["ttft_s"] / against["ttft_s"]}
        return dual | {
            "prefill_speedup": s["prefill_tokens_per_s"] / b["prefill_tokens_per_s"],
            "combined_speedup": s["combined_tokens_per_s"] / b["combined_tokens_per_s"],
            "ttft_ratio": s["ttft_s"] / b["ttft_s"],
            "kv_capacity_ratio": s["kv_cache_tokens"] / b["kv_cache_tokens"],
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
        }
    finally:
        for engine in engines:
            engine.close()


def spec_refusal(model: str, method: str, on_cpu: bool) -> str | None:
    """Why the engine would refuse `model` ("base" or "swiftkv") speculating with `method`: the SwiftKV engine's own
    rule (swiftkv_core.vllm.speculation), checked before starting an engine only to be refused."""
    from .speculation import speculation_refusal

    if model != "swiftkv" or method == "none":
        return None
    return speculation_refusal(on_cpu, method)


def _speculation(cfg: EngineBenchConfig, kv_bytes: int, on_cpu: bool, log) -> dict:
    """The speculation phase: per model, an engine per method, alternating rounds over every prompt kind and batch."""
    from transformers import AutoTokenizer

    from ..bench_prompts import KINDS, prompts, renderer

    P, O = cfg.prompt_tokens, cfg.output_tokens
    batches = sorted({1, cfg.spec_batch})
    render = renderer(AutoTokenizer.from_pretrained(cfg.baseline))  # a SwiftKV model keeps its base's tokenizer
    # different prompts in every round (suffix decoding remembers earlier answers), the same for every engine
    try:
        work = {(r, kind, b): [{"prompt_token_ids": ids} for ids in prompts(kind, b, P, render, seed=cfg.seed * 10_000 + r * 100 + b,
                                                                           text=cfg.text)]
                for r in range(cfg.rounds) for kind in KINDS for b in batches}
    except (ValueError, OSError) as e:
        raise BenchError(f"speculation prompts: {e}") from None
    warmup = [{"prompt_token_ids": ids} for ids in prompts("chat", 1, P, render, seed=-1)]
    prompt_lengths = {kind: statistics.fmean(len(p["prompt_token_ids"]) for (_, k, _), ps in work.items() if k == kind for p in ps)
                      for kind in KINDS}
    rows: list[dict] = []
    for model, path in (("base", cfg.baseline), ("swiftkv", cfg.model)):
        engines: dict[str, _Engine] = {}
        refused = {m: spec_refusal(model, m, on_cpu) for m in cfg.speculative}
        runnable = [m for m in cfg.speculative if refused[m] is None]
        for method in cfg.speculative:
            if refused[method] is not None:
                log(f"{model} with {method}: refused, reported as such: {refused[method]}")
        try:
            for method in runnable:
                spec = speculative_config(method, cfg.spec_tokens, cfg.spec_lookup_min, cfg.spec_lookup_max)
                log(f"starting {model} engine ({method}): {path}")
                engines[method] = _Engine(f"{model}/{method}", path, cfg, kv_bytes, speculative=spec, stats=True,
                                          gpu_share=_gpu_share(on_cpu, len(runnable)))
            for engine in engines.values():  # warm-up, on a prompt no round uses
                engine.generate(warmup, 2)
            measured: dict[tuple, list[dict]] = {}
            for r in range(cfg.rounds):
                order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
                for method, engine in order:
                    for kind in KINDS:
                        for b in batches:
                            before = spec_counts(engine.metrics.snapshot())
                            elapsed, outputs = engine.generate(work[(r, kind, b)], O)
                            after = spec_counts(engine.metrics.snapshot())
                            measured.setdefault((method, kind, b), []).append(
                                {"elapsed_s": elapsed, "tpot_s": decode_tpots(outputs),
                                 "counts": {k: after[k] - before[k] for k in after}})
                    log(f"round {r + 1}/{cfg.rounds} {model} {method}: "
                        + ", ".join(f"{kind} x{b} {measured[(method, kind, b)][-1]['elapsed_s']:.2f}s" for kind in KINDS for b in batches))
        finally:
            for engine in engines.values():
                engine.close()
        for method in cfg.speculative:
            for kind in KINDS:
                for b in batches:
                    if refused[method] is not None:
                        rows.append(refused_row(model, method, kind, b, refused[method]))
                    else:
                        rows.append(spec_row(model, method, kind, b, O, measured[(method, kind, b)]))
    return {
        "methods": cfg.speculative,
        "settings": {m: speculative_config(m, cfg.spec_tokens, cfg.spec_lookup_min, cfg.spec_lookup_max) for m in cfg.speculative},
        "batches": batches,
        "prompts": {kind: {"mean_prompt_tokens": round(prompt_lengths[kind], 1), "output_tokens": O} for kind in KINDS},
        "text": cfg.text,
        "rounds": cfg.rounds,
        "rows": against_none(rows),
    }


def speculation_table(spec: dict) -> list[str]:
    """The speculation rows as text lines for the terminal."""
    head = f"{'model':8s} {'spec':7s} {'prompts':7s} {'batch':>5s} {'TPOT ms':>9s} {'out tok/s':>10s} {'accept':>7s} " \
           f"{'mean acc len':>12s} {'TPOT x':>7s} {'tok/s x':>8s}"
    lines = [head]
    notes: dict[str, str] = {}

    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in spec["rows"]:
        if r["refused"]:
            notes.setdefault(f"{r['model']} {r['speculative']}", r["refused"])
            cells = f"{'refused':>9s} {'-':>10s} {'-':>7s} {'-':>12s} {'-':>7s} {'-':>8s}"
        else:
            cells = (f"{num(None if r['tpot_s'] is None else r['tpot_s'] * 1000, '.2f'):>9s} {num(r['output_tokens_per_s'], '.1f'):>10s} "
                     f"{num(r['acceptance_rate'], '.2f'):>7s} {num(r['mean_accepted_length'], '.2f'):>12s} "
                     f"{num(r['tpot_speedup'], '.2f'):>7s} {num(r['throughput_speedup'], '.2f'):>8s}")
        lines.append(f"{r['model']:8s} {r['speculative']:7s} {r['prompts']:7s} {r['batch']:>5d} {cells}")
    lines += [f"{who}: refused: {why}" for who, why in notes.items()]
    return lines


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
    speculative: Annotated[list[str], typer.Option(
        "--speculative", help="Also measure speculative decoding with these methods: none, ngram, suffix; repeat it or "
        "give a list (--speculative none,ngram), none being the rows without speculation")] = [],  # noqa: B006
    spec_tokens: Annotated[int, typer.Option(help="Speculation: tokens proposed per step at most (num_speculative_tokens)")] = 4,
    spec_lookup_min: Annotated[int, typer.Option(help="ngram: shortest n-gram looked up in the prompt")] = 2,
    spec_lookup_max: Annotated[int, typer.Option(help="ngram: longest n-gram looked up in the prompt")] = 4,
    spec_batch: Annotated[int, typer.Option(help="Speculation: the larger batch measured beside batch 1")] = 8,
    text: Annotated[Path | None, typer.Option(help="Speculation: cut the quote prompts' documents from this text "
                                              "(`swiftkv data prepare` output) instead of generated catalogues")] = None,
    speculation_only: Annotated[bool, typer.Option("--speculation-only", help="Only the --speculative phase")] = False,
    dual_mode: Annotated[bool, typer.Option("--dual-mode", help="Also measure the SwiftKV checkpoint as a dual-mode engine, "
                                            "in each of its two modes, against the two single-model engines")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
) -> None:
    """Prefill, combined and TTFT speed-ups and KV capacity of a SwiftKV model against its base; with --speculative,
    decode TPOT, output tokens/s and mean accepted length with and without speculative decoding, for both."""
    import json as jsonlib

    for path in (model, baseline):
        if not Path(path).is_dir():
            typer.secho(f"error: {path} is not a checkpoint folder", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
    try:
        methods = parse_speculative(speculative)
    except BenchError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
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
        speculative=methods,
        spec_tokens=spec_tokens,
        spec_lookup_min=spec_lookup_min,
        spec_lookup_max=spec_lookup_max,
        spec_batch=spec_batch,
        text=None if text is None else str(text),
        speculation_only=speculation_only,
        dual_mode=dual_mode,
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
    if not cfg.speculation_only:
        for key in ("prefill_speedup", "combined_speedup", "ttft_ratio", "kv_capacity_ratio", "expected_kv_capacity_ratio"):
            typer.echo(f"{key:28s} {report[key]:.3f}")
        for name in ("dual_swiftkv_ratio", "dual_base_ratio"):
            if name in report:
                typer.echo(f"{name:28s} " + ", ".join(f"{k} {v:.3f}" for k, v in report[name].items()))
        for name in ("base", "swiftkv", "dual_swiftkv", "dual_base"):
            if name not in report:
                continue
            f = report[name]
            typer.echo(
                f"{name:8s} prefill {f['prefill_tokens_per_s']:.0f} tok/s, combined {f['combined_tokens_per_s']:.0f} tok/s, "
                f"ttft {f['ttft_s']:.3f} s, kv {f['kv_cache_tokens']} tokens"
            )
    if "speculation" in report:
        typer.echo("")
        for line in speculation_table(report["speculation"]):
            typer.echo(line)
