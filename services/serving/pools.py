"""Build one Backend per configured pool, for the chosen engine runtime."""

from __future__ import annotations

import logging
from typing import Literal

from .backend import Backend
from .config import PlatformConfig

EngineKind = Literal["inprocess", "ray"]

log = logging.getLogger("swiftkv.pools")


def cpu_binds(cfg: PlatformConfig, engine: EngineKind) -> dict[str, str | None]:
    """VLLM_CPU_OMP_THREADS_BIND per in-process engine pool, from each pool's `cpu_cores` (vLLM's own elsewhere)."""
    engines = {name: pool for name, pool in cfg.pools.items() if pool.backend == "engine"}
    if engine != "inprocess":
        for name, pool in engines.items():
            if pool.cpu_cores != "auto":
                log.warning("pools.%s.cpu_cores %s applies to in-process engines; Ray replicas keep vLLM's own binding", name, pool.cpu_cores)
        return {}
    if not engines:
        return {}
    from swiftkv_core.hardware import plan_cpu_binding, vllm_on_cpu

    return plan_cpu_binding({name: p.cpu_cores for name, p in engines.items()}, {name: p.engine_workers for name, p in engines.items()},
                            vllm_on_cpu())


def build_backends(cfg: PlatformConfig, engine: EngineKind) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    binds = cpu_binds(cfg, engine)
    if engine == "inprocess" and any(pool.backend == "engine" for pool in cfg.pools.values()):
        from swiftkv_core.hardware import preload_tcmalloc, vllm_on_cpu

        if vllm_on_cpu():
            preload_tcmalloc()  # before any engine process starts: they read LD_PRELOAD when they exec
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

            backends[name] = InProcessBackend(name, pool.model, served, pool.engine_args, pool.warmup, cpu_bind=binds.get(name))
    return backends
