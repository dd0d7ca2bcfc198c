"""deploy/helm-values.md: every key of the Helm chart's values, from its JSON schema (type, bounds, description) and
its values.yaml (the default)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import yaml

from .markdown import banner, code, table, value

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "swiftkv"
SCHEMA, VALUES = CHART / "values.schema.json", CHART / "values.yaml"
ANY_KEY, ANY_ITEM = "<name>", "[]"  # path steps of a map's values (additionalProperties) and of a list's items
BOUNDS = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))


def load() -> tuple[dict, dict]:
    return json.loads(SCHEMA.read_text()), yaml.safe_load(VALUES.read_text()) or {}


def schema_paths(schema: dict, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict]]:
    """(path, schema) of every key the schema describes below `schema`, parents before children."""
    for name, sub in schema.get("properties", {}).items():
        yield path + (name,), sub
        yield from schema_paths(sub, path + (name,))
    for step, key in ((ANY_KEY, "additionalProperties"), (ANY_ITEM, "items")):
        sub = schema.get(key)
        if isinstance(sub, dict) and (sub.get("properties") or sub.get("additionalProperties") or sub.get("items")):
            yield from schema_paths(sub, path + (step,))


def type_text(schema: dict) -> str:
    if "const" in schema:
        return json.dumps(schema["const"])
    kinds = schema.get("type", [])
    text = " | ".join(json.dumps(e) for e in schema["enum"]) if "enum" in schema else " | ".join([kinds] if isinstance(kinds, str) else kinds)
    bounds = [f"{sign} {schema[key]}" for key, sign in BOUNDS if key in schema]
    return ", ".join([text or "any", *bounds])


def _children(schema: dict) -> bool:
    return any(True for _ in schema_paths(schema))


def default_at(values: Any, path: tuple[str, ...], schema: dict) -> str:
    """values.yaml's value at `path`, per key of the maps on the way (`swiftkv: ..., base: ...`); none where rows below
    give it piece by piece, or inside a list."""
    if _children(schema) or ANY_ITEM in path:
        return ""
    found = [((), values)]  # (the map keys chosen on the way, the value there)
    for step in path:
        following = []
        for keys, here in found:
            if isinstance(here, dict) and step == ANY_KEY:
                following += [(keys + (k,), v) for k, v in here.items()]
            elif isinstance(here, dict) and step in here:
                following.append((keys, here[step]))
        found = following
    return ", ".join(f"{'.'.join(keys)}: {value(v)}" if keys else value(v) for keys, v in found)


def rows(schema: dict, values: Any, leaves: bool = False) -> list[tuple[str, str, str, str]]:
    return [(code(".".join(path)), code(type_text(sub)), default_at(values, path, sub), sub.get("description", ""))
            for path, sub in schema_paths(schema) if not (leaves and _children(sub))]


def helm_values_page() -> str:
    schema, values = load()
    root = CHART.parents[2]
    parts = [banner("Helm values", str(SCHEMA.relative_to(root)), str(VALUES.relative_to(root))),
             f"Every value of the `{CHART.name}` chart: `helm install ... -f my-values.yaml` or `--set key=value`. "
             f"`{ANY_KEY}` stands for any key of a map, `{ANY_ITEM}` for any item of a list; Helm refuses values the "
             "schema does not allow.\n",
             table(("Key", "Type", "Default", "Description"), rows(schema, values))]
    if "if" in schema:  # a rule that holds for some values only (e.g. one gateway replica with SQLite)
        rule = [(key, kind) for key, kind, _, _ in rows(schema["if"], {}, leaves=True)]
        then = [(key, kind, why) for key, kind, _, why in rows(schema.get("then", {}), {}, leaves=True)]
        parts += ["## Conditional rules\n", "When the values match:\n", table(("Key", "Value"), rule),
                  "\nthey must also satisfy:\n", table(("Key", "Allowed", "Why"), then)]
    return "\n".join(parts)
