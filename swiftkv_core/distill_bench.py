"""`swiftkv bench distill`: training tokens/s of a distillation step, cached against uncached, in one run,
and where a cached step's time goes against its FLOPs bound.

Both variants run the same batches from the same starting tensors. The bound is the step's matmul FLOPs
(the later layers forward, their activation gradients, the trained projections' weight gradients, and the
three head products of `head_kl`) divided by the float32 matmul rate this machine reaches at the step's
own shapes, measured in the same run. The profile groups the step's CPU time by kind of operator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StepShape:
    tokens: int  # B x T
    seq_len: int
    targets: int  # rows the head and the loss see
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    later_layers: int
    leaders: int


def step_gflops(s: StepShape) -> dict[str, float]:
    """Matmul GFLOPs of one cached step by part (2 FLOPs per multiply-add)."""
    n, h = s.tokens, s.hidden
    layer_fwd = 2 * n * (2 * h * s.q_dim + 3 * h * s.intermediate) + 2 * 2 * n * s.q_dim * s.seq_len / 2  # q, o, mlp, attention
    kv_fwd = s.leaders * 2 * n * 2 * h * s.kv_dim
    fwd = s.later_layers * layer_fwd + kv_fwd
    # Backward: activation gradients cost about the forward again (one product per matmul, two for
    # attention), and only the SwiftKV projections add weight gradients.
    bwd = s.later_layers * layer_fwd + s.later_layers * 2 * 2 * n * s.q_dim * s.seq_len / 2 + kv_fwd
    wgrad = s.later_layers * 2 * n * h * s.q_dim + kv_fwd
    head = 3 * 2 * s.targets * h * s.vocab  # student logits, teacher logits, gradient
    parts = {"later_layers_forward": fwd / 1e9, "later_layers_backward": (bwd + wgrad) / 1e9, "head": head / 1e9}
    parts["total"] = sum(parts.values())
    return parts


def matmul_gflops(m: int, k: int, n: int, seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of an [m,k] @ [k,n] product in `dtype` on this machine at the current thread count."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def _category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("mm", "matmul", "linear", "addmm", "bmm")):
        return "matmul"
    if "attention" in n or "sdpa" in n or "flash" in n:
        return "attention"
    if any(k in n for k in ("softmax", "exp", "log")):
        return "softmax/exp"
    if any(k in n for k in ("adam", "foreach", "lerp", "sqrt", "addcdiv", "addcmul")):
        return "optimizer"
    if any(k in n for k in ("index", "copy", "cat", "clone", "contiguous", "to", "empty", "zero", "fill", "from_numpy")):
        return "copies/indexing"
    return "elementwise/other"


def run(base: str, data_path: str, cache_dir: str, l: int, g: int = 1, batch_size: int = 8, seq_len: int = 256, steps: int = 6, log=print) -> dict:
    from transformers import AutoTokenizer

    from . import teacher_cache
    from .data import load_packed, loss_mask
    from .distill import DistillConfig, batch_indices, build_student, distill_step, trainable_parameters, use_bf16
    from .hardware import cpu_info

    rows = batch_size * (steps + 2)
    data = load_packed(data_path, AutoTokenizer.from_pretrained(base), seq_len, True)
    cache = teacher_cache.build(cache_dir, base, data, [l], rows, progress=False)
    cfg = DistillConfig(base=base, out="unused", data=data_path, num_key_value_layers=l, key_value_group_size=g, batch_size=batch_size, seq_len=seq_len, progress=False)
    model = build_student(base, l, g)
    params = trainable_parameters(model, "swiftkv")
    opt = torch.optim.AdamW(list(params.values()), lr=1e-5)
    batches = [batch_indices(i, min(rows, cache.rows), batch_size, 0) for i in range(steps + 1)]

    def one(idx, cached: bool) -> float:
        t0 = time.perf_counter()
        terms = distill_step(model, model, data.ids[idx], data.target[idx], cfg, cache if cached else None, idx)
        opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        opt.step()
        return time.perf_counter() - t0

    result: dict = {"machine": cpu_info().as_dict(), "threads": torch.get_num_threads(), "precision": "bf16" if use_bf16(cfg.precision) else "fp32",
                    "num_key_value_layers": l, "key_value_group_size": g, "batch_size": batch_size, "seq_len": seq_len, "steps": steps}
    tokens = batch_size * seq_len
    for name, cached in (("uncached", False), ("cached", True)):
        one(batches[0], cached)  # warm-up
        secs = [one(idx, cached) for idx in batches[1:]]
        result[f"{name}_tokens_per_s"] = round(tokens * len(secs) / sum(secs), 1)
        log(f"{name}: {result[f'{name}_tokens_per_s']} training tokens/s")
    result["speedup"] = round(result["cached_tokens_per_s"] / result["uncached_tokens_per_s"], 2)

    c = model.config
    targets = int(sum(loss_mask(data.target[idx]).sum() for idx in batches[1:]) / len(batches[1:]))
    shape = StepShape(tokens, seq_len, targets, c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                      c.intermediate_size, c.vocab_size, c.num_hidden_layers - l, len(range(l, c.num_hidden_layers, g)))
    flops = step_gflops(shape)
    dtype = torch.bfloat16 if result["precision"] == "bf16" else torch.float32  # the bound at the step's own precision
    peak = max(matmul_gflops(tokens, c.hidden_size, c.intermediate_size, dtype=dtype), matmul_gflops(256, c.hidden_size, c.vocab_size, dtype=dtype))
    step_s = tokens / result["cached_tokens_per_s"]
    result.update({"step_gflops": {k: round(v, 1) for k, v in flops.items()}, "matmul_peak_gflops_per_s": round(peak, 1),
                   "bound_tokens_per_s": round(tokens / (flops["total"] / peak), 1), "achieved_gflops_per_s": round(flops["total"] / step_s, 1)})
    result["share_of_bound"] = round(result["cached_tokens_per_s"] / result["bound_tokens_per_s"], 2)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for idx in batches[1:3]:
            one(idx, True)
    by_kind: dict[str, float] = {}
    for ev in prof.key_averages():
        by_kind[_category(ev.key)] = by_kind.get(_category(ev.key), 0.0) + ev.self_cpu_time_total
    total = sum(by_kind.values()) or 1.0
    result["profile_share"] = {k: round(v / total, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    result["targets_per_step"] = targets
    return result
