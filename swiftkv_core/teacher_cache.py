"""What the frozen teacher says about the training data, computed once and memory-mapped.

Distillation trains only the SwiftKV tensors of layers >= l, so for a given token two things never change:
the residual stream after layer l-1 (the student's input: layers < l are frozen and shared) and the
teacher's output. One pass of the teacher over the data stores, per packed row and position:

    hidden_<k>.npy   the residual stream after layers 0..k-1, for each requested k (= l of a layout)
    final.npy        the teacher's final normed hidden state, the LM head's input

Every step then runs only the student's later layers and the head. The teacher's logits are one float32
matmul of `final` with the (tied, frozen) head away: exact at any temperature, and 576 numbers per token
for SmolLM2 where a top-k cache would be approximate. Rows are written in order and `meta.json` records
how many are done: an interrupted build resumes, and a run that reads the first N rows can use a cache with
N rows done. The data and the base model are fingerprinted so a cache is never used with other data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data import PackedData

META_FILE = "meta.json"


class CacheError(ValueError):
    """A cache that does not match the run; the message says what differs."""


def fingerprint(base: str | Path, data: PackedData) -> str:
    """Identity of (base weights, packed token rows, targets): a cache is valid only for the same three."""
    h = hashlib.sha256()
    for f in sorted(Path(base).glob("*.safetensors")) + [Path(base) / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
    h.update(data.ids.numpy().tobytes())
    h.update(data.target.numpy().tobytes())
    return h.hexdigest()[:24]


@dataclass
class TeacherCache:
    path: Path
    meta: dict

    @property
    def rows(self) -> int:
        return self.meta["rows_done"]

    def _open(self, name: str) -> np.ndarray:
        return np.load(self.path / f"{name}.npy", mmap_mode="r")

    def hidden(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """Residual stream after layers 0..layer-1 for rows `idx`: [B, T, d] float32."""
        if layer not in self.meta["layers"]:
            raise CacheError(f"{self.path} holds layers {self.meta['layers']}, not {layer}; build it with `swiftkv distill-cache --layers` including {layer}")
        return torch.from_numpy(np.ascontiguousarray(self._open(f"hidden_{layer}")[idx.numpy()]))

    def final(self, idx: torch.Tensor) -> torch.Tensor:
        """The teacher's final normed hidden state for rows `idx`: [B, T, d] float32."""
        return torch.from_numpy(np.ascontiguousarray(self._open("final")[idx.numpy()]))


def _read_meta(path: Path) -> dict | None:
    f = path / META_FILE
    return json.loads(f.read_text()) if f.exists() else None


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(path / META_FILE)


@torch.no_grad()
def build(path: str | Path, base: str | Path, data: PackedData, layers: list[int], rows: int, batch: int = 8, progress: bool = True) -> TeacherCache:
    """Create the cache in `path` with room for `rows` rows of `data`, or extend a partial one, until its first
    `rows` rows are done. A cache is a prefix store: a run that reads its first N rows needs N done."""
    from .modeling_llama_swiftkv import load_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rows = min(rows, len(data))
    layers = sorted(set(layers))
    want = {"fingerprint": fingerprint(base, data), "base": str(base), "seq_len": data.seq_len, "layers": layers}
    meta = _read_meta(path)
    if meta is not None and any(meta.get(k) != v for k, v in want.items()):
        diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
        raise CacheError(f"{path} holds a teacher cache for other settings {diff}; use another --cache or delete it")
    if meta is not None and rows > meta["rows"]:
        raise CacheError(f"{path} has room for {meta['rows']} rows, {rows} were asked for; build a new cache")
    model = load_model(str(base))  # the plain base model: its forward is the teacher's
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    if any(not 0 < k < L for k in layers):
        raise CacheError(f"cache layers must be in 1..{L - 1}, got {layers}")
    shape = (rows, data.seq_len, d)
    names = [f"hidden_{k}" for k in layers] + ["final"]
    if meta is None:
        meta = {**want, "rows": rows, "rows_done": 0, "dtype": "float32", "hidden_size": d}
        for name in names:
            np.lib.format.open_memmap(path / f"{name}.npy", mode="w+", dtype=np.float32, shape=shape).flush()
        _write_meta(path, meta)
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r+") for name in names}
    bar = None
    if progress and meta["rows_done"] < rows:
        from tqdm import tqdm

        bar = tqdm(total=rows, initial=meta["rows_done"], desc=f"teacher cache {path.name}", unit="row", dynamic_ncols=True)
    while meta["rows_done"] < rows:
        r0 = meta["rows_done"]
        r1 = min(rows, r0 + batch)
        ids = data.ids[r0:r1]
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        h = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(h, positions)
        for i, layer in enumerate(model.model.layers):
            if i in layers:
                arrays[f"hidden_{i}"][r0:r1] = h.numpy()
            h = layer(h, cos, sin)
        arrays["final"][r0:r1] = model.model.norm(h).numpy()
        for a in arrays.values():
            a.flush()
        meta["rows_done"] = r1
        _write_meta(path, meta)  # after the flush: a row counts only once it is on disk
        if bar is not None:
            bar.update(r1 - r0)
    if bar is not None:
        bar.close()
    return TeacherCache(path, meta)


def open_cache(path: str | Path, base: str | Path, data: PackedData, layer: int, rows: int) -> TeacherCache:
    """The cache in `path` if it matches `base` and `data`, holds `layer` and has its first `rows` rows done."""
    path = Path(path)
    meta = _read_meta(path)
    if meta is None:
        raise CacheError(f"{path} holds no teacher cache; build it with `swiftkv distill-cache`")
    if meta["fingerprint"] != fingerprint(base, data) or meta["seq_len"] != data.seq_len:
        raise CacheError(f"{path} was built for other data, base model or seq_len; build a new cache for this run")
    if layer not in meta["layers"]:
        raise CacheError(f"{path} holds layers {meta['layers']}, not {layer}; build one with `swiftkv distill-cache --layers` including {layer}")
    if meta["rows_done"] < rows:
        raise CacheError(f"{path} has {meta['rows_done']} rows done, this run reads {rows}; run `swiftkv distill-cache` again to extend it")
    return TeacherCache(path, meta)
