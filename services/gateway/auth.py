"""API keys (bearer, kept only as SHA-256 digests) and per-key token-aware rate limits."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import APIError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys(env_value: str | None, file: str | Path | None) -> set[str]:
    """Keys from a comma-separated env value and/or a file (one per line: the key itself or `sha256:<hex>`;
    `#` starts a comment). Only digests are kept."""
    entries: list[str] = []
    if env_value:
        entries += [k.strip() for k in env_value.split(",")]
    if file:
        for line in Path(file).read_text().splitlines():
            entries.append(line.split("#", 1)[0].strip())
    digests = set()
    for e in entries:
        if not e:
            continue
        if e.startswith("sha256:"):
            hexd = e[len("sha256:"):].lower()
            if len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
                raise ValueError("a sha256: key entry needs 64 hex digits")
            digests.add(hexd)
        else:
            digests.add(digest(e))
    return digests


class KeyStore:
    def __init__(self, digests: set[str]):
        self.digests = digests

    @classmethod
    def from_env(cls, file: str | None) -> "KeyStore":
        return cls(load_keys(os.environ.get("SWIFTKV_API_KEYS"), os.environ.get("SWIFTKV_API_KEYS_FILE") or file))

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


@dataclass
class Bucket:
    """Token bucket refilled continuously at capacity per minute."""

    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        missing = min(amount, self.capacity) - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.capacity


class RateLimiter:
    """Per key: requests, prompt tokens and output tokens per minute. Output tokens are reserved up front
    (max_tokens or the expected output) and the unused part is given back when the request ends."""

    KINDS = ("requests", "prompt_tokens", "output_tokens")

    def __init__(self, requests_per_minute: int | None, prompt_tokens_per_minute: int | None, output_tokens_per_minute: int | None):
        self.limits = dict(zip(self.KINDS, (requests_per_minute, prompt_tokens_per_minute, output_tokens_per_minute)))
        self.buckets: dict[str, dict[str, Bucket]] = {}

    @property
    def enabled(self) -> bool:
        return any(self.limits.values())

    def acquire(self, identity: str, prompt_tokens: int, output_tokens: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        buckets = self.buckets.get(identity)
        if buckets is None:
            buckets = self.buckets[identity] = {k: Bucket(v, v, now) for k, v in self.limits.items() if v}
        need = {"requests": 1, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
        waits = {}
        for kind, bucket in buckets.items():
            bucket.refill(now)
            waits[kind] = bucket.wait_for(need[kind])
        kind, wait = max(waits.items(), key=lambda kv: kv[1])
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise APIError(429, f"rate limit reached for {kind.replace('_', ' ')} per minute "
                                f"(limit {self.limits[kind]}); retry after {retry}s",
                           "requests" if kind == "requests" else "tokens", code="rate_limit_exceeded",
                           headers={"Retry-After": str(retry)})
        for kind, bucket in buckets.items():
            bucket.level -= min(need[kind], bucket.capacity)

    def settle(self, identity: str, reserved_output: int, actual_output: int) -> None:
        bucket = self.buckets.get(identity, {}).get("output_tokens")
        if bucket is not None and actual_output < reserved_output:
            bucket.level = min(bucket.capacity, bucket.level + reserved_output - actual_output)
