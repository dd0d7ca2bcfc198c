"""serving/http-api.md: every route of the gateway and of the trainer, from their apps' own OpenAPI documents (both
built in this process: the gateway over fake engine pools, as tests/harness/gateway.py builds it; no engine starts),
after a preamble on what the platform adds to OpenAI's API: headers, the `priority` field, errors and their codes."""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path
from typing import Iterator

from .markdown import banner, code, table

ROOT = Path(__file__).resolve().parents[2]
DOC_KEY = "sk-docs"  # with a key configured, the documents mark the routes that need one
# Where the gateway's errors are raised: its own package, the Batch and Files API it serves, and the shared helpers.
ERROR_SOURCES = ("services/gateway", "services/batch", "services/common", "services/serving")
# The error helpers of services/common/errors.py: where each takes its code and status (an argument's position, or fixed).
CODE_ARG = {"APIError": 4, "error_response": 4, "bad_request": 2, "sse_error": 2}
STATUS_ARG = {"APIError": 0, "error_response": 0}
FIXED_STATUS = {"bad_request": 400, "not_found": 404}
ROUTES_HEADERS = ("Method", "Path", "Summary", "Query", "Request body", "Responses", "Key")


def gateway_openapi() -> dict:
    """The gateway's document as `swiftkv serve` would serve it with the embedded default config and a keys file."""
    from services.batch.service import BatchService
    from services.common.keys import KeyStore, load_keys
    from services.config import load_config
    from services.gateway.app import Gateway, create_app
    from services.serving.fake import FakeBackend

    with tempfile.TemporaryDirectory() as data_dir:
        cfg = load_config(None, {"data_dir": data_dir})
        # no Prompter: building the app and its document never tokenizes, and so needs no model
        gateway = Gateway(cfg, {name: FakeBackend(name) for name in cfg.pools}, None, KeyStore(load_keys(DOC_KEY, None)))
        batch = BatchService(cfg)
        batch.attach(gateway)
        try:
            return create_app(gateway, [batch]).openapi()
        finally:
            batch.io.close()
            batch.store.close()
            gateway.cpu.shutdown()


def trainer_openapi() -> dict:
    from services.training.service import TrainerSettings, create_app

    with tempfile.TemporaryDirectory() as data_dir:
        keys = Path(data_dir) / "keys.yaml"
        keys.write_text(f"keys:\n  - key: {DOC_KEY}\n    name: docs\n")
        app = create_app(TrainerSettings(data_dir=data_dir, api_keys_file=str(keys)))
        try:
            return app.openapi()
        finally:
            app.state.service.io.close()
            app.state.service.store.close()


def _body(op: dict) -> str:
    parts = []
    for media, content in op.get("requestBody", {}).get("content", {}).items():
        schema = content.get("schema", {})
        if "$ref" in schema:
            parts.append(code(schema["$ref"].rsplit("/", 1)[-1]))
        else:
            fields = ", ".join(code(name) for name in schema.get("properties", {}))
            parts.append(f"{media}: {fields}" if fields else media)
    return "; ".join(parts)


def route_rows(doc: dict) -> Iterator[tuple[str, ...]]:
    needs_key = bool(doc.get("security"))
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            query = ", ".join(code(p["name"]) for p in op.get("parameters", []) if p.get("in") == "query")
            key = "yes" if needs_key and op.get("security") != [] else "no"
            yield (method.upper(), code(path), op.get("summary", ""), query, _body(op), ", ".join(op["responses"]), key)


def route_reasons() -> list[tuple[str, str]]:
    """The routing reasons as services/gateway/routing.py's docstring lists them (`  name   what it means`)."""
    from services.gateway import routing

    return re.findall(r"^  ([a-z_]+)\s{2,}(.+)$", routing.__doc__ or "", re.M)


def _helper_name(call: ast.Call) -> str | None:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name if name in CODE_ARG or name == "not_found" else None


def _argument(call: ast.Call, index: int | None, keyword: str) -> ast.expr | None:
    given = {k.arg: k.value for k in call.keywords}
    if keyword in given:
        return given[keyword]
    return call.args[index] if index is not None and index < len(call.args) else None


def _constants(node: ast.expr | None) -> list:
    """A literal argument's values (both branches of `a if c else b`); nothing for a computed one."""
    if isinstance(node, ast.Constant) and node.value is not None:
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _constants(node.body) + _constants(node.orelse)
    return []


def error_codes() -> dict[str, tuple[set[int], set[str]]]:
    """code -> (HTTP statuses, modules) of every literal error code the gateway's sources raise."""
    found: dict[str, tuple[set[int], set[str]]] = {}
    for source in ERROR_SOURCES:
        for file in sorted((ROOT / source).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                name = isinstance(node, ast.Call) and _helper_name(node)
                if not name:
                    continue
                if name == "not_found":  # not_found("file", ...) answers with the code file_not_found
                    codes = [f"{kind}_not_found" for kind in _constants(_argument(node, 0, "kind"))]
                else:
                    codes = _constants(_argument(node, CODE_ARG[name], "code"))
                statuses = [FIXED_STATUS[name]] if name in FIXED_STATUS else _constants(_argument(node, STATUS_ARG.get(name), "status"))
                for c in codes:
                    entry = found.setdefault(c, (set(), set()))
                    entry[0].update(s for s in statuses if isinstance(s, int))
                    entry[1].add(str(file.relative_to(ROOT)))
    return dict(sorted(found.items()))


def preamble() -> str:
    from services.config import BatchConfig
    from services.gateway.schemas import ChatCompletionRequest

    priority = ChatCompletionRequest.model_fields["priority"].default
    batch_priority = BatchConfig.model_fields["priority"].default
    return "\n".join([
        "## What the platform adds to OpenAI's API { #extensions }\n",
        "- **`x-swiftkv-route` response header.** Every generation response says where the request ran: "
        "`pool=<pool>`, then `; mode=<model>` when a dual-mode pool ran the other pool's model. Why it ran there goes to the "
        "metrics and the log, and into the header (`pool=<pool>; reason=<reason>; ratio=<prompt/output ratio>`) only where "
        "the operator sets `routing.expose_reason: true`: a `prefix` reason would tell one key what another sent. The "
        "reasons, as services/gateway/routing.py lists them:\n",
        table(("Reason", "Meaning"), ((code(r), m) for r, m in route_reasons())),
        f"- **`priority` request field** (chat and completions): an integer, default `{priority}`; lower runs first on "
        f"engines started with `scheduling_policy: priority`. Batch API requests run at `batch.priority` "
        f"(default `{batch_priority}`), after live ones.",
        "- **Errors** are OpenAI's envelope with the HTTP status: "
        '`{"error": {"message": "...", "type": "...", "param": "...", "code": "..."}}`; `param` names the request '
        "field at fault (or is null). An error after a stream has started arrives as one server-sent event with the "
        "same body.",
        "- **Keys.** With API keys configured, every route marked *Key: yes* wants `Authorization: Bearer <key>`.\n",
        "### Error codes\n",
        "The codes the gateway (with its Batch and Files API) answers with, found in its sources; errors without a "
        "code have `code: null`.\n",
        table(("Code", "HTTP status", "Raised in"), ((code(c), ", ".join(map(str, sorted(s))), ", ".join(code(f) for f in sorted(m)))
                                                      for c, (s, m) in error_codes().items())),
    ])


def http_api_page() -> str:
    return "\n".join([
        banner("HTTP API", "services/gateway/app.py", "services/batch/api.py", "services/training/service.py"),
        preamble(),
        "## Gateway (`swiftkv serve`) { #gateway }\n",
        table(ROUTES_HEADERS, route_rows(gateway_openapi())),
        "The machine-readable document is served at `/openapi.json`.\n",
        "## Trainer (`swiftkv trainer serve`) { #trainer }\n",
        table(ROUTES_HEADERS, route_rows(trainer_openapi())),
    ])
