"""The `swiftkv` command: one entry point, one sub-command module per capability.

Heavy imports (torch, vLLM, Ray) happen inside the commands so `swiftkv --help` stays instant.
"""

from __future__ import annotations

import typer

from services.serve import register_serving_commands
from services.training.cli import register_trainer_commands
from swiftkv_core.cli import register_core_commands

app = typer.Typer(no_args_is_help=True, add_completion=False, help="SwiftKV: serve prompt-heavy LLM traffic faster.")
register_core_commands(app)
register_serving_commands(app)
register_trainer_commands(app)


@app.callback()
def main() -> None:
    """SwiftKV: serve prompt-heavy LLM traffic faster."""
