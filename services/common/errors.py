"""OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}` with the matching status, for every service."""

from __future__ import annotations

import json

from starlette.responses import Response


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(error_body(message, type, param, code)), status_code=status, media_type="application/json", headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(kind: str, id_: str, param: str | None = None) -> APIError:
    """A 404 naming what was looked for (`file_not_found`, `batch_not_found`, ...); another key's object is one too."""
    return APIError(404, f"no such {kind}: {id_[:64]}", param=param, code=f"{kind}_not_found")


def sse_error(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An error inside an already-started stream: sent as one event, like OpenAI does."""
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()
