"""SwiftKV Llama for vLLM: SingleInputKV with one fused KV GEMM, AcrossKV through shared KV caches.

One forward step over a batch of scheduled tokens (prefill chunks and decode tokens mixed):

    layers 0..l-1          stock vLLM Llama layers, every token
    after layer l-1        stream = residual stream; kv_in = norm_swiftkv(stream)
                           ONE GEMM: kv_in @ [K_l.. | V_l..] for every AcrossKV group leader >= l,
                           RoPE on all those keys at once, then each leader's paged cache is written
                           for every token (`unified_kv_cache_update`)
    layers l..L-1          only the tokens that need logits (decode and draft tokens, the last token of
                           each prefill chunk): Q from q_proj_swiftkv, attention over the cache written
                           above (a group's later layers read their leader's cache through vLLM's
                           `kv_sharing_target_layer_name`, so they allocate none), o_proj, MLP
    final norm             rows that need logits; all other rows of the output are zeros (never read:
                           `prompt_logprobs` is refused by `engine_config`)

Dual mode (`hf_overrides={"swiftkv_dual_mode": true}`, swiftkv_core/dual_mode.py): the later layers also hold the
base model's q/k/v projections, and the requests the model runner marks as base mode (`request_modes`) keep every
token through the later layers, where their Q/K/V come from those projections and their K/V overwrite the SwiftKV ones
in the cache before each layer's attention: the base model exactly, beside SwiftKV requests in the same step.

Under vLLM's torch.compile modes, layers 0..l-1 with the fused projection and layers l..L-1 with the final
norm are two compile units (`SwiftKVLowerLayers`, `SwiftKVLaterLayers`); the glue between them (cache
writes, token selection, metadata) stays eager. Later layers build no k/v projections at all and the original q/k/v tensors of layers >= l are
skipped at load time. The checkpoint format is Snowflake's (`model.norm_swiftkv`,
`self_attn.q_proj_swiftkv`, `self_attn.{k,v}_proj_swiftkv` on group leaders), so their published
checkpoints and ours load unchanged. Reference semantics: `swiftkv_core.modeling_llama_swiftkv`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import (
    unified_attention_with_output,
    unified_kv_cache_update,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from vllm.utils.torch_utils import _encode_layer_name

from ..config import SwiftKVConfigError
from ..dual_mode import CONFIG_FIELD
from ..dual_mode import refusal as dual_mode_refusal
from . import request_modes
from .logits_tokens import rows_of_requests, select_logits_tokens


def _attention_bias(config) -> tuple[bool, bool]:
    """(bias of q/k/v, bias of o_proj), read the way vLLM's Llama reads them."""
    bias = getattr(config, "attention_bias", False) or getattr(config, "bias", False)
    return getattr(config, "qkv_bias", bias), bias


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attn_name(layer_idx: int, prefix: str) -> str:
    return f"{prefix}.layers.{layer_idx}.self_attn.attn"


def write_kv_cache(attn: Attention, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write K/V of every token of the step into `attn`'s paged cache, without running attention."""
    key = key.view(-1, attn.num_kv_heads, attn.head_size)
    value = value.view(-1, attn.num_kv_heads, attn.head_size_v)
    if attn.use_direct_call:
        unified_kv_cache_update(key, value, attn.layer_name)
    else:
        torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(attn.layer_name))


def attend_cached(attn: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`Attention.forward` minus its cache write: the keys and values are already in the cache."""
    if attn.query_quant is not None:
        query, _ = attn.query_quant(query, attn._q_scale)
    output = torch.empty((query.shape[0], attn.num_heads * attn.head_size_v), dtype=query.dtype, device=query.device)
    args = (
        query.view(-1, attn.num_heads, attn.head_size),
        key.view(-1, attn.num_kv_heads, attn.head_size),
        value.view(-1, attn.num_kv_heads, attn.head_size_v),
        output.view(-1, attn.num_heads, attn.head_size_v),
    )
    if attn.use_direct_call:
        unified_attention_with_output(*args, attn.layer_name)
    else:
        torch.ops.vllm.unified_attention_with_output(*args, _encode_layer_name(attn.layer_name))
    return output


class SwiftKVLaterAttention(nn.Module):
    """Self-attention of a later layer: its own Q projection, K/V taken from the paged cache. In a dual-mode engine
    it also holds the base model's q/k/v projection, for the rows of base-mode requests."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, kv_sharing_target_layer_name: str | None, dual_mode: bool = False):
        super().__init__()
        config = vllm_config.model_config.hf_config
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = _head_dim(config)
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        if self.total_num_heads % tp_size or self.total_num_kv_heads % tp_size:
            raise ValueError(
                f"SwiftKV needs attention heads ({self.total_num_heads}) and KV heads ({self.total_num_kv_heads}) "
                f"divisible by the tensor-parallel size ({tp_size})"
            )
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = self.total_num_kv_heads // tp_size
        qkv_bias, o_bias = _attention_bias(config)
        quant_config = vllm_config.quant_config
        self.q_proj = ColumnParallelLinear(
            config.hidden_size,
            self.total_num_heads * self.head_dim,
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.q_proj",
        )
        self.qkv_proj = None
        if dual_mode:
            self.qkv_proj = QKVParallelLinear(
                config.hidden_size,
                self.head_dim,
                self.total_num_heads,
                self.total_num_kv_heads,
                bias=qkv_bias,
                quant_config=quant_config,
                prefix=f"{prefix}.qkv_proj",
            )
            self.qkv_split = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=getattr(config, "max_position_embeddings", 8192),
            rope_parameters=getattr(config, "rope_parameters", None),
            is_neox_style=True,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
            kv_sharing_target_layer_name=kv_sharing_target_layer_name,
        )

    def forward(self, positions, hidden_states, key, value, base_rows=None) -> torch.Tensor:
        """`key`/`value`: the SwiftKV K/V of these rows (already in the cache). `base_rows` (dual mode): the rows of
        base-mode requests, which take Q/K/V from the base projections; their K/V replace the SwiftKV ones in the
        cache before attention."""
        q, _ = self.q_proj(hidden_states)
        if base_rows is None:
            q, _ = self.rotary_emb(positions, q, None)
        else:
            q_base, k_base, v_base = self.qkv_proj(hidden_states)[0].split(self.qkv_split, dim=-1)
            rows = base_rows[:, None]
            q, k_base = self.rotary_emb(positions, torch.where(rows, q_base, q), k_base)
            key, value = torch.where(rows, k_base, key), torch.where(rows, v_base, value)
            write_kv_cache(self.attn, key, value)
        output, _ = self.o_proj(attend_cached(self.attn, q, key, value))
        return output


class SwiftKVLaterDecoderLayer(nn.Module):
    """A later layer (i >= l): LlamaDecoderLayer with SwiftKVLaterAttention."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, kv_sharing_target_layer_name: str | None, dual_mode: bool = False):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = SwiftKVLaterAttention(vllm_config, f"{prefix}.self_attn", kv_sharing_target_layer_name, dual_mode)
        self.mlp = LlamaMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            bias=getattr(config, "mlp_bias", False),
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, key, value, base_rows=None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, key, value, base_rows)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class SwiftKVLowerLayers(nn.Module):
    """Embedding, layers 0..l-1 and the fused SwiftKV projection: one torch.compile unit (all tokens)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVLlamaModel):
        super().__init__()
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers[: model.num_kv_layers]
        self.norm_swiftkv = model.norm_swiftkv
        self.kv_proj_swiftkv = model.kv_proj_swiftkv
        self.rotary_emb = model.rotary_emb
        self.key_columns = len(model.leaders) * model.kv_size

    def forward(self, input_ids, positions, inputs_embeds=None):
        """(residual stream after layer l-1, keys of all leaders (rotated), values of all leaders)."""
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        stream = hidden_states + residual
        # One GEMM for the K/V of every later layer; output columns [K leader 0..n-1 | V leader 0..n-1].
        kv, _ = self.kv_proj_swiftkv(self.norm_swiftkv(stream))
        keys, _ = self.rotary_emb(positions, kv[:, : self.key_columns], None)
        return stream, keys, kv[:, self.key_columns :]


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden_states": 0, "key_block": 0, "value_block": 0})
class SwiftKVLaterLayers(nn.Module):
    """Layers l..L-1 and the final norm, for the tokens that need logits: one torch.compile unit."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVLlamaModel):
        super().__init__()
        self.layers = model.layers[model.num_kv_layers :]
        self.norm = model.norm
        self.kv_size, self.group_size = model.kv_size, model.group_size

    def forward(self, positions, hidden_states, key_block, value_block) -> torch.Tensor:
        return self.forward_dual(positions, hidden_states, key_block, value_block, None)

    def forward_dual(self, positions, hidden_states, key_block, value_block, base_rows) -> torch.Tensor:
        """`forward` with the rows of base-mode requests marked (dual mode; not a compile unit: eager)."""
        keys, values = key_block.split(self.kv_size, dim=-1), value_block.split(self.kv_size, dim=-1)
        residual = None
        for i, layer in enumerate(self.layers):
            j = i // self.group_size
            hidden_states, residual = layer(positions, hidden_states, residual, keys[j], values[j], base_rows)
        return self.norm(hidden_states, residual)[0]


class SwiftKVLlamaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model"):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        L = config.num_hidden_layers
        self.num_kv_layers = l = getattr(config, "num_key_value_layers", None) or L
        self.group_size = g = getattr(config, "key_value_group_size", 1) or 1
        # Tokens per request that continue past layer l: the last one, plus every draft position under speculative
        # decoding (verification needs logits at each; `logits_tokens`).
        speculative = vllm_config.speculative_config
        self.queries_per_request = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
        # The AcrossKV group leaders among the later layers: each owns one KV projection and cache.
        self.leaders = list(range(l, L, g))
        self.dual_mode = bool(getattr(config, CONFIG_FIELD, False))
        if self.dual_mode:
            _check_dual_mode(config, l, L, g)
            request_modes.install()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config)
        layers: list[nn.Module] = [LlamaDecoderLayer(vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}") for i in range(l)]
        for i in range(l, L):
            leader = config.kv_group_leader(i)
            target = None if leader == i else _attn_name(leader, prefix)
            layers.append(SwiftKVLaterDecoderLayer(vllm_config, f"{prefix}.layers.{i}", target, self.dual_mode))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.leaders:
            self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            later = self.layers[l].self_attn
            self.kv_size = later.num_kv_heads * later.head_dim  # per leader, per TP rank
            qkv_bias, _ = _attention_bias(config)
            # Output columns: [K of leader 0, ..., K of leader n-1, V of leader 0, ..., V of leader n-1],
            # so all keys form one block and get RoPE in one call.
            self.kv_proj_swiftkv = MergedColumnParallelLinear(
                config.hidden_size,
                [later.total_num_kv_heads * later.head_dim] * (2 * len(self.leaders)),
                bias=qkv_bias,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.kv_proj_swiftkv",
            )
            self.rotary_emb = later.rotary_emb
            # Two compile units (eager when the engine runs eagerly); the glue between them (cache writes,
            # token selection, metadata) stays eager. Parameters keep their names under `layers`.
            from vllm.compilation.backends import set_model_tag

            with set_model_tag("swiftkv_lower"):
                self.lower = SwiftKVLowerLayers(vllm_config=vllm_config, prefix=f"{prefix}.lower", model=self)
            with set_model_tag("swiftkv_later"):
                self.later = SwiftKVLaterLayers(vllm_config=vllm_config, prefix=f"{prefix}.later", model=self)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        if not self.leaders:  # l = L: a plain Llama
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
            for layer in self.layers:
                hidden_states, residual = layer(positions, hidden_states, residual)
            return self.norm(hidden_states, residual)[0]

        stream, key_block, value_block = self.lower(input_ids, positions, inputs_embeds)
        for leader, k, v in zip(self.leaders, self._split(key_block), self._split(value_block)):
            write_kv_cache(self.layers[leader].self_attn.attn, k, v)

        metadata = self.later_metadata()
        # Dual mode, a step holding base-mode requests: their every token continues (the base model runs all layers
        # on all tokens) through the base projections (`base_rows`), beside the SwiftKV requests' last tokens.
        base = request_modes.base_requests() if self.dual_mode and metadata is not None else None
        base_rows = None if base is None else rows_of_requests(metadata, base, stream.shape[0])

        def later(rows, *inputs):
            return self.later(*inputs) if base_rows is None else self.later.forward_dual(*inputs, base_rows[rows])

        selected = None if metadata is None else self.select_tokens(metadata, keep_all=base)
        if selected is None:  # decode-only step or profile run: all tokens continue
            return later(slice(None), positions, stream, key_block, value_block)
        indices = selected.indices
        # the later layers write the base-mode rows' K/V: to the selected rows' cache slots
        with self.later_layers_metadata(selected.metadata, None if base_rows is None else indices):
            out_sel = later(indices, positions[indices], stream[indices], key_block[indices], value_block[indices])
        out = stream.new_zeros(stream.shape)
        out[indices] = out_sel
        return out

    def _split(self, block: torch.Tensor) -> list[torch.Tensor]:
        return list(block.split(self.kv_size, dim=-1))

    def later_metadata(self):
        """The step's attention metadata of the first later layer (None in dummy and profiling runs)."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            return None
        if not isinstance(attn_metadata, dict):
            raise NotImplementedError("SwiftKV does not support micro-batched (DBO) attention metadata")
        return attn_metadata[self.layers[self.num_kv_layers].self_attn.attn.layer_name]

    def select_tokens(self, metadata, keep_all=None):
        attn = self.layers[self.num_kv_layers].self_attn.attn
        return select_logits_tokens(metadata, attn, self.queries_per_request, keep_all)

    @contextmanager
    def later_layers_metadata(self, metadata, indices=None):
        """Give every later layer's attention the metadata of the selected tokens for a while (and, where those
        layers write K/V of the selected rows, `indices`: the cache slots of those rows)."""
        ctx = get_forward_context()
        saved, saved_slots = ctx.attn_metadata, ctx.slot_mapping
        names = [layer.self_attn.attn.layer_name for layer in self.layers[self.num_kv_layers :]]
        ctx.attn_metadata = {**saved, **dict.fromkeys(names, metadata)}
        if indices is not None and isinstance(saved_slots, dict):
            ctx.slot_mapping = {**saved_slots, **{n: saved_slots[n][indices] for n in names if n in saved_slots}}
        try:
            yield
        finally:
            ctx.attn_metadata, ctx.slot_mapping = saved, saved_slots


def _check_dual_mode(config, l: int, L: int, g: int) -> None:
    """Refuse a dual-mode engine on a checkpoint that does not hold its base model whole, or shares later caches."""
    reason = dual_mode_refusal(L, l, g, getattr(config, "later_layers_adapted", False))
    if reason is not None:
        raise SwiftKVConfigError(reason, CONFIG_FIELD)


# checkpoint tensor name -> (vLLM parameter name, shard id or None), or None to skip the tensor
# (suffix: weight, bias, or a quantized checkpoint's weight_scale / input_scale ...)
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(\w+)$")


class VllmLlamaSwiftKVForCausalLM(nn.Module):
    """vLLM's SwiftKV Llama, registered for the checkpoint architecture `LlamaSwiftKVForCausalLM` (the name of the
    reference model in `modeling_llama_swiftkv`, which checkpoints list in `architectures`)."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = SwiftKVLlamaModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.lm_head" if prefix else "lm_head",
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def map_weight_name(self, name: str) -> tuple[str, str | int | None] | None:
        """Where a checkpoint tensor goes: (parameter name, shard id) or None if inference does not use it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return None
        match = _LAYER_TENSOR.match(name)
        if match is None:
            return name, None
        i, block, proj, kind = int(match[1]), match[2], match[3], match[4]
        layer = f"model.layers.{i}.{block}"
        l = self.model.num_kv_layers
        if proj in ("gate_proj", "up_proj"):
            return f"{layer}.gate_up_proj.{kind}", 0 if proj == "gate_proj" else 1
        if proj in ("q_proj", "k_proj", "v_proj"):
            # Layers >= l: the original projections are the base model's, used only by a dual-mode engine.
            return None if i >= l and not self.model.dual_mode else (f"{layer}.qkv_proj.{kind}", proj[0])
        if proj == "q_proj_swiftkv":
            return f"{layer}.q_proj.{kind}", None
        if proj in ("k_proj_swiftkv", "v_proj_swiftkv"):
            leaders = self.model.leaders
            if i not in leaders:
                raise ValueError(f"{name}: layer {i} is not an AcrossKV group leader (leaders: {leaders})")
            j = leaders.index(i)
            return f"model.kv_proj_swiftkv.{kind}", j if proj == "k_proj_swiftkv" else len(leaders) + j
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self.map_weight_name(name)
            if target is None:
                continue
            param_name, shard = target
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in {type(self).__name__} ({param_name})")
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(param_name)
        return loaded


def describe(model: nn.Module) -> dict:
    """What an engine actually loaded (for diagnostics and tests; run it with `LLM.apply_model`)."""
    layers = model.model.layers
    first_later = getattr(model.model, "num_kv_layers", len(layers))
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "later_layer_attention_params": sorted(
            name for i in range(first_later, len(layers)) for name, _ in layers[i].self_attn.named_parameters()
        ),
        "kv_cache_tensors": len({layer.self_attn.attn.kv_cache.data_ptr() for layer in layers}),
    }
