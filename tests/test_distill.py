"""Distillation on the tiny fixture: trainable set, loss maths, KL decreases, exact resume, clear errors."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import TRAIN_TEXT
from harness.training import distill_config as _cfg

from swiftkv_core.config import SwiftKVConfigError
from swiftkv_core.data import DataError
from swiftkv_core.distill import (
    DistillError,
    build_student,
    distill,
    distill_step,
    head_kl,
    kl_loss,
    lstsq_fit_queries,
    lstsq_init,
    trainable_parameters,
)
from swiftkv_core.modeling_llama_swiftkv import load_model


def test_trainable_set_is_exactly_the_swiftkv_tensors(tiny_base):
    model = build_student(tiny_base, 4, 2)
    trainable = trainable_parameters(model, "swiftkv")
    expected = {"model.norm_swiftkv.weight"}
    for i in range(4, 8):
        expected.add(f"model.layers.{i}.self_attn.q_proj_swiftkv.weight")
        if (i - 4) % 2 == 0:
            expected |= {f"model.layers.{i}.self_attn.k_proj_swiftkv.weight", f"model.layers.{i}.self_attn.v_proj_swiftkv.weight"}
    assert set(trainable) == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    full = trainable_parameters(model, "full-layers")
    assert expected < set(full)
    assert all(n.startswith(tuple(f"model.layers.{i}." for i in range(4, 8))) or n in expected for n in full)
    assert not any(n.startswith("model.layers.3.") or n.startswith("model.embed") for n in full)


def test_kl_is_zero_when_student_equals_teacher(tiny_base, train_text):
    model = build_student(tiny_base, 4, 1)
    # Student == teacher when the SwiftKV layout is the identity: l = L gives nothing to skip, so instead
    # compare the teacher pass with itself through the loss, and check the masked mean by hand.
    logits = torch.randn(10, 50)
    mask = torch.tensor([True] * 6 + [False] * 4)
    assert kl_loss(logits, logits.clone(), mask, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(10, 50)
    other[6:] += 100 * torch.randn(4, 50)  # masked-out rows must not matter
    full = kl_loss(other, logits, torch.ones(10, dtype=torch.bool), 2.0)
    masked = kl_loss(other, logits, mask, 2.0)
    by_hand = kl_loss(other[:6], logits[:6], torch.ones(6, dtype=torch.bool), 2.0)
    assert masked.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert full.item() > masked.item()
    # Through the model: the undistilled student differs from the teacher, the teacher from itself not.
    ids = torch.randint(0, 100, (1, 16))
    with torch.no_grad():
        lower = model.forward_lower(ids)
        t = model.forward_upper(lower, swiftkv=False).logits[0]
        s = model.forward_upper(lower, swiftkv=True).logits[0]
    every = torch.ones(16, dtype=torch.bool)
    assert kl_loss(t, t, every, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    assert kl_loss(s, t, every, 2.0).item() > 1e-3


@pytest.mark.slow
def test_a_few_steps_reduce_the_kl(tiny_base, train_text, tmp_path):
    from transformers import AutoTokenizer

    from swiftkv_core.data import load_packed

    cfg = _cfg(tiny_base, tmp_path / "run", train_text, max_steps=12, warmup=0.0, lr=5e-3)
    out = distill(cfg)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and rows[-1]["step"] == 12 and rows[-1]["tokens"] == 12 * 2 * 32
    # Same batch before and after training.
    data = load_packed(train_text, AutoTokenizer.from_pretrained(tiny_base), 32)
    ids, target = data.ids[:8], data.target[:8]
    with torch.no_grad():
        before = build_student(tiny_base, 4, 1)
        kl_before = distill_step(before, before, ids, target, cfg)["kl"].item()
        after = load_model(str(out))
        kl_after = distill_step(after, after, ids, target, cfg)["kl"].item()
    assert kl_after < 0.85 * kl_before
    # The output is a complete Snowflake-format SwiftKV checkpoint with the trained tensors.
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama_swiftkv" and cfg["num_key_value_layers"] == 4
    model = load_model(str(out))
    init = build_student(tiny_base, 4, 1)
    q = "model.layers.5.self_attn.q_proj_swiftkv.weight"
    assert not torch.equal(model.state_dict()[q], init.state_dict()[q])
    assert torch.equal(model.state_dict()["model.layers.5.mlp.up_proj.weight"], init.state_dict()["model.layers.5.mlp.up_proj.weight"])
    assert (out / "trained" / "swiftkv-trained.safetensors").exists() and (out / "tokenizer.json").exists()


@pytest.mark.slow
def test_resume_continues_the_same_run(tiny_base, train_text, tmp_path):
    straight = distill(_cfg(tiny_base, tmp_path / "a", train_text))
    # "Kill" a run after its step-3 checkpoint by running only 3 steps of a 6-step schedule, then resume.
    distill(_cfg(tiny_base, tmp_path / "b", train_text, stop_at=3))
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 3
    resumed = distill(_cfg(tiny_base, tmp_path / "b", train_text))
    a = [json.loads(ln)["loss"] for ln in (straight / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(ln)["loss"] for ln in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 6
    assert b == pytest.approx(a, rel=1e-4)


def test_sigterm_saves_the_step_it_ends_and_the_run_resumes_from_it(tiny_base, train_text, tmp_path):
    """A stopping service or pod sends SIGTERM: the loop ends at a step boundary with that step's state saved
    (not only at the last periodic checkpoint), and running again completes the same run."""
    import os
    import signal
    import threading

    from swiftkv_core.distill import DistillStopped

    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"

    def stop_after_the_first_step():
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_after_the_first_step, daemon=True).start()
    with pytest.raises(DistillStopped) as stopped:
        distill(_cfg(tiny_base, out, train_text, max_steps=200, checkpoint_every=1000))
    assert 1 <= stopped.value.step < 200 and torch.load(out / "state.pt", weights_only=True)["step"] == stopped.value.step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the run's only
    done = distill(_cfg(tiny_base, out, train_text, max_steps=200, checkpoint_every=1000, stop_at=stopped.value.step + 2))
    steps = [json.loads(ln)["step"] for ln in (done / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped.value.step + 3))


@pytest.mark.slow
def test_a_run_from_before_the_lora_settings_resumes_and_other_settings_are_refused(tiny_base, train_text, tmp_path):
    distill(_cfg(tiny_base, tmp_path / "run", train_text, stop_at=3))
    run_file = tmp_path / "run" / "run.json"
    old = {k: v for k, v in json.loads(run_file.read_text()).items() if not k.startswith("lora_")}
    run_file.write_text(json.dumps(old))  # as written before the settings existed: they had their defaults
    out = distill(_cfg(tiny_base, tmp_path / "run", train_text))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6
    distill(_cfg(tiny_base, tmp_path / "other", train_text, stop_at=3))
    with pytest.raises(DistillError, match="different settings.*train_scope"):
        distill(_cfg(tiny_base, tmp_path / "other", train_text, train_scope="lora"))


def test_lm_loss_full_layers_and_lstsq_run(tiny_base, train_text, tmp_path):
    distill(_cfg(tiny_base, tmp_path / "lm", train_text, loss="lm", max_steps=2))
    out = distill(_cfg(tiny_base, tmp_path / "full", train_text, train_scope="full-layers", max_steps=2, hidden_weight=0.5))
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert "hidden_mse" in rows[0]
    base = build_student(tiny_base, 4, 1)
    model = load_model(str(out))
    name = "model.layers.6.mlp.up_proj.weight"
    assert not torch.equal(model.state_dict()[name], base.state_dict()[name])


@pytest.mark.slow
def test_lstsq_init_lowers_the_starting_kl(tiny_base, train_text):
    from transformers import AutoTokenizer

    from swiftkv_core.data import load_packed

    data = load_packed(train_text, AutoTokenizer.from_pretrained(tiny_base), 32)
    cfg = _cfg(tiny_base, "unused", train_text)
    model = build_student(tiny_base, 4, 2)
    ids, target = data.ids[:4], data.target[:4]
    with torch.no_grad():
        before = distill_step(model, model, ids, target, cfg)["kl"].item()
        lstsq_init(model, data, 2048)
        after = distill_step(model, model, ids, target, cfg)["kl"].item()
        q_before = {n: p.clone() for n, p in model.named_parameters() if "q_proj_swiftkv" in n}
        lstsq_fit_queries(model, data, 2048)
        with_queries = distill_step(model, model, ids, target, cfg)["kl"].item()
    assert after < before
    assert with_queries < after
    assert all(not torch.equal(p, q_before[n]) for n, p in model.named_parameters() if n in q_before)


def test_bad_inputs_give_clear_errors(tiny_base, tiny_swiftkv, train_text, tmp_path):
    with pytest.raises(DistillError, match="does not exist"):
        distill(_cfg(tmp_path / "nope", tmp_path / "o", train_text))
    with pytest.raises(DataError, match="does not exist"):
        distill(_cfg(tiny_base, tmp_path / "o", tmp_path / "missing.txt"))
    with pytest.raises(SwiftKVConfigError, match="num_key_value_layers"):
        distill(_cfg(tiny_base, tmp_path / "o", train_text, num_key_value_layers=0))
    with pytest.raises(DistillError, match="< num_hidden_layers"):
        distill(_cfg(tiny_base, tmp_path / "o", train_text, num_key_value_layers=8))
    with pytest.raises(SwiftKVConfigError, match="divide"):
        distill(_cfg(tiny_base, tmp_path / "o", train_text, key_value_group_size=3))
    with pytest.raises(DistillError, match="already a SwiftKV"):
        distill(_cfg(tiny_swiftkv, tmp_path / "o", train_text))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text|not enough"):
        distill(_cfg(tiny_base, tmp_path / "o", empty))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match="not enough text"):
        distill(_cfg(tiny_base, tmp_path / "o", short))
    with pytest.raises(DistillError, match="loss"):
        distill(_cfg(tiny_base, tmp_path / "o", train_text, loss="mse"))
    with pytest.raises(DistillError, match="train scope"):
        distill(_cfg(tiny_base, tmp_path / "o", train_text, train_scope="everything"))


def test_shipped_tensors_rebuild_the_trained_checkpoint(tiny_base, train_text, tmp_path):
    from swiftkv_core.shipped import ShippedError, assemble_from_trained, export_trained

    run = distill(_cfg(tiny_base, tmp_path / "run", train_text, max_steps=2, key_value_group_size=2))
    shipped = export_trained(run, tmp_path / "ship" / "tiny.safetensors", recipe={"command": "swiftkv distill ..."})
    assert shipped.with_suffix(".json").exists()
    rebuilt = assemble_from_trained(tiny_base, shipped, tmp_path / "rebuilt")
    a, b = load_model(str(run)), load_model(str(rebuilt))
    assert b.config.num_key_value_layers == 4 and b.config.key_value_group_size == 2
    ids = torch.randint(0, 100, (1, 24))
    with torch.no_grad():
        la, lb = a(ids, swiftkv=True).logits, b(ids, swiftkv=True).logits
    # bf16 storage of the trained tensors: same predictions, logits within rounding.
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    assert (la - lb).abs().max().item() < 0.05 * la.abs().max().item()
    with pytest.raises(ShippedError, match="missing"):
        assemble_from_trained(tiny_base, tmp_path / "nope.safetensors", tmp_path / "x")


def test_finalize_writes_the_checkpoint_of_a_stopped_run(tiny_base, train_text, tmp_path):
    distill(_cfg(tiny_base, tmp_path / "run", train_text, stop_at=3))
    for f in (tmp_path / "run").glob("*.safetensors"):  # as if the run had been killed after its step-3 save
        f.unlink()
    (tmp_path / "run" / "config.json").unlink()
    out = distill(_cfg(tiny_base, tmp_path / "run", train_text, finalize=True))
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert load_model(str(out)).config.num_key_value_layers == 4


@pytest.mark.slow
def test_stop_at_ends_early_on_the_same_schedule(tiny_base, train_text, tmp_path):
    full = distill(_cfg(tiny_base, tmp_path / "full", train_text))
    early = distill(_cfg(tiny_base, tmp_path / "early", train_text, stop_at=3))
    a = [json.loads(ln) for ln in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(ln) for ln in (early / "metrics.jsonl").read_text().splitlines()]
    assert len(b) == 3 and [r["lr"] for r in b] == [r["lr"] for r in a[:3]]
    assert json.loads((early / "summary.json").read_text())["steps"] == 3 and (early / "config.json").exists()


def test_head_kl_matches_full_logits_in_value_and_gradient():
    torch.manual_seed(0)
    w = torch.randn(300, 16)
    t = torch.randn(10, 16)
    s1 = torch.randn(10, 16, requires_grad=True)
    s2 = s1.detach().clone().requires_grad_(True)
    for temp in (1.0, 2.0):
        fused = head_kl(s1, t, w, temp, chunk=3)  # chunks that do not divide the rows
        full = kl_loss(s2 @ w.T, t @ w.T, torch.ones(10, dtype=torch.bool), temp)
        assert fused.item() == pytest.approx(full.item(), rel=1e-5)
        (g1,) = torch.autograd.grad(fused, s1)
        (g2,) = torch.autograd.grad(full, s2)
        assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4)
    assert head_kl(t, t, w, 2.0).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.slow
def test_a_cached_step_gives_the_uncached_loss_and_gradients(tiny_base, train_text, tmp_path, group):
    from transformers import AutoTokenizer

    from swiftkv_core import teacher_cache
    from swiftkv_core.data import load_packed

    data = load_packed(train_text, AutoTokenizer.from_pretrained(tiny_base), 32)
    cache = teacher_cache.build(tmp_path / "cache", tiny_base, data, [4, 6], rows=len(data), progress=False)
    idx = torch.tensor([3, 0, 5])
    ids, target = data.ids[idx], data.target[idx]
    for hidden_weight in (0.0, 0.5):
        cfg = _cfg(tiny_base, "unused", train_text, key_value_group_size=group, hidden_weight=hidden_weight)
        grads = []
        for use_cache in (False, True):
            model = build_student(tiny_base, 4, group)
            params = trainable_parameters(model, "swiftkv")
            terms = distill_step(model, model, ids, target, cfg, cache if use_cache else None, idx)
            terms["loss"].backward()
            grads.append((terms, {n: p.grad.clone() for n, p in params.items()}))
        (a, ga), (b, gb) = grads
        for k in a:
            assert b[k].item() == pytest.approx(a[k].item(), rel=1e-5, abs=1e-7), k
        for n in ga:
            assert torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-7), n


def test_cache_is_resumable_and_refuses_other_data(tiny_base, train_text, tmp_path):
    from transformers import AutoTokenizer

    from swiftkv_core import teacher_cache
    from swiftkv_core.data import load_packed

    tok = AutoTokenizer.from_pretrained(tiny_base)
    data = load_packed(train_text, tok, 32)
    whole = teacher_cache.build(tmp_path / "whole", tiny_base, data, [4], rows=8, batch=8, progress=False)
    # A build interrupted after its first batch resumes where it stopped and ends with the same bytes.
    part = teacher_cache.build(tmp_path / "part", tiny_base, data, [4], rows=8, batch=3, progress=False)
    meta = json.loads((tmp_path / "part" / "meta.json").read_text())
    meta["rows_done"] = 3
    (tmp_path / "part" / "meta.json").write_text(json.dumps(meta))
    assert teacher_cache.open_cache(tmp_path / "part", tiny_base, data, 4, rows=3).rows == 3  # a prefix serves
    with pytest.raises(teacher_cache.CacheError, match="3 rows done, this run reads 8"):
        teacher_cache.open_cache(tmp_path / "part", tiny_base, data, 4, rows=8)
    teacher_cache.build(tmp_path / "part", tiny_base, data, [4], rows=8, batch=3, progress=False)
    idx = torch.arange(8)
    assert torch.equal(whole.hidden(4, idx), part.hidden(4, idx)) and torch.equal(whole.final(idx), part.final(idx))
    with pytest.raises(teacher_cache.CacheError, match="not 5"):
        teacher_cache.open_cache(tmp_path / "whole", tiny_base, data, 5, rows=8)
    other = tmp_path / "other.txt"
    other.write_text(TRAIN_TEXT[::-1])
    with pytest.raises(teacher_cache.CacheError, match="other data"):
        teacher_cache.open_cache(tmp_path / "whole", tiny_base, load_packed(other, tok, 32), 4, rows=8)
    with pytest.raises(teacher_cache.CacheError, match="other settings"):
        teacher_cache.build(tmp_path / "whole", tiny_base, data, [4, 5], rows=8, progress=False)
    with pytest.raises(teacher_cache.CacheError, match="room for 8 rows"):
        teacher_cache.build(tmp_path / "whole", tiny_base, data, [4], rows=9, progress=False)


@pytest.mark.slow
def test_a_cached_run_matches_the_uncached_run_and_resumes_exactly(tiny_base, train_text, tmp_path):
    plain = distill(_cfg(tiny_base, tmp_path / "plain", train_text))
    cached = distill(_cfg(tiny_base, tmp_path / "cached", train_text, cache=str(tmp_path / "cache")))
    distill(_cfg(tiny_base, tmp_path / "resumed", train_text, cache=str(tmp_path / "cache"), stop_at=3))
    resumed = distill(_cfg(tiny_base, tmp_path / "resumed", train_text, cache=str(tmp_path / "cache")))
    loss = {run: [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()] for run in (plain, cached, resumed)}
    assert len(loss[plain]) == 6
    assert loss[cached] == pytest.approx(loss[plain], rel=1e-4)
    assert loss[resumed] == pytest.approx(loss[cached], rel=1e-5)
    assert json.loads((cached / "summary.json").read_text())["teacher_cache"] == str(tmp_path / "cache")
    # --rows: epochs over the first rows only, through the same cache.
    epochs = distill(_cfg(tiny_base, tmp_path / "epochs", train_text, cache=str(tmp_path / "cache"), rows=4))
    assert len((epochs / "metrics.jsonl").read_text().splitlines()) == 6
