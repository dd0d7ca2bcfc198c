"""What every `swiftkv` command prints: one clear error line and exit code 2 (`fail`), JSON for machines, tables for
people. Shared by the commands of the core (swiftkv_core.cli), of the services (services.serve, services.training)
and of the load tests (loadtest.cli); it imports nothing of the project, so any layer may use it."""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for machines")]


def fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def print_json(data: dict) -> None:
    import json

    typer.echo(json.dumps(data, indent=2))


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)
