"""Build one Backend per configured pool, for the chosen engine runtime."""

from __future__ import annotations

from typing import Literal

from .backend import Backend
from .config import PlatformConfig

EngineKind = Literal["inprocess", "ray"]


def build_backends(cfg: PlatformConfig, engine: EngineKind) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    for name, pool in cfg.pools.items():
        served = cfg.served_name(name)
        if pool.backend == "remote":
            from .remote import RemoteBackend

            backends[name] = RemoteBackend(name, pool.url, pool.served_model_name or pool.model, pool.api_key)
        elif engine == "ray":
            from .ray_backend import RayBackend

            backends[name] = RayBackend(name, pool, served)
        else:
            from .engine import InProcessBackend

            backends[name] = InProcessBackend(name, pool.model, served, pool.engine_args, pool.warmup)
    return backends
