"""Student-only low-rank adapters (`--train-scope lora`) on the tiny fixture: exactly the adapters and the SwiftKV
tensors train, the teacher never sees the adapters, a run resumes exactly, and a checkpoint with the adapters
merged (by the run, or by shipping) gives the adapter student's logits, in the reference model and in vLLM."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from harness.training import distill_config as distill_cfg
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from swiftkv_core.distill import DistillConfig, DistillError, build_student, distill, distill_step, trainable_parameters, write_checkpoint
from swiftkv_core.modeling_llama_swiftkv import ADAPTER_MODULES, load_model
from swiftkv_core.shipped import ShippedError, assemble_from_trained, export_trained

LAYERS = range(4, 8)  # later layers of the fixture at l = 4


def _cfg(base, out, data, **kw) -> DistillConfig:
    """test_distill's small run, with rank-4 adapters."""
    return distill_cfg(base, out, data, **{"train_scope": "lora", "lora_rank": 4, "lora_alpha": 8.0, **kw})


def _student(tiny_base, modules=ADAPTER_MODULES, b_std: float = 0.1):
    """The fixture's student with rank-4 adapters whose B is nonzero (a trained adapter, not a fresh one)."""
    model = build_student(tiny_base, 4, 1)
    model.add_adapters(4, 8.0, modules)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.adapter_parameters().items():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    return model


def _adapter_names(modules=ADAPTER_MODULES) -> set[str]:
    where = {"o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    return {f"model.layers.{i}.{where[m]}.lora.{ab}" for i in LAYERS for m in modules for ab in "AB"}


def _logits(model, ids, swiftkv: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, swiftkv=swiftkv).logits


IDS = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))


def test_only_the_adapters_and_swiftkv_tensors_train_and_the_teacher_never_sees_them(tiny_base, train_text):
    from transformers import AutoTokenizer

    from swiftkv_core.data import load_packed

    plain = build_student(tiny_base, 4, 1)
    model = _student(tiny_base)
    # Teacher pass: bit for bit the original model, nonzero adapters or not; the student pass uses them.
    assert torch.equal(_logits(model, IDS, swiftkv=False), _logits(plain, IDS, swiftkv=False))
    assert not torch.allclose(_logits(model, IDS, swiftkv=True), _logits(plain, IDS, swiftkv=True), atol=1e-3)

    trainable = trainable_parameters(model, "lora")
    assert set(trainable) == set(model.swiftkv_parameters()) | _adapter_names()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = load_packed(train_text, AutoTokenizer.from_pretrained(tiny_base), 32)
    cfg = _cfg(tiny_base, "unused", train_text)
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=1e-2)
    distill_step(model, model, data.ids[:2], data.target[:2], cfg)["loss"].backward()
    for n, p in model.named_parameters():
        if n in trainable:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainable)
    # A subset of modules: only those get adapters.
    assert set(_student(tiny_base, ("o_proj", "down_proj")).adapter_parameters()) == _adapter_names(("o_proj", "down_proj"))


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_and_writes_a_merged_checkpoint(tiny_base, train_text, tmp_path):
    straight = distill(_cfg(tiny_base, tmp_path / "a", train_text))
    distill(_cfg(tiny_base, tmp_path / "b", train_text, stop_at=3))
    resumed = distill(_cfg(tiny_base, tmp_path / "b", train_text))
    a = torch.load(straight / "state.pt", weights_only=True)["trainable"]
    b = torch.load(resumed / "state.pt", weights_only=True)["trainable"]
    assert set(a) == set(b) == set(build_student(tiny_base, 4, 1).swiftkv_parameters()) | _adapter_names()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in a.items() if n.endswith(".lora.B"))  # trained

    # The full checkpoint: no adapter tensors, each adapted weight is W + scale * B A, nothing else changed.
    with safe_open(straight / "model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    base = build_student(tiny_base, 4, 1).state_dict()
    assert not any("lora" in k for k in saved)
    adapted = {n.removesuffix(".lora.A") + ".weight" for n in _adapter_names() if n.endswith(".A")}
    swiftkv = set(build_student(tiny_base, 4, 1).swiftkv_parameters())
    for name, tensor in saved.items():
        if name in adapted:
            prefix = name.removesuffix(".weight")
            expected = base[name] + a[f"{prefix}.lora.B"] @ a[f"{prefix}.lora.A"] * 2.0
            assert torch.allclose(tensor, expected, atol=1e-6), name
        elif name not in swiftkv:
            assert torch.equal(tensor, base[name]), name
    # The trained tensors: SwiftKV tensors and the adapters' factors (scale folded into lora_B).
    trained = load_file(straight / "trained" / "swiftkv-trained.safetensors")
    factors = {n.removesuffix(".lora.A") + ".lora_A" for n in _adapter_names() if n.endswith(".A")}
    factors |= {f.removesuffix("_A") + "_B" for f in factors}
    assert set(trained) == swiftkv | factors


def test_a_merged_checkpoint_gives_the_adapter_students_logits(tiny_base, tmp_path, monkeypatch):
    model = _student(tiny_base)
    expected = _logits(model, IDS, swiftkv=True)
    run = tmp_path / "run"
    write_checkpoint(model, tiny_base, run, trainable_parameters(model, "lora"))
    merged = load_model(str(run))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert merged.config.later_layers_adapted  # a dual-mode engine refuses it: its base mode would not be the base model
    assert torch.allclose(_logits(merged, IDS, swiftkv=True), expected, atol=1e-5, rtol=1e-5)
    # Shipping: the factors are merged into the base model at prepare time, float32 exactly, bf16 within rounding.
    exact = assemble_from_trained(tiny_base, export_trained(run, tmp_path / "f32.safetensors", dtype=torch.float32), tmp_path / "rebuilt32")
    assert torch.allclose(_logits(load_model(str(exact)), IDS, swiftkv=True), expected, atol=1e-5, rtol=1e-5)
    assert json.loads((exact / "config.json").read_text())["later_layers_adapted"]
    shipped = export_trained(run, tmp_path / "ship.safetensors")
    rounded = _logits(load_model(str(assemble_from_trained(tiny_base, shipped, tmp_path / "rebuilt"))), IDS, swiftkv=True)
    assert (rounded - expected).abs().max().item() < 0.05 * expected.abs().max().item()
    monkeypatch.setattr("swiftkv_core.shipped.MAX_SHIPPED_BYTES", 1000)
    with pytest.raises(ShippedError, match="more than"):
        export_trained(run, tmp_path / "big.safetensors")


def test_shipped_adapter_factors_that_do_not_fit_are_refused(tiny_base, tmp_path, monkeypatch):
    model = _student(tiny_base, ("o_proj",))
    write_checkpoint(model, tiny_base, tmp_path / "run", trainable_parameters(model, "lora"))
    good = export_trained(tmp_path / "run", tmp_path / "good.safetensors")
    with safe_open(good, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    o5 = "model.layers.5.self_attn.o_proj"
    cases = {
        "partner": {k: v for k, v in tensors.items() if k != f"{o5}.lora_B"},
        "later layers": {**tensors, "model.layers.2.self_attn.o_proj.lora_A": tensors[f"{o5}.lora_A"].clone(),
                         "model.layers.2.self_attn.o_proj.lora_B": tensors[f"{o5}.lora_B"].clone()},
        "do not fit": {**tensors, f"{o5}.lora_A": tensors[f"{o5}.lora_A"][:, :10].contiguous()},
    }
    for i, (message, bad) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.safetensors"
        save_file(bad, path, metadata=meta)
        with pytest.raises(ShippedError, match=message):
            assemble_from_trained(tiny_base, path, tmp_path / f"out{i}")
    # `swiftkv models prepare` of a model shipped that way: exit 2 with the reason, no traceback.
    from services.cli import app
    from swiftkv_core.shipped import DEFAULT_SWIFTKV_NAME

    shutil.copytree(tiny_base, tmp_path / "models" / "smollm2-135m-instruct")  # stands in for the prepared base
    (tmp_path / "weights").mkdir()
    save_file(cases["later layers"], tmp_path / "weights" / f"{DEFAULT_SWIFTKV_NAME}.safetensors", metadata=meta)
    monkeypatch.setattr("swiftkv_core.shipped.WEIGHTS_DIR", tmp_path / "weights")
    res = CliRunner().invoke(app, ["models", "prepare", DEFAULT_SWIFTKV_NAME, "--dir", str(tmp_path / "models")])
    assert res.exit_code == 2 and "later layers 4..7" in res.output and "Traceback" not in res.output


def test_bad_lora_settings_are_refused_before_anything_loads(tiny_base, train_text, tmp_path):
    from services.cli import app

    for kw in ({"lora_rank": 0}, {"lora_alpha": 0.0}, {"lora_modules": "q_proj"}, {"lora_modules": ""}):
        with pytest.raises(DistillError, match="rank >= 1"):
            distill(_cfg(tiny_base, tmp_path / "o", train_text, **kw))
    res = CliRunner().invoke(app, ["distill", "--base", str(tiny_base), "--out", str(tmp_path / "o"), "--data", str(train_text),
                                   "--num-key-value-layers", "4", "--train-scope", "lora", "--lora-modules", "o_proj,k_proj"])
    assert res.exit_code == 2 and "o_proj,gate_proj,up_proj,down_proj" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_serves_a_merged_lora_checkpoint_like_the_reference(tiny_base, tmp_path, offline_engines):
    pytest.importorskip("vllm")
    from harness.engines import generate, prompt

    model = _student(tiny_base, b_std=0.3)
    write_checkpoint(model, tiny_base, tmp_path / "run", trainable_parameters(model, "lora"))
    ref, plain = load_model(str(tmp_path / "run")), build_student(tiny_base, 4, 1)
    prompts = [prompt(n) for n in (5, 33, 70)]
    # through the run's shared engines: an in-process engine's shutdown tears down vLLM's process-wide state, which
    # an engine another module left running would still need
    try:
        outputs = generate(offline_engines.get(tmp_path / "run"), prompts, logprobs=None)
    finally:
        offline_engines.close()
    for p, out in zip(prompts, outputs):
        got = list(out.outputs[0].token_ids)
        assert got == ref.greedy_generate(p, len(got), swiftkv=True)
    # The adapters matter: without them the student answers differently, so the engine did load the merged weights.
    assert any(list(o.outputs[0].token_ids) != plain.greedy_generate(p, len(o.outputs[0].token_ids), swiftkv=True) for p, o in zip(prompts, outputs))
