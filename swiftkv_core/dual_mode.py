"""Dual-mode SwiftKV engines: one engine serving the SwiftKV model and its base model, chosen per request.

A SwiftKV checkpoint holds its base model whole (the later layers' original q/k/v are kept beside the SwiftKV
projections), so one vLLM engine can run either forward for each request of a batch: `swiftkv` (prompt tokens stop
at layer l, the SwiftKV projections fill the later layers' caches) or `base` (every token through every layer with
the original projections: exactly the base model). A platform whose engines are all dual-mode chooses the model of a
request by what it needs (quality, prompt/output ratio) and the engine by load and cache, independently: prompt-heavy
traffic at capacity runs as SwiftKV on every engine instead of leaving a base-model engine idle.

The contract between whoever sends a request and the engine (pure Python: the gateway imports it without vLLM):
- the engine is started with `hf_overrides` containing DUAL_MODE_OVERRIDES (`vllm serve ... --hf-overrides
  '{"swiftkv_dual_mode": true}'`);
- a base-mode request carries `SamplingParams.extra_args = {"swiftkv_mode": "base"}` (`vllm_xargs` in an OpenAI
  request to a vLLM server) and the cache salt BASE_MODE_CACHE_SALT: the later layers' KV of the two modes differ,
  so their prefix-cache blocks must never be shared, and vLLM keys blocks by the salt. A request without the key runs
  in SwiftKV mode, as on a single-mode SwiftKV engine. Where the gateway keeps API keys' caches apart, the key's salt
  joins the mode's (`cache_salt`): this module forms every salt an engine gets.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["swiftkv", "base"]
MODES: tuple[Mode, ...] = ("swiftkv", "base")
CONFIG_FIELD = "swiftkv_dual_mode"
DUAL_MODE_OVERRIDES = {CONFIG_FIELD: True}
MODE_ARG = "swiftkv_mode"
BASE_MODE_CACHE_SALT = "swiftkv-base-mode"


def with_dual_mode(engine_args: dict) -> dict:
    """Engine args that start a SwiftKV checkpoint as a dual-mode engine (the args' own hf_overrides kept)."""
    return {**engine_args, "hf_overrides": {**(engine_args.get("hf_overrides") or {}), **DUAL_MODE_OVERRIDES}}


def extra_args(mode: Mode | None) -> dict | None:
    """SamplingParams.extra_args (vLLM server: `vllm_xargs`) that ask a dual-mode engine for `mode`."""
    check_mode(mode)
    return {MODE_ARG: "base"} if mode == "base" else None


def cache_salt(mode: Mode | None, key_salt: str | None = None) -> str | None:
    """The prefix-cache salt of a request in `mode` (None: the SwiftKV mode shares blocks with single-mode engines),
    combined with its API key's (`key_salt`, which keeps one key's blocks apart from another's): vLLM takes one salt
    per request, so a base-mode request of a key is salted `<mode salt>:<key salt>`."""
    check_mode(mode)
    return ":".join(s for s in (BASE_MODE_CACHE_SALT if mode == "base" else None, key_salt) if s) or None


def with_cache_salt(prompt: dict, mode: Mode | None, key_salt: str | None = None) -> dict:
    """An engine prompt (`{"prompt_token_ids": ...}`) with the prefix-cache salt of `mode` and `key_salt`, where it has one."""
    salt = cache_salt(mode, key_salt)
    return prompt if salt is None else {**prompt, "cache_salt": salt}


def refusal(num_hidden_layers: int, num_key_value_layers: int | None, key_value_group_size: int | None,
            later_layers_adapted: bool = False) -> str | None:
    """Why a SwiftKV checkpoint of this layout cannot serve its base model in dual mode (None: it can)."""
    L, l, g = num_hidden_layers, num_key_value_layers or num_hidden_layers, key_value_group_size or 1
    if l == L:
        return (f"{CONFIG_FIELD}: this checkpoint skips no layer (num_key_value_layers = {L}): it is its base model "
                "already; serve it without the override")
    if g > 1:
        return (f"{CONFIG_FIELD} needs key_value_group_size 1 (got {g}): with AcrossKV the later layers share KV caches, "
                "which the base model's own K/V cannot")
    if later_layers_adapted:
        return (f"{CONFIG_FIELD}: this checkpoint's later layers carry merged adapters, so it no longer holds its base "
                "model; serve the base model from its own checkpoint")
    return None


def is_base(extra: dict | None) -> bool:
    """Whether a request's extra_args ask for base mode (read by the engine's model runner)."""
    return bool(extra) and extra.get(MODE_ARG) == "base"


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown SwiftKV engine mode {mode!r}; choose from {', '.join(MODES)}")
