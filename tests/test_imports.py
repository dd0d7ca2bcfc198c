"""The layers import downward only: the core library (`swiftkv_core`) knows nothing of the services or the load
tests, so it installs and imports without FastAPI, Ray or the platform around it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_core_imports_no_service_and_no_load_test():
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & {"services", "loadtest"})
                 for p in sorted((ROOT / "swiftkv_core").rglob("*.py"))}
    assert not {p: names for p, names in offenders.items() if names}
