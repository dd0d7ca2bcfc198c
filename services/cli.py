"""The `swiftkv` command: one entry point, one sub-command module per capability.

Heavy imports (torch, vLLM, Ray) happen inside the commands so `swiftkv --help` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from services.platform import register_serving_commands
from services.training.cli import register_trainer_commands
from swiftkv_core.cli import register_core_commands

app = typer.Typer(no_args_is_help=True, add_completion=False, help="SwiftKV: serve prompt-heavy LLM traffic faster.")
register_core_commands(app)
register_serving_commands(app)
register_trainer_commands(app)


def _register_loadtest_commands() -> None:
    """`swiftkv bench platform` lives with the load tests, beside the packages in a source checkout (they are not
    installed); elsewhere the command is absent."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "loadtest" / "cli.py").exists():
        return
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from loadtest.cli import register_loadtest_commands
    from swiftkv_core.vllm.bench import bench_app

    register_loadtest_commands(bench_app)


_register_loadtest_commands()


@app.callback()
def main() -> None:
    """SwiftKV: serve prompt-heavy LLM traffic faster."""
