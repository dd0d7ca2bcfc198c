"""A limit changed by a reload of the keys file applies to the key's next request in the Redis limiter too (the
real Redis at 127.0.0.1:6379): it reads the running KeyStore per request and sends the new capacity to Redis."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest
import yaml

from services.common.errors import APIError
from services.common.keys import KeyStore, digest
from services.gateway.rate_limits import RedisRateLimiter

pytestmark = pytest.mark.shares("redis")

REDIS = "redis://127.0.0.1:6379/0"


def write(path, entries) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"keys": entries}))
    os.replace(tmp, path)


def test_the_redis_limiter_applies_a_reloaded_limit_to_the_next_request(tmp_path):
    key = f"sk-redis-{secrets.token_hex(4)}"  # fresh buckets in Redis
    f = tmp_path / "keys.yaml"
    write(f, [{"key": key, "limits": {"requests_per_minute": 1}}])
    store = KeyStore.from_env(str(f))
    limiter = RedisRateLimiter(REDIS, None, None, None, store, prefix=f"test-keys-{secrets.token_hex(3)}")

    async def run():
        await limiter.acquire(digest(key), 1, 1)
        with pytest.raises(APIError) as e:
            await limiter.acquire(digest(key), 1, 1)
        assert "limit 1" in e.value.message
        write(f, [{"key": key, "limits": {"requests_per_minute": 6000}}])
        assert store.check() is True
        await asyncio.sleep(0.05)  # refilling at 100 a second
        await limiter.acquire(digest(key), 1, 1)

    asyncio.run(run())
    assert limiter.down_since is None  # it went through Redis


