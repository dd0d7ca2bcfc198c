"""The load-test tools as the tests run them: `swiftkv bench platform` and `python -m loadtest.soak` as commands, skipped
where the machine has no man pages to draw real text from. Shared by the modules that start platforms of their own
(tests/test_bench_platform.py) and those that point the tools at the run's shared platform
(tests/test_bench_target.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from swiftkv_core import data as D

from .processes import BIN, tool_env

ROOT = Path(__file__).resolve().parents[2]  # where the tools run (loadtest is a package of the project, installed with it)

needs_manpages = pytest.mark.skipif(not any(d.is_dir() for d in D.MAN_DIRS), reason="no man pages on this machine")


def bench_platform(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`swiftkv bench platform ARGS`, run to its end."""
    return subprocess.run([str(BIN / "swiftkv"), "bench", "platform", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=tool_env())


def soak_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "loadtest.soak", *args]


def soak(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m loadtest.soak ARGS`, run to its end."""
    return subprocess.run(soak_command(*args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=tool_env())


def is_plot(path: Path) -> bool:
    """A PNG the tools drew: its signature, and more than an empty canvas's bytes."""
    return path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
