"""A batch input file -> its requests, or the errors that fail the batch (each naming its line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
MAX_REPORTED_ERRORS = 100  # a file with thousands of bad lines fails with the first ones named


@dataclass
class Line:
    number: int  # 1-based line of the input file
    custom_id: str
    body: dict


def error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(path: Path, endpoint: str, max_lines: int) -> tuple[list[Line], list[dict]]:
    lines: list[Line] = []
    errors: list[dict] = []
    seen: dict[str, int] = {}
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            count += 1
            if count > max_lines:
                return [], [error("too_many_requests", f"the file has more than {max_lines} requests; the limit is {max_lines}",
                                  number)]
            problem = _check(raw, number, endpoint, seen)
            if isinstance(problem, Line):
                lines.append(problem)
            elif len(errors) < MAX_REPORTED_ERRORS:
                errors.append(problem)
    if count == 0 and not errors:
        errors.append(error("empty_file", "the input file has no requests"))
    return (lines, []) if not errors else ([], errors)


def _check(raw: bytes, number: int, endpoint: str, seen: dict[str, int]) -> Line | dict:
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return error("invalid_json_line", f"line {number} is not valid JSON: {e}", number)
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
    body = item.get("body")
    if not isinstance(body, dict):
        return error("missing_required_parameter", f"line {number}: body must be a JSON object", number, "body")
    if custom_id in seen:
        return error("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was already used on line {seen[custom_id]}",
                     number, "custom_id")
    seen[custom_id] = number
    return Line(number, custom_id, body)
