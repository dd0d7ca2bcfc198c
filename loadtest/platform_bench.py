"""Platform load test (`swiftkv bench platform`): the whole platform under realistic traffic, against the
obvious alternatives, one after the other on the same cores.

Each configuration is started by this tool as its own `swiftkv serve --engine inprocess` process (two
in-process engines, same engine arguments and KV budget each), measured, and stopped before the next:

    routed   swiftkv pool = the SwiftKV model, base pool = the base model; requests name the public
             model, and the prompt/output ratio alone picks the pool (routing.balance and cache_aware off)
    routed-cache
             the same pools with the platform's default routing: the ratio's intent, overridden by the pools'
             predicted work (balance) and by what each holds in its prefix cache (cache_aware)
    routed-events
             routed-cache with the gateway's prefix-cache index following the engines' KV-cache events
             (routing.kv_events) instead of predicting what they evict
    routed-dual
             both pools run the SwiftKV model as dual-mode engines (each pool's `dual_mode`: every engine serves the
             SwiftKV and the base model, per request), with the platform's default routing: the ratio's intent picks
             the model, load and prefix cache the engine, so prompt-heavy traffic at capacity runs as SwiftKV on both
    base     both pools serve the base model; requests alternate between the two pools' own model names
             (round-robin over two replicas, through the same gateway)
    swiftkv  both pools serve the SwiftKV model, round-robin likewise
    routed-spec, base-spec
             routed-cache and base with speculative decoding on every pool: each pool's `speculative` block in the
             platform config (the method and its settings: --spec-method, --spec-tokens, --spec-lookup-min/max;
             default ngram, 4 tokens, n-grams of 2 to 4). A SwiftKV pool cannot speculate on a GPU, so routed-spec
             is refused there before anything starts
    routed-responses
             routed-cache, every request sent through the Responses API (`/v1/responses`, streamed, vLLM's ignore_eos as
             the chat requests have it): a later turn of a chat-multiturn conversation carries only its own user message
             and the previous turn's `previous_response_id`, so the gateway rebuilds the conversation from its store; its
             time to first token is to the first `response.output_text.delta` event (a chat request's: to the first chunk
             with content). Beside routed-cache (the same conversations through chat with the whole history) and base, it
             measures what rebuilding the history costs a turn (the per-turn TTFT figures and plot)

The traffic (loadtest.workloads) is sent with the official openai client (async, streaming, usage in the
last chunk, ignore_eos so every request generates its full max_tokens) at each rate of a sweep; a later turn
of a chat-multiturn conversation once the previous turn's answer has arrived, with the conversation so far (the
answers as they came). Every configuration gets the same requests; each rate draws texts of its own (the run's seed,
then loadtest.workloads.rate_seed), and so do the few warm-up requests sent before the first rate (warmup_seed):
texts measured twice on one platform would be found in its prefix cache. Per config and rate: TTFT p50/p90/p99, TPOT p50/p99, inter-token latency, end-to-end latency, requests/s, prompt and
output tokens/s, goodput (requests/s meeting both SLOs), errors, the share of requests each pool served
(from the `x-swiftkv-route` header; routed-dual: also the share a pool ran as the other pool's model), and per
pool what its engines' speculative decoding drafted and accepted (vLLM's counters on the server's /metrics, read
before and after each rate: loadtest.speculation), and for chat-multiturn the TTFT p50 of first and of later turns (a
later turn finds its history in the prefix cache) and TTFT p50/p99 per turn. The CPU model, its vector flags and the load average are recorded.

With a target (`--target URL --target-model NAME`) no configuration is started: the same traffic goes to a
server already running there (a deployed gateway, vLLM's own OpenAI server), every request asking for NAME,
and the report has one configuration named NAME@host:port.

Run it as `swiftkv bench platform ...` from the repository root.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from loadtest import speculation as spec
from loadtest.predictions import prefix_cache, ttft_predictions
from loadtest.workloads import WORKLOADS, Request, generate, rate_seed, summary, warmup_seed
from services.config import DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_MODEL_LEN

ROOT = Path(__file__).resolve().parents[1]
# configuration -> (its pools' models: routed, base, swiftkv or dual (both the SwiftKV model, dual-mode); its routing
# settings beyond the platform's defaults)
LAYOUTS: dict[str, tuple[str, dict]] = {
    "routed": ("routed", {"balance": False, "cache_aware": False}),
    "routed-cache": ("routed", {}),
    "base": ("base", {}),
    "swiftkv": ("swiftkv", {}),
    "routed-spec": ("routed", {}),
    "base-spec": ("base", {}),
    "routed-events": ("routed", {"kv_events": True}),
    "routed-dual": ("dual", {}),
    "routed-responses": ("routed", {}),
}
ROUTED_LAYOUTS = ("routed", "dual")  # requests name the public model, and the gateway routes them
CONFIGS = tuple(LAYOUTS)
DEFAULT_CONFIGS = ("routed", "routed-cache", "base", "swiftkv")
SPECULATING = ("routed-spec", "base-spec")  # every pool speculates
SPEC_METHODS = ("ngram", "suffix")
RESPONSES_API = ("routed-responses",)  # sent through /v1/responses (a conversation by previous_response_id)
APIS = ("chat", "responses")
PUBLIC = "swiftkv-bench"


class PlatformBenchError(ValueError):
    """A run that cannot start or finish (bad option, missing model, a server that does not come up)."""


@dataclass
class PlatformBenchConfig:
    base_model: str = "models/smollm2-135m-instruct"
    swiftkv_model: str = "models/smollm2-135m-instruct-swiftkv"
    tokenizer: str | None = None  # default: the base model's
    text: str = "data/mix/heldout.jsonl"
    workload: str = "rag"
    rates: list[float] = field(default_factory=lambda: [0.5])
    count: int = 100  # requests per rate at most
    duration_s: float = 180.0  # arrivals per rate end after this
    seed: int = 0
    scale: float = 1.0  # length targets multiplied by this (tiny models)
    configs: list[str] = field(default_factory=lambda: list(DEFAULT_CONFIGS))
    spec_method: str = "ngram"  # the -spec configurations' speculative decoding (each pool's `speculative` block)
    spec_tokens: int = 4
    spec_lookup_min: int = 2  # ngram only
    spec_lookup_max: int = 4
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    dtype: str = "auto"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    extra_engine_args: dict = field(default_factory=dict)
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    reference_rate: float | None = None  # the rate of the top-level figures and the CDF; default the highest
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 900.0
    quiet_load: float | None = None  # wait for the 1-minute load average to fall below this before each configuration
    quiet_timeout_s: float = 600.0
    warmup_requests: int = 2
    progress: bool = True
    target: str | None = None  # a running OpenAI-compatible server's base URL: drive it instead of the configs
    target_model: str | None = None  # the model the requests to the target ask for
    api_key: str = "none"

    @property
    def target_name(self) -> str:
        from urllib.parse import urlsplit

        return f"{self.target_model}@{urlsplit(self.target).netloc}"

    def check(self) -> None:
        if self.workload not in WORKLOADS:
            raise PlatformBenchError(f"--workload: unknown {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.target is not None:
            if not self.target.startswith(("http://", "https://")):
                raise PlatformBenchError(f"--target: {self.target!r} is not an http(s) URL")
            if not self.target_model:
                raise PlatformBenchError("--target-model: the model the requests to --target ask for is required")
        bad = [c for c in self.configs if c not in CONFIGS]
        if self.target is None and (bad or not self.configs):
            raise PlatformBenchError(f"--configs: unknown {bad or 'none given'}; choose from {', '.join(CONFIGS)}")
        if self.target is None and any(c in SPECULATING for c in self.configs):
            self.speculative_block()  # refuses settings the platform config would
        if not self.rates or min(self.rates) <= 0:
            raise PlatformBenchError(f"--rate: rates must be positive, got {self.rates}")
        if self.count < 1 or self.duration_s <= 0 or self.scale <= 0:
            raise PlatformBenchError("--count, --duration and --scale must be positive")
        if self.reference_rate is not None and self.reference_rate not in self.rates:
            raise PlatformBenchError(f"--reference-rate {self.reference_rate} is not one of the rates {self.rates}")
        # a target needs only a tokenizer (the base model's unless --tokenizer names one)
        folders = [] if self.target is not None and self.tokenizer else [("--base-model", self.base_model)]
        if self.target is None:
            folders.append(("--swiftkv-model", self.swiftkv_model))
        for opt, path in folders:
            if not (Path(path) / "config.json").exists():
                raise PlatformBenchError(f"{opt}: {path} is not a model folder with a config.json")
        if not Path(self.text).exists():
            raise PlatformBenchError(f"--text: {self.text} does not exist (write it with `swiftkv data prepare`)")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise PlatformBenchError(f"--tokenizer: {self.tokenizer} does not exist (a model or tokenizer folder)")

    def speculative_block(self) -> dict:
        """The `speculative` block of every pool of a -spec configuration, as the platform config takes it."""
        from pydantic import ValidationError

        from services.config import SpeculativeConfig

        if self.spec_method not in SPEC_METHODS:
            raise PlatformBenchError(f"--spec-method: unknown {self.spec_method!r}; choose from {', '.join(SPEC_METHODS)}")
        block = {"method": self.spec_method, "num_speculative_tokens": self.spec_tokens}
        if self.spec_method == "ngram":
            block |= {"prompt_lookup_min": self.spec_lookup_min, "prompt_lookup_max": self.spec_lookup_max}
        try:
            SpeculativeConfig.model_validate(block)
        except ValidationError as e:
            flags = {"num_speculative_tokens": "--spec-tokens", "prompt_lookup_min": "--spec-lookup-min",
                     "prompt_lookup_max": "--spec-lookup-max"}
            raise PlatformBenchError("; ".join(f"{flags.get(err['loc'][0], '--spec-*') if err['loc'] else '--spec-*'}: "
                                               f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())) from None
        return block


# --------------------------------------------------------------------------------------------------
# Configurations and their servers


def engine_args(cfg: PlatformBenchConfig) -> dict:
    return {"max_model_len": cfg.max_model_len, "dtype": cfg.dtype, "enforce_eager": True,
            "kv_cache_memory_bytes": cfg.kv_cache_bytes, **cfg.extra_engine_args}


def platform_config(name: str, cfg: PlatformBenchConfig, port: int) -> dict:
    """The `swiftkv serve` YAML of one configuration (pools named swiftkv/base in every one, whatever model each serves)."""
    if name not in LAYOUTS:
        raise PlatformBenchError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    layout, routing = LAYOUTS[name]
    swiftkv, base = {"routed": (cfg.swiftkv_model, cfg.base_model), "base": (cfg.base_model, cfg.base_model),
                     "swiftkv": (cfg.swiftkv_model, cfg.swiftkv_model), "dual": (cfg.swiftkv_model, cfg.swiftkv_model)}[layout]
    dual = {"dual_mode": True} if layout == "dual" else {}
    tokenizer = cfg.tokenizer or cfg.base_model
    speculative = cfg.speculative_block() if name in SPECULATING else None

    def pool(model: str) -> dict:
        spec = {} if speculative is None else {"speculative": dict(speculative)}
        return {"model": str(Path(model).resolve()), "tokenizer": str(Path(tokenizer).resolve()), "engine_args": engine_args(cfg), **spec,
                **dual}

    return {"model": PUBLIC, "host": "127.0.0.1", "port": port, "pools": {"swiftkv": pool(swiftkv), "base": pool(base)},
            "limits": {"max_body_bytes": 4_000_000},
            # the route's reason in the x-swiftkv-route header: the bench counts requests by it
            "routing": {"expose_reason": True, **(routing or {})}}


def model_names(name: str) -> list[str]:
    """What requests ask for, in turn: the public name (routed), or each pool's own name (round-robin)."""
    return [PUBLIC] if LAYOUTS[name][0] in ROUTED_LAYOUTS else [f"{PUBLIC}-swiftkv", f"{PUBLIC}-base"]


def speculation_refusals(cfg: PlatformBenchConfig, on_cpu: bool) -> list[str]:
    """Why `swiftkv serve` would refuse a chosen -spec configuration on this kind of machine (a SwiftKV pool
    speculating on a GPU, suffix decoding without Arctic Inference): its own check, run before anything starts."""
    from services.config import PlatformConfig
    from services.serve import speculation_refusal

    refusals = []
    for name in (c for c in cfg.configs if c in SPECULATING):
        platform = PlatformConfig.model_validate(platform_config(name, cfg, 0))
        for pool_name, pool in platform.pools.items():
            refusal = speculation_refusal(pool_name, pool, on_cpu)
            if refusal:
                refusals.append(f"--configs {name}: {refusal}")
    return refusals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def existing(base: str, model: str, api_key: str, timeout: float):
    """A server this tool did not start: yields its base URL once its /v1/models lists `model`."""
    import httpx

    base = base.rstrip("/")
    try:
        r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
    except httpx.HTTPError as e:
        raise PlatformBenchError(f"--target: {base} does not answer: {e}") from e
    if r.status_code != 200:
        raise PlatformBenchError(f"--target: GET {base}/v1/models answered {r.status_code}: {r.text[:300]}")
    served = [m.get("id") for m in r.json().get("data", [])]
    if model not in served:
        raise PlatformBenchError(f"--target-model: {base} does not serve {model!r} (it serves {', '.join(map(str, served))})")
    yield base


@contextmanager
def serve(name: str, cfg: PlatformBenchConfig, work: Path, log: Callable[[str], None]):
    """A running `swiftkv serve` of configuration `name`; yields its base URL, stops it (engines too) after."""
    with started(name, cfg, work, log) as (base, _):
        yield base


@contextmanager
def started(name: str, cfg: PlatformBenchConfig, work: Path, log: Callable[[str], None]):
    """As `serve`, yielding (base URL, the `swiftkv serve` process: the gateway, with its engines as children)."""
    port = free_port()
    cfg_path, log_path = work / f"{name}.yaml", work / f"{name}.log"
    cfg_path.write_text(yaml.safe_dump(platform_config(name, cfg, port)))
    log(f"{name}: starting swiftkv serve on port {port} (log {log_path})")
    with swiftkv_serve(["--config", str(cfg_path), "--data-dir", str(work / f"{name}-data")], port, log_path,
                       cfg.ready_timeout_s, name) as running:
        try:
            yield running
        except PlatformBenchError as e:  # the log goes with the run's temporary folder: its end goes with the error
            raise PlatformBenchError(f"{e}\n--- the end of {name}'s swiftkv serve log:\n{log_path.read_text()[-3000:]}") from None


@contextmanager
def swiftkv_serve(args: list[str], port: int, log_path: Path, ready_timeout_s: float, name: str = "swiftkv serve"):
    """`swiftkv serve --engine inprocess --port PORT ARGS`, output to LOG_PATH, yielding (base URL, process) once every
    pool is ready. The process leads its own process group, which is stopped as a whole after (also on Ctrl-C)."""
    swiftkv = Path(sys.executable).parent / "swiftkv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWIFTKV_API_KEYS")}
    with open(log_path, "w") as out:
        proc = subprocess.Popen([str(swiftkv), "serve", "--engine", "inprocess", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_every_pool(base, ready_timeout_s, name, proc, log_path)
        yield base, proc
    finally:
        stop_tree(proc)


def wait_for_every_pool(base: str, timeout_s: float, name: str, proc: subprocess.Popen | None = None, log_path: Path | None = None,
                        every_s: float = 1.0) -> None:
    """Until the gateway at BASE has every pool ready: its /ready answers 200 as soon as one pool serves (the other's
    traffic goes there meanwhile), and the run's traffic, the warm-up pinned to each pool first, needs them all. Fails
    with the end of LOG_PATH when PROC exits first or TIMEOUT_S passes."""
    import httpx

    def logged() -> str:
        return log_path.read_text()[-3000:] if log_path is not None else ""

    deadline = time.time() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise PlatformBenchError(f"{name}: swiftkv serve exited with {proc.returncode}:\n{logged()}")
        try:
            r = httpx.get(f"{base}/ready", timeout=2)
            if r.status_code == 200 and all(r.json()["pools"].values()):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.time() > deadline:
            raise PlatformBenchError(f"{name}: not every pool ready after {timeout_s:.0f} s:\n{logged()}")
        time.sleep(every_s)


def stop_tree(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM to PROC's process group, then wait until PROC and every process it started are gone, SIGKILL after
    GRACE_S. Waiting for the leader alone is not enough: engine cores finish exiting a moment after it, and
    multiprocessing's resource tracker ignores SIGTERM and leaves only once the last of them has closed its pipe."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []

    def running() -> list:  # a zombie has exited: it only waits for its parent to reap it
        left = []
        for p in tree:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        return left

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for p in running():  # a descendant that left the group is still ours to stop
            with suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        deadline = time.time() + wait_s
        while running() and time.time() < deadline:
            time.sleep(0.2)
        if not running():
            break
    proc.wait()


# --------------------------------------------------------------------------------------------------
# Driving a server


@dataclass
class Record:
    index: int
    kind: str
    model: str
    sent_s: float = 0.0  # after the start of the run
    turn: int = 0  # its request's (chat-multiturn)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    pool: str | None = None
    route_reason: str | None = None
    mode: str | None = None  # the model a dual-mode pool ran it as, where not the pool's own (the route header's)
    finish_reason: str | None = None
    error: str | None = None
    answer: str | None = field(default=None, repr=False)  # the text it got, kept for a conversation's next turn
    response_id: str | None = None  # the Responses API's id of its answer (a conversation's next turn continues it)

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def parse_route(header: str | None) -> tuple[str | None, str | None, str | None]:
    """(pool, reason, mode) of the gateway's `x-swiftkv-route` header; mode only where a dual-mode pool ran the request as
    the other pool's model."""
    parts = dict(p.strip().split("=", 1) for p in (header or "").split(";") if "=" in p)
    return parts.get("pool"), parts.get("reason"), parts.get("mode")


async def one_request(client, req: Request, model: str, t0: float, timeout: float, history: list[dict] | None = None) -> Record:
    """`req` sent to `model`; with `history` (the conversation before it), its messages follow it and the record keeps
    the answer's text."""
    rec = Record(req.index, req.kind, model, sent_s=time.perf_counter() - t0, turn=req.turn)
    start = time.perf_counter()
    pieces: list[str] = []
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=[*(history or []), *req.messages()], max_tokens=req.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout)
        rec.pool, rec.route_reason, rec.mode = parse_route(raw.headers.get("x-swiftkv-route"))
        stream = raw.parse()
        if asyncio.iscoroutine(stream):
            stream = await stream
        last = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and (chunk.choices[0].delta.content or "") != "":
                pieces.append(chunk.choices[0].delta.content)
                if rec.ttft_s is None:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last = now
            if chunk.choices and chunk.choices[0].finish_reason:
                rec.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                rec.prompt_tokens, rec.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        rec.e2e_s = time.perf_counter() - start
        if history is not None:
            rec.answer = "".join(pieces)
        if rec.ttft_s is None:
            rec.error = "no content in the stream"
        elif rec.finish_reason is None:  # cut short: the server closed it without finishing the choice
            rec.error = "the stream ended without a finish_reason"
    except Exception as e:  # a failed request is a figure of the run, not the end of it
        rec.error = error_text(e)
    return rec


async def one_response(client, req: Request, model: str, t0: float, timeout: float, previous: str | None = None,
                       conversation: bool = False) -> Record:
    """`req` sent through the Responses API (streamed, stored) to `model`, continuing the response `previous` (a
    conversation's earlier turn, which the gateway rebuilds from its store); its TTFT is to the first
    `response.output_text.delta` event. `conversation`: the record keeps the answer's text and the response's id."""
    rec = Record(req.index, req.kind, model, sent_s=time.perf_counter() - t0, turn=req.turn)
    start = time.perf_counter()
    pieces: list[str] = []
    try:
        raw = await client.responses.with_raw_response.create(
            model=model, input=req.messages()[0]["content"], max_output_tokens=req.max_tokens, temperature=0, stream=True,
            store=True, previous_response_id=previous, extra_body={"ignore_eos": True}, timeout=timeout)
        rec.pool, rec.route_reason, rec.mode = parse_route(raw.headers.get("x-swiftkv-route"))
        stream = raw.parse()
        if asyncio.iscoroutine(stream):
            stream = await stream
        last = None
        async for event in stream:
            now = time.perf_counter()
            if event.type == "response.output_text.delta" and event.delta:
                pieces.append(event.delta)
                if rec.ttft_s is None:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last = now
            elif event.type in ("response.completed", "response.incomplete"):
                response = event.response
                rec.response_id = response.id
                # as a chat choice's: cut by max_output_tokens is "length"
                rec.finish_reason = "stop" if event.type == "response.completed" else "length"
                if response.usage is not None:
                    rec.prompt_tokens, rec.output_tokens = response.usage.input_tokens, response.usage.output_tokens
            elif event.type in ("response.failed", "error"):
                detail = event.response.error if event.type == "response.failed" else event
                rec.error = f"{event.type}: {getattr(detail, 'message', detail)}"
        rec.e2e_s = time.perf_counter() - start
        if conversation:
            rec.answer = "".join(pieces)
        if rec.error is None and rec.ttft_s is None:
            rec.error = "no output text in the stream"
        elif rec.error is None and rec.finish_reason is None:
            rec.error = "the stream ended without response.completed or response.incomplete"
    except Exception as e:  # a failed request is a figure of the run, not the end of it
        rec.error = error_text(e)
    return rec


def error_text(e: BaseException) -> str:
    """The exception and what raised it: the openai client's "Connection error." says nothing of which one (a refused
    connection, one the server closed before answering, a read that timed out)."""
    text = f"{type(e).__name__}: {str(e)[:200]}"
    cause = e.__cause__ or e.__context__
    return text if cause is None else f"{text} ({type(cause).__name__}: {str(cause)[:200]})"


async def drive(base: str, names: list[str], requests: list[Request], timeout: float, on_done: Callable[[Record], None],
                api_key: str = "none", api: str = "chat") -> tuple[list[Record], float]:
    """Send each request at its arrival time (not waiting for earlier ones), but a later turn of a conversation
    (chat-multiturn) no sooner than its think time after the previous turn's answer has arrived; -> records, in the
    order of `requests`, and the run's span (first send to last finish, as guidellm counts it: the first arrival comes
    a gap after the clock starts). `on_done` gets each record as its request ends. `api`: "chat" (a later turn
    carries the whole conversation) or "responses" (`/v1/responses`: a later turn carries its own message and the
    previous turn's previous_response_id)."""
    import httpx
    import openai

    if api not in APIS:
        raise PlatformBenchError(f"api: unknown {api!r}; choose from {', '.join(APIS)}")
    limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=1000)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=timeout,
                                http_client=httpx.AsyncClient(limits=limits, timeout=timeout))
    t0 = time.perf_counter()
    records: list[Record | None] = [None] * len(requests)

    async def send(i: int, not_before: float = 0.0, history: list[dict] | None = None, previous: Record | None = None) -> Record:
        req = requests[i]
        await asyncio.sleep(max(0.0, max(req.arrival_s, not_before) - (time.perf_counter() - t0)))
        model = names[req.index % len(names)]
        if api == "responses":
            records[i] = await one_response(client, req, model, t0, timeout, previous and previous.response_id, history is not None)
        else:
            records[i] = await one_request(client, req, model, t0, timeout, history)
        on_done(records[i])
        return records[i]

    async def conversation(turns: list[int]) -> None:
        # each turn's messages: the earlier ones with their answers as they came, so its prompt starts with what the
        # engine cached for the previous turn
        history: list[dict] = []
        prev: Record | None = None
        for i in turns:
            req = requests[i]
            if prev is not None and prev.error is not None:  # no answer to follow up on: the rest is not sent
                records[i] = Record(req.index, req.kind, names[req.index % len(names)], turn=req.turn,
                                    error=f"not sent: turn {prev.turn} of its conversation failed")
                on_done(records[i])
                continue
            prev = await send(i, 0.0 if prev is None else prev.sent_s + prev.e2e_s + req.think_s, history, prev)
            history += [*req.messages(), {"role": "assistant", "content": prev.answer}]

    chains: dict[int | None, list[int]] = {}
    for i, r in enumerate(requests):
        if r.turn:
            chains.setdefault(r.group, []).append(i)
    try:
        await asyncio.gather(*(send(i) for i, r in enumerate(requests) if not r.turn),
                             *(conversation(sorted(c, key=lambda i: requests[i].turn)) for c in chains.values()))
    finally:
        await client.close()
    first_send = min((r.arrival_s for r in requests), default=0.0)
    return list(records), time.perf_counter() - t0 - first_send


def draws(cfg: PlatformBenchConfig, rates: list[float], tokenizer) -> tuple[dict[float, int], dict[float, list[Request]], list[Request]]:
    """Each rate's seed and requests, and the warm-up's requests: texts of their own for each (module docstring)."""
    seeds = {r: rate_seed(cfg.seed, k) for k, r in enumerate(rates)}
    workloads = {r: generate(cfg.workload, cfg.text, tokenizer, r, cfg.count, cfg.duration_s, seeds[r], cfg.scale) for r in rates}
    warmup = generate(cfg.workload, cfg.text, tokenizer, rates[0], max(cfg.warmup_requests, 1), None, warmup_seed(cfg.seed), cfg.scale)
    return seeds, workloads, warmup


async def warm_up(base: str, names: list[str], requests: list[Request], n: int, timeout: float, api_key: str = "none",
                  api: str = "chat") -> None:
    """A few requests to each model name in `names` (the pools pinned, then what the run asks for), not measured; with
    `api` "responses", through /v1/responses (which opens the response store)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    try:
        for name in dict.fromkeys(names):
            for req in requests[:n]:
                rec = await (one_response if api == "responses" else one_request)(client, req, name, time.perf_counter(), timeout)
                if rec.error:
                    raise PlatformBenchError(f"warm-up request to {name} failed: {rec.error}")
    finally:
        await client.close()


# --------------------------------------------------------------------------------------------------
# Figures


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def figures(records: list[Record], span_s: float, rate: float, cfg: PlatformBenchConfig) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    good = [r for r in ok if r.ttft_s <= cfg.ttft_slo_s and (r.tpot_s is None or r.tpot_s <= cfg.tpot_slo_s)]
    prompt_toks, out_toks = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    pools: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in ok:
        pools[r.pool or "unknown"] = pools.get(r.pool or "unknown", 0) + 1
        reasons[r.route_reason or "unknown"] = reasons.get(r.route_reason or "unknown", 0) + 1
    span = max(span_s, 1e-9)
    req_s = len(ok) / span
    out = {
        "offered_rps": rate, "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:3], "span_s": round(span_s, 3),
        "ttft_p50_s": r4(pct(ttft, 50)), "ttft_p90_s": r4(pct(ttft, 90)), "ttft_p99_s": r4(pct(ttft, 99)),
        "ttft_mean_s": r4(statistics.fmean(ttft) if ttft else None),
        "tpot_p50_s": r4(pct(tpot, 50)), "tpot_p99_s": r4(pct(tpot, 99)),
        "itl_p50_s": r4(pct(itl, 50)), "itl_p99_s": r4(pct(itl, 99)),
        "e2e_p50_s": r4(pct(e2e, 50)), "e2e_p99_s": r4(pct(e2e, 99)),
        "requests_per_s": r4(req_s), "prompt_tok_s": round(prompt_toks / span, 1), "output_tok_s": round(out_toks / span, 1),
        "throughput_tok_s": round((prompt_toks + out_toks) / span, 1),
        "goodput_rps": r4(len(good) / span), "slo_attained": r4(len(good) / len(records)) if records else None,
        "sustained": sustained(records),
        "pool_share": {k: round(v / max(len(ok), 1), 3) for k, v in sorted(pools.items())},
        "route_reasons": dict(sorted(reasons.items())),
        "ttft_all_s": [round(x, 4) for x in sorted(ttft)],
    }
    modes = [r.mode for r in ok if r.mode]
    if modes:  # dual-mode pools ran requests as the other pool's model (routed-dual): the share of each model
        out["other_model_share"] = {m: round(modes.count(m) / len(ok), 3) for m in sorted(set(modes))}
    if any(r.turn for r in records):  # conversations: a later turn's history should be in the prefix cache
        out["ttft_p50_first_turn_s"] = r4(pct([r.ttft_s for r in ok if r.turn == 1], 50))
        out["ttft_p50_later_turns_s"] = r4(pct([r.ttft_s for r in ok if r.turn > 1], 50))
        out["ttft_by_turn"] = ttft_by_turn(records)
    return out


def ttft_by_turn(records: list[Record]) -> dict[str, dict]:
    """turn (from 1) -> TTFT p50/p99 of its requests that succeeded, and how many were sent and succeeded."""
    out = {}
    for turn in sorted({r.turn for r in records if r.turn}):
        sent = [r for r in records if r.turn == turn]
        ttft = [r.ttft_s for r in sent if r.error is None]
        out[str(turn)] = {"p50_s": r4(pct(ttft, 50)), "p99_s": r4(pct(ttft, 99)), "requests": len(sent), "completed": len(ttft)}
    return out


def sustained(records: list[Record]) -> bool:
    """Nothing failed and no queue built up: the median TTFT of the last third of the requests (by arrival)
    is at most twice that of the first third plus 0.1 s (a rate beyond capacity makes it grow without end)."""
    if not records or any(r.error for r in records):
        return False
    by_arrival = sorted(records, key=lambda r: r.index)
    third = max(1, len(by_arrival) // 3)
    early = statistics.median(r.ttft_s for r in by_arrival[:third])
    late = statistics.median(r.ttft_s for r in by_arrival[-third:])
    return late <= 2 * early + 0.1


def config_summary(per_rate: dict[float, dict], reference_rate: float) -> dict:
    """The top-level figures of one configuration: latencies and goodput at the reference rate, throughput at
    the highest rate it sustained (the highest rate measured if none was sustained)."""
    ref = per_rate[reference_rate]
    sustained = [r for r in sorted(per_rate) if per_rate[r]["sustained"]]
    at = sustained[-1] if sustained else max(per_rate)
    return {"reference_rate": reference_rate, "ttft_p50_s": ref["ttft_p50_s"], "ttft_p90_s": ref["ttft_p90_s"],
            "ttft_p99_s": ref["ttft_p99_s"], "tpot_p50_s": ref["tpot_p50_s"], "tpot_p99_s": ref["tpot_p99_s"],
            "goodput_rps": ref["goodput_rps"], "errors": sum(v["errors"] for v in per_rate.values()),
            "throughput_tok_s": per_rate[at]["throughput_tok_s"], "throughput_rate": at,
            "highest_sustained_rate": sustained[-1] if sustained else None, "pool_share": ref["pool_share"],
            "speculation": ref.get("speculation", {}), "prefix_cache": ref.get("prefix_cache", {}),
            "ttft_predicted": ref.get("ttft_predicted", {}), **({"ttft_by_turn": ref["ttft_by_turn"]} if "ttft_by_turn" in ref else {}),
            "rates": {str(r): {k: v for k, v in f.items() if k != "ttft_all_s"} for r, f in sorted(per_rate.items())}}


def machine() -> dict:
    from swiftkv_core.hardware import cpu_info

    info = cpu_info()
    return {**info.as_dict(), "cpu_summary": info.summary(), "cpus": os.cpu_count(), "load_average": list(os.getloadavg())}


# --------------------------------------------------------------------------------------------------
# The run


def settled_load(below: float | None, timeout_s: float, name: str, log: Callable[[str], None]) -> list[float]:
    """The load averages a configuration starts at; with `below`, first wait (up to `timeout_s`) until the 1-minute
    average is under it, so no configuration starts in the load the previous one's engines left."""
    deadline = time.time() + timeout_s
    if below is not None and os.getloadavg()[0] >= below:
        log(f"{name}: waiting for the 1-minute load average ({os.getloadavg()[0]:.2f}) to fall below {below:g}")
        while os.getloadavg()[0] >= below and time.time() < deadline:
            time.sleep(5)
        if os.getloadavg()[0] >= below:
            log(f"{name}: starting at load {os.getloadavg()[0]:.2f} after {timeout_s:.0f} s of waiting (recorded with its figures)")
    return list(os.getloadavg())


def run(cfg: PlatformBenchConfig, log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """-> (report, the TTFT samples per config and rate for the plots)."""
    cfg.check()
    if cfg.target is None and any(c in SPECULATING for c in cfg.configs):
        from swiftkv_core.hardware import vllm_on_cpu

        refusals = speculation_refusals(cfg, vllm_on_cpu())
        if refusals:
            raise PlatformBenchError("\n".join(refusals))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.base_model)
    rates = sorted(set(cfg.rates))
    reference = cfg.reference_rate if cfg.reference_rate is not None else rates[-1]
    seeds, workloads, warmup = draws(cfg, rates, tokenizer)
    report = {"workload": cfg.workload, "workload_summary": summary(workloads[reference]), "rates": rates,
              "seeds": {str(r): seed for r, seed in seeds.items()}, "warmup_seed": warmup_seed(cfg.seed),
              "reference_rate": reference, "slo": {"ttft_s": cfg.ttft_slo_s, "tpot_s": cfg.tpot_slo_s},
              "engine_args": engine_args(cfg), "models": {"base": cfg.base_model, "swiftkv": cfg.swiftkv_model},
              "machine": machine(), "configs": {}}
    if cfg.target is not None:  # nothing started here: no engine arguments or model folders of ours
        report |= {"engine_args": None, "models": None, "target": {"url": cfg.target, "model": cfg.target_model}}
    samples: dict[str, dict[float, list[float]]] = {}
    progress = _progress(cfg.progress)
    with tempfile.TemporaryDirectory(prefix="swiftkv-bench-platform-") as tmp, progress:
        for name in [cfg.target_name] if cfg.target is not None else cfg.configs:
            load_before = settled_load(cfg.quiet_load, cfg.quiet_timeout_s, name, log)
            per_rate: dict[float, dict] = {}
            if cfg.target is not None:
                server, names, warm = existing(cfg.target, cfg.target_model, cfg.api_key, 30), [cfg.target_model], [cfg.target_model]
            else:
                server, names = serve(name, cfg, Path(tmp), log), model_names(name)
                warm = [f"{PUBLIC}-swiftkv", f"{PUBLIC}-base", *names]
            with server as base:
                api = "responses" if name in RESPONSES_API else "chat"
                asyncio.run(warm_up(base, warm, warmup, cfg.warmup_requests, cfg.request_timeout_s, cfg.api_key, api))
                for rate in rates:
                    reqs = workloads[rate]
                    task = progress.add_task(f"{name} @ {rate:g} req/s", total=len(reqs))
                    before = spec.scrape(base, cfg.api_key)
                    records, span = asyncio.run(drive(base, names, reqs, cfg.request_timeout_s, lambda rec, t=task: progress.advance(t),
                                                      cfg.api_key, api))
                    per_rate[rate] = figures(records, span, rate, cfg)
                    after = spec.scrape(base, cfg.api_key)
                    drafted = spec.speculation(before, after)
                    per_rate[rate]["prefix_cache"] = prefix_cache(before, after, None if cfg.target is not None else PUBLIC)
                    per_rate[rate]["ttft_predicted"] = ttft_predictions(before, after)
                    # our own configurations' engines are named <public>-<pool>: keyed by pool, as pool_share is
                    per_rate[rate]["speculation"] = drafted if cfg.target is not None else {
                        m.removeprefix(f"{PUBLIC}-"): v for m, v in drafted.items()}
                    log(f"{name} @ {rate:g} req/s: TTFT p50 {per_rate[rate]['ttft_p50_s']} s p99 {per_rate[rate]['ttft_p99_s']} s, "
                        f"{per_rate[rate]['throughput_tok_s']} tok/s, goodput {per_rate[rate]['goodput_rps']} req/s, "
                        f"errors {per_rate[rate]['errors']}, pools {per_rate[rate]['pool_share']}"
                        + (f", TTFT p50 first turns {per_rate[rate]['ttft_p50_first_turn_s']} s, later turns "
                           f"{per_rate[rate]['ttft_p50_later_turns_s']} s" if "ttft_p50_first_turn_s" in per_rate[rate] else "")
                        + (", TTFT p50/p99 by turn " + " ".join(f"{t}:{v['p50_s']}/{v['p99_s']}" for t, v in per_rate[rate]["ttft_by_turn"].items())
                           if "ttft_by_turn" in per_rate[rate] else "")
                        + (", draft acceptance {}, mean accepted length {}".format(*spec.cells(per_rate[rate]["speculation"]))
                           if any(v["speculative"] for v in drafted.values()) else "")
                        + "".join(f", {pool} prefix-cache hits {c['hit_rate']} (gateway predicted {c['predicted_hit_rate']})"
                                  for pool, c in per_rate[rate]["prefix_cache"].items() if c["queries"])
                        + "".join(f", {pool} TTFT mean {t['measured_mean_s']} s (gateway predicted {t['predicted_mean_s']})"
                                  for pool, t in per_rate[rate]["ttft_predicted"].items()))
                    silent = [p for p in ("swiftkv", "base") if not per_rate[rate]["speculation"].get(p, {}).get("speculative")]
                    if name in SPECULATING and silent:  # its figures would read as "did not speculate"
                        log(f"{name} @ {rate:g} req/s: warning: /metrics shows no speculative decoding for pool(s) "
                            f"{', '.join(silent)}, though every pool of {name} speculates")
            samples[name] = {r: f.pop("ttft_all_s") for r, f in per_rate.items()}
            report["configs"][name] = config_summary(per_rate, reference) | {
                "load_average_before": load_before,
                "speculative": cfg.speculative_block() if name in SPECULATING else None}
    report["load_average_after"] = list(os.getloadavg())
    return report, samples


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *a, **k):
        return 0

    def advance(self, *a, **k):
        pass


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True))


def plot(report: dict, samples: dict[str, dict[float, list[float]]], out_json: Path) -> list[Path]:
    """TTFT p50/p99 against offered load per configuration, and the TTFT CDF at the reference rate; PNGs
    next to `out_json` (<stem>_ttft_vs_load.png, <stem>_ttft_cdf.png); for conversations (chat-multiturn) TTFT p50/p99
    per turn at the reference rate too (<stem>_ttft_by_turn.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = out_json.with_suffix("")
    paths = [Path(f"{stem}_ttft_vs_load.png"), Path(f"{stem}_ttft_cdf.png")]
    title = f"{report['workload']} workload, {report['machine']['cpu_model']}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in report["configs"].items():
        rates = sorted(float(r) for r in c["rates"])
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ys = [c["rates"][str(r)][f"ttft_{q}_s"] for r in rates]
            ax.plot(rates, [float("nan") if y is None else y for y in ys], style, label=f"{name} {q}")
    ax.set(xlabel="offered load (requests/s)", ylabel="TTFT (s)", title=f"TTFT against load: {title}")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ref = report["reference_rate"]
    for name, per_rate in samples.items():
        xs = per_rate.get(ref) or []
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF at {ref:g} req/s: {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    by_turn = {name: c["ttft_by_turn"] for name, c in report["configs"].items() if c.get("ttft_by_turn")}
    if by_turn:
        paths.append(Path(f"{stem}_ttft_by_turn.png"))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, turns in by_turn.items():
            xs = sorted(int(t) for t in turns)
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ys = [turns[str(t)][f"{q}_s"] for t in xs]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=f"{name} {q}")
        ax.set(xlabel="turn of the conversation", ylabel="TTFT (s)", title=f"TTFT per turn at {ref:g} req/s: {title}")
        ax.set_xticks(sorted({int(t) for turns in by_turn.values() for t in turns}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
