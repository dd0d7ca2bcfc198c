"""API keys (bearer, kept only as SHA-256 digests) with their per-key limits, and who a request's key names: the
gateway, the Batch API and the trainer share one set of keys, so a key sees the same objects everywhere."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from .errors import APIError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


LIMIT_FIELDS = ("requests_per_minute", "prompt_tokens_per_minute", "output_tokens_per_minute")
# The most urgent engine priority a key's requests may ask for (lower runs first; live traffic's default is 0):
# 0 unless an operator trusts the key with less, so no tenant jumps the others' queue.
MIN_PRIORITY = "min_priority"
INT32_MIN = -(2**31)


def _setting(option: str) -> tuple[str, int]:
    """`name=value` of a key's line -> (name, value): a limit is a positive integer, min_priority one in [-2**31, 0]."""
    name, _, value = option.partition("=")
    digits = value.removeprefix("-") if name == MIN_PRIORITY else value
    if digits.isascii() and digits.isdigit():  # '²' is a digit int() refuses
        number = int(value)
        if (name in LIMIT_FIELDS and number >= 1) or (name == MIN_PRIORITY and INT32_MIN <= number <= 0):
            return name, number
    raise ValueError(f"bad key option {option!r}: expected one of {', '.join(LIMIT_FIELDS)} = a positive integer, "
                     f"or {MIN_PRIORITY} = an integer from {INT32_MIN} to 0")


def load_keys(env_value: str | None, file: str | Path | None) -> dict[str, dict[str, int]]:
    """Keys from a comma-separated env value and/or a file. A file line is the key itself or `sha256:<hex>`,
    optionally followed by per-key settings: limits (`requests_per_minute=60 prompt_tokens_per_minute=100000
    output_tokens_per_minute=20000`) and `min_priority=-10` (a trusted key's requests may ask for priority down to
    it; default 0); `#` starts a comment. Only digests are kept: digest -> settings."""
    lines: list[str] = []
    if env_value:
        lines += [k.strip() for k in env_value.split(",")]
    if file:
        lines += [line.split("#", 1)[0].strip() for line in Path(file).read_text().splitlines()]
    keys: dict[str, dict[str, int]] = {}
    for line in lines:
        if not line:
            continue
        key, *options = line.split()
        limits = dict(_setting(option) for option in options)
        if key.startswith("sha256:"):
            hexd = key[len("sha256:"):].lower()
            if len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
                raise ValueError("a sha256: key entry needs 64 hex digits")
            keys[hexd] = limits
        else:
            keys[digest(key)] = limits
    return keys


class KeyStore:
    def __init__(self, digests: dict[str, dict[str, int]]):
        self.digests = digests  # digest -> per-key settings (limit overrides, min_priority)

    @classmethod
    def from_env(cls, file: str | None) -> "KeyStore":
        """Keys from SWIFTKV_API_KEYS plus `file`, which the caller resolved (flag, then environment, then config)."""
        return cls(load_keys(os.environ.get("SWIFTKV_API_KEYS"), file))

    def min_priority(self, identity: str) -> int:
        """The lowest priority value (the most urgent) this key's requests may ask for."""
        return self.digests.get(identity, {}).get(MIN_PRIORITY, 0)

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def identify(self, authorization: str | None) -> str:
        """The caller's identity (key digest); raises 401 when keys are configured and this one is not valid."""
        if not self.enabled:
            return "anonymous"
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error", code="invalid_api_key")
        d = digest(authorization[7:].strip())
        for known in self.digests:
            if hmac.compare_digest(d, known):
                return d
        raise APIError(401, "invalid API key", "invalid_request_error", code="invalid_api_key")
