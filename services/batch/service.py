"""The Batch API as a gateway extension: the store, the file store, the runner and the routes."""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from pathlib import Path

from services.common.files_api import FilesService
from services.common.threads import Threads
from services.config import PlatformConfig

from .api import build_router, openapi_operations
from .gateway_protocols import HostGateway
from .live import SharedLiveTraffic
from .runner import Runner
from .store import BatchStore

log = logging.getLogger("swiftkv.batch")


class BatchService:
    """Opened before the engines start (a bad database fails the command at once), then attached to the
    gateway whose request path replays the lines."""

    def __init__(self, cfg: PlatformConfig):
        data_dir = Path(cfg.data_dir).expanduser()
        data_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg.batch
        self.redis_url, self.redis_prefix = cfg.redis_url, cfg.redis_prefix
        self.store = BatchStore(cfg.database_url or f"sqlite:///{data_dir / 'swiftkv.db'}")
        self.io = Threads()
        # the platform's Files API, on the bytes and rows the trainer shares (its files_dir: this data_dir's files/)
        self.file_api = FilesService(self.store, data_dir / "files", self.io, max_file_bytes=self.cfg.max_file_bytes,
                                     quota=self.cfg.max_storage_bytes_per_key, expiry_seconds=self.cfg.file_expiry_seconds,
                                     body_timeout=cfg.limits.body_timeout_seconds, what="the batch store")
        self.files, self.records = self.file_api.contents, self.file_api.records
        self._tasks: list[asyncio.Task] = []

    def attach(self, gateway: HostGateway) -> None:
        self.gateway = gateway
        self.runner = Runner(self.store, self.files, gateway, self.cfg, self.io)
        # with redis_url, batch work here also makes way for live traffic that other gateway processes serve
        self.live = SharedLiveTraffic(self.redis_url, gateway.pools, self.cfg.live_quiet_seconds, self.redis_prefix) if self.redis_url else None
        self.router = build_router(self)
        self.openapi_operations = openapi_operations(list(self.cfg.completion_windows))

    async def start(self) -> None:
        loops = [self.runner.run(), self.sweep_expired()] + ([self.live.run()] if self.live is not None else [])
        self._tasks = [asyncio.create_task(loop) for loop in loops]

    async def sweep_expired(self) -> None:
        """Deletes expired files, and the line results of finished batches from before they were dropped at the
        finish, while the gateway runs."""
        while True:
            try:
                if removed := await self.io(self.records.sweep):
                    log.info("deleted %d expired files", removed)
                if pruned := await self.io(self.store.prune_results):
                    log.info("dropped the line results of %d finished batches", pruned)
            except Exception as e:  # the database is away: try again next time
                log.warning("deleting expired files: %s", e)
            await asyncio.sleep(self.cfg.file_sweep_seconds)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with suppress(asyncio.CancelledError):
                await task
        await self.runner.stop()
        self.io.close()
        self.store.close()
