"""Reference pages of the pydantic models people write by hand: the platform config (serving/config.md) and a
distillation job's hyperparameters with the trainer's settings (training/hyperparameters.md). Every field, with its
type and bounds, default and `Field(description=...)`, read from the models themselves."""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, Iterator, Literal, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .markdown import banner, code, docstring, table, value

FIELD_HEADERS = ("Key", "Type", "Default", "Description")
BOUNDS = {Ge: ("≥", "ge"), Gt: (">", "gt"), Le: ("≤", "le"), Lt: ("<", "lt")}
ITEM = "<name>"  # a key of a mapping of models (pools.<name>.model)


def type_name(annotation: Any) -> str:
    """A field's type as a YAML writer reads it: `int | null`, `"ngram" | "suffix"`, `dict[str, float]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    return ", ".join(f"{sign} {getattr(m, attr)}" for m in field.metadata for kind, (sign, attr) in BOUNDS.items()
                     if isinstance(m, kind))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        made = field.default_factory()
        return "" if isinstance(made, BaseModel) else value(made)  # a nested model: its own section lists the defaults
    return "required" if field.default is PydanticUndefined else value(field.default)


def nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field holds, and the key step to its fields: (Model, "") or, for a mapping of models, (Model, ITEM)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if typing.get_origin(annotation) is dict:
        inner = nested_model(typing.get_args(annotation)[1])
        return (inner[0], ITEM) if inner else None
    return None


def sections(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(key path, model) of `model` and of every model nested in it, depth first in field order."""
    yield path, model
    for name, field in model.model_fields.items():
        inner = nested_model(field.annotation)
        if inner:
            yield from sections(inner[0], ".".join(p for p in (path, name, inner[1]) if p))


def field_rows(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, str, str, str]]:
    for name, field in model.model_fields.items():
        bounds = _bounds(field)
        kind = type_name(field.annotation) + (f", {bounds}" if bounds else "")
        yield code(f"{path}.{name}" if path else name), code(kind), _default(field), field.description or ""


def model_reference(model: type[BaseModel]) -> str:
    """A section per model, nested ones included, each with its docstring and a table of its fields."""
    parts = []
    for key, section in sections(model):
        # stable anchors for links from the hand-written pages: config.md#routing, #pools-name-replicas
        anchor = re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-") or "top-level"
        name = f"`{key}`" if key else "Top level"
        doc = docstring(section)
        parts.append(f"## {name} ({section.__name__}) {{ #{anchor} }}\n\n" + (f"{doc}\n\n" if doc else "")
                     + table(FIELD_HEADERS, field_rows(section, key)))
    return "\n".join(parts)


def environment_reference(settings: type[BaseModel], also: type[BaseModel] | None = None) -> str:
    """A pydantic-settings class's variables: prefix + field name, upper case (`also`: a model whose same-named keys
    the variables override)."""
    prefix = settings.model_config.get("env_prefix", "")
    rows = []
    for name, field in settings.model_fields.items():
        overrides = f" Overrides the config's `{name}`." if also is not None and name in also.model_fields else ""
        rows.append((code(f"{prefix}{name}".upper()), code(type_name(field.annotation)), _default(field),
                     (field.description or "") + overrides))
    return (f"Read by `{settings.__module__}.{settings.__name__}`: prefix `{prefix}`.\n\n"
            + table(("Variable", "Type", "Default", "Description"), rows))


def config_page() -> str:
    """serving/config.md: the platform config (platform.yaml) and `swiftkv serve`'s environment variables."""
    from services import config
    from services.serve import ServeSettings

    return "\n".join([
        banner("Platform configuration", "services/config.py", "services/serve/settings.py"),
        docstring(config), "",
        "Keys are YAML key paths in the file `swiftkv serve --config` reads; `<name>` stands for a pool's name "
        "(`swiftkv` or `base`). A field without a description in the code has an empty one here.\n",
        model_reference(config.PlatformConfig),
        "## Environment variables of `swiftkv serve` { #environment-variables }\n",
        environment_reference(ServeSettings, also=config.PlatformConfig),
    ])


def hyperparameters_page() -> str:
    """training/hyperparameters.md: a distillation job's hyperparameters and `swiftkv trainer serve`'s settings."""
    from services.training import hyperparameters
    from services.training.service import TrainerSettings

    return "\n".join([
        banner("Distillation hyperparameters", "services/training/hyperparameters.py", "services/training/service.py"),
        docstring(hyperparameters), "",
        "## `method.distillation.hyperparameters` { #hyperparameters }\n",
        "What a fine-tuning job request (`POST /v1/fine_tuning/jobs`) may set.\n",
        table(FIELD_HEADERS, field_rows(hyperparameters.DistillationHyperparameters)),
        "## Trainer settings (`swiftkv trainer serve`) { #trainer-settings }\n",
        environment_reference(TrainerSettings),
    ])
