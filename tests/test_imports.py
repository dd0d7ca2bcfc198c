"""The layers import downward only, checked on the source (the AST of every module, so a lazy import inside a
function counts as much as one at the top):

- the core library (`swiftkv_core`) knows nothing of the services or the load tests, so it installs and imports
  without FastAPI, Ray or the platform around it;
- the services know nothing of the load tests, which drive them from above (`swiftkv bench platform` joins the CLI
  through an entry point, not an import);
- the gateway, the Batch API and the trainer are siblings over one shared layer (`services.common`, the OpenAI-API
  plumbing, and `services.config`, the platform config): none imports another, and the shared layer imports none
  of them; only the process that assembles them (`services.serve`, `services.cli`) imports them all;
- no two project modules import each other, directly or through others, when they are imported;
- no module of the packages edits `sys.path`: they import each other as installed packages (the load-test scripts
  run as modules, `python -m loadtest.NAME`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swiftkv_core", "services", "loadtest")
SIBLINGS = ("services.gateway", "services.batch", "services.training")
SHARED = ("services.common", "services.config")


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def project_imports(name: str, top_level_only: bool = False) -> set[str]:
    """The project modules `name` imports (relative imports resolved; `from package import module` names the
    module): anywhere in the file, or with `top_level_only` only the statements that run when it is imported
    (the module body, including under `if`, `try` and class bodies, not inside functions)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    if top_level_only:
        nodes, todo = [], list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # runs when called (a class body runs at import; its methods do not)
            nodes.append(node)
            todo += list(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_core_imports_no_service_and_no_load_test():
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & {"services", "loadtest"})
                 for p in sorted((ROOT / "swiftkv_core").rglob("*.py"))}
    assert not {p: names for p, names in offenders.items() if names}


def test_the_services_import_no_load_test():
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & {"loadtest"}) for p in sorted((ROOT / "services").rglob("*.py"))}
    assert not {p: names for p, names in offenders.items() if names}, "loadtest drives the services from above"


def edits_sys_path(path: Path) -> list[int]:
    """Lines where the file changes `sys.path`: assigns to it (or a slice of it), or calls a method on it (insert,
    append, extend, remove, ...); `import sys` alone or reading `sys.path` is fine."""
    def is_sys_path(node) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
    return lines


def test_no_package_module_edits_sys_path(tmp_path):
    offenders = sorted(f"{p.relative_to(ROOT)}:{line}" for p in MODULES.values() for line in edits_sys_path(p))
    assert not offenders, f"import the project's packages as installed (python -m loadtest.NAME), not through sys.path: {offenders}"
    probe = tmp_path / "probe.py"  # the check finds each way of editing it, and not a read
    probe.write_text("import sys\nsys.path.insert(0, 'a')\nsys.path[:0] = ['b']\nsys.path += ['c']\nprint(sys.path[0])\n")
    assert sorted(edits_sys_path(probe)) == [2, 3, 4]


def test_gateway_batch_and_training_do_not_import_each_other():
    offenders = {}
    for name in MODULES:
        for sibling in SIBLINGS:
            if within(name, sibling):
                others = sorted(m for m in project_imports(name) if any(within(m, s) for s in SIBLINGS if s != sibling))
                if others:
                    offenders[name] = others
    assert not offenders, f"services.gateway, services.batch and services.training are siblings on services.common: {offenders}"


def test_the_shared_layer_imports_no_service_above_it():
    above = (*SIBLINGS, "services.serving", "services.serve", "services.cli", "loadtest")
    offenders = {name: sorted(m for m in project_imports(name) if any(within(m, a) for a in above))
                 for name in MODULES if any(within(name, s) for s in SHARED)}
    assert any(within(name, "services.common") for name in MODULES), "services.common is missing"
    assert not {name: names for name, names in offenders.items() if names}


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: every component of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    """Over what each module imports when it is imported: a cycle there means one module may meet the other
    half-initialised."""
    assert not cycles_of({name: project_imports(name, top_level_only=True) for name in MODULES})


def test_no_cycles_through_lazy_imports_either():
    """Over every import, those inside functions too: a lazy import that closes a loop (a command of the core
    reaching into the services that import the core) is a layering error the interpreter would never report."""
    assert not cycles_of({name: project_imports(name) for name in MODULES})
