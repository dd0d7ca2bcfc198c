"""A service's own threads for blocking store and file calls: under a busy batch or trainer they must not queue
behind, or starve, the default executor the gateway uses (engine start-up, Ray health checks)."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor


class Threads:
    def __init__(self, workers: int = 4, name: str = "swiftkv-batch"):
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix=name)

    async def __call__(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.executor.shutdown(wait=False)
