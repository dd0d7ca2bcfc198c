"""`swiftkv trainer serve`: the distillation job service."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

trainer_app = typer.Typer(no_args_is_help=True, help="The distillation job service (OpenAI's fine-tuning jobs API).")


@trainer_app.command("serve")
def trainer_serve_command(
    host: Annotated[Optional[str], typer.Option(help="Address to listen on (default 127.0.0.1; 0.0.0.0 with API keys in a cluster)")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8001)")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Store and run folders, and files unless --files-dir (default data/trainer)")] = None,
    files_dir: Annotated[Optional[Path], typer.Option(help="The Files API's bytes, shared with the gateway: its data dir's files/ "
                                                      "(with its --database-url); default: the data dir's files/")] = None,
    database_url: Annotated[Optional[str], typer.Option(help="SQLAlchemy URL (PostgreSQL in a cluster); default SQLite in the data dir")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Submit each job to this Ray cluster (job submission API, e.g. http://head:8265)")] = None,
    models_dir: Annotated[Optional[Path], typer.Option(help="Where finished jobs publish their models (default models)")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Steps between resumable checkpoints (default 50)")] = None,
    events_every: Annotated[Optional[int], typer.Option(help="Steps between progress events (default 10)")] = None,
    eval_max_tokens: Annotated[Optional[int], typer.Option(help="Tokens of the final evaluation (0 = none; default 16384)")] = None,
    eval_prompts: Annotated[Optional[int], typer.Option(help="Short prompts for greedy agreement in the evaluation (default 4)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads of a job's process")] = None,
    api_keys_file: Annotated[Optional[str], typer.Option(help="The gateway's API keys file (also SWIFTKV_API_KEYS / SWIFTKV_API_KEYS_FILE)")] = None,
    allowed_models: Annotated[Optional[str], typer.Option(help="Hub ids or glob patterns a job may download, comma-separated (default: none; models-dir and prepared names only)")] = None,
    log_level: Annotated[str, typer.Option(help="Log level")] = "info",
) -> None:
    """Serve OpenAI's fine-tuning jobs API; each job distills a SwiftKV model and publishes it for serving."""
    from .service import TrainerSettings, serve

    given = {"host": host, "port": port, "data_dir": str(data_dir) if data_dir else None, "database_url": database_url,
             "files_dir": str(files_dir) if files_dir else None,
             "ray_address": ray_address, "models_dir": str(models_dir) if models_dir else None,
             "checkpoint_every": checkpoint_every, "events_every": events_every, "eval_max_tokens": eval_max_tokens,
             "eval_prompts": eval_prompts, "threads": threads, "api_keys_file": api_keys_file, "allowed_models": allowed_models}
    settings = TrainerSettings(**{k: v for k, v in given.items() if v is not None})
    for name in ("checkpoint_every", "events_every"):
        if getattr(settings, name) < 1:
            raise typer.BadParameter(f"--{name.replace('_', '-')} must be at least 1")
    # uvicorn drains on SIGTERM and Ctrl-C, then raises the signal again for the handler it found: ignoring ones make
    # a drained stop exit 0, not 143 or "Aborted!". A running job's process (its own session) is not stopped: the
    # next start follows it, or resumes it from its last checkpoint if it is gone.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the service takes it (a reload of the API keys), not a stop
    serve(settings, log_level)


def register_trainer_commands(app: typer.Typer) -> None:
    app.add_typer(trainer_app, name="trainer")
