"""The shipped default model: SmolLM2-135M-Instruct base + trained SwiftKV tensors -> a working checkpoint."""

from __future__ import annotations

import json

import pytest

from swiftkv_core.shipped import DEFAULT_SWIFTKV_NAME, WEIGHTS_DIR

SHIPPED = WEIGHTS_DIR / f"{DEFAULT_SWIFTKV_NAME}.safetensors"


def test_shipped_tensors_are_small_and_documented():
    assert SHIPPED.exists(), f"the default model's trained tensors must ship at {SHIPPED}"
    assert SHIPPED.stat().st_size <= 25 * 1024 * 1024
    recipe = json.loads(SHIPPED.with_suffix(".json").read_text())
    assert "swiftkv distill" in recipe["command"] and "swiftkv data prepare" in recipe["data"]


@pytest.mark.smollm2
def test_default_swiftkv_model_assembles_and_answers(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from swiftkv_core.modeling_llama_swiftkv import load_model
    from swiftkv_core.shipped import assemble_from_trained

    out = assemble_from_trained(smollm2_dir, SHIPPED, tmp_path / DEFAULT_SWIFTKV_NAME)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama_swiftkv" and config["num_key_value_layers"] < config["num_hidden_layers"]
    model = load_model(str(out))
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    answer = tok.decode(model.greedy_generate(list(ids), 12, swiftkv=True, eos_token_id=tok.eos_token_id))
    assert "Paris" in answer
