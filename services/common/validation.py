"""Checks of request fields the services share, with messages that say what the client sent."""

from __future__ import annotations

from .errors import bad_request

MAX_JSON_DEPTH = 100  # objects and arrays nested in a body (vLLM's own bound on a schema is 64 levels)


def too_deep(value: object, text: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether decoded JSON nests objects and arrays more than `limit` levels. Decided here, not by json's
    RecursionError, whose depth is the process's recursion limit (which libraries raise: torch, hypothesis);
    `text`, the JSON itself, skips the walk when it holds too few brackets to nest that deep."""
    opening = ("{", "[") if isinstance(text, str) else (b"{", b"[")
    if text.count(opening[0]) + text.count(opening[1]) <= limit:
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((item, depth + 1) for item in (node.values() if isinstance(node, dict) else node))
    return False


def describe(value: object) -> str:
    """What a client sent, for messages: the JSON type, or a short string."""
    if isinstance(value, str):
        return repr(value if len(value) <= 64 else value[:64] + "...")
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (dict, "an object"), (list, "an array")):
        if isinstance(value, kind):
            return name
    return "null"


def choice(value: object, name: str, allowed) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise bad_request(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {describe(value)}", param=name)
    return value


def check_metadata(metadata: object) -> dict | None:
    """OpenAI's metadata: at most 16 keys of up to 64 characters, each a string of up to 512 characters, or null."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        got = f"{len(metadata)} keys" if isinstance(metadata, dict) else describe(metadata)
        raise bad_request(f"metadata must be an object of at most 16 keys, or null; got {got}", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise bad_request(f"metadata keys are at most 64 characters; got {describe(key)}", param="metadata")
        if not isinstance(value, str) or len(value) > 512:
            raise bad_request(f"metadata values are strings of at most 512 characters; {key!r} is {describe(value)}",
                              param=f"metadata.{key}")
    return metadata
