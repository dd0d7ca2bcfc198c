"""The rules that refuse or adjust a platform's pools before any engine starts: an engine choice its pools cannot run
on, a missing model folder, a dual-mode or speculating pool its checkpoint or this machine cannot serve (refused, one
clear line and exit code 2); and the embedded default's pools fitted to this machine (models prepared, dual mode on a
CPU, speculation off where it cannot run).

A refusal is a `Refusal` (its message the one line `swiftkv serve` prints before exiting with code 2), so code that
changes pools at run time can apply the same rules without ending the process."""

from __future__ import annotations

import json
from pathlib import Path

import typer


class Refusal(ValueError):
    """A pool (or the engine choice for it) that cannot start here; the message says why and what to change."""


def check_engine_choice(cfg, engine: str) -> None:
    """Refuse pools the chosen engine cannot serve: a pool on a Ray Serve application without Ray, engines behind Ray
    Client, in-process engines in several gateway workers."""
    attached = [f"pools.{name}.ray_app" for name, pool in cfg.pools.items() if pool.ray_app]
    if attached and engine != "ray":
        raise Refusal(f"{', '.join(attached)}: a pool on a Ray Serve application needs --engine ray")
    if engine == "ray" and (cfg.ray_address or "").startswith("ray://") and any(p.backend == "engine" for p in cfg.pools.values()):
        raise Refusal(f"ray_address {cfg.ray_address}: the gateway streams from Ray Serve deployment handles, which Ray Client (ray://) "
             "does not support; run the gateway on a node of the cluster and give the GCS address (host:6379, or auto)")
    inprocess = [f"pools.{name}" for name, pool in cfg.pools.items() if pool.backend == "engine" and engine == "inprocess"]
    if cfg.workers > 1 and inprocess:
        raise Refusal(f"--workers {cfg.workers} with in-process engines ({', '.join(inprocess)}): each gateway process would load its own "
             f"copy of every engine ({cfg.workers} times the memory, all competing for the same cores and accelerators). "
             "Serve those pools with --engine ray (Ray Serve replicas, shared by every worker) or as remote vLLM servers "
             "(backend: remote, url: ...), or keep one worker")


def check_models(cfg) -> None:
    """Refuse a pool whose local model folder is missing, or that cannot run dual-mode engines on its checkpoint."""
    for name, pool in cfg.pools.items():
        path = Path(pool.model)
        looks_local = pool.model.startswith((".", "/")) or pool.model.startswith("models/")
        if pool.backend == "engine" and looks_local and not path.exists():
            raise Refusal(f"pool {name}: model folder {pool.model} does not exist "
                  f"(prepare it with `swiftkv models prepare {path.name}`, or run `swiftkv demo`)")
        refusal = dual_mode_refusal(name, pool)
        if refusal:
            raise Refusal(refusal)


def local_hf_config(pool) -> dict | None:
    """The config.json of the pool's model where it is a local folder (None: a hub id, or unreadable: the engine says
    what is wrong with it)."""
    config_file = Path(pool.model) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def dual_mode_refusal(name: str, pool) -> str | None:
    """Why the pool cannot run dual-mode engines (None: it can, it is not dual-mode, or its model is not a local folder
    to read): a dual-mode engine runs a SwiftKV checkpoint that holds its base model whole."""
    hf_config = local_hf_config(pool) if pool.dual_mode and pool.backend == "engine" else None
    reason = None if hf_config is None else checkpoint_dual_mode_refusal(hf_config)
    return None if reason is None else f"pools.{name}.dual_mode: {pool.model}: {reason}"


def checkpoint_dual_mode_refusal(hf_config: dict) -> str | None:
    """Why the checkpoint of this config.json cannot serve its base model in dual mode (None: it can)."""
    from swiftkv_core.dual_mode import refusal
    from swiftkv_core.vllm.speculation import CHECKPOINT_ARCHITECTURE, is_swiftkv_checkpoint

    if not is_swiftkv_checkpoint(hf_config):
        return (f"dual mode needs a SwiftKV checkpoint (architectures [{CHECKPOINT_ARCHITECTURE}] in its config.json), which "
                f"holds the base model whole; this one lists {hf_config.get('architectures') or 'none'}: convert it with "
                "`swiftkv convert` or set dual_mode false")
    return refusal(hf_config.get("num_hidden_layers"), hf_config.get("num_key_value_layers"),
                   hf_config.get("key_value_group_size"), bool(hf_config.get("later_layers_adapted")))


def check_machine(cfg, engine: str) -> None:
    """Refuse engine settings this machine cannot run (e.g. an FP8 KV cache on a CPU without AVX-512),
    before any engine starts. Engines on a remote Ray cluster are checked by their replicas instead."""
    local = {name: pool for name, pool in cfg.pools.items() if pool.backend == "engine"}
    if not local or (engine == "ray" and cfg.ray_address):
        return
    from swiftkv_core.hardware import UnsupportedSetting, check_cpu_cores_fit, check_engine_args, vllm_on_cpu

    on_cpu = vllm_on_cpu()
    for name, pool in local.items():
        try:
            check_engine_args(pool.engine_args, on_cpu, f"pools.{name}.engine_args")
            if on_cpu and engine == "inprocess":
                check_cpu_cores_fit(pool.cpu_cores, f"pools.{name}.cpu_cores")
        except UnsupportedSetting as e:
            raise Refusal(str(e)) from None
        refusal = speculation_refusal(name, pool, on_cpu)
        if refusal:
            raise Refusal(refusal)


def speculation_refusal(name: str, pool, on_cpu: bool) -> str | None:
    """Why this machine cannot start the pool's engines with their speculative decoding (None: it can): suffix
    decoding without Arctic Inference installed, or a SwiftKV model where SwiftKV cannot verify drafts. The
    engines refuse both too, but only once each has started loading."""
    import importlib.util

    speculation = pool.speculation
    if not isinstance(speculation, dict):  # none, or vLLM's JSON text in engine_args: the engine checks that
        return None
    setting = f"pools.{name}.speculative" if pool.speculative.enabled else f"pools.{name}.engine_args.speculative_config"
    if speculation.get("method") == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        return (f"{setting}: method suffix runs Arctic Inference's suffix decoding, and the arctic_inference package is "
                "not installed here (`pip install arctic-inference`: an sdist that compiles a C++ extension); "
                "or use method ngram")
    hf_config = local_hf_config(pool)
    if hf_config is not None:
        from swiftkv_core.vllm.speculation import is_swiftkv_checkpoint
        from swiftkv_core.vllm.speculation import speculation_refusal as swiftkv_refusal

        refusal = swiftkv_refusal(on_cpu, speculation.get("method")) if is_swiftkv_checkpoint(hf_config) else None
        if refusal:
            return f"{setting}: pool {name} serves the SwiftKV model {pool.model}: {refusal}"
    return None


def fit_the_default(cfg, prepare: bool) -> None:
    """The embedded default (no --config) fitted to this machine: its models (prepared when asked), dual mode, speculation."""
    default_models(cfg, prepare=prepare)
    default_dual_mode(cfg)
    default_speculation(cfg)


def default_dual_mode(cfg) -> None:
    """On a CPU the embedded default runs both pools on the SwiftKV checkpoint as dual-mode engines, each serving the base
    model too, per request: there rag at capacity ran as two SwiftKV engines do and conversations faster than on two
    base engines, each model within 0-3% of its own engine's speed (docs/benchmarks.md, "Dual-mode engines"). On a GPU a
    dual-mode engine gives up CUDA graphs, not yet measured there, so each pool keeps its one model; so it does where the
    SwiftKV model cannot serve its base model (no SwiftKV checkpoint prepared, AcrossKV, merged adapters)."""
    from swiftkv_core.hardware import vllm_on_cpu

    swiftkv, base = cfg.pools.get("swiftkv"), cfg.pools.get("base")
    if swiftkv is None or base is None or {swiftkv.backend, base.backend} != {"engine"} or cfg.routing.kv_events:
        return
    hf_config = local_hf_config(swiftkv)
    if hf_config is None or checkpoint_dual_mode_refusal(hf_config) is not None or not vllm_on_cpu():
        return
    base.model, base.tokenizer = swiftkv.model, swiftkv.tokenizer
    swiftkv.dual_mode = base.dual_mode = True


def default_speculation(cfg) -> None:
    """Where the embedded default speculates (its base pool), a pool this machine cannot speculate on (a SwiftKV model on
    a GPU) serves without it, with a warning, instead of the start being refused (as it is for a config file's)."""
    local = [name for name, pool in cfg.pools.items() if pool.backend == "engine" and pool.speculative.enabled]
    if not local:
        return
    from services.config import SpeculativeConfig
    from swiftkv_core.hardware import vllm_on_cpu

    on_cpu = vllm_on_cpu()
    for name in local:
        refusal = speculation_refusal(name, cfg.pools[name], on_cpu)
        if refusal:
            cfg.pools[name].speculative = SpeculativeConfig()
            typer.secho(f"pool {name}: speculative decoding off on this machine ({refusal})", fg=typer.colors.YELLOW)


def default_models(cfg, prepare: bool) -> None:
    """The embedded default's models: prepared when asked. Until a distilled SwiftKV model can be prepared,
    the swiftkv pool serves an undistilled conversion of the base model (half the layers take their KV
    from the middle layer), as `swiftkv convert` writes it."""
    base, swiftkv = cfg.pools["base"], cfg.pools["swiftkv"]
    if prepare and not Path(base.model).exists():
        _prepare(Path(base.model).name)
    if Path(swiftkv.model).exists():
        return
    if prepare:
        try:
            if _prepare(Path(swiftkv.model).name) is not None:
                return
        except Exception as e:  # e.g. the distilled tensors are not shipped yet
            typer.secho(f"pool swiftkv: cannot prepare {Path(swiftkv.model).name}: {e}", fg=typer.colors.YELLOW)
    undistilled = Path(swiftkv.model).parent / (Path(swiftkv.model).name + "-undistilled")
    if prepare and not (undistilled / "config.json").exists():
        _convert_undistilled(Path(base.model), undistilled)
    if (undistilled / "config.json").exists():
        swiftkv.model = str(undistilled)
        typer.secho(f"pool swiftkv: no distilled SwiftKV model yet; serving the undistilled {undistilled}", fg=typer.colors.YELLOW)


def _prepare(model_name: str) -> Path | None:
    from swiftkv_core import catalog

    if model_name not in catalog.REGISTRY:
        return None
    typer.echo(f"preparing {model_name} (offline, once)...")
    return catalog.prepare(model_name, Path(catalog.DEFAULT_MODELS_DIR))


def _convert_undistilled(base: Path, out: Path) -> None:
    from swiftkv_core.config import default_num_key_value_layers
    from swiftkv_core.convert import convert

    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    l = default_num_key_value_layers(layers)
    typer.echo(f"converting {base} to SwiftKV (l = {l} of {layers}) -> {out}")
    convert(str(base), out, num_key_value_layers=l)
