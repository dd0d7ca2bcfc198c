"""How `swiftkv serve` runs a platform: one gateway process, or `--workers N` of them under a supervisor
(services.serve.workers); the Ray cluster it starts or joins and the Ray Serve applications it deploys for its pools;
the Batch API's store; uvicorn and its signals. The place an engine's lifecycle at run time (rollouts, scale to zero)
will live. The settings come merged (services.serve.settings) and the pools checked (services.serve.preflight)."""

from __future__ import annotations

import gc
import logging
import signal
from pathlib import Path

import typer

from swiftkv_core.console import fail

from ..logs import Logs
from .preflight import Refusal, check_machine
from .settings import hide_password

log = logging.getLogger("swiftkv.serve")


def run_platform(cfg, engine: str, log_level: str = "info", api_keys_file: str | None = None, ray_metrics_port: int = 8080,
                 workers: int = 1, log_format: str = "text", log_file: str | None = None) -> None:
    """Serve `cfg` until stopped. `api_keys_file`: the one the settings chose (ServeSettings.keys_file); `log_file`: where
    engine and library logs go (default: data_dir/logs/serve.log; "-": the console)."""
    logs = Logs.start(log_level, log_format, capture=log_file != "-")
    try:
        check_machine(cfg, engine)
    except Refusal as e:
        fail(str(e))
    keys_file = api_keys_file
    _keys(keys_file)  # a bad keys file fails here, before anything starts
    batch = _batch_service(cfg)  # before any engine or Ray cluster starts: a bad store fails fast
    if workers > 1:
        batch.store.close()  # each worker opens its own
        return _run_workers(cfg, engine, logs, log_file, keys_file, ray_metrics_port, workers)
    _capture(logs, cfg, log_file)
    if engine == "ray":
        from services.serving.ray_backend import start_ray

        start_ray(cfg.ray_address, ray_metrics_port, deploy=any(p.backend == "engine" and not p.ray_app for p in cfg.pools.values()))
        if cfg.ray_address:
            log.info("joined the Ray cluster at %s", cfg.ray_address)
        else:
            log.info("Ray Serve up; engine metrics at http://127.0.0.1:%d/metrics (as ray_vllm_*) and on the gateway's /metrics "
                     "(as vllm:*)", ray_metrics_port)
    try:
        _serve(cfg, engine, keys_file, batch, ray_metrics_port if engine == "ray" and not cfg.ray_address else None)
    finally:
        if engine == "ray":
            from services.serving.ray_backend import stop_ray

            stop_ray(started_local_cluster=not cfg.ray_address)
    log.info("stopped")


def _keys(keys_file: str | None):
    from services.common.keys import KeyStore

    try:
        return KeyStore.from_env(keys_file)
    except (OSError, ValueError) as e:
        fail(f"API keys: {e}")


def _serve(cfg, engine: str, keys_file: str | None, batch, ray_metrics_port: int | None, sock=None, worker: int | None = None) -> None:
    """One gateway process: its pools' backends, the app, uvicorn (on `sock` when a supervisor bound it)."""
    import uvicorn

    from services.gateway.app import Gateway, create_app
    from services.gateway.http_limits import edge_protocol
    from services.gateway.prompts import Prompter
    from services.serving.pools import build_backends

    keys = _keys(keys_file)
    # Pools share one tokenizer (a SwiftKV model keeps its base model's); the base model's loads plainly.
    pool = cfg.pools.get("base") or next(iter(cfg.pools.values()))
    prompter = Prompter(pool.tokenizer or pool.model)
    backends = build_backends(cfg, engine)
    extra_metrics = None
    if ray_metrics_port is not None:  # engine metrics of a Ray cluster this command started
        from services.serving.ray_backend import engine_metrics

        extra_metrics = lambda: engine_metrics(ray_metrics_port)  # noqa: E731
    key_hint = ' -H "Authorization: Bearer $SWIFTKV_API_KEY"' if keys.enabled else ""

    def on_ready() -> None:
        if worker:  # said once, by worker 0
            return
        log.info("SwiftKV is serving %s (pools: %s) at http://%s:%d/v1\n"
                 "Try:\n  curl -s http://%s:%d/v1/chat/completions -H 'Content-Type: application/json'%s \\\n"
                 "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32}'",
                 cfg.model, ", ".join(cfg.pools), cfg.host, cfg.port, cfg.host, cfg.port, key_hint, cfg.model)

    gateway = Gateway(cfg, backends, prompter, keys, on_ready=on_ready, extra_metrics=extra_metrics)
    batch.attach(gateway)
    app = create_app(gateway, extensions=[batch], worker_header=worker is not None)
    # uvicorn drains on SIGTERM and SIGINT, then raises the signal again for the handler it found: an ignoring
    # one makes a drained shutdown exit 0 (what Kubernetes expects of a pod it stopped, and Ctrl-C in a terminal),
    # not -15 or a KeyboardInterrupt.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the app takes it (a reload of the API keys), never a stop
    # log_config=None: uvicorn's records go through the root logger's handlers (console or log file)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, access_log=False, http=edge_protocol(cfg.limits),
                            log_level="debug" if logging.getLogger().isEnabledFor(logging.DEBUG) else "warning",
                            timeout_keep_alive=cfg.limits.keep_alive_seconds, timeout_graceful_shutdown=cfg.health.shutdown_grace_seconds)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            if worker is None:  # with several workers, their supervisor says so
                log.info("stopping: the requests in flight get up to %.0f s, then the engines stop", cfg.health.shutdown_grace_seconds)
            await super().shutdown(sockets)

    server = Server(config)
    server.run(sockets=None if sock is None else [sock])
    # gateway.start froze everything loaded at start-up out of the cyclic GC's reach: collect it now, while the
    # modules are intact, or Triton's bindings report "leaked" objects as the interpreter exits
    gc.unfreeze()
    gc.collect()
    if not server.started:  # e.g. the port is taken: uvicorn has logged why
        raise SystemExit(3)


def _serve_worker(index: int, sock, cfg_data: dict, engine: str, logs: Logs, keys_file: str | None,
                  ray_metrics_port: int | None) -> None:
    """A worker process of `--workers N` (started by services.serve.workers.Supervisor)."""
    from services.config import PlatformConfig

    logs.configure(worker=index)
    cfg = PlatformConfig.model_validate(cfg_data)
    if engine == "ray":
        from services.serving.ray_backend import start_ray

        start_ray(cfg.ray_address, deploy=False)  # the parent deployed the pools; every pool here attaches
    _serve(cfg, engine, keys_file, _batch_service(cfg), ray_metrics_port, sock=sock, worker=index)


def _run_workers(cfg, engine: str, logs: Logs, log_file: str | None, keys_file: str | None, ray_metrics_port: int, workers: int) -> None:
    """`--workers N`: bind the port, deploy Ray pools once (each worker attaches to them), supervise N gateways."""
    from .workers import Supervisor, bind

    log = logging.getLogger("swiftkv.workers")
    if not cfg.redis_url:
        log.warning("%d workers without redis_url: per-key rate limits are kept by each worker on its own, so a key can be "
                    "admitted up to %d times its limit, and batch work in one worker does not make way for live requests at another; "
                    "set redis_url (--redis-url, SWIFTKV_REDIS_URL) to share both", workers, workers)
    log.info("%d workers on %s:%d; limits.max_concurrent_requests (%s) applies to each", workers, cfg.host, cfg.port,
             cfg.limits.max_concurrent_requests)
    try:
        sock = bind(cfg.host, cfg.port)
    except OSError as e:
        fail(f"cannot listen on {cfg.host}:{cfg.port}: {e}")
    _capture(logs, cfg, log_file)
    data = cfg.model_dump(mode="json")
    deployed: list[str] = []
    local_cluster = engine == "ray" and not cfg.ray_address
    if engine == "ray":
        deployed = _deploy_ray_pools(cfg, data, ray_metrics_port)
    code = 1
    try:
        code = Supervisor(_serve_worker, (data, engine, logs, keys_file, ray_metrics_port if local_cluster else None),
                          workers, sock, cfg.health.shutdown_grace_seconds).run()
    finally:
        if engine == "ray":
            from ray import serve

            from services.serving.ray_backend import stop_ray

            for app in deployed:
                try:
                    serve.delete(app, _blocking=False)
                except Exception:
                    pass
            stop_ray(started_local_cluster=local_cluster)
    if code == 0:
        log.info("stopped")
    else:
        log.warning("stopped; a worker did not stop cleanly")
    raise typer.Exit(code)


def _capture(logs: Logs, cfg, log_file: str | None) -> None:
    """Engine and library logs go to the log file from here on (the checks that refuse to start have spoken)."""
    if log_file != "-":
        logs.capture(Path(log_file) if log_file else Path(cfg.data_dir).expanduser() / "logs" / "serve.log")


def _deploy_ray_pools(cfg, data: dict, ray_metrics_port: int) -> list[str]:
    """Start or join Ray and deploy each engine pool's Serve application once, from the parent; `data` (the
    workers' config) then names the cluster and each application, so every worker attaches to the same ones."""
    import ray
    from ray import serve

    from services.serving.ray_backend import build_deployment, start_ray

    ours = {name: pool for name, pool in cfg.pools.items() if pool.backend == "engine" and not pool.ray_app}
    start_ray(cfg.ray_address, ray_metrics_port, deploy=bool(ours))
    data["ray_address"] = cfg.ray_address or ray.get_runtime_context().gcs_address
    deployed = []
    for name, pool in ours.items():
        app = f"swiftkv-{name}"
        logging.getLogger("swiftkv.workers").info("pool %s: deploying Ray Serve application %s (each replica starts its engine)", name, app)
        try:  # returns once the initial replicas passed their constructor (warm-up included)
            serve.run(build_deployment(name, pool, cfg.served_name(name), cfg.routing), name=app, route_prefix=None)
        except Exception:
            logging.getLogger("swiftkv.workers").exception("pool %s: deploying Ray Serve application %s failed", name, app)
        deployed.append(app)
        data["pools"][name]["ray_app"] = app
    return deployed


def _batch_service(cfg):
    from sqlalchemy.exc import SQLAlchemyError

    from services.batch.service import BatchService

    try:
        return BatchService(cfg)
    except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
        url = cfg.database_url
        where = hide_password(url) if url else cfg.data_dir
        fail(f"batch store ({where}): {str(e).replace(url, where) if url else e}")
