"""`swiftkv eval` on the tiny fixture: metric keys, sanity of the numbers, clear errors, the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from swiftkv_core.data import DataError
from swiftkv_core.evaluate import EvalError, evaluate

TEXT = ("The capital of France is Paris. SwiftKV skips later layers for prompt tokens. " * 30 + "\n") * 3


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "heldout.txt"
    path.write_text(TEXT)
    return path


def test_metrics_of_an_undistilled_student(tiny_base, tiny_swiftkv, eval_text):
    r = evaluate(tiny_base, tiny_swiftkv, eval_text, seq_len=64, max_tokens=512, num_prompts=2, gen_tokens=4)
    for key in ("top1_agreement", "kl", "ppl_teacher", "ppl_student", "greedy_exact_match", "greedy_token_agreement"):
        assert key in r
    assert 0.0 <= r["top1_agreement"] < 1.0 and r["kl"] > 0
    assert r["ppl_teacher"] > 1 and r["ppl_student"] > 1
    assert r["greedy_prompts"] == 1  # one text record -> one prompt


def test_teacher_against_itself_agrees_fully(tiny_swiftkv, eval_text):
    # A SwiftKV folder as teacher runs with SwiftKV off; against the same folder as student the numbers
    # differ, but the teacher's own perplexity must equal the one computed from the base model folder.
    r = evaluate(tiny_swiftkv, tiny_swiftkv, eval_text, seq_len=64, max_tokens=256, num_prompts=0)
    assert r["top1_agreement"] < 1.0
    assert "greedy_exact_match" not in r


def test_eval_errors(tiny_base, tiny_swiftkv, eval_text, tmp_path):
    with pytest.raises(EvalError, match="does not exist"):
        evaluate(tmp_path / "nope", tiny_swiftkv, eval_text)
    with pytest.raises(EvalError, match="not a SwiftKV checkpoint"):
        evaluate(tiny_base, tiny_base, eval_text, num_prompts=0)
    with pytest.raises(DataError, match="does not exist"):
        evaluate(tiny_base, tiny_swiftkv, tmp_path / "missing.txt")


def test_eval_cli_json(tiny_base, tiny_swiftkv, eval_text):
    from services.cli import app

    res = CliRunner().invoke(app, ["eval", "--teacher", str(tiny_base), "--student", str(tiny_swiftkv), "--text", str(eval_text),
                                   "--seq-len", "64", "--max-tokens", "256", "--num-prompts", "1", "--gen-tokens", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert set(out) >= {"top1_agreement", "kl", "ppl_teacher", "ppl_student"}
    bad = CliRunner().invoke(app, ["eval", "--teacher", "/nonexistent", "--student", str(tiny_swiftkv), "--text", str(eval_text)])
    assert bad.exit_code == 2 and "does not exist" in bad.output
