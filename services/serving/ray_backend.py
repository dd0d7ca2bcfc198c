"""A pool served by Ray Serve: a deployment whose replicas each own one vLLM engine, autoscaled on
ongoing requests. A replica becomes healthy only after its constructor has run a warm-up generation.

The gateway holds a deployment handle per pool and streams from it; cancelling the stream cancels the
request in the replica, which aborts it in the engine. Engine metrics are exported through Ray's metrics
agent (vLLM's names with the `ray_` prefix, e.g. `ray_vllm:time_to_first_token_seconds`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, AsyncIterator

from ray import serve

from services.config import DEFAULT_BLOCK_SIZE, PoolConfig, RoutingConfig

from .backend import BackendDown, BackendError, BadRequest, GenerateRequest, Output
from .engine import VLLMEngine

log = logging.getLogger("swiftkv.ray")


@serve.deployment(health_check_period_s=10, health_check_timeout_s=30, graceful_shutdown_timeout_s=5)
class EngineReplica:
    async def __init__(self, name: str, model: str, served_model_name: str, engine_args: dict[str, Any], warmup: bool):
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        self.engine = VLLMEngine(name, model, served_model_name, engine_args, warmup, stat_loggers=[RayPrometheusStatLogger])
        await self.engine.start()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        async for out in self.engine.generate(request):
            yield out

    async def check_health(self) -> None:
        if not await self.engine.health():
            raise RuntimeError(f"engine of pool {self.engine.name} is unhealthy")

    def __del__(self):
        if getattr(self, "engine", None) is not None and self.engine.llm is not None:
            self.engine.llm.shutdown()


def router_kwargs(cfg: PoolConfig, routing: RoutingConfig | None) -> dict:
    """The replica router's settings from the platform's routing config: the prefix's block size (the config's, else
    the pool's engine block_size, else vLLM's default on GPUs) and the distinctive minimum, as the gateway uses them."""
    routing = routing or RoutingConfig()
    block_size = routing.prefix_block_size or cfg.vllm_engine_args().get("block_size") or DEFAULT_BLOCK_SIZE
    return {"block_size": int(block_size), "min_distinct_tokens": routing.prefix_min_distinct_tokens}


def build_deployment(pool: str, cfg: PoolConfig, served_model_name: str, routing: RoutingConfig | None = None):
    """The Serve application of one pool (a small builder from config, as Ray Serve LLM does). Requests reach the
    replica their prompt's distinctive prefix ranks first, within a load bound (services/serving/ray_router.py),
    with the prefix read as `routing` says."""
    from ray.serve.config import RequestRouterConfig

    r = cfg.replicas
    return EngineReplica.options(
        name=f"engine-{pool}",
        max_ongoing_requests=r.max_ongoing_requests,
        request_router_config=RequestRouterConfig(request_router_class="services.serving.ray_router.PrefixAffinityRouter",
                                                  request_router_kwargs=router_kwargs(cfg, routing)),
        autoscaling_config={
            "min_replicas": r.min,
            "initial_replicas": max(r.min, 1),
            "max_replicas": r.max,
            "target_ongoing_requests": r.target_ongoing_requests,
            "upscale_delay_s": r.upscale_delay_s,
            "downscale_delay_s": r.downscale_delay_s,
        },
        ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
    ).bind(pool, cfg.model, served_model_name, cfg.vllm_engine_args(), cfg.warmup)


class RayBackend:
    """A pool's Serve application, found by name. Deployed here (`swiftkv serve --engine ray`), or, with the
    pool's `ray_app`, deployed by someone else (a KubeRay RayService from the chart's serveConfigV2): then the
    gateway only attaches, and until the application is RUNNING the pool stays down while the gateway's
    health watcher retries with backoff."""
    starts_alongside = False

    def __init__(self, name: str, cfg: PoolConfig, served_model_name: str, routing: RoutingConfig | None = None):
        self.name = name
        self.routing = routing
        self.app_name = cfg.ray_app or f"swiftkv-{name}"
        self.attached = cfg.ray_app is not None  # never deployed nor deleted from here
        self.cfg = cfg
        self.served_model_name = served_model_name
        self.handle = None
        self.running = 0  # replicas RUNNING as the last health check saw them

    async def start(self) -> None:
        t0 = time.perf_counter()
        if not self.attached:
            log.info("pool %s: deploying Ray Serve application %s (each replica starts its engine)", self.name, self.app_name)
            app = build_deployment(self.name, self.cfg, self.served_model_name, self.routing)
            # serve.run returns once the initial replicas passed their constructor (warm-up included).
            await asyncio.to_thread(serve.run, app, name=self.app_name, route_prefix=None)
        status = await self._status()
        if status != "RUNNING":
            raise BackendDown(f"pool {self.name}: Ray Serve application {self.app_name!r} is {status or 'not deployed'}")
        self.handle = await asyncio.to_thread(serve.get_app_handle, self.app_name)
        log.info("pool %s: Ray Serve application %s running (%.1fs)", self.name, self.app_name, time.perf_counter() - t0)

    async def _app(self):
        """The application's status overview, None when Serve or the application is absent."""
        try:
            return (await asyncio.to_thread(serve.status)).applications.get(self.app_name)
        except Exception:  # no Serve instance on the cluster (yet)
            return None

    async def _status(self) -> str | None:
        """The application's status (RUNNING, DEPLOYING, ...), None when Serve or the application is absent."""
        app = await self._app()
        return None if app is None else _name(app.status)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        if self.handle is None:
            raise BackendDown(f"pool {self.name}: not deployed")
        stream = self.handle.options(stream=True).generate.remote(request)
        finished = False
        try:
            async for out in stream:
                yield out
            finished = True
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, BadRequest) or isinstance(e, BadRequest):
                raise BadRequest(str(cause)) from e
            error = BackendDown if replica_gone(e) else BackendError
            raise error(f"pool {self.name}: {type(cause).__name__}: {cause}") from e
        finally:
            if not finished:
                stream.cancel()

    def kv_event_endpoints(self) -> list[str]:
        return []  # each replica's engine is on its own node; the replica router keeps its own index (ray_router.py)

    def prefix_cache(self) -> None:
        return None  # not reported over HTTP: routing.prefix_block_size / prefix_cache_tokens, or their defaults

    def replica_count(self) -> int:
        return self.running

    async def health(self) -> bool:
        """RUNNING, and (unless the pool may scale to zero) a replica running: while Serve replaces a replica
        that died, requests sent to the pool only wait in the handle for as long as the new replica's engine
        takes to start, so the pool is routed around until one runs, whatever status the application reads."""
        if self.handle is None:
            return False
        app = await self._app()
        if app is None or _name(app.status) != "RUNNING":
            self.running = 0
            return False
        running = [sum(n for state, n in d.replica_states.items() if _name(state) == "RUNNING") for d in app.deployments.values()]
        self.running = min(running, default=0)  # one deployment per pool: its engine replicas
        if self.cfg.replicas.min == 0:
            return True
        return all(n > 0 for n in running)

    async def recover(self) -> None:
        """Deploy (or attach) again if the first attempt failed; Serve itself replaces replicas that die."""
        if self.handle is None:
            await self.start()

    async def stop(self) -> None:
        if self.attached:
            return
        try:  # do not wait here: replicas drain on their own, and stop_ray() ends a cluster we started
            async with asyncio.timeout(10):  # not wait_for: it can lose a cancel (services.common.waiting)
                await asyncio.to_thread(serve.delete, self.app_name, _blocking=False)
        except Exception:
            pass


def _name(status) -> str:
    return str(status).rsplit(".", 1)[-1]


def replica_gone(e: BaseException) -> bool:
    """The error says the replica (or its worker, node, or the whole deployment) is gone, not that this one
    request failed: a dead actor (ActorDiedError, or ActorUnavailableError while Ray cannot tell yet), Serve
    finding no replica to send to, or an engine that died inside a living replica (its BackendDown), as
    raised through the handle or wrapped in a RayTaskError."""
    from ray import exceptions as rx
    from ray.serve import exceptions as sx

    gone = (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError, rx.LocalRayletDiedError,
            sx.DeploymentUnavailableError, sx.ReplicaUnavailableError, BackendDown)
    seen = 0
    while e is not None and seen < 4:  # a RayTaskError carries the original as `cause`
        if isinstance(e, gone):
            return True
        e, seen = getattr(e, "cause", None) or e.__cause__, seen + 1
    return False


_RAY_LABELS = re.compile(r'(Component|NodeAddress|SessionName|Version|WorkerId|otel_scope_\w+)="[^"]*",?')


async def engine_metrics(port: int) -> str:
    """The replicas' vLLM metrics from Ray's metrics endpoint, under vLLM's own names again (Ray exports
    `vllm:x` as `ray_vllm_x`), so stock vLLM dashboards work against the gateway's /metrics. Ray's
    bookkeeping labels are dropped except the replica id."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return ""
    out = []
    for line in text.splitlines():
        if line.startswith(("# HELP ray_vllm_", "# TYPE ray_vllm_")):
            out.append(line.replace(" ray_vllm_", " vllm:", 1))
        elif line.startswith("ray_vllm_"):
            line = "vllm:" + line[len("ray_vllm_"):]
            line = _RAY_LABELS.sub("", line).replace(",}", "}").replace('ReplicaId="', 'replica="')
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


def start_ray(address: str | None, metrics_port: int | None = None, deploy: bool = True) -> None:
    """Join `address` or start a local Ray cluster; Serve without its own HTTP proxy (the gateway is ours).
    deploy=False (every pool attaches to an application deployed by others): Serve is left to them."""
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if address:
            kwargs["address"] = address
        elif metrics_port:
            kwargs["_metrics_export_port"] = metrics_port
        ray.init(**kwargs)
    if deploy:
        serve.start(proxy_location="Disabled")


def stop_ray(started_local_cluster: bool) -> None:
    """Shut Serve down and, when we started the local cluster, Ray with it (engines end with their replicas)."""
    import ray

    if started_local_cluster:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
