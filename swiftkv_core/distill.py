"""Knowledge-preserving SwiftKV distillation (paper Sec. 3.4), short enough to read in one sitting.

One copy of the frozen base weights serves as teacher and student:

    lower = model.forward_lower(ids)                    layers < l, identical for both: no grad
    teacher = model.forward_upper_hidden(lower, False)  the original later layers + final norm, no grad
    student = model.forward_upper_hidden(lower, True)   SwiftKV later layers + final norm, gradients
    loss = T^2 * KL(softmax(teacher @ W / T) || softmax(student @ W / T)), mean over target positions
           (+ hidden_weight * MSE of the final normed hidden states, the LM head's input)

With a teacher cache (`--cache DIR`, see teacher_cache.py) `lower.hidden` and the teacher's final hidden
state are read from disk and a step is the student's later layers and the head only. The head (W, tied and
frozen) is applied to target rows only, in float32, chunk by chunk with the KL gradient formed on the fly
(`head_kl`), so no [tokens x vocabulary] tensor is ever stored.

Only `norm_swiftkv`, `q_proj_swiftkv` and `k/v_proj_swiftkv` train (`--train-scope swiftkv`, the paper's
recipe); `--train-scope full-layers` also trains every weight of layers >= l (the paper's ablation; the
teacher then keeps its own frozen copy of those layers); `--train-scope lora` adds low-rank adapters to
o_proj and the MLP of layers >= l (`--lora-rank`, `--lora-alpha`, `--lora-modules`), acting in the student pass
only, so the teacher still runs the one frozen copy. `--loss lm` replaces the KL by the plain
next-token loss (the other ablation). AdamW, lr 2e-4, linear schedule with 5% warm-up. The later layers
run in bfloat16 autocast only on CPUs with native bf16 (`precision auto`); elsewhere float32.

Run state lives in OUT/: `metrics.jsonl` (one line per logged step), `state.pt` (trainable tensors,
optimizer, scheduler, step; written every `checkpoint_every` steps and at the end), `run.json` (the
settings). Running again with the same OUT resumes from `state.pt`: the data order is a pure function of
(seed, step), so a resumed run replays the same batches. At the end OUT holds a complete SwiftKV checkpoint
in the Snowflake format (config `llama_swiftkv`, every original tensor plus the SwiftKV ones; adapters merged
into their weights), which the vLLM plugin serves, and `trained/swiftkv-trained.safetensors` (only the
trained tensors, adapters as their factors `<linear>.lora_A` / `.lora_B`, for shipping).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pickle
import re
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import LlamaSwiftKVConfig, check_swiftkv_layout, swiftkv_config_from_base
from .data import DataError, PackedData, load_packed, loss_mask
from .hardware import cpu_info
from .modeling_llama_swiftkv import ADAPTER_MODULES, LlamaSwiftKVForCausalLM, check_adapter_settings
from .shipped import TRAINED_FILE

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"


class DistillError(ValueError):
    """Bad distillation settings or inputs; the message says what to change."""


class DistillStopped(Exception):
    """SIGTERM arrived: the run saved its state at the end of the step it was in and stopped; running it again
    with the same OUT resumes from there."""

    def __init__(self, step: int):
        super().__init__(f"stopped at step {step}; the state is saved and the run resumes from it")
        self.step = step


@contextlib.contextmanager
def stop_on_sigterm():
    """Yields a list that becomes non-empty once SIGTERM arrives (a service stopping, a pod terminating), so the
    loop ends at a step boundary with its state saved. Outside the main thread (no signal handlers) it stays empty."""
    import signal
    import threading

    requested: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: requested.append(signum))
    try:
        yield requested
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class DistillConfig:
    base: str
    out: str
    data: str
    num_key_value_layers: int
    key_value_group_size: int = 1
    loss: str = "kl"  # kl | lm
    temperature: float = 2.0
    hidden_weight: float = 0.0  # weight of the MSE of the final normed hidden states (0 = off)
    train_scope: str = "swiftkv"  # swiftkv | full-layers | lora (student-only low-rank adapters on layers >= l, + swiftkv)
    lora_rank: int = 16
    lora_alpha: float = 16.0  # adapter update scaled by lora_alpha / lora_rank
    lora_modules: str = ",".join(ADAPTER_MODULES)  # comma-separated, among ADAPTER_MODULES
    init: str = "snowflake"  # snowflake | lstsq (least-squares fit of the K/V projections to the teacher's) | lstsq-qkv (and the queries)
    init_tokens: int = 32768  # tokens used by the lstsq initialisation
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of the steps
    max_steps: int = 200  # length of the lr schedule
    stop_at: int | None = None  # end training early at this step (schedule unchanged) and write the checkpoint
    batch_size: int = 4
    seq_len: int = 256
    rows: int | None = None  # train on the first `rows` packed rows only (default: max_steps x batch_size)
    assistant_only: bool = True
    precision: str = "auto"  # auto | fp32 | bf16: autocast of the later layers (weights and optimizer stay float32)
    cache: str | None = None  # teacher cache folder (built on first use for this run's rows and layer l)
    seed: int = 0
    log_every: int = 1
    checkpoint_every: int = 50
    eval_data: str | None = None  # held-out text evaluated every eval_every steps (top-1 agreement, KL)
    eval_every: int = 0
    eval_rows: int = 16
    threads: int | None = None
    device: str = "auto"  # auto (cuda when torch sees a GPU, else cpu) | cpu | cuda[:N]; a run may resume on another device
    progress: bool = True
    finalize: bool = False  # train no further: write the checkpoint from OUT's last saved state


# --------------------------------------------------------------------------------------------------
# Model set-up


def build_student(base: str | Path, num_key_value_layers: int, key_value_group_size: int) -> LlamaSwiftKVForCausalLM:
    """The base Llama weights in a SwiftKV model, SwiftKV tensors set to Snowflake's initialisation."""
    from transformers import AutoConfig

    from .convert import swiftkv_init_tensors

    base_dir = Path(base)
    if not (base_dir / "config.json").exists():
        raise DistillError(f"base model folder {str(base_dir)!r} does not exist or has no config.json")
    base_config = AutoConfig.from_pretrained(base_dir)
    if isinstance(base_config, LlamaSwiftKVConfig):
        raise DistillError(f"{base_dir} is already a SwiftKV checkpoint; pass the base Llama model as --base")
    if base_config.model_type != "llama":
        raise DistillError(f"only Llama models can be distilled, {base_dir} has model_type {base_config.model_type!r}")
    L = base_config.num_hidden_layers
    if num_key_value_layers >= L:
        raise DistillError(f"num_key_value_layers must be < num_hidden_layers = {L} to have anything to distill, got {num_key_value_layers}")
    check_swiftkv_layout(L, num_key_value_layers, key_value_group_size)
    config = swiftkv_config_from_base(base_config, num_key_value_layers, key_value_group_size)
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the SwiftKV tensors are "missing" from the base: expected
    try:
        model = LlamaSwiftKVForCausalLM.from_pretrained(base_dir, config=config, dtype=torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    init = swiftkv_init_tensors(base_dir, config)
    missing, unexpected = model.load_state_dict(init, strict=False)
    if unexpected:
        raise DistillError(f"unexpected SwiftKV tensors: {unexpected}")
    return model.eval()


TRAIN_SCOPES = ("swiftkv", "full-layers", "lora")


def lora_modules(cfg: DistillConfig) -> tuple[str, ...]:
    return tuple(m.strip() for m in cfg.lora_modules.split(",") if m.strip())


def trainable_parameters(model: LlamaSwiftKVForCausalLM, scope: str) -> dict[str, torch.nn.Parameter]:
    """Name -> parameter of what trains; everything else is frozen (requires_grad False). `lora` trains the
    adapters `model.add_adapters` gave the student, and the SwiftKV tensors."""
    if scope == "swiftkv":
        chosen = model.swiftkv_parameters()
    elif scope == "full-layers":
        later = tuple(f"model.layers.{i}." for i in model.config.swiftkv_layers)
        chosen = {n: p for n, p in model.named_parameters() if n.startswith(later) or n in model.swiftkv_parameters()}
    elif scope == "lora":
        if not model.adapter_parameters():
            raise DistillError("train scope 'lora' needs adapters on the model (model.add_adapters)")
        chosen = {**model.swiftkv_parameters(), **model.adapter_parameters()}
    else:
        raise DistillError(f"train scope must be {', '.join(TRAIN_SCOPES)}, got {scope!r}")
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
    return chosen


@torch.no_grad()
def lstsq_init(model: LlamaSwiftKVForCausalLM, data: PackedData, tokens: int, ridge: float = 1e-3) -> None:
    """Fit each group's k/v_proj_swiftkv so that W @ norm_swiftkv(h_{l-1}) matches the teacher's K and V.

    K and V are linear in the input and RoPE is applied after the projection, so matching them before
    RoPE is an ordinary (ridge) least-squares problem: W = Y^T X (X^T X + ridge I)^-1, with Y the mean
    of the group's teacher projections (the least-squares optimum for one W shared by the group).
    """
    cfg = model.config
    rows = max(1, min(len(data), tokens // data.seq_len))
    d, device = cfg.hidden_size, model.lm_head.weight.device
    xtx = torch.zeros(d, d, dtype=torch.float64, device=device)
    xty: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(rows):
        ids = data.ids[r : r + 1].to(device)
        state = model.forward_lower(ids)
        x = model.model.norm_swiftkv(state.hidden)[0].double()  # [T, d]
        xtx += x.T @ x
        h = state.hidden
        for i in cfg.swiftkv_layers:
            layer = model.model.layers[i]
            hn = layer.input_layernorm(h)
            leader = cfg.kv_group_leader(i)
            acc = xty.setdefault(leader, {"k": 0, "v": 0})
            acc["k"] = acc["k"] + x.T @ layer.self_attn.k_proj(hn)[0].double()
            acc["v"] = acc["v"] + x.T @ layer.self_attn.v_proj(hn)[0].double()
            h = layer(h, state.cos, state.sin)
    g = cfg.key_value_group_size
    reg = ridge * torch.trace(xtx) / d * torch.eye(d, dtype=torch.float64, device=device)
    inv = torch.linalg.inv(xtx + reg)
    for leader, acc in xty.items():
        attn = model.model.layers[leader].self_attn
        for key, proj in (("k", attn.k_proj_swiftkv), ("v", attn.v_proj_swiftkv)):
            w = (inv @ (acc[key] / g)).T  # [out, d]
            proj.weight.copy_(w.to(proj.weight.dtype))
            if proj.bias is not None:
                proj.bias.zero_()


@torch.no_grad()
def lstsq_fit_queries(model: LlamaSwiftKVForCausalLM, data: PackedData, tokens: int, ridge: float = 1e-3) -> None:
    """Fit each later layer's q_proj_swiftkv, in layer order, so that the student's queries match the teacher's.

    The student's residual stream drifts from the teacher's once its K/V are approximations; layer i's
    W = argmin ||LN_i(h_i^student) W^T - q_proj(LN_i(h_i^teacher))||^2 (ridge) lets its queries make up
    for the drift seen so far. Both streams advance through layer i before layer i+1 is fitted.
    """
    cfg = model.config
    rows = max(1, min(len(data), tokens // data.seq_len))
    device = model.lm_head.weight.device
    lower = [model.forward_lower(data.ids[r : r + 1].to(device)) for r in range(rows)]
    h_t = [s.hidden for s in lower]
    h_s = [s.hidden for s in lower]
    kv_input = [model.model.norm_swiftkv(s.hidden) for s in lower]
    shared: list = [None] * rows
    d = cfg.hidden_size
    for i in cfg.swiftkv_layers:
        layer = model.model.layers[i]
        attn = layer.self_attn
        xtx = torch.zeros(d, d, dtype=torch.float64, device=device)
        xty = torch.zeros(d, attn.q_proj.out_features, dtype=torch.float64, device=device)
        for r, s in enumerate(lower):
            if cfg.kv_group_leader(i) == i:
                shared[r] = attn.project_kv(kv_input[r], s.cos, s.sin, swiftkv=True)
            x = layer.input_layernorm(h_s[r])[0].double()
            xtx += x.T @ x
            xty += x.T @ attn.q_proj(layer.input_layernorm(h_t[r]))[0].double()
        reg = ridge * torch.trace(xtx) / d * torch.eye(d, dtype=torch.float64, device=device)
        attn.q_proj_swiftkv.weight.copy_(torch.linalg.solve(xtx + reg, xty).T.to(attn.q_proj_swiftkv.weight.dtype))
        if attn.q_proj_swiftkv.bias is not None:
            attn.q_proj_swiftkv.bias.copy_(attn.q_proj.bias)
        for r, s in enumerate(lower):
            h_t[r] = layer(h_t[r], s.cos, s.sin)
            h_s[r] = layer(h_s[r], s.cos, s.sin, swiftkv=True, kv=shared[r])


# --------------------------------------------------------------------------------------------------
# Losses


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is True (error if there are none)."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count == 0:
        raise DataError("a batch has no target positions")
    return (values * mask).sum() / count


class _HeadKL(torch.autograd.Function):
    """sum over rows of KL(softmax(t W^T / T) || softmax(s W^T / T)), with W frozen.

    Chunks of rows keep the [rows x vocabulary] logits in cache; the gradient w.r.t. s, (p_s - p_t) W / T,
    is formed in the same pass, so backward is a multiply and nothing the size of the vocabulary is kept.
    """

    @staticmethod
    def forward(ctx, s, t, weight, temperature: float, chunk: int):
        # In place wherever it can be: at 49k-token vocabularies each [chunk x vocabulary] temporary costs
        # as much memory traffic as a matmul, and the head is a third of a cached training step on a CPU.
        inv = 1.0 / temperature
        total = torch.zeros((), dtype=torch.float64, device=s.device)
        grad = torch.empty_like(s)
        for a in range(0, s.shape[0], chunk):
            log_ps = torch.log_softmax(torch.mm(s[a : a + chunk], weight.T).mul_(inv), dim=-1)
            log_pt = torch.log_softmax(torch.mm(t[a : a + chunk], weight.T).mul_(inv), dim=-1)
            p_t = log_pt.exp()
            total += torch.dot(p_t.view(-1), log_pt.sub_(log_ps).view(-1)).double()  # sum p_t (log p_t - log p_s)
            torch.mm(log_ps.exp_().sub_(p_t), weight, out=grad[a : a + chunk]).mul_(inv)  # (p_s - p_t) W / T
        ctx.save_for_backward(grad)
        return total.to(s.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad_out * grad, None, None, None, None


def head_kl(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, temperature: float, chunk: int = 256) -> torch.Tensor:
    """T^2 * mean over rows of KL(teacher || student) of the head's distributions at temperature T, in float32.

    `student` / `teacher` are final normed hidden states [rows, d] of target positions; `weight` the LM head."""
    if student.shape[0] == 0:
        raise DataError("a batch has no target positions")
    kl = _HeadKL.apply(student.float(), teacher.float().detach(), weight.detach().float(), temperature, chunk)
    return kl / student.shape[0] * temperature * temperature


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(teacher || student) at temperature T from full logits, averaged over masked positions."""
    t = temperature
    log_p_s = F.log_softmax(student_logits.float() / t, dim=-1)
    log_p_t = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = F.kl_div(log_p_s, log_p_t, reduction="none", log_target=True).sum(-1)  # [N]
    return masked_mean(kl, mask) * t * t


# --------------------------------------------------------------------------------------------------
# Training


def batch_indices(step: int, n_rows: int, batch_size: int, seed: int) -> torch.Tensor:
    """Rows of the batch at `step`: epoch e walks a permutation seeded by (seed, e). Pure in (step, seed)."""
    per_epoch = max(1, n_rows // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    if n_rows < batch_size:
        return perm.repeat(math.ceil(batch_size / n_rows))[:batch_size]
    return perm[k * batch_size : (k + 1) * batch_size]


def lr_lambda(total_steps: int, warmup: float):
    warm = max(1, int(round(warmup * total_steps)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (total_steps - step) / max(1, total_steps - warm))

    return f


def resolve_device(name: str) -> torch.device:
    """The torch device of `--device`: auto is cuda when torch sees a GPU, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise DistillError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DistillError(f"device {name!r} asked for, but this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    return torch.device(name)


def use_bf16(precision: str, device: torch.device = torch.device("cpu")) -> bool:
    """bf16 autocast for `precision`; auto: on a GPU with bf16, or a CPU with native bf16 (emulated bf16 is ~8x slower)."""
    if precision not in ("auto", "fp32", "bf16"):
        raise DistillError(f"precision must be auto, fp32 or bf16, got {precision!r}")
    if precision == "auto":
        return torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_info().native_bf16
    return precision == "bf16"


def autocast(enabled: bool, device: torch.device = torch.device("cpu")):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def head_chunk(device: torch.device) -> int:
    """Rows per chunk of the head's KL: small on a CPU (the [chunk x vocabulary] temporaries stay in cache), large
    on a GPU (fewer, fuller kernels; 4,096 x 49,152 float32 is 0.8 GB)."""
    return 4096 if device.type == "cuda" else 256


def loss_terms(model, student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor, cfg: DistillConfig) -> dict[str, torch.Tensor]:
    """The loss terms (total under 'loss') from the final normed hidden states of the target rows."""
    terms = {}
    if cfg.loss == "kl":
        terms["kl"] = head_kl(student, teacher, model.lm_head.weight, cfg.temperature, head_chunk(student.device))
    else:
        terms["lm"] = F.cross_entropy(model.lm_head(student.float()).float(), labels)
    main = terms.get("kl", terms.get("lm"))
    if cfg.hidden_weight > 0:
        terms["hidden_mse"] = (student.float() - teacher.float()).pow(2).mean()
        main = main + cfg.hidden_weight * terms["hidden_mse"]
    terms["loss"] = main
    return terms


def distill_step(model, teacher_upper, ids, target, cfg: DistillConfig, cache=None, idx=None) -> dict[str, torch.Tensor]:
    """Forward one batch and return the loss terms. With `cache`, layer l's input and the teacher's output
    for rows `idx` come from the teacher cache instead of being recomputed."""
    device = model.lm_head.weight.device
    ids, target = ids.to(device), target.to(device)
    mask = loss_mask(target)
    labels = torch.roll(ids, -1, dims=1)[mask]
    bf16 = use_bf16(cfg.precision, device)
    need_teacher = cfg.loss == "kl" or cfg.hidden_weight > 0
    if cache is not None:
        lower = model.lower_state(cache.hidden(cfg.num_key_value_layers, idx).to(device))
        teacher = cache.final(idx).to(device)[mask] if need_teacher else None
    else:
        with torch.no_grad(), autocast(bf16, device):
            lower = model.forward_lower(ids)
            teacher = teacher_upper.forward_upper_hidden(lower, swiftkv=False)[0][mask] if need_teacher else None
    with autocast(bf16, device):
        student = model.forward_upper_hidden(lower, swiftkv=True)[0][mask]
    return loss_terms(model, student, teacher, labels, cfg)


@torch.no_grad()
def quick_eval(model, teacher_upper, data: PackedData, rows: int, bf16: bool) -> dict[str, float]:
    """Top-1 agreement and KL (T = 1) of student vs teacher on the first `rows` held-out rows."""
    agree = kl = n = 0.0
    w = model.lm_head.weight.float()
    for r in range(min(rows, len(data))):
        ids, mask = data.ids[r : r + 1].to(w.device), loss_mask(data.target[r : r + 1])[0].to(w.device)
        with autocast(bf16, w.device):
            lower = model.forward_lower(ids)
            t = teacher_upper.forward_upper_hidden(lower, swiftkv=False)[0][0][mask].float() @ w.T
            s = model.forward_upper_hidden(lower, swiftkv=True)[0][0][mask].float() @ w.T
        agree += (t.argmax(-1) == s.argmax(-1)).sum().item()
        kl += F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="none", log_target=True).sum().item()
        n += mask.sum().item()
    return {"eval_top1": agree / max(n, 1), "eval_kl": kl / max(n, 1)}


def _save_state(path: Path, step: int, trainable: dict, optimizer, scheduler, elapsed: float, tokens: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "step": step,
            "trainable": {n: p.detach().cpu().clone() for n, p in trainable.items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "elapsed": elapsed,
            "tokens": tokens,
        },
        tmp,
    )
    os.replace(tmp, path)


RESUME_KEYS = ("base", "data", "num_key_value_layers", "key_value_group_size", "loss", "train_scope", "batch_size", "seq_len", "rows", "seed", "max_steps", "init", "temperature", "hidden_weight", "lr",
               "lora_rank", "lora_alpha", "lora_modules")


def _check_resume(out: Path, cfg: DistillConfig) -> None:
    run_file = out / "run.json"
    if not run_file.exists():
        return
    old = json.loads(run_file.read_text())
    defaults = {f.name: f.default for f in fields(DistillConfig)}  # a run from before a setting existed had its default
    diff = {k: (old.get(k, defaults[k]), getattr(cfg, k)) for k in RESUME_KEYS if old.get(k, defaults[k]) != getattr(cfg, k)}
    if diff and (out / STATE_FILE).exists():
        raise DistillError(f"{out} holds a run with different settings {diff}; use another --out or delete it")


def _check_settings(cfg: DistillConfig) -> None:
    if cfg.loss not in ("kl", "lm"):
        raise DistillError(f"loss must be 'kl' or 'lm', got {cfg.loss!r}")
    if cfg.init not in ("snowflake", "lstsq", "lstsq-qkv"):
        raise DistillError(f"init must be 'snowflake', 'lstsq' or 'lstsq-qkv', got {cfg.init!r}")
    if cfg.temperature <= 0 or cfg.max_steps < 1 or cfg.batch_size < 1:
        raise DistillError("temperature, max_steps and batch_size must be positive")
    if cfg.train_scope not in TRAIN_SCOPES:
        raise DistillError(f"train scope must be {', '.join(TRAIN_SCOPES)}, got {cfg.train_scope!r}")
    if cfg.train_scope == "lora":
        try:
            check_adapter_settings(cfg.lora_rank, cfg.lora_alpha, lora_modules(cfg))
        except ValueError as e:
            raise DistillError(f"lora: {e}") from None
    use_bf16(cfg.precision, resolve_device(cfg.device))


def distill(cfg: DistillConfig) -> Path:
    """Run (or resume) a distillation and write the SwiftKV checkpoint to cfg.out."""
    from transformers import AutoTokenizer

    from . import teacher_cache

    _check_settings(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    if not Path(cfg.data).exists():
        raise DataError(f"data path {cfg.data!r} does not exist")
    device = resolve_device(cfg.device)
    model = build_student(cfg.base, cfg.num_key_value_layers, cfg.key_value_group_size).to(device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.base)
    data = load_packed(cfg.data, tokenizer, cfg.seq_len, cfg.assistant_only)
    eval_data = load_packed(cfg.eval_data, tokenizer, cfg.seq_len, cfg.assistant_only, max_rows=cfg.eval_rows) if cfg.eval_data else None
    out.mkdir(parents=True, exist_ok=True)
    _check_resume(out, cfg)
    (out / "run.json").write_text(json.dumps(asdict(cfg), indent=2))

    # A run reads the first `rows` rows (default max_steps x batch_size, all of them if there are fewer), in
    # epochs when the steps ask for more; a teacher cache needs only those, and cached and uncached runs
    # see the same batches.
    n_rows = min(len(data), cfg.rows or cfg.max_steps * cfg.batch_size)
    cache = None
    if cfg.cache and not cfg.finalize:
        if (Path(cfg.cache) / teacher_cache.META_FILE).exists():
            cache = teacher_cache.open_cache(cfg.cache, cfg.base, data, cfg.num_key_value_layers, n_rows)
        else:
            cache = teacher_cache.build(cfg.cache, cfg.base, data, [cfg.num_key_value_layers], n_rows, progress=cfg.progress)
    if cfg.init.startswith("lstsq") and not (out / STATE_FILE).exists():  # a resumed run loads its tensors instead
        lstsq_init(model, data, cfg.init_tokens)
        if cfg.init == "lstsq-qkv":
            lstsq_fit_queries(model, data, cfg.init_tokens // 2)
    if cfg.train_scope == "lora":  # drawn from the seed; a resumed run then loads the trained ones
        model.add_adapters(cfg.lora_rank, cfg.lora_alpha, lora_modules(cfg), seed=cfg.seed)
    trainable = trainable_parameters(model, cfg.train_scope)
    # With full-layers the later layers change, so the teacher needs its own frozen copy of them (lora's
    # adapters act in the student pass only: its teacher is the shared copy).
    teacher_upper = copy.deepcopy(model).requires_grad_(False) if cfg.train_scope == "full-layers" else model
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.max_steps, cfg.warmup))

    step, elapsed, tokens = 0, 0.0, 0
    state_path, metrics_path = out / STATE_FILE, out / METRICS_FILE
    if state_path.exists():
        try:  # tensors, numbers and containers only: a pickled object in the file is refused, never run
            state = torch.load(state_path, weights_only=True, map_location=device)
        except pickle.UnpicklingError as e:
            raise DistillError(f"{state_path} holds objects other than tensors, numbers and containers, so it is not a state "
                               f"this run saved; it was not loaded (delete it to start the run over)") from e
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(state["trainable"][n])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, elapsed, tokens = state["step"], state["elapsed"], state["tokens"]
        if cfg.train_scope == "full-layers":  # the teacher copy must stay the original: rebuild it
            teacher_upper = build_student(cfg.base, cfg.num_key_value_layers, cfg.key_value_group_size).to(device).requires_grad_(False)
        # Drop metrics logged after the checkpoint: the resumed run logs those steps again.
        if metrics_path.exists():
            kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step]
            metrics_path.write_text("".join(k + "\n" for k in kept))
    elif cfg.finalize:
        raise DistillError(f"finalize needs a saved state in {state_path}")
    elif metrics_path.exists():
        metrics_path.unlink()

    n_params = sum(p.numel() for p in trainable.values())
    bf16 = use_bf16(cfg.precision, device)
    last = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
    bar = None
    if cfg.progress and not cfg.finalize:
        from tqdm import tqdm

        bar = tqdm(total=last, initial=step, desc=f"distill l={cfg.num_key_value_layers} g={cfg.key_value_group_size}", unit="step", dynamic_ncols=True)
    metrics = open(metrics_path, "a")
    if step == 0 and eval_data is not None and cfg.eval_every and not cfg.finalize:
        metrics.write(json.dumps({"step": 0, "tokens": 0, **quick_eval(model, teacher_upper, eval_data, cfg.eval_rows, bf16)}) + "\n")
        metrics.flush()
    model.train()
    t_run = time.perf_counter()
    with stop_on_sigterm() as stop_requested:
        while step < last and not cfg.finalize:
            t0 = time.perf_counter()
            idx = batch_indices(step, n_rows, cfg.batch_size, cfg.seed)
            ids, target = data.ids[idx], data.target[idx]
            terms = distill_step(model, teacher_upper, ids, target, cfg, cache, idx)
            optimizer.zero_grad(set_to_none=True)
            terms["loss"].backward()
            optimizer.step()
            scheduler.step()
            step += 1
            dt = time.perf_counter() - t0
            elapsed += dt
            tokens += ids.numel()
            tok_s = ids.numel() / dt
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                rec = {"step": step, "tokens": tokens, "lr": scheduler.get_last_lr()[0], "tok_s": round(tok_s, 1), "elapsed_s": round(elapsed, 2)}
                rec.update({k: round(v.item(), 6) for k, v in terms.items()})
                if eval_data is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                    model.eval()
                    rec.update(quick_eval(model, teacher_upper, eval_data, cfg.eval_rows, bf16))
                    model.train()
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{terms['loss'].item():.4f}", tok_s=f"{tok_s:.0f}")
                bar.update(1)
            if step % cfg.checkpoint_every == 0 or step == last:
                _save_state(state_path, step, trainable, optimizer, scheduler, elapsed, tokens)
            if stop_requested:  # a service or pod stopping: keep the step just finished, resume from it next time
                _save_state(state_path, step, trainable, optimizer, scheduler, elapsed, tokens)
                break
    if bar is not None:
        bar.close()
    metrics.close()
    if step < last and not cfg.finalize:
        raise DistillStopped(step)
    model.eval().cpu()
    write_checkpoint(model, cfg.base, out, trainable)
    summary = {
        "steps": step,
        "max_steps": cfg.max_steps,
        "tokens": tokens,
        "train_seconds": round(elapsed, 1),
        "wall_seconds_this_session": round(time.perf_counter() - t_run, 1),
        "tokens_per_second": round(tokens / max(elapsed, 1e-9), 1),
        "trainable_parameters": n_params,
        "precision": "bf16" if bf16 else "fp32",
        "teacher_cache": cfg.cache,
        "peak_rss_mb": peak_rss_mb(),
        "machine": cpu_info().as_dict(),  # tokens/s means nothing without the CPU (or GPU) it was measured on
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **({"peak_gpu_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)} if device.type == "cuda" else {}),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return out


def peak_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def write_checkpoint(model: LlamaSwiftKVForCausalLM, base: str | Path, out: Path, trainable: dict | None = None) -> None:
    """Snowflake-format checkpoint (every tensor, config `llama_swiftkv`) plus tokenizer files, and the
    trained tensors alone in TRAINED_FILE (the only part that differs from the base model). Adapters are
    merged into their weights (the model is changed in place) and kept in TRAINED_FILE as their factors."""
    from safetensors.torch import save_file

    adapters, factors = set(model.adapter_parameters()), model.adapter_factors()
    model.merge_adapters()  # the engine loads plain weights
    model.config.later_layers_adapted = bool(factors)  # merged: the checkpoint no longer holds its base model (no base mode)
    model.config.swiftkv = False  # as in Snowflake's published checkpoints; the serving engine ignores it
    model.save_pretrained(out)
    for item in Path(base).iterdir():
        if item.is_file() and (item.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")) or item.suffix == ".jinja"):
            shutil.copy2(item, out / item.name)
    names = trainable.keys() if trainable is not None else model.swiftkv_parameters().keys()
    params = dict(model.named_parameters())
    tensors = {n: params[n].detach().contiguous() for n in names if n not in adapters}
    tensors.update({n: t.contiguous() for n, t in factors.items()})
    (out / "trained").mkdir(exist_ok=True)
    save_file(tensors, out / "trained" / TRAINED_FILE, metadata={"format": "pt"})
