"""Build one Backend per configured pool, for the chosen engine runtime."""

from __future__ import annotations

import logging
from typing import Literal

from services.config import PlatformConfig, PoolConfig

from .backend import Backend

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


def describe(pool: PoolConfig, engine: EngineKind, cpu_bind: str | None = None) -> str:
    """Where a pool runs and with what budget, for the console: 'in-process vLLM engine (dtype float32, CPUs 0, ...)'."""
    if pool.backend == "remote":
        return "remote OpenAI-compatible server"
    if pool.ray_app:
        return f"Ray Serve application {pool.ray_app} (deployed by the cluster)"
    args = pool.engine_args
    budget = (["dual-mode: the SwiftKV and the base model"] if pool.dual_mode else []) + [f"dtype {args.get('dtype') or 'auto'}"]
    if cpu_bind:
        budget.append(f"CPUs {cpu_bind}")
    if args.get("kv_cache_memory_bytes"):
        budget.append(f"KV cache {int(args['kv_cache_memory_bytes']) / 2**20:,.0f} MiB")
    elif args.get("gpu_memory_utilization"):
        budget.append(f"gpu_memory_utilization {args['gpu_memory_utilization']}")
    if str(args.get("kv_cache_dtype") or "auto") != "auto":
        budget.append(f"kv_cache_dtype {args['kv_cache_dtype']}")
    if args.get("max_model_len"):
        budget.append(f"max_model_len {args['max_model_len']}")
    if engine == "ray":
        r = pool.replicas
        count = f"{r.min}" if r.min == r.max else f"{r.min}-{r.max}"
        return f"Ray Serve, {count} replica(s) of {r.num_cpus:g} CPU / {r.num_gpus:g} GPU, a vLLM engine each ({', '.join(budget)})"
    return f"in-process vLLM engine ({', '.join(budget)})"


def remote_pool(name: str, pool: PoolConfig, cfg: PlatformConfig) -> Backend:
    """One remote server, or several of one model with the replica chosen per request by its prefix and load."""
    from .remote import RemoteBackend

    model = pool.served_model_name or pool.model
    events = pool.kv_event_endpoints if cfg.routing.kv_events else []
    events += [None] * (len(pool.urls) - len(events))
    api_key = pool.remote_api_key(name)
    if len(pool.urls) == 1:
        return RemoteBackend(name, pool.urls[0], model, api_key, kv_events=events[0], dual_mode=pool.dual_mode)
    from urllib.parse import urlsplit

    from services.config import DEFAULT_BLOCK_SIZE

    from .replicas import ReplicaChooser, ReplicaSet

    replicas = {urlsplit(url).netloc or url: RemoteBackend(name, url, model, api_key, kv_events=e, dual_mode=pool.dual_mode)
                for url, e in zip(pool.urls, events)}
    r = cfg.routing
    chooser = ReplicaChooser(list(replicas), r.prefix_block_size or DEFAULT_BLOCK_SIZE, r.prefix_min_distinct_tokens,
                             r.balance_margin_tokens, r.decode_token_cost)
    return ReplicaSet(name, replicas, chooser)


def build_backends(cfg: PlatformConfig, engine: EngineKind) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    binds = cpu_binds(cfg, engine)
    if engine == "inprocess" and any(pool.backend == "engine" for pool in cfg.pools.values()):
        from swiftkv_core.hardware import note_triton, preload_tcmalloc, vllm_on_cpu

        if vllm_on_cpu():
            preload_tcmalloc()  # before any engine process starts: they read LD_PRELOAD when they exec
            note_triton()
    for name, pool in cfg.pools.items():
        served = cfg.served_name(name)
        log.info("pool %s: %s as %s, %s", name, ", ".join(pool.urls) if pool.backend == "remote" else pool.model, served,
                 describe(pool, engine, binds.get(name)))
        if pool.backend == "remote":
            backends[name] = remote_pool(name, pool, cfg)
        elif engine == "ray":
            from .ray_backend import RayBackend

            backends[name] = RayBackend(name, pool, served, cfg.routing)
        else:
            from .engine import InProcessBackend

            backends[name] = InProcessBackend(name, pool.model, served, engine_args_with_kv_events(name, pool, cfg), pool.warmup,
                                              cpu_bind=binds.get(name))
    return backends


def engine_args_with_kv_events(name: str, pool: PoolConfig, cfg: PlatformConfig) -> dict:
    """An in-process engine's args: with routing.kv_events (cache-aware routing), vLLM publishes its KV-cache events on
    an IPC socket of this process's (a kv_events_config of the pool's own is kept)."""
    args = pool.vllm_engine_args()
    if not (cfg.routing.kv_events and cfg.routing.cache_aware) or "kv_events_config" in args:
        return args
    import os
    import tempfile

    endpoint = f"ipc://{tempfile.gettempdir()}/swiftkv-{os.getpid()}-{name}.kv-events"
    return {**args, "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}}
