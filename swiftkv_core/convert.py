"""Base Llama checkpoint -> undistilled SwiftKV checkpoint (Snowflake's initialisation).

The base shards are copied unchanged and the new tensors go into one extra shard
(`model-swiftkv.safetensors`), so converting a 70B model needs no more memory than its later layers'
k/v projections. New tensors:

    model.norm_swiftkv.weight                         <- layer l's input_layernorm (final norm if l = L)
    model.layers.{i>=l}.self_attn.q_proj_swiftkv      <- that layer's q_proj
    model.layers.{leader}.self_attn.k/v_proj_swiftkv  <- mean of k/v_proj over the leader's AcrossKV group

The original q/k/v projections of layers >= l stay in the checkpoint: distillation's teacher needs them
and Snowflake's checkpoints keep them too. The vLLM model skips them at load time, so they cost disk,
not serving memory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from .config import LlamaSwiftKVConfig, swiftkv_config_from_base

SWIFTKV_SHARD = "model-swiftkv.safetensors"
BASE_SHARD = "model-base.safetensors"
INDEX = "model.safetensors.index.json"


class ConversionError(ValueError):
    pass


def resolve_model_dir(name_or_path: str) -> Path:
    """A local folder as is; anything else is treated as a hub id (downloads only on a user's machine)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/")):
        raise ConversionError(f"model folder {name_or_path!r} does not exist or is not a folder")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path))


def _weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name, for single-file and sharded checkpoints."""
    index = model_dir / INDEX
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ConversionError(f"{model_dir} has no model.safetensors or {INDEX}: not a safetensors checkpoint")
    with safe_open(single, "pt") as f:
        return {name: single.name for name in f.keys()}


def _read(model_dir: Path, weight_map: dict[str, str], name: str) -> torch.Tensor:
    if name not in weight_map:
        raise ConversionError(f"tensor {name!r} is missing from {model_dir}")
    with safe_open(model_dir / weight_map[name], "pt") as f:
        return f.get_tensor(name)


def swiftkv_init_tensors(model_dir: Path, config: LlamaSwiftKVConfig) -> dict[str, torch.Tensor]:
    """Snowflake's initialisation of every SwiftKV tensor, read from the base checkpoint."""
    weight_map = _weight_map(model_dir)
    L, l = config.num_hidden_layers, config.num_key_value_layers
    norm_source = f"model.layers.{l}.input_layernorm.weight" if l < L else "model.norm.weight"
    new = {"model.norm_swiftkv.weight": _read(model_dir, weight_map, norm_source).clone()}
    suffixes = ["weight", "bias"] if config.attention_bias else ["weight"]
    for i in config.swiftkv_layers:
        attn = f"model.layers.{i}.self_attn"
        for s in suffixes:
            new[f"{attn}.q_proj_swiftkv.{s}"] = _read(model_dir, weight_map, f"{attn}.q_proj.{s}").clone()
        if config.kv_group_leader(i) != i:
            continue
        group = range(i, i + config.key_value_group_size)
        for proj in ("k_proj", "v_proj"):
            for s in suffixes:
                members = [_read(model_dir, weight_map, f"model.layers.{j}.self_attn.{proj}.{s}") for j in group]
                mean = torch.stack([m.float() for m in members]).mean(0).to(members[0].dtype)
                new[f"{attn}.{proj}_swiftkv.{s}"] = mean
    return new


def convert(base: str, out: str | Path, num_key_value_layers: int, key_value_group_size: int = 1) -> Path:
    """Write a SwiftKV checkpoint to `out` and return its path."""
    base_dir, out_dir = resolve_model_dir(base), Path(out)
    if out_dir.resolve() == base_dir.resolve():
        raise ConversionError("--out must differ from --base: the base checkpoint is never modified")
    base_config = AutoConfig.from_pretrained(base_dir)
    if isinstance(base_config, LlamaSwiftKVConfig):
        raise ConversionError(f"{base_dir} is already a SwiftKV checkpoint; convert its base model instead")
    if base_config.model_type != "llama":
        raise ConversionError(f"only Llama checkpoints can be converted, {base_dir} has model_type {base_config.model_type!r}")
    config = swiftkv_config_from_base(base_config, num_key_value_layers, key_value_group_size)
    new_tensors = swiftkv_init_tensors(base_dir, config)

    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map = _weight_map(base_dir)
    # A lone model.safetensors would shadow the index (loaders prefer it), so it becomes a named shard.
    renamed = {"model.safetensors": BASE_SHARD}
    weight_map = {name: renamed.get(shard, shard) for name, shard in weight_map.items()}
    # Everything but the config and the weight index is copied as is: shards, tokenizer, chat template.
    for item in base_dir.iterdir():
        if item.is_file() and item.name not in ("config.json", INDEX):
            shutil.copy2(item, out_dir / renamed.get(item.name, item.name))
    save_file({k: v.contiguous() for k, v in new_tensors.items()}, out_dir / SWIFTKV_SHARD, metadata={"format": "pt"})
    weight_map.update({name: SWIFTKV_SHARD for name in new_tensors})
    total = sum((out_dir / shard).stat().st_size for shard in set(weight_map.values()))  # close enough: headers
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(out_dir)
    return out_dir
