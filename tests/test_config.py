import json
import typing

import pytest
from pydantic import BaseModel
from transformers import AutoConfig, LlamaConfig

from services.config import PlatformConfig
from services.training.hyperparameters import DistillationHyperparameters
from services.training.service import TrainerSettings
from swiftkv_core.config import (
    ARCHITECTURE,
    LlamaSwiftKVConfig,
    SwiftKVConfigError,
    check_swiftkv_layout,
    default_num_key_value_layers,
    swiftkv_config_from_base,
)

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)


def test_round_trip_keeps_snowflake_fields(tmp_path):
    config = swiftkv_config_from_base(LlamaConfig(**BASE), num_key_value_layers=4, key_value_group_size=2)
    config.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["architectures"] == [ARCHITECTURE]
    assert on_disk["model_type"] == "llama_swiftkv"
    assert (on_disk["num_key_value_layers"], on_disk["key_value_group_size"], on_disk["swiftkv"]) == (4, 2, False)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, LlamaSwiftKVConfig)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(loaded.to_dict()) == strip(config.to_dict())


def test_snowflake_published_config_loads(tmp_path):
    # The shape of Snowflake's published Llama-3.1-8B SwiftKV config.json (fields they write).
    published = {
        "architectures": ["LlamaSwiftKVForCausalLM"], "model_type": "llama_swiftkv", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 8, "num_key_value_heads": 2,
        "vocab_size": 100, "num_key_value_layers": 4, "key_value_group_size": 1, "swiftkv": True,
        "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64, "rope_type": "llama3"}, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, LlamaSwiftKVConfig)
    assert config.num_key_value_layers == 4 and config.swiftkv is True
    assert config.rope_parameters["rope_type"] == "llama3"


def test_defaults_mean_swiftkv_off():
    config = LlamaSwiftKVConfig(**BASE)
    assert config.num_key_value_layers == 8 and config.key_value_group_size == 1
    assert list(config.swiftkv_layers) == [] and config.num_kv_caches == 8


def test_layout_helpers():
    config = LlamaSwiftKVConfig(**BASE, num_key_value_layers=2, key_value_group_size=3)
    assert list(config.swiftkv_layers) == [2, 3, 4, 5, 6, 7]
    assert [config.kv_group_leader(i) for i in range(8)] == [0, 1, 2, 2, 2, 5, 5, 5]
    assert config.num_kv_caches == 4


@pytest.mark.parametrize(
    "l, g, field, hint",
    [
        (0, 1, "num_key_value_layers", "[1, 8]"),
        (9, 1, "num_key_value_layers", "[1, 8]"),
        (4, 3, "key_value_group_size", "allowed values: [1, 2, 4]"),
        (4, 0, "key_value_group_size", "allowed values: [1, 2, 4]"),
    ],
)
def test_bad_layout_names_field_and_allowed_values(l, g, field, hint):
    with pytest.raises(SwiftKVConfigError) as err:
        check_swiftkv_layout(8, l, g)
    assert field in str(err.value) and hint in str(err.value)
    with pytest.raises(Exception) as err:  # the config class validates on construction too
        LlamaSwiftKVConfig(**BASE, num_key_value_layers=l, key_value_group_size=g)
    assert field in str(err.value)


def test_default_layout_is_half_the_layers():
    assert default_num_key_value_layers(30) == 15 and default_num_key_value_layers(8) == 4
    check_swiftkv_layout(8, default_num_key_value_layers(8), 1, require_swiftkv_layers=True)


def test_distillation_layout_needs_a_later_layer():
    check_swiftkv_layout(8, 8, 1)  # a config may switch SwiftKV off (l = L) ...
    with pytest.raises(SwiftKVConfigError) as err:  # ... a distillation needs something to train
        check_swiftkv_layout(8, 8, 1, require_swiftkv_layers=True)
    assert err.value.field == "num_key_value_layers" and "[1, 7]" in str(err.value)
    with pytest.raises(SwiftKVConfigError) as err:
        check_swiftkv_layout(8, 5, 2)
    assert err.value.field == "key_value_group_size"


@pytest.mark.slow
def test_engine_config_refusals_are_the_one_swiftkv_config_error(tiny_swiftkv):
    """vLLM's engine-config hook raises the class every caller catches: one `except SwiftKVConfigError` covers a bad
    checkpoint layout and a setting the engine refuses for SwiftKV models."""
    import pydantic
    from vllm.engine.arg_utils import EngineArgs

    from swiftkv_core.vllm.engine_config import SwiftKVEngineConfig

    def engine_config(**overrides):  # vLLM's own config for the checkpoint: no engine starts
        return EngineArgs(model=str(tiny_swiftkv), dtype="float32", max_model_len=256, **overrides).create_engine_config()

    config = engine_config()
    config.cache_config.kv_offloading_size = 1.0
    with pytest.raises(SwiftKVConfigError) as err:
        SwiftKVEngineConfig.verify_and_update_config(config)
    assert err.value.field == "kv_offloading_size" and "KV transfer" in str(err.value)
    # Built through vLLM, the hook runs inside its pydantic config, which wraps the error: ours is its cause.
    with pytest.raises(pydantic.ValidationError) as wrapped:
        engine_config(kv_offloading_size=1.0)
    assert isinstance(wrapped.value.errors()[0]["ctx"]["error"], SwiftKVConfigError)


def _undescribed_fields(model: type[BaseModel], seen: set[type]) -> list[str]:
    """`Model.field` for each field of `model`, and of the models its fields hold (dict values, optionals), without a
    description."""
    seen.add(model)
    missing = []
    for name, field in model.model_fields.items():
        if not field.description:
            missing.append(f"{model.__name__}.{name}")
        nested, kinds = [], [field.annotation]
        while kinds:  # unwrap dict[str, PoolConfig], X | None, Annotated[...] down to the models inside
            kind = kinds.pop()
            kinds += typing.get_args(kind)
            if isinstance(kind, type) and issubclass(kind, BaseModel) and kind not in seen:
                nested.append(kind)
        for inner in nested:
            missing += _undescribed_fields(inner, seen)
    return missing


@pytest.mark.parametrize("model", [PlatformConfig, DistillationHyperparameters, TrainerSettings], ids=lambda m: m.__name__)
def test_every_setting_has_a_description(model):
    """The docs site's reference pages render these descriptions: a field without one would be a bare name there."""
    assert _undescribed_fields(model, set()) == []


def test_remote_pool_key_from_the_environment(monkeypatch):
    """A remote pool's key in a ConfigMap-held config comes from the environment (api_key_env, as vLLM's VLLM_API_KEY
    and OpenAI's OPENAI_API_KEY): read when the gateway builds the pool, refused when unset, never beside api_key."""
    from services.config import PoolConfig
    from services.serving.pools import remote_pool

    remote = {"backend": "remote", "url": "http://server:8000/v1", "model": "m"}
    with pytest.raises(ValueError, match="api_key or api_key_env"):
        PoolConfig.model_validate(remote | {"api_key": "k", "api_key_env": "ENGINE_KEY"})
    with pytest.raises(ValueError, match="api_key_env is for remote pools"):
        PoolConfig.model_validate({"model": "m", "api_key_env": "ENGINE_KEY"})
    with pytest.raises(ValueError, match="not an environment variable name"):
        PoolConfig.model_validate(remote | {"api_key_env": "$ENGINE_KEY"})
    cfg = PlatformConfig(model="m", pools={"base": remote | {"api_key_env": "ENGINE_KEY"}})
    monkeypatch.delenv("ENGINE_KEY", raising=False)
    with pytest.raises(ValueError, match="pools.base.api_key_env: the environment variable ENGINE_KEY .* is not set"):
        remote_pool("base", cfg.pools["base"], cfg)
    monkeypatch.setenv("ENGINE_KEY", "sk-engine\n")
    assert remote_pool("base", cfg.pools["base"], cfg).client.headers["Authorization"] == "Bearer sk-engine"
