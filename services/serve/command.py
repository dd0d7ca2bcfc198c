"""`swiftkv serve` (the platform) and `swiftkv demo` (prepare the models, then serve the default config): flags in,
settings merged (settings), pools checked and fitted (preflight), the platform run (runtime)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from swiftkv_core.console import fail

from .preflight import Refusal, check_engine_choice, check_models, fit_the_default
from .runtime import run_platform
from .settings import ServeSettings, SettingsError, printable_config


def serve_command(
    config: Annotated[Optional[Path], typer.Option(help="Platform YAML (pools, routing, limits); default: SmolLM2 on 127.0.0.1:8000")] = None,
    engine: Annotated[Optional[str], typer.Option(help="ray: Ray Serve deployments (local cluster unless ray_address); inprocess: engines inside the gateway process")] = None,
    host: Annotated[Optional[str], typer.Option(help="Override the config's host")] = None,
    port: Annotated[Optional[int], typer.Option(help="Override the config's port")] = None,
    api_keys_file: Annotated[Optional[str], typer.Option(help="API keys file (also SWIFTKV_API_KEYS / SWIFTKV_API_KEYS_FILE)")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Batch files and the embedded SQLite database (also SWIFTKV_DATA_DIR)")] = None,
    database_url: Annotated[Optional[str], typer.Option(help="Batch store database, e.g. postgresql://user@host/db (also SWIFTKV_DATABASE_URL)")] = None,
    redis_url: Annotated[Optional[str], typer.Option(help="Redis for per-key rate limits shared by several gateways, e.g. redis://host:6379/0 (also SWIFTKV_REDIS_URL)")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster (GCS address, e.g. head:6379) to join with --engine ray (also SWIFTKV_RAY_ADDRESS); default: the config's, else a local cluster")] = None,
    workers: Annotated[Optional[int], typer.Option(min=1, help="Gateway processes on the one port (also SWIFTKV_WORKERS; default: the config's "
                                                   "workers, 1), for pools on Ray or remote servers, which every worker shares")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning or error (also SWIFTKV_LOG_LEVEL; default info). "
                                                     "debug also shows engine and library logs on the console")] = None,
    log_format: Annotated[Optional[str], typer.Option(help="text, or json: one JSON object per console line, for log collectors "
                                                      "(also SWIFTKV_LOG_FORMAT)")] = None,
    log_file: Annotated[Optional[str], typer.Option(help="Where engine and library logs go (also SWIFTKV_LOG_FILE; default "
                                                    "DATA_DIR/logs/serve.log); - keeps them on the console")] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the platform config this command would serve "
                                               "(the embedded default or --config, with the flags and SWIFTKV_* variables "
                                               "applied) as YAML, and exit")] = False,
) -> None:
    """Run the OpenAI-compatible gateway and its engine pools."""
    try:
        settings = ServeSettings.merged(config=config, engine=engine, host=host, port=port, api_keys_file=api_keys_file,
                                        data_dir=data_dir, database_url=database_url, redis_url=redis_url, ray_address=ray_address,
                                        workers=workers, log_level=log_level, log_format=log_format, log_file=log_file)
        log_level, log_format = settings.log_options()
        cfg = settings.platform_config()
        check_engine_choice(cfg, settings.engine)
        if settings.config is None:
            fit_the_default(cfg, prepare=False)
        if print_config:
            typer.echo(printable_config(cfg, settings.config), nl=False)
            raise typer.Exit(0)
        check_models(cfg)
    except (SettingsError, Refusal) as e:
        fail(str(e))
    run_platform(cfg, settings.engine, log_level, settings.keys_file(cfg), settings.ray_metrics_port, cfg.workers, log_format,
                 settings.log_file)


def demo_command(
    engine: Annotated[str, typer.Option(help="inprocess (default: fits small machines) or ray")] = "inprocess",
    port: Annotated[Optional[int], typer.Option(help="Override the port (default 8000)")] = None,
) -> None:
    """Prepare SmolLM2 and its SwiftKV version offline, then serve them with the default config."""
    from services.config import load_config

    cfg = load_config(None, {"port": port})
    fit_the_default(cfg, prepare=True)
    try:
        settings = ServeSettings.merged()
        log_level, log_format = settings.log_options()
    except SettingsError as e:
        fail(str(e))
    run_platform(cfg, engine, log_level, settings.keys_file(cfg), log_format=log_format, log_file=settings.log_file)


def register_serving_commands(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
    app.command("demo")(demo_command)
