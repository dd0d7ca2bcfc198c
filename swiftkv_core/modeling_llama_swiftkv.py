"""Reference SwiftKV Llama in plain PyTorch: the source of truth for the vLLM model and distillation.

One module runs as the teacher (the original Llama, `swiftkv=False`) or the student (SwiftKV,
`swiftkv=True`) over one copy of the frozen weights, as in the paper's Sec. 3.4:

    layers 0..l-1      identical in both modes
    student, i >= l    K/V come from norm_swiftkv(h_{l-1}) through the group leader's k/v_proj_swiftkv
                       (AcrossKV: one projection per group of g layers); Q from q_proj_swiftkv(h_i)
    teacher, i >= l    the original q/k/v projections

Later layers' K/V never depend on later layers' hidden states, so a full-sequence forward here gives
exactly the logits an engine produces when prompt tokens skip the later layers.

Distillation may give the student low-rank adapters on later layers' o_proj and MLP (`add_adapters`): they
act in the student pass only, so the teacher keeps the original weights, and are folded into the weights
(`merge_adapters`) before a checkpoint is written, so engines never see them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .config import LlamaSwiftKVConfig

# Linear layers of a later layer that may take a student-only adapter (the original q/k/v are the teacher's).
ADAPTER_MODULES = ("o_proj", "gate_proj", "up_proj", "down_proj")
# An adapter's factors outside the model (trained tensors, shipped files): `<linear>.lora_A` [r, in] and
# `<linear>.lora_B` [out, r] with alpha / r folded in, so merging is W += lora_B @ lora_A for `<linear>.weight`.
ADAPTER_FACTOR = re.compile(r"^(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])$")


class LowRankAdapter(nn.Module):
    """A low-rank update of a frozen linear layer W (LoRA): y = W x + (alpha / r) B A x. A [r, in] starts small
    and random, B [out, r] at zero, so a new adapter changes nothing until it trains."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.scale = alpha / rank
        bound = 1 / math.sqrt(linear.in_features)  # the usual LoRA init of A (kaiming-uniform, a = sqrt 5)
        a = torch.empty(rank, linear.in_features, dtype=linear.weight.dtype).uniform_(-bound, bound, generator=generator)
        self.A = nn.Parameter(a.to(linear.weight.device))
        self.B = nn.Parameter(torch.zeros(linear.out_features, rank, dtype=linear.weight.dtype, device=linear.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B) * self.scale


def check_adapter_settings(rank: int, alpha: float, modules: tuple[str, ...]) -> None:
    """ValueError naming what is wrong with an adapter setting and what would be right."""
    unknown = sorted(set(modules) - set(ADAPTER_MODULES))
    if rank < 1 or not alpha > 0 or unknown or not modules:
        raise ValueError(f"adapters need rank >= 1 (got {rank}), alpha > 0 (got {alpha}) and modules a non-empty subset of "
                         f"{','.join(ADAPTER_MODULES)} (got {','.join(modules) or 'none'})")


def adapted(linear: nn.Linear, x: torch.Tensor, student: bool) -> torch.Tensor:
    """`linear(x)`, plus its adapter's update in the student pass; the teacher pass always uses W alone."""
    adapter = getattr(linear, "lora", None)
    y = linear(x)
    return y + adapter(x) if student and adapter is not None else y


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """W + lora_B @ lora_A (the scale already in lora_B), computed in float32, returned in W's dtype."""
    if lora_b.shape[1] != lora_a.shape[0] or (lora_b.shape[0], lora_a.shape[1]) != tuple(weight.shape):
        raise ValueError(f"adapter factors {tuple(lora_b.shape)} @ {tuple(lora_a.shape)} do not fit a weight of shape {tuple(weight.shape)}")
    return (weight.float() + lora_b.float() @ lora_a.float()).to(weight.dtype)


def adapter_targets(factors: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    """Weight name -> (layer, lora_A, lora_B) for adapter factors named as ADAPTER_FACTOR describes."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    layers: dict[str, int] = {}
    for name, tensor in factors.items():
        match = ADAPTER_FACTOR.match(name)
        if match is None or match[3] not in ADAPTER_MODULES:
            raise ValueError(f"{name!r} is not an adapter factor (<layer>.<{'|'.join(ADAPTER_MODULES)}>.lora_A / lora_B)")
        pairs.setdefault(match[1], {})[match[4]] = tensor
        layers[match[1]] = int(match[2])
    unpaired = sorted(f"{prefix}.lora_{'B' if 'A' in ab else 'A'}" for prefix, ab in pairs.items() if len(ab) != 2)
    if unpaired:
        raise ValueError(f"adapter factors missing their partner: {unpaired[:4]}")
    return {f"{prefix}.weight": (layers[prefix], ab["A"], ab["B"]) for prefix, ab in pairs.items()}


class SwiftKVMLP(LlamaMLP):
    """Llama's MLP; in the student pass its projections add their adapters (if any)."""

    def forward(self, x: torch.Tensor, student: bool = False) -> torch.Tensor:
        gate, up = adapted(self.gate_proj, x, student), adapted(self.up_proj, x, student)
        return adapted(self.down_proj, self.act_fn(gate) * up, student)


class SwiftKVAttention(nn.Module):
    def __init__(self, config: LlamaSwiftKVConfig, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, q_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=bias)
        if layer_idx >= config.num_key_value_layers:
            self.q_proj_swiftkv = nn.Linear(hidden, q_dim, bias=bias)
            if config.kv_group_leader(layer_idx) == layer_idx:
                self.k_proj_swiftkv = nn.Linear(hidden, kv_dim, bias=bias)
                self.v_proj_swiftkv = nn.Linear(hidden, kv_dim, bias=bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [B, n, T, D]

    def project_kv(self, x: torch.Tensor, cos, sin, swiftkv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated) and V for all tokens of `x`, from the original or the SwiftKV projections."""
        k_proj, v_proj = (self.k_proj_swiftkv, self.v_proj_swiftkv) if swiftkv else (self.k_proj, self.v_proj)
        k, v = self._heads(k_proj(x), self.num_kv_heads), self._heads(v_proj(x), self.num_kv_heads)
        return _rope(k, cos, sin), v

    def forward(self, x, cos, sin, swiftkv: bool, kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        q = _rope(self._heads((self.q_proj_swiftkv if swiftkv else self.q_proj)(x), self.num_heads), cos, sin)
        k, v = kv if kv is not None else self.project_kv(x, cos, sin, swiftkv=False)
        # Several queries: a prefix without past (causal). One query after a cache: it sees every key.
        causal = q.shape[2] > 1
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=self.num_kv_heads != self.num_heads)
        b, _, t, _ = out.shape
        return adapted(self.o_proj, out.transpose(1, 2).reshape(b, t, -1), swiftkv)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on [B, heads, T, D] with cos/sin of shape [B, T, D] (neox-style halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class SwiftKVDecoderLayer(nn.Module):
    def __init__(self, config: LlamaSwiftKVConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SwiftKVAttention(config, layer_idx)
        self.mlp = SwiftKVMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, cos, sin, swiftkv: bool = False, kv=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, swiftkv=swiftkv, kv=kv)
        return h + self.mlp(self.post_attention_layernorm(h), student=swiftkv)


class SwiftKVModel(nn.Module):
    def __init__(self, config: LlamaSwiftKVConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(SwiftKVDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_swiftkv = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)


@dataclass
class LowerState:
    """Everything the later layers need: the residual stream after layer l-1 and the RoPE tables."""

    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class KVCache:
    """K/V of the tokens seen so far, per layer ([B, kv_heads, T, D]); in student mode the later layers keep
    one entry per AcrossKV group, under the group leader's index."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    length: int = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.kv:
            k, v = torch.cat((self.kv[layer][0], k), dim=2), torch.cat((self.kv[layer][1], v), dim=2)
        self.kv[layer] = (k, v)
        return k, v


@dataclass
class SwiftKVOutput:
    logits: torch.Tensor
    hidden_states: list[torch.Tensor] | None = None  # residual stream after each later layer (i >= l)


class LlamaSwiftKVForCausalLM(PreTrainedModel):
    config_class = LlamaSwiftKVConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["SwiftKVDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: LlamaSwiftKVConfig):
        super().__init__(config)
        self.model = SwiftKVModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @property
    def num_key_value_layers(self) -> int:
        return self.config.num_key_value_layers

    # The two halves are public so distillation can run the shared lower layers once for both passes.
    def forward_lower(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> LowerState:
        """Embeddings and layers 0..l-1, identical for teacher and student."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(h, position_ids)
        for layer in self.model.layers[: self.num_key_value_layers]:
            h = layer(h, cos, sin)
        return LowerState(h, cos, sin)

    def lower_state(self, hidden: torch.Tensor) -> LowerState:
        """The state after layer l-1 from a stored residual stream [B, T, d] (positions 0..T-1)."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = self.model.rotary_emb(hidden, positions)
        return LowerState(hidden, cos, sin)

    def forward_upper(self, state: LowerState, swiftkv: bool, output_hidden_states: bool = False) -> SwiftKVOutput:
        """Layers l..L-1 in teacher or student mode, then the final norm and the LM head."""
        final, hidden_states = self.forward_upper_hidden(state, swiftkv, output_hidden_states)
        return SwiftKVOutput(logits=self.lm_head(final), hidden_states=hidden_states)

    def forward_upper_hidden(self, state: LowerState, swiftkv: bool, output_hidden_states: bool = False):
        """Layers l..L-1 and the final norm: the LM head's input (distillation applies the head to chosen rows
        only), and the residual stream after each later layer if asked."""
        h, cos, sin = state.hidden, state.cos, state.sin
        kv_input = self.model.norm_swiftkv(h) if swiftkv else None
        shared_kv, hidden_states = None, []
        for i in self.config.swiftkv_layers:
            layer = self.model.layers[i]
            if swiftkv and self.config.kv_group_leader(i) == i:
                shared_kv = layer.self_attn.project_kv(kv_input, cos, sin, swiftkv=True)
            h = layer(h, cos, sin, swiftkv=swiftkv, kv=shared_kv if swiftkv else None)
            if output_hidden_states:
                hidden_states.append(h)
        return self.model.norm(h), (hidden_states if output_hidden_states else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        swiftkv: bool | None = None,
        output_hidden_states: bool = False,
        **_: object,
    ) -> SwiftKVOutput:
        """Full-sequence causal forward. `swiftkv=None` follows `config.swiftkv`. Right padding only."""
        swiftkv = self.config.swiftkv if swiftkv is None else swiftkv
        return self.forward_upper(self.forward_lower(input_ids, position_ids), swiftkv, output_hidden_states)

    def forward_cached(self, input_ids: torch.Tensor, cache: KVCache, swiftkv: bool) -> torch.Tensor:
        """Logits [B, V] of the last of the new tokens given `cache` (K/V of every earlier token; updated in
        place): the whole prompt on an empty cache (prefill), then one token per call. Same layers as
        forward_lower + forward_upper: student K/V of the later layers come from norm_swiftkv(h_{l-1}) of each
        new token. The LM head runs on the last token only (on a long prompt it costs as much as the layers)."""
        t = input_ids.shape[1]
        if cache.length and t != 1:
            raise ValueError("after the prefill, forward_cached takes one token per call")
        positions = torch.arange(cache.length, cache.length + t, device=input_ids.device).unsqueeze(0)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(h, positions)
        l = self.num_key_value_layers
        for i, layer in enumerate(self.model.layers):
            student = swiftkv and i >= l
            if student and i == l:
                kv_input = self.model.norm_swiftkv(h)
            if not student:
                kv = cache.append(i, *layer.self_attn.project_kv(layer.input_layernorm(h), cos, sin, swiftkv=False))
            elif self.config.kv_group_leader(i) == i:
                kv = cache.append(i, *layer.self_attn.project_kv(kv_input, cos, sin, swiftkv=True))
            h = layer(h, cos, sin, swiftkv=student, kv=kv)
        cache.length += t
        return self.lm_head(self.model.norm(h[:, -1]))

    def swiftkv_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters distillation trains: norm_swiftkv and every *_proj_swiftkv."""
        return {n: p for n, p in self.named_parameters() if "swiftkv" in n.split(".")[-2]}

    # Student-only adapters (distillation's `lora` scope); model.layers.{i}.<module>.lora.{A,B} in the model.

    def _adapter_linear(self, layer: int, module: str) -> nn.Linear:
        block = self.model.layers[layer]
        return block.self_attn.o_proj if module == "o_proj" else getattr(block.mlp, module)

    def add_adapters(self, rank: int, alpha: float, modules: tuple[str, ...] = ADAPTER_MODULES, seed: int = 0) -> dict[str, nn.Parameter]:
        """Give `modules` of every later layer (i >= l) a LowRankAdapter; A is drawn from `seed`. Returns them."""
        check_adapter_settings(rank, alpha, modules)
        generator = torch.Generator().manual_seed(seed)
        for i in self.config.swiftkv_layers:
            for module in ADAPTER_MODULES:  # a fixed order: the same seed gives the same adapters
                if module in modules:
                    linear = self._adapter_linear(i, module)
                    linear.lora = LowRankAdapter(linear, rank, alpha, generator)
        return self.adapter_parameters()

    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if n.split(".")[-2] == "lora"}

    def adapter_factors(self) -> dict[str, torch.Tensor]:
        """Each adapter as its factors outside the model: `<linear>.lora_A`, `<linear>.lora_B` (scale folded in)."""
        factors = {}
        for name, module in self.named_modules():
            if isinstance(module, LowRankAdapter):
                linear = name.removesuffix(".lora")
                factors[f"{linear}.lora_A"] = module.A.detach().clone()
                factors[f"{linear}.lora_B"] = module.B.detach() * module.scale
        return factors

    @torch.no_grad()
    def merge_adapters(self) -> None:
        """Fold every adapter into its weight (W += scale * B A) and remove it: the student pass is unchanged,
        the later layers' teacher pass now uses the merged weights, and the model saves as a plain checkpoint."""
        params = dict(self.named_parameters())
        for weight_name, (_, a, b) in adapter_targets(self.adapter_factors()).items():
            params[weight_name].copy_(merged_weight(params[weight_name], a, b))
            del self.get_submodule(weight_name.removesuffix(".weight")).lora

    @torch.no_grad()
    def greedy_generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        swiftkv: bool | None = None,
        eos_token_id: int | None = None,
        use_cache: bool = True,
    ) -> list[int]:
        """Greedy decoding: with a KV cache (prefill once, then one token per step), or without one
        (`use_cache=False` re-runs the whole prefix per token: slow, the reference the cache is tested against)."""
        swiftkv = self.config.swiftkv if swiftkv is None else swiftkv
        ids = list(prompt_ids)
        device = self.model.embed_tokens.weight.device
        cache = KVCache()
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(torch.tensor([ids], device=device), swiftkv=swiftkv).logits[0, -1]
            else:
                new = ids if cache.length == 0 else ids[-1:]
                logits = self.forward_cached(torch.tensor([new], device=device), cache, swiftkv)[0]
            next_id = int(torch.argmax(logits))
            ids.append(next_id)
            if eos_token_id is not None and next_id == eos_token_id:
                break
        return ids[len(prompt_ids):]


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaSwiftKVForCausalLM:
    """Load a SwiftKV checkpoint (ours or Snowflake's), or a plain Llama one as a SwiftKV model with l = L."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if not isinstance(config, LlamaSwiftKVConfig):
        from .config import swiftkv_config_from_base

        config = swiftkv_config_from_base(config, config.num_hidden_layers)
    model = LlamaSwiftKVForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    return model.to(device).eval()
