"""OpenAI's own schema as a test oracle: `assert_openai_shape(obj, openai_type)` checks a response body (a dict parsed
from JSON, or an object the official `openai` client returned) against a type of the `openai` package, whose models
are generated from OpenAI's OpenAPI document (`openai.types.chat.ChatCompletion`, `ChatCompletionChunk`,
`openai.types.Completion`, `FileObject`, `Batch`, `openai.types.fine_tuning.FineTuningJob`, `openai.types.responses.
Response`, a stream event union such as `ResponseStreamEvent`, ...).

Validating is not enough: the package's pydantic models accept unknown fields silently (into `model_extra`), so a
misspelt or invented field would pass. After validating, every nested model is walked and any field OpenAI's schema
does not have fails the check, with its path. The platform's documented extensions are the only exceptions, each
listed in ALLOWED_EXTENSIONS with why it is there; a value at an allowed path is exempt from OpenAI's schema (it is
checked by the platform's own tests). ALLOWED_NULLS lists the few places where OpenAI's own answers carry a null its
OpenAPI document does not type (each with why)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

# (the OpenAI type's name, the field's path in it with [] for any list index) -> why the platform sends it
ALLOWED_EXTENSIONS: dict[tuple[str, str], str] = {
    ("FineTuningJob", "method"): "the distillation service's jobs have method {'type': 'distillation', 'distillation': "
                                 "{'hyperparameters': ...}} (docs/training/index.md): SwiftKV's knowledge-preserving "
                                 "distillation, which OpenAI's Method (supervised, dpo, reinforcement) has no type for",
}

# (the OpenAI type's name, the field's path) -> (a value the type takes, why OpenAI itself sends null there): a null at
# the path is checked as that value; any other value is checked as it is
ALLOWED_NULLS: dict[tuple[str, str], tuple[Any, str]] = {
    ("Completion", "choices[].finish_reason"): ("stop", "OpenAI streams text_completion chunks, which the SDK types as "
                                                "Completion, with finish_reason null until the choice ends; the "
                                                "OpenAPI document types only the final value"),
}


def _as_data(obj: Any) -> Any:
    """The JSON the server sent: an `openai` client object keeps exactly the fields it was given (to_dict with
    exclude_unset), unknown ones included."""
    if isinstance(obj, BaseModel):
        to_dict = getattr(obj, "to_dict", None)
        return to_dict(mode="json", exclude_unset=True) if to_dict else obj.model_dump(mode="json", exclude_unset=True)
    return obj


def _type_name(openai_type: Any) -> str:
    name = getattr(openai_type, "__name__", None)
    return name if name and name != "Annotated" else str(openai_type)


def _exempt(data: Any, path: list[str]) -> int:
    """Remove the value at `path` (with [] for every list item) from `data`; how many were removed."""
    if not path:
        return 0
    head, rest = path[0], path[1:]
    if head == "[]":
        return sum(_exempt(item, rest) for item in data) if isinstance(data, list) else 0
    if not isinstance(data, dict) or head not in data:
        return 0
    if not rest:
        del data[head]
        return 1
    return _exempt(data[head], rest)


def _stand_in(data: Any, path: list[str], value: Any) -> None:
    """Replace a null at `path` (with [] for every list item) by `value`."""
    if not path:
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        for item in data if isinstance(data, list) else []:
            _stand_in(item, rest, value)
    elif isinstance(data, dict) and head in data:
        if rest:
            _stand_in(data[head], rest, value)
        elif data[head] is None:
            data[head] = value


def _split(path: str) -> list[str]:
    return [part for part in path.replace("[]", ".[]").split(".") if part]


def unknown_fields(value: Any, path: str = "") -> list[str]:
    """The paths of every field some nested model of a validated `value` took into model_extra."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        for name in (value.model_extra or {}):
            found.append(f"{path}.{name}" if path else name)
        for name in type(value).model_fields:
            found += unknown_fields(getattr(value, name, None), f"{path}.{name}" if path else name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found += unknown_fields(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            found += unknown_fields(item, f"{path}.{key}" if path else str(key))
    return found


def assert_openai_shape(obj: Any, openai_type: Any, allowed: dict[tuple[str, str], str] | None = None) -> Any:
    """Validate `obj` (a dict, or an `openai` client object) against `openai_type` (a model class of the `openai`
    package, or a union of them such as a stream event type) and fail on any field OpenAI's schema does not have,
    except the documented extensions (ALLOWED_EXTENSIONS, plus `allowed` for a test's own; keys are (the type's name,
    the field's path)). Returns the validated object."""
    import copy

    data = copy.deepcopy(_as_data(obj))
    name = _type_name(openai_type)
    for (type_name, path), _why in {**ALLOWED_EXTENSIONS, **(allowed or {})}.items():
        if type_name == name:
            _exempt(data, _split(path))
    for (type_name, path), (value, _why) in ALLOWED_NULLS.items():
        if type_name == name:
            _stand_in(data, _split(path), value)
    try:
        validated = TypeAdapter(openai_type).validate_python(data)
    except ValidationError as e:
        raise AssertionError(f"not a valid {name} by OpenAI's schema: {e}\n{data}") from None
    extra = unknown_fields(validated)
    shown = type(validated).__name__ if isinstance(validated, BaseModel) else name  # a union: the member it matched
    assert not extra, f"fields OpenAI's {shown} does not have: {', '.join(extra)}\n{data}"
    return validated
