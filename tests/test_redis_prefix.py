"""Releases sharing one Redis keep their own per-key limits: every Redis key carries PlatformConfig.redis_prefix,
which the Helm chart sets to the release's name (real Redis at 127.0.0.1:6379; the chart through `helm template`)."""

from __future__ import annotations

import secrets

import pytest
import yaml
from harness.deploy import CHART, find, run, tool

from services.common.errors import APIError
from services.config import PlatformConfig
from services.gateway.rate_limits import RedisRateLimiter

REDIS = "redis://127.0.0.1:6379/0"


async def test_two_prefixes_do_not_share_a_bucket():
    pytest.importorskip("redis")
    key = f"sk-{secrets.token_hex(8)}"  # the same key in two releases
    one = RedisRateLimiter(REDIS, 2, None, None, prefix=f"rel-a-{secrets.token_hex(3)}")
    two = RedisRateLimiter(REDIS, 2, None, None, prefix=f"rel-b-{secrets.token_hex(3)}")
    for _ in range(2):
        await one.acquire(key, 1, 1)
    with pytest.raises(APIError):
        await one.acquire(key, 1, 1)  # release a's bucket is empty
    await two.acquire(key, 1, 1)  # release b's is not
    assert one.down_since is None and two.down_since is None  # both answered by Redis, not by local buckets
    import redis

    r = redis.Redis.from_url(REDIS)
    assert float(r.hget(f"{one.PREFIX}{key}:requests", "level")) < 1
    assert float(r.hget(f"{two.PREFIX}{key}:requests", "level")) >= 1
    assert RedisRateLimiter(REDIS, 1, None, None).PREFIX == "swiftkv:ratelimit:"  # the default keys are unchanged


def test_redis_prefix_defaults_and_refuses_a_separator():
    pools = {"base": {"model": "m"}}
    assert PlatformConfig(pools=pools).redis_prefix == "swiftkv"
    with pytest.raises(ValueError, match="redis_prefix"):
        PlatformConfig(pools=pools, redis_prefix="a:b")


def test_the_chart_renders_the_release_name_as_the_redis_prefix():
    out = run(tool("helm"), "template", "team-b", CHART, "--namespace", "llm").stdout
    cm = find([d for d in yaml.safe_load_all(out) if d], "ConfigMap", "platform")[0]
    cfg = PlatformConfig.model_validate(yaml.safe_load(cm["data"]["platform.yaml"]))
    assert cfg.redis_prefix == "team-b"


def test_the_live_traffic_channel_carries_the_prefix():
    from services.batch.live import SharedLiveTraffic

    assert SharedLiveTraffic(REDIS, {}, 1.0, "team-b").channel == "team-b:live"
    assert SharedLiveTraffic(REDIS, {}, 1.0).channel == "swiftkv:live"  # the default, as before
