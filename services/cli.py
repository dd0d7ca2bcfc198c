"""The `swiftkv` command: one entry point, one sub-command module per capability.

Heavy imports (torch, vLLM, Ray) happen inside the commands so `swiftkv --help` stays instant.
"""

from __future__ import annotations

from importlib.metadata import distributions

import typer

from services.serve import register_serving_commands
from services.training.cli import register_trainer_commands
from swiftkv_core.cli import register_core_commands

app = typer.Typer(no_args_is_help=True, add_completion=False, help="SwiftKV: serve prompt-heavy LLM traffic faster.")
register_core_commands(app)
register_serving_commands(app)
register_trainer_commands(app)


def _register_bench_plugins() -> None:
    """`swiftkv bench NAME` commands other packages declare under the entry point group `swiftkv.bench`: the load
    tests' `swiftkv bench platform` (loadtest.cli, installed with the project). Found by name, so the services import
    nothing of the load tests, which sit above them."""
    from swiftkv_core.vllm.bench import bench_app

    # Every distribution's, not importlib.metadata.entry_points(), which reads only the first copy of each project's
    # metadata on sys.path: in a checkout that can be a stale swiftkv.egg-info from an older build, without the group.
    plugins = {}
    for dist in distributions():
        for plugin in dist.entry_points.select(group="swiftkv.bench"):
            plugins.setdefault(plugin.name, plugin)
    for plugin in plugins.values():
        try:
            command = plugin.load()
        except ModuleNotFoundError as e:  # declared, but its package is not in this install (an image without loadtest/)
            if e.name and f"{plugin.module}.".startswith(f"{e.name}."):
                continue
            raise
        bench_app.command(plugin.name)(command)


_register_bench_plugins()


@app.callback()
def main() -> None:
    """SwiftKV: serve prompt-heavy LLM traffic faster."""
