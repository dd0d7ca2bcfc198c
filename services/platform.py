"""`swiftkv serve` (the platform) and `swiftkv demo` (prepare the models, then serve the default config)."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
from pathlib import Path
from typing import Annotated, Literal, Optional
from urllib.parse import urlsplit, urlunsplit

import typer
from pydantic import ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from swiftkv_core.cli import fail

from .logs import FORMATS, LEVELS, Logs

log = logging.getLogger("swiftkv.serve")


class ServeSettings(BaseSettings):
    """Environment (SWIFTKV_*) defaults for `swiftkv serve`; command-line flags override them."""

    model_config = SettingsConfigDict(env_prefix="SWIFTKV_")

    config: Optional[Path] = None
    engine: Literal["inprocess", "ray"] = "ray"
    host: Optional[str] = None
    port: Optional[int] = None
    api_keys_file: Optional[str] = None
    log_level: str = "info"
    log_format: str = "text"
    log_file: Optional[str] = None
    ray_metrics_port: int = 8080
    data_dir: Optional[str] = None
    database_url: Optional[str] = None
    redis_url: Optional[str] = None
    ray_address: Optional[str] = None
    workers: Optional[int] = None

    @field_validator("workers", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):  # SWIFTKV_WORKERS= in a pod spec means unset, like the other variables
        return None if v == "" else v


def _check_models(cfg) -> None:
    for name, pool in cfg.pools.items():
        path = Path(pool.model)
        looks_local = pool.model.startswith((".", "/")) or pool.model.startswith("models/")
        if pool.backend == "engine" and looks_local and not path.exists():
            fail(f"pool {name}: model folder {pool.model} does not exist "
                  f"(prepare it with `swiftkv models prepare {path.name}`, or run `swiftkv demo`)")
        refusal = dual_mode_refusal(name, pool)
        if refusal:
            fail(refusal)


def local_hf_config(pool) -> dict | None:
    """The config.json of the pool's model where it is a local folder (None: a hub id, or unreadable: the engine says
    what is wrong with it)."""
    config_file = Path(pool.model) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def dual_mode_refusal(name: str, pool) -> str | None:
    """Why the pool cannot run dual-mode engines (None: it can, it is not dual-mode, or its model is not a local folder
    to read): a dual-mode engine runs a SwiftKV checkpoint that holds its base model whole."""
    hf_config = local_hf_config(pool) if pool.dual_mode and pool.backend == "engine" else None
    reason = None if hf_config is None else checkpoint_dual_mode_refusal(hf_config)
    return None if reason is None else f"pools.{name}.dual_mode: {pool.model}: {reason}"


def checkpoint_dual_mode_refusal(hf_config: dict) -> str | None:
    """Why the checkpoint of this config.json cannot serve its base model in dual mode (None: it can)."""
    from swiftkv_core.dual_mode import refusal
    from swiftkv_core.vllm.speculation import CHECKPOINT_ARCHITECTURE, is_swiftkv_checkpoint

    if not is_swiftkv_checkpoint(hf_config):
        return (f"dual mode needs a SwiftKV checkpoint (architectures [{CHECKPOINT_ARCHITECTURE}] in its config.json), which "
                f"holds the base model whole; this one lists {hf_config.get('architectures') or 'none'}: convert it with "
                "`swiftkv convert` or set dual_mode false")
    return refusal(hf_config.get("num_hidden_layers"), hf_config.get("num_key_value_layers"),
                   hf_config.get("key_value_group_size"), bool(hf_config.get("later_layers_adapted")))


def _check_machine(cfg, engine: str) -> None:
    """Refuse engine settings this machine cannot run (e.g. an FP8 KV cache on a CPU without AVX-512),
    before any engine starts. Engines on a remote Ray cluster are checked by their replicas instead."""
    local = {name: pool for name, pool in cfg.pools.items() if pool.backend == "engine"}
    if not local or (engine == "ray" and cfg.ray_address):
        return
    from swiftkv_core.hardware import UnsupportedSetting, check_cpu_cores_fit, check_engine_args, vllm_on_cpu

    on_cpu = vllm_on_cpu()
    for name, pool in local.items():
        try:
            check_engine_args(pool.engine_args, on_cpu, f"pools.{name}.engine_args")
            if on_cpu and engine == "inprocess":
                check_cpu_cores_fit(pool.cpu_cores, f"pools.{name}.cpu_cores")
        except UnsupportedSetting as e:
            fail(str(e))
        refusal = speculation_refusal(name, pool, on_cpu)
        if refusal:
            fail(refusal)


def speculation_refusal(name: str, pool, on_cpu: bool) -> str | None:
    """Why this machine cannot start the pool's engines with their speculative decoding (None: it can): suffix
    decoding without Arctic Inference installed, or a SwiftKV model where SwiftKV cannot verify drafts. The
    engines refuse both too, but only once each has started loading."""
    import importlib.util

    speculation = pool.speculation
    if not isinstance(speculation, dict):  # none, or vLLM's JSON text in engine_args: the engine checks that
        return None
    setting = f"pools.{name}.speculative" if pool.speculative.enabled else f"pools.{name}.engine_args.speculative_config"
    if speculation.get("method") == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        return (f"{setting}: method suffix runs Arctic Inference's suffix decoding, and the arctic_inference package is "
                "not installed here (`pip install arctic-inference`: an sdist that compiles a C++ extension); "
                "or use method ngram")
    hf_config = local_hf_config(pool)
    if hf_config is not None:
        from swiftkv_core.vllm.speculation import is_swiftkv_checkpoint
        from swiftkv_core.vllm.speculation import speculation_refusal as swiftkv_refusal

        refusal = swiftkv_refusal(on_cpu, speculation.get("method")) if is_swiftkv_checkpoint(hf_config) else None
        if refusal:
            return f"{setting}: pool {name} serves the SwiftKV model {pool.model}: {refusal}"
    return None


def run_platform(cfg, engine: str, log_level: str = "info", api_keys_file: str | None = None, ray_metrics_port: int = 8080,
                 workers: int = 1, log_format: str = "text", log_file: str | None = None) -> None:
    """`log_file`: where engine and library logs go (default: data_dir/logs/serve.log; "-": the console)."""
    logs = Logs.start(log_level, log_format, capture=log_file != "-")
    _check_machine(cfg, engine)
    # The command-line flag wins over SWIFTKV_API_KEYS_FILE, which wins over the config's api_keys_file.
    keys_file = api_keys_file or os.environ.get("SWIFTKV_API_KEYS_FILE") or cfg.api_keys_file
    _keys(keys_file)
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
    """A worker process of `--workers N` (started by services.gateway_workers.Supervisor)."""
    from services.config import PlatformConfig

    logs.configure(worker=index)
    cfg = PlatformConfig.model_validate(cfg_data)
    if engine == "ray":
        from services.serving.ray_backend import start_ray

        start_ray(cfg.ray_address, deploy=False)  # the parent deployed the pools; every pool here attaches
    _serve(cfg, engine, keys_file, _batch_service(cfg), ray_metrics_port, sock=sock, worker=index)


def _run_workers(cfg, engine: str, logs: Logs, log_file: str | None, keys_file: str | None, ray_metrics_port: int, workers: int) -> None:
    """`--workers N`: bind the port, deploy Ray pools once (each worker attaches to them), supervise N gateways."""
    from services.gateway_workers import Supervisor, bind

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


def hide_password(url: str) -> str:
    """`url` with its password (user:PASSWORD@, ?password=) replaced by ***, for messages and logs; works on
    URLs that SQLAlchemy or Redis would refuse to parse."""
    parts = urlsplit(url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}" if ":" in userinfo else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, query=re.sub(r"(?i)\bpassword=[^&]*", "password=***", parts.query)))


def serve_command(
    config: Annotated[Optional[Path], typer.Option(help="Platform YAML (pools, routing, limits); default: SmolLM2 on 127.0.0.1:8000")] = None,
    engine: Annotated[Optional[str], typer.Option(help="ray: Ray Serve deployments (local cluster unless ray_address); inprocess: engines inside the gateway process")] = None,
    host: Annotated[Optional[str], typer.Option(help="Override the config's host")] = None,
    port: Annotated[Optional[int], typer.Option(help="Override the config's port")] = None,
    api_keys_file: Annotated[Optional[str], typer.Option(help="API keys file (also SWIFTKV_API_KEYS / SWIFTKV_API_KEYS_FILE)")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Batch files and the embedded SQLite database (also SWIFTKV_DATA_DIR)")] = None,
    database_url: Annotated[Optional[str], typer.Option(help="Batch store database, e.g. postgresql://user@host/db (also SWIFTKV_DATABASE_URL)")] = None,
    redis_url: Annotated[Optional[str], typer.Option(help="Redis for per-key rate limits shared by several gateways, e.g. redis://host:6379/0 (also SWIFTKV_REDIS_URL)")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster (GCS address, e.g. head:6379) to join with --engine ray (also SWIFTKV_RAY_ADDRESS); default: the config's, else a local cluster")] = None,
    workers: Annotated[Optional[int], typer.Option(min=1, help="Gateway processes on the one port (also SWIFTKV_WORKERS; default: the config's "
                                                   "workers, 1), for pools on Ray or remote servers, which every worker shares")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning or error (also SWIFTKV_LOG_LEVEL; default info). "
                                                     "debug also shows engine and library logs on the console")] = None,
    log_format: Annotated[Optional[str], typer.Option(help="text, or json: one JSON object per console line, for log collectors "
                                                      "(also SWIFTKV_LOG_FORMAT)")] = None,
    log_file: Annotated[Optional[str], typer.Option(help="Where engine and library logs go (also SWIFTKV_LOG_FILE; default "
                                                    "DATA_DIR/logs/serve.log); - keeps them on the console")] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the platform config this command would serve "
                                               "(the embedded default or --config, with the flags and SWIFTKV_* variables "
                                               "applied) as YAML, and exit")] = False,
) -> None:
    """Run the OpenAI-compatible gateway and its engine pools."""
    from services.config import load_config

    settings = ServeSettings()
    engine = engine or settings.engine
    if engine not in ("ray", "inprocess"):
        fail(f"--engine must be 'ray' or 'inprocess', not {engine!r}")
    log_level, log_format = _log_options(log_level or settings.log_level, log_format or settings.log_format)
    config = config or settings.config
    if config is not None and not Path(config).exists():
        fail(f"config file {config} does not exist")
    try:
        # An empty flag or variable (SWIFTKV_DATABASE_URL= in a pod spec) means unset, not "override with nothing".
        cfg = load_config(config, {"host": host or settings.host, "port": port or settings.port,
                                   "data_dir": data_dir or settings.data_dir or None,
                                   "database_url": database_url or settings.database_url or None,
                                   "redis_url": redis_url or settings.redis_url or None,
                                   "ray_address": ray_address or settings.ray_address or None,
                                   "workers": workers or settings.workers or None})
    except ValidationError as e:  # not str(e): it repeats the input, store URLs and their passwords included
        fail(f"invalid config {config or '(default)'}: "
             + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()))
    except ValueError as e:
        fail(f"invalid config {config or '(default)'}: {e}")
    attached = [f"pools.{name}.ray_app" for name, pool in cfg.pools.items() if pool.ray_app]
    if attached and engine != "ray":
        fail(f"{', '.join(attached)}: a pool on a Ray Serve application needs --engine ray")
    if engine == "ray" and (cfg.ray_address or "").startswith("ray://") and any(p.backend == "engine" for p in cfg.pools.values()):
        fail(f"ray_address {cfg.ray_address}: the gateway streams from Ray Serve deployment handles, which Ray Client (ray://) "
             "does not support; run the gateway on a node of the cluster and give the GCS address (host:6379, or auto)")
    inprocess = [f"pools.{name}" for name, pool in cfg.pools.items() if pool.backend == "engine" and engine == "inprocess"]
    if cfg.workers > 1 and inprocess:
        fail(f"--workers {cfg.workers} with in-process engines ({', '.join(inprocess)}): each gateway process would load its own "
             f"copy of every engine ({cfg.workers} times the memory, all competing for the same cores and accelerators). "
             "Serve those pools with --engine ray (Ray Serve replicas, shared by every worker) or as remote vLLM servers "
             "(backend: remote, url: ...), or keep one worker")
    if config is None:
        default_models(cfg, prepare=False)
        default_dual_mode(cfg)
        default_speculation(cfg)
    if print_config:
        typer.echo(printable_config(cfg, config), nl=False)
        raise typer.Exit(0)
    _check_models(cfg)
    run_platform(cfg, engine, log_level, api_keys_file or settings.api_keys_file, settings.ray_metrics_port, cfg.workers, log_format,
                 log_file or settings.log_file or None)


def printable_config(cfg, source: Path | None) -> str:
    """The effective platform config as YAML that `swiftkv serve --config` reads back, every setting spelled out;
    passwords in store URLs and remote pools' keys shown as ***."""
    import yaml

    data = cfg.model_dump(mode="json")
    for field in ("database_url", "redis_url"):
        if data.get(field):
            data[field] = hide_password(data[field])
    for pool in data["pools"].values():
        if pool.get("api_key"):
            pool["api_key"] = "***"
    header = (f"# The platform config `swiftkv serve` runs: {source or 'the embedded default'} with flags and SWIFTKV_* "
              "variables applied.\n# Passwords and keys are shown as ***.\n")
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _log_options(level: str, fmt: str) -> tuple[str, str]:
    level, fmt = level or "info", fmt or "text"  # SWIFTKV_LOG_LEVEL= in a pod spec means unset, like the other variables
    if level.lower() not in LEVELS:
        fail(f"--log-level (SWIFTKV_LOG_LEVEL) must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt.lower() not in FORMATS:
        fail(f"--log-format (SWIFTKV_LOG_FORMAT) must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return level.lower(), fmt.lower()


def demo_command(
    engine: Annotated[str, typer.Option(help="inprocess (default: fits small machines) or ray")] = "inprocess",
    port: Annotated[Optional[int], typer.Option(help="Override the port (default 8000)")] = None,
) -> None:
    """Prepare SmolLM2 and its SwiftKV version offline, then serve them with the default config."""
    from services.config import load_config

    cfg = load_config(None, {"port": port})
    default_models(cfg, prepare=True)
    default_dual_mode(cfg)
    default_speculation(cfg)
    settings = ServeSettings()
    log_level, log_format = _log_options(settings.log_level, settings.log_format)
    run_platform(cfg, engine, log_level, log_format=log_format, log_file=settings.log_file or None)


def default_dual_mode(cfg) -> None:
    """On a CPU the embedded default runs both pools on the SwiftKV checkpoint as dual-mode engines, each serving the base
    model too, per request: there rag at capacity ran as two SwiftKV engines do and conversations faster than on two
    base engines, each model within 0-3% of its own engine's speed (docs/benchmarks.md, "Dual-mode engines"). On a GPU a
    dual-mode engine gives up CUDA graphs, not yet measured there, so each pool keeps its one model; so it does where the
    SwiftKV model cannot serve its base model (no SwiftKV checkpoint prepared, AcrossKV, merged adapters)."""
    from swiftkv_core.hardware import vllm_on_cpu

    swiftkv, base = cfg.pools.get("swiftkv"), cfg.pools.get("base")
    if swiftkv is None or base is None or {swiftkv.backend, base.backend} != {"engine"} or cfg.routing.kv_events:
        return
    hf_config = local_hf_config(swiftkv)
    if hf_config is None or checkpoint_dual_mode_refusal(hf_config) is not None or not vllm_on_cpu():
        return
    base.model, base.tokenizer = swiftkv.model, swiftkv.tokenizer
    swiftkv.dual_mode = base.dual_mode = True


def default_speculation(cfg) -> None:
    """Where the embedded default speculates (its base pool), a pool this machine cannot speculate on (a SwiftKV model on
    a GPU) serves without it, with a warning, instead of the start being refused (as it is for a config file's)."""
    local = [name for name, pool in cfg.pools.items() if pool.backend == "engine" and pool.speculative.enabled]
    if not local:
        return
    from services.config import SpeculativeConfig
    from swiftkv_core.hardware import vllm_on_cpu

    on_cpu = vllm_on_cpu()
    for name in local:
        refusal = speculation_refusal(name, cfg.pools[name], on_cpu)
        if refusal:
            cfg.pools[name].speculative = SpeculativeConfig()
            typer.secho(f"pool {name}: speculative decoding off on this machine ({refusal})", fg=typer.colors.YELLOW)


def default_models(cfg, prepare: bool) -> None:
    """The embedded default's models: prepared when asked. Until a distilled SwiftKV model can be prepared,
    the swiftkv pool serves an undistilled conversion of the base model (half the layers take their KV
    from the middle layer), as `swiftkv convert` writes it."""
    base, swiftkv = cfg.pools["base"], cfg.pools["swiftkv"]
    if prepare and not Path(base.model).exists():
        _prepare(Path(base.model).name)
    if Path(swiftkv.model).exists():
        return
    if prepare:
        try:
            if _prepare(Path(swiftkv.model).name) is not None:
                return
        except Exception as e:  # e.g. the distilled tensors are not shipped yet
            typer.secho(f"pool swiftkv: cannot prepare {Path(swiftkv.model).name}: {e}", fg=typer.colors.YELLOW)
    undistilled = Path(swiftkv.model).parent / (Path(swiftkv.model).name + "-undistilled")
    if prepare and not (undistilled / "config.json").exists():
        _convert_undistilled(Path(base.model), undistilled)
    if (undistilled / "config.json").exists():
        swiftkv.model = str(undistilled)
        typer.secho(f"pool swiftkv: no distilled SwiftKV model yet; serving the undistilled {undistilled}", fg=typer.colors.YELLOW)


def _prepare(model_name: str) -> Path | None:
    from swiftkv_core import catalog

    if model_name not in catalog.REGISTRY:
        return None
    typer.echo(f"preparing {model_name} (offline, once)...")
    return catalog.prepare(model_name, Path(catalog.DEFAULT_MODELS_DIR))


def _convert_undistilled(base: Path, out: Path) -> None:
    from swiftkv_core.config import default_num_key_value_layers
    from swiftkv_core.convert import convert

    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    l = default_num_key_value_layers(layers)
    typer.echo(f"converting {base} to SwiftKV (l = {l} of {layers}) -> {out}")
    convert(str(base), out, num_key_value_layers=l)


def register_serving_commands(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
    app.command("demo")(demo_command)
