"""Shipped trained tensors: a run's SwiftKV tensors alone (a few MB; a `lora` run's adapter factors too),
and the full checkpoint rebuilt from them plus the base model. The platform's default SwiftKV model is built
this way (`swiftkv models prepare`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TRAINED_FILE = "swiftkv-trained.safetensors"  # a run's trained tensors, in OUT/trained/
MAX_SHIPPED_BYTES = 25 * 1024 * 1024  # per model: shipped tensors live in the package


class ShippedError(ValueError):
    """Missing or mismatched shipped tensors; the message says which file."""


WEIGHTS_DIR = Path(__file__).parent / "weights"
DEFAULT_SWIFTKV_NAME = "smollm2-135m-instruct-swiftkv"


def recipe(name: str) -> dict | None:
    """The recipe file of a shipped model (how it was trained, its measured quality), or None."""
    path = WEIGHTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def export_trained(run_dir: str | Path, dest: str | Path, recipe: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a run's trained tensors to `dest` (.safetensors, stored in `dtype`) with a recipe .json beside it.
    Refused (nothing written) past MAX_SHIPPED_BYTES."""
    from safetensors.torch import load_file, save_file

    run_dir, dest = Path(run_dir), Path(dest)
    tensors = load_file(run_dir / "trained" / TRAINED_FILE)
    cfg = json.loads((run_dir / "config.json").read_text())
    meta = {"num_key_value_layers": str(cfg["num_key_value_layers"]), "key_value_group_size": str(cfg["key_value_group_size"])}
    size = sum(t.numel() for t in tensors.values()) * dtype.itemsize
    if size > MAX_SHIPPED_BYTES:
        raise ShippedError(f"{run_dir}'s trained tensors take {size / 2**20:.1f} MiB in {dtype}, more than the {MAX_SHIPPED_BYTES / 2**20:.0f} MiB "
                           "a shipped model may take: use a later l, AcrossKV or a lower --lora-rank")
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, dest, metadata={"format": "pt", **meta})
    if recipe is not None:
        dest.with_suffix(".json").write_text(json.dumps(recipe, indent=2) + "\n")
    return dest


def assemble_from_trained(base_dir: str | Path, tensors_path: str | Path, out_dir: str | Path) -> Path:
    """A complete Snowflake-format SwiftKV checkpoint from a base model plus shipped trained tensors.

    `convert` writes the undistilled checkpoint (base shards copied, SwiftKV tensors initialised), then the
    SwiftKV shard is replaced by the trained tensors (stored in bf16, written in the base's dtype), and adapter
    factors, if any, are merged into their weights in the copied base shards.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .convert import SWIFTKV_SHARD, convert
    from .modeling_llama_swiftkv import ADAPTER_FACTOR

    tensors_path = Path(tensors_path)
    if not tensors_path.exists():
        raise ShippedError(f"trained tensors {tensors_path} are missing")
    with safe_open(tensors_path, "pt") as f:
        meta = f.metadata() or {}
        trained = {k: f.get_tensor(k) for k in f.keys()}
    factors = {k: trained.pop(k) for k in list(trained) if ADAPTER_FACTOR.match(k)}
    if "num_key_value_layers" not in meta:
        raise ShippedError(f"{tensors_path} has no num_key_value_layers in its metadata")
    out = convert(str(base_dir), out_dir, int(meta["num_key_value_layers"]), int(meta.get("key_value_group_size", 1)))
    with safe_open(out / SWIFTKV_SHARD, "pt") as f:
        init = {k: f.get_tensor(k) for k in f.keys()}
    if set(trained) != set(init):
        raise ShippedError(f"{tensors_path} does not match the SwiftKV layout: {sorted(set(trained) ^ set(init))[:4]}")
    save_file({k: trained[k].to(init[k].dtype).contiguous() for k in init}, out / SWIFTKV_SHARD, metadata={"format": "pt"})
    if factors:
        _merge_adapters(out, factors, tensors_path)
    return out


def _merge_adapters(checkpoint: Path, factors: dict, tensors_path: Path) -> None:
    """W += lora_B @ lora_A for every adapter in `factors`, rewriting the checkpoint's shards that hold the W's
    (each replaced atomically). Adapters exist on the later layers (i >= l) only."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .convert import _weight_map
    from .modeling_llama_swiftkv import adapter_targets, merged_weight

    config = json.loads((checkpoint / "config.json").read_text())
    l, L = config["num_key_value_layers"], config["num_hidden_layers"]
    try:
        targets = adapter_targets(factors)
    except ValueError as e:
        raise ShippedError(f"{tensors_path}: {e}") from None
    weight_map = _weight_map(checkpoint)
    bad = sorted(n for n, (layer, _, _) in targets.items() if n not in weight_map or not l <= layer < L)
    if bad:
        raise ShippedError(f"{tensors_path} has adapters for {bad[:4]}, which are not weights of the later layers {l}..{L - 1} of the base model")
    for shard in sorted({weight_map[n] for n in targets}):
        with safe_open(checkpoint / shard, "pt") as f:
            meta = f.metadata() or {"format": "pt"}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for name, (_, a, b) in targets.items():
            if weight_map[name] == shard:
                try:
                    tensors[name] = merged_weight(tensors[name], a, b)
                except ValueError as e:
                    raise ShippedError(f"{tensors_path}, {name}: {e}") from None
        tmp = checkpoint / f".{shard}.tmp"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, checkpoint / shard)
    config["later_layers_adapted"] = True  # its later layers are no longer the base model's: no base mode
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2) + "\n")
