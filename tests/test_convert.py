"""Converter: Snowflake's initialisation, a checkpoint that reloads, clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from services.cli import app
from swiftkv_core.convert import ConversionError, convert
from swiftkv_core.modeling_llama_swiftkv import load_model


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_convert_initialises_like_snowflake(tiny_base, tiny_swiftkv_across_undistilled):
    base, new = _tensors(tiny_base), _tensors(tiny_swiftkv_across_undistilled)
    assert torch.equal(new["model.norm_swiftkv.weight"], base["model.layers.4.input_layernorm.weight"])
    for i in range(4, 8):
        assert torch.equal(new[f"model.layers.{i}.self_attn.q_proj_swiftkv.weight"], base[f"model.layers.{i}.self_attn.q_proj.weight"])
    for leader in (4, 6):
        for p in ("k_proj", "v_proj"):
            mean = (base[f"model.layers.{leader}.self_attn.{p}.weight"] + base[f"model.layers.{leader + 1}.self_attn.{p}.weight"]) / 2
            assert torch.allclose(new[f"model.layers.{leader}.self_attn.{p}_swiftkv.weight"], mean)
    # Non-leaders hold no k/v_proj_swiftkv; every original tensor is kept unchanged (the teacher needs them).
    assert "model.layers.5.self_attn.k_proj_swiftkv.weight" not in new
    assert all(torch.equal(new[k], v) for k, v in base.items())


def test_converted_checkpoint_reloads_with_every_tensor(tiny_swiftkv_across):
    model = load_model(str(tiny_swiftkv_across))
    saved = _tensors(tiny_swiftkv_across)
    for name, param in model.state_dict().items():
        if name != "lm_head.weight":  # tied to the embeddings
            assert torch.equal(param, saved[name]), name
    index = json.loads((tiny_swiftkv_across / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(saved)
    assert (tiny_swiftkv_across / "tokenizer.json").exists() and (tiny_swiftkv_across / "chat_template.jinja").exists()


def test_convert_with_l_equal_L_is_the_base_model(tiny_base, tmp_path):
    out = convert(str(tiny_base), tmp_path / "skv", num_key_value_layers=8)
    ids = torch.randint(0, 300, (1, 12))
    model = load_model(str(out))
    with torch.no_grad():
        assert torch.equal(model(ids, swiftkv=True).logits, model(ids, swiftkv=False).logits)


def test_convert_refuses_bad_inputs(tiny_base, tiny_swiftkv, tmp_path):
    with pytest.raises(ConversionError, match="already a SwiftKV checkpoint"):
        convert(str(tiny_swiftkv), tmp_path / "a", 4)
    with pytest.raises(ConversionError, match="does not exist"):
        convert(str(tmp_path / "missing"), tmp_path / "b", 4)
    with pytest.raises(ConversionError, match="must differ"):
        convert(str(tiny_base), tiny_base, 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-key-value-layers", "9"], "num_key_value_layers must be an integer in [1, 8]"),
        (["--num-key-value-layers", "4", "--key-value-group-size", "3"], "allowed values: [1, 2, 4]"),
    ],
)
def test_cli_convert_errors_are_one_clear_line(tiny_base, tmp_path, args, message):
    result = CliRunner().invoke(app, ["convert", "--base", str(tiny_base), "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_cli_convert_writes_checkpoint(tiny_base, tmp_path):
    result = CliRunner().invoke(app, ["convert", "--base", str(tiny_base), "--out", str(tmp_path / "o"), "--num-key-value-layers", "6"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "o" / "config.json").read_text())["num_key_value_layers"] == 6
