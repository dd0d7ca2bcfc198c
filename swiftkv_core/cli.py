"""Command-line front of swiftkv_core: models, convert, analyze (and, as they land, distill, eval, bench).

Each command validates its arguments and turns library errors into one clear line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


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
    from .models import ModelPrepareError, prepare

    try:
        path = prepare(name, dir)
    except ModelPrepareError as e:
        fail(str(e))
    typer.echo(str(path))


@models_app.command("list")
def models_list_command() -> None:
    """Show the models `prepare` knows."""
    from .models import REGISTRY

    for model in REGISTRY.values():
        typer.echo(f"{model.name:36s} {model.description}")


def register_core_commands(app: typer.Typer) -> None:
    app.command("convert")(convert_command)
    app.add_typer(models_app, name="models")
