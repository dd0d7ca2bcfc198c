"""The real gateway app in this process, assembled as `swiftkv serve` assembles it (Gateway, the Batch API as its
extension, create_app) over FakeBackends: driven through httpx's ASGI transport, or served by uvicorn (with the
gateway's edge protocol) in a thread on a free port where a real connection or the official `openai` client is needed
(`served_gateway`, what a test module's gateway fixture yields)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx

from services.config import PlatformConfig
from services.serving.fake import FakeBackend

from .processes import free_port

PUBLIC = "m"


def pool_config(tiny_base: Path, max_model_len: int = 512, **fields) -> dict:
    return {"model": str(tiny_base), "engine_args": {"max_model_len": max_model_len}, **fields}


def platform_config(tiny_base: Path, pools=("swiftkv", "base"), max_model_len: int = 512, **fields) -> PlatformConfig:
    """A platform over the tiny checkpoint's tokenizer: its pools (names, or name -> pool fields), the rest as given;
    the route's reason in the x-swiftkv-route header (routing.expose_reason), which the tests read, unless `routing` says
    otherwise."""
    if not isinstance(pools, dict):
        pools = {name: {} for name in pools}
    fields["routing"] = {"expose_reason": True} | dict(fields.get("routing") or {})
    return PlatformConfig.model_validate({"model": PUBLIC, "pools": {name: pool_config(tiny_base, max_model_len) | extra
                                                                     for name, extra in pools.items()}} | fields)


class InProcessGateway:
    """The app over `backends` (default: a FakeBackend per pool of `cfg`), with the API keys `keys` (lines as in a
    keys file, e.g. "sk-x prompt_tokens_per_minute=300"; none: no key needed) and the Batch API unless `batch` is
    False. The pools are ready unless `ready` is False (the lifespan, which would start them, runs only under uvicorn).
    `key_store`: a KeyStore to use instead of `keys` (one reading a keys file, which the lifespan then watches)."""

    def __init__(self, cfg: PlatformConfig, backends: dict | None = None, keys: tuple[str, ...] = (), batch: bool = True,
                 ready: bool = True, key_store=None):
        from services.batch.service import BatchService
        from services.common.keys import KeyStore, load_keys
        from services.gateway.app import Gateway, create_app
        from services.gateway.prompts import Prompter

        self.cfg = cfg
        self.backends = backends if backends is not None else {name: FakeBackend(name) for name in cfg.pools}
        pool = cfg.pools.get("base") or next(iter(cfg.pools.values()))
        self.gateway = Gateway(cfg, self.backends, Prompter(pool.tokenizer or pool.model),
                               key_store or KeyStore(load_keys(",".join(keys), None)))
        if ready:
            for state in self.gateway.pools.values():
                state.ready = True
        self.service = None
        if batch:
            self.service = BatchService(cfg)
            self.service.attach(self.gateway)
        self.app = create_app(self.gateway, [self.service] if batch else [])

    def client(self, key: str | None = None, host: str = "gw", timeout: float = 60) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=f"http://{host}", headers=headers, timeout=timeout)

    @contextlib.asynccontextmanager
    async def running(self, key: str | None = None, host: str = "gw"):
        """The batch runner started and a client of the app; the runner stopped after."""
        if self.service is not None:
            await self.service.start()
        try:
            async with self.client(key, host) as c:
                yield c
        finally:
            if self.service is not None:
                await self.service.stop()

    def close(self) -> None:
        """Close the batch store (a service never started holds it open)."""
        if self.service is not None:
            self.service.io.close()
            self.service.store.close()


class ThreadedServer:
    """uvicorn serving an InProcessGateway's app on a free port from a thread, as `swiftkv serve` configures it (the
    edge protocol with the config's limits, keep-alive): the app's lifespan starts the pools' backends, their health
    watchers and the batch runner. `call(fn)` runs fn on the server's event loop (a FakeBackend's gate is set there)."""

    def __init__(self, served: InProcessGateway):
        import uvicorn

        from services.gateway.http_limits import edge_protocol

        self.served = served
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        limits = served.cfg.limits
        config = uvicorn.Config(served.app, host="127.0.0.1", port=self.port, log_config=None, access_log=False, log_level="warning",
                                http=edge_protocol(limits), timeout_keep_alive=limits.keep_alive_seconds, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.loop = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name=f"uvicorn-{self.port}", daemon=True)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.time() + 60
        while not (self.server.started and self.served.gateway.started):
            assert self.thread.is_alive() and time.time() < deadline, "the in-process server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        # the lifespan's gateway.start froze everything loaded so far out of the cyclic GC's reach (as in `swiftkv
        # serve`): collect it again, or Triton's bindings report "leaked" objects when the test process exits
        gc.unfreeze()
        gc.collect()

    def call(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def client(self, key: str = "none", timeout: float = 60, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=kw.pop("max_retries", 0), timeout=timeout, **kw)


@contextlib.contextmanager
def served_gateway(tiny_base: Path, data_dir: Path, pools=("swiftkv", "base"), max_model_len: int = 512, *, fake: dict | None = None,
                   keys: tuple[str, ...] = (), batch: bool = True, **fields) -> Iterator[ThreadedServer]:
    """The app served from a thread (ThreadedServer) over a FakeBackend per pool, each made with the options `fake`;
    its config from `pools`, `max_model_len` and `fields` (platform_config) with its data in `data_dir`, and `keys`
    and `batch` as InProcessGateway takes them. Stopped (pools, batch runner and store) when the block ends."""
    cfg = platform_config(tiny_base, pools, max_model_len, data_dir=str(data_dir), **fields)
    backends = {name: FakeBackend(name, **(fake or {})) for name in cfg.pools}
    with ThreadedServer(InProcessGateway(cfg, backends, keys=keys, batch=batch)) as server:
        yield server
