"""The OpenAPI document at /openapi.json: FastAPI's own for the routes it declares, plus what the routes that parse
their own bodies accept (request bodies from the pydantic schemas that validate them, query parameters), every
4xx/5xx as OpenAI's error envelope, and bearer keys. Clients and schema fuzzers (tests/test_fuzz.py) read it."""

from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ERROR_RESPONSE = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def ref(model: type[BaseModel] | str) -> dict:
    return {"$ref": f"#/components/schemas/{model if isinstance(model, str) else model.__name__}"}


def json_body(schema: dict, example: dict | None = None) -> dict:
    media = {"schema": schema} if example is None else {"schema": schema, "example": example}
    return {"required": True, "content": {"application/json": media}}


def query(name: str, schema: dict, description: str = "") -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def page_params(high: int) -> list[dict]:
    """`after` and `limit` of a list route (OpenAI's cursor pagination)."""
    return [query("after", {"type": "string"}, "the last id of the previous page"),
            query("limit", {"type": "integer", "minimum": 1, "maximum": high}, f"items per page, 1 to {high}")]


def upload_body(purposes: list[str]) -> dict:
    return {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": purposes}}}}}}


def document(app, operations: dict[tuple[str, str], dict[str, Any]], models: list[type[BaseModel]] = (), bearer: bool = False,
             public: tuple[str, ...] = ()) -> dict:
    """The app's OpenAPI document with `operations` ((method, path) -> fields of the operation) merged in; with
    `bearer`, every operation wants a key but those on the `public` paths."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    if models:
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
        schemas.update(defs.get("$defs", {}))
    schemas["Error"] = ERROR
    for (method, path), extra in operations.items():
        op = doc.setdefault("paths", {}).setdefault(path, {}).setdefault(method, {"responses": {"200": {"description": "OK"}}})
        extra = dict(extra)
        op["parameters"] = op.get("parameters", []) + extra.pop("parameters", [])
        op.update(extra)
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # bad input is a 400 in OpenAI's envelope here, never FastAPI's 422
            responses["4XX"] = {"description": "refused: OpenAI's error envelope, `param` names the field", **ERROR_RESPONSE}
            responses["5XX"] = {"description": "server error: OpenAI's error envelope", **ERROR_RESPONSE}
            if not op.get("parameters"):
                op.pop("parameters", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if bearer:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": "an API key"}}
        doc["security"] = [{"bearer": []}]
        for path in public:
            for op in doc["paths"].get(path, {}).values():
                op["security"] = []
    app.openapi_schema = doc
    return doc
