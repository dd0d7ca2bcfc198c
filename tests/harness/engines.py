"""Real vLLM engines on the tiny checkpoints: their settings, the platform every engine test shares (one `swiftkv serve
--engine inprocess` for the whole run, the session fixture `platform` in conftest.py) and vLLM's own OpenAI server (the
session fixture `vllm_server`), both launched when the run starts and waited for where first used."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import httpx

from .processes import Server, swiftkv_serve, vllm_openai_server

MAX_MODEL_LEN = 512
PUBLIC = "tiny"  # the platform's public model; its pools answer as tiny-swiftkv and tiny-base
KEY = "sk-test-main"
ENV_ONLY_KEY = "sk-test-env-only"  # only in the SWIFTKV_API_KEYS_FILE file, which the --api-keys-file flag overrides
# The batch settings of the shared platform: short windows for expiry, small bounds, fast polling.
BATCH = {"completion_windows": {"24h": 86400, "5s": 5}, "max_in_flight": 4, "lease_seconds": 3, "poll_seconds": 0.2,
         "max_file_bytes": 8_000_000}
UPSTREAM = "upstream"  # vLLM's own server's model name
UPSTREAM_KEY = "sk-upstream"


def engine_args(**extra) -> dict:
    # max_logprobs 5: a top_logprobs the gateway accepts (up to 20) that these engines refuse
    return {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 32 << 20,
            "max_logprobs": 5} | extra


def swiftkv_plugin_available() -> bool:
    return (Path(__file__).parents[2] / "swiftkv_core" / "vllm" / "__init__.py").exists() and os.environ.get("SWIFTKV_TEST_PREFILL") != "base"


def platform_config(tiny_base: Path, tiny_swiftkv: Path, work: Path) -> dict:
    """Two pools with priority scheduling: swiftkv (the SwiftKV model, one sequence at a time so requests queue and
    priority decides who runs next; no tool-call parser) and base (the base model, vLLM's hermes parser); the
    gateway's prefix-cache index follows the engines' KV-cache events."""
    swiftkv = tiny_swiftkv if swiftkv_plugin_available() else tiny_base
    return {
        "model": PUBLIC,
        "data_dir": str(work / "data"),
        "pools": {
            # an SLO that counts attainment (the SLO panels and burn-rate alerts read it) and sheds nothing
            "swiftkv": {"model": str(swiftkv), "engine_args": engine_args(scheduling_policy="priority", max_num_seqs=1),
                        "slo": {"ttft_seconds": 30.0}},
            "base": {"model": str(tiny_base), "engine_args": engine_args(scheduling_policy="priority"), "tool_call_parser": "hermes",
                     "slo": {"ttft_seconds": 30.0}},
        },
        # the index follows the engines' KV-cache events; the route's reason in the header, which the tests read
        "routing": {"ratio_threshold": 4.0, "kv_events": True, "expose_reason": True},
        "limits": {"max_body_bytes": 200_000},
        # a health check slower than a request: requests meet a dead engine before the watcher takes its pool out
        "health": {"period_seconds": 3.0, "shutdown_grace_seconds": 30.0},
        "batch": BATCH,
    }


def launch_platform(tiny_base: Path, tiny_swiftkv: Path, work: Path) -> Server:
    """The shared platform at the default log level, started (not yet ready: `platform_ready`)."""
    (work / "keys").write_text(f"{KEY} min_priority=-10\n")  # trusted: test_openai_compat sends priorities below 0
    (work / "env-keys").write_text(f"{ENV_ONLY_KEY}\n")
    server = swiftkv_serve(work, platform_config(tiny_base, tiny_swiftkv, work), "--engine", "inprocess",
                           "--api-keys-file", str(work / "keys"),
                           env={"SWIFTKV_API_KEYS_FILE": str(work / "env-keys"),  # loses to --api-keys-file
                                "VLLM_CPU_OMP_THREADS_BIND": "",  # an operator's binding would win over cpu_cores auto
                                "SWIFTKV_LOG_LEVEL": "", "SWIFTKV_LOG_FORMAT": "", "SWIFTKV_LOG_FILE": "",
                                "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # vLLM's CPU layout: an engine core and a worker
    return server.start()


def platform_ready(server: Server) -> Server:
    """The launched platform once ready (every pool), its console up to then in `console_at_ready`."""
    server.wait(lambda: every_pool_ready(server.base) and "SwiftKV is serving" in server.log_path.read_text())
    server.console_at_ready = server.log_path.read_text().splitlines()
    server.killed_engines = 0  # engine cores a test killed with SIGKILL
    return server


def engine_log(server: Server) -> Path:
    """The file that takes a platform's engine and library logs (its data_dir is `work/data`: platform_config)."""
    return server.work / "data" / "logs" / "serve.log"


def engine_cores(server: Server) -> dict:
    """The shared platform's engine core processes (psutil) by pool, as started (an engine restarted later is not
    among them). The pools start together, so each core is told apart by the served model name it logs as it
    initializes (`engine_log`), matched to the pool the console says serves that name."""
    import psutil

    console = "\n".join(server.console_at_ready)
    served = dict(re.findall(r"pool (\w+): \S+ as (\S+), ", console))  # pool -> served model name
    first: dict[str, int] = {}  # served model name -> pid of the first core that initialized for it
    for pid, name in re.findall(r"\(EngineCore pid=(\d+)\).*Initializing a V1 LLM engine.*?served_model_name=([^,]+),",
                                engine_log(server).read_text()):
        first.setdefault(name, int(pid))
    alive = {p.pid: p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCor" in p.name()}
    assert set(served.values()) <= set(first) and len(alive) >= len(served), (served, first, alive)
    return {pool: alive[first[name]] for pool, name in served.items() if first[name] in alive}


def every_pool_ready(base: str) -> bool:
    """/ready is 200 once some pool serves; a test that needs every pool (or a restarted one back) reads its body."""
    r = httpx.get(f"{base}/ready", timeout=5)
    return r.status_code == 200 and all(r.json()["pools"].values())


def launch_vllm_server(tiny_base: Path, work: Path) -> Server:
    """vLLM's OpenAI server on the base checkpoint, started (not yet ready: wait()), with the platform's base pool's
    engine arguments (sampling matches it token for token), its hermes tool parser and priority scheduling; plus a key,
    one logprob at most and three tokens per streamed chunk, which the remote backend's tests read. It also answers to
    the platform's base pool's name and key: the two serve as a pool of two replicas (tests/test_replicas.py)."""
    a = engine_args()
    return vllm_openai_server(work, tiny_base, "--served-model-name", UPSTREAM, f"{PUBLIC}-base", "--api-key", UPSTREAM_KEY, KEY,
                              "--max-model-len", a["max_model_len"], "--enforce-eager", "--dtype", a["dtype"],
                              "--kv-cache-memory-bytes", a["kv_cache_memory_bytes"], "--max-logprobs", "1", "--stream-interval", "3",
                              "--scheduling-policy", "priority", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                              "--enable-prompt-tokens-details").start()


# ---- vLLM's offline LLM, for the tests of the SwiftKV model inside an engine -----------------------------------
# 3 MiB of float32 KV: a block of one layer is 32 tokens * 2 (K, V) * 2 heads * 32 dims * 4 bytes = 16 KiB,
# so the base model (8 caches) gets 24 blocks (768 tokens) and 2-way AcrossKV (4 + 2 caches) exactly 32.
BLOCK = 32
KV_BYTES = 3 << 20
LLM_ARGS = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK, max_model_len=512,
                max_num_batched_tokens=64, enable_prefix_caching=True, disable_log_stats=False, seed=0)
NEW_TOKENS = 24


def offline_llm(path, in_process: bool = True, **args):
    """vLLM's offline LLM on `path` with LLM_ARGS (and `args`), by default its engine in this process: on CPU vLLM
    otherwise spawns an engine core process and a worker process that each import vLLM again (about 12 s a start on two
    cores, against 2 s; shutting down 4 s against 1 s). What the tests check (the model inside the engine) does not
    depend on the process layout; the platform's engines keep vLLM's. The in-process worker replaces
    `torch.set_num_threads` with a no-op for the whole process: it is put back."""
    import torch
    import vllm.envs
    from vllm import LLM

    set_num_threads = torch.set_num_threads
    # read at construction; vLLM's cache of its environment, frozen by an in-process engine core, is reset around it
    with mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}):
        vllm.envs.disable_envs_cache()
        try:
            return LLM(model=str(path), **{**LLM_ARGS, **args})
        finally:
            vllm.envs.disable_envs_cache()
            torch.set_num_threads = set_num_threads


class OfflineEngines:
    """vLLM's offline LLM on a checkpoint (`offline_llm`), one alive at a time: asking for another checkpoint or other
    settings shuts the current one down first. Shared by the run (conftest's `offline_engines`), so a module that asks
    for the engine the one before it left running gets it without a start-up."""

    def __init__(self):
        self.key, self.llm = None, None

    def get(self, path, **overrides):
        key = (str(path), tuple(sorted(overrides.items())))
        if key != self.key:
            self.close()
            self.llm = offline_llm(path, **overrides)
            self.key = key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.key = None, None


def prompt(n: int, seed: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(1000 * seed + n)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def generate(llm, prompts: list[list[int]], max_tokens: int = NEW_TOKENS, logprobs: int | None = 2):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def chat_and_stream(base: str, model: str) -> str:
    """A 4-token chat answer and a streamed 3-token completion from `model` at `base`, both checked; returns the chat
    answer's x-swiftkv-route header."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                                           extra_body={"ignore_eos": True})
    assert raw.parse().usage.completion_tokens == 4
    chunks = list(client.completions.create(model=model, prompt="Pack my box", max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    return raw.headers["x-swiftkv-route"]
