"""The platform's one configuration: pools of engines plus gateway settings, from YAML.

A pool is a set of identical engine replicas serving one model: `swiftkv` (the SwiftKV model, for
prompt-heavy requests) and `base` (the base model). Each pool says where its engines run
(`inprocess`, `ray`, or a `remote` OpenAI-compatible URL), the model, vLLM engine arguments and
replica/autoscaling settings. With no file, the embedded DEFAULT_CONFIG serves SmolLM2 on
127.0.0.1:8000.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swiftkv_core.dual_mode import with_dual_mode
from swiftkv_core.hardware import check_cpu_cores

# The two pools, named by the model each serves: the SwiftKV model (cheap prefill, for prompt-heavy requests) and
# its base model. Not disaggregated prefill/decode with KV transfer, which is what those names mean elsewhere
# (llm-d, Dynamo): configs with the pools' former names are refused with the new ones.
POOL_NAMES = ("swiftkv", "base")
RENAMED_POOLS = {"prefill": "swiftkv", "decode": "base"}

DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig default block size (GPUs); its CPU backend picks 128
DEFAULT_PREFIX_CACHE_TOKENS = 16_384

DEFAULT_CONFIG = """\
# Served by `swiftkv serve` when no --config is given (and by `swiftkv demo`).
# dtype auto: the model's dtype on GPUs; on CPUs bfloat16 only with native bf16 (AVX-512 BF16 or AMX), else float32.
# cpu_cores auto (every pool's default): on CPUs each in-process engine computes on its own cores.
# scheduling_policy priority: Batch API requests (lower priority) run after live ones.
# max_model_len 8192: SmolLM2's whole context (prompt-heavy traffic brings long documents). KV cache 1 GiB per
# engine: 23,000 float32 tokens (46,000 in bf16), a dozen 2,000-token prompts at once; at 256 MiB an engine
# held three and requests queued for KV space (docs/benchmarks.md, "KV-cache budget").
# speculative ngram on the base pool: lossless, 1.02-1.6x output tokens/s on CPUs (docs/benchmarks.md, "Speculative
# decoding"), where decode-heavy requests go. The swiftkv pool does not speculate, so requests with logit_bias or min_p
# (which vLLM refuses under speculative decoding) are served there (docs/concepts/speculation.md).
# On a CPU both pools then run the SwiftKV model as dual-mode engines, each serving the base model too, per request
# (docs/benchmarks.md, "Dual-mode engines"); on a GPU each pool keeps its model (services/serve/preflight.default_dual_mode).
# No tool_call_parser: SmolLM2-135M-Instruct's chat template renders no tools and its vocabulary has no tool-call
# tokens, so no vLLM parser fits; tool_choice auto is refused, required and named functions work (docs/serving/responses.md).
model: swiftkv-smollm2            # the public name; requests for it are routed between the pools
host: 127.0.0.1
port: 8000
routing:
  ratio_threshold: 4.0            # prompt/expected-output tokens >= this -> swiftkv pool, unless...
  balance: true                   # ...it holds more predicted work than the other pool (both engines stay busy)
  cache_aware: true               # ...or the other pool holds more of the prompt in its prefix cache
pools:
  swiftkv:                        # SwiftKV model: cheap prefill for prompt-heavy requests
    model: models/smollm2-135m-instruct-swiftkv
    engine_args: {max_model_len: 8192, dtype: auto, enforce_eager: true, kv_cache_memory_bytes: 1073741824, scheduling_policy: priority}
    replicas: {min: 1, max: 2, target_ongoing_requests: 8, max_ongoing_requests: 32}
  base:                           # base model: decode-heavy requests
    model: models/smollm2-135m-instruct
    engine_args: {max_model_len: 8192, dtype: auto, enforce_eager: true, kv_cache_memory_bytes: 1073741824, scheduling_policy: priority}
    replicas: {min: 1, max: 2, target_ongoing_requests: 8, max_ongoing_requests: 32}
    speculative: {method: ngram, num_speculative_tokens: 4, prompt_lookup_min: 2, prompt_lookup_max: 4}
"""
# The embedded engine settings, for tools that start engines like the default platform's (`swiftkv bench platform`).
_DEFAULT_ENGINE_ARGS: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG)["pools"]["swiftkv"]["engine_args"]
DEFAULT_MAX_MODEL_LEN: int = _DEFAULT_ENGINE_ARGS["max_model_len"]
DEFAULT_KV_CACHE_BYTES: int = _DEFAULT_ENGINE_ARGS["kv_cache_memory_bytes"]


class StrictModel(BaseModel):
    """Refuses unknown keys: a misspelt setting is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class Replicas(StrictModel):
    """Ray Serve replica count and autoscaling (ignored by in-process and remote pools: one engine each)."""

    min: int = Field(1, ge=0, description="fewest engine replicas the autoscaler keeps (at least one starts); 0: an idle "
                     "pool may scale to zero and counts as ready with no replica running")
    max: int = Field(2, ge=1, description="most engine replicas the autoscaler starts")
    target_ongoing_requests: float = Field(8, gt=0, description="requests in flight per replica the autoscaler aims at: "
                                           "more on average adds replicas, fewer removes them")
    max_ongoing_requests: int = Field(32, ge=1, description="requests one replica runs at once; more wait in Ray Serve's "
                                      "queue until a replica has room")
    upscale_delay_s: float = Field(10.0, ge=0, description="seconds the load must stay above the target before the "
                                   "autoscaler adds a replica")
    downscale_delay_s: float = Field(120.0, ge=0, description="seconds the load must stay below the target before the "
                                     "autoscaler removes a replica")
    num_cpus: float = Field(1.0, ge=0, description="Ray resources per replica: the CPUs Ray reserves for each engine replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each engine replica (a fraction shares a GPU; "
                            "0: CPU engines)")

    @model_validator(mode="after")
    def _order(self) -> "Replicas":
        if self.max < self.min:
            raise ValueError(f"replicas.max ({self.max}) must be >= replicas.min ({self.min})")
        return self


class SpeculativeConfig(StrictModel):
    """Speculative decoding of a pool's engines without a draft model: vLLM proposes tokens by looking the
    recent output up in the prompt (`ngram`) or in suffix trees of the prompt and earlier answers (`suffix`,
    Arctic Inference's), and one step verifies them all. Lossless: greedy output is the same as without it."""

    method: Literal["ngram", "suffix", "none"] = Field("none", description="ngram (prompt lookup), suffix (Arctic "
                                                        "Inference's suffix decoding; needs `arctic_inference` in "
                                                        "the engine's environment) or none")
    num_speculative_tokens: int | None = Field(None, ge=1, description="tokens proposed per step; required for "
                                               "ngram; suffix: the most per step (default: vLLM's, 24)")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest n-gram matched in the prompt "
                                          "(default: prompt_lookup_max, or vLLM's 5)")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest n-gram matched in the prompt "
                                          "(default: prompt_lookup_min, or vLLM's 5)")

    @model_validator(mode="after")
    def _combination(self) -> "SpeculativeConfig":
        lookup = [f for f in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, f) is not None]
        if self.method == "ngram" and self.num_speculative_tokens is None:
            raise ValueError("num_speculative_tokens is required with method ngram: how many tokens to "
                             "propose per step, e.g. 4")
        if self.method != "ngram" and lookup:
            raise ValueError(f"{lookup[0]} applies to method ngram only, not {self.method}")
        if lookup == ["prompt_lookup_min", "prompt_lookup_max"] and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max}): the n-grams matched run from min to max tokens")
        if self.method == "none" and self.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens has no effect with method none: set a method "
                             "(ngram or suffix) or drop it")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def vllm_config(self) -> dict[str, Any] | None:
        """vLLM's `speculative_config` (None: no speculation); unset fields are left to vLLM's defaults."""
        if not self.enabled:
            return None
        return {k: v for k, v in self.model_dump().items() if v is not None}


class SLOConfig(StrictModel):
    """A pool's latency objective (all optional): what the gateway measures its live requests against
    (swiftkv_slo_ttft_requests), sheds past (`max_queue_seconds`) and sizes the pool for (swiftkv_pool_desired_replicas);
    the chart's TTFT and burn-rate alerts read the same values (docs/operations/slo.md)."""

    ttft_seconds: float | None = Field(None, gt=0, description="time to first token a live request of this pool should "
                                       "get (gateway-side, request received to first token sent); requests are counted "
                                       "within or over it, the chart alerts on its p95 and on the error budget's burn rate, "
                                       "and the desired replicas keep the predicted TTFT under it; null: no TTFT objective")
    objective: float = Field(0.99, gt=0, lt=1, description="share of live requests that should get their first token "
                             "within ttft_seconds: 1 - objective is the error budget whose burn rate the chart alerts on")
    tpot_seconds: float | None = Field(None, gt=0, description="mean time per output token after the first a live request "
                                       "should get; the desired replicas keep the pool's measured decode rate at its "
                                       "concurrency above 1/tpot_seconds per sequence; null: no TPOT objective")
    max_queue_seconds: float | None = Field(None, gt=0, description="shed: a live request whose predicted time to first "
                                            "token on the pool it is routed to exceeds this is refused at once with a "
                                            "429 `overloaded` and Retry-After, rather than queued past its SLO; null: "
                                            "never shed (the default)")


class PoolConfig(StrictModel):
    """One pool: identical engines (or remote servers) serving one model, and how they run."""

    model: str = Field(description="local folder or hub id of the model this pool serves")
    served_model_name: str | None = Field(None, description="name clients use to bypass routing; default '<public>-<pool>'")
    tokenizer: str | None = Field(None, description="tokenizer folder or hub id; default: the model")
    backend: Literal["engine", "remote"] = Field("engine", description="engine: vLLM engines the gateway starts, in its "
                                                 "process or on Ray (`swiftkv serve --engine`); remote: an OpenAI-compatible "
                                                 "server at `url`")
    url: str | list[str] | None = Field(None, description="base URL of a remote OpenAI-compatible server (backend: remote); a "
                                        "list: several servers of the model, each request sent to the one its prompt's "
                                        "prefix and the servers' load choose (services/serving/replicas.py)")
    api_key: str | None = Field(None, description="bearer key for the remote server")
    api_key_env: str | None = Field(None, description="environment variable holding the remote server's bearer key, read when "
                                    "the gateway starts (as vLLM's VLLM_API_KEY and OpenAI's OPENAI_API_KEY are): keeps the key out "
                                    "of the config file, e.g. a Kubernetes Secret beside a ConfigMap; not with api_key")
    kv_events_endpoint: str | list[str] | None = Field(None, description="ZMQ endpoint where the remote server publishes vLLM's "
                                                       "KV-cache events (its --kv-events-config endpoint, e.g. tcp://host:5557), "
                                                       "one per url; read when routing.kv_events is on")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="vLLM AsyncEngineArgs fields")
    replicas: Replicas = Field(default_factory=Replicas, description="Ray Serve replica count and autoscaling of the pool's "
                               "engines (ignored by in-process and remote pools)")
    warmup: bool = Field(True, description="each engine generates 2 tokens for a fixed prompt before it counts as ready, so "
                         "no client request pays for its first step; false: ready as soon as it has loaded")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig,
                                           description="speculative decoding of this pool's engines (vLLM's speculative_config)")
    ray_app: str | None = Field(None, description="Ray Serve application already running this pool (a KubeRay RayService's): "
                                "the gateway attaches to it by name instead of deploying its own (--engine ray, with ray_address)")
    tool_call_parser: str | None = Field(None, description="vLLM tool-call parser for this model's tool-call format "
                                         "(e.g. hermes); without one, tool_choice auto is refused")
    cpu_cores: str = Field("auto", description="on a CPU machine, the CPUs an in-process engine's OpenMP compute threads are "
                           "bound to (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto (several in-process engines: each its own "
                           "cores; one: vLLM's own binding), nobind, or CPU ids such as 0, 0-3 or 0,2 (one list per worker, "
                           "separated by |); Ray replicas and GPUs keep vLLM's own")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="the pool's latency objective: ttft_seconds, "
                           "objective, tpot_seconds, max_queue_seconds (docs/operations/slo.md)")
    dual_mode: bool = Field(False, description="the pool's engines run its SwiftKV checkpoint as dual-mode engines: they serve "
                            "the base model too, per request (swiftkv_core/dual_mode.py); the router then keeps each request's "
                            "model and chooses the engine by load and prefix cache. A remote pool: its vLLM server was started "
                            "with --hf-overrides '{\"swiftkv_dual_mode\": true}'")

    @field_validator("speculative", mode="before")
    @classmethod
    def _null_is_off(cls, v):  # `speculative:` left empty in YAML (or a chart's null) means no speculation
        return {} if v is None else v

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _cpu_id_as_text(cls, v):  # `cpu_cores: 1` in YAML is a number
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _remote_needs_url(self) -> "PoolConfig":
        if self.backend == "remote" and not self.urls:
            raise ValueError("a remote pool needs `url`")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("`url` lists a server twice")
        if self.kv_events_endpoint is not None and (self.backend != "remote" or len(self.kv_event_endpoints) != len(self.urls)):
            raise ValueError("`kv_events_endpoint` is for remote pools, one per url (in-process engines publish theirs "
                             "where the gateway reads them)")
        for endpoint in self.kv_event_endpoints:
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"`kv_events_endpoint` {endpoint!r} is not a ZMQ endpoint: tcp://host:port or ipc://path")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("the remote server's key is given twice: set api_key or api_key_env, not both")
        if self.api_key_env is not None and self.backend != "remote":
            raise ValueError("api_key_env is for remote pools: the key the gateway sends to the server at `url`")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError(f"api_key_env {self.api_key_env!r} is not an environment variable name (the name, without $)")
        if self.backend == "remote" and self.ray_app:
            raise ValueError("`ray_app` is for engine pools on Ray; a remote pool is reached at its `url`")
        if self.backend == "remote" and self.speculative.enabled:
            raise ValueError("`speculative` is for engine pools: a remote server decides its own speculative decoding "
                             "(vLLM: its --speculative-config flag), which no OpenAI request can change")
        if self.speculative.enabled and "speculative_config" in self.engine_args:
            raise ValueError("speculative decoding is set twice, in `speculative` and engine_args.speculative_config: "
                             "keep one")
        self.cpu_cores = check_cpu_cores(self.cpu_cores, self.engine_workers)
        return self

    @property
    def urls(self) -> list[str]:
        """The remote servers of this pool (none for an engine pool)."""
        return [self.url] if isinstance(self.url, str) else list(self.url or [])

    def remote_api_key(self, name: str) -> str | None:
        """The remote server's key: api_key, or the variable api_key_env names, read now (the gateway's start)."""
        if self.api_key_env is None:
            return self.api_key
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise ValueError(f"pools.{name}.api_key_env: the environment variable {self.api_key_env} that holds the remote "
                             "server's key is not set (or empty)")
        return key

    @property
    def kv_event_endpoints(self) -> list[str]:
        """The remote servers' KV-cache event endpoints (kv_events_endpoint as a list)."""
        e = self.kv_events_endpoint
        return [e] if isinstance(e, str) else list(e or [])

    def vllm_engine_args(self) -> dict[str, Any]:
        """The AsyncEngineArgs fields an engine of this pool starts with: engine_args plus `speculative`, and the
        dual-mode override (`dual_mode`) beside the pool's own hf_overrides."""
        speculative = self.speculative.vllm_config()
        args = self.engine_args if speculative is None else {**self.engine_args, "speculative_config": speculative}
        return with_dual_mode(args) if self.dual_mode else args

    @property
    def speculation(self) -> dict[str, Any] | None:
        """The speculative_config the pool's engines run with, from `speculative` or engine_args; None: none."""
        return self.speculative.vllm_config() or self.engine_args.get("speculative_config") or None

    @property
    def engine_workers(self) -> int:
        """Worker processes of one engine (tensor x pipeline parallel), each with its own CPU list."""
        return int(self.engine_args.get("tensor_parallel_size") or 1) * int(self.engine_args.get("pipeline_parallel_size") or 1)


class RoutingConfig(StrictModel):
    """How the gateway picks a pool: the prompt/output ratio states the intent; the pools' predicted work (load
    balance) and what each holds in its prefix cache (cache-aware) may override it (services/gateway/routing.py)."""

    ratio_threshold: float = Field(4.0, gt=0, description="prompt/output >= threshold -> swiftkv pool")
    default_output_estimate: int = Field(256, ge=1, description="expected output before any request without max_tokens has finished")
    balance: bool = Field(True, description="send a request to the other pool when the ratio's pool holds more predicted work "
                          "(prompt tokens not yet prefilled and not found cached + decode_token_cost * expected output tokens of the requests in "
                          "flight there, and this one's) by more than balance_margin_tokens (route reason `backlog`); off: "
                          "the ratio alone decides while both pools are up")
    decode_token_cost: float = Field(4.0, gt=0, description="the work of one output token in prompt tokens' prefill work: on "
                                     "2 CPU cores a batched decode step per sequence costs about what 4-7 prompt tokens of "
                                     "prefill do (docs/benchmarks.md, Engine); on GPUs decode is relatively cheaper. The prior: once a pool's decode rate at its "
                                     "batch size is measured, that prices its output tokens (docs/operations/slo.md)")
    balance_margin_tokens: int = Field(2048, ge=0, description="balance: the difference in predicted work, in prompt-token "
                                       "units, below which the ratio's choice stands (about one prompt-heavy request)")
    cache_aware: bool = Field(True, description="let what each pool holds in vLLM's prefix cache (as the gateway tracks it) "
                              "count: a request goes to the other pool when it holds more of the prompt cached there and its "
                              "predicted work there, counting only the prompt tokens not cached, is lower (route reason `prefix`)")
    prefix_min_distinct_tokens: int = Field(256, ge=0, description="cache_aware: cached prompt tokens up to this many count for "
                                            "nothing, so a prefix every request shares (a system prompt no longer than this) "
                                            "does not pin traffic to a pool")
    prefix_block_size: int | None = Field(None, ge=1, description="cache_aware: tokens per prefix-cache block, the engines' "
                                          "block_size; null: what in-process engines report (vLLM's CPU backend: 128), else "
                                          "16 (vLLM's default on GPUs)")
    kv_events: bool = Field(False, description="cache_aware: correct the gateway's index with vLLM's KV-cache events (blocks "
                            "stored, evicted, cleared) rather than predict evictions: in-process engines publish them on an "
                            "IPC socket the gateway reads; remote pools where their `kv_events_endpoint` is set; Ray pools "
                            "keep the prediction")
    prefix_cache_tokens: int | None = Field(None, ge=1, description="cache_aware: tokens of prompt prefixes one pool's engine "
                                            "keeps cached, its KV-cache capacity (vLLM's num_gpu_blocks * block_size); the "
                                            "gateway forgets the least recently sent beyond it. null: what in-process engines "
                                            "report, else 16,384")
    share_prefix_cache: bool = Field(False, description="with API keys: let every key's requests share the engines' prefix "
                                     "caches (and cache-aware routing see them all), for a deployment whose keys trust one "
                                     "another. Off: each key's cache is its own (vLLM's cache_salt, from a digest of the key), "
                                     "so no key learns from a cache hit or a route what another sent; a prompt two keys share "
                                     "(a system prompt) is then cached and prefilled once per key. Without keys: one tenant, shared. "
                                     "A key's share_prefix_cache in the keys file overrides this for that key")
    expose_reason: bool = Field(False, description="put why a request was routed (`reason=...; ratio=...`) in its "
                                "x-swiftkv-route header, beside the pool; off: the pool (and `mode=`) only, the reason in "
                                "the logs and metrics, since a `prefix` reason tells a client another's recent prompt "
                                "(docs/concepts/routing.md)")

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data: Any) -> Any:
        replaced = {
            "backlog_factor": "routing.balance and routing.balance_margin_tokens (the pools' predicted work in prompt "
                              "tokens, not a ratio of waits)",
            "backlog_min_seconds": "routing.balance_margin_tokens",
            "prefix_load_factor": "nothing: a pool's load counts in its predicted work, cache or not",
        }
        if isinstance(data, dict):
            for key, instead in replaced.items():
                if key in data:
                    raise ValueError(f"routing.{key} is no longer a setting; use {instead}")
        return data

    @model_validator(mode="after")
    def _prefix_cache_holds_a_block(self) -> "RoutingConfig":
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < (self.prefix_block_size or DEFAULT_BLOCK_SIZE):
            raise ValueError(f"routing.prefix_cache_tokens ({self.prefix_cache_tokens}) must hold at least one block of "
                             f"routing.prefix_block_size ({self.prefix_block_size or DEFAULT_BLOCK_SIZE}) tokens")
        return self


class LimitsConfig(StrictModel):
    """Bounds on what a client controls, checked at the edge: each refusal is a 4xx in OpenAI's envelope that
    names the field and the limit (docs/serving/index.md, "Limits at the edge")."""

    max_body_bytes: int = Field(1_000_000, ge=1024, description="request body of the JSON routes; more is a 413")
    max_header_bytes: int = Field(16_384, ge=1024, description="request line plus headers; more is a 431 and the connection closes")
    max_messages: int = Field(2048, ge=1, description="messages of a chat request (OpenAI's own bound)")
    max_stop_sequences: int = Field(4, ge=1, description="stop strings per request (OpenAI's bound)")
    max_stop_chars: int = Field(256, ge=1, description="characters of one stop string")
    max_n: int = Field(16, ge=1, description="choices per request (n)")
    max_logit_bias: int = Field(1024, ge=1, description="logit_bias entries")
    max_tools: int = Field(128, ge=1, description="tools of a chat request (OpenAI's bound)")
    max_content_parts: int = Field(4096, ge=1, description="content parts and tool calls of all the messages of a chat "
                                   "request together; more is a 400. Each is an object to validate: the bound keeps what "
                                   "one body costs the gateway's CPU (which holds the GIL) small whatever its bytes")
    max_concurrent_requests: int | None = Field(512, ge=1, description="generation, /tokenize and /detokenize requests one gateway process holds at once "
                                                "(streams until their last byte), counted once the body is in; more wait up to "
                                                "slot_wait_seconds, then are a 503 with Retry-After; null: no cap")
    max_concurrent_requests_per_key: int | None = Field(None, ge=1, description="generation, /tokenize and /detokenize "
                                                        "requests one API key (all callers without keys) holds at once in one "
                                                        "gateway process, counted from arrival (reading the body included) to "
                                                        "the last byte; more are a 429 before the body is read. A key's "
                                                        "max_concurrent_requests in api_keys_file overrides it; null: no "
                                                        "per-key bound (one key's slow bodies may then hold every slot)")
    slot_wait_seconds: float = Field(3.0, ge=0, description="how long a request whose body is in waits for one of the "
                                     "max_concurrent_requests slots when all are held, in a queue fair across keys (FIFO "
                                     "per key, keys in turn; at most max_concurrent_requests waiting), before its 503; "
                                     "0: the 503 at once")
    header_timeout_seconds: float = Field(10.0, gt=0, description="from a connection's (or request's) first byte to the end of "
                                          "its headers; a client still sending them is disconnected")
    body_timeout_seconds: float = Field(30.0, gt=0, description="to receive a whole request body; a slower one is a 408")
    keep_alive_seconds: float = Field(75.0, gt=0, description="an idle keep-alive connection is closed after this; longer than "
                                      "clients' and load balancers' own idle expiry (httpx 5 s, ALB 60 s), so the client, "
                                      "never the gateway, closes it: a close racing a request on the connection resets it")
    send_timeout_seconds: float = Field(30.0, gt=0, description="a client that reads nothing of its response for this long "
                                        "is disconnected and its engine request aborted")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens of one request; more is a 400. "
                                          "default: the smallest max_model_len of the pools, less one (room for an output token)")
    max_unstreamed_tokens: int | None = Field(131_072, ge=1, description="n * max_tokens * (1 + top logprobs) of a non-streamed "
                                              "answer, which the gateway holds whole before sending it (about 0.6 KB per "
                                              "token and per logprob); more is a 400 that says to stream. The default lets "
                                              "n 16 fill an 8192-token context; null: no bound")
    # The per-minute limits are token buckets per API key (all callers are one key without keys), refilled
    # continuously; a key's entry in api_keys_file may set its own (services/common/keys.py).
    requests_per_minute: int | None = Field(None, ge=1, description="requests one API key may send per minute; past it a "
                                            "429 with Retry-After; null: no limit")
    prompt_tokens_per_minute: int | None = Field(None, ge=1, description="prompt tokens one API key may send per minute "
                                                 "(estimated from the body, settled once tokenized); past it a 429 with "
                                                 "Retry-After; null: no limit")
    output_tokens_per_minute: int | None = Field(None, ge=1, description="output tokens generated for one API key per "
                                                 "minute (max_tokens, or the expected output, reserved at admission and "
                                                 "settled against what was generated); past it a 429 with Retry-After; "
                                                 "null: no limit")


class BatchConfig(StrictModel):
    """The Batch API's runner: how hard batch work may push the pools, and for how long a batch may run."""

    completion_windows: dict[str, float] = Field(default_factory=lambda: {"24h": 86400.0},
                                                 description="completion_window values accepted, in seconds (tests add short ones)")
    max_in_flight: int = Field(8, ge=1, description="batch requests in flight per pool while the pool has no live traffic")
    min_in_flight: int = Field(1, ge=0, description="batch requests in flight on a pool that is live-busy (see live_quiet_seconds). "
                               "Lines that can move to a pool without live traffic are steered there anyway (SwiftKV pool -> "
                               "base-model pool); this bound is for the others (lines pinned to the pool, lines of the base-model "
                               "pool), which 0 would hold back for as long as live traffic lasts")
    live_quiet_seconds: float = Field(5.0, ge=0, description="a pool stays live-busy this long after its last live request "
                                      "ended: longer than the gap between the requests of steady interactive traffic, so batch "
                                      "requests (which hold a slot for their whole run, seconds on CPU) do not fill the pool in "
                                      "those gaps and meet the next live request; short enough that batch work is back at full "
                                      "width seconds after live traffic stops")
    preempt_prefills: bool = Field(True, description="when a live request arrives on a pool, abort that pool's batch requests "
                                   "beyond min_in_flight that have no output token yet (the youngest first) and run their lines "
                                   "again later: vLLM keeps running requests it has started ahead of waiting ones whatever their "
                                   "priority, so without this a live prefill shares engine steps with up to max_in_flight batch "
                                   "prefills. The prompt work done on an aborted line is lost unless prefix caching keeps it")
    priority: int = Field(10, description="vLLM priority of batch requests (live: 0; lower runs first; used by engines with scheduling_policy=priority)")
    max_active_batches: int = Field(4, ge=1, description="batches one gateway process works at once")
    max_active_per_key: int | None = Field(16, ge=1, description="batches one key may have validating, in_progress or "
                                           "finalizing at once; creating one more is a 429 too_many_active_batches (one "
                                           "input file may back any number of batches); null: no cap")
    max_lines: int = Field(50_000, ge=1, description="requests (lines) of one batch input file; more fails the batch "
                           "(OpenAI's bound)")
    max_line_bytes: int = Field(1_000_000, ge=1024, description="one line (request) of a batch input file, like "
                                "limits.max_body_bytes for a live request; a longer line fails the batch naming it")
    max_attempts: int = Field(3, ge=1, description="a batch whose processing fails this many times (an unexpected error, "
                              "not a line's) ends failed with the error in its errors")
    max_file_bytes: int = Field(200_000_000, ge=1024, description="largest uploaded file")
    file_expiry_seconds: int | None = Field(30 * 86400, ge=3600, description="batch input files uploaded without "
                                            "expires_after, and batch output and error files, expire this long after "
                                            "their creation (OpenAI's 30 days); null: kept until deleted")
    max_storage_bytes_per_key: int | None = Field(2 << 30, ge=1024, description="bytes of files (uploads and batch output) one "
                                                  "key may hold; an upload past it is a 413 storage_quota_exceeded; null: no "
                                                  "quota. 2 GiB: a fifth of the Helm chart's 10 Gi file volume")
    file_sweep_seconds: float = Field(60.0, gt=0, description="how often expired files are deleted")
    lease_seconds: float = Field(30.0, gt=0, description="a batch whose holder stops renewing is taken over after this")
    poll_seconds: float = Field(1.0, gt=0, description="how often idle runners look for work")

    @model_validator(mode="after")
    def _bounds(self) -> "BatchConfig":
        if not self.completion_windows or min(self.completion_windows.values()) <= 0:
            raise ValueError("batch.completion_windows needs at least one window, each longer than 0 seconds")
        if self.min_in_flight > self.max_in_flight:
            raise ValueError(f"batch.min_in_flight ({self.min_in_flight}) must be <= batch.max_in_flight ({self.max_in_flight})")
        return self


class ResponsesConfig(StrictModel):
    """The Responses API (/v1/responses): stored responses and the conversations chained by previous_response_id."""

    max_chain_length: int = Field(100, ge=1, description="turns a conversation chained by previous_response_id may hold "
                                  "(the new one included): each turn rebuilds the whole chain from the store, charged to "
                                  "the key's prompt tokens before it is read; one more is a 400 naming previous_response_id")


class HealthConfig(StrictModel):
    """The gateway's watcher of each pool: checks, and brings a pool that is down back (a dead in-process
    engine is restarted), retrying with exponential backoff."""

    period_seconds: float = Field(5.0, gt=0, description="time between health checks of a pool")
    timeout_seconds: float = Field(10.0, gt=0, description="a check that takes longer fails")
    max_backoff_seconds: float = Field(60.0, gt=0, description="longest wait between failed recovery attempts")
    shutdown_grace_seconds: float = Field(30.0, ge=0, description="on SIGTERM: the listener closes at once (readiness "
                                          "fails), requests in flight get this long to finish, then batch leases are released")


class PlatformConfig(StrictModel):
    """The whole platform: the gateway's address, its pools and the settings of each part (platform.yaml)."""

    model: str = Field("swiftkv", description="public model name: requests for it are routed between the pools (each pool "
                       "also answers to its served_model_name)")
    host: str = Field("127.0.0.1", description="address the gateway listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port the gateway listens on (0: one the OS picks)")
    workers: int = Field(1, ge=1, description="gateway processes accepting on the one port (`swiftkv serve --workers`), for pools "
                         "on Ray or remote servers; per-key limits are shared between them only through redis_url")
    pools: dict[str, PoolConfig] = Field(description="the engine pools by name: swiftkv (the SwiftKV model) and/or base "
                                         "(the base model)")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="how the gateway chooses a pool for each request")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="bounds on client requests checked at the edge, "
                                 "and per-key rate limits")
    api_keys_file: str | None = Field(None, description="the API keys file: YAML with a `keys:` list of entries (key or sha256, "
                                      "name, limits, min_priority, share_prefix_cache; services/common/keys.py), reloaded when it "
                                      "changes and on SIGHUP")
    ray_address: str | None = Field(None, description="Ray cluster to join; default: start a local one")
    data_dir: str = Field("~/.local/share/swiftkv", description="batch files and the embedded SQLite database")
    database_url: str | None = Field(None, description="SQLAlchemy URL of the batch store (postgresql://...); default: SQLite in data_dir")
    redis_url: str | None = Field(None, description="Redis (redis://host:6379/0) holding the per-key rate limits that several "
                                  "gateway processes share, and carrying their live traffic to each other's batch runners; "
                                  "default: each process keeps its own limits in memory and sees only its own live traffic")
    redis_prefix: str = Field("swiftkv", min_length=1, pattern=r"^[^\s:]+$", description="first part of every Redis key and "
                              "channel this platform uses (<prefix>:ratelimit:..., <prefix>:live), so that releases sharing "
                              "one Redis keep their own limits and live traffic; the Helm chart sets the release's name")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="the Batch API's runner and its files")
    health: HealthConfig = Field(default_factory=HealthConfig, description="health checks of each pool and recovery of one "
                                 "that is down")
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig, description="the Responses API's stored "
                                       "conversations (stored responses expire and count against the storage quota like "
                                       "batch files: batch.file_expiry_seconds, batch.max_storage_bytes_per_key)")

    @model_validator(mode="after")
    def _pools(self) -> "PlatformConfig":
        if not self.pools:
            raise ValueError("at least one pool is needed")
        renamed = [name for name in self.pools if name in RENAMED_POOLS]
        if renamed:
            raise ValueError(f"pools.{renamed[0]}: the pools are named swiftkv (the SwiftKV model) and base (the base "
                             "model); rename prefill -> swiftkv and decode -> base")
        unknown = set(self.pools) - set(POOL_NAMES)
        if unknown:
            raise ValueError(f"pool names must be 'swiftkv' and/or 'base', got {sorted(unknown)}")
        for name, pool in self.pools.items():
            if pool.ray_app and not self.ray_address:
                raise ValueError(f"pools.{name}.ray_app attaches to an application on a running Ray cluster: set ray_address")
        names = [self.served_name(p) for p in self.pools] + [self.model]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be distinct: {names}")
        return self

    def served_name(self, pool: str) -> str:
        return self.pools[pool].served_model_name or f"{self.model}-{pool}"


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PlatformConfig:
    """Read the YAML at `path` (or the embedded default) and apply top-level overrides (e.g. host, port)."""
    text = DEFAULT_CONFIG if path is None else Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a YAML mapping")
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return PlatformConfig.model_validate(data)
