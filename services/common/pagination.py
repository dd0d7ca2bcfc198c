"""OpenAI's list routes: a page of objects (`first_id`, `last_id`, `has_more`), the `after` cursor, and the query
parameters a list route takes (anything else is refused, not ignored)."""

from __future__ import annotations

from starlette.requests import Request

from .errors import bad_request
from .ids import ID
from .validation import describe


def page(objects: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": objects, "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None, "has_more": has_more}


def only_query(request: Request, *names: str) -> None:
    """Unknown query parameters are refused, like unknown body fields (a misspelt `limit` is not silently ignored)."""
    for name in request.query_params:
        if name not in names:
            raise bad_request(f"unsupported query parameter '{name}'; this route takes {', '.join(names)}", param=name)


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only: str.isdigit() also holds for '²', which int() refuses, and 5,000 digits are too many for int()
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9 and low <= int(raw) <= high):
        raise bad_request(f"{name} must be an integer from {low} to {high}; got {describe(raw)}", param=name)
    return int(raw)


def cursor(request: Request) -> str | None:
    """`after`: the last id of the previous page."""
    after = request.query_params.get("after")
    if after is not None and not ID.fullmatch(after):
        raise bad_request(f"after must be an id from the previous page (letters, digits, '-' and '_'); got {describe(after)}",
                          param="after")
    return after
