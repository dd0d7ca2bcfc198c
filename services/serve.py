"""`swiftkv serve` (the platform) and `swiftkv demo` (prepare the models, then serve the default config)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from swiftkv_core.cli import fail


class ServeSettings(BaseSettings):
    """Environment (SWIFTKV_*) defaults for `swiftkv serve`; command-line flags override them."""

    model_config = SettingsConfigDict(env_prefix="SWIFTKV_")

    config: Optional[Path] = None
    engine: Literal["inprocess", "ray"] = "ray"
    host: Optional[str] = None
    port: Optional[int] = None
    api_keys_file: Optional[str] = None
    log_level: str = "info"
    ray_metrics_port: int = 8080
    data_dir: Optional[str] = None
    database_url: Optional[str] = None


def _check_models(cfg) -> None:
    for name, pool in cfg.pools.items():
        path = Path(pool.model)
        looks_local = pool.model.startswith((".", "/")) or pool.model.startswith("models/")
        if pool.backend == "engine" and looks_local and not path.exists():
            fail(f"pool {name}: model folder {pool.model} does not exist "
                  f"(prepare it with `swiftkv models prepare {path.name}`, or run `swiftkv demo`)")


def _check_machine(cfg, engine: str) -> None:
    """Refuse engine settings this machine cannot run (e.g. an FP8 KV cache on a CPU without AVX-512),
    before any engine starts. Engines on a remote Ray cluster are checked by their replicas instead."""
    local = {name: pool for name, pool in cfg.pools.items() if pool.backend == "engine"}
    if not local or (engine == "ray" and cfg.ray_address):
        return
    from swiftkv_core.hardware import UnsupportedSetting, check_engine_args, vllm_on_cpu

    on_cpu = vllm_on_cpu()
    for name, pool in local.items():
        try:
            check_engine_args(pool.engine_args, on_cpu, f"pools.{name}.engine_args")
        except UnsupportedSetting as e:
            fail(str(e))


def run_platform(cfg, engine: str, log_level: str = "info", api_keys_file: str | None = None, ray_metrics_port: int = 8080) -> None:
    import uvicorn

    from services.gateway.app import Gateway, create_app
    from services.gateway.auth import KeyStore
    from services.gateway.prompts import Prompter
    from services.serving.pools import build_backends

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_machine(cfg, engine)
    try:
        # The command-line flag wins over SWIFTKV_API_KEYS_FILE, which wins over the config's api_keys_file.
        keys = KeyStore.from_env(api_keys_file or os.environ.get("SWIFTKV_API_KEYS_FILE") or cfg.api_keys_file)
    except (OSError, ValueError) as e:
        fail(f"API keys: {e}")
    batch = _batch_service(cfg)  # before any engine or Ray cluster starts: a bad store fails fast
    # Pools share one tokenizer (a SwiftKV model keeps its base model's); the base model's loads plainly.
    pool = cfg.pools.get("decode") or next(iter(cfg.pools.values()))
    prompter = Prompter(pool.tokenizer or pool.model)
    if engine == "ray":
        from services.serving.ray_backend import start_ray

        start_ray(cfg.ray_address, ray_metrics_port)
        typer.echo(f"Ray Serve up; engine metrics at http://127.0.0.1:{ray_metrics_port}/metrics (as ray_vllm_*) and on "
                   "the gateway's /metrics (as vllm:*)" if not cfg.ray_address else "joined Ray cluster")
    backends = build_backends(cfg, engine)
    extra_metrics = None
    if engine == "ray" and not cfg.ray_address:
        from services.serving.ray_backend import engine_metrics

        extra_metrics = lambda: engine_metrics(ray_metrics_port)  # noqa: E731
    key_hint = ' -H "Authorization: Bearer $SWIFTKV_API_KEY"' if keys.enabled else ""

    def on_ready() -> None:
        typer.secho(f"SwiftKV is serving {cfg.model} (pools: {', '.join(cfg.pools)}) at http://{cfg.host}:{cfg.port}/v1", fg=typer.colors.GREEN)
        typer.echo("Try:\n  curl -s http://%s:%d/v1/chat/completions -H 'Content-Type: application/json'%s \\\n"
                   "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32}'"
                   % (cfg.host, cfg.port, key_hint, cfg.model))

    gateway = Gateway(cfg, backends, prompter, keys, on_ready=on_ready, extra_metrics=extra_metrics)
    batch.attach(gateway)
    app = create_app(gateway, extensions=[batch])
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    finally:
        if engine == "ray":
            from services.serving.ray_backend import stop_ray

            stop_ray(started_local_cluster=not cfg.ray_address)


def _batch_service(cfg):
    from sqlalchemy.exc import SQLAlchemyError

    from services.batch.service import BatchService

    try:
        return BatchService(cfg)
    except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
        fail(f"batch store ({cfg.database_url or cfg.data_dir}): {e}")


def serve_command(
    config: Annotated[Optional[Path], typer.Option(help="Platform YAML (pools, routing, limits); default: SmolLM2 on 127.0.0.1:8000")] = None,
    engine: Annotated[Optional[str], typer.Option(help="ray: Ray Serve deployments (local cluster unless ray_address); inprocess: engines inside the gateway process")] = None,
    host: Annotated[Optional[str], typer.Option(help="Override the config's host")] = None,
    port: Annotated[Optional[int], typer.Option(help="Override the config's port")] = None,
    api_keys_file: Annotated[Optional[str], typer.Option(help="API keys file (also SWIFTKV_API_KEYS / SWIFTKV_API_KEYS_FILE)")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Batch files and the embedded SQLite database (also SWIFTKV_DATA_DIR)")] = None,
    database_url: Annotated[Optional[str], typer.Option(help="Batch store database, e.g. postgresql://user@host/db (also SWIFTKV_DATABASE_URL)")] = None,
) -> None:
    """Run the OpenAI-compatible gateway and its engine pools."""
    from services.serving.config import load_config

    settings = ServeSettings()
    engine = engine or settings.engine
    if engine not in ("ray", "inprocess"):
        fail(f"--engine must be 'ray' or 'inprocess', not {engine!r}")
    config = config or settings.config
    if config is not None and not Path(config).exists():
        fail(f"config file {config} does not exist")
    try:
        cfg = load_config(config, {"host": host or settings.host, "port": port or settings.port,
                                   "data_dir": data_dir or settings.data_dir, "database_url": database_url or settings.database_url})
    except (ValidationError, ValueError) as e:
        fail(f"invalid config {config or '(default)'}: {e}")
    if config is None:
        default_models(cfg, prepare=False)
    _check_models(cfg)
    run_platform(cfg, engine, settings.log_level, api_keys_file or settings.api_keys_file, settings.ray_metrics_port)


def demo_command(
    engine: Annotated[str, typer.Option(help="inprocess (default: fits small machines) or ray")] = "inprocess",
    port: Annotated[Optional[int], typer.Option(help="Override the port (default 8000)")] = None,
) -> None:
    """Prepare SmolLM2 and its SwiftKV version offline, then serve them with the default config."""
    from services.serving.config import load_config

    cfg = load_config(None, {"port": port})
    default_models(cfg, prepare=True)
    run_platform(cfg, engine)


def default_models(cfg, prepare: bool) -> None:
    """The embedded default's models: prepared when asked. Until a distilled SwiftKV model can be prepared,
    the prefill pool serves an undistilled conversion of the base model (half the layers take their KV
    from the middle layer), as `swiftkv convert` writes it."""
    decode, prefill = cfg.pools["decode"], cfg.pools["prefill"]
    if prepare and not Path(decode.model).exists():
        _prepare(Path(decode.model).name)
    if Path(prefill.model).exists():
        return
    if prepare:
        try:
            if _prepare(Path(prefill.model).name) is not None:
                return
        except Exception as e:  # e.g. the distilled tensors are not shipped yet
            typer.secho(f"pool prefill: cannot prepare {Path(prefill.model).name}: {e}", fg=typer.colors.YELLOW)
    undistilled = Path(prefill.model).parent / (Path(prefill.model).name + "-undistilled")
    if prepare and not (undistilled / "config.json").exists():
        _convert_half(Path(decode.model), undistilled)
    if (undistilled / "config.json").exists():
        prefill.model = str(undistilled)
        typer.secho(f"pool prefill: no distilled SwiftKV model yet; serving the undistilled {undistilled}", fg=typer.colors.YELLOW)


def _prepare(model_name: str) -> Path | None:
    from swiftkv_core import models

    if model_name not in models.REGISTRY:
        return None
    typer.echo(f"preparing {model_name} (offline, once)...")
    return models.prepare(model_name, Path(models.DEFAULT_MODELS_DIR))


def _convert_half(base: Path, out: Path) -> None:
    import json

    from swiftkv_core.convert import convert

    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    typer.echo(f"converting {base} to SwiftKV (l = {layers // 2} of {layers}) -> {out}")
    convert(str(base), out, num_key_value_layers=layers // 2)


def register_serving_commands(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
    app.command("demo")(demo_command)
