"""`swiftkv eval` on the tiny fixture: metric keys, sanity of the numbers, the shared-model path, the
long-prompt task, ROUGE-L, clear errors, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from swiftkv_core.data import DataError
from swiftkv_core.evaluate import EvalError, evaluate, long_context_agreement, long_documents, rouge_l
from swiftkv_core.modeling_llama_swiftkv import load_model

TEXT = ("The capital of France is Paris. SwiftKV skips later layers for prompt tokens. " * 30 + "\n") * 3


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "heldout.txt"
    path.write_text(TEXT)
    return path


def test_metrics_of_an_undistilled_student(tiny_base, tiny_swiftkv_undistilled, eval_text):
    r = evaluate(tiny_base, tiny_swiftkv_undistilled, eval_text, seq_len=64, max_tokens=512, num_prompts=2, gen_tokens=4,
                 long_docs=2, long_min_tokens=64, long_max_tokens=96, answer_tokens=4)
    for key in ("top1_agreement", "kl", "ppl_teacher", "ppl_student", "greedy_exact_match", "greedy_token_agreement",
                "long_teacher_forced_agreement", "long_rouge_l", "long_exact_match"):
        assert key in r
    assert r["shared_lower_layers"] and r["long_docs"] == 2
    assert 0.0 <= r["long_teacher_forced_agreement"] <= 1.0 and 0.0 <= r["long_rouge_l"] <= 1.0
    assert 0.0 <= r["top1_agreement"] < 1.0 and r["kl"] > 0
    assert r["ppl_teacher"] > 1 and r["ppl_student"] > 1
    assert r["greedy_prompts"] == 1  # one text record -> one prompt


def test_teacher_against_itself_agrees_fully(tiny_swiftkv, eval_text):
    # A SwiftKV folder as teacher runs with SwiftKV off; against the same folder as student the numbers
    # differ, but the teacher's own perplexity must equal the one computed from the base model folder.
    r = evaluate(tiny_swiftkv, tiny_swiftkv, eval_text, seq_len=64, max_tokens=256, num_prompts=0, long_docs=0)
    assert r["top1_agreement"] < 1.0
    assert "greedy_exact_match" not in r


def test_eval_errors(tiny_base, tiny_swiftkv, eval_text, tmp_path):
    with pytest.raises(EvalError, match="does not exist"):
        evaluate(tmp_path / "nope", tiny_swiftkv, eval_text)
    with pytest.raises(EvalError, match="not a SwiftKV checkpoint"):
        evaluate(tiny_base, tiny_base, eval_text, num_prompts=0)
    with pytest.raises(EvalError, match="min tokens <= max tokens"):
        evaluate(tiny_base, tiny_swiftkv, eval_text, seq_len=64, max_tokens=64, num_prompts=0, long_min_tokens=90, long_max_tokens=80)
    with pytest.raises(DataError, match="does not exist"):
        evaluate(tiny_base, tiny_swiftkv, tmp_path / "missing.txt")


@pytest.mark.slow
def test_eval_cli_json(tiny_base, tiny_swiftkv, eval_text, tmp_path):
    from services.cli import app

    res = CliRunner().invoke(app, ["eval", "--teacher", str(tiny_base), "--student", str(tiny_swiftkv), "--text", str(eval_text),
                                   "--seq-len", "64", "--max-tokens", "256", "--num-prompts", "1", "--gen-tokens", "2",
                                   "--long-docs", "1", "--long-min-tokens", "40", "--long-max-tokens", "40", "--answer-tokens", "3",
                                   "--json", "--json-out", str(tmp_path / "out" / "eval.json")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(out) >= {"top1_agreement", "kl", "ppl_teacher", "ppl_student", "long_rouge_l", "long_exact_match"}
    assert json.loads((tmp_path / "out" / "eval.json").read_text()) == out
    bad = CliRunner().invoke(app, ["eval", "--teacher", "/nonexistent", "--student", str(tiny_swiftkv), "--text", str(eval_text)])
    assert bad.exit_code == 2 and "does not exist" in bad.output


def test_rouge_l_on_hand_computed_examples():
    ref = "police killed the gunman".split()
    assert rouge_l("police kill the gunman".split(), ref) == pytest.approx(0.75)  # LCS 3 of 4 and 4
    assert rouge_l("the gunman kill police".split(), ref) == pytest.approx(0.5)  # LCS "the gunman"
    assert rouge_l([1, 2], [1, 2, 3, 4]) == pytest.approx(2 * 1.0 * 0.5 / 1.5)  # P = 1, R = 1/2
    assert rouge_l([1, 3, 5, 7, 9], [9, 1, 5, 9, 3]) == pytest.approx(0.6)  # LCS 1 5 9: P = R = 3/5
    assert rouge_l([4, 5], [4, 5]) == 1.0 and rouge_l([1, 2], [3, 4]) == 0.0
    assert rouge_l([], []) == 1.0 and rouge_l([], [1]) == 0.0 and rouge_l([1], []) == 0.0


def test_long_documents_come_from_the_text_with_spread_lengths(tiny_base, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    path = tmp_path / "two-sources.jsonl"
    lines = [{"text": f"Water boils at one hundred degrees, note {i}.", "source": "a"} for i in range(60)]
    lines += [{"messages": [{"role": "user", "content": f"SELECT name FROM users; -- {i}"},
                            {"role": "assistant", "content": "def add(a, b): return a + b"}], "source": "b"} for i in range(60)]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    docs = long_documents(path, tok, 4, 50, 80)
    assert len(docs) == 4
    lengths = [len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs]
    assert all(abs(n - want) <= 2 for n, want in zip(lengths, (50, 60, 70, 80))), lengths
    assert "Water" in docs[0] and "SELECT" not in docs[0] and "SELECT" in docs[1] and "Water" not in docs[1]
    assert len(long_documents(path, tok, 100, 50, 80)) < 100  # the text runs out: fewer documents, no repeats


def test_long_task_of_a_student_equal_to_its_teacher_agrees_fully(tiny_base, eval_text):
    # A plain Llama loads with l = L: its "student" mode is the teacher, so every long-task metric is 1.
    from transformers import AutoTokenizer

    model, tok = load_model(str(tiny_base)), AutoTokenizer.from_pretrained(tiny_base)
    r = long_context_agreement(model, model, tok, long_documents(eval_text, tok, 2, 60, 90), answer_tokens=6)
    assert r["long_docs"] == 2 and r["long_prompt_tokens_mean"] > 60
    assert r["long_teacher_forced_agreement"] == 1.0 and r["long_rouge_l"] == 1.0 and r["long_exact_match"] == 1.0


def _perturbed_student(src, dest):
    """A copy of a SwiftKV folder whose SwiftKV shard has noise added (as after distillation)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from swiftkv_core.convert import SWIFTKV_SHARD

    shutil.copytree(src, dest)
    gen = torch.Generator().manual_seed(3)
    shard = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in load_file(dest / SWIFTKV_SHARD).items()}
    save_file(shard, dest / SWIFTKV_SHARD, metadata={"format": "pt"})
    return dest


@pytest.mark.slow
def test_one_shared_model_gives_the_same_metrics_as_two(tiny_base, tiny_swiftkv_across, eval_text, tmp_path):
    student = _perturbed_student(tiny_swiftkv_across, tmp_path / "student")
    args = dict(seq_len=64, max_tokens=256, num_prompts=2, gen_tokens=6, long_docs=2, long_min_tokens=60, long_max_tokens=90, answer_tokens=6)
    one = evaluate(tiny_base, student, eval_text, **args)
    two = evaluate(tiny_base, student, eval_text, share=False, **args)
    assert one.pop("shared_lower_layers") and not two.pop("shared_lower_layers")
    for r in (one, two):
        r.pop("seconds"), r.pop("long_seconds")
    assert one == two
    assert one["long_docs"] == 2 and one["greedy_prompts"] == 1


def test_a_teacher_with_other_weights_gets_its_own_model(tiny_base, tiny_swiftkv, eval_text, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    teacher = tmp_path / "other-teacher"
    shutil.copytree(tiny_base, teacher)
    tensors = load_file(teacher / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"] * 1.01
    save_file(tensors, teacher / "model.safetensors", metadata={"format": "pt"})
    r = evaluate(teacher, tiny_swiftkv, eval_text, seq_len=64, max_tokens=128, num_prompts=0, long_docs=0)
    assert r["shared_lower_layers"] is False
    with pytest.raises(EvalError, match="cannot share one model"):
        evaluate(teacher, tiny_swiftkv, eval_text, seq_len=64, max_tokens=128, num_prompts=0, long_docs=0, share=True)
