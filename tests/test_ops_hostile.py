"""Operations: what the gateway tells Kubernetes and Prometheus while pools go down, and what `swiftkv serve`
prints about its stores. In-process, against fake backends; no engine."""

from __future__ import annotations

import asyncio

import httpx
from harness import FakeBackend
from typer.testing import CliRunner

from services.common.keys import KeyStore, digest
from services.config import PlatformConfig

KEY = "sk-ops"


def test_one_pool_down_the_gateway_stays_live_and_ready(tiny_base):
    """With one pool's engines down the gateway is live (/health 200) and ready (/ready 200: the other pool serves
    every request, reason fallback), the body and swiftkv_pool_ready say which pool is down, /metrics answers
    without a key while the API wants one; with no pool up it is not ready but still live (no restart)."""
    from services.gateway.app import Gateway, create_app
    from services.gateway.prompts import Prompter

    pool_cfg = {"model": str(tiny_base), "engine_args": {"max_model_len": 64}}
    cfg = PlatformConfig(model="m", pools={"swiftkv": pool_cfg, "base": pool_cfg}, health={"period_seconds": 3600},
                         routing={"expose_reason": True})  # the route's reason in the header, read below
    backends = {"swiftkv": FakeBackend("swiftkv", up=False), "base": FakeBackend("base")}
    gateway = Gateway(cfg, backends, Prompter(str(tiny_base)), KeyStore({digest(KEY): {}}))
    auth = {"Authorization": f"Bearer {KEY}"}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw") as c:
            assert (await c.get("/health")).status_code == 200  # starting: live, not ready
            r = await c.get("/ready")
            assert r.status_code == 503 and r.json()["started"] is False
            await gateway.start()
            try:
                assert (await c.get("/health")).json() == {"status": "ok"}
                r = await c.get("/ready")
                assert r.status_code == 200
                assert r.json() == {"ready": True, "started": True, "pools": {"swiftkv": False, "base": True}}
                r = await c.post("/v1/completions", headers=auth, json={"model": "m", "prompt": "hello " * 20, "max_tokens": 1})
                assert r.status_code == 200 and "pool=base; reason=fallback" in r.headers["x-swiftkv-route"]
                assert (await c.get("/v1/models")).status_code == 401
                metrics = await c.get("/metrics")  # no key: Prometheus scrapes it as it scrapes vLLM
                assert metrics.status_code == 200
                assert 'swiftkv_pool_ready{pool="swiftkv"} 0.0' in metrics.text
                assert 'swiftkv_pool_ready{pool="base"} 1.0' in metrics.text

                gateway.lifecycle.set_ready(gateway.pools["base"], False)  # now no pool can serve
                r = await c.get("/ready")
                assert r.status_code == 503 and r.json()["pools"] == {"swiftkv": False, "base": False}
                assert (await c.get("/health")).status_code == 200
            finally:
                await gateway.stop()

    asyncio.run(run())


DATABASE = "postgresql://swiftkv:db-s3cret@127.0.0.1:9/swiftkv"
REDIS = "redis://:redis-s3cret@127.0.0.1:9/0"


def serve(tmp_path, config: str):
    from services.cli import app

    (tmp_path / "platform.yaml").write_text(config)
    return CliRunner().invoke(app, ["serve", "--engine", "inprocess", "--config", str(tmp_path / "platform.yaml"),
                                    "--database-url", DATABASE, "--redis-url", REDIS, "--data-dir", str(tmp_path)])


def test_an_unreachable_database_is_named_without_its_password(tmp_path):
    r = serve(tmp_path, "model: m\npools:\n  base: {backend: remote, url: 'http://127.0.0.1:9/v1', model: x}\n")
    assert r.exit_code == 2, r.output
    assert "batch store (postgresql://swiftkv:***@127.0.0.1:9/swiftkv)" in r.output and "s3cret" not in r.output


def test_a_config_error_does_not_repeat_the_store_urls(tmp_path):
    """pydantic's own message repeats the whole input, database and Redis URLs (and their passwords) included."""
    r = serve(tmp_path, "model: m\npools:\n  base: {backend: remote, url: 'http://127.0.0.1:9/v1', model: x, served_model_name: m}\n")
    assert r.exit_code == 2 and "model names must be distinct" in r.output, r.output
    assert "s3cret" not in r.output
