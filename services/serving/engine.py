"""One vLLM `AsyncLLM` engine behind the Backend interface: used in-process by the gateway and inside
each Ray Serve replica.

The engine gets token ids (the gateway already applied the chat template and counted them) and streams
deltas. Leaving the output iteration early (client gone, task cancelled) aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, AsyncIterator

from prometheus_client import REGISTRY, CollectorRegistry

from services.common.kv_events import local_endpoint
from swiftkv_core.dual_mode import extra_args, with_cache_salt
from swiftkv_core.interrupts import shield_children

from .backend import BackendDown, BackendError, BadRequest, ChoiceDelta, GenerateRequest, Output, SamplingOptions, TokenLogprob

log = logging.getLogger("swiftkv.engine")

WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# How long an engine core gets to exit after SIGTERM. vLLM's default (5 s) is the time its core itself waits for
# its workers: a core killed then leaves its shared memory behind (resource_tracker's "leaked" warning at exit).
SHUTDOWN_SECONDS = 15.0


class EngineMetrics:
    """vLLM registers its `vllm:` metrics in the global registry and unregisters any earlier ones when a
    second engine starts in the same process. Each engine's Prometheus logger (`stat_logger`) moves its
    collectors into the engine's own registry as it is built, and one collector exposes the union (samples
    differ by `model_name`)."""

    def __init__(self) -> None:
        self.registries: dict[str, CollectorRegistry] = {}
        self._registering = threading.Lock()  # one engine's register-then-move at a time: engines start together
        REGISTRY.register(self)

    def stat_logger(self, engine: str):
        """vLLM's Prometheus stat logger for `engine`, as a factory for `AsyncLLM(stat_loggers=...)`: it registers
        vLLM's metrics and moves them into the engine's registry in one step, so an engine starting alongside
        cannot unregister them in between. A restarted engine's replace its old ones."""
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        metrics = self

        class EnginePrometheusStatLogger(PrometheusStatLogger):
            def __init__(self, *args, **kwargs):
                with metrics._registering:
                    super().__init__(*args, **kwargs)
                    metrics._adopt_vllm_collectors(engine)

        return EnginePrometheusStatLogger

    def _adopt_vllm_collectors(self, engine: str) -> None:
        own = CollectorRegistry(auto_describe=False)
        for collector in list(REGISTRY._collector_to_names):
            if getattr(collector, "_name", "").startswith("vllm:"):
                REGISTRY.unregister(collector)
                own.register(collector)
        self.registries[engine] = own

    def describe(self):  # no fixed names: never conflicts with other collectors
        return []

    def collect(self):
        families: dict[str, Any] = {}
        for registry in list(self.registries.values()):
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())


_engine_metrics: EngineMetrics | None = None


def engine_metrics() -> EngineMetrics:
    global _engine_metrics
    if _engine_metrics is None:
        _engine_metrics = EngineMetrics()
    return _engine_metrics


def to_sampling_params(options: SamplingOptions):
    """vLLM's SamplingParams with every field of `options` under its own name (`structured` is vLLM's
    `structured_outputs`); vLLM takes None, not an empty list or dict, for a field left unset."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    params = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    params = {name: None if value == [] or value == {} else value for name, value in params.items()}
    structured = params.pop("structured")
    return SamplingParams(**params, structured_outputs=StructuredOutputsParams(**structured) if structured else None,
                          output_kind=RequestOutputKind.DELTA)


def engine_inputs(request: GenerateRequest) -> tuple[dict, Any]:
    """The prompt and SamplingParams `AsyncLLM.generate` takes for `request`: a dual-mode engine's base-mode request
    carries the mode in its extra_args; the prompt carries the prefix-cache salt of its mode and its key
    (swiftkv_core/dual_mode.py)."""
    params = to_sampling_params(request.sampling)
    params.extra_args = extra_args(request.mode)
    return with_cache_salt({"prompt_token_ids": request.prompt_token_ids}, request.mode, request.key_salt), params


def _logprobs(token_ids, entries, k: int) -> list[TokenLogprob]:
    """Logprobs floored at -9999.0 as vLLM's server does: a masked token's -inf is not JSON."""
    result = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        result.append(
            TokenLogprob(
                token=chosen.decoded_token or "",
                logprob=max(float(chosen.logprob), -9999.0),
                top=[(lp.decoded_token or "", max(float(lp.logprob), -9999.0)) for lp in top],
            )
        )
    return result


_spawn_env = threading.Lock()


@contextmanager
def cpu_binding(bind: str | None):
    """VLLM_CPU_OMP_THREADS_BIND = `bind` for the engine core process that building an AsyncLLM spawns (None: the
    environment as it is). vLLM reads it in that process, which takes this process's environment as it is spawned:
    the variable is held (under a lock, so two engines starting at once do not see each other's value) only until
    the new EngineCore child exists. The rest of the start (model load, KV cache, warm-up) overlaps other engines'."""
    from swiftkv_core.hardware import BIND_ENV

    if bind is None:
        yield
        return
    _spawn_env.acquire()
    known = set(multiprocessing.active_children())
    before = os.environ.get(BIND_ENV)
    os.environ[BIND_ENV] = bind
    restored = threading.Event()
    restoring = threading.Lock()

    def restore() -> None:
        with restoring:
            if restored.is_set():
                return
            if before is None:
                os.environ.pop(BIND_ENV, None)
            else:
                os.environ[BIND_ENV] = before
            restored.set()
            _spawn_env.release()

    def restore_once_spawned() -> None:
        while not restored.wait(0.02):
            if any(p.name.startswith("EngineCore") for p in set(multiprocessing.active_children()) - known):
                restore()

    threading.Thread(target=restore_once_spawned, name="cpu-binding", daemon=True).start()
    try:
        yield
    finally:
        restore()


class VLLMEngine:
    """Owns one AsyncLLM, built from `engine_args` (a pool's `PoolConfig.vllm_engine_args()`: its speculative decoding
    included). `start()` builds it (off the event loop) and runs a warm-up generation. `cpu_bind`: the
    VLLM_CPU_OMP_THREADS_BIND its workers start with (`hardware.plan_cpu_binding`); None leaves vLLM's."""

    def __init__(self, name: str, model: str, served_model_name: str, engine_args: dict[str, Any], warmup: bool = True,
                 stat_loggers: list | None = None, cpu_bind: str | None = None):
        self.name = name
        self.cpu_bind = cpu_bind
        self.stat_loggers = stat_loggers
        self.model = model
        self.served_model_name = served_model_name
        self.engine_args = dict(engine_args)
        self.warmup = warmup
        self.llm = None
        self.ready = False
        self.stopped = False
        self._swap = threading.Lock()  # stop() against a start finishing in its thread

    def _build(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from swiftkv_core.hardware import engine_args_for_machine, vllm_on_cpu

        engine_args = engine_args_for_machine(self.engine_args, vllm_on_cpu(), f"pools.{self.name}.engine_args")
        args = AsyncEngineArgs(model=self.model, served_model_name=[self.served_model_name], **engine_args)
        # A Ctrl-C in a terminal reaches only the gateway, which drains, then stops the engine's processes in order.
        with shield_children(), cpu_binding(self.cpu_bind):
            llm = AsyncLLM.from_engine_args(args, stat_loggers=self.stat_loggers)
        # Kept on self, not returned nor left in a local: this thread's frames can outlive the start (an error a
        # library stored while vLLM imported holds them), and an engine they still hold at exit shuts down again
        # in the interpreter's teardown, with a traceback.
        with self._swap:
            if not self.stopped:
                self.llm, llm = llm, None
        if llm is not None:  # stopped while it started: its processes would outlive the gateway
            llm.shutdown(timeout=SHUTDOWN_SECONDS)
            llm = None

    async def start(self) -> None:
        t0 = time.perf_counter()
        self.stopped = False
        log.info("pool %s: starting the engine for %s", self.name, self.model)
        await asyncio.to_thread(self._build)
        if self.llm is None:
            raise BackendDown(f"pool {self.name}: stopped while its engine started")
        if self.warmup:
            request = GenerateRequest(f"warmup-{self.name}", WARMUP_PROMPT, SamplingOptions(max_tokens=2))
            async for _ in self.generate(request):
                pass
        self.ready = True
        cache = self.llm.vllm_config.cache_config
        speculative = self.llm.vllm_config.speculative_config
        log.info("pool %s: engine for %s ready in %.1fs (KV cache: %s tokens%s)", self.name, self.model, time.perf_counter() - t0,
                 f"{(cache.num_gpu_blocks or 0) * cache.block_size:,}",
                 f"; speculative decoding: {speculative.method}, up to {speculative.num_speculative_tokens} tokens per step"
                 if speculative is not None else "")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Output]:
        from vllm.exceptions import VLLMClientError

        if self.llm is None:
            raise BackendDown(f"pool {self.name}: engine not started")
        try:
            prompt, params = engine_inputs(request)
        except ValueError as e:  # vLLM's own checks of the parameters
            raise BadRequest(str(e)) from e
        prefilled = False
        try:
            async for out in self.llm.generate(prompt, params, request.request_id, priority=request.priority):
                queue_seconds = cached_tokens = None
                if not prefilled:
                    prefilled = True
                    stats = getattr(out, "metrics", None)
                    if stats is not None and getattr(stats, "scheduled_ts", 0) and getattr(stats, "queued_ts", 0):
                        queue_seconds = max(0.0, stats.scheduled_ts - stats.queued_ts)
                    cached_tokens = out.num_cached_tokens  # known once prefilled, as vLLM's server reads it
                choices = []
                for c in out.outputs:
                    if c.finish_reason == "error":  # vLLM failed this request in its engine (e.g. its grammar did not compile)
                        raise BackendError(f"pool {self.name}: the engine failed request {request.request_id}")
                    if not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs = None
                    if request.sampling.logprobs is not None and c.logprobs is not None:
                        logprobs = _logprobs(c.token_ids, c.logprobs, request.sampling.logprobs)
                    choices.append(ChoiceDelta(c.index, c.text, len(c.token_ids), c.finish_reason, logprobs, list(c.token_ids)))
                yield Output(choices, queue_seconds, cached_tokens)
        except VLLMClientError as e:
            raise BadRequest(str(e)) from e
        except ValueError as e:  # vLLM validates sampling parameters and prompt length with ValueError
            raise BadRequest(str(e)) from e
        except (asyncio.CancelledError, GeneratorExit, BackendError):
            raise
        except Exception as e:
            # Only a dead engine takes the pool down; anything else failed this one request.
            error = BackendDown if self.dead else BackendError
            raise error(f"pool {self.name}: {type(e).__name__}: {e}") from e

    @property
    def dead(self) -> bool:
        """The engine is gone (its core process died or it was never built): only a restart helps."""
        return self.llm is None or self.llm.errored

    def kv_event_endpoints(self) -> list[str]:
        endpoint = local_endpoint(self.engine_args.get("kv_events_config") or {})
        return [] if endpoint is None else [endpoint]

    def prefix_cache(self) -> tuple[int, int] | None:
        if self.llm is None:
            return None
        cache = self.llm.vllm_config.cache_config
        return cache.block_size, (cache.num_gpu_blocks or 0) * cache.block_size

    async def health(self) -> bool:
        if self.llm is None or not self.ready:
            return False
        try:
            await self.llm.check_health()
            return True
        except Exception:
            return False

    async def stop(self) -> None:
        with self._swap:
            llm, self.llm, self.ready, self.stopped = self.llm, None, False, True
        if llm is not None:
            # vLLM cancels its output handler only after the engine core has stopped; until then the handler can read
            # the dead engine and log an EngineDeadError traceback at every clean stop. Cancelled first, on its loop.
            from vllm.utils.async_utils import cancel_task_threadsafe

            cancel_task_threadsafe(getattr(llm, "output_handler", None))
            # off the event loop: the shutdown waits on the engine's processes (vLLM allows other threads)
            await asyncio.to_thread(llm.shutdown, timeout=SHUTDOWN_SECONDS)


class InProcessBackend(VLLMEngine):
    """The gateway's own engine (no Ray): `swiftkv serve --engine inprocess`."""

    @property
    def starts_alongside(self) -> bool:
        """Bound to CPU cores of its own, its start competes with no other engine's."""
        return self.cpu_bind not in (None, "nobind")

    def replica_count(self) -> int:
        """One engine (its tensor- or pipeline-parallel workers serve it together)."""
        return 1

    async def start(self) -> None:
        self.stat_loggers = [engine_metrics().stat_logger(self.name)]  # its metrics kept apart from other engines'
        await super().start()

    async def recover(self) -> None:
        """Restart the engine if it is dead (its core process exited) or never finished starting; a live one
        that answered its health check slowly is left alone."""
        if self.ready and not self.dead:
            return
        log.warning("pool %s: the engine is %s; restarting it", self.name, "dead" if self.dead else "not started")
        try:
            await self.stop()
        except Exception:  # the remains of a dead engine: nothing left to save
            log.exception("pool %s: shutting the dead engine down", self.name)
            self.llm = None
        await self.start()
