"""A pool served by Ray Serve: a deployment whose replicas each own one vLLM engine, autoscaled on
ongoing requests. A replica becomes healthy only after its constructor has run a warm-up generation.

The gateway holds a deployment handle per pool and streams from it; cancelling the stream cancels the
request in the replica, which aborts it in the engine. Engine metrics are exported through Ray's metrics
agent (vLLM's names with the `ray_` prefix, e.g. `ray_vllm:time_to_first_token_seconds`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterator

from ray import serve

from .backend import BackendDown, BackendError, BadRequest, GenerateRequest, Output
from .config import PoolConfig
from .engine import VLLMEngine


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


def build_deployment(pool: str, cfg: PoolConfig, served_model_name: str):
    """The Serve application of one pool (a small builder from config, as Ray Serve LLM does)."""
    r = cfg.replicas
    return EngineReplica.options(
        name=f"engine-{pool}",
        max_ongoing_requests=r.max_ongoing_requests,
        autoscaling_config={
            "min_replicas": r.min,
            "initial_replicas": max(r.min, 1),
            "max_replicas": r.max,
            "target_ongoing_requests": r.target_ongoing_requests,
            "upscale_delay_s": r.upscale_delay_s,
            "downscale_delay_s": r.downscale_delay_s,
        },
        ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
    ).bind(pool, cfg.model, served_model_name, cfg.engine_args, cfg.warmup)


class RayBackend:
    def __init__(self, name: str, cfg: PoolConfig, served_model_name: str):
        self.name = name
        self.app_name = f"swiftkv-{name}"
        self.cfg = cfg
        self.served_model_name = served_model_name
        self.handle = None

    async def start(self) -> None:
        app = build_deployment(self.name, self.cfg, self.served_model_name)
        # serve.run returns once the initial replicas passed their constructor (warm-up included).
        self.handle = await asyncio.to_thread(serve.run, app, name=self.app_name, route_prefix=None)

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
            raise BackendError(f"pool {self.name}: {type(cause).__name__}: {cause}") from e
        finally:
            if not finished:
                stream.cancel()

    async def health(self) -> bool:
        try:
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(self.app_name)
            return app is not None and str(app.status).endswith("RUNNING")
        except Exception:
            return False

    async def recover(self) -> None:
        """Deploy again if the first deployment failed; Serve itself replaces replicas that die."""
        if self.handle is None:
            await self.start()

    async def stop(self) -> None:
        try:  # do not wait here: replicas drain on their own, and stop_ray() ends a cluster we started
            await asyncio.wait_for(asyncio.to_thread(serve.delete, self.app_name, _blocking=False), 10)
        except Exception:
            pass


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


def start_ray(address: str | None, metrics_port: int | None = None) -> None:
    """Join `address` or start a local Ray cluster; Serve without its own HTTP proxy (the gateway is ours)."""
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if address:
            kwargs["address"] = address
        elif metrics_port:
            kwargs["_metrics_export_port"] = metrics_port
        ray.init(**kwargs)
    serve.start(proxy_location="Disabled")


def stop_ray(started_local_cluster: bool) -> None:
    """Shut Serve down and, when we started the local cluster, Ray with it (engines end with their replicas)."""
    import ray

    if started_local_cluster:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
