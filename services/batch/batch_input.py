"""A batch input file -> its requests, or the errors that fail the batch (each naming its line).

Validation keeps no request bodies: a body parsed into Python objects takes up to ~25 times its bytes
(`[{},{},...]`), so a whole file's would not fit in memory. Each `Line` keeps where its bytes are, and the
runner reads the body again (`read_body`) when the line runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.uploads import jsonl_lines
from services.common.validation import MAX_JSON_DEPTH, too_deep

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}
MAX_REPORTED_ERRORS = 100  # a file with thousands of bad lines fails with the first ones named


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based line of the input file
    offset: int  # where its bytes start in the file
    size: int  # and how many there are
    custom_id: str


def error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(path: Path, endpoint: str, max_lines: int, max_line_bytes: int) -> tuple[list[Line], list[dict]]:
    """Check every line in one pass, holding one line at a time."""
    lines: list[Line] = []
    errors: list[dict] = []
    seen: dict[str, int] = {}
    count = 0
    with open(path, "rb") as f:
        for number, offset, raw in jsonl_lines(f, max_line_bytes):
            if raw is not None and not raw.strip():
                continue
            count += 1
            if count > max_lines:
                return [], [error("too_many_requests", f"the file has more than {max_lines} requests; the limit is {max_lines}",
                                  number)]
            if raw is None:
                problem = error("line_too_large", f"line {number} has more than {max_line_bytes} bytes; a line is limited "
                                f"to {max_line_bytes} bytes (batch.max_line_bytes)", number)
            else:
                problem = _check(raw, number, offset, endpoint, seen)
            if isinstance(problem, Line):
                if not errors:  # once the batch fails, only its errors are wanted
                    lines.append(problem)
            else:
                lines.clear()
                if len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(problem)
    if count == 0 and not errors:
        errors.append(error("empty_file", "the input file has no requests"))
    return (lines, []) if not errors else ([], errors)


def read_body(path: Path, line: Line) -> dict:
    """The body of a line that `parse_input` accepted."""
    with open(path, "rb") as f:
        f.seek(line.offset)
        return json.loads(f.read(line.size))["body"]


def _check(raw: bytes, number: int, offset: int, endpoint: str, seen: dict[str, int]) -> Line | dict:
    try:
        item = json.loads(raw)
    except Exception as e:  # any failure to parse (bad UTF-8, bad JSON, RecursionError from deep nesting) is the line's
        return error("invalid_json_line", f"line {number} is not valid JSON: {e}", number)
    if too_deep(item, raw, MAX_JSON_DEPTH + 1):  # the line's object holds the body, which may nest MAX_JSON_DEPTH
        return error("invalid_json_line", f"line {number} nests objects and arrays more than {MAX_JSON_DEPTH + 1} levels deep", number)
    if not isinstance(item, dict):
        return error("invalid_json_line", f"line {number} is not a JSON object", number)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return error("missing_required_parameter", f"line {number}: custom_id must be a non-empty string", number, "custom_id")
    if len(custom_id) > 512:
        return error("invalid_value", f"line {number}: custom_id is longer than 512 characters", number, "custom_id")
    if item.get("method") != "POST":
        return error("invalid_value", f"line {number}: method must be 'POST'", number, "method")
    if item.get("url") != endpoint:
        return error("mismatched_url", f"line {number}: url {item.get('url')!r} differs from the batch's endpoint {endpoint!r}",
                     number, "url")
    if not isinstance(item.get("body"), dict):
        return error("missing_required_parameter", f"line {number}: body must be a JSON object", number, "body")
    if custom_id in seen:
        return error("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was already used on line {seen[custom_id]}",
                     number, "custom_id")
    seen[custom_id] = number
    return Line(number, offset, len(raw), custom_id)
