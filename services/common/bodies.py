"""JSON request bodies, read the same way by every service (the gateway's routes, the Batch API, the trainer): at most
`max_bytes` (a 413, refused from Content-Length before reading when declared), within `timeout_seconds` (a 408); both
close the connection, so the rest of the body is never read. Then decoded, with its two hazards for what runs after
validation refused as 400s naming the field (`check_tree`), on a worker thread when the body is large."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Awaitable, Callable

from starlette.requests import Request

from .errors import APIError, bad_request
from .validation import MAX_JSON_DEPTH, describe

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")
CLOSE = {"Connection": "close"}  # a refusal before the whole body was read: the rest is never read

# Bodies up to this size are decoded and validated on the event loop (a few ms at worst: 16 kB of tiny arrays); larger
# ones on a worker thread (a hop of tens of microseconds), so up to a megabyte of JSON (1 MB of tiny arrays: 250 ms of
# decoding and checks) never stalls the other requests for the whole of it.
SMALL_BODY_BYTES = 16 * 1024


@dataclass(frozen=True)
class BodyLimits:
    """A service's bounds on a JSON body, and the names of the settings that set them (said in the refusals)."""

    max_bytes: int
    timeout_seconds: float
    max_bytes_setting: str = "limits.max_body_bytes"
    timeout_setting: str = "limits.body_timeout_seconds"


def check_tree(data: object, text: str | None = None) -> None:
    """A decoded JSON body's two hazards for what runs after validation: nesting past MAX_JSON_DEPTH (recursion
    in serializers, chat templates and grammar converters) and lone UTF-16 surrogates ("\\ud800": valid JSON,
    but no UTF-8 for the tokenizer or any native library). Either is a 400 naming the field. `text`, the body
    itself, skips the walk when it cannot hold either."""
    surrogates = text is None or _SURROGATE_ESCAPE.search(text) is not None
    if not surrogates and text.count("{") + text.count("[") <= MAX_JSON_DEPTH:
        return
    stack: list[tuple[object, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                _bad_string(path)
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"{path[0]} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                              param=str(path[0]), code="invalid_value")
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if surrogates and isinstance(key, str) and _SURROGATE.search(key):
                _bad_string((*path, key))
            if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str)):
                stack.append((item, (*path, key), depth + 1))


def _bad_string(path: tuple) -> None:
    param = ".".join(str(p) for p in path) or None
    raise bad_request(f"{param or 'the body'} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                      "which is no Unicode text; escape characters outside the BMP as a surrogate pair",
                      param=param, code="invalid_value")


def decode(body: bytes) -> object:
    """A JSON body's bytes -> its value, checked by `check_tree`; what is not JSON is a 400."""
    try:
        text = body.decode(json.detect_encoding(body))  # what json.loads(bytes) would decode
        data = json.loads(text)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad_request(f"malformed JSON body: {e}", code="invalid_json")
    except RecursionError:
        raise bad_request("the JSON body nests objects and arrays too deeply", code="invalid_json")
    check_tree(data, text)
    return data


async def receive(request: Request, limits: BodyLimits) -> bytes:
    """The body's bytes: more than limits.max_bytes is a 413 (refused from Content-Length before reading when
    declared), a body still arriving after limits.timeout_seconds a 408; both close the connection."""
    limit = limits.max_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit} bytes ({limits.max_bytes_setting})",
                       code="request_too_large", headers=CLOSE)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.timeout_seconds):
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes ({limits.max_bytes_setting})",
                                   code="request_too_large", headers=CLOSE)
    except TimeoutError:
        raise APIError(408, f"request body not received within {limits.timeout_seconds:g} s ({limits.timeout_setting})",
                       code="request_timeout", headers=CLOSE) from None
    return b"".join(chunks)


async def by_size(size: int, off_loop: Callable[..., Awaitable], fn, *args):
    """`fn(*args)` for a body of `size` bytes: here for a small one (the hop to a worker thread would cost more),
    through `off_loop` for a large one or one of unknown size (0), where its cost holds no other request up."""
    return fn(*args) if 0 < size <= SMALL_BODY_BYTES else await off_loop(fn, *args)


async def read_object(request: Request, limits: BodyLimits, off_loop: Callable[..., Awaitable]) -> dict:
    """The body as a JSON object (`receive`, then `decode`), else a 4xx."""
    body = await receive(request, limits)
    data = await by_size(len(body), off_loop, decode, body)
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object; got {describe(data)}")
    return data
