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


def register_core_commands(app: typer.Typer) -> None:
    app.command("convert")(convert_command)
