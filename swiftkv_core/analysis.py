"""What SwiftKV saves, computed from a config: prefill FLOPs (paper Table 1), KV-cache bytes, SimScore (Eq. 1).

FLOP accounting ("exact", the default): 2 FLOPs per multiply-accumulate; the LM head counted once per
token; causal attention over an average context of S/2 (QK^T and AV: 2 * 2 * q_dim * S/2 per layer).
With SingleInputKV a prompt token runs layers < l fully and only the K/V projections of later layers
(one per AcrossKV group).

The paper's Table 1 keeps two different books: its vocab column counts the embedding lookup as a
matmul too (2 x 2hV), and its attention column is in units of 2^30 FLOPs while the others use 10^9
(Llama-3.1-70B at S = 128K: 171.8e9 attention FLOPs = 160 x 2^30). `convention="paper"` reproduces
those figures exactly; "exact" is what the hardware does. The ratios differ by less than a point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import check_swiftkv_layout

GIGA = 1e9
COMPONENTS = ("vocab", "kv", "qo", "mlp", "attn")


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            name or getattr(config, "_name_or_path", "") or "model",
            config.num_hidden_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            head_dim,
            config.vocab_size,
        )


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256),
        ModelShape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128, 128256),
        ModelShape("llama-3.1-405b", 126, 16384, 53248, 128, 8, 128, 128256),
        ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152),
    )
}


def num_kv_layers(L: int, l: int, g: int) -> int:
    """Distinct KV caches (and KV projections a prompt token computes): l own + (L - l) / g shared."""
    return l + (L - l) // g


def prefill_flops(shape: ModelShape, seq_len: int, l: int | None = None, g: int = 1, convention: str = "exact") -> dict[str, float]:
    """GFLOPs per prefill token by component, plus `total`."""
    if convention not in ("exact", "paper"):
        raise ValueError(f"convention must be 'exact' or 'paper', got {convention!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    L = shape.num_hidden_layers
    l = L if l is None else l
    check_swiftkv_layout(L, l, g)
    h, q_dim, kv_dim = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    vocab_matmuls = 2 if convention == "paper" else 1
    attn_unit = 2**30 if convention == "paper" else GIGA
    figures = {
        "vocab": vocab_matmuls * 2 * h * shape.vocab_size / GIGA,
        "kv": num_kv_layers(L, l, g) * 2 * (2 * h * kv_dim) / GIGA,
        "qo": l * 2 * (2 * h * q_dim) / GIGA,
        "mlp": l * 2 * (3 * h * shape.intermediate_size) / GIGA,
        "attn": l * 2 * 2 * q_dim * (seq_len / 2) / attn_unit,
    }
    figures["total"] = sum(figures[c] for c in COMPONENTS)
    return figures


def flops_report(shape: ModelShape, seq_len: int, l: int, g: int = 1, convention: str = "exact") -> dict:
    """Per-component figures for the SwiftKV layout and the baseline, and the ratio of totals."""
    ours = prefill_flops(shape, seq_len, l, g, convention)
    base = prefill_flops(shape, seq_len, None, 1, convention)
    return {
        "model": shape.name,
        "seq_len": seq_len,
        "num_key_value_layers": l,
        "key_value_group_size": g,
        "convention": convention,
        "gflops": {c: ours[c] for c in COMPONENTS},
        "baseline_gflops": {c: base[c] for c in COMPONENTS},
        "total_gflops": ours["total"],
        "baseline_total_gflops": base["total"],
        "relative": ours["total"] / base["total"],
        # An engine computes logits only for the last prompt token, so the vocab column drops out of
        # the prefill cost it pays: this is the speedup a perfect SwiftKV engine could show on prefill.
        "max_prefill_speedup": (base["total"] - base["vocab"]) / (ours["total"] - ours["vocab"]),
    }


KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_cache_report(shape: ModelShape, l: int, g: int = 1, kv_dtype: str = "bfloat16", baseline_dtype: str = "bfloat16") -> dict:
    """KV-cache bytes per token for the layout against the baseline (all layers, `baseline_dtype`)."""
    for name, dtype in (("kv_dtype", kv_dtype), ("baseline_dtype", baseline_dtype)):
        if dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {sorted(KV_DTYPE_BYTES)}, got {dtype!r}")
    L = shape.num_hidden_layers
    check_swiftkv_layout(L, l, g)
    per_layer = 2 * shape.num_key_value_heads * shape.head_dim  # K and V elements per token per cache
    ours = num_kv_layers(L, l, g) * per_layer * KV_DTYPE_BYTES[kv_dtype]
    base = L * per_layer * KV_DTYPE_BYTES[baseline_dtype]
    return {
        "model": shape.name,
        "num_key_value_layers": l,
        "key_value_group_size": g,
        "kv_dtype": kv_dtype,
        "kv_caches": num_kv_layers(L, l, g),
        "bytes_per_token": ours,
        "baseline_bytes_per_token": base,
        "relative": ours / base,
        "saving": 1 - ours / base,
        "capacity_ratio": base / ours,
    }


# SimScore (paper Eq. 1) -----------------------------------------------------------------------------
# Eq. 1 verbatim averages cos(x_l, x_j) over tokens. In small models a few "massive activation" channels
# are shared by every token and dominate the residual stream, so the raw cosine mostly measures those
# channels (SmolLM2's raw SimScore dips in the middle layers). Centering each layer's states on their
# token mean removes that shared direction and leaves what differs between tokens, which is what the
# later layers' K/V must be recovered from. We report both; the suggestion uses the centered score.


@torch.no_grad()
def sim_scores(model, sequences: list[torch.Tensor], center: bool = True) -> list[float]:
    """SimScore(x_l) for l = 0..L-1: mean over j > l of the token-averaged cosine(x_l, x_j).

    x_i is the residual stream entering layer i (x_0: embeddings), x_L the last layer's output.
    """
    layers = model.model.layers
    L = len(layers)
    totals = torch.zeros(L, dtype=torch.float64)
    for ids in sequences:
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        h = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(h, position_ids)
        xs = [h]
        for layer in layers:
            h = layer(h, cos, sin)
            xs.append(h)
        # Token 0 is an attention sink with activations ~100x the others: it would swamp the mean.
        x = torch.stack([t[0, 1:].float() for t in xs])  # [L+1, T-1, H]
        if center:
            x = x - x.mean(dim=1, keepdim=True)
        x = torch.nn.functional.normalize(x, dim=-1)
        sim = torch.einsum("ith,jth->ijt", x, x).mean(-1)  # [L+1, L+1], token-averaged cosine
        for l in range(L):
            totals[l] += sim[l, l + 1 :].mean().item()
    return (totals / len(sequences)).tolist()


def suggest_num_key_value_layers(scores: list[float], threshold: float = 0.5) -> int:
    """The first l >= 1 whose SimScore is `threshold` of the way from its lowest to its highest value.

    A relative rule, because absolute similarity levels differ between models (the paper saw about 0.5
    at half depth for 7-8B models); what carries over is where the curve has mostly settled.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    body = scores[1:]
    target = min(body) + threshold * (max(body) - min(body))
    return next(l for l in range(1, len(scores)) if scores[l] >= target)


def similarity_report(model_dir: str, text: str, seq_len: int = 256, max_sequences: int = 16, threshold: float = 0.5) -> dict:
    from transformers import AutoTokenizer

    from .modeling_llama_swiftkv import load_model

    if not text.strip():
        raise ValueError("the text is empty: SimScore needs some tokens")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    chunks = [ids[i : i + seq_len].unsqueeze(0) for i in range(0, len(ids), seq_len)][:max_sequences]
    chunks = [c for c in chunks if c.shape[1] >= 3]
    if not chunks:
        raise ValueError("the text has fewer than 3 tokens: SimScore needs some tokens")
    scores = sim_scores(model, chunks, center=True)
    return {
        "model": model_dir,
        "num_hidden_layers": len(scores),
        "sequences": len(chunks),
        "tokens": sum(c.shape[1] for c in chunks),
        "sim_scores": scores,
        "sim_scores_raw": sim_scores(model, chunks, center=False),
        "threshold": threshold,
        "suggested_num_key_value_layers": suggest_num_key_value_layers(scores, threshold),
    }
