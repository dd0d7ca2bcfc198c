"""The chart and the deployment tools `make setup` installs (helm, promtool, hadolint, prometheus)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "swiftkv"


def tool(name: str) -> str:
    """A tool from PATH, the venv or the npm prefix `make setup` uses; a failure naming the install step if absent (`make test` installs it)."""
    for candidate in (shutil.which(name), Path(sys.executable).parent / name, ROOT / ".tools" / "node_modules" / ".bin" / name,
                      ROOT / ".tools" / "prometheus" / "usr" / "bin" / name):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail(f"{name} is not installed: run `make setup` (installs it from npm, Debian or PyPI)")


def run(*args, check=True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def values_args(values: Path | None) -> list[str]:
    return [] if values is None else ["-f", str(values)]


def render(values: Path | None = None, *extra: str) -> list[dict]:
    out = run(tool("helm"), "template", "swiftkv", CHART, "--namespace", "llm", *values_args(values), *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objs: list[dict], kind: str, name_part: str = "") -> list[dict]:
    return [o for o in objs if o["kind"] == kind and name_part in o["metadata"]["name"]]
