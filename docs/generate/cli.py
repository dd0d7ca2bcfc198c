"""cli.md: every command of `swiftkv` (services.cli:app) with its help, arguments and options, from the click
command tree Typer builds. tests/test_docs.py checks the documentation's `swiftkv ...` lines against the same tree."""

from __future__ import annotations

import functools
import inspect
from typing import Iterator

import typer

from .markdown import banner, code, prose, table, value

PROGRAM = "swiftkv"


@functools.cache
def root_command():
    from services.cli import app

    return typer.main.get_command(app)


def commands(command=None, path: tuple[str, ...] = (PROGRAM,)) -> Iterator[tuple[tuple[str, ...], object]]:
    """(path, command) of the program and of every subcommand, depth first in the order of `--help`."""
    command = command or root_command()
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from commands(sub, path + (name,))


def option_names(command) -> set[str]:
    """Every spelling of every option the command takes, `--help` included."""
    ctx = command.context_class(command)
    params = [*command.params, command.get_help_option(ctx)]
    return {name for p in params if p is not None and p.param_type_name == "option" for name in (*p.opts, *p.secondary_opts)}


def _type(param, ctx) -> str:
    parts = ["flag" if getattr(param, "is_flag", False) else param.display_type(ctx).strip("<>")]
    if getattr(param, "min", None) is not None:
        parts.append(f"≥ {param.min}")
    if getattr(param, "max", None) is not None:
        parts.append(f"≤ {param.max}")
    if getattr(param, "multiple", False):
        parts.append("repeatable")
    return ", ".join(parts)


def _default(param) -> str:
    if param.required:
        return "required"
    return "" if param.default is None else value(param.default)


def _params_table(command) -> str:
    ctx = command.context_class(command)
    rows = [(" / ".join(code(o) for o in (*p.opts, *p.secondary_opts)) if p.param_type_name == "option" else code(p.name.upper()),
             code(_type(p, ctx)), _default(p), getattr(p, "help", None) or "")
            for p in command.params if not getattr(p, "hidden", False)]
    return table(("Name", "Type", "Default", "Help"), rows) if rows else "No options but `--help`.\n"


def _help(command) -> str:
    return prose(inspect.cleandoc((command.help or "").replace("\b\n", ""))) + "\n"


def cli_page() -> str:
    parts = [banner("CLI reference", "services/cli.py"),
             f"Every command of `{PROGRAM}` (the console script `{PROGRAM} = services.cli:app`); each also takes `--help`.\n"]
    for path, command in commands():
        parts += [f"## `{' '.join(path)}`\n", _help(command)]
        subs = getattr(command, "commands", None)
        if subs:
            parts.append(table(("Command", "Summary"), [(code(f"{' '.join(path)} {name}"), sub.get_short_help_str(120))
                                                         for name, sub in subs.items() if not sub.hidden]))
        else:
            parts.append(_params_table(command))
    return "\n".join(parts)
